"""Flash-style blocked attention with O(T) memory for every pointwise weighting F.

    out_i = Σ_j F(s_ij) v_j / N_i,   s_ij = scale · q_i·k_j + bias_ij

Keys are streamed tile by tile (Dao et al. 2022, "FlashAttention", arXiv 2205.14135; Rabe &
Staats 2021, "Self-attention does not need O(n²) memory", arXiv 2112.05682), so the T×S score
matrix never exists. Two streaming rules cover every :class:`~attnx.core.weightings.Pointwise`:

* softmax-like F = exp(α s) with ``normalization="sum"`` (``w.online_max``): the online softmax
  (Milakov & Gimelshein 2018, arXiv 1805.02867) with a running row maximum m and denominator l;
  ``denominator_offset`` c (quiet softmax, Evan Miller 2023) is a virtual key of score 0, so
  m starts at 0 and l at c.
* any other F: acc += F(S)·V and l += rowsum(F(S)) (``"sum"``), l = number of valid keys
  (``"length"``, Wortsman et al. 2023) or l = 1 (``"none"``, Ramapuram et al. 2024); one
  division at the end. No rescaling is needed because nothing is shifted.

For ``"sum"`` the row sums ride along in the F·V matmul as a column of ones appended to V,
which saves one pass over every tile.

The backward pass is a ``jax.custom_vjp`` that recomputes the tiles (FlashAttention-2, Dao 2023,
arXiv 2307.08691): only the output, one row statistic and the inputs are saved. With
D_i = dO_i·O_i and dP_ij = dO_i·v_j:

* online max: P = exp((α s − hi) − lo), dS = α P ∘ (dP − D), with lse = hi + lo saved as two
  floats (one float32 lse ≈ 20 would be off by up to 2⁻²⁰ relative in every weight);
* ``"sum"``: dS = F'(s) ∘ (dP − D) / l;  ``"length"``: dS = F'(s) ∘ dP / n;  ``"none"``:
  dS = F'(s) ∘ dP.

Everything is computed in max(float32, the input dtype): float64 inputs (``jax_enable_x64``) in
float64 (:func:`attnx.core.contract.compute_dtype`). The backward recomputes each tile as the
forward computed it (the same score function on the same [queries × keys] tile).

Masked keys contribute exactly nothing, and a row without any valid key (or where every F is
0) gets a zero output with finite, zero gradients, matching
:func:`attnx.core.weightings.pointwise_weights`; NaN/Inf inputs follow the contract of
:mod:`attnx.core.contract`, like the dense path.

Causal attention (section "Causal" below) costs about half of full attention: the triangle is cut
into unmasked squares (run by the plain kernel with tall tiles) and small masked diagonal tiles,
and nothing above the diagonal is ever computed, in the forward or the backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export, lax

from attnx.core import masks, streaming
from attnx.core.contract import compute_dtype, finite, nonfinite_inputs
from attnx.core.kernels import common
from attnx.core.kernels.xla import tiling as tl
from attnx.core.weightings import Pointwise

Array = jax.Array

# Tiles are sized by a budget of scores per tile (all heads of a chunk × G query heads × bq ×
# bk): XLA's CPU dots are faster on one tall [bq, H] × [H, bk] product than on a batch of
# shorter ones, so the kernel walks the heads in chunks and gives each chunk the tallest tile
# the budget allows; 2^20 f32 scores = 4 MiB per tile (measured: docs/guides/benchmarks.md,
# "The kernels' constants").
TILE_BUDGET = 1 << 20
DEFAULT_BLOCK_K = 256
# Causal: the side of the masked diagonal tiles (see "Causal" below). The work is T²/2 + T·d/2
# of the full T², and everything but the diagonal tiles runs unmasked with tall tiles.
CAUSAL_LEAF = 128

__all__ = ["CAUSAL_LEAF", "DEFAULT_BLOCK_K", "STRUCTURED_BLOCK_K", "STRUCTURED_BLOCK_Q",
           "TILE_BUDGET", "block_config", "block_grads", "blocked_attention", "causal_leaves",
           "default_block_sizes", "mask_tile_counts", "plain_tiles", "raw_block_state"]


def manual_axes(*xs: Any) -> tuple[str, ...]:
  """The mesh axes any of ``xs`` varies over inside ``jax.shard_map(..., check_vma=True)``
  (empty elsewhere, and with ``check_vma=False``). jax 0.10 keeps them in the aval's
  ``manual_axis_type``; without it nothing is known and :func:`vary` does nothing."""
  axes = set()
  for x in xs:
    if x is not None:
      mat = getattr(jax.typeof(x), "manual_axis_type", None)
      axes |= set(getattr(mat, "varying", ()) or ())
  return tuple(sorted(axes))


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
  """``tree`` typed as varying over ``axes`` (:func:`manual_axes` of the kernel's inputs).

  Under ``shard_map``'s varying-type check a loop's start (zeros, constants) must have the
  type of what its body returns, which varies with the inputs, and so must both branches of a
  ``lax.cond``; ``lax.pcast`` says so. A no-op without axes, so outside ``shard_map`` (and
  with ``check_vma=False``) nothing changes.
  """
  if not axes:
    return tree

  def one(x):
    missing = tuple(a for a in axes if a not in manual_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(one, tree)


# Default tiles under a structured mask: the tiles it skips are whole tiles, so shorter ones
# skip more, and cost more per score (the loop's per-tile work). 512×256 was the fastest of
# 128–1024 × 128–256 at T = 16 384 for a causal 512-window and 16 packed documents, fwd+bwd on
# 2 CPU cores (docs/guides/masks.md).
STRUCTURED_BLOCK_Q = 512
STRUCTURED_BLOCK_K = 256


def default_block_sizes(t: int, s: int, group: int = 1, is_causal: bool = False,
                        budget: int | None = None) -> tuple[int, int]:
  """Default (block_q, block_k) for T queries, S keys and ``group`` query heads per kv head.

  block_k = 256 and block_q as tall as the budget (:data:`TILE_BUDGET`) allows (group ·
  block_q · block_k scores); both capped at the (8-aligned) lengths. Causal: the side d of
  the masked diagonal tiles (:func:`causal_leaves`); the squares below the diagonal get
  the non-causal tiles of their own size, cut down to divisors of the square's side.
  """
  if is_causal:
    d = causal_leaves(min(t, s), CAUSAL_LEAF)[1]
    return d, d
  budget = TILE_BUDGET if budget is None else budget
  bk = min(DEFAULT_BLOCK_K, common.round_up(max(s, 1), tl.ALIGN))
  bq = max(tl.ALIGN, (budget // (bk * max(group, 1))) // tl.ALIGN * tl.ALIGN)
  return min(bq, common.round_up(max(t, 1), tl.ALIGN)), bk


def causal_leaves(t: int, leaf: int) -> tuple[int, int]:
  """(P, d): the causal triangle of T rows as P = 2^L diagonal tiles of d ≤ max(leaf, 8) rows
  (d a multiple of 8, P·d ≥ T, P the smallest power of 2 that allows it)."""
  leaf = max(tl.ALIGN, leaf // tl.ALIGN * tl.ALIGN)
  p = 1
  while common.round_up(-(-t // p), tl.ALIGN) > leaf:
    p *= 2
  return p, common.round_up(-(-max(t, 1) // p), tl.ALIGN)


def heads_per_chunk(b: int, kv_heads: int, group: int, bq: int, bk: int,
                    budget: int | None = None) -> int:
  """How many of the X = B·K (batch, kv head) rows one tile holds: the largest count within
  the budget (:data:`TILE_BUDGET`) that divides K or is a multiple of K dividing B·K (so
  that a chunk covers a rectangle of [batch, kv head] and a bias/mask slice stays a plain
  slice). A symbolic batch (``jax.export``) is not enumerated: the chunk then divides K."""
  per_row = group * bq * bk
  fits = max(1, (TILE_BUDGET if budget is None else budget) // per_row)
  options = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
  if not export.is_symbolic_dim(b):
    options += [kv_heads * d for d in range(1, b + 1) if b % d == 0]
  return max(c for c in options if c <= fits) if fits >= 1 else 1


# --------------------------------------------------------------------------------------------
# Chunks: the kernels run on heads_in_chunk of the X = B·K rows at a time.
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Tiles. Internal layout: q [X, G, Tp, H] and k/v [X, Sp, H] with X = B·K (G query heads share a
# kv head), bias/mask [Bb, Kb, Gb, Tb, Sb]. A tile flattens (G, bq) into rows, so scores are one
# batched [G·bq, H] × [H, bk] matmul whose output needs no relayout.
# --------------------------------------------------------------------------------------------


def _pv(p: Array, vj: Array) -> Array:
  return jnp.einsum("xqs,xsd->xqd", p.astype(vj.dtype), vj,
                    preferred_element_type=compute_dtype(vj.dtype))


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------

def _forward(q, k, v, bias, mask, scale, cfg: tl.TileConfig, smask: Any = None,
             mod: Any = None, sinks: Any = None):
  """Returns O [X, G, Tp, Hv] and the row statistic [X, G, Tp] (online max: lse as the pair
  [X, G, Tp, 2] of :func:`_stat_shape`) in the compute dtype, chunk by chunk. ``smask``: the
  bound structured mask (``cfg.structured``), evaluated per tile; ``mod``: the
  :class:`~attnx.core.score_mods.ScoreMod` (``cfg.score_mod``), applied per tile;
  ``sinks``: the attention sinks [N] (``cfg.sinks``), a virtual key before each row's keys."""
  x, g, tp, _ = q.shape
  chunk_cfg = dataclasses.replace(cfg, head_dims=cfg.chunk_head_dims())

  def chunk(c, carry):
    out, stat = carry
    o, st = _forward_chunk(tl.chunk_rows(q, c, cfg), tl.chunk_rows(k, c, cfg),
                           tl.chunk_rows(v, c, cfg), tl.chunk_bias(bias, c, cfg),
                           tl.chunk_bias(mask, c, cfg), scale, chunk_cfg, smask,
                           c * cfg.heads_in_chunk, mod, sinks)
    return (lax.dynamic_update_slice_in_dim(out, o, c * cfg.heads_in_chunk, 0),
            lax.dynamic_update_slice_in_dim(stat, st, c * cfg.heads_in_chunk, 0))

  cd = compute_dtype(q.dtype)
  init = vary((jnp.zeros((x, g, tp, _out_cols(cfg, v.shape[-1])), cd),
               jnp.zeros(_stat_shape(cfg, (x, g, tp)), cd)), manual_axes(q, k, v, bias, mask))
  if cfg.heads_in_chunk == x:
    return _forward_chunk(q, k, v, bias, mask, scale, chunk_cfg, smask, 0, mod, sinks)
  return lax.fori_loop(0, x // cfg.heads_in_chunk, chunk, init)


def _sink_scores(sinks: Array, x0: Any, cfg: tl.TileConfig, cd: Any) -> Array:
  """The sink's exponent z = α·sinks[h] (α = 1 unless online max) of the rows of one query
  block of a chunk (first row ``x0``), [X, G·bq, 1]."""
  alpha = float(cfg.w.exp_alpha) if cfg.w.online_max else 1.0
  z = sinks.astype(cd)[tl.row_heads(x0, cfg)] * alpha  # [X, G]
  return jnp.repeat(z, cfg.bq, axis=1)[..., None]


def _sink_grad(sinks: Array, x0: Any, cfg: tl.TileConfig, grad_rows: Any, n: int) -> Array:
  """d sinks [N] from the rows of a chunk (first row ``x0``): the sink is a key of zero
  value, so dP = 0 there and its cotangent is −P_sink·δ per row (times α), summed over the
  rows of each head. Padding rows have δ = 0 and add nothing."""
  w = cfg.w
  heads = tl.row_heads(x0, cfg)  # [X, G]
  cd = sinks.dtype
  alpha = float(w.exp_alpha) if w.online_max else 1.0
  delta = grad_rows[2]
  z = jnp.broadcast_to((sinks[heads] * alpha)[..., None, None],
                       delta.shape + (1,) if delta is not None else ())
  _, dz = streaming.pointwise_tile_grad(w, z, None, jnp.zeros_like(z), grad_rows, cfg.num_keys,
                                        row=lambda a: a[..., None])
  per_row = jnp.sum(dz[..., 0], axis=2) * alpha  # [X, G]
  return jnp.zeros((n,), cd).at[heads.reshape(-1)].add(per_row.reshape(-1).astype(cd))


def _stat_shape(cfg: tl.TileConfig, rows: tuple[int, ...]) -> tuple[int, ...]:
  """The forward's row statistic: [rows], or for the online max's lse the pair (hi, lo)
  [rows, 2] of :func:`attnx.core.streaming.pointwise_finalize` with ``split_lse``: one f32
  lse near 20 (scores of large mean) is off by up to 2⁻²⁰ relative in every weight the
  backward recomputes. A raw state's statistic is the running max m, one value."""
  return rows + (2,) if cfg.w.online_max and not cfg.raw else rows


def _out_cols(cfg: tl.TileConfig, hv: int) -> int:
  """Columns of the forward's first output: Hv, or Hv + 1 for a raw state that carries Σ F."""
  return hv + 1 if cfg.raw and cfg.w.divides_by_sum else hv


def _tile_loop(cfg: tl.TileConfig, kinds: Array | None, outer: Any, axis: int,
               plain: tuple[Any, Any], step: Any) -> tuple[Any, Any, Any]:
  """The bounds and body of a kernel's inner loop over tiles (``axis`` 1: the key tiles of
  query tile ``outer``; 0: the query tiles of key tile ``outer``). Without a structured mask:
  ``plain`` bounds and ``step(inner, carry, masked=True)``. With one (``kinds`` from
  :func:`attnx.core.kernels.xla.tiling.tile_kinds`): the span of the tiles it does not skip,
  and per tile a switch between skipping it, the step without the elementwise structured mask
  (every pair may attend) and the step with it."""
  if kinds is None:
    return (*plain, lambda inner, c: step(inner, c, True))
  lo, hi = tl.tile_span(kinds, axis)
  kind_of = (lambda inner: kinds[outer, inner]) if axis == 1 else (
      lambda inner: kinds[inner, outer])

  def body(inner, c):
    return tl.kind_switch(kind_of(inner), lambda c: c, lambda c, masked: step(inner, c, masked),
                          c, full_needs_mask=cfg.w.divides_by_length)

  return lo[outer], hi[outer], body


def _forward_chunk(q, k, v, bias, mask, scale, cfg: tl.TileConfig, smask: Any = None,
                   x0: Any = 0, mod: Any = None, sinks: Any = None):
  """One chunk of :func:`_forward`: O [X', G, Tp, Hv] and the row statistic [X', G, Tp]
  (X' = ``cfg.heads_in_chunk``).

  The statistic is lse = m + log l for online-max weightings (+inf where l = 0, which makes
  every recomputed weight 0) and the normalizer l otherwise (1 for ``"none"``).

  With ``cfg.raw`` the result is the unnormalized state of the keys seen, to be merged with
  other key ranges of the same rows (:func:`attnx.core.streaming.pointwise_merge`) and normalized
  once (:func:`attnx.core.streaming.pointwise_finalize`):
  acc = Σ F·[V, 1] whose last column is Σ F for ``"sum"`` (online max: Σ exp(z − m) with the
  running max m as the statistic), acc = Σ F·V otherwise, with the valid-key count
  (``"length"``) or Σ F / 0 as the statistic.
  """
  w = cfg.w
  tl.check_tiling(q, k, cfg)
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  cd = compute_dtype(q.dtype)
  row_shape = (x, g * cfg.bq)
  axes = manual_axes(q, k, v, bias, mask)
  q, qk_mult, bias_mult, _ = tl.prescale(q, scale, cfg)
  v_fwd = v
  if w.divides_by_sum:
    # Row sums ride along in the F·V matmul as a column of ones appended to V: one pass over
    # the tile fewer than a separate reduction.
    v_fwd = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)

  kinds = tl.tile_kinds(smask, x0, cfg) if cfg.structured else None
  if cfg.sinks:  # the sink as one more key of each row: score sinks[h], value 0 (Σ F: 1)
    sink_z = _sink_scores(sinks, x0, cfg, cd)  # [X, G·bq, 1]
    sink_v = jnp.zeros((x, 1, v_fwd.shape[-1]), cd).at[..., hv].set(1.0)

  def q_block(i, carry):
    out, stat = carry
    qi = tl.row_block(q, i, cfg)

    def tile(j, structured):
      kj = tl.slice_along(k, j * cfg.bk, cfg.bk, 1)
      vj = tl.slice_along(v_fwd, j * cfg.bk, cfg.bk, 1)
      z = tl.tile_scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult, mod, x0)
      return z, vj, tl.tile_valid(mask, smask, x0, i, j, cfg, structured)

    if w.online_max:
      def k_step(j, c, structured):
        z, vj, valid = tile(j, structured)
        return streaming.online_max_update(*c, z, valid, vj)

      # The offset is a virtual key with z = 0, in l's column of ones (raw: not yet;
      # streaming.pointwise_finalize adds it once after the partial states are merged).
      m_start, off = streaming.online_max_start(w, with_offset=not cfg.raw)
      m0 = jnp.full(row_shape, m_start, cd)
      acc0 = jnp.zeros(row_shape + (hv + 1,), cd).at[..., hv].set(off)
      if cfg.sinks:
        acc0, m0 = streaming.online_max_update(acc0, m0, sink_z, None, sink_v)
      lo, hi, k_block = _tile_loop(cfg, kinds, i, 1, tl.k_range(i, cfg), k_step)
      acc, m = lax.fori_loop(lo, hi, k_block, vary((acc0, m0), axes))
      if cfg.raw:
        return tl.put_row_block(out, acc, i, cfg), tl.put_row_block(stat, m, i, cfg)
      o, st = streaming.pointwise_finalize(w, acc, m, add_offset=False, split_lse=True)
    else:
      norm = w.normalization

      def k_step(j, c, structured):
        s, vj, valid = tile(j, structured)
        return streaming.pointwise_update(w, *c, s, valid, vj, cfg.num_keys)

      l0 = jnp.zeros(row_shape, cd)
      acc0 = jnp.zeros(row_shape + (v_fwd.shape[-1],), cd)
      if cfg.sinks:
        acc0, l0 = streaming.pointwise_update(w, acc0, l0, sink_z, None, sink_v, cfg.num_keys)
      lo, hi, k_block = _tile_loop(cfg, kinds, i, 1, tl.k_range(i, cfg), k_step)
      acc, l = lax.fori_loop(lo, hi, k_block, vary((acc0, l0), axes))
      if cfg.raw:
        if norm == "length" and not cfg.needs_valid:
          l = jnp.full(row_shape, float(cfg.s), cd)  # every key of the block
        return tl.put_row_block(out, acc, i, cfg), tl.put_row_block(stat, l, i, cfg)
      # Unmasked tiles counted nothing: every row has all cfg.s keys.
      o, st = streaming.pointwise_finalize(w, acc, l,
                                           num_keys=None if cfg.needs_valid else cfg.s)

    return tl.put_row_block(out, o, i, cfg), tl.put_row_block(stat, st, i, cfg)

  out0 = jnp.zeros((x, g, tp, _out_cols(cfg, hv)), cd)
  stat0 = jnp.zeros(_stat_shape(cfg, (x, g, tp)), cd)
  return lax.fori_loop(0, cfg.num_q_blocks, q_block, vary((out0, stat0), axes))


# --------------------------------------------------------------------------------------------
# Backward: key blocks outside (dK, dV of a key block stay in the carry), query blocks inside
# (dQ accumulates in place in a [X, G, Tp, H] buffer).
# --------------------------------------------------------------------------------------------


def _backward(q, k, v, bias, mask, scale, out, stat, do, cfg: tl.TileConfig,
              smask: Any = None, mod: Any = None, sinks: Any = None):
  """(dq, dk, dv, dbias, dscale), chunk by chunk; chunks may share a broadcast bias slice.
  Then, with a score modification (``cfg.score_mod``), the cotangent of ``mod`` (its
  parameters' gradients, summed over every tile), and with sinks (``cfg.sinks``) d sinks."""
  x = q.shape[0]
  chunk_cfg = dataclasses.replace(cfg, head_dims=cfg.chunk_head_dims())
  if cfg.heads_in_chunk == x:
    return _backward_chunk(q, k, v, bias, mask, scale, out, stat, do, chunk_cfg, smask, 0, mod,
                           sinks)
  cd = compute_dtype(q.dtype)

  def chunk(c, carry):
    dq, dk, dv, dbias, dscale, *dmod = carry
    rows = lambda a: tl.chunk_rows(a, c, cfg)
    dq_c, dk_c, dv_c, dbias_c, dscale_c, *dmod_c = _backward_chunk(
        rows(q), rows(k), rows(v), tl.chunk_bias(bias, c, cfg), tl.chunk_bias(mask, c, cfg), scale,
        rows(out), rows(stat), rows(do), chunk_cfg, smask, c * cfg.heads_in_chunk, mod, sinks)
    put = lambda buf, a: lax.dynamic_update_slice_in_dim(buf, a, c * cfg.heads_in_chunk, 0)
    if cfg.has_bias:
      starts, sizes = tl.chunk_bias_window(bias, c, cfg)
      dbias = lax.dynamic_update_slice(dbias, lax.dynamic_slice(dbias, starts, sizes) + dbias_c,
                                       starts)
    return (put(dq, dq_c), put(dk, dk_c), put(dv, dv_c), dbias, dscale + dscale_c,
            *jax.tree.map(jnp.add, dmod, dmod_c))

  init = (jnp.zeros(q.shape, cd), jnp.zeros(k.shape, cd), jnp.zeros(v.shape, cd),
          jnp.zeros(bias.shape, cd) if cfg.has_bias else None, jnp.zeros((), cd))
  if cfg.score_mod:
    init += (jax.tree.map(jnp.zeros_like, mod),)
  if cfg.sinks:
    init += (jnp.zeros_like(sinks),)
  init = vary(init, manual_axes(q, k, v, bias, mask, out, do))
  return lax.fori_loop(0, x // cfg.heads_in_chunk, chunk, init)


def _backward_chunk(q, k, v, bias, mask, scale, out, stat, do, cfg: tl.TileConfig,
                    smask: Any = None, x0: Any = 0, mod: Any = None, sinks: Any = None):
  """One chunk of :func:`_backward`."""
  w = cfg.w
  tl.check_tiling(q, k, cfg)
  cd = compute_dtype(q.dtype)  # float32, or float64 for float64 inputs
  q_raw = q
  q, qk_mult, bias_mult, alpha = tl.prescale(q, scale, cfg)
  # dS·K and dSᵀ·Q take finite copies (attnx.core.contract): 0·NaN at masked pairs.
  q_f, k_f = finite(q), finite(k)
  # D_i = dO_i·O_i = Σ_j w_ij dP_ij (also correct with a denominator offset).
  delta = jnp.sum(do.astype(cd) * out, axis=-1)
  grad_rows = streaming.pointwise_grad_rows(w, stat, delta)
  bias_shape = bias.shape if cfg.has_bias else None
  axes = manual_axes(q, k, v, bias, mask, out, do)
  kinds = tl.tile_kinds(smask, x0, cfg) if cfg.structured else None

  def k_block(j, carry):
    dq, dk_all, dv_all, dbias, *dmod = carry
    kj, vj = tl.slice_along(k, j * cfg.bk, cfg.bk, 1), tl.slice_along(v, j * cfg.bk, cfg.bk, 1)
    kj_f = tl.slice_along(k_f, j * cfg.bk, cfg.bk, 1)

    def tile_terms(i, dk_j, dv_j, structured, dq_rows=None):
      """Tile (i, j): dK and dV of key block j with its terms added, its dQ term
      [X, G·bq, H] (added to ``dq_rows()`` where given), with a bias dz (the score
      gradient, for dbias) and with a score modification the tile's cotangent of ``mod``."""
      qi, doi = tl.row_block(q, i, cfg), tl.row_block(do, i, cfg)
      # The tile is computed as in the forward, [X, G·bq, bk] (queries × keys), by the
      # forward's own tl.tile_scores (the same dot, summed in the same order). A transposed tile
      # [X, bk, G·bq] (dV = Pᵀ·dO and dK = dZᵀ·Q plain matmuls) is no faster on XLA:CPU, whose
      # dot for it sums q·k in another order, 2.5× further from the exact scores at T ≫ S
      # (docs/guides/implementations.md, "Precision and accuracy").
      if cfg.score_mod:
        z, mod_vjp = tl.modded_tile(qi, kj, bias, i, j, cfg, qk_mult, mod, x0)
      else:
        z = tl.tile_scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult)
      valid = tl.tile_valid(mask, smask, x0, i, j, cfg, structured)
      row = lambda a: tl.row_block(a, i, cfg)[..., None]  # per-query statistic, broadcast over keys
      dp = jnp.einsum("xqd,xsd->xqs", doi, vj, preferred_element_type=cd)
      # dz: the cotangent of z = α·s (α = 1 unless online max).
      p, dz = streaming.pointwise_tile_grad(w, z, valid, dp, grad_rows, cfg.num_keys, row=row)
      dv_j = dv_j + jnp.einsum("xqs,xqd->xsd", p.astype(doi.dtype), doi,
                               preferred_element_type=cd)
      extra = ()
      if cfg.score_mod:  # through the modification: dz of scale·q·k, of the bias, of mod
        dz, dbias_z, dmod_tile = mod_vjp(dz)
        extra = (dmod_tile,)
      dzc = dz.astype(qi.dtype)
      dk_j = dk_j + jnp.einsum("xqs,xqh->xsh", dzc, tl.row_block(q_f, i, cfg),
                               preferred_element_type=cd)
      base = None if dq_rows is None else dq_rows()  # read before the product, as always
      dq_i = jnp.einsum("xqs,xsh->xqh", dzc, kj_f, preferred_element_type=cd)
      if cfg.score_mod:
        dz = dbias_z
      return (dk_j, dv_j, dq_i if base is None else base + dq_i, dz if cfg.has_bias else None,
              *extra)

    def add_terms(i, dq, dbias, dq_i, dz):  # dq_i: the rows' new dQ
      dq = tl.put_row_block(dq, dq_i, i, cfg)
      if cfg.has_bias:
        dbias = tl.add_bias_grad_tile(dbias, dz, i, j, cfg)
      return dq, dbias

    def q_step(i, c, structured):
      dq, dk_j, dv_j, dbias, *dmod = c
      dk_j, dv_j, dq_i, dz, *dmod_tile = tile_terms(i, dk_j, dv_j, structured,
                                                    lambda: tl.row_block(dq, i, cfg))
      dq, dbias = add_terms(i, dq, dbias, dq_i, dz)
      return dq, dk_j, dv_j, dbias, *jax.tree.map(jnp.add, dmod, dmod_tile)

    def structured_q_step(i, c):  # the dQ and dbias buffers stay outside the switch
      dq, dk_j, dv_j, dbias, *dmod = c

      def leave_out(dk_j, dv_j):
        rows = (q.shape[0], q.shape[1] * cfg.bq)
        return (dk_j, dv_j, jnp.zeros(rows + q.shape[-1:], cd),
                jnp.zeros(rows + (cfg.bk,), cd) if cfg.has_bias else None,
                *jax.tree.map(jnp.zeros_like, dmod))

      dk_j, dv_j, dq_term, dz, *dmod_tile = tl.kind_switch(
          kinds[i, j], leave_out, lambda *c: tile_terms(i, *c), dk_j, dv_j,
          full_needs_mask=w.divides_by_length)
      dq, dbias = add_terms(i, dq, dbias, tl.row_block(dq, i, cfg) + dq_term, dz)
      return dq, dk_j, dv_j, dbias, *jax.tree.map(jnp.add, dmod, dmod_tile)

    dk0 = jnp.zeros((k.shape[0], cfg.bk, k.shape[-1]), cd)
    dv0 = jnp.zeros((v.shape[0], cfg.bk, v.shape[-1]), cd)
    if kinds is None:
      lo, hi, q_block = _tile_loop(cfg, kinds, j, 0, tl.q_range(j, cfg), q_step)
    else:
      lo, hi = (a[j] for a in tl.tile_span(kinds, 0))
      q_block = structured_q_step
    dq, dk_j, dv_j, dbias, *dmod = lax.fori_loop(
        lo, hi, q_block, (dq, *vary((dk0, dv0), axes), dbias, *dmod))
    dk_all = lax.dynamic_update_slice_in_dim(dk_all, dk_j, j * cfg.bk, axis=1)
    dv_all = lax.dynamic_update_slice_in_dim(dv_all, dv_j, j * cfg.bk, axis=1)
    return dq, dk_all, dv_all, dbias, *dmod

  init = (jnp.zeros(q.shape, cd), jnp.zeros(k.shape, cd), jnp.zeros(v.shape, cd),
          jnp.zeros(bias_shape, cd) if cfg.has_bias else jnp.zeros((), cd))
  if cfg.score_mod:
    init += (jax.tree.map(jnp.zeros_like, mod),)
  init = vary(init, axes)
  # The loop accumulated Σ dz·k (into dq) and Σ dzᵀ·q' (into dk) with q' = q·(scale·α) in
  # float32/float64, or the unscaled q otherwise (16-bit q); under a score modification α = 1
  # here (the tile's VJP applied it).
  dq_z, dk_z, dv, dbias_z, *dmod = lax.fori_loop(0, cfg.num_k_blocks, k_block, init)
  c = scale * alpha
  dq = dq_z * c
  dk = dk_z if qk_mult is None else dk_z * c
  dscale = alpha * jnp.sum(dq_z * finite(q_raw).astype(cd))
  dbias = dbias_z * bias_mult if cfg.has_bias else None
  if cfg.sinks:
    dmod.append(_sink_grad(sinks, x0, cfg, grad_rows, sinks.shape[0]))
  return (dq, dk, dv, dbias, dscale, *dmod)


# --------------------------------------------------------------------------------------------
# Causal: the triangle as unmasked squares plus small masked diagonal tiles.
#
# The Tp = P·d queries and keys (P = 2^L leaves of d rows) split into
#   * level l = 0 … L−1: 2^l squares of side s = Tp / 2^(l+1); square m holds the queries
#     [(2m+1)s, (2m+2)s) and the keys [2m·s, (2m+1)s), all of them strictly below the diagonal,
#     so they run the plain (non-causal) kernel with tall tiles and no masking work. Squares
#     are not padded, so their tiles divide s (_dividing_tile): a tile running past the end
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
    bq, bk = default_block_sizes(side, side, cfg.head_dims[2])
    bq = _dividing_tile(side, min(bq, cfg.user_bq or bq))
    bk = _dividing_tile(side, min(bk, cfg.user_bk or bk))
  b, kv_heads, g = cfg.head_dims
  return dataclasses.replace(
      cfg, t=side, s=side, bq=bq, bk=bk, is_causal=causal, raw=raw, full_num_keys=cfg.num_keys,
      num_diag_tiles=0, head_dims=(m * b, kv_heads, g),
      heads_in_chunk=heads_per_chunk(m * b, kv_heads, g, bq, bk))


def _dividing_tile(side: int, cap: int) -> int:
  """The largest tile ≤ cap that divides `side`, a multiple of 8 where one fits (SIMD)."""
  divisors = [t for t in range(min(cap, side), 0, -1) if side % t == 0]
  aligned = [t for t in divisors if t % tl.ALIGN == 0]
  return (aligned or divisors)[0]


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


def _causal_forward(q, k, v, bias, mask, scale, cfg: tl.TileConfig):
  """The causal forward (T = S = P·d): O [X, G, Tp, Hv] and the row statistic [X, G, Tp]."""
  p, d = cfg.num_diag_tiles, cfg.bq

  def run(m, side, rp, cp, parts, causal):
    c = _piece_cfg(cfg, m, side, causal=causal, raw=True)
    (acc, st), unflat, _ = _pieces(
        lambda q, k, v, b, mk: _forward(q, k, v, b, mk, scale, c), c, m,
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


def _causal_backward(q, k, v, bias, mask, scale, out, stat, do, cfg: tl.TileConfig):
  """The causal backward: the plain backward of every piece with the rows' final statistic."""
  p, d = cfg.num_diag_tiles, cfg.bq
  cd = compute_dtype(q.dtype)

  def run(m, side, rp, cp, parts, causal):
    c = _piece_cfg(cfg, m, side, causal=causal, raw=False)
    qp = lambda a: _q_part(a, m, parts, side, rp)
    kp = lambda a: _k_part(a, m, parts, side, cp)
    (dq, dk, dv, db, ds), unflat, how = _pieces(
        lambda q, k, v, b, mk, o, st, g: _backward(q, k, v, b, mk, scale, o, st, g, c), c, m,
        qp(q), kp(k), kp(v), _pick_blocks(bias, m, parts, side, rp, cp),
        _pick_blocks(mask, m, parts, side, rp, cp), qp(out), qp(stat), qp(do))
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


# --------------------------------------------------------------------------------------------
# One block of a larger problem (the ring: the local query shard against one visiting
# key shard). The tile math is the kernel's own; only the cfg and the entry points are new.
# --------------------------------------------------------------------------------------------

# The causal diagonal block of a ring runs the plain kernel with causal masking (not the
# triangle of pieces, which needs power-of-2 leaves and padding): short tiles keep the work
# above the diagonal that tile granularity cannot skip small.
BLOCK_CAUSAL_TILE = 256


def block_config(w: Any, t: int, s: int, head_dims: tuple[int, int, int], *, is_causal: bool,
                 has_mask: bool, has_bias: bool, num_keys: int, block_q: int | None = None,
                 block_k: int | None = None, whole_chunk: bool = False) -> tl.TileConfig:
  """The cfg of one unpadded [t × s] block of a larger attention problem.

  A ring step (:mod:`attnx.core.parallel.ring`) computes the local query rows against one
  visiting key shard; the blocks of all steps must agree on the rows' layout, so nothing is
  padded: the tiles are the largest that divide t and s (multiples of 8 where one fits) below
  the caps ``block_q``/``block_k`` (default: :func:`default_block_sizes`, causal
  :data:`BLOCK_CAUSAL_TILE`). ``num_keys`` is the key count F sees (sigmoid's default
  b = −log n): the whole problem's, not the block's. ``is_causal``: the block is the diagonal
  one (query i sees key j ≤ i, block-local indices). ``whole_chunk``: all B·K (batch, kv head)
  rows in one chunk, the query tile shortened to keep :data:`TILE_BUDGET` scores (the whole-row
  kernels' raw entry points run one chunk).
  """
  b, kv_heads, g = head_dims
  if is_causal:
    cap_q = cap_k = BLOCK_CAUSAL_TILE
  else:
    cap_q, cap_k = default_block_sizes(t, s, g)
  cap_q, cap_k = block_q or cap_q, block_k or cap_k
  bk = _dividing_tile(s, min(cap_k, s))
  if whole_chunk:
    cap_q = min(cap_q, max(tl.ALIGN, TILE_BUDGET // (b * kv_heads * g * bk)))
  bq = _dividing_tile(t, min(cap_q, t))
  chunk = b * kv_heads if whole_chunk else heads_per_chunk(b, kv_heads, g, bq, bk)
  return tl.TileConfig(w=w, t=t, s=s, bq=bq, bk=bk, is_causal=is_causal, has_mask=has_mask,
                       has_bias=has_bias, head_dims=head_dims, kv_heads=kv_heads,
                       heads_in_chunk=chunk, full_num_keys=num_keys)


def raw_block_state(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                    scale: Array, cfg: tl.TileConfig) -> tuple[Array, Array]:
  """The unnormalized state (acc, st) of every query row over this block's keys, for a
  pointwise F, in the kernel layout (q [X, G, t, H], k/v [X, s, H], bias/mask
  [Bb, Kb, Gb, t|1, s|1]; ``cfg`` from :func:`block_config`).

  States of disjoint key blocks of the same rows merge exactly with
  :func:`attnx.core.streaming.pointwise_merge` and are normalized once by
  :func:`attnx.core.streaming.pointwise_finalize` (no ``num_keys``: a ``"length"`` state
  already counts its keys); see :func:`_forward_chunk` for what acc and st hold.
  """
  return _forward(q, k, v, bias, mask, scale, dataclasses.replace(cfg, raw=True))


def block_grads(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                scale: Array, out: Array, stat: Array, do: Array, cfg: tl.TileConfig):
  """(dq, dk, dv, dbias, dscale) of this block's scores (in the compute dtype: float32, or
  float64), given the rows' final output and row statistic (of the whole problem: the
  backward of a block needs nothing else, as each tile's weights are recomputed from them;
  lse as one value or as the pair of :func:`_stat_shape`). Summed over the key blocks, they
  are the whole problem's gradients."""
  return _backward(q, k, v, bias, mask, scale, out, stat, do, cfg)


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------

def finite_residual(tree: Any) -> Any:
  """``tree`` with +inf replaced by the dtype's largest finite number.

  A row without weight has the statistic lse = +inf (and the kernels mark masked scores with
  −inf), which the backward reads only through e^{z − lse} = 0: the largest finite number
  gives the same 0 for every score z ≤ ~1e38. The kernels' forward and backward run under
  ``jax.jit`` and return their statistics through this, so that what leaves them (output,
  residuals, gradients) is finite for finite inputs: ``jax.debug_infs`` and
  ``jax.debug_nans`` check every array an eagerly run operation produces, and the ±inf
  inside a compiled function (as inside ``jax.nn``'s) never reach them.
  """
  def one(x):
    if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jnp.where(x == jnp.inf, jnp.finfo(x.dtype).max, x)
  return jax.tree.map(one, tree)


def _make_kernel(cfg: tl.TileConfig):
  """A custom-VJP function of internal-layout arrays (q, k, v, bias, mask, scale) -> O; with
  ``cfg.structured`` it takes the bound structured mask as a seventh argument."""
  if cfg.structured or cfg.score_mod or cfg.sinks:
    return _make_structured_kernel(cfg)

  causal_or_plain = _causal_forward if cfg.is_causal else _forward

  @jax.jit  # see finite_residual: inside, masked scores and rows without weight are ±inf
  def forward(q, k, v, bias, mask, scale):
    out, stat = causal_or_plain(q, k, v, bias, mask, scale, cfg)
    return out, finite_residual(stat)

  backward = jax.jit(functools.partial(_causal_backward if cfg.is_causal else _backward,
                                       cfg=cfg))

  @jax.custom_vjp
  def kernel(q, k, v, bias, mask, scale):
    return forward(q, k, v, bias, mask, scale)[0].astype(q.dtype)

  def fwd(q, k, v, bias, mask, scale):
    out, stat = forward(q, k, v, bias, mask, scale)
    return out.astype(q.dtype), (q, k, v, bias, mask, scale, out, stat)

  def bwd(res, do):
    q, k, v, bias, mask, scale, out, stat = res
    dq, dk, dv, dbias, dscale = backward(q, k, v, bias, mask, scale, out, stat, do)
    return _cotangents(q, k, v, bias, scale, dq, dk, dv, dbias, dscale)

  kernel.defvjp(fwd, bwd)
  return kernel


def _cotangents(q, k, v, bias, scale, dq, dk, dv, dbias, dscale):
  """The kernel's cotangents (q, k, v, bias, mask, scale) in the inputs' dtypes."""
  dbias = None if bias is None else dbias.astype(bias.dtype)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, None,
          dscale.astype(scale.dtype))


def _make_structured_kernel(cfg: tl.TileConfig):
  """:func:`_make_kernel` with a structured mask (a pytree of index arrays: no cotangent) as a
  seventh argument, a score modification (a :class:`~attnx.core.score_mods.ScoreMod`, whose
  parameters get gradients) as an eighth and attention sinks [N] as a ninth; None where the
  call has none."""

  @jax.jit
  def forward(q, k, v, bias, mask, scale, smask, mod, sinks):
    out, stat = _forward(q, k, v, bias, mask, scale, cfg, smask, mod, sinks)
    return out, finite_residual(stat)

  backward = jax.jit(functools.partial(_backward, cfg=cfg))

  @jax.custom_vjp
  def kernel(q, k, v, bias, mask, scale, smask, mod, sinks):
    return forward(q, k, v, bias, mask, scale, smask, mod, sinks)[0].astype(q.dtype)

  def fwd(q, k, v, bias, mask, scale, smask, mod, sinks):
    out, stat = forward(q, k, v, bias, mask, scale, smask, mod, sinks)
    return out.astype(q.dtype), (q, k, v, bias, mask, scale, out, stat, smask, mod, sinks)

  def bwd(res, do):
    q, k, v, bias, mask, scale, out, stat, smask, mod, sinks = res
    dq, dk, dv, dbias, dscale, *extra = backward(q, k, v, bias, mask, scale, out, stat, do,
                                                 smask=smask, mod=mod, sinks=sinks)
    dmod, dsinks = tl.extra_cotangents(cfg, extra, mod, sinks)
    return (*_cotangents(q, k, v, bias, scale, dq, dk, dv, dbias, dscale), None, dmod, dsinks)

  kernel.defvjp(fwd, bwd)
  return kernel


def blocked_attention(q: Array, k: Array, v: Array, *, weighting: Pointwise, scale: float | Array,
                      bias: Array | None = None, mask: Array | None = None,
                      is_causal: bool = False, block_q: int | None = None,
                      block_k: int | None = None, structured_mask: Any = None,
                      score_mod: Any = None, sinks: Array | None = None) -> Array:
  """Memory-efficient attention out_i = Σ_j w_ij v_j for a pointwise weighting F.

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H]; N must be a multiple of K (grouped-query attention: query head n
      uses kv head n // (N // K)).
    v: values [B, S, K, Hv].
    weighting: the :class:`~attnx.core.weightings.Pointwise` F and its normalization.
    scale: multiplies q·k (a Python float or a scalar array, which then gets a gradient).
    bias: optional additive bias broadcastable to [B, N, T, S] (4-D, size-1 dims allowed).
    mask: optional boolean mask broadcastable to [B, N, T, S]; True = attend.
    is_causal: query i attends key j ≤ i (top-left aligned, like ``jnp.tril``).
    block_q, block_k: tile sizes (default :func:`default_block_sizes`); T and S need not be
      multiples of them. Heads are processed in chunks that fill :data:`TILE_BUDGET`.
    structured_mask: a structured mask (:mod:`attnx.core.masks`) bound to the flat batch
      (:meth:`~attnx.core.masks.Mask.bind` with the batch ``(B,)``): evaluated per tile, never
      as a [T, S] array, and the tiles where it allows no pair are skipped (with ``is_causal``
      the causal condition joins it).
    score_mod: a :class:`~attnx.core.score_mods.ScoreMod` (soft cap, ``score_mod`` function
      and its parameters), applied per tile between the score and F; its parameters get
      gradients. The causal triangle then runs as tiles under a causal structured mask.
    sinks: attention sinks [N] (``normalization="sum"`` only): a virtual key of score
      ``sinks[h]`` and zero value in every row of head h; gets a gradient.

  Returns:
    [B, T, N, Hv] in q's dtype; equal (up to float rounding) to
    ``pointwise_weights(s, weighting, where=valid) @ v`` with float32 accumulation (float64
    for float64 inputs: :func:`attnx.core.contract.compute_dtype`).
  """
  if not isinstance(weighting, Pointwise):
    raise TypeError(f"blocked_attention needs a Pointwise weighting, got {type(weighting)}")
  check_layout(q, k, v, mask, block_q, block_k)
  b, t, n, h = q.shape
  _, s, kv_heads, _ = k.shape
  if q.size == 0 or s == 0:  # no query, or no key (every row has no valid key)
    return jnp.zeros((b, t, n, v.shape[-1]), q.dtype)
  kw = dict(weighting=weighting, scale=scale, block_q=block_q, block_k=block_k, num_keys=s)
  if structured_mask is not None or score_mod is not None or sinks is not None:
    # The tiles of the mask, not the causal triangle's pieces (whose positions are not the
    # tile's: a score modification reads them).
    smask = structured_mask
    if is_causal:
      smask = masks.Causal() if smask is None else masks.Causal() & smask
    return _blocked(q, k, v, bias=bias, mask=mask, is_causal=False, structured=smask,
                    score_mod=score_mod, sinks=sinks, **kw)
  if is_causal and s > t:  # keys j ≥ T are above the diagonal of every row: never touched
    return _blocked(q, k[:, :t], v[:, :t], bias=_part4(bias, 3, 0, t),
                    mask=_part4(mask, 3, 0, t), is_causal=True, **kw)
  if is_causal and t > s:  # rows i ≥ S see every key: a plain (non-causal) problem
    top = _blocked(q[:, :s], k, v, bias=_part4(bias, 2, 0, s), mask=_part4(mask, 2, 0, s),
                   is_causal=True, **kw)
    rest = _blocked(q[:, s:], k, v, bias=_part4(bias, 2, s, t), mask=_part4(mask, 2, s, t),
                    is_causal=False, **kw)
    return jnp.concatenate([top, rest], axis=1)
  return _blocked(q, k, v, bias=bias, mask=mask, is_causal=is_causal, **kw)


def check_layout(q: Array, k: Array, v: Array, mask: Array | None, block_q: int | None,
                 block_k: int | None) -> None:
  """The input checks of the blocked kernels: [B, T, N, H] / [B, S, K, H] shapes (N a multiple
  of K), a boolean mask, positive tile sizes."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected 4-D [B, T, N, H] inputs, got {q.shape}, {k.shape}, {v.shape}")
  b, _, n, h = q.shape
  kv_heads = k.shape[2]
  if (kv_heads == 0 or n % kv_heads or k.shape[:3] != v.shape[:3] or k.shape[0] != b
      or k.shape[-1] != h):
    raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean, got {mask.dtype}")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if blk is not None and blk < 1:
      raise ValueError(f"{name} must be a positive tile size, got {blk}")


def _part4(x: Array | None, axis: int, lo: int, hi: int) -> Array | None:
  """Rows (axis 2) or keys (axis 3) [lo, hi) of a [B|1, N|1, T|1, S|1]-broadcastable array."""
  if x is None:
    return None
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return x if x.shape[axis] == 1 else lax.slice_in_dim(x, lo, hi, axis=axis)


def plain_tiles(t: int, s: int, g: int, block_q: int | None, block_k: int | None,
                structured: bool) -> tuple[int, int]:
  """The (bq, bk) tiles of the plain (non-causal-triangle) kernel: the caps asked for, else
  :func:`default_block_sizes` (under a structured mask at most :data:`STRUCTURED_BLOCK_Q` ×
  :data:`STRUCTURED_BLOCK_K`: shorter tiles skip more), never longer than the sequence."""
  dq, dk = default_block_sizes(t, s, g)
  if structured:
    dq, dk = min(dq, STRUCTURED_BLOCK_Q), min(dk, STRUCTURED_BLOCK_K)
  # A tile never needs to be longer than the (8-aligned) sequence.
  bq = min(block_q, common.round_up(t, tl.ALIGN)) if block_q else dq
  bk = min(block_k, common.round_up(s, tl.ALIGN)) if block_k else dk
  return bq, bk


def mask_tile_counts(structured_mask: Any, weighting: Pointwise, b: int, t: int, s: int,
                     num_heads: int, kv_heads: int, is_causal: bool,
                     block_q: int | None = None, block_k: int | None = None) -> dict[str, Any]:
  """How :func:`blocked_attention` meets a bound structured mask: its tiles ``(bq, bk)`` and
  how many of them it skips (no pair may attend for any head), runs without the elementwise
  mask (every pair may) and runs masked (:func:`attnx.core.explain` shows it)."""
  smask = masks.Causal() & structured_mask if is_causal else structured_mask
  g = num_heads // kv_heads
  bq, bk = plain_tiles(t, s, g, block_q, block_k, True)
  cfg = tl.TileConfig(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=False, has_mask=False,
                      has_bias=False, head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                      structured=True)
  return tl.tile_counts(smask, cfg)


def _blocked(q, k, v, *, weighting, scale, bias, mask, is_causal, block_q, block_k, num_keys,
             structured=None, score_mod=None, sinks=None):
  """:func:`blocked_attention` on checked, non-empty inputs; causal ones have T = S."""
  b, t, n, h = q.shape
  _, s, kv_heads, _ = k.shape
  q, k, v, bias = nonfinite_inputs(q, k, v, bias)
  g = n // kv_heads
  if is_causal:
    asked = [x for x in (block_q, block_k) if x]
    num_diag_tiles, d = causal_leaves(t, min(asked) if asked else CAUSAL_LEAF)
    cfg = tl.TileConfig(w=weighting, t=t, s=s, bq=d, bk=d, is_causal=True,
                        has_mask=mask is not None, has_bias=bias is not None,
                        head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                        num_diag_tiles=num_diag_tiles, user_bq=block_q or 0,
                        user_bk=block_k or 0, full_num_keys=num_keys)
    tp = sp = num_diag_tiles * d
  else:
    bq, bk = plain_tiles(t, s, g, block_q, block_k, structured is not None)
    cfg = tl.TileConfig(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=False,
                        has_mask=mask is not None, has_bias=bias is not None,
                        head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                        heads_in_chunk=heads_per_chunk(b, kv_heads, g, bq, bk),
                        full_num_keys=num_keys, structured=structured is not None,
                        score_mod=score_mod is not None, sinks=sinks is not None)
    tp, sp = cfg.num_q_blocks * bq, cfg.num_k_blocks * bk

  # [B, T, N, H] -> [X, G, Tp, H] and [B, S, K, H] -> [X, Sp, H] (X = B·K), zero padded.
  q4, k3, v3, bias5, mask5 = tl.kernel_layout(q, k, v, bias, mask, tp, sp)
  scale_arr = jnp.asarray(scale, compute_dtype(q.dtype))
  args = (q4, k3, v3, bias5, mask5, scale_arr)
  if cfg.structured or cfg.score_mod or cfg.sinks:
    args += (structured, score_mod,
             None if sinks is None else jnp.asarray(sinks, compute_dtype(q.dtype)))
  out = _make_kernel(cfg)(*args)
  return out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3)
