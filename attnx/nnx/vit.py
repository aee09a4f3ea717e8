"""A Vision Transformer classifier in NNX: :class:`attnx.nn.VisionTransformer`'s model.

The linen model's submodule and parameter names (``patch_embedding``, ``cls``,
``pos_embedding/pos_embedding``, ``encoder/block_<i>``, ``encoder/ln_final``, ``head``), so a
linen checkpoint's ``params`` load with ``nnx.replace_by_pure_dict``; its checks and pooling are
the linen module's functions. NNX creates parameters when the model is made, so the image size
and channels are constructor arguments here (linen reads them from the first input).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnx.nn import vit as vit_lib
from attnx.nnx.transformer import Encoder, make_dropout

Array = jax.Array


class _Table(nnx.Module):
  """A learned ``pos_embedding [L, D]`` (init N(0, 0.02²)), linen's LearnedPositionEmbedding."""

  def __init__(self, length: int, dim: int, param_dtype: Any, rngs: nnx.Rngs):
    self.pos_embedding = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (length, dim), param_dtype))

  def __call__(self, x: Array) -> Array:
    return x + self.pos_embedding[...][: x.shape[1]].astype(x.dtype)[None]


class VisionTransformer(nnx.Module):
  """ViT: patchify → linear embedding → [CLS] + learned positions → pre-LN encoder → head.

  The arguments are the fields of :class:`attnx.nn.VisionTransformer` (``num_classes``,
  ``patch_size``, ``hidden_dim``, ``num_layers``, ``num_heads``, ``mlp_dim``, ``dropout_rate``,
  ``attention_dropout_rate``, ``pool``, ``attention`` of type ``"dot"`` or ``"metric"``,
  ``dtype``, ``param_dtype``) and:

  Args:
    image_size: ``(H, W)`` or one side: the images the model takes (multiples of
      ``patch_size``).
    in_channels: image channels C.
    rngs: ``nnx.Rngs`` (``params``; ``dropout`` when a rate is set).

  Images ``[B, H, W, C]`` float → logits ``[B, num_classes]``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> vit = anx.VisionTransformer(num_classes=10, image_size=8, in_channels=1, patch_size=4,
    ...                             hidden_dim=16, num_heads=2, attention="relu",
    ...                             rngs=nnx.Rngs(0))
    >>> vit(jnp.zeros((2, 8, 8, 1))).shape
    (2, 10)
  """

  def __init__(self, *, num_classes: int, image_size: int | tuple[int, int], in_channels: int,
               patch_size: int = 4, hidden_dim: int = 64, num_layers: int = 2,
               num_heads: int = 4, mlp_dim: int = 128, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, pool: str = "cls",
               attention: Mapping[str, Any] | str | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    vit_lib.check_vit(pool, hidden_dim, num_heads)
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    vit_lib.check_images(jnp.zeros((1, h, w, in_channels)), patch_size)
    self.image_size, self.in_channels = (h, w), in_channels
    self.patch_size, self.hidden_dim, self.pool = patch_size, hidden_dim, pool
    self.num_classes = num_classes
    p = patch_size
    self.patch_embedding = nnx.Conv(in_channels, hidden_dim, (p, p), strides=(p, p),
                                    padding="VALID", dtype=dtype, param_dtype=param_dtype,
                                    rngs=rngs)
    if pool == "cls":
      self.cls = nnx.Param(jnp.zeros((1, 1, hidden_dim), param_dtype))
    tokens = (h // p) * (w // p) + (pool == "cls")
    self.pos_embedding = _Table(tokens, hidden_dim, param_dtype, rngs)
    self.dropout = make_dropout(dropout_rate, rngs)
    self.encoder = Encoder(hidden_dim, num_layers, num_heads, mlp_dim,
                           dropout_rate=dropout_rate,
                           attention_dropout_rate=attention_dropout_rate, attention=attention,
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.head = nnx.Linear(hidden_dim, num_classes, kernel_init=nnx.initializers.zeros,
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, images: Array, *, deterministic: bool = True) -> Array:
    """Logits ``[B, num_classes]`` of images ``[B, H, W, C]`` (the constructor's H, W, C)."""
    vit_lib.check_images(images, self.patch_size)
    if tuple(images.shape[1:]) != (*self.image_size, self.in_channels):
      raise ValueError(f"VisionTransformer: images {images.shape} do not match the model's "
                       f"image_size={self.image_size}, in_channels={self.in_channels}.")
    b, d = images.shape[0], self.hidden_dim
    x = self.patch_embedding(images).reshape(b, -1, d)  # [B, HW/P², D]
    if self.pool == "cls":
      x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (b, 1, d)).astype(x.dtype), x],
                          axis=1)
    x = self.dropout(self.pos_embedding(x), deterministic=deterministic)
    x = self.encoder(x, deterministic=deterministic)
    return self.head(vit_lib.pool_tokens(x, self.pool))
