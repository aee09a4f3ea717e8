"""Stick-breaking ring attention in the zigzag layout (see the comment below for the runs)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import residuals
from attnx.core.parallel import layout as ring_layout
from attnx.core.parallel import steps

Array = jax.Array
F32 = jnp.float32

# --------------------------------------------------------------------------------------------
# Stick-breaking in the zigzag layout: the keys of a row must merge in order, and a zigzag
# shard holds two distant chunks, j and 2P − 1 − j. Its halves travel apart: the low chunks
# (j) around the ring as usual, arriving i, i − 1, …, 0, P − 1, …, i + 1, the high chunks
# (2P − 1 − j) the other way round, arriving 2P − 1 − i, then P + … down to P, then 2P − 1
# down to 2P − i. Every chunk then arrives before the chunks of its run that come before it:
# five runs, L1 (chunks ≤ i), L2 (up to P − 1), H2 (from P, below 2P − 1 − i), H0 (chunk
# 2P − 1 − i) and H3 (after it), each merged behind its later keys as they come, and the runs
# merged at the end, later first. The backward walks the same runs in the same order, each
# starting from the carries (L and Σ A·dP) of the runs after it, from their saved totals.
# --------------------------------------------------------------------------------------------

# Pieces of a half-shard visit (rows in halves of the local rows; keys: the whole half), by
# where the visiting device j is relative to i (−1: j < i, 0: j = i, 1: j > i).
_LOW_PIECES = {-1: (ring_layout.Piece(0, 2, 0, 2, False),),
               0: (ring_layout.Piece(0, 1, 0, 2, True), ring_layout.Piece(1, 2, 0, 2, False)),
               1: (ring_layout.Piece(1, 2, 0, 2, False),)}
_HIGH_PIECES = {-1: (), 0: (ring_layout.Piece(1, 2, 0, 2, True),),
                1: (ring_layout.Piece(1, 2, 0, 2, False),)}
_RUNS = ("H3", "H0", "H2", "L2", "L1")  # later first


def _reverse_perm(p: int) -> list[tuple[int, int]]:
  return [(j, (j - 1) % p) for j in range(p)]  # device i receives from i + 1


def _half(rc: steps.RingConfig, travel, lo: int, size: int):
  """The key half [lo, lo + size) of travelling (k, v, bias, mask)."""
  k, v, b, m = travel
  cut = lambda x, axis: None if x is None else lax.slice_in_dim(x, lo, lo + size, axis=axis)
  return cut(k, 1), cut(v, 1), cut(b, 4), cut(m, 4)


def _half_inputs(rc: steps.RingConfig, half, bias, mask, src, off: int):
  """(k, v), bias block, mask block of a visit by half a shard of device ``src`` (its keys
  [off, off + S/2) of the shard)."""
  k, v, bias_t, mask_t = half
  size = k.shape[1]

  def pick(local, travelling, kind):
    if kind == "travel":
      return travelling
    if kind == "rows":
      return lax.dynamic_slice_in_dim(local, src * rc.s + off, size, axis=4)
    if kind == "structured":
      return local.block(rc, src, off, size)
    return local

  return (k, v), pick(bias, bias_t, rc.bias_kind), pick(mask, mask_t, rc.mask_kind)


def _rel_switch(rc: steps.RingConfig, i, src, table, run, *operands):
  """run(pieces)(*operands) with the pieces of ``table`` for src relative to i."""
  if not rc.is_causal:
    return run((ring_layout.Piece(0, 2, 0, 2, False),))(*operands)
  return lax.switch(jnp.sign(src - i) + 1, [run(table[r]) for r in (-1, 0, 1)], *operands)


def _runs_update(runs: dict, names: tuple[str, ...], which: Array, new: Any, fn) -> dict:
  """runs[names[which]] = fn(runs[names[which]], new), the others unchanged."""
  picked = runs[names[-1]]
  for n, name in enumerate(names[:-1]):
    picked = steps.select(which == n, runs[name], picked)
  merged = fn(picked, new)
  return {**runs, **{name: steps.select(which == n, merged, runs[name])
                     for n, name in enumerate(names)}}


def _high_run(i, src):
  return jnp.where(src == i, 0, jnp.where(src > i, 1, 2))  # H0, H2, H3


def forward(rc: steps.RingConfig, q, k, v, bias, mask, scale, mod=None):
  p, hv, c = rc.p, v.shape[-1], rc.s // 2
  i = lax.axis_index(rc.axis)
  rows = q.shape[:2] + (rc.t,)
  merge = lambda acc, new: steps.merge_parts(rc, acc, new)  # acc holds the later keys

  def visit(half, src, off, table):
    kv, b, m = _half_inputs(rc, half, bias, mask, src, off)
    smod = steps.step_mod(rc, mod, src, off, c)
    run = lambda pieces: (lambda: steps.kind_state(rc, pieces, q, kv, b, m, None, scale, hv,
                                                   smod))
    return _rel_switch(rc, i, src, table, run)

  def body(r, carry):
    low, high, runs = carry
    src_l, src_h = (i - r) % p, (i + r) % p
    after_l = lax.ppermute(low, rc.axis, steps.perm(p)) if p > 1 else low
    after_h = lax.ppermute(high, rc.axis, _reverse_perm(p)) if p > 1 else high
    runs = _runs_update(runs, ("L1", "L2"), (src_l > i).astype(jnp.int32),
                        steps.part(rc, visit(low, src_l, 0, _LOW_PIECES)), merge)
    runs = _runs_update(runs, ("H0", "H2", "H3"), _high_run(i, src_h),
                        steps.part(rc, visit(high, src_h, c, _HIGH_PIECES)), merge)
    return after_l, after_h, runs

  travel = steps.travelling_arrays(rc, k, v, bias, mask)
  init = (_half(rc, travel, 0, c), _half(rc, travel, c, c),
          {name: steps.part(rc, steps.empty(rc, rows, hv)) for name in _RUNS})
  _, _, runs = lax.fori_loop(0, p, body, init)
  part = runs["L1"]
  for name in ("L2", "H2", "H0", "H3"):
    part = steps.merge_parts(rc, runs[name], part)
  out, res = part
  return out, residuals.to_stats(rc.w, res), tuple(runs[name] for name in _RUNS[:-1])


def backward(rc: steps.RingConfig, res, do, mod=None):
  q, k, v, bias, mask, _, scale, out, stats, extra = res
  p, c = rc.p, rc.s // 2
  i = lax.axis_index(rc.axis)
  do = do.astype(rc.dtype)
  carries = dict(zip(_RUNS, extra, strict=True))  # steps.start_carries
  dbias_local = None
  if bias is not None and rc.bias_kind != "travel":
    dbias_local = steps.zeros(rc, bias.shape)

  def visit(half, src, off, table, run_carries):
    kv, bb, m = _half_inputs(rc, half, bias, mask, src, off)
    smod = steps.step_mod(rc, mod, src, off, c)
    run = lambda pieces: (lambda cc: steps.kind_grads(rc, pieces, q, kv, bb, m, None, scale, out,
                                                 stats, do, cc, smod))
    return _rel_switch(rc, i, src, table, run, run_carries)

  def add_bias(dbias_local, db, tgrad_b, src, off):
    if db is None:
      return dbias_local, tgrad_b
    if rc.bias_kind == "travel":
      return dbias_local, tgrad_b + db
    if rc.bias_kind == "rows":
      return steps.add_at(dbias_local, db, 4, src * rc.s + off), tgrad_b
    return dbias_local + db, tgrad_b

  def body(r, carry):
    low, high, t_low, t_high, (dq, dscale, dbias_local, carries, *dmod) = carry
    src_l, src_h = (i - r) % p, (i + r) % p
    after_l = lax.ppermute(low, rc.axis, steps.perm(p)) if p > 1 else low
    after_h = lax.ppermute(high, rc.axis, _reverse_perm(p)) if p > 1 else high
    grads = {}

    def one(names, which, half, src, off, table):
      nonlocal carries
      box = {}

      def fn(cc, _):
        gq, gkv, db, cc, gs, *gm = visit(half, src, off, table, cc)
        box.update(gq=gq, gkv=gkv, db=db, gs=gs, gm=gm)
        return cc

      carries = _runs_update(carries, names, which, None, fn)
      return box

    grads["low"] = one(("L1", "L2"), (src_l > i).astype(jnp.int32), low, src_l, 0, _LOW_PIECES)
    grads["high"] = one(("H0", "H2", "H3"), _high_run(i, src_h), high, src_h, c, _HIGH_PIECES)
    new_t = []
    for key, tg, src, off in (("low", t_low, src_l, 0), ("high", t_high, src_h, c)):
      g = grads[key]
      dk, dv, dbt = tg
      dbias_local, dbt = add_bias(dbias_local, g["db"], dbt, src, off)
      new_t.append((dk + g["gkv"][0], dv + g["gkv"][1], dbt))
      dq, dscale = dq + g["gq"], dscale + g["gs"]
      dmod = jax.tree.map(jnp.add, dmod, g["gm"])
    t_low, t_high = new_t
    if p > 1:  # each half's dK/dV go on with it, in its direction; after P hops: home
      t_low = lax.ppermute(t_low, rc.axis, steps.perm(p))
      t_high = lax.ppermute(t_high, rc.axis, _reverse_perm(p))
    return after_l, after_h, t_low, t_high, (dq, dscale, dbias_local, carries, *dmod)

  travel = steps.travelling_arrays(rc, k, v, bias, mask)
  zeros_half = lambda: (steps.zeros(rc, (k.shape[0], c, k.shape[2])),
                        steps.zeros(rc, (v.shape[0], c, v.shape[2])),
                        steps.zeros(rc, bias.shape[:4] + (c,)) if rc.bias_kind == "travel"
                        else None)
  init = (_half(rc, travel, 0, c), _half(rc, travel, c, c), zeros_half(), zeros_half(),
          (steps.zeros(rc, q.shape), steps.zeros(rc, ()), dbias_local, carries))
  if mod is not None:  # the gradient of the score modification's parameters
    init = init[:4] + (init[4] + (jax.tree.map(lambda x: steps.zeros(rc, x.shape),
                                               mod[0].params),),)
  _, _, t_low, t_high, (dq, dscale, dbias_local, _, *dmod) = lax.fori_loop(0, p, body, init)
  dk = jnp.concatenate([t_low[0], t_high[0]], axis=1)
  dv = jnp.concatenate([t_low[1], t_high[1]], axis=1)
  dbias = (jnp.concatenate([t_low[2], t_high[2]], axis=4) if rc.bias_kind == "travel"
           else dbias_local)
  if mod is None:
    return dq, dk, dv, dbias, None, dscale
  return dq, dk, dv, dbias, None, dscale, dmod[0], None


