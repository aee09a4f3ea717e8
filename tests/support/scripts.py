"""Running the tests' helper scripts and launch.py runs in subprocesses, and reading them back.

``script_result("ring_check.py", "--ci")`` runs tests/support/ring_check.py on the CPU with the
repository on the path and returns the JSON of its ``RESULT {...}`` line; ``metric_records``
reads a run's metrics.jsonl keyed by (run, step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(ROOT, "tests", "support")


def cpu_env(**extra: str) -> dict[str, str]:
  """This environment with the repository on PYTHONPATH, JAX on the CPU, plus `extra`."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  env.update(extra)
  return env


def script_result(script: str, *args: str, timeout: int = 600) -> Any:
  """The JSON a tests/support script prints after ``RESULT `` (it must exit 0)."""
  proc = subprocess.run([sys.executable, os.path.join(SUPPORT, script), *args],
                        capture_output=True, text=True, env=cpu_env(), timeout=timeout, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


def metric_records(workdir: Any) -> dict[tuple[str, int], dict]:
  """A run directory's metrics.jsonl records by (run, step)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {(r["run"], r["step"]): r for r in map(json.loads, f)}
