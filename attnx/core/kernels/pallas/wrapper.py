"""Pallas attention kernels (GPU through Triton, TPU through Mosaic) for every pointwise F and
the whole-row weightings with a streaming family.

    out_i = Σ_j F(s_ij) v_j / N_i,   s_ij = scale · q_i·k_j + bias_ij

The same math, layout and edge-case contract as
:func:`attnx.core.kernels.xla.pointwise.blocked_attention` (:mod:`attnx.core.contract`), written as
fused Pallas kernels: FlashAttention's tiling (Dao et al. 2022, "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness") and FlashAttention-2's work partitioning and
recomputing backward (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning"): the forward saves O and one row statistic (log-sum-exp for online-max weightings,
the normalizer otherwise); the backward (a ``jax.custom_vjp``) recomputes the tiles in a dK/dV
kernel and a dQ kernel. The kernels themselves live in :mod:`.triton` and :mod:`.mosaic` (pointwise
F), :mod:`.triton_rows` and :mod:`.mosaic_rows` (SSMax, softpick, stick-breaking, sparsemax,
α-entmax); their tiles and backends in :mod:`.tiles`.

This module: :func:`pallas_attention` (checks, padding, the custom VJPs, the kernels of each
lowering platform by :func:`.platforms.by_platform`), :func:`kernel_inputs` (the config and
padded operands, shared with the ring's steps in :mod:`.block`) and the per-backend entry
points :func:`forward` / :func:`backward` (pointwise) and :func:`row_forward` /
:func:`row_backward` (whole-row) on padded arrays.

Supported inputs (both backends): every :class:`~attnx.core.weightings.Pointwise` weighting,
GQA (N a multiple of K), T ≠ S, ragged T and S (padded internally), H ≠ Hv, ``is_causal``
(top-left aligned; tiles above the diagonal are skipped), an additive ``bias`` and a boolean
``mask`` of any shape broadcastable to [B, N, T, S] whose dims are each 1 or full, per-batch
``q_lengths``/``kv_lengths`` (tiles beyond the key length are skipped), a structured mask
(:mod:`attnx.core.masks`, evaluated per tile by :mod:`.masking`; tiles outside each tile row's
span skipped), a static float scale (a traced scale is folded into q). dtypes: float32,
bfloat16 and (GPU) float16, with float32 scores, F and accumulators. The bias gradient
materializes dS as [B, N, T, S] float32 before summing over the bias' broadcast dims, and only
when the bias is differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import masks as masks_lib
from attnx.core import residuals as residuals_lib
from attnx.core import score_mods
from attnx.core import streaming as st
from attnx.core.contract import finite, nonfinite_inputs
from attnx.core.kernels.common import round_up, sum_to
from attnx.core.kernels.pallas import (
    masking,
    mosaic,
    mosaic_rows,
    platforms,
    split,
    tiles,
    triton,
    triton_rows,
)
from attnx.core.kernels.pallas.common import KernelConfig, grad_rows, relative_ext, sink_grad
from attnx.core.kernels.pallas.rows import row_scale, sink_grad_rows, streams
from attnx.core.weightings import Pointwise

Array = jax.Array
F32 = jnp.float32

__all__ = ["backward", "forward", "kernel_inputs", "pad_to", "pallas_attention", "row_backward",
           "row_forward"]


# --------------------------------------------------------------------------------------------
# Entry points on padded arrays: [B, Tp, N, H] in, [B, Tp, N, Hv] out, either backend.
# --------------------------------------------------------------------------------------------

def forward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len,
            out_dtype: Any = None, smask: Any = None,
            sinks: Array | None = None, slopes: Array | None = None) -> tuple[Array, Array]:
  """O [B, Tp, N, Hv] (``out_dtype``, default q's) and the row statistic [B, N, Tp] (float32)
  of a pointwise F.

  ``bias``/``mask``: [Bb, Nb, Tb, Sb] with every dim 1 or full (mask as int8/int32).
  ``out_dtype`` float32 keeps O as accumulated (ring attention merges the O of key blocks).
  ``smask``: a structured mask's operands (:func:`.masking.prepare`) when ``cfg.smask``.
  ``sinks``: the attention sinks [N] when ``cfg.sinks``; the statistic then counts them.
  ``slopes``: the score modification's operand when ``cfg.mod_operand``: ALiBi's slopes [N]
  (``cfg.alibi``) or a relative table's ext [N, Lx] (``cfg.relative``,
  :func:`.common.relative_ext`).
  """
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if cfg.kv_splits > 1:
    return split.forward(cfg, forward, q, k, v, bias, mask, q_len, kv_len, out_dtype, sinks)
  kernels = triton if cfg.backend == "gpu" else mosaic
  return kernels.forward(cfg, q, k, v, bias, mask, q_len, kv_len, out_dtype, smask, sinks,
                         slopes)


def backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows,
             want_ds: bool, smask: Any = None, slopes: Array | None = None) -> tuple:
  """dq, dk, dv (input dtypes) and, when ``want_ds``, dS [B, N, Tp, Sp] float32; with
  ``cfg.mod_operand`` a fifth value, the gradient of ``slopes`` float32 (d slopes [N] with
  ``cfg.alibi``, d ext [N, Lx] with ``cfg.relative``).

  ``rows``: the three per-row values (r0, r1, δ), each [B, N, Tp] float32, of
  :func:`.common.grad_rows`.
  """
  kernels = triton if cfg.backend == "gpu" else mosaic
  return kernels.backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, want_ds, smask,
                          slopes)


def row_forward(cfg: KernelConfig, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype=None,
                smask: Any = None, slopes: Array | None = None, sinks: Array | None = None):
  """(O [B, Tp, N, Hv], row statistics (each [B, N, Tp] float32), Σu·v/Σu [B, Tp, N, Hv]
  float32 or None) of a whole-row weighting; ``rowc`` SSMax's [B, N, Tp] c or None;
  ``slopes`` ALiBi's [N] or a relative table's ext [N, Lx] when ``cfg.mod_operand``;
  ``sinks`` [N] when ``cfg.sinks`` (the statistics then count them)."""
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if cfg.kv_splits > 1:
    return split.row_forward(cfg, row_forward, q, k, v, rowc, bias, mask, q_len, kv_len,
                             out_dtype, sinks)
  kernels = triton_rows if cfg.backend == "gpu" else mosaic_rows
  return kernels.forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, out_dtype, smask,
                         slopes, sinks=sinks)


def row_backward(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc,
                 want_ds: bool, smask: Any = None, slopes: Array | None = None):
  """(dq, dk, dv, dS [B, N, Tp, Sp] or None, dc [B, N, Tp] or None) of a whole-row
  weighting, and with ``cfg.mod_operand`` the gradient of ``slopes`` (d slopes [N] or d ext
  [N, Lx]) float32. ``rows``: the row
  statistics and δ (each [B, N, Tp] float32)."""
  kernels = triton_rows if cfg.backend == "gpu" else mosaic_rows
  return kernels.backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows, rowc, want_ds,
                          smask, slopes)


# --------------------------------------------------------------------------------------------
# The custom VJPs.
# --------------------------------------------------------------------------------------------

def _values(tree: Any) -> Any:
  """The values of a pytree of ``CustomVJPPrimal`` (symbolic_zeros' forward arguments)."""
  return jax.tree.map(lambda p: p.value, tree,
                      is_leaf=lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal))


def log_normalizer(cfg: KernelConfig, stat: Array) -> Array:
  """The rows' log normalizer [B, N, Tp] in natural units (the residual of
  :mod:`attnx.core.residuals`) from a pointwise kernel's row statistic: the online max's
  log2-sum-exp (:data:`.common.ROW_OPS`) times ln 2, −∞ where a row has no weight (+∞);
  log l, log n; 0 for ``"none"``."""
  w = cfg.w
  if w.online_max:
    return jnp.where(stat == jnp.inf, -jnp.inf, stat * math.log(2.0))
  if w.unnormalized:
    return jnp.zeros_like(stat)
  return jnp.log(stat)


def _split_ct(ct: Any, residual: bool) -> tuple[Any, Any]:
  """(dO, d residual) of a kernel's cotangent; a symbolic zero dO becomes zeros where the
  residual has a cotangent (the backward still runs for it)."""
  if not residual:
    return ct, None
  do, dres = ct
  zero = lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero)
  leaves = dres if isinstance(dres, tuple) else (dres,)
  if all(zero(x) for x in leaves):
    return do, None
  leaves = tuple(jnp.zeros(x.shape, x.dtype) if zero(x) else x for x in leaves)
  if zero(do):
    do = jnp.zeros(do.shape, do.dtype)
  return do, leaves if isinstance(dres, tuple) else leaves[0]


@functools.lru_cache(maxsize=512)
def _make_kernel(cfg: KernelConfig, residual: bool = False) -> Callable[..., Array]:
  """A custom-VJP function (q, k, v, bias, mask, q_len, kv_len, smask, sinks[, mod]) -> O
  of padded arrays (``smask``: a structured mask's operands, or None; ``sinks``: [N] when
  ``cfg.sinks``, else None; ``mod``: the score modification's operand when
  ``cfg.mod_operand``, ALiBi's slopes [N] or a relative table's ext [N, Lx]). d sinks is
  computed here, outside the kernels, from the saved row statistic and δ
  (:func:`.common.sink_grad`); d slopes from the dQ kernel's per-row sums, d ext from its
  per-tile sums. ``residual``: it returns (O, :func:`log_normalizer` [B, N, Tp]) and takes
  the latter's cotangent, folded into δ (d lse/dz is the −δ term's factor)."""
  if cfg.mod_operand:
    return _make_mod_kernel(cfg, residual)

  @jax.custom_vjp
  def attn(q, k, v, bias, mask, q_len, kv_len, smask, sinks):
    o, stat = forward(cfg, q, k, v, bias, mask, q_len, kv_len, smask=smask, sinks=sinks)
    return (o, log_normalizer(cfg, stat)) if residual else o

  def fwd(q, k, v, bias, mask, q_len, kv_len, smask, sinks):
    # symbolic_zeros: each array arrives as CustomVJPPrimal(value, perturbed); dS is only
    # materialized when the bias is differentiated.
    want_ds = bias is not None and bias.perturbed
    vals = [None if x is None else x.value for x in (q, k, v, bias, mask, q_len, kv_len)]
    smask = _values(smask)
    sinks = None if sinks is None else sinks.value
    o, stat = forward(cfg, *vals, smask=smask, sinks=sinks)
    marker = jnp.zeros((), jnp.float32) if want_ds else None
    out = (o, log_normalizer(cfg, stat)) if residual else o
    return out, (*vals, smask, sinks, o, stat, marker)

  def bwd(res, ct):
    q, k, v, bias, mask, q_len, kv_len, smask, sinks, o, stat, marker = res
    do, dres = _split_ct(ct, residual)
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
      return (None,) * 9
    rows = _fold_residual(cfg, grad_rows(cfg, stat, o, do), dres)
    dq, dk, dv, ds = backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows,
                              want_ds=marker is not None, smask=smask)
    dbias = None if ds is None else sum_to(ds, bias.shape).astype(bias.dtype)
    dsinks = sink_grad(cfg, sinks, rows) if cfg.sinks else None
    return dq, dk, dv, dbias, None, None, None, None, dsinks

  attn.defvjp(fwd, bwd, symbolic_zeros=True)
  return attn


def _fold_residual(cfg: KernelConfig, rows: list[Array], dres: Array | None) -> list[Array]:
  """The backward's row values (r0, r1, δ) with the log normalizer's cotangent ``dres``
  folded into δ (δ − dres) where the normalizer depends on the scores (a sum of F)."""
  sign = 0.0 if dres is None else residuals_lib.cotangent_sign(cfg.w)
  if not sign:
    return rows
  return [rows[0], rows[1], rows[2] + sign * dres.astype(rows[2].dtype)]


def _make_mod_kernel(cfg: KernelConfig, residual: bool = False) -> Callable[..., Array]:
  """:func:`_make_kernel`'s function with the score modification's operand (ALiBi's slopes
  [N], a relative table's ext [N, Lx]) as its last argument (a separate custom VJP, so that
  the programs without one keep theirs op for op)."""

  @jax.custom_vjp
  def attn(q, k, v, bias, mask, q_len, kv_len, smask, sinks, mod):
    o, stat = forward(cfg, q, k, v, bias, mask, q_len, kv_len, smask=smask, sinks=sinks,
                      slopes=mod)
    return (o, log_normalizer(cfg, stat)) if residual else o

  def fwd(q, k, v, bias, mask, q_len, kv_len, smask, sinks, mod):
    want_ds = bias is not None and bias.perturbed
    vals = [None if x is None else x.value for x in (q, k, v, bias, mask, q_len, kv_len)]
    smask = _values(smask)
    sinks = None if sinks is None else sinks.value
    mod = mod.value
    o, stat = forward(cfg, *vals, smask=smask, sinks=sinks, slopes=mod)
    marker = jnp.zeros((), jnp.float32) if want_ds else None
    out = (o, log_normalizer(cfg, stat)) if residual else o
    return out, (*vals, smask, sinks, mod, o, stat, marker)

  def bwd(res, ct):
    q, k, v, bias, mask, q_len, kv_len, smask, sinks, mod, o, stat, marker = res
    do, dres = _split_ct(ct, residual)
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
      return (None,) * 10
    rows = _fold_residual(cfg, grad_rows(cfg, stat, o, do), dres)
    dq, dk, dv, ds, dmod = backward(cfg, q, k, v, bias, mask, q_len, kv_len, do, rows,
                                    want_ds=marker is not None, smask=smask, slopes=mod)
    dbias = None if ds is None else sum_to(ds, bias.shape).astype(bias.dtype)
    dsinks = sink_grad(cfg, sinks, rows) if cfg.sinks else None
    return (dq, dk, dv, dbias, None, None, None, None, dsinks, dmod.astype(mod.dtype))

  attn.defvjp(fwd, bwd, symbolic_zeros=True)
  return attn


@functools.lru_cache(maxsize=512)
def _make_row_kernel(cfg: KernelConfig, residual: bool = False):
  """A custom-VJP function (q, k, v, bias, mask, q_len, kv_len, rowc, smask, slopes, sinks) -> O
  of padded arrays (rowc: SSMax's per-row scale [B, N, Tp], None for the other families; smask:
  a structured mask's operands, or None; slopes: the score modification's operand when
  ``cfg.mod_operand`` (ALiBi's slopes [N], d slopes from the dQ kernel's per-row sums; a
  relative table's ext [N, Lx], d ext from the dQ kernel), else None; sinks: [N] when
  ``cfg.sinks``, else None, d sinks and the sink's term of SSMax's dc computed here, outside
  the kernels, from the saved row statistics and δ: :func:`.rows.sink_grad_rows`).
  ``residual``: it returns (O, the family's row statistics, each [B, N, Tp]: the log
  normalizer, stick-breaking's log survival, entmax's (m, τ, Σp)) and folds their cotangent
  into δ (:func:`attnx.core.streaming.residual_delta`; entmax's needs Σu per row, which the
  forward then writes too: ``cfg.keep_u_sum``)."""
  rs = cfg.w.stream
  n = rs.num_stats
  if residual and rs.needs_threshold and not cfg.keep_u_sum:
    raise ValueError("a sparsemax/entmax residual needs cfg.keep_u_sum")
  if rs.suffix_carries and cfg.bk_dq != cfg.bk_dkv:
    raise ValueError(f"stick-breaking's dQ and dK/dV key tiles must agree (its carries are "
                     f"per key tile), got {cfg.bk_dq} and {cfg.bk_dkv}")

  @jax.custom_vjp
  def attn(q, k, v, bias, mask, q_len, kv_len, rowc, smask, slopes, sinks):
    o, stats, _ = row_forward(cfg, q, k, v, rowc, bias, mask, q_len, kv_len, smask=smask,
                              slopes=slopes, sinks=sinks)
    return (o, tuple(stats[:n])) if residual else o

  def fwd(q, k, v, bias, mask, q_len, kv_len, rowc, smask, slopes, sinks):
    want_ds = bias is not None and bias.perturbed
    vals = [None if x is None else x.value for x in (q, k, v, bias, mask, q_len, kv_len, rowc)]
    q_, k_, v_, bias_, mask_, ql, kl, rowc_ = vals
    smask = _values(smask)
    slopes = None if slopes is None else slopes.value
    sinks = None if sinks is None else sinks.value
    # O in float32 for δ = dO·O (the backward's row sums), q's dtype for the caller.
    o, stats, smean = row_forward(cfg, q_, k_, v_, rowc_, bias_, mask_, ql, kl, out_dtype=F32,
                                  smask=smask, slopes=slopes, sinks=sinks)
    marker = jnp.zeros((), F32) if want_ds else None
    out = (o.astype(q_.dtype), tuple(stats[:n])) if residual else o.astype(q_.dtype)
    return out, (*vals, smask, slopes, sinks, o, stats, smean, marker)

  def bwd(res, ct):
    q, k, v, bias, mask, q_len, kv_len, rowc, smask, slopes, sinks, o, stats, smean, marker = res
    do, dres = _split_ct(ct, residual)
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
      return (None,) * 11
    ref = smean if rs.saves_support_mean else o
    delta = jnp.sum(do.astype(F32) * ref, axis=-1).transpose(0, 2, 1)
    if dres is not None:
      delta = delta + st.residual_delta(rs, tuple(stats[:n]), tuple(x.astype(F32) for x in dres),
                                        stats[n] if len(stats) > n else None)
    stats = stats[:n]
    dq, dk, dv, ds, dc, *dslopes = row_backward(
        cfg, q, k, v, bias, mask, q_len, kv_len, do, (*stats, delta), rowc,
        want_ds=marker is not None, smask=smask, slopes=slopes)
    dbias = None if ds is None else sum_to(ds, bias.shape).astype(bias.dtype)
    dslopes = dslopes[0].astype(slopes.dtype) if cfg.mod_operand else None
    dsinks = None
    if cfg.sinks:  # outside the kernels: the sink's dz, and its term of SSMax's dc
      dsinks, dc_sink = sink_grad_rows(cfg, sinks, stats, delta, rowc)
      dsinks = dsinks.astype(sinks.dtype)
      if dc_sink is not None:
        dc = dc + dc_sink
    return dq, dk, dv, dbias, None, None, None, dc, None, dslopes, dsinks

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
                     skip_zero_tiles: bool = True, structured_mask: Any = None,
                     score_mod: Any = None, sinks: Array | None = None,
                     return_residual: bool = False,
                     num_splits: int = 1) -> Array | tuple[Array, Array]:
  """Fused attention out_i = Σ_j w_ij v_j for a pointwise weighting F, or a whole-row weighting
  with a streaming family (SSMax, softpick, stick-breaking, sparsemax, entmax: the kernels of
  :mod:`attnx.core.kernels.pallas.rows`), as Pallas kernels.

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
      a TPU (:func:`.platforms.by_platform`), so that a CPU host can lower, export
      or compile it for either, or for both at once. Lowering it for a CPU raises ValueError.
    interpret: run the kernels in Pallas' interpreter (any machine, slow; for testing); with
      ``backend=None`` they are the kernels of the host's kind of device (GPU on a CPU).
    ssmax_s: SSMax only: s as a scalar or one value per query head [N] (an array gets a
      gradient); default the weighting's own s.
    skip_zero_tiles: sparsemax/entmax only: in the output pass and the backward, a key tile
      whose scores show every weight of the query tile to be zero (all x ≤ τ) adds nothing and
      its remaining work (powers, P·V; dP, dS·K, Pᵀ·dO, dSᵀ·Q) is left out (AdaSplash's block
      skipping; the scores are computed to find out). The skipped tiles add exact zeros: the
      result is the same bit for bit as where no tile is skipped (up to how the compiler rounds
      a loop with and without the branch); False computes every tile (for side-by-side
      timings). The threshold passes compute
      every tile: these kernels keep no table of tile maxima across passes.
    structured_mask: a structured mask (:mod:`attnx.core.masks`) bound to the flat batch
      (:meth:`~attnx.core.masks.Mask.bind` with batch ``(B,)``), and-ed with ``mask``: every
      kernel loops only over the tiles some pair of it may attend and evaluates it per tile
      from its arrays (:mod:`.masking`), never as a T×S array. A ``from_fn`` mask whose
      ``mask_mod`` closes over arrays is materialized into ``mask`` instead.
    score_mod: a :class:`~attnx.core.score_mods.ScoreMod` (any F) with a soft cap
      (each tile's raw score scale·q·k becomes c·tanh(scale·q·k / c) before the bias,
      :func:`.common.tile_scores`) and/or ALiBi (:func:`attnx.core.score_mods.alibi`: its
      ``linear_bias`` declaration, slopes [N] as ``params``; s − m_h·(i − j) or
      − m_h·abs(i − j) after the bias, global positions; the slopes get a gradient) or a
      relative-position table (:func:`attnx.core.score_mods.relative_table`: its ``relative``
      declaration, the table [N, L] as ``params``; s + table[h, clip(i − j) + (L − 1)/2]
      after the bias, read per tile from the table extended to every distance,
      :func:`.common.relative_ext`; the table gets a gradient). Any other ``score_mod``
      function (a user's) is a ValueError: the kernels evaluate no user code per tile.
    sinks: attention sinks [N] (a pointwise F with a sum of weights, or a whole-row F but
      stick-breaking): each row of query head h also sees a virtual key of score
      ``sinks[h]`` and zero value, folded into the row's starting state (whole-row: and its
      threshold passes; SSMax's n_i counts it); gets a gradient (computed outside the
      kernels).
    return_residual: also return the rows' residual [B, T, N] float32
      (:mod:`attnx.core.residuals`: the log normalizer, stick-breaking's log survival,
      entmax's threshold and weight total), with a gradient (entmax: the forward then also
      writes Σu per row, which the threshold's gradient needs).
    num_splits: split-KV (flash-decoding, :mod:`.split`): the forward cuts the keys into about
      this many chunks (the divisor of its key tiles nearest it) that run side by side as a
      batch axis and merge after; 1 (default): one pass over every key per program. For few
      query rows against many keys. Causality, a structured mask, ALiBi and a relative table
      then enter as a dense [B|1, N|1, T, S] mask and bias (O(T·S) per head). Sparsemax and
      entmax cannot be split (ValueError).

  Returns:
    [B, T, N, Hv] in q's dtype (with ``return_residual``: and the residual), equal up to float
    rounding to ``blocked_attention(q, k, v, weighting=..., ...)`` (float32 accumulation).

  Raises:
    ValueError: for an unsupported combination (see :func:`tiles.supported`; the message names the
      alternative implementation), bad shapes or tile sizes.
  """
  cap = _soft_cap(weighting, score_mod, sinks)
  alibi = None if score_mod is None else score_mod.linear_bias
  relative = score_mod is not None and score_mod.relative
  rows = not isinstance(weighting, Pointwise)
  if backend is None and not interpret:
    return _per_platform(
        q, k, v, weighting=weighting, scale=scale, bias=bias, mask=mask, is_causal=is_causal,
        q_lengths=q_lengths, kv_lengths=kv_lengths, block_q=block_q, block_k=block_k,
        ssmax_s=ssmax_s, skip_zero_tiles=skip_zero_tiles, structured_mask=structured_mask,
        score_mod=score_mod, sinks=sinks, return_residual=return_residual,
        num_splits=num_splits)
  if not isinstance(skip_zero_tiles, bool):
    raise ValueError(f"skip_zero_tiles must be a bool, got {skip_zero_tiles!r}")
  if rows and not streams(weighting):
    raise ValueError(f"implementation='pallas' cannot run this: {tiles.supported(weighting)}.")
  if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
    raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
  if num_splits > 1 and split.reason(weighting):
    raise ValueError(f"num_splits={num_splits}: {split.reason(weighting)}.")
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
  be = tiles.resolve_backend(backend, interpret)
  reason = tiles.supported(weighting, backend=be, dtype=q.dtype, head_dim=h, value_head_dim=hv,
                     interpret=interpret)
  if reason:
    raise ValueError(f"implementation='pallas' cannot run this: {reason}.")
  if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean, got {jnp.asarray(mask).dtype}")
  if structured_mask is not None:
    if not isinstance(structured_mask, masks_lib.Mask):
      raise ValueError(f"structured_mask must be an attnx.core.masks.Mask, got "
                       f"{type(structured_mask).__name__}")
    if masking.kernel_reason(structured_mask) is not None:  # evaluated densely instead
      mask = masks_lib.combine(mask, structured_mask, (b,), n, t, s)
      structured_mask = None
  blocks, launch = tiles.kernel_tiles(be, weighting, t, s, h, hv, q.dtype, block_q, block_k,
                                      causal=is_causal, group=n // kh)
  bias4 = _as_4d(bias, (b, n, t, s), "bias")
  mask4 = _as_4d(mask, (b, n, t, s), "mask")
  q_len = _lengths(q_lengths, b, t, "q_lengths")
  kv_len = _lengths(kv_lengths, b, s, "kv_lengths")
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (n,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(f"sinks must be a float array [N] = [{n}], got shape {sinks.shape} "
                       f"and dtype {sinks.dtype}")
  slopes = None
  if relative:
    table = jnp.asarray(score_mod.params)
    if (table.ndim != 2 or table.shape[0] != n or table.shape[1] % 2 == 0
        or not jnp.issubdtype(table.dtype, jnp.floating)):
      raise ValueError(f"a relative table must be a float array [N, L] = [{n}, L] with L odd, "
                       f"got shape {table.shape} and dtype {table.dtype}")
  if alibi is not None:
    slopes = jnp.asarray(score_mod.params)
    if slopes.shape != (n,) or not jnp.issubdtype(slopes.dtype, jnp.floating):
      raise ValueError(f"ALiBi's slopes must be a float array [N] = [{n}], got shape "
                       f"{slopes.shape} and dtype {slopes.dtype}")
  if q.size == 0 or s == 0:  # no query, or no key (every row has no valid key)
    out = jnp.zeros((b, t, n, hv), q.dtype)
    return (out, residuals_lib.empty_residual(weighting, (b, t, n))) if return_residual else out
  splits = 1
  if num_splits > 1:
    sp = round_up(s, math.lcm(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv))
    splits = split.split_count(sp // blocks.block_k, num_splits)
  if splits > 1:  # a chunk's kernel sees its own key positions: make positions dense first
    bias, mask = split.dense_positions((b, t, n, h), s, bias=bias4, mask=mask4,
                                       is_causal=is_causal, structured_mask=structured_mask,
                                       score_mod=score_mod)
    bias4, mask4 = _as_4d(bias, (b, n, t, s), "bias"), _as_4d(mask, (b, n, t, s), "mask")
    is_causal, structured_mask, alibi, relative, slopes = False, None, None, False, None

  rowc = None
  if rows and weighting.stream.needs_row_scale:  # SSMax's c_i = s·log n_i, from the raw masks
    rowc = row_scale(weighting.stream, b, n, t, s, bias4, mask4, is_causal,
                     None if kv_lengths is None else kv_len, ssmax_s,
                     structured=structured_mask, kv_heads=kh,
                     tiles=(blocks.block_q, blocks.block_k),
                     extra_keys=int(sinks is not None))
  cfg, (q, k, v, bias4, mask4) = kernel_inputs(
      q, k, v, bias4, mask4, weighting=weighting, scale=scale, backend=be, interpret=interpret,
      blocks=blocks, launch=launch, is_causal=is_causal, q_bound=q_lengths is not None,
      kv_bound=kv_lengths is not None, skip_zero_tiles=skip_zero_tiles)
  if return_residual and rows and weighting.stream.needs_threshold:
    cfg = dataclasses.replace(cfg, keep_u_sum=True)  # entmax's residual gradient needs Σu
  if cap is not None or sinks is not None or alibi is not None:
    # tiles of the plain kernels otherwise, op for op
    cfg = dataclasses.replace(cfg, cap=cap, sinks=sinks is not None, alibi=alibi)
  if relative:  # the table extended to every distance (its gradient folds back by autodiff)
    slopes, off = relative_ext(table, t, s)
    cfg = dataclasses.replace(cfg, relative=True, rel_offset=off)
  if splits > 1:
    cfg = dataclasses.replace(cfg, kv_splits=splits)
  smask = None
  if structured_mask is not None:
    plan, smask = masking.prepare(
        structured_mask, {"fwd": (cfg.bq, cfg.bk), "dq": (cfg.bq_dq, cfg.bk_dq),
                          "dkv": (cfg.bq_dkv, cfg.bk_dkv)}, cfg.tp, cfg.sp, t, s)
    cfg = dataclasses.replace(cfg, smask=plan)
    if rows and be == "tpu":
      _check_vmem(cfg, weighting, q.dtype, h, hv, bias4, mask4)
  if rows:
    if rowc is not None:
      rowc = pad_to(rowc, {2: cfg.tp})
    out = _make_row_kernel(cfg, return_residual)(q, k, v, bias4, mask4, q_len, kv_len, rowc,
                                                 smask, slopes, sinks)
  else:
    extra = () if slopes is None else (slopes,)
    out = _make_kernel(cfg, return_residual)(q, k, v, bias4, mask4, q_len, kv_len, smask, sinks,
                                             *extra)
  if not return_residual:
    return out[:, :t, :, :hv]
  out, stats = out
  if not rows:  # a pointwise F's statistic is its log normalizer already
    return out[:, :t, :, :hv], stats[:, :, :t].transpose(0, 2, 1)
  stats = tuple(x[:, :, :t].transpose(0, 2, 1) for x in stats)
  return out[:, :t, :, :hv], residuals_lib.from_stats(weighting, stats)


def _soft_cap(weighting: Any, score_mod: Any, sinks: Any) -> float | None:
  """The soft cap c of ``score_mod`` (None without one), after the checks of what the kernels
  run: a ScoreMod with a cap and/or ALiBi's declared linear bias or a declared relative table
  (any F), and sinks for a
  pointwise F with a sum of weights or a whole-row F but stick-breaking. ValueError
  otherwise, naming what is not supported."""
  if score_mod is None and sinks is None:
    return None
  if not isinstance(weighting, Pointwise) and sinks is not None:
    if getattr(getattr(weighting, "stream", None), "reverse", False):
      raise ValueError(f"implementation='pallas': {weighting.name!r} takes no attention sinks "
                       f"(a stick-breaking row has no key outside its sequence).")
  elif sinks is not None and not weighting.divides_by_sum:
    raise ValueError(f"implementation='pallas': sinks need a weighting with a sum of weights "
                     f"to enter, and {weighting.name!r} divides by none.")
  if score_mod is None:
    return None
  if not isinstance(score_mod, score_mods.ScoreMod):
    raise ValueError(f"score_mod must be an attnx.core.score_mods.ScoreMod, got "
                     f"{type(score_mod).__name__}")
  if score_mods.kind(score_mod) == "fn":
    raise ValueError("implementation='pallas' cannot run this: its kernels apply a "
                     "logits_soft_cap, ALiBi (core.alibi) and a relative-position table "
                     "(core.relative_table) but no other score_mod function (a user's fn: "
                     "the kernels evaluate no user code per tile); use "
                     "implementation='blocked'.")
  return score_mod.cap


def kernel_inputs(q: Array, k: Array, v: Array, bias4: Array | None, mask4: Array | None, *,
                  weighting: Any, scale: float | Array, backend: str, interpret: bool,
                  blocks: tiles.BlockSizes, launch: tiles.GpuTiles | None, is_causal: bool,
                  q_bound: bool, kv_bound: bool, skip_zero_tiles: bool = True,
                  num_keys: int | None = None) -> tuple[KernelConfig, tuple[Array | None, ...]]:
  """The kernels' config and padded operands (q, k, v, bias, mask) of a checked, non-empty
  problem: q [B, T, N, H], k/v [B, S, K, H|Hv], bias/mask [B|1, N|1, T|1, S|1] (each dim 1 or
  full; the mask boolean), tiles and GPU launches from :func:`.tiles.kernel_tiles`.

  Shared by :func:`pallas_attention` and the per-block entry points of ring attention
  (:mod:`.block`). Applies the contract's input step (:func:`nonfinite_inputs`),
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
  tp = round_up(t, math.lcm(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv))
  sp = round_up(s, math.lcm(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv))
  # GPU: head dims padded to a multiple of 16, processed in power-of-2 chunks (head_chunks).
  hp, hvp = ((round_up(h, tiles.GPU_MIN_BLOCK), round_up(hv, tiles.GPU_MIN_BLOCK)) if be == "gpu"
             else (h, hv))
  if rows and be == "gpu":  # the streaming state's value rows: one power-of-2 array
    hvp = tiles.pow2(hv)
  gpu = {} if launch is None else dict(
      num_warps=launch.fwd.warps, num_warps_dq=launch.dq.warps, num_warps_bwd=launch.dkv.warps,
      two_pass_dkv=launch.dkv.two_pass_dkv)
  cfg = KernelConfig(
      w=weighting, backend=be, interpret=bool(interpret), s=s if num_keys is None else num_keys,
      tp=tp, sp=sp, g=n // kh, scale=float(scale), is_causal=bool(is_causal),
      q_bound=q_bound or tp != t, kv_bound=kv_bound or sp != s, bq=blocks.block_q,
      bk=blocks.block_k, bq_dq=blocks.block_q_dq, bk_dq=blocks.block_k_dq,
      bq_dkv=blocks.block_q_dkv, bk_dkv=blocks.block_k_dkv, **gpu,
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
    _check_vmem(cfg, weighting, q.dtype, h, hv, bias4, mask4)
  return cfg, (q, k, v, bias4, mask4)


def _check_vmem(cfg: KernelConfig, weighting: Any, dtype: Any, h: int, hv: int,
                bias4: Array | None, mask4: Array | None) -> None:
  """ValueError where a TPU whole-row kernel would not fit in VMEM."""
  need = mosaic_rows.vmem_bytes(cfg, dtype, h, hv, bias4, mask4, backward=True)
  if need > mosaic_rows.VMEM_LIMIT:
    raise ValueError(
        f"implementation='pallas' cannot run this: the TPU kernels of {weighting.name!r} "
        f"hold whole sequences in VMEM, ~{need / 2**20:.0f} MiB here (limit "
        f"{mosaic_rows.VMEM_LIMIT / 2**20:.0f} MiB); use implementation='blocked'.")


def _per_platform(q: Array, k: Array, v: Array, **kwargs: Any) -> Array:
  """:func:`pallas_attention` with the Triton kernels where the program is lowered for a GPU
  and the Mosaic kernels for a TPU. Array arguments travel as operands, the rest (tiles, a
  Python scale, the weighting) is compiled into both branches."""
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if q.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected 4-D [B, T, N, H] inputs, got {q.shape}, {k.shape}, {v.shape}")
  arrays = {n: kwargs[n] for n in ("scale", "bias", "mask", "q_lengths", "kv_lengths", "ssmax_s",
                                   "structured_mask", "sinks")
            if kwargs[n] is not None and not isinstance(kwargs[n], numbers.Number)}
  mod = kwargs.get("score_mod")
  if mod is not None and mod.params is not None:  # ALiBi's slopes travel as operands too
    arrays["score_mod"] = mod
  static = {n: x for n, x in kwargs.items() if n not in arrays}

  residual = static.get("return_residual", False)

  def kernel(backend: str) -> Callable[..., Array]:
    def run(q, k, v, arrays):
      out = pallas_attention(q, k, v, backend=backend, **static, **arrays)
      if residual:  # one array leaves by_platform: the residual's arrays as last columns
        out, res = out
        out = jnp.concatenate([out.astype(F32)] + [x[..., None].astype(F32)
                                                   for x in jax.tree.leaves(res)], axis=-1)
      return out
    return run

  hv = v.shape[-1]
  w = static["weighting"]
  extra = 0
  if residual:
    extra = len(jax.tree.leaves(residuals_lib.empty_residual(w, (1,))))
  out = platforms.by_platform(
      q, k, v, arrays, gpu=kernel("gpu"), tpu=kernel("tpu"),
      out=jax.ShapeDtypeStruct((*q.shape[:3], hv + extra), F32 if residual else q.dtype),
      other=("implementation='pallas' needs a GPU or TPU; this program is being lowered or run "
             "for a platform with neither (the CPU host, unless lowered with "
             "lowering_platforms=('cuda',) or ('tpu',)). Use implementation="
             "core.Pallas(interpret=True) (here: interpret=True) to run the kernels in Pallas' "
             "interpreter (slow; for testing), or implementation='blocked' (the XLA "
             "flash-style kernel) on a CPU."))
  if not residual:
    return out
  tree = jax.tree.structure(residuals_lib.empty_residual(w, (1,)))
  return out[..., :hv].astype(q.dtype), jax.tree.unflatten(
      tree, [out[..., hv + i] for i in range(extra)])
