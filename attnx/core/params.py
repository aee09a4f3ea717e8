"""Validation of the scalar parameters of weightings and scores (``"power:p=3"``).

Parameters arrive as Python values, often parsed from a string on the command line, so a typo
must fail when the name is parsed, naming the parameter and its valid range, instead of
surfacing later as a TypeError deep in a trace or as NaN weights.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
  if low is not None and high is not None:
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  if low is not None:
    return f"{'>' if low_open else '≥'} {low:g}"
  if high is not None:
    return f"{'<' if high_open else '≤'} {high:g}"
  return "finite"


def number(owner: str, name: str, value: Any, *, low: float | None = None,
           high: float | None = None, low_open: bool = True, high_open: bool = False,
           integer: bool = False) -> float | int:
  """``value`` as a finite float (or int) within the given bounds, else a ValueError.

  Args:
    owner: what the parameter belongs to, for the message (e.g. ``"weighting 'power'"``).
    name: the parameter's name.
    value: the value to check (bool and strings are rejected: ``"p=abc"`` parses as a string).
    low, high: bounds (None: unbounded); ``low_open``/``high_open`` exclude the bound.
    integer: require an integral value.
  """
  kind = "an integer" if integer else "a finite number"
  bounds = _interval(low, high, low_open, high_open)
  what = f"{kind} {bounds}" if bounds != "finite" else kind
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if ok:
    x = float(value)
    ok = math.isfinite(x) and not (integer and x != int(x))
    if ok and low is not None:
      ok = x > low if low_open else x >= low
    if ok and high is not None:
      ok = x < high if high_open else x <= high
  if not ok:
    raise ValueError(f"{owner}: parameter {name!r} must be {what}, got {value!r}.")
  return int(value) if integer else float(value)
