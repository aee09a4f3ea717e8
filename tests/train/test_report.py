"""Report, tables, figures, verdicts, learning-curve plots; config helpers."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np
import pytest

from attnx import train


def test_mean_std():
  assert train.mean_std([0.95, 0.96]) == "0.955 ± 0.005"
  assert train.mean_std([0.5]) == "0.5"
  assert train.mean_std([]) == "n/a"


def test_report_writes_markdown_json_and_png(tmp_path):
  cfg = ml_collections.ConfigDict({"lr": 0.1, "weightings": "softmax,relu"})
  rep = train.Report("My experiment", str(tmp_path), config=cfg, claim="relu matches softmax")
  rep.section("Results")
  rep.text("Same budget for every weighting.")
  rows = [{"weighting": "softmax", "accuracy": np.array([0.9, 0.92]), "ms/step": 1.23456},
          {"weighting": "re|lu", "accuracy": np.array([0.88, 0.9]), "ms/step": 2.0}]
  rep.table(rows, caption="final accuracy", floatfmt=".3g")
  hist = {"softmax": [{"step": 10, "loss": [1.0, 1.2]}, {"step": 20, "loss": [0.5, 0.7]}],
          "relu": [{"step": 10, "loss": [1.1, 1.3]}, {"step": 20, "loss": [0.6, 0.8]},
                   {"step": 20, "eval_accuracy": [0.5, 0.6]}]}
  fig = train.plot_learning_curves(hist, "loss", logy=True, title="train loss")
  assert len(fig.axes[0].lines) == 2
  rep.figure(fig, "curves", "learning curves")
  rep.verdict(False, "relu is 2 points lower")
  path = rep.write()
  md = open(path).read()
  assert path == os.path.join(str(tmp_path), "report.md")
  assert "# My experiment" in md and "**Claim under test:** relu matches softmax" in md
  assert "| weighting | accuracy | ms/step |" in md
  assert "| softmax | 0.91 ± 0.01 | 1.23 |" in md and "re\\|lu" in md
  assert "![learning curves](curves.png)" in md and (tmp_path / "curves.png").stat().st_size > 0
  assert "**Claim did not hold:** relu is 2 points lower" in md
  assert "| jax |" in md and "cores" in md and "Command:" in md
  res = json.load(open(tmp_path / "results.json"))
  assert res["verdicts"] == [{"held": False, "text": "relu is 2 points lower"}]
  assert res["tables"][0]["columns"] == ["weighting", "accuracy", "ms/step"]
  assert res["tables"][0]["rows"][0]["accuracy"] == [0.9, 0.92]
  assert res["config"]["lr"] == 0.1 and res["environment"]["versions"]["flax"]


def test_config_helpers(tmp_path):
  assert train.split_list("softmax, relu,,sparsemax") == ["softmax", "relu", "sparsemax"]
  assert train.split_list(("a", "b")) == ["a", "b"]
  c = train.base_config()
  train.validate(c)
  c.parallel = "dp"
  with pytest.raises(ValueError, match=r"config\.parallel='dp'.*none, shard_map, pmap"):
    train.validate(c)
  (tmp_path / "exp_a.py").write_text(
      '"""Does A beat B?\n\nMore."""\nPRESETS = ("default", "tiny")\n'
      "def get_config(preset=None):\n  pass\n")
  (tmp_path / "helper.py").write_text("X = 1\n")
  exps = train.list_experiments(str(tmp_path))
  assert exps == [{"name": "exp_a", "path": str(tmp_path / "exp_a.py"),
                   "summary": "Does A beat B?", "presets": ["default", "tiny"]}]
  assert "exp_a: Does A beat B?" in train.format_experiments(str(tmp_path))
