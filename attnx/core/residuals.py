"""Residuals of attention and the merge of partial attention, for every weighting F.

``attention(..., return_residual=True)`` returns ``(out, residual)``: besides the output, the
row state that lets attention over disjoint key chunks be combined into attention over their
union (:func:`merge_attention`). What the residual is depends on the family of F
(:func:`residual_kind`):

``"log_normalizer"``
  an array ``[batch..., T, N]``: the natural log of the number each row's output was divided
  by. For softmax it is the log-sum-exp of the scores, exactly ``jax.nn.dot_product_attention``'s
  ``return_residual``; for any sum-normalized pointwise F, SSMax and softpick, log(Σ F) over
  the call's keys together with its virtual keys (a sink, softmax_plus_one's offset, softpick's
  ε); for ``normalization="length"``, log n. A row without weight has −∞.
``"log_survival"``
  stick-breaking (Tan et al., "Scaling Stick-Breaking Attention"): ``[batch..., T, N]``, the log
  of the stick the call's keys leave, Σ_j log(1 − σ(z_ij)) (0 for a row without a valid key).
``"unnormalized"``
  ``normalization="none"``: zeros ``[batch..., T, N]`` (the output is not divided by anything).
``"threshold"``
  sparsemax / entmax (Martins & Astudillo; Peters, Niculae & Martins): an
  :class:`EntmaxResidual`, the threshold τ of each row in score units
  (p_j = [(α−1)·scale·(z_j − τ)]₊^{1/(α−1)}) and the weight its keys hold.

Merging (:func:`merge_attention`) uses the family's own merge rule, the one its streaming
kernels use between key tiles (:mod:`attnx.core.streaming`): the running-max rule for the log
normalizers (with the terms that belong to the whole row — softmax_plus_one's offset, softpick's
ε — counted once, as the kernels' block streams do), stick-breaking's ordered rule (parts in key
order), a sum for unnormalized F. A sink is a key of the row: pass it to one part only. For
SSMax (whose scale is s·log n of the whole row) and sparsemax/entmax (whose threshold depends on
every key) a part cannot be computed alone; :func:`merge_attention` refuses them with the
reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attnx.core import streaming
from attnx.core import weightings as weightings_lib
from attnx.core.streaming.running_max import MaxState
from attnx.core.streaming.stick_breaking import StickState

Array = jax.Array

KINDS = ("log_normalizer", "log_survival", "unnormalized", "threshold")


class EntmaxResidual(NamedTuple):
  """The residual of sparsemax / α-entmax: ``threshold`` τ [batch..., T, N] in score units
  (p_j = [(α−1)·scale·(z_j − τ)]₊^{1/(α−1)}), and ``total``, Σ_j p_j over the call's keys
  (1 where a row has a valid key; the output was divided by it for the renormalized
  bisection variant)."""

  threshold: Array
  total: Array


class SharedThreshold(NamedTuple):
  """The residual of one chunk's part of sparsemax / entmax attention computed at the whole
  row's threshold (:func:`attnx.core.thresholds.thresholded_attention`, the protocol's third
  step): ``threshold`` τ [batch..., T, N] as in :class:`EntmaxResidual`, ``total`` Σ p over the
  chunk's keys. Parts with it merge (:func:`merge_attention`); parts of attention over a chunk
  alone (each at its own threshold) do not."""

  threshold: Array
  total: Array


def residual_kind(weighting: Any) -> str:
  """Which residual (one of :data:`KINDS`) attention with ``weighting`` returns; ValueError
  for a whole-row weighting without a row state (no streaming family)."""
  w = weightings_lib.get_weighting(weighting) if not _resolved(weighting) else weighting
  if isinstance(w, weightings_lib.Pointwise):
    return "unnormalized" if w.unnormalized else "log_normalizer"
  rs = getattr(w, "stream", None)
  if rs is None:
    raise ValueError(
        f"weighting {w.name!r} normalizes whole rows without a row state (it has no streaming "
        "family), so attention with it has no residual to return or merge; the weightings with "
        "one: every pointwise F, ssmax, softpick, stick_breaking, sparsemax and entmax.")
  if rs.reverse:
    return "log_survival"
  if rs.needs_threshold:
    return "threshold"
  return "log_normalizer"


def _resolved(w: Any) -> bool:
  return isinstance(w, weightings_lib.Pointwise | weightings_lib.RowNormalizer)


def from_stats(w: Any, stats: tuple[Array, ...]) -> Any:
  """The public residual of the family of ``w`` from the row statistics its streaming rules
  finalize with (:func:`attnx.core.streaming.finalize`,
  :func:`attnx.core.streaming.pointwise_finalize`; natural units), any row layout."""
  kind = residual_kind(w)
  if kind == "log_survival":
    return stats[0]
  if kind == "threshold":
    m, tau, norm = stats
    rs = w.stream
    return EntmaxResidual((m + tau) / ((rs.alpha - 1.0) * rs.scale), norm)
  stat = stats[0]
  if kind == "unnormalized":
    return jnp.zeros_like(stat)
  if isinstance(w, weightings_lib.Pointwise) and not w.online_max:
    return jnp.log(stat)  # the normalizer l itself: log 0 = −∞
  return jnp.where(stat == jnp.inf, -jnp.inf, stat)  # lse: +∞ marks a row without weight


def empty_residual(w: Any, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
  """The residual of rows that saw no key (an empty key sequence)."""
  kind = residual_kind(w)
  if kind == "log_normalizer":
    return jnp.full(shape, -jnp.inf, dtype)
  if kind == "threshold":
    return EntmaxResidual(jnp.full(shape, jnp.inf, dtype), jnp.zeros(shape, dtype))
  return jnp.zeros(shape, dtype)


def normalizer(w: Any, residual: Any) -> Array:
  """What the output was divided by, [batch..., T, N]: e^residual for a log normalizer (which
  overflows float32 past e^88: the numerator of :func:`unnormalize` then too), the weight
  total of a renormalized entmax, else 1."""
  kind = residual_kind(w)
  if kind == "log_normalizer":
    return jnp.exp(residual)
  if kind == "threshold":
    return residual.total if w.stream.renormalize else jnp.ones_like(residual.total)
  return jnp.ones_like(residual)


def unnormalize(w: Any, out: Array, residual: Any) -> Array:
  """The numerator Σ_j F_ij v_j of ``out`` (``normalize_output=False``): out times
  :func:`normalizer`, in float32 (or the output's wider dtype)."""
  cd = jnp.promote_types(out.dtype, jnp.float32)
  return out.astype(cd) * normalizer(w, residual).astype(cd)[..., None]


def merge_attention(parts: Sequence[tuple[Array, Any]], *, weighting: Any = "softmax"
                    ) -> tuple[Array, Any]:
  """Attention over the union of disjoint key chunks from attention over each.

  Args:
    parts: ``(out, residual)`` pairs, each from ``attention(q, k_c, v_c, ...,
      return_residual=True)`` on one chunk of keys with the same queries and weighting, in key
      order (required for stick-breaking, any order for the others). ``out``
      ``[batch..., T, N, Hv]``, residual as :func:`residual_kind` says. Pass ``sinks`` to one
      part only (a sink is one more key of the row); softmax_plus_one's offset and softpick's
      ε, which every part holds, are counted once.
    weighting: the parts' weighting (name, parameters or object), which selects the merge
      rule.

  Returns:
    ``(out, residual)`` of the whole: equal to one call over all keys up to float rounding,
    in the first part's output dtype (the merge runs in float32, or float64). Differentiable.

  Raises:
    ValueError: no part, parts of different shapes, or a weighting whose parts cannot be
      computed alone (SSMax: s·log n of the whole row; sparsemax/entmax: one threshold over
      every key of the row).
  """
  w = weightings_lib.get_weighting(weighting) if not _resolved(weighting) else weighting
  residual_kind(w)  # ValueError for a weighting without a row state
  parts = list(parts)
  if not parts:
    raise ValueError("merge_attention needs at least one (out, residual) part.")
  rs = getattr(w, "stream", None)
  shared = rs is not None and rs.needs_threshold and all(
      isinstance(r, SharedThreshold) for _, r in parts)
  if rs is not None and (rs.needs_row_scale or rs.needs_threshold) and not shared:
    what = ("SSMax scales the scores by s·log n, n the valid keys of the whole row (count n "
            "over the chunks first, then merge softmax parts of (s·log n)·q: the guide's "
            "recipe)"
            if rs.needs_row_scale else
            "sparsemax/entmax weigh every key against one threshold τ that depends on every key "
            "of the row (compute the parts at the whole row's threshold with the protocol of "
            "attnx.core.thresholds, whose parts merge)")
    raise ValueError(
        f"merge_attention cannot merge parts of weighting {w.name!r}: {what}, so attention over "
        "one chunk of keys is not a part of attention over all of them. Gather the keys (or "
        "their scores) and call attnx.core.attention over the whole row; "
        "docs/guides/residuals.md explains why.")
  shape = parts[0][0].shape
  for i, (o, _) in enumerate(parts):
    if o.shape != shape:
      raise ValueError(f"merge_attention: part {i}'s output has shape {o.shape}, part 0's "
                       f"{shape}; the parts must share queries, heads and Hv.")
  if shared:
    return _merge_shared(w, parts)
  return merge_parts(w, parts)


def _merge_shared(w: Any, parts: list[tuple[Array, SharedThreshold]]
                  ) -> tuple[Array, SharedThreshold]:
  """Parts at one threshold: their numerators and totals add up (the entmax family's merge,
  a sum, given the threshold). Thresholds that differ (when concrete) raise."""
  tau = parts[0][1].threshold
  for i, (_, r) in enumerate(parts[1:], 1):
    if not (isinstance(r.threshold, jax.core.Tracer) or isinstance(tau, jax.core.Tracer)):
      if not bool(jnp.all((r.threshold == tau) | (jnp.isnan(r.threshold) & jnp.isnan(tau)))):
        raise ValueError(f"merge_attention: part {i}'s threshold differs from part 0's; parts "
                         "of one row must share the threshold solve_threshold found.")
  dtype = parts[0][0].dtype
  num = sum(unnormalize(w, o, r) for o, r in parts)
  total = sum(r.total.astype(num.dtype) for _, r in parts)
  d = normalizer(w, EntmaxResidual(tau, total)).astype(num.dtype)[..., None]
  out = jnp.where(d == 0, 0.0, num / jnp.where(d == 0, 1.0, d))  # a row without weight: 0
  return out.astype(dtype), SharedThreshold(tau, total)


def merge_parts(w: Any, parts: Sequence[tuple[Array, Any]]) -> tuple[Array, Any]:
  """The merge rule behind :func:`merge_attention`, without its checks: each part becomes the
  raw streaming state of its family (:func:`to_state`), the states merge with the family's own
  rule — :func:`attnx.core.streaming.pointwise_merge` or :func:`attnx.core.streaming.merge`,
  the one the tile loops, split-KV and the ring use — and the result is finalized once.

  Ring attention merges its steps with it. It also merges SSMax parts computed with the whole
  row's scale (the ring's are), which :func:`merge_attention` refuses from users.
  ``w``: a resolved weighting; ``parts`` in key order for stick-breaking.
  """
  dtype = parts[0][0].dtype
  cd = jnp.promote_types(dtype, jnp.float32)
  states = [to_state(w, o.astype(cd), jax.tree.map(lambda x: x.astype(cd), r))
            for o, r in parts]
  pointwise = isinstance(w, weightings_lib.Pointwise)
  rule = ((lambda a, b: streaming.pointwise_merge(w, a, b)) if pointwise
          else (lambda a, b: streaming.merge(w.stream, a, b)))
  if not pointwise and w.stream.reverse:  # the later keys first (streaming.merge's order)
    state = states[-1]
    for st in reversed(states[:-1]):
      state = rule(state, st)
  else:
    state = states[0]
    for st in states[1:]:
      state = rule(state, st)
  if pointwise:
    out, stat = streaming.pointwise_finalize(w, *state)
    stats = (stat,)
  else:
    out, stats, _ = streaming.finalize(w.stream, state, None)
  return out.astype(dtype), from_stats(w, stats)


def to_state(w: Any, out: Array, residual: Any) -> Any:
  """The raw streaming state (XLA spelling, :mod:`attnx.core.streaming`) of a part ``(out,
  residual)``: what the family's kernels would hold after that part's keys, in units of its
  normalizer. Log normalizer r: running max m = r and the keys' share 1 − c·e^{−r} of the
  normalizer (c the row term :func:`row_term`, which the family's finalize adds back once);
  a row without weight (r = −∞) is an empty state."""
  kind = residual_kind(w)
  if kind == "log_survival":
    return StickState(out, residual)
  if kind == "threshold":
    raise ValueError(f"{w.name!r}: a threshold part has no streaming state of its own")
  if isinstance(w, weightings_lib.Pointwise) and not w.online_max:
    if kind == "unnormalized":
      return out, jnp.zeros(out.shape[:-1], out.dtype)
    n = jnp.exp(residual)  # the part's normalizer: Σ F (+ offset) or the key count
    if w.divides_by_sum:  # Σ F rides in a last column; the offset is finalize's
      acc = jnp.concatenate([out * n[..., None], (n - row_term(w))[..., None]], -1)
      return acc, jnp.zeros_like(n)
    return out * n[..., None], n
  empty = residual == -jnp.inf
  c = row_term(w)
  share = -jnp.expm1(jnp.log(c) - residual) if c else jnp.ones_like(residual)
  share = jnp.where(empty, 0.0, share)
  acc = jnp.where(empty[..., None], 0.0, out)
  if isinstance(w, weightings_lib.Pointwise):  # the online max: Σ F in a last column
    return jnp.concatenate([acc, share[..., None]], -1), residual
  return MaxState(acc, share, residual)


def to_stats(w: Any, residual: Any) -> tuple[Array, ...]:
  """The row statistics a kernel's backward reads (:func:`attnx.core.streaming.finalize`,
  :func:`attnx.core.streaming.pointwise_finalize`) from a one-array residual: the inverse of
  :func:`from_stats`."""
  kind = residual_kind(w)
  if kind == "threshold":
    raise ValueError(f"{w.name!r}: a threshold residual does not hold the backward's statistics")
  if kind == "log_survival":
    return (residual,)
  if kind == "unnormalized":
    return (jnp.ones_like(residual),)
  if isinstance(w, weightings_lib.Pointwise) and not w.online_max:
    return (jnp.exp(residual),)
  return (jnp.where(residual == -jnp.inf, jnp.inf, residual),)


def cotangent_sign(w: Any) -> float:
  """How the cotangent g of a one-array residual enters the kernels' backward row term δ
  (δ + sign·g; :func:`attnx.core.streaming.residual_delta` for the whole-row families): −1
  for a log normalizer that depends on the scores (a sum of F, SSMax, softpick), +1 for
  stick-breaking's log survival, 0 where nothing does (``"length"``, ``"none"``).
  ValueError for sparsemax/entmax, whose residual is two arrays."""
  if isinstance(w, weightings_lib.Pointwise):
    return -1.0 if (w.online_max or w.divides_by_sum) else 0.0
  rs = w.stream
  if rs.needs_threshold:
    raise ValueError(f"{w.name!r}'s residual is a threshold and a total: "
                     "attnx.core.streaming.residual_delta folds its cotangent")
  return 1.0 if rs.reverse else -1.0


def row_term(w: Any) -> float:
  """The constant every row's normalizer holds besides its keys' sum: softmax_plus_one's
  offset (a virtual key of score 0), softpick's ε; 0 for the others."""
  if isinstance(w, weightings_lib.Pointwise):
    return float(w.denominator_offset) if w.divides_by_sum else 0.0
  rs = getattr(w, "stream", None)
  return float(sum(getattr(rs, name) for name in rs.rules.row_terms)) if rs is not None else 0.0


__all__ = ["KINDS", "EntmaxResidual", "SharedThreshold", "cotangent_sign", "empty_residual",
           "from_stats", "merge_attention", "merge_parts", "normalizer", "residual_kind",
           "row_term", "to_state", "to_stats", "unnormalize"]
