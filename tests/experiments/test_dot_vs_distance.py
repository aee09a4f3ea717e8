"""dot_vs_distance: the identity at constant key norm, and tiny preset end to end."""

import json
import os
import sys

import pytest
from support import legs

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


def _row(spread, f, vs, diff, tv):
  return {"key-norm spread": spread, "F": f, "distance weights vs": vs, "max abs diff": diff,
          "mean TV": tv}


def test_kernel_claim_derives_each_statement():
  rows = exp.kernel_level(exp.get_config("tiny"))
  claim, ks = exp.kernel_claim(rows)
  assert ks["exact"] and ks["grows"] and ks["non_exp_differ"] and ks["held"] is True
  assert claim.held is True and claim.kind == "claim"
  good = [_row(0.0, "softmax", "softmax(2 q·k)", 1e-7, 1e-7),
          _row(0.3, "softmax", "softmax(2 q·k)", 0.5, 0.3),
          _row(0.0, "sigmoid", "sigmoid(2 q·k)", 0.6, 0.2)]
  assert exp.kernel_claim(good)[1]["held"] is True
  # TV that does not grow with the spread, or a non-exp F that coincides: not held.
  flat = [good[0], _row(0.3, "softmax", "softmax(2 q·k)", 1e-7, 1e-7), good[2]]
  claim, ks = exp.kernel_claim(flat)
  assert ks["grows"] is False and ks["held"] is False and claim.refuted() == ["growth"]
  same = good[:2] + [_row(0.0, "sigmoid", "sigmoid(2 q·k)", 1e-7, 1e-7)]
  claim, ks = exp.kernel_claim(same)
  assert ks["held"] is False and "Not every non-exp F differs" in claim.text
  # Nothing measured for a statement: untested (None), not vacuously true.
  claim, ks = exp.kernel_claim(good[:1])
  assert ks["grows"] is None and ks["non_exp_differ"] is None and ks["held"] is True
  assert "untested" in claim.text
  claim, ks = exp.kernel_claim(good[1:])  # no spread-0 row: the identity, hence the claim
  assert ks["held"] is None and not claim.tested and "Spread 0 was not measured" in claim.text


def test_bad_score():
  c = exp.get_config("tiny")
  c.train.scores = ("scaled_dot", "cosine_similarity")
  with pytest.raises(ValueError, match="train.scores.*neg_sq_dist"):
    exp.validate_config(c)


@legs.experiment_run
def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  assert out["verdict"] is True and out["kernel_summary"]["grows"] is True
  assert set(out["training"]["accuracy"]) == {"scaled_dot", "neg_sq_dist"}
  results = json.loads((tmp_path / "results.json").read_text())
  variants = [r["variant"] for r in results["tables"][1]["rows"]]
  assert variants == ["scaled_dot", "neg_sq_dist"]
  assert list(out["training"]["comparison"]) == ["qk_norm=False"]
  for fig in ("kernel_tv_vs_norm_spread.png", "test_accuracy_curves.png"):
    assert (tmp_path / fig).exists()


def test_training_tasks_pair_scores_per_qk_norm():
  groups = exp.training_tasks(exp.get_config("default"))
  assert [(qk, [v.name for v in vs], ref) for qk, _, vs, ref in groups] == [
      (False, ["scaled_dot", "neg_sq_dist"], "scaled_dot"),
      (True, ["scaled_dot + qk_norm", "neg_sq_dist + qk_norm"], "scaled_dot + qk_norm")]
  for qk, task, vs, _ in groups:
    assert task.evaluators == ("accuracy", "loss") and task.metric == "accuracy"
    assert all(v.spec["qk_norm"] == qk for v in vs)
