"""experiments/ablations.py: the pair claims, and a trimmed tiny run end to end."""

import os
import sys
import types

import numpy as np
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from attnx.train.experiment import TaskResult  # noqa: E402
from experiments import ablations as exp  # noqa: E402


def _result(**acc):
  """A TaskResult of the digits task with these per-seed accuracies."""
  fits = {k: types.SimpleNamespace(final_metrics={"accuracy": np.asarray(v)})
          for k, v in acc.items()}
  return TaskResult(exp._digits_task(exp.get_config("tiny")), {}, fits, {}, {})


def _held(result, pair):
  good, bad = exp.PAIRS[pair]
  return result.claim([(good, "softmax", "not worse"), (bad, good, "worse")]).held


def test_pair_claims():
  good, bad = exp.PAIRS["sigmoid"]
  held = _result(softmax=[0.9, 0.91, 0.92], **{good: [0.9, 0.912, 0.918],
                                               bad: [0.5, 0.55, 0.52]})
  assert _held(held, "sigmoid") is True
  # The "bad" variant is as good: the ablation shows nothing is needed.
  same = _result(softmax=[0.9, 0.91, 0.92], **{good: [0.9, 0.912, 0.918],
                                               bad: [0.9, 0.911, 0.919]})
  assert _held(same, "sigmoid") is False
  # The "good" variant is worse than softmax.
  worse = _result(softmax=[0.9, 0.91, 0.92], **{good: [0.7, 0.71, 0.72],
                                                bad: [0.5, 0.55, 0.52]})
  assert _held(worse, "sigmoid") is False
  missing = _result(softmax=[0.9, 0.91])
  assert _held(missing, "sigmoid") is None and not missing.claim(
      [(good, "softmax", "not worse")]).tested


@legs.experiment_run
def test_trimmed_tiny_run(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  monkeypatch.setattr(exp, "RELU", {})  # fewer compiles; the sigmoid pair keeps the shape
  c = exp.get_config("tiny")
  c.progress = False
  c.digits.num_steps = c.mqar.num_steps = 5
  out = exp.run(c, str(tmp_path / "wd"))
  assert set(out["sigmoid"]["accuracy"]) == {"softmax", *exp.SIGMOID}
  by_len = out["ssmax"]["accuracy_by_length"]
  assert set(by_len) == {"softmax", "ssmax"} and set(by_len["ssmax"]) == {24, 48}
  assert all(0 <= a <= 1 for v in by_len.values() for n in v.values() for a in n)
  assert os.path.exists(tmp_path / "wd" / "mqar_accuracy_vs_length.png")
  assert "accuracy drop" in open(out["report"]).read()
