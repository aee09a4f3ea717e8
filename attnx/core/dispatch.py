"""The attention dispatcher: `attention` (dense or blocked), `attention_weights`, masks.

Same layout and mask/bias semantics as ``jax.nn.dot_product_attention``: ``q`` is
``[batch..., T, N, H]``, ``k`` and ``v`` are ``[batch..., S, K, H]`` with ``N`` a multiple of
``K`` (grouped-query attention), ``mask`` is boolean (True = attend) and ``bias`` additive, both
broadcastable to ``[batch..., N, T, S]``.

Two implementations:

* ``"dense"`` materializes the ``[N, T, S]`` weights; every weighting and score works.
* ``"blocked"`` streams key tiles flash-style with O(T) memory and a recomputing custom VJP;
  it runs every :class:`~attnx.core.weightings.Pointwise` weighting with every score that is a
  dot product of transformed vectors (all built-in scores but ``additive``).

Both obey one edge-case contract (:mod:`attnx.core.contract`): empty sequences, rows without a
valid key (a zero output where ``jax.nn`` averages all values), NaN/Inf inputs reaching exactly
the rows that attend them, weightings with an unbounded F', bf16/f16.

Dropout on the weights (``dropout_rate``/``dropout_rng``/``deterministic``/``broadcast_dropout``,
the arguments and RNG use of ``flax.linen.dot_product_attention``) and ``return_weights`` need
the weights, so they run the dense implementation. This is the one place attnx computes
"weights → dropout → values": :func:`~attnx.core.flax_attention_fn` and every ``attnx.nn``
module call :func:`attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import blocked_rows, rownorm
from attnx.core import pallas_attention as pallas_lib
from attnx.core import params as params_lib
from attnx.core import scores as scores_lib
from attnx.core import weightings as weightings_lib
from attnx.core.blocked import blocked_attention
from attnx.core.contract import nonfinite_inputs

Array = jax.Array
IMPLEMENTATIONS = ("dense", "blocked", "pallas")
STREAMING = ("blocked", "pallas")  # need a pointwise F and a dot-product score

# Above this many score entries per (batch, head), the blocked kernel is used by default.
# Re-measured with the triangle-shaped causal kernel (blocked / dense time, float32, one pinned
# core of a shared 2-core Xeon, medians of 5–25 round-robin runs, fwd | fwd+bwd; full, causal):
#   T = 17   (64×17×4×8, digits ViT):  full 1.28 | 2.08,  causal 1.19 | 2.00
#   T = 64   (8×64×4×64):              full 0.79 | 1.11,  causal 0.87 | 1.14
#   T = 128  (8×128×4×64):             full 0.74 | 1.11,  causal 0.80 | 1.14
#   T = 256  (2×256×4×64):             full 0.76 | 1.15,  causal 0.62 | 0.92
#   T = 512  (2×512×4×64):             full 0.82 | 0.92,  causal 0.53 | 0.87
#   T = 1024 (2×1024×4×64):            full 0.56 | 0.62,  causal 0.34 | 0.54
# Training is fwd+bwd: dense is faster up to T = 256 (full) and the causal gain at T = 256 is
# small, blocked wins everywhere from T = 512 on, so the threshold stays at 512².
# (experiments/kernel_benchmark.py times both implementations at larger shapes.)
BLOCKED_MIN_SCORES = 512 * 512
# The whole-row weightings are slower dense than softmax (a sort-free threshold search,
# cumulative sums, more transcendentals per score) and their blocked kernel wins earlier.
# fwd+bwd time blocked / dense, float32, 2-core AMD EPYC, full | causal (kernel benchmark,
# `rows` preset, 2026-11-25): at T = 256 (8×256×8×64) ssmax 0.83 | 0.78, softpick 0.78 | 0.77,
# stick_breaking 0.85 | 0.83, sparsemax 0.65 | 0.67, entmax15 0.75 | 0.72, entmax:alpha=1.3
# 0.48 | 0.50; measured side by side at T = 128 (16×128×4×64, while another process ran) the
# ratios were 0.63–0.95 with one loss (sparsemax full, 1.33). So blocked from 256² on.
ROW_BLOCKED_MIN_SCORES = 256 * 256


def _fail(msg: str) -> None:
  raise ValueError(msg)


def _check_inputs(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                  score: scores_lib.Score) -> None:
  """Shape/dtype checks on static shapes, before anything is traced."""
  shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"
  if q.ndim < 3 or k.ndim < 3 or v.ndim < 3:
    _fail(f"attention expects [batch..., T, N, H] arrays; got {shapes}.")
  if not (q.ndim == k.ndim == v.ndim):
    _fail(f"query, key and value must have the same rank; got {shapes}.")
  if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
    _fail(f"query, key and value must have the same batch dims; got {shapes}.")
  if k.shape[-3] != v.shape[-3] or k.shape[-2] != v.shape[-2]:
    _fail(f"key and value must have the same length S and kv heads K; got {shapes}.")
  n, kh = q.shape[-2], k.shape[-2]
  if kh == 0 or n % kh:
    _fail(f"query heads N={n} must be a multiple of key/value heads K={kh}; got {shapes}.")
  if q.shape[-1] == 0 or k.shape[-1] == 0:
    _fail(f"query and key need a head dim H ≥ 1; got {shapes}.")
  if score.name in ("dot", "scaled_dot", "cosine", "neg_sq_dist") and q.shape[-1] != k.shape[-1]:
    _fail(f"score {score.name!r} needs equal query/key head dims; got {shapes}.")
  for name, x in (("query", q), ("key", k), ("value", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      _fail(f"{name} must be floating point, got dtype {x.dtype}.")
  full = (*q.shape[:-3], n, q.shape[-3], k.shape[-3])
  for name, x in (("bias", bias), ("mask", mask)):
    if x is None:
      continue
    if x.ndim > len(full):
      _fail(f"{name} of shape {x.shape} has more dims than [batch..., N, T, S] = {full}.")
    try:
      if jnp.broadcast_shapes(x.shape, full) != full:
        raise ValueError
    except ValueError:
      _fail(f"{name} of shape {x.shape} does not broadcast to [batch..., N, T, S] = {full} "
            f"({shapes}).")
  if mask is not None and mask.dtype != jnp.bool_:
    _fail(f"mask must be boolean (True = attend), got dtype {mask.dtype}.")


def _to_4d(x: Array | None, batch: tuple[int, ...]) -> Array | None:
  """[batch..., N, T, S]-broadcastable -> [B or 1, N or 1, T or 1, S or 1]."""
  if x is None:
    return None
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)
  lead = x.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(batch):])
  x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
  return x.reshape((-1,) + x.shape[len(batch):])


def causal_mask(t: int, s: int) -> Array:
  """Boolean [T, S] lower-triangular mask: query i attends key j ≤ i (jax.nn convention)."""
  return jnp.tril(jnp.ones((t, s), dtype=jnp.bool_))


def _combined_mask(mask: Array | None, is_causal: bool, t: int, s: int) -> Array | None:
  if is_causal:
    c = causal_mask(t, s)
    return c if mask is None else jnp.logical_and(mask, c)
  return mask


def _zero_on_distances(weighting: Any, w: Any) -> bool:
  """Whether every weight is 0 on a distance score (s = −d² ≤ 0): the ``zero_on_nonpositive``
  trait the resolved weighting ``w`` declares (relu, relu2, power, softpick)."""
  if w.zero_on_nonpositive:
    return True
  if isinstance(weighting, (str, weightings_lib.Pointwise, weightings_lib.RowNormalizer)):
    return False
  # A bare callable F declares nothing (its trait reads False, "not known"), and accepting a
  # relu-like F here would silently give all-zero attention: probe it on a row of negative
  # scores instead. One constant evaluation of F, also while tracing.
  with jax.ensure_compile_time_eval():
    row = jnp.linspace(-50.0, -1e-3, 33, dtype=jnp.float32)
    return not bool(jnp.any(weightings_lib.apply_weighting(row, w) != 0))


def streams(w: Any) -> bool:
  """Whether the blocked kernel runs the resolved weighting ``w`` (every pointwise F, and the
  whole-row weightings that declare a streaming family)."""
  return isinstance(w, weightings_lib.Pointwise) or blocked_rows.streams(w)


def _check_implementation(implementation: str | None, w: Any, sc: scores_lib.Score) -> None:
  if implementation is None:
    return
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown implementation {implementation!r}; valid: "
                     f"{', '.join(IMPLEMENTATIONS)} or None (automatic).")
  if implementation in STREAMING and not streams(w):
    raise ValueError(
        f"Weighting {w.name!r} normalizes whole rows and has no streaming form "
        f"(implementation={implementation!r}); use implementation='dense' (or None).")
  if implementation in STREAMING and sc.to_dot is None:
    raise ValueError(f"Score {sc.name!r} is not a dot product of transformed vectors and "
                     f"cannot stream (implementation={implementation!r}); use "
                     "implementation='dense' (or None).")


def check_compatible(weighting: Any, score: Any = "scaled_dot",
                     implementation: str | None = None) -> None:
  """Raises ValueError if ``weighting``, ``score`` and ``implementation`` do not fit together.

  * The distance kernels (``gaussian``, ``boxcar``, ``triangular``, ``epanechnikov``) read the
    score as s = −d²: on a similarity score they would silently threshold q·k, so they need a
    distance score (``neg_sq_dist`` or ``metric``).
  * Conversely, a weighting that declares ``zero_on_nonpositive`` (0 for every s ≤ 0:
    ``list_weightings(zero_on_nonpositive=True)``, i.e. ``relu``, ``relu2``, ``power``,
    ``softpick``) gives all-zero weights on a distance score, which is always ≤ 0.
  * ``implementation="blocked"`` needs a pointwise weighting and a dot-product score.

  A user callable score is trusted. Unknown names raise too, listing the valid ones. Used by
  :func:`attention`, :func:`~attnx.core.flax_attention_fn` and every ``attnx.nn`` module, so a
  bad configuration fails when a model is built.
  """
  w = weightings_lib.get_weighting(weighting)
  sc = scores_lib.get_score(score)
  _check_implementation(implementation, w, sc)
  if not isinstance(score, (str, scores_lib.Score)):
    return
  check_score_params(score, None, require_arrays=False)  # inline "cosine:temperature=..."
  distance_scores = [n for n in scores_lib.list_scores() if scores_lib.get_score(n).distance]
  if w.kind == "pointwise" and w.distance_kernel and not sc.distance:
    raise ValueError(
        f"Weighting {w.name!r} is a kernel of the distance d = ‖q − k‖ and reads the score as "
        f"−d²; score {sc.name!r} is not a distance. Use score="
        f"{' or '.join(repr(n) for n in distance_scores)}, or a weighting of a similarity "
        "(e.g. 'softmax').")
  if sc.distance and _zero_on_distances(weighting, w):
    raise ValueError(
        f"Weighting {w.name!r} is 0 for every score ≤ 0, and score {sc.name!r} = −d² is never "
        "positive: every weight would be 0. Use a distance kernel ('gaussian', 'triangular', "
        "...) or a weighting that is positive on negative scores ('softmax', 'sigmoid', "
        "'sparsemax', ...).")


def check_score_params(score: Any, score_params: dict[str, Any] | None, *,
                       require_arrays: bool = True) -> dict[str, Any]:
  """The parameters of ``score`` (inline ``"name:k=v"`` and ``score_params``), checked.

  Raises ValueError for parameters the score does not accept, for a scalar temperature that is
  not a finite number > 0, and (``require_arrays``) for missing arrays of a parametrized score
  (bilinear W, metric L, additive Wq/Wk/v). A user callable takes any.
  """
  sc = scores_lib.get_score(score)
  params = {**scores_lib.score_params_from_name(score), **(score_params or {})}
  unknown = sorted(set(params) - set(sc.params))
  if unknown and isinstance(score, (str, scores_lib.Score)):
    raise ValueError(f"Unknown parameters {unknown} for score {sc.name!r}; it accepts "
                     f"{list(sc.params) or 'none'}.")
  temperature = params.get("temperature")
  if isinstance(temperature, (int, float, str, bool)):  # an array may be a learned temperature
    params["temperature"] = params_lib.number(f"score {sc.name!r}", "temperature", temperature,
                                              low=0.0)
  missing = [p for p in sc.params if p not in params and p != "temperature"]
  if missing and require_arrays:
    raise ValueError(f"score {sc.name!r} needs score_params {missing} (e.g. "
                     f"score_params={{{missing[0]!r}: array}}).")
  return params


def _resolve(weighting, score, scale, score_params, head_dim):
  check_compatible(weighting, score)
  w = weightings_lib.get_weighting(weighting)
  sc = scores_lib.get_score(score)
  params = check_score_params(score, score_params)
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim) if sc.scaled else 1.0
  return w, sc, params, float(scale) if not isinstance(scale, jax.Array) else scale


def _choose_implementation(implementation, w, sc, t: int, s: int) -> str:
  _check_implementation(implementation, w, sc)
  if implementation is None:
    blocked_ok = streams(w) and sc.to_dot is not None
    threshold = (BLOCKED_MIN_SCORES if isinstance(w, weightings_lib.Pointwise)
                 else ROW_BLOCKED_MIN_SCORES)
    return "blocked" if blocked_ok and t * s >= threshold else "dense"
  return implementation


# Scores linear in q: the scale can multiply q ([T, H]) instead of the [T, S] scores.
_LINEAR_IN_Q = ("dot", "scaled_dot", "bilinear")


def _dense_scores(q, k, bias, sc, params, scale):
  """[B, N, T, S] float32 scores (scale and bias applied); k already has N heads."""
  if isinstance(scale, float) and scale == 1.0:
    s = sc.dense(q, k, **params)
  elif (q.dtype == jnp.float32 and isinstance(scale, float)
        and any(sc is scores_lib.get_score(n) for n in _LINEAR_IN_Q)):
    s = sc.dense(q * scale, k, **params)  # one pass over T×H instead of T×S
  else:
    s = sc.dense(q, k, **params) * scale
  if bias is not None:
    s = s + bias.astype(s.dtype)
  return s


def _repeat_kv(x: Array, n: int) -> Array:
  return jnp.repeat(x, n // x.shape[-2], axis=-2) if x.shape[-2] != n else x


def _prepare(query, key, value, bias, mask, weighting, score, scale, score_params):
  q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  bias = None if bias is None else jnp.asarray(bias)
  mask = None if mask is None else jnp.asarray(mask)
  sc = scores_lib.get_score(score)
  _check_inputs(q, k, v, bias, mask, sc)
  w, sc, params, scale = _resolve(weighting, score, scale, score_params, q.shape[-1])
  return q, k, v, bias, mask, w, sc, params, scale


def attention_weights(query: Array, key: Array, bias: Array | None = None,
                      mask: Array | None = None, *, weighting: Any = "softmax",
                      score: Any = "scaled_dot", is_causal: bool = False,
                      scale: float | None = None,
                      score_params: dict[str, Any] | None = None) -> Array:
  """The attention weights w [batch..., N, T, S] (float32) of :func:`attention`.

  Always dense: it materializes the T×S weights. Arguments as in :func:`attention`.
  """
  q, k = jnp.asarray(query), jnp.asarray(key)
  q, k, _, bias, mask, w, sc, params, scale = _prepare(
      q, k, k, bias, mask, weighting, score, scale, score_params)
  (t, n), s = q.shape[-3:-1], k.shape[-3]
  if q.size == 0 or s == 0:
    return jnp.zeros((*q.shape[:-3], n, t, s), jnp.float32)
  q, k, _, bias = nonfinite_inputs(q, k, None, bias)
  scores = _dense_scores(q, _repeat_kv(k, n), bias, sc, params, scale)
  valid = _combined_mask(mask, is_causal, t, s)
  return weightings_lib.apply_weighting(scores, w, axis=-1, where=valid)


def _ssmax_param(w: Any, weighting_params: dict[str, Any] | None, n: int) -> Array | None:
  """SSMax's learned s from ``weighting_params`` (float32, shape () or [N]), checked."""
  if not weighting_params:
    return None
  family = getattr(getattr(w, "stream", None), "family", None)
  if family != "ssmax" or set(weighting_params) != {"s"}:
    raise ValueError(f"weighting_params {sorted(weighting_params)} do not apply to weighting "
                     f"{w.name!r}: only 'ssmax' takes learnable parameters ({{'s': array}}).")
  s = jnp.asarray(weighting_params["s"], jnp.float32)
  if s.shape not in ((), (n,)):
    raise ValueError(f"weighting_params['s'] must be a scalar or one value per query head "
                     f"[N] = [{n}], got shape {s.shape}.")
  return s


def _dropout_active(dropout_rate: Any, deterministic: Any) -> bool:
  """Validates the dropout arguments; whether dropout applies (rate > 0, not deterministic)."""
  try:
    rate = float(dropout_rate)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
    raise ValueError("dropout_rate must be a Python number in [0, 1) (it fixes the program), "
                     f"got {dropout_rate!r}.") from None
  if not 0.0 <= rate < 1.0:  # also rejects NaN
    raise ValueError(f"dropout_rate must be in [0, 1) (dropout keeps 1 − rate of the weights "
                     f"and rescales them by 1/(1 − rate)), got {dropout_rate}.")
  return rate > 0.0 and not bool(deterministic)


def _drop_weights(w: Array, rng: Array, rate: float, broadcast: bool, key_ndim: int) -> Array:
  """Dropout on weights [batch..., N, T, S] exactly as ``flax.linen.dot_product_attention``.

  Same RNG use, mask shape and rescaling, so equal keys give equal masks: ``broadcast`` draws
  one [T, S] mask shared by the batch and head dims, otherwise one mask per weight.
  """
  keep_prob = 1.0 - rate
  shape = ((1,) * (key_ndim - 2) + w.shape[-2:]) if broadcast else w.shape
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  return w * (keep.astype(w.dtype) / jnp.asarray(keep_prob, w.dtype))


def attention(query: Array, key: Array, value: Array, bias: Array | None = None,
              mask: Array | None = None, *, weighting: Any = "softmax",
              score: Any = "scaled_dot", is_causal: bool = False, scale: float | None = None,
              implementation: str | None = None, score_params: dict[str, Any] | None = None,
              block_q: int | None = None, block_k: int | None = None,
              dropout_rate: float = 0.0, dropout_rng: Array | None = None,
              deterministic: bool = False, broadcast_dropout: bool = True,
              return_weights: bool = False, interpret: bool = False,
              weighting_params: dict[str, Any] | None = None) -> Array | tuple[Array, Array]:
  """Attention with a pluggable score s and weighting F, optional dropout on the weights.

  Args:
    query: ``[batch..., T, N, H]``.
    key: ``[batch..., S, K, H]``; ``N`` must be a multiple of ``K`` (GQA).
    value: ``[batch..., S, K, Hv]``.
    bias: optional additive score bias broadcastable to ``[batch..., N, T, S]``.
    mask: optional boolean mask broadcastable to ``[batch..., N, T, S]``; True = attend.
    weighting: F — a name from ``list_weightings()``, ``"name:k=v"`` (``"power:p=3"``,
      ``"entmax:alpha=1.5"``), a Weighting, or a callable F(z) (sum-normalized).
    score: s — a name from ``list_scores()``, ``"cosine:temperature=0.1"``, or a callable
      ``(q, k) -> [batch..., N, T, S]``.
    is_causal: query i attends keys j ≤ i (top-left aligned, as in jax.nn).
    scale: multiplies the score; default 1/√H for ``scaled_dot`` and 1 for the others.
    implementation: ``"dense"``, ``"blocked"`` (flash-style in XLA, O(T) memory), ``"pallas"``
      (fused Pallas kernels: Triton on GPU, Mosaic on TPU; :mod:`attnx.core.pallas_attention`)
      or None: dense for small problems; for large streamable ones the blocked kernel, or on a
      GPU/TPU the Pallas kernel once a one-time self-check against blocked passed for that
      (backend, weighting, dtype, head size) — one warning and blocked if it fails. An
      explicit ``"pallas"`` never falls back.
    score_params: arrays for parametrized scores: ``bilinear`` (W), ``metric`` (L),
      ``additive`` (Wq, Wk, v); scalars for ``cosine`` (temperature).
    block_q, block_k: tile sizes of the blocked/Pallas kernel (default: chosen by the kernel,
      validated against the backend's rules for Pallas).
    dropout_rate: dropout on the weights, in [0, 1) (a Python number): each weight is kept
      with probability 1 − rate and rescaled by 1/(1 − rate).
    dropout_rng: the PRNG key of that dropout; required when dropout applies.
    deterministic: turns dropout off (evaluation). The argument convention is flax's
      ``dot_product_attention`` (default False: ``dropout_rate > 0`` alone means dropout, so
      a forgotten key raises instead of silently skipping dropout), and so is the RNG use:
      with ``weighting="softmax"`` and the same key the output equals flax's.
    broadcast_dropout: one [T, S] dropout mask shared by the batch and head dims (as flax);
      False draws one mask per weight.
    return_weights: also return the weights ``[batch..., N, T, S]`` (float32), as
      :func:`attention_weights` gives them: before dropout.
    interpret: run ``implementation="pallas"`` in Pallas' interpreter (the only way on a CPU:
      for tests; slow).
    weighting_params: arrays for the weighting's learnable parameters, which then get
      gradients: ``{"s": s}`` for ``ssmax`` (a scalar or one value per query head, shape
      ``[N]``; Nakanishi 2025 learn s per head). Every implementation that runs the weighting
      takes them.

  Dropout and ``return_weights`` need the weights themselves, so they run the dense
  implementation (``implementation=None`` picks it); ``implementation="blocked"``, which never
  forms them, raises a ValueError with either.

  Returns:
    ``[batch..., T, N, Hv]`` in the query's dtype (math is float32 for bf16/f16 inputs), or
    ``(output, weights)`` with ``return_weights``.

  Edge cases (the same in every implementation; :mod:`attnx.core.contract`):

  * T = 0 gives an empty output, S = 0 a zero output; gradients are zero.
  * A row with no valid key (fully masked, or every F(s) = 0) gives zeros with zero gradients.
  * Masked keys are never touched: NaN/Inf in a masked key, value or bias entry changes nothing.
  * NaN/Inf inputs: output row i is all NaN iff it has a valid key and q_i, or k_j, v_j or
    bias_ij (NaN or +Inf) of a valid key j, is non-finite — as in ``jax.nn``. A bias of −Inf
    is a score of −Inf (weight F(−∞) = 0 for every built-in F but ``taylor_exp``).
  * Finite inputs give finite outputs and gradients for every built-in weighting (scores up
    to ~1e4); ``power:p<1`` uses F(s) = F'(s) = 0 for s < 2⁻¹²⁶, where F' is unbounded.
  * Parameters are validated when the weighting/score is parsed: ``"power:p=abc"`` or
    ``"cosine:temperature=0"`` raise a ValueError naming the parameter and its range.
  * The returned weights follow the same contract (empty: an empty ``[..., N, T, S]``; zero
    rows for rows without a valid key; NaN rows where the output is NaN), and dropout keeps
    it: a dropped weight of a NaN row is still NaN, a zero row stays zero.

  Raises:
    ValueError: bad shapes or dtypes, a tile size below 1 (whatever the implementation), an
      unknown or incompatible weighting/score/implementation, ``dropout_rate`` outside
      [0, 1), dropout without ``dropout_rng``, or dropout / ``return_weights`` with
      ``implementation="blocked"``.
  """
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    # Checked for every implementation, so a bad tile fails the same way whichever one runs.
    bad = not isinstance(blk, numbers.Integral) or isinstance(blk, bool) or blk < 1
    if blk is not None and bad:
      raise ValueError(f"{name} must be a positive int tile size or None, got {blk!r}.")
  dropout = _dropout_active(dropout_rate, deterministic)
  if dropout and dropout_rng is None:
    raise ValueError(f"attention dropout (dropout_rate={dropout_rate}, deterministic=False) "
                     "needs dropout_rng, a PRNG key; pass deterministic=True to turn it off.")
  q, k, v, bias, mask, w, sc, params, scale = _prepare(
      query, key, value, bias, mask, weighting, score, scale, score_params)
  batch, (t, n), s = q.shape[:-3], q.shape[-3:-1], k.shape[-3]
  ssmax_s = _ssmax_param(w, weighting_params, n)
  impl = _choose_implementation(implementation, w, sc, t, s)
  if dropout or return_weights:
    if implementation not in (None, "dense"):  # the streaming kernels never form them
      needs = "dropout on the weights" if dropout else "return_weights=True"
      raise ValueError(f"{needs} needs the [T, S] weights, which implementation="
                       f"{implementation!r} never forms; use implementation='dense' (or None, "
                       "which picks it).")
    impl = "dense"
  out_dtype = q.dtype
  if impl == "pallas":  # the backend's tile rules, checked for empty inputs too
    pallas_lib.check_block_sizes(pallas_lib.resolve_backend(None, interpret), q.dtype,
                                 block_q=block_q, block_k=block_k)
  if q.size == 0 or s == 0:  # no query, or no key: every row has no valid key
    out = jnp.zeros((*batch, t, n, v.shape[-1]), out_dtype)
    return (out, jnp.zeros((*batch, n, t, s), jnp.float32)) if return_weights else out
  if impl in STREAMING:
    qd, kd = sc.to_dot(q, k, **params)
    flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])
    # Scores that transform q/k in float32 (distances, cosine) upcast v too: one dtype.
    compute = jnp.result_type(qd.dtype, kd.dtype, v.dtype)
    pointwise = isinstance(w, weightings_lib.Pointwise)
    if implementation is None and pallas_lib.choose_pallas(
        None, w, compute, qd.shape[-1], value_head_dim=v.shape[-1]):
      impl = "pallas"  # GPU/TPU, self-check passed; never consulted for an explicit choice
    kernel = (functools.partial(pallas_lib.pallas_attention, interpret=interpret,
                                **({} if ssmax_s is None else {"ssmax_s": ssmax_s}))
              if impl == "pallas" else blocked_attention if pointwise
              else functools.partial(blocked_rows.blocked_row_attention, ssmax_s=ssmax_s))
    out = kernel(flat(qd.astype(compute)), flat(kd.astype(compute)), flat(v.astype(compute)),
                 weighting=w, scale=scale, bias=_to_4d(bias, batch), mask=_to_4d(mask, batch),
                 is_causal=is_causal, block_q=block_q, block_k=block_k)
    return out.reshape(batch + out.shape[1:]).astype(out_dtype)
  q, k, v, bias = nonfinite_inputs(q, k, v, bias)
  scores = _dense_scores(q, _repeat_kv(k, n), bias, sc, params, scale)
  valid = _combined_mask(mask, is_causal, t, s)
  if ssmax_s is not None:  # s per head: [N] against the [..., N, T, S] scores
    s_rows = ssmax_s.reshape(ssmax_s.shape + (1, 1)) if ssmax_s.ndim else ssmax_s
    w = dataclasses.replace(w, fn=lambda z, wh, ax: rownorm.ssmax(z, axis=ax, where=wh,
                                                                  s=s_rows))
  probs = weightings_lib.apply_weighting(scores, w, axis=-1, where=valid)
  used = (_drop_weights(probs, dropout_rng, float(dropout_rate), broadcast_dropout, k.ndim)
          if dropout else probs)
  vv = _repeat_kv(v, n)
  out = jnp.einsum("...nts,...snh->...tnh", used.astype(vv.dtype), vv,
                   preferred_element_type=jnp.promote_types(vv.dtype, jnp.float32))
  out = out.astype(out_dtype)
  return (out, probs) if return_weights else out

