"""tools/program_hashes.py: hashes compare only when made with the same JAX.

One program of the corpus (dense softmax attention's forward), hashed in a subprocess as a user
runs the tool; the lowered programs differ across XLA versions, so a file made with another JAX
is refused (exit 2) instead of reporting every program changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
from support.scripts import ROOT, cpu_env

TOOL = os.path.join(ROOT, "tools", "program_hashes.py")
ONLY = "^attention/self/softmax/dense/causal=False/none/fwd$"  # the cheapest program


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, TOOL, "--only", ONLY, *args], capture_output=True,
                        text=True, env=cpu_env(), timeout=600, cwd=ROOT)


def test_hashes_compare_with_the_same_jax_only(tmp_path):
  first = tmp_path / "first.json"
  proc = _run("--out", str(first))
  assert proc.returncode == 0, proc.stderr[-2000:]
  run = json.loads(first.read_text())
  name = "attention/self/softmax/dense/causal=False/none/fwd"
  assert run["jax"] == jax.__version__ and list(run["hashes"]) == [name]

  proc = _run("--out", str(tmp_path / "again.json"), "--compare", str(first))
  assert proc.returncode == 0 and "identical: all 1 programs" in proc.stdout, proc.stdout

  changed = dict(run, hashes={k: "0" * 16 for k in run["hashes"]})
  (tmp_path / "changed.json").write_text(json.dumps(changed))
  proc = _run("--out", str(tmp_path / "x.json"), "--compare", str(tmp_path / "changed.json"))
  assert proc.returncode == 1 and f"changed: {name}" in proc.stdout

  other = {"0.0.1": dict(run, jax="0.0.1")}  # a baseline-shaped file of another JAX only
  (tmp_path / "other.json").write_text(json.dumps(other))
  proc = _run("--out", str(tmp_path / "y.json"), "--compare", str(tmp_path / "other.json"))
  assert proc.returncode == 2, proc.stdout
  assert f"no hashes made with jax {jax.__version__}" in proc.stderr


def test_the_baseline_holds_the_ends_of_the_supported_range():
  with open(os.path.join(ROOT, "tools", "program_hashes_baseline.json")) as f:
    base = json.load(f)
  assert {"0.10.2", "0.12.0.1"} <= set(base)
  for version, run in base.items():
    assert run["jax"] == version and len(run["hashes"]) >= 620
    assert not any(h.startswith("error") for h in run["hashes"].values())
