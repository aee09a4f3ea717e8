"""attnx.data.noisy_clusters: class centers, shared global noise, the dot-product shift."""

import numpy as np
import pytest

import attnx.data as D


def test_noisy_clusters_structure():
  params = dict(num_classes=5, dim=6, num_objects=10, classes_per_sample=3)
  clean = D.make_noisy_clusters(
    30, seed=0, within_class_spread=0.0, local_noise=0.0, global_noise=0.0, **params
  )
  centers = D.class_centers(5, 6, center_seed=0)
  np.testing.assert_allclose(clean["inputs"], centers[clean["targets"]], atol=1e-6)
  assert max(len(np.unique(t)) for t in clean["targets"]) <= 3
  # Varying global_noise (same seed) adds one shared vector to every object of a sample.
  a = D.make_noisy_clusters(30, seed=1, global_noise=0.5, **params)
  b = D.make_noisy_clusters(30, seed=1, global_noise=3.0, **params)
  np.testing.assert_array_equal(a["targets"], b["targets"])
  diff = b["inputs"] - a["inputs"]
  np.testing.assert_allclose(diff, np.broadcast_to(diff[:, :1], diff.shape), atol=1e-5)
  np.testing.assert_allclose(diff[:, 0], b["global_offset"] - a["global_offset"], atol=1e-5)
  # Pairwise dot products shift by about M = global_noise^2 * dim.
  big = D.make_noisy_clusters(400, seed=2, global_noise=2.0, **params)
  small = D.make_noisy_clusters(400, seed=2, global_noise=0.0, **params)
  dots = lambda x: np.einsum("nid,njd->nij", x, x)
  shift = (dots(big["inputs"]) - dots(small["inputs"])).mean()
  assert abs(shift - 4.0 * 6) < 3.0
  with pytest.raises(ValueError, match="unknown_param"):
    D.make_noisy_clusters(2, seed=0, unknown_param=1)
