"""The Triton (GPU) kernels of the whole-row weightings (:mod:`.rows` describes them).

Arrays stay in the [B, T, N, H] layout with key/value blocks of the whole padded sequence read
tile by tile (strided loads), q/k head dims in power-of-2 chunks (:func:`.triton.head_chunks`),
the value head dim padded to a power of 2; stick-breaking's carries are [B, N, key tiles, Tp]
with the key tiles padded to a power of 2. A relative table as in :mod:`.triton` (the gathered
bias in every pass's tile scores, d ext added to by the dQ kernel's :func:`.triton.scatter_add`
from each tile's dS).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attnx.core import streaming as st
from attnx.core.kernels.pallas import triton
from attnx.core.kernels.pallas.common import (
    KernelConfig,
    bcast_index,
    kv_full,
    kv_span,
    q_span,
    ref_cols,
    relative_index,
)
from attnx.core.kernels.pallas.rows import (
    dkv_names,
    dkv_step,
    dq_names,
    dq_rows,
    forward_rows,
    fwd_names,
    num_key_tiles,
    split_refs,
    stat_refs_of,
    tile_fn,
)

Array = jax.Array
F32 = jnp.float32
# Triton: no reverse cumsum, concatenation of [..., 1] arrays only, no boolean reductions.
# The threshold passes run as a fori_loop with skipped passes: the while_loop form lowers, but
# for α ∉ {1.5, 2} the Triton compiler crashed on it (docs/guides/pallas.md).
OPS = st.Ops(cumsum_matmul=True, concat_pv=False, all_rows=False, threshold_loop="fori",
             support_stop=False)

__all__ = ["OPS", "backward", "forward"]


def _carry_cols(cfg: KernelConfig) -> int:
  """Columns of stick-breaking's carries: the key tiles, padded to a power of 2 (Triton)."""
  n = num_key_tiles(cfg)
  return max(1, 1 << (n - 1).bit_length())


def _mod(cfg, ref, bq: int, bk: int, head=None):
  """(ALiBi's slope or None, the relative table's rel(r0, c0) or None) of a program from the
  score modification's ref: ALiBi's [1] block at the query head (``head`` None) or [Gp] row
  of the kv head's slopes; a relative table's [Lx] row of ext at the query head or its [G, Lx]
  rows, read at ``head`` (:func:`.triton.rel_tile`)."""
  if cfg.alibi:
    return ref[0 if head is None else head], None
  if cfg.relative:
    return None, lambda r0, c0: triton.rel_tile(cfg, ref, (bq, bk), r0, c0, head)[0]
  return None, None


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, cfg, has_bias, has_mask):
  r = split_refs(refs, fwd_names(cfg, has_bias, has_mask, lens_first=False))
  bq, bk = cfg.bq, cfg.bk
  hc = triton.head_chunks(r["q"].shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = r["qlen"][0], r["kvlen"][0]
  sm = triton.smask_view(cfg, r["sm"], "fwd", bq, bk)
  qs = triton.load_chunks(r["q"], slice(None), hc)
  k_ref, v_ref, bias_ref, mask_ref = r["k"], r["v"], r["bias"], r["mask"]
  slope, rel = _mod(cfg, r["slopes"], bq, bk)
  tile = tile_fn(cfg, i, bq, bk, qs, lambda c0: triton.load_chunks(k_ref, pl.ds(c0, bk), hc),
                  lambda c0: None if bias_ref is None else ref_cols(bias_ref, c0, bk),
                  lambda c0: None if mask_ref is None else ref_cols(mask_ref, c0, bk),
                  q_len, kv_len, sm, None if sm is None else pl.program_id(2), slope=slope,
                  rel=rel)
  span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  # The output pass runs the full tiles unmasked; the threshold passes and the backward
  # kernels keep one masked loop: split there, the loops spilled registers compiled for an
  # H100 (entmax's forward 8–32 B; the dK/dV kernels about twice their spills, docs/known_limits).
  full = kv_full(cfg, i, bq, bk, q_len, kv_len, span, has_mask, sm)
  rowc = None if r["rowc"] is None else r["rowc"][...]
  sink = None if r["sinks"] is None else r["sinks"][0]  # [1]: the query head's sink
  o, stats, smean, usum = forward_rows(cfg, OPS, tile, lambda c0: v_ref[pl.ds(c0, bk), :], span,
                                       rowc, bq, v_ref.shape[-1], sink, full, False)
  r["o"][...] = o.astype(r["o"].dtype)
  for ref, x in zip(stat_refs_of(r, cfg), stats, strict=True):
    ref[...] = x
  if smean is not None:
    r["smean"][...] = smean
  if usum is not None:
    r["usum"][...] = usum


def forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype, smask=None, slopes=None,
            sinks=None):
  b, tp, n, hp = q.shape
  hvp = v.shape[-1]
  bq, g, sp = cfg.bq, cfg.g, cfg.sp
  rs = cfg.w.stream
  row = pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0))
  kv = lambda d: pl.BlockSpec((None, sp, None, d), lambda i, bb, h: (bb, 0, lax.div(h, g), 0))
  rowvec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
  in_specs = [row, kv(hp), kv(hvp)] + ([rowvec] if rowc is not None else [])
  for x in (bias, mask):
    in_specs += triton.bias_specs(x, (1, 1, bq, sp), lambda i, bb, h: (bb, h, i, 0))
  mod_specs, slope_args = triton.mod_args(cfg, slopes)  # at the query head
  in_specs += mod_specs
  if cfg.sinks:  # a [1] block at the query head
    in_specs.append(pl.BlockSpec((1,), lambda i, bb, h: (h,)))
    slope_args.append(sinks.astype(F32))
  in_specs += [pl.BlockSpec((1,), lambda i, bb, h: (bb,))] * 2
  sm_args, sm_specs = triton.smask_operands(cfg, smask, "fwd", bq, cfg.bk)
  in_specs += sm_specs
  orow = pl.BlockSpec((None, bq, None, hvp), lambda i, bb, h: (bb, i, h, 0))
  out_specs = [orow] + [rowvec] * rs.num_stats
  out_shape = [jax.ShapeDtypeStruct((b, tp, n, hvp), out_dtype)] + [
      jax.ShapeDtypeStruct((b, n, tp), F32)] * rs.num_stats
  if rs.saves_support_mean:
    out_specs.append(orow)
    out_shape.append(jax.ShapeDtypeStruct((b, tp, n, hvp), F32))
  if cfg.keep_u_sum:
    out_specs.append(rowvec)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp), F32))
  args = [x for x in (q, k, v, rowc, bias, mask) if x is not None] + slope_args + [
      q_len, kv_len] + sm_args
  res = triton.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                        has_mask=mask is not None),
      grid=(tp // bq, b, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="attnx_pallas_rows_fwd")(*args)
  o, stats = res[0], tuple(res[1:1 + rs.num_stats])
  smean = res[1 + rs.num_stats] if rs.saves_support_mean else None
  return o, stats + ((res[-1],) if cfg.keep_u_sum else ()), smean


# --------------------------------------------------------------------------------------------
# Backward: dQ (dS, dc, carries), then dK/dV.
# --------------------------------------------------------------------------------------------

def _dq_kernel(*refs, cfg, has_bias, has_mask, want_ds):
  # A relative table: the first operand is the zeros that d ext's output aliases.
  r = split_refs(refs[1:] if cfg.relative else refs,
                 dq_names(cfg, has_bias, has_mask, want_ds, lens_first=False))
  bq, bk = cfg.bq_dq, cfg.bk_dq
  hc, vc = triton.head_chunks(r["q"].shape[-1]), triton.head_chunks(r["v"].shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = r["qlen"][0], r["kvlen"][0]
  sm = triton.smask_view(cfg, r["sm"], "dq", bq, bk)
  qs = triton.load_chunks(r["q"], slice(None), hc)
  dos = triton.load_chunks(r["do"], slice(None), vc)
  k_ref, v_ref, bias_ref, mask_ref, ds_ref = r["k"], r["v"], r["bias"], r["mask"], r["ds"]
  load_k = lambda c0: triton.load_chunks(k_ref, pl.ds(c0, bk), hc)
  slope, rel = _mod(cfg, r["slopes"], bq, bk)
  tile = tile_fn(cfg, i, bq, bk, qs, load_k,
                  lambda c0: None if bias_ref is None else ref_cols(bias_ref, c0, bk),
                  lambda c0: None if mask_ref is None else ref_cols(mask_ref, c0, bk),
                  q_len, kv_len, sm, None if sm is None else pl.program_id(2), grad=True,
                  slope=slope, rel=rel)
  lo, hi = span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  stats = tuple(ref[...] for ref in stat_refs_of(r, cfg))
  rowc = None if r["rowc"] is None else r["rowc"][...]

  def ds_store(c0, dz):
    if ds_ref is not None:
      ds_ref[:, pl.ds(c0, bk)] = dz
    if cfg.relative:  # d ext[i − j + off] += dS_ij (α = 1 for the whole-row families)
      dext = r["dslope"]
      triton.scatter_add(cfg, dext, relative_index(cfg, (bq, bk), i * bq, c0, dext.shape[-1]),
                         dz)

  ca_ref, cb_ref = r["ca"], r["cb"]

  def carry_store(j, ca, cb):  # [key tiles, rows] blocks: row j
    ca_ref[j, :], cb_ref[j, :] = ca, cb

  dq, dc, (ca, cb), dm = dq_rows(
      cfg, OPS, tile, qs, lambda c0: triton.load_chunks(v_ref, pl.ds(c0, bk), vc), dos, span,
      stats, r["delta"][...], rowc, ds_store, carry_store)
  triton.store_chunks(r["dq"], dq, hc, cfg.grad_mult[0])
  if dc is not None:
    r["dc"][...] = dc
  if dm is not None:  # ALiBi: the rows' d slope sums, summed over rows and batch outside
    r["dslope"][...] = dm
  if ca_ref is not None:
    def fill(values):
      def put(j, c):
        carry_store(j, *values())
        return c
      return put
    # Key tiles after the rows' last: no carry; before their first (a structured mask's):
    # every key the rows attend is after them.
    lax.fori_loop(hi, ca_ref.shape[0],
                  fill(lambda: (jnp.zeros((bq,), F32), jnp.zeros((bq,), F32))), 0)
    if sm is not None:
      lax.fori_loop(0, lo, fill(lambda: (ca, cb)), 0)
  if ds_ref is not None:  # tiles the loop skipped get a zero score cotangent
    triton.zero_tiles(ds_ref, lo, hi, bq, bk, cfg.sp // bk)


def _dkv_kernel(*refs, cfg, has_bias, has_mask, want_dk=True, want_dv=True):
  r = split_refs(refs, dkv_names(cfg, has_bias, has_mask, lens_first=False, want_dk=want_dk,
                                      want_dv=want_dv))
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  hc, vc = triton.head_chunks(r["k"].shape[-1]), triton.head_chunks(r["v"].shape[-1])
  j = pl.program_id(0)
  q_len, kv_len = r["qlen"][0], r["kvlen"][0]
  sm = triton.smask_view(cfg, r["sm"], "dkv", bq, bk)
  ks = triton.load_chunks(r["k"], slice(None), hc)
  vs = triton.load_chunks(r["v"], slice(None), vc) if want_dk else None
  lo, hi = q_span(cfg, j, bq, bk, q_len, kv_len, sm)
  head0 = None if sm is None else pl.program_id(2) * cfg.g  # the kv head's first query head
  q_ref, do_ref, bias_ref, mask_ref = r["q"], r["do"], r["bias"], r["mask"]
  stat_refs = stat_refs_of(r, cfg)

  def head(h, carry):
    def q_block(i, dkv):
      rows = pl.ds(i * bq, bq)
      qs, dos = triton.load_chunks3(q_ref, rows, h, hc), triton.load_chunks3(do_ref, rows, h, vc)
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
      return dkv_step(cfg, OPS, dkv, j, i, qs, dos, ks, vs, bias_t, mask_t, q_len, kv_len,
                       stats, r["delta"][h, rows], rowc, carry, sm,
                       None if sm is None else head0 + h,
                       *_mod(cfg, r["slopes"], bq, bk, h))
    return lax.fori_loop(lo, hi, q_block, carry)

  init = (tuple(jnp.zeros((bk, c), F32) for _, c in hc) if want_dk else (),
          tuple(jnp.zeros((bk, c), F32) for _, c in vc) if want_dv else ())
  dk, dv = lax.fori_loop(0, cfg.g, head, init)
  if want_dk:
    triton.store_chunks(r["dk"], dk, hc, cfg.grad_mult[0])
  if want_dv:
    triton.store_chunks(r["dv"], dv, vc)


def backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc, want_ds, smask=None,
             slopes=None):
  """(dq, dk, dv, dS or None, dc or None) and, with ``cfg.mod_operand``, the gradient of
  ``slopes`` float32: d slopes [N] (ALiBi) or d ext [N, Lx] (a relative table: the dQ
  kernel's atomic adds, :func:`.triton.scatter_add`)."""
  b, tp, n, hp = q.shape
  _, sp, kh, _ = k.shape
  hvp = v.shape[-1]
  g = cfg.g
  rs = cfg.w.stream
  saves_carries = rs.suffix_carries  # stick-breaking
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
    in_specs += triton.bias_specs(x, (1, 1, bq, sp), lambda i, bb, h: (bb, h, i, 0))
  mod_specs, slope_args = triton.mod_args(cfg, slopes)  # at the query head
  in_specs += mod_specs
  out_specs = [pl.BlockSpec((None, bq, None, hp), qmap)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, sp), lambda i, bb, h: (bb, h, i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), F32))
  if rs.needs_row_scale:
    out_specs.append(rowvec)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp), F32))
  if cfg.alibi:  # the rows' d slope sums
    out_specs.append(rowvec)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp), F32))
  # d ext [N, Lx] (a relative table): in d slopes' place; the kernel's first operand its zeros
  zero_specs, zero_args, aliases = triton.rel_grad_out(cfg, slopes, out_specs, out_shape)
  if saves_carries:  # [B, N, key tiles, Tp]: the carries of each row at each key tile
    out_specs += [pl.BlockSpec((None, None, ncols, bq), lambda i, bb, h: (bb, h, 0, i))] * 2
    out_shape += [jax.ShapeDtypeStruct((b, n, ncols, tp), F32)] * 2
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + slope_args + [
      q_len, kv_len]
  sm_args, sm_specs = triton.smask_operands(cfg, smask, "dq", bq, cfg.bk_dq)
  res = list(triton.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid=(tp // bq, b, n), in_specs=zero_specs + in_specs + lens + sm_specs,
      out_specs=out_specs, out_shape=out_shape, compiler_params=dq_params,
      input_output_aliases=aliases, interpret=cfg.interpret,
      name="attnx_pallas_rows_dq")(*zero_args, *args, *sm_args))
  dq = res.pop(0)
  ds = res.pop(0) if want_ds else None
  dc = res.pop(0) if rs.needs_row_scale else None
  dslopes = None
  if cfg.alibi:
    dslopes = jnp.sum(res.pop(0), axis=(0, 2))
  elif cfg.relative:
    dslopes = res.pop(0)
  carries = res if saves_carries else []

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
        blk, lambda j, bb, h, shape=shape: bcast_index(shape, (bb, h, 0, j))))
  in_specs += [pl.BlockSpec((None, g, ncols, tp), lambda j, bb, h: (bb, h, 0, 0))] * len(carries)
  # ALiBi: [K, Gp] (a power of 2 for Triton), the G slopes of each kv head; ext's G rows
  mod_specs, slope_args = triton.mod_args(cfg, slopes, kv_heads=kh)
  in_specs += mod_specs
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + carries + (
      slope_args + [q_len, kv_len])
  sm_args, sm_specs = triton.smask_operands(cfg, smask, "dkv", cfg.bq_dkv, bk)
  dk, dv = triton.dkv_passes(_dkv_kernel, cfg, args + sm_args, in_specs + lens + sm_specs, k, v,
                             params=params, name="attnx_pallas_rows", has=has)
  if cfg.mod_operand:
    return dq, dk, dv, ds, dc, dslopes
  return dq, dk, dv, ds, dc
