"""Tiling for the XLA blocked kernels: the static problem description and the tile helpers.

Internal layout: q [X, G, Tp, H] and k/v [X, Sp, H] with X = B·K (G query heads share a kv
head), bias/mask [Bb, Kb, Gb, Tb, Sb]. A tile flattens (G, bq) into rows, so scores are one
batched [G·bq, H] × [H, bk] matmul whose output needs no relayout. The kernels run on
``heads_in_chunk`` of the X rows at a time (a chunk). Shared by the pointwise kernels
(:mod:`attnx.core.kernels.xla.pointwise`), the whole-row ones (:mod:`attnx.core.kernels.xla.rows`)
and the ring's steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnx.core.contract import compute_dtype
from attnx.core.kernels import common
from attnx.core.kernels.common import tile_span
from attnx.core.weightings import Pointwise

Array = jax.Array

ALIGN = 8  # tiles are multiples of 8 rows (SIMD-friendly)

__all__ = ["ALIGN", "TileConfig", "add_bias_grad_tile", "bias_mask_layout", "bias_tile",
           "bias_tile_rows", "check_tiling", "chunk_bias", "chunk_bias_window", "chunk_rows",
           "extra_cotangents",
           "k_range", "kernel_layout", "kind_switch", "mod_alpha", "modded_tile", "prescale",
           "put_row_block", "q_range", "row_heads",
           "row_block", "slice_along", "structured_tile", "tile_counts", "tile_kinds",
           "tile_positions", "tile_scores", "tile_span", "tile_valid", "valid_tile"]


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Static description of one blocked-attention problem (closed over by the kernels)."""
  w: Pointwise
  t: int
  s: int
  bq: int
  bk: int
  is_causal: bool
  has_mask: bool
  has_bias: bool
  # (B, K, G): batch, kv heads and query heads per kv head of the rows a kernel call runs on
  # (the whole problem, then one chunk): X = B·K rows of G query heads.
  head_dims: tuple[int, int, int] = (1, 1, 1)
  kv_heads: int = 1  # K of the whole problem (chunks are rectangles of [batch, kv head])
  heads_in_chunk: int = 1  # X rows (batch, kv head pairs) per chunk
  user_bq: int = 0  # tile sizes asked for (0 = default): caps on the causal path's tiles
  user_bk: int = 0
  raw: bool = False  # forward returns the unnormalized state (see sweep.forward), no offset
  # Causal (whole problem): P diagonal tiles of bq = bk = d rows, T = S ≤ P·d.
  num_diag_tiles: int = 0
  # The key count S that F sees (F(z, S)); 0 = s. Causal sub-blocks keep the problem's S.
  full_num_keys: int = 0
  # A structured mask (attnx.core.masks) is evaluated per tile and its empty tiles skipped.
  structured: bool = False
  # A score modification (attnx.core.score_mods: soft cap, score_mod) is applied per tile; the
  # kernels then take its ScoreMod (whose parameters get gradients) as an argument.
  score_mod: bool = False
  # Attention sinks: a virtual key of score sinks[h] and zero value in every row, folded into
  # each row's state before its keys; the kernels take sinks [N] (with a gradient).
  sinks: bool = False
  # The caller asks for the residual: the whole-row forward also returns entmax's Σu per row,
  # which the residual's gradient needs (attnx.core.streaming.residual_delta).
  residual: bool = False

  @property
  def num_keys(self) -> int:
    return self.full_num_keys or self.s

  @property
  def num_q_blocks(self) -> int:
    return -(-self.t // self.bq)

  @property
  def num_k_blocks(self) -> int:
    return -(-self.s // self.bk)

  @property
  def pad_k(self) -> bool:
    return self.num_k_blocks * self.bk != self.s

  @property
  def needs_valid(self) -> bool:
    return self.has_mask or self.is_causal or self.pad_k or self.structured

  def chunk_head_dims(self) -> tuple[int, int, int]:
    """(B, K, G) of one chunk of heads_in_chunk consecutive X rows."""
    if self.heads_in_chunk <= self.kv_heads:
      return (1, self.heads_in_chunk, self.head_dims[2])
    return (self.heads_in_chunk // self.kv_heads, self.kv_heads, self.head_dims[2])


def chunk_rows(x: Array, c: Array, cfg: TileConfig) -> Array:
  return lax.dynamic_slice_in_dim(x, c * cfg.heads_in_chunk, cfg.heads_in_chunk, 0)


def chunk_bias_window(bias_or_mask: Array, c: Array,
                       cfg: TileConfig) -> tuple[tuple[Any, ...], tuple[int, ...]]:
  """Start and size of chunk c's slice of a [Bb, Kb, Gb, Tb, Sb] bias/mask (or its grad)."""
  cb, ck, _ = cfg.chunk_head_dims()
  x0 = c * cfg.heads_in_chunk
  b0, k0 = x0 // cfg.kv_heads, x0 % cfg.kv_heads
  shape = bias_or_mask.shape
  starts = (b0 if shape[0] != 1 else 0, k0 if shape[1] != 1 else 0, 0, 0, 0)
  sizes = (cb if shape[0] != 1 else 1, ck if shape[1] != 1 else 1) + shape[2:]
  return starts, sizes


def chunk_bias(bias_or_mask: Array | None, c: Array, cfg: TileConfig) -> Array | None:
  if bias_or_mask is None:
    return None
  starts, sizes = chunk_bias_window(bias_or_mask, c, cfg)
  return lax.dynamic_slice(bias_or_mask, starts, sizes)


def slice_along(x: Array, start: Array, size: int, axis: int) -> Array:
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def row_block(x: Array, i: Array, cfg: TileConfig) -> Array:
  """Query block i of a [X, G, Tp, ...] array as [X, G·bq, ...]."""
  x = slice_along(x, i * cfg.bq, cfg.bq, 2)
  return x.reshape((x.shape[0], x.shape[1] * cfg.bq) + x.shape[3:])


def put_row_block(buf: Array, x: Array, i: Array, cfg: TileConfig) -> Array:
  x = x.reshape((buf.shape[0], buf.shape[1], cfg.bq) + buf.shape[3:])
  return lax.dynamic_update_slice_in_dim(buf, x, i * cfg.bq, axis=2)


def bias_tile(x: Array, i: Array, j: Array, cfg: TileConfig) -> Array:
  """The [Bb, Kb, Gb, bq|1, bk|1] tile (i, j) of a broadcastable bias/mask."""
  if x.shape[3] != 1:
    x = slice_along(x, i * cfg.bq, cfg.bq, 3)
  if x.shape[4] != 1:
    x = slice_along(x, j * cfg.bk, cfg.bk, 4)
  return x


def add_bias_grad_tile(dbias: Array, dz: Array, i: Array, j: Array, cfg: TileConfig) -> Array:
  """``dbias`` plus tile (i, j)'s score gradient ``dz`` [X, G·bq, bk], summed over the bias'
  broadcast dims (``dbias`` has the bias' 5-D shape, 1 where it broadcasts)."""
  shape = dbias.shape
  tshape = shape[:3] + tuple(1 if shape[a] == 1 else (cfg.bq, cfg.bk)[a - 3] for a in (3, 4))
  start = (0, 0, 0, 0 if shape[3] == 1 else i * cfg.bq, 0 if shape[4] == 1 else j * cfg.bk)
  cur = lax.dynamic_slice(dbias, start, tshape)
  dz5 = dz.reshape(cfg.head_dims + (cfg.bq, cfg.bk))
  return lax.dynamic_update_slice(dbias, cur + common.sum_to(dz5, tshape), start)


def bias_tile_rows(x: Array, i: Array, j: Array, cfg: TileConfig) -> Array:
  """Tile (i, j) of a bias/mask broadcast to the scores' layout [X, G·bq, bk]."""
  x = jnp.broadcast_to(bias_tile(x, i, j, cfg), cfg.head_dims + (cfg.bq, cfg.bk))
  return x.reshape(cfg.head_dims[0] * cfg.head_dims[1], cfg.head_dims[2] * cfg.bq, cfg.bk)


def valid_tile(mask: Array | None, i: Array, j: Array, cfg: TileConfig) -> Array | None:
  """Boolean tile broadcastable to [X, G·bq, bk], or None if every entry is valid."""
  if not cfg.needs_valid:
    return None
  valid = bias_tile_rows(mask, i, j, cfg) if cfg.has_mask else None
  if cfg.is_causal or cfg.pad_k:
    shape = (cfg.head_dims[2] * cfg.bq, cfg.bk)
    cols = j * cfg.bk + lax.broadcasted_iota(jnp.int32, shape, 1)
    c = None
    if cfg.is_causal:
      rows = i * cfg.bq + lax.broadcasted_iota(jnp.int32, shape, 0) % cfg.bq
      c = cols <= rows
    if cfg.pad_k:
      c = cols < cfg.s if c is None else c & (cols < cfg.s)
    valid = c if valid is None else valid & c
  return valid


def tile_positions(x0: Array, i: Array, j: Array, cfg: TileConfig) -> tuple[Array, ...]:
  """(b, h, q_idx, kv_idx) of tile (i, j) of a chunk whose first (batch, kv head) row is
  ``x0``: the flat batch, the query head and the global positions, int32 arrays broadcasting
  against the tile's [X, G·bq, bk]."""
  x_rows = cfg.head_dims[0] * cfg.head_dims[1]
  g = cfg.head_dims[2]
  xs = x0 + lax.broadcasted_iota(jnp.int32, (x_rows, 1, 1), 0)
  r = lax.broadcasted_iota(jnp.int32, (1, g * cfg.bq, 1), 1)
  b, h = xs // cfg.kv_heads, (xs % cfg.kv_heads) * g + r // cfg.bq
  cols = j * cfg.bk + lax.broadcasted_iota(jnp.int32, (1, 1, cfg.bk), 2)
  return b, h, i * cfg.bq + r % cfg.bq, cols


def row_heads(x0: Any, cfg: TileConfig) -> Array:
  """The query head of each (batch, kv head) row and query head of a chunk whose first row
  is ``x0``: int32 [X, G] (its [N] parameters, such as sinks, are gathered with it)."""
  x_rows, g = cfg.head_dims[0] * cfg.head_dims[1], cfg.head_dims[2]
  xs = x0 + lax.broadcasted_iota(jnp.int32, (x_rows, 1), 0)
  return (xs % cfg.kv_heads) * g + lax.broadcasted_iota(jnp.int32, (1, g), 1)


def structured_tile(smask: Any, x0: Array, i: Array, j: Array, cfg: TileConfig) -> Array:
  """A structured mask (:class:`attnx.core.masks.Mask`, bound) on tile (i, j) of a chunk
  whose first (batch, kv head) row is ``x0``: booleans broadcastable to [X, G·bq, bk]."""
  return smask.mask_mod(*tile_positions(x0, i, j, cfg))


def tile_valid(mask: Array | None, smask: Any, x0: Array, i: Array, j: Array, cfg: TileConfig,
               structured: bool) -> Array | None:
  """Tile (i, j)'s validity: :func:`valid_tile` and, where ``structured`` (and
  ``cfg.structured``), the structured mask's (:func:`structured_tile`)."""
  valid = valid_tile(mask, i, j, cfg)
  if cfg.structured and structured:
    st = structured_tile(smask, x0, i, j, cfg)
    valid = st if valid is None else valid & st
  return valid


def tile_kinds(smask: Any, x0: Array, cfg: TileConfig) -> Array:
  """How a chunk (first row ``x0``) meets every tile of a structured mask, [nq, nk] int32:
  0 no pair may attend (skip the tile), 1 every pair may (no elementwise mask needed), 2 some
  may — from the mask's :meth:`~attnx.core.masks.Mask.block_table`, never a T×S array."""
  nq, nk = cfg.num_q_blocks, cfg.num_k_blocks
  some, every = smask.block_table(cfg.bq, cfg.bk, nq, nk)
  x_rows, g = cfg.head_dims[0] * cfg.head_dims[1], cfg.head_dims[2]
  xs = x0 + jnp.arange(x_rows)

  def rows(table: Array) -> Array:  # [B|1, N|1, nq, nk] -> this chunk's [X, G, nq, nk]
    b = (xs // cfg.kv_heads if table.shape[0] > 1 else jnp.zeros_like(xs))[:, None]
    h = ((xs % cfg.kv_heads)[:, None] * g + jnp.arange(g) if table.shape[1] > 1
         else jnp.zeros((1, g), jnp.int32))
    return table[b, h]

  some_c = jnp.any(rows(some), axis=(0, 1))
  # A tile past the end of the keys holds padding, which is always masked.
  inside = (jnp.arange(nk) + 1) * cfg.bk <= cfg.s
  every_c = jnp.all(rows(every), axis=(0, 1)) & inside[None, :]
  return jnp.where(some_c, jnp.where(every_c, 1, 2), 0).astype(jnp.int32)


def tile_counts(smask: Any, cfg: TileConfig) -> dict[str, Any]:
  """How a kernel with ``cfg``'s tiles meets a bound structured mask over all its rows: the
  tiles ``(bq, bk)`` and how many it skips (no pair may attend for any head), runs without the
  elementwise mask (every pair may) and runs masked (:func:`attnx.core.explain` shows it)."""
  kinds = np.asarray(tile_kinds(smask, 0, cfg))
  return {"tiles": (cfg.bq, cfg.bk), "skipped": int((kinds == 0).sum()),
          "unmasked": int((kinds == 1).sum()), "masked": int((kinds == 2).sum())}


def kind_switch(kind: Array | None, skipped: Any, step: Any, *operands: Any,
                full_needs_mask: bool = False) -> Any:
  """A tile's work by its :func:`tile_kinds` ``kind``: ``skipped(*operands)`` (0, no pair may
  attend), ``step(*operands, False)`` (1, every pair may: no elementwise structured mask;
  ``step(*operands, True)`` still where ``full_needs_mask``, for a family that counts valid
  keys) or ``step(*operands, True)`` (2). ``kind`` None (no structured mask): the masked
  step. Only the tile's own terms belong in ``operands``: XLA copies a conditional's operands,
  so a [X, G, Tp, H] buffer there is copied on every call."""
  if kind is None:
    return step(*operands, True)
  return lax.switch(kind, [skipped, lambda *o: step(*o, full_needs_mask),
                           lambda *o: step(*o, True)], *operands)


def tile_scores(qi: Array, kj: Array, bias: Array | None, i: Array, j: Array, cfg: TileConfig,
                qk_mult: Array | None, bias_mult: float, mod: Any = None, x0: Any = 0) -> Array:
  """z = qk_mult · q·k + bias_mult · bias on one tile, [X, G·bq, bk] in the compute dtype
  (float32, or float64 for float64 inputs: :func:`attnx.core.contract.compute_dtype`). With
  a score modification (``cfg.score_mod``: ``mod`` the call's
  :class:`~attnx.core.score_mods.ScoreMod`, ``x0`` the chunk's first row) the tile is
  α·mod(scale·q·k, bias) instead (:func:`modded_tile`)."""
  z = _qk(qi, kj, qk_mult)
  if cfg.score_mod:
    bt = bias_tile_rows(bias, i, j, cfg).astype(z.dtype) if cfg.has_bias else None
    return _modded(z, bt, mod, tile_positions(x0, i, j, cfg), mod_alpha(cfg))
  if cfg.has_bias:
    bt = bias_tile_rows(bias, i, j, cfg).astype(z.dtype)
    z = z + (bt * bias_mult if bias_mult != 1.0 else bt)
  return z


def _qk(qi: Array, kj: Array, qk_mult: Array | None) -> Array:
  z = jnp.einsum("xqh,xsh->xqs", qi, kj, preferred_element_type=compute_dtype(qi.dtype))
  return z if qk_mult is None else z * qk_mult


def mod_alpha(cfg: TileConfig) -> float:
  """α of z = α·s for online-max weightings (``w.alpha``), which a score modification's tiles
  apply after the modification (without one, :func:`prescale` folds it into q)."""
  return cfg.w.alpha


def modded_tile(qi: Array, kj: Array, bias: Array | None, i: Array, j: Array, cfg: TileConfig,
                qk_mult: Array | None, mod: Any, x0: Any) -> tuple[Array, Any]:
  """The tile z = α·mod(scale·q·k, bias) under a score modification and its VJP:
  ``dz -> (d(scale·q·k), d(bias tile) or None, d(mod))`` — the score's cotangent for dQ and
  dK, the bias's for dbias, and the modification's parameters' (summed over tiles)."""
  zq = _qk(qi, kj, qk_mult)
  bt = bias_tile_rows(bias, i, j, cfg).astype(zq.dtype) if cfg.has_bias else None
  pos, alpha = tile_positions(x0, i, j, cfg), mod_alpha(cfg)
  # The VJP is taken where the raw score is finite: a NaN query or key (attnx.core.contract)
  # makes the tile NaN at its pairs, but the cap's or score_mod's derivative there would put
  # 0·NaN into the dQ and dK of the rows and keys that mask it. The tile keeps its NaN.
  zq_lin = jnp.where(jnp.isnan(zq), 0.0, zq)
  z, vjp = jax.vjp(lambda zq, bt, mod: _modded(zq, bt, mod, pos, alpha), zq_lin, bt, mod)
  return z + (zq - zq_lin), vjp


def extra_cotangents(cfg: TileConfig, extra: list, mod: Any, sinks: Any) -> tuple[Any, Any]:
  """(d mod, d sinks) in their inputs' dtypes from the gradients a kernel's backward appends
  after its own (the modification's when ``cfg.score_mod``, then the sinks' when
  ``cfg.sinks``); None for either the call does not have."""
  dmod = dsinks = None
  if cfg.score_mod:
    dmod = jax.tree.map(lambda d, p: d.astype(p.dtype), extra.pop(0), mod)
  if cfg.sinks:
    dsinks = extra.pop(0).astype(sinks.dtype)
  return dmod, dsinks


def _modded(zq: Array, bt: Array | None, mod: Any, pos: tuple[Array, ...], alpha: float) -> Array:
  z = mod.apply(zq, bt, *pos)
  return z * alpha if alpha != 1.0 else z


def k_range(i: Array, cfg: TileConfig) -> tuple[int, Any]:
  """Key blocks seen by query block i: all, or those not entirely above the diagonal."""
  if not cfg.is_causal or cfg.num_k_blocks == 1:
    return 0, cfg.num_k_blocks
  return 0, jnp.minimum(cfg.num_k_blocks, (i * cfg.bq + cfg.bq - 1) // cfg.bk + 1)


def q_range(j: Array, cfg: TileConfig) -> tuple[Any, int]:
  """Query blocks that see key block j (causal: i·bq + bq − 1 ≥ j·bk)."""
  if not cfg.is_causal or cfg.num_q_blocks == 1:
    return 0, cfg.num_q_blocks
  return jnp.minimum(cfg.num_q_blocks, (j * cfg.bk) // cfg.bq), cfg.num_q_blocks


def prescale(q: Array, scale: Array, cfg: TileConfig) -> tuple[Array, Array | None, float, float]:
  """Folds the score multiplier into q once (float32/float64) instead of into every tile.

  Returns (q', tile multiplier or None, bias multiplier, α) with z = α·s the exponent for
  online-max weightings (α = 1 otherwise).
  """
  # Under a score modification α multiplies the modified score (tile_scores), not q.
  alpha = cfg.w.alpha if not cfg.score_mod else 1.0
  c = scale * alpha
  if jnp.dtype(q.dtype).itemsize >= 4:
    return q * c, None, alpha, alpha
  return q, c, alpha, alpha  # low precision: keep q exact, scale the f32 tile


def check_tiling(q: Array, k: Array, cfg: TileConfig) -> None:
  """Trace-time guard: the kernels slice whole tiles, so padded lengths must be whole tiles.

  lax.dynamic_slice clamps a slice that runs past the end, which would silently read earlier
  rows instead of failing.
  """
  if q.shape[2] != cfg.num_q_blocks * cfg.bq or k.shape[1] != cfg.num_k_blocks * cfg.bk:
    raise AssertionError(
        f"blocked kernel: padded lengths (T {q.shape[2]}, S {k.shape[1]}) are not whole tiles "
        f"of ({cfg.bq}, {cfg.bk})")


def kernel_layout(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                  tp: int, sp: int) -> tuple[Array, Array, Array, Array | None, Array | None]:
  """[B, T, N, H] q and [B, S, K, H] k/v -> q [X, G, Tp, H], k/v [X, Sp, H] (X = B·K), zero
  padded to Tp, Sp; bias/mask [Bb, Kb, Gb, Tp|1, Sp|1] (a padded mask is False)."""
  b, t, n, h = q.shape
  _, s, kv_heads, _ = k.shape
  g = n // kv_heads
  q4 = common.pad_axis(q.transpose(0, 2, 1, 3).reshape(b * kv_heads, g, t, h), 2, tp)
  k3 = common.pad_axis(k.transpose(0, 2, 1, 3).reshape(b * kv_heads, s, h), 1, sp)
  v3 = common.pad_axis(v.transpose(0, 2, 1, 3).reshape(b * kv_heads, s, -1), 1, sp)
  return (q4, k3, v3) + bias_mask_layout(bias, mask, n, kv_heads, tp, sp)


def bias_mask_layout(bias: Array | None, mask: Array | None, num_heads: int, kv_heads: int,
                     tp: int, sp: int) -> tuple[Array | None, Array | None]:
  """A [B|1, N|1, T|1, S|1] bias and mask in the kernels' layout [Bb, Kb, Gb, Tp|1, Sp|1],
  padded to Tp, Sp (a padded mask is False)."""
  bias5 = common.as_5d(bias, num_heads, kv_heads, "bias")
  mask5 = common.as_5d(mask, num_heads, kv_heads, "mask")
  if bias5 is not None:
    bias5 = common.pad_axis(common.pad_axis(bias5, 3, tp, keep_one=True), 4, sp, keep_one=True)
  if mask5 is not None:
    mask5 = common.pad_axis(common.pad_axis(mask5, 3, tp, False, True), 4, sp, False, True)
  return bias5, mask5
