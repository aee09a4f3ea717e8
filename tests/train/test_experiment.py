"""The declarative comparison path (attnx/train/experiment.py) on a tiny task."""

from __future__ import annotations

import json
import os

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from attnx import train
from attnx.train import experiment, verdict


class _Linear(nn.Module):
  """A linear classifier whose capacity the variant sets (0 features = a constant)."""
  width: int

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    x = x.reshape(x.shape[0], -1)[:, :self.width] if self.width else jnp.zeros((x.shape[0], 1))
    return nn.Dense(10)(x)


def _config(**kw) -> ml_collections.ConfigDict:
  c = train.base_config()
  c.update(dict(num_seeds=3, num_steps=30, batch_size=32, eval_every=15, log_every=5,
                checkpoint_every=0, progress=False, experiment="t", preset="p"))
  c.optimizer = train.optimizer_config(name="adam", learning_rate=1e-2)
  c.update(kw)
  return c


def _task(**kw) -> experiment.Task:
  return experiment.Task(name="digits", dataset="digits", metric="accuracy",
                         build_model=lambda width: _Linear(width), eval_limit=200, **kw)


def test_run_comparison_trains_compares_and_reports(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  variants = [experiment.Variant("full", 64), experiment.Variant("blind", 0)]
  out = experiment.run_comparison(_config(), str(tmp_path / "wd"), title="T", claim="C",
                                  tasks=[_task()], variants=variants, reference="full")
  result = out["tasks"]["digits"]
  acc = {v.name: result.metric(v.name) for v in variants}
  assert acc["full"].shape == (3,) and acc["full"].mean() > acc["blind"].mean() + 0.2
  # The comparison is exactly the shared rule applied to the per-seed metrics.
  expected = verdict.compare(acc["blind"], acc["full"], margin=0.01, a_name="blind",
                             b_name="full", metric="accuracy")
  assert result.comparisons["blind"] == expected and expected.outcome == "worse"
  report = open(out["report"]).read()
  assert "Verdict rule" in report and "3 seeds" in report and "Claim did not hold" in report
  assert os.path.exists(tmp_path / "wd" / "digits_curves.png")
  final = json.load(open(tmp_path / "wd" / "final_metrics.json"))
  assert np.allclose(final["digits"]["blind"]["accuracy"], acc["blind"])
  results = json.load(open(tmp_path / "wd" / "results.json"))
  assert results["verdicts"][0]["held"] is False


def test_unknown_evaluator_is_named(tmp_path):
  with pytest.raises(ValueError, match="unknown evaluator.*'bleu_score'.*valid: accuracy"):
    experiment.run_task(_config(), str(tmp_path), _task(evaluators=("bleu_score",)),
                        [experiment.Variant("full", 64)], None)


def test_run_name_is_file_system_safe():
  assert experiment.run_name("survey", "power:p=3") == "survey-power_p_3"
  assert experiment.run_name("a", "x/y z") == "a-x_y_z"
