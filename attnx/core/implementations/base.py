"""What every attention implementation is: a :class:`Problem` it is asked to solve, and the
:class:`Implementation` interface the dispatcher (:func:`attnx.core.attention`) walks.

The cut follows tokamax (openxla/tokamax, ``_src/ops/attention/base.py``): an implementation
is an object that says *whether* it can run a problem (:meth:`Implementation.supports`, a
human reason when it cannot) apart from *running* it (:meth:`Implementation.__call__`), so
that the automatic choice is a walk over an ordered list and a user can ask why one does not
run (:func:`attnx.core.explain`) instead of reading if/else chains.
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from attnx.core import masks as masks_lib
from attnx.core import residuals as residuals_lib
from attnx.core import scores as scores_lib
from attnx.core import weightings as weightings_lib
from attnx.core.contract import nonfinite_inputs

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static description of one :func:`attnx.core.attention` call: everything an
  implementation needs to decide whether (and whether it should) run it, and no array.

  Built once per call by the dispatcher (also while the caller's function is traced: only
  shapes, dtypes and Python values enter it). :func:`attnx.core.explain` returns the one it
  built, and ``dataclasses.replace`` gives variants (another platform, another dtype).

  Attributes:
    weighting: the resolved weighting F (:class:`~attnx.core.weightings.Pointwise` or
      :class:`~attnx.core.weightings.RowNormalizer`).
    score: the resolved :class:`~attnx.core.scores.Score`.
    batch: the batch dims ``[batch...]`` of query, key and value.
    t, s: query and key lengths.
    num_heads, num_kv_heads: N query heads and K key/value heads (N a multiple of K).
    head_dim, value_head_dim: H of query/key and Hv of value.
    dtype: the query's dtype name (the output's dtype).
    stream_dtype: the dtype the streaming kernels compute in (of the score's dot-product form
      ``Score.to_dot`` and the value), or None when the score has no dot-product form.
    stream_head_dim: the head dim of that dot-product form (a distance score adds 2 columns),
      or None likewise.
    is_causal: causal masking (top-left aligned).
    has_mask, has_bias: whether a boolean mask / an additive bias is given.
    has_structured_mask: whether a structured mask (:mod:`attnx.core.masks`, or ``jax.nn``'s
      length/window keywords, ``segment_ids``) is given.
    has_score_mod: whether a score modification (:mod:`attnx.core.score_mods`:
      ``logits_soft_cap``, ``score_mod``) is given.
    score_mod_kind: what that modification's function is
      (:func:`attnx.core.score_mods.kind`): None (none, or a soft cap alone), ``"alibi"`` (a
      ScoreMod declaring ALiBi's linear bias, which the Pallas kernels run), ``"relative"`` (a
      ScoreMod declaring a relative-position table, which the GPU Pallas kernels run) or
      ``"fn"`` (any other function); :attr:`has_score_mod_fn` says whether there is one.
    has_sinks: whether attention sinks (``sinks``, one learned score per head) are given.
    dropout_rate: the dropout rate on the weights when dropout applies, else 0.0.
    broadcast_dropout: one dropout mask shared by the batch and head dims.
    return_weights: whether the weights are returned too.
    return_residual: whether the residual (:mod:`attnx.core.residuals`) is returned too.
    normalize_output: False: the output is the numerator Σ_j F_ij v_j, not divided by the
      row's normalizer (:func:`attnx.core.residuals.unnormalize`).
    platform: the JAX platform the call runs on (``jax.default_backend()``: "cpu", "gpu",
      "tpu").

  How a kernel runs the problem (tiles, Pallas' interpreter) is not part of it: those settings
  live on the implementation object (:class:`Blocked`, :class:`Pallas`).
  """

  weighting: Any
  score: scores_lib.Score
  batch: tuple[int, ...]
  t: int
  s: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  value_head_dim: int
  dtype: str
  stream_dtype: str | None
  stream_head_dim: int | None
  is_causal: bool = False
  has_mask: bool = False
  has_bias: bool = False
  has_structured_mask: bool = False
  has_score_mod: bool = False
  has_sinks: bool = False
  score_mod_kind: str | None = None
  dropout_rate: float = 0.0
  broadcast_dropout: bool = True
  return_weights: bool = False
  platform: str = "cpu"
  return_residual: bool = False
  normalize_output: bool = True

  @property
  def wants_residual(self) -> bool:
    """Whether the call needs the row state besides the output (``return_residual`` or
    ``normalize_output=False``)."""
    return self.return_residual or not self.normalize_output

  @property
  def has_score_mod_fn(self) -> bool:
    """Whether the modification has a function (``score_mod``: ALiBi, a relative table, a
    user's fn), not only a soft cap."""
    return self.score_mod_kind is not None

  @property
  def pointwise(self) -> bool:
    """Whether F is pointwise (else it normalizes whole rows)."""
    return isinstance(self.weighting, weightings_lib.Pointwise)

  @property
  def dropout(self) -> bool:
    """Whether dropout on the weights applies."""
    return self.dropout_rate > 0.0

  @property
  def scores_per_head(self) -> int:
    """T·S: the score entries of one (batch, head), the size the automatic choice weighs."""
    return self.t * self.s

  @property
  def empty(self) -> bool:
    """No query or no key: the output is empty or zero whatever the implementation."""
    return self.t == 0 or self.s == 0 or self.num_heads == 0 or 0 in self.batch


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
  """The arrays of one call, after the dispatcher's checks (layout ``[batch..., T, N, H]``).

  Attributes:
    query, key, value: ``[batch..., T, N, H]``, ``[batch..., S, K, H]``, ``[batch..., S, K, Hv]``.
    bias, mask: broadcastable to ``[batch..., N, T, S]``, or None.
    scale: the score's multiplier (a Python float, or an array: a learned scale).
    score_params: the score's parameters (arrays and numbers), checked.
    weighting_params: the weighting's parameters given as arrays, checked
      (:func:`attnx.core.problem.check_weighting_params`: each declared by the weighting, shape
      () or [N]); empty for the weighting's own values.
    dropout_rng: the PRNG key of dropout on the weights, or None.
    structured_mask: the structured mask bound to the call (:meth:`attnx.core.masks.Mask.bind`:
      per-batch arrays with one flat batch axis), or None. A pair may attend where ``mask``,
      ``structured_mask`` and ``is_causal`` all allow it.
    score_mod: the :class:`~attnx.core.score_mods.ScoreMod` of the call (soft cap,
      ``score_mod`` and its parameters), or None.
    sinks: the attention sinks ``[N]`` (float32, float64 for float64 inputs), or None.
  """

  query: Array
  key: Array
  value: Array
  bias: Array | None
  mask: Array | None
  scale: float | Array
  score_params: dict[str, Any]
  weighting_params: dict[str, Array] = dataclasses.field(default_factory=dict)
  dropout_rng: Array | None = None
  structured_mask: Any = None
  score_mod: Any = None
  sinks: Array | None = None


def check_tile_size(name: str, value: Any) -> int | None:
  """``value`` as a tile size: a positive int, or None (the kernel's default); ValueError
  otherwise."""
  bad = not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1
  if value is not None and bad:
    raise ValueError(f"{name} must be a positive int tile size or None, got {value!r}.")
  return None if value is None else int(value)


@dataclasses.dataclass(frozen=True)
class RingProblem:
  """What :func:`attnx.core.ring_attention` asks an implementation before its ring runs: can
  its kernels run every step of this ring (:meth:`Implementation.ring_reason`), and does the
  automatic choice take them (:meth:`Implementation.ring_declines`)?

  Attributes:
    weighting: the resolved weighting F.
    dtype: the dtype of q, k and v together.
    head_dim, value_head_dim: H and Hv.
    typed_vma: the inputs are typed by ``shard_map(check_vma=True)``.
    backend: the Pallas kernels asked for (``"gpu"``/``"tpu"``), or None: the host's.
    modifications: the names of the call's score modifications and sinks
      (``"logits_soft_cap"``, ``"score_mod"``, ``"sinks"``) the steps must apply.
    score_mod_kind: :func:`attnx.core.score_mods.kind` of the call's modification: None,
      ``"alibi"``, ``"relative"`` or ``"fn"`` (a user's function).
  """

  weighting: Any
  dtype: Any
  head_dim: int
  value_head_dim: int
  typed_vma: bool = False
  backend: str | None = None
  modifications: tuple[str, ...] = ()
  score_mod_kind: str | None = None


@dataclasses.dataclass(frozen=True)
class Implementation(abc.ABC):
  """One way to compute attention, e.g. dense, blocked (XLA) or Pallas, with its settings.

  An implementation is a small frozen object: its fields are the kernel settings
  (``Blocked(block_q=64)``, ``Pallas(interpret=True)``), and ``attention(...,
  implementation=obj)`` runs it with them; the name (``"blocked"``) stands for the object with
  its defaults.

  Subclasses set :attr:`name` and implement :meth:`supports` and :meth:`__call__`; the
  automatic choice also asks :meth:`declines`. The dispatcher calls :meth:`__call__` only for
  a problem that :meth:`supports` accepted and that is not :attr:`Problem.empty` (the empty
  cases are answered once, by the dispatcher, for every implementation). An implementation
  whose kernels can run the steps of :func:`attnx.core.ring_attention` also implements
  :meth:`ring_reason` and :meth:`ring_kernel`.
  """

  name: ClassVar[str]

  @property
  def block_sizes(self) -> tuple[int | None, int | None]:
    """The tile caps ``(block_q, block_k)`` of this implementation's kernels (None: the
    kernel's own choice); ``(None, None)`` for an implementation without tiles."""
    return (getattr(self, "block_q", None), getattr(self, "block_k", None))

  def configured(self, settings: dict[str, Any]) -> Implementation:
    """This implementation with those of ``settings`` (kernel-setting keywords such as
    ``block_q`` or ``interpret``) that it has; the others do not apply to it."""
    mine = {f.name for f in dataclasses.fields(self)}
    return dataclasses.replace(self, **{k: v for k, v in settings.items() if k in mine})

  def supports_config(self, weighting: Any, score: scores_lib.Score) -> str | None:
    """The part of :meth:`supports` that depends on the resolved weighting and score alone
    (what a model knows when it is built, before any shape): None, or why not."""
    del weighting, score
    return None

  @abc.abstractmethod
  def supports(self, problem: Problem) -> str | None:
    """None if this implementation can run ``problem``, else a sentence saying why not and
    what to use instead (the ValueError an explicit ``implementation=`` raises)."""

  def declines(self, problem: Problem) -> str | None:
    """Why the automatic choice (``implementation=None``) passes over this implementation for
    a problem it supports (e.g. too small to pay off), or None when it takes it. Asked only
    after :meth:`supports` accepted the problem, and only for ``implementation=None``."""
    del problem
    return None

  @abc.abstractmethod
  def __call__(self, problem: Problem, inputs: Inputs) -> Array | tuple[Array, Array]:
    """The output ``[batch..., T, N, Hv]`` in the query's dtype, or ``(output, weights)``
    when ``problem.return_weights``."""

  def mask_tiles(self, problem: Problem, inputs: Inputs) -> dict[str, Any] | None:
    """How this implementation's kernel meets the call's structured mask (its tiles, and how
    many it skips), for :func:`attnx.core.explain`; None where it reads no tiles of one."""
    del problem, inputs
    return None

  def ring_reason(self, ring: RingProblem) -> str | None:
    """None if this implementation's kernels can run every step of ``ring``, else why not
    (the ValueError an explicit ``ring_attention(implementation=...)`` raises)."""
    del ring
    return (f"ring_attention runs attnx's blocked kernel or the Pallas kernels on every step: "
            f"implementation must be None, 'blocked' or 'pallas' (or core.Blocked(...), "
            f"core.Pallas(...)), got {self.name!r}.")

  def ring_declines(self, ring: RingProblem) -> str | None:
    """Why :func:`attnx.core.ring_attention`'s automatic choice passes over this
    implementation's kernels for ``ring``, or None when it takes them."""
    return self.ring_reason(ring)

  def ring_kernel(self, ring: RingProblem) -> Any:
    """The step kernels (a :class:`attnx.core.parallel.steps.BlockKernel`) every step of
    ``ring`` runs; asked only after :meth:`ring_reason` or :meth:`ring_declines` said None."""
    raise NotImplementedError(self.ring_reason(ring))


def streams(w: Any) -> bool:
  """Whether the streaming kernels (blocked and Pallas) run the resolved weighting ``w``: every
  pointwise F, and the whole-row weightings that declare a streaming family."""
  return (isinstance(w, weightings_lib.Pointwise)
          or (isinstance(w, weightings_lib.RowNormalizer) and w.stream is not None))


def streaming_config_reason(name: str, w: Any, sc: scores_lib.Score) -> str | None:
  """Why a streaming implementation (``name``) cannot run weighting ``w`` with score ``sc``:
  it needs a weighting with a streaming form and a score that is a dot product of transformed
  vectors (``Score.to_dot``)."""
  if not streams(w):
    return (f"Weighting {w.name!r} normalizes whole rows and has no streaming form "
            f"(implementation={name!r}); use implementation='dense' (or None).")
  if sc.to_dot is None:
    return (f"Score {sc.name!r} is not a dot product of transformed vectors and cannot stream "
            f"(implementation={name!r}); use implementation='dense' (or None).")
  return None


def needs_weights_reason(name: str, problem: Problem) -> str | None:
  """Why an implementation that never forms the [T, S] weights cannot run ``problem``: dropout
  on the weights and ``return_weights`` need them."""
  if not (problem.dropout or problem.return_weights):
    return None
  needs = "dropout on the weights" if problem.dropout else "return_weights=True"
  return (f"{needs} needs the [T, S] weights, which implementation={name!r} never forms; use "
          "implementation='dense' (or None, which picks it).")


def residual_reason(name: str, problem: Problem) -> str | None:
  """Why ``problem``'s ``return_residual``/``normalize_output=False`` cannot be given: the
  weighting has no row state, or the weights are asked for too."""
  if not problem.wants_residual:
    return None
  try:
    residuals_lib.residual_kind(problem.weighting)
  except ValueError as e:
    return str(e)
  if problem.return_weights or problem.dropout:
    return (f"return_residual / normalize_output=False (implementation={name!r}) do not combine "
            "with return_weights or dropout on the weights.")
  return None


def streaming_reason(impl: Implementation, problem: Problem) -> str | None:
  """What every streaming implementation (blocked, split-KV, Pallas) checks first: its
  weighting and score (:meth:`Implementation.supports_config`), the weights it never forms,
  static dims, the residual."""
  return (impl.supports_config(problem.weighting, problem.score)
          or needs_weights_reason(impl.name, problem)
          or static_dims_reason(impl.name, problem)
          or residual_reason(impl.name, problem))


def with_residual(problem: Problem, out: Array, residual: Any) -> Any:
  """What :meth:`Implementation.__call__` returns from the output [batch..., T, N, Hv] and the
  public residual (:mod:`attnx.core.residuals`): the output in the problem's dtype, or
  unnormalized (``normalize_output=False``, float32), with the residual where asked."""
  if not problem.normalize_output:
    out = residuals_lib.unnormalize(problem.weighting, out, residual)
  else:
    out = out.astype(problem.dtype)
  return (out, residual) if problem.return_residual else out


def row_state_reason(name: str, problem: Problem) -> str | None:
  """Why a fused kernel (``name``) does not return what ``problem`` asks besides the
  output: its row statistics stay inside its custom VJP, so ``return_residual=True`` and
  ``normalize_output=False`` run on the implementations that form the row state in XLA."""
  if not problem.wants_residual:
    return None
  return (f"return_residual / normalize_output=False: implementation={name!r} keeps its row "
          "statistics inside its kernels; use implementation='split_kv' (short queries, "
          "long caches), 'dense' or None, which picks one (docs/guides/residuals.md).")


def static_dims_reason(name: str, problem: Problem) -> str | None:
  """Why a streaming implementation (``name``) cannot run ``problem`` whose sequence lengths,
  head counts or head dims are symbolic (``jax.export`` shape polymorphism): its tiles and
  loops are sized from them. The batch dims may be symbolic; ``"dense"`` takes any."""
  dims = {"T": problem.t, "S": problem.s, "N": problem.num_heads, "K": problem.num_kv_heads,
          "H": problem.head_dim, "Hv": problem.value_head_dim}
  symbolic = [d for d, size in dims.items() if jax.export.is_symbolic_dim(size)]
  if not symbolic:
    return None
  return (f"implementation={name!r} needs static {', '.join(symbolic)}: its tiles are sized "
          "from the sequence lengths, heads and head dims; only the batch dims may be symbolic "
          "(jax.export). Use implementation='dense' (or None, which picks it).")


def to_4d(x: Array | None, batch: tuple[int, ...]) -> Array | None:
  """[batch..., N, T, S]-broadcastable -> [B or 1, N or 1, T or 1, S or 1]."""
  if x is None:
    return None
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)
  lead = x.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(batch):])
  x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
  return x.reshape((-1,) + x.shape[len(batch):])


def run_streaming(problem: Problem, inputs: Inputs, kernel: Callable[..., Array],
                  block_sizes: tuple[int | None, int | None],
                  structured_kernel: bool = False) -> Array:
  """Runs a streaming ``kernel`` (``[B, T, N, H]`` layout, like
  :func:`attnx.core.kernels.xla.pointwise.blocked_attention`) on the score's dot-product form.

  The batch dims are flattened into one, bias and mask brought to 4-D, q', k', v cast to one
  dtype (scores that transform q/k in float32, distances and cosine, upcast v too), and the
  tile caps ``block_sizes = (block_q, block_k)`` passed on. A structured mask goes to a
  ``structured_kernel`` as ``structured_mask=`` (evaluated per tile); other kernels get it
  materialized into ``mask``.

  The contract's input step (:func:`~attnx.core.contract.nonfinite_inputs`) runs before the
  dot-product form too, not only inside the kernel: a score like ``neg_sq_dist`` forms |k|²
  from k, and its gradient would multiply the zero cotangent of a masked key by that key's
  NaN; after the step, the ``where`` gives a non-finite entry a zero gradient, as in dense.
  """
  batch = problem.batch
  mask, extra = inputs.mask, {}
  if inputs.structured_mask is not None and structured_kernel:
    extra = dict(structured_mask=inputs.structured_mask)
  else:
    mask = masks_lib.combine(mask, inputs.structured_mask, batch, problem.num_heads, problem.t,
                             problem.s)
  if inputs.score_mod is not None:  # implementations without it refuse it in supports()
    extra["score_mod"] = inputs.score_mod
  if inputs.sinks is not None:  # likewise
    extra["sinks"] = inputs.sinks
  query, key, value, bias = nonfinite_inputs(inputs.query, inputs.key, inputs.value,
                                             inputs.bias)
  qd, kd = problem.score.to_dot(query, key, **inputs.score_params)
  compute = jnp.result_type(qd.dtype, kd.dtype, value.dtype)
  flat = lambda x: x.astype(compute).reshape((-1,) + x.shape[len(batch):])
  if problem.wants_residual:
    extra["return_residual"] = True
  out = kernel(flat(qd), flat(kd), flat(value), weighting=problem.weighting,
               scale=inputs.scale, bias=to_4d(bias, batch),
               mask=to_4d(mask, batch), is_causal=problem.is_causal,
               block_q=block_sizes[0], block_k=block_sizes[1], **extra)
  unflat = lambda x: x.reshape(batch + x.shape[1:])
  if problem.wants_residual:
    out, residual = out
    return with_residual(problem, unflat(out), jax.tree.map(unflat, residual))
  return unflat(out).astype(problem.dtype)
