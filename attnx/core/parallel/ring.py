"""Context-parallel (ring) attention for every streamable weighting F.

The sequence is split over the devices of one mesh axis (inside ``jax.shard_map``, with or
without ``check_vma``): device i holds its query rows and its key/value shard. The K/V
shards travel around the ring with ``lax.ppermute`` (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers", arXiv 2310.01889; Brandon et al. 2023, "Striped
Attention", arXiv 2311.09431 for the load balance of causal rings): at step r device i holds
the shard of device (i − r) mod P, runs attnx's blocked kernel on its queries against it (the
transfer of the next shard is issued before, so that XLA may overlap the two) and merges the
step's part — its output and residual, :mod:`attnx.core.residuals` — into the device's, exactly,
with the public merge (:func:`attnx.core.residuals.merge_parts`, the rule of
:func:`attnx.core.merge_attention`), which runs the streaming module's rules
(:mod:`attnx.core.streaming`):

* pointwise F with the online max (softmax-like): rescale by e^{m_a − m} and add
  (:func:`~attnx.core.streaming.pointwise_merge`); ``"sum"``, ``"length"`` and ``"none"``:
  plain sums of Σ F·V and of Σ F / the valid-key count;
* SSMax and softpick: the running max's rescaling (:func:`~attnx.core.streaming.merge`);
* stick-breaking: the later keys break the stick first, so the state of a key range that lies
  after another is merged in front of it. Shards arrive in the order i, i − 1, …, 0 (each
  before the previous) and then P − 1, …, i + 1 (after all of those): two states are kept,
  one per run, and merged at the end. In the zigzag layout the two chunks of a shard travel
  apart, in opposite directions, so that every chunk still arrives before the earlier chunks
  of its run (five runs; see "Stick-breaking in the zigzag layout" below).

What depends on the length of the row uses
the whole (global) sequence, never the shard's: F sees the global key count S = P·S_local
(sigmoid's default b = −log S), ``"length"`` counts the valid keys of every shard (the merged
count), SSMax's n_i is the row's count of valid keys over all shards (found before the ring:
from the masks, gathered along the key axis when they are sharded).

Causal attention (T = S) with ``layout="contiguous"`` (device i holds chunk i): the shards of
devices after i are above the diagonal of every local row and are skipped (``lax.switch``), so
device P − 1 does P − ½ blocks of work and device 0 only ½: the ring waits for the slowest.
``layout="zigzag"`` cuts the sequence into 2P chunks and gives device i chunks i and 2P − 1 − i
(:func:`zigzag_permute`): every step is then half a block on every device (:func:`ring_work`).
Without ``is_causal`` the layout changes nothing but which positions a device holds.

The backward is a ``jax.custom_vjp`` that runs the ring again (FlashAttention-2's recomputation
at the scale of shards): only the local output and the row statistics are saved, O(T/P) per
device. Autodiff through the forward ring would save every visiting K/V shard for the
backward (the loop's carries), O(T) per device — the memory ring attention exists to avoid.
dQ accumulates locally; the dK/dV accumulators (and a key-sharded bias' gradient) travel
around the ring with their K/V shard, one hop after each step: after P hops they are home.

A ring holds about 12 buffers of its shard's size (the visiting K/V, the next one and XLA's
copy of the one it sends, dK/dV sent and received, dQ, the kernel's own accumulators), so the
kv heads run in passes (``kv_head_block`` per pass, by default as many as keep a pass' query
shard within :data:`PASS_BUDGET` elements): one whole ring per pass, one pass after the other,
each over its heads only. The contract's input step runs per pass too, and stick-breaking's
saved states are reduced to per-row carries before the backward's passes (the memory this
saves is measured in docs/guides/ring.md).

Masks and biases follow :func:`attnx.core.attention` ([batch..., N, T, S]-broadcastable, True
= attend), with their T and S axes given per device as:

* T axis: 1 (broadcast) or the local query length (sharded with q);
* S axis: 1 (broadcast); the local key length, sharded with k (a key padding mask
  [B, 1, 1, S]: it travels with the K/V shards; its T axis must be 1); or the whole key
  length P·S_local in the layout's order (the shards of devices 0, …, P − 1 concatenated,
  i.e. :func:`zigzag_permute` of the natural order for zigzag), with the T axis sharded: each
  step slices the visiting shard's columns.

Score modifications (``logits_soft_cap``, ``score_mod``: :mod:`attnx.core.score_mods`) run in
every step's kernel, per tile, with the global positions of the local rows and of the visiting
keys and the global query head (:class:`~attnx.core.parallel.steps.StepMod`); attention sinks
are folded once into each device's first row state (:func:`~attnx.core.parallel.steps.
sink_state`) and their gradient comes from the saved row statistics
(:func:`~attnx.core.parallel.steps.sink_grads`). The XLA steps run all of them; the Pallas
steps a soft cap (in their kernels), sinks (the ring's, outside the steps), and ALiBi and
relative tables, which their kernels take as a relative table at each contiguous block's
global distances (:class:`~attnx.core.parallel.steps.OffsetMod`; zigzag pieces run chunk by
chunk: :func:`~attnx.core.parallel.steps.blocks`), not a user's ``score_mod`` function
(their kernels' positions are the block's).

Sparsemax and α-entmax cannot run here: their threshold τ_i needs every key of the row before
the first weight (several passes over all keys; each would be a ring of its own).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnx.core import implementations as impl_lib
from attnx.core import masks, score_mods, streaming
from attnx.core import problem as problem_lib
from attnx.core import residuals as residuals_lib
from attnx.core import scores as scores_lib
from attnx.core.contract import compute_dtype, nonfinite_inputs
from attnx.core.implementations import Implementation, RingProblem
from attnx.core.kernels import common
from attnx.core.kernels.xla import sweep
from attnx.core.parallel import layout as ring_layout
from attnx.core.parallel import steps, stick_zigzag
from attnx.core.parallel.layout import LAYOUTS, ring_work, zigzag_permute, zigzag_unpermute
from attnx.core.weightings import get_weighting

Array = jax.Array
F32 = jnp.float32

__all__ = ["LAYOUTS", "PASS_BUDGET", "ring_attention", "ring_work", "zigzag_permute",
           "zigzag_unpermute"]



# --------------------------------------------------------------------------------------------
# The ring: forward, backward, custom VJP.
# --------------------------------------------------------------------------------------------

def _forward(rc: steps.RingConfig, q, k, v, bias, mask, rsc, scale, mod=None, sinks=None):
  """(out [X, G, T, Hv] in the compute dtype, row statistics, stick-breaking's (O, L) of the
  later run). ``mod``: the pass' (ScoreMod, first query head) or None; ``sinks``: the pass'
  sinks [hq] or None, folded into the rows' first state."""
  p, hv = rc.p, v.shape[-1]
  i = lax.axis_index(rc.axis)
  rows = q.shape[:2] + (rc.t,)
  two_runs = rc.reverse

  def body(r, c):
    travel, low, high = c
    src = (i - r) % p
    # The next shard's transfer is issued before this step's work, which does not depend on
    # it, so XLA may overlap them (at the last step it is not used).
    after = lax.ppermute(travel, rc.axis, steps.perm(p)) if p > 1 else travel
    kv, b, m = steps.step_inputs(rc, travel, bias, mask, src)
    smod = steps.step_mod(rc, mod, src)
    run = lambda kind: (lambda: steps.kind_state(rc, ring_layout.PIECES[kind], q, kv, b, m,
                                                 rsc, scale, hv, smod))
    part = steps.part(rc, steps.switch(rc, i, src, run, mask=m))
    if not two_runs:
      return after, steps.merge_parts(rc, low, part), high
    # Shards i, i−1, …, 0 and then P−1, …, i+1 each come before the previous one: two runs,
    # each merged behind the part of the keys after it.
    later = src > i
    acc = steps.select(later, high, low)
    merged = steps.merge_parts(rc, acc, part)
    return after, steps.select(later, low, merged), steps.select(later, merged, high)

  first = steps.part(rc, steps.empty(rc, rows, hv) if sinks is None
                     else steps.sink_state(rc, sinks, rows, hv, rsc))
  init = (steps.travelling_arrays(rc, k, v, bias, mask), first,
          steps.part(rc, steps.empty(rc, rows, hv)))
  _, low, high = lax.fori_loop(0, p, body, init)
  out, res = steps.merge_parts(rc, high, low) if two_runs else low
  return out, residuals_lib.to_stats(rc.w, res), high if two_runs else None


def _backward(rc: steps.RingConfig, res, do, mod=None, sinks=None):
  """(dq, dk, dv, dbias, d row scales, dscale) of a pass, and with a score modification or
  sinks (``mod``, ``sinks`` as in :func:`_forward`) d(its parameters) and d sinks [hq]."""
  q, k, v, bias, mask, rsc, scale, out, stats, extra = res
  p = rc.p
  i = lax.axis_index(rc.axis)
  do = do.astype(rc.dtype)
  rows = q.shape[:3]
  two_runs = rc.reverse
  zero_rows = steps.zeros(rc, rows)
  # Carries of the whole-row backward. SSMax: dc, summed over every shard. Stick-breaking, run
  # from the later keys backwards: the run of shards after i (high) starts empty, the run of
  # shards up to i (low) starts after all of them: with their L and Σ A·dP = dO·O_high.
  if two_runs:
    low_c = extra  # (L, Σ A·dP) of the later run: steps.start_carries
    high_c = (zero_rows, zero_rows)
  else:
    low_c = high_c = (zero_rows, zero_rows)
  dbias_local = None
  if bias is not None and rc.bias_kind != "travel":
    dbias_local = steps.zeros(rc, bias.shape)

  def bias_home(dbias_local, db, tgrad_b, src):
    """Adds a step's bias gradient where it belongs: the local bias (broadcast S axis, or
    the visiting shard's columns of the whole S axis) or the travelling accumulator."""
    if db is None:
      return dbias_local, tgrad_b
    if rc.bias_kind == "travel":
      return dbias_local, tgrad_b + db
    if rc.bias_kind == "rows":
      return steps.add_at(dbias_local, db, 4, src * rc.s), tgrad_b
    return dbias_local + db, tgrad_b

  def body(r, c):
    travel, tgrads, (dq, dscale, dbias_local, low_c, high_c, *dmod) = c
    src = (i - r) % p
    after = lax.ppermute(travel, rc.axis, steps.perm(p)) if p > 1 else travel
    kv, b, m = steps.step_inputs(rc, travel, bias, mask, src)
    later = src > i if two_runs else False
    carries = steps.select(later, high_c, low_c) if two_runs else low_c
    smod = steps.step_mod(rc, mod, src)
    run = lambda kind: (lambda c: steps.kind_grads(rc, ring_layout.PIECES[kind], q, kv, b, m,
                                                   rsc, scale, out, stats, do, c, smod))
    gq, (gk, gv), db, carries, gs, *gm = steps.switch(rc, i, src, run, carries, mask=m)
    dmod = jax.tree.map(jnp.add, dmod, gm)
    if two_runs:
      low_c, high_c = steps.select(later, low_c, carries), steps.select(later, carries, high_c)
    else:
      low_c = carries
    dk, dv, dbt = tgrads
    dbias_local, dbt = bias_home(dbias_local, db, dbt, src)
    tgrads = (dk + gk, dv + gv, dbt)
    # The visiting shard's dK/dV go on with it; after P hops they are home.
    if p > 1:
      tgrads = lax.ppermute(tgrads, rc.axis, steps.perm(p))
    return after, tgrads, (dq + gq, dscale + gs, dbias_local, low_c, high_c, *dmod)

  tgrads = (steps.zeros(rc, k.shape), steps.zeros(rc, v.shape),
            steps.zeros(rc, bias.shape) if rc.bias_kind == "travel" else None)
  acc = (steps.zeros(rc, q.shape), steps.zeros(rc, ()), dbias_local, low_c, high_c)
  if mod is not None:
    acc += (jax.tree.map(lambda x: steps.zeros(rc, x.shape), mod[0].params),)
  init = (steps.travelling_arrays(rc, k, v, bias, mask), tgrads, acc)
  _, tgrads, acc = lax.fori_loop(0, p, body, init)
  dk, dv, dbias_t = tgrads
  dq, dscale, dbias_local, low_c, _, *dmod = acc
  dbias = dbias_t if rc.bias_kind == "travel" else dbias_local
  dsinks = None
  if sinks is not None:  # the sink, a key of every row: from the rows' statistics
    dsinks, low_c = steps.sink_grads(rc, sinks, out, stats, do, low_c, rsc)
  drsc = low_c[0] if rc.needs_row_scale else None
  if mod is None and sinks is None:
    return dq, dk, dv, dbias, drsc, dscale
  return dq, dk, dv, dbias, drsc, dscale, dmod[0] if dmod else None, dsinks


# --------------------------------------------------------------------------------------------
# Passes over head groups: the custom VJP.
# --------------------------------------------------------------------------------------------

def _heads(x: Array | None, lo: Any, size: int) -> Array | None:
  """Heads [lo, lo + size) of a [Bb, Nb, ...] bias/mask/row array (all of a broadcast one)."""
  if x is None or x.shape[1] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, lo, size, axis=1)


def _pass_inputs(rc: steps.RingConfig, c: Any, qd, kd, vd, bias4, mask4, rsc):
  """The kernel-layout inputs of pass c (kv heads [c·kc, (c+1)·kc), query heads with them):
  q [X, G, t, H], k/v [X, s, H], bias/mask [Bb, Kb, Gb, t|1, s|1], row scales [X, G, t].

  The contract's input step (:func:`~attnx.core.contract.nonfinite_inputs`) runs here, on
  the pass' heads: on the whole inputs it would keep a cleaned copy of each (O(T/P) per
  input, for the whole backward); :func:`_clean_grads` is its gradient."""
  b, kc, g = rc.head_dims
  hq = kc * g
  q, k, v, bias = nonfinite_inputs(lax.dynamic_slice_in_dim(qd, c * hq, hq, axis=2),
                                   lax.dynamic_slice_in_dim(kd, c * kc, kc, axis=2),
                                   lax.dynamic_slice_in_dim(vd, c * kc, kc, axis=2),
                                   _heads(bias4, c * hq, hq))
  kv = lambda x: x.transpose(0, 2, 1, 3).reshape(b * kc, x.shape[1], x.shape[3])
  q4 = q.transpose(0, 2, 1, 3).reshape(b * kc, g, rc.t, q.shape[3])
  r3 = None if rsc is None else _heads(rsc, c * hq, hq).reshape(b * kc, g, rc.t)
  if isinstance(mask4, steps.MaskRows):  # its steps evaluate the pass' heads
    mask = steps.MaskRows(mask4.mask, c * hq, hq)
  else:
    mask = common.as_5d(_heads(mask4, c * hq, hq), hq, kc, "mask")
  return (q4, kv(k), kv(v), common.as_5d(bias, hq, kc, "bias"), mask, r3)


def _clean_grads(qd, kd, vd, bias4, dq, dk, dv, dbias):
  """The gradients through :func:`~attnx.core.contract.nonfinite_inputs`: zero at the entries
  it replaces (a non-finite q or k entry, every k entry of a key with a non-finite value, a
  non-finite value entry, a bias of +Inf), passed through elsewhere."""
  k_ok = jnp.isfinite(kd) & jnp.all(jnp.isfinite(vd), axis=-1, keepdims=True)
  dq = jnp.where(jnp.isfinite(qd), dq, 0)
  dk = jnp.where(k_ok, dk, 0)
  dv = jnp.where(jnp.isfinite(vd), dv, 0)
  if dbias is not None and jnp.issubdtype(bias4.dtype, jnp.floating):
    dbias = jnp.where(bias4 == jnp.inf, 0, dbias)
  return dq, dk, dv, dbias


def _pass_rows(rc: steps.RingConfig, c: Any, x: Array) -> Array:
  """Query heads of pass c of a [B, t, N, D] array, in the kernel layout [X, G, t, D]."""
  b, kc, g = rc.head_dims
  x = lax.dynamic_slice_in_dim(x, c * kc * g, kc * g, axis=2)
  return x.transpose(0, 2, 1, 3).reshape(b * kc, g, rc.t, x.shape[3])


def _put_heads(full: Array, part: Array, lo: Any, axis: int) -> Array:
  return lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), lo, axis=axis)


_PLAIN_DOTS = (scores_lib.get_score("dot"), scores_lib.get_score("scaled_dot"))


def _step_implementation(chosen: Implementation | tuple[Implementation, ...],
                         ring: RingProblem) -> Implementation:
  """The implementation whose kernels run every ring step: the explicit one (ValueError with
  its :meth:`~attnx.core.implementations.Implementation.ring_reason` when it cannot), or for
  the automatic choice the first of ``chosen`` that does not decline the ring (Pallas where
  :func:`attnx.core.attention`'s automatic choice would take it, else blocked)."""
  if isinstance(chosen, tuple):
    return next(impl for impl in chosen if impl.ring_declines(ring) is None)
  why = chosen.ring_reason(ring)
  if why is not None:
    raise ValueError(why)
  return chosen


PASS_BUDGET = 1 << 19  # elements of one pass' query shard (B·t·heads·H) under the default


def _kv_heads_per_pass(block: int | None, b: int, kv_heads: int, g: int, length: int,
                       head_dim: int) -> int:
  """How many kv heads one pass of the ring carries: ``block`` when given (it must divide K),
  else the most whose query shard (B · length · kc·G · head dim) stays within
  :data:`PASS_BUDGET` elements (at least one)."""
  if block is not None:
    if (not isinstance(block, numbers.Integral) or isinstance(block, bool) or block < 1
        or kv_heads % block):
      raise ValueError(f"kv_head_block must be a positive int dividing the {kv_heads} kv "
                       f"heads, got {block!r}.")
    return int(block)
  fits = [d for d in range(1, kv_heads + 1)
          if kv_heads % d == 0 and b * length * d * g * head_dim <= PASS_BUDGET]
  return max(fits, default=1)


def _make_ring(rc: steps.RingConfig, passes: int, residual: bool = False):
  """A custom-VJP function (q [B, t, N, H], k/v [B, s, K, H|Hv], bias/mask [Bb, Nb, Tb, Sb],
  row scales [B, N, t], scale) -> O [B, t, N, Hv] of the local shards (see the module
  docstring for why the backward is not autodiff). ``rc`` describes one pass: its kv heads
  ``rc.head_dims[1]``, of ``passes`` passes that run one after another (``lax.scan``), each a
  whole ring over its heads, so that every ring buffer holds only the pass' heads.

  ``residual``: it returns (O, the rows' residual [B, t, N], :mod:`attnx.core.residuals`,
  from the statistics the passes save anyway) and takes the residual's cotangent g into the
  backward as one more value column: V gains a column of zeros whose output column is 1 and
  whose dO column is ∓g, which leaves every dP as it is and makes δ = dO·O into δ ∓ g — the
  fold of :func:`attnx.core.streaming.residual_delta` — in every step kernel unchanged."""

  forward = ((lambda rc, q, k, v, bias, mask, rsc, scale, mod=None, sinks=None:
              stick_zigzag.forward(rc, q, k, v, bias, mask, scale, mod))
             if rc.chunks_apart else _forward)
  backward = ((lambda rc, res, do, mod=None, sinks=None: stick_zigzag.backward(rc, res, do, mod))
              if rc.chunks_apart else _backward)
  b, kc, g = rc.head_dims
  hq = kc * g

  def bthd(x: Array) -> Array:  # [X, G, t, D] of one pass -> [B, t, hq, D]
    return x.reshape(b, hq, x.shape[2], x.shape[3]).transpose(0, 2, 1, 3)

  def pass_mods(c: Any, mod: Any, sinks: Array | None) -> dict[str, Any]:
    """The score modification (with the pass' first query head) and the sinks of pass c."""
    kw = {}
    if mod is not None:
      kw["mod"] = (mod, c * hq)
    if sinks is not None:
      kw["sinks"] = lax.dynamic_slice_in_dim(sinks.astype(rc.dtype), c * hq, hq)
    return kw

  def run(qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks):
    """(O [B, t, N, Hv] in q's dtype, per pass (row statistics, extra[, O in the compute
    dtype]))."""
    keep_f32 = qd.dtype != rc.dtype  # else O itself is the backward's compute-dtype output

    def one(out, c):
      o, stats, extra = forward(rc, *_pass_inputs(rc, c, qd, kd, vd, bias4, mask4, rsc),
                                scale, **pass_mods(c, mod, sinks))
      return _put_heads(out, bthd(o), c * hq, 2), (stats, extra, o if keep_f32 else None)

    out = sweep.vary(jnp.zeros(qd.shape[:3] + vd.shape[3:], qd.dtype), rc.vma)
    if passes == 1:
      out, saved = one(out, 0)
      return out, jax.tree.map(lambda x: x[None], saved)
    return lax.scan(one, out, jnp.arange(passes))

  def public_residual(saved):
    """The residual [B, t, N] from the passes' row statistics ([passes, X, G, t] each)."""
    heads = lambda x: (x.reshape(passes, b, hq, rc.t).transpose(1, 3, 0, 2)
                       .reshape(b, rc.t, passes * hq))
    return residuals_lib.from_stats(rc.w, tuple(heads(x) for x in saved[0]))

  @jax.custom_vjp
  def ring(qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks):
    out, saved = run(qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks)
    return (out, public_residual(saved)) if residual else out

  def fwd(qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks):
    out, saved = run(qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks)
    primal = (out, public_residual(saved)) if residual else out
    return primal, (qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks, out, saved)

  sign = residuals_lib.cotangent_sign(rc.w) if residual else 0.0

  def bwd(res, ct):
    if not residual:
      return grads(res, ct)
    do, dres = ct
    if sign == 0.0:  # the normalizer (n, or none) does not depend on the scores
      return grads(res, do)
    # One more value column: zeros in V, ones in O, sign·g in dO (see the docstring).
    qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks, out, (stats, extra, o32) = res
    col = lambda x, c: jnp.concatenate([x, jnp.full(x.shape[:-1] + (1,), c, x.dtype)], -1)
    extra = jax.tree.map(lambda x: col(x, 0.0) if x.ndim == 5 else x, extra)
    saved = (stats, extra, None if o32 is None else col(o32, 1.0))
    do = jnp.concatenate([do, (sign * dres)[..., None].astype(do.dtype)], -1)
    g = grads((qd, kd, col(vd, 0.0), bias4, mask4, rsc, scale, mod, sinks, col(out, 1.0),
               saved), do)
    return g[:2] + (g[2][..., :-1],) + g[3:]

  def grads(res, do):
    qd, kd, vd, bias4, mask4, rsc, scale, mod, sinks, out, saved = res
    head_bias = bias4 is not None and bias4.shape[1] != 1
    with_mods = mod is not None or sinks is not None

    def one(acc, xs):
      dq, dk, dv, dbias, drsc, dscale, *dextra = acc
      c, (stats, extra, o32) = xs
      inputs = _pass_inputs(rc, c, qd, kd, vd, bias4, mask4, rsc)
      o = _pass_rows(rc, c, out).astype(rc.dtype) if o32 is None else o32
      gq, gk, gv, gb, gr, gs, *gx = backward(rc, inputs[:6] + (scale, o, stats, extra),
                                             _pass_rows(rc, c, do), **pass_mods(c, mod, sinks))
      if with_mods:
        dmod, dsinks = dextra
        gm, g_sinks = gx
        if gm is not None:
          dmod = jax.tree.map(jnp.add, dmod, gm)
        if g_sinks is not None:
          dsinks = _put_heads(dsinks, g_sinks, c * hq, 0)
        dextra = [dmod, dsinks]
      dq = _put_heads(dq, bthd(gq), c * hq, 2)
      dk = _put_heads(dk, gk.reshape(b, kc, rc.s, -1).transpose(0, 2, 1, 3), c * kc, 2)
      dv = _put_heads(dv, gv.reshape(b, kc, rc.s, -1).transpose(0, 2, 1, 3), c * kc, 2)
      if gb is not None:
        gb = gb.reshape(gb.shape[0], -1, *gb.shape[3:])
        dbias = _put_heads(dbias, gb, c * hq, 1) if head_bias else dbias + gb
      if gr is not None:
        drsc = _put_heads(drsc, gr.reshape(b, hq, rc.t), c * hq, 1)
      return (dq, dk, dv, dbias, drsc, dscale + gs, *dextra), None

    zeros = lambda x, dtype: None if x is None else steps.zeros(rc, x.shape).astype(dtype)
    acc = (zeros(qd, qd.dtype), zeros(kd, kd.dtype), zeros(vd, vd.dtype),
           zeros(bias4, rc.dtype), zeros(rsc, rc.dtype), steps.zeros(rc, ()))
    if with_mods:
      acc += (None if mod is None else jax.tree.map(lambda x: zeros(x, rc.dtype), mod.params),
              zeros(sinks, rc.dtype))
    stats, extra, o32 = saved
    do_passes = (do.reshape(b, rc.t, passes, hq, -1).transpose(2, 0, 3, 1, 4)
                 .reshape(passes, b * kc, g, rc.t, -1).astype(rc.dtype))
    saved = (stats, jax.vmap(lambda e, d: steps.start_carries(rc, e, d))(extra, do_passes), o32)
    if passes == 1:
      acc, _ = one(acc, (0, jax.tree.map(lambda x: x[0], saved)))
    else:
      acc, _ = lax.scan(one, acc, (jnp.arange(passes), saved))
    dq, dk, dv, dbias, drsc, dscale, *dextra = acc
    dq, dk, dv, dbias = _clean_grads(qd, kd, vd, bias4, dq, dk, dv, dbias)

    def like(ct, x):
      """The cotangent of an input that does not vary over the ring's axis (a replicated
      scale or bias, with check_vma=True) is the sum of every device's."""
      missing = tuple(a for a in sweep.manual_axes(ct) if a not in sweep.manual_axes(x))
      return (lax.psum(ct, missing) if missing else ct).astype(x.dtype)

    dmod = dsinks = None
    if mod is not None:  # replicated parameters: summed over the devices, as the scale
      dmod = dataclasses.replace(mod, params=jax.tree.map(like, dextra[0], mod.params))
    if sinks is not None:
      dsinks = like(dextra[1], sinks)
    return (like(dq, qd), like(dk, kd), like(dv, vd),
            None if bias4 is None else like(dbias, bias4), None,
            None if rsc is None else like(drsc, rsc), like(dscale, scale), dmod, dsinks)

  ring.defvjp(fwd, bwd)
  return ring


# --------------------------------------------------------------------------------------------
# SSMax: the global count of valid keys per row.
# --------------------------------------------------------------------------------------------

def _valid_counts(rc: steps.RingConfig, bias4: Array | None, mask4: Array | None, b: int,
                  n: int) -> Array:
  """[B, N, T_local] float32: how many keys of the whole sequence each local row attends."""
  if rc.mask_kind == "structured":
    return _structured_counts(rc, bias4, mask4, b, n)
  p, t, s = rc.p, rc.t, rc.s
  i = lax.axis_index(rc.axis)
  qpos = ring_layout.positions(i, t, p, rc.layout)
  kpos = np.concatenate([ring_layout.positions(j, s, p, rc.layout, np) for j in range(p)])
  keys, rows, full = [], [], []
  for x, kind, is_bias in ((mask4, rc.mask_kind, False), (bias4, rc.bias_kind, True)):
    if x is None:
      continue
    valid = (x != -jnp.inf) if is_bias else x
    if kind == "const":
      rows.append(valid)
    elif kind == "travel":
      keys.append(lax.all_gather(valid, rc.axis, axis=3, tiled=True))
    else:
      full.append(valid)
  if full:
    valid = jnp.ones((1, 1, t, p * s), bool)
    for x in keys + rows + full:
      valid = valid & x
    if rc.is_causal:
      valid = valid & (jnp.asarray(kpos)[None, :] <= qpos[:, None])
    counts = jnp.sum(valid, axis=-1, dtype=F32)
  else:
    if keys:
      key = keys[0] if len(keys) == 1 else keys[0] & keys[1]
      if rc.is_causal:  # Σ_{j ≤ pos_i} valid_j from the natural order's running count
        natural = jnp.take(key, jnp.asarray(np.argsort(kpos)), axis=3).astype(F32)
        counts = jnp.take(jnp.cumsum(natural, axis=3)[:, :, 0], qpos, axis=2)
      else:
        counts = jnp.sum(key, axis=3, dtype=F32)  # [Bb, Nb, 1]
    else:
      counts = (qpos + 1).astype(F32) if rc.is_causal else jnp.full((t,), float(p * s), F32)
      counts = counts[None, None]
    for x in rows:
      counts = counts * x[..., 0].astype(F32)
  return jnp.broadcast_to(counts, (b, n, t))


def _structured_counts(rc: steps.RingConfig, bias4: Array | None, rows: steps.MaskRows,
                       b: int, n: int) -> Array:
  """:func:`_valid_counts` under a structured mask: shard by shard, one [t, s] block at a
  time (with the causal condition and a bias's −∞ entries)."""
  p, t, s = rc.p, rc.t, rc.s
  qpos = ring_layout.positions(lax.axis_index(rc.axis), t, p, rc.layout)
  finite = None if bias4 is None else bias4 != -jnp.inf
  if finite is not None and rc.bias_kind == "travel":
    finite = lax.all_gather(finite, rc.axis, axis=3, tiled=True)

  def shard(j, counts):
    valid = rows.block4(rc, j)
    if rc.is_causal:
      valid = valid & (ring_layout.positions(j, s, p, rc.layout)[None, :] <= qpos[:, None])
    if finite is not None:
      valid = valid & (finite if rc.bias_kind == "const"
                       else lax.dynamic_slice_in_dim(finite, j * s, s, axis=3))
    return counts + jnp.broadcast_to(jnp.sum(valid, axis=-1, dtype=F32), (b, n, t))

  return lax.fori_loop(0, p, shard, jnp.zeros((b, n, t), F32))


# --------------------------------------------------------------------------------------------
# Structured masks.
# --------------------------------------------------------------------------------------------

def _structured_rows(mask: masks.Mask, w: Any, bias4: Array | None, batch: tuple[int, ...],
                     n: int, t: int, s: int, p: int, layout: str, axis: Any,
                     dtype: Any) -> tuple[steps.MaskRows, Array | None]:
  """A structured mask (of the global sequence: ids and lengths of all P·T positions) on the
  local rows, evaluated step by step (:class:`~attnx.core.parallel.steps.MaskRows`), and the
  bias with the weighting's per-query shift for the keys of each query's sequence
  (:func:`attnx.core.problem.sequence_bias`: sigmoid's −log n)."""
  bound = mask.bind(batch, n, p * t, p * s)
  qpos = ring_layout.positions(lax.axis_index(axis), t, p, layout)
  m = steps.MaskRows(bound, 0, n)
  shift = getattr(w, "sequence_shift", None)
  counts = None if shift is None else bound.sequence_keys(p * t, p * s)
  if counts is not None:
    extra = lax.stop_gradient(shift(jnp.take(counts, qpos, axis=1), p * s).astype(dtype))
    extra = extra[:, None, :, None]
    if bias4 is not None and p > 1 and bias4.shape[2:] == (1, s):
      # A key padding bias travels with its shard; with a per-query shift it has both axes,
      # so it takes the whole S axis (its gradient goes back through the gather).
      bias4 = lax.all_gather(bias4, axis, axis=3, tiled=True)
    bias4 = extra if bias4 is None else bias4 + extra
  return m, bias4


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------

def _to_4d(x: Array | None, batch: tuple[int, ...], name: str) -> Array | None:
  """A [batch..., N|1, T|1, S|1]-broadcastable local bias/mask -> [B|1, N|1, T|1, S|1]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  full_rank = len(batch) + 3
  if x.ndim > full_rank:
    raise ValueError(f"{name} of local shape {x.shape} has more dims than [batch..., N, T, S].")
  x = x.reshape((1,) * (full_rank - x.ndim) + x.shape)
  lead = x.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(batch):])
  if any(d not in (1, b) for d, b in zip(lead, batch, strict=True)):
    raise ValueError(f"{name} of local shape {x.shape}: its batch dims must broadcast to "
                     f"{batch}.")
  x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
  return x.reshape((-1,) + x.shape[len(batch):])


def ring_attention(q: Array, k: Array, v: Array, bias: Array | None = None,
                   mask: Array | None = None, *, axis_name: Any, weighting: Any = "softmax",
                   score: Any = "scaled_dot", scale: float | Array | None = None,
                   score_params: dict[str, Any] | None = None,
                   weighting_params: dict[str, Any] | None = None, is_causal: bool = False,
                   layout: str = "contiguous", block_q: int | None = None,
                   block_k: int | None = None, kv_head_block: int | None = None,
                   implementation: str | Implementation | None = None,
                   pallas_backend: str | None = None, interpret: bool = False,
                   logits_soft_cap: float | None = None, score_mod: Any = None,
                   score_mod_params: Any = None, sinks: Array | None = None,
                   return_residual: bool = False) -> Array | tuple[Array, Array]:
  """Attention over a sequence sharded along mesh axis ``axis_name``: call it inside
  ``jax.shard_map`` (``check_vma`` either way) on the local shards.

  Args:
    q: the local queries ``[batch..., T/P, N, H]`` (P = ``lax.axis_size(axis_name)``).
    k: the local keys ``[batch..., S/P, K, H]``; N a multiple of K (GQA).
    v: the local values ``[batch..., S/P, K, Hv]``.
    bias, mask: as in :func:`attnx.core.attention` (additive; boolean, True = attend), local
      shards whose T axis is 1 or sharded with q and whose S axis is 1, sharded with k (then
      T must be 1: a key padding mask, which travels with K/V) or the whole S in the layout's
      order (see the module docstring). ``mask`` may also be a structured mask
      (:mod:`attnx.core.masks`) of the whole sequence — ids and lengths of all P·T positions,
      replicated — evaluated by each step at the global positions of the local rows and of
      the visiting shard's keys (one [t, S] block at a time, never the rows against every
      key: :class:`~attnx.core.parallel.steps.MaskRows`); a step whose shards it lets meet
      in no pair is
      skipped (:func:`ring_work` with ``mask=`` counts the work left); sigmoid's n is then
      each query's own sequence, as in :func:`attnx.core.attention`.
    axis_name: the mesh axis the sequence is sharded over.
    weighting: F, as in :func:`attnx.core.attention`: every pointwise weighting, and the
      whole-row ``ssmax``, ``softpick`` and ``stick_breaking``. Sparsemax and α-entmax raise
      a ValueError naming the alternatives.
    score, scale, score_params, weighting_params: as in :func:`attnx.core.attention` (every
      score with a dot-product form; ``weighting_params={"s": s}`` for SSMax).
    is_causal: query i attends keys j ≤ i of the global sequence (needs T = S).
    layout: how the global sequence is laid out over the devices: ``"contiguous"`` (device i
      holds positions [i·T/P, (i+1)·T/P)) or ``"zigzag"`` (:func:`zigzag_permute`: 2P chunks,
      device i holds chunks i and 2P − 1 − i, which balances causal work: :func:`ring_work`).
      Without ``is_causal`` it changes nothing but which positions the outputs belong to.
    block_q, block_k: deprecated (removed in the next release; a DeprecationWarning): the
      caps on the step kernel's tiles, now ``core.Blocked(block_q=...)`` /
      ``core.Pallas(block_q=...)`` (the tiles divide the local lengths).
    kv_head_block: kv heads per pass (a divisor of K; their query heads go with them): the
      ring runs once per pass, and its buffers hold only the pass' heads. None: as many as
      keep a pass' query shard (B · T/P · heads · H) within :data:`PASS_BUDGET` elements, one
      at least. More heads per pass: fewer, larger transfers and kernels; fewer: less memory.
    implementation: the kernel of every ring step, an implementation object with its settings
      or its name: ``core.Blocked(block_q=..., block_k=...)`` / ``"blocked"`` (attnx's XLA
      blocked kernel), ``core.Pallas(block_q=..., block_k=..., interpret=...)`` /
      ``"pallas"`` (the Pallas kernels, :mod:`attnx.core.kernels.pallas.block`: Triton on a
      GPU, Mosaic on a TPU) or None: Pallas where the automatic choice of
      :func:`attnx.core.attention` would take it for this weighting, dtype and head size on
      ``jax.default_backend()`` (a GPU or TPU, a verified combination:
      :func:`attnx.core.kernels.pallas.verify.decline_reason`) and the inputs are not typed by
      ``check_vma=True`` (the Pallas kernels' outputs carry no varying axes yet), else blocked.
    pallas_backend: ``"gpu"`` or ``"tpu"``: the Pallas kernels to build (to lower for a chip
      from another host); None: ``jax.default_backend()``'s.
    interpret: deprecated (removed in the next release; a DeprecationWarning): now
      ``core.Pallas(interpret=True)``, the Pallas kernels in Pallas' interpreter.
    logits_soft_cap, score_mod, score_mod_params: as in :func:`attnx.core.attention` (a soft
      cap c > 0; FlexAttention's ``fn(score, b, h, q_idx, kv_idx, params)`` or a
      :class:`~attnx.core.score_mods.ScoreMod` such as ``core.alibi(slopes)``, with
      replicated parameters that get gradients), applied by every step's kernel per tile:
      ``q_idx``/``kv_idx`` are positions in the whole sequence of P·T/P positions in its
      natural order (for ``layout="zigzag"`` each chunk's own, as in
      :func:`zigzag_permute`'s input), ``h`` the query head and ``b`` the flat batch index,
      so ALiBi or a relative-position table give the result of :func:`attnx.core.attention`
      on the unsharded sequence. For every weighting the ring runs (stick-breaking too).
    sinks: attention sinks ``[N]``, replicated, as in :func:`attnx.core.attention`: a virtual
      key of score ``sinks[h]`` and zero value in every row (counted once per row: folded
      into each device's first row state; SSMax counts it in n_i), with a gradient. For the
      weightings that divide by a sum (pointwise F with ``normalization="sum"``, SSMax,
      softpick); a ValueError for the others (stick-breaking, ``"length"``, ``"none"``).
      The Pallas steps run ``logits_soft_cap``, sinks, ALiBi and relative tables, not a
      user's ``score_mod``
      function (an explicit ``implementation="pallas"`` raises a ValueError naming it);
      with any of them the automatic choice takes the XLA steps (Pallas' self-check does not
      cover them).
    return_residual: also return the local rows' residual ``[batch..., T/P, N]`` over the
      whole sequence (:mod:`attnx.core.residuals`: for softmax the log-sum-exp, as
      :func:`attnx.core.attention` returns it), with a gradient: one ring's output merges
      with attention over more keys (a cache, another sequence axis) by
      :func:`attnx.core.merge_attention`.

  Returns:
    The local output ``[batch..., T/P, N, Hv]`` in q's dtype: the rows of the global attention
    this device holds (with ``return_residual``: and their residual).

  Raises:
    ValueError: outside a map over ``axis_name``, an unknown
      layout, shapes that do not split (causal needs equal local T and S, zigzag even ones;
      tiles divide the local lengths, which must not leave tiles of a few rows), a bias/mask
      sharded otherwise than documented, a weighting that cannot stream (sparsemax, entmax:
      the message names the alternatives), a user's ``score_mod`` function with the Pallas
      steps (or ALiBi/a table on kernels without relative tables), or the
      checks of :func:`attnx.core.attention` (among them a cap ≤ 0, sinks not
      of shape [N], sinks for a weighting without a sum: stick-breaking, ``"length"``,
      ``"none"``).

  Example:
    A causal ring over every device (one on a plain CPU: the ring then has one step); the
    result equals single-device attention:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from attnx import core
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q, k, v = (jax.random.normal(key, (2, 16 * n, 4, 8)) for key in (kq, kk, kv))
    >>> ring = jax.shard_map(
    ...     lambda q, k, v: core.ring_attention(q, k, v, axis_name="sp", is_causal=True),
    ...     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    >>> out = ring(q, k, v)  # [2, 16 n, 4, 8], sharded over "sp"
    >>> bool(jnp.allclose(out, core.attention(q, k, v, is_causal=True), atol=1e-3))
    True
  """
  p = steps.axis_size(axis_name)
  ring_layout.check_layout(layout)
  return_residual = problem_lib.check_flag("return_residual", return_residual)
  settings = impl_lib.legacy_settings("ring_attention", block_q=block_q, block_k=block_k,
                                      interpret=interpret)
  chosen = impl_lib.configure(implementation, settings, "ring_attention")
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  sc = scores_lib.get_score(score)
  problem_lib.check_inputs(q, k, v, None, None, sc)
  w, sc, params, scale = problem_lib.resolve(weighting, score, scale, score_params, q.shape[-1])
  family = check_supported(w, sc, layout)
  batch = q.shape[:-3]
  t, n, h = q.shape[-3:]
  mod = problem_lib.score_modification(logits_soft_cap, score_mod, score_mod_params, q)
  sinks = problem_lib.check_sinks(sinks, w, n, q.dtype)
  s, kv_heads = k.shape[-3], k.shape[-2]
  if is_causal and t != s:
    raise ValueError(f"causal ring attention needs as many local queries as keys (T = S), "
                     f"got T/P = {t}, S/P = {s}.")
  if layout == "zigzag" and is_causal and t % 2:
    raise ValueError(f"the zigzag layout holds two chunks per device: the local length {t} "
                     f"must be even (the global length a multiple of 2·P = {2 * p}).")
  stream = steps.stream_of(w)
  if layout == "zigzag" and stream is not None and stream.reverse and s % 2:
    raise ValueError(f"{family} in the zigzag layout sends the two chunks of a shard "
                     f"around the ring apart: the local key length {s} must be even.")
  ssmax_s = w.kernel_args(problem_lib.check_weighting_params(w, weighting_params, n)).get(
      "ssmax_s")
  structured = None
  if isinstance(mask, masks.Mask):
    structured, mask = mask, None
  if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = attend), got dtype "
                     f"{jnp.asarray(mask).dtype}.")
  bias4 = _to_4d(bias, batch, "bias")
  mask4 = _to_4d(mask, batch, "mask")
  if structured is not None:
    mask4, bias4 = _structured_rows(structured, w, bias4, batch, n, t, s, p, layout,
                                    axis_name, jnp.result_type(q.dtype, jnp.float32))
  for name, x in (("bias", bias4), ("mask", None if structured is not None else mask4)):
    if x is not None and x.shape[1] not in (1, n):
      raise ValueError(f"{name} of local shape {x.shape} has {x.shape[1]} heads, expected "
                       f"{n} or 1.")
  b = int(np.prod(batch)) if batch else 1
  rc = steps.RingConfig(axis=axis_name, p=p, layout=layout, is_causal=bool(is_causal), w=w,
                        family=family, t=t, s=s, head_dims=(b, kv_heads, n // kv_heads),
                        bias_kind=steps.kind_of(bias4, t, s, p, "bias"),
                        mask_kind=("structured" if structured is not None
                                   else steps.kind_of(mask4, t, s, p, "mask")),
                        vma=sweep.manual_axes(q, k, v, bias4,
                                           None if structured is not None else mask4,
                                           lax.axis_index(axis_name)),
                        skip_empty_steps=structured is not None, score_mod=mod is not None,
                        sinks=sinks is not None)
  g = n // kv_heads
  kc = _kv_heads_per_pass(kv_head_block, b, kv_heads, g, max(t, s),
                          max(q.shape[-1], v.shape[-1]))
  given = (("logits_soft_cap", logits_soft_cap), ("score_mod", score_mod), ("sinks", sinks))
  ring = RingProblem(w, jnp.result_type(q.dtype, k.dtype, v.dtype), q.shape[-1], v.shape[-1],
                     typed_vma=bool(rc.vma), backend=pallas_backend,
                     modifications=tuple(name for name, x in given if x is not None),
                     score_mod_kind=score_mods.kind(mod))
  impl = _step_implementation(chosen, ring)
  block_q, block_k = impl.block_sizes
  rc = dataclasses.replace(rc, head_dims=(b, kc, g), block_q=block_q, block_k=block_k,
                           kernel=impl.ring_kernel(ring))
  if t == 0 or s == 0:
    out = jnp.zeros(batch + (t, n, v.shape[-1]), q.dtype)
    return ((out, residuals_lib.empty_residual(w, batch + (t, n), compute_dtype(q.dtype)))
            if return_residual else out)
  steps.check_tiles(rc)

  query, key, value = q, k, v
  if sc not in _PLAIN_DOTS:  # the score's own vectors: from inputs the contract has cleaned
    query, key, value, _ = nonfinite_inputs(q, k, v, None)
  qd, kd = sc.to_dot(query, key, **params)
  compute = jnp.result_type(qd.dtype, kd.dtype, value.dtype)
  flat = lambda x: x.astype(compute).reshape((b,) + x.shape[len(batch):])
  qd, kd, value = flat(qd), flat(kd), flat(value)
  rc = dataclasses.replace(rc, dtype=compute_dtype(compute))  # float64 inputs: float64
  rsc = None
  if rc.needs_row_scale:
    sv = jnp.asarray(w.stream.s if ssmax_s is None else ssmax_s, rc.dtype)
    if sv.ndim:
      sv = jnp.broadcast_to(sv.reshape(-1), (n,))[None, :, None]
    counts = _valid_counts(rc, bias4, mask4, b, n)
    if sinks is not None:  # the sink is one more key of every row
      counts = counts + 1
    rsc = streaming.row_scale(w.stream, counts, sv, rc.dtype)
  out = _make_ring(rc, kv_heads // kc, return_residual)(qd, kd, value, bias4, mask4, rsc,
                                                        jnp.asarray(scale, rc.dtype), mod, sinks)
  if not return_residual:
    return out.reshape(batch + out.shape[1:]).astype(q.dtype)
  out, residual = out
  return (out.reshape(batch + out.shape[1:]).astype(q.dtype),
          residual.reshape(batch + residual.shape[1:]))


def check_supported(weighting: Any = "softmax", score: Any = "scaled_dot",
                    layout: str = "contiguous") -> str:
  """The streaming family :func:`ring_attention` runs ``weighting`` with (``"pointwise"``,
  ``"ssmax"``, ``"softpick"``, ``"stick_breaking"``); a ValueError naming the alternatives
  when the weighting, the score or the layout cannot run ring-parallel. For checks at
  construction (``attnx.nn``), before any shard_map."""
  ring_layout.check_layout(layout)
  family = steps.family_of(get_weighting(weighting))
  sc = scores_lib.get_score(score)
  if sc.to_dot is None:
    raise ValueError(f"Score {sc.name!r} is not a dot product of transformed vectors and "
                     "cannot stream: ring_attention needs one (every built-in score but "
                     "'additive').")
  return family
