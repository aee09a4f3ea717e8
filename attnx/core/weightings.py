"""Weightings: how a row of scores s_j becomes attention weights w_j.

Two families (see ``docs/references.md``):

* :class:`Pointwise` — ``w_j = F(s_j) / N`` with an elementwise F and a normalizer N chosen by
  ``normalization``: ``"sum"`` (N = Σ_l F(s_l) + offset, the attention formula of Alam et al.),
  ``"length"`` (N = number of valid keys, ReLU attention of Wortsman et al. 2023) or ``"none"``
  (N = 1, sigmoid attention of Ramapuram et al. 2024). Pointwise weightings stream: the blocked
  kernel accumulates numerator and denominator tile by tile.
* :class:`RowNormalizer` — anything that needs the whole row at once (sparsemax, entmax,
  stick-breaking, softpick, SSMax). These run only in the dense implementation.

Masked entries (``where=False``) never reach F: they are replaced by a safe value before F is
applied and their weight is set to exactly 0, so fully masked rows give all-zero weights with
finite gradients (the "double where" trick).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import params as params_lib
from attnx.core.softplus import softplus
from attnx.core.streaming import RowStream

Array = jax.Array
Normalization = str  # "sum" | "length" | "none"
NORMALIZATIONS = ("sum", "length", "none")


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
    denominator_offset: a constant added to the denominator (``softmax_plus_one`` uses 1). For
      online-max weightings it acts like a virtual key with score 0: kernels start the running
      max at 0 and the running denominator at ``denominator_offset``.
    distance_kernel: F is a kernel of a distance, K(d) with s = −d²: it is meaningful only on
      a distance score (``neg_sq_dist``, ``metric``), which :func:`attnx.core.attention`
      enforces.
    zero_on_nonpositive: declared trait (see :data:`TRAITS`): F(s) = 0 for every s ≤ 0, so
      every weight at a score ≤ 0 is 0 under any normalization. Default False ("not known"),
      also for a callable F: pass ``get_weighting(F, zero_on_nonpositive=True)`` to declare it.

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

  kind = "pointwise"

  @property
  def online_max(self) -> bool:
    """Whether kernels should stream this weighting with a running maximum (softmax-like)."""
    return self.exp_alpha is not None and self.normalization == "sum"

  @property
  def sums_to_one(self) -> bool:
    """F(s)/ΣF(s): sum normalization without a denominator offset (true for any F; rows where
    every valid F(s) is 0 stay all zero, see :data:`TRAITS`)."""
    return self.normalization == "sum" and self.denominator_offset == 0

  @property
  def shift_invariant(self) -> bool:
    """exp(αs)/Σexp(αs): the only sum-normalized increasing F with w(s + c) = w(s) (Alam et
    al.); an offset in the denominator breaks it (a virtual key of fixed score 0)."""
    return self.online_max and self.denominator_offset == 0

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
      set where the weighting is registered. Default False: "not known to hold".
  """

  name: str
  fn: Callable[[Array, Array | None, int], Array]
  stream: RowStream | None = None
  sums_to_one: bool = False
  zero_on_nonpositive: bool = False
  shift_invariant: bool = False

  kind = "row"
  online_max = False

  @property
  def stream_rule(self) -> str | None:
    """The streaming family (``stream.family``), or None for a dense-only weighting."""
    return None if self.stream is None else self.stream.family

  @property
  def traits(self) -> dict[str, Any]:
    """``{trait: value}`` for every name in :data:`TRAITS`."""
    return _traits(self)


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

# --------------------------------------------------------------------------------------------
# Registry.
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Weighting]] = {}
_DOCS: dict[str, str] = {}


def register_weighting(name: str, factory: Callable[..., Weighting] | None = None, *,
                       doc: str = "", overwrite: bool = False):
  """Registers a weighting factory under ``name``.

  ``factory(**params)`` must return a :class:`Pointwise` or :class:`RowNormalizer`; parameters
  come from the name string (``"name:p=3,normalization=length"``). Usable as a decorator.
  After registration the weighting is usable by name everywhere: ``core.attention``,
  ``attnx.nn`` modules and ``--config.weightings=`` on the command line.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from attnx import core
    >>> @core.register_weighting("cube", doc="max(s, 0)³, sum-normalized")
    ... def cube():
    ...   return core.Pointwise("cube", lambda z, num_keys: jnp.maximum(z, 0.0) ** 3)
    >>> print(np.asarray(core.weights(jnp.array([1.0, 2.0, -1.0]), "cube")).round(3))
    [0.111 0.889 0.   ]
    >>> core.describe_weightings()["cube"]
    'max(s, 0)³, sum-normalized'
    >>> from attnx.core.weightings import unregister_weighting
    >>> unregister_weighting("cube")  # registrations last for the process
  """
  def _register(f):
    if not overwrite and name in _REGISTRY:
      raise ValueError(f"Weighting {name!r} is already registered; pass overwrite=True.")
    if ":" in name or "," in name or "=" in name:
      raise ValueError(f"Weighting names may not contain ':', ',' or '=': {name!r}")
    _REGISTRY[name] = f
    _DOCS[name] = doc or (f.__doc__ or "").strip().split("\n")[0]
    return f
  return _register(factory) if factory is not None else _register


def unregister_weighting(name: str) -> None:
  """Removes a registered weighting (for tests and interactive experimentation)."""
  if name not in _REGISTRY:
    raise ValueError(f"Weighting {name!r} is not registered.")
  del _REGISTRY[name], _DOCS[name]


def list_weightings(kind: str | None = None, **traits: Any) -> list[str]:
  """Names of the registered weightings, sorted, filtered by kind and by trait values.

  ``kind="pointwise"``/``"row"`` keeps one family; each keyword is a trait of :data:`TRAITS`
  and keeps the weightings whose trait equals the value, e.g.
  ``list_weightings(zero_on_nonpositive=True)``, ``list_weightings("pointwise",
  shift_invariant=True)``, ``list_weightings(stream="entmax")``. Traits are those of each
  weighting at its default parameters (``"relu"`` sums to one, ``"relu:normalization=length"``
  does not: ask ``get_weighting(spec).traits`` for a parametrized spec).

  Example:
    >>> from attnx import core
    >>> core.list_weightings(zero_on_nonpositive=True)
    ['power', 'relu', 'relu2', 'softpick']
    >>> core.list_weightings("row")
    ['entmax', 'entmax15', 'softpick', 'sparsemax', 'ssmax', 'stick_breaking']
  """
  if kind not in (None, "pointwise", "row"):
    raise ValueError(f"kind must be 'pointwise', 'row' or None, got {kind!r}")
  unknown = sorted(set(traits) - set(TRAITS))
  if unknown:
    raise ValueError(f"Unknown weighting trait(s) {unknown}; valid traits: "
                     f"{', '.join(TRAITS)}.")
  names = sorted(_REGISTRY)
  if kind is None and not traits:
    return names
  out = []
  for n in names:
    w = get_weighting(n)
    if kind is not None and w.kind != kind:
      continue
    have = w.traits
    if all(have[t] == v for t, v in traits.items()):
      out.append(n)
  return out


def describe_weightings() -> dict[str, str]:
  """``{name: one-line description}`` for every registered weighting."""
  return {n: _DOCS[n] for n in sorted(_REGISTRY)}


def _parse_value(text: str) -> Any:
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def parse_weighting_name(spec: str) -> tuple[str, dict[str, Any]]:
  """``"entmax:alpha=1.5"`` -> ``("entmax", {"alpha": 1.5})``.

  Example:
    >>> from attnx import core
    >>> core.parse_weighting_name("power:p=3,normalization=length")
    ('power', {'p': 3, 'normalization': 'length'})
  """
  name, _, rest = spec.strip().partition(":")
  params: dict[str, Any] = {}
  if rest:
    for item in rest.split(","):
      key, eq, value = item.partition("=")
      if not eq or not key.strip():
        raise ValueError(
            f"Bad weighting parameter {item!r} in {spec!r}: expected 'name:key=value,...'.")
      params[key.strip()] = _parse_value(value.strip())
  return name.strip(), params


def get_weighting(weighting: WeightingLike, **overrides: Any) -> Weighting:
  """Resolves a name, a ``"name:k=v"`` string, a Weighting or a callable F to a Weighting.

  A plain callable ``F(z)`` becomes a sum-normalized :class:`Pointwise`.
  Raises ValueError listing the valid names for an unknown name, and naming the accepted
  parameters for an unknown parameter.

  Example:
    >>> from attnx import core
    >>> w = core.get_weighting("entmax:alpha=1.5")
    >>> type(w).__name__, w.name
    ('RowNormalizer', 'entmax:alpha=1.5')
    >>> core.get_weighting("power:p=3").traits
    {'sums_to_one': True, 'zero_on_nonpositive': True, 'shift_invariant': False, 'stream': 'sum'}
    >>> core.get_weighting("relu:normalization=length").traits["sums_to_one"]
    False
  """
  if isinstance(weighting, (Pointwise, RowNormalizer)):
    if overrides:
      return dataclasses.replace(weighting, **overrides)
    return weighting
  if isinstance(weighting, str):
    name, params = parse_weighting_name(weighting)
    params.update(overrides)
    if name not in _REGISTRY:
      raise ValueError(
          f"Unknown weighting {name!r}. Valid weightings: {', '.join(sorted(_REGISTRY))} "
          "(or pass a callable F(z)).")
    factory = _REGISTRY[name]
    accepted = _factory_params(factory)
    unknown = sorted(set(params) - set(accepted)) if accepted is not None else []
    if unknown:
      raise ValueError(
          f"Unknown parameter(s) {unknown} for weighting {name!r}; it accepts "
          f"{', '.join(accepted) or 'no parameters'} (e.g. '{name}:{accepted[0]}=...')."
          if accepted else f"Weighting {name!r} takes no parameters, got {unknown}.")
    try:
      return factory(**params)
    except TypeError as e:
      raise ValueError(f"Bad parameters {params} for weighting {name!r}: {e}") from None
  if callable(weighting):
    fn = weighting
    label = getattr(fn, "__name__", "custom")
    normalization = overrides.pop("normalization", "sum")
    _check_normalization(normalization, label)
    return Pointwise(name=label, fn=lambda z, n: fn(z), normalization=normalization, **overrides)
  raise TypeError(
      f"weighting must be a name, a Weighting or a callable, got {type(weighting).__name__}")


def _factory_params(factory: Callable[..., Weighting]) -> list[str] | None:
  """Keyword parameters a weighting factory accepts (None if it takes **kwargs)."""
  sig = inspect.signature(factory)
  if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
    return None
  return [n for n, p in sig.parameters.items()
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_normalization(normalization: str, name: str) -> None:
  if not isinstance(normalization, str) or normalization not in NORMALIZATIONS:
    raise ValueError(f"Unknown normalization {normalization!r} for weighting {name!r}; valid: "
                     f"{', '.join(NORMALIZATIONS)}.")


def _label(base: str, **params: Any) -> str:
  shown = ",".join(f"{k}={v}" for k, v in params.items() if v is not None)
  return f"{base}:{shown}" if shown else base


# --------------------------------------------------------------------------------------------
# Applying a weighting to a dense score array.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _online_max_weights(z: Array, axis: int, offset: float) -> Array:
  """exp(z) / (Σ exp(z) + offset) along ``axis``.

  Masked entries come as z = the dtype's finite minimum, as in ``jax.nn`` (an array holding
  −inf would stop ``jax.debug_infs``): next to a valid score below ~1e31 they weigh exactly 0,
  and a row of nothing but masked entries gets uniform weights, which the caller's ``where``
  sets to 0. A row with no finite z (and no offset) gets zero weights. The custom JVP,
  dw = w ∘ (dz − Σ w dz), is what makes the dense backward as cheap as ``jax.nn.softmax``'s:
  autodiff through the max, the shift and the guards would keep several T×S intermediates.
  """
  m = jnp.max(z, axis=axis, keepdims=True)
  if offset > 0:
    m = jnp.maximum(m, 0.0)  # the offset is a virtual key with z = 0
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.exp(z - m)
  denom = jnp.sum(e, axis=axis, keepdims=True)
  if offset > 0:
    denom = denom + offset * jnp.exp(-m)
  return e / jnp.where(denom == 0, 1.0, denom)  # e = 0 wherever denom = 0; NaN propagates


@_online_max_weights.defjvp
def _online_max_weights_jvp(axis, offset, primals, tangents):
  (z,), (dz,) = primals, tangents
  w = _online_max_weights(z, axis, offset)
  wdz = jnp.where(w > 0, w * dz, 0.0)  # masked entries: w = 0 even if dz is not finite
  return w, wdz - w * jnp.sum(wdz, axis=axis, keepdims=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _sum_normalize(e: Array, axis: int, offset: float) -> Array:
  """e / (Σ e + offset) along ``axis``; all-zero weights where the denominator is 0.

  The custom JVP, dw = (de − w Σ de) / denom, divides by the denominator once. Autodiff of
  ``e / denom`` would form e / denom², which underflows to 0 once denom is below ~1e-19 (e.g.
  ``power:p=3`` on scores near 0) and turns the gradient into inf · 0 = NaN.
  """
  denom = jnp.sum(e, axis=axis, keepdims=True) + offset
  empty = denom == 0  # only an exact 0 means "no weight": a NaN denominator propagates
  return jnp.where(empty, 0.0, e / jnp.where(empty, 1.0, denom))


@_sum_normalize.defjvp
def _sum_normalize_jvp(axis, offset, primals, tangents):
  (e,), (de,) = primals, tangents
  denom = jnp.sum(e, axis=axis, keepdims=True) + offset
  empty = denom == 0
  d = jnp.where(empty, 1.0, denom)
  w = jnp.where(empty, 0.0, e / d)
  dw = (de - w * jnp.sum(de, axis=axis, keepdims=True)) / d
  return w, jnp.where(empty, 0.0, dw)


def pointwise_weights(scores: Array, w: Pointwise, axis: int = -1,
                      where: Array | None = None, num_keys: int | None = None) -> Array:
  """Dense reference implementation of a :class:`Pointwise` weighting (float32 math)."""
  s = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
  n = s.shape[axis] if num_keys is None else num_keys
  valid = None if where is None else jnp.broadcast_to(where, s.shape)
  # A NaN row's normalizer is NaN, and 0/NaN would make its masked weights NaN too: they are
  # set to 0 after the division, so the row reaches only the keys it attends.
  if w.online_max:
    z = w.exp_alpha * s
    if valid is None:
      return _online_max_weights(z, axis, float(w.denominator_offset))
    z = jnp.where(valid, z, jnp.finfo(z.dtype).min)  # finite: see _online_max_weights
    return jnp.where(valid, _online_max_weights(z, axis, float(w.denominator_offset)), 0.0)
  if valid is None:
    e = w.fn(s, n)
  else:
    e = jnp.where(valid, w.fn(jnp.where(valid, s, 0.0), n), 0.0)
  if w.normalization == "sum":
    out = _sum_normalize(e, axis, float(w.denominator_offset))
    return out if valid is None else jnp.where(valid, out, 0.0)
  if w.normalization == "length":
    denom = (jnp.asarray(float(n), s.dtype) if valid is None
             else jnp.sum(valid, axis=axis, keepdims=True).astype(s.dtype))
  else:
    return e
  empty = denom == 0
  return jnp.where(empty, 0.0, e / jnp.where(empty, 1.0, denom))


def weights(scores: Array, weighting: WeightingLike = "softmax", axis: int = -1,
            where: Array | None = None) -> Array:
  """Turns scores into attention weights along ``axis``, like ``jax.nn.softmax``.

  Args:
    scores: array of scores s (any float dtype; math is done in float32 or wider).
    weighting: a registered name (``core.list_weightings()``), ``"name:k=v"``, a
      :class:`Pointwise`/:class:`RowNormalizer`, or a callable F (sum-normalized).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``scores``; False entries get weight 0.
      A row with no valid entry (or where every F is 0) gets all-zero weights; a row with a
      NaN at a valid entry gets NaN weights at its valid entries and 0 at the masked ones
      (as ``jax.nn.softmax``).

  Returns:
    float32 (or wider) weights with the shape of ``scores``.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from attnx import core
    >>> s = jnp.array([1.0, 2.0, -1.0])
    >>> print(np.asarray(core.weights(s, "softmax")).round(3))
    [0.259 0.705 0.035]
    >>> print(np.asarray(core.weights(s, "relu")).round(3))
    [0.333 0.667 0.   ]
    >>> print(np.asarray(core.weights(s, "sparsemax")))
    [0. 1. 0.]
    >>> print(np.asarray(core.weights(s, "relu", where=jnp.array([True, False, True]))))
    [1. 0. 0.]
  """
  w = get_weighting(weighting)
  scores = jnp.asarray(scores)
  if where is not None:
    where = jnp.asarray(where)
    try:
      jnp.broadcast_shapes(where.shape, scores.shape)
    except ValueError:
      raise ValueError(f"where of shape {where.shape} does not broadcast to scores of shape "
                       f"{scores.shape}") from None
    if where.dtype != jnp.bool_:
      raise ValueError(f"where must be boolean, got dtype {where.dtype}")
  return apply_weighting(scores, w, axis=axis, where=where)


def apply_weighting(scores: Array, w: Weighting, axis: int = -1,
                    where: Array | None = None) -> Array:
  """:func:`weights` for a resolved Weighting and checked arguments (kernels call this).

  NaN contract: a row with a NaN score at a valid (``where``-True) position is NaN at its
  valid entries and 0 at the masked ones, for every weighting. Pointwise F propagate NaN
  through their normalizer by themselves; for the whole-row normalizers (bisection,
  sorting-free thresholds, cumulative products) the rule is applied explicitly, since their
  algorithms may turn NaN into finite numbers (−∞ scores count as masked there, as these
  weightings treat them).
  """
  if scores.shape[axis] == 0:  # no keys: nothing to weigh
    return jnp.zeros(scores.shape, jnp.promote_types(scores.dtype, jnp.float32))
  if isinstance(w, Pointwise):
    return pointwise_weights(scores, w, axis=axis, where=where)
  s = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
  out = w.fn(s, where, axis)
  nan = jnp.isnan(s)
  masked = s == -jnp.inf
  if where is not None:
    nan = nan & where
    masked = masked | ~where
  nan_row = jnp.any(nan, axis=axis, keepdims=True)
  # Two selects, so that no array holds a NaN unless a row is NaN (jax.debug_nans).
  return jnp.where(nan_row & masked, 0.0, jnp.where(nan_row, jnp.nan, out))


# --------------------------------------------------------------------------------------------
# The built-in pointwise weightings.
# --------------------------------------------------------------------------------------------

def _pointwise(name, fn, normalization="sum", **kw) -> Pointwise:
  _check_normalization(normalization, name)
  return Pointwise(name=name, fn=fn, normalization=normalization, **kw)


def _exp_like(name: str, alpha: float, normalization: str, offset: float = 0.0) -> Pointwise:
  if normalization != "sum":
    raise ValueError(
        f"{name!r} is defined only with normalization='sum' (exp overflows unnormalized); "
        "use 'sigmoid' or 'gaussian' for unnormalized weights.")
  a = params_lib.number(f"weighting {name!r}", "alpha", alpha, low=0.0)
  return _pointwise(_label(name, alpha=None if a == 1.0 else a),
                    lambda z, n: jnp.exp(a * z), "sum", exp_alpha=a, denominator_offset=offset)


@register_weighting("softmax",
                    doc="exp(alpha*s)/Σexp(alpha*s) (Alam et al.: the only shift-invariant F)")
def _softmax(alpha: float = 1.0, normalization: str = "sum") -> Pointwise:
  return _exp_like("softmax", alpha, normalization)


@register_weighting("exp", doc="alias of softmax: F(z)=exp(alpha*z), sum-normalized")
def _exp(alpha: float = 1.0, normalization: str = "sum") -> Pointwise:
  return _exp_like("exp", alpha, normalization)


@register_weighting("softmax_plus_one",
                    doc="exp(s)/(1+Σexp(s)), 'quiet' softmax (Evan Miller 2023)")
def _softmax_plus_one(alpha: float = 1.0, normalization: str = "sum") -> Pointwise:
  return _exp_like("softmax_plus_one", alpha, normalization, offset=1.0)


def _simple(name: str, fn: Callable[[Array], Array], doc: str,
            zero_on_nonpositive: bool = False) -> None:
  def factory(normalization: str = "sum") -> Pointwise:
    return _pointwise(_label(name, normalization=None if normalization == "sum"
                             else normalization), lambda z, n: fn(z), normalization,
                      zero_on_nonpositive=zero_on_nonpositive)
  register_weighting(name, factory, doc=doc)


def _elu_plus_one(z: Array) -> Array:
  # where(z>=0, z+1, exp(min(z,0))): exact in bf16 far below 0 (docs/references.md, pitfalls).
  return jnp.where(z >= 0, z + 1.0, jnp.exp(jnp.minimum(z, 0.0)))


_simple("relu", jax.nn.relu, "max(s, 0) (Wortsman et al. 2023 use normalization=length)",
        zero_on_nonpositive=True)
_simple("relu2", lambda z: jnp.square(jax.nn.relu(z)), "max(s, 0)^2 (squared ReLU)",
        zero_on_nonpositive=True)
_simple("softplus", softplus, "log(1 + exp(s)) (one exp per score, see attnx.core.softplus)")
_simple("elu_plus_one", _elu_plus_one, "elu(s) + 1 (the linear-attention feature map as F)")
_simple("taylor_exp", lambda z: 1.0 + z + 0.5 * z * z,
        "1 + s + s^2/2, second-order Taylor expansion of exp (always > 0)")


# Below the smallest normal float32 a positive score counts as 0 in `power`: F'(z) = p·z^(p−1)
# is unbounded at 0+ for p < 1, and on the normal range it stays below p/tiny ≈ 8.5e37·p.
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _power_fn(p: float) -> Callable[[Array], Array]:
  """max(s, 0)^p with F(s) = F'(s) = 0 for s < 2^-126 (incl. s = 0 for p < 1) and F(NaN) = NaN.

  ``jnp.power(relu(s), p)`` differentiates to inf·0 = NaN at s ≤ 0 when p < 1.
  """
  def fn(z):
    zero = z < _TINY  # False for NaN, so NaN reaches jnp.power and propagates
    return jnp.where(zero, 0.0, jnp.power(jnp.where(zero, 1.0, z), p))
  return fn


@register_weighting("power", doc="max(s, 0)^p, p > 0 (F(0) = F'(0) = 0 also for p < 1)")
def _power(p: float = 2.0, normalization: str = "sum") -> Pointwise:
  p = params_lib.number("weighting 'power'", "p", p, low=0.0)
  fn = _power_fn(p)
  return _pointwise(_label("power", p=p), lambda z, n: fn(z), normalization,
                    zero_on_nonpositive=True)


@register_weighting("sigmoid", doc="σ(s + b); b = −log n by default when unnormalized "
                    "(Ramapuram et al. 2024)")
def _sigmoid(bias: float | None = None, normalization: str = "sum") -> Pointwise:
  if bias is not None:
    bias = params_lib.number("weighting 'sigmoid'", "bias", bias)

  def fn(z, n):
    b = (-math.log(max(n, 1)) if normalization == "none" else 0.0) if bias is None else bias
    return jax.nn.sigmoid(z + b)
  return _pointwise(_label("sigmoid", bias=bias, normalization=None if normalization == "sum"
                           else normalization), fn, normalization)


# Distance kernels take the score to be s = −‖q − k‖² (score="neg_sq_dist") and a bandwidth h,
# u = sqrt(max(−s, 0)) / h.

def _dist_u(z: Array, h: float) -> Array:
  # sqrt has an infinite derivative at 0: its branch sees only d² > 0 (or NaN, which
  # propagates), and u = 0 at d = 0 with a zero gradient.
  d2 = jnp.maximum(-z, 0.0)
  zero = d2 == 0
  return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, d2))) / h


def _check_h(name: str, h: float) -> float:
  return params_lib.number(f"weighting {name!r}", "h", h, low=0.0)


@register_weighting("gaussian", doc="exp(−‖q−k‖²/(2h²)) on score neg_sq_dist (bandwidth h)")
def _gaussian(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  h = _check_h("gaussian", h)
  alpha = 1.0 / (2.0 * h * h)
  if normalization == "sum":
    # Normalized Gaussian kernel == softmax(s / 2h²); streamed with the running max.
    return _pointwise(_label("gaussian", h=h), lambda z, n: jnp.exp(alpha * z), "sum",
                      exp_alpha=alpha, distance_kernel=True)
  return _pointwise(_label("gaussian", h=h, normalization=normalization),
                    lambda z, n: jnp.exp(alpha * jnp.minimum(z, 0.0)), normalization,
                    distance_kernel=True)


@register_weighting("boxcar", doc="1[‖q−k‖ ≤ h] on score neg_sq_dist")
def _boxcar(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  h2 = _check_h("boxcar", h) ** 2
  # Written as a function of s so that its derivative is 0 almost everywhere; 0·z makes
  # F(NaN) = NaN (a comparison alone would turn NaN into 0).
  return _pointwise(_label("boxcar", h=h, normalization=None if normalization == "sum"
                           else normalization),
                    lambda z, n: jnp.where(z < -h2, 0.0, 1.0 + 0.0 * z), normalization,
                    distance_kernel=True)


@register_weighting("triangular", doc="max(0, 1 − ‖q−k‖/h) on score neg_sq_dist "
                    "(what Martínez-Ramón, Ajith & Kurup's slides and d2l call 'Epanechnikov')")
def _triangular(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  h = _check_h("triangular", h)
  return _pointwise(_label("triangular", h=h, normalization=None if normalization == "sum"
                           else normalization),
                    lambda z, n: jax.nn.relu(1.0 - _dist_u(z, h)), normalization,
                    distance_kernel=True)


@register_weighting("epanechnikov", doc="3/4 (1 − u²)₊, u = ‖q−k‖/h, on score neg_sq_dist "
                    "(the textbook kernel; the slides' 'Epanechnikov' is 'triangular')")
def _epanechnikov(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  h2 = _check_h("epanechnikov", h) ** 2
  # u² = −s/h²: polynomial in s, so smooth inside the support.
  return _pointwise(_label("epanechnikov", h=h, normalization=None if normalization == "sum"
                           else normalization),
                    lambda z, n: 0.75 * jax.nn.relu(1.0 + z / h2), normalization,
                    distance_kernel=True)


POINTWISE_KERNELS = ("gaussian", "boxcar", "triangular", "epanechnikov")
