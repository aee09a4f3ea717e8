"""The Mosaic (TPU) kernels of pointwise F, behind
:func:`attnx.core.kernels.pallas.wrapper.pallas_attention`.

The three kernels of :mod:`.triton` (forward; dQ and dS; dK/dV over the G query heads of a kv
head), laid out for the TPU: arrays are transposed to ``[B, N, T, H]`` (a block's last two dims
must be multiples of (8, 128) or full); the streamed axis (keys, or queries for dK/dV) is the
last, "arbitrary" grid axis with VMEM scratch accumulators, as in JAX's
``ops/tpu/flash_attention.py``; lengths arrive as scalar prefetch (SMEM); row statistics live
lane-replicated as ``[rows, 128]`` (:data:`OPS`). Skipped tiles (causal, key lengths) keep
their block index so that no DMA is issued for them. :func:`forward` and :func:`backward` take
and return the ``[B, T, N, H]`` layout of :mod:`.triton`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnx.core import streaming
from attnx.core.contract import finite
from attnx.core.kernels.pallas import masking
from attnx.core.kernels.pallas.common import (
    LANES,
    NT,
    KernelConfig,
    alibi_tile,
    bcast_index,
    bnth,
    bwd_tile,
    capped_grad,
    in_span,
    kv_full,
    kv_hi,
    kv_span,
    q_full,
    q_range,
    q_span,
    sink_start,
    span_when,
    tile_scores,
    tile_scores_grad,
    tile_valid,
    uncounted,
)

Array = jax.Array
# The spelling of the streaming rules Mosaic lowers: row statistics replicated over 128 lanes.
OPS = streaming.Ops(exp2=True, ones_column=False, lanes=LANES)

__all__ = ["OPS", "backward", "forward", "kv_block", "q_block", "rel_diag_sums", "rel_grad",
           "rel_layout", "rel_load", "rel_operand", "rel_tile", "rel_width", "rel_window",
           "smask_counts", "smask_ids", "smask_prefetch", "smask_view", "to_lanes_all"]


def _tile(ref):
  return None if ref is None else ref[...]


# --------------------------------------------------------------------------------------------
# A structured mask's refs: scalars and spans as scalar prefetch after the lengths, ids after
# the other inputs (:mod:`.masking`).
# --------------------------------------------------------------------------------------------

def smask_counts(cfg: KernelConfig) -> tuple[int, int]:
  """(prefetch refs, id refs) of a structured mask in a TPU kernel."""
  p = cfg.smask
  return (0, 0) if p is None else (p.num_prefetch, p.num_ids)


def smask_view(cfg: KernelConfig, pre: list, ids: list, b, t, n: int, bq: int, bk: int,
               q_whole: bool = False, kv_whole: bool = False) -> masking.KernelMask | None:
  """A TPU program's structured mask (None without one); see :func:`.masking.tpu_view`."""
  if cfg.smask is None:
    return None
  return masking.tpu_view(cfg.smask, pre, ids, b, t, n, bq, bk, q_whole, kv_whole)


def smask_prefetch(cfg: KernelConfig, smask: Any, kind: str) -> list:
  return [] if cfg.smask is None else masking.tpu_prefetch(cfg.smask, smask, kind)


def smask_ids(cfg: KernelConfig, smask: Any, q_block: tuple, kv_block: tuple,
              q_index: Callable, kv_index: Callable) -> tuple[list, list]:
  """(arrays, BlockSpecs) of a structured mask's ids: query ids [B|1, Tp, 128] in ``q_block``
  blocks at ``q_index(*grid, *prefetch)`` (the row block), key ids [B|1, 8, Sp] in
  ``kv_block`` blocks at ``kv_index`` (the column block)."""
  if cfg.smask is None:
    return [], []
  arrays = masking.tpu_ids(cfg.smask, smask)
  specs = []
  for kind, f in cfg.smask.ids:
    if kind == "q":
      specs.append(pl.BlockSpec((None, *q_block), lambda bb, *rest, f=f: (
          bb if f else 0, q_index(bb, *rest), 0)))
    else:
      specs.append(pl.BlockSpec((None, *kv_block), lambda bb, *rest, f=f: (
          bb if f else 0, 0, kv_index(bb, *rest))))
  return arrays, specs


def kv_block(cfg: KernelConfig, b, i, j, bq: int, bk: int, ql, kl, pre=()):
  """Key tile to fetch at grid step j: a skipped tile repeats a needed one (no DMA)."""
  hi = kv_hi(cfg, i, bq, bk, ql[b], kl[b])
  if cfg.smask is None:
    return jnp.minimum(j, jnp.maximum(hi - 1, 0))
  lo, hi = masking.narrow(masking.tpu_span(cfg.smask, pre, b, i, cfg.tp // bq), 0, hi)
  return jnp.minimum(jnp.maximum(j, lo), jnp.maximum(hi - 1, lo))


def q_block(cfg: KernelConfig, b, j, i, bq: int, bk: int, ql, kl, pre=()):
  """Query tile to fetch at step i of key tile j's loop (a skipped one repeats a needed one)."""
  lo, hi = q_range(cfg, j, bq, bk, ql[b], kl[b])
  if cfg.smask is not None:
    lo, hi = masking.narrow(masking.tpu_span(cfg.smask, pre, b, j, cfg.sp // bk), lo, hi)
  return jnp.minimum(jnp.maximum(i, lo), jnp.maximum(hi - 1, lo))


# --------------------------------------------------------------------------------------------
# A relative-position table (``cfg.relative``): the tile's Toeplitz bias from an aligned window
# of the reversed table, and its gradient's diagonal sums (TPUs have no general gather).
# --------------------------------------------------------------------------------------------

def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def rel_width(bq: int, bk: int) -> int:
  """W: the lanes of a [bq, bk] tile's window of the reversed table (:func:`rel_window`)."""
  return _round_up(bq + bk + LANES - 1, LANES)


def rel_layout(cfg: KernelConfig) -> tuple[int, int]:
  """(M, Lr) of the reversed table rev [N, 1, Lr], rev[h, 0, m] = ext[h, M − m]: ext's column
  g = i − j + off sits at m = M − g. M ≥ Tp + off + 127 with M ≡ off (mod 8) keeps every
  tile's window in [0, Lr) and its roll amounts multiples of 8 (:func:`rel_window`)."""
  m = cfg.rel_offset + _round_up(cfg.tp + LANES - 1, 8)
  return m, _round_up(m + cfg.sp - cfg.rel_offset + 2 * LANES, LANES)


def rel_operand(cfg: KernelConfig, ext: Array) -> Array:
  """rev [N, 1, Lr] float32 of ext [N, Lx] (:func:`rel_layout`; columns past ext's ends repeat
  them: only padding reads them, and is masked), in XLA before the kernels."""
  m, lr = rel_layout(cfg)
  idx = jnp.clip(m - jnp.arange(lr), 0, ext.shape[1] - 1)
  return jnp.take(ext.astype(jnp.float32), idx, axis=1)[:, None, :]


def rel_grad(cfg: KernelConfig, drev: Array, lx: int) -> Array:
  """d ext [N, Lx] float32 of the dQ kernel's d rev [B, N, 1, Lr] (:func:`rel_operand`'s
  adjoint, summed over the batch)."""
  m, lr = rel_layout(cfg)
  idx = jnp.clip(m - jnp.arange(lr), 0, lx - 1)
  d = jnp.sum(drev[:, :, 0, :], axis=0)
  return jnp.zeros((d.shape[0], lx), jnp.float32).at[:, idx].add(d)


def rel_window(cfg: KernelConfig, r0, c0, bq: int):
  """(start, e) of the window rev[start : start + W] of a tile whose first row is query r0 and
  first column key c0: start a multiple of 128, and ext[r0 + r − c0 − c + off] =
  window[c − r + e] with e in [bq, bq + 127], e ≡ 0 (mod 8); e a Python int when bq is a
  multiple of 128 (the default tiles): Mosaic then rotates by static amounts, and checks at
  compile time that each vreg's stays within its lanes."""
  m, _ = rel_layout(cfg)
  t = m - (r0 - c0 + cfg.rel_offset) - bq  # ≥ 127 ≥ 0 (rel_layout): lax.div rounds down
  start = lax.div(t, LANES) * LANES
  if bq % LANES == 0:  # r0, c0 multiples of 128: e is static, and so the rotates' amounts
    return start, (m - cfg.rel_offset - bq) % LANES + bq
  return start, t - start + bq


def rel_tile(cfg: KernelConfig, load, r0, c0, bq: int, bk: int):
  """The relative table's bias [bq, bk] float32 of a tile: ext[h, r0 + r − (c0 + c) + off]
  (the dense bias), a Toeplitz tile. ``load(start, W)`` reads the head's window
  rev[start : start + W] as [1, W]; broadcast over the rows, each row r rolled by
  W − e + r lanes (one strided rotate), the first bk lanes are the tile. The amount is a
  multiple of 8, so that each 8-row vreg's rotate stays within its 128 lanes as Mosaic's
  strided rotate needs."""
  w = rel_width(bq, bk)
  start, e = rel_window(cfg, r0, c0, bq)
  x = jnp.broadcast_to(load(pl.multiple_of(start, LANES), w), (bq, w))
  return _roll_rows(x, w - e)[:, :bk]


def _roll_rows(x, shift):
  """Row r of x [rows, W] rotated by shift + r lanes: one strided rotate where ``shift`` is a
  Python int; where it is traced (query tiles that are not multiples of 128), a rotate of every
  row by ``shift``, then the strided one by the row alone. Mosaic took a strided rotate by a
  traced amount in libtpu 0.0.42 (jax 0.10.2) and refuses it from 0.0.50 (jax 0.12: "strided
  dynamic rotation along the two last dimensions is unsupported"); rotates add, so both forms
  give the same lanes on either."""
  if isinstance(shift, int):
    return pltpu.roll(x, shift, 1, stride=1, stride_axis=0)
  return pltpu.roll(pltpu.roll(x, shift, 1), 0, 1, stride=1, stride_axis=0)


def _reverse_rows(x):
  """x [bq, n] with its rows in reverse order: each 8-row slab reversed by a sublane gather
  (within one vreg, as Mosaic gathers), the slabs concatenated last first."""
  idx = (7 - lax.broadcasted_iota(jnp.int32, (8, x.shape[1]), 0))
  return jnp.concatenate(
      [jnp.take_along_axis(x[r:r + 8], idx, axis=0, mode="promise_in_bounds")
       for r in range(x.shape[0] - 8, -8, -8)], axis=0)


def rel_diag_sums(cfg: KernelConfig, dz, r0, c0):
  """(start, sums [1, W]): the adjoint of :func:`rel_tile` on a tile's score cotangent dz
  [bq, bk] — its sums along the diagonals i − j, at the window's lanes (d rev[start + u] +=
  sums[u]). Rows reversed (a positive stride then walks the diagonals), padded to W lanes and
  row p rolled by e − bq + 1 + p, each column of the result holds one diagonal."""
  bq, bk = dz.shape
  w = rel_width(bq, bk)
  start, e = rel_window(cfg, r0, c0, bq)
  x = jnp.concatenate([_reverse_rows(dz), jnp.zeros((bq, w - bk), jnp.float32)], axis=1)
  y = _roll_rows(x, e - bq + 1)
  return pl.multiple_of(start, LANES), jnp.sum(y, axis=0, keepdims=True)


def _rel_window_spec(cfg: KernelConfig, bq: int, bk: int, index: Callable) -> pl.BlockSpec:
  """rev [N, 1, Lr] as the [1, W] window (:func:`rel_window`) of one tile: ``index(*grid,
  *prefetch)`` -> (query head, r0, c0) of the tile the grid step fetches (a skipped step's
  repeats a needed one's: no DMA); element offsets, so that a program holds W lanes of the
  table, not the O(T + S) of its row."""
  def index_map(*ids):
    head, r0, c0 = index(*ids)
    return head, 0, rel_window(cfg, r0, c0, bq)[0]
  return pl.BlockSpec((None, pl.Element(1), pl.Element(rel_width(bq, bk))), index_map)


def _window_load(ref) -> Callable:
  """load(start, W) of :func:`rel_tile` on a [1, W] window ref that is that window."""
  return lambda start, w: ref[...]


def rel_load(ref, head=None) -> Callable:
  """load(start, W) of :func:`rel_tile` on a (1, Lr) ref (or row ``head`` of a (G, 1, Lr))."""
  if head is None:
    return lambda start, w: ref[:, pl.ds(start, w)]
  return lambda start, w: ref[head, :, pl.ds(start, w)]


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool):
  it = iter(refs)
  n_pre, n_ids = smask_counts(cfg)
  qlen_ref, kvlen_ref = next(it), next(it)
  sm_pre = [next(it) for _ in range(n_pre)]
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  sink_ref = next(it) if cfg.sinks else None  # [1, 128]: this query head's sink, lanes
  slope_ref = next(it) if cfg.alibi else None  # [N] in SMEM: the ALiBi slopes
  rel_ref = next(it) if cfg.relative else None  # [1, W]: the tile's window of the table
  sm_ids = [next(it) for _ in range(n_ids)]
  o_ref, stat_ref = next(it), next(it)
  w, bq, bk, ops = cfg.w, cfg.bq, cfg.bk, OPS
  scratch = list(it)
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  sm = smask_view(cfg, sm_pre, sm_ids, b, i, cfg.tp // bq, bq, bk)
  head = None if sm is None else pl.program_id(1)
  # The query head's ALiBi slope (read outside pl.when: no program_id in its body).
  slope = None if slope_ref is None else slope_ref[pl.program_id(1)]

  # The state lives in VMEM scratch across the key tiles (the last grid axis): m and l as
  # lane-replicated [bq, 128] (ops.lanes), acc as [bq, Hv].
  if w.online_max:
    m_sc, l_sc, acc_sc = scratch
  else:
    l_sc, acc_sc = scratch

  @pl.when(j == 0)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if w.online_max:
      m0, l0 = streaming.online_max_start(w)  # from the offset's virtual key, if any
      if sink_ref is None:
        m_sc[...] = jnp.full(m_sc.shape, m0, jnp.float32)
        l_sc[...] = jnp.full(l_sc.shape, l0, jnp.float32)
      else:
        m_sc[...], l_sc[...] = sink_start(
            cfg, jnp.full(m_sc.shape, m0, jnp.float32), jnp.full(l_sc.shape, l0, jnp.float32),
            jnp.broadcast_to(sink_ref[...], l_sc.shape), ops)
    elif sink_ref is None:
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    else:
      _, l_sc[...] = sink_start(cfg, None, jnp.zeros(l_sc.shape, jnp.float32),
                                jnp.broadcast_to(sink_ref[...], l_sc.shape), ops)

  span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)

  def _run(masked):
    if slope is not None:
      lin, _ = alibi_tile(cfg, slope, (bq, bk), i * bq, j * bk)
      z = tile_scores(cfg, [q_ref[...]], [k_ref[...]], _tile(bias_ref), lin)
    elif rel_ref is not None:
      lin = rel_tile(cfg, _window_load(rel_ref), i * bq, j * bk, bq, bk)
      z = tile_scores(cfg, [q_ref[...]], [k_ref[...]], _tile(bias_ref), lin)
    else:
      z = tile_scores(cfg, [q_ref[...]], [k_ref[...]], _tile(bias_ref))
    valid = None if not masked else tile_valid(
        cfg, (bq, bk), i * bq, j * bk, _tile(mask_ref), q_len, kv_len, sm, head)
    v = v_ref[...]
    if w.online_max:
      acc_sc[...], m_sc[...], l_sc[...] = streaming.online_max_update(
          acc_sc[...], m_sc[...], z, valid, v, l_sc[...], ops=ops, log_f=w.log_f)
    else:
      l = l_sc[...]
      acc_sc[...], l_new = streaming.pointwise_update(w, acc_sc[...], l, z, valid, v, cfg.s,
                                                      ops=ops, full=not masked)
      if l_new is not l:  # "none", and "length" on unmasked tiles, leave l as it is
        l_sc[...] = l_new

  span_when(j, span, kv_full(cfg, i, bq, bk, q_len, kv_len, span, has_mask, sm), _run)

  @pl.when(j == cfg.sp // bk - 1)
  def _finish():
    if w.online_max:
      o, st = streaming.pointwise_finalize(w, acc_sc[...], m_sc[...], l_sc[...],
                                           add_offset=False, ops=ops)
    else:
      o, st = streaming.pointwise_finalize(w, acc_sc[...], l_sc[...],
                                           num_keys=uncounted(cfg, has_mask), ops=ops)
    o_ref[...] = o.astype(o_ref.dtype)
    stat_ref[...] = st


def _bias_spec(x: Array | None, bq: int, bk: int, index: Callable) -> list:
  """[Bb, Nb, Tb, Sb] bias/mask: a (bq|1, bk|1) tile at the grid's (b, head, i, j)."""
  if x is None:
    return []
  shape = x.shape
  blk = (None, None, bq if shape[2] > 1 else 1, bk if shape[3] > 1 else 1)
  return [pl.BlockSpec(blk, lambda *ids: bcast_index(shape, index(*ids)))]


def _params(n_parallel: int, n_arbitrary: int):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary)


def _rel_dq_params(lr: int):
  """The dQ kernel's with a relative table: its d rev block (1, Lr) stays resident over the
  query and key tiles (those axes arbitrary), double-buffered (up to 8 sublanes × Lr
  float32 each); past about 12 MiB of it (T + S ≈ 190k) the scoped-VMEM limit is raised to
  fit (at most 96 MiB, :data:`.mosaic_rows.VMEM_LIMIT`'s: a v5e / v6e core's)."""
  need = 2 * 8 * lr * 4 + 4 * 2**20
  limit = None if need <= 16 * 2**20 else min(need, 96 * 2**20)
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * 2 + ("arbitrary",) * 2,
                              vmem_limit_bytes=limit)


def _kv_maps(cfg: KernelConfig, bq: int, bk: int) -> tuple[Callable, Callable, Callable]:
  """Index maps of a (b, n, query tile, key tile) grid: the key tile to fetch (:func:`kv_block`
  on the grid ids and the scalar prefetch), K/V's block and a bias/mask's block."""
  def clamp(bb, i, j, ql, kl, *pre):
    return kv_block(cfg, bb, i, j, bq, bk, ql, kl, pre)

  def kv_map(bb, hh, i, j, *lens):
    return bb, lax.div(hh, cfg.g), clamp(bb, i, j, *lens), 0

  def bias_map(bb, hh, i, j, *lens):
    return bb, hh, i, clamp(bb, i, j, *lens)

  return clamp, kv_map, bias_map


def _slope_spec() -> pl.BlockSpec:
  """The ALiBi slopes [N] float32, whole, in SMEM (each program reads its query head's)."""
  return pl.BlockSpec(memory_space=pltpu.SMEM)


def _forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, out_dtype, smask=None,
             sinks=None, slopes=None):
  b, n, tp, h = q.shape
  hv = v.shape[-1]
  bq, bk = cfg.bq, cfg.bk
  clamp, kv_map, bias_map = _kv_maps(cfg, bq, bk)

  in_specs = [pl.BlockSpec((None, None, bq, h), lambda bb, hh, i, j, *_: (bb, hh, i, 0)),
              pl.BlockSpec((None, None, bk, h), kv_map),
              pl.BlockSpec((None, None, bk, hv), kv_map)]
  for x in (bias, mask):
    in_specs += _bias_spec(x, bq, bk, bias_map)
  sink_args = []
  if cfg.sinks:  # [N, 1, 128]: a (1, 128) block per query head, lane-replicated as m and l
    in_specs.append(pl.BlockSpec((None, 1, LANES), lambda bb, hh, i, j, *_: (hh, 0, 0)))
    sink_args = [jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (n, 1, LANES))]
  if cfg.alibi:
    in_specs.append(_slope_spec())
    sink_args.append(slopes.astype(jnp.float32))
  if cfg.relative:  # the query head's row of the reversed table
    in_specs.append(_rel_window_spec(cfg, bq, bk, lambda bb, hh, i, j, *lens: (
        hh, i * bq, clamp(bb, i, j, *lens) * bk)))
    sink_args.append(rel_operand(cfg, slopes))
  sm_ids, sm_specs = smask_ids(cfg, smask, (bq, LANES), (masking.SUBLANES, bk),
                               lambda bb, hh, i, j, *_: i,
                               lambda bb, hh, i, j, *lens: clamp(bb, i, j, *lens))
  in_specs += sm_specs
  out_map = lambda bb, hh, i, j, *_: (bb, hh, i, 0)
  scratch = [pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, hv), jnp.float32)]
  if cfg.w.online_max:
    scratch = [pltpu.VMEM((bq, LANES), jnp.float32)] + scratch
  sm_pre = smask_prefetch(cfg, smask, "fwd")
  o, st = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                        has_mask=mask is not None),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(sm_pre), grid=(b, n, tp // bq, cfg.sp // bk),
          in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, None, bq, hv), out_map),
                     pl.BlockSpec((None, None, bq, LANES), out_map)],
          scratch_shapes=scratch),
      out_shape=[jax.ShapeDtypeStruct((b, n, tp, hv), out_dtype),
                 jax.ShapeDtypeStruct((b, n, tp, LANES), jnp.float32)],
      compiler_params=_params(n_parallel=3, n_arbitrary=1), interpret=cfg.interpret,
      name="attnx_pallas_fwd",
  )(q_len, kv_len, *sm_pre, *[x for x in (q, k, v, bias, mask) if x is not None], *sink_args,
    *sm_ids)
  return o, st[..., 0]


# --------------------------------------------------------------------------------------------
# Backward: dQ (and dS), then dK/dV.
# --------------------------------------------------------------------------------------------

def _dq_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool, want_ds: bool):
  it = iter(refs)
  n_pre, n_ids = smask_counts(cfg)
  qlen_ref, kvlen_ref = next(it), next(it)
  sm_pre = [next(it) for _ in range(n_pre)]
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  slope_ref = next(it) if cfg.alibi else None  # [N] in SMEM: the ALiBi slopes
  rel_ref = next(it) if cfg.relative else None  # [1, W]: the tile's window of the table
  sm_ids = [next(it) for _ in range(n_ids)]
  dq_ref = next(it)
  ds_ref = next(it) if want_ds else None
  dm_ref = next(it) if cfg.alibi else None  # [bq, 128]: the rows' d slope sums, lanes
  # [1, Lr]: d rev of this (batch, query head), resident over the query and key tiles.
  drel_ref = next(it) if cfg.relative else None
  dq_sc = next(it)
  bq, bk = cfg.bq_dq, cfg.bk_dq
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  sm = smask_view(cfg, sm_pre, sm_ids, b, i, cfg.tp // bq, bq, bk)
  head = None if sm is None else pl.program_id(1)
  gq, gb = cfg.grad_mult
  slope = None if slope_ref is None else slope_ref[pl.program_id(1)]

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
    if dm_ref is not None:
      dm_ref[...] = jnp.zeros(dm_ref.shape, jnp.float32)

  if drel_ref is not None:
    @pl.when((i == 0) & (j == 0))
    def _init_rel():
      drel_ref[...] = jnp.zeros(drel_ref.shape, jnp.float32)

  span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  run = in_span(j, span)

  def _run(masked):
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    if slope is not None:
      lin, dist = alibi_tile(cfg, slope, (bq, bk), i * bq, j * bk)
      z, dcap = tile_scores_grad(cfg, [q], [k], _tile(bias_ref), lin)
    elif rel_ref is not None:
      lin = rel_tile(cfg, _window_load(rel_ref), i * bq, j * bk, bq, bk)
      z, dcap = tile_scores_grad(cfg, [q], [k], _tile(bias_ref), lin)
    else:
      z, dcap = tile_scores_grad(cfg, [q], [k], _tile(bias_ref))
    valid = None if not masked else tile_valid(
        cfg, (bq, bk), i * bq, j * bk, _tile(mask_ref), q_len, kv_len, sm, head)
    dp = lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
    rows = tuple(OPS.spread(r[...], bk) for r in (r0_ref, r1_ref, dl_ref))
    _, dz = bwd_tile(cfg, z, valid, dp, rows, OPS)
    if ds_ref is not None:
      ds_ref[...] = dz * gb if gb != 1.0 else dz
    if dm_ref is not None:  # d slope = Σ dS·dist (dS = gb·dz)
      dm = jnp.sum(dz * dist, axis=1, keepdims=True)
      dm_ref[...] += jnp.broadcast_to(dm * gb if gb != 1.0 else dm, dm_ref.shape)
    if drel_ref is not None:  # d ext = Σ dS along each diagonal (dS = gb·dz)
      start, sums = rel_diag_sums(cfg, dz, i * bq, j * bk)
      drel_ref[:, pl.ds(start, sums.shape[1])] += sums * gb if gb != 1.0 else sums
    dz = capped_grad(dz, dcap)  # the cotangent of scale·q·k
    dq_sc[...] += jnp.dot(dz.astype(k.dtype), finite(k), preferred_element_type=jnp.float32)

  span_when(j, span, kv_full(cfg, i, bq, bk, q_len, kv_len, span, has_mask, sm), _run)

  if ds_ref is not None:
    @pl.when(jnp.logical_not(run))
    def _skip():
      ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)

  @pl.when(j == cfg.sp // bk - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * gq).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool):
  it = iter(refs)
  n_pre, n_ids = smask_counts(cfg)
  qlen_ref, kvlen_ref = next(it), next(it)
  sm_pre = [next(it) for _ in range(n_pre)]
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  slope_ref = next(it) if cfg.alibi else None  # [N] in SMEM: the ALiBi slopes
  rel_ref = next(it) if cfg.relative else None  # [1, W]: the tile's window of the table
  sm_ids = [next(it) for _ in range(n_ids)]
  dk_ref, dv_ref, dk_sc, dv_sc = next(it), next(it), next(it), next(it)
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  b, j, h, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  sm = smask_view(cfg, sm_pre, sm_ids, b, j, cfg.sp // bk, bq, bk)
  head = None if sm is None else pl.program_id(1) * cfg.g + h
  gq, _ = cfg.grad_mult
  # The query head's (kv head·G + h) ALiBi slope.
  slope = None if slope_ref is None else slope_ref[pl.program_id(1) * cfg.g + h]
  span = q_span(cfg, j, bq, bk, q_len, kv_len, sm)

  @pl.when((h == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  def _run(masked):
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    if slope is not None:
      z, dcap = tile_scores_grad(cfg, [q], [k], _tile(bias_ref),
                                 alibi_tile(cfg, slope, (bq, bk), i * bq, j * bk)[0])
    elif rel_ref is not None:
      z, dcap = tile_scores_grad(cfg, [q], [k], _tile(bias_ref),
                                 rel_tile(cfg, _window_load(rel_ref), i * bq, j * bk, bq, bk))
    else:
      z, dcap = tile_scores_grad(cfg, [q], [k], _tile(bias_ref))
    valid = None if not masked else tile_valid(
        cfg, (bq, bk), i * bq, j * bk, _tile(mask_ref), q_len, kv_len, sm, head)
    dp = lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
    rows = tuple(OPS.spread(r[...], bk) for r in (r0_ref, r1_ref, dl_ref))
    p, dz = bwd_tile(cfg, z, valid, dp, rows, OPS)
    dz = capped_grad(dz, dcap)  # the cotangent of scale·q·k
    # Transposed in float32, then cast (as JAX's TPU flash kernel).
    dv_sc[...] += jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dk_sc[...] += jnp.dot(dz.T.astype(q.dtype), finite(q), preferred_element_type=jnp.float32)

  span_when(i, span, q_full(cfg, j, bq, bk, q_len, kv_len, span, has_mask, sm), _run)

  @pl.when((h == cfg.g - 1) & (i == cfg.tp // bq - 1))
  def _finish():
    dk_ref[...] = (dk_sc[...] * gq).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, want_ds,
              smask=None, slopes=None):
  b, n, tp, h = q.shape
  _, kh, sp, _ = k.shape
  hv = v.shape[-1]
  g = cfg.g
  has = dict(has_bias=bias is not None, has_mask=mask is not None)
  rows = [to_lanes_all(r) for r in rows]
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None]
  slope_specs = [_slope_spec()] if cfg.alibi else []
  if cfg.alibi:
    args.append(slopes.astype(jnp.float32))
  if cfg.relative:
    rev = rel_operand(cfg, slopes)
    lr = rev.shape[-1]
    args.append(rev)

  # dQ (and dS): grid (B, N, query tiles, key tiles).
  bq, bk = cfg.bq_dq, cfg.bk_dq
  row_map = lambda bb, hh, i, j, *_: (bb, hh, i, 0)
  clamp, kv_map, bias_map = _kv_maps(cfg, bq, bk)

  in_specs = [pl.BlockSpec((None, None, bq, h), row_map), pl.BlockSpec((None, None, bk, h), kv_map),
              pl.BlockSpec((None, None, bk, hv), kv_map),
              pl.BlockSpec((None, None, bq, hv), row_map)]
  in_specs += [pl.BlockSpec((None, None, bq, LANES), row_map)] * 3
  for x in (bias, mask):
    in_specs += _bias_spec(x, bq, bk, bias_map)
  in_specs += slope_specs
  if cfg.relative:
    in_specs.append(_rel_window_spec(cfg, bq, bk, lambda bb, hh, i, j, *lens: (
        hh, i * bq, clamp(bb, i, j, *lens) * bk)))
  sm_ids, sm_specs = smask_ids(cfg, smask, (bq, LANES), (masking.SUBLANES, bk),
                               lambda bb, hh, i, j, *_: i,
                               lambda bb, hh, i, j, *lens: clamp(bb, i, j, *lens))
  sm_pre = smask_prefetch(cfg, smask, "dq")
  out_specs = [pl.BlockSpec((None, None, bq, h), row_map)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, bk), lambda bb, hh, i, j, *_: (bb, hh, i, j)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32))
  if cfg.alibi:  # the rows' d slope sums, lane-replicated, accumulated over the key tiles
    out_specs.append(pl.BlockSpec((None, None, bq, LANES), row_map))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, LANES), jnp.float32))
  if cfg.relative:  # d rev per (batch, query head), accumulated over both tile axes
    out_specs.append(pl.BlockSpec((None, None, 1, lr), lambda bb, hh, i, j, *_: (bb, hh, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, 1, lr), jnp.float32))
  res = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(sm_pre), grid=(b, n, tp // bq, sp // bk),
          in_specs=in_specs + sm_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)]),
      out_shape=out_shape,
      compiler_params=(_rel_dq_params(lr) if cfg.relative
                       else _params(n_parallel=3, n_arbitrary=1)),
      interpret=cfg.interpret,
      name="attnx_pallas_dq")(q_len, kv_len, *sm_pre, *args, *sm_ids)
  dq, ds = res[0], (res[1] if want_ds else None)
  dslopes = jnp.sum(res[-1][..., 0], axis=(0, 2)) if cfg.alibi else None
  if cfg.relative:
    dslopes = rel_grad(cfg, res[-1], slopes.shape[1])

  # dK, dV: grid (B, K, key tiles, G, query tiles); the last two accumulate in VMEM.
  bq, bk = cfg.bq_dkv, cfg.bk_dkv

  def q_clamp(bb, j, i, ql, kl, *pre):
    return q_block(cfg, bb, j, i, bq, bk, ql, kl, pre)

  def qrow_map(bb, hh, j, gg, i, *lens):
    return bb, hh * g + gg, q_clamp(bb, j, i, *lens), 0

  def bias_map_kv(bb, hh, j, gg, i, *lens):
    return bb, hh * g + gg, q_clamp(bb, j, i, *lens), j

  kv_map2 = lambda bb, hh, j, *_: (bb, hh, j, 0)
  in_specs = [pl.BlockSpec((None, None, bq, h), qrow_map),
              pl.BlockSpec((None, None, bk, h), kv_map2),
              pl.BlockSpec((None, None, bk, hv), kv_map2),
              pl.BlockSpec((None, None, bq, hv), qrow_map)]
  in_specs += [pl.BlockSpec((None, None, bq, LANES), qrow_map)] * 3
  for x in (bias, mask):
    in_specs += _bias_spec(x, bq, bk, bias_map_kv)
  in_specs += slope_specs
  if cfg.relative:
    in_specs.append(_rel_window_spec(cfg, bq, bk, lambda bb, hh, j, gg, i, *lens: (
        hh * g + gg, q_clamp(bb, j, i, *lens) * bq, j * bk)))
  sm_ids, sm_specs = smask_ids(cfg, smask, (bq, LANES), (masking.SUBLANES, bk),
                               lambda bb, hh, j, gg, i, *lens: q_clamp(bb, j, i, *lens),
                               lambda bb, hh, j, *_: j)
  sm_pre = smask_prefetch(cfg, smask, "dkv")
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2 + len(sm_pre), grid=(b, kh, sp // bk, g, tp // bq),
          in_specs=in_specs + sm_specs,
          out_specs=[pl.BlockSpec((None, None, bk, h), kv_map2),
                     pl.BlockSpec((None, None, bk, hv), kv_map2)],
          scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, hv), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(n_parallel=3, n_arbitrary=2), interpret=cfg.interpret,
      name="attnx_pallas_dkv",
  )(q_len, kv_len, *sm_pre, *args, *sm_ids)
  if cfg.alibi or cfg.relative:
    return dq, dk, dv, ds, dslopes
  return dq, dk, dv, ds


# --------------------------------------------------------------------------------------------
# Layouts.
# --------------------------------------------------------------------------------------------

def to_lanes_all(r: Array) -> Array:
  """[B, N, Tp] row values -> [B, N, Tp, 128] (lane-replicated, as the TPU kernels read them)."""
  return jnp.broadcast_to(r[..., None], r.shape + (LANES,))



def forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len,
            out_dtype: Any, smask: Any = None, sinks: Any = None,
            slopes: Any = None) -> tuple[Array, Array]:
  """O [B, Tp, N, Hv] and the row statistic [B, N, Tp] of [B, Tp, N, H] arrays (the kernels
  run on their [B, N, Tp, H] transposes); ``sinks`` [N] when ``cfg.sinks``, ``slopes`` [N]
  when ``cfg.alibi``, a relative table's ext [N, Lx] when ``cfg.relative``."""
  o, st = _forward(cfg, bnth(q), bnth(k), bnth(v), bias, mask, q_len, kv_len, out_dtype, smask,
                   sinks, slopes)
  return bnth(o), st


def backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows,
             want_ds: bool, smask: Any = None, slopes: Any = None) -> tuple:
  """dq, dk, dv [B, Tp|Sp, N|K, H] and dS [B, N, Tp, Sp] or None, as :func:`forward`; with
  ``cfg.alibi`` (``slopes`` [N]) also d slopes [N] float32, with ``cfg.relative`` (``slopes``
  the ext [N, Lx]) d ext [N, Lx] float32 (summed over the batch)."""
  res = _backward(cfg, bnth(q), bnth(k), bnth(v), bias, mask, q_len, kv_len, bnth(do), rows,
                  want_ds, smask, slopes)
  dq, dk, dv, ds = res[:4]
  return (bnth(dq), bnth(dk), bnth(dv), ds) + tuple(res[4:])
