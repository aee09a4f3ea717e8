"""Flash-style blocked attention for the whole-row weightings (SSMax, softpick, stick-breaking,
sparsemax, entmax) with O(T) memory, in XLA (any backend).

The kernel walks query blocks and, for each, the key tiles its rows can see (causal: the tiles
not entirely above the diagonal), keeping per row the streaming state of the weighting's family
(:mod:`attnx.core.streaming`): the T×S scores and weights never exist. Sparsemax and entmax
first find each row's threshold τ with a few passes over the same key tiles, then make one
output pass. Stick-breaking visits the tiles from the last key backwards.

The backward pass is a ``jax.custom_vjp`` that recomputes the tiles: key tiles outside (dK,
dV of a tile stay in the carry; stick-breaking walks them from the last key backwards, carrying
per row the remaining stick and Σ A·dP of the keys already visited), query blocks inside (dQ
and the per-row carries are updated in place). Saved: the output, one to three row statistics,
and for entmax Σu·v/Σu — O(T·H) memory.

Layout, tiles, masks, padding and chunks of heads are those of :mod:`attnx.core.blocked`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import blocked as bl
from attnx.core import streaming as st
from attnx.core.contract import nonfinite_inputs
from attnx.core.weightings import RowNormalizer

Array = jax.Array
F32 = jnp.float32

# Causal query blocks are short so that the tiles above the diagonal can be skipped; the key
# tiles are those of the pointwise kernel.
CAUSAL_BLOCK_Q = 256

__all__ = ["CAUSAL_BLOCK_Q", "blocked_row_attention", "streams", "threshold_passes"]


def streams(weighting: Any) -> bool:
  """Whether ``weighting`` is a whole-row weighting this kernel runs."""
  return isinstance(weighting, RowNormalizer) and weighting.stream is not None


def _tiles(q, k, v, bias, mask, i, cfg: bl._Cfg, qk_mult, bias_mult):
  """tile(j) -> (z [X, G·bq, bk] f32, valid (broadcastable), v tile) of query block i."""
  qi = bl._rows(q, i, cfg)

  def tile(j):
    kj, vj = bl._slice(k, j * cfg.bk, cfg.bk, 1), bl._slice(v, j * cfg.bk, cfg.bk, 1)
    z = bl._scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult)
    valid = bl._valid_tile(mask, i, j, cfg)
    finite = z != -jnp.inf  # a score of −∞ is a masked key (NaN stays valid: the row is NaN)
    return z, (finite if valid is None else valid & finite), vj

  return tile


def _fold(tile, lo, hi, fn, init, reverse: bool = False):
  """Folds fn(carry, z, valid, v) over key tiles [lo, hi), last tile first if reverse."""
  def body(r, c):
    j = hi - 1 - r if reverse else lo + r
    z, valid, vj = tile(j)
    return fn(c, z, valid, vj)
  return lax.fori_loop(0, hi - lo, body, init)


def _forward_chunk(q, k, v, bias, mask, rowc, scale, cfg: bl._Cfg):
  """(O [x, G, Tp, Hv], row statistics, Σu·v/Σu or None, max threshold passes) of a chunk."""
  rs = cfg.w.stream
  bl._check_tiling(q, k, cfg)
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  rows = (x, g * cfg.bq)
  q, qk_mult, bias_mult, _ = bl._prescale(q, scale, cfg)

  def q_block(i, carry):
    out, stats, smean, passes = carry
    tile = _tiles(q, k, v, bias, mask, i, cfg, qk_mult, bias_mult)
    lo, hi = bl._k_range(i, cfg)
    ctx = bl._rows(rowc, i, cfg) if rs.needs_row_scale else None
    if rs.needs_threshold:
      ctx = st.entmax_threshold(
          lambda fn, init: _fold(tile, lo, hi, lambda c, z, ok, _: fn(c, z, ok), init), rows, rs)
      passes = jnp.maximum(passes, ctx.passes)
    state = _fold(tile, lo, hi, lambda c, z, ok, vj: st.update(rs, c, z, ok, vj, ctx),
                  st.init(rs, rows, hv), rs.reverse)
    o, row_stats, sm = st.finalize(rs, state, ctx)
    put = lambda buf, a: bl._put_rows(buf, a, i, cfg)
    stats = tuple(put(buf, a) for buf, a in zip(stats, row_stats, strict=True))
    return put(out, o), stats, smean if sm is None else put(smean, sm), passes

  init = (jnp.zeros((x, g, tp, hv), F32), tuple(jnp.zeros((x, g, tp), F32)
                                              for _ in range(rs.num_stats)),
          jnp.zeros((x, g, tp, hv), F32) if rs.saves_support_mean else None, jnp.int32(0))
  return lax.fori_loop(0, cfg.nq, q_block, init)


def _backward_chunk(q, k, v, bias, mask, rowc, scale, out, stats, smean, do, cfg: bl._Cfg):
  """(dq, dk, dv, dbias, drowc, dscale) of a chunk."""
  rs = cfg.w.stream
  bl._check_tiling(q, k, cfg)
  q_raw = q
  q, qk_mult, bias_mult, alpha = bl._prescale(q, scale, cfg)
  delta = jnp.sum(do.astype(F32) * (smean if rs.saves_support_mean else out), axis=-1)
  bias_shape = bias.shape if cfg.has_bias else None
  rowsum = lambda a, i: bl._rows(a, i, cfg)

  def k_block(r, carry):
    j = cfg.nk - 1 - r if rs.reverse else r
    kj, vj = bl._slice(k, j * cfg.bk, cfg.bk, 1), bl._slice(v, j * cfg.bk, cfg.bk, 1)

    def q_block(i, c):
      dq, dk_j, dv_j, dbias, ca, cb = c
      qi, doi = bl._rows(q, i, cfg), bl._rows(do, i, cfg)
      z = bl._scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult)
      valid = bl._valid_tile(mask, i, j, cfg)
      finite = z != -jnp.inf
      valid = finite if valid is None else valid & finite
      dp = jnp.einsum("xqd,xsd->xqs", doi, vj, preferred_element_type=F32)
      ctx = rowsum(rowc, i) if rs.needs_row_scale else None
      p, dz, gc = st.tile_grad(rs, z, valid, dp, tuple(rowsum(a, i) for a in stats),
                               rowsum(delta, i), st.GradCarry(rowsum(ca, i), rowsum(cb, i)),
                               ctx, weights_dtype=v.dtype)
      dv_j = dv_j + jnp.einsum("xqs,xqd->xsd", p.astype(doi.dtype), doi,
                               preferred_element_type=F32)
      dzc = dz.astype(qi.dtype)
      dk_j = dk_j + jnp.einsum("xqs,xqh->xsh", dzc, qi, preferred_element_type=F32)
      dq = bl._put_rows(dq, rowsum(dq, i) + jnp.einsum("xqs,xsh->xqh", dzc, kj,
                                                       preferred_element_type=F32), i, cfg)
      ca, cb = bl._put_rows(ca, gc.a, i, cfg), bl._put_rows(cb, gc.b, i, cfg)
      if cfg.has_bias:
        tshape = bias_shape[:3] + tuple(
            1 if bias_shape[a] == 1 else (cfg.bq, cfg.bk)[a - 3] for a in (3, 4))
        start = (0, 0, 0, 0 if bias_shape[3] == 1 else i * cfg.bq,
                 0 if bias_shape[4] == 1 else j * cfg.bk)
        cur = lax.dynamic_slice(dbias, start, tshape)
        dz5 = dz.reshape(cfg.b5 + (cfg.bq, cfg.bk))
        dbias = lax.dynamic_update_slice(dbias, cur + bl._sum_to(dz5, tshape), start)
      return dq, dk_j, dv_j, dbias, ca, cb

    dq, dkb, dvb, dbias, ca, cb = carry
    dk0 = jnp.zeros((k.shape[0], cfg.bk, k.shape[-1]), F32)
    dv0 = jnp.zeros((v.shape[0], cfg.bk, v.shape[-1]), F32)
    dq, dk_j, dv_j, dbias, ca, cb = lax.fori_loop(
        *bl._q_range(j, cfg), q_block, (dq, dk0, dv0, dbias, ca, cb))
    dkb = lax.dynamic_update_slice_in_dim(dkb, dk_j, j * cfg.bk, axis=1)
    dvb = lax.dynamic_update_slice_in_dim(dvb, dv_j, j * cfg.bk, axis=1)
    return dq, dkb, dvb, dbias, ca, cb

  rows0 = jnp.zeros(q.shape[:3], F32)
  init = (jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32),
          jnp.zeros(bias_shape, F32) if cfg.has_bias else jnp.zeros((), F32), rows0, rows0)
  dq_z, dk_z, dv, dbias_z, ca, _ = lax.fori_loop(0, cfg.nk, k_block, init)
  c = scale * alpha
  dq = dq_z * c
  dk = dk_z if qk_mult is None else dk_z * c
  dscale = alpha * jnp.sum(dq_z * q_raw.astype(F32))
  dbias = dbias_z * bias_mult if cfg.has_bias else None
  return dq, dk, dv, dbias, ca, dscale


# --------------------------------------------------------------------------------------------
# Chunks of heads.
# --------------------------------------------------------------------------------------------

def _forward(q, k, v, bias, mask, rowc, scale, cfg: bl._Cfg):
  x = q.shape[0]
  ccfg = dataclasses.replace(cfg, b5=cfg.chunk_b5())
  if cfg.xc == x:
    return _forward_chunk(q, k, v, bias, mask, rowc, scale, ccfg)
  rows = lambda a, c: None if a is None else bl._chunk_rows(a, c, cfg)

  def chunk(c, carry):
    res = _forward_chunk(rows(q, c), rows(k, c), rows(v, c), bl._chunk5(bias, c, cfg),
                         bl._chunk5(mask, c, cfg), rows(rowc, c), scale, ccfg)
    put = lambda buf, a: lax.dynamic_update_slice_in_dim(buf, a, c * cfg.xc, 0)
    out, stats, smean, passes = carry
    return (put(out, res[0]), tuple(put(b, a) for b, a in zip(stats, res[1], strict=True)),
            None if smean is None else put(smean, res[2]), jnp.maximum(passes, res[3]))

  rs = cfg.w.stream
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  init = (jnp.zeros((x, g, tp, hv), F32), tuple(jnp.zeros((x, g, tp), F32)
                                              for _ in range(rs.num_stats)),
          jnp.zeros((x, g, tp, hv), F32) if rs.saves_support_mean else None, jnp.int32(0))
  return lax.fori_loop(0, x // cfg.xc, chunk, init)


def _backward(q, k, v, bias, mask, rowc, scale, out, stats, smean, do, cfg: bl._Cfg):
  x = q.shape[0]
  ccfg = dataclasses.replace(cfg, b5=cfg.chunk_b5())
  if cfg.xc == x:
    return _backward_chunk(q, k, v, bias, mask, rowc, scale, out, stats, smean, do, ccfg)
  rows = lambda a, c: None if a is None else bl._chunk_rows(a, c, cfg)

  def chunk(c, carry):
    dq, dk, dv, dbias, drowc, dscale = carry
    dq_c, dk_c, dv_c, dbias_c, drowc_c, dscale_c = _backward_chunk(
        rows(q, c), rows(k, c), rows(v, c), bl._chunk5(bias, c, cfg), bl._chunk5(mask, c, cfg),
        rows(rowc, c), scale, rows(out, c), tuple(rows(a, c) for a in stats), rows(smean, c),
        rows(do, c), ccfg)
    put = lambda buf, a: lax.dynamic_update_slice_in_dim(buf, a, c * cfg.xc, 0)
    if cfg.has_bias:
      starts, sizes = bl._chunk5_start(bias, c, cfg)
      dbias = lax.dynamic_update_slice(
          dbias, lax.dynamic_slice(dbias, starts, sizes) + dbias_c, starts)
    return (put(dq, dq_c), put(dk, dk_c), put(dv, dv_c), dbias, put(drowc, drowc_c),
            dscale + dscale_c)

  init = (jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32),
          jnp.zeros(bias.shape, F32) if cfg.has_bias else None, jnp.zeros(q.shape[:3], F32),
          jnp.zeros((), F32))
  return lax.fori_loop(0, x // cfg.xc, chunk, init)


def _make_kernel(cfg: bl._Cfg):
  """A custom-VJP function of internal-layout (q, k, v, bias, mask, rowc, scale) -> O."""

  @jax.custom_vjp
  def kernel(q, k, v, bias, mask, rowc, scale):
    return _forward(q, k, v, bias, mask, rowc, scale, cfg)[0].astype(q.dtype)

  def fwd(q, k, v, bias, mask, rowc, scale):
    out, stats, smean, _ = _forward(q, k, v, bias, mask, rowc, scale, cfg)
    return out.astype(q.dtype), (q, k, v, bias, mask, rowc, scale, out, stats, smean)

  def bwd(res, do):
    q, k, v, bias, mask, rowc, scale, out, stats, smean = res
    dq, dk, dv, dbias, drowc, dscale = _backward(q, k, v, bias, mask, rowc, scale, out, stats,
                                                 smean, do, cfg)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else dbias.astype(bias.dtype), None,
            None if rowc is None else drowc, dscale.astype(scale.dtype))

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


def _problem(t: int, s: int, g: int, b: int, kh: int, is_causal: bool, block_q, block_k):
  bq, bk = bl.default_block_sizes(t, s, g)
  if is_causal:
    bq = min(bq, CAUSAL_BLOCK_Q)
  bq = min(block_q, bl._round_up(t, bl._ALIGN)) if block_q else bq
  bk = min(block_k, bl._round_up(s, bl._ALIGN)) if block_k else bk
  return bq, bk, bl.heads_per_chunk(b, kh, g, bq, bk)


def _cfg(weighting, t, s, b, kh, g, is_causal, block_q, block_k, has_mask, has_bias):
  bq, bk, xc = _problem(t, s, g, b, kh, is_causal, block_q, block_k)
  return bl._Cfg(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=is_causal, has_mask=has_mask,
                 has_bias=has_bias, b5=(b, kh, g), kh=kh, xc=xc)


def _inputs(q, k, v, bias, mask, weighting, is_causal, block_q, block_k, ssmax_s):
  """Checked, non-empty inputs in the kernel layout, and the problem's cfg."""
  _check_only(q, k, v, mask, weighting, block_q, block_k)
  b, t, n, h = q.shape
  _, s, kh, _ = k.shape
  g = n // kh
  cfg = _cfg(weighting, t, s, b, kh, g, is_causal, block_q, block_k, mask is not None,
             bias is not None)
  tp, sp = cfg.nq * cfg.bq, cfg.nk * cfg.bk
  rs = weighting.stream
  rowc = None
  if rs.needs_row_scale:
    bias4 = None if bias is None else bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    sv = jnp.asarray(rs.s if ssmax_s is None else ssmax_s, F32)
    if sv.ndim:  # one s per query head
      sv = jnp.broadcast_to(sv.reshape(-1), (n,))[None, :, None]
    c = st.row_scale(rs, _valid_counts(b, n, t, s, bias4, mask4, is_causal), sv)
    rowc = bl._pad_axis(c.reshape(b * kh, g, t), 2, tp)
  q, k, v, bias = nonfinite_inputs(q, k, v, bias)
  q4 = bl._pad_axis(q.transpose(0, 2, 1, 3).reshape(b * kh, g, t, h), 2, tp)
  k3 = bl._pad_axis(k.transpose(0, 2, 1, 3).reshape(b * kh, s, h), 1, sp)
  v3 = bl._pad_axis(v.transpose(0, 2, 1, 3).reshape(b * kh, s, -1), 1, sp)
  bias5 = bl._as_5d(bias, n, kh, "bias")
  mask5 = bl._as_5d(mask, n, kh, "mask")
  if bias5 is not None:
    bias5 = bl._pad_axis(bl._pad_axis(bias5, 3, tp, keep_one=True), 4, sp, keep_one=True)
  if mask5 is not None:
    mask5 = bl._pad_axis(bl._pad_axis(mask5, 3, tp, False, True), 4, sp, False, True)
  return (q4, k3, v3, bias5, mask5, rowc), cfg


def blocked_row_attention(q: Array, k: Array, v: Array, *, weighting: RowNormalizer,
                          scale: float | Array, bias: Array | None = None,
                          mask: Array | None = None, is_causal: bool = False,
                          block_q: int | None = None, block_k: int | None = None,
                          ssmax_s: Array | float | None = None) -> Array:
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
    block_q, block_k: tile sizes (default: the pointwise kernel's, with query blocks of at most
      :data:`CAUSAL_BLOCK_Q` rows when causal so that tiles above the diagonal are skipped).
    ssmax_s: SSMax only: s as a scalar or one value per query head [N] (an array gets a
      gradient); default the weighting's own s.

  Returns:
    [B, T, N, Hv] in q's dtype, equal up to float rounding to the dense weights' product with
    v (float32 accumulation).
  """
  _check_only(q, k, v, mask, weighting, block_q, block_k)
  b, t, n, _ = q.shape
  if q.size == 0 or k.shape[1] == 0:  # no query, or no key (every row has no valid key)
    return jnp.zeros((b, t, n, v.shape[-1]), q.dtype)
  arrays, cfg = _inputs(q, k, v, bias, mask, weighting, is_causal, block_q, block_k, ssmax_s)
  out = _make_kernel(cfg)(*arrays, jnp.asarray(scale, F32))
  return out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3)


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
  arrays, cfg = _inputs(q, k, v, bias, mask, weighting, is_causal, block_q, block_k, None)
  return _forward(*arrays, jnp.asarray(scale, F32), cfg)[3]
