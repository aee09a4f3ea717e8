"""experiments/ablations.py: the pair verdicts, and a trimmed tiny run end to end."""

import os
import sys
import types

import numpy as np
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import ablations as exp  # noqa: E402


def _result(**acc):
  fits = {k: types.SimpleNamespace(final_metrics={"accuracy": np.asarray(v)})
          for k, v in acc.items()}
  r = types.SimpleNamespace(fits=fits, failures={})
  r.metric = lambda name: fits[name].final_metrics["accuracy"]
  return r


def test_pair_verdict():
  good, bad = "sigmoid b=−log n", "sigmoid b=0"
  held = _result(softmax=[0.9, 0.91, 0.92], **{good: [0.9, 0.912, 0.918],
                                               bad: [0.5, 0.55, 0.52]})
  assert exp._pair_verdict(held, good, bad, 0.01)[0] is True
  # The "bad" variant is as good: the ablation shows nothing is needed.
  same = _result(softmax=[0.9, 0.91, 0.92], **{good: [0.9, 0.912, 0.918],
                                               bad: [0.9, 0.911, 0.919]})
  assert exp._pair_verdict(same, good, bad, 0.01)[0] is False
  # The "good" variant is worse than softmax.
  worse = _result(softmax=[0.9, 0.91, 0.92], **{good: [0.7, 0.71, 0.72],
                                                bad: [0.5, 0.55, 0.52]})
  assert exp._pair_verdict(worse, good, bad, 0.01)[0] is False
  missing = _result(softmax=[0.9, 0.91])
  assert exp._pair_verdict(missing, good, bad, 0.01)[0] is None


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
