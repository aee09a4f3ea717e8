"""``implementation="blocked"``: flash-style key tiles in XLA, O(T) memory, on any backend.

Pointwise weightings run :func:`attnx.core.kernels.xla.pointwise.blocked_attention`, the whole-row
ones with a streaming family (SSMax, softpick, stick-breaking, sparsemax, α-entmax) run
:func:`attnx.core.kernels.xla.rows.blocked_row_attention`; both take every score with a
dot-product form (``Score.to_dot``: all built-in scores but ``additive``). Neither forms the
[T, S] weights, so dropout on the weights and ``return_weights`` are not supported.

The automatic choice takes it from :data:`BLOCKED_MIN_SCORES` (pointwise) or
:data:`ROW_BLOCKED_MIN_SCORES` (whole-row) score entries per (batch, head) on, where it was
measured to beat dense.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax

from attnx.core import scores as scores_lib
from attnx.core import weightings as weightings_lib
from attnx.core.implementations.base import (
  Implementation,
  Inputs,
  Problem,
  RingProblem,
  check_tile_size,
  run_streaming,
  streaming_config_reason,
  streaming_reason,
)
from attnx.core.kernels.xla import block as xla_block
from attnx.core.kernels.xla import rows as blocked_rows
from attnx.core.kernels.xla.pointwise import blocked_attention, mask_tile_counts

Array = jax.Array

# Above this many score entries per (batch, head), the blocked kernel is used by default:
# measured, training (fwd+bwd) is faster dense below (docs/guides/benchmarks.md, "The
# kernels' constants").
BLOCKED_MIN_SCORES = 512 * 512
# The whole-row weightings are slower dense than softmax (a threshold search, cumulative
# sums, more transcendentals per score), so their blocked kernel wins earlier (measured:
# docs/guides/benchmarks.md, "The kernels' constants").
ROW_BLOCKED_MIN_SCORES = 256 * 256


def min_scores(weighting: Any) -> int:
  """The score entries per (batch, head) from which streaming beats dense for the resolved
  ``weighting``: :data:`BLOCKED_MIN_SCORES` (pointwise) or :data:`ROW_BLOCKED_MIN_SCORES`."""
  return (BLOCKED_MIN_SCORES if isinstance(weighting, weightings_lib.Pointwise)
          else ROW_BLOCKED_MIN_SCORES)


def small_problem_reason(problem: Problem) -> str | None:
  """Why a streaming kernel is not worth it for ``problem`` (None when it is): dense is faster
  below :func:`min_scores` score entries per (batch, head)."""
  threshold = min_scores(problem.weighting)
  if problem.scores_per_head >= threshold:
    return None
  which = "BLOCKED_MIN_SCORES" if problem.pointwise else "ROW_BLOCKED_MIN_SCORES"
  return (f"T·S = {problem.t}·{problem.s} = {problem.scores_per_head} scores per head is below "
          f"{which} = {threshold}, where dense is faster")


@dataclasses.dataclass(frozen=True)
class Blocked(Implementation):
  """The XLA flash-style kernels (:mod:`attnx.core.kernels.xla.pointwise`,
  :mod:`attnx.core.kernels.xla.rows`): ``implementation=core.Blocked(block_q=..., block_k=...)``
  (``"blocked"``: the defaults). Also the step kernel of :func:`attnx.core.ring_attention`.

  Attributes:
    block_q, block_k: caps on the query and key tiles (None: chosen by the kernel from the
      shapes; the kernel takes the largest tile up to the cap that suits the lengths).
  """

  name: ClassVar[str] = "blocked"
  block_q: int | None = None
  block_k: int | None = None

  def __post_init__(self):
    for field in ("block_q", "block_k"):
      object.__setattr__(self, field, check_tile_size(field, getattr(self, field)))

  def supports_config(self, weighting: Any, score: scores_lib.Score) -> str | None:
    return streaming_config_reason(self.name, weighting, score)

  def supports(self, problem: Problem) -> str | None:
    return streaming_reason(self, problem)

  def declines(self, problem: Problem) -> str | None:
    return small_problem_reason(problem)

  def __call__(self, problem: Problem, inputs: Inputs) -> Array:
    kernel = (blocked_attention if problem.pointwise
              else functools.partial(blocked_rows.blocked_row_attention,
                                     **problem.weighting.kernel_args(inputs.weighting_params)))
    # Both kernels evaluate a structured mask per tile and skip its empty tiles.
    return run_streaming(problem, inputs, kernel, self.block_sizes, structured_kernel=True)

  def mask_tiles(self, problem: Problem, inputs: Inputs) -> dict[str, Any] | None:
    if inputs.structured_mask is None:
      return None
    shape = (inputs.structured_mask, problem.weighting, math.prod(problem.batch), problem.t,
             problem.s, problem.num_heads, problem.num_kv_heads, problem.is_causal)
    try:
      if problem.pointwise:
        return mask_tile_counts(*shape, *self.block_sizes)
      return blocked_rows.mask_tile_counts(*shape, inputs.bias is not None, problem.dtype,
                                           *self.block_sizes)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      return None  # traced ids or lengths: no count

  def ring_reason(self, ring: RingProblem) -> str | None:
    del ring  # every weighting the ring streams (ring.check_supported) runs in XLA
    return None

  def ring_kernel(self, ring: RingProblem) -> Any:
    del ring
    return xla_block.XLA_BLOCK_KERNEL
