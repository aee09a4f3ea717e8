"""Array-layout helpers every kernel backend (XLA blocked, Pallas, the ring) shares."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["as_5d", "pad_axis", "round_up", "sum_to", "tile_span"]


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def sum_to(x: Array, shape: tuple[int, ...]) -> Array:
  """Sums the broadcast dims of x down to `shape` (same rank)."""
  axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 and n != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def as_5d(x: Array | None, n: int, kv_heads: int, name: str) -> Array | None:
  """A [B|1, N|1, T|1, S|1]-broadcastable array -> [B|1, K|1, G|1, T|1, S|1]."""
  if x is None:
    return None
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims [B, N, T, S], got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if x.shape[1] == 1:
    return x[:, :, None]
  if x.shape[1] != n:
    raise ValueError(f"{name} of shape {x.shape} has {x.shape[1]} heads, expected {n} or 1")
  return x.reshape(x.shape[0], kv_heads, n // kv_heads, *x.shape[2:])


def pad_axis(x: Array, axis: int, size: int, value: Any = 0, keep_one: bool = False) -> Array:
  """Pads `axis` to `size`; a broadcast (size-1) axis stays as is when keep_one."""
  if x.shape[axis] == size or (keep_one and x.shape[axis] == 1):
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pads, constant_values=value)


def tile_span(kinds: Array, axis: int) -> tuple[Array, Array]:
  """The first and one-past-last tile along ``axis`` of a [nq, nk] table of tile kinds (0: the
  tile is skipped, as :func:`attnx.core.kernels.xla.tiling.tile_kinds`) that is not skipped,
  for every tile of the other axis (``lo = hi`` where all are skipped): the loop bounds of a
  kernel's inner loop (axis 1: key tiles of each query tile; 0: query tiles of each key
  tile)."""
  n = kinds.shape[axis]
  idx = jnp.expand_dims(jnp.arange(n), 1 - axis)
  lo = jnp.min(jnp.where(kinds > 0, idx, n), axis=axis)
  hi = jnp.max(jnp.where(kinds > 0, idx + 1, 0), axis=axis)
  return lo, jnp.maximum(hi, lo)
