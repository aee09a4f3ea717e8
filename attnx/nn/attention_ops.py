"""The logic of multi-head attention that the linen and the NNX module share.

:class:`attnx.nn.MultiHeadAttention` (linen) and :class:`attnx.nnx.MultiHeadAttention` (NNX)
differ only in how they own parameters and the KV cache; everything else is here, as
functions of arrays and of the module's options. ``opts`` is the module itself: any object
with the fields the linen module documents (``num_heads``, ``weighting``, ``score``,
``is_causal``, ``sliding_window``, ``logits_soft_cap``, ``sinks``, ``alibi``,
``learn_alibi``, ``rotary``, ``rotary_base``, ``sequence_axis``, ``sequence_layout``,
``implementation``, ``dropout_rate``, ...): the linen module itself, or the NNX module's
``options`` (a dataclass of the linen module's fields).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from attnx import core
from attnx.core import problem as problem_lib
from attnx.core.parallel import ring as ring_lib
from attnx.nn import _util
from attnx.nn import rotary as rotary_lib

Array = jax.Array


# Scores whose width a module's score_dim sets: metric's rank (its features), and every score
# with a learned parameter whose shape uses the width.
SCORE_DIM_SCORES = ("metric",) + tuple(
    name for name in core.list_scores()
    if any(spec.uses_width for _, spec in core.get_score(name).learned))


def ssmax_init(weighting: Any) -> float | None:
  """The weighting's own ``s`` (the initial value of a learned s: SSMax declares it as a
  learnable parameter), None for a weighting without one."""
  return next((p.default for p in core.get_weighting(weighting).learnable if p.name == "s"),
              None)


def is_metric(score: Any) -> bool:
  """``score="metric"``: metric attention's learned map replaces the q/k projections."""
  return _util.score_name(score) == "metric"


def check_options(opts: Any, where: str, *, sow_weights: bool = False) -> None:
  """ValueError (naming ``where``) for options that contradict each other; normalizes
  ``opts.sliding_window`` to an int or a (left, right) pair. Called when a module is made.

  ``sow_weights``: whether the module may sow or drop out its weights (linen's field; an NNX
  module's call argument, checked there)."""
  check_modifications(opts, where)
  if opts.rotary and not opts.rotary_base > 0:
    raise ValueError(f"{where}: rotary_base must be positive, got {opts.rotary_base}.")
  _util.validate_attention_config(opts.weighting, opts.score, opts.implementation, where)
  _util.check_heads(opts.qkv_features or opts.num_heads, opts.num_heads, opts.num_kv_heads,
                    where)
  _util.check_dropout_rate(opts.dropout_rate, where)
  if opts.score_dim is not None:
    if _util.score_name(opts.score) not in SCORE_DIM_SCORES:
      raise ValueError(f"{where}: score_dim applies only to the scores "
                       f"{', '.join(map(repr, SCORE_DIM_SCORES))} (rank of L / hidden width), "
                       f"not to score {opts.score!r}.")
    if opts.score_dim <= 0:
      raise ValueError(f"{where}: score_dim must be positive, got {opts.score_dim}.")
  if is_metric(opts.score):
    if opts.num_kv_heads not in (None, opts.num_heads):
      raise ValueError(f"{where}: score='metric' shares one map between queries and keys, "
                       f"so keys have the query heads; num_kv_heads={opts.num_kv_heads} does "
                       "not apply.")
    if opts.qk_norm:
      raise ValueError(f"{where}: qk_norm does not apply to score='metric' (queries and keys "
                       "share one map; separate norms would break the pseudo-metric).")
    if opts.scale is not None and not opts.scale > 0:
      raise ValueError(f"{where}: scale is the temperature τ > 0 of score='metric', got "
                       f"{opts.scale}.")
  elif opts.learn_temperature is not None:
    raise ValueError(f"{where}: learn_temperature applies only to score='metric', not to "
                     f"score {opts.score!r}.")
  if opts.learn_ssmax_s and ssmax_init(opts.weighting) is None:
    raise ValueError(f"{where}: learn_ssmax_s applies only to weighting 'ssmax', not to "
                     f"{opts.weighting!r}.")
  check_sequence_axis(opts, where, sow_weights=sow_weights)
  check_weights_formed(opts, sow_weights, where)


def check_weights_formed(opts: Any, sow_weights: bool, where: str) -> None:
  """ValueError when dropout or ``sow_weights`` needs the attention weights and the chosen
  implementation never forms them (anything but dense or the automatic choice)."""
  if _util.implementation_name(opts.implementation) not in (None, "dense") and (
      opts.dropout_rate > 0 or sow_weights):
    needs = "dropout_rate > 0" if opts.dropout_rate > 0 else "sow_weights=True"
    raise ValueError(f"{where}: {needs} needs the attention weights, which implementation="
                     f"{opts.implementation!r} never forms; use implementation='dense' or "
                     "None.")


def check_modifications(opts: Any, where: str) -> None:
  """The window, cap, ALiBi and sinks options, checked when a module is made."""
  w = opts.sliding_window
  if w is not None:
    pair = (w, w) if isinstance(w, int) else tuple(w) if isinstance(w, tuple | list) else None
    if (pair is None or len(pair) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in pair)):
      raise ValueError(f"{where}: sliding_window must be an int >= 0 or a pair (left, right) "
                       f"of them, got {w!r}.")
    object.__setattr__(opts, "sliding_window", w if isinstance(w, int) else pair)
  if opts.logits_soft_cap is not None:
    core.soft_cap(opts.logits_soft_cap)  # the ValueError of a cap that is not positive
  if opts.sinks:
    reason = problem_lib.sinks_reason(core.get_weighting(opts.weighting))
    if reason is not None:
      raise ValueError(f"{where}: sinks=True: {reason}")
  if opts.alibi and opts.learn_alibi:
    raise ValueError(f"{where}: set alibi=True (fixed slopes) or learn_alibi=True (learned), "
                     "not both.")
  if opts.sliding_window is not None and opts.sequence_axis is not None:
    raise ValueError(f"{where}: sliding_window with sequence_axis (ring attention): "
                     "attnx.core.ring_attention takes a window as a structured mask "
                     "(attnx.core.masks.sliding_window), not as a module field yet; use "
                     "sequence_axis=None.")


def check_sequence_axis(opts: Any, where: str, *, sow_weights: bool = False) -> None:
  if opts.sequence_layout not in ring_lib.LAYOUTS:
    raise ValueError(f"{where}: sequence_layout must be one of {', '.join(ring_lib.LAYOUTS)}, "
                     f"got {opts.sequence_layout!r}.")
  if opts.sequence_axis is None:
    return
  if opts.dropout_rate > 0 or sow_weights:
    raise ValueError(f"{where}: sequence_axis={opts.sequence_axis!r} (ring attention) never "
                     "forms the attention weights: attention dropout and sow_weights need "
                     "sequence_axis=None.")
  check_ring_attention(opts.weighting, opts.score, opts.sequence_layout,
                       f"{where}: sequence_axis={opts.sequence_axis!r}")


def check_ring_attention(weighting: Any, score: Any, layout: str, where: str) -> None:
  """ValueError (prefixed by `where`) when this weighting and score cannot run as ring
  attention in `layout` (``score="metric"`` is a plain ``neg_sq_dist`` on learned features)."""
  score = "neg_sq_dist" if is_metric(score) else score
  try:
    ring_lib.check_supported(weighting, score, layout)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def check_inputs(inputs_q: Array, inputs_kv: Array) -> None:
  """Rank and batch prefix of ``[B..., T, D]`` queries and ``[B..., S, D']`` keys/values."""
  chex.assert_rank(inputs_q, inputs_kv.ndim)
  if inputs_q.ndim < 2:
    raise ValueError(f"inputs_q must be [B..., T, D], got shape {inputs_q.shape}.")
  chex.assert_equal_shape_prefix([inputs_q, inputs_kv], inputs_q.ndim - 2)


def score_param_shapes(score: Any, num_heads: int, head_dim: int,
                       width: int | None) -> list[tuple[str, Any, tuple[int, ...]]]:
  """(name, init, shape) of each learned parameter the score declares
  (:class:`attnx.core.scores.LearnedParam`; a module names it ``score_<name>``); empty for a
  score without any (a user callable included)."""
  if _util.score_name(score) is None:
    return []
  r = width or head_dim
  return [(name, spec.init, spec.shape(num_heads, head_dim, r))
          for name, spec in core.get_score(score).learned]


def metric_log_temperature_init(scale: float | None, rank: int) -> Array:
  """The initial log τ of metric attention: log(scale), default τ = 1/√R (the scaled-dot
  analogue)."""
  return -0.5 * jnp.log(float(rank)) if scale is None else jnp.log(float(scale))


def metric_features(zq: Array, zk: Array, log_tau: Array) -> tuple[Array, Array]:
  """Queries and keys of ``score="metric"``: √τ_h L_h x, so −‖zq_i − zk_j‖² is the score.

  Folding the per-head τ into the features leaves a plain ``neg_sq_dist`` score, which every
  implementation (blocked included) runs.
  """
  root = jnp.exp(0.5 * log_tau)[:, None].astype(zq.dtype)
  return zq * root, zk * root


def check_metric_inputs(inputs_q: Array, inputs_k: Array, where: str) -> None:
  if inputs_q.shape[-1] != inputs_k.shape[-1]:
    raise ValueError(f"{where}: score='metric' compares queries and keys in one "
                     f"space: inputs_q {inputs_q.shape} and inputs_kv {inputs_k.shape} need "
                     "equal features.")


def rotate(opts: Any, query: Array, key: Array, start: Any = 0,
           positions: Array | None = None, where: str = "MultiHeadAttention"
           ) -> tuple[Array, Array]:
  """RoPE on queries [B..., T, N, H] and keys [B..., S, K, H]; positions start at ``start``
  (the cache index when decoding), or are the ``positions`` given ([B..., T], self
  attention), or the global positions of a sequence sharded over ``opts.sequence_axis``."""
  q_pos = start + jnp.arange(query.shape[-3])
  k_pos = start + jnp.arange(key.shape[-3])
  if positions is not None:
    positions = jnp.asarray(positions)
    if (positions.shape != query.shape[:-2] or query.shape[-3] != key.shape[-3]
        or not jnp.issubdtype(positions.dtype, jnp.integer)):
      raise ValueError(f"{where}: positions must be int [B..., T] = "
                       f"{query.shape[:-2]} of self attention, got {positions.shape} "
                       f"{positions.dtype}.")
    q_pos = k_pos = positions
  if sequence_shards(opts.sequence_axis) is not None:  # global positions here
    q_pos = k_pos = shard_positions(query.shape[-3], opts.sequence_axis, opts.sequence_layout)
  return (rotary_lib.apply_rotary(query, q_pos, opts.rotary_base),
          rotary_lib.apply_rotary(key, k_pos, opts.rotary_base))


def positions_unused(where: str) -> ValueError:
  return ValueError(f"{where}: positions are read by rotary=True only (ALiBi and the masks "
                    "use offsets, the same in every document).")


def cache_step(cached_key: Array, cached_value: Array, index: Array, query: Array, key: Array,
               value: Array, mask: Array | None, sliding_window: Any
               ) -> tuple[Array, Array, Array, Array, Array]:
  """One decoding step of a KV cache [B..., max_length, K, H]: writes this step's key and
  value [B..., 1, K, H] (of the one query [B..., 1, N, H]) at ``index`` and masks the
  positions not generated yet (and, under a sliding window, those before it).

  Returns (new cached key, new cached value, index + 1, the mask: [B..., 1, 1, max_length]
  and ``mask``, ``in_range``: whether the step had a slot). Past
  the end the cache is left as it is: dynamic_update_slice would clamp the index onto the
  last slot, so that slot is rewritten with its own value, and the caller turns the step's
  output to NaN.
  """
  *batch, max_length, kv_heads, head_dim = cached_key.shape
  if query.shape[-3] != 1 or tuple(key.shape) != (*batch, 1, kv_heads, head_dim):
    raise ValueError(f"decode=True feeds one position at a time: expected key shape "
                     f"{(*batch, 1, kv_heads, head_dim)} for the cache "
                     f"{cached_key.shape}, got query {query.shape}, key {key.shape}.")
  in_range = index < max_length
  zero = jnp.zeros((), index.dtype)
  idx = (zero,) * len(batch) + (index, zero, zero)
  new = []
  for cache, x in ((cached_key, key), (cached_value, value)):
    old = jax.lax.dynamic_slice(cache, idx, x.shape)  # a [B..., 1, K, H] slice
    new.append(jax.lax.dynamic_update_slice(cache, jnp.where(in_range, x, old), idx))
  new.append(index + 1)
  # The single query at position i sees cached positions ≤ i (this replaces is_causal), and
  # under a sliding window only the last `left` before it.
  seen = jnp.arange(max_length) <= index
  if sliding_window is not None:
    left = sliding_window if isinstance(sliding_window, int) else sliding_window[0]
    seen = seen & (jnp.arange(max_length) >= index - left)
  step = jnp.broadcast_to(seen, (*batch, 1, 1, max_length))
  mask = step if mask is None else jnp.logical_and(mask, step)
  return *new, mask, in_range


def paged_cache_init(key_shape: tuple[int, ...], page_size: int, dtype: Any
                     ) -> dict[str, Array]:
  """The empty paged KV cache for keys of ``key_shape`` [B, max_length, K, H]: a pool of
  B·P pages of ``page_size`` positions (P = ⌈max_length / page_size⌉) per key and value, the
  page table [B, P] (sequence b owns pages b·P … b·P + P − 1: a serving stack would hand pages
  out as sequences grow; attention reads any table) and the shared step index."""
  if len(key_shape) != 4:
    raise ValueError(f"a paged KV cache takes one batch dim: keys [B, max_length, K, H], got "
                     f"{key_shape}.")
  if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
    raise ValueError(f"cache_page_size must be a positive int, got {page_size!r}.")
  b, max_length, kv_heads, head_dim = key_shape
  pages = -(-max_length // page_size)
  pool = (b * pages, page_size, kv_heads, head_dim)
  return {"k_pages": jnp.zeros(pool, dtype), "v_pages": jnp.zeros(pool, dtype),
          "page_table": jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages),
          "cache_index": jnp.array(0, jnp.int32)}


def paged_cache_step(k_pages: Array, v_pages: Array, page_table: Array, index: Array,
                     query: Array, key: Array, value: Array, mask: Array | None,
                     sliding_window: Any) -> tuple[Array, ...]:
  """One decoding step of a paged KV cache (:func:`paged_cache_init`): writes this step's
  key and value [B, 1, K, H] at position ``index`` of every sequence
  (:func:`attnx.core.append_to_pages`) and returns (new k pages, new v pages, index + 1, the
  sequences' keys and values gathered in position order [B, P·page_size, K, H], the mask of
  the positions generated so far (and inside the window) ``&`` ``mask``, ``in_range``). Past
  the cache's end nothing is written and the caller turns the output to NaN, as
  :func:`cache_step`."""
  b, pages = page_table.shape
  capacity = pages * k_pages.shape[1]
  if query.shape[-3] != 1 or key.shape != (b, 1) + k_pages.shape[2:]:
    raise ValueError(f"decode=True feeds one position at a time: expected key shape "
                     f"{(b, 1) + k_pages.shape[2:]} for the paged cache, got query "
                     f"{query.shape}, key {key.shape}.")
  in_range = index < capacity
  lengths = jnp.full((b,), jnp.minimum(index, capacity - 1), jnp.int32)
  new_k, new_v, _ = core.append_to_pages(k_pages, v_pages, page_table, lengths, key[:, 0],
                                          value[:, 0])
  k_pages = jnp.where(in_range, new_k, k_pages)
  v_pages = jnp.where(in_range, new_v, v_pages)
  keys = core.paged.gather_pages(k_pages, page_table)
  values = core.paged.gather_pages(v_pages, page_table)
  seen = jnp.arange(capacity) <= index
  if sliding_window is not None:
    left = sliding_window if isinstance(sliding_window, int) else sliding_window[0]
    seen = seen & (jnp.arange(capacity) >= index - left)
  step = jnp.broadcast_to(seen, (b, 1, 1, capacity))
  mask = step if mask is None else jnp.logical_and(mask, step)
  return k_pages, v_pages, index + 1, keys, values, mask, in_range


def modifications(opts: Any, step_position: Array | None, slopes: Array | None = None,
                  sinks: Array | None = None, *, causal: bool | None = None) -> dict[str, Any]:
  """``core.attention``'s keywords for the window, the cap, ALiBi and the sinks. ``slopes``
  (ALiBi's, learned or fixed) and ``sinks`` are the module's; ALiBi is causal (−m·(i − j))
  when ``causal`` (default ``opts.is_causal``), else symmetric. A cached decoding step
  (``step_position``: the query's position) masks the window in the cache step instead, and
  ALiBi counts from there."""
  kw: dict[str, Any] = {}
  if opts.sliding_window is not None and step_position is None:
    kw["local_window_size"] = opts.sliding_window
  if opts.logits_soft_cap is not None:
    kw["logits_soft_cap"] = opts.logits_soft_cap
  if slopes is not None:
    symmetric = not (opts.is_causal if causal is None else causal)
    if step_position is None:
      kw["score_mod"] = core.alibi(slopes, symmetric=symmetric)
    else:  # the one query sits at the cache position, not at 0
      kw["score_mod"] = core.ScoreMod(fn=_alibi_from(step_position, symmetric), params=slopes)
  if sinks is not None:
    kw["sinks"] = sinks
  return kw


def _alibi_from(offset: Array, symmetric: bool):
  """ALiBi's score_mod for queries whose positions start at ``offset`` (a decoding step)."""
  def fn(score, b, h, q_idx, kv_idx, slopes):
    del b
    d = (q_idx + offset - kv_idx).astype(score.dtype)
    return score - slopes[h].astype(score.dtype) * (jnp.abs(d) if symmetric else d)
  return fn


def attend(opts: Any, query: Array, key: Array, value: Array, *, bias: Array | None,
           mask: Array | None, is_causal: bool, score: Any, score_params: Any, scale: Any,
           weighting_params: Any, mods: dict[str, Any], dropout_rng: Array | None,
           deterministic: bool, need_weights: bool, segment_ids: Any,
           self_attention: bool, decode: bool, where: str) -> tuple[Array, Array | None]:
  """The attention of projected queries [B..., T, N, H], keys and values [B..., S, K, H]:
  ring attention where ``opts.sequence_axis`` is bound, else :func:`attnx.core.attention`.
  Returns ([B..., T, N, H], the weights or None)."""
  if sequence_shards(opts.sequence_axis) is not None:
    if segment_ids is not None:
      raise ValueError(f"{where}: segment_ids with sequence_axis (ring attention): pass "
                       "them as a mask of attnx.core.masks to attnx.core.ring_attention.")
    if not self_attention or decode or need_weights:
      raise ValueError(f"{where}: with sequence_axis={opts.sequence_axis!r} bound (sequence "
                       "sharded over devices) only self attention runs, without decode or "
                       "return_weights.")
    x = core.ring_attention(
        query, key, value, bias, mask, axis_name=opts.sequence_axis,
        weighting=opts.weighting, score=score, weighting_params=weighting_params,
        is_causal=is_causal, scale=scale, score_params=score_params,
        layout=opts.sequence_layout,
        implementation=(None if _util.implementation_name(opts.implementation) in (None, "dense")
                        else opts.implementation),
        **mods)  # the cap, ALiBi and the sinks (a window is refused when made)
    return x, None
  x = core.attention(
      query, key, value, bias, mask, weighting=opts.weighting, score=score,
      weighting_params=weighting_params,
      is_causal=is_causal, scale=scale, score_params=score_params,
      implementation=opts.implementation, dropout_rate=opts.dropout_rate,
      dropout_rng=dropout_rng,
      deterministic=deterministic, broadcast_dropout=opts.broadcast_dropout,
      return_weights=need_weights, segment_ids=segment_ids, **mods)
  return x if need_weights else (x, None)


def overflow_to_nan(in_range: Array | None, out: Array,
                    weights: Array | None) -> tuple[Array, Array | None]:
  """A decoding step past the KV cache's end: NaN rather than a silently wrong value."""
  if in_range is None:
    return out, weights
  return (jnp.where(in_range, out, jnp.nan),
          None if weights is None else jnp.where(in_range, weights, jnp.nan))


def sequence_shards(axis_name: str | None) -> int | None:
  """How many shards the sequence has when mesh axis `axis_name` is bound here (inside a map
  over it), else None: the whole sequence is on this device."""
  if axis_name is None:
    return None
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    return None


def shard_positions(length: int, axis_name: str, layout: str = "contiguous") -> Array:
  """The global positions of the `length` tokens this device holds of a sequence sharded over
  mesh axis `axis_name` in `layout` (call inside a map over the axis)."""
  p, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  positions = jnp.arange(p * length)
  if layout == "zigzag":
    positions = core.zigzag_permute(positions, p, axis=0)
  return jax.lax.dynamic_slice_in_dim(positions, i * length, length)
