"""Pallas attention kernels (GPU through Triton, TPU through Mosaic) for every pointwise F.

    out_i = Σ_j F(s_ij) v_j / N_i,   s_ij = scale · q_i·k_j + bias_ij

The same math, layout and edge-case contract as :func:`attnx.core.blocked.blocked_attention`
(:mod:`attnx.core.contract`), written as fused Pallas kernels: FlashAttention's tiling (Dao et
al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness") and
FlashAttention-2's work partitioning and recomputing backward (Dao 2023, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning"): the forward saves O and one
row statistic (log-sum-exp for online-max weightings, the normalizer otherwise); the backward
(a ``jax.custom_vjp``) recomputes the tiles in a dK/dV kernel and a dQ kernel. The kernels
themselves live in :mod:`attnx.core.pallas_kernels`.

Entry points:

* :func:`pallas_attention` — the kernel, ``[B, T, N, H]`` / ``[B, S, K, H]`` layout like
  ``blocked_attention``; plus ``q_lengths`` / ``kv_lengths`` (per-batch valid lengths).
* :func:`supported` — why a combination cannot run (None when it can).
* :func:`default_block_sizes` / :func:`check_block_sizes` — per-backend tile rules.
* :func:`verify_pallas` — the explicit verification: a one-time self-check per (backend,
  weighting, dtype, head size) (:func:`self_check` compares with the blocked kernel), cached,
  one warning when it fails. It runs eagerly on inputs of its own, outside any caller's trace.
* :func:`decline_reason` / :func:`choose_pallas` — the automatic choice's policy: GPU/TPU
  only, whole-row weightings on a GPU only, verified combinations only
  (:class:`attnx.core.implementations.pallas.PallasImplementation` asks it).

The whole-row weightings with a streaming family (SSMax, softpick, stick-breaking, sparsemax,
α-entmax) run the kernels of :mod:`attnx.core.pallas_rows` through the same entry point, with
the same inputs, tile rules and contract.

Supported inputs (both backends): every :class:`~attnx.core.weightings.Pointwise` weighting,
GQA (N a multiple of K), T ≠ S, ragged T and S (padded internally), H ≠ Hv, ``is_causal``
(top-left aligned; tiles above the diagonal are skipped), an additive ``bias`` and a boolean
``mask`` of any shape broadcastable to [B, N, T, S] whose dims are each 1 or full, per-batch
``q_lengths``/``kv_lengths`` (tiles beyond the key length are skipped), a static float scale
(a traced scale is folded into q). dtypes: float32, bfloat16 and (GPU) float16, with float32
scores, F and accumulators. The bias gradient materializes dS as [B, N, T, S] float32 before
summing over the bias' broadcast dims, and only when the bias is differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx.core import pallas_kernels as kernels
from attnx.core import pallas_rows, platforms
from attnx.core.contract import finite, nonfinite_inputs
from attnx.core.kernels import common
from attnx.core.weightings import Pointwise

Array = jax.Array
BACKENDS = ("gpu", "tpu")
_BACKEND_ALIASES = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "triton": "gpu", "tpu": "tpu",
                    "mosaic": "tpu"}
_DTYPES = {"gpu": ("float32", "bfloat16", "float16"), "tpu": ("float32", "bfloat16")}
GPU_MAX_HEAD_DIM = 256  # after padding to a multiple of 16: larger tiles do not fit in registers
GPU_MIN_BLOCK = 16  # tl.dot needs every matmul dim ≥ 16
TPU_SUBLANES = 8
TPU_LANES = 128
_LOG = logging.getLogger(__name__)

__all__ = ["BACKENDS", "BlockSizes", "PallasVerification", "backend_for_platform",
           "check_block_sizes", "choose_pallas", "clear_verifications", "decline_reason",
           "default_block_sizes", "gpu_tiles", "kernel_inputs", "kernel_tiles", "pad_to",
           "pallas_attention", "q_align", "resolve_backend", "self_check", "supported",
           "verify_pallas", "weighting_key"]


# --------------------------------------------------------------------------------------------
# Backends, support and block sizes.
# --------------------------------------------------------------------------------------------

def resolve_backend(backend: str | None = None, interpret: bool = False) -> str:
  """``"gpu"`` or ``"tpu"``: the kernel family to build.

  ``None`` follows ``jax.default_backend()``; on a CPU it is an error unless ``interpret``
  (then the GPU kernels run in Pallas' interpreter). ``"cuda"``, ``"rocm"``, ``"triton"``
  mean ``"gpu"`` and ``"mosaic"`` means ``"tpu"``. An explicit backend is accepted on any
  machine, so that a CPU can trace and lower the kernels for a GPU/TPU.
  """
  if backend is None:
    return backend_for_platform(jax.default_backend(), interpret)
  name = _BACKEND_ALIASES.get(str(backend).lower())
  if name is None:
    raise ValueError(f"Unknown Pallas backend {backend!r}; valid: 'gpu' (Triton) or 'tpu' "
                     "(Mosaic), or None for the default device.")
  return name


def backend_for_platform(platform: str, interpret: bool = False) -> str:
  """``"gpu"`` or ``"tpu"``: the kernel family for the JAX platform ``platform`` (what
  ``jax.default_backend()`` names); a CPU is an error unless ``interpret``."""
  if platform in _BACKEND_ALIASES:
    return _BACKEND_ALIASES[platform]
  if interpret:
    return "gpu"
  raise ValueError(
      f"implementation='pallas' needs a GPU or TPU; this machine runs JAX on {platform!r}. "
      "Pass interpret=True to run the kernels in Pallas' interpreter (slow; for testing), or "
      "use implementation='blocked' (the XLA flash-style kernel) on a CPU.")


def supported(weighting: Any, *, backend: str | None = None, dtype: Any = None,
              head_dim: int | None = None, value_head_dim: int | None = None,
              interpret: bool = False) -> str | None:
  """Why ``implementation="pallas"`` cannot run this combination, or None if it can.

  Checks the weighting (pointwise, or a whole-row weighting with a streaming family:
  :mod:`attnx.core.pallas_rows`), the backend (a GPU/TPU, or ``interpret`` on a CPU),
  the dtype (float32/bfloat16, and float16 on the GPU) and the GPU's head-size limit
  (:data:`GPU_MAX_HEAD_DIM` after padding to a multiple of 16). Whether F lowers on the backend is
  found out by compiling it (:func:`self_check`).
  """
  if not isinstance(weighting, Pointwise) and not pallas_rows.streams(weighting):
    name = getattr(weighting, "name", type(weighting).__name__)
    return (f"weighting {name!r} normalizes whole rows and has no streaming form; use "
            "implementation='dense'")
  try:
    be = resolve_backend(backend, interpret)
  except ValueError as e:
    return str(e)
  if dtype is not None:
    name = jnp.dtype(dtype).name
    if name not in _DTYPES[be]:
      return (f"dtype {name} is not supported by the Pallas {be} kernels (supported: "
              f"{', '.join(_DTYPES[be])}); use implementation='blocked'")
  if be == "gpu":
    for label, h in (("head dim", head_dim), ("value head dim", value_head_dim)):
      if h is not None and _round_up(h, GPU_MIN_BLOCK) > GPU_MAX_HEAD_DIM:
        return (f"{label} {h} exceeds the GPU kernel's limit {GPU_MAX_HEAD_DIM}; use "
                "implementation='blocked'")
  return None


def _pow2(x: int) -> int:
  return max(GPU_MIN_BLOCK, 1 << max(int(x) - 1, 0).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the three kernels: forward, dQ and dK/dV (queries × keys each)."""

  block_q: int
  block_k: int
  block_q_dq: int
  block_k_dq: int
  block_q_dkv: int
  block_k_dkv: int


# Defaults. GPU tiles and warps per kernel (queries × keys, warps), by dtype width and padded
# head size, with overrides per streaming family: the first entry of a small grid of
# candidates that compiled with 0 spill bytes for an H100 *and* an A100 (ptxas at XLA's
# production settings; experiments/kernel_compile.py) for the F of the tier (pointwise: softmax,
# sigmoid, power, softplus; every whole-row family), causal GQA at T = 2048. The tutorial tiles
# of Triton's fused attention (forward 128 × 64, dQ 64 × 32, dK/dV 32 × 64, 4 warps at H ≤ 64)
# spilled 12–1700 B in the backward of most F on one of the two chips; an A100 (no wgmma: the
# MMA operands live in registers) binds most often. Where the fused dK/dV pass spilled at every
# tile (float32 at H > 64: the dK and dV accumulators and the K, V tiles in registers), dK and
# dV run as two passes (split_dkv: scores recomputed, one accumulator each; the dV pass needs
# neither V nor dP). Where no candidate was spill-free (the distance kernels' dK at H = 128;
# stick-breaking's dK at float32 H = 256 with a bias) the table keeps the best one and
# docs/known_limits.md gives the figures. TPU tiles as in JAX's splash attention (bigger tiles
# amortize the ~0.35 µs per-grid-step overhead); none of them overflows VMEM on a v5e or v6e.
# kernel -> (block_q, block_k, num_warps); dK/dV may add a 4th entry, True: split_dkv (dK and
# dV in two passes of one accumulator each, where the fused pass spilled at every tile tried).
_GpuTier = dict[str, tuple[int, ...]]
# (float32?, largest padded head size) -> tiles, tried in order. The distance kernels run their
# dot form (H + 2 columns) in float32: H = 64 and 128 land in the float32 tiers of 80 and 160.
_GPU_TIERS: tuple[tuple[bool, int, _GpuTier], ...] = (
    (False, 64, dict(fwd=(128, 64, 8), dq=(64, 16, 8), dkv=(16, 32, 4))),
    (False, 128, dict(fwd=(128, 32, 8), dq=(64, 16, 8), dkv=(32, 64, 8))),
    (False, 256, dict(fwd=(64, 64, 8), dq=(64, 16, 8), dkv=(16, 64, 8))),
    (True, 64, dict(fwd=(128, 32, 8), dq=(64, 16, 8), dkv=(16, 32, 4))),
    (True, 80, dict(fwd=(32, 64, 4), dq=(64, 16, 8), dkv=(16, 16, 8, True))),
    (True, 128, dict(fwd=(32, 32, 8), dq=(64, 16, 8), dkv=(16, 64, 8, True))),
    (True, 160, dict(fwd=(32, 32, 8), dq=(64, 16, 8), dkv=(16, 64, 8, True))),
    (True, 256, dict(fwd=(32, 32, 8), dq=(16, 16, 8), dkv=(16, 16, 8, True))),
)
# Per family, per tier (same keys): the kernels whose tiles differ. Stick-breaking's dQ keeps
# 32 query rows on 4 warps (its carries; its key tile is the dK/dV kernel's).
_GPU_FAMILY_TIERS: dict[str, dict[tuple[bool, int], _GpuTier]] = {
    "entmax": {(False, 64): dict(fwd=(64, 64, 8)), (False, 128): dict(fwd=(32, 64, 4)),
               (False, 256): dict(fwd=(32, 64, 8), dkv=(16, 32, 8)),
               (True, 128): dict(fwd=(32, 64, 8), dkv=(16, 16, 8)),
               (True, 256): dict(dq=(32, 16, 8))},
    "softpick": {(False, 128): dict(fwd=(64, 64, 8)), (False, 256): dict(fwd=(32, 64, 8))},
    "stick_breaking": {
        (False, 64): dict(fwd=(128, 32, 8), dq=(32, 32, 4), dkv=(16, 32, 4)),
        (False, 128): dict(dq=(32, 32, 4), dkv=(16, 32, 4)),
        (False, 256): dict(fwd=(32, 64, 8), dq=(16, 16, 4), dkv=(16, 16, 8)),
        (True, 64): dict(dq=(32, 32, 4)),
        (True, 128): dict(fwd=(32, 64, 8), dq=(32, 16, 4), dkv=(16, 16, 8, True)),
        (True, 256): dict(dq=(16, 16, 4)),
    },
}
_TPU_DEFAULT = dict(block_q=256, block_k=512, block_q_dq=256, block_k_dq=256,
                    block_q_dkv=256, block_k_dkv=256)


def q_align(backend: str, dtype: Any) -> int:
  """TPU query tiles: a multiple of the sublane count of the dtype's (8·packing, 128) tile."""
  return TPU_SUBLANES * (4 // min(jnp.dtype(dtype).itemsize, 4)) if backend == "tpu" else 1


def check_block_sizes(backend: str, dtype: Any = jnp.float32, **blocks: int | None) -> None:
  """Raises ValueError for a tile size the backend's lowering rejects.

  GPU (Triton): powers of 2, at least 16. TPU (Mosaic): query tiles a multiple of 8 (16 for
  16-bit dtypes), key tiles a multiple of 128 (the key axis is the lane axis of every tile).
  """
  be = resolve_backend(backend)
  for name, value in blocks.items():
    if value is None:
      continue
    if not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
    if be == "gpu":
      if value < GPU_MIN_BLOCK or value & (value - 1):
        raise ValueError(
            f"{name}={value} is not valid for the GPU (Triton) kernels: Pallas' Triton "
            f"lowering needs power-of-2 tiles, and tl.dot at least {GPU_MIN_BLOCK} (e.g. "
            f"{max(GPU_MIN_BLOCK, 1 << (int(value).bit_length() - 1))}).")
    else:
      is_q = name.startswith("block_q")
      align = q_align(be, dtype) if is_q else TPU_LANES
      if value % align:
        raise ValueError(
            f"{name}={value} is not valid for the TPU (Mosaic) kernels: "
            f"{'query' if is_q else 'key'} tiles must be a multiple of {align} "
            f"({'sublanes of a ' + jnp.dtype(dtype).name + ' tile' if is_q else 'lanes'}).")


def gpu_tiles(head_dim: int | None, family: str | None, dtype: Any) -> dict[str, int]:
  """The GPU kernels' tiles and warps for a padded head size, a dtype and a streaming family
  (None: pointwise F): :class:`BlockSizes` fields plus ``num_warps`` (forward), ``num_warps_dq``
  and ``num_warps_bwd`` (dK/dV), from :data:`_GPU_TIERS` and :data:`_GPU_FAMILY_TIERS`."""
  wide = jnp.dtype(dtype).itemsize > 2
  hp = head_dim or 0
  key, tier = next(((w, h), t) for w, h, t in _GPU_TIERS if w == wide and (hp <= h or h == 256))
  tier = {**tier, **_GPU_FAMILY_TIERS.get(family or "", {}).get(key, {})}
  (bq, bk, w), (bq_dq, bk_dq, w_dq) = tier["fwd"], tier["dq"]
  bq_dkv, bk_dkv, w_dkv, *split = tier["dkv"]
  return dict(block_q=bq, block_k=bk, block_q_dq=bq_dq, block_k_dq=bk_dq, block_q_dkv=bq_dkv,
              block_k_dkv=bk_dkv, num_warps=w, num_warps_dq=w_dq, num_warps_bwd=w_dkv,
              split_dkv=bool(split and split[0]))


def default_block_sizes(backend: str, t: int, s: int, dtype: Any = jnp.float32,
                        block_q: int | None = None, block_k: int | None = None, *,
                        head_dim: int | None = None, family: str | None = None) -> BlockSizes:
  """The tiles used for T queries and S keys (``block_q``/``block_k`` override all kernels).

  Defaults (queries × keys): GPU by dtype width and head size (``head_dim``, the padded one;
  without it the H ≤ 64 tier, e.g. bf16: forward 128 × 64, dQ 64 × 16, dK/dV 16 × 32) and by
  a whole-row weighting's streaming ``family``, the tiles that compiled without register
  spills for an H100 and an A100 (:data:`_GPU_TIERS`); TPU forward 256 × 512, backward
  256 × 256. Every tile is then capped at the (aligned) sequence: GPU at the next power of 2
  (≥ 16), TPU at T rounded up to 8 (16 for 16-bit dtypes) and S rounded up to 128.
  """
  be = resolve_backend(backend)
  check_block_sizes(be, dtype, block_q=block_q, block_k=block_k)
  sizes = dict(_TPU_DEFAULT)
  if be == "gpu":
    sizes = {n: v for n, v in gpu_tiles(head_dim, family, dtype).items()
             if n.startswith("block_")}
  for name in sizes:
    given = block_q if name.startswith("block_q") else block_k
    if given is not None:
      sizes[name] = int(given)
  if be == "gpu":
    cap_q, cap_k = _pow2(t), _pow2(s)
  else:
    cap_q, cap_k = _round_up(max(t, 1), q_align(be, dtype)), _round_up(max(s, 1), TPU_LANES)
  return BlockSizes(**{n: min(v, cap_q if n.startswith("block_q") else cap_k)
                       for n, v in sizes.items()})


# --------------------------------------------------------------------------------------------
# The custom VJP.
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=512)
def _make_kernel(cfg: kernels.KernelConfig) -> Callable[..., Array]:
  """A custom-VJP function (q, k, v, bias, mask, q_len, kv_len) -> O of padded arrays."""

  @jax.custom_vjp
  def attn(q, k, v, bias, mask, q_len, kv_len):
    return kernels.forward(cfg, q, k, v, bias, mask, q_len, kv_len)[0]

  def fwd(q, k, v, bias, mask, q_len, kv_len):
    # symbolic_zeros: each array arrives as CustomVJPPrimal(value, perturbed); dS is only
    # materialized when the bias is differentiated.
    want_ds = bias is not None and bias.perturbed
    vals = [None if x is None else x.value for x in (q, k, v, bias, mask, q_len, kv_len)]
    o, stat = kernels.forward(cfg, *vals)
    marker = jnp.zeros((), jnp.float32) if want_ds else None
    return o, (*vals, o, stat, marker)

  def bwd(res, do):
    q, k, v, bias, mask, q_len, kv_len, o, stat, marker = res
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
      return (None,) * 7
    rows = kernels.grad_rows(cfg, stat, o, do)
    dq, dk, dv, ds = kernels.backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows,
                                      want_ds=marker is not None)
    dbias = None if ds is None else common.sum_to(ds, bias.shape).astype(bias.dtype)
    return dq, dk, dv, dbias, None, None, None

  attn.defvjp(fwd, bwd, symbolic_zeros=True)
  return attn


# --------------------------------------------------------------------------------------------
# The public kernel.
# --------------------------------------------------------------------------------------------

def _as_4d(x: Array | None, shape4: tuple[int, int, int, int], name: str) -> Array | None:
  """A [B|1, N|1, T|1, S|1]-broadcastable array (≤ 4 dims) as 4-D, each dim 1 or full."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims [B, N, T, S], got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(d not in (1, f) for d, f in zip(x.shape, shape4, strict=True)):
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to [B, N, T, S] = "
                     f"{shape4} (each dim must be 1 or full)")
  return x


def pad_to(x: Array, sizes: dict[int, int], value: Any = 0, keep_one: bool = False) -> Array:
  """Pads the given axes at the end to the given sizes; with ``keep_one`` a size-1 axis is a
  broadcast (of a bias or mask) and stays as is. q, k and v of length 1 are padded."""
  pads = [(0, 0)] * x.ndim
  for axis, size in sizes.items():
    if x.shape[axis] != size and not (keep_one and x.shape[axis] == 1):
      pads[axis] = (0, size - x.shape[axis])
  if all(p == (0, 0) for p in pads):
    return x
  return jnp.pad(x, pads, constant_values=value)


def _lengths(x: Array | None, b: int, full: int, name: str) -> Array:
  if x is None:
    return jnp.full((b,), full, jnp.int32)
  x = jnp.asarray(x)
  if x.shape not in ((b,), ()) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape [B] = ({b},), got "
                     f"{x.shape} {x.dtype}")
  return jnp.clip(jnp.broadcast_to(x, (b,)).astype(jnp.int32), 0, full)


def pallas_attention(q: Array, k: Array, v: Array, *, weighting: Any,
                     scale: float | Array, bias: Array | None = None, mask: Array | None = None,
                     is_causal: bool = False, q_lengths: Array | None = None,
                     kv_lengths: Array | None = None, block_q: int | None = None,
                     block_k: int | None = None, backend: str | None = None,
                     interpret: bool = False, ssmax_s: Array | float | None = None,
                     skip_zero_tiles: bool = True) -> Array:
  """Fused attention out_i = Σ_j w_ij v_j for a pointwise weighting F, or a whole-row weighting
  with a streaming family (SSMax, softpick, stick-breaking, sparsemax, entmax: the kernels of
  :mod:`attnx.core.pallas_rows`), as Pallas kernels.

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H]; N a multiple of K (GQA: query head n uses kv head n // (N // K)).
    v: values [B, S, K, Hv].
    weighting: the :class:`~attnx.core.weightings.Pointwise` F and its normalization, or a
      :class:`~attnx.core.weightings.RowNormalizer` with a ``stream``.
    scale: multiplies q·k; a Python/NumPy number is compiled into the kernels, an array is
      multiplied into q beforehand (in float32, then cast back to q's dtype).
    bias: additive bias broadcastable to [B, N, T, S] (≤ 4 dims, each 1 or full).
    mask: boolean mask broadcastable to [B, N, T, S]; True = attend.
    is_causal: query i attends key j ≤ i (top-left aligned, like ``jnp.tril``).
    q_lengths, kv_lengths: optional int [B]: rows i ≥ q_lengths[b] get no valid key (zero
      output), keys j ≥ kv_lengths[b] are masked (and their tiles skipped).
    block_q, block_k: tile sizes for every kernel (default :func:`default_block_sizes`);
      validated by :func:`check_block_sizes`. T and S need not be multiples of them.
    backend: ``"gpu"`` (Triton) or ``"tpu"`` (Mosaic); None (default) chooses per lowering
      platform: the Triton kernels where the program is lowered for a GPU, the Mosaic ones for
      a TPU (:func:`attnx.core.platforms.by_platform`), so that a CPU host can lower, export
      or compile it for either, or for both at once. Lowering it for a CPU raises ValueError.
    interpret: run the kernels in Pallas' interpreter (any machine, slow; for testing); with
      ``backend=None`` they are the kernels of the host's kind of device (GPU on a CPU).
    ssmax_s: SSMax only: s as a scalar or one value per query head [N] (an array gets a
      gradient); default the weighting's own s.
    skip_zero_tiles: sparsemax/entmax only: in the output pass and the backward, a key tile
      whose scores show every weight of the query tile to be zero (all x ≤ τ) adds nothing and
      its remaining work (powers, P·V; dP, dS·K, Pᵀ·dO, dSᵀ·Q) is left out (AdaSplash's block
      skipping; the scores are computed to find out). The result is the same bit for bit;
      False computes every tile (for side-by-side timings). The threshold passes compute
      every tile: these kernels keep no table of tile maxima across passes.

  Returns:
    [B, T, N, Hv] in q's dtype, equal up to float rounding to
    ``blocked_attention(q, k, v, weighting=..., ...)`` (float32 accumulation).

  Raises:
    ValueError: for an unsupported combination (see :func:`supported`; the message names the
      alternative implementation), bad shapes or tile sizes.
  """
  if backend is None and not interpret:
    return _per_platform(
        q, k, v, weighting=weighting, scale=scale, bias=bias, mask=mask, is_causal=is_causal,
        q_lengths=q_lengths, kv_lengths=kv_lengths, block_q=block_q, block_k=block_k,
        ssmax_s=ssmax_s, skip_zero_tiles=skip_zero_tiles)
  rows = not isinstance(weighting, Pointwise)
  if not isinstance(skip_zero_tiles, bool):
    raise ValueError(f"skip_zero_tiles must be a bool, got {skip_zero_tiles!r}")
  if rows and not pallas_rows.streams(weighting):
    raise ValueError(f"implementation='pallas' cannot run this: {supported(weighting)}.")
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected 4-D [B, T, N, H] inputs, got {q.shape}, {k.shape}, {v.shape}")
  b, t, n, h = q.shape
  _, s, kh, _ = k.shape
  hv = v.shape[-1]
  if kh == 0 or n % kh or k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[-1] != h:
    raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  be = resolve_backend(backend, interpret)
  reason = supported(weighting, backend=be, dtype=q.dtype, head_dim=h, value_head_dim=hv,
                     interpret=interpret)
  if reason:
    raise ValueError(f"implementation='pallas' cannot run this: {reason}.")
  if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean, got {jnp.asarray(mask).dtype}")
  bias4 = _as_4d(bias, (b, n, t, s), "bias")
  mask4 = _as_4d(mask, (b, n, t, s), "mask")
  blocks, launch = kernel_tiles(be, weighting, t, s, h, hv, q.dtype, block_q, block_k)
  q_len = _lengths(q_lengths, b, t, "q_lengths")
  kv_len = _lengths(kv_lengths, b, s, "kv_lengths")
  if q.size == 0 or s == 0:  # no query, or no key (every row has no valid key)
    return jnp.zeros((b, t, n, hv), q.dtype)

  rowc = None
  if rows and weighting.stream.needs_row_scale:  # SSMax's c_i = s·log n_i, from the raw masks
    rowc = pallas_rows.row_scale(weighting.stream, b, n, t, s, bias4, mask4, is_causal,
                                 None if kv_lengths is None else kv_len, ssmax_s)
  cfg, (q, k, v, bias4, mask4) = kernel_inputs(
      q, k, v, bias4, mask4, weighting=weighting, scale=scale, backend=be, interpret=interpret,
      blocks=blocks, launch=launch, is_causal=is_causal, q_bound=q_lengths is not None,
      kv_bound=kv_lengths is not None, skip_zero_tiles=skip_zero_tiles)
  if rows:
    if rowc is not None:
      rowc = pad_to(rowc, {2: cfg.tp})
    out = pallas_rows.make_kernel(cfg)(q, k, v, bias4, mask4, q_len, kv_len, rowc)
  else:
    out = _make_kernel(cfg)(q, k, v, bias4, mask4, q_len, kv_len)
  return out[:, :t, :, :hv]


def kernel_tiles(be: str, weighting: Any, t: int, s: int, h: int, hv: int, dtype: Any,
           block_q: int | None, block_k: int | None) -> tuple[BlockSizes, dict[str, Any]]:
  """The tiles (:func:`default_block_sizes`, checked) and the GPU's launch parameters (warps,
  dK/dV as two passes; none on the TPU) of a T × S problem of head sizes H, Hv."""
  rows = not isinstance(weighting, Pointwise)
  # The GPU's padded head size (a multiple of 16) picks its tiles.
  family = weighting.stream.family if rows else None
  blocks = default_block_sizes(be, t, s, dtype, block_q, block_k,
                               head_dim=_round_up(max(h, hv), GPU_MIN_BLOCK), family=family)
  launch = {} if be != "gpu" else {
      n: v for n, v in gpu_tiles(_round_up(max(h, hv), GPU_MIN_BLOCK), family,
                                  dtype).items() if not n.startswith("block_")}
  if rows and weighting.stream.reverse:
    # Stick-breaking's dQ pass saves its carries at the dK/dV pass's key tiles.
    blocks = dataclasses.replace(blocks, block_k_dq=blocks.block_k_dkv)
  return blocks, launch


def kernel_inputs(q: Array, k: Array, v: Array, bias4: Array | None, mask4: Array | None, *,
                  weighting: Any, scale: float | Array, backend: str, interpret: bool,
                  blocks: BlockSizes, launch: dict[str, Any], is_causal: bool, q_bound: bool,
                  kv_bound: bool, skip_zero_tiles: bool = True, num_keys: int | None = None
                  ) -> tuple[kernels.KernelConfig, tuple[Array | None, ...]]:
  """The kernels' config and padded operands (q, k, v, bias, mask) of a checked, non-empty
  problem: q [B, T, N, H], k/v [B, S, K, H|Hv], bias/mask [B|1, N|1, T|1, S|1] (each dim 1 or
  full; the mask boolean), tiles and launch parameters from :func:`kernel_tiles`.

  Shared by :func:`pallas_attention` and the per-block entry points of ring attention
  (:mod:`attnx.core.ring_pallas`). Applies the contract's input step (:func:`nonfinite_inputs`),
  folds an array ``scale`` into q (the config's scale is then 1), pads T and S to whole tiles
  (``q_bound``/``kv_bound``: the caller passes lengths, so rows/keys past them are invalid even
  without padding) and, on the GPU, the head dims to multiples of 16. ``num_keys``: the key count
  F sees (sigmoid's default b = −log n), default S. Raises ValueError where a TPU whole-row kernel
  would not fit in VMEM.
  """
  b, t, n, h = q.shape
  _, s, kh, _ = k.shape
  hv = v.shape[-1]
  be = backend
  rows = not isinstance(weighting, Pointwise)
  q, k, v, bias4 = nonfinite_inputs(q, k, v, bias4)
  if not isinstance(scale, numbers.Real):  # a traced/learned scale: fold it into q
    # A NaN entry of q stays NaN with no path to the scale's gradient (0·NaN there would make
    # it NaN even when the NaN's row attends nothing; attnx.core.contract).
    q32 = q.astype(jnp.float32)
    q = jnp.where(jnp.isnan(q32), q32,
                  finite(q32) * jnp.asarray(scale, jnp.float32)).astype(q.dtype)
    scale = 1.0
  tp = _round_up(t, math.lcm(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv))
  sp = _round_up(s, math.lcm(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv))
  # GPU: head dims padded to a multiple of 16, processed in power-of-2 chunks (head_chunks).
  hp, hvp = ((_round_up(h, GPU_MIN_BLOCK), _round_up(hv, GPU_MIN_BLOCK)) if be == "gpu"
             else (h, hv))
  if rows and be == "gpu":  # the streaming state's value rows: one power-of-2 array
    hvp = _pow2(hv)
  cfg = kernels.KernelConfig(
      w=weighting, backend=be, interpret=bool(interpret), s=s if num_keys is None else num_keys,
      tp=tp, sp=sp, g=n // kh, scale=float(scale), is_causal=bool(is_causal),
      q_bound=q_bound or tp != t, kv_bound=kv_bound or sp != s, bq=blocks.block_q,
      bk=blocks.block_k, bq_dq=blocks.block_q_dq, bk_dq=blocks.block_k_dq,
      bq_dkv=blocks.block_q_dkv, bk_dkv=blocks.block_k_dkv, **launch,
      # 3 stages of f32 tiles (a bias tile too) overflow an A100's 163 KiB of shared memory.
      num_stages=3 if hp <= 128 and q.dtype.itemsize == 2 else 2, num_stages_bwd=2,
      skip_zero_tiles=skip_zero_tiles)
  q = pad_to(q, {1: tp, 3: hp})
  k = pad_to(k, {1: sp, 3: hp})
  v = pad_to(v, {1: sp, 3: hvp})
  # Narrow dtypes on the TPU only for full-height tiles whose rows fill its packed tiling
  # ((16, 128) for bf16, (32, 128) for int8); 32-bit otherwise.
  min_bq = min(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
  if bias4 is not None:
    if bias4.dtype != jnp.bfloat16 or (be == "tpu" and (min_bq % 16 or bias4.shape[2] == 1)):
      bias4 = bias4.astype(jnp.float32)
    bias4 = pad_to(bias4, {2: tp, 3: sp}, keep_one=True)
  if mask4 is not None:
    wide = be == "tpu" and (min_bq % 32 or mask4.shape[2] == 1)
    mask4 = pad_to(mask4.astype(jnp.int32 if wide else jnp.int8), {2: tp, 3: sp}, keep_one=True)
  if rows and be == "tpu":
    need = pallas_rows.tpu_vmem_bytes(cfg, q.dtype, h, hv, bias4, mask4, backward=True)
    if need > pallas_rows.TPU_VMEM_LIMIT:
      raise ValueError(
          f"implementation='pallas' cannot run this: the TPU kernels of {weighting.name!r} "
          f"hold whole sequences in VMEM, ~{need / 2**20:.0f} MiB here (limit "
          f"{pallas_rows.TPU_VMEM_LIMIT / 2**20:.0f} MiB); use implementation='blocked'.")
  return cfg, (q, k, v, bias4, mask4)


def _per_platform(q: Array, k: Array, v: Array, **kwargs: Any) -> Array:
  """:func:`pallas_attention` with the Triton kernels where the program is lowered for a GPU
  and the Mosaic kernels for a TPU. Array arguments travel as operands, the rest (tiles, a
  Python scale, the weighting) is compiled into both branches."""
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if q.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected 4-D [B, T, N, H] inputs, got {q.shape}, {k.shape}, {v.shape}")
  arrays = {n: kwargs[n] for n in ("scale", "bias", "mask", "q_lengths", "kv_lengths", "ssmax_s")
            if kwargs[n] is not None and not isinstance(kwargs[n], numbers.Number)}
  static = {n: x for n, x in kwargs.items() if n not in arrays}

  def kernel(backend: str) -> Callable[..., Array]:
    return lambda q, k, v, arrays: pallas_attention(q, k, v, backend=backend, **static,
                                                    **arrays)

  return platforms.by_platform(
      q, k, v, arrays, gpu=kernel("gpu"), tpu=kernel("tpu"),
      out=jax.ShapeDtypeStruct((*q.shape[:3], v.shape[-1]), q.dtype),
      other=("implementation='pallas' needs a GPU or TPU; this program is being lowered or run "
             "for a platform with neither (the CPU host, unless lowered with "
             "lowering_platforms=('cuda',) or ('tpu',)). Pass interpret=True to run the kernels "
             "in Pallas' interpreter (slow; for testing), or use implementation='blocked' (the "
             "XLA flash-style kernel) on a CPU."))


# --------------------------------------------------------------------------------------------
# Verification: a one-time self-check per combination, which the automatic choice consults.
# --------------------------------------------------------------------------------------------

# The answers of verify_pallas, per (backend, weighting_key, dtype name, head_dim): None when
# the self-check passed, else its reason.
_VERIFIED: dict[tuple[Any, ...], str | None] = {}
# Relative tolerance of the self-check: max |pallas − blocked| / max |blocked| over the output
# and the gradients. Wrong kernels are off by O(1); rounding differences (bf16 probabilities,
# default-precision matmuls on a TPU) stay far below these.
SELF_CHECK_RTOL = {"float32": 2e-2, "bfloat16": 8e-2, "float16": 8e-2}


def _value_key(x: Any, depth: int = 0) -> Any:
  if isinstance(x, (bool, int, float, str, type(None))):
    return x
  if callable(x) and depth < 4 and hasattr(x, "__code__"):
    cells = tuple(_value_key(c.cell_contents, depth + 1) for c in (x.__closure__ or ()))
    return (x.__code__, cells)
  return id(x)


def weighting_key(w: Any) -> tuple[Any, ...]:
  """A hashable identity of a weighting's math: its fields and its F's code and closure (a
  whole-row weighting: its name and streaming parameters).

  Two ``get_weighting("power:p=3")`` calls give equal keys; two different user callables
  (even with the same ``__name__``) give different ones.
  """
  if not isinstance(w, Pointwise):
    return (w.name, w.stream)
  return (w.name, w.normalization, w.exp_alpha, w.denominator_offset, w.distance_kernel,
          _value_key(w.fn))


def clear_verifications() -> None:
  """Forgets every :func:`verify_pallas` answer (for tests, or after changing the kernels)."""
  _VERIFIED.clear()


def self_check(backend: str, weighting: Any, dtype: Any, head_dim: int, *,
               kernel: Callable[..., Array] | None = None, interpret: bool = False,
               seed: int = 0) -> str | None:
  """Compiles and runs the Pallas kernel on a small problem and compares it with the blocked
  kernel: output and gradients w.r.t. q, k, v (B = 1, T = S = 256 → 8 × 8 tiles on a GPU, N = 2
  query heads sharing K = 1 kv head, causal). Returns None if they agree within
  :data:`SELF_CHECK_RTOL`, else a reason; compile/run errors propagate. The default check
  of :func:`verify_pallas`, which runs it eagerly outside any caller's trace.

  ``kernel`` replaces :func:`pallas_attention` (for tests: a kernel made to fail or to be
  wrong). Distance kernels (``w.distance_kernel``) get scores −‖q − k‖² through
  ``Score.to_dot`` (head_dim counts the two extra columns), the others q·k/√H.
  """
  from attnx.core.blocked import blocked_attention  # noqa: PLC0415
  from attnx.core.blocked_rows import blocked_row_attention  # noqa: PLC0415

  kernel = kernel or pallas_attention
  blocked = blocked_attention if isinstance(weighting, Pointwise) else blocked_row_attention
  dtype = jnp.dtype(dtype)
  rng = np.random.default_rng(seed)
  n, t = 2, 64 if interpret else 256
  kw = dict(weighting=weighting, is_causal=True)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  # NumPy outside the compiled programs, so that the check stays eager also when called
  # directly (not through verify_pallas) while a caller's function is traced.
  if getattr(weighting, "distance_kernel", False) and head_dim > 2:
    # Score.to_dot of neg_sq_dist: s = [2q, −‖q‖², −1]·[k, 1, ‖k‖²] = −‖q − k‖².
    xq, xk = normal(1, t, 1, head_dim - 2) * 0.5, normal(1, t, 1, head_dim - 2) * 0.5
    qq, kk = np.sum(xq * xq, -1, keepdims=True), np.sum(xk * xk, -1, keepdims=True)
    q = np.repeat(np.concatenate([2 * xq, -qq, -np.ones_like(qq)], -1), n, axis=2)
    k = np.concatenate([xk, np.ones_like(kk), kk], -1)
    kw["scale"] = 1.0
  else:
    q, k = normal(1, t, n, head_dim), normal(1, t, 1, head_dim)
    kw["scale"] = 1.0 / math.sqrt(head_dim)
  args = [x.astype(dtype) for x in (q, k, normal(1, t, 1, head_dim))]
  ct = normal(1, t, n, head_dim)

  def run(fn):
    def prog(q, k, v):
      loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)
      return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    out, grads = jax.jit(prog).lower(*args).compile()(*args)
    return [np.asarray(x).astype(np.float32) for x in (out, *grads)]

  got = run(lambda q, k, v: kernel(q, k, v, backend=backend, interpret=interpret, **kw))
  want = run(lambda q, k, v: blocked(q, k, v, **kw))
  rtol = SELF_CHECK_RTOL.get(dtype.name, 8e-2)
  for name, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
    ref = float(np.max(np.abs(b))) if b.size else 0.0
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    if not np.isfinite(err) or err > rtol * max(ref, 1e-6):
      return (f"{name} differs from the blocked kernel: max abs error {err:.3g} vs max "
              f"|blocked| {ref:.3g} (tolerance {rtol:g} relative)")
  return None


@dataclasses.dataclass(frozen=True)
class PallasVerification:
  """What :func:`verify_pallas` found for one (backend, weighting, dtype, head size).

  Truthy iff ``ok``.

  Attributes:
    ok: the Pallas kernels compiled, ran and agreed with the blocked kernel (now, or in an
      earlier call: answers are cached per process).
    reason: None when ``ok``, else why not: the combination is not supported (no GPU/TPU,
      dtype, head size: :func:`supported`), a result differs from the blocked kernel, or the
      compile/run error (its type and first line).
    backend: "gpu" or "tpu", or None when no Pallas backend applies.
    weighting: the weighting's name.
    dtype: the dtype's name.
    head_dim: the head size verified.
    checked: whether the answer comes from a self-check (run now or cached); False when the
      combination was rejected before compiling anything.
  """

  ok: bool
  reason: str | None
  backend: str | None
  weighting: str
  dtype: str
  head_dim: int
  checked: bool

  def __bool__(self) -> bool:
    return self.ok


def _run_check(check_fn: Callable[..., str | None], backend: str, weighting: Any, dtype: str,
               head_dim: int) -> str | None:
  """``check_fn``'s reason (None: passed); an exception it raises is a reason too."""
  try:
    # The check builds its own concrete inputs from the static description it gets (never an
    # array of the caller), and ensure_compile_time_eval makes it run eagerly even when
    # verify_pallas is called while the caller's function is traced by jit/grad/vmap: nothing
    # is staged into the caller's program.
    with jax.ensure_compile_time_eval():
      return check_fn(backend, weighting, dtype, head_dim)
  except Exception as e:  # noqa: BLE001 - any compile/run failure means "not verified"
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def verify_pallas(weighting: Any, dtype: Any, head_dim: int, *, backend: str | None = None,
                  value_head_dim: int | None = None,
                  check_fn: Callable[..., str | None] | None = None) -> PallasVerification:
  """Verifies that the Pallas kernels run ``weighting`` correctly on this machine: compiles and
  runs them once on a small problem of their own and compares with the blocked kernel
  (:func:`self_check`: output and gradients).

  The automatic choice (``attnx.core.attention(..., implementation=None)``) uses Pallas on a
  GPU/TPU only for verified combinations, and verifies a new one the first time it meets it.
  Calling this ahead of time moves that compile and run (seconds) out of the first model call
  and shows the answer; a failing combination makes the automatic choice use the blocked
  kernel, with one warning. An explicit ``implementation="pallas"`` never consults it.

  Answers are cached per (backend, weighting, dtype, head_dim) for the process, so the check
  runs at most once per combination (:func:`clear_verifications` forgets them). The check
  sees only this static description, never the caller's arrays, and runs eagerly on concrete
  inputs of its own, also when called while a function is being traced (jit, grad, vmap):
  it adds nothing to the caller's program.

  Args:
    weighting: a weighting name (``"softmax"``, ``"power:p=3"``), object or callable F.
    dtype: the dtype the kernels compute in (the query's, after the score's transform).
    head_dim: the query/key head size the kernels see (a distance score adds 2 columns).
    backend: "gpu"/"tpu" (aliases as :func:`resolve_backend`) or None for the default device;
      a CPU gives ``ok=False`` (the interpreter is for tests, not a backend to choose).
    value_head_dim: the value head size, checked against the backend's limits (the self-check
      itself uses ``head_dim`` for the values).
    check_fn: ``(backend, weighting, dtype_name, head_dim) -> reason | None`` replacing
      :func:`self_check` (tests use it to make a check fail); a raised exception is a reason.

  Returns:
    A :class:`PallasVerification` (truthy iff ``ok``).
  """
  from attnx.core.weightings import get_weighting  # noqa: PLC0415 (weightings imports jax only)

  w = get_weighting(weighting)
  dt = jnp.dtype(dtype).name
  head_dim = int(head_dim)
  result = functools.partial(PallasVerification, weighting=w.name, dtype=dt, head_dim=head_dim)
  try:
    be = resolve_backend(backend)
  except ValueError as e:  # a CPU (backend None) or an unknown name
    return result(ok=False, reason=str(e), backend=None, checked=False)
  reason = supported(w, backend=be, dtype=dt, head_dim=head_dim, value_head_dim=value_head_dim)
  if reason is not None:
    return result(ok=False, reason=reason, backend=be, checked=False)
  key = (be, weighting_key(w), dt, head_dim)
  if key not in _VERIFIED:
    reason = _run_check(check_fn or self_check, be, w, dt, head_dim)
    if reason is not None:
      _LOG.warning("Pallas attention self-check failed for backend=%s, weighting=%s, dtype=%s, "
                   "head_dim=%d: %s. Using implementation='blocked' for this combination.",
                   be, w.name, dt, head_dim, reason)
    _VERIFIED[key] = reason
  reason = _VERIFIED[key]
  return result(ok=reason is None, reason=reason, backend=be, checked=True)


def decline_reason(backend: str | None, weighting: Any, dtype: Any, head_dim: int, *,
                   value_head_dim: int | None = None,
                   check_fn: Callable[..., str | None] | None = None) -> str | None:
  """Why the automatic choice should not use the Pallas kernels for this combination, or None
  when it should (it then runs them instead of the blocked kernel).

  Not on a CPU; whole-row weightings on a GPU only (measured 3–13× the blocked kernel's
  fwd+bwd on an H100; on a TPU their kernels hold whole sequences in VMEM and run on explicit
  request only); otherwise only if :func:`verify_pallas` passes (run with ``check_fn`` the
  first time; one warning if it fails). Arguments as :func:`verify_pallas`.
  """
  try:
    be = resolve_backend(backend)
  except ValueError as e:
    return str(e)
  if not isinstance(weighting, Pointwise) and be != "gpu":
    return (f"the automatic choice runs the whole-row Pallas kernels ({weighting.name!r}) on a "
            "GPU only: on a TPU they hold whole sequences in VMEM (implementation='pallas' runs "
            "them on request)")
  v = verify_pallas(weighting, dtype, head_dim, backend=be, value_head_dim=value_head_dim,
                    check_fn=check_fn)
  if v.ok:
    return None
  return f"the Pallas self-check failed: {v.reason}" if v.checked else v.reason


def choose_pallas(backend: str | None, weighting: Any, dtype: Any, head_dim: int, *,
                  value_head_dim: int | None = None,
                  check_fn: Callable[..., str | None] | None = None) -> bool:
  """Whether ``implementation=None`` uses the Pallas kernels for this combination:
  :func:`decline_reason` is None. Explicit ``implementation="pallas"`` never asks."""
  return decline_reason(backend, weighting, dtype, head_dim, value_head_dim=value_head_dim,
                        check_fn=check_fn) is None
