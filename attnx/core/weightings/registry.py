"""The name index of weightings: ``"name:k=v"`` strings resolved to constructors.

The table :data:`BUILTIN` lists every built-in weighting with its constructor (the pointwise
families of :mod:`~attnx.core.weightings.pointwise`, the whole-row normalizers of
:mod:`~attnx.core.weightings.rownorm` and :mod:`~attnx.core.weightings.simplex`); a constructor's
keyword parameters are the parameters its name accepts (``"power:p=3"`` calls
``pointwise.power(p=3)``) and the first line of its docstring is its description.
:func:`register_weighting` adds a user's constructor. Nothing registers itself on import.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from attnx.core.weightings import pointwise, rownorm, simplex
from attnx.core.weightings.base import (
    TRAITS,
    Pointwise,
    RowNormalizer,
    Weighting,
    WeightingLike,
    check_normalization,
)

# name -> constructor, for every built-in weighting.
BUILTIN: dict[str, Callable[..., Weighting]] = {
    "softmax": pointwise.softmax,
    "exp": pointwise.exp,
    "softmax_plus_one": pointwise.softmax_plus_one,
    "relu": pointwise.relu,
    "relu2": pointwise.relu2,
    "softplus": pointwise.softplus,
    "elu_plus_one": pointwise.elu_plus_one,
    "taylor_exp": pointwise.taylor_exp,
    "power": pointwise.power,
    "sigmoid": pointwise.sigmoid,
    "gaussian": pointwise.gaussian,
    "boxcar": pointwise.boxcar,
    "triangular": pointwise.triangular,
    "epanechnikov": pointwise.epanechnikov,
    "ssmax": rownorm.ssmax_weighting,
    "softpick": rownorm.softpick_weighting,
    "stick_breaking": rownorm.stick_breaking_weighting,
    "sparsemax": simplex.sparsemax_weighting,
    "entmax15": simplex.entmax15_weighting,
    "entmax": simplex.entmax_weighting,
}


def _summary(constructor: Callable[..., Weighting]) -> str:
  """The first line of a constructor's docstring: its one-line description."""
  return (constructor.__doc__ or "").strip().split("\n")[0]


_REGISTRY: dict[str, Callable[..., Weighting]] = dict(BUILTIN)
_DOCS: dict[str, str] = {name: _summary(f) for name, f in BUILTIN.items()}

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
    _DOCS[name] = doc or _summary(f)
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
    check_normalization(normalization, label)
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

