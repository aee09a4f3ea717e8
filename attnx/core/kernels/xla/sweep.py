"""The XLA blocked kernel's sweep: a chunk of (batch, kv head) rows streams over its key tiles,
forward (:func:`forward`: the row states, normalized or raw) and backward (:func:`backward`:
the tiles recomputed from the saved row statistic), for every pointwise F (the streaming
rules in :mod:`.pointwise`'s docstring), with masks, a bias, a structured mask, a score
modification and attention sinks. :mod:`.pointwise` wraps it in a custom VJP; the causal
triangle (:mod:`.triangle`) and the ring's steps run it on pieces of a problem."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import streaming
from attnx.core.contract import compute_dtype, finite
from attnx.core.kernels.xla import tiling as tl

Array = jax.Array

__all__ = ["backward", "forward", "manual_axes", "sink_grad", "stat_shape", "vary"]


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

def forward(q, k, v, bias, mask, scale, cfg: tl.TileConfig, smask: Any = None,
             mod: Any = None, sinks: Any = None):
  """Returns O [X, G, Tp, Hv] and the row statistic [X, G, Tp] (online max: lse as the pair
  [X, G, Tp, 2] of :func:`stat_shape`) in the compute dtype, chunk by chunk. ``smask``: the
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
               jnp.zeros(stat_shape(cfg, (x, g, tp)), cd)), manual_axes(q, k, v, bias, mask))
  if cfg.heads_in_chunk == x:
    return _forward_chunk(q, k, v, bias, mask, scale, chunk_cfg, smask, 0, mod, sinks)
  return lax.fori_loop(0, x // cfg.heads_in_chunk, chunk, init)


def _sink_scores(sinks: Array, x0: Any, cfg: tl.TileConfig, cd: Any) -> Array:
  """The sink's exponent z = α·sinks[h] (α = 1 unless online max; for a log-domain F its
  score, as the tiles') of the rows of one query block of a chunk (first row ``x0``),
  [X, G·bq, 1]."""
  z = sinks.astype(cd)[tl.row_heads(x0, cfg)] * cfg.w.alpha  # [X, G]
  return jnp.repeat(z, cfg.bq, axis=1)[..., None]


def sink_grad(sinks: Array, x0: Any, cfg: tl.TileConfig, grad_rows: Any, n: int) -> Array:
  """d sinks [N] from the rows of a chunk (first row ``x0``): the sink is a key of zero
  value, so dP = 0 there and its cotangent is −P_sink·δ per row (times α), summed over the
  rows of each head. Padding rows have δ = 0 and add nothing."""
  w = cfg.w
  heads = tl.row_heads(x0, cfg)  # [X, G]
  cd = sinks.dtype
  alpha = w.alpha
  delta = grad_rows[2]
  z = jnp.broadcast_to((sinks[heads] * alpha)[..., None, None],
                       delta.shape + (1,) if delta is not None else ())
  _, dz = streaming.pointwise_tile_grad(w, z, None, jnp.zeros_like(z), grad_rows, cfg.num_keys,
                                        row=lambda a: a[..., None])
  per_row = jnp.sum(dz[..., 0], axis=2) * alpha  # [X, G]
  return jnp.zeros((n,), cd).at[heads.reshape(-1)].add(per_row.reshape(-1).astype(cd))


def stat_shape(cfg: tl.TileConfig, rows: tuple[int, ...]) -> tuple[int, ...]:
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
  """One chunk of :func:`forward`: O [X', G, Tp, Hv] and the row statistic [X', G, Tp]
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
        return streaming.online_max_update(*c, z, valid, vj, log_f=w.log_f)

      # The offset is a virtual key with z = 0, in l's column of ones (raw: not yet;
      # streaming.pointwise_finalize adds it once after the partial states are merged).
      m_start, off = streaming.online_max_start(w, with_offset=not cfg.raw)
      m0 = jnp.full(row_shape, m_start, cd)
      acc0 = jnp.zeros(row_shape + (hv + 1,), cd).at[..., hv].set(off)
      if cfg.sinks:
        acc0, m0 = streaming.online_max_update(acc0, m0, sink_z, None, sink_v, log_f=w.log_f)
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
  stat0 = jnp.zeros(stat_shape(cfg, (x, g, tp)), cd)
  return lax.fori_loop(0, cfg.num_q_blocks, q_block, vary((out0, stat0), axes))


# --------------------------------------------------------------------------------------------
# Backward: key blocks outside (dK, dV of a key block stay in the carry), query blocks inside
# (dQ accumulates in place in a [X, G, Tp, H] buffer).
# --------------------------------------------------------------------------------------------


def backward(q, k, v, bias, mask, scale, out, stat, do, cfg: tl.TileConfig,
              smask: Any = None, mod: Any = None, sinks: Any = None, dres: Any = None):
  """(dq, dk, dv, dbias, dscale), chunk by chunk; chunks may share a broadcast bias slice.
  Then, with a score modification (``cfg.score_mod``), the cotangent of ``mod`` (its
  parameters' gradients, summed over every tile), and with sinks (``cfg.sinks``) d sinks.
  ``dres``: None, or the cotangent [X, G, Tp] of the rows' log normalizer (the residual,
  :mod:`attnx.core.residuals`), whose score gradient P ∘ dres joins dS as δ − dres."""
  x = q.shape[0]
  chunk_cfg = dataclasses.replace(cfg, head_dims=cfg.chunk_head_dims())
  if cfg.heads_in_chunk == x:
    return _backward_chunk(q, k, v, bias, mask, scale, out, stat, do, chunk_cfg, smask, 0, mod,
                           sinks, dres)
  cd = compute_dtype(q.dtype)

  def chunk(c, carry):
    dq, dk, dv, dbias, dscale, *dmod = carry
    rows = lambda a: tl.chunk_rows(a, c, cfg)
    dq_c, dk_c, dv_c, dbias_c, dscale_c, *dmod_c = _backward_chunk(
        rows(q), rows(k), rows(v), tl.chunk_bias(bias, c, cfg), tl.chunk_bias(mask, c, cfg), scale,
        rows(out), rows(stat), rows(do), chunk_cfg, smask, c * cfg.heads_in_chunk, mod, sinks,
        None if dres is None else rows(dres))
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
                    smask: Any = None, x0: Any = 0, mod: Any = None, sinks: Any = None,
                    dres: Any = None):
  """One chunk of :func:`backward`."""
  w = cfg.w
  tl.check_tiling(q, k, cfg)
  cd = compute_dtype(q.dtype)  # float32, or float64 for float64 inputs
  q_raw = q
  q, qk_mult, bias_mult, alpha = tl.prescale(q, scale, cfg)
  # dS·K and dSᵀ·Q take finite copies (attnx.core.contract): 0·NaN at masked pairs.
  q_f, k_f = finite(q), finite(k)
  # D_i = dO_i·O_i = Σ_j w_ij dP_ij (also correct with a denominator offset).
  delta = jnp.sum(do.astype(cd) * out, axis=-1)
  if dres is not None:  # d lse/dz = P, as −δ's term: fold it into δ
    delta = delta - dres.astype(cd)
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
      # dz: the cotangent of α·s (α = 1 unless online max; of s itself for a log-domain F).
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
    dmod.append(sink_grad(sinks, x0, cfg, grad_rows, sinks.shape[0]))
  return (dq, dk, dv, dbias, dscale, *dmod)
