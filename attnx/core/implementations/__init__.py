"""The attention implementations as objects, and the order the automatic choice walks.

Each implementation lives in its own module and says whether it can run a
:class:`~attnx.core.implementations.base.Problem` (``supports(problem)``: None, or a reason)
and whether the automatic choice should take it (``declines(problem)``):

* :class:`Pallas` (``"pallas"``, :mod:`.pallas`) — fused Pallas kernels, Triton on a GPU,
  Mosaic on a TPU;
* :class:`Blocked` (``"blocked"``, :mod:`.blocked`) — flash-style key tiles in XLA, any
  backend, O(T) memory;
* :class:`SplitKV` (``"split_kv"``, :mod:`.split_kv`) — decoding: a few query rows against a
  long cache, the keys in chunks merged by the family's rule; residuals;
* :class:`Dense` (``"dense"``, :mod:`.dense`) — materializes the weights; runs every problem.

An implementation object carries its kernel settings (``Pallas(block_q=64, interpret=True)``);
a name stands for the object with its defaults.

:func:`attnx.core.attention` with ``implementation=None`` takes the first implementation of
:func:`list_implementations` that supports the problem and does not decline it; dense, last,
supports everything. An explicit name runs that implementation or raises a ValueError with its
reason. :func:`attnx.core.explain` shows the reasons for one call.
"""

from __future__ import annotations

import warnings
from typing import Any

from attnx.core.implementations.base import (
    Implementation,
    Inputs,
    Problem,
    RingProblem,
    check_tile_size,
    streams,
)
from attnx.core.implementations.blocked import (
    BLOCKED_MIN_SCORES,
    ROW_BLOCKED_MIN_SCORES,
    Blocked,
)
from attnx.core.implementations.dense import Dense
from attnx.core.implementations.pallas import Pallas
from attnx.core.implementations.split_kv import DECODE_MAX_QUERIES, DECODE_MIN_KEYS, SplitKV

# The earlier names of the classes (before they carried settings).
BlockedImplementation, DenseImplementation, PallasImplementation = Blocked, Dense, Pallas

# The automatic choice's order: the most specialized (fastest where it runs) first.
_ORDER: tuple[Implementation, ...] = (Pallas(), SplitKV(), Blocked(), Dense())
_BY_NAME = {impl.name: impl for impl in _ORDER}
# The names from the simplest to the most specialized (error messages, attnx.core's tuple).
NAMES: tuple[str, ...] = ("dense", "blocked", "split_kv", "pallas")
# The kernel settings that attention()/ring_attention()/flax_attention_fn still take as
# keywords for one release (deprecated: they belong to the implementation objects).
LEGACY_SETTINGS: dict[str, Any] = {"block_q": None, "block_k": None, "interpret": False}

__all__ = ["BLOCKED_MIN_SCORES", "DECODE_MAX_QUERIES", "DECODE_MIN_KEYS", "LEGACY_SETTINGS",
           "NAMES", "ROW_BLOCKED_MIN_SCORES",
           "Blocked", "BlockedImplementation", "Dense", "DenseImplementation", "Implementation",
           "Inputs", "Pallas", "PallasImplementation", "Problem", "RingProblem", "SplitKV",
           "check_tile_size", "configure", "dispatch_order", "get_implementation",
           "legacy_settings", "list_implementations", "streams"]


def list_implementations() -> list[str]:
  """The implementation names in the order the automatic choice tries them."""
  return [impl.name for impl in _ORDER]


def dispatch_order() -> tuple[Implementation, ...]:
  """The implementation objects (default settings) in the order the automatic choice tries
  them."""
  return _ORDER


def get_implementation(implementation: str | Implementation) -> Implementation:
  """The implementation object: ``implementation`` itself when it is one, else the one called
  ``implementation`` with its default settings; ValueError listing the valid names otherwise."""
  if isinstance(implementation, Implementation):
    return implementation
  impl = _BY_NAME.get(implementation) if isinstance(implementation, str) else None
  if impl is None:
    raise ValueError(f"Unknown implementation {implementation!r}; valid: {', '.join(NAMES)}, "
                     "an implementation object (core.Dense(), core.Blocked(...), "
                     "core.SplitKV(...), core.Pallas(...)) or None (automatic).")
  return impl


def legacy_settings(where: str, **given: Any) -> dict[str, Any]:
  """The deprecated kernel-setting keywords (:data:`LEGACY_SETTINGS`) a caller passed to
  ``where`` (e.g. ``"attention"``), checked: the ones that differ from their defaults, with a
  DeprecationWarning naming the object to use instead; ``{}`` when none was given."""
  unknown = set(given) - set(LEGACY_SETTINGS)
  if unknown:
    raise TypeError(f"{where}() got unexpected keyword arguments {sorted(unknown)}.")
  settings = {k: v for k, v in given.items() if v is not None and v is not False}
  for k in ("block_q", "block_k"):
    if k in settings:
      settings[k] = check_tile_size(k, settings[k])
  if "interpret" in settings:
    settings["interpret"] = bool(settings["interpret"])
  if settings:
    args = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    objects = (f"core.Pallas({args})" if "interpret" in settings
               else f"core.Blocked({args}) or core.Pallas({args})")
    warnings.warn(f"{where}({args}) is deprecated and will be removed in the next release: "
                  f"kernel settings belong to the implementation object: "
                  f"implementation={objects}.", DeprecationWarning, stacklevel=3)
  return settings


def configure(implementation: str | Implementation | None, settings: dict[str, Any],
              where: str) -> Implementation | tuple[Implementation, ...]:
  """The implementation a call runs with the deprecated keyword ``settings`` applied
  (:func:`legacy_settings`): the object for an explicit implementation, the dispatch order
  with the settings applied for None. ValueError when an implementation object comes with
  keyword settings too (which would win is not obvious)."""
  if implementation is None:
    return tuple(impl.configured(settings) for impl in _ORDER) if settings else _ORDER
  if settings and isinstance(implementation, Implementation):
    raise ValueError(f"{where}: {', '.join(settings)} given both as a keyword and with "
                     f"implementation={implementation!r}; set kernel settings on the "
                     f"implementation object only.")
  impl = get_implementation(implementation)
  return impl.configured(settings) if settings else impl
