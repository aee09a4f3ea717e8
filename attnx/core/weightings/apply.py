"""Applying a weighting to a dense array of scores: :func:`weights` and the reference
implementation every kernel is checked against.

Masked entries (``where=False``) never reach F: they are replaced by a safe value before F is
applied and their weight is set to exactly 0, so fully masked rows give all-zero weights with
finite gradients (the "double where" trick).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnx.core.weightings.base import Array, Pointwise, Weighting, WeightingLike
from attnx.core.weightings.registry import get_weighting


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
    # log F sees only valid scores (as F does below), so masked ones cannot make NaN.
    z = w.exponent(s if valid is None or w.log_f is None else jnp.where(valid, s, 0.0), n)
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

