"""``implementation="dense"``: the reference, which materializes the [N, T, S] weights.

It runs every weighting and every score (including those without a dot-product form, such as
``additive``), dropout on the weights and ``return_weights``, so it supports every problem and
ends the automatic choice's list. It is also the fastest for small problems, where the
streaming kernels' tiling costs more than the T×S weights (see
:data:`attnx.core.implementations.blocked.BLOCKED_MIN_SCORES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from attnx.core import masks as masks_lib
from attnx.core import scores as scores_lib
from attnx.core import weightings as weightings_lib
from attnx.core.contract import finite, nonfinite_inputs
from attnx.core.implementations.base import Implementation, Inputs, Problem, residual_reason

Array = jax.Array

# Scores linear in q: the scale can multiply q ([T, H]) instead of the [T, S] scores.
_LINEAR_IN_Q = ("dot", "scaled_dot", "bilinear")


def causal_mask(t: int, s: int) -> Array:
  """Boolean [T, S] lower-triangular mask: query i attends key j ≤ i (jax.nn convention)."""
  return jnp.tril(jnp.ones((t, s), dtype=jnp.bool_))


def combined_mask(mask: Array | None, is_causal: bool, t: int, s: int) -> Array | None:
  """The user's mask and the causal mask together (None: every key is valid)."""
  if is_causal:
    c = causal_mask(t, s)
    return c if mask is None else jnp.logical_and(mask, c)
  return mask


def dense_scores(q: Array, k: Array, bias: Array | None, sc: scores_lib.Score,
                 params: dict[str, Any], scale: float | Array, mod: Any = None) -> Array:
  """[B, N, T, S] float32 scores (scale and bias applied, and the score modification ``mod``,
  a :class:`~attnx.core.score_mods.ScoreMod`: cap, bias, ``score_mod`` in that order); k
  already has N heads.

  q and k come from :func:`~attnx.core.contract.nonfinite_inputs` (NaN their only non-finite
  value). The score is formed from their :func:`~attnx.core.contract.finite` copies, and a
  NaN added to the rows of a NaN q_i and the columns of a NaN k_j outside autodiff: the
  scores are NaN at exactly the same pairs, but the gradients of q, k (and of the scale and
  score parameters) are products of dS with finite numbers only. dS is 0 at masked pairs,
  and 0·NaN would otherwise make a masked NaN key poison dq of every row, and a NaN query row
  without valid keys dk of every key (the streaming kernels' backward does the same).
  """
  q_f, k_f = finite(q), finite(k)
  if isinstance(scale, float) and scale == 1.0:
    s = sc.dense(q_f, k_f, **params)
  elif (q.dtype == jnp.float32 and isinstance(scale, float)
        and any(sc is scores_lib.get_score(n) for n in _LINEAR_IN_Q)):
    s = sc.dense(q_f * scale, k_f, **params)  # one pass over T×H instead of T×S
  else:
    s = sc.dense(q_f, k_f, **params) * scale
  if mod is not None:
    s = mod.grid(s, bias, q.shape[:-3])
  elif bias is not None:
    s = s + bias.astype(s.dtype)
  nan_of = lambda x: jnp.where(jnp.any(jnp.isnan(x), axis=-1), jnp.nan, 0.0).astype(s.dtype)
  rows = jnp.swapaxes(nan_of(q), -1, -2)[..., :, None]  # [..., T, N] -> [..., N, T, 1]
  cols = jnp.swapaxes(nan_of(k), -1, -2)[..., None, :]  # [..., S, N] -> [..., N, 1, S]
  return s + jax.lax.stop_gradient(rows + cols)  # + 0 where finite: s unchanged


def weights_with_sinks(scores: Array, w: Any, valid: Array | None,
                       sinks: Array | None) -> Array:
  """The weights of [..., N, T, S] ``scores`` under ``valid``; with ``sinks`` [N] those of
  each row's keys and a virtual key of score ``sinks[h]`` that every row may attend (an
  attention sink: its value is zero, so only its share of the row's sum is seen), the
  sink's own weight dropped. F sees the sink as any key of the row (a pointwise F's n stays
  S)."""
  if sinks is None:
    return weightings_lib.apply_weighting(scores, w, axis=-1, where=valid)
  s = scores.shape[-1]
  col = jnp.broadcast_to(sinks.astype(scores.dtype)[:, None, None], scores.shape[:-1] + (1,))
  z = jnp.concatenate([scores, col], axis=-1)
  where = None
  if valid is not None:
    valid = jnp.broadcast_to(valid, scores.shape)
    where = jnp.concatenate([valid, jnp.ones(col.shape, bool)], axis=-1)
  if isinstance(w, weightings_lib.Pointwise):
    probs = weightings_lib.pointwise_weights(z, w, axis=-1, where=where, num_keys=s)
  else:
    probs = weightings_lib.apply_weighting(z, w, axis=-1, where=where)
  return probs[..., :s]


def repeat_kv(x: Array, n: int) -> Array:
  """[..., S, K, H] -> [..., S, N, H]: each kv head repeated for its N // K query heads."""
  return jnp.repeat(x, n // x.shape[-2], axis=-2) if x.shape[-2] != n else x


def drop_weights(w: Array, rng: Array, rate: float, broadcast: bool, key_ndim: int) -> Array:
  """Dropout on weights [batch..., N, T, S] exactly as ``flax.linen.dot_product_attention``.

  Same RNG use, mask shape and rescaling, so equal keys give equal masks: ``broadcast`` draws
  one [T, S] mask shared by the batch and head dims, otherwise one mask per weight.
  """
  keep_prob = 1.0 - rate
  shape = ((1,) * (key_ndim - 2) + w.shape[-2:]) if broadcast else w.shape
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  return w * (keep.astype(w.dtype) / jnp.asarray(keep_prob, w.dtype))


@dataclasses.dataclass(frozen=True)
class Dense(Implementation):
  """Scores, weights and the weighted sum as whole [batch..., N, T, S] arrays (float32):
  ``implementation=core.Dense()`` or ``"dense"``. It has no settings."""

  name: ClassVar[str] = "dense"

  def supports(self, problem: Problem) -> str | None:
    return residual_reason(self.name, problem)  # else every weighting, score, dropout, …

  def __call__(self, problem: Problem, inputs: Inputs) -> Array | tuple[Array, Array]:
    p = problem
    q, k, v, bias = nonfinite_inputs(inputs.query, inputs.key, inputs.value, inputs.bias)
    scores = dense_scores(q, repeat_kv(k, p.num_heads), bias, p.score, inputs.score_params,
                          inputs.scale, inputs.score_mod)
    mask = masks_lib.combine(inputs.mask, inputs.structured_mask, p.batch, p.num_heads, p.t,
                             p.s)
    valid = combined_mask(mask, p.is_causal, p.t, p.s)
    w = p.weighting
    if inputs.weighting_params:  # per head: [N] against the [..., N, T, S] scores
      rows = {name: x.reshape(x.shape + (1, 1)) if x.ndim else x
              for name, x in inputs.weighting_params.items()}
      w = dataclasses.replace(w, fn=w.bind(rows))
    if p.wants_residual:
      from attnx.core.implementations.split_kv import solve_rows
      flat = lambda x: x.reshape((-1,) + x.shape[len(p.batch):])
      return solve_rows(p, inputs, flat(scores), flat(repeat_kv(v, p.num_heads)), p.num_heads,
                        1, modify=lambda z: z)
    probs = weights_with_sinks(scores, w, valid, inputs.sinks)
    used = (drop_weights(probs, inputs.dropout_rng, p.dropout_rate, p.broadcast_dropout,
                         k.ndim) if p.dropout else probs)
    vv = repeat_kv(v, p.num_heads)
    out = jnp.einsum("...nts,...snh->...tnh", used.astype(vv.dtype), vv,
                     preferred_element_type=jnp.promote_types(vv.dtype, jnp.float32))
    out = out.astype(p.dtype)
    return (out, probs) if p.return_weights else out
