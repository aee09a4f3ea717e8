"""dot_vs_distance: the identity at constant key norm, and tiny preset end to end."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import dot_vs_distance as exp  # noqa: E402


def test_kernel_level_identity():
  c = exp.get_config("tiny")
  rows = exp.kernel_level(c)
  get = lambda spread, vs: next(r for r in rows if r["key-norm spread"] == spread
                                and r["distance weights vs"] == vs)
  assert get(0.0, "softmax(2 q·k)")["max abs diff"] < 1e-5
  assert get(0.0, "softmax(q·k)")["max abs diff"] > 0.05  # the factor 2 is a temperature
  assert get(0.3, "softmax(2 q·k)")["mean TV"] > 0.05  # spread norms break the identity
  assert get(0.0, "sigmoid(2 q·k)")["max abs diff"] > 0.05  # non-exp F: no cancellation


def test_bad_score():
  c = exp.get_config("tiny")
  c.train.scores = ("scaled_dot", "cosine_similarity")
  with pytest.raises(ValueError, match="train.scores.*neg_sq_dist"):
    exp.validate_config(c)


def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  assert out["verdict"] is True
  assert set(out["training"]["accuracy"]) == {"scaled_dot", "neg_sq_dist"}
  results = json.loads((tmp_path / "results.json").read_text())
  variants = [r["variant"] for r in results["tables"][1]["rows"]]
  assert variants == ["scaled_dot", "neg_sq_dist"]
  for fig in ("kernel_tv_vs_norm_spread.png", "test_accuracy_curves.png"):
    assert (tmp_path / fig).exists()
