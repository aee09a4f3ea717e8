"""A benchmark's targets as a table of data: each :class:`Target` compares a measured cell with a
bound, and :func:`check` turns the table into the lines of a report's "Targets" table
({"target", "measured", "met"}); :func:`add_to_report` writes them with their verdict.

A target applies to every row its ``where`` selects (one line each), or, with ``worst``, to
the worst of each group of rows (one line per group). A target whose rows were not measured in
a run (a shape or baseline left out) gives no line. For example::

    Target("blocked softmax fwd ≥ 4× jax.nn at {shape}", "speed-up vs jax.nn", ">=", 4,
           where=dict(shape="1x4096x4x64", mode="fwd", impl="attnx blocked",
                      weighting="softmax"), fmt="{:.2f}×")

Labels are ``str.format`` templates over the row's fields
(:func:`attnx.train.benchmark.ratios.fields`: its cells and ``T``, ``family``, ``causality``),
``bound``, ``column`` and, for a ``worst`` target, ``worst`` (the worst row's weighting); or
functions of that dict.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attnx.train import verdict
from attnx.train.benchmark.ratios import fields, lookup, matches

OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
# The fields that name a row; `over` finds its reference row by them.
IDENTITY = ("shape", "mode", "impl", "weighting", "score", "causal", "mask")


@dataclasses.dataclass(frozen=True)
class Target:
  """One target (see the module docstring).

  ``column``: the cell compared, or several: the first one that gives a line; ``op``: one of
  :data:`OPS`, measured ``op`` bound is met; ``bound``: a number, or a function of the row's
  fields; ``where``: the rows it applies to (:func:`attnx.train.benchmark.ratios.matches`);
  ``fmt``: the format of the measured value; ``over``: compare the ratio of another row's
  value to this row's instead — the row named like this one (:data:`IDENTITY`) but for the
  fields given, e.g. ``dict(impl="jax.nn (xla)")`` (both values nonzero); ``worst``: the
  fields that group the rows: one line per group, for its row farthest from the bound (by
  weighting), if the group has ``min_rows`` weightings with a value — with ``complete``, no
  line unless all of them have one.
  """

  label: str | Callable[[Mapping[str, Any]], str]
  column: str | tuple[str, ...]
  op: str
  bound: float | Callable[[Mapping[str, Any]], float]
  where: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  fmt: str = "{:.2f}"
  over: Mapping[str, Any] | None = None
  worst: tuple[str, ...] | None = None
  min_rows: int = 1
  complete: bool = False

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"Target {self.label!r}: op must be one of {list(OPS)}, got {self.op!r}")
    if self.worst is not None and self.over is not None:
      raise ValueError(f"Target {self.label!r}: worst and over do not combine")

  @property
  def columns(self) -> tuple[str, ...]:
    return (self.column,) if isinstance(self.column, str) else tuple(self.column)

  def line(self, f: Mapping[str, Any], value: float, **extra: Any) -> dict[str, str]:
    """The table line of measured ``value`` for a row with fields ``f``."""
    bound = self.bound(f) if callable(self.bound) else self.bound
    names = {**f, "bound": bound, **extra}
    label = self.label(names) if callable(self.label) else self.label.format(**names)
    return {"target": label, "measured": self.fmt.format(value),
            "met": "yes" if OPS[self.op](value, bound) else "**no**"}


def _per_row(target: Target, r: Mapping[str, Any], index: dict) -> dict[str, str] | None:
  f = fields(r)
  if not matches(f, target.where):
    return None
  for col in target.columns:
    value = r.get(col)
    if target.over is not None:
      ref = index.get(tuple(target.over.get(k, f.get(k)) for k in IDENTITY), {})
      value = ref.get(col) / value if value and ref.get(col) else None
    if value is not None:
      return target.line(f, value, column=col)
  return None


def _worst(target: Target, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
  groups: dict[tuple, list[Mapping[str, Any]]] = {}
  for r in rows:
    f = fields(r)
    if matches(f, target.where):
      groups.setdefault(tuple(f.get(k) for k in target.worst), []).append(r)
  pick = max if target.op in ("<", "<=") else min  # farthest from the bound
  out = []
  for group in groups.values():
    for col in target.columns:
      values = {r["weighting"]: r.get(col) for r in group
                if target.complete or r.get(col) is not None}
      if len(values) < max(target.min_rows, 1) or any(v is None for v in values.values()):
        continue
      worst = pick(values, key=values.get)
      row = next(r for r in reversed(group) if r["weighting"] == worst)
      out.append(target.line(fields(row), values[worst], column=col, worst=worst))
      break
  return out


def check(table: Iterable[Target | Sequence[Target]],
          rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
  """The lines of ``table`` over ``rows``: target by target, each over the rows in order; a
  tuple of targets is checked row by row (each row against each of its targets)."""
  index = lookup(rows, IDENTITY)
  out: list[dict[str, str]] = []
  for entry in table:
    if isinstance(entry, Target) and entry.worst is not None:
      out.extend(_worst(entry, rows))
      continue
    group = (entry,) if isinstance(entry, Target) else tuple(entry)
    for r in rows:
      out.extend(line for t in group if (line := _per_row(t, r, index)) is not None)
  return out


def summary(goals: Sequence[Mapping[str, str]], count: bool = True) -> tuple[bool | None, str]:
  """(held, the verdict's sentence) of the claim "every target is met": the verdict kind
  *claim* of ``attnx.train.verdict`` over one exact check per target (held when all are met,
  not held when one is missed; None without targets), and "every target met." or the missed
  targets (with ``count``, after how many of all were met)."""
  claim = verdict.claim([verdict.check(g["target"], g["met"] == "yes") for g in goals])
  missed = claim.refuted()
  if not goals:
    return None, "no target was checked."
  if not missed:
    return claim.held, "every target met."
  head = f"{len(goals) - len(missed)} of {len(goals)} targets met; " if count else ""
  return claim.held, f"{head}missed: " + "; ".join(missed) + "."


def write_results(rep: Any, goals: Sequence[Mapping[str, str]], table: str) -> str:
  """The end of a benchmark's report: the "Targets" section (:func:`add_to_report`), then a
  "Results" section with ``table``; writes ``rep`` and returns its path."""
  add_to_report(rep, goals)
  rep.section("Results")
  rep.text(table)
  return rep.write()


def add_to_report(rep: Any, goals: Sequence[Mapping[str, str]], count: bool = True) -> None:
  """A "Targets" section in ``rep`` (an ``attnx.train.Report``): the table and its verdict
  (:func:`summary`); nothing when no target was checked."""
  if not goals:
    return
  rep.section("Targets")
  rep.table(list(goals), columns=["target", "measured", "met"])
  rep.verdict(*summary(goals, count))
