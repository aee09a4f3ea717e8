"""tools/experiment_fingerprint.py: what a fingerprint keeps, what it masks, what compare sees.

A run directory is written by hand here in the layout the experiments write (results.json's
tables and verdicts, final_metrics.json, metrics.jsonl); the tool's own run of every tiny preset
is what a refactor is checked with (docs/development.md), too long for the suite.
"""

from __future__ import annotations

import importlib.util
import json
import os

from support.scripts import ROOT

_spec = importlib.util.spec_from_file_location(
    "experiment_fingerprint", os.path.join(ROOT, "tools", "experiment_fingerprint.py"))
fp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp)


def _workdir(path, accuracy=0.5, ms=7.3, verdict="relu vs softmax: worse"):
  path.mkdir()
  results = {"title": "t", "claim": "c", "created": "2026-11-29 10:44:56 UTC",
             "command": f"python launch.py --workdir={path}",
             "tables": [{"caption": "final", "columns": ["weighting", "accuracy", "ms/step",
                                                         "compile s", "ratio vs softmax"],
                         "rows": [{"weighting": "relu", "accuracy": accuracy, "ms/step": ms,
                                   "compile s": 5.0, "ratio vs softmax": 1.1}]}],
             "verdicts": [{"held": False, "text": verdict}]}
  (path / "results.json").write_text(json.dumps(results))
  (path / "final_metrics.json").write_text(json.dumps({"relu": {"accuracy": [accuracy]}}))
  (path / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": [1.5],
                                                  "steps_per_s": ms}) + "\n")
  return str(path)


def test_training_fingerprints_keep_metrics_and_verdicts_and_mask_timings(tmp_path):
  a = fp.fingerprint(_workdir(tmp_path / "fingerprint_a"), "compare_weightings")
  b = fp.fingerprint(_workdir(tmp_path / "fingerprint_b", ms=99.0), "compare_weightings")
  assert a == b  # another time per step, another workdir: the same fingerprint
  row = a["results.json"]["tables"][0]["rows"][0]
  assert row["accuracy"] == 0.5 and row["ms/step"] == "<timed>" and row["compile s"] == "<timed>"
  assert row["ratio vs softmax"] != "<timed>"  # a training run's ratio is no timing
  assert a["results.json"]["verdicts"] == [{"held": False, "text": "relu vs softmax: worse"}]
  assert a["final_metrics.json"] == {"relu": {"accuracy": [0.5]}}
  assert a["metrics.jsonl"] == [{"loss": [1.5], "step": 10, "steps_per_s": "<timed>"}]
  c = fp.fingerprint(_workdir(tmp_path / "fingerprint_c", accuracy=0.6), "compare_weightings")
  assert c != a


def test_benchmark_fingerprints_mask_what_timings_decide():
  assert fp._timed("ratio vs softmax", benchmark=True)
  assert fp._timed("target met", benchmark=True)
  assert fp._timed("causal / full", benchmark=True) and fp._timed("% matmul", benchmark=True)
  assert fp._timed("matmul_gflops", benchmark=True)
  assert not fp._timed("max abs error", benchmark=True)
  assert not fp._timed("weighting", benchmark=True)


def _write(path, payload):
  path.write_text(json.dumps(payload))
  return str(path)


def test_compare_names_each_difference_and_exits_1(tmp_path, capsys):
  before = {"x": {"final_metrics.json": {"relu": [0.5, 0.25]}}, "y": {"exit": 0}}
  same = _write(tmp_path / "same.json", before)
  assert fp.compare(same, same) == 0
  changed = {"x": {"final_metrics.json": {"relu": [0.5, 0.26]}}, "y": {"exit": 0}}
  assert fp.compare(same, _write(tmp_path / "changed.json", changed)) == 1
  assert "/x/final_metrics.json/relu[1]: '0.25' != '0.26'" in capsys.readouterr().out
  partial = _write(tmp_path / "partial.json", {"x": before["x"]})  # a run with --only=x
  assert fp.compare(same, partial) == 0
  assert "(not compared): y" in capsys.readouterr().out
  extra = _write(tmp_path / "extra.json", {**before, "z": {"exit": 0}})
  assert fp.compare(same, extra) == 1  # an experiment the baseline lacks is a difference


def test_compare_counts_nan_equal_to_nan(tmp_path):
  nan = _write(tmp_path / "nan.json", {"x": {"stats": [float("nan"), 1.0]}})
  assert fp.compare(nan, nan) == 0  # a NaN metric (e.g. a statistic with no defined value)
  other = _write(tmp_path / "other.json", {"x": {"stats": [0.0, 1.0]}})
  assert fp.compare(nan, other) == 1
