"""Flash-style blocked attention for the whole-row weightings (SSMax, softpick, stick-breaking,
sparsemax, entmax) with O(T) memory, in XLA (any backend).

The kernel walks query blocks and, for each, the key tiles its rows can see (causal: the tiles
not entirely above the diagonal), keeping per row the streaming state of the weighting's family
(:mod:`attnx.core.streaming`): the T×S scores and weights never exist. Sparsemax and entmax
first find each row's threshold τ with a few passes over the same key tiles, then make one
output pass; the key tiles in which every weight of the query block is zero (every x ≤ τ) are
left out of the later passes and of the backward (``lax.cond``, AdaSplash's block skipping), found
from each tile's row max, which the first pass records. Stick-breaking visits the tiles from the
last key backwards.

The backward pass is a ``jax.custom_vjp`` that recomputes the tiles: key tiles outside (dK,
dV of a tile stay in the carry; stick-breaking walks them from the last key backwards, carrying
per row the remaining stick and Σ A·dP of the keys already visited), query blocks inside (dQ
and the per-row carries are updated in place). Saved: the output, one to three row statistics,
and for entmax Σu·v/Σu — O(T·H) memory.

SSMax on full rows without a bias, in float32 or float64, is softmax of (c_i·q_i)·k and runs in the
pointwise kernel of :mod:`attnx.core.kernels.xla.pointwise` (:func:`_ssmax_as_softmax`); causal,
with a bias or with 16-bit inputs, here.

Layout, masks, padding and chunks of heads are those of :mod:`attnx.core.kernels.xla.pointwise`; the
tiles are chosen per family (:func:`causal_block_sizes`, measured).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import masks
from attnx.core import residuals as residuals_lib
from attnx.core import streaming as st
from attnx.core.contract import compute_dtype, finite, nonfinite_inputs
from attnx.core.kernels import common
from attnx.core.kernels.xla import pointwise as bl
from attnx.core.kernels.xla import sizes, sweep
from attnx.core.kernels.xla import tiling as tl
from attnx.core.weightings import RowNormalizer, get_weighting

Array = jax.Array
F32 = jnp.float32

# Causal tiles (block_q, block_k): query blocks short enough that the tiles above the diagonal
# are skipped; stick-breaking, whose tiles hold the most intermediates, takes fewer keys a tile
# and shorter query blocks below T = 2048 (measured: docs/guides/benchmarks.md, "The kernels'
# constants").
CAUSAL_BLOCK_Q = 512
BLOCK_K = 512
STICK_BLOCK_K = 256
STICK_SHORT_BLOCK_Q, STICK_SHORT_T = 256, 2048
# The families whose tiles differ from those defaults: their key tiles, and (query block,
# length below which it applies) of their causal query blocks.
FAMILY_BLOCK_K = {"stick_breaking": STICK_BLOCK_K}
FAMILY_SHORT_BLOCK_Q = {"stick_breaking": (STICK_SHORT_BLOCK_Q, STICK_SHORT_T)}

__all__ = ["BLOCK_K", "CAUSAL_BLOCK_Q", "FAMILY_BLOCK_K", "FAMILY_SHORT_BLOCK_Q", "STICK_BLOCK_K",
           "block_grads", "blocked_row_attention", "causal_block_sizes", "mask_tile_counts",
           "raw_block_state",
           "streams", "structured_counts", "threshold_passes", "zero_tiles"]


def streams(weighting: Any) -> bool:
  """Whether ``weighting`` is a whole-row weighting this kernel runs."""
  return isinstance(weighting, RowNormalizer) and weighting.stream is not None


def _valid(z: Array, mask, smask, x0, i, j, cfg: tl.TileConfig, structured: bool) -> Array:
  """Tile (i, j)'s valid keys, [X, G·bq, bk]: the dense mask's, the structured mask's (where
  ``structured``: a tile every pair of which may attend leaves it out), and a finite score (a
  score of −∞ is a masked key; NaN stays valid: the row is NaN)."""
  valid = tl.tile_valid(mask, smask, x0, i, j, cfg, structured)
  finite = z != -jnp.inf
  return finite if valid is None else valid & finite


def _tiles(q, k, v, bias, mask, i, cfg: tl.TileConfig, qk_mult, bias_mult, smask=None, x0=0,
           mod=None):
  """tile(j, structured=True) -> (z [X, G·bq, bk] in the compute dtype, valid, v tile) of
  query block i (``mod``: the score modification of ``cfg.score_mod``)."""
  qi = tl.row_block(q, i, cfg)

  def tile(j, structured=True):
    kj, vj = tl.slice_along(k, j * cfg.bk, cfg.bk, 1), tl.slice_along(v, j * cfg.bk, cfg.bk, 1)
    z = tl.tile_scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult, mod, x0)
    return z, _valid(z, mask, smask, x0, i, j, cfg, structured), vj

  return tile


def _fold(tile, lo, hi, fn, init, reverse: bool = False, zero: Array | None = None,
          kinds: Array | None = None, sink: tuple[Array, Array, Array] | None = None):
  """Folds fn(carry, z, valid, v) over key tiles [lo, hi), last tile first if reverse.

  ``zero`` ([num_k_blocks] bool) marks tiles to leave out: their scores are never computed
  (``lax.cond`` runs only the taken branch). ``kinds`` ([num_k_blocks] int32): the query
  block's row of a structured mask's tile kinds (:func:`attnx.core.kernels.xla.tiling.kind_switch`).
  ``sink``: the (z, valid, v) of the attention sink (:func:`_sink_tile`), folded in first, a
  key before the row's keys (never with ``reverse``: stick-breaking takes no sink).
  """
  if sink is not None:
    init = fn(init, *sink)
  def body(r, c):
    j = hi - 1 - r if reverse else lo + r
    visit = lambda c: tl.kind_switch(None if kinds is None else kinds[j], lambda c: c,
                                     lambda c, structured: fn(c, *tile(j, structured)), c)
    if zero is None:
      return visit(c)
    return lax.cond(zero[j], lambda c: c, visit, c)
  return lax.fori_loop(0, hi - lo, body, init)


def _k_bounds(i, cfg: tl.TileConfig, span) -> tuple[Any, Any]:
  """The key tiles query block i visits: under a structured mask the span of its tiles that
  are not skipped (``span``: :func:`attnx.core.kernels.xla.tiling.tile_span` along keys),
  else all (causal: those not entirely above the diagonal)."""
  return tl.k_range(i, cfg) if span is None else (span[0][i], span[1][i])


def _entmax_threshold_skipping(tile, i, lo, hi, rows: tuple[int, ...], cfg: tl.TileConfig,
                               dtype: Any = F32, kinds: Array | None = None,
                               sink: tuple[Array, Array, Array] | None = None
                               ) -> tuple[st.Threshold, Array]:
  """τ of a query block (:func:`attnx.core.streaming.entmax_threshold`) with zero tiles left
  out of the passes, and which tiles are zero at the final τ ([num_k_blocks] bool).

  Pass 1 (the row max) also records each tile's max of x per row, [num_k_blocks, rows] (one
  float per row and key tile, O(T·S/bk) for the block, like one tile of bk = S/num_k_blocks
  scores): the test of a tile at any τ then needs no second QKᵀ. A tile whose every x is at or
  below the threshold of every row adds exact zeros to the sums of a pass, to the output and to
  the gradients (:func:`attnx.core.streaming.entmax_zero_tiles`). Tiles not visited (above the
  causal diagonal, or skipped by a structured mask: ``kinds`` as in :func:`_fold`) keep a
  max of −∞ and count as zero.

  The padding rows of a ragged last query block (q = 0: every key in their support) would
  keep every tile of that block: they are made empty rows here instead (no key, done at once).
  Their outputs are cut off, and their zero dO gives their finite weights no gradient.
  """
  rs = cfg.w.stream
  num_k_blocks = cfg.num_k_blocks

  def max_body(r, c):
    j = lo + r

    def step(c, structured):
      z, valid, _ = tile(j, structured)
      m, n, table = c
      tile_max = st.entmax_tile_max(z, valid, rs)
      return (jnp.maximum(m, tile_max), n + jnp.sum(valid, axis=-1, dtype=dtype),
              lax.dynamic_update_index_in_dim(table, tile_max, j, 0))

    return tl.kind_switch(None if kinds is None else kinds[j], lambda c: c, step, c)

  init = (jnp.full(rows, -jnp.inf, dtype), jnp.zeros(rows, dtype),
          jnp.full((num_k_blocks,) + rows, -jnp.inf, dtype))
  if sink is not None:  # the sink is a key of every row (never a zero tile)
    init = (st.entmax_tile_max(sink[0], sink[1], rs), jnp.ones(rows, dtype), init[2])
  m, n, table = lax.fori_loop(0, hi - lo, max_body, init)
  if cfg.num_q_blocks * cfg.bq != cfg.t:
    real = i * cfg.bq + jnp.arange(rows[-1]) % cfg.bq < cfg.t  # [G·bq]: not a padding row
    n = jnp.where(real, n, 0.0)
    table = jnp.where(real, table, -jnp.inf)

  def sums_pass(fn, init, m_row, tau):
    return _fold(tile, lo, hi, lambda c, z, ok, _: fn(c, z, ok), init,
                 zero=st.entmax_zero_tiles(table, m_row, tau), kinds=kinds, sink=sink)

  def tile_pass(fn, init):  # unused: both passes entmax_threshold makes are the hooks above
    return _fold(tile, lo, hi, lambda c, z, ok, _: fn(c, z, ok), init, kinds=kinds, sink=sink)

  th = st.entmax_threshold(tile_pass, rows, rs, row_max=(m, n), sums_pass=sums_pass,
                           dtype=dtype)
  return th, st.entmax_zero_tiles(table, th.m, th.tau)


def _sink_tile(sinks: Array, x0: Any, cfg: tl.TileConfig, cd: Any,
               hv: int) -> tuple[Array, Array, Array]:
  """The attention sink as a tile of one key for the rows of a query block of a chunk (first
  row ``x0``): its scores sinks[h] [X, G·bq, 1], always valid, and a zero value [X, 1, Hv]."""
  z = jnp.repeat(sinks.astype(cd)[tl.row_heads(x0, cfg)], cfg.bq, axis=1)[..., None]
  return z, jnp.ones(z.shape, bool), jnp.zeros((z.shape[0], 1, hv), cd)


def _keeps_u_sum(cfg: tl.TileConfig) -> bool:
  """Whether the forward keeps entmax's Σu per row as one more statistic (for the residual's
  gradient: :func:`attnx.core.streaming.residual_delta`)."""
  return cfg.residual and cfg.w.stream.needs_threshold


def _num_stats(cfg: tl.TileConfig) -> int:
  return cfg.w.stream.num_stats + int(_keeps_u_sum(cfg))


def _forward_chunk(q, k, v, bias, mask, row_scales, scale, cfg: tl.TileConfig, skip: bool,
                   smask: Any = None, x0: Any = 0, mod: Any = None, sinks: Any = None):
  """(O [x, G, Tp, Hv], row statistics, Σu·v/Σu or None, max threshold passes, zero tiles) of
  a chunk (whose first row is ``x0``; ``smask``: the bound structured mask of
  ``cfg.structured``, evaluated per tile, its empty tiles skipped).

  With ``skip`` (entmax family only), key tiles that are all zero for every row of a query
  block are left out of the threshold passes after the first and of the output pass; the last
  result is then the [num_q_blocks, num_k_blocks] table of the tiles the output pass left out
  (the backward leaves out the same), else None.
  """
  rs = cfg.w.stream
  tl.check_tiling(q, k, cfg)
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  rows = (x, g * cfg.bq)
  cd = compute_dtype(q.dtype)
  q, qk_mult, bias_mult, _ = tl.prescale(q, scale, cfg)
  skip = skip and rs.needs_threshold
  kinds = tl.tile_kinds(smask, x0, cfg) if cfg.structured else None
  span = None if kinds is None else tl.tile_span(kinds, 1)
  sink = _sink_tile(sinks, x0, cfg, cd, hv) if cfg.sinks else None

  def q_block(i, carry):
    out, stats, support_mean, passes, zero_table = carry
    tile = _tiles(q, k, v, bias, mask, i, cfg, qk_mult, bias_mult, smask, x0, mod)
    row_kinds = None if kinds is None else kinds[i]
    lo, hi = _k_bounds(i, cfg, span)
    ctx = tl.row_block(row_scales, i, cfg) if rs.needs_row_scale else None
    zero = None
    if skip:
      ctx, zero = _entmax_threshold_skipping(tile, i, lo, hi, rows, cfg, cd, row_kinds, sink)
      passes = jnp.maximum(passes, ctx.passes)
      zero_table = lax.dynamic_update_index_in_dim(zero_table, zero, i, 0)
    elif rs.needs_threshold:
      ctx = st.entmax_threshold(
          lambda fn, init: _fold(tile, lo, hi, lambda c, z, ok, _: fn(c, z, ok), init,
                                 kinds=row_kinds, sink=sink), rows, rs, dtype=cd)
      passes = jnp.maximum(passes, ctx.passes)
    state = _fold(tile, lo, hi, lambda c, z, ok, vj: st.update(rs, c, z, ok, vj, ctx),
                  st.init(rs, rows, hv, cd), rs.reverse, zero, row_kinds, sink)
    o, row_stats, sm = st.finalize(rs, state, ctx)
    if _keeps_u_sum(cfg):
      row_stats += (state.u_sum,)
    put = lambda buf, a: tl.put_row_block(buf, a, i, cfg)
    stats = tuple(put(buf, a) for buf, a in zip(stats, row_stats, strict=True))
    return (put(out, o), stats, support_mean if sm is None else put(support_mean, sm), passes,
            zero_table)

  init = (jnp.zeros((x, g, tp, hv), cd), tuple(jnp.zeros((x, g, tp), cd)
                                             for _ in range(_num_stats(cfg))),
          jnp.zeros((x, g, tp, hv), cd) if rs.saves_support_mean else None, jnp.int32(0),
          jnp.zeros((cfg.num_q_blocks, cfg.num_k_blocks), bool) if skip else None)
  return lax.fori_loop(0, cfg.num_q_blocks, q_block, init)


def _backward_chunk(q, k, v, bias, mask, row_scales, scale, out, stats, support_mean, do,
                    zero, cfg: tl.TileConfig, carry0: tuple[Array, Array] | None = None,
                    both_carries: bool = False, smask: Any = None, x0: Any = 0,
                    mod: Any = None, sinks: Any = None, ddelta: Any = None):
  """(dq, dk, dv, dbias, drow_scales, dscale) of a chunk (first row ``x0``; ``smask`` as in
  :func:`_forward_chunk`: its skipped tiles add nothing to any gradient or grad carry).

  ``zero``: None, or the forward's [num_q_blocks, num_k_blocks] table of all-zero tiles, which
  add exact zeros to every gradient and are left out, in query blocks whose dO is finite (a
  NaN or Inf in dO makes even a zero weight's products NaN, as autodiff of the dense weights).
  ``carry0``: the per-row grad carries ([X, G, Tp] each, :class:`attnx.core.streaming.
  GradCarry`) left by key blocks of the same rows visited before this chunk's keys (ring
  attention; default zeros); ``both_carries``: return (carry_a, carry_b) in the place of
  drow_scales, for the next block. ``ddelta``: None, or what joins δ for the residual's
  cotangent (:func:`attnx.core.streaming.residual_delta`).
  """
  rs = cfg.w.stream
  tl.check_tiling(q, k, cfg)
  cd = compute_dtype(q.dtype)
  q_raw = q
  q, qk_mult, bias_mult, alpha = tl.prescale(q, scale, cfg)
  # dS·K and dSᵀ·Q take finite copies (attnx.core.contract): 0·NaN at masked pairs.
  q_f, k_f = finite(q), finite(k)
  delta = jnp.sum(do.astype(cd) * (support_mean if rs.saves_support_mean else out), axis=-1)
  if ddelta is not None:
    delta = delta + ddelta
  bias_shape = bias.shape if cfg.has_bias else None
  axes = sweep.manual_axes(q, k, v, bias, mask, row_scales, out, do)
  block_rows = lambda a, i: tl.row_block(a, i, cfg)
  if zero is not None:
    do_blocks = do.reshape(do.shape[:2] + (cfg.num_q_blocks, cfg.bq) + do.shape[3:])
    zero = zero & jnp.all(jnp.isfinite(do_blocks), axis=(0, 1, 3, 4))[:, None]
  kinds = tl.tile_kinds(smask, x0, cfg) if cfg.structured else None
  span = None if kinds is None else tl.tile_span(kinds, 0)
  # The cotangent of a score modification's parameters, summed over the tiles (or nothing).
  mod_zeros = [jax.tree.map(jnp.zeros_like, mod)] if cfg.score_mod else []

  def k_block(r, carry):
    j = cfg.num_k_blocks - 1 - r if rs.reverse else r
    kj, vj = tl.slice_along(k, j * cfg.bk, cfg.bk, 1), tl.slice_along(v, j * cfg.bk, cfg.bk, 1)
    kj_f = tl.slice_along(k_f, j * cfg.bk, cfg.bk, 1)

    def masked_tile_terms(i, dk_j, dv_j, carry_a, carry_b, structured):
      """Tile (i, j): dK and dV of key block j with its terms added, its dQ term
      [X, G·bq, H], dz (for dbias), the grad carries of its rows and with a score
      modification the tile's cotangent of ``mod``."""
      qi, doi = tl.row_block(q, i, cfg), tl.row_block(do, i, cfg)
      if cfg.score_mod:
        z, mod_vjp = tl.modded_tile(qi, kj, bias, i, j, cfg, qk_mult, mod, x0)
      else:
        z = tl.tile_scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult)
      valid = _valid(z, mask, smask, x0, i, j, cfg, structured)
      dp = jnp.einsum("xqd,xsd->xqs", doi, vj, preferred_element_type=cd)
      ctx = block_rows(row_scales, i) if rs.needs_row_scale else None
      p, dz, gc = st.tile_grad(rs, z, valid, dp, tuple(block_rows(a, i) for a in stats),
                               block_rows(delta, i), st.GradCarry(carry_a, carry_b), ctx,
                               weights_dtype=v.dtype)
      dv_j = dv_j + jnp.einsum("xqs,xqd->xsd", p.astype(doi.dtype), doi,
                               preferred_element_type=cd)
      extra, dz_bias = (), dz
      if cfg.score_mod:  # through the modification: dz of scale·q·k, of the bias, of mod
        dz, dz_bias, dmod_tile = mod_vjp(dz)
        extra = (dmod_tile,)
      dzc = dz.astype(qi.dtype)
      dk_j = dk_j + jnp.einsum("xqs,xqh->xsh", dzc, tl.row_block(q_f, i, cfg),
                               preferred_element_type=cd)
      dq_i = jnp.einsum("xqs,xsh->xqh", dzc, kj_f, preferred_element_type=cd)
      return (dk_j, dv_j, dq_i, dz_bias if cfg.has_bias else None, gc, *extra)

    def tile_terms(i, dk_j, dv_j, carry_a, carry_b):
      """:func:`masked_tile_terms` of a tile of the structured mask's kind (a skipped tile:
      zero dQ and dz terms, dK, dV and the carries unchanged); the dQ and dbias buffers stay
      outside the switch."""
      def leave_out(dk_j, dv_j, carry_a, carry_b):
        rows = (q.shape[0], q.shape[1] * cfg.bq)
        return (dk_j, dv_j, jnp.zeros(rows + q.shape[-1:], cd),
                jnp.zeros(rows + (cfg.bk,), cd) if cfg.has_bias else None,
                st.GradCarry(carry_a, carry_b), *mod_zeros)

      return tl.kind_switch(None if kinds is None else kinds[i, j], leave_out,
                            lambda *c: masked_tile_terms(i, *c), dk_j, dv_j, carry_a, carry_b)

    def add_dbias(dbias, dz, i):
      return tl.add_bias_grad_tile(dbias, dz, i, j, cfg)

    def q_block(i, c):
      dq, dk_j, dv_j, dbias, carry_a, carry_b, *dmod = c
      dk_j, dv_j, dq_i, dz, gc, *dmod_tile = tile_terms(i, dk_j, dv_j, block_rows(carry_a, i),
                                                        block_rows(carry_b, i))
      dq = tl.put_row_block(dq, block_rows(dq, i) + dq_i, i, cfg)
      carry_a = tl.put_row_block(carry_a, gc.a, i, cfg)
      carry_b = tl.put_row_block(carry_b, gc.b, i, cfg)
      if cfg.has_bias:
        dbias = add_dbias(dbias, dz, i)
      return dq, dk_j, dv_j, dbias, carry_a, carry_b, *jax.tree.map(jnp.add, dmod, dmod_tile)

    def skipping_q_block(i, c):
      # Only the tile's own terms sit inside the cond: with the [X, G, Tp, H] dQ (or dbias)
      # buffer in its operands XLA copies the buffer on every call. A zero tile adds zeros to
      # dQ and dbias (exact: they start at +0, and x + 0 = x). Entmax has no grad carries.
      dq, dk_j, dv_j, dbias, carry_a, carry_b, *dmod = c

      def compute(dk_j, dv_j):
        dk_j, dv_j, dq_i, dz, _, *dmod_tile = tile_terms(i, dk_j, dv_j, None, None)
        return dk_j, dv_j, dq_i, dz, *dmod_tile

      def leave_out(dk_j, dv_j):
        rows = (q.shape[0], q.shape[1] * cfg.bq)
        return (dk_j, dv_j, jnp.zeros(rows + q.shape[-1:], cd),
                jnp.zeros(rows + (cfg.bk,), cd) if cfg.has_bias else None, *mod_zeros)

      dk_j, dv_j, dq_i, dz, *dmod_tile = lax.cond(zero[i, j], leave_out, compute, dk_j, dv_j)
      dq = tl.put_row_block(dq, block_rows(dq, i) + dq_i, i, cfg)
      if cfg.has_bias:
        dbias = add_dbias(dbias, dz, i)
      return dq, dk_j, dv_j, dbias, carry_a, carry_b, *jax.tree.map(jnp.add, dmod, dmod_tile)

    body = q_block if zero is None else skipping_q_block
    dq, dk_all, dv_all, dbias, carry_a, carry_b, *dmod = carry
    dk0 = jnp.zeros((k.shape[0], cfg.bk, k.shape[-1]), cd)
    dv0 = jnp.zeros((v.shape[0], cfg.bk, v.shape[-1]), cd)
    lo, hi = tl.q_range(j, cfg) if span is None else (span[0][j], span[1][j])
    dq, dk_j, dv_j, dbias, carry_a, carry_b, *dmod = lax.fori_loop(
        lo, hi, body, (dq, *sweep.vary((dk0, dv0), axes), dbias, carry_a, carry_b, *dmod))
    dk_all = lax.dynamic_update_slice_in_dim(dk_all, dk_j, j * cfg.bk, axis=1)
    dv_all = lax.dynamic_update_slice_in_dim(dv_all, dv_j, j * cfg.bk, axis=1)
    return dq, dk_all, dv_all, dbias, carry_a, carry_b, *dmod

  rows0 = jnp.zeros(q.shape[:3], cd)
  carry_a0, carry_b0 = (rows0, rows0) if carry0 is None else carry0
  init = (jnp.zeros(q.shape, cd), jnp.zeros(k.shape, cd), jnp.zeros(v.shape, cd),
          jnp.zeros(bias_shape, cd) if cfg.has_bias else jnp.zeros((), cd), carry_a0, carry_b0)
  init = sweep.vary(init + tuple(mod_zeros), axes)
  dq_z, dk_z, dv, dbias_z, carry_a, carry_b, *dmod = lax.fori_loop(0, cfg.num_k_blocks, k_block,
                                                                   init)
  if cfg.sinks:  # the sink, a key of zero value (dP = 0) in every row: d sinks and the carries
    z_s, valid_s, _ = _sink_tile(sinks, x0, cfg, cd, v.shape[-1])
    heads = tl.row_heads(x0, cfg)

    def sink_block(i, c):
      carry_a, carry_b, dsinks = c
      ctx = block_rows(row_scales, i) if rs.needs_row_scale else None
      _, dz, gc = st.tile_grad(rs, z_s, valid_s, jnp.zeros(z_s.shape, cd),
                               tuple(block_rows(a, i) for a in stats), block_rows(delta, i),
                               st.GradCarry(block_rows(carry_a, i), block_rows(carry_b, i)),
                               ctx, weights_dtype=v.dtype)
      per_head = jnp.sum(dz.reshape(heads.shape + (cfg.bq,)), axis=-1)  # [X, G]
      dsinks = dsinks.at[heads.reshape(-1)].add(per_head.reshape(-1).astype(dsinks.dtype))
      return (tl.put_row_block(carry_a, gc.a, i, cfg), tl.put_row_block(carry_b, gc.b, i, cfg),
              dsinks)

    carry_a, carry_b, dsinks = lax.fori_loop(
        0, cfg.num_q_blocks, sink_block, (carry_a, carry_b, jnp.zeros(sinks.shape, cd)))
    dmod.append(dsinks)
  c = scale * alpha
  dq = dq_z * c
  dk = dk_z if qk_mult is None else dk_z * c
  dscale = alpha * jnp.sum(dq_z * finite(q_raw).astype(cd))
  dbias = dbias_z * bias_mult if cfg.has_bias else None
  return (dq, dk, dv, dbias, (carry_a, carry_b) if both_carries else carry_a, dscale, *dmod)


# --------------------------------------------------------------------------------------------
# Chunks of heads.
# --------------------------------------------------------------------------------------------

def _forward(q, k, v, bias, mask, row_scales, scale, cfg: tl.TileConfig, skip: bool,
             smask: Any = None, mod: Any = None, sinks: Any = None):
  """:func:`_forward_chunk` over the chunks of heads; the zero-tile table gains a leading
  chunk axis, [num_chunks, num_q_blocks, num_k_blocks] (or is None)."""
  x = q.shape[0]
  chunk_cfg = dataclasses.replace(cfg, head_dims=cfg.chunk_head_dims())
  if cfg.heads_in_chunk == x:
    *res, zero = _forward_chunk(q, k, v, bias, mask, row_scales, scale, chunk_cfg, skip,
                                smask, 0, mod, sinks)
    return (*res, None if zero is None else zero[None])
  rows = lambda a, c: None if a is None else tl.chunk_rows(a, c, cfg)

  def chunk(c, carry):
    res = _forward_chunk(rows(q, c), rows(k, c), rows(v, c), tl.chunk_bias(bias, c, cfg),
                         tl.chunk_bias(mask, c, cfg), rows(row_scales, c), scale, chunk_cfg,
                         skip, smask, c * cfg.heads_in_chunk, mod, sinks)
    put = lambda buf, a: lax.dynamic_update_slice_in_dim(buf, a, c * cfg.heads_in_chunk, 0)
    out, stats, support_mean, passes, zero = carry
    return (put(out, res[0]), tuple(put(b, a) for b, a in zip(stats, res[1], strict=True)),
            None if support_mean is None else put(support_mean, res[2]),
            jnp.maximum(passes, res[3]),
            None if zero is None else lax.dynamic_update_index_in_dim(zero, res[4], c, 0))

  rs = cfg.w.stream
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  cd = compute_dtype(q.dtype)
  num_chunks = x // cfg.heads_in_chunk
  zero0 = None
  if skip and rs.needs_threshold:
    zero0 = jnp.zeros((num_chunks, cfg.num_q_blocks, cfg.num_k_blocks), bool)
  init = (jnp.zeros((x, g, tp, hv), cd), tuple(jnp.zeros((x, g, tp), cd)
                                             for _ in range(_num_stats(cfg))),
          jnp.zeros((x, g, tp, hv), cd) if rs.saves_support_mean else None, jnp.int32(0),
          zero0)
  return lax.fori_loop(0, num_chunks, chunk, init)


def _backward(q, k, v, bias, mask, row_scales, scale, out, stats, support_mean, do, zero,
              cfg: tl.TileConfig, smask: Any = None, mod: Any = None, sinks: Any = None,
              ddelta: Any = None):
  x = q.shape[0]
  cd = compute_dtype(q.dtype)
  chunk_cfg = dataclasses.replace(cfg, head_dims=cfg.chunk_head_dims())
  if cfg.heads_in_chunk == x:
    return _backward_chunk(q, k, v, bias, mask, row_scales, scale, out, stats, support_mean, do,
                           None if zero is None else zero[0], chunk_cfg, smask=smask, mod=mod,
                           sinks=sinks, ddelta=ddelta)
  rows = lambda a, c: None if a is None else tl.chunk_rows(a, c, cfg)

  def chunk(c, carry):
    dq, dk, dv, dbias, drow_scales, dscale, *dmod = carry
    dq_c, dk_c, dv_c, dbias_c, drow_scales_c, dscale_c, *dmod_c = _backward_chunk(
        rows(q, c), rows(k, c), rows(v, c), tl.chunk_bias(bias, c, cfg),
        tl.chunk_bias(mask, c, cfg), rows(row_scales, c), scale, rows(out, c),
        tuple(rows(a, c) for a in stats), rows(support_mean, c), rows(do, c),
        None if zero is None else zero[c], chunk_cfg, smask=smask, x0=c * cfg.heads_in_chunk,
        mod=mod, sinks=sinks, ddelta=rows(ddelta, c))
    put = lambda buf, a: lax.dynamic_update_slice_in_dim(buf, a, c * cfg.heads_in_chunk, 0)
    if cfg.has_bias:
      starts, sizes = tl.chunk_bias_window(bias, c, cfg)
      dbias = lax.dynamic_update_slice(
          dbias, lax.dynamic_slice(dbias, starts, sizes) + dbias_c, starts)
    return (put(dq, dq_c), put(dk, dk_c), put(dv, dv_c), dbias, put(drow_scales, drow_scales_c),
            dscale + dscale_c, *jax.tree.map(jnp.add, dmod, dmod_c))

  init = (jnp.zeros(q.shape, cd), jnp.zeros(k.shape, cd), jnp.zeros(v.shape, cd),
          jnp.zeros(bias.shape, cd) if cfg.has_bias else None, jnp.zeros(q.shape[:3], cd),
          jnp.zeros((), cd))
  if cfg.score_mod:
    init += (jax.tree.map(jnp.zeros_like, mod),)
  if cfg.sinks:
    init += (jnp.zeros_like(sinks),)
  return lax.fori_loop(0, x // cfg.heads_in_chunk, chunk, init)


# --------------------------------------------------------------------------------------------
# One block of a larger problem (the ring: the local query shard against one visiting
# key shard): the unnormalized streaming state, and the block's gradients.
# --------------------------------------------------------------------------------------------

def raw_block_state(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                    row_scales: Array | None, scale: Array, cfg: tl.TileConfig,
                    mod: Any = None) -> Any:
  """The streaming state (:mod:`attnx.core.streaming`: ``MaxState`` of SSMax and softpick,
  ``StickState`` of stick-breaking) of every query row over this block's keys, its leaves laid
  out [X, G, t, ...], for :func:`attnx.core.streaming.merge` with other key blocks of the same
  rows and one :func:`attnx.core.streaming.finalize`.

  Kernel layout as :func:`attnx.core.kernels.xla.pointwise.raw_block_state`; ``cfg`` from
  :func:`attnx.core.kernels.xla.pointwise.block_config` with ``whole_chunk=True`` (one chunk of
  heads); ``row_scales`` SSMax's c_i = s·log n_i [X, G, t] with n_i the row's count over the whole
  problem. Not for sparsemax/entmax: their threshold needs every key of the row first.
  ``mod``: the :class:`~attnx.core.score_mods.ScoreMod` of ``cfg.score_mod``, else None.
  """
  rs = cfg.w.stream
  if rs.needs_threshold or cfg.heads_in_chunk != q.shape[0]:
    raise ValueError(f"raw_block_state: needs a family without a threshold and one chunk of "
                     f"heads, got {rs.family!r} with {cfg.heads_in_chunk} of {q.shape[0]} rows")
  tl.check_tiling(q, k, cfg)
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  rows = (x, g * cfg.bq)
  cd = compute_dtype(q.dtype)
  axes = sweep.manual_axes(q, k, v, bias, mask, row_scales)
  q, qk_mult, bias_mult, _ = tl.prescale(q, scale, cfg)

  def q_block(i, buf):
    tile = _tiles(q, k, v, bias, mask, i, cfg, qk_mult, bias_mult, mod=mod)
    lo, hi = tl.k_range(i, cfg)
    ctx = tl.row_block(row_scales, i, cfg) if rs.needs_row_scale else None
    state = _fold(tile, lo, hi, lambda c, z, ok, vj: st.update(rs, c, z, ok, vj, ctx),
                  sweep.vary(st.init(rs, rows, hv, cd), axes), rs.reverse)
    return jax.tree.map(lambda b, a: tl.put_row_block(b, a, i, cfg), buf, state)

  return lax.fori_loop(0, cfg.num_q_blocks, q_block,
                       sweep.vary(st.init(rs, (x, g, tp), hv, cd), axes))


def block_grads(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                row_scales: Array | None, scale: Array, out: Array, stats: tuple[Array, ...],
                do: Array, carry0: tuple[Array, Array], cfg: tl.TileConfig, mod: Any = None):
  """(dq, dk, dv, dbias, (carry_a, carry_b), dscale) of this block's scores from the rows'
  final output and statistics (:func:`attnx.core.streaming.finalize` of the merged state).

  ``carry0``: the per-row grad carries after the key blocks visited before this one (SSMax:
  dc = Σ z·dy so far; stick-breaking, whose blocks must come from the last key backwards: L
  and Σ A·dP of the later keys); the result's carries go on to the next block. Same layout
  and cfg as :func:`raw_block_state`; with ``cfg.score_mod`` the cotangent of ``mod`` follows
  dscale.
  """
  return _backward_chunk(q, k, v, bias, mask, row_scales, scale, out, stats, None, do, None,
                         cfg, carry0=carry0, both_carries=True, mod=mod)


def _make_kernel(cfg: tl.TileConfig, skip: bool):
  """A custom-VJP function of internal-layout (q, k, v, bias, mask, row_scales, scale, smask,
  mod, sinks) -> O; ``skip``: leave out all-zero key tiles (entmax family); ``smask``: the
  bound structured mask of ``cfg.structured`` (a pytree of index arrays: no cotangent), else
  None; ``mod``: the :class:`~attnx.core.score_mods.ScoreMod` of ``cfg.score_mod`` (its
  parameters get gradients), else None; ``sinks``: the attention sinks [N] of ``cfg.sinks``
  (with a gradient), else None."""

  @jax.jit  # as the pointwise kernel's: only finite arrays leave (bl.finite_residual)
  def forward(q, k, v, bias, mask, row_scales, scale, smask, mod, sinks):
    out, stats, support_mean, _, zero = _forward(q, k, v, bias, mask, row_scales, scale, cfg,
                                                 skip, smask, mod, sinks)
    return out, bl.finite_residual(stats), support_mean, zero

  backward = jax.jit(functools.partial(_backward, cfg=cfg))

  rs = cfg.w.stream
  n = rs.num_stats

  def primal(out, stats, dtype):
    out = out.astype(dtype)
    if not cfg.residual:
      return out
    big = lambda a: jnp.where(a >= jnp.finfo(a.dtype).max, jnp.inf, a)  # finite_residual's +∞
    return out, tuple(big(a) for a in stats[:n])

  @jax.custom_vjp
  def kernel(q, k, v, bias, mask, row_scales, scale, smask, mod, sinks):
    out, stats, _, _ = forward(q, k, v, bias, mask, row_scales, scale, smask, mod, sinks)
    return primal(out, stats, q.dtype)

  def fwd(q, k, v, bias, mask, row_scales, scale, smask, mod, sinks):
    out, stats, support_mean, zero = forward(q, k, v, bias, mask, row_scales, scale, smask, mod,
                                             sinks)
    return primal(out, stats, q.dtype), (q, k, v, bias, mask, row_scales, scale, out, stats,
                                         support_mean, zero, smask, mod, sinks)

  def bwd(res, ct):
    (q, k, v, bias, mask, row_scales, scale, out, stats, support_mean, zero, smask, mod,
     sinks) = res
    do, ddelta = ct, None
    if cfg.residual:
      do, dstats = ct
      ddelta = st.residual_delta(rs, stats[:n], dstats, stats[n] if n < len(stats) else None)
    dq, dk, dv, dbias, drow_scales, dscale, *extra = backward(
        q, k, v, bias, mask, row_scales, scale, out, stats[:n], support_mean, do, zero,
        smask=smask, mod=mod, sinks=sinks, ddelta=ddelta)
    dmod, dsinks = tl.extra_cotangents(cfg, extra, mod, sinks)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else dbias.astype(bias.dtype), None,
            None if row_scales is None else drow_scales, dscale.astype(scale.dtype), None, dmod,
            dsinks)

  kernel.defvjp(fwd, bwd)
  return kernel


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------

def _valid_counts(b: int, n: int, t: int, s: int, bias, mask, is_causal: bool) -> Array:
  """[B, N, T] float32: the number of keys each row attends (SSMax's n_i)."""
  rows = jnp.arange(t)
  if mask is None and bias is None:
    n_valid = jnp.clip(rows + 1, 0, s) if is_causal else jnp.full((t,), s)
    return jnp.broadcast_to(n_valid.astype(F32), (b, n, t))
  valid = jnp.ones((1, 1, t, s), bool)
  if mask is not None:
    valid = valid & mask
  if bias is not None:
    valid = valid & (bias != -jnp.inf)
  if is_causal:
    valid = valid & (jnp.arange(s)[None, :] <= rows[:, None])
  return jnp.broadcast_to(jnp.sum(valid, axis=-1, dtype=F32), (b, n, t))


def structured_counts(structured_mask: Any, bias: Array | None, mask: Array | None, b: int,
                      num_heads: int, kv_heads: int, t: int, s: int, bq: int, bk: int) -> Array:
  """[B, N, T] float32: the number of keys each row attends under a bound structured mask
  (and a [B|1, N|1, T|1, S|1] dense ``mask`` and ``bias``, whose −∞ masks), counted tile by
  tile (tiles of ``bq`` × ``bk``) without a T×S array; the tiles the mask skips count
  nothing, those it allows whole count without evaluating it."""
  g = num_heads // kv_heads
  cfg = tl.TileConfig(w=get_weighting("softmax"), t=t, s=s, bq=bq, bk=bk, is_causal=False,
                      has_mask=mask is not None, has_bias=bias is not None,
                      head_dims=(b, kv_heads, g), kv_heads=kv_heads, structured=True)
  tp, sp = cfg.num_q_blocks * bq, cfg.num_k_blocks * bk
  bias5, mask5 = tl.bias_mask_layout(bias, mask, num_heads, kv_heads, tp, sp)
  kinds = tl.tile_kinds(structured_mask, 0, cfg)
  lo, hi = tl.tile_span(kinds, 1)
  rows = (b * kv_heads, g * bq)

  def q_block(i, buf):
    def k_step(j, n):
      def count(n, structured):
        valid = tl.tile_valid(mask5, structured_mask, 0, i, j, cfg, structured)
        if bias5 is not None:
          finite = tl.bias_tile_rows(bias5, i, j, cfg) != -jnp.inf
          valid = finite if valid is None else valid & finite
        if valid is None:
          return n + float(bk)
        return n + jnp.sum(jnp.broadcast_to(valid, rows + (bk,)), axis=-1, dtype=F32)
      return tl.kind_switch(kinds[i, j], lambda n: n, count, n)

    n = lax.fori_loop(lo[i], hi[i], k_step, jnp.zeros(rows, F32))
    return tl.put_row_block(buf, n, i, cfg)

  counts = lax.fori_loop(0, cfg.num_q_blocks, q_block, jnp.zeros((b * kv_heads, g, tp), F32))
  return counts[:, :, :t].reshape(b, num_heads, t)


def _ssmax_row_scales(q, k, bias, mask, rs: st.RowStream, is_causal: bool, ssmax_s,
                      structured: Any = None, tiles: tuple[int, int] | None = None,
                      extra_keys: int = 0) -> Array:
  """SSMax's c_i = s·log n_i, [B, N, T] in the compute dtype (s: the weighting's, or
  ``ssmax_s``); under a ``structured`` mask n_i counted on ``tiles``
  (:func:`structured_counts`); ``extra_keys`` more keys in every row (an attention sink)."""
  b, t, n, _ = q.shape
  s = k.shape[1]
  bias4 = None if bias is None else bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  cd = compute_dtype(q.dtype)
  sv = jnp.asarray(rs.s if ssmax_s is None else ssmax_s, cd)
  if sv.ndim:  # one s per query head
    sv = jnp.broadcast_to(sv.reshape(-1), (n,))[None, :, None]
  if structured is None:
    counts = _valid_counts(b, n, t, s, bias4, mask4, is_causal)
  else:
    counts = structured_counts(structured, bias4, mask4, b, n, k.shape[2], t, s, *tiles)
  return st.row_scale(rs, counts + extra_keys if extra_keys else counts, sv, cd)


def _ssmax_as_softmax(q, k, v, mask, weighting, scale, block_q, block_k, ssmax_s,
                      structured: Any = None, return_residual: bool = False) -> Any:
  """SSMax without a bias, in float32 or float64: softmax of (c_i·q_i)·k, the pointwise kernel
  (:func:`attnx.core.kernels.xla.pointwise.blocked_attention`) on the rows of q scaled by c_i =
  s·log n_i.

  Taken for full (non-causal) rows, where it is as fast as softmax and the row kernel 1.18×
  (2-core Xeon, fwd+bwd, 1×4096×4×64, side by side). Causal rows stay in the row kernel:
  1.10× softmax there (the pointwise kernel's causal triangle: 1.00×), but its scratch at
  T = 65 536 is 100 MiB where the triangle's is 620 MiB.

  The gradient of c_i is Σ_h dq'_ih·q_ih with q's finite copy (:func:`finite`): a NaN q_i of
  a row without a valid key (dq' = 0) must not reach a learned s; where the row attends a
  key, dq' is NaN and so is dc_i, as in the row kernel.
  """
  tiles = None
  if structured is not None:  # n_i counted on the pointwise kernel's tiles of the mask
    tiles = bl.plain_tiles(q.shape[1], k.shape[1], q.shape[2] // k.shape[2], block_q, block_k,
                           True)
  c = _ssmax_row_scales(q, k, None, mask, weighting.stream, False, ssmax_s, structured, tiles)
  c = jnp.transpose(c, (0, 2, 1))[..., None]  # [B, T, N, 1]
  q, _, _, _ = nonfinite_inputs(q, k, None, None)
  c_fixed = lax.stop_gradient(c)
  q_scaled = c_fixed * q + (c - c_fixed) * finite(q)  # the value c·q; dc from the finite copy
  return bl.blocked_attention(q_scaled, k, v, weighting=get_weighting("softmax"), scale=scale,
                              mask=mask, block_q=block_q, block_k=block_k,
                              structured_mask=structured, return_residual=return_residual)


def _runs_as_softmax(weighting: RowNormalizer, has_bias: bool, dtype: Any,
                     is_causal: bool) -> bool:
  """Whether :func:`blocked_row_attention` runs SSMax as softmax in the pointwise kernel
  (:func:`_ssmax_as_softmax`): full rows (or a structured mask) without a bias, float32 or
  float64."""
  return (weighting.stream.needs_row_scale and not has_bias
          and jnp.dtype(dtype).itemsize >= 4 and not is_causal)


def mask_tile_counts(structured_mask: Any, weighting: RowNormalizer, b: int, t: int, s: int,
                     num_heads: int, kv_heads: int, is_causal: bool, has_bias: bool,
                     dtype: Any, block_q: int | None = None,
                     block_k: int | None = None) -> dict[str, Any]:
  """How :func:`blocked_row_attention` meets a bound structured mask (as
  :func:`attnx.core.kernels.xla.pointwise.mask_tile_counts`: its tiles and how many it skips,
  runs without the elementwise mask and runs masked)."""
  if _runs_as_softmax(weighting, has_bias, dtype, False):
    return bl.mask_tile_counts(structured_mask, get_weighting("softmax"), b, t, s, num_heads,
                               kv_heads, is_causal, block_q, block_k)
  smask = masks.Causal() & structured_mask if is_causal else structured_mask
  cfg = _cfg(weighting, t, s, b, kv_heads, num_heads // kv_heads, False, block_q, block_k,
             False, False, True)
  return tl.tile_counts(smask, cfg)


def _block_k(family: str, s: int) -> int:
  """Key tiles of :data:`BLOCK_K` (or the family's in :data:`FAMILY_BLOCK_K`), capped at S."""
  bk = FAMILY_BLOCK_K.get(family, BLOCK_K)
  return min(bk, common.round_up(max(s, 1), tl.ALIGN))


def causal_block_sizes(family: str, t: int, s: int, group: int = 1) -> tuple[int, int]:
  """Default causal (block_q, block_k) of a streaming family for T queries, S keys and
  ``group`` query heads per kv head (see :data:`CAUSAL_BLOCK_Q`): capped at the (8-aligned)
  lengths and, like the pointwise kernel's, at :data:`attnx.core.kernels.xla.sizes.TILE_BUDGET`
  scores per tile."""
  bk = _block_k(family, s)
  short_bq, short_t = FAMILY_SHORT_BLOCK_Q.get(family, (CAUSAL_BLOCK_Q, 0))
  bq = short_bq if t < short_t else CAUSAL_BLOCK_Q
  budget = max(tl.ALIGN, (sizes.TILE_BUDGET // (bk * max(group, 1))) // tl.ALIGN * tl.ALIGN)
  return min(bq, budget, common.round_up(max(t, 1), tl.ALIGN)), bk


def _problem(family: str, t: int, s: int, g: int, b: int, kv_heads: int, is_causal: bool,
             block_q, block_k, structured: bool = False):
  if structured:  # the causal tiles, at most the pointwise kernel's under a structured mask
    bq, bk = causal_block_sizes(family, t, s, g)
    bq, bk = min(bq, sizes.STRUCTURED_BLOCK_Q), min(bk, sizes.STRUCTURED_BLOCK_K)
  elif is_causal:
    bq, bk = causal_block_sizes(family, t, s, g)
  else:  # the pointwise kernel's query blocks
    bq, bk = sizes.default_block_sizes(t, s, g)[0], _block_k(family, s)
  bq = min(block_q, common.round_up(t, tl.ALIGN)) if block_q else bq
  bk = min(block_k, common.round_up(s, tl.ALIGN)) if block_k else bk
  return bq, bk, sizes.heads_per_chunk(b, kv_heads, g, bq, bk)


def _cfg(weighting, t, s, b, kv_heads, g, is_causal, block_q, block_k, has_mask, has_bias,
         structured: bool = False, score_mod: bool = False, sinks: bool = False):
  bq, bk, heads_in_chunk = _problem(weighting.stream.family, t, s, g, b, kv_heads, is_causal,
                                    block_q, block_k, structured)
  return tl.TileConfig(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=is_causal, has_mask=has_mask,
                       has_bias=has_bias, head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                       heads_in_chunk=heads_in_chunk, structured=structured,
                       score_mod=score_mod, sinks=sinks)


def _inputs(q, k, v, bias, mask, scale, weighting, is_causal, block_q, block_k, ssmax_s,
            structured: Any = None, score_mod: Any = None, sinks: Any = None):
  """Checked, non-empty inputs in the kernel layout (the scale in the compute dtype, then the
  structured mask: ``structured``, with the causal condition already joined, or None, then
  the score modification or None, then the sinks or None), and the problem's cfg."""
  _check_only(q, k, v, mask, weighting, block_q, block_k)
  b, t, n, h = q.shape
  _, s, kv_heads, _ = k.shape
  g = n // kv_heads
  cfg = _cfg(weighting, t, s, b, kv_heads, g, is_causal, block_q, block_k, mask is not None,
             bias is not None, structured is not None, score_mod is not None, sinks is not None)
  tp, sp = cfg.num_q_blocks * cfg.bq, cfg.num_k_blocks * cfg.bk
  rs = weighting.stream
  row_scales = None
  if rs.needs_row_scale:
    c = _ssmax_row_scales(q, k, bias, mask, rs, is_causal, ssmax_s, structured,
                          (cfg.bq, cfg.bk), extra_keys=int(sinks is not None))
    row_scales = common.pad_axis(c.reshape(b * kv_heads, g, t), 2, tp)
  q, k, v, bias = nonfinite_inputs(q, k, v, bias)
  q4, k3, v3, bias5, mask5 = tl.kernel_layout(q, k, v, bias, mask, tp, sp)
  cd = compute_dtype(q4.dtype)
  sinks = None if sinks is None else jnp.asarray(sinks, cd)
  return (q4, k3, v3, bias5, mask5, row_scales, jnp.asarray(scale, cd), structured, score_mod,
          sinks), cfg


def blocked_row_attention(q: Array, k: Array, v: Array, *, weighting: RowNormalizer,
                          scale: float | Array, bias: Array | None = None,
                          mask: Array | None = None, is_causal: bool = False,
                          block_q: int | None = None, block_k: int | None = None,
                          ssmax_s: Array | float | None = None,
                          skip_zero_tiles: bool = True, structured_mask: Any = None,
                          score_mod: Any = None, sinks: Array | None = None,
                          return_residual: bool = False) -> Array | tuple[Array, Any]:
  """Memory-efficient attention for a whole-row weighting (its ``stream`` family).

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H]; N a multiple of K (grouped-query attention).
    v: values [B, S, K, Hv].
    weighting: a :class:`~attnx.core.weightings.RowNormalizer` with a ``stream``
      (:func:`streams`).
    scale: multiplies q·k (a float or a scalar array, which then gets a gradient).
    bias: optional additive bias broadcastable to [B, N, T, S] (4-D, size-1 dims allowed).
    mask: optional boolean mask broadcastable to [B, N, T, S]; True = attend.
    is_causal: query i attends key j ≤ i (top-left aligned).
    block_q, block_k: tile sizes (default, measured per family: :func:`causal_block_sizes`
      when causal, whose query blocks are short enough that tiles above the diagonal are
      skipped; else the pointwise kernel's query blocks and key tiles of :data:`BLOCK_K`,
      stick-breaking's of :data:`STICK_BLOCK_K`).
    ssmax_s: SSMax only: s as a scalar or one value per query head [N] (an array gets a
      gradient); default the weighting's own s.
    skip_zero_tiles: sparsemax/entmax only: leave out the key tiles in which every weight of
      every row of the query block is zero (all x ≤ τ), in the threshold passes after the
      first, the output pass and the backward (AdaSplash's block skipping). The result is the
      same bit for bit; False computes every tile (for side-by-side timings).
    structured_mask: a structured mask (:mod:`attnx.core.masks`) bound to the flat batch
      (:meth:`~attnx.core.masks.Mask.bind` with the batch ``(B,)``): evaluated per tile, never
      as a [T, S] array, in every pass (SSMax's n_i, stick-breaking's stick and the entmax
      threshold count only the keys it allows), and the tiles where it allows no pair are
      skipped (with ``is_causal`` the causal condition joins it).
    score_mod: a :class:`~attnx.core.score_mods.ScoreMod` (soft cap, ``score_mod`` function
      and its parameters), applied per tile between the score and the weighting in every pass
      (SSMax scales the modified score); its parameters get gradients.
    sinks: attention sinks [N] (not stick-breaking): a virtual key of score ``sinks[h]`` and
      zero value in every row of head h, in every pass (SSMax scales its score and counts
      it, entmax's threshold sees it); gets a gradient.
    return_residual: also return the family's residual ([B, T, N] rows: the log normalizer,
      stick-breaking's log survival, entmax's :class:`~attnx.core.residuals.EntmaxResidual`,
      :mod:`attnx.core.residuals`), with a gradient.

  Returns:
    [B, T, N, Hv] in q's dtype (with ``return_residual``: and the residual), equal up to float
    rounding to the dense weights' product with v (float32 accumulation; float64 for float64
    inputs).
  """
  _check_only(q, k, v, mask, weighting, block_q, block_k)
  b, t, n, _ = q.shape
  if q.size == 0 or k.shape[1] == 0:  # no query, or no key (every row has no valid key)
    out = jnp.zeros((b, t, n, v.shape[-1]), q.dtype)
    return ((out, residuals_lib.empty_residual(weighting, (b, t, n), compute_dtype(q.dtype)))
            if return_residual else out)
  if not isinstance(skip_zero_tiles, bool):
    raise ValueError(f"skip_zero_tiles must be a bool, got {skip_zero_tiles!r}")
  if structured_mask is not None:  # the tiles of the mask, not the causal ones
    structured_mask = masks.Causal() & structured_mask if is_causal else structured_mask
    is_causal = False
  if (score_mod is None and sinks is None
      and _runs_as_softmax(weighting, bias is not None, q.dtype, is_causal)):
    return _ssmax_as_softmax(q, k, v, mask, weighting, scale, block_q, block_k, ssmax_s,
                             structured_mask, return_residual)
  arrays, cfg = _inputs(q, k, v, bias, mask, scale, weighting, is_causal, block_q, block_k,
                        ssmax_s, structured_mask, score_mod, sinks)
  out = _make_kernel(dataclasses.replace(cfg, residual=return_residual), skip_zero_tiles)(*arrays)
  if not return_residual:
    return out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3)
  out, stats = out
  rows = lambda a: a[:, :, :t].reshape(b, n, t).transpose(0, 2, 1)
  return (out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3),
          residuals_lib.from_stats(weighting, tuple(rows(a) for a in stats)))


def _check_only(q, k, v, mask, weighting, block_q, block_k) -> None:
  if not streams(weighting):
    raise TypeError(f"blocked_row_attention needs a streaming RowNormalizer, got {weighting!r}")
  bl.check_layout(q, k, v, mask, block_q, block_k)


def threshold_passes(q: Array, k: Array, v: Array, *, weighting: RowNormalizer,
                     scale: float | Array, bias: Array | None = None, mask: Array | None = None,
                     is_causal: bool = False, block_q: int | None = None,
                     block_k: int | None = None) -> Array:
  """The largest number of passes over the key tiles any query block used to find its
  threshold τ (sparsemax/entmax; the row-max pass and the exact last step included), for the
  benchmark's report. 0 for the other families."""
  arrays, cfg = _inputs(q, k, v, bias, mask, scale, weighting, is_causal, block_q, block_k,
                        None)
  return _forward(*arrays[:-3], cfg, True)[3]


def zero_tiles(q: Array, k: Array, v: Array, *, weighting: RowNormalizer, scale: float | Array,
               bias: Array | None = None, mask: Array | None = None, is_causal: bool = False,
               block_q: int | None = None,
               block_k: int | None = None) -> tuple[Array, Array]:
  """Which key tiles the sparsemax/entmax kernel leaves out as all zero, for tests and the
  benchmark's report.

  Returns (skipped, visited), both bool [num_chunks, num_q_blocks, num_k_blocks] (chunks of
  heads as the kernel runs them, tiles of the kernel's block sizes): ``visited`` the tiles a
  query block can see (causal: not entirely above the diagonal), ``skipped`` those of them in
  which every weight of every row of the block is zero at the final τ, which the output pass
  and the backward leave out (the backward keeps a block's tiles where its dO is not finite).
  The share of work saved is ``skipped.sum() / visited.sum()`` (the first threshold pass, the
  row max, visits every tile).
  """
  _check_only(q, k, v, mask, weighting, block_q, block_k)
  if not weighting.stream.needs_threshold:
    raise ValueError(f"zero_tiles needs a sparsemax/entmax weighting, got {weighting!r}")
  if q.size == 0 or k.shape[1] == 0:
    raise ValueError(f"zero_tiles needs queries and keys, got q {q.shape}, k {k.shape}")
  arrays, cfg = _inputs(q, k, v, bias, mask, scale, weighting, is_causal, block_q, block_k,
                        None)
  zero = _forward(*arrays[:-3], cfg, True)[4]
  hi = jnp.stack([jnp.asarray(tl.k_range(i, cfg)[1]) for i in range(cfg.num_q_blocks)])
  visited = jnp.arange(cfg.num_k_blocks)[None, :] < hi[:, None]
  visited = jnp.broadcast_to(visited, zero.shape)
  return zero & visited, visited
