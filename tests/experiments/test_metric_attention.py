"""metric_attention: tiny preset end to end; the report has a row per variant."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import metric_attention as exp  # noqa: E402


def test_steps_to_target():
  hist = [{"step": 10, "eval_accuracy": [0.1, 0.5]}, {"step": 20, "loss": [1, 1]},
          {"step": 30, "eval_accuracy": [0.6, 0.4]}, {"step": 40, "eval_accuracy": [0.7, 0.3]}]
  np.testing.assert_array_equal(exp.steps_to_target(hist, 0.5, 2), [30, 10])
  assert np.isnan(exp.steps_to_target(hist, 0.9, 2)).all()


def test_bad_variant():
  c = exp.get_config("tiny")
  c.variants = ("softmax", "metrik")
  with pytest.raises(ValueError, match="variants.*metric"):
    exp.validate_config(c)


def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  res = out["datasets"]["digits"]
  assert set(res) == {"softmax", "metric"}
  for r in res.values():
    acc = np.asarray(r["accuracy"])
    assert acc.shape == (2,) and np.all((acc >= 0) & (acc <= 1))
    assert set(r["noisy"]) == {0.0, 0.3}
  assert set(out["claims"]) == {"accuracy", "efficiency", "robustness"}
  assert set(out["claims"].values()) <= {"better", "worse", "within seed noise"}

  results = json.loads((tmp_path / "results.json").read_text())
  variants = [r["variant"] for r in results["tables"][0]["rows"]]
  assert variants == ["softmax", "metric"]
  assert len(results["verdicts"]) == 1
  assert (tmp_path / "digits_curves.png").exists()


def test_outcome():
  assert exp._outcome([0.9, 0.92], [0.5, 0.52]) == "better"
  assert exp._outcome([0.5, 0.52], [0.9, 0.92]) == "worse"
  assert exp._outcome([0.5, 0.7], [0.6, 0.62]) == "within seed noise"
