"""experiments/icl_regression.py: the claim against least squares, and the tiny preset."""

import json
import os
import sys

import numpy as np
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import icl_regression as exp  # noqa: E402


def test_match_from_defaults_to_d_plus_2():
  c = exp.get_config("tiny")
  assert exp.match_from(c) == c.data.dim + 2
  c.match_from = 1
  assert exp.match_from(c) == 1


def test_claim_tracks_least_squares():
  k = np.arange(10)
  ls = np.where(k < 5, 1.0 - k / 5, 0.0)  # least squares: 0 from k = d = 5 on
  close = np.stack([ls + 0.01, ls + 0.012])
  claim, text, outcomes = exp.tracks_least_squares({"softmax": close}, ls, 7, 0.05)
  assert claim.held is True and outcomes["softmax"] == "within noise" and "falls" in text
  far = np.stack([ls + 0.5, ls + 0.52])
  assert exp.tracks_least_squares({"softmax": far}, ls, 7, 0.05)[0].held is False
  flat = np.full((2, 10), 0.01)  # close to least squares at the end but never falls
  assert exp.tracks_least_squares({"softmax": flat}, ls, 7, 0.05)[0].held is False
  untested = exp.tracks_least_squares({"relu": close}, ls, 7, 0.05)[0]
  assert untested.held is None and not untested.tested


@legs.experiment_run
def test_tiny_preset_end_to_end(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  c = exp.get_config("tiny")
  c.progress = False
  out = exp.run(c, str(tmp_path / "wd"))
  fin = out["finish"]
  assert np.asarray(fin["curves"]["softmax"]).shape == (2, c.data.num_points)
  assert set(fin["baselines"]) == {"least squares", "3-nearest neighbours", "zero"}
  assert fin["baselines"]["least squares"][-1] < 1e-6  # noiseless, k - 1 = 7 ≥ d = 3
  assert os.path.exists(tmp_path / "wd" / "icl_regression_vs_least_squares.png")
  assert json.load(open(tmp_path / "wd" / "results.json"))["verdicts"]
