"""The built-in pointwise weightings, one constructor per family: ``w_j = F(s_j) / N``.

Each constructor returns the :class:`~attnx.core.weightings.base.Pointwise` that its registry
name gives (``power(p=3)`` is ``get_weighting("power:p=3")``); its keyword parameters are the
parameters the name accepts, ``normalization`` (``"sum"``, ``"length"`` or ``"none"``) among
them, and the first line of its docstring is the description :func:`describe_weightings` shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import params as params_lib
from attnx.core import softplus as softplus_lib
from attnx.core.weightings.base import Array, LogF, Pointwise, check_normalization, label

# The distance kernels: F(s) of a distance score s = −‖q − k‖² (``Pointwise.distance_kernel``).
POINTWISE_KERNELS = ("gaussian", "boxcar", "triangular", "epanechnikov")


def _pointwise(name, fn, normalization="sum", **kw) -> Pointwise:
  check_normalization(normalization, name)
  return Pointwise(name=name, fn=fn, normalization=normalization, **kw)


# --------------------------------------------------------------------------------------------
# exp(αs): streamed with a running maximum (online softmax).
# --------------------------------------------------------------------------------------------

def _exp_like(name: str, alpha: float, normalization: str, offset: float = 0.0) -> Pointwise:
  if normalization != "sum":
    raise ValueError(
        f"{name!r} is defined only with normalization='sum' (exp overflows unnormalized); "
        "use 'sigmoid' or 'gaussian' for unnormalized weights.")
  a = params_lib.number(f"weighting {name!r}", "alpha", alpha, low=0.0)
  return _pointwise(label(name, alpha=None if a == 1.0 else a),
                    lambda z, n: jnp.exp(a * z), "sum", exp_alpha=a, denominator_offset=offset)


def softmax(alpha: float = 1.0, normalization: str = "sum") -> Pointwise:
  """exp(alpha*s)/Σexp(alpha*s) (Alam et al.: the only shift-invariant F)

  ``alpha > 0`` is an inverse temperature; only ``normalization="sum"`` is defined.
  """
  return _exp_like("softmax", alpha, normalization)


def exp(alpha: float = 1.0, normalization: str = "sum") -> Pointwise:
  """alias of softmax: F(z)=exp(alpha*z), sum-normalized"""
  return _exp_like("exp", alpha, normalization)


def softmax_plus_one(alpha: float = 1.0, normalization: str = "sum") -> Pointwise:
  """exp(s)/(1+Σexp(s)), 'quiet' softmax (Evan Miller 2023)

  The 1 in the denominator acts as a virtual key of score 0: rows sum to less than one.
  """
  return _exp_like("softmax_plus_one", alpha, normalization, offset=1.0)


# --------------------------------------------------------------------------------------------
# Parameter-free F (only the normalization is chosen).
# --------------------------------------------------------------------------------------------

def _simple(name: str, fn: Callable[[Array], Array], normalization: str,
            zero_on_nonpositive: bool = False) -> Pointwise:
  return _pointwise(label(name, normalization=None if normalization == "sum"
                          else normalization), lambda z, n: fn(z), normalization,
                    zero_on_nonpositive=zero_on_nonpositive)


def relu(normalization: str = "sum") -> Pointwise:
  """max(s, 0) (Wortsman et al. 2023 use normalization=length)"""
  return _simple("relu", jax.nn.relu, normalization, zero_on_nonpositive=True)


def relu2(normalization: str = "sum") -> Pointwise:
  """max(s, 0)^2 (squared ReLU)"""
  return _simple("relu2", lambda z: jnp.square(jax.nn.relu(z)), normalization,
                 zero_on_nonpositive=True)


def softplus(normalization: str = "sum") -> Pointwise:
  """log(1 + exp(s)) (one exp per score, see attnx.core.softplus)"""
  return _simple("softplus", softplus_lib.softplus, normalization)


def _elu_plus_one(z: Array) -> Array:
  # where(z>=0, z+1, exp(min(z,0))): exact in bf16 far below 0 (docs/references.md, pitfalls).
  return jnp.where(z >= 0, z + 1.0, jnp.exp(jnp.minimum(z, 0.0)))


def elu_plus_one(normalization: str = "sum") -> Pointwise:
  """elu(s) + 1 (the linear-attention feature map as F)"""
  return _simple("elu_plus_one", _elu_plus_one, normalization)


def taylor_exp(normalization: str = "sum") -> Pointwise:
  """1 + s + s^2/2, second-order Taylor expansion of exp (always > 0)"""
  return _simple("taylor_exp", lambda z: 1.0 + z + 0.5 * z * z, normalization)


# --------------------------------------------------------------------------------------------
# Parametrized F.
# --------------------------------------------------------------------------------------------

# Below the smallest normal float32 a positive score counts as 0 in `power`: F'(z) = p·z^(p−1)
# is unbounded at 0+ for p < 1, and on the normal range it stays below p/tiny ≈ 8.5e37·p.
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _power_fn(p: float) -> Callable[[Array], Array]:
  """max(s, 0)^p with F(s) = F'(s) = 0 for s < 2^-126 (incl. s = 0 for p < 1) and F(NaN) = NaN.

  ``jnp.power(relu(s), p)`` differentiates to inf·0 = NaN at s ≤ 0 when p < 1. An integral p
  is p − 1 multiplications (``lax.integer_pow``, and its derivative p·s^(p−1) likewise);
  another p is exp2(p·log2 s) on s > 0 (a float ``pow`` is the GPU's slow, edge-case-handling
  ``powf``: it made ``power`` the slowest pointwise F of the Pallas kernels).
  """
  whole = float(p).is_integer() and 1 <= p <= _MAX_INTEGER_POWER

  def fn(z):
    zero = z < _TINY  # False for NaN, so NaN reaches the power and propagates
    x = jnp.where(zero, 1.0, z)
    y = lax.integer_pow(x, int(p)) if whole else jnp.exp2(p * jnp.log2(x))
    return jnp.where(zero, 0.0, y)
  return fn


# Integral powers up to this run as multiplications (log2(64) + popcount squarings at most).
_MAX_INTEGER_POWER = 64


def power(p: float = 2.0, normalization: str = "sum") -> Pointwise:
  """max(s, 0)^p, p > 0 (F(0) = F'(0) = 0 also for p < 1)"""
  p = params_lib.number("weighting 'power'", "p", p, low=0.0)
  fn = _power_fn(p)
  return _pointwise(label("power", p=p), lambda z, n: fn(z), normalization,
                    zero_on_nonpositive=True)


_SIGMOID_N = ("sequence", "all")


def _log_keys_shift(n: Array, s: int) -> Array:
  """log S − log max(n, 1): moves σ(z − log S) to σ(z − log n) (a query without keys, n = 0,
  is masked whole; it keeps a finite shift)."""
  return math.log(max(s, 1)) - jnp.log(jnp.maximum(n, 1).astype(jnp.float32))


def _log_sigmoid(b: float) -> LogF:
  """log σ(z + b) for the online max. float32's σ is 0 below z + b ≈ −104, where
  log σ(x) = −softplus(−x) ≈ x still orders the row. With x = z + b and a running max
  m ≥ log σ(x) (m ≥ min(x, 0)): e^{log σ(x) − m} = 1/(e^m + e^{m − x}) — one exponential,
  which overflows to 0 weight only for x far below m — and d log σ/dx = σ(−x) = 1 − e^m·r."""
  def shifted(z, m, em, exp, unit):
    x = z + b
    r = 1.0 / (em + exp((m - x * unit) if unit != 1.0 else (m - x)))
    return r, 1.0 - em * r
  return LogF(fn=lambda z: -softplus_lib.softplus(-(z + b)),
              bound=lambda z: jnp.minimum(z + b, 0.0), shifted=shifted)


def sigmoid(bias: float | None = None, normalization: str = "sum",
            n: str = "sequence") -> Pointwise:
  """σ(s + b); b = −log n by default when unnormalized (Ramapuram et al. 2024)

  ``bias=None`` is b = −log n with ``normalization="none"``, else 0. ``n="sequence"``
  (default): n is the number of keys of the query's sequence, as in Ramapuram et al.'s
  formula — the S keys of the call, or under packed documents (``segment_ids``) the keys of
  the query's document and under padded lengths (``key_value_seq_lengths``) the row's key
  length (:meth:`attnx.core.masks.Mask.sequence_keys`), so that a packed document gets the
  weights it gets alone. ``n="all"``: n = S always (attnx before 2026-11-27). A causal or
  windowed query's n is still its sequence's, not the keys it attends.

  Sum-normalized (the default), every implementation computes the weights as
  exp(log σ(s + b) − log Σ σ) with a running maximum, as softmax's: a row whose every σ is
  below float32's range (s + b < −104, ALiBi far from the keys) keeps the weights float64
  gives it, where σ/Σσ would be 0/0.
  """
  if bias is not None:
    bias = params_lib.number("weighting 'sigmoid'", "bias", bias)
  if n not in _SIGMOID_N:
    raise ValueError(f"weighting 'sigmoid': n must be one of {_SIGMOID_N}, got {n!r}.")

  def fn(z, num_keys):
    b = ((-math.log(max(num_keys, 1)) if normalization == "none" else 0.0) if bias is None
         else bias)
    return jax.nn.sigmoid(z + b)
  counts = bias is None and normalization == "none" and n == "sequence"
  log_f = _log_sigmoid(0.0 if bias is None else bias) if normalization == "sum" else None
  return _pointwise(label("sigmoid", bias=bias, normalization=None if normalization == "sum"
                          else normalization, n=None if n == "sequence" else n), fn,
                    normalization, sequence_shift=_log_keys_shift if counts else None,
                    log_f=log_f)


# --------------------------------------------------------------------------------------------
# Distance kernels: the score is s = −‖q − k‖² (score="neg_sq_dist") and h a bandwidth,
# u = sqrt(max(−s, 0)) / h.
# --------------------------------------------------------------------------------------------

def _dist_u(z: Array, h: float) -> Array:
  # sqrt has an infinite derivative at 0: its branch sees only d² > 0 (or NaN, which
  # propagates), and u = 0 at d = 0 with a zero gradient.
  d2 = jnp.maximum(-z, 0.0)
  zero = d2 == 0
  return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, d2))) / h


def _check_h(name: str, h: float) -> float:
  return params_lib.number(f"weighting {name!r}", "h", h, low=0.0)


def gaussian(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  """exp(−‖q−k‖²/(2h²)) on score neg_sq_dist (bandwidth h)"""
  h = _check_h("gaussian", h)
  alpha = 1.0 / (2.0 * h * h)
  if normalization == "sum":
    # Normalized Gaussian kernel == softmax(s / 2h²); streamed with the running max.
    return _pointwise(label("gaussian", h=h), lambda z, n: jnp.exp(alpha * z), "sum",
                      exp_alpha=alpha, distance_kernel=True)
  return _pointwise(label("gaussian", h=h, normalization=normalization),
                    lambda z, n: jnp.exp(alpha * jnp.minimum(z, 0.0)), normalization,
                    distance_kernel=True)


def boxcar(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  """1[‖q−k‖ ≤ h] on score neg_sq_dist"""
  h2 = _check_h("boxcar", h) ** 2
  # Written as a function of s so that its derivative is 0 almost everywhere; 0·z makes
  # F(NaN) = NaN (a comparison alone would turn NaN into 0).
  return _pointwise(label("boxcar", h=h, normalization=None if normalization == "sum"
                          else normalization),
                    lambda z, n: jnp.where(z < -h2, 0.0, 1.0 + 0.0 * z), normalization,
                    distance_kernel=True)


def triangular(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  """max(0, 1 − ‖q−k‖/h) on score neg_sq_dist (what Martínez-Ramón, Ajith & Kurup's slides and d2l call 'Epanechnikov')"""  # noqa: E501 (the description is the first line)
  h = _check_h("triangular", h)
  return _pointwise(label("triangular", h=h, normalization=None if normalization == "sum"
                          else normalization),
                    lambda z, n: jax.nn.relu(1.0 - _dist_u(z, h)), normalization,
                    distance_kernel=True)


def epanechnikov(h: float = 1.0, normalization: str = "sum") -> Pointwise:
  """3/4 (1 − u²)₊, u = ‖q−k‖/h, on score neg_sq_dist (the textbook kernel; the slides' 'Epanechnikov' is 'triangular')"""  # noqa: E501 (the description is the first line)
  h2 = _check_h("epanechnikov", h) ** 2
  # u² = −s/h²: polynomial in s, so smooth inside the support.
  return _pointwise(label("epanechnikov", h=h, normalization=None if normalization == "sum"
                          else normalization),
                    lambda z, n: 0.75 * jax.nn.relu(1.0 + z / h2), normalization,
                    distance_kernel=True)
