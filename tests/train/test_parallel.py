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
  script = os.path.join(ROOT, "tests", "support", "parallel_check.py")
  proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                        timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  out = json.loads(line[len("RESULT "):])
  for case in ("sgd", "masked_clipped", "nnx_gpt"):
    res = out[case]
    assert res["param_change"] > 1e-2, res  # training moved the params: not vacuous
    for key in ("shard_map", "pmap", "shard_map_pmap"):
      assert res[f"max_param_diff_{key}"] < 1e-6, (case, key, res)
    for mode in ("shard_map", "pmap"):
      for k in ("loss", "accuracy", "eval_accuracy"):
        np.testing.assert_allclose(res[mode][k], res["none"][k], atol=1e-6,
                                   err_msg=f"{case} {mode} {k}")
  # A (data, seq) mesh splits every example's positions too: the same training.
  seq = out["sequence"]
  assert seq["param_change"] > 1e-2, seq
  for name in ("seq4", "seq4_zigzag", "seq8"):
    assert seq[f"max_param_diff_{name}"] < 1e-6, (name, seq)
    np.testing.assert_allclose(seq[name]["loss"], seq["none"]["loss"], atol=1e-6, err_msg=name)


def test_unknown_parallel_mode_and_indivisible_batch(monkeypatch):
  from attnx.train.parallel import validate_parallel

  with pytest.raises(ValueError, match="parallel='dp'.*none.*shard_map.*pmap"):
    train.Placement("dp")
  with pytest.raises(ValueError, match="parallel"):
    validate_parallel("nope", 8)
  # Config validation catches it before JAX starts, from the number of fake CPU devices.
  c = train.base_config()
  c.batch_size = 31
  c.update(parallel="pmap", num_cpu_devices=2)
  with pytest.raises(ValueError, match=r"config\.batch_size=31 .*divisible.*2 devices"):
    train.validate(c)
  c.batch_size = 32
  train.validate(c)
  c.update(parallel="none", batch_size=31)
  train.validate(c)  # one device: any batch size
  # At run time, against the devices JAX sees (4 here, faked).
  import jax

  monkeypatch.setattr(jax, "local_device_count", lambda *a, **k: 4)
  monkeypatch.setattr(jax, "device_count", lambda *a, **k: 4)
  for mode in ("shard_map", "pmap"):
    with pytest.raises(ValueError, match=r"batch_size=30 .*divisible.*4 devices"):
      validate_parallel(mode, 30)
    validate_parallel(mode, 32)
  validate_parallel("none", 30)
