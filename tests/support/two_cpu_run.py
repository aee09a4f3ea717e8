"""Runs a Python snippet in its own process pinned to 2 CPUs, like the CI machine.

For regressions that only show on a 2-thread XLA CPU pool (deadlocks): pinning makes XLA size
its pool for 2 cores on any machine, and the own process turns a hang into a test failure
after `timeout` seconds instead of a stalled suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PIN = "import os; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])\n"


def run_on_two_cpus(script: str, timeout: float, what: str) -> subprocess.CompletedProcess:
  """Runs `script` (which must print OK at the end); fails the test if it hangs or errors."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  try:
    proc = subprocess.run([sys.executable, "-c", _PIN + script], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{what} hung for {timeout} s on 2 CPUs (XLA CPU thread-pool deadlock)")
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
  return proc
