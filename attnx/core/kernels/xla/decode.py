"""Split-KV attention in XLA: a few query rows against a long key/value cache (decoding).

The keys are cut into C chunks of L = S/C keys; every chunk's row state is computed at once (the
chunks are a batch axis, not a loop), then the states are merged with the family's own merge
(:mod:`attnx.core.streaming`: the rule the blocked kernels, the Pallas kernels and the ring use)
and finalized once. The same code with C = 1 is the row-state path of the dense implementation
(:func:`row_attention` on scores it formed itself).

Two layout choices make it read K and V about once, where a matmul formulation reads them
several times on a CPU (a [G·T, H] × [H, S] product per KV head is a matrix-vector product that
XLA:CPU runs through a transposed copy of K):

* the query heads that share one KV head are packed as the rows of that head (R = T·G rows), so
  K and V are never repeated per query head (grouped-query attention);
* the scores and the weighted sums are multiply-reduce fusions over K and V *as they are
  stored* (``[B, S, K, H]``: :func:`packed_scores`, :func:`chunk_pv`), never transposed; only
  the small [B, K, R, S] scores are.

Memory beyond the cache: the scores and weights, O(R·S) per KV head, and C row states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import streaming
from attnx.core.contract import compute_dtype, finite
from attnx.core.weightings import Pointwise

Array = jax.Array


def chunk_count(s: int, num_chunks: int | None) -> int:
  """The number of chunks C for S keys: the divisor of S nearest ``num_chunks`` (default:
  chunks of about 1024 keys, at most 64), so that K and V are cut without a copy."""
  want = max(1, min(64, s // 1024)) if num_chunks is None else max(1, min(int(num_chunks), s))
  return min(_divisors(s), key=lambda d: (abs(math.log(d / want)), -d))


def _divisors(s: int) -> list[int]:
  small = [d for d in range(1, int(math.isqrt(s)) + 1) if s % d == 0]
  return sorted(set(small + [s // d for d in small]))


def packed_scores(q: Array, k: Array, v: Array | None, scale: Any) -> Array:
  """Scores [B, K, R, S] of queries q [B, T, N, H] against keys k [B, S, K, H] as stored (R =
  T·G rows per KV head, query head n = k·G + g), in the compute dtype.

  The contract's NaN rule (:mod:`attnx.core.contract`): a score is NaN exactly where q_i or
  k_j (or v_j, when given) holds a non-finite number, and the backward's products take finite
  copies of q and k (a masked NaN key gets a zero gradient and poisons no row)."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  cd = compute_dtype(q.dtype, k.dtype)
  qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h).astype(cd)
  # XLA:CPU of jaxlib 0.10 miscompiles this packing fused into the multiply-reduce (scores off
  # by O(1) for G > 1 at some S; jaxlib 0.12 is right): the barrier keeps it a separate, tiny
  # array.
  qr = jax.lax.optimization_barrier(qr)
  z = _qk(qr, k)  # [B, K, R, S]
  z = jnp.where(jnp.isfinite(z), z, jnp.nan)  # an infinite q or k entry: NaN, not ±∞
  if v is not None:
    # A key whose value holds a non-finite number gets NaN scores (a sum over Hv is finite
    # for finite values up to ~1e38/Hv; larger ones are flagged too, which only costs speed).
    bad = ~jnp.isfinite(jnp.sum(v.astype(cd), axis=-1))  # [B, S, K]
    z = jnp.where(jnp.transpose(bad, (0, 2, 1))[:, :, None, :], jnp.nan, z)
  return z * scale


@jax.custom_vjp
def _qk(qr: Array, k: Array) -> Array:
  """Σ_h q[b, k, r, h]·k[b, s, k, h] -> [B, K, R, S] as a multiply-reduce over K as stored (a
  select inside the product would stop XLA:CPU vectorizing it: 4× slower)."""
  z = jnp.sum(k.astype(qr.dtype)[:, :, :, None, :] * qr[:, None], axis=-1)  # [B, S, K, R]
  return jnp.transpose(z, (0, 2, 3, 1))


def _qk_fwd(qr, k):
  return _qk(qr, k), (qr, k)


def _qk_bwd(res, dz):
  qr, k = res
  kf = finite(k).astype(qr.dtype)
  dq = jnp.einsum("bkrs,bskh->bkrh", dz, kf)
  dk = jnp.einsum("bkrs,bkrh->bskh", dz, finite(qr))
  return dq, dk.astype(k.dtype)


_qk.defvjp(_qk_fwd, _qk_bwd)


def rows_to_heads(x: Array, t: int) -> Array:
  """[B, K, R, ...] (R = T·G) -> [B, N, T, ...]."""
  b, kh, r = x.shape[:3]
  g = r // t
  x = x.reshape((b, kh, t, g) + x.shape[3:])
  x = jnp.moveaxis(x, 3, 2)
  return x.reshape((b, kh * g, t) + x.shape[4:])


def heads_to_rows(x: Array, kv_heads: int) -> Array:
  """[B, N, T, ...] -> [B, K, R, ...]."""
  b, n, t = x.shape[:3]
  g = n // kv_heads
  x = x.reshape((b, kv_heads, g, t) + x.shape[3:])
  x = jnp.moveaxis(x, 2, 3)
  return x.reshape((b, kv_heads, t * g) + x.shape[4:])


def chunk_pv(p: Array, v: Array) -> Array:
  """Σ_l p[b, k, c, r, l] v[b, c, l, k, :] -> [B, K, C, R, Hv]: the weighted sums of every
  chunk with V as stored ([B, C, L, K, Hv], a free reshape of [B, S, K, Hv]), as a
  multiply-reduce over its keys (weights rounded to v's dtype first, as
  :func:`attnx.core.streaming.pv`; accumulated in the compute dtype). A non-finite value
  enters no row that gives it weight 0 (the contract): when V holds one, the product takes V
  with it replaced by 0 (the rows that attend it are NaN through their scores)."""
  cd = compute_dtype(v.dtype)
  pt = jnp.transpose(p.astype(v.dtype).astype(cd), (0, 2, 4, 1, 3))  # [B, C, L, K, R]
  any_bad = ~jnp.isfinite(jnp.sum(v.astype(cd)))
  # The select inside the product (the rare branch) keeps it one fusion: no copy of V.
  out = jax.lax.cond(any_bad, lambda: _pv(pt, v, True), lambda: _pv(pt, v, False))
  return jnp.transpose(out, (0, 2, 1, 3, 4))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pv(pt: Array, v: Array, clean: bool) -> Array:
  """Σ_l pt[b, c, l, k, r]·v[b, c, l, k, :] -> [B, C, K, R, Hv] (multiply-reduce); ``clean``:
  V's non-finite entries read as 0."""
  prod = lambda p, x: jnp.sum(p[..., None] * x.astype(p.dtype)[:, :, :, :, None, :], axis=2)
  if not clean:
    return prod(pt, v)
  # One chunk at a time: the select is not fused into the product, and a cleaned copy of the
  # whole of V would be the program's largest buffer (XLA reserves it even when the branch
  # that needs it does not run).
  c = pt.shape[1]

  def one(i, out):
    x = jax.lax.dynamic_slice_in_dim(v, i, 1, axis=1)
    x = jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))
    return jax.lax.dynamic_update_slice_in_dim(
        out, prod(jax.lax.dynamic_slice_in_dim(pt, i, 1, axis=1), x), i, axis=1)

  out = jnp.zeros(pt.shape[:2] + pt.shape[3:] + v.shape[-1:], pt.dtype)
  return jax.lax.fori_loop(0, c, one, out)


def _pv_fwd(pt, v, clean):
  return _pv(pt, v, clean), (pt, v)


def _pv_bwd(clean, res, do):
  pt, v = res
  vf = jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype)).astype(pt.dtype)
  dp = jnp.einsum("bckrh,bclkh->bclkr", do, vf)
  dv = jnp.einsum("bckrh,bclkr->bclkh", do, pt)
  return dp, dv.astype(v.dtype)


_pv.defvjp(_pv_fwd, _pv_bwd)


def _pv_any(p: Array, v: Array) -> Array:
  """:func:`chunk_pv` on a chunked V, plain :func:`attnx.core.streaming.pv` otherwise."""
  return chunk_pv(p, v) if v.ndim == 5 and p.ndim == 5 else streaming.pv(p, v)


# The tile math with V as stored: no ones column (Hv + 1 would copy V), P·V by chunk_pv.
DECODE = dataclasses.replace(streaming.XLA, ones_column=False, concat_pv=False, matmul=_pv_any)


@dataclasses.dataclass(frozen=True)
class RowState:
  """What :func:`row_attention` returns: the output rows [B, K, R, Hv] and the family's
  row statistics (those of :func:`attnx.core.streaming.finalize` /
  :func:`attnx.core.streaming.pointwise_finalize`), from which
  :func:`attnx.core.residuals.from_stats` makes the public residual."""

  out: Array
  stats: tuple[Array, ...]


def row_attention(z: Array, valid: Array, v: Array, w: Any, *, num_chunks: int = 1,
                  sinks: Array | None = None, ssmax_s: Array | None = None,
                  num_keys: int | None = None) -> RowState:
  """Attention of rows whose scores are all at hand, as C chunks merged.

  Args:
    z: scores [B, K, R, S] (the compute dtype), R = T·G rows per KV head.
    valid: bool, broadcastable to z.
    v: values [B, S, K, Hv] as stored.
    w: the resolved weighting: a :class:`~attnx.core.weightings.Pointwise` or a whole-row
      weighting with a streaming family.
    num_chunks: C, a divisor of S.
    sinks: [B or 1, K, R] the sink's score of every row, or None.
    ssmax_s: SSMax's s per row [B or 1, K, R] (learned per head), or None (the weighting's).
    num_keys: the n a pointwise F's formula reads (default S).
  """
  b, kh, r, s = z.shape
  c = num_chunks
  if s % c:
    raise ValueError(f"num_chunks={c} must divide the {s} keys")
  ln = s // c
  cd = z.dtype
  valid = jnp.broadcast_to(valid, z.shape)
  zc = jnp.moveaxis(z.reshape(b, kh, r, c, ln), 3, 2)  # [B, K, C, R, L]
  vc_ = jnp.moveaxis(valid.reshape(b, kh, r, c, ln), 3, 2)
  vch = v.reshape((v.shape[0], c, ln) + v.shape[2:])  # [B, C, L, K, Hv]: a free reshape
  hv = v.shape[-1]
  if isinstance(w, Pointwise):
    return _pointwise(zc, vc_, vch, w, sinks, hv, cd, s if num_keys is None else num_keys)
  rs = w.stream
  if rs.needs_threshold:
    z_all, v_all = z, valid
    if sinks is not None:
      z_all = jnp.concatenate([z, sinks.astype(cd)[..., None] + jnp.zeros_like(z[..., :1])], -1)
      v_all = jnp.concatenate([valid, jnp.ones(valid.shape[:-1] + (1,), bool)], -1)
    th = threshold(rs, z_all, v_all)
    ctx = th
    chunk_ctx = streaming.Threshold(th.m[:, :, None], th.tau[:, :, None], th.passes)
  elif rs.needs_row_scale:
    n = jnp.sum(valid, axis=-1, dtype=cd) + (0.0 if sinks is None else 1.0)
    ctx = streaming.row_scale(rs, n, ssmax_s, cd)
    chunk_ctx = ctx[:, :, None]
  else:
    ctx = chunk_ctx = None
  stream = rs.block_stream if c > 1 or sinks is not None else rs
  st = streaming.update(stream, streaming.init(stream, (b, kh, c, r), hv, cd), zc, vc_, vch,
                        chunk_ctx, DECODE)
  st = streaming.fold(lambda a, x: streaming.merge(stream, a, x), st, 2, stream.reverse)
  if sinks is not None:
    zs = sinks.astype(cd)[..., None] + jnp.zeros((b, kh, r, 1), cd)
    st = streaming.merge(stream, st, streaming.row_sink(stream, zs, hv, ctx))
  out, stats, _ = streaming.finalize(rs, st, ctx)
  return RowState(out, tuple(stats))


def _pointwise(zc, vc_, vch, w: Pointwise, sinks, hv: int, cd, num_keys: int) -> RowState:
  """:func:`row_attention` for a pointwise F: each chunk's raw state by the streaming rules
  (online max or acc += F·V), merged in the XLA layout (Σ F in a last column)."""
  b, kh, c, r, _ = zc.shape
  rows = (b, kh, c, r)
  zero_acc = jnp.zeros(rows + (hv,), cd)
  if w.online_max:
    # The online max's state of each chunk in one step (the chunk is one tile), with its
    # shift m outside autodiff: the output does not depend on m, and its gradient through m
    # (terms that cancel) met underflowed weights as 0·∞ in XLA:CPU's unoptimized programs.
    # The exponent is α·z, or log F(z) of the valid scores (masked ones replaced by 0 first:
    # autodiff through log F at a masked −∞ would be NaN).
    ex = (w.alpha * zc if w.log_f is None
          else w.log_f.fn(jnp.where(vc_, zc, 0.0)))
    ex = jnp.where(vc_, ex, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(ex, axis=-1))
    p = jnp.exp(ex - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    acc, l = DECODE.pv(p, vch), jnp.sum(p, axis=-1)
    state = (jnp.concatenate([acc, l[..., None]], -1), m)
  else:
    acc, l = streaming.pointwise_update(w, zero_acc, jnp.zeros(rows, cd), zc, vc_, vch,
                                        num_keys, ops=DECODE)
    if w.divides_by_sum:
      state = (jnp.concatenate([acc, l[..., None]], -1), jnp.zeros(rows, cd))
    else:
      state = (acc, l)
  state = streaming.fold(lambda a, x: streaming.pointwise_merge(w, a, x), state, 2)
  if sinks is not None:  # normalization "sum" only (attnx.core.problem.sinks_reason)
    zs = sinks.astype(cd) + jnp.zeros((b, kh, r), cd)
    state = streaming.pointwise_merge(w, state, streaming.pointwise_sink(w, zs, hv, num_keys))
  out, stat = streaming.pointwise_finalize(w, *state)
  return RowState(out, (stat,))


# --------------------------------------------------------------------------------------------
# The entmax threshold with its implicit derivative (the passes are a while loop, which
# reverse-mode autodiff cannot enter).
# --------------------------------------------------------------------------------------------

def threshold(rs: streaming.RowStream, z: Array, valid: Array) -> streaming.Threshold:
  """τ and the row max m of rows whose scores z [..., S] are all at hand
  (:func:`attnx.core.streaming.entmax_threshold` on one tile), differentiable: with
  x = (α−1)·scale·z, dτ_abs = Σ_j u_j dx_j / Σ_j u_j (u = p^{2−α} on the support; the
  implicit function theorem on Σ_j [x_j − τ]₊^{1/(α−1)} = 1), and dm = dx at the argmax."""
  m, tau = _threshold(rs, z, valid)
  return streaming.Threshold(m, tau, jnp.int32(0))


@jax.custom_jvp
def _threshold_pair(z: Array, valid: Array, rs_box: Any) -> tuple[Array, Array]:
  rs = rs_box.rs
  th = streaming.entmax_threshold(lambda fn, init: fn(init, z, valid), z.shape[:-1], rs,
                                  dtype=z.dtype)
  return th.m, th.tau


@_threshold_pair.defjvp
def _threshold_pair_jvp(primals, tangents):
  z, valid, rs_box = primals
  dz = tangents[0]
  rs = rs_box.rs
  m, tau = _threshold_pair(z, valid, rs_box)
  k = (rs.alpha - 1.0) * rs.scale
  x = streaming.entmax_x(z, valid, rs)
  dx = jnp.where(valid, k * dz, 0.0)
  r = jnp.maximum(x - m[..., None] - tau[..., None], 0.0)
  u = jnp.where(r > 0, r ** (1.0 / (rs.alpha - 1.0) - 1.0) if rs.alpha != 2.0 else 1.0, 0.0)
  u = jnp.where(valid, u, 0.0)
  us = jnp.sum(u, axis=-1)
  d_abs = jnp.sum(u * dx, axis=-1) / jnp.where(us > 0, us, 1.0)
  top = jnp.argmax(jnp.where(valid, x, -jnp.inf), axis=-1)
  dm = jnp.take_along_axis(dx, top[..., None], axis=-1)[..., 0]
  dm = jnp.where(jnp.any(valid, axis=-1), dm, 0.0)
  return (m, tau), (dm, d_abs - dm)


@dataclasses.dataclass(frozen=True)
class _Static:
  """A hashable box for the stream (a custom_jvp's non-array argument)."""
  rs: Any


jax.tree_util.register_static(_Static)


def _threshold(rs: streaming.RowStream, z: Array, valid: Array) -> tuple[Array, Array]:
  return _threshold_pair(z, valid, _Static(rs))


__all__ = ["DECODE", "RowState", "chunk_count", "chunk_pv", "heads_to_rows", "packed_scores",
           "row_attention", "rows_to_heads", "threshold"]
