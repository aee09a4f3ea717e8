"""Data parallelism on 8 fake CPU devices equals the single-device step (subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attnx import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shard_map_and_pmap_equal_single_device_on_8_fake_devices():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu",
             # Busy CI machines: do not let XLA abort a slow all-reduce after 40 s.
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                        + " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip())
  script = os.path.join(os.path.dirname(__file__), "parallel_check.py")
  proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                        timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  out = json.loads(line[len("RESULT "):])
  assert out["max_param_diff_shard_map"] < 1e-5, out
  assert out["max_param_diff_pmap"] < 1e-5, out
  assert out["max_param_diff_shard_map_pmap"] < 1e-5, out
  for mode in ("shard_map", "pmap"):
    np.testing.assert_allclose(out[mode]["loss"], out["none"]["loss"], atol=1e-5)
    np.testing.assert_allclose(out[mode]["accuracy"], out["none"]["accuracy"], atol=1e-6)


def test_unknown_parallel_mode_and_indivisible_batch():
  with pytest.raises(ValueError, match="parallel='dp'.*none.*shard_map.*pmap"):
    train.Placement("dp")
  with pytest.raises(ValueError, match="parallel"):
    from attnx.train.parallel import validate_parallel
    validate_parallel("nope", 8)
