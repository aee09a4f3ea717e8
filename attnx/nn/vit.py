"""A Vision Transformer classifier (Dosovitskiy et al. 2021) with pluggable attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx.nn.spec import freeze_attention_fields
from attnx.nn.transformer import Encoder, LearnedPositionEmbedding

Array = jax.Array

POOLS = ("cls", "mean")


class VisionTransformer(nn.Module, kw_only=True):
  """ViT: patchify → linear embedding → [CLS] + learned positions → pre-LN encoder → head.

  Attributes:
    num_classes: output classes C.
    patch_size: square patch side P (1 = every pixel is a token); H and W must be multiples.
    hidden_dim: token width D.
    num_layers, num_heads, mlp_dim: encoder size.
    dropout_rate: dropout on embeddings and residual branches.
    attention_dropout_rate: dropout on attention weights.
    pool: ``"cls"`` (a learned class token) or ``"mean"`` (mean over patch tokens).
    attention: attention dict (``attnx.nn.attention_spec(...)``).
    dtype, param_dtype: as in flax.

  Input images ``[B, H, W, C]`` float → logits ``[B, num_classes]``.
  """

  num_classes: int
  patch_size: int = 4
  hidden_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 128
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  pool: str = "cls"
  attention: Mapping[str, Any] | str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    check_vit(self.pool, self.hidden_dim, self.num_heads)
    freeze_attention_fields(self, "attention")
    super().__post_init__()

  @nn.compact
  def __call__(self, images: Array, *, deterministic: bool = True) -> Array:
    check_images(images, self.patch_size)
    b, p = images.shape[0], self.patch_size
    x = nn.Conv(self.hidden_dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                param_dtype=self.param_dtype, name="patch_embedding")(images)
    x = x.reshape(b, -1, self.hidden_dim)  # [B, HW/P², D]
    if self.pool == "cls":
      cls = self.param("cls", nn.initializers.zeros, (1, 1, self.hidden_dim), self.param_dtype)
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.hidden_dim)).astype(x.dtype), x],
                          axis=1)
    x = LearnedPositionEmbedding(max_len=x.shape[1], param_dtype=self.param_dtype,
                                 name="pos_embedding")(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = Encoder(num_layers=self.num_layers, num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate, attention=self.attention,
                dtype=self.dtype, param_dtype=self.param_dtype,
                name="encoder")(x, deterministic=deterministic)
    logits = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                      kernel_init=nn.initializers.zeros, name="head")(pool_tokens(x, self.pool))
    chex.assert_shape(logits, (b, self.num_classes))
    return logits


# The logic the linen model shares with attnx.nnx.VisionTransformer.


def check_vit(pool: str, hidden_dim: int, num_heads: int) -> None:
  """ValueError for a ViT configuration that cannot be built."""
  if pool not in POOLS:
    raise ValueError(f"VisionTransformer: unknown pool {pool!r}; valid: {POOLS}.")
  if hidden_dim % num_heads:
    raise ValueError(f"VisionTransformer: hidden_dim={hidden_dim} is not divisible by "
                     f"num_heads={num_heads}.")


def check_images(images: Array, patch_size: int) -> None:
  """Images ``[B, H, W, C]`` with H and W multiples of the patch side."""
  chex.assert_rank(images, 4)
  _, h, w, _ = images.shape
  if h % patch_size or w % patch_size:
    raise ValueError(f"image size {(h, w)} (images {images.shape}) is not a multiple of "
                     f"patch_size={patch_size}.")


def pool_tokens(x: Array, pool: str) -> Array:
  """The encoder output ``[B, L, D]`` -> ``[B, D]``: the class token or the mean."""
  return x[:, 0] if pool == "cls" else jnp.mean(x, axis=1)
