"""The Pallas kernels behind :func:`attnx.core.pallas_attention.pallas_attention`.

Three kernels per backend, FlashAttention-2 style (Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning"; Dao et al. 2022, "FlashAttention:
Fast and Memory-Efficient Exact Attention with IO-Awareness"):

* forward: one query tile per program, key tiles streamed; writes O and one row statistic
  (log2-sum-exp for online-max weightings, the normalizer l otherwise);
* dK/dV: one key tile per program, looping over the G query heads that share it (GQA) and over
  query tiles;
* dQ: one query tile per program, looping over key tiles; optionally writes the score
  cotangent dS (the bias gradient before the sum over broadcast dims).

The tile math is :mod:`attnx.core.streaming`'s two pointwise rules, the blocked kernel's
(:mod:`attnx.core.blocked`; same masking, same empty-row and NaN rules): the online max
(:func:`~attnx.core.streaming.online_max_update`) for ``w.online_max``, ``acc += F(S)·V``
with one division at the end otherwise (:func:`~attnx.core.streaming.pointwise_update`), both
ended by :func:`~attnx.core.streaming.pointwise_finalize`; the backward's dS from the saved
statistic is :func:`~attnx.core.streaming.pointwise_tile_grad`: α·P∘(dP − D) (online max),
F'(s)∘(dP − D)/l (``"sum"``), F'(s)∘dP/n (``"length"``), F'(s)∘dP (``"none"``). The kernels
spell them with :data:`GPU_OPS` / :data:`TPU_OPS`: scores in base-2 units (exp2, log₂e folded
into the score's scale), Σ F summed apart from the F·V matmul, and on the TPU row statistics
replicated over 128 lanes.

Backends:

* ``"gpu"``: Pallas' Triton lowering. Arrays stay in the ``[B, T, N, H]`` layout (strided
  loads); every in-kernel array must have power-of-2 dims, so tiles are powers of 2 and the
  head dims are zero-padded to a power of 2 by the caller. Keys are streamed by an in-kernel
  loop (Triton has no cross-program accumulators).
* ``"tpu"``: Pallas' Mosaic TPU lowering. Arrays are transposed to ``[B, N, T, H]`` (block last
  two dims must be multiples of (8, 128) or full); keys are the last, "arbitrary" grid axis
  with VMEM scratch accumulators, as in JAX's ``ops/tpu/flash_attention.py``; row statistics
  live lane-replicated as ``[rows, 128]``. Skipped tiles (causal, key lengths) keep their
  block index so that no DMA is issued for them.

All arrays given to these functions are already padded (T to Tp, S to Sp, and on the GPU H to a
power of 2); padded rows/keys are excluded through the ``q_len``/``kv_len`` bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from attnx.core import streaming
from attnx.core.contract import finite
from attnx.core.weightings import Pointwise

Array = jax.Array
LOG2E = math.log2(math.e)
LANES = 128  # TPU vector lanes: row statistics are stored replicated over 128 lanes
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
# The spellings of the streaming rules (see the module docstring and streaming.Ops).
GPU_OPS = streaming.Ops(exp2=True, ones_column=False)
TPU_OPS = streaming.Ops(exp2=True, ones_column=False, lanes=LANES)

__all__ = ["GPU_OPS", "LANES", "TPU_OPS", "KernelConfig", "accumulate_dkv", "backward",
           "bcast_index", "dot_chunks", "forward", "gpu_bias_specs", "gpu_dkv_passes",
           "grad_rows", "head_chunks", "kv_hi", "load_chunks", "load_chunks3", "q_range",
           "ref_cols", "store_chunks", "tile_scores", "tile_valid", "to_lanes_all"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static description of one problem (closed over by the kernels).

  Tiles: (bq, bk) forward, (bq_dq, bk_dq) for dQ, (bq_dkv, bk_dkv) for dK/dV. ``q_bound`` /
  ``kv_bound``: rows i ≥ q_len[b] / keys j ≥ kv_len[b] are invalid (lengths or padding).
  """

  w: Pointwise
  backend: str  # "gpu" | "tpu"
  interpret: bool
  s: int  # true number of keys S (F's num_keys argument)
  tp: int  # padded T
  sp: int  # padded S
  g: int  # query heads per kv head
  scale: float
  is_causal: bool
  q_bound: bool
  kv_bound: bool
  bq: int
  bk: int
  bq_dq: int
  bk_dq: int
  bq_dkv: int
  bk_dkv: int
  num_warps: int = 4  # GPU forward
  num_warps_bwd: int = 4  # GPU dK/dV
  num_warps_dq: int = 4  # GPU dQ
  num_stages: int = 2
  num_stages_bwd: int = 2
  # GPU: dK and dV in two passes of one accumulator each (their registers, at wide heads).
  split_dkv: bool = False
  # Sparsemax/entmax: skip the work of key tiles whose every weight is zero (pallas_rows).
  skip_zero_tiles: bool = True

  @property
  def alpha(self) -> float:
    return float(self.w.exp_alpha) if self.w.online_max else 1.0

  @property
  def z_mult(self) -> tuple[float, float]:
    """(q·k, bias) multipliers of the tile score z (base-2 exponent for online max)."""
    if self.w.online_max:
      return self.scale * self.alpha * LOG2E, self.alpha * LOG2E
    return self.scale, 1.0

  @property
  def grad_mult(self) -> tuple[float, float]:
    """(q·k, bias) multipliers turning the cotangent of z (natural units) into gradients."""
    return self.scale * self.alpha, self.alpha

  def needs_valid(self, has_mask: bool) -> bool:
    return has_mask or self.is_causal or self.q_bound or self.kv_bound

  @property
  def ops(self) -> streaming.Ops:
    """The backend's spelling of the streaming rules."""
    return GPU_OPS if self.backend == "gpu" else TPU_OPS


# --------------------------------------------------------------------------------------------
# Tile math shared by both backends (values, not refs).
# --------------------------------------------------------------------------------------------

def _cdiv(a, b: int):
  return lax.div(a + (b - 1), b)


def kv_hi(cfg: KernelConfig, i, bq: int, bk: int, q_len, kv_len):
  """Number of key tiles seen by query tile i (causal: not above the diagonal)."""
  hi = jnp.int32(cfg.sp // bk)
  if cfg.is_causal:
    hi = jnp.minimum(hi, lax.div(i * bq + bq + bk - 1, bk))
  if cfg.kv_bound:
    hi = jnp.minimum(hi, _cdiv(kv_len, bk))
  if cfg.q_bound:
    hi = jnp.where(i * bq < q_len, hi, 0)
  return hi


def q_range(cfg: KernelConfig, j, bq: int, bk: int, q_len, kv_len):
  """[lo, hi) of the query tiles that see key tile j."""
  lo = lax.div(j * bk, bq) if cfg.is_causal else jnp.int32(0)
  hi = jnp.int32(cfg.tp // bq)
  if cfg.q_bound:
    hi = jnp.minimum(hi, _cdiv(q_len, bq))
  if cfg.kv_bound:
    hi = jnp.where(j * bk < kv_len, hi, lo)
  return lo, jnp.maximum(hi, lo)


def tile_valid(cfg: KernelConfig, shape: tuple[int, int], r0, c0, mask_tile, q_len, kv_len):
  """Boolean [bq, bk] validity of a tile (None when every entry is valid)."""
  valid = None
  if mask_tile is not None:  # broadcast as int32, compare after (no i1 broadcasts)
    valid = jnp.broadcast_to(mask_tile.astype(jnp.int32), shape) != 0
  if cfg.is_causal or cfg.q_bound or cfg.kv_bound:
    rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    conds = []
    if cfg.is_causal:
      conds.append(cols <= rows)
    if cfg.q_bound:
      conds.append(rows < q_len)
    if cfg.kv_bound:
      conds.append(cols < kv_len)
    for c in conds:
      valid = c if valid is None else valid & c
  return valid


def tile_scores(cfg: KernelConfig, qs, ks, bias_tile):
  """The tile score z [bq, bk] float32 (base-2 exponent for online-max weightings).

  ``qs``/``ks``: the [bq, c] / [bk, c] chunks of the head dim (one chunk but on the GPU).
  """
  zq, zb = cfg.z_mult
  z = None
  for q, k in zip(qs, ks, strict=True):
    d = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
    z = d if z is None else z + d
  if zq != 1.0:
    z = z * zq
  if bias_tile is not None:
    b = bias_tile.astype(jnp.float32)
    z = z + (b * zb if zb != 1.0 else b)
  return z


def _bwd_tile(cfg: KernelConfig, z, valid, dp, rows):
  """(P, dZ) of one tile: the weights (for dV) and the cotangent of z in natural units.

  ``rows``: (r0, r1, δ) of :func:`attnx.core.streaming.pointwise_grad_rows`, broadcast
  against the tile (zeros where the rule reads nothing).
  """
  return streaming.pointwise_tile_grad(cfg.w, z, valid, dp, rows, cfg.s, ops=cfg.ops)


def ref_cols(ref, c0, size: int):
  """Columns [c0, c0 + size) of a 2-D ref (all of it when its last dim is broadcast)."""
  if ref.shape[-1] == 1:
    return ref[...]
  return ref[:, pl.ds(c0, size)]


# --------------------------------------------------------------------------------------------
# GPU (Triton): grid over query (or key) tiles, in-kernel loops over the other axis.
# --------------------------------------------------------------------------------------------

def bcast_index(shape: tuple[int, ...], full: tuple[Any, ...]) -> tuple[Any, ...]:
  """Block indices of a bias/mask with broadcast (size-1) dims: 0 along those."""
  return tuple(0 if d == 1 else x for d, x in zip(shape, full, strict=True))


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


def dot_chunks(as_, bs):
  """Σ_c a_c @ b_cᵀ (float32)."""
  out = None
  for a, b in zip(as_, bs, strict=True):
    d = lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)
    out = d if out is None else out + d
  return out


def _gpu_fwd_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool):
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  qlen_ref, kvlen_ref, o_ref, stat_ref = next(it), next(it), next(it), next(it)
  w, bq, bk, ops = cfg.w, cfg.bq, cfg.bk, cfg.ops
  hc, vc = head_chunks(q_ref.shape[-1]), head_chunks(v_ref.shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = qlen_ref[0], kvlen_ref[0]
  qs = load_chunks(q_ref, slice(None), hc)

  def tile(j):
    c0 = j * bk
    rows = pl.ds(c0, bk)
    ks, vs = load_chunks(k_ref, rows, hc), tuple(load_chunks(v_ref, rows, vc))
    z = tile_scores(cfg, qs, ks, None if bias_ref is None else ref_cols(bias_ref, c0, bk))
    mask_t = None if mask_ref is None else ref_cols(mask_ref, c0, bk)
    return z, vs, tile_valid(cfg, (bq, bk), i * bq, c0, mask_t, q_len, kv_len)

  # The accumulator and V are tuples of head-dim chunks (streaming's rules map over them).
  acc0 = tuple(jnp.zeros((bq, c), jnp.float32) for _, c in vc)
  hi = kv_hi(cfg, i, bq, bk, q_len, kv_len)
  if w.online_max:
    def body(j, carry):
      acc, m, l = carry
      z, vs, valid = tile(j)
      return streaming.online_max_update(acc, m, z, valid, vs, l, ops=ops)

    m0, l0 = streaming.online_max_start(w)  # from the offset's virtual key, if any
    acc, m, l = lax.fori_loop(0, hi, body, (acc0, jnp.full((bq,), m0, jnp.float32),
                                            jnp.full((bq,), l0, jnp.float32)))
    os_, st = streaming.pointwise_finalize(w, acc, m, l, add_offset=False, ops=ops)
  else:
    def body(j, carry):
      z, vs, valid = tile(j)
      return streaming.pointwise_update(w, *carry, z, valid, vs, cfg.s, ops=ops)

    acc, l = lax.fori_loop(0, hi, body, (acc0, jnp.zeros((bq,), jnp.float32)))
    os_, st = streaming.pointwise_finalize(w, acc, l, num_keys=_uncounted(cfg, has_mask),
                                           ops=ops)
  store_chunks(o_ref, os_, vc)
  stat_ref[...] = st


def _uncounted(cfg: KernelConfig, has_mask: bool) -> int | None:
  """pointwise_finalize's ``num_keys``: S when no tile is masked (so no key was counted)."""
  return None if cfg.needs_valid(has_mask) else cfg.s


def gpu_bias_specs(x: Array | None, block: tuple[int, ...], index: Callable) -> list:
  if x is None:
    return []
  shape = x.shape
  blk = tuple(1 if d == 1 else b for d, b in zip(shape, block, strict=True))
  blk = (None, None) + blk[2:]  # batch and head dims are squeezed
  return [pl.BlockSpec(blk, lambda *ids: bcast_index(shape, index(*ids)))]


def _gpu_forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, out_dtype):
  b, tp, n, hp = q.shape
  hvp = v.shape[-1]
  bq, g = cfg.bq, cfg.g
  in_specs = [
      pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0)),
      pl.BlockSpec((None, cfg.sp, None, hp), lambda i, bb, h: (bb, 0, lax.div(h, g), 0)),
      pl.BlockSpec((None, cfg.sp, None, hvp), lambda i, bb, h: (bb, 0, lax.div(h, g), 0)),
  ]
  for x in (bias, mask):
    in_specs += gpu_bias_specs(x, (1, 1, bq, cfg.sp), lambda i, bb, h: (bb, h, i, 0))
  in_specs += [pl.BlockSpec((1,), lambda i, bb, h: (bb,))] * 2
  kernel = functools.partial(_gpu_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                             has_mask=mask is not None)
  args = [x for x in (q, k, v, bias, mask) if x is not None] + [q_len, kv_len]
  return pl.pallas_call(
      kernel, grid=(tp // bq, b, n), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bq, None, hvp), lambda i, bb, h: (bb, i, h, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))],
      out_shape=[jax.ShapeDtypeStruct((b, tp, n, hvp), out_dtype),
                 jax.ShapeDtypeStruct((b, n, tp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="attnx_pallas_fwd")(*args)


def _gpu_dq_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool, want_ds: bool):
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  qlen_ref, kvlen_ref, dq_ref = next(it), next(it), next(it)
  ds_ref = next(it) if want_ds else None
  bq, bk = cfg.bq_dq, cfg.bk_dq
  hc, vc = head_chunks(q_ref.shape[-1]), head_chunks(v_ref.shape[-1])
  i = pl.program_id(0)
  q_len, kv_len = qlen_ref[0], kvlen_ref[0]
  qs, dos = load_chunks(q_ref, slice(None), hc), load_chunks(do_ref, slice(None), vc)
  r0, r1, delta = r0_ref[...][:, None], r1_ref[...][:, None], dl_ref[...][:, None]
  gq, gb = cfg.grad_mult

  def body(j, dq):
    c0 = j * bk
    rows = pl.ds(c0, bk)
    ks, vs = load_chunks(k_ref, rows, hc), load_chunks(v_ref, rows, vc)
    z = tile_scores(cfg, qs, ks, None if bias_ref is None else ref_cols(bias_ref, c0, bk))
    mask_t = None if mask_ref is None else ref_cols(mask_ref, c0, bk)
    valid = tile_valid(cfg, (bq, bk), i * bq, c0, mask_t, q_len, kv_len)
    _, dz = _bwd_tile(cfg, z, valid, dot_chunks(dos, vs), (r0, r1, delta))
    if ds_ref is not None:
      ds_ref[:, rows] = dz * gb if gb != 1.0 else dz
    return tuple(a + jnp.dot(dz.astype(k.dtype), finite(k), preferred_element_type=jnp.float32)
                 for a, k in zip(dq, ks, strict=True))

  hi = kv_hi(cfg, i, bq, bk, q_len, kv_len)
  dq = lax.fori_loop(0, hi, body, tuple(jnp.zeros((bq, c), jnp.float32) for _, c in hc))
  store_chunks(dq_ref, dq, hc, gq)
  if ds_ref is not None:  # tiles the loop skipped get a zero score cotangent
    def zero(j, c):
      ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), jnp.float32)
      return c
    lax.fori_loop(hi, cfg.sp // bk, zero, 0)


def _gpu_dkv_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool,
                    want_dk: bool = True, want_dv: bool = True):
  """dK and/or dV of one key tile (``cfg.split_dkv``: one of them per pass)."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  qlen_ref, kvlen_ref = next(it), next(it)
  dk_ref = next(it) if want_dk else None
  dv_ref = next(it) if want_dv else None
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  hc, vc = head_chunks(k_ref.shape[-1]), head_chunks(v_ref.shape[-1])
  j = pl.program_id(0)
  q_len, kv_len = qlen_ref[0], kvlen_ref[0]
  ks = load_chunks(k_ref, slice(None), hc)
  # dV needs the weights only; dP = dO·Vᵀ (and V) only for dK.
  vs = load_chunks(v_ref, slice(None), vc) if want_dk else None
  c0 = j * bk
  lo, hi = q_range(cfg, j, bq, bk, q_len, kv_len)
  gq, _ = cfg.grad_mult

  def head(h, carry):
    def q_block(i, carry):
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
      z = tile_scores(cfg, qs, ks, bias_t)
      valid = tile_valid(cfg, (bq, bk), i * bq, c0, mask_t, q_len, kv_len)
      dp = dot_chunks(dos, vs) if want_dk else jnp.zeros((bq, bk), jnp.float32)
      p, dz = _bwd_tile(cfg, z, valid, dp, (r0, r1, delta))
      return accumulate_dkv((dk, dv), p, dz, qs, dos)
    return lax.fori_loop(lo, hi, q_block, carry)

  init = (tuple(jnp.zeros((bk, c), jnp.float32) for _, c in hc) if want_dk else (),
          tuple(jnp.zeros((bk, c), jnp.float32) for _, c in vc) if want_dv else ())
  dk, dv = lax.fori_loop(0, cfg.g, head, init)
  if want_dk:
    store_chunks(dk_ref, dk, hc, gq)
  if want_dv:
    store_chunks(dv_ref, dv, vc)


def accumulate_dkv(dkv: tuple, p: Array, dz: Array, qs: list, dos: list) -> tuple:
  """(dK + dZᵀ·Q, dV + Pᵀ·dO) in float32, per head-dim chunk, for the accumulators held (an
  empty tuple: that one is not wanted, as in a pass of the two-pass form)."""
  dk, dv = dkv
  # The transposes first: the order in which the fused pass compiled without spills.
  pt = p.astype(dos[0].dtype).T if dv else None
  dzt = dz.astype(qs[0].dtype).T if dk else None
  if dv:
    dv = tuple(a + jnp.dot(pt, do, preferred_element_type=jnp.float32)
               for a, do in zip(dv, dos, strict=True))
  if dk:
    dk = tuple(a + jnp.dot(dzt, finite(q), preferred_element_type=jnp.float32)
               for a, q in zip(dk, qs, strict=True))
  return dk, dv


def gpu_dkv_passes(kernel: Callable, cfg: KernelConfig, args: list, in_specs: list, k: Array,
                   v: Array, params: Any, name: str, has: dict) -> tuple[Array, Array]:
  """(dK, dV) by the GPU dK/dV ``kernel`` (keyword flags ``want_dk``/``want_dv``): one pass
  named ``{name}_dkv``, or with ``cfg.split_dkv`` two (``{name}_dk``, ``{name}_dv``) that
  each hold one accumulator, for heads whose two accumulators spill registers."""
  b, sp, kh, _ = k.shape
  bk = cfg.bk_dkv
  out = lambda x: (pl.BlockSpec((None, bk, None, x.shape[-1]), lambda j, bb, h: (bb, j, h, 0)),
                   jax.ShapeDtypeStruct(x.shape, x.dtype))

  def call(want_dk: bool, want_dv: bool, suffix: str) -> list[Array]:
    outs = [out(x) for x, on in ((k, want_dk), (v, want_dv)) if on]
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg, want_dk=want_dk, want_dv=want_dv, **has),
        grid=(sp // bk, b, kh), in_specs=in_specs, out_specs=[o[0] for o in outs],
        out_shape=[o[1] for o in outs], compiler_params=params, interpret=cfg.interpret,
        name=f"{name}_{suffix}")(*args)

  if cfg.split_dkv:
    (dk,), (dv,) = call(True, False, "dk"), call(False, True, "dv")
    return dk, dv
  dk, dv = call(True, True, "dkv")
  return dk, dv


def _gpu_backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, want_ds):
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
    in_specs += gpu_bias_specs(x, (1, 1, bq, sp), lambda i, bb, h: (bb, h, i, 0))
  out_specs = [pl.BlockSpec((None, bq, None, hp), lambda i, bb, h: (bb, i, h, 0))]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, sp), lambda i, bb, h: (bb, h, i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32))
  res = pl.pallas_call(
      functools.partial(_gpu_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid=(tp // bq, b, n), in_specs=in_specs + lens, out_specs=out_specs,
      out_shape=out_shape, compiler_params=dq_params, interpret=cfg.interpret,
      name="attnx_pallas_dq")(*args)
  dq, ds = res[0], (res[1] if want_ds else None)

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
  dk, dv = gpu_dkv_passes(_gpu_dkv_kernel, cfg, args, in_specs + lens, k, v, params,
                          "attnx_pallas", has)
  return dq, dk, dv, ds


# --------------------------------------------------------------------------------------------
# TPU (Mosaic): [B, N, T, H] layout, keys (or queries) as the last "arbitrary" grid axis,
# VMEM scratch accumulators, lengths as scalar prefetch (SMEM).
# --------------------------------------------------------------------------------------------

def _tpu_tile(ref):
  return None if ref is None else ref[...]


def _tpu_fwd_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool):
  it = iter(refs)
  qlen_ref, kvlen_ref, q_ref, k_ref, v_ref = (next(it) for _ in range(5))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  o_ref, stat_ref = next(it), next(it)
  w, bq, bk, ops = cfg.w, cfg.bq, cfg.bk, cfg.ops
  scratch = list(it)
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]

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
      m_sc[...] = jnp.full(m_sc.shape, m0, jnp.float32)
      l_sc[...] = jnp.full(l_sc.shape, l0, jnp.float32)
    else:
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

  @pl.when(j < kv_hi(cfg, i, bq, bk, q_len, kv_len))
  def _run():
    z = tile_scores(cfg, [q_ref[...]], [k_ref[...]], _tpu_tile(bias_ref))
    valid = tile_valid(cfg, (bq, bk), i * bq, j * bk, _tpu_tile(mask_ref), q_len, kv_len)
    v = v_ref[...]
    if w.online_max:
      acc_sc[...], m_sc[...], l_sc[...] = streaming.online_max_update(
          acc_sc[...], m_sc[...], z, valid, v, l_sc[...], ops=ops)
    else:
      l = l_sc[...]
      acc_sc[...], l_new = streaming.pointwise_update(w, acc_sc[...], l, z, valid, v, cfg.s,
                                                      ops=ops)
      if l_new is not l:  # "none", and "length" on unmasked tiles, leave l as it is
        l_sc[...] = l_new

  @pl.when(j == cfg.sp // bk - 1)
  def _finish():
    if w.online_max:
      o, st = streaming.pointwise_finalize(w, acc_sc[...], m_sc[...], l_sc[...],
                                           add_offset=False, ops=ops)
    else:
      o, st = streaming.pointwise_finalize(w, acc_sc[...], l_sc[...],
                                           num_keys=_uncounted(cfg, has_mask), ops=ops)
    o_ref[...] = o.astype(o_ref.dtype)
    stat_ref[...] = st


def _tpu_bias_spec(x: Array | None, bq: int, bk: int, index: Callable) -> list:
  """[Bb, Nb, Tb, Sb] bias/mask: a (bq|1, bk|1) tile at the grid's (b, head, i, j)."""
  if x is None:
    return []
  shape = x.shape
  blk = (None, None, bq if shape[2] > 1 else 1, bk if shape[3] > 1 else 1)
  return [pl.BlockSpec(blk, lambda *ids: bcast_index(shape, index(*ids)))]


def _tpu_params(n_parallel: int, n_arbitrary: int):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary)


def _kv_clamp(cfg: KernelConfig, b, i, j, bq, bk, ql, kl):
  """Key tile to fetch at grid step j: a skipped tile repeats the last needed one (no DMA)."""
  hi = kv_hi(cfg, i, bq, bk, ql[b], kl[b])
  return jnp.minimum(j, jnp.maximum(hi - 1, 0))


def _tpu_forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, out_dtype):
  b, n, tp, h = q.shape
  hv = v.shape[-1]
  bq, bk, g = cfg.bq, cfg.bk, cfg.g

  def kv_map(bb, hh, i, j, ql, kl):
    return bb, lax.div(hh, g), _kv_clamp(cfg, bb, i, j, bq, bk, ql, kl), 0

  def bias_map(bb, hh, i, j, ql, kl):
    return bb, hh, i, _kv_clamp(cfg, bb, i, j, bq, bk, ql, kl)

  in_specs = [pl.BlockSpec((None, None, bq, h), lambda bb, hh, i, j, *_: (bb, hh, i, 0)),
              pl.BlockSpec((None, None, bk, h), kv_map),
              pl.BlockSpec((None, None, bk, hv), kv_map)]
  for x in (bias, mask):
    in_specs += _tpu_bias_spec(x, bq, bk, bias_map)
  out_map = lambda bb, hh, i, j, *_: (bb, hh, i, 0)
  scratch = [pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, hv), jnp.float32)]
  if cfg.w.online_max:
    scratch = [pltpu.VMEM((bq, LANES), jnp.float32)] + scratch
  o, st = pl.pallas_call(
      functools.partial(_tpu_fwd_kernel, cfg=cfg, has_bias=bias is not None,
                        has_mask=mask is not None),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, n, tp // bq, cfg.sp // bk), in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, None, bq, hv), out_map),
                     pl.BlockSpec((None, None, bq, LANES), out_map)],
          scratch_shapes=scratch),
      out_shape=[jax.ShapeDtypeStruct((b, n, tp, hv), out_dtype),
                 jax.ShapeDtypeStruct((b, n, tp, LANES), jnp.float32)],
      compiler_params=_tpu_params(3, 1), interpret=cfg.interpret, name="attnx_pallas_fwd",
  )(q_len, kv_len, *[x for x in (q, k, v, bias, mask) if x is not None])
  return o, st[..., 0]


def _tpu_dq_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool, want_ds: bool):
  it = iter(refs)
  qlen_ref, kvlen_ref = next(it), next(it)
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  dq_ref = next(it)
  ds_ref = next(it) if want_ds else None
  dq_sc = next(it)
  bq, bk = cfg.bq_dq, cfg.bk_dq
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  gq, gb = cfg.grad_mult

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  run = j < kv_hi(cfg, i, bq, bk, q_len, kv_len)

  @pl.when(run)
  def _run():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    z = tile_scores(cfg, [q], [k], _tpu_tile(bias_ref))
    valid = tile_valid(cfg, (bq, bk), i * bq, j * bk, _tpu_tile(mask_ref), q_len, kv_len)
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    rows = tuple(TPU_OPS.spread(r[...], bk) for r in (r0_ref, r1_ref, dl_ref))
    _, dz = _bwd_tile(cfg, z, valid, dp, rows)
    if ds_ref is not None:
      ds_ref[...] = dz * gb if gb != 1.0 else dz
    dq_sc[...] += jnp.dot(dz.astype(k.dtype), finite(k), preferred_element_type=jnp.float32)

  if ds_ref is not None:
    @pl.when(jnp.logical_not(run))
    def _skip():
      ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)

  @pl.when(j == cfg.sp // bk - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * gq).astype(dq_ref.dtype)


def _tpu_dkv_kernel(*refs, cfg: KernelConfig, has_bias: bool, has_mask: bool):
  it = iter(refs)
  qlen_ref, kvlen_ref = next(it), next(it)
  q_ref, k_ref, v_ref, do_ref, r0_ref, r1_ref, dl_ref = (next(it) for _ in range(7))
  bias_ref = next(it) if has_bias else None
  mask_ref = next(it) if has_mask else None
  dk_ref, dv_ref, dk_sc, dv_sc = next(it), next(it), next(it), next(it)
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  b, j, h, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  gq, _ = cfg.grad_mult
  lo, hi = q_range(cfg, j, bq, bk, q_len, kv_len)

  @pl.when((h == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when((i >= lo) & (i < hi))
  def _run():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    z = tile_scores(cfg, [q], [k], _tpu_tile(bias_ref))
    valid = tile_valid(cfg, (bq, bk), i * bq, j * bk, _tpu_tile(mask_ref), q_len, kv_len)
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    rows = tuple(TPU_OPS.spread(r[...], bk) for r in (r0_ref, r1_ref, dl_ref))
    p, dz = _bwd_tile(cfg, z, valid, dp, rows)
    # Transposed in float32, then cast (as JAX's TPU flash kernel).
    dv_sc[...] += jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dk_sc[...] += jnp.dot(dz.T.astype(q.dtype), finite(q), preferred_element_type=jnp.float32)

  @pl.when((h == cfg.g - 1) & (i == cfg.tp // bq - 1))
  def _finish():
    dk_ref[...] = (dk_sc[...] * gq).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, want_ds):
  b, n, tp, h = q.shape
  _, kh, sp, _ = k.shape
  hv = v.shape[-1]
  g = cfg.g
  has = dict(has_bias=bias is not None, has_mask=mask is not None)
  rows = [to_lanes_all(r) for r in rows]
  args = [q, k, v, do, *rows] + [x for x in (bias, mask) if x is not None]

  # dQ (and dS): grid (B, N, query tiles, key tiles).
  bq, bk = cfg.bq_dq, cfg.bk_dq
  row_map = lambda bb, hh, i, j, *_: (bb, hh, i, 0)

  def kv_map(bb, hh, i, j, ql, kl):
    return bb, lax.div(hh, g), _kv_clamp(cfg, bb, i, j, bq, bk, ql, kl), 0

  def bias_map(bb, hh, i, j, ql, kl):
    return bb, hh, i, _kv_clamp(cfg, bb, i, j, bq, bk, ql, kl)

  in_specs = [pl.BlockSpec((None, None, bq, h), row_map), pl.BlockSpec((None, None, bk, h), kv_map),
              pl.BlockSpec((None, None, bk, hv), kv_map),
              pl.BlockSpec((None, None, bq, hv), row_map)]
  in_specs += [pl.BlockSpec((None, None, bq, LANES), row_map)] * 3
  for x in (bias, mask):
    in_specs += _tpu_bias_spec(x, bq, bk, bias_map)
  out_specs = [pl.BlockSpec((None, None, bq, h), row_map)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if want_ds:
    out_specs.append(pl.BlockSpec((None, None, bq, bk), lambda bb, hh, i, j, *_: (bb, hh, i, j)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32))
  res = pl.pallas_call(
      functools.partial(_tpu_dq_kernel, cfg=cfg, want_ds=want_ds, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, n, tp // bq, sp // bk), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)]),
      out_shape=out_shape, compiler_params=_tpu_params(3, 1), interpret=cfg.interpret,
      name="attnx_pallas_dq")(q_len, kv_len, *args)
  dq, ds = res[0], (res[1] if want_ds else None)

  # dK, dV: grid (B, K, key tiles, G, query tiles); the last two accumulate in VMEM.
  bq, bk = cfg.bq_dkv, cfg.bk_dkv

  def q_clamp(bb, j, i, ql, kl):
    lo, hi = q_range(cfg, j, bq, bk, ql[bb], kl[bb])
    return jnp.minimum(jnp.maximum(i, lo), jnp.maximum(hi - 1, lo))

  def qrow_map(bb, hh, j, gg, i, ql, kl):
    return bb, hh * g + gg, q_clamp(bb, j, i, ql, kl), 0

  def bias_map_kv(bb, hh, j, gg, i, ql, kl):
    return bb, hh * g + gg, q_clamp(bb, j, i, ql, kl), j

  kv_map2 = lambda bb, hh, j, *_: (bb, hh, j, 0)
  in_specs = [pl.BlockSpec((None, None, bq, h), qrow_map),
              pl.BlockSpec((None, None, bk, h), kv_map2),
              pl.BlockSpec((None, None, bk, hv), kv_map2),
              pl.BlockSpec((None, None, bq, hv), qrow_map)]
  in_specs += [pl.BlockSpec((None, None, bq, LANES), qrow_map)] * 3
  for x in (bias, mask):
    in_specs += _tpu_bias_spec(x, bq, bk, bias_map_kv)
  dk, dv = pl.pallas_call(
      functools.partial(_tpu_dkv_kernel, cfg=cfg, **has),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, kh, sp // bk, g, tp // bq), in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, None, bk, h), kv_map2),
                     pl.BlockSpec((None, None, bk, hv), kv_map2)],
          scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, hv), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_tpu_params(3, 2), interpret=cfg.interpret, name="attnx_pallas_dkv",
  )(q_len, kv_len, *args)
  return dq, dk, dv, ds


def to_lanes_all(r: Array) -> Array:
  """[B, N, Tp] row values -> [B, N, Tp, 128] (lane-replicated, as the TPU kernels read them)."""
  return jnp.broadcast_to(r[..., None], r.shape + (LANES,))


# --------------------------------------------------------------------------------------------
# Entry points: [B, Tp, N, H] arrays in, [B, Tp, N, Hv] out, on either backend.
# --------------------------------------------------------------------------------------------

def _bnth(x: Array) -> Array:
  return x.transpose(0, 2, 1, 3)


def forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len,
            out_dtype: Any = None) -> tuple[Array, Array]:
  """O [B, Tp, N, Hv] (``out_dtype``, default q's) and the row statistic [B, N, Tp] (float32).

  ``bias``/``mask``: [Bb, Nb, Tb, Sb] with every dim 1 or full (mask as int8/int32).
  ``out_dtype`` float32 keeps O as accumulated (ring attention merges the O of key blocks).
  """
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if cfg.backend == "gpu":
    return _gpu_forward(cfg, q, k, v, bias, mask, q_len, kv_len, out_dtype)
  o, st = _tpu_forward(cfg, _bnth(q), _bnth(k), _bnth(v), bias, mask, q_len, kv_len, out_dtype)
  return _bnth(o), st


def grad_rows(cfg: KernelConfig, stat: Array, o: Array, do: Array) -> list[Array]:
  """The per-row values (r0, r1, δ) [B, N, Tp] of :func:`backward`, from the forward's row
  statistic [B, N, Tp] and O, dO [B, Tp, N, Hv]: those of
  :func:`attnx.core.streaming.pointwise_grad_rows`, zeros where the rule reads nothing."""
  # δ_i = dO_i·O_i; XLA drops it where the rule does not read it ("length", "none").
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
  zeros = jnp.zeros_like(stat)
  return [zeros if r is None else r for r in streaming.pointwise_grad_rows(cfg.w, stat, delta)]


def backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows,
             want_ds: bool) -> tuple[Array, Array, Array, Array | None]:
  """dq, dk, dv (input dtypes) and, when ``want_ds``, dS [B, N, Tp, Sp] float32.

  ``rows``: the three per-row values (r0, r1, δ), each [B, N, Tp] float32, of
  :func:`grad_rows`.
  """
  if cfg.backend == "gpu":
    return _gpu_backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, want_ds)
  dq, dk, dv, ds = _tpu_backward(cfg, _bnth(q), _bnth(k), _bnth(v), bias, mask, q_len,
                                 kv_len, _bnth(do), rows, want_ds)
  return _bnth(dq), _bnth(dk), _bnth(dv), ds
