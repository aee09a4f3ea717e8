"""Whole-row normalizers from recent work: SSMax, softpick and stick-breaking attention.

None of these is ``F(s)/ΣF(s)`` with a fixed elementwise F, so each is a
:class:`~attnx.core.weightings.base.RowNormalizer` (see ``docs/references.md``):

* **SSMax** (Nakanishi 2025, arXiv 2501.19399): softmax((s · log n) · z), n = number of valid
  keys, so the attention does not flatten as the context grows.
* **softpick** (Zuhri et al. 2025, arXiv 2504.20966): relu(eᶻ − 1)/(Σ|eᶻ − 1| + ε); rows need
  not sum to one (no attention sink), negative scores get exactly zero weight.
* **stick-breaking** (Tan et al. 2024, arXiv 2410.17980): β_j = σ(z_j) and
  w_j = β_j Π_{k>j}(1 − β_k), the stick broken from the last position of the axis backwards
  (for causal attention: nearest key first); rows sum to ≤ 1.

All functions compute in float32, or float64 for float64 inputs
(:func:`attnx.core.contract.compute_dtype`), accept ``where`` (False → weight exactly 0; a fully
masked row gives zeros with finite gradients; −inf scores count as masked) and stay finite for
scores of ±1e4. :func:`ssmax_weighting`, :func:`softpick_weighting` and
:func:`stick_breaking_weighting` are the weightings ``"ssmax"``, ``"softpick"`` and
``"stick_breaking"`` of the registry (:mod:`attnx.core.weightings.registry`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnx.core import params as params_lib
from attnx.core.contract import compute_dtype
from attnx.core.streaming import RowStream
from attnx.core.weightings.base import RowNormalizer, WeightingParam, label

Array = jax.Array

SSMAX_DEFAULT_S = 1.0  # the paper learns s per head; we did not verify its initialization
SOFTPICK_EPS = 1e-6


def _prepare(x: Array, where: Array | None, axis: int) -> tuple[Array, Array]:
  """(z with the axis last, valid mask); masked/−inf entries of z are set to 0. z is float32,
  or float64 for float64 ``x`` (:func:`attnx.core.contract.compute_dtype`)."""
  x = jnp.asarray(x)
  z = jnp.moveaxis(x.astype(compute_dtype(x.dtype)), axis, -1)
  valid = z != -jnp.inf
  if where is not None:
    where = jnp.broadcast_to(jnp.asarray(where, bool), jnp.shape(x))
    valid = valid & jnp.moveaxis(where, axis, -1)
  # Double-where: masked entries never reach exp/log, so their gradients stay finite.
  return jnp.where(valid, z, 0.0), valid


def _masked_max(z: Array, valid: Array) -> Array:
  m = jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1, keepdims=True)
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))


# --------------------------------------------------------------------------------------------
# SSMax.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("axis",))
def ssmax(x: Array, axis: int = -1, where: Array | None = None,
          s: float | Array = SSMAX_DEFAULT_S) -> Array:
  """Scalable-Softmax (Nakanishi 2025, arXiv 2501.19399).

  SSMax(z)_i = n^{s z_i} / Σ_j n^{s z_j} = softmax((s · log n) · z)_i, with n the number of
  valid keys in the row (at least 1; n = 1 gives weight 1 to the single key).

  Args:
    x: scores, any float dtype (computed in float32, or float64 for float64 inputs).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get weight 0.
    s: the scaling parameter (learned per head in the paper; any array broadcastable to the
      row-reduced shape with the axis kept, or a scalar). The default 1.0 is our choice.

  Returns:
    float32 weights (float64 for float64 inputs); non-empty rows sum to one, fully masked rows
    are all zeros.
  """
  z, valid = _prepare(x, where, axis)
  n = jnp.sum(valid, axis=-1, keepdims=True).astype(z.dtype)
  s = jnp.asarray(s, z.dtype)
  if s.ndim:
    s = jnp.moveaxis(jnp.broadcast_to(s, jnp.broadcast_shapes(s.shape, jnp.shape(x))),
                     axis, -1)
  a = s * jnp.log(jnp.maximum(n, 1.0)) * z
  m = _masked_max(jnp.where(valid, a, -jnp.inf), valid)
  e = jnp.where(valid, jnp.exp(jnp.where(valid, a - m, 0.0)), 0.0)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  # Only an empty row divides by 1: a NaN denominator (a NaN score) keeps the whole row NaN,
  # and with it the row's gradient (attnx.core.contract).
  p = e / jnp.where(denom == 0, 1.0, denom)
  return jnp.moveaxis(p, -1, axis)


# --------------------------------------------------------------------------------------------
# softpick.
# --------------------------------------------------------------------------------------------

# The largest m for e^{−m}·expm1(z): e^80 is far from float32 overflow (e^88.7), e^700 from
# float64's (e^709.8). Past it e^{z−m} − e^{−m} cancels only in weights ≲ e^{−m} of the largest.
_EXPM1_SAFE = 80.0
_EXPM1_SAFE_F64 = 700.0


def _expm1_safe(dtype) -> float:
  return _EXPM1_SAFE_F64 if jnp.dtype(dtype).itemsize > 4 else _EXPM1_SAFE


@functools.partial(jax.jit, static_argnames=("axis",))
def softpick(x: Array, axis: int = -1, where: Array | None = None,
             eps: float = SOFTPICK_EPS) -> Array:
  """Softpick (Zuhri et al. 2025, arXiv 2504.20966), ``relu(eᶻ − 1)/(Σ_j |e^{z_j} − 1| + ε)``.

  Evaluated as relu(d)/(Σ|d| + ε e^{−m}) with d = e^{z−m} − e^{−m} = e^{−m}(eᶻ − 1) and
  m = max(0, row max), which is the same ratio without overflow. For m < 80 (700 in float64)
  we use e^{−m}·expm1(z), exact for small ``|z|`` where e^{z−m} − e^{−m} would cancel.

  Args:
    x: scores, any float dtype (computed in float32, or float64 for float64 inputs).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get weight 0.
    eps: the ε of the denominator.

  Returns:
    float32 (float64 for float64 inputs) weights in [0, 1); rows sum to less than one by
    design (exactly 0 if every valid score is ≤ 0; fully masked rows are zeros).
  """
  z, valid = _prepare(x, where, axis)
  m = jnp.maximum(_masked_max(z, valid), 0.0)
  safe = _expm1_safe(z.dtype)
  small = m < safe
  d_small = jnp.exp(-jnp.minimum(m, safe)) * jnp.expm1(jnp.minimum(z, safe))
  d_large = jnp.exp(z - m) - jnp.exp(-m)
  d = jnp.where(valid, jnp.where(small, d_small, d_large), 0.0)
  denom = jnp.sum(jnp.abs(d), axis=-1, keepdims=True) + eps * jnp.exp(-m)
  p = jax.nn.relu(d) / jnp.where(denom == 0, 1.0, denom)  # NaN stays NaN, as in ssmax
  return jnp.moveaxis(p, -1, axis)


# --------------------------------------------------------------------------------------------
# Stick-breaking.
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("axis",))
def stick_breaking(x: Array, axis: int = -1, where: Array | None = None) -> Array:
  """Stick-breaking attention (Tan et al. 2024, arXiv 2410.17980), in log space.

  β_j = σ(z_j), w_j = β_j Π_{k>j, valid}(1 − β_k): the last position along ``axis`` takes its
  share first and each earlier key gets what is left. Computed as
  log w_j = logσ(z_j) + Σ_{k>j, valid} logσ(−z_k) with a reverse exclusive cumsum, so no
  product of many numbers < 1 underflows before the exp.

  Args:
    x: scores, any float dtype (computed in float32, or float64 for float64 inputs).
    axis: the axis to normalize over (position order matters).
    where: optional boolean mask broadcastable to ``x``; masked keys neither receive weight nor
      break the stick.

  Returns:
    float32 (float64 for float64 inputs) weights with Σ w = 1 − Π_valid(1 − β) ≤ 1.
  """
  z, valid = _prepare(x, where, axis)
  log_rest = jnp.where(valid, jax.nn.log_sigmoid(-z), 0.0)
  # Exclusive reverse cumsum: Σ_{k>j}. Shifting the inclusive one avoids a cancelling subtraction.
  incl = jax.lax.cumsum(log_rest, axis=log_rest.ndim - 1, reverse=True)
  excl = jnp.concatenate([incl[..., 1:], jnp.zeros_like(incl[..., :1])], axis=-1)
  log_w = jax.nn.log_sigmoid(z) + excl
  p = jnp.where(valid, jnp.exp(log_w), 0.0)
  return jnp.moveaxis(p, -1, axis)


# --------------------------------------------------------------------------------------------
# The weightings.
# --------------------------------------------------------------------------------------------

def ssmax_weighting(s: float = SSMAX_DEFAULT_S) -> RowNormalizer:
  """softmax((s·log n)·z), n = valid keys (Nakanishi 2025, arXiv 2501.19399)

  The weighting ``"ssmax:s=..."``: :func:`ssmax` with a fixed ``s``.
  """
  s = params_lib.number("weighting 'ssmax'", "s", s)
  return RowNormalizer(
      name=label("ssmax", s=None if s == SSMAX_DEFAULT_S else s),
      fn=lambda z, w, ax: ssmax(z, axis=ax, where=w, s=s), stream=RowStream("ssmax", s=s),
      # softmax of c·z, c = s·log n per row: a shift c·M of every c·z cancels.
      sums_to_one=True, shift_invariant=True,
      learnable=(WeightingParam("s", default=s, kernel_arg="ssmax_s"),),
      bind=lambda values: lambda z, w, ax: ssmax(z, axis=ax, where=w, s=values["s"]))


def softpick_weighting(eps: float = SOFTPICK_EPS) -> RowNormalizer:
  """relu(e^s − 1)/(Σ|e^s − 1| + ε), rows sum to < 1 (arXiv 2504.20966)

  The weighting ``"softpick:eps=..."``: :func:`softpick` with a fixed ``eps``.
  """
  eps = params_lib.number("weighting 'softpick'", "eps", eps, low=0.0)
  return RowNormalizer(
      name=label("softpick", eps=None if eps == SOFTPICK_EPS else eps),
      fn=lambda z, w, ax: softpick(z, axis=ax, where=w, eps=eps),
      stream=RowStream("softpick", eps=eps),
      zero_on_nonpositive=True)  # relu(e^z − 1) = 0 for z ≤ 0; rows sum to < 1


def stick_breaking_weighting() -> RowNormalizer:
  """σ(s_j)Π_{k>j}(1 − σ(s_k)), last key first, rows sum to ≤ 1 (Tan et al. 2024)

  The weighting ``"stick_breaking"``: :func:`stick_breaking`.
  """
  return RowNormalizer(
      name="stick_breaking", fn=lambda z, w, ax: stick_breaking(z, axis=ax, where=w),
      stream=RowStream("stick_breaking"))  # σ(z) > 0; rows sum to ≤ 1; no trait holds
