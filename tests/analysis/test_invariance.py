"""attnx.analysis.invariance: the kernel tables (softmax invariant, relu not; the functional
equation), the sets and the claims they decide, the training-level summary and report."""

import jax.numpy as jnp
import numpy as np
import pytest

from attnx.analysis import invariance
from attnx.train import Report


def test_shift_table_and_functional_equation():
  specs = [(n, n) for n in ("softmax", "relu", "gaussian", "softmax_plus_one")]
  inv = invariance.shift_table(specs + [("naive", jnp.exp)], shifts=(-1.0, 5.0),
                               large_shift=100.0, num_rows=16, num_keys=8, dim=4, seed=0)
  rows = {r["weighting"]: r for r in inv}
  assert rows["softmax"]["invariant"] and rows["gaussian"]["invariant"]
  assert not rows["relu"]["invariant"] and rows["relu"]["max_diff"] > 0.1
  assert not rows["softmax_plus_one"]["invariant"]
  assert np.isnan(rows["naive"]["M=100"])  # exp without the row-max shift overflows
  fe = invariance.functional_equation_table([n for n, _ in specs], ratio_shifts=(0.5, 1.0),
                                            grid=101, num_keys=8)
  g = {r["weighting"]: r["g(M) constant"] for r in fe}
  assert g == {"softmax": True, "relu": False, "gaussian": True, "softmax_plus_one": True}
  ks = invariance.kernel_summary(inv, fe)
  assert ks["held"] is True and ks["offset"] == ["softmax_plus_one"]
  assert set(invariance.exp_family()) == {"softmax", "exp", "gaussian"}
  with pytest.raises(ValueError, match="keys"):
    invariance.shift_table(specs, shifts=(1.0,), large_shift=100.0, num_rows=4, num_keys=1,
                           dim=2, seed=0)


def _kernel_rows(invariant, g_const):
  names = ["softmax", "exp", "gaussian", "softmax_plus_one", "relu"]
  inv = [{"weighting": n, "invariant": n in invariant} for n in names]
  inv.append({"weighting": "sparsemax (row normalizer)", "invariant": True})
  return inv, [{"weighting": n, "g(M) constant": n in g_const} for n in names]


def test_kernel_summary_compares_sets():
  exp_family = {"softmax", "exp", "gaussian"}
  ks = invariance.kernel_summary(*_kernel_rows(exp_family, exp_family | {"softmax_plus_one"}))
  assert ks["held"] is True and ks["predicted"] == sorted(exp_family)
  assert "only the exp family" in invariance.kernel_text(ks)
  # The offset case found invariant, or an exp-family member not invariant: not held, and the
  # "only exp" sentence is not printed.
  for invariant in (exp_family | {"softmax_plus_one"}, {"softmax", "exp"}):
    ks = invariance.kernel_summary(*_kernel_rows(invariant, exp_family | {"softmax_plus_one"}))
    assert ks["held"] is False and "only the exp family" not in invariance.kernel_text(ks)
  ks = invariance.kernel_summary(*_kernel_rows(exp_family | {"relu"}, exp_family))
  assert ks["held"] is False and ks["invariant_outside_family"] == ["relu"]


def _fake_training(tv, acc, scores=None):
  """tr dict as training_level returns it, from {label: {σ: per-seed values}}."""
  as_arrays = lambda d: {k: {s: np.asarray(v) for s, v in x.items()} for k, x in d.items()}
  return {"weight_tv": as_arrays(tv), "accuracy": as_arrays(acc),
          "scores": scores or {k: "dot" for k in tv}}


def test_training_summary_every_sigma_and_ties(tmp_path):
  tv = {"softmax": {0: [0, 0], 1: [0.10, 0.11], 4: [0.50, 0.52]},
        "softmax_plus_one": {0: [0, 0], 1: [0.10, 0.11], 4: [0.50, 0.51]},
        "sigmoid": {0: [0, 0], 1: [0.30, 0.31], 4: [0.35, 0.35]}}
  acc = {"softmax": {0: [0.9, 0.9], 1: [0.8, 0.8], 4: [0.3, 0.3]},
         "softmax_plus_one": {0: [0.9, 0.9], 1: [0.8, 0.8], 4: [0.3, 0.3]},
         "sigmoid": {0: [0.7, 0.7], 1: [0.5, 0.5], 4: [0.2, 0.2]}}
  s = invariance.training_summary(_fake_training(tv, acc), [0, 1, 4])
  # σ = 1: softmax (tied with softmax_plus_one) moves least; σ = 4: sigmoid (saturated) does.
  assert [p["tv_ok"] for p in s["per_sigma"]] == [True, False]
  assert s["per_sigma"][1]["tv_ranking"][0] == "sigmoid"
  assert s["per_sigma"][0]["acc_best"] == ["softmax", "softmax_plus_one"]
  assert s["held"] is None and "not at σ = 4" in invariance.training_text(s)
  tr = {**_fake_training(tv, acc), "histories": {k: [] for k in tv}}
  rep = Report("t", str(tmp_path))
  summary = invariance.report_training_level(rep, tr, [0, 1, 4], num_seeds=2, dim=16,
                                             margins={"tv": 0.01, "accuracy": 0.01})
  text = rep.markdown()
  assert summary["held"] is None and rep.verdicts[-1]["held"] is None
  assert "Verdict rule *all or none*" in text
  assert ("softmax_plus_one ties with softmax in accuracy at σ = 1, 4 and in weight change "
          "at σ = 1:") in text
  assert text.count("softmax_plus_one ties with softmax") == 1
  assert "distance score" not in text and "−β‖x_i − x_j‖²" not in text
  # softmax_plus_one is not an exp-family win on its own.
  only_plus_one = {k: v for k, v in acc.items() if k != "softmax"}
  s = invariance.training_summary(
      _fake_training({k: tv[k] for k in only_plus_one}, only_plus_one), [0, 1, 4])
  assert s["exp_family_trained"] == [] and s["held"] is None
  # One dot-product F (the distance model does not count): nothing to compare.
  s = invariance.training_summary(_fake_training(
      {"softmax": tv["softmax"], "gaussian (neg_sq_dist)": tv["sigmoid"]},
      {"softmax": acc["softmax"], "gaussian (neg_sq_dist)": acc["sigmoid"]},
      {"softmax": "dot", "gaussian (neg_sq_dist)": "neg_sq_dist"}), [0, 1, 4])
  assert s["comparable"] is False and s["held"] is None


