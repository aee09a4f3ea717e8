"""attnx.data.nw_regression: the true function and the noisy sample."""

import numpy as np

import attnx.data as D


def test_nw_regression_truth_and_sample(data_dir):
  test = D.load_arrays("nw_regression", "test", data_dir=data_dir)
  x = test["inputs"][:, 0].astype(np.float64)
  np.testing.assert_allclose(x, np.linspace(0, 4, 41), atol=1e-6)
  np.testing.assert_allclose(test["targets"], 2 * np.sin(x) + x, atol=1e-5)
  train = D.load_arrays("nw_regression", "train", data_dir=data_dir)
  xt = train["inputs"][:, 0]
  assert len(xt) == 100 and (np.diff(xt) >= 0).all() and xt.min() >= 0 and xt.max() <= 4
  resid = train["targets"] - (2 * np.sin(xt) + xt)
  assert 0.7 < resid.std() < 1.3
  raw = D.make_nw_regression(100, seed=0)
  np.testing.assert_allclose(raw["x_train"], xt)
  np.testing.assert_allclose(raw["y_test"], test["targets"])
