"""Sparse projections onto the probability simplex: sparsemax and α-entmax.

Attention weights as a regularized argmax over the simplex Δ (after Martins et al. 2020 and
Blondel, Martins &
Niculae 2020, "Learning with Fenchel-Young losses"):

    p*(z) = argmax_{p ∈ Δ} ⟨p, z⟩ − Ω(p).

* Ω = −Shannon entropy gives softmax.
* Ω = ½‖p‖² − ½ (Gini) gives **sparsemax** = [z − τ]₊ (Martins & Astudillo 2016).
* Ω = −Tsallis α-entropy, H^T_α(p) = (1 − Σ p^α)/(α(α−1)), gives **α-entmax**
  = [(α−1) z − τ]₊^{1/(α−1)} (Peters, Niculae & Martins 2019); α → 1 is softmax, α = 2 is
  sparsemax, α = 1.5 has a closed form once the support is known (:func:`entmax15`).

τ is the unique threshold making the weights sum to one. All three are shift invariant
(p*(z + c) = p*(z)), which we exploit: rows are shifted by their (valid) maximum before any
other math, so scores of ±1e4 stay exact in float32. All compute in float32, or float64 for
float64 inputs (:func:`attnx.core.contract.compute_dtype`; the bisections then take enough
steps for float64 resolution). Gradients are exact, via ``jax.custom_jvp``
(Peters et al. 2019, Prop. 2): with s = p^{2−α} on the support and 0 elsewhere,

    dp = s ⊙ dz − (⟨s, dz⟩ / Σ s) s,

which for sparsemax (α = 2, s = 1[p > 0]) is dz − mean_S(dz) on the support S.

Masking: ``where=False`` entries never get weight. They are replaced by a finite value that lies
provably below the threshold τ (never −inf, which makes the threshold arithmetic produce NaN — a
known failure of reference entmax15 on fully masked rows), and their weight is then set to
exactly 0. Scores equal to −inf are treated as masked too. A fully masked
row returns all zeros with zero gradients.

:func:`sparsemax_weighting`, :func:`entmax15_weighting` and :func:`entmax_weighting` are the
``RowNormalizer`` weightings ``"sparsemax"``, ``"entmax15"`` and ``"entmax"``
(``"entmax:alpha=1.3,n_iter=40"``) of the registry (:mod:`attnx.core.weightings.registry`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnx.core import params as params_lib
from attnx.core.contract import compute_dtype
from attnx.core.streaming import RowStream
from attnx.core.weightings.base import RowNormalizer, label

Array = jax.Array

DEFAULT_N_ITER = 30  # bisection steps; 24 already reach float32 resolution (docs/references.md)
# Float64 (jax_enable_x64): 29 more halvings for its 52-bit mantissa (float32's has 23).
DEFAULT_N_ITER_F64 = DEFAULT_N_ITER + 29
_ENTMAX15_BISECT_STEPS = 25  # τ ∈ [−1, 0]: 2⁻²⁵ ≈ 3e-8, float32 resolution near 1
_ENTMAX15_BISECT_STEPS_F64 = 54  # 2⁻⁵⁴ ≈ 6e-17, float64 resolution near 1


def _is_f64(dtype) -> bool:
  return jnp.dtype(dtype).itemsize > 4


def default_n_iter(dtype) -> int:
  """The bisection steps of :func:`entmax_bisect` for scores of ``dtype`` (its n_iter=None):
  30 in float32 (and for 16-bit inputs, computed in float32), 59 in float64."""
  return DEFAULT_N_ITER_F64 if _is_f64(compute_dtype(dtype)) else DEFAULT_N_ITER


# --------------------------------------------------------------------------------------------
# Shared plumbing: float32 (float64 for float64 inputs), move the axis last, shift by the valid
# row max, fill masked entries.
# --------------------------------------------------------------------------------------------

def _prepare(x: Array, where: Array | None, axis: int, fill: float) -> tuple[Array, Array]:
  """Returns (z, valid) with the normalized axis last and max(z over valid) = 0.

  Masked entries become ``fill`` (a value below any possible threshold τ after the shift);
  fully masked rows become all zeros, so the core solvers always see a regular row.
  """
  x = jnp.asarray(x)
  z = jnp.moveaxis(x.astype(compute_dtype(x.dtype)), axis, -1)  # float32, or float64
  # −inf scores (a common way to mask) are treated exactly like where=False.
  valid = z != -jnp.inf
  if where is not None:
    where = jnp.broadcast_to(jnp.asarray(where, bool), jnp.shape(x))
    valid = valid & jnp.moveaxis(where, axis, -1)
  any_valid = jnp.any(valid, axis=-1, keepdims=True)
  m = jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1, keepdims=True)
  # Shift invariance makes the gradient through m exactly zero; stop it to keep grads finite.
  m = jax.lax.stop_gradient(jnp.where(any_valid, m, 0.0))
  z = jnp.where(valid, z - m, jnp.where(any_valid, fill, 0.0))
  return z, valid


def _finish(p: Array, valid: Array, axis: int) -> Array:
  p = jnp.where(valid, p, 0.0)
  return jnp.moveaxis(p, -1, axis)


def _support(p: Array) -> Array:
  """p > 0, with NaN counted in: a NaN row's derivative is then NaN, as the other
  weightings' (NaN where it reaches, attnx.core.contract), not a zero that hides the NaN."""
  return ~(p <= 0)


def _simplex_jvp(p: Array, s: Array, dz: Array) -> Array:
  """dp = s·dz − (⟨s, dz⟩/Σs)·s, the Jacobian-vector product of α-entmax (s = p^{2−α})."""
  ssum = jnp.sum(s, axis=-1, keepdims=True)
  ssum = jnp.where(ssum > 0, ssum, 1.0)
  return s * dz - (jnp.sum(s * dz, axis=-1, keepdims=True) / ssum) * s


# --------------------------------------------------------------------------------------------
# sparsemax.
# --------------------------------------------------------------------------------------------

@jax.custom_jvp
def _sparsemax_last(z: Array) -> Array:
  """Sparsemax over the last axis of rows with max 0, by Michelot's (1986) fixed point.

  Start with every entry in the support S; repeat τ = (Σ_S z − 1)/|S|, S = {z > τ}. τ only
  grows and S only shrinks, so the loop ends, on the exact support, after at most n rounds
  (≈ log n in practice: 6 at n = 17, 12 at n = 4096). Each round is one fused pass over the
  row, where sorting (Martins & Astudillo's Algorithm 1) costs 10-40× more on a CPU.
  """
  n = z.shape[-1]

  def tau_of(support):
    k = jnp.sum(support, axis=-1, keepdims=True, dtype=z.dtype)  # ≥ 1: the max 0 stays in S
    return (jnp.sum(jnp.where(support, z, 0.0), axis=-1, keepdims=True) - 1.0) / k, k

  def body(carry):
    i, tau, k_old, _ = carry
    tau_new, k = tau_of(z > tau)
    return i + 1, tau_new, k, jnp.any(k != k_old)

  tau0, k0 = tau_of(jnp.ones(z.shape, bool))
  # n + 1 rounds bound the loop even if float rounding ever made |S| oscillate.
  _, tau, _, _ = jax.lax.while_loop(lambda c: (c[0] <= n) & c[3], body,
                                    (0, tau0, k0, jnp.array(True)))
  return jnp.maximum(z - tau, 0.0)


@_sparsemax_last.defjvp
def _sparsemax_last_jvp(primals, tangents):
  (z,), (dz,) = primals, tangents
  p = _sparsemax_last(z)
  s = jnp.where(jnp.isnan(p), p, _support(p).astype(p.dtype))  # 1 on the support, or NaN
  return p, _simplex_jvp(p, s, dz)


@functools.partial(jax.jit, static_argnames=("axis",))
def sparsemax(x: Array, axis: int = -1, where: Array | None = None) -> Array:
  """Sparsemax, the Euclidean projection of ``x`` onto the simplex (Martins & Astudillo 2016).

  sparsemax(z) = argmax_{p∈Δ} ⟨p, z⟩ − ½‖p‖² = [z − τ]₊ with Σ = 1. Exact (Michelot's
  fixed point on the support; no sort).

  Args:
    x: scores, any float dtype (computed in float32, or float64 for float64 inputs).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get weight exactly 0,
      fully masked rows get all zeros.

  Returns:
    float32 weights (float64 for float64 inputs) of ``x``'s shape; each (non-fully-masked)
    row sums to one.
  """
  # After the shift the max is 0 and τ ≥ max − 1 = −1, so −2 is always outside the support.
  z, valid = _prepare(x, where, axis, fill=-2.0)
  return _finish(_sparsemax_last(z), valid, axis)


# --------------------------------------------------------------------------------------------
# 1.5-entmax (exact).
# --------------------------------------------------------------------------------------------

def _bisect_threshold(z: Array, mass, n_iter: int, lo: float = -1.0, hi: float = 0.0) -> Array:
  """t in [lo, hi] with mass(z, t) = 1 per row, by bisection (mass decreases in t)."""
  lo = jnp.full(z.shape[:-1] + (1,), lo, z.dtype)
  hi = jnp.full_like(lo, hi)

  def body(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    too_much = mass(z, mid) >= 1.0
    return jnp.where(too_much, mid, lo), jnp.where(too_much, hi, mid)

  lo, hi = jax.lax.fori_loop(0, n_iter, body, (lo, hi))
  return 0.5 * (lo + hi)


@jax.custom_jvp
def _entmax15_last(z: Array) -> Array:
  """1.5-entmax over the last axis of rows with max 0: [z/2 − τ]₊² (Peters et al. 2019).

  Bisection on τ ∈ [−1, 0] to float32 resolution (float64 for float64 rows) finds the support
  S = {z/2 > τ}; τ then comes from the closed form on S (the smaller root of
  Σ_S (z_j/2 − τ)² = 1), as in the paper's sort-based Algorithm 2 but with ~25 fused passes
  (54 in float64) instead of a sort (10-20× faster on a CPU). Only an entry within 2⁻²⁵ of τ
  (2⁻⁵⁴ in float64) — weight ≤ 1e-15 (1e-32) — could be put on the wrong side.
  """
  zh = z / 2.0  # the (α−1) z scaling
  t = _bisect_threshold(
      zh, lambda x, t: jnp.sum(jnp.square(jnp.maximum(x - t, 0.0)), axis=-1, keepdims=True),
      _ENTMAX15_BISECT_STEPS_F64 if _is_f64(z.dtype) else _ENTMAX15_BISECT_STEPS)
  support = zh > t  # never empty: τ < 0 = max
  k = jnp.sum(support, axis=-1, keepdims=True, dtype=z.dtype)
  mean = jnp.sum(jnp.where(support, zh, 0.0), axis=-1, keepdims=True) / k
  ss = jnp.sum(jnp.where(support, jnp.square(zh - mean), 0.0), axis=-1, keepdims=True)
  tau = mean - jnp.sqrt(jnp.maximum((1.0 - ss) / k, 0.0))
  return jnp.square(jnp.maximum(zh - tau, 0.0))


@_entmax15_last.defjvp
def _entmax15_last_jvp(primals, tangents):
  (z,), (dz,) = primals, tangents
  p = _entmax15_last(z)
  pos = _support(p)  # safe sqrt: keeps second derivatives finite at the support boundary
  return p, _simplex_jvp(p, jnp.where(pos, jnp.sqrt(jnp.where(pos, p, 1.0)), 0.0), dz)


@functools.partial(jax.jit, static_argnames=("axis",))
def entmax15(x: Array, axis: int = -1, where: Array | None = None) -> Array:
  """1.5-entmax (Peters, Niculae & Martins 2019): support by bisection, τ in closed form.

  entmax15(z) = argmax_{p∈Δ} ⟨p, z⟩ + H^T_{1.5}(p) = [z/2 − τ]₊². Sparse like sparsemax but
  smoother; e.g. [−2, 0, 0.5] ↦ [0, 0.326, 0.674].

  Args:
    x: scores, any float dtype (computed in float32, or float64 for float64 inputs).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get weight exactly 0,
      fully masked rows get all zeros (never NaN).

  Returns:
    float32 weights (float64 for float64 inputs) of ``x``'s shape.
  """
  # After the shift τ ≥ max/2 − 1 = −1, so z = −3 (z/2 = −1.5) is always outside the support.
  z, valid = _prepare(x, where, axis, fill=-3.0)
  return _finish(_entmax15_last(z), valid, axis)


# --------------------------------------------------------------------------------------------
# α-entmax by bisection.
# --------------------------------------------------------------------------------------------
# We write (α−1) z − τ = 1 + (α−1)(y − δ) with y = z − max z ≤ 0 and bisect on δ ≥ 0, so
# p = exp(log1p((α−1)(y − δ)) / (α−1)). This is the usual τ-bisection (Blondel et al. 2019,
# Peters et al. 2019) reparametrized so that α → 1 degrades gracefully to exp(y − δ) (softmax,
# δ = logsumexp y) instead of raising a number near 1 to a huge power.

def _entmax_log_p(y: Array, delta: Array, alpha: float) -> tuple[Array, Array]:
  """(log p, in_support) for p = [1 + (α−1)(y − δ)]₊^{1/(α−1)}; NaN counts as in the support,
  so that a NaN row's p (and gradient) is NaN rather than 0."""
  a = (alpha - 1.0) * (y - delta)
  pos = ~(a <= -1.0)
  return jnp.log1p(jnp.where(pos, a, 0.0)) / (alpha - 1.0), pos


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _entmax_bisect_last(y: Array, alpha: float, n_iter: int) -> Array:
  n = y.shape[-1]
  am1 = alpha - 1.0
  # δ = 0 gives p_max = 1 (Σp ≥ 1); δ_hi gives p_max = 1/n (Σp ≤ 1).
  hi = -math.expm1(-am1 * math.log(n)) / am1 if n > 1 else 0.0

  def mass(y, delta):
    log_p, pos = _entmax_log_p(y, delta, alpha)
    return jnp.sum(jnp.where(pos, jnp.exp(log_p), 0.0), axis=-1, keepdims=True)

  delta = _bisect_threshold(y, mass, n_iter, lo=0.0, hi=hi)
  log_p, pos = _entmax_log_p(y, delta, alpha)
  p = jnp.where(pos, jnp.exp(log_p), 0.0)
  total = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(total > 0, total, 1.0)  # remove the residual bisection error


@_entmax_bisect_last.defjvp
def _entmax_bisect_last_jvp(alpha, n_iter, primals, tangents):
  (y,), (dy,) = primals, tangents
  p = _entmax_bisect_last(y, alpha, n_iter)
  # s = p^{2−α} on the support (0^0 must be 0 here, not 1).
  pos = _support(p)
  s = jnp.where(pos, jnp.exp((2.0 - alpha) * jnp.log(jnp.where(pos, p, 1.0))), 0.0)
  return p, _simplex_jvp(p, s, dy)


def _check_alpha(alpha: float) -> float:
  if isinstance(alpha, jax.Array) or hasattr(alpha, "aval"):
    raise TypeError("entmax alpha must be a concrete Python number (it selects the "
                    f"algorithm), got {type(alpha).__name__}")
  if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha == 1.0:
    raise ValueError("entmax needs alpha > 1, got 1; alpha = 1 is softmax: use "
                     "jax.nn.softmax or the 'softmax' weighting.")
  return params_lib.number("weighting 'entmax'", "alpha", alpha, low=1.0)


@functools.partial(jax.jit, static_argnames=("alpha", "axis", "n_iter"))
def entmax_bisect(x: Array, alpha: float = 1.5, axis: int = -1, where: Array | None = None,
                  n_iter: int | None = None) -> Array:
  """α-entmax for any α > 1 by bisection on the threshold (Peters et al. 2019).

  entmax_α(z) = argmax_{p∈Δ} ⟨p, z⟩ + H^T_α(p) = [(α−1) z − τ]₊^{1/(α−1)},
  H^T_α(p) = (1 − Σ p_j^α)/(α(α−1)). α → 1⁺ tends to softmax, α = 1.5 equals
  :func:`entmax15`, α = 2 equals :func:`sparsemax`; larger α is sparser.

  Args:
    x: scores, any float dtype (computed in float32, or float64 for float64 inputs).
    alpha: a concrete Python float > 1 (ValueError otherwise; use softmax for α = 1).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get weight exactly 0,
      fully masked rows get all zeros.
    n_iter: bisection steps; the bracket has width ≤ log n, so 30 reach float32 resolution.
      None (the default) takes enough for the compute dtype: 30 for float32 and 16-bit
      inputs, 59 for float64 ones (``attnx.core.weightings.simplex.default_n_iter``).

  Returns:
    float32 weights (float64 for float64 inputs) of ``x``'s shape.
  """
  alpha = _check_alpha(alpha)
  if n_iter is None:
    n_iter = default_n_iter(jnp.asarray(x).dtype)
  n_iter = params_lib.number("entmax_bisect", "n_iter", n_iter, low=1, low_open=False,
                             integer=True)
  # Entries with y ≤ −1/(α−1) have weight 0 for every δ ≥ 0.
  z, valid = _prepare(x, where, axis, fill=-1.0 / (alpha - 1.0) - 1.0)
  return _finish(_entmax_bisect_last(z, alpha, n_iter), valid, axis)


# --------------------------------------------------------------------------------------------
# The weightings.
# --------------------------------------------------------------------------------------------

def _check_scale(name: str, scale: float) -> float:
  return params_lib.number(f"weighting {name!r}", "scale", scale, low=0.0)


def _row(base: str, fn, scale: float, stream: RowStream, **params) -> RowNormalizer:
  name = label(base, **params, scale=None if scale == 1.0 else scale)
  # Projections onto the simplex: rows sum to one, and [x − τ]₊ moves τ with a shift of x.
  traits = dict(sums_to_one=True, shift_invariant=True)
  if scale == 1.0:
    return RowNormalizer(name=name, fn=lambda s, w, ax: fn(s, axis=ax, where=w),
                         stream=stream, **traits)
  return RowNormalizer(name=name, fn=lambda s, w, ax: fn(scale * s, axis=ax, where=w),
                       stream=stream, **traits)


def sparsemax_weighting(scale: float = 1.0) -> RowNormalizer:
  """[s − τ]₊, Euclidean projection onto the simplex (Martins & Astudillo 2016)

  The weighting ``"sparsemax:scale=..."``: :func:`sparsemax` of ``scale`` · s.
  """
  scale = _check_scale("sparsemax", scale)
  return _row("sparsemax", sparsemax, scale, RowStream("entmax", alpha=2.0, scale=scale))


def entmax15_weighting(scale: float = 1.0) -> RowNormalizer:
  """[s/2 − τ]₊², exact 1.5-entmax (Peters et al. 2019)

  The weighting ``"entmax15:scale=..."``: :func:`entmax15` of ``scale`` · s.
  """
  scale = _check_scale("entmax15", scale)
  return _row("entmax15", entmax15, scale, RowStream("entmax", alpha=1.5, scale=scale))


def entmax_weighting(alpha: float = 1.5, n_iter: int | None = None,
                     scale: float = 1.0) -> RowNormalizer:
  """[(α−1)s − τ]₊^{1/(α−1)}, α-entmax by bisection (param alpha>1, n_iter)

  The weighting ``"entmax:alpha=...,n_iter=...,scale=..."``: α-entmax of ``scale`` · s, with
  the exact algorithms for α ∈ {1.5, 2} (:func:`entmax15`, :func:`sparsemax`) unless
  ``n_iter`` is given, else :func:`entmax_bisect`.
  """
  alpha = _check_alpha(alpha)
  scale = _check_scale("entmax", scale)
  if n_iter is not None:
    n_iter = params_lib.number("weighting 'entmax'", "n_iter", n_iter, low=1, low_open=False,
                               integer=True)
  if n_iter is None and alpha == 2.0:
    fn = sparsemax
  elif n_iter is None and alpha == 1.5:
    fn = entmax15
  else:
    fn = functools.partial(entmax_bisect, alpha=alpha,
                           n_iter=None if n_iter is None else int(n_iter))
  stream = RowStream("entmax", alpha=alpha, scale=scale,
                     renormalize=fn not in (sparsemax, entmax15))
  return _row("entmax", fn, scale, stream, alpha=alpha, n_iter=n_iter)
