"""Transformer models over token sequences (ListOps, associative recall) and continuous
sequences (in-context regression), with pluggable attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx.nn.spec import freeze_attention_fields
from attnx.nn.transformer import Encoder, position_embedding

Array = jax.Array

POOLS = ("cls", "mean", "none")
PAD_ID = 0


def _encoder(m: nn.Module) -> Encoder:
  """The pre-LN encoder of a sequence model, from its size and attention fields."""
  return Encoder(num_layers=m.num_layers, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
                 dropout_rate=m.dropout_rate, attention_dropout_rate=m.attention_dropout_rate,
                 attention=m.attention, is_causal=m.is_causal, dtype=m.dtype,
                 param_dtype=m.param_dtype, name="encoder")


def short_convolution(x: Array, width: int, *, dtype: Any = None,
                      param_dtype: Any = jnp.float32, name: str = "short_conv") -> Array:
  """Depthwise causal convolution of ``x [B, L, D]`` over L with ``width`` taps per channel:
  output t depends on inputs t−width+1..t only (left zero padding)."""
  d = x.shape[-1]
  return nn.Conv(d, kernel_size=(width,), padding=((width - 1, 0),), feature_group_count=d,
                 dtype=dtype, param_dtype=param_dtype, name=name)(x)


class SequenceClassifier(nn.Module, kw_only=True):
  """Token sequences ``[B, L]`` int → logits ``[B, C]`` (or per token ``[B, L, C]``).

  Token 0 is PAD: it is masked out of the attention keys and of mean pooling.

  Attributes:
    vocab_size, num_classes: token and class counts.
    hidden_dim, num_layers, num_heads, mlp_dim: encoder size.
    max_len: longest sequence (learned position table size, without the CLS token).
    pool: ``"cls"``, ``"mean"`` or ``"none"`` (per-token logits, e.g. associative recall).
    is_causal: causal self-attention.
    position: ``"learned"``, ``"sinusoidal"`` or ``"none"``.
    short_conv: width w > 0 of a depthwise causal convolution added (residually) to the
      token embeddings before the first block: token t then also carries tokens t−w+1..t,
      the "short convolution" of Zoology's gated-convolution models and of Based (Arora et
      al. 2023, 2024). It gives every weighting the previous-token step of associative
      recall for free, which smooth kernels such as linear attention cannot learn from
      positions alone. 0 (default): none. Causal whatever ``is_causal`` says.
    dropout_rate, attention_dropout_rate: dropout on residual branches / attention weights.
    attention: attention dict (``attnx.nn.attention_spec(...)``).
    dtype, param_dtype: as in flax.
  """

  vocab_size: int
  num_classes: int
  hidden_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 128
  max_len: int = 512
  pool: str = "cls"
  is_causal: bool = False
  position: str = "learned"
  short_conv: int = 0
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if not isinstance(self.short_conv, int) or self.short_conv < 0:
      raise ValueError(f"SequenceClassifier: short_conv must be an int ≥ 0 (a convolution "
                       f"width; 0 for none), got {self.short_conv!r}.")
    if self.pool not in POOLS:
      raise ValueError(f"SequenceClassifier: unknown pool {self.pool!r}; valid: {POOLS}.")
    if self.hidden_dim % self.num_heads:
      raise ValueError(f"SequenceClassifier: hidden_dim={self.hidden_dim} is not divisible by "
                       f"num_heads={self.num_heads}.")
    if self.pool == "cls" and self.is_causal:
      raise ValueError("SequenceClassifier: pool='cls' puts CLS first, which under is_causal "
                       "sees nothing; use pool='mean' or 'none'.")
    freeze_attention_fields(self, "attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: Array, *, deterministic: bool = True) -> Array:
    """``tokens [B, L]`` int (L ≤ ``max_len``, 0 = PAD) -> logits ``[B, C]``, or ``[B, L, C]``
    with ``pool="none"``. ``deterministic=False`` enables dropout (``"dropout"`` RNG)."""
    chex.assert_rank(tokens, 2)
    chex.assert_type(tokens, int)
    b, length = tokens.shape
    if length > self.max_len:
      raise ValueError(f"tokens {tokens.shape} longer than max_len={self.max_len}.")
    valid = tokens != PAD_ID  # [B, L]
    x = nn.Embed(self.vocab_size, self.hidden_dim, dtype=self.dtype,
                 param_dtype=self.param_dtype, name="embed")(tokens)
    if self.short_conv:
      x = x + short_convolution(x, self.short_conv, dtype=self.dtype,
                                param_dtype=self.param_dtype)
    pos = position_embedding(self.position, self.max_len + 1, self.param_dtype,
                             name="pos_embedding")
    if self.pool == "cls":
      cls = self.param("cls", nn.initializers.normal(0.02), (1, 1, self.hidden_dim),
                       self.param_dtype)
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.hidden_dim)).astype(x.dtype), x],
                          axis=1)
      valid = jnp.concatenate([jnp.ones((b, 1), bool), valid], axis=1)
    if pos is not None:
      x = pos(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = _encoder(self)(x, key_mask=valid, deterministic=deterministic)
    if self.pool == "cls":
      x = x[:, 0]
    elif self.pool == "mean":
      wts = valid.astype(x.dtype)[..., None]
      x = jnp.sum(x * wts, axis=1) / jnp.maximum(jnp.sum(wts, axis=1), 1.0)
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    name="head")(x)


class SequenceRegressor(nn.Module, kw_only=True):
  """Continuous sequences ``[B, L, D]`` → per-token predictions ``[B, L, out_dim]``.

  For in-context regression (Garg et al. 2022): prompts (x_1, y_1, ..., x_q) as tokens, read
  the prediction at the query positions. Causal by default.

  Attributes:
    out_dim: output features per token.
    hidden_dim, num_layers, num_heads, mlp_dim, max_len: encoder size.
    is_causal: causal self-attention (default True).
    position: ``"learned"``, ``"sinusoidal"`` or ``"none"``.
    dropout_rate, attention_dropout_rate, attention, dtype, param_dtype: as above.
  """

  out_dim: int = 1
  hidden_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 128
  max_len: int = 256
  is_causal: bool = True
  position: str = "learned"
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if self.hidden_dim % self.num_heads:
      raise ValueError(f"SequenceRegressor: hidden_dim={self.hidden_dim} is not divisible by "
                       f"num_heads={self.num_heads}.")
    freeze_attention_fields(self, "attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: Array, *, key_mask: Array | None = None,
               deterministic: bool = True) -> Array:
    """``inputs [B, L, D]`` float, optional ``key_mask [B, L]`` -> ``[B, L, out_dim]``."""
    chex.assert_rank(inputs, 3)
    if inputs.shape[1] > self.max_len:
      raise ValueError(f"inputs {inputs.shape} longer than max_len={self.max_len}.")
    x = nn.Dense(self.hidden_dim, dtype=self.dtype, param_dtype=self.param_dtype,
                 name="embed")(inputs)
    pos = position_embedding(self.position, self.max_len, self.param_dtype,
                             name="pos_embedding")
    if pos is not None:
      x = pos(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = _encoder(self)(x, key_mask=key_mask, deterministic=deterministic)
    return nn.Dense(self.out_dim, dtype=self.dtype, param_dtype=self.param_dtype,
                    name="head")(x)
