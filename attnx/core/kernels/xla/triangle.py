"""The causal triangle of the XLA blocked kernel: unmasked squares below the diagonal plus
small masked diagonal tiles, each level one batched call of the plain sweep (:mod:`.sweep`).

Causal attention costs about half of full attention this way, and nothing above the diagonal
is ever computed, in the forward or the backward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnx.core import streaming
from attnx.core.contract import compute_dtype
from attnx.core.kernels.xla import sizes, sweep
from attnx.core.kernels.xla import tiling as tl

Array = jax.Array

__all__ = ["causal_backward", "causal_forward"]


# --------------------------------------------------------------------------------------------
# Causal: the triangle as unmasked squares plus small masked diagonal tiles.
#
# The Tp = P·d queries and keys (P = 2^L leaves of d rows) split into
#   * level l = 0 … L−1: 2^l squares of side s = Tp / 2^(l+1); square m holds the queries
#     [(2m+1)s, (2m+2)s) and the keys [2m·s, (2m+1)s), all of them strictly below the diagonal,
#     so they run the plain (non-causal) kernel with tall tiles and no masking work. Squares
#     are not padded, so their tiles divide s (sizes.dividing_tile): a tile running past the end
#     would be clamped by dynamic_slice onto earlier keys, silently;
#   * the P diagonal d×d tiles, the only ones that are masked (causally).
# Together they cover exactly j ≤ i, and nothing above the diagonal is ever computed: Tp²/2 +
# Tp·d/2 scores of Tp². The squares of one level (and the diagonal tiles) are one call of the
# plain kernel, their piece axis folded into the batch, so each level is a few batched matmuls.
# The forward merges the unnormalized states of a row's pieces and normalizes once; the
# backward runs the plain backward on each piece with the row's final statistic (lse or l) and
# adds the gradients up. T ≠ S is reduced to T = S in blocked_attention (keys past T are never
# seen; rows past S see every key, a plain problem). Measured on one CPU core, the small pieces
# cost more per score than the large ones, so at T ≈ 1024 the time ratio causal/full stays
# above the operation ratio.
# --------------------------------------------------------------------------------------------

def _levels(cfg: tl.TileConfig) -> list[tuple[int, int]]:
  """(squares M, side s) of every level of the causal triangle, largest first."""
  p, d = cfg.num_diag_tiles, cfg.bq
  return [(1 << lv, p * d >> (lv + 1)) for lv in range(p.bit_length() - 1)]


def _pick_blocks(bias_or_mask: Array | None, m: int, parts: int, side: int, rp: int,
                 cp: int) -> Array | None:
  """[M, Bb, Kb, Gb, side|1, side|1]: block (m·parts + rp, m·parts + cp), m < M, of a
  [Bb, Kb, Gb, Tb, Sb] bias/mask whose T and S (or size-1) axes split into M·parts blocks."""
  if bias_or_mask is None:
    return None
  bb, kb, gb, tb, sb = bias_or_mask.shape
  if tb != 1 and sb != 1:
    ar = np.arange(m)
    grid = bias_or_mask.reshape(bb, kb, gb, m, parts, side, m, parts, side)
    return grid[:, :, :, ar, rp, :, ar, cp, :]
  if tb != 1:
    return jnp.moveaxis(bias_or_mask.reshape(bb, kb, gb, m, parts, side, 1)[:, :, :, :, rp], 3, 0)
  if sb != 1:
    return jnp.moveaxis(bias_or_mask.reshape(bb, kb, gb, 1, m, parts, side)[..., cp, :], 4, 0)
  return jnp.broadcast_to(bias_or_mask[None], (m,) + bias_or_mask.shape)


# Blocks go back with pads and stacks, never with .at[] (a scatter, slow on XLA CPU).
def _put_part(r: Array, y: Array, axis: int, p: int, add: bool) -> Array:
  """r with its part p along `axis` replaced by (or increased by) y (that axis dropped)."""
  parts = [lax.index_in_dim(r, i, axis, keepdims=False) for i in range(r.shape[axis])]
  parts[p] = parts[p] + y if add else y
  return jnp.stack(parts, axis=axis)


def _add_blocks(full: Array, blocks: Array, m: int, parts: int, side: int, rp: int,
                cp: int) -> Array:
  """Adds the [M, ...] blocks of :func:`_pick_blocks` back into `full` (a bias gradient)."""
  bb, kb, gb, tb, sb = full.shape
  if tb != 1 and sb != 1:
    # Block m on the diagonal of an [M, side, M, side] grid, then padded into its part. A
    # select, not a product with the identity: 0·NaN would carry a NaN row's gradient to the
    # blocks off the diagonal (keys it never attends).
    on_diag = jnp.eye(m, dtype=jnp.bool_)[:, None, :, None]  # [M, 1, M, 1]
    y = jnp.where(on_diag, jnp.moveaxis(blocks, 0, 3)[..., None, :], jnp.zeros((), blocks.dtype))
    y = y.reshape(bb, kb, gb, m, 1, side, m, 1, side)
    y = jnp.pad(y, [(0, 0)] * 4 + [(rp, parts - 1 - rp)] + [(0, 0)] * 2
                + [(cp, parts - 1 - cp), (0, 0)])
    return full + y.reshape(full.shape)
  if tb != 1:
    y = full.reshape(bb, kb, gb, m, parts, side, 1)
    return _put_part(y, jnp.moveaxis(blocks, 0, 3), 4, rp, True).reshape(full.shape)
  if sb != 1:
    y = full.reshape(bb, kb, gb, 1, m, parts, side)
    return _put_part(y, jnp.moveaxis(blocks, 0, 4), 5, cp, True).reshape(full.shape)
  return full + jnp.sum(blocks, axis=0)


def _q_part(x: Array, m: int, parts: int, side: int, p: int) -> Array:
  """[X, G, Tp, ...] -> [M, X, G, side, ...]: query rows of block (m·parts + p), m < M."""
  y = x.reshape(x.shape[:2] + (m, parts, side) + x.shape[3:])[:, :, :, p]
  return jnp.moveaxis(y, 2, 0)


def _q_unpart(y: Array, full: Array, m: int, parts: int, side: int, p: int,
              add: bool = False) -> Array:
  """Writes (or adds) the [M, X, G, side, ...] rows of :func:`_q_part` into `full`."""
  r = full.reshape(full.shape[:2] + (m, parts, side) + full.shape[3:])
  return _put_part(r, jnp.moveaxis(y, 0, 2), 3, p, add).reshape(full.shape)


def _k_part(x: Array, m: int, parts: int, side: int, p: int) -> Array:
  """[X, Sp, ...] -> [M, X, side, ...]: key rows of block (m·parts + p), m < M."""
  y = x.reshape(x.shape[:1] + (m, parts, side) + x.shape[2:])[:, :, p]
  return jnp.moveaxis(y, 1, 0)


def _k_unpart(y: Array, full: Array, m: int, parts: int, side: int, p: int) -> Array:
  r = full.reshape(full.shape[:1] + (m, parts, side) + full.shape[2:])
  return _put_part(r, jnp.moveaxis(y, 0, 1), 2, p, True).reshape(full.shape)


def _piece_cfg(cfg: tl.TileConfig, m: int, side: int, causal: bool, raw: bool) -> tl.TileConfig:
  """The cfg of M side×side pieces run as one problem of batch M·B (see :func:`_pieces`)."""
  if causal:
    bq = bk = side
  else:
    # Pieces are not padded, so their tiles must divide the side: a last tile running past the
    # end would be clamped by dynamic_slice onto earlier keys/queries (wrong, not an error).
    bq, bk = sizes.default_block_sizes(side, side, cfg.head_dims[2])
    bq = sizes.dividing_tile(side, min(bq, cfg.user_bq or bq))
    bk = sizes.dividing_tile(side, min(bk, cfg.user_bk or bk))
  b, kv_heads, g = cfg.head_dims
  return dataclasses.replace(
      cfg, t=side, s=side, bq=bq, bk=bk, is_causal=causal, raw=raw, full_num_keys=cfg.num_keys,
      num_diag_tiles=0, head_dims=(m * b, kv_heads, g),
      heads_in_chunk=sizes.heads_per_chunk(m * b, kv_heads, g, bq, bk))


def _fold_pieces(bias_or_mask: Array | None, b: int) -> tuple[Array | None, str]:
  """[M, Bb, ...] piece blocks of a bias/mask -> [M·Bb', ...] rows of batch M·B (and how)."""
  if bias_or_mask is None:
    return None, ""
  m, bb = bias_or_mask.shape[:2]
  if bb == b or m == 1:  # piece m, batch i -> row m·B + i; or one piece (Bb = 1 broadcasts)
    return bias_or_mask.reshape((m * bb,) + bias_or_mask.shape[2:]), "fold"
  if bias_or_mask.shape[-2:] == (1, 1):  # the same block for every piece: Bb = 1 broadcasts as is
    return bias_or_mask[0], "same"
  rest = bias_or_mask.shape[2:]
  return jnp.broadcast_to(bias_or_mask, (m, b) + rest).reshape((m * b,) + rest), "bcast"


def _unfold_pieces(dx: Array, how: str, m: int) -> Array:
  """The gradient of :func:`_fold_pieces`'s result -> [M or 1, Bb, ...] (piece blocks)."""
  if how == "same":
    return dx[None]
  dx = dx.reshape((m, -1) + dx.shape[1:])
  return jnp.sum(dx, axis=1, keepdims=True) if how == "bcast" else dx


def _pieces(fn, cfg: tl.TileConfig, m: int, q, k, v, bias, mask, *rows):
  """Runs ``fn(q, k, v, bias, mask, *rows)`` on M pieces at once, the piece axis folded into
  the batch (rows of X = M·B·K); results come back as [M, X, ...]. No vmap: batching the
  kernels' dynamic slices and updates would turn them into gathers and scatters."""
  b = cfg.head_dims[0] // m  # the problem's batch (cfg is the pieces' cfg, of batch M·B)
  flat = lambda a: a.reshape((-1,) + a.shape[2:])
  bias_f, how = _fold_pieces(bias, b)
  mask_f, _ = _fold_pieces(mask, b)
  out = fn(flat(q), flat(k), flat(v), bias_f, mask_f, *(flat(r) for r in rows))
  unflat = lambda a: a.reshape((m, -1) + a.shape[1:])
  return out, unflat, how


def causal_forward(q, k, v, bias, mask, scale, cfg: tl.TileConfig):
  """The causal forward (T = S = P·d): O [X, G, Tp, Hv] and the row statistic [X, G, Tp]."""
  p, d = cfg.num_diag_tiles, cfg.bq

  def run(m, side, rp, cp, parts, causal):
    c = _piece_cfg(cfg, m, side, causal=causal, raw=True)
    (acc, st), unflat, _ = _pieces(
        lambda q, k, v, b, mk: sweep.forward(q, k, v, b, mk, scale, c), c, m,
        _q_part(q, m, parts, side, rp), _k_part(k, m, parts, side, cp),
        _k_part(v, m, parts, side, cp), _pick_blocks(bias, m, parts, side, rp, cp),
        _pick_blocks(mask, m, parts, side, rp, cp))
    return unflat(acc), unflat(st)

  acc_d, st_d = run(p, d, 0, 0, 1, True)
  acc = jnp.moveaxis(acc_d, 0, 2).reshape(q.shape[:3] + acc_d.shape[-1:])
  st = jnp.moveaxis(st_d, 0, 2).reshape(q.shape[:3])
  for m, side in _levels(cfg):
    acc_l, st_l = run(m, side, 1, 0, 2, False)
    rows = (_q_part(acc, m, 2, side, 1), _q_part(st, m, 2, side, 1))
    acc_r, st_r = streaming.pointwise_merge(cfg.w, rows, (acc_l, st_l))
    acc = _q_unpart(acc_r, acc, m, 2, side, 1)
    st = _q_unpart(st_r, st, m, 2, side, 1)
  return streaming.pointwise_finalize(cfg.w, acc, st, split_lse=True)


def causal_backward(q, k, v, bias, mask, scale, out, stat, do, cfg: tl.TileConfig,
                    dres: Array | None = None):
  """The causal backward: the plain backward of every piece with the rows' final statistic
  (``dres``: the cotangent of the rows' log normalizer, as :func:`.sweep.backward`'s)."""
  p, d = cfg.num_diag_tiles, cfg.bq
  cd = compute_dtype(q.dtype)

  def run(m, side, rp, cp, parts, causal):
    c = _piece_cfg(cfg, m, side, causal=causal, raw=False)
    qp = lambda a: _q_part(a, m, parts, side, rp)
    kp = lambda a: _k_part(a, m, parts, side, cp)
    (dq, dk, dv, db, ds), unflat, how = _pieces(
        lambda q, k, v, b, mk, o, st, g, *r: sweep.backward(q, k, v, b, mk, scale, o, st, g, c,
                                                            dres=r[0] if r else None), c, m,
        qp(q), kp(k), kp(v), _pick_blocks(bias, m, parts, side, rp, cp),
        _pick_blocks(mask, m, parts, side, rp, cp), qp(out), qp(stat), qp(do),
        *(() if dres is None else (qp(dres),)))
    return (unflat(dq), unflat(dk), unflat(dv), None if db is None else _unfold_pieces(db, how, m),
            ds)

  dq_d, dk_d, dv_d, db_d, ds_d = run(p, d, 0, 0, 1, True)
  dq = jnp.moveaxis(dq_d, 0, 2).reshape(q.shape).astype(cd)
  dk = jnp.moveaxis(dk_d, 0, 1).reshape(k.shape).astype(cd)
  dv = jnp.moveaxis(dv_d, 0, 1).reshape(v.shape).astype(cd)
  dbias = _add_blocks(jnp.zeros(bias.shape, cd), db_d, p, 1, d, 0, 0) if cfg.has_bias else None
  dscale = jnp.sum(ds_d)
  for m, side in _levels(cfg):
    dq_l, dk_l, dv_l, db_l, ds_l = run(m, side, 1, 0, 2, False)
    dq = _q_unpart(dq_l, dq, m, 2, side, 1, add=True)
    dk = _k_unpart(dk_l, dk, m, 2, side, 0)
    dv = _k_unpart(dv_l, dv, m, 2, side, 0)
    if cfg.has_bias:
      dbias = _add_blocks(dbias, db_l, m, 2, side, 1, 0)
    dscale = dscale + jnp.sum(ds_l)
  return dq, dk, dv, dbias, dscale
