"""Code blocks of the documentation pages, and how the test suite runs them.

A page's fenced blocks are found by their opening fence (```LANG). ``python`` blocks of a page
run in order in one fresh process, like a notebook. ``bash`` blocks run in bash, with ``python``
replaced by :func:`shim` (``python`` calls come back here): ``launch.py`` (directly or after
``python -m attnx.launch_local ... --``) gets ``--dry_run`` so the command line is checked without
training (once per page: a command line a page repeats is checked the first time); pip,
pytest, sphinx-build and ``.ci/run`` are what CI itself runs, so they are not repeated; every
other command runs as written. A block preceded by the line
``<!-- no-run: REASON -->`` is not run (the reason is required).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNABLE = ("python", "bash", "sh", "shell")
NOT_CODE = ("text", "toml", "json", "yaml", "ini", "diff", "console-output")
_FENCE = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_NO_RUN = re.compile(r"^<!--\s*no-run:\s*(?P<reason>.*?)\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
  page: str  # path relative to the repository root
  line: int  # 1-based line of the opening fence
  lang: str
  code: str
  no_run: str | None  # the reason given in a no-run comment, else None

  @property
  def where(self) -> str:
    return f"{self.page}:{self.line}"


def doc_pages() -> list[str]:
  """The pages whose code blocks the suite runs: README, getting started, guides, results."""
  pages = ["README.md", os.path.join("docs", "getting_started.md")]
  for folder in ("guides", "results"):
    path = os.path.join(ROOT, "docs", folder)
    pages += sorted(os.path.join("docs", folder, f) for f in os.listdir(path) if f.endswith(".md"))
  return pages


def blocks(page: str) -> list[Block]:
  """Fenced blocks of ``page`` (MyST directives such as ```{toctree} are not code)."""
  lines = open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
  out, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, info = m.group("fence"), m.group("info").strip()
    end = i + 1
    while end < len(lines) and not re.match(rf"^\s{{0,3}}{fence[0]}{{{len(fence)},}}\s*$",
                                            lines[end]):
      end += 1
    if not info.startswith("{"):  # a directive (toctree, eval-rst, figure), not a code block
      prev = lines[i - 1].strip() if i else ""
      no_run = _NO_RUN.match(prev)
      out.append(Block(page, i + 1, info.split()[0] if info else "",
                       "\n".join(lines[i + 1:end]) + "\n",
                       no_run.group("reason") if no_run else None))
    i = end + 1
  return out


def env(tmp: str) -> dict[str, str]:
  """The environment blocks run in: CPU JAX, a private data dir, no display."""
  e = dict(os.environ)
  e.update(JAX_PLATFORMS="cpu", ATTNX_DATA_DIR=os.path.join(tmp, "data"), MPLBACKEND="Agg",
           PYTHONPATH=ROOT + os.pathsep + e.get("PYTHONPATH", ""),
           ATTNX_DOC_PYTHON=sys.executable)
  return e


def run_python(page_blocks: list[Block], tmp: str, timeout: int = 600):
  """Runs the python blocks of one page in order in one process; returns the CompletedProcess."""
  script = ["import sys", "_ns = {'__name__': '__main__'}"]
  for b in page_blocks:
    script.append(f"print({'>>> ' + b.where!r}, flush=True)")
    script.append(f"exec(compile({b.code!r}, {b.where!r}, 'exec'), _ns)")
  path = os.path.join(tmp, "page.py")
  with open(path, "w") as f:
    f.write("\n".join(script) + "\n")
  return subprocess.run([sys.executable, path], capture_output=True, text=True, cwd=ROOT,
                        env=env(tmp), timeout=timeout)


_SHELL_PRELUDE = """set -eo pipefail
python() { "$ATTNX_DOC_PYTHON" "$ATTNX_DOC_SHIM" "$@"; }
python3() { python "$@"; }
pip() { echo "[doc test] not run (CI installs): pip $*"; }
sphinx-build() { echo "[doc test] not run (CI builds the site): sphinx-build $*"; }
ci_run() { echo "[doc test] not run (it is CI): .ci/run"; }
"""


def run_shell(block: Block, tmp: str, timeout: int = 600):
  """Runs one bash block under the shim; returns the CompletedProcess."""
  code = re.sub(r"(?m)^(\s*)\.ci/run\b", r"\1ci_run", block.code)
  e = env(tmp)
  e["ATTNX_DOC_SHIM"] = os.path.abspath(__file__)
  e["ATTNX_DOC_CHECKED"] = os.path.join(tmp, "dry_run_commands.txt")
  return subprocess.run(["bash", "-c", _SHELL_PRELUDE + code], capture_output=True, text=True,
                        cwd=ROOT, env=e, timeout=timeout)


def shim(args: list[str]) -> int:
  """What a documented ``python ARGS`` does under the doc test (see the module docstring)."""
  python = os.environ.get("ATTNX_DOC_PYTHON", sys.executable)
  if args[:2] == ["-m", "pytest"]:
    print("[doc test] not run (CI runs the suite): python " + " ".join(args))
    return 0
  if args[:2] == ["-m", "attnx.launch_local"]:
    if "--" not in args:
      return subprocess.call([python, *args])  # e.g. --help
    args = args[args.index("--") + 1:]
  if args and os.path.basename(args[0]) == "launch.py":
    return _dry_run(python, args)
  return subprocess.call([python, *args])


def _dry_run(python: str, args: list[str]) -> int:
  """``launch.py ARGS --dry_run``, unless this page's blocks already checked these ARGS."""
  record = os.environ.get("ATTNX_DOC_CHECKED")
  line = "\0".join(args)
  if record and os.path.exists(record):
    with open(record) as f:
      if line in f.read().split("\n"):
        print("[doc test] checked above: python " + " ".join(args))
        return 0
  status = subprocess.call([python, *args, "--dry_run"])
  if record and status == 0:
    with open(record, "a") as f:
      f.write(line + "\n")
  return status


if __name__ == "__main__":
  sys.exit(shim(sys.argv[1:]))
