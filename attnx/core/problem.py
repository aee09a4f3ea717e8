"""The validated problem: argument checks, parameters and the static description of a call.

Every entry point (:func:`attnx.core.attention`, :func:`~attnx.core.attention_weights`,
:func:`~attnx.core.ring_attention`, :func:`~attnx.core.flax_attention_fn`, the ``attnx.nn``
modules) checks its arguments here, once, before anything is traced: shapes and GQA, dtypes,
masks and biases, the weighting with its parameters, the score with its parameters, tiles and
dropout. :func:`plan` turns a checked call into the :class:`~attnx.core.implementations.Problem`
(shapes, dtypes, flags: no array) that every implementation reads and the
:class:`~attnx.core.implementations.Inputs` (the arrays) that it runs on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnx.core import masks as masks_lib
from attnx.core import params as params_lib
from attnx.core import score_mods as score_mods_lib
from attnx.core import scores as scores_lib
from attnx.core import weightings as weightings_lib
from attnx.core.implementations import (
  DECODE_MAX_QUERIES,
  DECODE_MIN_KEYS,
  Implementation,
  Inputs,
  Problem,
  get_implementation,
)
from attnx.core.implementations.blocked import min_scores

Array = jax.Array

__all__ = ["check_compatible", "check_flag", "check_implementation", "check_inputs",
           "check_score_params",
           "check_weighting_params", "choose_implementation", "describe", "dropout_active",
           "check_sinks", "plan", "prepare", "resolve", "score_modification", "sinks_reason"]


def _fail(msg: str) -> None:
  raise ValueError(msg)


def check_inputs(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
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
  if score.equal_head_dims and q.shape[-1] != k.shape[-1]:
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


def check_implementation(implementation: str | Implementation | None, w: Any,
                         sc: scores_lib.Score) -> None:
  """Raises ValueError for an unknown implementation name, or one that cannot run weighting
  ``w`` with score ``sc`` whatever the shapes."""
  if implementation is None:
    return
  reason = get_implementation(implementation).supports_config(w, sc)
  if reason is not None:
    raise ValueError(reason)


def check_compatible(weighting: Any, score: Any = "scaled_dot",
                     implementation: str | Implementation | None = None) -> None:
  """Raises ValueError if ``weighting``, ``score`` and ``implementation`` do not fit together.

  * The distance kernels (``gaussian``, ``boxcar``, ``triangular``, ``epanechnikov``) read the
    score as s = −d²: on a similarity score they would silently threshold q·k, so they need a
    distance score (``neg_sq_dist`` or ``metric``).
  * Conversely, a weighting that declares ``zero_on_nonpositive`` (0 for every s ≤ 0:
    ``list_weightings(zero_on_nonpositive=True)``, i.e. ``relu``, ``relu2``, ``power``,
    ``softpick``) gives all-zero weights on a distance score, which is always ≤ 0.
  * ``implementation="blocked"`` or ``"pallas"`` needs a weighting with a streaming form and
    a dot-product score (the implementation's ``supports_config``); the checks that need
    shapes, dtypes and the device come when :func:`attention` runs (:func:`explain`).

  A user callable score is trusted. Unknown names raise too, listing the valid ones. Used by
  :func:`attention`, :func:`~attnx.core.flax_attention_fn` and every ``attnx.nn`` module, so a
  bad configuration fails when a model is built.
  """
  w = weightings_lib.get_weighting(weighting)
  sc = scores_lib.get_score(score)
  check_implementation(implementation, w, sc)
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


def resolve(weighting: Any, score: Any, scale: float | Array | None,
            score_params: dict[str, Any] | None,
            head_dim: int) -> tuple[Any, scores_lib.Score, dict[str, Any], float | Array]:
  """The weighting and score objects, the checked score parameters and the scale (default
  1/√H for a scaled score, else 1); ValueError when they do not fit together."""
  check_compatible(weighting, score)
  w = weightings_lib.get_weighting(weighting)
  sc = scores_lib.get_score(score)
  params = check_score_params(score, score_params)
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim) if sc.scaled else 1.0
  return w, sc, params, float(scale) if not isinstance(scale, jax.Array) else scale


def choose_implementation(implementation: str | Implementation | None, w: Any,
                          sc: scores_lib.Score, t: int, s: int) -> str:
  """The name ``implementation`` checked, or for None the automatic choice between dense,
  split-KV and blocked for T×S scores (the answer on a CPU), from the weighting and score
  alone: for callers that decide before they have arrays (the differential test net)."""
  check_implementation(implementation, w, sc)
  if implementation is not None:
    return get_implementation(implementation).name
  blocked_ok = get_implementation("blocked").supports_config(w, sc) is None
  if blocked_ok and t <= DECODE_MAX_QUERIES and s >= DECODE_MIN_KEYS:
    return "split_kv"
  return "blocked" if blocked_ok and t * s >= min_scores(w) else "dense"


def prepare(query: Array, key: Array, value: Array, bias: Array | None,
            mask: Array | masks_lib.Mask | None, weighting: Any, score: Any,
            scale: float | Array | None, score_params: dict[str, Any] | None,
            mask_keywords: dict[str, Any] | None = None) -> tuple[Any, ...]:
  """The arrays checked (:func:`check_inputs`) and the call resolved (:func:`resolve`):
  ``(q, k, v, bias, mask, weighting, score, score_params, scale, structured)``.

  ``mask`` may be a structured mask (:mod:`attnx.core.masks`), and ``mask_keywords`` holds
  ``jax.nn``'s ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size`` and
  attnx's ``segment_ids`` (:func:`~attnx.core.masks.from_jax_nn`): together they are
  ``structured``, bound to the call (:meth:`~attnx.core.masks.Mask.bind`), or None; ``mask``
  is then the dense boolean array given, or None."""
  q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  bias = None if bias is None else jnp.asarray(bias)
  structured = masks_lib.from_jax_nn(**(mask_keywords or {}))
  if isinstance(mask, masks_lib.Mask):
    structured = mask if structured is None else mask & structured
    mask = None
  mask = None if mask is None else jnp.asarray(mask)
  sc = scores_lib.get_score(score)
  check_inputs(q, k, v, bias, mask, sc)
  w, sc, params, scale = resolve(weighting, score, scale, score_params, q.shape[-1])
  if structured is not None:
    structured = structured.bind(q.shape[:-3], q.shape[-2], q.shape[-3], k.shape[-3])
    bias = sequence_bias(w, structured, bias, q, k.shape[-3])
  return q, k, v, bias, mask, w, sc, params, scale, structured


def sequence_bias(w: Any, structured: masks_lib.Mask, bias: Array | None, q: Array,
                  s: int) -> Array | None:
  """``bias`` plus the weighting's per-query shift for the keys of each query's sequence
  (``Pointwise.sequence_shift``: sigmoid's −log n with n the query's document) where the
  bound ``structured`` mask splits rows into sequences; ``bias`` unchanged otherwise. The
  shift is a [batch..., 1, T, 1] bias: every implementation reads it as any bias."""
  shift = getattr(w, "sequence_shift", None)
  if shift is None or s == 0:
    return bias
  t, batch = q.shape[-3], q.shape[:-3]
  n = structured.sequence_keys(t, s)
  if n is None:
    return bias
  dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  lead = batch if n.shape[0] > 1 else (1,) * len(batch)
  extra = lax.stop_gradient(shift(n, s).astype(dtype)).reshape(lead + (1, t, 1))
  return extra if bias is None else bias + extra


def check_weighting_params(w: Any, values: dict[str, Any] | None,
                           n: int) -> dict[str, Array]:
  """The checked ``weighting_params`` of a call: each a parameter the weighting declares
  (``w.learnable``), a scalar or one value per query head ``[N]``, float32 (float64 for a
  float64 array; the kernels take it in their compute dtype). ``{}`` for None."""
  if not values:
    return {}
  declared = [p.name for p in getattr(w, "learnable", ())]
  if set(values) != set(declared):
    takes = (f"it takes {{{', '.join(repr(n) + ': array' for n in declared)}}}" if declared
             else "it has no learnable parameters (of the built-in weightings only 'ssmax' "
                  "has one: {'s': array})")
    raise ValueError(f"weighting_params {sorted(values)} do not apply to weighting "
                     f"{w.name!r}: {takes}.")
  out = {}
  for name in declared:
    x = jnp.asarray(values[name])
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if x.shape not in ((), (n,)):
      raise ValueError(f"weighting_params[{name!r}] must be a scalar or one value per query "
                       f"head [N] = [{n}], got shape {x.shape}.")
    out[name] = x
  return out


def dropout_active(dropout_rate: Any, deterministic: Any) -> bool:
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


def describe(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None, w: Any,
             sc: scores_lib.Score, params: dict[str, Any], *, is_causal: bool,
             dropout_rate: float, broadcast_dropout: bool, return_weights: bool,
             has_structured_mask: bool = False, has_score_mod: bool = False,
             has_sinks: bool = False, score_mod_kind: str | None = None,
             return_residual: bool = False, normalize_output: bool = True) -> Problem:
  """The static description of a checked call (shapes and dtypes only: works on tracers)."""
  stream_dtype = stream_head_dim = None
  if sc.to_dot is not None:  # what the streaming kernels will see, without computing it
    qd, kd = jax.eval_shape(lambda q, k: sc.to_dot(q, k, **params), q, k)
    stream_dtype = jnp.result_type(qd.dtype, kd.dtype, v.dtype).name
    stream_head_dim = int(qd.shape[-1])
  return Problem(
      weighting=w, score=sc, batch=tuple(q.shape[:-3]), t=q.shape[-3], s=k.shape[-3],
      num_heads=q.shape[-2], num_kv_heads=k.shape[-2], head_dim=q.shape[-1],
      value_head_dim=v.shape[-1], dtype=q.dtype.name, stream_dtype=stream_dtype,
      stream_head_dim=stream_head_dim, is_causal=bool(is_causal), has_mask=mask is not None,
      has_bias=bias is not None, has_structured_mask=has_structured_mask,
      has_score_mod=has_score_mod, has_sinks=has_sinks,
      score_mod_kind=score_mod_kind,
      dropout_rate=dropout_rate,
      broadcast_dropout=bool(broadcast_dropout), return_weights=bool(return_weights),
      platform=jax.default_backend(), return_residual=return_residual,
      normalize_output=normalize_output)


def plan(query: Array, key: Array, value: Array, bias: Array | None = None,
          mask: Array | None = None, *, weighting: Any = "softmax", score: Any = "scaled_dot",
          is_causal: bool = False, scale: float | None = None,
          score_params: dict[str, Any] | None = None, dropout_rate: float = 0.0,
          dropout_rng: Array | None = None, deterministic: bool = False,
          broadcast_dropout: bool = True, return_weights: bool = False,
          weighting_params: dict[str, Any] | None = None,
          query_seq_lengths: Array | None = None, key_value_seq_lengths: Array | None = None,
          local_window_size: int | tuple[int, int] | None = None,
          segment_ids: Any = None, logits_soft_cap: float | None = None,
          score_mod: Any = None, score_mod_params: Any = None,
          sinks: Array | None = None, return_residual: bool = False,
          normalize_output: bool = True) -> tuple[Problem, Inputs]:
  """Checks the arguments of :func:`attention` (which documents them) that describe the
  problem; the call's Problem and Inputs. The implementation and its settings are the
  dispatcher's (:mod:`attnx.core.api`)."""
  dropout = dropout_active(dropout_rate, deterministic)
  return_residual = check_flag("return_residual", return_residual)
  normalize_output = check_flag("normalize_output", normalize_output)
  if return_weights and return_residual:
    raise ValueError("return_weights and return_residual cannot both be True: ask for the "
                     "weights (dense) or for the residual, in two calls.")
  if dropout and dropout_rng is None:
    raise ValueError(f"attention dropout (dropout_rate={dropout_rate}, deterministic=False) "
                     "needs dropout_rng, a PRNG key; pass deterministic=True to turn it off.")
  q, k, v, bias, mask, w, sc, params, scale, structured = prepare(
      query, key, value, bias, mask, weighting, score, scale, score_params,
      dict(query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
           local_window_size=local_window_size, segment_ids=segment_ids))
  wparams = check_weighting_params(w, weighting_params, q.shape[-2])
  mod = score_modification(logits_soft_cap, score_mod, score_mod_params, q)
  sinks = check_sinks(sinks, w, q.shape[-2], q.dtype)
  problem = describe(q, k, v, bias, mask, w, sc, params, is_causal=is_causal,
                     has_structured_mask=structured is not None, has_score_mod=mod is not None,
                     score_mod_kind=score_mods_lib.kind(mod),
                     has_sinks=sinks is not None,
                     dropout_rate=float(dropout_rate) if dropout else 0.0,
                     broadcast_dropout=broadcast_dropout, return_weights=return_weights,
                     return_residual=return_residual, normalize_output=normalize_output)
  inputs = Inputs(query=q, key=k, value=v, bias=bias, mask=mask, scale=scale,
                  score_params=params, weighting_params=wparams, dropout_rng=dropout_rng,
                  structured_mask=structured, score_mod=mod, sinks=sinks)
  return problem, inputs


def check_flag(name: str, value: Any) -> bool:
  """A Python bool argument that fixes the program (``return_residual``,
  ``normalize_output``); ValueError for anything else (an array would be traced)."""
  if not isinstance(value, bool | np.bool_):
    raise ValueError(f"{name} must be a Python bool (it fixes what attention returns), got "
                     f"{value!r}.")
  return bool(value)


def sinks_reason(w: Any) -> str | None:
  """Why attention sinks mean nothing for the resolved weighting ``w`` (None where they do):
  a sink is a virtual key of zero value, so it changes the output only through a sum of
  weights that its score enters."""
  if isinstance(w, weightings_lib.Pointwise):
    if w.normalization == "sum":
      return None
    return (f"sinks change only the sum that normalizes the weights, and weighting {w.name!r} "
            f"(normalization={w.normalization!r}) divides by no sum of weights: a key of zero "
            f"value would change nothing. Use a weighting with normalization='sum'.")
  stream = getattr(w, "stream", None)
  if stream is not None and not stream.takes_sinks:
    return (f"weighting {w.name!r} has no sum for a sink to enter: stick-breaking leaves the "
            "stick its keys do not take unassigned, which already is its sink (Tan et al., "
            "'Scaling Stick-Breaking Attention').")
  return None


def check_sinks(sinks: Any, w: Any, n: int, dtype: Any) -> Array | None:
  """The checked ``sinks`` of a call: a float array ``[N]`` (one learned score per query
  head), in float32 (float64 for float64 inputs), for a weighting it means something for
  (:func:`sinks_reason`); None for None."""
  if sinks is None:
    return None
  x = jnp.asarray(sinks)
  if x.shape != (n,) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"sinks must be a float array [N] = [{n}] (one score per query head), "
                     f"got shape {x.shape} and dtype {x.dtype}.")
  reason = sinks_reason(w)
  if reason is not None:
    raise ValueError(reason)
  return x.astype(jnp.float64 if dtype == jnp.float64 else jnp.promote_types(x.dtype,
                                                                                jnp.float32))


def score_modification(logits_soft_cap: Any, score_mod: Any, score_mod_params: Any,
                       q: Array) -> score_mods_lib.ScoreMod | None:
  """The call's checked :class:`~attnx.core.score_mods.ScoreMod` (None without one): a
  positive cap, a callable or ScoreMod whose parameters are float arrays and which returns
  scores of the tile's shape and dtype (the compute dtype of ``q``)."""
  mod = score_mods_lib.make(logits_soft_cap, score_mod, score_mod_params)
  if mod is None:
    return None
  params = jax.tree.map(jnp.asarray, mod.params)
  for leaf in jax.tree.leaves(params):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(f"score_mod_params must be float arrays (they get gradients), got one "
                       f"of dtype {leaf.dtype}; close over integer data in the score_mod "
                       "function instead.")
  mod = dataclasses.replace(mod, params=params)
  score_mods_lib.check(mod, jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
  return mod

