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


def test_task_hooks_prepare_limits_curve_and_skipped_evaluators(tmp_path, monkeypatch):
  """prepare/train_limit/eval_limit shape the arrays; the curve uses curve_evaluators on the
  first curve_limit examples while the final metrics use every evaluator on the whole eval
  split; a variant's skip_evaluators are not run; fit_options reach FitConfig."""
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  seen = {}

  def prepare(arrays):
    seen.update({s: len(a["targets"]) for s, a in arrays.items()})
    return {s: {**a, "inputs": a["inputs"] * 0.0} if s == "eval" else a
            for s, a in arrays.items()}

  task = _task(evaluators=("accuracy", "loss"), curve_evaluators=("loss",), curve_limit=50,
               train_limit=300, prepare=prepare, fit_options=dict(log_every=10))
  arrays = experiment.load_task_arrays(task)
  assert seen == {"train": 300, "eval": 200}
  assert set(arrays["eval"]) == {"inputs", "targets"} and not arrays["eval"]["inputs"].any()
  res = experiment.train_variant(_config(), str(tmp_path / "wd"), task,
                                 experiment.Variant("full", 64), arrays)
  evals = [h for h in res.history if "eval_loss" in h]
  assert evals and not any("eval_accuracy" in h for h in res.history)  # the curve: loss only
  logged = [h["step"] for h in res.history if "loss" in h]
  assert 10 in logged and 20 in logged and 5 not in logged  # log_every=10, not config's 5
  model = task.build_model(64)

  def score(n):
    part = {k: v[:n] for k, v in arrays["eval"].items()}
    return train.evaluate(model, res.params, train.loader(part, 500), ("accuracy", "loss"))

  np.testing.assert_allclose(evals[-1]["eval_loss"], score(50)["loss"], rtol=1e-5)
  for k in ("accuracy", "loss"):  # final metrics: every evaluator on all 200 examples
    np.testing.assert_allclose(res.final_metrics[k], score(None)[k], rtol=1e-5)
  skipped = experiment.train_variant(
      _config(num_steps=10), str(tmp_path / "wd"), task,
      experiment.Variant("skip", 64, skip_evaluators=("loss",)), arrays)
  assert "loss" not in skipped.final_metrics and "accuracy" in skipped.final_metrics
  assert not any("eval_loss" in h for h in skipped.history)


def test_the_documented_minimal_experiment_runs_through_launch(tmp_path):
  """docs/architecture.md promises that a new comparison is one short file: run that text."""
  import re
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  doc = open(os.path.join(root, "docs", "architecture.md")).read()
  code = re.search(r"```python\n(\"\"\"ReLU attention vs softmax.*?)```", doc, re.S).group(1)
  path = tmp_path / "relu_vs_softmax.py"
  path.write_text(code)
  env = {**os.environ, "ATTNX_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": root}
  out = subprocess.run(
      [sys.executable, os.path.join(root, "launch.py"), f"--config={path}",
       f"--workdir={tmp_path / 'wd'}", "--config.num_steps=10", "--config.num_seeds=2",
       "--config.eval_every=0", "--config.progress=False"],
      capture_output=True, text=True, cwd=root, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  final = json.load(open(tmp_path / "wd" / "final_metrics.json"))
  assert set(final["digits"]) == {"softmax", "relu"}
  assert len(final["digits"]["relu"]["accuracy"]) == 2
  assert "Verdict rule" in open(tmp_path / "wd" / "report.md").read()


def _result(**metric) -> experiment.TaskResult:
  """A TaskResult of ``_task()`` whose variants have these per-seed accuracies."""
  fits = {k: type("Fit", (), {"final_metrics": {"accuracy": np.asarray(v)}})()
          for k, v in metric.items()}
  return experiment.TaskResult(_task(), {}, fits, {}, {})


def test_task_result_compare_and_claim():
  r = _result(a=[0.9, 0.91, 0.92], b=[0.5, 0.52, 0.51], c=[0.9, 0.911, 0.919])
  c = r.compare("a", "b")
  assert (c.a, c.b, c.metric, c.margin, c.outcome) == ("a", "b", "accuracy", 0.01, "better")
  assert r.claim([("a", "b", "better"), ("c", "a", "not worse")]).held is True
  assert r.claim([("a", "b", "better"), ("c", "a", "better")]).held is False  # c ≈ a
  missing = r.claim([("a", "z", "better")])
  assert missing.held is None and not missing.tested


def test_with_budget_sets_the_study_budget_on_a_copy():
  c = _config()
  c.study = ml_collections.ConfigDict(dict(num_steps=7, batch_size=4))
  b = experiment.with_budget(c, num_steps=c.study.num_steps, batch_size=4, eval_every=0,
                             optimizer=train.optimizer_config(name="sgd", learning_rate=0.1))
  assert (b.num_steps, b.batch_size, b.eval_every, b.optimizer.name) == (7, 4, 0, "sgd")
  assert (c.num_steps, c.batch_size, c.optimizer.name) == (30, 32, "adam")  # untouched


def test_images_to_unit_floats():
  arrays = {"train": {"inputs": np.array([[0, 255]], np.uint8), "targets": np.array([1])},
            "eval": {"inputs": np.array([[0.5, 1.0]], np.float32), "targets": np.array([0])}}
  out = experiment.images_to_unit_floats(arrays)
  np.testing.assert_array_equal(out["train"]["inputs"], [[0.0, 1.0]])
  assert out["train"]["inputs"].dtype == np.float32
  np.testing.assert_array_equal(out["eval"]["inputs"], [[0.5, 1.0]])  # floats untouched
  np.testing.assert_array_equal(out["train"]["targets"], [1])
