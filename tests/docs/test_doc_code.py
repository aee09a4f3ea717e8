"""Every code block of the README, the getting-started page and the guides runs.

Python blocks of a page run in order in one process; shell blocks run with launch.py commands
checked by ``--dry_run`` (``tests/support/doc_blocks.py`` says exactly what runs how). A block
can only be left out with a ``<!-- no-run: REASON -->`` line above it.
"""

from __future__ import annotations

import pytest

from tests.support import doc_blocks

PAGES = doc_blocks.doc_pages()


def _all_blocks():
  return [b for page in PAGES for b in doc_blocks.blocks(page)]


def test_pages_have_code_and_every_block_names_its_language():
  found = _all_blocks()
  assert len(PAGES) >= 8, PAGES  # README, getting started and the guides
  assert sum(b.lang == "python" for b in found) >= 10, "the parser found too few python blocks"
  assert sum(b.lang in ("bash", "sh", "shell") for b in found) >= 10
  unlabeled = [b.where for b in found if not b.lang]
  assert not unlabeled, f"code blocks without a language (say python, bash or text): {unlabeled}"
  unknown = [f"{b.where} ({b.lang})" for b in found
             if b.lang not in doc_blocks.RUNNABLE + doc_blocks.NOT_CODE]
  assert not unknown, f"blocks of a language the doc test neither runs nor knows: {unknown}"
  no_reason = [b.where for b in found if b.no_run is not None and len(b.no_run) < 10]
  assert not no_reason, f"no-run markers need a reason: {no_reason}"


def test_the_parser_reads_fences_markers_and_directives(tmp_path, monkeypatch):
  page = tmp_path / "page.md"
  page.write_text("text\n```python\nx = 1\n```\n<!-- no-run: needs a GPU to show this -->\n"
                  "```bash\nnvidia-smi\n```\n```{toctree}\nguides/a\n```\n````text\n```\n````\n")
  monkeypatch.setattr(doc_blocks, "ROOT", str(tmp_path))
  got = doc_blocks.blocks("page.md")
  assert [(b.line, b.lang, b.code, b.no_run) for b in got] == [
      (2, "python", "x = 1\n", None), (6, "bash", "nvidia-smi\n", "needs a GPU to show this"),
      (12, "text", "```\n", None)]


# Pages whose code depends on how a JAX or Flax release behaves (the lowering target, Flax NNX,
# shard_map, the first examples a user runs) run on both ends; the others' python blocks are
# split between the ends like a kernel matrix (tests/support/legs.py).
BOTH_ENDS = ("README.md", "docs/getting_started.md", "docs/guides/pallas.md",
             "docs/guides/nnx.md", "docs/guides/ring.md")


@pytest.mark.parametrize("page", [
    p if p in BOTH_ENDS else pytest.param(p, marks=pytest.mark.split_by_jax) for p in PAGES])
def test_python_blocks_of_the_page_run_in_order(page, tmp_path):
  todo = [b for b in doc_blocks.blocks(page) if b.lang == "python" and b.no_run is None]
  if not todo:
    pytest.skip(f"{page} has no python blocks to run")
  proc = doc_blocks.run_python(todo, str(tmp_path))
  assert proc.returncode == 0, f"{page}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.split_by_jax
def test_shell_blocks_of_the_page_run(page, tmp_path):
  todo = [b for b in doc_blocks.blocks(page)
          if b.lang in ("bash", "sh", "shell") and b.no_run is None]
  if not todo:
    pytest.skip(f"{page} has no shell blocks to run")
  for b in todo:
    proc = doc_blocks.run_shell(b, str(tmp_path))
    assert proc.returncode == 0, (
        f"{b.where}:\n{b.code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def test_a_failing_block_fails_the_test(tmp_path):
  bad = doc_blocks.Block("x.md", 3, "python", "assert 1 + 1 == 3\n", None)
  proc = doc_blocks.run_python([bad], str(tmp_path))
  assert proc.returncode != 0 and "x.md:3" in proc.stderr
  wrong = doc_blocks.Block("x.md", 7, "bash", "python launch.py --config.num_steps=0\n", None)
  proc = doc_blocks.run_shell(wrong, str(tmp_path))
  assert proc.returncode == 2 and "num_steps must be >= 1" in proc.stderr
  ok = doc_blocks.Block("x.md", 9, "bash", "pip install nothing-at-all && python -m pytest -x\n"
                        "python launch.py --config.num_steps=3 --workdir=" + str(tmp_path / "w")
                        + "\n", None)
  proc = doc_blocks.run_shell(ok, str(tmp_path))
  assert proc.returncode == 0 and "nothing was run" in proc.stdout, proc.stderr
  assert not (tmp_path / "w").exists()
