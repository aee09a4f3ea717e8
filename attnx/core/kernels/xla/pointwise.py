"""Flash-style blocked attention with O(T) memory for every pointwise weighting F.

    out_i = Σ_j F(s_ij) v_j / N_i,   s_ij = scale · q_i·k_j + bias_ij

Keys are streamed tile by tile (Dao et al. 2022, "FlashAttention", arXiv 2205.14135; Rabe &
Staats 2021, "Self-attention does not need O(n²) memory", arXiv 2112.05682), so the T×S score
matrix never exists. Two streaming rules cover every :class:`~attnx.core.weightings.Pointwise`:

* softmax-like F = exp(α s) with ``normalization="sum"`` (``w.online_max``): the online softmax
  (Milakov & Gimelshein 2018, arXiv 1805.02867) with a running row maximum m and denominator l;
  ``denominator_offset`` c (quiet softmax, Evan Miller 2023) is a virtual key of score 0, so
  m starts at 0 and l at c. A sum-normalized F > 0 with a logarithm (``w.log_f``: sigmoid)
  streams the same way on z = log F(s), which does not underflow where F does.
* any other F: acc += F(S)·V and l += rowsum(F(S)) (``"sum"``), l = number of valid keys
  (``"length"``, Wortsman et al. 2023) or l = 1 (``"none"``, Ramapuram et al. 2024); one
  division at the end. No rescaling is needed because nothing is shifted.

For ``"sum"`` the row sums ride along in the F·V matmul as a column of ones appended to V,
which saves one pass over every tile.

The backward pass is a ``jax.custom_vjp`` that recomputes the tiles (FlashAttention-2, Dao 2023,
arXiv 2307.08691): only the output, one row statistic and the inputs are saved. With
D_i = dO_i·O_i and dP_ij = dO_i·v_j:

* online max: P = exp((α s − hi) − lo), dS = α P ∘ (dP − D), with lse = hi + lo saved as two
  floats (one float32 lse ≈ 20 would be off by up to 2⁻²⁰ relative in every weight); under a
  log F, P = exp((log F(s) − hi) − lo) and dS = P ∘ (dP − D) ∘ (log F)'(s);
* ``"sum"``: dS = F'(s) ∘ (dP − D) / l;  ``"length"``: dS = F'(s) ∘ dP / n;  ``"none"``:
  dS = F'(s) ∘ dP.

Everything is computed in max(float32, the input dtype): float64 inputs (``jax_enable_x64``) in
float64 (:func:`attnx.core.contract.compute_dtype`). The backward recomputes each tile as the
forward computed it (the same score function on the same [queries × keys] tile).

Masked keys contribute exactly nothing, and a row without any valid key (or where every F is
0) gets a zero output with finite, zero gradients, matching
:func:`attnx.core.weightings.pointwise_weights`; NaN/Inf inputs follow the contract of
:mod:`attnx.core.contract`, like the dense path.

Causal attention (section "Causal" below) costs about half of full attention: the triangle is cut
into unmasked squares (run by the plain kernel with tall tiles) and small masked diagonal tiles,
and nothing above the diagonal is ever computed, in the forward or the backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import masks, residuals
from attnx.core.contract import compute_dtype, nonfinite_inputs
from attnx.core.kernels import common
from attnx.core.kernels.xla import sizes, sweep, triangle
from attnx.core.kernels.xla import tiling as tl
from attnx.core.weightings import Pointwise

Array = jax.Array

__all__ = ["block_config", "block_grads", "blocked_attention", "check_layout", "finite_residual",
           "mask_tile_counts", "plain_tiles", "raw_block_state"]


# --------------------------------------------------------------------------------------------
# One block of a larger problem (the ring: the local query shard against one visiting
# key shard). The tile math is the kernel's own; only the cfg and the entry points are new.
# --------------------------------------------------------------------------------------------

# The causal diagonal block of a ring runs the plain kernel with causal masking (not the
# triangle of pieces, which needs power-of-2 leaves and padding): short tiles keep the work
# above the diagonal that tile granularity cannot skip small.
BLOCK_CAUSAL_TILE = 256


def block_config(w: Any, t: int, s: int, head_dims: tuple[int, int, int], *, is_causal: bool,
                 has_mask: bool, has_bias: bool, num_keys: int, block_q: int | None = None,
                 block_k: int | None = None, whole_chunk: bool = False) -> tl.TileConfig:
  """The cfg of one unpadded [t × s] block of a larger attention problem.

  A ring step (:mod:`attnx.core.parallel.ring`) computes the local query rows against one
  visiting key shard; the blocks of all steps must agree on the rows' layout, so nothing is
  padded: the tiles are the largest that divide t and s (multiples of 8 where one fits) below
  the caps ``block_q``/``block_k`` (default: :func:`.sizes.default_block_sizes`, causal
  :data:`BLOCK_CAUSAL_TILE`). ``num_keys`` is the key count F sees (sigmoid's default
  b = −log n): the whole problem's, not the block's. ``is_causal``: the block is the diagonal
  one (query i sees key j ≤ i, block-local indices). ``whole_chunk``: all B·K (batch, kv head)
  rows in one chunk, the query tile shortened to keep :data:`.sizes.TILE_BUDGET` scores (the
  whole-row kernels' raw entry points run one chunk).
  """
  b, kv_heads, g = head_dims
  if is_causal:
    cap_q = cap_k = BLOCK_CAUSAL_TILE
  else:
    cap_q, cap_k = sizes.default_block_sizes(t, s, g)
  cap_q, cap_k = block_q or cap_q, block_k or cap_k
  bk = sizes.dividing_tile(s, min(cap_k, s))
  if whole_chunk:
    cap_q = min(cap_q, max(tl.ALIGN, sizes.TILE_BUDGET // (b * kv_heads * g * bk)))
  bq = sizes.dividing_tile(t, min(cap_q, t))
  chunk = b * kv_heads if whole_chunk else sizes.heads_per_chunk(b, kv_heads, g, bq, bk)
  return tl.TileConfig(w=w, t=t, s=s, bq=bq, bk=bk, is_causal=is_causal, has_mask=has_mask,
                       has_bias=has_bias, head_dims=head_dims, kv_heads=kv_heads,
                       heads_in_chunk=chunk, full_num_keys=num_keys)


def raw_block_state(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                    scale: Array, cfg: tl.TileConfig, mod: Any = None) -> tuple[Array, Array]:
  """The unnormalized state (acc, st) of every query row over this block's keys, for a
  pointwise F, in the kernel layout (q [X, G, t, H], k/v [X, s, H], bias/mask
  [Bb, Kb, Gb, t|1, s|1]; ``cfg`` from :func:`block_config`).

  States of disjoint key blocks of the same rows merge exactly with
  :func:`attnx.core.streaming.pointwise_merge` and are normalized once by
  :func:`attnx.core.streaming.pointwise_finalize` (no ``num_keys``: a ``"length"`` state
  already counts its keys); see :func:`.sweep.forward` for what acc and st hold. ``mod``: the
  :class:`~attnx.core.score_mods.ScoreMod` of ``cfg.score_mod`` (its positions the block's
  own, from 0: a ring wraps its function to see global ones), else None.
  """
  return sweep.forward(q, k, v, bias, mask, scale, dataclasses.replace(cfg, raw=True),
                       mod=mod)


def block_grads(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                scale: Array, out: Array, stat: Array, do: Array, cfg: tl.TileConfig,
                mod: Any = None):
  """(dq, dk, dv, dbias, dscale) of this block's scores (in the compute dtype: float32, or
  float64), given the rows' final output and row statistic (of the whole problem: the
  backward of a block needs nothing else, as each tile's weights are recomputed from them;
  lse as one value or as the pair of :func:`.sweep.stat_shape`). Summed over the key blocks, they
  are the whole problem's gradients. With ``cfg.score_mod`` (``mod`` as in
  :func:`raw_block_state`) the cotangent of ``mod`` follows dscale."""
  return sweep.backward(q, k, v, bias, mask, scale, out, stat, do, cfg, mod=mod)


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------

def finite_residual(tree: Any) -> Any:
  """``tree`` with +inf replaced by the dtype's largest finite number.

  A row without weight has the statistic lse = +inf (and the kernels mark masked scores with
  −inf), which the backward reads only through e^{z − lse} = 0: the largest finite number
  gives the same 0 for every score z ≤ ~1e38. The kernels' forward and backward run under
  ``jax.jit`` and return their statistics through this, so that what leaves them (output,
  residuals, gradients) is finite for finite inputs: ``jax.debug_infs`` and
  ``jax.debug_nans`` check every array an eagerly run operation produces, and the ±inf
  inside a compiled function (as inside ``jax.nn``'s) never reach them.
  """
  def one(x):
    if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jnp.where(x == jnp.inf, jnp.finfo(x.dtype).max, x)
  return jax.tree.map(one, tree)


def log_normalizer(w: Pointwise, stat: Array) -> Array:
  """The rows' log normalizer (the residual of :mod:`attnx.core.residuals`) from the forward's
  finite row statistic: lse = hi + lo (−∞ for a row without weight, whose hi
  :func:`finite_residual` made the largest finite number), log l, log n; 0 for
  ``"none"``."""
  if w.online_max:
    hi, lo = (stat[..., 0], stat[..., 1]) if stat.ndim == 4 else (stat, 0.0)
    return jnp.where(hi >= jnp.finfo(hi.dtype).max, -jnp.inf, hi + lo)
  if w.unnormalized:
    return jnp.zeros_like(stat)
  return jnp.log(stat)


def _custom_kernel(cfg: tl.TileConfig, forward, backward, num_args: int, cotangents,
                   residual: bool):
  """The custom-VJP kernel over ``forward`` (args -> (O, stat), jitted) and ``backward``
  (``backward(*args[:6], out, stat, do, **extra, dres=...)``), whose first ``num_args``
  arguments are the kernel's and the rest keyword arguments of the backward; ``cotangents``
  turns the backward's results into the arguments' cotangents. ``residual``: the kernel
  returns (O, log normalizer [X, G, Tp]) and takes the latter's cotangent (the normalizer
  of ``"length"`` and ``"none"`` has no gradient)."""
  extra_names = ("smask", "mod", "sinks")[:num_args - 6]

  @jax.custom_vjp
  def kernel(*args):
    out, stat = forward(*args)
    out = out.astype(args[0].dtype)
    return (out, log_normalizer(cfg.w, stat)) if residual else out

  def fwd(*args):
    out, stat = forward(*args)
    y = out.astype(args[0].dtype)
    return ((y, log_normalizer(cfg.w, stat)) if residual else y), (*args, out, stat)

  def bwd(res, ct):
    do, dres = ct if residual else (ct, None)
    args, out, stat = res[:num_args], res[num_args], res[num_args + 1]
    kw = dict(zip(extra_names, args[6:], strict=True))
    if residual and residuals.cotangent_sign(cfg.w):  # −1: δ − dres
      kw["dres"] = dres
    return cotangents(args, backward(*args[:6], out, stat, do, **kw))

  kernel.defvjp(fwd, bwd)
  return kernel


def _make_kernel(cfg: tl.TileConfig, residual: bool = False):
  """A custom-VJP function of internal-layout arrays (q, k, v, bias, mask, scale) -> O (with
  ``residual``: (O, log normalizer)); with ``cfg.structured`` it takes the bound structured
  mask as a seventh argument."""
  if cfg.structured or cfg.score_mod or cfg.sinks:
    return _make_structured_kernel(cfg, residual)

  causal_or_plain = triangle.causal_forward if cfg.is_causal else sweep.forward

  @jax.jit  # see finite_residual: inside, masked scores and rows without weight are ±inf
  def forward(q, k, v, bias, mask, scale):
    out, stat = causal_or_plain(q, k, v, bias, mask, scale, cfg)
    return out, finite_residual(stat)

  backward = jax.jit(functools.partial(
      triangle.causal_backward if cfg.is_causal else sweep.backward, cfg=cfg))
  return _custom_kernel(cfg, forward, backward, 6,
                        lambda args, grads: _cotangents(*args[:4], args[5], *grads), residual)


def _cotangents(q, k, v, bias, scale, dq, dk, dv, dbias, dscale):
  """The kernel's cotangents (q, k, v, bias, mask, scale) in the inputs' dtypes."""
  dbias = None if bias is None else dbias.astype(bias.dtype)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, None,
          dscale.astype(scale.dtype))


def _make_structured_kernel(cfg: tl.TileConfig, residual: bool = False):
  """:func:`_make_kernel` with a structured mask (a pytree of index arrays: no cotangent) as a
  seventh argument, a score modification (a :class:`~attnx.core.score_mods.ScoreMod`, whose
  parameters get gradients) as an eighth and attention sinks [N] as a ninth; None where the
  call has none."""

  @jax.jit
  def forward(q, k, v, bias, mask, scale, smask, mod, sinks):
    out, stat = sweep.forward(q, k, v, bias, mask, scale, cfg, smask, mod, sinks)
    return out, finite_residual(stat)

  backward = jax.jit(functools.partial(sweep.backward, cfg=cfg))

  def cotangents(args, grads):
    q, k, v, bias, _, scale, _, mod, sinks = args
    dq, dk, dv, dbias, dscale, *extra = grads
    dmod, dsinks = tl.extra_cotangents(cfg, extra, mod, sinks)
    return (*_cotangents(q, k, v, bias, scale, dq, dk, dv, dbias, dscale), None, dmod, dsinks)

  return _custom_kernel(cfg, forward, backward, 9, cotangents, residual)


def blocked_attention(q: Array, k: Array, v: Array, *, weighting: Pointwise, scale: float | Array,
                      bias: Array | None = None, mask: Array | None = None,
                      is_causal: bool = False, block_q: int | None = None,
                      block_k: int | None = None, structured_mask: Any = None,
                      score_mod: Any = None, sinks: Array | None = None,
                      return_residual: bool = False) -> Array | tuple[Array, Array]:
  """Memory-efficient attention out_i = Σ_j w_ij v_j for a pointwise weighting F.

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H]; N must be a multiple of K (grouped-query attention: query head n
      uses kv head n // (N // K)).
    v: values [B, S, K, Hv].
    weighting: the :class:`~attnx.core.weightings.Pointwise` F and its normalization.
    scale: multiplies q·k (a Python float or a scalar array, which then gets a gradient).
    bias: optional additive bias broadcastable to [B, N, T, S] (4-D, size-1 dims allowed).
    mask: optional boolean mask broadcastable to [B, N, T, S]; True = attend.
    is_causal: query i attends key j ≤ i (top-left aligned, like ``jnp.tril``).
    block_q, block_k: tile sizes (default :func:`.sizes.default_block_sizes`); T and S need not be
      multiples of them. Heads are processed in chunks that fill :data:`.sizes.TILE_BUDGET`.
    structured_mask: a structured mask (:mod:`attnx.core.masks`) bound to the flat batch
      (:meth:`~attnx.core.masks.Mask.bind` with the batch ``(B,)``): evaluated per tile, never
      as a [T, S] array, and the tiles where it allows no pair are skipped (with ``is_causal``
      the causal condition joins it).
    score_mod: a :class:`~attnx.core.score_mods.ScoreMod` (soft cap, ``score_mod`` function
      and its parameters), applied per tile between the score and F; its parameters get
      gradients. The causal triangle then runs as tiles under a causal structured mask.
    sinks: attention sinks [N] (``normalization="sum"`` only): a virtual key of score
      ``sinks[h]`` and zero value in every row of head h; gets a gradient.
    return_residual: also return each row's log normalizer [B, T, N] (the residual of
      :mod:`attnx.core.residuals`: log Σ F with the sinks and offset, log n, 0 for
      ``"none"``; −∞ for a row without weight), in the compute dtype, with a gradient.

  Returns:
    [B, T, N, Hv] in q's dtype (with ``return_residual``: and the residual); equal (up to
    float rounding) to ``pointwise_weights(s, weighting, where=valid) @ v`` with float32
    accumulation (float64 for float64 inputs: :func:`attnx.core.contract.compute_dtype`).
  """
  if not isinstance(weighting, Pointwise):
    raise TypeError(f"blocked_attention needs a Pointwise weighting, got {type(weighting)}")
  check_layout(q, k, v, mask, block_q, block_k)
  b, t, n, h = q.shape
  _, s, kv_heads, _ = k.shape
  if q.size == 0 or s == 0:  # no query, or no key (every row has no valid key)
    out = jnp.zeros((b, t, n, v.shape[-1]), q.dtype)
    if not return_residual:
      return out
    empty = 0.0 if weighting.unnormalized else -jnp.inf
    return out, jnp.full((b, t, n), empty, compute_dtype(q.dtype))
  kw = dict(weighting=weighting, scale=scale, block_q=block_q, block_k=block_k, num_keys=s,
            residual=return_residual)
  if structured_mask is not None or score_mod is not None or sinks is not None:
    # The tiles of the mask, not the causal triangle's pieces (whose positions are not the
    # tile's: a score modification reads them).
    smask = structured_mask
    if is_causal:
      smask = masks.Causal() if smask is None else masks.Causal() & smask
    return _blocked(q, k, v, bias=bias, mask=mask, is_causal=False, structured=smask,
                    score_mod=score_mod, sinks=sinks, **kw)
  if is_causal and s > t:  # keys j ≥ T are above the diagonal of every row: never touched
    return _blocked(q, k[:, :t], v[:, :t], bias=_part4(bias, 3, 0, t),
                    mask=_part4(mask, 3, 0, t), is_causal=True, **kw)
  if is_causal and t > s:  # rows i ≥ S see every key: a plain (non-causal) problem
    top = _blocked(q[:, :s], k, v, bias=_part4(bias, 2, 0, s), mask=_part4(mask, 2, 0, s),
                   is_causal=True, **kw)
    rest = _blocked(q[:, s:], k, v, bias=_part4(bias, 2, s, t), mask=_part4(mask, 2, s, t),
                    is_causal=False, **kw)
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), top, rest)
  return _blocked(q, k, v, bias=bias, mask=mask, is_causal=is_causal, **kw)


def check_layout(q: Array, k: Array, v: Array, mask: Array | None, block_q: int | None,
                 block_k: int | None) -> None:
  """The input checks of the blocked kernels: [B, T, N, H] / [B, S, K, H] shapes (N a multiple
  of K), a boolean mask, positive tile sizes."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected 4-D [B, T, N, H] inputs, got {q.shape}, {k.shape}, {v.shape}")
  b, _, n, h = q.shape
  kv_heads = k.shape[2]
  if (kv_heads == 0 or n % kv_heads or k.shape[:3] != v.shape[:3] or k.shape[0] != b
      or k.shape[-1] != h):
    raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean, got {mask.dtype}")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if blk is not None and blk < 1:
      raise ValueError(f"{name} must be a positive tile size, got {blk}")


def _part4(x: Array | None, axis: int, lo: int, hi: int) -> Array | None:
  """Rows (axis 2) or keys (axis 3) [lo, hi) of a [B|1, N|1, T|1, S|1]-broadcastable array."""
  if x is None:
    return None
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return x if x.shape[axis] == 1 else lax.slice_in_dim(x, lo, hi, axis=axis)


def plain_tiles(t: int, s: int, g: int, block_q: int | None, block_k: int | None,
                structured: bool) -> tuple[int, int]:
  """The (bq, bk) tiles of the plain (non-causal-triangle) kernel: the caps asked for, else
  :func:`.sizes.default_block_sizes` (under a structured mask at most
  :data:`.sizes.STRUCTURED_BLOCK_Q` × :data:`.sizes.STRUCTURED_BLOCK_K`: shorter tiles skip more),
  never longer than the sequence."""
  dq, dk = sizes.default_block_sizes(t, s, g)
  if structured:
    dq, dk = min(dq, sizes.STRUCTURED_BLOCK_Q), min(dk, sizes.STRUCTURED_BLOCK_K)
  # A tile never needs to be longer than the (8-aligned) sequence.
  bq = min(block_q, common.round_up(t, tl.ALIGN)) if block_q else dq
  bk = min(block_k, common.round_up(s, tl.ALIGN)) if block_k else dk
  return bq, bk


def mask_tile_counts(structured_mask: Any, weighting: Pointwise, b: int, t: int, s: int,
                     num_heads: int, kv_heads: int, is_causal: bool,
                     block_q: int | None = None, block_k: int | None = None) -> dict[str, Any]:
  """How :func:`blocked_attention` meets a bound structured mask: its tiles ``(bq, bk)`` and
  how many of them it skips (no pair may attend for any head), runs without the elementwise
  mask (every pair may) and runs masked (:func:`attnx.core.explain` shows it)."""
  smask = masks.Causal() & structured_mask if is_causal else structured_mask
  g = num_heads // kv_heads
  bq, bk = plain_tiles(t, s, g, block_q, block_k, True)
  cfg = tl.TileConfig(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=False, has_mask=False,
                      has_bias=False, head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                      structured=True)
  return tl.tile_counts(smask, cfg)


def _blocked(q, k, v, *, weighting, scale, bias, mask, is_causal, block_q, block_k, num_keys,
             structured=None, score_mod=None, sinks=None, residual=False):
  """:func:`blocked_attention` on checked, non-empty inputs; causal ones have T = S."""
  b, t, n, h = q.shape
  _, s, kv_heads, _ = k.shape
  q, k, v, bias = nonfinite_inputs(q, k, v, bias)
  g = n // kv_heads
  if is_causal:
    asked = [x for x in (block_q, block_k) if x]
    num_diag_tiles, d = sizes.causal_leaves(t, min(asked) if asked else sizes.CAUSAL_LEAF)
    cfg = tl.TileConfig(w=weighting, t=t, s=s, bq=d, bk=d, is_causal=True,
                        has_mask=mask is not None, has_bias=bias is not None,
                        head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                        num_diag_tiles=num_diag_tiles, user_bq=block_q or 0,
                        user_bk=block_k or 0, full_num_keys=num_keys)
    tp = sp = num_diag_tiles * d
  else:
    bq, bk = plain_tiles(t, s, g, block_q, block_k, structured is not None)
    cfg = tl.TileConfig(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=False,
                        has_mask=mask is not None, has_bias=bias is not None,
                        head_dims=(b, kv_heads, g), kv_heads=kv_heads,
                        heads_in_chunk=sizes.heads_per_chunk(b, kv_heads, g, bq, bk),
                        full_num_keys=num_keys, structured=structured is not None,
                        score_mod=score_mod is not None, sinks=sinks is not None)
    tp, sp = cfg.num_q_blocks * bq, cfg.num_k_blocks * bk

  # [B, T, N, H] -> [X, G, Tp, H] and [B, S, K, H] -> [X, Sp, H] (X = B·K), zero padded.
  q4, k3, v3, bias5, mask5 = tl.kernel_layout(q, k, v, bias, mask, tp, sp)
  scale_arr = jnp.asarray(scale, compute_dtype(q.dtype))
  args = (q4, k3, v3, bias5, mask5, scale_arr)
  if cfg.structured or cfg.score_mod or cfg.sinks:
    args += (structured, score_mod,
             None if sinks is None else jnp.asarray(sinks, compute_dtype(q.dtype)))
  out = _make_kernel(cfg, residual)(*args)
  if residual:
    out, res = out
    return (out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3),
            res[:, :, :t].reshape(b, n, t).transpose(0, 2, 1))
  return out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3)

