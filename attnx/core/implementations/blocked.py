"""``implementation="blocked"``: flash-style key tiles in XLA, O(T) memory, on any backend.

Pointwise weightings run :func:`attnx.core.blocked.blocked_attention`, the whole-row ones with
a streaming family (SSMax, softpick, stick-breaking, sparsemax, α-entmax) run
:func:`attnx.core.blocked_rows.blocked_row_attention`; both take every score with a
dot-product form (``Score.to_dot``: all built-in scores but ``additive``). Neither forms the
[T, S] weights, so dropout on the weights and ``return_weights`` are not supported.

The automatic choice takes it from :data:`BLOCKED_MIN_SCORES` (pointwise) or
:data:`ROW_BLOCKED_MIN_SCORES` (whole-row) score entries per (batch, head) on, where it was
measured to beat dense.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from attnx.core import blocked_rows
from attnx.core import scores as scores_lib
from attnx.core import weightings as weightings_lib
from attnx.core.blocked import blocked_attention
from attnx.core.implementations.base import (
    Implementation,
    Inputs,
    Problem,
    needs_weights_reason,
    run_streaming,
    static_dims_reason,
    streaming_config_reason,
)

Array = jax.Array

# Above this many score entries per (batch, head), the blocked kernel is used by default.
# Re-measured with the triangle-shaped causal kernel (blocked / dense time, float32, one pinned
# core of a shared 2-core Xeon, medians of 5–25 round-robin runs, fwd | fwd+bwd; full, causal):
#   T = 17   (64×17×4×8, digits ViT):  full 1.28 | 2.08,  causal 1.19 | 2.00
#   T = 64   (8×64×4×64):              full 0.79 | 1.11,  causal 0.87 | 1.14
#   T = 128  (8×128×4×64):             full 0.74 | 1.11,  causal 0.80 | 1.14
#   T = 256  (2×256×4×64):             full 0.76 | 1.15,  causal 0.62 | 0.92
#   T = 512  (2×512×4×64):             full 0.82 | 0.92,  causal 0.53 | 0.87
#   T = 1024 (2×1024×4×64):            full 0.56 | 0.62,  causal 0.34 | 0.54
# Training is fwd+bwd: dense is faster up to T = 256 (full) and the causal gain at T = 256 is
# small, blocked wins everywhere from T = 512 on, so the threshold stays at 512².
# (experiments/kernel_benchmark.py times both implementations at larger shapes.)
BLOCKED_MIN_SCORES = 512 * 512
# The whole-row weightings are slower dense than softmax (a sort-free threshold search,
# cumulative sums, more transcendentals per score) and their blocked kernel wins earlier.
# fwd+bwd time blocked / dense, float32, 2-core AMD EPYC, full | causal (kernel benchmark,
# `rows` preset, 2026-11-25): at T = 256 (8×256×8×64) ssmax 0.83 | 0.78, softpick 0.78 | 0.77,
# stick_breaking 0.85 | 0.83, sparsemax 0.65 | 0.67, entmax15 0.75 | 0.72, entmax:alpha=1.3
# 0.48 | 0.50; measured side by side at T = 128 (16×128×4×64, while another process ran) the
# ratios were 0.63–0.95 with one loss (sparsemax full, 1.33). So blocked from 256² on.
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


class BlockedImplementation(Implementation):
  """The XLA flash-style kernels (:mod:`attnx.core.blocked`, :mod:`attnx.core.blocked_rows`)."""

  name = "blocked"

  def supports_config(self, weighting: Any, score: scores_lib.Score) -> str | None:
    return streaming_config_reason(self.name, weighting, score)

  def supports(self, problem: Problem) -> str | None:
    return (self.supports_config(problem.weighting, problem.score)
            or needs_weights_reason(self.name, problem)
            or static_dims_reason(self.name, problem))

  def declines(self, problem: Problem) -> str | None:
    return small_problem_reason(problem)

  def __call__(self, problem: Problem, inputs: Inputs) -> Array:
    kernel = (blocked_attention if problem.pointwise
              else functools.partial(blocked_rows.blocked_row_attention,
                                     ssmax_s=inputs.ssmax_s))
    return run_streaming(problem, inputs, kernel)
