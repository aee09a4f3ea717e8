"""Bahdanau (additive) and Luong (dot / general / concat) attention with any weighting F.

Attention of a query sequence over a memory (e.g. encoder states), as used in RNN
encoder-decoders (Wikipedia, "Attention (machine learning)"; Martínez-Ramón, Ajith & Kurup's
slides, eq. 12), single-head as in the papers. Scores are
``attnx.core``'s ``additive``, ``bilinear`` and ``dot`` scores, and weights, dropout and the
weighted values ``core.attention``'s, so softmax can be swapped for any weighting by name. These
scores are similarities, so the distance kernels (``gaussian``, ``boxcar``, ...) are rejected at
construction. Both modules are called like every ``attnx.nn`` attention module (same mask
convention, ``[B..., N, T, S]`` weights), and ``AdditiveAttention`` can be the attention of a
transformer block.
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


def _attend(module: nn.Module, query: Array, keys: Array | None, values: Array | None, *,
            mask: Array | None, bias: Array | None, deterministic: bool, decode: bool,
            return_weights: bool, score: str, score_params: dict[str, Array] | None,
            scale: float | None, num_heads: int = 1, is_causal: bool = False):
  """Shared body: [B..., (T,) Dq] over [B..., S, Dk] -> [B..., (T,) Dv] (+ weights).

  Each of the ``num_heads`` heads scores the whole query and key vectors (its own score
  parameters) and averages its slice of the value features; with one head this is the
  single-head attention of the papers. Weights are ``[B..., N, T, S]`` (``[B..., N, S]`` for a
  single query), before dropout, as :class:`attnx.nn.MultiHeadAttention` returns them.
  """
  where = type(module).__name__
  _util.check_no_decode(decode, where)
  keys = query if keys is None else keys
  values = keys if values is None else values
  chex.assert_rank(values, keys.ndim)
  chex.assert_equal_shape_prefix([keys, values], keys.ndim - 1)
  single = query.ndim == keys.ndim - 1
  if not single and query.ndim != keys.ndim:
    raise ValueError(f"{where}: query must be [B..., T, Dq] or [B..., Dq] for keys "
                     f"[B..., S, Dk]; got query {query.shape}, keys {keys.shape}.")
  if values.shape[-1] % num_heads:
    raise ValueError(f"{where}: value features {values.shape[-1]} are not divisible by "
                     f"num_heads={num_heads}.")
  q = query[..., None, :] if single else query
  chex.assert_equal_shape_prefix([q, keys], keys.ndim - 2)
  # [B..., T, N, D] layout of core.attention: every head sees the whole query and key vectors.
  heads = lambda x: jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], num_heads, x.shape[-1]))
  q4, k4 = heads(q), heads(keys)
  v4 = values.reshape(*values.shape[:-1], num_heads, values.shape[-1] // num_heads)
  dropout = module.dropout_rate > 0.0 and not deterministic
  out = core.attention(
      q4, k4, v4.astype(q4.dtype), bias, _util.as_bool_mask(mask), weighting=module.weighting,
      score=score, score_params=score_params, scale=scale, is_causal=is_causal,
      implementation="dense", dropout_rate=module.dropout_rate,
      dropout_rng=module.make_rng("dropout") if dropout else None, deterministic=deterministic,
      # An independent mask per weight: few heads and (in RNNs) a single step per call.
      broadcast_dropout=False, return_weights=return_weights)
  out, w = out if return_weights else (out, None)
  out = out.reshape(*out.shape[:-2], -1)  # heads back to features: [B..., T, Dv]
  if single:
    out = out[..., 0, :]
    w = None if w is None else w[..., 0, :]
  return (out, w) if return_weights else out


class AdditiveAttention(nn.Module, kw_only=True):
  """Bahdanau attention: s(q, k) = vᵀ tanh(W_q q + W_k k), weights F(s)/ΣF(s).

  The slides of Martínez-Ramón, Ajith & Kurup, eq. 12.

  Called like every ``attnx.nn`` attention module — ``(inputs_q, inputs_kv=None, *, mask,
  bias, deterministic, decode, return_weights)`` with ``mask`` broadcastable to
  ``[B..., N, T, S]`` — so it also serves as the attention of a transformer block (attention
  type ``"additive"``), without projections: the context is a weighted average of the values.

  Attributes:
    num_heads: N. One head (the default) is Bahdanau's: params ``query_kernel`` [Dq, A],
      ``key_kernel`` [Dk, A], ``score_v`` [A]. With N > 1 each head has its own
      ``query_kernel``/``key_kernel`` ([N, Dq, A], [N, Dk, A]; ``score_v`` is shared, as in
      ``MultiHeadAttention(score="additive")``), scores the whole query and key vectors and
      averages its slice of the value features (Dv must be divisible by N).
    attention_dim: hidden width A of the score MLP (default: key features).
    weighting: F (any ``core.get_weighting`` spec of a similarity; not a distance kernel).
    is_causal: query i attends keys j ≤ i (self-attention in a decoder).
    dropout_rate: dropout on the attention weights (``deterministic=False``, ``"dropout"``
      RNG), an independent mask per weight; in [0, 1).
    dtype, param_dtype: as in flax.
  """

  num_heads: int = 1
  attention_dim: int | None = None
  weighting: Any = "softmax"
  is_causal: bool = False
  dropout_rate: float = 0.0
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    where = type(self).__name__
    _util.validate_attention_config(self.weighting, "additive", None, where)
    _util.check_dropout_rate(self.dropout_rate, where)
    if self.num_heads <= 0:
      raise ValueError(f"{where}: num_heads must be positive, got {self.num_heads}.")
    super().__post_init__()

  @nn.compact
  def __call__(self, query: Array, keys: Array | None = None, values: Array | None = None, *,
               mask: Array | None = None, bias: Array | None = None,
               deterministic: bool = True, decode: bool = False,
               return_weights: bool = False):
    """Attends ``query [B..., T, Dq]`` (or one step ``[B..., Dq]``) over ``keys [B..., S, Dk]``.

    Args:
      query: ``[B..., T, Dq]`` or ``[B..., Dq]``.
      keys: ``[B..., S, Dk]`` (default ``query``: self-attention).
      values: ``[B..., S, Dv]`` (default ``keys``).
      mask: boolean (or 0/1 float), True = attend, broadcastable to ``[B..., N, T, S]`` (T = 1
        for a single query): the mask of every ``attnx.nn`` attention module, e.g. key
        padding ``valid[:, None, None, :]``.
      bias: additive score bias broadcastable to ``[B..., N, T, S]``.
      deterministic: disables dropout on the weights.
      decode: not supported (no KV cache); accepted only to raise a clear error.
      return_weights: also return the weights ``[B..., N, T, S]`` (``[B..., N, S]`` for a
        single query), before dropout.

    Returns:
      context ``[B..., T, Dv]`` (or ``[B..., Dv]``), and the weights if requested.
    """
    keys = query if keys is None else keys
    a = self.attention_dim or keys.shape[-1]
    init = nn.initializers.lecun_normal()
    lead = () if self.num_heads == 1 else (self.num_heads,)  # shared [D, A] or per-head
    params = {
        "Wq": self.param("query_kernel", init, (*lead, query.shape[-1], a), self.param_dtype),
        "Wk": self.param("key_kernel", init, (*lead, keys.shape[-1], a), self.param_dtype),
        "v": self.param("score_v", nn.initializers.normal(a ** -0.5), (a,), self.param_dtype),
    }
    if self.dtype is not None:
      query, keys = query.astype(self.dtype), keys.astype(self.dtype)
      params = {k: v.astype(self.dtype) for k, v in params.items()}
    return _attend(self, query, keys, values, mask=mask, bias=bias, deterministic=deterministic,
                   decode=decode, return_weights=return_weights, score="additive",
                   score_params=params, scale=None, num_heads=self.num_heads,
                   is_causal=self.is_causal)


class LuongAttention(nn.Module, kw_only=True):
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
  def __call__(self, query: Array, keys: Array | None = None, values: Array | None = None, *,
               mask: Array | None = None, bias: Array | None = None,
               deterministic: bool = True, decode: bool = False,
               return_weights: bool = False):
    """Same arguments and shapes as :meth:`AdditiveAttention.__call__` (one head)."""
    keys = query if keys is None else keys
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
    return _attend(self, query, keys, values, mask=mask, bias=bias, deterministic=deterministic,
                   decode=decode, return_weights=return_weights,
                   score=LUONG_CORE_SCORES[self.score], score_params=params, scale=self.scale)
