"""``implementation="pallas"``: fused Pallas kernels, Triton on a GPU and Mosaic on a TPU.

Wraps :func:`attnx.core.kernels.pallas.wrapper.pallas_attention` (pointwise F and the whole-row
weightings with a streaming family), on the score's dot-product form like the blocked kernel.
It supports a problem when the weighting streams, the score has a dot-product form, no
weights are needed (dropout, ``return_weights``), the tiles fit the backend's rules, and the
dtype and head sizes fit the kernels (:func:`attnx.core.kernels.pallas.tiles.supported`): the
host's GPU or TPU kernels, or on a CPU host either kind. Of the score modifications it runs a
soft cap and ALiBi (:func:`attnx.core.score_mods.alibi`, learned slopes included) with any F,
a relative-position table (:func:`attnx.core.score_mods.relative_table`, learned) with any F
on the GPU (Triton) kernels (not yet on the TPU's), attention sinks with a pointwise F or a
whole-row F with a sum (not stick-breaking); any other ``score_mod`` function (a user's) is
refused with that reason.
The kernels are chosen per lowering platform
(:func:`attnx.core.kernels.pallas.platforms.by_platform`): Triton where the program is lowered
for a GPU, Mosaic for a TPU, so a CPU host can lower, export or AOT-compile a model for
either; run or lowered for the CPU it raises ValueError (``core.Pallas(interpret=True)`` runs
the kernels in Pallas' interpreter on any machine).

The automatic choice takes it first in its list, but declines it unless a GPU/TPU runs the call, the
problem is large enough to stream at all (the blocked kernel's thresholds), it has no soft cap,
ALiBi, relative table or sinks (which the verification does not cover), and the combination is
verified (:func:`attnx.core.kernels.pallas.verify.verify_pallas`, run once per combination, eagerly,
outside the caller's trace); a failing verification logs one warning and the walk goes on to
the blocked kernel. An explicit ``implementation="pallas"`` is never
verified and never falls back: its errors are the kernels' own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax

from attnx.core import masks as masks_lib
from attnx.core import scores as scores_lib
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
from attnx.core.implementations.blocked import small_problem_reason
from attnx.core.implementations.split_kv import DECODE_MAX_QUERIES, DECODE_MIN_KEYS
from attnx.core.kernels import pallas as pallas_lib
from attnx.core.kernels.pallas import block as pallas_block
from attnx.core.kernels.pallas import masking as pallas_masking
from attnx.core.kernels.pallas import split as pallas_split

Array = jax.Array


def _modification_reason(problem: Problem) -> str | None:
  """Why the kernels cannot run the problem's score modification or sinks (None when they
  can): they apply a soft cap, ALiBi's linear bias (a ScoreMod declaring it,
  :func:`attnx.core.score_mods.alibi`), a relative-position table (declared likewise,
  :func:`attnx.core.score_mods.relative_table`)
  and fold sinks into the rows' state (sinks mean nothing without a sum of weights, which the
  call's checks refuse first);
  any other score_mod function is user code per tile. The whole-row kernels take the soft cap,
  ALiBi, a relative table and sinks (stick-breaking takes no sink: the call's checks refuse
  it first)."""
  if not (problem.has_score_mod or problem.has_sinks):
    return None
  if problem.score_mod_kind not in (None, "alibi", "relative"):
    return ("implementation='pallas' runs a logits_soft_cap, ALiBi (core.alibi) and a "
            "relative-position table (core.relative_table), not another score_mod function "
            "(a user's fn): the blocked and dense implementations do. Use "
            "implementation='blocked' (or None, which picks it).")
  return None


@dataclasses.dataclass(frozen=True)
class Pallas(Implementation):
  """The Pallas kernels of :mod:`attnx.core.kernels.pallas` (pointwise F and whole-row):
  ``implementation=core.Pallas(block_q=..., block_k=..., interpret=...)`` (``"pallas"``: the
  defaults). Also a step kernel of :func:`attnx.core.ring_attention`.

  Attributes:
    block_q, block_k: the query and key tiles (None: the backend's tile table,
      :mod:`attnx.core.kernels.pallas.tiles`); checked against the backend's rules.
    interpret: run the kernels in Pallas' interpreter (any machine, the only way on a CPU;
      slow, for tests).
    num_splits: split-KV decoding (flash-decoding, :mod:`attnx.core.kernels.pallas.split`):
      the forward cuts the keys into about this many chunks that run side by side and merge
      after. None (default): for decoding shapes (T ≤ ``DECODE_MAX_QUERIES`` query rows against
      S ≥ ``DECODE_MIN_KEYS`` keys) chunks of about 1024 keys, at most 64, for every F but
      sparsemax/entmax (which run unsplit); 1: never; C > 1: about C chunks for every call
      (sparsemax/entmax refused).
  """

  name: ClassVar[str] = "pallas"
  block_q: int | None = None
  block_k: int | None = None
  interpret: bool = False
  num_splits: int | None = None

  def __post_init__(self):
    for field in ("block_q", "block_k"):
      object.__setattr__(self, field, check_tile_size(field, getattr(self, field)))
    if not isinstance(self.interpret, bool):
      raise ValueError(f"interpret must be True or False, got {self.interpret!r}.")
    n = self.num_splits
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
      raise ValueError(f"Pallas(num_splits=...) must be a positive int or None, got {n!r}.")

  def splits(self, problem: Problem) -> int:
    """How many key chunks the forward asks for (1: no split): ``num_splits``, or with None
    chunks of about 1024 keys for a decoding shape whose F splits."""
    if self.num_splits is not None:
      return self.num_splits
    decoding = problem.t <= DECODE_MAX_QUERIES and problem.s >= DECODE_MIN_KEYS
    if not decoding or pallas_split.reason(problem.weighting) is not None:
      return 1
    return max(1, min(64, problem.s // 1024))

  def _backends(self, problem: Problem) -> tuple[str, ...]:
    """The kernel families ("gpu", "tpu") that must be able to run ``problem``: the host's,
    or on a CPU host without ``interpret`` either one (the call lowers for the platform it is
    compiled for: :func:`attnx.core.kernels.pallas.platforms.by_platform`)."""
    try:
      return (pallas_lib.backend_for_platform(problem.platform, self.interpret),)
    except ValueError:
      return pallas_lib.BACKENDS

  def supports_config(self, weighting: Any, score: scores_lib.Score) -> str | None:
    return streaming_config_reason(self.name, weighting, score)

  def supports(self, problem: Problem) -> str | None:
    reason = streaming_reason(self, problem)
    if reason is not None:
      return reason
    if (self.num_splits or 1) > 1 and pallas_split.reason(problem.weighting) is not None:
      return (f"core.Pallas(num_splits={self.num_splits}) cannot split this call's keys: "
              f"{pallas_split.reason(problem.weighting)}.")
    reason = _modification_reason(problem)
    if reason is not None:
      return reason
    if not self.interpret and any(jax.export.is_symbolic_dim(d) for d in problem.batch):
      # JAX 0.10: Triton lowers no symbolic grid ("dynamic grid bounds not supported in the
      # Triton backend"), and Mosaic no scalar-prefetch operand of symbolic shape (the
      # kernels' per-batch lengths [B]: MemRefType.get takes ints only).
      return ("implementation='pallas' cannot run a symbolic batch dimension (jax.export with "
              "a polymorphic batch): the batch is a dimension of the kernels' grid and of "
              "their per-batch length arrays, which JAX's Pallas backends lower only with a "
              "static size (Triton: 'dynamic grid bounds not supported'; Mosaic: no "
              "scalar-prefetch array of symbolic shape). Use implementation='blocked' (or "
              "None, which picks it) or export with a concrete batch.")
    reasons = [self._backend_reason(problem, be) for be in self._backends(problem)]
    if None in reasons:
      return None
    return "; ".join(dict.fromkeys(reasons))  # on a CPU host: why neither kind can

  def _backend_reason(self, problem: Problem, backend: str) -> str | None:
    try:  # the backend's tile rules, for empty inputs too (checked on the query's dtype)
      pallas_lib.check_block_sizes(backend, problem.dtype, block_q=self.block_q,
                                   block_k=self.block_k)
    except ValueError as e:
      return str(e)
    reason = pallas_lib.supported(problem.weighting, backend=backend,
                                  dtype=problem.stream_dtype, head_dim=problem.stream_head_dim,
                                  value_head_dim=problem.value_head_dim,
                                  interpret=self.interpret)
    return None if reason is None else f"implementation='pallas' cannot run this: {reason}."

  def declines(self, problem: Problem) -> str | None:
    try:
      be = pallas_lib.backend_for_platform(problem.platform)
    except ValueError:
      return (f"the automatic choice uses Pallas on a GPU or TPU only; this call runs on "
              f"{problem.platform!r}")
    if problem.has_score_mod or problem.has_sinks:
      # verify_pallas checks each combination without them: a capped, ALiBi or sink kernel
      # has not been compared with the blocked kernel on this device.
      return ("the automatic choice's self-check of the Pallas kernels covers no "
              "logits_soft_cap, ALiBi, relative table or attention sinks; "
              "implementation='pallas' runs them on request")
    # Cheap before costly: the size rule, then the policy and the (one-time) verification.
    return small_problem_reason(problem) or pallas_lib.decline_reason(
        be, problem.weighting, problem.stream_dtype, problem.stream_head_dim,
        value_head_dim=problem.value_head_dim)

  def __call__(self, problem: Problem, inputs: Inputs) -> Any:
    # backend=None: Triton or Mosaic by the platform the program is lowered for.
    backend = self._backends(problem)[0] if self.interpret else None
    splits = self.splits(problem)
    kernel = functools.partial(
        pallas_lib.pallas_attention, backend=backend, interpret=self.interpret,
        **({} if splits == 1 else {"num_splits": splits}),
        **problem.weighting.kernel_args(inputs.weighting_params))
    # The kernels loop over the tiles a structured mask may attend; the pointwise kernels
    # evaluate it per element on the boundary tiles only, the whole-row ones on every tile.
    return run_streaming(problem, inputs, kernel, self.block_sizes, structured_kernel=True)

  def mask_tiles(self, problem: Problem, inputs: Inputs) -> dict[str, Any] | None:
    smask = inputs.structured_mask
    if smask is None or pallas_masking.kernel_reason(smask) is not None:
      return None  # none, or one the kernels read materialized
    be = self._backends(problem)[0]
    blocks, _ = pallas_lib.tiles.kernel_tiles(
        be, problem.weighting, problem.t, problem.s, problem.stream_head_dim,
        problem.value_head_dim, problem.stream_dtype, self.block_q, self.block_k)
    if problem.is_causal:
      smask = masks_lib.Causal() & smask
    try:
      return pallas_masking.tile_counts(smask, blocks.block_q, blocks.block_k, problem.t,
                                        problem.s)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      return None  # traced ids or lengths: no count

  def ring_reason(self, ring: RingProblem) -> str | None:
    be = pallas_lib.resolve_backend(ring.backend, self.interpret)
    why = (_ring_modifications(ring) or pallas_block.supported(ring.weighting, be)
           or pallas_lib.supported(ring.weighting, backend=be, dtype=ring.dtype,
                                   head_dim=ring.head_dim, value_head_dim=ring.value_head_dim,
                                   interpret=self.interpret))
    if why is None and ring.typed_vma:
      why = ("its inputs are typed by shard_map(check_vma=True), and the Pallas kernels' "
             "outputs carry no varying mesh axes yet: use check_vma=False")
    return None if why is None else f"ring_attention(implementation='pallas'): {why}."

  def ring_declines(self, ring: RingProblem) -> str | None:
    # Where attention's automatic choice would take Pallas: a GPU/TPU, a verified combination
    # (verify_pallas covers no score modification or sinks, as for attention's choice).
    if ring.modifications:
      return (f"the automatic choice's self-check of the Pallas kernels covers no "
              f"{', '.join(ring.modifications)}; implementation='pallas' runs a "
              f"logits_soft_cap and sinks on request")
    if ring.typed_vma:
      return "the inputs are typed by shard_map(check_vma=True)"
    return pallas_block.supported(ring.weighting, "gpu") or pallas_lib.decline_reason(
        ring.backend, ring.weighting, ring.dtype, ring.head_dim,
        value_head_dim=ring.value_head_dim)

  def ring_kernel(self, ring: RingProblem) -> pallas_block.PallasBlockKernel:
    return pallas_block.PallasBlockKernel(
        pallas_lib.resolve_backend(ring.backend, self.interpret), self.interpret)


def _ring_modifications(ring: RingProblem) -> str | None:
  """Why the ring's Pallas steps (:mod:`attnx.core.kernels.pallas.block`) cannot run ``ring``'s
  score modifications, or None: they run a soft cap (in the kernels), sinks (folded in by the
  ring, outside the steps), and ALiBi and relative-position tables at the global positions
  (each block's as a relative table at its distances:
  :class:`attnx.core.parallel.steps.OffsetMod`), not a user's ``score_mod`` function, which
  needs global positions the kernels' tiles do not have."""
  if ring.score_mod_kind == "fn":
    return ("the ring's Pallas steps run logits_soft_cap, ALiBi (core.alibi), relative-position "
            "tables (core.relative_table) and sinks, not a user's score_mod function; use the "
            "XLA steps (implementation='blocked', or None, which picks them)")
  return None
