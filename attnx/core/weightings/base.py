"""Weightings: how a row of scores s_j becomes attention weights w_j.

Two families (see ``docs/references.md``):

* :class:`Pointwise` — ``w_j = F(s_j) / N`` with an elementwise F and a normalizer N chosen by
  ``normalization``: ``"sum"`` (N = Σ_l F(s_l) + offset, the attention formula of Alam et al.),
  ``"length"`` (N = number of valid keys, ReLU attention of Wortsman et al. 2023) or ``"none"``
  (N = 1, sigmoid attention of Ramapuram et al. 2024). The streaming kernels accumulate
  numerator and denominator tile by tile.
* :class:`RowNormalizer` — anything that needs the whole row at once (sparsemax, entmax,
  stick-breaking, softpick, SSMax): a dense function of the row, and a
  :class:`~attnx.core.streaming.RowStream` that says how the streaming kernels (blocked, Pallas,
  ring) run it in a few passes over the keys.

This module holds the two classes, their traits and the helpers every constructor shares
(:func:`label`, :func:`check_normalization`); the constructors are in
:mod:`~attnx.core.weightings.pointwise`, :mod:`~attnx.core.weightings.rownorm` and
:mod:`~attnx.core.weightings.simplex`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from attnx.core.streaming import RowStream

Array = jax.Array
Normalization = str  # "sum" | "length" | "none"
NORMALIZATIONS = ("sum", "length", "none")

@dataclasses.dataclass(frozen=True)
class WeightingParam:
  """A parameter of a weighting that a caller may pass as an array (``weighting_params``) and a
  module may learn: a scalar, or one value per query head ``[N]``.

  Attributes:
    name: its key in ``weighting_params``.
    default: the weighting's own value (a module's initial value).
    kernel_arg: the keyword under which the streaming kernels take it.
  """

  name: str
  default: float
  kernel_arg: str


@dataclasses.dataclass(frozen=True)
class LogF:
  """log F of an F > 0 that does not count keys, for the online max: what lets a
  sum-normalized F stream like softmax, w = exp(log F − log Σ F), so that a row whose every F
  is below float32's range (sigmoid far below 0: ALiBi at long distances) keeps its weights.

  The kernels never form log F itself: they track a running maximum m ≥ log F of the row
  (``bound``) and weigh each score by ``shifted``, with one exponential per score as softmax.
  ``unit`` is the exponent's unit (1, or log₂e where ``exp`` is 2ˣ: the Pallas kernels).

  Attributes:
    fn: ``log F(z)``, elementwise (the dense implementation and the reference).
    bound: ``g(z) ≥ log F(z)``, non-decreasing, so that g(max z) bounds a row's log F
      (natural units).
    shifted: ``shifted(z, m, em, exp, unit) -> (r, slope)``: r = exp(unit·log F(z) − m) and
      slope = d log F/dz, from one ``exp`` per score; ``m`` ≥ unit·log F(z) (or +∞) and
      ``em = exp(m)`` come broadcast against z.
  """

  fn: Callable[[Array], Array]
  bound: Callable[[Array], Array]
  shifted: Callable[..., tuple[Array, Array]]


@dataclasses.dataclass(frozen=True)
class Pointwise:
  """An elementwise weighting F with a normalization mode.

  Attributes:
    name: registry name (with parameters, e.g. ``"power:p=3"``).
    fn: ``F(z, num_keys) -> array``, elementwise on float32 scores; ``num_keys`` is the static
      number of keys S (used by e.g. sigmoid's default bias −log S).
    normalization: ``"sum"``, ``"length"`` or ``"none"``.
    exp_alpha: if not None, ``F(z) = exp(exp_alpha * z)`` and, with ``normalization="sum"``,
      kernels subtract a running row maximum (online softmax), which makes the weights exactly
      invariant to a shift of all scores (Alam et al.) and overflow-free.
    log_f: for an F > 0 that is not an exponential: its logarithm (:class:`LogF`). With
      ``normalization="sum"`` every implementation streams log F with the running maximum as
      softmax streams α·z, w = exp(log F − log Σ F): no row loses its weights to underflow
      (sigmoid: σ(z) is 0 in float32 below z ≈ −104, log σ(z) ≈ z is not).
    denominator_offset: a constant added to the denominator (``softmax_plus_one`` uses 1). For
      online-max weightings it acts like a virtual key with score 0: kernels start the running
      max at 0 and the running denominator at ``denominator_offset``.
    distance_kernel: F is a kernel of a distance, K(d) with s = −d²: it is meaningful only on
      a distance score (``neg_sq_dist``, ``metric``), which :func:`attnx.core.attention`
      enforces.
    zero_on_nonpositive: declared trait (see :data:`TRAITS`): F(s) = 0 for every s ≤ 0, so
      every weight at a score ≤ 0 is 0 under any normalization. Default False ("not known"),
      also for a callable F: pass ``get_weighting(F, zero_on_nonpositive=True)`` to declare it.
    sequence_shift: for an F whose formula counts the keys of a query's sequence (sigmoid's
      default b = −log n): ``shift(n, S)`` with F(z, n) = F(z + shift(n, S), S), for n the
      keys of the query's own sequence ``[B or 1, T]`` and S the static key count. Under a
      mask that splits rows into sequences (packed documents, padded lengths:
      :meth:`attnx.core.masks.Mask.sequence_keys`), :func:`attnx.core.attention` adds it to
      the bias of each query, the same in every implementation. None: F's n is S.

  The other traits follow from the fields: ``sums_to_one`` from the normalization,
  ``shift_invariant`` from ``exp_alpha`` (declare F = exp(αs) through ``exp_alpha``, not as a
  callable, for it to be known), ``stream_rule`` from :attr:`online_max` and the normalization.
  """

  name: str
  fn: Callable[[Array, int], Array]
  normalization: Normalization = "sum"
  exp_alpha: float | None = None
  denominator_offset: float = 0.0
  distance_kernel: bool = False
  zero_on_nonpositive: bool = False
  sequence_shift: Callable[[Array, int], Array] | None = None
  log_f: LogF | None = None

  kind = "pointwise"
  learnable: ClassVar[tuple[WeightingParam, ...]] = ()  # no pointwise F learns a parameter

  def kernel_args(self, values: dict[str, Any]) -> dict[str, Any]:
    """The streaming kernels' keyword arguments for ``weighting_params``: none."""
    del values
    return {}

  @property
  def divides_by_sum(self) -> bool:
    """``normalization="sum"``: w = F/(offset + Σ F); the streaming kernels carry Σ F (as a
    column of ones appended to V)."""
    return self.normalization == "sum"

  @property
  def divides_by_length(self) -> bool:
    """``normalization="length"``: w = F/n with n the row's valid-key count."""
    return self.normalization == "length"

  @property
  def unnormalized(self) -> bool:
    """``normalization="none"``: w = F."""
    return self.normalization == "none"

  @property
  def online_max(self) -> bool:
    """Whether kernels should stream this weighting with a running maximum (softmax-like):
    exp(α·z) or a :class:`LogF`, sum-normalized."""
    return (self.exp_alpha is not None or self.log_f is not None) and self.divides_by_sum

  @property
  def alpha(self) -> float:
    """The constant slope of the online max's exponent that kernels fold into the score's
    scale: α of exp(α·z); 1 for a :class:`LogF` (the streaming rules take its scores as they
    are: :func:`attnx.core.streaming.online_max_update`) and without the online max."""
    return float(self.exp_alpha) if self.online_max and self.exp_alpha is not None else 1.0

  def exponent(self, z: Array, num_keys: int) -> Array:
    """The online max's exponent of scores z: α·z, or log F(z) for a :class:`LogF`."""
    if self.log_f is not None:
      return self.log_f.fn(z)
    return self.exp_alpha * z

  @property
  def sums_to_one(self) -> bool:
    """F(s)/ΣF(s): sum normalization without a denominator offset (true for any F; rows where
    every valid F(s) is 0 stay all zero, see :data:`TRAITS`)."""
    return self.divides_by_sum and self.denominator_offset == 0

  @property
  def shift_invariant(self) -> bool:
    """exp(αs)/Σexp(αs): the only sum-normalized increasing F with w(s + c) = w(s) (Alam et
    al.); an offset in the denominator breaks it (a virtual key of fixed score 0)."""
    return self.exp_alpha is not None and self.online_max and self.denominator_offset == 0

  @property
  def stream_rule(self) -> str:
    """How the streaming kernels accumulate it: ``"online_max"`` (running max, softmax-like)
    or the normalization (``"sum"``, ``"length"``, ``"none"``)."""
    return "online_max" if self.online_max else self.normalization

  @property
  def traits(self) -> dict[str, Any]:
    """``{trait: value}`` for every name in :data:`TRAITS`."""
    return _traits(self)

  def __call__(self, z: Array, num_keys: int) -> Array:
    return self.fn(z, num_keys)

  def derivative(self, z: Array, num_keys: int) -> Array:
    """F'(z), elementwise, via a forward-mode JVP (exact for any differentiable F)."""
    return jax.jvp(lambda t: self.fn(t, num_keys), (z,), (jnp.ones_like(z),))[1]


@dataclasses.dataclass(frozen=True)
class RowNormalizer:
  """A weighting that needs the whole row: ``fn(scores, where, axis) -> weights``.

  Attributes:
    name: registry name (with parameters).
    fn: the dense implementation.
    stream: how the streaming kernels run it (:class:`attnx.core.streaming.RowStream`), or
      None for a weighting that runs dense only.
    sums_to_one, zero_on_nonpositive, shift_invariant: declared traits (see :data:`TRAITS`),
      set by the weighting's constructor. Default False: "not known to hold".
    learnable: the parameters that ``weighting_params`` may give as arrays
      (:class:`WeightingParam`), e.g. SSMax's ``s``.
    bind: ``values -> fn``: the dense implementation with those arrays (each broadcastable
      against the scores) in place of the weighting's own values; None if nothing is learnable.
  """

  name: str
  fn: Callable[[Array, Array | None, int], Array]
  stream: RowStream | None = None
  sums_to_one: bool = False
  zero_on_nonpositive: bool = False
  shift_invariant: bool = False
  learnable: tuple[WeightingParam, ...] = ()
  bind: Callable[[dict[str, Any]], Callable[[Array, Array | None, int], Array]] | None = None

  kind = "row"
  online_max = False
  alpha = 1.0  # no online max: nothing to fold into the score's scale
  log_f = None

  @property
  def stream_rule(self) -> str | None:
    """The streaming family (``stream.family``), or None for a dense-only weighting."""
    return None if self.stream is None else self.stream.family

  @property
  def traits(self) -> dict[str, Any]:
    """``{trait: value}`` for every name in :data:`TRAITS`."""
    return _traits(self)

  def kernel_args(self, values: dict[str, Any]) -> dict[str, Any]:
    """The streaming kernels' keyword arguments for checked ``weighting_params`` values."""
    return {p.kernel_arg: values[p.name] for p in self.learnable if p.name in values}


Weighting = Pointwise | RowNormalizer
WeightingLike = str | Weighting | Callable[[Array], Array]

# Facts a weighting declares about itself (``w.traits``; filter with ``list_weightings``). They
# hold for every row of scores, masked keys excluded, up to float32 rounding
# (tests/core/test_traits.py checks each declaration numerically):
#   sums_to_one: every row's weights sum to one, except rows that get no weight at all: a row
#     without a valid key and, for F(s)/ΣF(s), a row where every valid F(s) is 0 (relu on
#     all-negative scores, a compact distance kernel beyond its bandwidth). So each row sums
#     to 1 or is all zero; for F > 0 (softmax) only rows without a valid key are all zero.
#   zero_on_nonpositive: the weight is exactly 0 at every score s ≤ 0, whatever the rest of the
#     row (such a weighting gives all-zero weights on a distance score, −d² ≤ 0).
#   shift_invariant: adding one constant to every score of a row leaves its weights unchanged.
#   stream: how the streaming kernels run it: for a Pointwise ``"online_max"`` (running
#     maximum) or its normalization ``"sum"``/``"length"``/``"none"``; for a RowNormalizer the
#     ``RowStream`` family (``"ssmax"``, ``"softpick"``, ``"stick_breaking"``, ``"entmax"``)
#     or None (dense only). (``w.stream_rule``: a RowNormalizer's ``w.stream`` is the
#     RowStream itself, which callers duck-type on.)
# A trait that is not declared reads False: "not known to hold", never "known to fail".
TRAITS = ("sums_to_one", "zero_on_nonpositive", "shift_invariant", "stream")


def _traits(w: Weighting) -> dict[str, Any]:
  return {"sums_to_one": bool(w.sums_to_one), "zero_on_nonpositive": bool(w.zero_on_nonpositive),
          "shift_invariant": bool(w.shift_invariant), "stream": w.stream_rule}


def check_normalization(normalization: str, name: str) -> None:
  """Raises ValueError unless ``normalization`` is one of :data:`NORMALIZATIONS`."""
  if not isinstance(normalization, str) or normalization not in NORMALIZATIONS:
    raise ValueError(f"Unknown normalization {normalization!r} for weighting {name!r}; valid: "
                     f"{', '.join(NORMALIZATIONS)}.")


def label(base: str, **params: Any) -> str:
  """A weighting's name with its parameters: ``label("power", p=3.0)`` is ``"power:p=3.0"``;
  parameters that are None (left at a default that is not shown) are left out."""
  shown = ",".join(f"{k}={v}" for k, v in params.items() if v is not None)
  return f"{base}:{shown}" if shown else base
