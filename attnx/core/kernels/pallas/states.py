"""Raw streaming states from the Pallas kernels' normalized outputs.

A Pallas forward over a block of keys returns a *normalized* output and a row statistic; the
raw state of the block (what :mod:`attnx.core.streaming` merges between key blocks) is
recovered exactly from them, in XLA's units, so that blocks computed by the Pallas kernels
merge with each other and with XLA blocks and are normalized once:

* online max (softmax-like): m = lse (the kernel's log2-sum-exp times ln 2), l = 1, acc = O;
* ``"sum"``: l = the normalizer Σ F, acc = O·l (Σ F rides in acc's last column, as in XLA);
* ``"length"``: acc = O·n with n the block's valid-key count; ``"none"``: acc = O;
* SSMax: the online max's rule on its c_i-scaled scores (m = lse, l = 1, acc = O);
* softpick: e^{lse} = Σ|eᶻ − 1|, so m = max(lse, 0), l = e^{lse − m}, acc = O·l;
* stick-breaking: O and L = Σ log(1 − β) are the raw state already.

A row whose every key is masked in the block (lse = +∞, or a normalizer of 0) becomes an empty
state: it may have keys in other blocks. Used by the ring's Pallas steps (:mod:`.block`) and
split-KV decoding (:mod:`.split`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import streaming
from attnx.core.weightings import Pointwise

Array = jax.Array
F32 = jnp.float32
LN2 = math.log(2.0)

__all__ = ["block_weighting", "pointwise_state", "row_state"]


def block_weighting(w: Any) -> Any:
  """The weighting a block's kernel runs: without the terms that belong to the whole row
  (softmax_plus_one's denominator offset, softpick's ε: its ``block_stream``), which the
  finalize after the merge adds once."""
  if isinstance(w, Pointwise):
    return dataclasses.replace(w, denominator_offset=0.0) if w.denominator_offset else w
  rs = w.stream
  return w if rs.block_stream is rs else dataclasses.replace(w, stream=rs.block_stream)


def pointwise_state(w: Pointwise, o: Array, stat: Array, counted: bool, s: int
                    ) -> tuple[Array, Array]:
  """The raw state (acc, st) in XLA's units of a pointwise F's Pallas forward over a block of
  keys, from its normalized output ``o`` [..., Hv] float32 and row statistic ``stat`` [...]
  (any matching leading dims). ``counted``: whether the kernel counted the valid keys
  (``"length"``; otherwise it divided by F's key count, and every one of the block's ``s``
  keys counts)."""
  if w.online_max:  # m = lse (natural units of α·s), l = 1
    empty = stat == jnp.inf
    acc = jnp.concatenate([o, jnp.ones(o.shape[:-1] + (1,), F32)], axis=-1)
    return jnp.where(empty[..., None], 0.0, acc), jnp.where(empty, -jnp.inf, stat * LN2)
  zero = jnp.zeros(stat.shape, F32)
  if w.unnormalized:
    return o, zero
  acc = o * stat[..., None]  # the kernel's normalizer (0 for an empty row, whose O is 0)
  if w.divides_by_sum:
    return jnp.concatenate([acc, stat[..., None]], axis=-1), zero
  # "length": the kernel counted the valid keys unless no key could be invalid (then it
  # divided by F's key count, the whole problem's): every key of the block counts.
  return acc, stat if counted else jnp.full(stat.shape, float(s), F32)


def row_state(rs: Any, o: Array, lse: Array) -> Any:
  """The streaming state (``MaxState`` of SSMax and softpick, ``StickState`` of
  stick-breaking) of a whole-row family's Pallas forward over a block of keys, from its
  normalized output ``o`` [..., Hv] float32 and first row statistic ``lse`` [...] (any
  matching leading dims)."""
  if rs.output_is_state:  # stick-breaking's (Σ A·v, L)
    return streaming.StickState(o, lse)
  empty = lse == jnp.inf  # no valid key in the block (softpick: or no weight)
  zero = jnp.zeros(lse.shape, F32)
  if rs.max_start == -jnp.inf:  # an online max with no floor (SSMax): m = lse, l = 1
    return streaming.MaxState(jnp.where(empty[..., None], 0.0, o), jnp.where(empty, 0.0, 1.0),
                              jnp.where(empty, -jnp.inf, lse))
  # m never below its start (softpick: e^{lse} = Σ|eᶻ − 1|, ε = 0, m ≥ 0); l = e^{lse − m}.
  m = jnp.where(empty, rs.max_start, jnp.maximum(lse, rs.max_start))
  l = jnp.where(empty, zero, jnp.exp(lse - m))
  return streaming.MaxState(o * l[..., None], l, m)
