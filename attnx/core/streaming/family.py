"""What a whole-row family is to a kernel: :class:`Family`, its functions on one tile and the
traits a kernel asks instead of its name, and :class:`GradCarry`, the per-row sums its backward
carries across key tiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from attnx.core.streaming.ops import Array


@dataclasses.dataclass(frozen=True)
class Family:
  """The streaming rules of one family of whole-row weightings (a :class:`RowStream`'s
  ``family``), as functions of that stream ``rs`` and one tile (the interface of
  :mod:`attnx.core.streaming`, whose module-level functions call these):

  * ``init(rs, rows, hv, dtype)``: the state of rows that have seen no key;
  * ``update(rs, state, z, valid, v, ctx, ops)``: the state after one more key tile;
  * ``merge(rs, a, b)``: the state of two disjoint key ranges (``a`` the later keys if
    ``reverse``);
  * ``finalize(rs, state, ctx)``: (output, row statistics, Σu·v/Σu or None);
  * ``tile_grad(rs, z, valid, dp, stats, delta, carry, ctx, ops, weights_dtype)``: (weights,
    dz, :class:`GradCarry`) of one tile.

  Traits (their meaning in full on the :class:`RowStream` properties of the same names):

  Attributes:
    name: the family's name, ``RowStream.family``.
    num_stats: how many [rows] statistics ``finalize`` returns.
    reverse: key tiles are visited from the last key backwards, and ``merge`` takes the
      later keys first.
    needs_row_scale: ``ctx`` is the per-row scale c_i = s·log n_i (SSMax).
    needs_threshold: ``ctx`` is the per-row threshold τ_i, found by passes over every key of
      the row before the output pass (sparsemax/entmax).
    saves_support_mean: ``finalize`` also returns Σu·v/Σu, which the backward needs.
    suffix_carries: the backward of a key tile needs the carries of the keys after it.
    output_is_state: ``finalize`` returns the raw state as it is.
    max_start: the running max of an empty :class:`MaxState`, or None (no running max).
    row_terms: the :class:`RowStream` parameters that belong to the whole row, added once by
      ``finalize`` after a merge (softpick's ε): a key block's stream holds them at 0.
    takes_sinks: an attention sink (a virtual key of zero value) means something: the weights
      share a sum over the row's keys that the sink's score enters. False for stick-breaking,
      whose unassigned stick is already its own sink.
  """

  name: str
  init: Callable[..., Any]
  update: Callable[..., Any]
  merge: Callable[..., Any]
  finalize: Callable[..., tuple[Any, ...]]
  tile_grad: Callable[..., tuple[Any, ...]]
  num_stats: int = 1
  reverse: bool = False
  needs_row_scale: bool = False
  needs_threshold: bool = False
  saves_support_mean: bool = False
  suffix_carries: bool = False
  output_is_state: bool = False
  max_start: float | None = None
  row_terms: tuple[str, ...] = ()
  takes_sinks: bool = True


class GradCarry(NamedTuple):
  """Per-row sums the backward carries across key tiles (zeros where a family has none)."""
  a: Array  # stick-breaking: L of the keys visited; SSMax: dc = Σ z·dy
  b: Array  # stick-breaking: Σ A·dP over the keys visited


__all__ = ["Family", "GradCarry"]
