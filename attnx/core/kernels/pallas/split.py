"""Split-KV decoding on the Pallas kernels (flash-decoding: Dao, Haziza, Massa & Sizov,
"Flash-Decoding for long-context inference", 2023).

A decoding step has a few query rows and a long cache: one program per (batch, head, query
tile), each looping over every key, leaves most of a GPU idle. Here the keys are cut into C
chunks that become a batch axis of the same kernels (a free reshape of K and V, ``[B, S, K, H]``
→ ``[B·C, S/C, K, H]``; the few query rows are repeated per chunk), so B·C·N programs run side by
side; each chunk's normalized output and row statistic become its raw streaming state
(:mod:`.states`), the C states merge with the family's own rule
(:func:`attnx.core.streaming.fold`), a sink joins once, and the family's finalize gives exactly
what the unsplit forward kernel returns: the output and the row statistics in the kernels'
units. The backward is the unsplit kernels' (they recompute from the output and statistics).

Every F with a merge runs split: every pointwise F, SSMax (with the whole row's scale c_i,
computed before), softpick and stick-breaking (chunks merged in key order). Sparsemax and
α-entmax are not split (their threshold needs every key of a row before the first weight; the
unsplit kernels run them): :func:`reason` says so.

Positions: a chunk's kernel sees its keys at 0 … S/C − 1, so what reads a key's position is
made dense before the split (:func:`dense_positions` in :func:`.wrapper.pallas_attention`):
causality and a structured mask into the boolean mask, ALiBi and a relative-position table into
the bias (after the cap, as everywhere: :mod:`attnx.core.score_mods`). For decoding these are
O(T·S) per head, small beside the cache. The per-batch key lengths become per-chunk lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import masks as masks_lib
from attnx.core import streaming
from attnx.core.kernels.pallas.common import KernelConfig
from attnx.core.kernels.pallas.states import block_weighting, pointwise_state, row_state
from attnx.core.kernels.xla import decode
from attnx.core.weightings import Pointwise

Array = jax.Array
F32 = jnp.float32
LN2 = math.log(2.0)

__all__ = ["dense_positions", "forward", "reason", "row_forward", "split_count"]


def reason(weighting: Any) -> str | None:
  """Why the keys of ``weighting``'s rows cannot be split into chunks merged afterwards, or
  None when they can (every pointwise F, SSMax, softpick, stick-breaking)."""
  if isinstance(weighting, Pointwise):
    return None
  rs = getattr(weighting, "stream", None)
  if rs is None:
    return f"weighting {weighting.name!r} has no streaming form"
  if rs.needs_threshold:
    return (f"weighting {weighting.name!r} ({rs.family}) needs every key of a row for its "
            "threshold τ before the first weight, so its keys are not split (the unsplit "
            "kernels run it; attnx.core.thresholds has the protocol over key chunks)")
  return None


def split_count(key_tiles: int, num_splits: int) -> int:
  """The number of chunks: the divisor of the forward's key tiles nearest ``num_splits`` (a
  chunk is whole tiles, so K and V are cut without a copy)."""
  return decode.chunk_count(key_tiles, num_splits)


def dense_positions(q_shape: tuple[int, int, int, int], s: int, *, bias: Array | None,
                    mask: Array | None, is_causal: bool, structured_mask: Any,
                    score_mod: Any) -> tuple[Array | None, Array | None]:
  """(bias, mask) with what reads a key's position made dense, for a split call: causality
  (top-left) and a structured mask (bound to the flat batch) and-ed into ``mask``
  ([B|1, N|1, T, S]), ALiBi's or a relative table's terms (``score_mod``'s function on zero
  scores: both are additive) added to ``bias``. A soft cap stays the kernels' (before the
  bias)."""
  b, t, n, _ = q_shape
  if structured_mask is not None:
    mask = masks_lib.combine(mask, structured_mask, (b,), n, t, s)
  if is_causal:
    causal = jnp.tril(jnp.ones((t, s), bool))[None, None]
    mask = causal if mask is None else jnp.asarray(mask) & causal
  if score_mod is not None and score_mod.fn is not None:
    pos = dataclasses.replace(score_mod, cap=None).grid(jnp.zeros((1, n, t, s), F32), None, (1,))
    bias = pos if bias is None else jnp.asarray(bias) + pos
  return bias, mask


def _chunked(cfg: KernelConfig, q, k, v, bias, mask, q_len, kv_len, rowc=None):
  """The chunk problem: its config (one chunk's keys, every key bounded by its chunk length,
  without the row's sink, offset or ε) and operands, the chunks a batch axis (b·C + c)."""
  c = cfg.kv_splits
  b = q.shape[0]
  sc = cfg.sp // c
  rep = lambda x: jnp.broadcast_to(x[:, None], (b, c) + x.shape[1:]).reshape(
      (b * c,) + x.shape[1:])

  def keys(x):  # [Bb, Nb, Tb, Sb] -> [B·C | 1, Nb, Tb, S/C | 1]
    if x is None:
      return None
    bb, nb, tb, sb = x.shape
    if sb == 1:
      return x if bb == 1 else rep(x)
    x = x.reshape(bb, nb, tb, c, sc).transpose(0, 3, 1, 2, 4)
    return jnp.broadcast_to(x, (b, c, nb, tb, sc)).reshape(b * c, nb, tb, sc)

  ccfg = dataclasses.replace(cfg, w=block_weighting(cfg.w), kv_splits=1, sp=sc, kv_bound=True,
                             sinks=False)
  start = sc * jnp.arange(c, dtype=kv_len.dtype)
  kl = jnp.clip(kv_len[:, None] - start[None], 0, sc).reshape(b * c)
  chunk = lambda x: x.reshape((b * c, sc) + x.shape[2:])
  return ccfg, (rep(q), chunk(k), chunk(v), keys(bias), keys(mask), rep(q_len), kl,
                None if rowc is None else rep(rowc))


def _rows(x: Array, b: int, c: int) -> Array:
  """A chunk kernel's rows [B·C, N, Tp] -> [B, C, N, Tp]."""
  return x.reshape((b, c) + x.shape[1:])


def _outs(o: Array, b: int, c: int) -> Array:
  """A chunk kernel's output [B·C, Tp, N, Hv] -> rows [B, C, N, Tp, Hv] float32."""
  return jnp.swapaxes(o.reshape((b, c) + o.shape[1:]), 2, 3).astype(F32)


def forward(cfg: KernelConfig, run: Callable[..., tuple[Array, Array]], q, k, v, bias, mask,
            q_len, kv_len, out_dtype: Any, sinks: Array | None) -> tuple[Array, Array]:
  """What :func:`.wrapper.forward` returns for a pointwise F — O [B, Tp, N, Hvp] and the row
  statistic [B, N, Tp] in the kernels' units (a log2-sum-exp for the online max) — computed
  as ``cfg.kv_splits`` chunks by ``run`` (the unsplit forward) and merged. The call has no
  positional masks or modifications left (:func:`dense_positions`)."""
  w = cfg.w
  b, c = q.shape[0], cfg.kv_splits
  ccfg, (qc, kc, vc, bc, mc, ql, kl, _) = _chunked(cfg, q, k, v, bias, mask, q_len, kv_len)
  o, stat = run(ccfg, qc, kc, vc, bc, mc, ql, kl, out_dtype=F32)
  state = pointwise_state(ccfg.w, _outs(o, b, c), _rows(stat, b, c), True, ccfg.sp)
  state = streaming.fold(lambda x, y: streaming.pointwise_merge(w, x, y), state, 1)
  if sinks is not None:
    zs = sinks.astype(F32)[None, :, None] + jnp.zeros(state[1].shape, F32)
    state = streaming.pointwise_merge(w, state, streaming.pointwise_sink(w, zs, o.shape[-1],
                                                                         cfg.s))
  out, stat = streaming.pointwise_finalize(w, *state)
  if w.online_max:  # the kernels' log2-sum-exp (+∞ stays +∞: a row without weight)
    stat = stat * (1.0 / LN2)
  return jnp.swapaxes(out, 1, 2).astype(out_dtype), stat


def row_forward(cfg: KernelConfig, run: Callable[..., Any], q, k, v, rowc, bias, mask, q_len,
                kv_len, out_dtype: Any, sinks: Array | None) -> tuple[Array, list, None]:
  """What :func:`.wrapper.row_forward` returns for SSMax, softpick and stick-breaking — O
  [B, Tp, N, Hvp], the row statistics of :func:`attnx.core.streaming.finalize` (each
  [B, N, Tp]) and no support mean — computed as ``cfg.kv_splits`` chunks by ``run`` (the
  unsplit forward) and merged; ``rowc`` SSMax's scale of the whole row [B, N, Tp] (or None)."""
  rs = cfg.w.stream
  b, c = q.shape[0], cfg.kv_splits
  ccfg, (qc, kc, vc, bc, mc, ql, kl, rc) = _chunked(cfg, q, k, v, bias, mask, q_len, kv_len,
                                                     rowc)
  crs = ccfg.w.stream
  o, stats, _ = run(ccfg, qc, kc, vc, rc, bc, mc, ql, kl, out_dtype=F32)
  state = row_state(rs, _outs(o, b, c), _rows(stats[0], b, c))
  state = streaming.fold(lambda x, y: streaming.merge(crs, x, y), state, 1, crs.reverse)
  if sinks is not None:  # not stick-breaking (the call's checks)
    rows = (b,) + stats[0].shape[1:]
    zs = sinks.astype(F32)[None, :, None, None] + jnp.zeros(rows + (1,), F32)
    state = streaming.merge(crs, state, streaming.row_sink(crs, zs, o.shape[-1], rowc))
  out, stats, _ = streaming.finalize(rs, state, rowc)
  return jnp.swapaxes(out, 1, 2).astype(out_dtype), list(stats), None
