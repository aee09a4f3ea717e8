"""attnx.data.icl_regression: targets w·x, token layout, the least-squares baseline."""

import numpy as np

import attnx.data as D


def test_icl_regression_targets_are_w_dot_x():
  data = D.make_icl_regression(20, seed=0, dim=4, num_points=9)
  x_tokens, y_tokens = data["inputs"][:, 0::2], data["inputs"][:, 1::2]
  xs = x_tokens[..., :4]
  np.testing.assert_allclose(data["targets"], np.einsum("nkd,nd->nk", xs, data["w"]), atol=1e-5)
  np.testing.assert_array_equal(x_tokens[..., 4], 0)
  np.testing.assert_array_equal(y_tokens[..., :4], 0)
  np.testing.assert_array_equal(y_tokens[..., 4], data["targets"])
  np.testing.assert_array_equal(xs, data["xs"])
  noisy = D.make_icl_regression(20, seed=0, dim=4, num_points=9, noise_std=0.5)
  assert 0.2 < np.std(noisy["targets"] - data["targets"]) < 1.0


def test_least_squares_baseline():
  data = D.make_icl_regression(5, seed=1, dim=3, num_points=8)
  preds = D.least_squares_baseline(data["xs"], data["targets"])
  assert preds.shape == (5, 8)
  np.testing.assert_array_equal(preds[:, 0], 0)
  # With >= d noiseless points the task vector is identified exactly.
  np.testing.assert_allclose(preds[:, 3:], data["targets"][:, 3:], atol=1e-4)
  assert np.abs(preds[:, 1] - data["targets"][:, 1]).max() > 1e-2
  # Minimum-norm solution from one point: w_hat = x1 y1 / |x1|^2.
  x1, y1, x2 = data["xs"][:, 0], data["targets"][:, 0], data["xs"][:, 1]
  w_hat = x1 * (y1 / (x1 * x1).sum(-1))[:, None]
  np.testing.assert_allclose(preds[:, 1], (x2 * w_hat).sum(-1), rtol=1e-4, atol=1e-5)


def test_nearest_neighbours_and_baselines_against_brute_force():
  from attnx.data.icl_regression import baseline_errors, nearest_neighbours_baseline

  rng = np.random.default_rng(0)
  xs, ys = rng.normal(size=(4, 9, 3)), rng.normal(size=(4, 9))
  got = nearest_neighbours_baseline(xs, ys, 3)
  for n in range(4):
    assert got[n, 0] == 0
    for i in range(1, 9):
      d = [np.sum((xs[n, j] - xs[n, i]) ** 2) for j in range(i)]
      near = sorted(range(i), key=lambda j: d[j])[:3]
      np.testing.assert_allclose(got[n, i], np.mean([ys[n, j] for j in near]))
  data = D.make_icl_regression(200, seed=1, dim=3, num_points=9)
  base = baseline_errors(data["inputs"], data["targets"])
  np.testing.assert_allclose(base["zero"], (data["targets"] ** 2).mean(0) / 3, rtol=1e-5)
  assert base["least squares"][-1] < 1e-8 and base["least squares"][1] > 0.3
  assert base["3-nearest neighbours"][-1] > base["least squares"][-1] + 0.1
