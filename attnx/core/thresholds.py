"""Sparsemax and entmax over key chunks: the two-step protocol, as public functions.

Sparsemax and α-entmax (Martins & Astudillo, "From Softmax to Sparsemax"; Peters, Niculae &
Martins, "Sparse Sequence-to-Sequence Models") weigh every key of a row against one threshold
τ, the root of Σ_j [(α−1)·scale·z_j − τ']₊^{1/(α−1)} = 1 over *every* key of the row. Attention
over one chunk of keys is therefore not a part of attention over all of them (which is why
:func:`attnx.core.merge_attention` refuses parts computed alone). With the keys split into
chunks — on one device, or over the devices of a mesh axis — the row is computed in steps:

1. **chunk statistics**: :func:`threshold_stats` of each chunk (the row max of x =
   (α−1)·scale·z and the count of valid keys), combined over the chunks with
   :func:`combine_threshold_stats` (or ``lax.pmax`` / ``lax.psum`` over a mesh axis);
2. **the global threshold**: :func:`solve_threshold` runs the kernels' Newton/bisection passes
   (:func:`attnx.core.streaming.entmax_threshold`); each pass asks ``sums_at(tau)`` for the sums
   of every chunk at a candidate, which the caller adds up — :func:`threshold_sums` per chunk,
   a Python sum over chunks or a ``lax.psum``;
3. **chunk outputs**: :func:`thresholded_attention` of each chunk at that threshold, whose
   ``(out, SharedThreshold)`` parts :func:`attnx.core.merge_attention` adds up (or, on a mesh,
   gather the parts and merge them).

Every step is differentiable: the threshold's gradient comes from the implicit function
theorem (``lax.custom_root``: Σ p(τ) = 1 at the root), not through the passes. The result
equals ``attention(q, k, v, weighting=...)`` over all keys to float32 rounding.

The queries are the same in every chunk (a decoding query against a sharded cache, or queries
gathered on every device); context parallelism with sharded queries needs every key at every
device once per pass, which :func:`attnx.core.ring_attention` does not do (it refuses these
weightings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import streaming
from attnx.core import weightings as weightings_lib
from attnx.core.api import scores_and_valid
from attnx.core.residuals import SharedThreshold

Array = jax.Array


class ThresholdStats(NamedTuple):
  """Step 1 of the protocol for each row, ``[batch..., T, N]``: ``max``, the largest x =
  (α−1)·scale·z over the row's valid keys (−∞ where none), and ``count``, their number."""

  max: Array
  count: Array


class ThresholdSums(NamedTuple):
  """A pass' sums at a candidate threshold, ``[batch..., T, N]``, additive over chunks:
  Σ p (the mass the threshold leaves, 1 at the root), Σ r^{q−1} (Newton's slope) and the size
  of the support."""

  mass: Array
  slope: Array
  support: Array


def _stream(weighting: Any) -> Any:
  w = weightings_lib.get_weighting(weighting)
  rs = getattr(w, "stream", None)
  if rs is None or not rs.needs_threshold:
    raise ValueError(
        f"the threshold protocol is for sparsemax and entmax; {w.name!r} has no threshold "
        "(merge its parts with attnx.core.merge_attention directly).")
  return w, rs


def _scores(q, k, bias, mask, weighting, kwargs) -> tuple[Array, Array, Any]:
  """[batch..., N, T, S] scores and the valid mask (all True where None) of one chunk."""
  if kwargs.get("sinks") is not None:
    raise ValueError("the threshold protocol takes no sinks: a sink is a key of the whole row, "
                     "which no chunk's statistics hold; call attnx.core.attention over the row.")
  z, valid, w, _ = scores_and_valid(q, k, bias, mask, weighting=weighting, **kwargs)
  valid = jnp.ones(z.shape, bool) if valid is None else jnp.broadcast_to(valid, z.shape)
  return z, valid, w


def _rows(x: Array) -> Array:  # [..., N, T] -> [..., T, N]
  return jnp.swapaxes(x, -1, -2)


def _check_rows(fn: str, name: str, x: Array, query: Array) -> None:
  """A per-row array must be [batch..., T, N] of the query: broadcasting it would silently
  give rows another row's threshold."""
  want = tuple(jnp.shape(query)[:-1])
  if tuple(jnp.shape(x)) != want:
    raise ValueError(f"{fn}: {name} must have the query's rows, [batch..., T, N] = {want}; got "
                     f"{tuple(jnp.shape(x))}.")


def threshold_stats(query: Array, key: Array, bias: Array | None = None,
                    mask: Array | None = None, *, weighting: Any = "sparsemax",
                    **score_kwargs: Any) -> ThresholdStats:
  """Step 1 for one chunk of keys: each row's max of x = (α−1)·scale·z and its valid keys.

  Args:
    query: ``[batch..., T, N, H]``, the same in every chunk.
    key: this chunk's ``[batch..., S_c, K, H]``.
    bias, mask: this chunk's columns of the bias and mask (as :func:`attnx.core.attention`).
    weighting: sparsemax or an entmax (name, parameters or object).
    **score_kwargs: the score and mask keywords of :func:`attnx.core.attention_weights`
      (``score``, ``scale``, ``is_causal``, ``logits_soft_cap``, ...; an unknown one raises).

  Returns:
    :class:`ThresholdStats` ``[batch..., T, N]``, without a gradient (the max only shifts the
    passes; the threshold's gradient comes from its root condition).
  """
  _, rs = _stream(weighting)
  z, valid, _ = _scores(query, key, bias, mask, weighting, score_kwargs)
  x = streaming.entmax_x(z, valid, rs)
  # The max is only the passes' shift (τ found relative to it, and added back): the
  # threshold's gradient does not go through it, and without one lax.pmax can combine it.
  return ThresholdStats(_rows(lax.stop_gradient(jnp.max(x, axis=-1, initial=-jnp.inf))),
                        _rows(jnp.sum(valid, axis=-1, dtype=z.dtype)))


def combine_threshold_stats(stats: Sequence[ThresholdStats]) -> ThresholdStats:
  """The statistics of the union of chunks (max of the maxima, sum of the counts); on a mesh
  axis the same is ``ThresholdStats(lax.pmax(s.max, axis), lax.psum(s.count, axis))``."""
  stats = list(stats)
  if not stats:
    raise ValueError("combine_threshold_stats needs at least one chunk's statistics.")
  m, n = stats[0]
  for s in stats[1:]:
    m, n = jnp.maximum(m, s.max), n + s.count
  return ThresholdStats(m, n)


def _row_max(stats: ThresholdStats) -> Array:
  """The shift the passes use: the row max, 0 for a row without keys (as the kernels)."""
  return jnp.where(stats.count == 0, 0.0, stats.max)


def threshold_sums(query: Array, key: Array, bias: Array | None = None,
                   mask: Array | None = None, *, stats: ThresholdStats, tau: Array,
                   weighting: Any = "sparsemax", **score_kwargs: Any) -> ThresholdSums:
  """One chunk's sums at a candidate threshold (step 2: what ``sums_at`` adds up).

  Args:
    query, key, bias, mask, weighting, score_kwargs: as :func:`threshold_stats`.
    stats: the combined statistics of every chunk (step 1).
    tau: the candidate ``[batch..., T, N]`` that :func:`solve_threshold` passes to
      ``sums_at``, in its own units (relative to the row max): pass it on unchanged.
  """
  _, rs = _stream(weighting)
  for name, x in (("stats.max", stats.max), ("stats.count", stats.count), ("tau", tau)):
    _check_rows("threshold_sums", name, x, query)
  z, valid, _ = _scores(query, key, bias, mask, weighting, score_kwargs)
  zero = jnp.zeros(z.shape[:-1], z.dtype)
  fold = streaming.threshold_sums_fold(rs, _rows(_row_max(stats)), _rows(tau), z.dtype)
  return ThresholdSums(*(_rows(x) for x in fold((zero, zero, zero), z, valid)))


def _with_support_min(sums: ThresholdSums, init: tuple) -> tuple:
  """``sums`` as the threshold search's pass returns them: chunks summed together cannot give
  the support's smallest r, so a fourth entry of −∞ (never "support final") where it asks."""
  return tuple(sums) + tuple(jnp.full_like(x, -jnp.inf) for x in init[3:])


def solve_threshold(stats: ThresholdStats, sums_at: Callable[[Array], ThresholdSums], *,
                    weighting: Any = "sparsemax") -> Array:
  """Step 2: the threshold of every row, from passes over every chunk.

  Args:
    stats: the combined :class:`ThresholdStats` of every chunk.
    sums_at: ``tau -> ThresholdSums`` summed over every chunk (each chunk's
      :func:`threshold_sums` at ``tau``; a Python sum, or a ``lax.psum`` over a mesh axis).
      Called once per pass (up to :func:`attnx.core.streaming.max_threshold_passes`).
    weighting: the chunks' sparsemax or entmax.

  Returns:
    τ ``[batch..., T, N]`` in score units (the ``threshold`` of
    :class:`~attnx.core.EntmaxResidual`): p_j = [(α−1)·scale·(z_j − τ)]₊^{1/(α−1)}. For
    :func:`thresholded_attention`. Differentiable (implicit function theorem).
  """
  w, rs = _stream(weighting)
  if jnp.shape(stats.max) != jnp.shape(stats.count):
    raise ValueError(f"solve_threshold: stats.max {jnp.shape(stats.max)} and stats.count "
                     f"{jnp.shape(stats.count)} must have the same [batch..., T, N] shape.")
  m = _row_max(stats)
  dtype = m.dtype
  rows = m.shape

  def mass(tau):  # f(τ) = Σ p − 1 over every chunk: 0 at the root
    return sums_at(tau).mass - 1.0

  def solve(_, tau0):
    th = streaming.entmax_threshold(
        None, rows, rs, row_max=(lax.stop_gradient(m), lax.stop_gradient(stats.count)),
        sums_pass=lambda fn, init, m_, tau: _with_support_min(sums_at(tau), init),
        dtype=dtype)
    return th.tau

  def tangent_solve(g, y):  # f's Jacobian is diagonal (one τ per row)
    d = g(jnp.ones_like(y))
    return jnp.where(d == 0, 0.0, y / jnp.where(d == 0, 1.0, d))

  tau = lax.custom_root(mass, jnp.zeros(rows, dtype), solve, tangent_solve)
  return (m + tau) / ((rs.alpha - 1.0) * rs.scale)


def thresholded_attention(query: Array, key: Array, value: Array, bias: Array | None = None,
                          mask: Array | None = None, *, threshold: Array,
                          weighting: Any = "sparsemax",
                          **score_kwargs: Any) -> tuple[Array, SharedThreshold]:
  """Step 3: one chunk's part of attention at the whole row's threshold.

  Args:
    query, key, bias, mask, weighting, score_kwargs: as :func:`threshold_stats`.
    value: this chunk's ``[batch..., S_c, K, Hv]``.
    threshold: τ ``[batch..., T, N]`` from :func:`solve_threshold`.

  Returns:
    ``(out [batch..., T, N, Hv], SharedThreshold(threshold, total))`` with total = Σ p over
    the chunk, in the convention of ``attention(..., return_residual=True)`` (the renormalized
    entmax variant divides ``out`` by ``total``): parts that
    :func:`attnx.core.merge_attention` merges into attention over every chunk (it refuses
    entmax parts computed alone, each at its own threshold).
  """
  w, rs = _stream(weighting)
  _check_rows("thresholded_attention", "threshold", threshold, query)
  z, valid, _ = _scores(query, key, bias, mask, weighting, score_kwargs)
  x = streaming.entmax_x(z, valid, rs)
  shift = ((rs.alpha - 1.0) * rs.scale) * _rows(threshold).astype(z.dtype)
  r = jnp.maximum(x - shift[..., None], 0.0)
  p, _ = streaming.entmax_powers(r, rs.alpha)
  total = _rows(jnp.sum(p, axis=-1))  # [..., T, N]
  v = jnp.asarray(value)
  g = z.shape[-3] // v.shape[-2]
  vr = jnp.repeat(v, g, axis=-2) if g > 1 else v
  num = jnp.einsum("...nts,...snh->...tnh", p, vr.astype(p.dtype))
  if rs.renormalize:
    num = num / jnp.where(total > 0, total, 1.0)[..., None]
  return num.astype(jnp.asarray(query).dtype), SharedThreshold(threshold, total)


__all__ = ["ThresholdStats", "ThresholdSums", "combine_threshold_stats", "solve_threshold",
           "threshold_stats", "threshold_sums", "thresholded_attention"]
