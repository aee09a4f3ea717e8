"""Nadaraya-Watson regression against a brute-force numpy computation.

Data and kernels as in the lecture slides on attention mechanisms cited in the README.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core

RNG = np.random.default_rng(0)
XT = np.sort(RNG.uniform(0, 4, 30)).astype(np.float32)
YT = (2 * np.sin(XT) + XT + RNG.normal(size=30)).astype(np.float32)
XQ = np.linspace(0, 4, 17).astype(np.float32)

KERNELS = {
    "gaussian": lambda d, h: np.exp(-(d**2) / (2 * h * h)),
    "boxcar": lambda d, h: (d <= h).astype(float),
    "triangular": lambda d, h: np.maximum(0, 1 - d / h),
    "epanechnikov": lambda d, h: 0.75 * np.maximum(0, 1 - (d / h) ** 2),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("h", [0.3, 1.0])
def test_matches_brute_force(kernel, h):
  pred = core.nadaraya_watson(XQ, XT, YT, kernel=kernel, bandwidth=h)
  d = np.abs(XQ[:, None].astype(np.float64) - XT[None, :])
  k = KERNELS[kernel](d, h)
  denom = k.sum(1)
  ref = np.where(denom > 0, (k @ YT) / np.where(denom > 0, denom, 1), 0)
  np.testing.assert_allclose(pred, ref, rtol=1e-4, atol=1e-5)


def test_multivariate_and_learned_bandwidth_gradient():
  xt = RNG.normal(size=(20, 3)).astype(np.float32)
  yt = RNG.normal(size=(20, 2)).astype(np.float32)
  pred, w = core.nadaraya_watson(xt[:4], xt, yt, bandwidth=0.7, return_weights=True)
  assert pred.shape == (4, 2) and w.shape == (4, 20)
  np.testing.assert_allclose(w.sum(1), 1, rtol=1e-5)
  loss = lambda h: jnp.mean((core.nadaraya_watson(XQ, XT, YT, bandwidth=h) - XQ) ** 2)
  g = jax.grad(loss)(jnp.float32(0.5))
  assert np.isfinite(g) and g != 0
  np.testing.assert_allclose(loss(jnp.float32(0.5)), loss(0.5), rtol=1e-5)


def test_bad_shapes():
  with pytest.raises(ValueError, match="different lengths"):
    core.nadaraya_watson(XQ, XT, YT[:5])
  with pytest.raises(ValueError, match="feature dims"):
    core.nadaraya_watson(np.zeros((3, 2)), np.zeros((4, 3)), np.zeros(4))
