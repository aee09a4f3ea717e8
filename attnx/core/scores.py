"""Scores s(q, k): how similar a query is to a key.

Every score is a pure function of ``(q, k[, params])`` in the layout of
``jax.nn.dot_product_attention``: ``q`` is ``[..., T, N, H]``, ``k`` is ``[..., S, N, H]`` (same
number of heads; :func:`attnx.core.attention` repeats kv heads for GQA) and the result is
``[..., N, T, S]`` in float32 (or wider).

Scores that reduce to a dot product of transformed vectors (all but ``additive``) also provide
``to_dot``, which the memory-efficient blocked kernel uses: e.g. −‖q−k‖² is the dot product
of ``[2q, −‖q‖², −1]`` and ``[k, 1, ‖k‖²]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def _f32(x: Array) -> Array:
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _einsum_scores(q: Array, k: Array) -> Array:
  return jnp.einsum("...tnh,...snh->...nts", q, k,
                    preferred_element_type=jnp.promote_types(q.dtype, jnp.float32))


def _project(x: Array, w: Array, name: str) -> Array:
  """x [..., N, H] times a shared [H, R] or per-head [N, H, R] matrix."""
  w = jnp.asarray(w)
  if w.ndim == 2:
    if w.shape[0] != x.shape[-1]:
      raise ValueError(f"{name} of shape {w.shape} does not match head dim {x.shape[-1]}; "
                       "expected [H, R] or [N, H, R].")
    return jnp.einsum("...nh,hr->...nr", x, w)
  if w.ndim == 3:
    if w.shape[:2] != x.shape[-2:]:
      raise ValueError(f"{name} of shape {w.shape} does not match (heads, head dim) = "
                       f"{x.shape[-2:]}; expected [H, R] or [N, H, R].")
    return jnp.einsum("...nh,nhr->...nr", x, w)
  raise ValueError(f"{name} must be [H, R] or [N, H, R], got shape {w.shape}")


def _l2_normalize(x: Array, eps: float = 1e-6) -> Array:
  x = _f32(x)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


# --------------------------------------------------------------------------------------------
# The scores as plain functions.
# --------------------------------------------------------------------------------------------

def dot(q: Array, k: Array) -> Array:
  """s = q·k."""
  return _einsum_scores(q, k)


def scaled_dot(q: Array, k: Array, scale: float | None = None) -> Array:
  """s = q·k / √H (Vaswani et al. 2017), or q·k · scale."""
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  return _einsum_scores(q, k) * scale


def cosine(q: Array, k: Array, temperature: float = 1.0) -> Array:
  """s = cos(q, k) / temperature (cosine attention, e.g. Swin-v2)."""
  return _einsum_scores(_l2_normalize(q), _l2_normalize(k)) / temperature


def neg_sq_dist(q: Array, k: Array) -> Array:
  """s = −‖q − k‖², the Euclidean form (Alam et al.; Martínez-Ramón et al.'s slides). ≤ 0."""
  q, k = _f32(q), _f32(k)
  qq = jnp.swapaxes(jnp.sum(q * q, -1), -1, -2)[..., :, :, None]  # [..., N, T, 1]
  kk = jnp.swapaxes(jnp.sum(k * k, -1), -1, -2)[..., :, None, :]  # [..., N, 1, S]
  return jnp.minimum(2.0 * _einsum_scores(q, k) - qq - kk, 0.0)


def bilinear(q: Array, k: Array, W: Array) -> Array:  # noqa: N803 (math name)
  """s = q W kᵀ, Luong et al. 2015 "general". W: [H, H] or per-head [N, H, H]."""
  return _einsum_scores(_project(q, W, "W"), k)


def metric(q: Array, k: Array, L: Array) -> Array:  # noqa: N803
  """s = −‖(q − k) L‖², a learned Mahalanobis pseudo-metric (Ruan & Zhang); L [H, R] | [N, H, R]."""
  return neg_sq_dist(_project(q, L, "L"), _project(k, L, "L"))


def additive(q: Array, k: Array, Wq: Array, Wk: Array, v: Array) -> Array:  # noqa: N803
  """s = vᵀ tanh(q W_q + k W_k), Bahdanau et al. 2015. Wq, Wk: [H, A] (or [N, H, A]); v: [A].

  Materializes a [..., N, T, S, A] tensor: dense implementation only.
  """
  qa = _f32(_project(q, Wq, "Wq"))  # [..., T, N, A]
  ka = _f32(_project(k, Wk, "Wk"))  # [..., S, N, A]
  h = jnp.tanh(jnp.swapaxes(qa, -2, -3)[..., :, :, None, :]
               + jnp.swapaxes(ka, -2, -3)[..., :, None, :, :])  # [..., N, T, S, A]
  return jnp.einsum("...tsa,...a->...ts", h, _f32(jnp.asarray(v)))


# --------------------------------------------------------------------------------------------
# Registry used by attention(): dense form, dot-product form, default scale.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LearnedParam:
  """A score parameter that a module learns (``attnx.nn``): its shape and initializer.

  Attributes:
    shape: ``(num_heads, head_dim, width) -> shape``; ``width`` is the module's ``score_dim``
      (default: the head dim).
    init: ``(key, shape, dtype) -> array``, a ``jax.nn.initializers`` initializer.
    uses_width: whether the shape depends on ``width`` (a module's ``score_dim`` applies).
  """

  shape: Callable[[int, int, int], tuple[int, ...]]
  init: Callable[..., Array]
  uses_width: bool = False


def _identity_init(key: Any, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
  """Identity matrices in the last two axes: a bilinear score starts as the plain dot."""
  del key
  return jnp.broadcast_to(jnp.eye(shape[-1], dtype=dtype), shape)


@dataclasses.dataclass(frozen=True)
class Score:
  """A registered score.

  Attributes:
    name: registry name.
    dense: ``(q, k, **params) -> [..., N, T, S]`` (no scale applied).
    to_dot: ``(q, k, **params) -> (q', k')`` with ``s = q'·k'``, or None if the score is not
      a dot product of transformed vectors (then only the dense implementation can run it).
    scaled: whether the default scale is 1/√H (else 1).
    params: names of the parameters the score accepts.
    distance: whether s = −d² for a (pseudo-)distance d, which the distance kernels
      (``gaussian``, ``boxcar``, ``triangular``, ``epanechnikov``) need.
    learned: ``((name, LearnedParam), ...)``: the parameters a module learns for this score
      (``attnx.nn`` creates each as ``score_<name>``); empty for scores without arrays.
    equal_head_dims: whether queries and keys must have the same head dim (the score compares
      them directly; the parametrized scores map them first).
  """

  name: str
  dense: Callable[..., Array]
  to_dot: Callable[..., tuple[Array, Array]] | None
  scaled: bool = False
  params: tuple[str, ...] = ()
  distance: bool = False
  learned: tuple[tuple[str, LearnedParam], ...] = ()
  equal_head_dims: bool = False


def _neg_sq_dist_to_dot(q: Array, k: Array) -> tuple[Array, Array]:
  q, k = _f32(q), _f32(k)
  qq = jnp.sum(q * q, -1, keepdims=True)
  kk = jnp.sum(k * k, -1, keepdims=True)
  one = jnp.ones_like(qq)
  return (jnp.concatenate([2.0 * q, -qq, -one], -1),
          jnp.concatenate([k, jnp.ones_like(kk), kk], -1))


_SCORES: dict[str, Score] = {
    "dot": Score("dot", dot, lambda q, k: (q, k), equal_head_dims=True),
    "scaled_dot": Score("scaled_dot", lambda q, k: dot(q, k), lambda q, k: (q, k), scaled=True,
                        equal_head_dims=True),
    "cosine": Score("cosine", lambda q, k, temperature=1.0: cosine(q, k, temperature),
                    lambda q, k, temperature=1.0: (_l2_normalize(q) / temperature,
                                                   _l2_normalize(k)),
                    params=("temperature",), equal_head_dims=True),
    "neg_sq_dist": Score("neg_sq_dist", neg_sq_dist, _neg_sq_dist_to_dot, distance=True,
                         equal_head_dims=True),
    "bilinear": Score("bilinear", bilinear, lambda q, k, W: (_project(q, W, "W"), k),
                      params=("W",),
                      learned=(("W", LearnedParam(lambda n, h, r: (n, h, h), _identity_init)),)),
    "metric": Score("metric", metric,
                    lambda q, k, L: _neg_sq_dist_to_dot(_project(q, L, "L"), _project(k, L, "L")),
                    params=("L",), distance=True),
    "additive": Score("additive", additive, None, params=("Wq", "Wk", "v"), learned=(
        ("Wq", LearnedParam(lambda n, h, r: (n, h, r), jax.nn.initializers.lecun_normal(), True)),
        ("Wk", LearnedParam(lambda n, h, r: (n, h, r), jax.nn.initializers.lecun_normal(), True)),
        ("v", LearnedParam(lambda n, h, r: (r,), lambda key, shape, dtype=jnp.float32:
                           jax.nn.initializers.normal(shape[0] ** -0.5)(key, shape, dtype),
                           True)))),
}


def list_scores() -> list[str]:
  """Names of the built-in scores.

  Example:
    >>> from attnx import core
    >>> core.list_scores()
    ['additive', 'bilinear', 'cosine', 'dot', 'metric', 'neg_sq_dist', 'scaled_dot']
  """
  return sorted(_SCORES)


def get_score(score: str | Score | Callable[..., Array]) -> Score:
  """Resolves a score name (or ``"cosine:temperature=0.1"``), a Score, or a callable.

  A callable ``f(q, k) -> [..., N, T, S]`` becomes a dense-only score.

  Example:
    >>> from attnx import core
    >>> s = core.get_score("neg_sq_dist")
    >>> s.name, s.distance, s.scaled
    ('neg_sq_dist', True, False)
    >>> core.get_score("additive").params  # learned arrays, passed as score_params
    ('Wq', 'Wk', 'v')
    >>> core.get_score(lambda q, k: -abs(q - k).sum(-1)).to_dot is None  # dense only
    True
  """
  if isinstance(score, Score):
    return score
  if isinstance(score, str):
    name = score.partition(":")[0]
    if name not in _SCORES:
      raise ValueError(f"Unknown score {name!r}. Valid scores: {', '.join(list_scores())} "
                       "(or pass a callable (q, k) -> scores).")
    return _SCORES[name]
  if callable(score):
    return Score(getattr(score, "__name__", "custom"), lambda q, k, **p: score(q, k, **p), None)
  raise TypeError(f"score must be a name or a callable, got {type(score).__name__}")


def score_params_from_name(score: Any) -> dict[str, Any]:
  """Scalar parameters given inline, e.g. ``"cosine:temperature=0.1"``."""
  if not isinstance(score, str) or ":" not in score:
    return {}
  from attnx.core.weightings import parse_weighting_name  # same "name:k=v" grammar
  return parse_weighting_name(score)[1]
