"""The ``attention`` dict every block and model takes, and experiment variant names.

An attention spec is a dict with key ``type``:

* ``"dot"`` (default): :class:`~attnx.nn.MultiHeadAttention`; keys ``weighting``, ``score``,
  ``implementation``, ``qk_norm``, ``num_kv_heads``, ``score_dim``, ``scale``, ...
* ``"linear"``: :class:`~attnx.nn.LinearAttention`; keys ``feature_map``, ``num_features``.
* ``"metric"``: :class:`~attnx.nn.MetricAttention` (``MultiHeadAttention(score="metric")``);
  keys ``weighting``, ``rank``, ``learn_temperature``, ...
* ``"additive"``: :class:`~attnx.nn.AdditiveAttention` (Bahdanau scores, no projections);
  keys ``weighting``, ``attention_dim``.

All other keys are forwarded to the module's constructor. Every type is called the same way,
with the same mask (see :func:`attnx.nn.transformer.call_attention`). :func:`attention_spec`
maps the variant names used on experiment command lines (``"relu"``, ``"entmax:alpha=1.5"``,
``"linear_favor"``, ``"metric:weighting=sparsemax"``) to such dicts.

Distance kernels (``gaussian``, ``boxcar``, ``triangular``, ``epanechnikov``) are functions of
−‖q − k‖²: a ``"dot"`` spec with such a weighting and no ``score`` gets ``score="neg_sq_dist"``,
in the dict form as in the variant name, so ``{"weighting": "gaussian"}`` and
``attention_spec("gaussian")`` build the same model. An explicit similarity score with a
distance kernel raises (``core.check_compatible``), as do other bad weighting/score/
implementation combinations, when the spec is resolved (at block/model construction).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax.core import FrozenDict

from attnx import core
from attnx.nn import _util
from attnx.nn.additive import AdditiveAttention
from attnx.nn.attention import MultiHeadAttention
from attnx.nn.linear import LinearAttention
from attnx.nn.metric import MetricAttention

ATTENTION_TYPES = {"dot": MultiHeadAttention, "linear": LinearAttention,
                   "metric": MetricAttention, "additive": AdditiveAttention}
# The score each type other than "dot" (whose spec names it) always uses; linear has none.
_FIXED_SCORES = {"metric": "metric", "additive": "additive"}

SPECIAL_VARIANTS: dict[str, dict[str, Any]] = {
    "linear_elu": {"type": "linear", "feature_map": "elu_plus_one"},
    "linear_favor": {"type": "linear", "feature_map": "favor_plus"},
    "metric": {"type": "metric"},
    "additive": {"type": "additive"},
    # SSMax as published (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"): s
    # learned per head, starting from 0.43 (the default of gdevos010/Scalable-Softmax, which
    # cites the paper for it); the plain name "ssmax" keeps s fixed.
    "ssmax_learned": {"type": "dot", "weighting": "ssmax:s=0.43", "learn_ssmax_s": True},
}


def is_distance_kernel(weighting: Any) -> bool:
  """Whether a weighting spec is a kernel of ‖q − k‖ (reads the score as −d²)."""
  return bool(getattr(core.get_weighting(weighting), "distance_kernel", False))


def list_attention_variants() -> list[str]:
  """Every weighting name plus the special variants (``linear_elu``, ``linear_favor``,
  ``metric``, ``additive``, ``ssmax_learned``)."""
  return sorted(set(core.list_weightings()) | set(SPECIAL_VARIANTS))


def attention_spec(variant: str) -> dict[str, Any]:
  """Maps an experiment variant name to an attention dict.

  ``"linear_elu"``, ``"linear_favor"``, ``"metric"``, ``"additive"``, ``"ssmax_learned"`` (SSMax
  with s learned per head) are special;
  ``"special:k=v,..."`` adds keys (``"metric:weighting=sparsemax"``,
  ``"linear_favor:num_features=64"``). Anything else is a weighting spec for
  ``{"type": "dot", "weighting": variant}`` (distance kernels such as ``"gaussian:h=2"`` also
  get ``score="neg_sq_dist"``, as in :func:`resolve_attention`).

  Raises:
    ValueError: unknown variant, listing the valid weightings and the special variants.

  Example:
    >>> from attnx import nn
    >>> nn.attention_spec("relu")
    {'type': 'dot', 'weighting': 'relu'}
    >>> nn.attention_spec("gaussian:h=2")
    {'type': 'dot', 'weighting': 'gaussian:h=2', 'score': 'neg_sq_dist'}
    >>> nn.attention_spec("linear_favor:num_features=64")
    {'type': 'linear', 'feature_map': 'favor_plus', 'num_features': 64}
  """
  if not isinstance(variant, str) or not variant.strip():
    raise ValueError(f"attention variant must be a non-empty string, got {variant!r}")
  base, params = core.parse_weighting_name(variant)
  if base in SPECIAL_VARIANTS:
    spec = {**SPECIAL_VARIANTS[base], **params}
    if "weighting" in spec:
      _check_weighting(spec["weighting"], variant)
    return spec
  _check_weighting(variant.strip(), variant)
  return _default_score({"type": "dot", "weighting": variant.strip()})


def _default_score(spec: dict[str, Any]) -> dict[str, Any]:
  """A dot spec with a distance kernel and no score gets the score that kernel reads."""
  if (spec.get("type", "dot") == "dot" and "score" not in spec
      and is_distance_kernel(spec.get("weighting", "softmax"))):
    spec["score"] = "neg_sq_dist"
  return spec


def _check_weighting(weighting: str, variant: str) -> None:
  try:
    core.get_weighting(weighting)
  except ValueError as e:
    raise ValueError(f"Unknown attention variant {variant!r}: {e} Special variants: "
                     f"{', '.join(sorted(SPECIAL_VARIANTS))}.") from None


def resolve_attention(attention: Mapping[str, Any] | str | None) -> dict[str, Any]:
  """Normalizes an attention dict (or a variant name, or None = softmax) to a full dict.

  Fills the default score of distance kernels (see the module docstring) and validates the
  weighting/score/implementation of every spec with a weighting (all types but ``"linear"``).

  Raises:
    ValueError: unknown type or weighting, or an incompatible combination.
  """
  if attention is None:
    return {"type": "dot"}
  if isinstance(attention, str):
    return attention_spec(attention)
  spec = dict(attention)
  spec.setdefault("type", "dot")
  if spec["type"] not in ATTENTION_TYPES:
    raise ValueError(f"Unknown attention type {spec['type']!r}; valid: "
                     f"{', '.join(ATTENTION_TYPES)}.")
  if isinstance(spec.get("weighting"), str):
    _check_weighting(spec["weighting"], spec["weighting"])
  spec = _default_score(spec)
  if spec["type"] != "linear":  # linear attention has no weighting or score
    score = _FIXED_SCORES.get(spec["type"]) or spec.get("score", "scaled_dot")
    _util.validate_attention_config(spec.get("weighting", "softmax"), score,
                                    spec.get("implementation"), f"attention spec {attention!r}")
  return spec


def freeze_attention_fields(module: Any, *fields: str) -> None:
  """Validates attention-spec fields of a linen module and stores them as hashable FrozenDicts.

  Call from ``__post_init__`` (before ``super().__post_init__()``): a bad spec fails at
  construction, and modules stay hashable (needed by ``nn.jit``/``nn.remat``).
  """
  for f in fields:
    value = getattr(module, f)
    if value is None:
      continue
    spec = resolve_attention(value)
    if not isinstance(value, str):
      object.__setattr__(module, f, FrozenDict(spec))


def make_attention(attention: Mapping[str, Any] | str | None, *, num_heads: int,
                   is_causal: bool = False, dropout_rate: float = 0.0,
                   dtype: Any = None, param_dtype: Any = jnp.float32,
                   name: str | None = None, **overrides: Any):
  """Builds the attention module an attention spec describes.

  Block-level settings (``num_heads``, ``is_causal``, ``dropout_rate``, dtypes) are given by
  the caller; spec keys win over ``overrides`` but not over ``is_causal``. Linear attention has
  no explicit weights, so ``dropout_rate`` is not passed to it.

  Raises:
    ValueError: a bad spec, or keys the module does not take.
  """
  spec = resolve_attention(attention)
  cls = ATTENTION_TYPES[spec.pop("type")]
  kw: dict[str, Any] = dict(num_heads=num_heads, dtype=dtype, param_dtype=param_dtype)
  kw.update(overrides)
  kw.update(spec)
  kw["is_causal"] = bool(is_causal or spec.get("is_causal", False))
  if cls is not LinearAttention:
    kw.setdefault("dropout_rate", dropout_rate)
  try:
    return cls(name=name, **kw)
  except TypeError as e:
    raise ValueError(f"Bad attention spec {attention!r} for {cls.__name__}: {e}") from None
