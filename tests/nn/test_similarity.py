"""attnx.nn.SimilarityAveraging: shapes, weights that are rows of a distribution, and a
distance score that does not see a global offset."""

import jax
import jax.numpy as jnp
import numpy as np

from attnx import nn


def test_logits_and_weights():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 4))
  model = nn.SimilarityAveraging(num_classes=3, weighting="softmax", hidden_dim=8)
  params = model.init(jax.random.PRNGKey(1), x)
  assert model.apply(params, x).shape == (2, 5, 3)
  w = model.apply(params, x, method="attention_weights")
  assert w.shape == (2, 5, 5)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_distance_score_ignores_a_global_offset():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 4))
  g = jnp.ones((2, 1, 4)) * 3.0
  for score, same in (("neg_sq_dist", True), ("dot", False)):
    model = nn.SimilarityAveraging(num_classes=3, weighting="softmax", score=score)
    params = model.init(jax.random.PRNGKey(1), x)
    w0, w1 = (model.apply(params, y, method="attention_weights") for y in (x, x + g))
    assert np.allclose(w0, w1, atol=1e-5) is same
