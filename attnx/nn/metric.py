"""Metric attention: attention over a learned pseudo-metric (seed 003, arXiv 2412.18288).

Ruan & Zhang decompose attention into a learnable pseudo-metric and a similarity-based
propagation, and propose "metric-attention". Their exact parametrization is not public, so
this module implements the principled version of the idea, not a reproduction: per head h a
learned linear map L_h (shared by queries and keys) defines the Mahalanobis pseudo-metric

    d_h(x_i, x_j)² = ‖L_h (x_i − x_j)‖²,   s_ij = −τ_h · d_h(x_i, x_j)²,

which is symmetric, non-negative and satisfies the triangle inequality by construction (a
pseudo-metric: L_h may have a kernel). τ_h > 0 is an optional learned temperature. Weights
are w_ij = F(s_ij)/Σ_l F(s_il) for any weighting F (softmax gives a Gaussian kernel).
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx import core
from attnx.nn import _util

Array = jax.Array


class MetricAttention(nn.Module):
  """Multi-head attention with score −τ_h‖L_h(x_i − x_j)‖² and any weighting F.

  Attributes:
    num_heads: heads N.
    qkv_features: value width (default: input features), divisible by N.
    out_features: output width (default: input features).
    rank: rank R of each L_h (default qkv_features // N).
    weighting: F (any ``core.get_weighting`` spec). Scores are ≤ 0 here, so weightings that
      vanish there (``relu``, ``relu2``, ``power``, ``softpick``) give all-zero weights;
      exp-like weightings, the simplex projections and the distance kernels are meaningful.
    learn_temperature: learn τ_h = exp(log_tau_h) per head (init τ = 1/√R, the scaled-dot
      analogue). Otherwise τ = 1/√R fixed.
    implementation: passed to ``core.attention``.
    is_causal, dropout_rate, use_bias, sow_weights, dtype, param_dtype, kernel_init: as in
      :class:`attnx.nn.MultiHeadAttention`.
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  rank: int | None = None
  weighting: Any = "softmax"
  learn_temperature: bool = True
  implementation: str | None = None
  is_causal: bool = False
  dropout_rate: float = 0.0
  use_bias: bool = True
  sow_weights: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.linear.default_kernel_init

  def __post_init__(self):
    where = type(self).__name__
    _util.validate_attention_config(self.weighting, "neg_sq_dist", self.implementation, where)
    _util.check_heads(self.qkv_features or self.num_heads, self.num_heads, None, where)
    _util.check_dropout_rate(self.dropout_rate, where)
    if self.rank is not None and self.rank <= 0:
      raise ValueError(f"{where}: rank must be positive, got {self.rank}.")
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
               mask: Array | None = None, bias: Array | None = None,
               deterministic: bool = True,
               return_weights: bool = False) -> Array | tuple[Array, Array]:
    """``inputs_q [B..., T, D]``, ``inputs_kv [B..., S, D]`` (same D: one metric space).

    Returns ``[B..., T, out_features]`` (and weights ``[B..., N, T, S]`` if requested).
    """
    if inputs_kv is None:
      inputs_kv = inputs_q
    chex.assert_rank(inputs_q, inputs_kv.ndim)
    chex.assert_equal_shape_prefix([inputs_q, inputs_kv], inputs_q.ndim - 2)
    if inputs_q.shape[-1] != inputs_kv.shape[-1]:
      raise ValueError("MetricAttention compares queries and keys in one space: inputs_q "
                       f"{inputs_q.shape} and inputs_kv {inputs_kv.shape} need equal features.")
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    _util.check_heads(qkv_features, self.num_heads, None, type(self).__name__)
    head_dim = qkv_features // self.num_heads
    rank = self.rank or head_dim
    # L shared by queries and keys; no bias (it cancels in x_i − x_j).
    metric = nn.DenseGeneral(features=(self.num_heads, rank), use_bias=False, dtype=self.dtype,
                             param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                             name="metric")
    zq, zk = metric(inputs_q), metric(inputs_kv)  # [B..., T|S, N, R]
    init_log_tau = -0.5 * jnp.log(float(rank))
    if self.learn_temperature:
      log_tau = self.param("log_temperature", nn.initializers.constant(init_log_tau),
                           (self.num_heads,), self.param_dtype)
    else:
      log_tau = jnp.full((self.num_heads,), init_log_tau)
    # −τ‖L(x_i − x_j)‖² = −‖√τ L(x_i − x_j)‖²: fold the per-head τ into the features so
    # every implementation (including blocked) sees a plain neg_sq_dist score.
    root = jnp.exp(0.5 * log_tau)[:, None].astype(zq.dtype)
    zq, zk = zq * root, zk * root
    value = nn.DenseGeneral(features=(self.num_heads, head_dim), use_bias=self.use_bias,
                            dtype=self.dtype, param_dtype=self.param_dtype,
                            kernel_init=self.kernel_init, name="value")(inputs_kv)
    mask = _util.as_bool_mask(mask)
    common = dict(weighting=self.weighting, score="neg_sq_dist", is_causal=self.is_causal)
    dropout = self.dropout_rate > 0.0 and not deterministic
    w = None
    if dropout or return_weights or self.sow_weights:
      w = core.attention_weights(zq, zk, bias, mask, **common)
      if return_weights or self.sow_weights:
        self.sow("intermediates", "attention_weights", w)
      w_used = (_util.dropout_weights(w, self.make_rng("dropout"), self.dropout_rate, True,
                                      zk.ndim) if dropout else w)
      x = _util.weighted_values(w_used, value, value.dtype)
    else:
      x = core.attention(zq, zk, value, bias, mask, implementation=self.implementation, **common)
    out = nn.DenseGeneral(features=features, axis=(-2, -1), use_bias=self.use_bias,
                          dtype=self.dtype, param_dtype=self.param_dtype,
                          kernel_init=self.kernel_init, name="out")(x)
    return (out, w) if return_weights else out
