"""``implementation="split_kv"``: decoding, a few query rows against a long key/value cache.

The cache is cut into chunks whose row states are computed side by side and merged with the
family's merge rule (:mod:`attnx.core.kernels.xla.decode`), reading K and V about once and
never repeating them per query head (the query heads of one KV head are packed as its rows).
The automatic choice takes it for short queries against long caches
(:data:`DECODE_MAX_QUERIES`, :data:`DECODE_MIN_KEYS`); its chunk count is its setting,
``SplitKV(num_chunks=16)``. It also returns residuals (``return_residual=True``) and the
unnormalized output (``normalize_output=False``), and the dense implementation forms those
with the same row code (:func:`solve_rows`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from attnx.core import masks as masks_lib
from attnx.core import residuals as residuals_lib
from attnx.core.contract import compute_dtype
from attnx.core.implementations.base import (
  Implementation,
  Inputs,
  Problem,
  streaming_config_reason,
  streaming_reason,
  to_4d,
  with_residual,
)
from attnx.core.kernels.xla import decode

Array = jax.Array

# The automatic choice takes split-KV for at most this many query rows (T) ...
DECODE_MAX_QUERIES = 8
# ... against at least this many keys (shorter caches: dense is as fast).
DECODE_MIN_KEYS = 1024


@dataclasses.dataclass(frozen=True)
class SplitKV(Implementation):
  """Split-KV attention in XLA (flash-decoding's cut): ``implementation=core.SplitKV()`` or
  ``"split_kv"``.

  Attributes:
    num_chunks: how many chunks the keys are cut into (the divisor of S nearest it; default:
      chunks of about 1024 keys, at most 64). More chunks: more parallel work, a larger merge.
  """

  name: ClassVar[str] = "split_kv"
  num_chunks: int | None = None

  def __post_init__(self):
    n = self.num_chunks
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
      raise ValueError(f"SplitKV(num_chunks=...) must be a positive int or None, got {n!r}.")

  def supports_config(self, weighting: Any, score: Any) -> str | None:
    return streaming_config_reason(self.name, weighting, score)

  def supports(self, problem: Problem) -> str | None:
    return streaming_reason(self, problem)

  def declines(self, problem: Problem) -> str | None:
    if problem.t > DECODE_MAX_QUERIES:
      return (f"{problem.t} query rows: split-KV is for decoding (T ≤ {DECODE_MAX_QUERIES}); its "
              "scores are [T, S] per head.")
    if problem.s < DECODE_MIN_KEYS and not problem.wants_residual:
      return f"{problem.s} keys: below {DECODE_MIN_KEYS} the dense implementation is as fast."
    return None

  def __call__(self, problem: Problem, inputs: Inputs) -> Any:
    p = problem
    qd, kd = p.score.to_dot(inputs.query, inputs.key, **inputs.score_params)
    cd = compute_dtype(qd.dtype, kd.dtype, inputs.value.dtype)
    flat = lambda x: x.reshape((-1,) + x.shape[len(p.batch):])
    v = flat(inputs.value)
    z = decode.packed_scores(flat(qd), flat(kd), v, inputs.scale).astype(cd)
    c = decode.chunk_count(p.s, self.num_chunks)
    return solve_rows(p, inputs, z, v, p.num_kv_heads, c)


def _per_row(x: Array, t: int, kv_heads: int) -> Array:
  """A per-head array [N] as per row [1, K, R]."""
  return decode.heads_to_rows(jnp.broadcast_to(x[None, :, None], (1, x.shape[0], t)), kv_heads)


def solve_rows(p: Problem, inputs: Inputs, z: Array, v: Array, kv_heads: int,
               num_chunks: int, modify: Callable[[Array], Array] | None = None) -> Any:
  """The output (and residual) of a call whose scores z [B, K, R, S] (flat batch, R = T·G rows
  per KV head; ``kv_heads`` = K, N when the keys were repeated per query head) are at hand:
  the call's score modification, bias and masks, then :func:`decode.row_attention`. ``modify``
  replaces the modification and bias step (the dense implementation applied them already).
  Returns what :meth:`Implementation.__call__` returns."""
  b = z.shape[0]
  t, n, s = p.t, p.num_heads, p.s
  if modify is None:
    bias = inputs.bias
    if bias is not None:
      bias = jnp.where(bias == jnp.inf, jnp.nan, bias) if jnp.issubdtype(bias.dtype,
                                                                           jnp.floating) else bias
    if inputs.score_mod is not None or bias is not None:
      zd = decode.rows_to_heads(z, t)  # [B, N, T, S]
      b4 = to_4d(bias, p.batch)
      zd = (inputs.score_mod.grid(zd, b4, (b,)) if inputs.score_mod is not None
            else zd + b4.astype(zd.dtype))
      z = decode.heads_to_rows(zd, kv_heads)
  else:
    z = modify(z)
  mask = masks_lib.combine(inputs.mask, inputs.structured_mask, p.batch, n, t, s)
  valid = to_4d(mask, p.batch)
  if p.is_causal:
    causal = jnp.tril(jnp.ones((t, s), bool))[None, None]
    valid = causal if valid is None else valid & causal
  if valid is None:
    valid = jnp.ones((1, 1, 1, 1), bool)
  valid = decode.heads_to_rows(jnp.broadcast_to(valid, (valid.shape[0], n, t, s)), kv_heads)
  return _solve(p, inputs, z, valid, v, kv_heads, num_chunks)


def _solve(p: Problem, inputs: Inputs, z: Array, valid: Array, v: Array, kv_heads: int,
           num_chunks: int, num_keys: int | None = None) -> Any:
  """:func:`decode.row_attention` with the call's sinks and SSMax s, in the call's layout."""
  t, n = p.t, p.num_heads
  sinks = None if inputs.sinks is None else _per_row(inputs.sinks, t, kv_heads)
  kw = p.weighting.kernel_args(inputs.weighting_params) if inputs.weighting_params else {}
  ssmax_s = kw.get("ssmax_s")
  if ssmax_s is not None:
    ssmax_s = _per_row(jnp.broadcast_to(jnp.asarray(ssmax_s, z.dtype), (n,)), t, kv_heads)
  st = decode.row_attention(z, valid, v, p.weighting, num_chunks=num_chunks, sinks=sinks,
                            ssmax_s=ssmax_s, num_keys=num_keys)
  heads = lambda x: jnp.moveaxis(decode.rows_to_heads(x, t), 1, 2)  # [B, T, N, ...]
  unflat = lambda x: x.reshape(p.batch + x.shape[1:])
  out = unflat(heads(st.out))
  if not p.wants_residual:
    return out.astype(p.dtype)
  residual = jax.tree.map(lambda x: unflat(heads(x)),
                          residuals_lib.from_stats(p.weighting, st.stats))
  return with_residual(p, out, residual)


def sink_only_rows(p: Problem, inputs: Inputs) -> Any:
  """What a call without keys (S = 0) but with sinks returns: rows that saw only the sink, a
  key of zero value — output 0, and the residual of that one key (not an empty row's). One
  masked key stands in for the missing ones; F still reads n = 0 keys."""
  b = math.prod(p.batch)
  kh = p.num_kv_heads
  cd = compute_dtype(jnp.dtype(p.dtype))
  z = jnp.zeros((b, kh, p.t * (p.num_heads // kh), 1), cd)
  v = jnp.zeros((b, 1, kh, p.value_head_dim), cd)
  return _solve(p, inputs, z, jnp.zeros((1, 1, 1, 1), bool), v, kh, 1, num_keys=0)


__all__ = ["DECODE_MAX_QUERIES", "DECODE_MIN_KEYS", "SplitKV", "sink_only_rows", "solve_rows"]
