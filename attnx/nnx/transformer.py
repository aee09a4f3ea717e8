"""Pre-LN transformer blocks in NNX, built from the attention specs of :mod:`attnx.nn.spec`.

The NNX twins of :class:`attnx.nn.EncoderBlock` and :class:`attnx.nn.MlpBlock`, with the linen
modules' submodule and parameter names (``ln_attention``, ``attention``, ``ln_mlp``,
``mlp/Dense_0``, ``mlp/Dense_1``), so a linen parameter tree loads with
``nnx.replace_by_pure_dict``. Attention types ``"dot"`` and ``"metric"``
(:class:`attnx.nnx.MultiHeadAttention`) exist in NNX; the others raise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnx.nn.spec import resolve_attention
from attnx.nn.transformer import combine_masks
from attnx.nnx.attention import MultiHeadAttention

Array = jax.Array

NNX_TYPES = ("dot", "metric")
# Spec keys whose NNX name differs from the linen module's.
_RENAMED = {"qk_norm": "normalize_qk", "rank": "score_dim"}


def make_attention(attention: Mapping[str, Any] | str | None, *, in_features: int,
                   num_heads: int, is_causal: bool = False, dropout_rate: float = 0.0,
                   dtype: Any = None, param_dtype: Any = jnp.float32,
                   rngs: nnx.Rngs) -> MultiHeadAttention:
  """The NNX attention module an attention spec describes (as
  :func:`attnx.nn.spec.make_attention` builds the linen one): block settings from the caller,
  spec keys win over them but not over ``is_causal``.

  Raises:
    ValueError: a bad spec, a type NNX does not have yet, or keys the module does not take.

  Example:
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> mha = anx.make_attention({"weighting": "entmax15", "num_kv_heads": 1}, in_features=16,
    ...                          num_heads=2, is_causal=True, rngs=nnx.Rngs(0))
    >>> mha.options.weighting, mha.num_kv_heads, mha.options.is_causal
    ('entmax15', 1, True)
  """
  spec = resolve_attention(attention)
  kind = spec.pop("type")
  if kind not in NNX_TYPES:
    raise ValueError(f"attnx.nnx has attention types {', '.join(map(repr, NNX_TYPES))}; "
                     f"{attention!r} is of type {kind!r} (attnx.nn has it, in linen).")
  kw: dict[str, Any] = dict(num_heads=num_heads, dropout_rate=dropout_rate, dtype=dtype,
                            param_dtype=param_dtype)
  kw.update({_RENAMED.get(k, k): v for k, v in spec.items()})
  if kind == "metric":
    kw["score"] = "metric"
  kw["is_causal"] = bool(is_causal or spec.get("is_causal", False))
  try:
    return MultiHeadAttention(in_features=in_features, rngs=rngs, **kw)
  except TypeError as e:
    raise ValueError(f"Bad attention spec {attention!r} for attnx.nnx.MultiHeadAttention: "
                     f"{e}") from None


def make_dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
  """``nnx.Dropout(rate)``, holding the ``dropout`` stream only when it drops something (as
  Flax's attention does), so that models without dropout build from ``Rngs(params=...)``."""
  return nnx.Dropout(rate, rngs=rngs if rate > 0 else None)


class MlpBlock(nnx.Module):
  """Linear(mlp_dim) → GELU → dropout → Linear(out_dim) → dropout, as
  :class:`attnx.nn.MlpBlock`: ``[..., D] -> [..., out_dim or D]``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> anx.MlpBlock(16, 64, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 16))).shape
    (2, 5, 16)
  """

  def __init__(self, in_features: int, mlp_dim: int, out_dim: int | None = None, *,
               dropout_rate: float = 0.0, dtype: Any = None, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    dense = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    # linen's automatic names, so that linen parameters load as they are
    self.Dense_0 = nnx.Linear(in_features, mlp_dim, **dense)
    self.Dense_1 = nnx.Linear(mlp_dim, out_dim or in_features, **dense)
    self.dropout = make_dropout(dropout_rate, rngs)

  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    y = self.dropout(nnx.gelu(self.Dense_0(x)), deterministic=deterministic)
    return self.dropout(self.Dense_1(y), deterministic=deterministic)


class EncoderBlock(nnx.Module):
  """Pre-LN block: x + Attn(LN(x)), then + MLP(LN(x)), as :class:`attnx.nn.EncoderBlock`.
  ``[B, L, D] -> [B, L, D]``.

  The arguments are the width ``hidden_dim`` (D), the fields of :class:`attnx.nn.EncoderBlock`
  (``num_heads``, ``mlp_dim``, ``dropout_rate``, ``attention_dropout_rate``, ``attention``,
  ``is_causal``, ``dtype``, ``param_dtype``) and ``rngs`` (``params``; ``dropout`` when a
  rate is set).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> block = anx.EncoderBlock(16, 2, 32, attention="relu", is_causal=True, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((2, 5, 16)), key_mask=jnp.ones((2, 5), bool)).shape
    (2, 5, 16)
  """

  def __init__(self, hidden_dim: int, num_heads: int, mlp_dim: int, *,
               dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0,
               attention: Mapping[str, Any] | str | None = None, is_causal: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    ln = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ln_attention = nnx.LayerNorm(hidden_dim, **ln)
    self.attention = make_attention(attention, in_features=hidden_dim, num_heads=num_heads,
                                    is_causal=is_causal, dropout_rate=attention_dropout_rate,
                                    dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ln_mlp = nnx.LayerNorm(hidden_dim, **ln)
    self.mlp = MlpBlock(hidden_dim, mlp_dim, dropout_rate=dropout_rate, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs)
    self.dropout = make_dropout(dropout_rate, rngs)

  def __call__(self, x: Array, *, mask: Array | None = None, key_mask: Array | None = None,
               deterministic: bool = True, decode: bool = False, segment_ids: Any = None,
               positions: Array | None = None) -> Array:
    """Self-attention and MLP over ``x [B, L, D]``; the arguments are
    :meth:`attnx.nn.EncoderBlock.__call__`'s."""
    if x.ndim != 3:
      raise ValueError(f"EncoderBlock: x must be [B, L, D], got shape {x.shape}.")
    y = self.attention(self.ln_attention(x), mask=combine_masks(mask, key_mask),
                       deterministic=deterministic, decode=decode, segment_ids=segment_ids,
                       positions=positions)
    x = x + self.dropout(y, deterministic=deterministic)
    return x + self.mlp(self.ln_mlp(x), deterministic=deterministic)


class Encoder(nnx.Module):
  """``num_layers`` :class:`EncoderBlock` + a final LayerNorm, as :class:`attnx.nn.Encoder`
  (names ``block_<i>``, ``ln_final``): embedded inputs ``[B, L, D] -> [B, L, D]``.

  Args: ``hidden_dim`` (D), then :class:`attnx.nn.Encoder`'s fields, and ``rngs``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> encoder = anx.Encoder(16, 2, 2, 32, attention="sparsemax", rngs=nnx.Rngs(0))
    >>> encoder(jnp.ones((2, 5, 16))).shape, sorted(nnx.state(encoder, nnx.Param))
    ((2, 5, 16), ['block_0', 'block_1', 'ln_final'])
  """

  def __init__(self, hidden_dim: int, num_layers: int, num_heads: int, mlp_dim: int, *,
               dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0,
               attention: Mapping[str, Any] | str | None = None, is_causal: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.num_layers = num_layers
    for i in range(num_layers):
      setattr(self, f"block_{i}", EncoderBlock(
          hidden_dim, num_heads, mlp_dim, dropout_rate=dropout_rate,
          attention_dropout_rate=attention_dropout_rate, attention=attention,
          is_causal=is_causal, dtype=dtype, param_dtype=param_dtype, rngs=rngs))
    self.ln_final = nnx.LayerNorm(hidden_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: Array, *, mask: Array | None = None, key_mask: Array | None = None,
               deterministic: bool = True, decode: bool = False) -> Array:
    """``x [B, L, D]`` -> ``[B, L, D]``; the arguments are :meth:`EncoderBlock.__call__`'s."""
    for i in range(self.num_layers):
      x = getattr(self, f"block_{i}")(x, mask=mask, key_mask=key_mask,
                                      deterministic=deterministic, decode=decode)
    return self.ln_final(x)
