"""Bahdanau (additive) and Luong (dot / general / concat) attention with any weighting F.

Single-head attention of a query sequence over a memory (e.g. encoder states), as used in RNN
encoder-decoders (seed 001; seed 004 eq. 12). Scores come from ``attnx.core``'s ``additive``,
``bilinear`` and ``dot`` scores and weights from ``core.attention``/``core.attention_weights``,
so softmax can be swapped for any weighting by name. These scores are similarities, so the
distance kernels (``gaussian``, ``boxcar``, ...) are rejected at construction.
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

LUONG_SCORES = ("dot", "general", "concat")
# The attnx.core score each Luong score is.
LUONG_CORE_SCORES = {"dot": "dot", "general": "bilinear", "concat": "additive"}


def _attend(module: nn.Module, query: Array, keys: Array, values: Array | None,
            mask: Array | None, return_weights: bool, deterministic: bool, score: str,
            score_params: dict[str, Array] | None, scale: float | None):
  """Shared body: [B..., (T,) Dq] over [B..., S, Dk] -> [B..., (T,) Dv] (+ weights).

  Returned weights are before dropout (as :class:`attnx.nn.MultiHeadAttention`).
  """
  values = keys if values is None else values
  chex.assert_rank(values, keys.ndim)
  chex.assert_equal_shape_prefix([keys, values], keys.ndim - 1)
  single = query.ndim == keys.ndim - 1
  if not single and query.ndim != keys.ndim:
    raise ValueError(f"{type(module).__name__}: query must be [B..., T, Dq] or [B..., Dq] for "
                     f"keys [B..., S, Dk]; got query {query.shape}, keys {keys.shape}.")
  q = query[..., None, :] if single else query
  chex.assert_equal_shape_prefix([q, keys], keys.ndim - 2)
  mask = _util.as_bool_mask(mask)
  if mask is not None:
    # [B..., (T,) S] -> [B..., 1(head), T, S]
    mask = mask[..., None, :] if single else mask
    mask = mask[..., None, :, :]
  # One head: [B..., T, 1, D] layout of core.attention.
  q4, k4, v4 = q[..., None, :], keys[..., None, :], values[..., None, :]
  kw = dict(weighting=module.weighting, score=score, score_params=score_params, scale=scale,
            mask=mask)
  dropout = module.dropout_rate > 0.0 and not deterministic
  if return_weights or dropout:
    w = core.attention_weights(q4, k4, **kw)  # [B..., 1, T, S]
    # Independent mask per weight: a single head and (in RNNs) a single step per call.
    w_used = (_util.dropout_weights(w, module.make_rng("dropout"), module.dropout_rate, False,
                                    w.ndim) if dropout else w)
    out = _util.weighted_values(w_used, v4, jnp.result_type(q.dtype, values.dtype))[..., 0, :]
    w = w[..., 0, :, :]  # [B..., T, S]
  else:
    w = None
    out = core.attention(q4, k4, v4.astype(q4.dtype), implementation="dense", **kw)[..., 0, :]
  if single:
    out = out[..., 0, :]
    w = None if w is None else w[..., 0, :]
  return (out, w) if return_weights else out


class AdditiveAttention(nn.Module):
  """Bahdanau attention: s(q, k) = vᵀ tanh(W_q q + W_k k) (seed 004 eq. 12), weights F(s)/ΣF(s).

  Attributes:
    attention_dim: hidden width A of the score MLP (default: key features).
    weighting: F (any ``core.get_weighting`` spec of a similarity; not a distance kernel).
    dtype, param_dtype: as in flax.
    dropout_rate: dropout on the attention weights (``deterministic=False``, ``"dropout"``
      RNG), an independent mask per weight; in [0, 1).
  """

  attention_dim: int | None = None
  weighting: Any = "softmax"
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dropout_rate: float = 0.0

  def __post_init__(self):
    where = type(self).__name__
    _util.validate_attention_config(self.weighting, "additive", None, where)
    _util.check_dropout_rate(self.dropout_rate, where)
    super().__post_init__()

  @nn.compact
  def __call__(self, query: Array, keys: Array, values: Array | None = None, *,
               mask: Array | None = None, return_weights: bool = False,
               deterministic: bool = True):
    """Attends ``query [B..., T, Dq]`` (or one step ``[B..., Dq]``) over ``keys [B..., S, Dk]``.

    Args:
      query: ``[B..., T, Dq]`` or ``[B..., Dq]``.
      keys: ``[B..., S, Dk]``.
      values: ``[B..., S, Dv]`` (default ``keys``).
      mask: boolean broadcastable to ``[B..., T, S]`` (``[B..., S]`` for a single query).
      return_weights: also return the weights ``[B..., T, S]`` (or ``[B..., S]``), before
        dropout.
      deterministic: disables dropout on the weights.

    Returns:
      context ``[B..., T, Dv]`` (or ``[B..., Dv]``), and the weights if requested.
    """
    a = self.attention_dim or keys.shape[-1]
    init = nn.initializers.lecun_normal()
    params = {
        "Wq": self.param("query_kernel", init, (query.shape[-1], a), self.param_dtype),
        "Wk": self.param("key_kernel", init, (keys.shape[-1], a), self.param_dtype),
        "v": self.param("score_v", nn.initializers.normal(a ** -0.5), (a,), self.param_dtype),
    }
    if self.dtype is not None:
      query, keys = query.astype(self.dtype), keys.astype(self.dtype)
      params = {k: v.astype(self.dtype) for k, v in params.items()}
    return _attend(self, query, keys, values, mask, return_weights, deterministic, "additive",
                   params, None)


class LuongAttention(nn.Module):
  """Luong attention (Luong et al. 2015) with any weighting F.

  ``score="dot"``: s = qᵀk (needs Dq == Dk); ``"general"``: s = qᵀ W k (``core`` bilinear);
  ``"concat"``: s = vᵀ tanh(W [q; k]) = vᵀ tanh(W_q q + W_k k) (``core`` additive).

  Attributes:
    score: ``"dot"``, ``"general"`` or ``"concat"``.
    attention_dim: hidden width of ``concat`` (default: key features).
    weighting: F (any ``core.get_weighting`` spec of a similarity; not a distance kernel).
    scale: optional score multiplier (default 1, as in the paper).
    dtype, param_dtype: as in flax.
    dropout_rate: dropout on the attention weights, as in :class:`AdditiveAttention`.
  """

  score: str = "general"
  attention_dim: int | None = None
  weighting: Any = "softmax"
  scale: float | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dropout_rate: float = 0.0

  def __post_init__(self):
    where = type(self).__name__
    if self.score not in LUONG_SCORES:
      raise ValueError(f"{where}: unknown Luong score {self.score!r}; valid: "
                       f"{', '.join(LUONG_SCORES)}.")
    _util.validate_attention_config(self.weighting, LUONG_CORE_SCORES[self.score], None, where)
    _util.check_dropout_rate(self.dropout_rate, where)
    super().__post_init__()

  @nn.compact
  def __call__(self, query: Array, keys: Array, values: Array | None = None, *,
               mask: Array | None = None, return_weights: bool = False,
               deterministic: bool = True):
    """Same arguments and shapes as :meth:`AdditiveAttention.__call__`."""
    dq, dk = query.shape[-1], keys.shape[-1]
    if self.score == "dot":
      if dq != dk:
        raise ValueError(f"LuongAttention(score='dot') needs equal query/key features; got "
                         f"query {query.shape}, keys {keys.shape}. Use 'general'.")
      params = None
    elif self.score == "general":
      init = ((lambda k, s, d: jnp.eye(dq, dtype=d)) if dq == dk  # start as the dot score
              else nn.initializers.lecun_normal())
      params = {"W": self.param("general_kernel", init, (dq, dk), self.param_dtype)}
    else:
      a = self.attention_dim or dk
      init = nn.initializers.lecun_normal()
      params = {
          "Wq": self.param("query_kernel", init, (dq, a), self.param_dtype),
          "Wk": self.param("key_kernel", init, (dk, a), self.param_dtype),
          "v": self.param("score_v", nn.initializers.normal(a ** -0.5), (a,), self.param_dtype),
      }
    if self.dtype is not None:
      query, keys = query.astype(self.dtype), keys.astype(self.dtype)
      params = None if params is None else {k: v.astype(self.dtype) for k, v in params.items()}
    return _attend(self, query, keys, values, mask, return_weights, deterministic,
                   LUONG_CORE_SCORES[self.score], params, self.scale)
