"""nadaraya_watson: tiny preset end to end; the Gaussian fit beats the constant predictor."""

import json
import os
import sys

import numpy as np
import pytest
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import nadaraya_watson as exp  # noqa: E402


def test_dataset_matches_the_slides(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path))
  c = exp.get_config("tiny")
  x, y = exp.load(c, "train", 0)
  assert x.shape == (100,) and np.all(np.diff(x) >= 0) and 0 <= x.min() and x.max() <= 4
  # Residuals are the unit-variance noise around 2 sin x + x.
  assert 0.7 < np.std(y - (2 * np.sin(x) + x)) < 1.3
  x1, _ = exp.load(c, "train", 1)
  assert not np.allclose(x, x1)  # independent training sets
  grid, f = exp.load(c, "test")
  np.testing.assert_allclose(grid, np.linspace(0, c.x_max, c.num_test), rtol=1e-6)
  np.testing.assert_allclose(f, 2 * np.sin(grid) + grid, rtol=1e-5)


def test_bad_kernel_is_rejected():
  c = exp.get_config("tiny")
  c.kernels = ("gaussian", "cosine")
  with pytest.raises(ValueError, match="kernels.*epanechnikov"):
    exp.validate_config(c)


@legs.experiment_run
def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  mse = {k: float(np.mean(v)) for k, v in out["mse"].items()}
  assert mse["gaussian h=1"] < mse["constant mean"]
  assert mse["gaussian, learned h"] < mse["constant mean"]
  assert 0.05 < np.mean(out["learned_bandwidth"]) < 1.0
  results = json.loads((tmp_path / "results.json").read_text())
  predictors = [r["predictor"] for r in results["tables"][0]["rows"]]
  assert "constant mean" in predictors
  assert any("Epanechnikov (textbook)" in p for p in predictors)
  assert any("triangular" in p for p in predictors)
  for fig in ("fits_kernels.png", "fits_gaussian_widths.png", "attention_weights.png"):
    assert (tmp_path / fig).exists()
