"""shift_invariance: kernel-level table (softmax invariant, relu not) and tiny end to end."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import shift_invariance as exp  # noqa: E402


def test_presets_and_validation():
  assert set(exp.PRESETS) >= {"default", "tiny"}
  with pytest.raises(ValueError, match="default"):
    exp.get_config("nope")
  c = exp.get_config("tiny")
  c.train.weightings = ("softmax", "not_a_weighting")
  with pytest.raises(ValueError, match="train.weightings"):
    exp.validate_config(c)


def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  inv = {r["weighting"]: r for r in out["kernel_invariance"]}
  assert inv["softmax"]["max_diff"] < 1e-6 and inv["softmax"]["invariant"]
  assert inv["gaussian"]["invariant"]
  assert inv["relu"]["max_diff"] > 0.1 and not inv["relu"]["invariant"]
  assert not inv["softmax_plus_one"]["invariant"]
  # The textbook exp without the max shift overflows at M = 100 (float32).
  assert np.isnan(inv["exp (naive callable, no max shift)"]["M=100"])
  fe = {r["weighting"]: r for r in out["functional_equation"]}
  assert fe["softmax"]["g(M) constant"] and not fe["relu"]["g(M) constant"]
  assert fe["sigmoid"]["max_spread"] > 0.1
  tr = out["training"]
  assert set(tr["accuracy"]) == {"softmax", "relu"}
  for label in ("softmax", "relu"):
    acc = np.asarray(tr["accuracy"][label][0.0])
    assert acc.shape == (2,) and np.all((acc >= 0) & (acc <= 1))
    assert np.allclose(tr["weight_tv"][label][0.0], 0.0)
  results = json.loads((tmp_path / "results.json").read_text())
  assert len(results["tables"]) == 4 and results["verdicts"][0]["held"] is True
  assert (tmp_path / "accuracy_vs_global_noise.png").exists()
