"""Pre-LN transformer blocks whose attention is chosen by an attention dict (see ``spec.py``).

Masks: ``mask`` is a general boolean mask broadcastable to ``[B, N, T, S]`` and ``key_mask`` a
``[B, S]`` key padding mask (True = real token); the block combines them into one mask of the
``attnx.nn`` convention and calls its attention module — any of them, the same way. Keep
padding in ``key_mask``: linear attention can only express key padding and causality, so it
raises for a ``mask`` that varies over queries or heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnx.nn.attention import MultiHeadAttention
from attnx.nn.spec import freeze_attention_fields, make_attention

Array = jax.Array


def combine_masks(mask: Array | None, key_mask: Array | None) -> Array | None:
  """General mask [B.., N|1, T, S] and key padding [B, S] -> one boolean mask (or None)."""
  if key_mask is None:
    return None if mask is None else jnp.asarray(mask).astype(bool)
  km = jnp.asarray(key_mask).astype(bool)[:, None, None, :]
  return km if mask is None else jnp.logical_and(jnp.asarray(mask).astype(bool), km)


def call_attention(attn: nn.Module, x: Array, kv: Array | None, *, mask: Array | None,
                   key_mask: Array | None, deterministic: bool, decode: bool = False,
                   segment_ids: Any = None, positions: Array | None = None) -> Array:
  """Calls any attention module built by ``make_attention``: one call, one mask convention.

  Every ``attnx.nn`` attention module takes ``(inputs_q, inputs_kv, *, mask, deterministic,
  decode)`` with ``mask`` broadcastable to ``[B, N, T, S]``; a module raises for what it cannot
  do (a general mask in linear attention, ``decode`` without a KV cache). Packed documents
  (``segment_ids``) and their ``positions`` go to the modules with query/key projections
  (:class:`~attnx.nn.MultiHeadAttention` and its metric form); a ValueError for the others.
  """
  extra = {name: x for name, x in (("segment_ids", segment_ids), ("positions", positions))
           if x is not None}
  if extra and not isinstance(attn, MultiHeadAttention):
    raise ValueError(f"{', '.join(extra)} need an attention of type 'dot' or 'metric' "
                     f"(MultiHeadAttention), not {type(attn).__name__}.")
  return attn(x, kv, mask=combine_masks(mask, key_mask), deterministic=deterministic,
              decode=decode, **extra)


class MlpBlock(nn.Module, kw_only=True):
  """Dense(mlp_dim) → GELU → dropout → Dense(out_dim or input) → dropout. [..., D] -> [..., D']."""

  mlp_dim: int
  out_dim: int | None = None
  dropout_rate: float = 0.0
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    out_dim = self.out_dim or x.shape[-1]
    y = nn.Dense(self.mlp_dim, dtype=self.dtype, param_dtype=self.param_dtype)(x)
    y = nn.gelu(y)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = nn.Dense(out_dim, dtype=self.dtype, param_dtype=self.param_dtype)(y)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)


def sinusoidal_table(length: int, dim: int, max_scale: float = 10_000.0) -> np.ndarray:
  """Vaswani et al. 2017 table [length, dim]: sin on even, cos on odd features."""
  pos = np.arange(length)[:, None]
  div = np.exp(np.arange(0, dim, 2) * (-np.log(max_scale) / dim))
  table = np.zeros((length, dim), np.float32)
  table[:, 0::2] = np.sin(pos * div)
  table[:, 1::2] = np.cos(pos * div)[:, : dim // 2]
  return table


class SinusoidalPositionEmbedding(nn.Module, kw_only=True):
  """Adds fixed sinusoidal position embeddings: ``[B, L, D] -> [B, L, D]`` (L ≤ max_len)."""

  max_len: int = 2048

  @nn.compact
  def __call__(self, x: Array) -> Array:
    chex.assert_rank(x, 3)
    if x.shape[1] > self.max_len:
      raise ValueError(f"sequence length {x.shape[1]} exceeds max_len={self.max_len} "
                       f"(input {x.shape}).")
    table = sinusoidal_table(x.shape[1], x.shape[-1])
    return x + jnp.asarray(table, x.dtype)[None]


class LearnedPositionEmbedding(nn.Module, kw_only=True):
  """Adds a learned ``pos_embedding [max_len, D]`` (init N(0, 0.02²)): [B, L, D] -> [B, L, D]."""

  max_len: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    chex.assert_rank(x, 3)
    if x.shape[1] > self.max_len:
      raise ValueError(f"sequence length {x.shape[1]} exceeds max_len={self.max_len} "
                       f"(input {x.shape}).")
    table = self.param("pos_embedding", nn.initializers.normal(0.02),
                       (self.max_len, x.shape[-1]), self.param_dtype)
    return x + table[: x.shape[1]].astype(x.dtype)[None]


def position_embedding(kind: str, max_len: int, param_dtype: Any = jnp.float32,
                       name: str | None = None) -> nn.Module | None:
  """``"learned"`` | ``"sinusoidal"`` | ``"none"`` -> module (or None)."""
  if kind == "learned":
    return LearnedPositionEmbedding(max_len=max_len, param_dtype=param_dtype, name=name)
  if kind == "sinusoidal":
    return SinusoidalPositionEmbedding(max_len=max_len, name=name)
  if kind == "none":
    return None
  raise ValueError(f"Unknown position embedding {kind!r}; valid: learned, sinusoidal, none.")


class EncoderBlock(nn.Module, kw_only=True):
  """Pre-LN block: x + Attn(LN(x)), then + MLP(LN(x)). ``[B, L, D] -> [B, L, D]``.

  Attributes:
    num_heads: attention heads.
    mlp_dim: hidden width of the MLP.
    dropout_rate: dropout on the residual branches.
    attention_dropout_rate: dropout on attention weights (every attention type but linear).
    attention: attention dict (``{"type": "dot", "weighting": "relu"}``; see ``spec.py``).
    is_causal: causal self-attention.
    dtype, param_dtype: as in flax.
  """

  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  is_causal: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    freeze_attention_fields(self, "attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None, key_mask: Array | None = None,
               deterministic: bool = True, decode: bool = False, segment_ids: Any = None,
               positions: Array | None = None) -> Array:
    """Self-attention and MLP over ``x [B, L, D]`` -> ``[B, L, D]``.

    Args:
      x: the block's input ``[B, L, D]``.
      mask: optional boolean mask broadcastable to ``[B, N, L, L]``; True = attend.
      key_mask: optional ``[B, L]`` key padding mask (True = real token).
      deterministic: disables dropout (the ``"dropout"`` RNG is needed otherwise).
      decode: KV-cache decoding, for attention types that have a cache.
      segment_ids: ``[B, L]`` packed documents (attention stays within a document; negative
        ids are padding), for attention types ``"dot"``/``"metric"``.
      positions: ``[B, L]`` token positions for rotary embeddings (e.g. restarting per
        document).
    """
    chex.assert_rank(x, 3)
    ln = lambda name: nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    attn = make_attention(self.attention, num_heads=self.num_heads, is_causal=self.is_causal,
                          dropout_rate=self.attention_dropout_rate, dtype=self.dtype,
                          param_dtype=self.param_dtype, name="attention")
    y = call_attention(attn, ln("ln_attention")(x), None, mask=mask, key_mask=key_mask,
                       deterministic=deterministic, decode=decode, segment_ids=segment_ids,
                       positions=positions)
    x = x + nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = MlpBlock(mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate, dtype=self.dtype,
                 param_dtype=self.param_dtype, name="mlp")(ln("ln_mlp")(x),
                                                          deterministic=deterministic)
    return x + y


class DecoderBlock(nn.Module, kw_only=True):
  """Pre-LN decoder block: causal self-attention, cross-attention to ``memory``, MLP.

  ``x [B, T, D]``, ``memory [B, S, D]`` -> ``[B, T, D]``. Fields as in :class:`EncoderBlock`;
  ``cross_attention`` (default: same as ``attention``) chooses the cross-attention.
  """

  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  cross_attention: Mapping[str, Any] | str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    freeze_attention_fields(self, "attention", "cross_attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, memory: Array, *, mask: Array | None = None,
               key_mask: Array | None = None, memory_key_mask: Array | None = None,
               deterministic: bool = True, decode: bool = False) -> Array:
    """Causal self-attention over ``x [B, T, D]``, cross-attention to ``memory [B, S, D]``, MLP.

    Args:
      x: the decoder stream ``[B, T, D]``.
      memory: the encoder output ``[B, S, D]`` (same batch size).
      mask: optional boolean mask of the self-attention, broadcastable to ``[B, N, T, T]``.
      key_mask: optional ``[B, T]`` padding mask of the decoder tokens (True = real token).
      memory_key_mask: optional ``[B, S]`` padding mask of ``memory``.
      deterministic: disables dropout (the ``"dropout"`` RNG is needed otherwise).
      decode: KV-cache decoding of the self-attention, for attention types that have a cache.

    Returns:
      ``[B, T, D]``.
    """
    chex.assert_rank([x, memory], 3)
    chex.assert_equal_shape_prefix([x, memory], 1)
    ln = lambda name: nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    common = dict(num_heads=self.num_heads, dropout_rate=self.attention_dropout_rate,
                  dtype=self.dtype, param_dtype=self.param_dtype)
    self_attn = make_attention(self.attention, is_causal=True, name="self_attention", **common)
    cross = self.cross_attention if self.cross_attention is not None else self.attention
    cross_attn = make_attention(cross, name="cross_attention", **common)
    drop = lambda y: nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = call_attention(self_attn, ln("ln_self_attention")(x), None, mask=mask,
                       key_mask=key_mask, deterministic=deterministic, decode=decode)
    x = x + drop(y)
    y = call_attention(cross_attn, ln("ln_cross_attention")(x), memory, mask=None,
                       key_mask=memory_key_mask, deterministic=deterministic)
    x = x + drop(y)
    y = MlpBlock(mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate, dtype=self.dtype,
                 param_dtype=self.param_dtype, name="mlp")(ln("ln_mlp")(x),
                                                          deterministic=deterministic)
    return x + y


class Encoder(nn.Module, kw_only=True):
  """``num_layers`` :class:`EncoderBlock` + final LayerNorm on embedded inputs ``[B, L, D]``."""

  num_layers: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  is_causal: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    freeze_attention_fields(self, "attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None, key_mask: Array | None = None,
               deterministic: bool = True, decode: bool = False) -> Array:
    """``x [B, L, D]`` -> ``[B, L, D]``; the arguments are :meth:`EncoderBlock.__call__`'s."""
    for i in range(self.num_layers):
      x = EncoderBlock(num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                       dropout_rate=self.dropout_rate,
                       attention_dropout_rate=self.attention_dropout_rate,
                       attention=self.attention, is_causal=self.is_causal, dtype=self.dtype,
                       param_dtype=self.param_dtype, name=f"block_{i}")(
                           x, mask=mask, key_mask=key_mask, deterministic=deterministic,
                           decode=decode)
    return nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="ln_final")(x)


class Decoder(nn.Module, kw_only=True):
  """``num_layers`` :class:`DecoderBlock` + final LayerNorm: ``[B, T, D]``, memory ``[B, S, D]``."""

  num_layers: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  cross_attention: Mapping[str, Any] | str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    freeze_attention_fields(self, "attention", "cross_attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, memory: Array, *, mask: Array | None = None,
               key_mask: Array | None = None, memory_key_mask: Array | None = None,
               deterministic: bool = True, decode: bool = False) -> Array:
    """``x [B, T, D]``, ``memory [B, S, D]`` -> ``[B, T, D]``; the arguments are
    :meth:`DecoderBlock.__call__`'s."""
    for i in range(self.num_layers):
      x = DecoderBlock(num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                       dropout_rate=self.dropout_rate,
                       attention_dropout_rate=self.attention_dropout_rate,
                       attention=self.attention, cross_attention=self.cross_attention,
                       dtype=self.dtype, param_dtype=self.param_dtype, name=f"block_{i}")(
                           x, memory, mask=mask, key_mask=key_mask,
                           memory_key_mask=memory_key_mask, deterministic=deterministic,
                           decode=decode)
    return nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="ln_final")(x)
