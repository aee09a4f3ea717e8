"""The attention implementations as objects, and the order the automatic choice walks.

Each implementation lives in its own module and says whether it can run a
:class:`~attnx.core.implementations.base.Problem` (``supports(problem)``: None, or a reason)
and whether the automatic choice should take it (``declines(problem)``):

* ``"pallas"`` (:mod:`.pallas`) — fused Pallas kernels, Triton on a GPU, Mosaic on a TPU;
* ``"blocked"`` (:mod:`.blocked`) — flash-style key tiles in XLA, any backend, O(T) memory;
* ``"dense"`` (:mod:`.dense`) — materializes the weights; runs every problem.

:func:`attnx.core.attention` with ``implementation=None`` takes the first implementation of
:func:`list_implementations` that supports the problem and does not decline it; dense, last,
supports everything. An explicit name runs that implementation or raises a ValueError with its
reason. :func:`attnx.core.explain` shows the reasons for one call.
"""

from __future__ import annotations

from attnx.core.implementations.base import (
    Implementation,
    Inputs,
    Problem,
    streams,
)
from attnx.core.implementations.blocked import (
    BLOCKED_MIN_SCORES,
    ROW_BLOCKED_MIN_SCORES,
    BlockedImplementation,
)
from attnx.core.implementations.dense import DenseImplementation
from attnx.core.implementations.pallas import PallasImplementation

# The automatic choice's order: the most specialized (fastest where it runs) first.
_ORDER: tuple[Implementation, ...] = (PallasImplementation(), BlockedImplementation(),
                                      DenseImplementation())
_BY_NAME = {impl.name: impl for impl in _ORDER}
# The names from the simplest to the most specialized (error messages, attnx.core's tuple).
NAMES: tuple[str, ...] = ("dense", "blocked", "pallas")

__all__ = ["BLOCKED_MIN_SCORES", "NAMES", "ROW_BLOCKED_MIN_SCORES", "BlockedImplementation",
           "DenseImplementation", "Implementation", "Inputs", "PallasImplementation", "Problem",
           "dispatch_order", "get_implementation", "list_implementations", "streams"]


def list_implementations() -> list[str]:
  """The implementation names in the order the automatic choice tries them."""
  return [impl.name for impl in _ORDER]


def dispatch_order() -> tuple[Implementation, ...]:
  """The implementation objects in the order the automatic choice tries them."""
  return _ORDER


def get_implementation(name: str) -> Implementation:
  """The implementation called ``name``; ValueError listing the valid names otherwise."""
  impl = _BY_NAME.get(name) if isinstance(name, str) else None
  if impl is None:
    raise ValueError(f"Unknown implementation {name!r}; valid: {', '.join(NAMES)} or None "
                     "(automatic).")
  return impl
