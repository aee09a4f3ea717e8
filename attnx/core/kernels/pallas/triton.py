"""The Triton (GPU) kernels of pointwise F, behind
:func:`attnx.core.kernels.pallas.wrapper.pallas_attention`.

Three kernels, FlashAttention-2 style (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning"; Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient
Exact Attention with IO-Awareness"):

* forward: one query tile per program, key tiles streamed by an in-kernel loop (Triton has no
  cross-program accumulators); writes O and one row statistic (log2-sum-exp for online-max
  weightings, the normalizer l otherwise);
* dK/dV: one key tile per program, looping over the G query heads that share it (GQA) and over
  query tiles; with ``cfg.two_pass_dkv`` dK and dV in two passes (:func:`dkv_passes`);
* dQ: one query tile per program, looping over key tiles; optionally writes the score
  cotangent dS (the bias gradient before the sum over broadcast dims).

Arrays stay in the ``[B, T, N, H]`` layout (strided loads). Every in-kernel array must have
power-of-2 dims, so tiles are powers of 2 and the head dims, zero-padded to a multiple of 16 by
the caller, are processed in power-of-2 chunks (:func:`head_chunks`). The tile math is
:mod:`.common`'s, spelled with :data:`OPS`: Σ F summed apart from the F·V matmul.

Score modifications: a soft cap and ALiBi in the tile scores (:mod:`.common`); a relative
table's extended table ext [N, Lx] as the score-mod operand, each tile's bias a gathered load
of its head's row (:func:`rel_tile`), and d ext accumulated by the dQ kernel with atomic adds
into one zero-initialised [N, Lx] (:func:`scatter_add`, :func:`rel_grad_out`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attnx import _compat
from attnx.core import streaming
from attnx.core.contract import finite
from attnx.core.kernels.pallas import masking
from attnx.core.kernels.pallas.common import (
    KernelConfig,
    accumulate_dkv,
    alibi_tile,
    bcast_index,
    bwd_tile,
    capped_grad,
    dot_chunks,
    kv_full,
    kv_span,
    q_full,
    q_span,
    ref_cols,
    relative_index,
    sink_start,
    span_loop,
    tile_scores,
    tile_scores_grad,
    tile_valid,
    uncounted,
)

Array = jax.Array
# The spelling of the streaming rules Triton lowers (see streaming.Ops).
OPS = streaming.Ops(exp2=True, ones_column=False)

__all__ = ["OPS", "backward", "bias_specs", "dkv_passes", "forward", "head_chunks", "load_chunks",
           "load_chunks3", "mod_args", "pallas_call", "rel_grad_out", "rel_tile", "scatter_add",
           "smask_operands", "smask_view", "store_chunks", "zero_tiles"]


def pallas_call(kernel: Callable[..., None], *, interpret: bool,
                **kwargs: Any) -> Callable[..., Any]:
  """``pl.pallas_call`` for a Triton kernel, traced knowing the GPU it will be lowered for.

  jax >= 0.11 lowers a Triton kernel for the GPU of the abstract mesh it was traced in; on a
  host without a GPU (lowering for ``cuda`` from a CPU, ``jax.export`` for two platforms) that
  is the ``AbstractDevice`` the caller named with ``jax.sharding.use_abstract_mesh``, else an
  H100, as jax 0.10 lowered (:func:`attnx._compat.triton_lowering_target`).
  """
  call = pl.pallas_call(kernel, interpret=interpret, **kwargs)
  if interpret:
    return call

  def traced(*args: Any) -> Any:
    with _compat.triton_lowering_target():
      return call(*args)
  return traced


def head_chunks(size: int) -> tuple[tuple[int, int], ...]:
  """(offset, width) chunks of a GPU head dim padded to a multiple of 16: the binary
  decomposition into powers of 2 ≥ 16 (Triton arrays must be powers of 2), e.g. 130 → 144 =
  128 + 16 instead of a padding to 256 (the neg_sq_dist score adds two columns to H)."""
  padded = -(-size // 16) * 16
  out, offset = [], 0
  for bit in reversed(range(padded.bit_length())):
    width = 1 << bit
    if padded & width:
      out.append((offset, width))
      offset += width
  return tuple(out)


def load_chunks(ref, rows, chunks):
  return [ref[rows, pl.ds(o, c)] for o, c in chunks]


def load_chunks3(ref, rows, head, chunks):
  return [ref[rows, head, pl.ds(o, c)] for o, c in chunks]


def store_chunks(ref, values, chunks, mult: float = 1.0):
  for (o, c), x in zip(chunks, values, strict=True):
    ref[:, pl.ds(o, c)] = (x * mult if mult != 1.0 else x).astype(ref.dtype)


# --------------------------------------------------------------------------------------------
# A relative-position table: its extended table ext [N, Lx] (common.relative_ext), read per tile
# by a gathered load, its gradient accumulated by atomic adds.
# --------------------------------------------------------------------------------------------

def rel_tile(cfg: KernelConfig, ref, shape: tuple[int, int], r0, c0, head=None):
  """(bias, idx): a relative table's bias of the [bq, bk] tile whose first row is query ``r0``
  and first column key ``c0``, float32, gathered from ``ref`` (ext's row of the query head,
  [Lx]; or [G, Lx] rows read at ``head``) at idx = :func:`.common.relative_index` (a load of a
  pointer tensor on the GPU)."""
  idx = relative_index(cfg, shape, r0, c0, ref.shape[-1])
  return (ref[idx] if head is None else ref[head, idx]), idx


def scatter_add(cfg: KernelConfig, ref, idx, val) -> None:
  """``ref[idx] += val`` for an [Lx] row ``ref`` shared by many programs, duplicates in ``idx``
  summed: Triton's atomic add on a pointer tensor (``tt.atomic_rmw`` fadd, one per entry). In
  Pallas' interpreter the atomic add of an index array keeps one of duplicate indices (its
  discharge rule gathers, adds and sets), so there the same sums are a scatter-add on values
  (the interpreter runs the programs one after another: no race)."""
  if cfg.interpret:
    ref[...] = ref[...] + jnp.zeros(ref.shape, jnp.float32).at[idx.reshape(-1)].add(
        val.reshape(-1))
  else:
    plgpu.atomic_add(ref, (idx,), val)


def mod_args(cfg: KernelConfig, mod, kv_heads: int | None = None) -> tuple[list, list]:
  """([BlockSpec], [array]) of the score modification's operand of a kernel with grid
  (tile, batch, head): ALiBi's slopes [N] as a [1] block at the query head, a relative
  table's ext [N, Lx] as the query head's row [Lx]; with ``kv_heads`` (the dK/dV kernels, grid
  over kv heads) the G slopes of the kv head as a [Gp] row (a power of 2), or ext's G rows
  [G, Lx]. None of them without ``cfg.mod_operand``."""
  if not cfg.mod_operand:
    return [], []
  mod = mod.astype(jnp.float32)
  g = cfg.g
  if cfg.relative:
    lx = mod.shape[-1]
    if kv_heads is None:
      return [pl.BlockSpec((None, lx), lambda i, bb, h: (h, 0))], [mod]
    return [pl.BlockSpec((g, lx), lambda j, bb, h: (h, 0))], [mod]
  if kv_heads is None:
    return [pl.BlockSpec((1,), lambda i, bb, h: (h,))], [mod]
  gp = pl.next_power_of_2(g)
  return ([pl.BlockSpec((None, gp), lambda j, bb, h: (h, 0))],
          [jnp.pad(mod.reshape(kv_heads, g), ((0, 0), (0, gp - g)))])


def rel_grad_out(cfg: KernelConfig, ext, out_specs: list, out_shape: list) -> tuple:
  """(in_specs, operands, input_output_aliases) that give a dQ kernel (grid (tile, batch,
  head)) d ext [N, Lx] float32 as its last output, appended to ``out_specs``/``out_shape``:
  each program adds (:func:`scatter_add`) into its query head's row, so the output starts
  as zeros, the kernel's first operand, which it aliases. Nothing without
  ``cfg.relative``."""
  if not cfg.relative:
    return [], [], {}
  n, lx = ext.shape
  spec = pl.BlockSpec((None, lx), lambda i, bb, h: (h, 0))
  aliases = {0: len(out_specs)}
  out_specs.append(spec)
  out_shape.append(jax.ShapeDtypeStruct((n, lx), jnp.float32))
  return [spec], [jnp.zeros((n, lx), jnp.float32)], aliases


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool):
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  qlen_ref, kvlen_ref = next(it), next(it)
  sink_ref = next(it) if cfg.sinks else None  # [1]: this query head's sink
  # [1]: this query head's ALiBi slope, or [Lx]: its row of a relative table's ext
  slope_ref = next(it) if cfg.mod_operand else None
  sm_refs = [next(it) for _ in range(cfg.num_smask_refs)]
  o_ref, stat_ref = next(it), next(it)
  w, bq, bk, ops = cfg.w, cfg.bq, cfg.bk, OPS
  hc, vc = head_chunks(q_ref.shape[-1]), head_chunks(v_ref.shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = qlen_ref[0], kvlen_ref[0]
  sm = smask_view(cfg, sm_refs, "fwd", bq, bk)
  head = None if sm is None else pl.program_id(2)
  qs = load_chunks(q_ref, slice(None), hc)
  slope = slope_ref[0] if cfg.alibi else None

  def tile(j, masked):
    c0 = j * bk
    rows = pl.ds(c0, bk)
    ks, vs = load_chunks(k_ref, rows, hc), tuple(load_chunks(v_ref, rows, vc))
    bias_t = None if bias_ref is None else ref_cols(bias_ref, c0, bk)
    if cfg.relative:
      z = tile_scores(cfg, qs, ks, bias_t, rel_tile(cfg, slope_ref, (bq, bk), i * bq, c0)[0])
    elif slope is None:
      z = tile_scores(cfg, qs, ks, bias_t)
    else:
      z = tile_scores(cfg, qs, ks, bias_t, alibi_tile(cfg, slope, (bq, bk), i * bq, c0)[0])
    if not masked:  # a tile of the full run: every pair attends
      return z, vs, None
    mask_t = None if mask_ref is None else ref_cols(mask_ref, c0, bk)
    return z, vs, tile_valid(cfg, (bq, bk), i * bq, c0, mask_t, q_len, kv_len, sm, head)

  # The accumulator and V are tuples of head-dim chunks (streaming's rules map over them).
  acc0 = tuple(jnp.zeros((bq, c), jnp.float32) for _, c in vc)
  span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  full = kv_full(cfg, i, bq, bk, q_len, kv_len, span, mask_ref is not None, sm)
  if w.online_max:
    def body(j, carry, masked):
      acc, m, l = carry
      z, vs, valid = tile(j, masked)
      return streaming.online_max_update(acc, m, z, valid, vs, l, ops=ops, log_f=w.log_f)

    m0, l0 = streaming.online_max_start(w)  # from the offset's virtual key, if any
    m0, l0 = jnp.full((bq,), m0, jnp.float32), jnp.full((bq,), l0, jnp.float32)
    if sink_ref is not None:
      m0, l0 = sink_start(cfg, m0, l0, jnp.full((bq,), sink_ref[0], jnp.float32), ops)
    acc, m, l = span_loop(span, full, body, (acc0, m0, l0))
    os_, st = streaming.pointwise_finalize(w, acc, m, l, add_offset=False, ops=ops)
  else:
    def body(j, carry, masked):
      z, vs, valid = tile(j, masked)
      return streaming.pointwise_update(w, *carry, z, valid, vs, cfg.s, ops=ops,
                                        full=not masked)

    l0 = jnp.zeros((bq,), jnp.float32)
    if sink_ref is not None:
      _, l0 = sink_start(cfg, None, l0, jnp.full((bq,), sink_ref[0], jnp.float32), ops)
    acc, l = span_loop(span, full, body, (acc0, l0))
    os_, st = streaming.pointwise_finalize(w, acc, l, num_keys=uncounted(cfg, has_mask),
                                           ops=ops)
  store_chunks(o_ref, os_, vc)
  stat_ref[...] = st


def smask_view(cfg: KernelConfig, refs: list, kind: str, bq: int,
               bk: int) -> masking.KernelMask | None:
  """A GPU program's structured mask from its refs (None without one)."""
  return None if cfg.smask is None else masking.gpu_view(cfg.smask, refs, kind, bq, bk)


def smask_operands(cfg: KernelConfig, smask: Any, kind: str, bq: int,
                   bk: int) -> tuple[list, list]:
  """(arrays, BlockSpecs) of a structured mask's operands for a GPU kernel (none without)."""
  if cfg.smask is None:
    return [], []
  return masking.gpu_operands(cfg.smask, smask, kind, bq, bk, cfg.tp, cfg.sp)


def bias_specs(x: Array | None, block: tuple[int, ...], index: Callable) -> list:
  if x is None:
    return []
  shape = x.shape
  blk = tuple(1 if d == 1 else b for d, b in zip(shape, block, strict=True))
  blk = (None, None) + blk[2:]  # batch and head dims are squeezed
  return [pl.BlockSpec(blk, lambda *ids: bcast_index(shape, index(*ids)))]


def forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, out_dtype, smask=None,
            sinks=None, slopes=None):
  """O and the row statistic (:func:`attnx.core.kernels.pallas.wrapper.forward`); ``sinks``
  [N] float32 when ``cfg.sinks``, ``slopes`` ALiBi's [N] or a relative table's ext [N, Lx]
  when ``cfg.mod_operand`` (each program reads its query head's, :func:`mod_args`)."""
  b, tp, n, hp = q.shape
  hvp = v.shape[-1]
  bq, g = cfg.bq, cfg.g
  in_specs = [
      pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0)),
      pl.BlockSpec((None, cfg.sp, None, hp), lambda i, bb, h: (bb, 0, lax.div(h, g), 0)),
      pl.BlockSpec((None, cfg.sp, None, hvp), lambda i, bb, h: (bb, 0, lax.div(h, g), 0)),
  ]
  for x in (bias, mask):
    in_specs += bias_specs(x, (1, 1, bq, cfg.sp), lambda i, bb, h: (bb, h, i, 0))
  in_specs += [pl.BlockSpec((1,), lambda i, bb, h: (bb,))] * 2
  sink_args = []
  if cfg.sinks:
    in_specs.append(pl.BlockSpec((1,), lambda i, bb, h: (h,)))
    sink_args = [sinks.astype(jnp.float32)]
  mod_specs, mod_arrays = mod_args(cfg, slopes)
  in_specs += mod_specs
  sink_args += mod_arrays
  sm_args, sm_specs = smask_operands(cfg, smask, "fwd", bq, cfg.bk)
  in_specs += sm_specs
  kernel = functools.partial(_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                             has_mask=mask is not None)
  args = ([x for x in (q, k, v, bias, mask) if x is not None] + [q_len, kv_len] + sink_args
          + sm_args)
  return pallas_call(
      kernel, grid=(tp // bq, b, n), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bq, None, hvp), lambda i, bb, h: (bb, i, h, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))],
      out_shape=[jax.ShapeDtypeStruct((b, tp, n, hvp), out_dtype),
                 jax.ShapeDtypeStruct((b, n, tp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="attnx_pallas_fwd")(*args)


# --------------------------------------------------------------------------------------------
# Backward: dQ (and dS), then dK/dV.
# --------------------------------------------------------------------------------------------

def _dq_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool, want_ds: bool):
  # A relative table: the first operand is the zeros that d ext's output aliases.
  it = iter(refs[1:] if cfg.relative else refs)
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  qlen_ref, kvlen_ref = next(it), next(it)
  # [1]: this query head's ALiBi slope, or [Lx]: its row of a relative table's ext
  slope_ref = next(it) if cfg.mod_operand else None
  sm_refs = [next(it) for _ in range(cfg.num_smask_refs)]
  dq_ref = next(it)
  ds_ref = next(it) if want_ds else None
  # [bq]: the rows' partial sums of d slope, or [Lx]: the head's d ext (shared by the programs)
  dm_ref = next(it) if cfg.mod_operand else None
  bq, bk = cfg.bq_dq, cfg.bk_dq
  hc, vc = head_chunks(q_ref.shape[-1]), head_chunks(v_ref.shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = qlen_ref[0], kvlen_ref[0]
  sm = smask_view(cfg, sm_refs, "dq", bq, bk)
  head = None if sm is None else pl.program_id(2)
  qs, dos = load_chunks(q_ref, slice(None), hc), load_chunks(do_ref, slice(None), vc)
  r0, r1, delta = r0_ref[...][:, None], r1_ref[...][:, None], dl_ref[...][:, None]
  gq, gb = cfg.grad_mult
  slope = slope_ref[0] if cfg.alibi else None

  def body(j, carry, masked):
    dq, dm = carry if slope is not None else (carry, None)
    c0 = j * bk
    rows = pl.ds(c0, bk)
    ks, vs = load_chunks(k_ref, rows, hc), load_chunks(v_ref, rows, vc)
    bias_t = None if bias_ref is None else ref_cols(bias_ref, c0, bk)
    if cfg.relative:
      lin, idx = rel_tile(cfg, slope_ref, (bq, bk), i * bq, c0)
      z, dcap = tile_scores_grad(cfg, qs, ks, bias_t, lin)
    elif slope is None:
      z, dcap = tile_scores_grad(cfg, qs, ks, bias_t)
    else:
      lin, dist = alibi_tile(cfg, slope, (bq, bk), i * bq, c0)
      z, dcap = tile_scores_grad(cfg, qs, ks, bias_t, lin)
    valid = None
    if masked:
      mask_t = None if mask_ref is None else ref_cols(mask_ref, c0, bk)
      valid = tile_valid(cfg, (bq, bk), i * bq, c0, mask_t, q_len, kv_len, sm, head)
    _, dz = bwd_tile(cfg, z, valid, dot_chunks(dos, vs), (r0, r1, delta), OPS)
    if ds_ref is not None:
      ds_ref[:, rows] = dz * gb if gb != 1.0 else dz
    if slope is not None:  # d slope = Σ dS·dist (dS = gb·dz: scaled once, outside)
      dm = dm + jnp.sum(dz * dist, axis=1)
    if cfg.relative:  # d ext[i − j + off] += dS_ij (dS = gb·dz: scaled once, outside)
      scatter_add(cfg, dm_ref, idx, dz)
    dz = capped_grad(dz, dcap)  # the cotangent of scale·q·k
    dq = tuple(a + jnp.dot(dz.astype(k.dtype), finite(k), preferred_element_type=jnp.float32)
               for a, k in zip(dq, ks, strict=True))
    return dq if slope is None else (dq, dm)

  lo, hi = span = kv_span(cfg, i, bq, bk, q_len, kv_len, sm)
  # Heads of more than one chunk (the distance kernels' 130 columns) keep one masked loop: the
  # split loops spilled the dQ kernel's registers (40 B, gaussian, causal GQA, H100, H = 128).
  full = (None if len(hc) > 1 else
          kv_full(cfg, i, bq, bk, q_len, kv_len, span, mask_ref is not None, sm))
  dq0 = tuple(jnp.zeros((bq, c), jnp.float32) for _, c in hc)
  if slope is None:
    dq = span_loop(span, full, body, dq0)
  else:
    dq, dm = span_loop(span, full, body, (dq0, jnp.zeros((bq,), jnp.float32)))
    dm_ref[...] = dm * gb if gb != 1.0 else dm
  store_chunks(dq_ref, dq, hc, gq)
  if ds_ref is not None:  # tiles the loop skipped get a zero score cotangent
    zero_tiles(ds_ref, lo, hi, bq, bk, cfg.sp // bk)


def zero_tiles(ds_ref, lo, hi, bq: int, bk: int, nk: int) -> None:
  """Zeros in the [bq, Sp] dS block's key tiles outside [lo, hi) (a loop's skipped tiles)."""
  def zero(j, c):
    ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), jnp.float32)
    return c
  if not (isinstance(lo, int) and lo == 0):
    lax.fori_loop(0, lo, zero, 0)
  lax.fori_loop(hi, nk, zero, 0)


def _dkv_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool,
                    want_dk: bool = True, want_dv: bool = True):
  """dK and/or dV of one key tile (``cfg.two_pass_dkv``: one of them per pass)."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  qlen_ref, kvlen_ref = next(it), next(it)
  # [Gp]: the ALiBi slopes of the kv head's query heads, or [G, Lx]: their rows of ext
  slope_ref = next(it) if cfg.mod_operand else None
  sm_refs = [next(it) for _ in range(cfg.num_smask_refs)]
  dk_ref = next(it) if want_dk else None
  dv_ref = next(it) if want_dv else None
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  hc, vc = head_chunks(k_ref.shape[-1]), head_chunks(v_ref.shape[-1])
  j = pl.program_id(0)
  q_len, kv_len = qlen_ref[0], kvlen_ref[0]
  sm = smask_view(cfg, sm_refs, "dkv", bq, bk)
  head0 = None if sm is None else pl.program_id(2) * cfg.g  # the kv head's first query head
  ks = load_chunks(k_ref, slice(None), hc)
  # dV needs the weights only; dP = dO·Vᵀ (and V) only for dK.
  vs = load_chunks(v_ref, slice(None), vc) if want_dk else None
  c0 = j * bk
  span = q_span(cfg, j, bq, bk, q_len, kv_len, sm)
  full = q_full(cfg, j, bq, bk, q_len, kv_len, span, mask_ref is not None, sm)
  gq, _ = cfg.grad_mult

  def head(h, carry):
    slope = slope_ref[h] if cfg.alibi else None

    def q_block(i, carry, masked):
      dk, dv = carry
      r = pl.ds(i * bq, bq)
      qs, dos = load_chunks3(q_ref, r, h, hc), load_chunks3(do_ref, r, h, vc)
      r0, r1, delta = r0_ref[h, r][:, None], r1_ref[h, r][:, None], dl_ref[h, r][:, None]
      bias_t = mask_t = None
      if bias_ref is not None:
        bias_t = bias_ref[h if bias_ref.shape[0] > 1 else 0,
                          r if bias_ref.shape[1] > 1 else pl.ds(0, 1), :]
      if mask_ref is not None:
        mask_t = mask_ref[h if mask_ref.shape[0] > 1 else 0,
                          r if mask_ref.shape[1] > 1 else pl.ds(0, 1), :]
      if cfg.relative:
        z, dcap = tile_scores_grad(cfg, qs, ks, bias_t,
                                   rel_tile(cfg, slope_ref, (bq, bk), i * bq, c0, h)[0])
      elif slope is None:
        z, dcap = tile_scores_grad(cfg, qs, ks, bias_t)
      else:
        z, dcap = tile_scores_grad(cfg, qs, ks, bias_t,
                                   alibi_tile(cfg, slope, (bq, bk), i * bq, c0)[0])
      valid = None if not masked else tile_valid(
          cfg, (bq, bk), i * bq, c0, mask_t, q_len, kv_len, sm, None if sm is None else head0 + h)
      dp = dot_chunks(dos, vs) if want_dk else jnp.zeros((bq, bk), jnp.float32)
      p, dz = bwd_tile(cfg, z, valid, dp, (r0, r1, delta), OPS)
      return accumulate_dkv((dk, dv), p, capped_grad(dz, dcap), qs, dos)
    return span_loop(span, full, q_block, carry)

  init = (tuple(jnp.zeros((bk, c), jnp.float32) for _, c in hc) if want_dk else (),
          tuple(jnp.zeros((bk, c), jnp.float32) for _, c in vc) if want_dv else ())
  dk, dv = lax.fori_loop(0, cfg.g, head, init)
  if want_dk:
    store_chunks(dk_ref, dk, hc, gq)
  if want_dv:
    store_chunks(dv_ref, dv, vc)


def dkv_passes(kernel: Callable, cfg: KernelConfig, args: list, in_specs: list, k: Array,
               v: Array, *, params: Any, name: str, has: dict) -> tuple[Array, Array]:
  """(dK, dV) by the GPU dK/dV ``kernel`` (keyword flags ``want_dk``/``want_dv``): one pass
  named ``{name}_dkv``, or with ``cfg.two_pass_dkv`` two (``{name}_dk``, ``{name}_dv``) that
  each hold one accumulator, for heads whose two accumulators spill registers."""
  b, sp, kh, _ = k.shape
  bk = cfg.bk_dkv
  out = lambda x: (pl.BlockSpec((None, bk, None, x.shape[-1]), lambda j, bb, h: (bb, j, h, 0)),
                   jax.ShapeDtypeStruct(x.shape, x.dtype))

  def call(want_dk: bool, want_dv: bool, suffix: str) -> list[Array]:
    outs = [out(x) for x, on in ((k, want_dk), (v, want_dv)) if on]
    return pallas_call(
        functools.partial(kernel, cfg=cfg, want_dk=want_dk, want_dv=want_dv, **has),
        grid=(sp // bk, b, kh), in_specs=in_specs, out_specs=[o[0] for o in outs],
        out_shape=[o[1] for o in outs], compiler_params=params, interpret=cfg.interpret,
        name=f"{name}_{suffix}")(*args)

  if cfg.two_pass_dkv:
    (dk,) = call(want_dk=True, want_dv=False, suffix="dk")
    (dv,) = call(want_dk=False, want_dv=True, suffix="dv")
    return dk, dv
  dk, dv = call(want_dk=True, want_dv=True, suffix="dkv")
  return dk, dv


def backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, want_ds,
             smask=None, slopes=None):
  """dq, dk, dv, dS or None and, when ``cfg.mod_operand``, the gradient of ``slopes`` float32:
  d slopes [N] (``cfg.alibi``: the dQ kernel's per-row partial sums, summed here) or d ext
  [N, Lx] (``cfg.relative``: the dQ kernels' atomic adds into one zero-initialised [N, Lx],
  summed over the batch and the query tiles in place)."""
  b, tp, n, hp = q.shape
  _, sp, kh, _ = k.shape
  hvp = v.shape[-1]
  g = cfg.g
  has = dict(has_bias=bias is not None, has_mask=mask is not None)
  lens = [pl.BlockSpec((1,), lambda i, bb, h: (bb,))] * 2
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
  dq_params = plgpu.CompilerParams(num_warps=cfg.num_warps_dq, num_stages=cfg.num_stages_bwd)
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None] + [q_len, kv_len]

  # dQ (and dS): grid over query tiles of every query head.
  bq, kv = cfg.bq_dq, lambda i, bb, h: (bb, 0, lax.div(h, g), 0)
  in_specs = [pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0)),
              pl.BlockSpec((None, sp, None, hp), kv), pl.BlockSpec((None, sp, None, hvp), kv),
              pl.BlockSpec((None, bq, None, hvp), lambda i, bb, h: (bb, i, h, 0))]
  in_specs += [pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))] * 3
  for x in (bias, mask):
    in_specs += bias_specs(x, (1, 1, bq, sp), lambda i, bb, h: (bb, h, i, 0))
  out_specs = [pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0))]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, sp), lambda i, bb, h: (bb, h, i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32))
  slope_specs, slope_args = mod_args(cfg, slopes)
  if cfg.alibi:  # the rows' d slope sums [B, N, Tp] out
    out_specs.append(pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp), jnp.float32))
  zero_specs, zero_args, aliases = rel_grad_out(cfg, slopes, out_specs, out_shape)
  sm_args, sm_specs = smask_operands(cfg, smask, "dq", bq, cfg.bk_dq)
  res = pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid=(tp // bq, b, n), in_specs=zero_specs + in_specs + lens + slope_specs + sm_specs,
      out_specs=out_specs, out_shape=out_shape, compiler_params=dq_params,
      input_output_aliases=aliases, interpret=cfg.interpret,
      name="attnx_pallas_dq")(*zero_args, *args, *slope_args, *sm_args)
  dq, ds = res[0], (res[1] if want_ds else None)
  dslopes = None
  if cfg.alibi:
    dslopes = jnp.sum(res[-1], axis=(0, 2))
  elif cfg.relative:
    dslopes = res[-1] * gb if (gb := cfg.grad_mult[1]) != 1.0 else res[-1]

  # dK, dV: grid over key tiles of every kv head; the G query heads of a kv head in-kernel.
  bk = cfg.bk_dkv
  in_specs = [pl.BlockSpec((None, tp, g, hp), lambda j, bb, h: (bb, 0, h, 0)),
              pl.BlockSpec((None, bk, None, hp), lambda j, bb, h: (bb, j, h, 0)),
              pl.BlockSpec((None, bk, None, hvp), lambda j, bb, h: (bb, j, h, 0)),
              pl.BlockSpec((None, tp, g, hvp), lambda j, bb, h: (bb, 0, h, 0))]
  in_specs += [pl.BlockSpec((None, g, tp), lambda j, bb, h: (bb, h, 0))] * 3
  for x in (bias, mask):
    if x is None:
      continue
    shape = x.shape
    blk = (None, 1 if shape[1] == 1 else g, 1 if shape[2] == 1 else tp, 1 if shape[3] == 1 else bk)
    in_specs.append(pl.BlockSpec(
        blk, lambda j, bb, h, shape=shape: bcast_index(shape, (bb, h, 0, j))))
  slope_specs, slope_args = mod_args(cfg, slopes, kv_heads=kh)
  sm_args, sm_specs = smask_operands(cfg, smask, "dkv", cfg.bq_dkv, bk)
  dk, dv = dkv_passes(_dkv_kernel, cfg, args + slope_args + sm_args,
                      in_specs + lens + slope_specs + sm_specs, k, v, params=params,
                      name="attnx_pallas", has=has)
  if cfg.mod_operand:
    return dq, dk, dv, ds, dslopes
  return dq, dk, dv, ds
