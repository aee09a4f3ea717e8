"""A benchmark's ratio columns as a table of data: each :class:`Ratio` divides a row's value by
that of its reference row — the row that agrees with it on some cells and has given values in
others — and :func:`add_ratios` writes them into the rows.

For example, a speed-up over jax.nn's softmax at the same shape, mode and causality::

    Ratio("speed-up vs jax.nn", same=("shape", "mode", "causal", "mask"),
          reference=dict(impl="jax.nn (xla)", weighting="softmax"), invert=True)

Rows are dicts of cells (:mod:`attnx.train.benchmark.runner`'s). :func:`fields` is what
ratios and targets (:mod:`attnx.train.benchmark.targets`) read of a row: its cells, with
``causal`` False, ``mask`` "" and ``score`` "scaled_dot" where a row has none, and derived from
them ``T`` (the sequence length of a ``shape`` "BxTxNxH"), ``family`` (its weighting's name without
parameters) and ``causality`` ("causal" or "full").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attnx.core import weightings as wlib

Row = dict[str, Any]
DEFAULTS = {"causal": False, "mask": "", "score": "scaled_dot"}


def fields(row: Mapping[str, Any]) -> dict[str, Any]:
  """The cells of ``row`` with :data:`DEFAULTS` and the derived ``T``, ``family`` and
  ``causality`` (see the module docstring)."""
  out = {**DEFAULTS, **row}
  out["causal"] = bool(out["causal"])
  out["mask"] = out["mask"] or ""
  out["causality"] = "causal" if out["causal"] else "full"
  parts = out["shape"].split("x") if isinstance(out.get("shape"), str) else []
  if "T" not in out and len(parts) == 4 and parts[1].isdigit():
    out["T"] = int(parts[1])
  if isinstance(out.get("weighting"), str):
    out["family"] = wlib.parse_weighting_name(out["weighting"])[0]
  return out


def matches(f: Mapping[str, Any], where: Mapping[str, Any]) -> bool:
  """Whether the fields ``f`` satisfy ``where``: each of its values equals the field, or, if it
  is callable, returns true for the field's value (None when absent)."""
  for key, want in where.items():
    got = f.get(key)
    if not (want(got) if callable(want) else got == want):
      return False
  return True


def lookup(rows: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> dict[tuple, Row]:
  """{(the fields ``keys`` of a row): row} (the last row wins a shared key)."""
  return {tuple(f.get(k) for k in keys): r for r, f in ((r, fields(r)) for r in rows)}


@dataclasses.dataclass(frozen=True)
class Ratio:
  """One ratio column (see the module docstring).

  ``column``: the cell written; ``same``: the fields a row and its reference row share;
  ``reference``: the reference row's other fields, each a value or a function of the row's
  fields; ``where``: the rows that get the column (:func:`matches`); ``value``: the cell
  divided (both rows must have it, the reference a nonzero one); ``invert``: reference over
  row (a speed-up) instead of row over reference (a time ratio); ``per``: a count each value is
  divided by first, a function of a row (e.g. the pairs it attends: time per pair).
  """

  column: str
  same: tuple[str, ...]
  reference: Mapping[str, Any]
  where: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  value: str = "time ms"
  invert: bool = False
  per: Callable[[Mapping[str, Any]], float] | None = None

  def __post_init__(self):
    overlap = set(self.same) & set(self.reference)
    if overlap:
      raise ValueError(f"Ratio {self.column!r}: fields {sorted(overlap)} are both shared "
                       "(same) and set (reference)")


def add_ratios(rows: Sequence[Row], table: Iterable[Ratio]) -> None:
  """Writes each ratio of ``table`` into the rows it applies to, in the table's order."""
  for ratio in table:
    keys = (*ratio.same, *ratio.reference)
    index = lookup(rows, keys)
    for r in rows:
      f = fields(r)
      if ratio.value not in r or not matches(f, ratio.where):
        continue
      want = tuple(f.get(k) for k in ratio.same) + tuple(
          v(f) if callable(v) else v for v in ratio.reference.values())
      ref = index.get(want)
      if not ref or not ref.get(ratio.value):
        continue
      mine, theirs = r[ratio.value], ref[ratio.value]
      if ratio.per is not None:
        mine, theirs = mine / ratio.per(f), theirs / ratio.per(fields(ref))
      r[ratio.column] = theirs / mine if ratio.invert else mine / theirs
