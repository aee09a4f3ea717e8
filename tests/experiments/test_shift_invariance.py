"""shift_invariance: presets, the tiny run end to end (kernel table: softmax invariant, relu
not), the training task's declaration."""

import json
import os
import sys

import numpy as np
import pytest
from support import legs

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


@legs.experiment_run
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
  ks = out["kernel_summary"]
  assert ks["held"] is True and out["verdict"] is True
  assert set(ks["invariant"]) == {"softmax", "exp", "gaussian"}
  assert "softmax_plus_one" in ks["g_const"] and ks["offset"] == ["softmax_plus_one"]
  tr = out["training"]
  assert set(tr["accuracy"]) == {"softmax", "relu"}
  for label in ("softmax", "relu"):
    acc = np.asarray(tr["accuracy"][label][0.0])
    assert acc.shape == (2,) and np.all((acc >= 0) & (acc <= 1))
    assert np.allclose(tr["weight_tv"][label][0.0], 0.0)
  # Softmax's weights move less than relu's under the largest global noise (tiny, seeds 0-2:
  # 0.35-0.37 vs 0.44-0.46).
  top = max(tr["weight_tv"]["softmax"])
  assert np.mean(tr["weight_tv"]["softmax"][top]) < np.mean(tr["weight_tv"]["relu"][top]) - 0.03
  assert tr["per_sigma"][0]["tv_ranking"] == ["softmax", "relu"]
  results = json.loads((tmp_path / "results.json").read_text())
  assert len(results["tables"]) == 5
  assert [v["held"] for v in results["verdicts"]] == [True, out["training_verdict"]]
  assert "only the exp family is shift-invariant" in results["verdicts"][0]["text"]
  report = (tmp_path / "report.md").read_text()
  assert "distance score" not in report and "neg_sq_dist" not in report  # none trained
  assert (tmp_path / "accuracy_vs_global_noise.png").exists()


def test_noisy_task_declares_evaluators_and_levels(tmp_path, monkeypatch):
  from attnx.data._base import split_seed
  from attnx.data.noisy_clusters import make_noisy_clusters

  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path))
  c = exp.get_config("tiny")
  task, arrays = exp.noisy_task(c)
  assert task.evaluators == ("accuracy_by_level", "weight_tv_by_level")
  assert task.eval_options["levels"] == [0.0, 2.0]
  tc = c.train
  x = arrays["eval"]["inputs_by_level"]
  assert x.shape == (2, tc.num_eval, tc.num_objects, tc.dim)
  # Same samples at every level, only σ changes: x(σ) − x(0) = σ·g, one g per sample.
  step = x[1] - x[0]
  np.testing.assert_allclose(step, np.broadcast_to(step[:, :1], step.shape), atol=1e-5)
  assert np.abs(step).max() > 0.5
  for i, sigma in enumerate(tc.eval_global_noise):  # read through attnx.data's builder
    ref = make_noisy_clusters(tc.num_eval, split_seed(c.seed, "test"),
                              **exp._cluster_params(tc), global_noise=sigma)
    np.testing.assert_array_equal(x[i], ref["inputs"])
    np.testing.assert_array_equal(arrays["eval"]["targets"], ref["targets"])
  budget = exp._budget(c)
  assert (budget.num_steps, budget.batch_size, budget.eval_every) == (20, 32, 0)
  assert budget.optimizer.name == "adam" and budget.optimizer.schedule == "constant"
