"""Pallas kernels (Triton on a GPU, Mosaic on a TPU) for the whole-row weightings.

SSMax, softpick, stick-breaking, sparsemax and α-entmax run as the streaming families of
:mod:`attnx.core.streaming`: every kernel here does its per-tile math with that module's
``init`` / ``update`` / ``finalize`` / ``entmax_threshold`` / ``tile_grad`` (the definitions the
XLA blocked kernel :mod:`attnx.core.blocked_rows` uses), spelled with the :class:`streaming.Ops`
the two lowerings accept (:data:`GPU_OPS`, :data:`TPU_OPS`). Layout, padding, masks, lengths,
bias and GQA are those of the pointwise Pallas kernels (:mod:`attnx.core.pallas_kernels`,
whose tile helpers these kernels call).

Kernels (the same bodies on both backends; keys are streamed by in-kernel loops, so a program
holds its rows' streaming state in registers / VMEM values):

* forward: one program per (query tile, batch, head). Sparsemax / entmax first find each
  row's threshold τ with passes over the row's key tiles, then one pass over the key tiles
  (from the last tile backwards for stick-breaking) accumulates the state; writes O, the row
  statistics of ``finalize`` (and Σu·v/Σu for entmax).
* dQ: one program per (query tile, batch, head), looping over the key tiles (last first for
  stick-breaking) with the family's per-row carries (:class:`streaming.GradCarry`) in
  registers; writes dQ, SSMax's dc (the cotangent of the per-row scale c_i), optionally dS
  (the bias gradient before the sum over broadcast dims), and for stick-breaking the carries
  of every row at every key tile (the stick L and Σ A·dP of the keys after the tile; GPU
  [B, N, key tiles, Tp], TPU [B, N, Tp, key tiles]: O(T·S/block_k) floats, an intermediate of
  the backward, not a residual).
* dK/dV: one program per (key tile, batch, kv head), looping over the G query heads that share
  it and over the query tiles that see it; stick-breaking reads its carries from the dQ pass
  (so its dQ and dK/dV passes use the same key tiles).

Saved for the backward (O(T)): the output in float32, the row statistics and, for entmax,
Σu·v/Σu.

SSMax's per-row scale c_i = s·log n_i is computed outside (:func:`row_scale`) and enters as a
[B, N, Tp] input with a gradient, so a learned s (scalar or per head) gets one by autodiff.

Backends: on the GPU (Triton) arrays stay in the [B, T, N, H] layout with key/value blocks of
the whole padded sequence read tile by tile (strided loads), q/k head dims in power-of-2
chunks, the value head dim padded to a power of 2. On the TPU (Mosaic) arrays are [B, N, T, H]
and a program's whole key/value (dK/dV: query) sequence is one VMEM block that the loops slice;
row values are lane-replicated [rows, 128] arrays. :func:`tpu_vmem_bytes` estimates the VMEM
this needs; above :data:`TPU_VMEM_LIMIT` the combination is unsupported (use "blocked").
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from attnx.core import pallas_kernels as pk
from attnx.core import streaming as st
from attnx.core.contract import finite
from attnx.core.kernels import common
from attnx.core.weightings import RowNormalizer

Array = jax.Array
F32 = jnp.float32
LANES = pk.LANES
# Triton: no reverse cumsum, concatenation of [..., 1] arrays only, no boolean reductions.
# The threshold passes run as a fori_loop with skipped passes: the while_loop form lowers, but
# for α ∉ {1.5, 2} jaxlib 0.11.2 segfaulted compiling it for an H100 (2026-11-25; not reduced
# to a smaller kernel: a while_loop around libdevice calls alone compiles).
GPU_OPS = st.Ops(cumsum_matmul=True, concat_pv=False, all_rows=False, threshold_loop="fori")
# Mosaic: no cumsum, a sign that needs the TPU's generation to lower.
TPU_OPS = st.Ops(cumsum_matmul=True, sign=False)
# VMEM a TPU program may use (whole-sequence blocks, double-buffered): about 3/4 of the 128 MiB
# of a v5e / v6e core; the compiler limit is raised to the estimate.
TPU_VMEM_LIMIT = 96 * 2**20

__all__ = ["GPU_OPS", "TPU_OPS", "TPU_VMEM_LIMIT", "backward", "forward", "make_kernel",
           "row_scale", "streams", "tpu_vmem_bytes"]


def streams(weighting: Any) -> bool:
  """Whether ``weighting`` is a whole-row weighting these kernels run."""
  return isinstance(weighting, RowNormalizer) and weighting.stream is not None


def _rs(cfg: pk.KernelConfig) -> st.RowStream:
  return cfg.w.stream


def _ops(cfg: pk.KernelConfig) -> st.Ops:
  return GPU_OPS if cfg.backend == "gpu" else TPU_OPS


def num_key_tiles(cfg: pk.KernelConfig) -> int:
  """Key tiles of the backward (stick-breaking's carries: one column per tile)."""
  return cfg.sp // cfg.bk_dkv


def _carry_cols(cfg: pk.KernelConfig) -> int:
  n = num_key_tiles(cfg)
  return max(1, 1 << (n - 1).bit_length()) if cfg.backend == "gpu" else n  # Triton: a power of 2


# --------------------------------------------------------------------------------------------
# SSMax's per-row scale, outside the kernels.
# --------------------------------------------------------------------------------------------

def row_scale(rs: st.RowStream, b: int, n: int, t: int, s: int, bias4: Array | None,
              mask4: Array | None, is_causal: bool, kv_lengths: Array | None,
              s_param: Array | float | None) -> Array:
  """[B, N, T] float32 c_i = s·log max(n_i, 1), n_i the keys row i attends (mask, bias ≠ −∞,
  causal, key lengths), as :func:`attnx.core.blocked_rows._valid_counts`; ``s_param`` a scalar
  or one value per query head [N] (default the weighting's s)."""
  rows = jnp.arange(t)
  if mask4 is None and bias4 is None:  # closed form: no [T, S] intermediate
    n_valid = jnp.clip(rows + 1, 0, s) if is_causal else jnp.full((t,), s)
    n_valid = jnp.broadcast_to(n_valid, (b, t))
    if kv_lengths is not None:
      n_valid = jnp.minimum(n_valid, kv_lengths[:, None])
    counts = jnp.broadcast_to(n_valid.astype(F32)[:, None, :], (b, n, t))
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
  return st.row_scale(rs, counts, _per_head(rs, s_param, n))


def _per_head(rs: st.RowStream, s_param: Array | float | None, n: int) -> Array:
  sv = jnp.asarray(rs.s if s_param is None else s_param, F32)
  if sv.ndim:  # one s per query head
    sv = jnp.broadcast_to(sv.reshape(-1), (n,))[None, :, None]
  return sv


# --------------------------------------------------------------------------------------------
# Tile loops shared by both backends (values and ref accessors, no layout).
# --------------------------------------------------------------------------------------------

def _tile_fn(cfg, i, bq, bk, qs, load_k, bias_cols, mask_cols, q_len, kv_len):
  """tile(j) -> (z [bq, bk] float32, valid [bq, bk] bool, the key tile's head-dim chunks) of
  query tile i and key tile j."""
  def tile(j):
    c0 = j * bk
    ks = load_k(c0)
    z = pk.tile_scores(cfg, qs, ks, bias_cols(c0))
    valid = pk.tile_valid(cfg, (bq, bk), i * bq, c0, mask_cols(c0), q_len, kv_len)
    return z, _scored(z, valid), ks
  return tile


def _scored(z, valid):
  """valid without the keys whose score is −∞, which are masked (NaN stays valid: the row is
  NaN); ``valid`` None means every key."""
  scored = z != -jnp.inf
  return scored if valid is None else valid & scored


def _forward_rows(cfg, tile, load_v, hi, rowc, bq: int, hv: int):
  """(O, row statistics, Σu·v/Σu or None) of one query tile: threshold passes (entmax), then
  one pass over key tiles [0, hi) (last first for stick-breaking)."""
  rs, ops = _rs(cfg), _ops(cfg)
  bk = cfg.bk
  rows = (bq,)
  ctx = rowc if rs.needs_row_scale else None
  if rs.needs_threshold:
    def tile_pass(fn, init):
      return lax.fori_loop(0, hi, lambda j, c: fn(c, *tile(j)[:2]), init)
    ctx = st.entmax_threshold(tile_pass, rows, rs, ops)

  skip = _skips(cfg)

  def body(r, state):
    j = hi - 1 - r if rs.reverse else r
    z, valid, _ = tile(j)
    add = lambda state: st.update(rs, state, z, valid, load_v(j * bk), ctx, ops)
    if not skip:
      return add(state)
    # A tile of zero weights adds exact zeros: no powers, no P·V (AdaSplash's block skipping).
    return lax.cond(st.entmax_zero_tile(z, valid, ctx.m, ctx.tau, rs, ops), lambda s: s, add,
                    state)

  state = lax.fori_loop(0, hi, body, st.init(rs, rows, hv))
  return st.finalize(rs, state, ctx)


def _skips(cfg) -> bool:
  """Whether the kernels leave out the work of key tiles whose weights are all zero."""
  return _rs(cfg).needs_threshold and cfg.skip_zero_tiles


def _all_finite(xs) -> Array:
  """Whether every entry of the arrays xs is finite (a scalar bool; no boolean reductions)."""
  bad = sum(jnp.max(jnp.where(jnp.abs(x.astype(F32)) < jnp.inf, 0.0, 1.0)) for x in xs)
  return bad == 0.0


def _zero_grad_tile(cfg, z, valid, stats, do_ok) -> Array:
  """Whether a backward tile adds nothing: all its weights are zero (entmax's m, τ in the row
  statistics) and dO is finite (NaN or Inf in dO makes even a zero weight's products NaN, as
  autodiff of the dense weights)."""
  return st.entmax_zero_tile(z, valid, stats[0], stats[1], _rs(cfg), _ops(cfg)) & do_ok


def _one_hot_cols(n: int, j, x):
  """[rows, n]: x [rows] in column j, 0 elsewhere."""
  cols = lax.broadcasted_iota(jnp.int32, (x.shape[0], n), 1)
  return jnp.where(cols == j, x[:, None], 0.0)


def _col(x, j):
  """Column j of [rows, n] as [rows]."""
  cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(cols == j, x, 0.0), axis=1)


def _dq_rows(cfg, tile, qs, load_v, dos, hi, stats, delta, rowc, ds_store, carry_store):
  """(dQ in units of z [bq, H chunks], SSMax's dc or None) of one query tile: key tiles
  [0, hi), last first for stick-breaking, whose carries of the keys after tile j (the stick L
  and Σ A·dP) go to ``carry_store(j, L, ΣA·dP)`` for the dK/dV pass."""
  rs, ops = _rs(cfg), _ops(cfg)
  bq, bk = cfg.bq_dq, cfg.bk_dq

  skip = _skips(cfg)
  do_ok = _all_finite(dos) if skip else None

  def body(r, c):
    dq, ca, cb = c
    j = hi - 1 - r if rs.reverse else r
    c0 = j * bk
    z, valid, ks = tile(j)
    if rs.family == "stick_breaking":
      carry_store(j, ca, cb)

    def grad(dq):
      vt = load_v(c0)
      dp = pk.dot_chunks(dos, vt)
      _, dz, gc = st.tile_grad(rs, z, valid, dp, stats, delta, st.GradCarry(ca, cb), rowc, ops,
                               weights_dtype=vt[0].dtype)
      dq = tuple(a + jnp.dot(dz.astype(k.dtype), finite(k), preferred_element_type=F32)
                 for a, k in zip(dq, ks, strict=True))
      return dq, dz, gc.a, gc.b

    if skip:
      dq, dz, ca, cb = lax.cond(_zero_grad_tile(cfg, z, valid, stats, do_ok),
                                lambda dq: (dq, jnp.zeros_like(z), ca, cb), grad, dq)
    else:
      dq, dz, ca, cb = grad(dq)
    ds_store(c0, dz)
    return dq, ca, cb

  zero = jnp.zeros((bq,), F32)
  dq0 = tuple(jnp.zeros((bq, x.shape[-1]), F32) for x in qs)
  dq, ca, _ = lax.fori_loop(0, hi, body, (dq0, zero, zero))
  return dq, ca if rs.needs_row_scale else None


def _dkv_step(cfg, dkv, j, i, qs, dos, ks, vs, bias_t, mask_t, q_len, kv_len, stats, delta,
              rowc, carry):
  """(dK, dV) after query tile i (rows of one head) against key tile j in the dK/dV pass
  (``()`` for the one not wanted: dV needs the weights only, not dP = dO·Vᵀ nor V)."""
  rs, ops = _rs(cfg), _ops(cfg)
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  z = pk.tile_scores(cfg, qs, ks, bias_t)
  valid = _scored(z, pk.tile_valid(cfg, (bq, bk), i * bq, j * bk, mask_t, q_len, kv_len))

  def grad(dkv):
    dp = pk.dot_chunks(dos, vs) if dkv[0] else jnp.zeros((bq, bk), F32)
    p, dz, _ = st.tile_grad(rs, z, valid, dp, stats, delta, carry, rowc, ops,
                            weights_dtype=dos[0].dtype)
    return pk.accumulate_dkv(dkv, p, dz, qs, dos)

  # The split passes (GPU, wide heads) do not skip: the branch's merge of the accumulator
  # spilled registers (entmax dK at float32 H = 256: 3 KB) where the pass without it did not.
  if not _skips(cfg) or cfg.split_dkv:
    return grad(dkv)
  return lax.cond(_zero_grad_tile(cfg, z, valid, stats, _all_finite(dos)), lambda c: c, grad,
                  dkv)


def _split(refs, names):
  """Refs in order, as a dict over the names whose flag is True (None for the others)."""
  it = iter(refs)
  out = {name: (next(it) if on else None) for name, on in names}
  rest = list(it)
  assert not rest, len(rest)
  return out


def _fwd_names(cfg, has_bias, has_mask, lens_first: bool):
  rs = _rs(cfg)
  ins = [("q", True), ("k", True), ("v", True), ("rowc", rs.needs_row_scale),
         ("bias", has_bias), ("mask", has_mask)]
  lens = [("qlen", True), ("kvlen", True)]
  outs = [("o", True)] + [(f"stat{n}", True) for n in range(rs.num_stats)] + [
      ("smean", rs.saves_support_mean)]
  return (lens + ins if lens_first else ins + lens) + outs


def _bwd_rows_in(cfg):
  rs = _rs(cfg)
  return ([(f"stat{n}", True) for n in range(rs.num_stats)] + [("delta", True),
                                                                ("rowc", rs.needs_row_scale)])


def _dq_names(cfg, has_bias, has_mask, want_ds, lens_first: bool):
  rs = _rs(cfg)
  ins = [("q", True), ("k", True), ("v", True), ("do", True)] + _bwd_rows_in(cfg) + [
      ("bias", has_bias), ("mask", has_mask)]
  lens = [("qlen", True), ("kvlen", True)]
  stick = rs.family == "stick_breaking"
  outs = [("dq", True), ("ds", want_ds), ("dc", rs.needs_row_scale), ("ca", stick),
          ("cb", stick)]
  return (lens + ins if lens_first else ins + lens) + outs


def _dkv_names(cfg, has_bias, has_mask, lens_first: bool, want_dk: bool = True,
               want_dv: bool = True):
  stick = _rs(cfg).family == "stick_breaking"
  ins = [("q", True), ("k", True), ("v", True), ("do", True)] + _bwd_rows_in(cfg) + [
      ("bias", has_bias), ("mask", has_mask), ("ca", stick), ("cb", stick)]
  lens = [("qlen", True), ("kvlen", True)]
  return (lens + ins if lens_first else ins + lens) + [("dk", want_dk), ("dv", want_dv)]


def _stat_refs(r, cfg):
  return [r[f"stat{n}"] for n in range(_rs(cfg).num_stats)]


# --------------------------------------------------------------------------------------------
# GPU (Triton): [B, T, N, H] layout, grid over query (or key) tiles.
# --------------------------------------------------------------------------------------------

def _gpu_fwd_kernel(*refs, cfg, has_bias, has_mask):
  r = _split(refs, _fwd_names(cfg, has_bias, has_mask, lens_first=False))
  bq, bk = cfg.bq, cfg.bk
  hc = pk.head_chunks(r["q"].shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = r["qlen"][0], r["kvlen"][0]
  qs = pk.load_chunks(r["q"], slice(None), hc)
  k_ref, v_ref, bias_ref, mask_ref = r["k"], r["v"], r["bias"], r["mask"]
  tile = _tile_fn(cfg, i, bq, bk, qs, lambda c0: pk.load_chunks(k_ref, pl.ds(c0, bk), hc),
                  lambda c0: None if bias_ref is None else pk.ref_cols(bias_ref, c0, bk),
                  lambda c0: None if mask_ref is None else pk.ref_cols(mask_ref, c0, bk),
                  q_len, kv_len)
  hi = pk.kv_hi(cfg, i, bq, bk, q_len, kv_len)
  rowc = None if r["rowc"] is None else r["rowc"][...]
  o, stats, smean = _forward_rows(cfg, tile, lambda c0: v_ref[pl.ds(c0, bk), :], hi, rowc, bq,
                                  v_ref.shape[-1])
  r["o"][...] = o.astype(r["o"].dtype)
  for ref, x in zip(_stat_refs(r, cfg), stats, strict=True):
    ref[...] = x
  if smean is not None:
    r["smean"][...] = smean


def _gpu_forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype):
  b, tp, n, hp = q.shape
  hvp = v.shape[-1]
  bq, g, sp = cfg.bq, cfg.g, cfg.sp
  rs = _rs(cfg)
  row = pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0))
  kv = lambda d: pl.BlockSpec((None, sp, None, d), lambda i, bb, h: (bb, 0, lax.div(h, g), 0))
  rowvec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
  in_specs = [row, kv(hp), kv(hvp)] + ([rowvec] if rowc is not None else [])
  for x in (bias, mask):
    in_specs += pk.gpu_bias_specs(x, (1, 1, bq, sp), lambda i, bb, h: (bb, h, i, 0))
  in_specs += [pl.BlockSpec((1,), lambda i, bb, h: (bb,))] * 2
  orow = pl.BlockSpec((None, bq, None, hvp), lambda i, bb, h: (bb, i, h, 0))
  out_specs = [orow] + [rowvec] * rs.num_stats
  out_shape = [jax.ShapeDtypeStruct((b, tp, n, hvp), out_dtype)] + [
      jax.ShapeDtypeStruct((b, n, tp), F32)] * rs.num_stats
  if rs.saves_support_mean:
    out_specs.append(orow)
    out_shape.append(jax.ShapeDtypeStruct((b, tp, n, hvp), F32))
  args = [x for x in (q, k, v, rowc, bias, mask) if x is not None] + [q_len, kv_len]
  res = pl.pallas_call(
      functools.partial(_gpu_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                        has_mask=mask is not None),
      grid=(tp // bq, b, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="attnx_pallas_rows_fwd")(*args)
  o, stats = res[0], tuple(res[1:1 + rs.num_stats])
  return o, stats, (res[-1] if rs.saves_support_mean else None)


def _gpu_dq_kernel(*refs, cfg, has_bias, has_mask, want_ds):
  r = _split(refs, _dq_names(cfg, has_bias, has_mask, want_ds, lens_first=False))
  bq, bk = cfg.bq_dq, cfg.bk_dq
  hc, vc = pk.head_chunks(r["q"].shape[-1]), pk.head_chunks(r["v"].shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = r["qlen"][0], r["kvlen"][0]
  qs = pk.load_chunks(r["q"], slice(None), hc)
  dos = pk.load_chunks(r["do"], slice(None), vc)
  k_ref, v_ref, bias_ref, mask_ref, ds_ref = r["k"], r["v"], r["bias"], r["mask"], r["ds"]
  load_k = lambda c0: pk.load_chunks(k_ref, pl.ds(c0, bk), hc)
  tile = _tile_fn(cfg, i, bq, bk, qs, load_k,
                  lambda c0: None if bias_ref is None else pk.ref_cols(bias_ref, c0, bk),
                  lambda c0: None if mask_ref is None else pk.ref_cols(mask_ref, c0, bk),
                  q_len, kv_len)
  hi = pk.kv_hi(cfg, i, bq, bk, q_len, kv_len)
  stats = tuple(ref[...] for ref in _stat_refs(r, cfg))
  rowc = None if r["rowc"] is None else r["rowc"][...]

  def ds_store(c0, dz):
    if ds_ref is not None:
      ds_ref[:, pl.ds(c0, bk)] = dz

  ca_ref, cb_ref = r["ca"], r["cb"]

  def carry_store(j, ca, cb):  # [key tiles, rows] blocks: row j
    ca_ref[j, :], cb_ref[j, :] = ca, cb

  dq, dc = _dq_rows(cfg, tile, qs, lambda c0: pk.load_chunks(v_ref, pl.ds(c0, bk), vc), dos,
                    hi, stats, r["delta"][...], rowc, ds_store, carry_store)
  pk.store_chunks(r["dq"], dq, hc, cfg.grad_mult[0])
  if dc is not None:
    r["dc"][...] = dc
  if ca_ref is not None:  # key tiles the rows do not reach: no carry
    def zero_carry(j, c):
      carry_store(j, jnp.zeros((bq,), F32), jnp.zeros((bq,), F32))
      return c
    lax.fori_loop(hi, ca_ref.shape[0], zero_carry, 0)
  if ds_ref is not None:  # tiles the loop skipped get a zero score cotangent
    def zero(j, c):
      ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), F32)
      return c
    lax.fori_loop(hi, cfg.sp // bk, zero, 0)


def _gpu_dkv_kernel(*refs, cfg, has_bias, has_mask, want_dk=True, want_dv=True):
  r = _split(refs, _dkv_names(cfg, has_bias, has_mask, False, want_dk, want_dv))
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  hc, vc = pk.head_chunks(r["k"].shape[-1]), pk.head_chunks(r["v"].shape[-1])
  j = pl.program_id(0)
  q_len, kv_len = r["qlen"][0], r["kvlen"][0]
  ks = pk.load_chunks(r["k"], slice(None), hc)
  vs = pk.load_chunks(r["v"], slice(None), vc) if want_dk else None
  lo, hi = pk.q_range(cfg, j, bq, bk, q_len, kv_len)
  q_ref, do_ref, bias_ref, mask_ref = r["q"], r["do"], r["bias"], r["mask"]
  stat_refs = _stat_refs(r, cfg)

  def head(h, carry):
    def q_block(i, dkv):
      rows = pl.ds(i * bq, bq)
      qs, dos = pk.load_chunks3(q_ref, rows, h, hc), pk.load_chunks3(do_ref, rows, h, vc)
      bias_t = mask_t = None
      if bias_ref is not None:
        bias_t = bias_ref[h if bias_ref.shape[0] > 1 else 0,
                          rows if bias_ref.shape[1] > 1 else pl.ds(0, 1), :]
      if mask_ref is not None:
        mask_t = mask_ref[h if mask_ref.shape[0] > 1 else 0,
                          rows if mask_ref.shape[1] > 1 else pl.ds(0, 1), :]
      stats = tuple(ref[h, rows] for ref in stat_refs)
      rowc = None if r["rowc"] is None else r["rowc"][h, rows]
      carry = st.GradCarry(jnp.zeros((bq,), F32), jnp.zeros((bq,), F32))
      if r["ca"] is not None:
        carry = st.GradCarry(r["ca"][h, j, rows], r["cb"][h, j, rows])
      return _dkv_step(cfg, dkv, j, i, qs, dos, ks, vs, bias_t, mask_t, q_len, kv_len,
                       stats, r["delta"][h, rows], rowc, carry)
    return lax.fori_loop(lo, hi, q_block, carry)

  init = (tuple(jnp.zeros((bk, c), F32) for _, c in hc) if want_dk else (),
          tuple(jnp.zeros((bk, c), F32) for _, c in vc) if want_dv else ())
  dk, dv = lax.fori_loop(0, cfg.g, head, init)
  if want_dk:
    pk.store_chunks(r["dk"], dk, hc, cfg.grad_mult[0])
  if want_dv:
    pk.store_chunks(r["dv"], dv, vc)


def _gpu_backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc, want_ds):
  b, tp, n, hp = q.shape
  _, sp, kh, _ = k.shape
  hvp = v.shape[-1]
  g = cfg.g
  rs = _rs(cfg)
  stick = rs.family == "stick_breaking"
  has = dict(has_bias=bias is not None, has_mask=mask is not None)
  lens = [pl.BlockSpec((1,), lambda i, bb, h: (bb,))] * 2
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
  dq_params = plgpu.CompilerParams(num_warps=cfg.num_warps_dq, num_stages=cfg.num_stages_bwd)
  rows = list(rows) + ([rowc] if rowc is not None else [])
  nrows = len(rows)
  ncols = _carry_cols(cfg)

  # dQ (dS, dc, carries): grid over query tiles of every query head.
  bq, kv = cfg.bq_dq, lambda i, bb, h: (bb, 0, lax.div(h, g), 0)
  qmap = lambda i, bb, h: (bb, i, h, 0)
  rowvec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
  in_specs = [pl.BlockSpec((None, bq, None, hp), qmap), pl.BlockSpec((None, sp, None, hp), kv),
              pl.BlockSpec((None, sp, None, hvp), kv), pl.BlockSpec((None, bq, None, hvp), qmap)]
  in_specs += [rowvec] * nrows
  for x in (bias, mask):
    in_specs += pk.gpu_bias_specs(x, (1, 1, bq, sp), lambda i, bb, h: (bb, h, i, 0))
  out_specs = [pl.BlockSpec((None, bq, None, hp), qmap)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, sp), lambda i, bb, h: (bb, h, i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), F32))
  if rs.needs_row_scale:
    out_specs.append(rowvec)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp), F32))
  if stick:  # [B, N, key tiles, Tp]: the carries of each row at each key tile
    out_specs += [pl.BlockSpec((None, None, ncols, bq), lambda i, bb, h: (bb, h, 0, i))] * 2
    out_shape += [jax.ShapeDtypeStruct((b, n, ncols, tp), F32)] * 2
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + [q_len, kv_len]
  res = list(pl.pallas_call(
      functools.partial(_gpu_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid=(tp // bq, b, n), in_specs=in_specs + lens, out_specs=out_specs,
      out_shape=out_shape, compiler_params=dq_params, interpret=cfg.interpret,
      name="attnx_pallas_rows_dq")(*args))
  dq = res.pop(0)
  ds = res.pop(0) if want_ds else None
  dc = res.pop(0) if rs.needs_row_scale else None
  carries = res if stick else []

  # dK, dV: grid over key tiles of every kv head; the G query heads of a kv head in-kernel.
  bk = cfg.bk_dkv
  in_specs = [pl.BlockSpec((None, tp, g, hp), lambda j, bb, h: (bb, 0, h, 0)),
              pl.BlockSpec((None, bk, None, hp), lambda j, bb, h: (bb, j, h, 0)),
              pl.BlockSpec((None, bk, None, hvp), lambda j, bb, h: (bb, j, h, 0)),
              pl.BlockSpec((None, tp, g, hvp), lambda j, bb, h: (bb, 0, h, 0))]
  in_specs += [pl.BlockSpec((None, g, tp), lambda j, bb, h: (bb, h, 0))] * nrows
  for x in (bias, mask):
    if x is None:
      continue
    shape = x.shape
    blk = (None, 1 if shape[1] == 1 else g, 1 if shape[2] == 1 else tp,
           1 if shape[3] == 1 else bk)
    in_specs.append(pl.BlockSpec(
        blk, lambda j, bb, h, shape=shape: pk.bcast_index(shape, (bb, h, 0, j))))
  in_specs += [pl.BlockSpec((None, g, ncols, tp), lambda j, bb, h: (bb, h, 0, 0))] * len(carries)
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + carries + [
      q_len, kv_len]
  dk, dv = pk.gpu_dkv_passes(_gpu_dkv_kernel, cfg, args, in_specs + lens, k, v, params,
                             "attnx_pallas_rows", has)
  return dq, dk, dv, ds, dc


# --------------------------------------------------------------------------------------------
# TPU (Mosaic): [B, N, T, H] layout, whole-sequence VMEM blocks sliced by the loops, row values
# lane-replicated [rows, 128], lengths as scalar prefetch (SMEM).
# --------------------------------------------------------------------------------------------

def _lane0(x):
  """A lane-replicated [rows, 128] value as [rows]."""
  return x[:, 0]


def _to_lanes(x):
  return jnp.broadcast_to(x[:, None], (x.shape[0], LANES))


def _tpu_cols(ref, c0, size: int):
  return None if ref is None else pk.ref_cols(ref, pl.multiple_of(c0, LANES), size)


def _tpu_fwd_kernel(*refs, cfg, has_bias, has_mask):
  r = _split(refs, _fwd_names(cfg, has_bias, has_mask, lens_first=True))
  bq, bk = cfg.bq, cfg.bk
  b, i = pl.program_id(0), pl.program_id(2)
  q_len, kv_len = r["qlen"][b], r["kvlen"][b]
  k_ref, v_ref, bias_ref, mask_ref = r["k"], r["v"], r["bias"], r["mask"]
  ds = lambda c0: pl.ds(pl.multiple_of(c0, LANES), bk)
  tile = _tile_fn(cfg, i, bq, bk, [r["q"][...]], lambda c0: [k_ref[ds(c0), :]],
                  lambda c0: _tpu_cols(bias_ref, c0, bk),
                  lambda c0: _tpu_cols(mask_ref, c0, bk), q_len, kv_len)
  hi = pk.kv_hi(cfg, i, bq, bk, q_len, kv_len)
  rowc = None if r["rowc"] is None else _lane0(r["rowc"][...])
  o, stats, smean = _forward_rows(cfg, tile, lambda c0: v_ref[ds(c0), :], hi, rowc, bq,
                                  v_ref.shape[-1])
  r["o"][...] = o.astype(r["o"].dtype)
  for ref, x in zip(_stat_refs(r, cfg), stats, strict=True):
    ref[...] = _to_lanes(x)
  if smean is not None:
    r["smean"][...] = smean


def _tpu_bias_spec(x, bq_or_t: int, bk_or_s: int, lead: int | None, index) -> list:
  """A [Bb, Nb, Tb, Sb] bias/mask block of (lead|1 heads,) bq|1 rows and bk|1 keys."""
  if x is None:
    return []
  shape = x.shape
  blk = (None, None if lead is None else (1 if shape[1] == 1 else lead),
         bq_or_t if shape[2] > 1 else 1, bk_or_s if shape[3] > 1 else 1)
  return [pl.BlockSpec(blk, lambda *ids: pk.bcast_index(shape, index(*ids)))]


def _tpu_params(cfg, n_parallel: int, vmem: int):
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_parallel,
                              vmem_limit_bytes=int(max(32 * 2**20, min(vmem * 5 // 4,
                                                                       TPU_VMEM_LIMIT))))


def _tpu_forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype):
  b, n, tp, h = q.shape
  hv = v.shape[-1]
  bq, g, sp = cfg.bq, cfg.g, cfg.sp
  rs = _rs(cfg)
  rowmap = lambda bb, hh, i, *_: (bb, hh, i, 0)
  kvmap = lambda bb, hh, i, *_: (bb, lax.div(hh, g), 0, 0)
  lanes = pl.BlockSpec((None, None, bq, LANES), rowmap)
  in_specs = [pl.BlockSpec((None, None, bq, h), rowmap), pl.BlockSpec((None, None, sp, h), kvmap),
              pl.BlockSpec((None, None, sp, hv), kvmap)]
  in_specs += [lanes] if rowc is not None else []
  for x in (bias, mask):
    in_specs += _tpu_bias_spec(x, bq, sp, None, lambda bb, hh, i, *_: (bb, hh, i, 0))
  orow = pl.BlockSpec((None, None, bq, hv), rowmap)
  out_specs = [orow] + [lanes] * rs.num_stats
  out_shape = [jax.ShapeDtypeStruct((b, n, tp, hv), out_dtype)] + [
      jax.ShapeDtypeStruct((b, n, tp, LANES), F32)] * rs.num_stats
  if rs.saves_support_mean:
    out_specs.append(orow)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, hv), F32))
  args = [x for x in (q, k, v, None if rowc is None else pk.to_lanes_all(rowc), bias, mask)
          if x is not None]
  res = pl.pallas_call(
      functools.partial(_tpu_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                        has_mask=mask is not None),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, n, tp // bq), in_specs=in_specs, out_specs=out_specs),
      out_shape=out_shape,
      compiler_params=_tpu_params(cfg, 3, tpu_vmem_bytes(cfg, q.dtype, h, hv, bias, mask)),
      interpret=cfg.interpret, name="attnx_pallas_rows_fwd")(q_len, kv_len, *args)
  o, stats = res[0], tuple(x[..., 0] for x in res[1:1 + rs.num_stats])
  return o, stats, (res[-1] if rs.saves_support_mean else None)


def _tpu_dq_kernel(*refs, cfg, has_bias, has_mask, want_ds):
  r = _split(refs, _dq_names(cfg, has_bias, has_mask, want_ds, lens_first=True))
  bq, bk = cfg.bq_dq, cfg.bk_dq
  b, i = pl.program_id(0), pl.program_id(2)
  q_len, kv_len = r["qlen"][b], r["kvlen"][b]
  k_ref, v_ref, bias_ref, mask_ref, ds_ref = r["k"], r["v"], r["bias"], r["mask"], r["ds"]
  ds = lambda c0: pl.ds(pl.multiple_of(c0, LANES), bk)
  qs = [r["q"][...]]
  tile = _tile_fn(cfg, i, bq, bk, qs, lambda c0: [k_ref[ds(c0), :]],
                  lambda c0: _tpu_cols(bias_ref, c0, bk),
                  lambda c0: _tpu_cols(mask_ref, c0, bk), q_len, kv_len)
  hi = pk.kv_hi(cfg, i, bq, bk, q_len, kv_len)
  stats = tuple(_lane0(ref[...]) for ref in _stat_refs(r, cfg))
  rowc = None if r["rowc"] is None else _lane0(r["rowc"][...])

  if ds_ref is not None:
    ds_ref[...] = jnp.zeros(ds_ref.shape, F32)  # tiles the loop skips

  def ds_store(c0, dz):
    if ds_ref is not None:
      ds_ref[:, ds(c0)] = dz

  ca_ref, cb_ref = r["ca"], r["cb"]
  if ca_ref is not None:
    ca_ref[...] = jnp.zeros(ca_ref.shape, F32)
    cb_ref[...] = jnp.zeros(cb_ref.shape, F32)

  def carry_store(j, ca, cb):  # [rows, key tiles] blocks: column j (no dynamic lane index)
    ca_ref[...] += _one_hot_cols(ca_ref.shape[1], j, ca)
    cb_ref[...] += _one_hot_cols(cb_ref.shape[1], j, cb)

  dq, dc = _dq_rows(cfg, tile, qs, lambda c0: [v_ref[ds(c0), :]], [r["do"][...]], hi, stats,
                    _lane0(r["delta"][...]), rowc, ds_store, carry_store)
  r["dq"][...] = (dq[0] * cfg.grad_mult[0]).astype(r["dq"].dtype)
  if dc is not None:
    r["dc"][...] = _to_lanes(dc)


def _tpu_dkv_kernel(*refs, cfg, has_bias, has_mask):
  r = _split(refs, _dkv_names(cfg, has_bias, has_mask, lens_first=True))
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  b, j = pl.program_id(0), pl.program_id(2)
  q_len, kv_len = r["qlen"][b], r["kvlen"][b]
  ks, vs = [r["k"][...]], [r["v"][...]]
  lo, hi = pk.q_range(cfg, j, bq, bk, q_len, kv_len)
  q_ref, do_ref, bias_ref, mask_ref = r["q"], r["do"], r["bias"], r["mask"]
  stat_refs = _stat_refs(r, cfg)

  def head(h, carry):
    def q_block(i, dkv):
      rows = pl.ds(pl.multiple_of(i * bq, 8), bq)
      qs, dos = [q_ref[h, rows, :]], [do_ref[h, rows, :]]
      bias_t = mask_t = None
      if bias_ref is not None:
        bias_t = bias_ref[h if bias_ref.shape[0] > 1 else 0,
                          rows if bias_ref.shape[1] > 1 else pl.ds(0, 1), :]
      if mask_ref is not None:
        mask_t = mask_ref[h if mask_ref.shape[0] > 1 else 0,
                          rows if mask_ref.shape[1] > 1 else pl.ds(0, 1), :]
      stats = tuple(_lane0(ref[h, rows, :]) for ref in stat_refs)
      rowc = None if r["rowc"] is None else _lane0(r["rowc"][h, rows, :])
      carry = st.GradCarry(jnp.zeros((bq,), F32), jnp.zeros((bq,), F32))
      if r["ca"] is not None:
        carry = st.GradCarry(_col(r["ca"][h, rows, :], j), _col(r["cb"][h, rows, :], j))
      return _dkv_step(cfg, dkv, j, i, qs, dos, ks, vs, bias_t, mask_t, q_len, kv_len,
                       stats, _lane0(r["delta"][h, rows, :]), rowc, carry)
    return lax.fori_loop(lo, hi, q_block, carry)

  init = ((jnp.zeros((bk, ks[0].shape[-1]), F32),), (jnp.zeros((bk, vs[0].shape[-1]), F32),))
  dk, dv = lax.fori_loop(0, cfg.g, head, init)
  r["dk"][...] = (dk[0] * cfg.grad_mult[0]).astype(r["dk"].dtype)
  r["dv"][...] = dv[0].astype(r["dv"].dtype)


def _tpu_backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc, want_ds):
  b, n, tp, h = q.shape
  _, kh, sp, _ = k.shape
  hv = v.shape[-1]
  g = cfg.g
  rs = _rs(cfg)
  stick = rs.family == "stick_breaking"
  has = dict(has_bias=bias is not None, has_mask=mask is not None)
  rows = [pk.to_lanes_all(x) for x in list(rows) + ([rowc] if rowc is not None else [])]
  ncols = _carry_cols(cfg)
  vmem = tpu_vmem_bytes(cfg, q.dtype, h, hv, bias, mask, backward=True)

  # dQ (dS, dc, carries): grid (B, N, query tiles).
  bq = cfg.bq_dq
  rowmap = lambda bb, hh, i, *_: (bb, hh, i, 0)
  kvmap = lambda bb, hh, i, *_: (bb, lax.div(hh, g), 0, 0)
  lanes = pl.BlockSpec((None, None, bq, LANES), rowmap)
  in_specs = [pl.BlockSpec((None, None, bq, h), rowmap), pl.BlockSpec((None, None, sp, h), kvmap),
              pl.BlockSpec((None, None, sp, hv), kvmap),
              pl.BlockSpec((None, None, bq, hv), rowmap)]
  in_specs += [lanes] * len(rows)
  for x in (bias, mask):
    in_specs += _tpu_bias_spec(x, bq, sp, None, lambda bb, hh, i, *_: (bb, hh, i, 0))
  out_specs = [pl.BlockSpec((None, None, bq, h), rowmap)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, sp), rowmap))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), F32))
  if rs.needs_row_scale:
    out_specs.append(lanes)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, LANES), F32))
  if stick:
    out_specs += [pl.BlockSpec((None, None, bq, ncols), rowmap)] * 2
    out_shape += [jax.ShapeDtypeStruct((b, n, tp, ncols), F32)] * 2
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None]
  res = list(pl.pallas_call(
      functools.partial(_tpu_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, n, tp // bq), in_specs=in_specs, out_specs=out_specs),
      out_shape=out_shape, compiler_params=_tpu_params(cfg, 3, vmem), interpret=cfg.interpret,
      name="attnx_pallas_rows_dq")(q_len, kv_len, *args))
  dq = res.pop(0)
  ds = res.pop(0) if want_ds else None
  dc = res.pop(0)[..., 0] if rs.needs_row_scale else None
  carries = res if stick else []

  # dK, dV: grid (B, K, key tiles); the G query heads and the query tiles in-kernel.
  bk = cfg.bk_dkv
  headmap = lambda bb, hh, j, *_: (bb, hh, 0, 0)
  kvmap2 = lambda bb, hh, j, *_: (bb, hh, j, 0)
  in_specs = [pl.BlockSpec((None, g, tp, h), headmap), pl.BlockSpec((None, None, bk, h), kvmap2),
              pl.BlockSpec((None, None, bk, hv), kvmap2),
              pl.BlockSpec((None, g, tp, hv), headmap)]
  in_specs += [pl.BlockSpec((None, g, tp, LANES), headmap)] * len(rows)
  for x in (bias, mask):
    in_specs += _tpu_bias_spec(x, tp, bk, g, lambda bb, hh, j, *_: (bb, hh, 0, j))
  in_specs += [pl.BlockSpec((None, g, tp, ncols), headmap)] * len(carries)
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + carries
  dk, dv = pl.pallas_call(
      functools.partial(_tpu_dkv_kernel, cfg=cfg, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, kh, sp // bk), in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, None, bk, h), kvmap2),
                     pl.BlockSpec((None, None, bk, hv), kvmap2)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_tpu_params(cfg, 3, vmem), interpret=cfg.interpret,
      name="attnx_pallas_rows_dkv")(q_len, kv_len, *args)
  return dq, dk, dv, ds, dc


def tpu_vmem_bytes(cfg: pk.KernelConfig, dtype: Any, h: int, hv: int, bias: Any = None,
                   mask: Any = None, backward: bool = False) -> int:
  """An estimate of the VMEM one TPU program's blocks take (each double-buffered): the whole
  key/value sequence (forward, dQ) or the G heads' whole query sequence (dK/dV)."""
  item = jnp.dtype(dtype).itemsize
  sp, tp, g = cfg.sp, cfg.tp, cfg.g

  def extra(rows: int, cols: int, heads: int = 1) -> int:
    out = 0
    for x in (bias, mask):
      if x is not None:
        r = rows if x.shape[2] > 1 else 1
        c = cols if x.shape[3] > 1 else 1
        n = heads if x.shape[1] > 1 else 1
        out += n * max(r, 8) * max(c, LANES) * jnp.dtype(x.dtype).itemsize
    return out

  fwd = sp * (h + hv) * item + cfg.bq * (h + 2 * hv) * 4 + extra(cfg.bq, sp)
  if not backward:
    return 2 * fwd
  ncols = num_key_tiles(cfg)
  dq = sp * (h + hv) * item + cfg.bq_dq * (h + hv + 8 * LANES + 2 * ncols) * 4 + extra(
      cfg.bq_dq, sp) + (cfg.bq_dq * sp * 4)
  dkv = g * tp * ((h + hv) * item + 6 * LANES * 4 + 2 * ncols * 4) + extra(tp, cfg.bk_dkv, g)
  return 2 * max(fwd, dq, dkv)


# --------------------------------------------------------------------------------------------
# Entry points and the custom VJP.
# --------------------------------------------------------------------------------------------

def _bnth(x):
  return x.transpose(0, 2, 1, 3)


def forward(cfg: pk.KernelConfig, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype=None):
  """(O [B, Tp, N, Hv], row statistics (each [B, N, Tp] float32), Σu·v/Σu [B, Tp, N, Hv]
  float32 or None) of padded [B, Tp, N, H] arrays; ``rowc`` SSMax's [B, N, Tp] c or None."""
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if cfg.backend == "gpu":
    return _gpu_forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype)
  o, stats, smean = _tpu_forward(cfg, _bnth(q), _bnth(k), _bnth(v), rowc, bias, mask, q_len,
                                 kv_len, out_dtype)
  return _bnth(o), stats, None if smean is None else _bnth(smean)


def backward(cfg: pk.KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc,
             want_ds: bool):
  """(dq, dk, dv, dS [B, N, Tp, Sp] or None, dc [B, N, Tp] or None). ``rows``: the row
  statistics and δ (each [B, N, Tp] float32)."""
  if cfg.backend == "gpu":
    return _gpu_backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc, want_ds)
  dq, dk, dv, ds, dc = _tpu_backward(cfg, _bnth(q), _bnth(k), _bnth(v), bias, mask, q_len,
                                     kv_len, _bnth(do), rows, rowc, want_ds)
  return _bnth(dq), _bnth(dk), _bnth(dv), ds, dc


@functools.lru_cache(maxsize=512)
def make_kernel(cfg: pk.KernelConfig):
  """A custom-VJP function (q, k, v, bias, mask, q_len, kv_len, rowc) -> O of padded arrays
  (rowc: SSMax's per-row scale [B, N, Tp], None for the other families)."""
  rs = _rs(cfg)
  if rs.reverse and cfg.bk_dq != cfg.bk_dkv:
    raise ValueError(f"stick-breaking's dQ and dK/dV key tiles must agree (its carries are "
                     f"per key tile), got {cfg.bk_dq} and {cfg.bk_dkv}")

  @jax.custom_vjp
  def attn(q, k, v, bias, mask, q_len, kv_len, rowc):
    return forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len)[0]

  def fwd(q, k, v, bias, mask, q_len, kv_len, rowc):
    want_ds = bias is not None and bias.perturbed
    vals = [None if x is None else x.value for x in (q, k, v, bias, mask, q_len, kv_len, rowc)]
    q_, k_, v_, bias_, mask_, ql, kl, rowc_ = vals
    # O in float32 for δ = dO·O (the backward's row sums), q's dtype for the caller.
    o, stats, smean = forward(cfg, q_, k_, v_, rowc_, bias_, mask_, ql, kl, out_dtype=F32)
    marker = jnp.zeros((), F32) if want_ds else None
    return o.astype(q_.dtype), (*vals, o, stats, smean, marker)

  def bwd(res, do):
    q, k, v, bias, mask, q_len, kv_len, rowc, o, stats, smean, marker = res
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
      return (None,) * 8
    ref = smean if rs.saves_support_mean else o
    delta = jnp.sum(do.astype(F32) * ref, axis=-1).transpose(0, 2, 1)
    dq, dk, dv, ds, dc = backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, (*stats, delta),
                                  rowc, want_ds=marker is not None)
    dbias = None if ds is None else common.sum_to(ds, bias.shape).astype(bias.dtype)
    return dq, dk, dv, dbias, None, None, None, dc

  attn.defvjp(fwd, bwd, symbolic_zeros=True)
  return attn

