"""The Mosaic (TPU) kernels of the whole-row weightings (:mod:`.rows` describes them).

Arrays are [B, N, T, H] and a program's whole key/value (dK/dV: query) sequence is one VMEM
block that the loops slice; row values are lane-replicated [rows, 128] arrays, lengths scalar
prefetch (SMEM). :func:`vmem_bytes` estimates the VMEM this needs; above :data:`VMEM_LIMIT`
the combination is unsupported (use "blocked"). :func:`forward` and :func:`backward` take and
return the [B, T, N, H] layout of :mod:`.triton_rows`'.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnx.core import streaming as st
from attnx.core.kernels.pallas import masking, mosaic
from attnx.core.kernels.pallas.common import (
    LANES,
    KernelConfig,
    bcast_index,
    bnth,
    kv_full,
    kv_span,
    q_full,
    q_span,
    ref_cols,
    span_loop,
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
# Mosaic: no cumsum, a sign that needs the TPU's generation to lower.
OPS = st.Ops(cumsum_matmul=True, sign=False)
# VMEM a TPU program may use (whole-sequence blocks, double-buffered): about 3/4 of the 128 MiB
# of a v5e / v6e core; the compiler limit is raised to the estimate.
VMEM_LIMIT = 96 * 2**20

__all__ = ["OPS", "VMEM_LIMIT", "backward", "forward", "vmem_bytes"]


def _lane0(x):
  """A lane-replicated [rows, 128] value as [rows]."""
  return x[:, 0]


def _to_lanes(x):
  return jnp.broadcast_to(x[:, None], (x.shape[0], LANES))


def _cols(ref, c0, size: int):
  return None if ref is None else ref_cols(ref, pl.multiple_of(c0, LANES), size)


def _one_hot_cols(n: int, j, x):
  """[rows, n]: x [rows] in column j, 0 elsewhere."""
  cols = lax.broadcasted_iota(jnp.int32, (x.shape[0], n), 1)
  return jnp.where(cols == j, x[:, None], 0.0)


def _col(x, j):
  """Column j of [rows, n] as [rows]."""
  cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(cols == j, x, 0.0), axis=1)


def _rel(cfg, ref, bq: int, bk: int, head=None):
  """rel(r0, c0) of :func:`.rows.tile_fn`: a relative table's [bq, bk] bias tile
  (:func:`.mosaic.rel_tile`) from the reversed table's ref (a (1, Lr) block, or row ``head``
  of a (G, 1, Lr) one), or None without a table."""
  if not cfg.relative:
    return None
  load = mosaic.rel_load(ref, head)
  return lambda r0, c0: mosaic.rel_tile(cfg, load, r0, c0, bq, bk)


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, cfg, has_bias, has_mask):
  r = split_refs(refs, fwd_names(cfg, has_bias, has_mask, lens_first=True))
  bq, bk = cfg.bq, cfg.bk
  b, i = pl.program_id(0), pl.program_id(2)
  q_len, kv_len = r["qlen"][b], r["kvlen"][b]
  sm = mosaic.smask_view(cfg, r["sm"], r["sm_ids"], b, i, cfg.tp // bq, bq, bk, kv_whole=True)
  k_ref, v_ref, bias_ref, mask_ref = r["k"], r["v"], r["bias"], r["mask"]
  ds = lambda c0: pl.ds(pl.multiple_of(c0, LANES), bk)
  slope = None if not cfg.alibi else r["slopes"][pl.program_id(1)]  # ALiBi, SMEM [N]
  tile = tile_fn(cfg, i, bq, bk, [r["q"][...]], lambda c0: [k_ref[ds(c0), :]],
                  lambda c0: _cols(bias_ref, c0, bk),
                  lambda c0: _cols(mask_ref, c0, bk), q_len, kv_len, sm,
                  None if sm is None else pl.program_id(1), slope=slope,
                  rel=_rel(cfg, r["slopes"], bq, bk))
  span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  full = kv_full(cfg, i, bq, bk, q_len, kv_len, span, has_mask, sm)
  rowc = None if r["rowc"] is None else _lane0(r["rowc"][...])
  sink = None if r["sinks"] is None else r["sinks"][pl.program_id(1)]  # SMEM [N]
  o, stats, smean, usum = forward_rows(cfg, OPS, tile, lambda c0: v_ref[ds(c0), :], span, rowc,
                                       bq, v_ref.shape[-1], sink, full)
  r["o"][...] = o.astype(r["o"].dtype)
  for ref, x in zip(stat_refs_of(r, cfg), stats, strict=True):
    ref[...] = _to_lanes(x)
  if smean is not None:
    r["smean"][...] = smean
  if usum is not None:
    r["usum"][...] = _to_lanes(usum)


def _bias_spec(x, bq_or_t: int, bk_or_s: int, lead: int | None, index) -> list:
  """A [Bb, Nb, Tb, Sb] bias/mask block of (lead|1 heads,) bq|1 rows and bk|1 keys."""
  if x is None:
    return []
  shape = x.shape
  blk = (None, None if lead is None else (1 if shape[1] == 1 else lead),
         bq_or_t if shape[2] > 1 else 1, bk_or_s if shape[3] > 1 else 1)
  return [pl.BlockSpec(blk, lambda *ids: bcast_index(shape, index(*ids)))]


def _params(cfg, n_parallel: int, vmem: int):
  """Grid (b, n, tiles): the first ``n_parallel`` axes parallel, the rest (a relative table's
  dQ, whose d ext accumulates over the query tiles) arbitrary."""
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_parallel
                              + ("arbitrary",) * (3 - n_parallel),
                              vmem_limit_bytes=int(max(32 * 2**20, min(vmem * 5 // 4,
                                                                       VMEM_LIMIT))))


def _smask_ids(cfg, smask, bq: int | None) -> tuple[list, list]:
  """The id operands of a rows kernel: its query tile of ``bq`` rows and all keys (forward,
  dQ: grid (b, n, i)) or, ``bq`` None, all queries and its key tile (dK/dV: grid (b, kh, j))."""
  if bq is None:
    return mosaic.smask_ids(cfg, smask, (cfg.tp, LANES), (masking.SUBLANES, cfg.bk_dkv),
                            lambda *_: 0, lambda bb, hh, j, *_: j)
  return mosaic.smask_ids(cfg, smask, (bq, LANES), (masking.SUBLANES, cfg.sp),
                          lambda bb, hh, i, *_: i, lambda *_: 0)


def _slope_spec() -> pl.BlockSpec:
  """ALiBi's slopes [N] float32, whole, in SMEM (each program reads its query heads')."""
  return pl.BlockSpec(memory_space=pltpu.SMEM)


def _forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype, smask=None, slopes=None,
             sinks=None):
  b, n, tp, h = q.shape
  hv = v.shape[-1]
  bq, g, sp = cfg.bq, cfg.g, cfg.sp
  rs = cfg.w.stream
  rowmap = lambda bb, hh, i, *_: (bb, hh, i, 0)
  kvmap = lambda bb, hh, i, *_: (bb, lax.div(hh, g), 0, 0)
  lanes = pl.BlockSpec((None, None, bq, LANES), rowmap)
  in_specs = [pl.BlockSpec((None, None, bq, h), rowmap), pl.BlockSpec((None, None, sp, h), kvmap),
              pl.BlockSpec((None, None, sp, hv), kvmap)]
  in_specs += [lanes] if rowc is not None else []
  for x in (bias, mask):
    in_specs += _bias_spec(x, bq, sp, lead=None, index=lambda bb, hh, i, *_: (bb, hh, i, 0))
  in_specs += [_slope_spec()] if cfg.alibi else []
  rev = mosaic.rel_operand(cfg, slopes) if cfg.relative else None
  if cfg.relative:  # the query head's row of the reversed table
    in_specs.append(pl.BlockSpec((None, 1, rev.shape[-1]), lambda bb, hh, i, *_: (hh, 0, 0)))
  in_specs += [_slope_spec()] if cfg.sinks else []  # the sinks [N], whole in SMEM
  orow = pl.BlockSpec((None, None, bq, hv), rowmap)
  out_specs = [orow] + [lanes] * rs.num_stats
  out_shape = [jax.ShapeDtypeStruct((b, n, tp, hv), out_dtype)] + [
      jax.ShapeDtypeStruct((b, n, tp, LANES), F32)] * rs.num_stats
  if rs.saves_support_mean:
    out_specs.append(orow)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, hv), F32))
  if cfg.keep_u_sum:
    out_specs.append(lanes)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, LANES), F32))
  args = [x for x in (q, k, v, None if rowc is None else mosaic.to_lanes_all(rowc), bias, mask)
          if x is not None] + ([slopes.astype(F32)] if cfg.alibi else []) + (
              [rev] if cfg.relative else []) + ([sinks.astype(F32)] if cfg.sinks else [])
  sm_ids, sm_specs = _smask_ids(cfg, smask, bq)
  sm_pre = mosaic.smask_prefetch(cfg, smask, "fwd")
  res = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                        has_mask=mask is not None),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(sm_pre), grid=(b, n, tp // bq),
          in_specs=in_specs + sm_specs, out_specs=out_specs),
      out_shape=out_shape,
      compiler_params=_params(cfg, n_parallel=3,
                              vmem=vmem_bytes(cfg, q.dtype, h, hv, bias, mask)),
      interpret=cfg.interpret, name="attnx_pallas_rows_fwd")(q_len, kv_len, *sm_pre, *args,
                                                             *sm_ids)
  o, stats = res[0], tuple(x[..., 0] for x in res[1:1 + rs.num_stats])
  smean = res[1 + rs.num_stats] if rs.saves_support_mean else None
  return o, stats + ((res[-1][..., 0],) if cfg.keep_u_sum else ()), smean


# --------------------------------------------------------------------------------------------
# Backward: dQ (dS, dc, carries), then dK/dV.
# --------------------------------------------------------------------------------------------

def _dq_kernel(*refs, cfg, has_bias, has_mask, want_ds):
  r = split_refs(refs, dq_names(cfg, has_bias, has_mask, want_ds, lens_first=True))
  bq, bk = cfg.bq_dq, cfg.bk_dq
  b, i = pl.program_id(0), pl.program_id(2)
  q_len, kv_len = r["qlen"][b], r["kvlen"][b]
  sm = mosaic.smask_view(cfg, r["sm"], r["sm_ids"], b, i, cfg.tp // bq, bq, bk, kv_whole=True)
  k_ref, v_ref, bias_ref, mask_ref, ds_ref = r["k"], r["v"], r["bias"], r["mask"], r["ds"]
  ds = lambda c0: pl.ds(pl.multiple_of(c0, LANES), bk)
  qs = [r["q"][...]]
  slope = None if not cfg.alibi else r["slopes"][pl.program_id(1)]  # ALiBi, SMEM [N]
  tile = tile_fn(cfg, i, bq, bk, qs, lambda c0: [k_ref[ds(c0), :]],
                  lambda c0: _cols(bias_ref, c0, bk),
                  lambda c0: _cols(mask_ref, c0, bk), q_len, kv_len, sm,
                  None if sm is None else pl.program_id(1), grad=True, slope=slope,
                  rel=_rel(cfg, r["slopes"], bq, bk))
  lo, _ = span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  stats = tuple(_lane0(ref[...]) for ref in stat_refs_of(r, cfg))
  rowc = None if r["rowc"] is None else _lane0(r["rowc"][...])

  if ds_ref is not None:
    ds_ref[...] = jnp.zeros(ds_ref.shape, F32)  # tiles the loop skips

  drel_ref = r["dslope"] if cfg.relative else None  # d rev [1, Lr], resident over i
  if drel_ref is not None:
    @pl.when(i == 0)
    def _init_rel():
      drel_ref[...] = jnp.zeros(drel_ref.shape, F32)

  def ds_store(c0, dz):
    if ds_ref is not None:
      ds_ref[:, ds(c0)] = dz
    if drel_ref is not None:  # d ext = Σ dS along each diagonal (dS = dz: α = 1)
      start, sums = mosaic.rel_diag_sums(cfg, dz, i * bq, c0)
      drel_ref[:, pl.ds(start, sums.shape[1])] += sums

  ca_ref, cb_ref = r["ca"], r["cb"]
  if ca_ref is not None:
    ca_ref[...] = jnp.zeros(ca_ref.shape, F32)
    cb_ref[...] = jnp.zeros(cb_ref.shape, F32)

  def carry_store(j, ca, cb):  # [rows, key tiles] blocks: column j (no dynamic lane index)
    ca_ref[...] += _one_hot_cols(ca_ref.shape[1], j, ca)
    cb_ref[...] += _one_hot_cols(cb_ref.shape[1], j, cb)

  dq, dc, (ca, cb), dm = dq_rows(cfg, OPS, tile, qs, lambda c0: [v_ref[ds(c0), :]],
                                 [r["do"][...]], span, stats, _lane0(r["delta"][...]), rowc,
                                 ds_store, carry_store,
                                 kv_full(cfg, i, bq, bk, q_len, kv_len, span, has_mask, sm))
  if dm is not None:  # the rows' d slope sums, lanes; summed over rows and batch outside
    r["dslope"][...] = _to_lanes(dm)
  if ca_ref is not None and sm is not None:
    # Key tiles before the rows' first: every key the rows attend is after them.
    def fill(j, c):
      carry_store(j, ca, cb)
      return c
    lax.fori_loop(0, lo, fill, 0)
  r["dq"][...] = (dq[0] * cfg.grad_mult[0]).astype(r["dq"].dtype)
  if dc is not None:
    r["dc"][...] = _to_lanes(dc)


def _dkv_kernel(*refs, cfg, has_bias, has_mask):
  r = split_refs(refs, dkv_names(cfg, has_bias, has_mask, lens_first=True))
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  b, j = pl.program_id(0), pl.program_id(2)
  q_len, kv_len = r["qlen"][b], r["kvlen"][b]
  sm = mosaic.smask_view(cfg, r["sm"], r["sm_ids"], b, j, cfg.sp // bk, bq, bk, q_whole=True)
  ks, vs = [r["k"][...]], [r["v"][...]]
  span = q_span(cfg, j, bq, bk, q_len, kv_len, sm)
  full = q_full(cfg, j, bq, bk, q_len, kv_len, span, has_mask, sm)
  head0 = None if sm is None else pl.program_id(1) * cfg.g  # the kv head's first query head
  q_ref, do_ref, bias_ref, mask_ref = r["q"], r["do"], r["bias"], r["mask"]
  stat_refs = stat_refs_of(r, cfg)
  # ALiBi: the first query head of this kv head (program_id outside the loops' bodies).
  slope0 = None if not cfg.alibi else pl.program_id(1) * cfg.g

  def head(h, carry):
    slope = None if slope0 is None else r["slopes"][slope0 + h]
    rel = _rel(cfg, r["slopes"], bq, bk, h)  # the head's row of the reversed table

    def q_block(i, dkv, masked):
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
      return dkv_step(cfg, OPS, dkv, j, i, qs, dos, ks, vs, bias_t, mask_t, q_len, kv_len,
                       stats, _lane0(r["delta"][h, rows, :]), rowc, carry, sm,
                       None if sm is None else head0 + h, slope, rel, masked)
    return span_loop(span, full, q_block, carry)

  init = ((jnp.zeros((bk, ks[0].shape[-1]), F32),), (jnp.zeros((bk, vs[0].shape[-1]), F32),))
  dk, dv = lax.fori_loop(0, cfg.g, head, init)
  r["dk"][...] = (dk[0] * cfg.grad_mult[0]).astype(r["dk"].dtype)
  r["dv"][...] = dv[0].astype(r["dv"].dtype)


def _backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc, want_ds, smask=None,
              slopes=None):
  b, n, tp, h = q.shape
  _, kh, sp, _ = k.shape
  hv = v.shape[-1]
  g = cfg.g
  rs = cfg.w.stream
  saves_carries = rs.suffix_carries  # stick-breaking
  has = dict(has_bias=bias is not None, has_mask=mask is not None)
  rows = [mosaic.to_lanes_all(x) for x in list(rows) + ([rowc] if rowc is not None else [])]
  ncols = num_key_tiles(cfg)
  vmem = vmem_bytes(cfg, q.dtype, h, hv, bias, mask, backward=True)

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
    in_specs += _bias_spec(x, bq, sp, lead=None, index=lambda bb, hh, i, *_: (bb, hh, i, 0))
  slope_specs = [_slope_spec()] if cfg.alibi else []
  slope_args = [slopes.astype(F32)] if cfg.alibi else []
  if cfg.relative:  # the reversed table: a query head's row (dQ), a kv head's G rows (dK/dV)
    rev = mosaic.rel_operand(cfg, slopes)
    lr = rev.shape[-1]
    slope_specs = [pl.BlockSpec((None, 1, lr), lambda bb, hh, i, *_: (hh, 0, 0))]
    slope_args = [rev]
  in_specs += slope_specs
  out_specs = [pl.BlockSpec((None, None, bq, h), rowmap)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, sp), rowmap))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), F32))
  if rs.needs_row_scale:
    out_specs.append(lanes)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, LANES), F32))
  if cfg.alibi:  # the rows' d slope sums, lane-replicated
    out_specs.append(lanes)
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, LANES), F32))
  if cfg.relative:  # d rev per (batch, query head), accumulated over the query tiles
    out_specs.append(pl.BlockSpec((None, None, 1, lr), lambda bb, hh, i, *_: (bb, hh, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, 1, lr), F32))
  if saves_carries:
    out_specs += [pl.BlockSpec((None, None, bq, ncols), rowmap)] * 2
    out_shape += [jax.ShapeDtypeStruct((b, n, tp, ncols), F32)] * 2
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + slope_args
  sm_ids, sm_specs = _smask_ids(cfg, smask, bq)
  sm_pre = mosaic.smask_prefetch(cfg, smask, "dq")
  res = list(pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(sm_pre), grid=(b, n, tp // bq),
          in_specs=in_specs + sm_specs, out_specs=out_specs),
      out_shape=out_shape,
      compiler_params=_params(cfg, n_parallel=2 if cfg.relative else 3, vmem=vmem),
      interpret=cfg.interpret,
      name="attnx_pallas_rows_dq")(q_len, kv_len, *sm_pre, *args, *sm_ids))
  dq = res.pop(0)
  ds = res.pop(0) if want_ds else None
  dc = res.pop(0)[..., 0] if rs.needs_row_scale else None
  dslopes = jnp.sum(res.pop(0)[..., 0], axis=(0, 2)) if cfg.alibi else None
  if cfg.relative:
    dslopes = mosaic.rel_grad(cfg, res.pop(0), slopes.shape[1])
  carries = res if saves_carries else []

  # dK, dV: grid (B, K, key tiles); the G query heads and the query tiles in-kernel.
  bk = cfg.bk_dkv
  headmap = lambda bb, hh, j, *_: (bb, hh, 0, 0)
  kvmap2 = lambda bb, hh, j, *_: (bb, hh, j, 0)
  in_specs = [pl.BlockSpec((None, g, tp, h), headmap), pl.BlockSpec((None, None, bk, h), kvmap2),
              pl.BlockSpec((None, None, bk, hv), kvmap2),
              pl.BlockSpec((None, g, tp, hv), headmap)]
  in_specs += [pl.BlockSpec((None, g, tp, LANES), headmap)] * len(rows)
  for x in (bias, mask):
    in_specs += _bias_spec(x, tp, bk, lead=g, index=lambda bb, hh, j, *_: (bb, hh, 0, j))
  if cfg.relative:
    slope_specs = [pl.BlockSpec((g, 1, lr), lambda bb, hh, j, *_: (hh, 0, 0))]
  in_specs += [pl.BlockSpec((None, g, tp, ncols), headmap)] * len(carries) + slope_specs
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + carries + slope_args
  sm_ids, sm_specs = _smask_ids(cfg, smask, None)
  sm_pre = mosaic.smask_prefetch(cfg, smask, "dkv")
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(sm_pre), grid=(b, kh, sp // bk),
          in_specs=in_specs + sm_specs,
          out_specs=[pl.BlockSpec((None, None, bk, h), kvmap2),
                     pl.BlockSpec((None, None, bk, hv), kvmap2)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(cfg, n_parallel=3, vmem=vmem), interpret=cfg.interpret,
      name="attnx_pallas_rows_dkv")(q_len, kv_len, *sm_pre, *args, *sm_ids)
  if cfg.alibi or cfg.relative:
    return dq, dk, dv, ds, dc, dslopes
  return dq, dk, dv, ds, dc


def vmem_bytes(cfg: KernelConfig, dtype: Any, h: int, hv: int, bias: Any = None,
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

  kinds = () if cfg.smask is None else cfg.smask.kinds
  nq_ids, nkv_ids = kinds.count("q"), kinds.count("kv")

  def ids(rows: int, cols: int) -> int:  # a structured mask's ids (int32, lane layouts)
    return 4 * (nq_ids * rows * LANES + nkv_ids * masking.SUBLANES * cols)

  def rel(heads: int, bq: int, bk: int, outs: int = 0) -> int:
    """A relative table's reversed rows ((1, Lr) blocks: 8 sublanes each), d rev, and the
    [bq, W] window a tile's bias and d ext roll."""
    if not cfg.relative:
      return 0
    lr = mosaic.rel_layout(cfg)[1]
    return (heads + outs) * 8 * lr * 4 + bq * mosaic.rel_width(bq, bk) * 4

  fwd = sp * (h + hv) * item + cfg.bq * (h + 2 * hv) * 4 + extra(cfg.bq, sp) + ids(
      cfg.bq, sp) + rel(1, cfg.bq, cfg.bk)
  if not backward:
    return 2 * fwd
  ncols = num_key_tiles(cfg)
  dq = sp * (h + hv) * item + cfg.bq_dq * (h + hv + 8 * LANES + 2 * ncols) * 4 + extra(
      cfg.bq_dq, sp) + (cfg.bq_dq * sp * 4) + ids(cfg.bq_dq, sp) + rel(
          1, cfg.bq_dq, cfg.bk_dq, outs=1)
  dkv = g * tp * ((h + hv) * item + 6 * LANES * 4 + 2 * ncols * 4) + extra(
      tp, cfg.bk_dkv, g) + ids(tp, cfg.bk_dkv) + rel(g, cfg.bq_dkv, cfg.bk_dkv)
  return 2 * max(fwd, dq, dkv)


def forward(cfg: KernelConfig, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype,
            smask: Any = None, slopes: Any = None, sinks: Any = None):
  """(O, row statistics, Σu·v/Σu or None) of [B, Tp, N, H] arrays, as
  :func:`.triton_rows.forward` (the kernels run on the [B, N, Tp, H] transposes)."""
  o, stats, smean = _forward(cfg, bnth(q), bnth(k), bnth(v), rowc, bias, mask, q_len, kv_len,
                             out_dtype, smask, slopes, sinks)
  return bnth(o), stats, None if smean is None else bnth(smean)


def backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc,
             want_ds: bool, smask: Any = None, slopes: Any = None):
  """(dq, dk, dv, dS or None, dc or None[, d slopes]) as :func:`.triton_rows.backward`."""
  res = _backward(cfg, bnth(q), bnth(k), bnth(v), bias, mask, q_len, kv_len, bnth(do), rows,
                  rowc, want_ds, smask, slopes)
  dq, dk, dv, ds, dc = res[:5]
  return (bnth(dq), bnth(dk), bnth(dv), ds, dc) + tuple(res[5:])
