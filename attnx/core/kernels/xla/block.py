"""The XLA kernels as the step kernel of :func:`attnx.core.ring_attention`
(:class:`attnx.core.parallel.steps.BlockKernel`): the raw streaming state of a block of query
rows against one visiting key shard, and its gradients, for a pointwise F
(:mod:`.pointwise`) and for the whole-row families that stream in one pass (:mod:`.rows`).
:class:`attnx.core.kernels.pallas.block.PallasBlockKernel` is the same on the Pallas kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnx.core.kernels.xla import pointwise, rows

__all__ = ["XLA_BLOCK_KERNEL", "XlaBlockKernel"]


@dataclasses.dataclass(frozen=True)
class XlaBlockKernel:
  """The ring's steps on attnx's XLA blocked kernels (any backend)."""

  def state(self, *args: Any, **kwargs: Any) -> Any:
    """:func:`.pointwise.raw_block_state` (pointwise F)."""
    return pointwise.raw_block_state(*args, **kwargs)

  def row_state(self, *args: Any, **kwargs: Any) -> Any:
    """:func:`.rows.raw_block_state` (whole-row families)."""
    return rows.raw_block_state(*args, **kwargs)

  def grads(self, *args: Any, **kwargs: Any) -> Any:
    """:func:`.pointwise.block_grads` (pointwise F)."""
    return pointwise.block_grads(*args, **kwargs)

  def row_grads(self, *args: Any, **kwargs: Any) -> Any:
    """:func:`.rows.block_grads` (whole-row families)."""
    return rows.block_grads(*args, **kwargs)


XLA_BLOCK_KERNEL = XlaBlockKernel()
