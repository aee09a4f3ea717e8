"""The whole-row weightings' Pallas kernels: what the Triton (:mod:`.triton_rows`) and Mosaic
(:mod:`.mosaic_rows`) kernels share.

SSMax, softpick, stick-breaking, sparsemax and α-entmax run as the streaming families of
:mod:`attnx.core.streaming`: every kernel does its per-tile math with that module's
``init`` / ``update`` / ``finalize`` / ``entmax_threshold`` / ``tile_grad`` (the definitions the
XLA blocked kernel :mod:`attnx.core.kernels.xla.rows` uses), spelled with the
:class:`~attnx.core.streaming.Ops` its lowering accepts (:data:`.triton_rows.OPS`,
:data:`.mosaic_rows.OPS`). Layout, padding, masks, lengths, bias and GQA are those of the
pointwise kernels (:mod:`.common`'s tile math).

Kernels (the same bodies on both backends, the loops of this module; keys are streamed by
in-kernel loops, so a program holds its rows' streaming state in registers / VMEM values):

* forward: one program per (query tile, batch, head). Sparsemax / entmax first find each
  row's threshold τ with passes over the row's key tiles, then one pass over the key tiles
  (from the last tile backwards for stick-breaking) accumulates the state; writes O, the row
  statistics of ``finalize`` (and Σu·v/Σu for entmax): :func:`forward_rows`.
* dQ: one program per (query tile, batch, head), looping over the key tiles (last first for
  stick-breaking) with the family's per-row carries (:class:`streaming.GradCarry`) in
  registers; writes dQ, SSMax's dc (the cotangent of the per-row scale c_i), optionally dS
  (the bias gradient before the sum over broadcast dims), and for stick-breaking the carries
  of every row at every key tile (the stick L and Σ A·dP of the keys after the tile; GPU
  [B, N, key tiles, Tp], TPU [B, N, Tp, key tiles]: O(T·S/block_k) floats, an intermediate of
  the backward, not a residual): :func:`dq_rows`.
* dK/dV: one program per (key tile, batch, kv head), looping over the G query heads that share
  it and over the query tiles that see it; stick-breaking reads its carries from the dQ pass
  (so its dQ and dK/dV passes use the same key tiles): :func:`dkv_step`.

Saved for the backward (O(T)): the output in float32, the row statistics and, for entmax,
Σu·v/Σu. A kernel's refs arrive in the order of :func:`fwd_names` / :func:`dq_names` /
:func:`dkv_names` (:func:`split_refs` names them).

Attention sinks (``cfg.sinks``; not stick-breaking): the forward kernel takes the sinks [N] as
one more operand and folds its head's sink, a key tile whose only valid column holds the score
and whose values are zero (:func:`sink_tile`), into entmax's threshold passes and the output
pass's starting state first, as the XLA kernel does; the dQ and dK/dV kernels are unchanged
(the saved statistics count the sink), and d sinks with the sink's term of SSMax's dc come
from the statistics and δ outside the kernels (:func:`sink_grad_rows`).

SSMax's per-row scale c_i = s·log n_i is computed outside (:func:`row_scale`) and enters as a
[B, N, Tp] input with a gradient, so a learned s (scalar or per head) gets one by autodiff.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import masks as masks_lib
from attnx.core import streaming as st
from attnx.core.contract import finite
from attnx.core.kernels.pallas.common import (
  KernelConfig,
  accumulate_dkv,
  alibi_tile,
  capped_grad,
  dot_chunks,
  span_loop,
  tile_scores,
  tile_scores_grad,
  tile_valid,
)
from attnx.core.kernels.xla import rows as xla_rows
from attnx.core.weightings import RowNormalizer

Array = jax.Array
F32 = jnp.float32

__all__ = ["dkv_names", "dkv_step", "dq_names", "dq_rows", "forward_rows", "fwd_names",
           "num_key_tiles", "row_scale", "sink_grad_rows", "sink_tile", "split_refs",
           "stat_refs_of", "streams", "tile_fn"]


def streams(weighting: Any) -> bool:
  """Whether ``weighting`` is a whole-row weighting these kernels run."""
  return isinstance(weighting, RowNormalizer) and weighting.stream is not None


def num_key_tiles(cfg: KernelConfig) -> int:
  """Key tiles of the backward (stick-breaking's carries: one column per tile)."""
  return cfg.sp // cfg.bk_dkv


# --------------------------------------------------------------------------------------------
# SSMax's per-row scale, outside the kernels.
# --------------------------------------------------------------------------------------------

def row_scale(rs: st.RowStream, b: int, n: int, t: int, s: int, bias4: Array | None,
              mask4: Array | None, is_causal: bool, kv_lengths: Array | None,
              s_param: Array | float | None, structured: Any = None, kv_heads: int = 1,
              tiles: tuple[int, int] = (128, 128), extra_keys: int = 0) -> Array:
  """[B, N, T] float32 c_i = s·log max(n_i, 1), n_i the keys row i attends (mask, bias ≠ −∞,
  causal, key lengths), counted as the XLA whole-row kernel counts them; ``s_param`` a scalar
  or one value per query head [N] (default the weighting's s). Under a bound ``structured``
  mask n_i is counted tile by tile (``tiles``; :func:`attnx.core.kernels.xla.rows.
  structured_counts`), without a T×S array."""
  if structured is not None:
    if is_causal:
      structured = masks_lib.Causal() & structured
    if kv_lengths is not None:
      structured = structured & masks_lib.SeqLengths(None, kv_lengths)
    counts = xla_rows.structured_counts(structured, bias4, mask4, b, n, kv_heads, t, s, *tiles)
    if extra_keys:
      counts = counts + extra_keys
    return st.row_scale(rs, counts, _per_head(rs, s_param, n))
  rows = jnp.arange(t)
  if mask4 is None and bias4 is None:  # closed form: no [T, S] intermediate
    n_valid = jnp.clip(rows + 1, 0, s) if is_causal else jnp.full((t,), s)
    n_valid = jnp.broadcast_to(n_valid, (b, t))
    if kv_lengths is not None:
      n_valid = jnp.minimum(n_valid, kv_lengths[:, None])
    counts = jnp.broadcast_to(n_valid.astype(F32)[:, None, :], (b, n, t))
    if extra_keys:
      counts = counts + extra_keys
    return st.row_scale(rs, counts, _per_head(rs, s_param, n))
  valid = jnp.ones((1, 1, t, s), bool)
  if mask4 is not None:
    valid = valid & mask4
  if bias4 is not None:
    valid = valid & (bias4 != -jnp.inf)
  if is_causal:
    valid = valid & (jnp.arange(s)[None, :] <= rows[:, None])
  if kv_lengths is not None:
    valid = valid & (jnp.arange(s) < kv_lengths[:, None, None, None])
  counts = jnp.broadcast_to(jnp.sum(valid, axis=-1, dtype=F32), (b, n, t))
  if extra_keys:
    counts = counts + extra_keys
  return st.row_scale(rs, counts, _per_head(rs, s_param, n))


def _per_head(rs: st.RowStream, s_param: Array | float | None, n: int) -> Array:
  sv = jnp.asarray(rs.s if s_param is None else s_param, F32)
  if sv.ndim:  # one s per query head
    sv = jnp.broadcast_to(sv.reshape(-1), (n,))[None, :, None]
  return sv


# --------------------------------------------------------------------------------------------
# Tile loops shared by both backends (values and ref accessors, no layout).
# --------------------------------------------------------------------------------------------

def tile_fn(cfg, i, bq, bk, qs, load_k, bias_cols, mask_cols, q_len, kv_len, sm=None,
            head=None, grad=False, slope=None, rel=None):
  """tile(j, masked=True) -> (z [bq, bk] float32, valid [bq, bk] bool, the key tile's head-dim
  chunks, d, dist) of query tile i and key tile j (``sm``: a structured mask, of query head
  ``head``; ``masked`` False: a tile of a full run (:func:`.common.kv_full`), every pair
  attends and only the keys whose score is −∞ are invalid);
  ``d`` the soft cap's derivative 1 − tanh² (:func:`.common.tile_scores_grad`) when ``grad``
  and ``cfg.cap``, else None (the forward computes z alone); ``dist`` ALiBi's −(i − j) or
  −abs(i − j) (:func:`.common.alibi_tile`, the bias ``slope``·dist added after the cap and
  the bias) when ``cfg.alibi``, else None. With ``cfg.relative``, ``rel(r0, c0)`` is the
  relative table's bias of the tile whose first row is query r0 and first column key c0 (the
  kernel's read of ext at :func:`.common.relative_index`), added likewise."""
  def tile(j, masked=True):
    c0 = j * bk
    ks = load_k(c0)
    lin = dist = None
    if cfg.alibi:  # (no op before the scores otherwise: the loops' programs stay as they were)
      lin, dist = alibi_tile(cfg, slope, (bq, bk), i * bq, c0)
    elif cfg.relative:
      lin = rel(i * bq, c0)
    if grad:
      z, d = tile_scores_grad(cfg, qs, ks, bias_cols(c0), lin)
    else:
      z, d = tile_scores(cfg, qs, ks, bias_cols(c0), lin), None
    valid = None if not masked else tile_valid(cfg, (bq, bk), i * bq, c0, mask_cols(c0), q_len,
                                               kv_len, sm, head)
    return z, _scored(z, valid), ks, d, dist
  return tile


def _walk(span, reverse: bool):
  """(count, tile(r)) of a loop r = 0 … count − 1 over the tiles [lo, hi) of ``span``: first
  to last, or last first (stick-breaking); ``span`` (0, hi) keeps the loop as it was without
  a mask."""
  lo, hi = span
  if reverse:
    return (hi if isinstance(lo, int) and lo == 0 else hi - lo), lambda r: hi - 1 - r
  if isinstance(lo, int) and lo == 0:
    return hi, lambda r: r
  return hi - lo, lambda r: lo + r


def walk_loop(span, full, reverse: bool, body, carry):
  """``body(j, carry, masked)`` over the key tiles of ``span`` (:func:`_walk`'s order); with a
  ``full`` run (:func:`.common.kv_full`), its tiles unmasked (:func:`.common.span_loop`)."""
  if full is not None:
    return span_loop(span, full, body, carry, reverse)
  count, at = _walk(span, reverse)
  return lax.fori_loop(0, count, lambda r, c: body(at(r), c, True), carry)


def _scored(z, valid):
  """valid without the keys whose score is −∞, which are masked (NaN stays valid: the row is
  NaN); ``valid`` None means every key."""
  scored = z != -jnp.inf
  return scored if valid is None else valid & scored


def sink_tile(sink, bq: int, bk: int, hv: int):
  """The attention sink as a key tile (z [bq, bk], valid [bq, bk], v [bk, hv]): column 0 holds
  the score ``sink`` (a scalar, the query head's) and is the only valid key, every value is
  zero. A whole tile, not one column: the lowerings' matmuls need full tiles (the P·V it adds
  is of zeros)."""
  z = jnp.full((bq, bk), sink, F32)
  valid = lax.broadcasted_iota(jnp.int32, (bq, bk), 1) == 0
  return z, valid, jnp.zeros((bk, hv), F32)


def forward_rows(cfg, ops, tile, load_v, span, rowc, bq: int, hv: int, sink=None, full=None,
                 full_passes: bool = True):
  """(O, row statistics, Σu·v/Σu or None, Σu with ``cfg.keep_u_sum`` or None) of one query
  tile: threshold passes (entmax), then
  one pass over the key tiles [lo, hi) of ``span`` (last first for stick-breaking); the tiles
  of the ``full`` run (:func:`.common.kv_full`) without the elementwise mask, in the threshold
  passes too with ``full_passes`` (else each pass is one masked loop).

  ``sink`` (with ``cfg.sinks``: the query head's sink, a scalar): one more key of every row,
  of score ``sink`` and zero value, folded first (:func:`sink_tile`) into the threshold passes'
  sums and the output pass's starting state, as the XLA kernel folds it (never
  stick-breaking)."""
  rs = cfg.w.stream
  bk = cfg.bk
  rows = (bq,)
  ctx = rowc if rs.needs_row_scale else None
  sk = None if sink is None else sink_tile(sink, bq, bk, hv)
  if rs.needs_threshold:
    def tile_pass(fn, init):
      if sk is not None:  # the sink is a key of every row
        init = fn(init, *sk[:2])
      return span_loop(span, full if full_passes else None,
                       lambda j, c, masked: fn(c, *tile(j, masked)[:2]), init)
    ctx = st.entmax_threshold(tile_pass, rows, rs, ops)

  skip = _skips(cfg)

  def body(j, state, masked):
    z, valid = tile(j, masked)[:2]
    add = lambda state: st.update(rs, state, z, valid, load_v(j * bk), ctx, ops)
    if not skip:
      return add(state)
    # A tile of zero weights adds exact zeros: no powers, no P·V (AdaSplash's block skipping).
    return lax.cond(st.entmax_zero_tile(z, valid, ctx.m, ctx.tau, rs, ops), lambda s: s, add,
                    state)

  state = st.init(rs, rows, hv)
  if sk is not None:
    state = st.update(rs, state, *sk, ctx, ops)
  state = walk_loop(span, full, rs.reverse, body, state)
  o, stats, smean = st.finalize(rs, state, ctx)
  return o, stats, smean, (state.u_sum if cfg.keep_u_sum else None)


def sink_grad_rows(cfg, sinks, stats, delta, rowc):
  """(d sinks [N] float32, the sink's term of SSMax's dc [B, N, Tp] or None), outside the
  kernels, from the saved row statistics and δ (each [B, N, Tp] float32): the sink is a key of
  zero value, so dP = 0 there and its score's cotangent is the family's tile rule
  (:func:`attnx.core.streaming.tile_grad`) on that key, summed over the batch and the rows of
  each head; SSMax's per-row carry Σ z·dy gets the sink's term (as in the XLA kernel's
  backward). Padding rows and rows past their length have δ = 0 and add nothing."""
  rs = cfg.w.stream
  z = jnp.broadcast_to(sinks.astype(F32)[None, :, None, None], delta.shape + (1,))
  zero = jnp.zeros(delta.shape, F32)
  _, dz, gc = st.tile_grad(rs, z, jnp.ones(z.shape, bool), jnp.zeros(z.shape, F32),
                           tuple(stats), delta, st.GradCarry(zero, zero), rowc)
  return jnp.sum(dz[..., 0], axis=(0, 2)), gc.a if rs.needs_row_scale else None


def _skips(cfg) -> bool:
  """Whether the kernels leave out the work of key tiles whose weights are all zero."""
  return cfg.w.stream.needs_threshold and cfg.skip_zero_tiles


def _all_finite(xs) -> Array:
  """Whether every entry of the arrays xs is finite (a scalar bool; no boolean reductions)."""
  bad = sum(jnp.max(jnp.where(jnp.abs(x.astype(F32)) < jnp.inf, 0.0, 1.0)) for x in xs)
  return bad == 0.0


def _zero_grad_tile(cfg, ops, z, valid, stats, do_ok) -> Array:
  """Whether a backward tile adds nothing: all its weights are zero (entmax's m, τ in the row
  statistics) and dO is finite (NaN or Inf in dO makes even a zero weight's products NaN, as
  autodiff of the dense weights)."""
  return st.entmax_zero_tile(z, valid, stats[0], stats[1], cfg.w.stream, ops) & do_ok


def dq_rows(cfg, ops, tile, qs, load_v, dos, span, stats, delta, rowc, ds_store, carry_store,
            full=None):
  """(dQ in units of z [bq, H chunks], SSMax's dc or None, stick-breaking's carries after
  the loop, and with ALiBi the rows' d slope sums Σ_j dz·dist [bq], else None) of one query
  tile: the key tiles [lo, hi) of ``span``, last first for stick-breaking, whose carries of
  the keys after tile j (the stick L and Σ A·dP) go to ``carry_store(j, L, ΣA·dP)`` for the
  dK/dV pass. Each key tile's score cotangent dS goes to ``ds_store(c0, dS)`` (zeros for a
  skipped tile): with ``cfg.relative`` the kernel accumulates d ext there. The tiles of the
  ``full`` run (:func:`.common.kv_full`) go without the elementwise mask."""
  rs = cfg.w.stream
  bq, bk = cfg.bq_dq, cfg.bk_dq

  skip = _skips(cfg)
  do_ok = _all_finite(dos) if skip else None

  alibi = cfg.alibi is not None

  def body(j, c, masked):
    dq, ca, cb = c[:3]
    c0 = j * bk
    z, valid, ks, d, dist = tile(j, masked)
    if rs.suffix_carries:  # the carries of the keys after tile j, for the dK/dV pass
      carry_store(j, ca, cb)

    def grad(dq):
      vt = load_v(c0)
      dp = dot_chunks(dos, vt)
      _, dz, gc = st.tile_grad(rs, z, valid, dp, stats, delta, st.GradCarry(ca, cb), rowc, ops,
                               weights_dtype=vt[0].dtype)
      dzq = capped_grad(dz, d)  # the cotangent of scale·q·k (dS stays that of z)
      dq = tuple(a + jnp.dot(dzq.astype(k.dtype), finite(k), preferred_element_type=F32)
                 for a, k in zip(dq, ks, strict=True))
      return dq, dz, gc.a, gc.b

    if skip:
      dq, dz, ca, cb = lax.cond(_zero_grad_tile(cfg, ops, z, valid, stats, do_ok),
                                lambda dq: (dq, jnp.zeros_like(z), ca, cb), grad, dq)
    else:
      dq, dz, ca, cb = grad(dq)
    ds_store(c0, dz)
    if alibi:  # d slope = Σ dS·dist (dS = dz: α = 1 for the whole-row families)
      return dq, ca, cb, c[3] + jnp.sum(dz * dist, axis=1)
    return dq, ca, cb

  zero = jnp.zeros((bq,), F32)
  dq0 = tuple(jnp.zeros((bq, x.shape[-1]), F32) for x in qs)
  out = walk_loop(span, full, rs.reverse, body, (dq0, zero, zero) + ((zero,) if alibi else ()))
  dq, ca, cb = out[:3]
  return dq, ca if rs.needs_row_scale else None, (ca, cb), out[3] if alibi else None


def dkv_step(cfg, ops, dkv, j, i, qs, dos, ks, vs, bias_t, mask_t, q_len, kv_len, stats, delta,
              rowc, carry, sm=None, head=None, slope=None, rel=None, masked=True):
  """(dK, dV) after query tile i (rows of one head) against key tile j in the dK/dV pass
  (``()`` for the one not wanted: dV needs the weights only, not dP = dO·Vᵀ nor V); ``slope``
  the head's ALiBi slope when ``cfg.alibi``; ``rel(r0, c0)`` the head's relative-table bias
  of a tile when ``cfg.relative`` (:func:`tile_fn`); ``masked`` False: a tile of a full run
  (:func:`.common.q_full`), no elementwise mask."""
  rs = cfg.w.stream
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  lin = None
  if cfg.alibi:
    lin = alibi_tile(cfg, slope, (bq, bk), i * bq, j * bk)[0]
  elif cfg.relative:
    lin = rel(i * bq, j * bk)
  z, d = tile_scores_grad(cfg, qs, ks, bias_t, lin)  # d: the soft cap's derivative, or None
  valid = _scored(z, None if not masked else tile_valid(cfg, (bq, bk), i * bq, j * bk, mask_t,
                                                       q_len, kv_len, sm, head))

  def grad(dkv):
    dp = dot_chunks(dos, vs) if dkv[0] else jnp.zeros((bq, bk), F32)
    p, dz, _ = st.tile_grad(rs, z, valid, dp, stats, delta, carry, rowc, ops,
                            weights_dtype=dos[0].dtype)
    return accumulate_dkv(dkv, p, capped_grad(dz, d), qs, dos)

  # The split passes (GPU, wide heads) do not skip: the branch's merge of the accumulator
  # spilled registers (entmax dK at float32 H = 256: 3 KB) where the pass without it did not.
  if not _skips(cfg) or cfg.two_pass_dkv:
    return grad(dkv)
  return lax.cond(_zero_grad_tile(cfg, ops, z, valid, stats, _all_finite(dos)), lambda c: c, grad,
                  dkv)


# --------------------------------------------------------------------------------------------
# The kernels' operands, in order.
# --------------------------------------------------------------------------------------------

def split_refs(refs, names):
  """Refs in order, as a dict over the names whose flag is True (None for the others); a flag
  that is an int (not a bool) takes that many refs, as a list."""
  it = iter(refs)
  out = {name: ([next(it) for _ in range(on)] if type(on) is int else next(it) if on else None)
         for name, on in names}
  rest = list(it)
  assert not rest, len(rest)
  return out


def _lens(cfg, lens_first: bool) -> list:
  """The lengths and a structured mask's refs: on the GPU (after the inputs) all of
  :func:`.masking.gpu_operands`'; on the TPU (scalar prefetch, first) its scalars and spans,
  its ids after the inputs (:func:`_ids`)."""
  p = cfg.smask
  n = 0 if p is None else (p.num_prefetch if lens_first else cfg.num_smask_refs)
  return [("qlen", True), ("kvlen", True), ("sm", n)]


def _ids(cfg, lens_first: bool) -> list:
  return [("sm_ids", cfg.smask.num_ids if lens_first and cfg.smask is not None else 0)]


def fwd_names(cfg, has_bias, has_mask, lens_first: bool):
  rs = cfg.w.stream
  ins = [("q", True), ("k", True), ("v", True), ("rowc", rs.needs_row_scale),
         ("bias", has_bias), ("mask", has_mask), ("slopes", cfg.mod_operand),
         ("sinks", cfg.sinks)] + _ids(cfg, lens_first)
  lens = _lens(cfg, lens_first)
  outs = [("o", True)] + [(f"stat{n}", True) for n in range(rs.num_stats)] + [
      ("smean", rs.saves_support_mean), ("usum", cfg.keep_u_sum)]
  return (lens + ins if lens_first else ins + lens) + outs


def _bwd_rows_in(cfg):
  rs = cfg.w.stream
  return ([(f"stat{n}", True) for n in range(rs.num_stats)] + [("delta", True),
                                                                ("rowc", rs.needs_row_scale)])


def dq_names(cfg, has_bias, has_mask, want_ds, lens_first: bool):
  rs = cfg.w.stream
  ins = [("q", True), ("k", True), ("v", True), ("do", True)] + _bwd_rows_in(cfg) + [
      ("bias", has_bias), ("mask", has_mask), ("slopes", cfg.mod_operand)] + _ids(
          cfg, lens_first)
  lens = _lens(cfg, lens_first)
  carries = rs.suffix_carries
  outs = [("dq", True), ("ds", want_ds), ("dc", rs.needs_row_scale),
          ("dslope", cfg.mod_operand), ("ca", carries), ("cb", carries)]
  return (lens + ins if lens_first else ins + lens) + outs


def dkv_names(cfg, has_bias, has_mask, lens_first: bool, want_dk: bool = True,
               want_dv: bool = True):
  carries = cfg.w.stream.suffix_carries
  ins = [("q", True), ("k", True), ("v", True), ("do", True)] + _bwd_rows_in(cfg) + [
      ("bias", has_bias), ("mask", has_mask), ("ca", carries), ("cb", carries),
      ("slopes", cfg.mod_operand)] + _ids(cfg, lens_first)
  lens = _lens(cfg, lens_first)
  return (lens + ins if lens_first else ins + lens) + [("dk", want_dk), ("dv", want_dv)]


def stat_refs_of(r, cfg):
  return [r[f"stat{n}"] for n in range(cfg.w.stream.num_stats)]
