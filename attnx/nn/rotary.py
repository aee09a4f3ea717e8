"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", arXiv 2104.09864).

Feature pairs ``(x_2i, x_2i+1)`` of a query or key at position m are rotated by the angle
``m θ_i`` with ``θ_i = base^(−2i/H)`` (the paper's interleaved pairs, i = 0 .. H/2 − 1). A
rotation R_m is orthogonal and ``R_mᵀ R_n = R_(n−m)``, so

    (R_m q) · (R_n k) = q · R_(n−m) k,

a function of the offset n − m alone: shifting every position by the same amount leaves all
dot-product scores unchanged, and any sequence length works (nothing is learned per
position). The squared distance ``‖R_m q − R_n k‖² = ‖q‖² + ‖k‖² − 2 q · R_(n−m) k`` is
relative too, so distance kernels keep the property.

Used by :class:`attnx.nn.MultiHeadAttention` (``rotary=True``) and :class:`attnx.nn.GPT`
(``positions="rotary"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

DEFAULT_BASE = 10_000.0


def rotary_angles(positions: Array, dim: int, base: float = DEFAULT_BASE) -> Array:
  """``positions [..., T]`` -> angles ``[..., T, dim // 2]``: ``m θ_i``, θ_i = base^(−2i/dim)."""
  if dim % 2:
    raise ValueError(f"rotary position embeddings rotate feature pairs: the head dim must be "
                     f"even, got {dim}.")
  inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  return jnp.asarray(positions, jnp.float32)[..., None] * inv_freq


def apply_rotary(x: Array, positions: Array, base: float = DEFAULT_BASE) -> Array:
  """Rotates queries or keys ``x [B..., T, N, H]`` at ``positions`` (``[T]`` or ``[B..., T]``).

  Computed in float32 and cast back to ``x.dtype``.
  """
  if x.ndim < 3:
    raise ValueError(f"apply_rotary expects [B..., T, N, H], got shape {x.shape}.")
  angles = rotary_angles(positions, x.shape[-1], base)[..., None, :]  # [..., T, 1, H/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  even, odd = xf[..., 0::2], xf[..., 1::2]
  out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)
