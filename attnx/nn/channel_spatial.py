"""Channel and spatial attention for CNNs (Wikipedia, "Attention (machine learning)").

Squeeze-and-Excitation (Hu et al. 2018)
and CBAM (Woo et al. 2018), and a small CNN classifier that can use them.

The papers gate with a sigmoid. ``weighting=<name>`` instead normalizes the gate logits over
channels (or positions) with ``core.weights`` and rescales by the count, so the mean gate is 1:
the same F(s)/ΣF(s) family as token attention. Gate logits are learned scores, not distances,
so the distance kernels (``gaussian``, ``boxcar``, ...) are rejected.
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

BLOCK_ATTENTION = ("none", "se", "cbam")


def _gate(logits: Array, weighting: Any | None, axis: int | tuple[int, ...]) -> Array:
  """Sigmoid gate (weighting None), or F(s)/ΣF(s) over ``axis`` times the number of entries."""
  if weighting is None:
    return jax.nn.sigmoid(logits)
  axes = (axis,) if isinstance(axis, int) else axis
  moved = jnp.moveaxis(logits, axes, tuple(range(-len(axes), 0)))
  flat = moved.reshape(moved.shape[: moved.ndim - len(axes)] + (-1,))
  w = core.weights(flat, weighting, axis=-1) * flat.shape[-1]
  return jnp.moveaxis(w.reshape(moved.shape), tuple(range(-len(axes), 0)), axes).astype(
      logits.dtype)


def _check_weighting(weighting: Any | None, where: str) -> None:
  if weighting is not None:
    try:
      core.get_weighting(weighting)
      core.check_compatible(weighting, "dot")  # the gate logits are a learned linear score
    except ValueError as e:
      raise ValueError(f"{where} (gate logits are learned scores, not distances): {e}") from None


class SqueezeExcite(nn.Module, kw_only=True):
  """Channel attention: x · g, g = gate(W₂ relu(W₁ GAP(x))). ``[B, H, W, C] -> [B, H, W, C]``.

  Attributes:
    reduction: bottleneck ratio r (hidden = max(C // r, 1)).
    weighting: None for the paper's sigmoid gate, or a weighting F over channels.
    dtype, param_dtype: as in flax; the output is in ``dtype`` (default: the input's).
  """

  reduction: int = 4
  weighting: Any | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    _check_weighting(self.weighting, type(self).__name__)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    chex.assert_rank(x, 4)
    if self.dtype is not None:  # compute (and return) in dtype, as flax layers do
      x = x.astype(self.dtype)
    c = x.shape[-1]
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    s = jnp.mean(x, axis=(1, 2))  # squeeze [B, C]
    s = nn.relu(nn.Dense(max(c // self.reduction, 1), name="reduce", **kw)(s))
    g = _gate(nn.Dense(c, name="expand", **kw)(s), self.weighting, -1)
    return x * g[:, None, None, :]


class CBAM(nn.Module, kw_only=True):
  """Convolutional Block Attention Module: channel then spatial attention.

  Channel: g_c = gate(MLP(avgpool x) + MLP(maxpool x)); spatial: g_s = gate(conv7×7([mean_c;
  max_c])). ``[B, H, W, C] -> [B, H, W, C]``.

  Attributes:
    reduction: MLP bottleneck ratio.
    kernel_size: spatial conv size.
    weighting: None (sigmoid gates, the paper) or F normalizing over channels / positions.
    dtype, param_dtype: as in flax; the output is in ``dtype`` (default: the input's).
  """

  reduction: int = 4
  kernel_size: int = 7
  weighting: Any | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    _check_weighting(self.weighting, type(self).__name__)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    chex.assert_rank(x, 4)
    if self.dtype is not None:  # compute (and return) in dtype, as flax layers do
      x = x.astype(self.dtype)
    c = x.shape[-1]
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    reduce = nn.Dense(max(c // self.reduction, 1), name="mlp_reduce", **kw)
    expand = nn.Dense(c, name="mlp_expand", **kw)
    mlp = lambda v: expand(nn.relu(reduce(v)))
    logits = mlp(jnp.mean(x, axis=(1, 2))) + mlp(jnp.max(x, axis=(1, 2)))
    x = x * _gate(logits, self.weighting, -1)[:, None, None, :]
    pooled = jnp.concatenate([jnp.mean(x, -1, keepdims=True), jnp.max(x, -1, keepdims=True)], -1)
    k = self.kernel_size
    s = nn.Conv(1, (k, k), padding="SAME", name="spatial_conv", **kw)(pooled)[..., 0]  # [B,H,W]
    return x * _gate(s, self.weighting, (1, 2))[..., None]


class SmallCNN(nn.Module, kw_only=True):
  """Conv blocks (3×3 conv → ReLU → [SE | CBAM] → 2×2 avg pool), global pool, linear head.

  Attributes:
    num_classes: classes C.
    features: channels per block.
    block_attention: ``"none"``, ``"se"`` or ``"cbam"``.
    weighting: gate weighting for SE/CBAM (None = sigmoid).
    reduction: SE/CBAM bottleneck ratio.
    dtype, param_dtype: as in flax.
    dropout_rate: dropout on the pooled features before the head (``deterministic=False``,
      ``"dropout"`` RNG).

  Images ``[B, H, W, C_in]`` → logits ``[B, num_classes]``.
  """

  num_classes: int
  features: tuple[int, ...] = (16, 32)
  block_attention: str = "se"
  weighting: Any | None = None
  reduction: int = 4
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dropout_rate: float = 0.0

  def __post_init__(self):
    _util.check_dropout_rate(self.dropout_rate, type(self).__name__)
    if self.block_attention not in BLOCK_ATTENTION:
      raise ValueError(f"SmallCNN: unknown block_attention {self.block_attention!r}; valid: "
                       f"{', '.join(BLOCK_ATTENTION)}.")
    _check_weighting(self.weighting, type(self).__name__)
    super().__post_init__()

  @nn.compact
  def __call__(self, images: Array, *, deterministic: bool = True) -> Array:
    chex.assert_rank(images, 4)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    x = images
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Conv(f, (3, 3), padding="SAME", name=f"conv_{i}", **kw)(x))
      if self.block_attention == "se":
        x = SqueezeExcite(reduction=self.reduction, weighting=self.weighting, name=f"se_{i}",
                          **kw)(x)
      elif self.block_attention == "cbam":
        x = CBAM(reduction=self.reduction, weighting=self.weighting, name=f"cbam_{i}", **kw)(x)
      if min(x.shape[1:3]) >= 2:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    return nn.Dense(self.num_classes, name="head", **kw)(x)
