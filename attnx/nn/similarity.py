"""Similarity averaging: attention without projections, as in Alam et al.

Alam et al., "Attention in machine learning: how to explain the empirical formula": each
object is replaced by the average of the objects weighted by F of their similarity, which is
the attention formula with the inputs as queries, keys and values. With no projections a
global offset added to every object shifts the scores by the same amount per row (plus a
key-dependent cross term), which is what makes the choice of F visible (the shift-invariance
experiment, experiments/shift_invariance.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnx import core


class SimilarityAveraging(nn.Module):
  """The model of Alam et al. ("Attention in machine learning: how to explain the empirical
  formula"): y_i = Σ_j w_ij x_j, w_ij = F(β x_i·x_j)/Σ_l F(β x_i·x_l), then a per-object MLP
  classifier on y_i.

  No query/key projections, so a global offset g shifts every score of row i by
  β(‖g‖² + g·x_i) plus the key-dependent cross term β g·x_j — Alam et al.'s M and the part of
  the noise their argument drops. With ``score="neg_sq_dist"`` the scores are −β‖x_i − x_j‖², which
  do not see g at all. β is learned (same initialization for every F).
  """

  num_classes: int
  weighting: str = "softmax"
  score: str = "dot"
  hidden_dim: int = 32

  def setup(self):
    self.log_beta = self.param("log_beta", nn.initializers.zeros, ())
    self.hidden = nn.Dense(self.hidden_dim)
    self.out = nn.Dense(self.num_classes)

  def attention_weights(self, x: jax.Array) -> jax.Array:
    """[B, L, L] weights (row i: object i as the query)."""
    beta = jnp.exp(self.log_beta) / np.sqrt(x.shape[-1])  # starts as scaled dot product
    q = x[..., None, :]  # one head: [B, L, 1, D]
    return core.attention_weights(q, q, weighting=self.weighting, score=self.score,
                                  scale=beta)[..., 0, :, :]

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, L, num_classes] logits per object of ``x`` [B, L, D]."""
    y = jnp.einsum("bij,bjd->bid", self.attention_weights(x), x)
    return self.out(nn.relu(self.hidden(y)))
