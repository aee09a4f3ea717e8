"""Multi-head attention with a pluggable score s and weighting F.

``MultiHeadAttention`` has exactly the parameter layout of
``flax.linen.MultiHeadDotProductAttention`` (DenseGeneral ``query``/``key``/``value`` with
features ``(heads, head_dim)``, ``out`` over axes ``(-2, -1)``, optional ``query_ln``/``key_ln``),
so linen checkpoints load verbatim and, with ``weighting="softmax"``, the outputs agree.

``score="metric"`` is metric attention (:class:`attnx.nn.MetricAttention` is this module with
that score): one learned map shared by queries and keys replaces their two projections.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx import core
from attnx.core import problem as problem_lib
from attnx.core.parallel import ring as ring_lib
from attnx.nn import _util
from attnx.nn import rotary as rotary_lib

Array = jax.Array

# Scores whose learned parameters have a free width (``score_dim``).
# Scores whose width a module's score_dim sets: metric's rank (its features), and every score
# with a learned parameter whose shape uses the width.
SCORE_DIM_SCORES = ("metric",) + tuple(
    name for name in core.list_scores()
    if any(spec.uses_width for _, spec in core.get_score(name).learned))


def _ssmax_init(weighting: Any) -> float | None:
  """The weighting's own ``s`` (the initial value of a learned s: SSMax declares it as a
  learnable parameter), None for a weighting without one."""
  return next((p.default for p in core.get_weighting(weighting).learnable if p.name == "s"),
              None)


class MultiHeadAttention(nn.Module, kw_only=True):
  """Multi-head attention, ``w_ij = F(s(q_i, k_j)) / Σ_l F(s(q_i, k_l))`` per head.

  Attributes:
    num_heads: query heads N.
    qkv_features: total q/k/v width (default: input features); must be divisible by N.
    out_features: output width (default: input features).
    num_kv_heads: key/value heads K for grouped-query attention (default N); N % K == 0.
    weighting: F, any ``core.get_weighting`` spec (``"relu"``, ``"entmax:alpha=1.5"``, callable).
    score: s, any ``core.list_scores()`` name or callable. ``bilinear``/``additive`` get learned
      per-head parameters (``score_W``/``score_Wq``, ``score_Wk``, ``score_v``) owned here.
      ``"metric"`` is metric attention (Ruan & Zhang, "Towards understanding how attention
      mechanism works in deep learning"): s_ij = −τ_h‖L_h(x_i − x_j)‖², a learned Mahalanobis
      pseudo-metric per head on the inputs, with one map L (param ``metric``, [D, N, R], no
      bias: it cancels in x_i − x_j) shared by queries and keys instead of the ``query`` and
      ``key`` projections, and a per-head temperature τ_h (param ``log_temperature``). It
      needs equal query/key input features and takes neither ``num_kv_heads`` nor
      ``qk_norm``.
    score_dim: rank R of ``metric``'s L or hidden width A of ``additive`` (default head_dim);
      must be positive, and is an error for any other score (it would be ignored).
    scale: score multiplier (default 1/√H for ``scaled_dot``, 1 otherwise); for ``metric`` the
      temperature τ (fixed, or the initial value when learned; default 1/√R).
    learn_temperature: ``metric`` only: learn τ_h = exp(log_temperature_h) (default True).
    learn_ssmax_s: ``ssmax`` only: learn its s per head (param ``ssmax_s`` [N], initialized
      at the weighting's s, e.g. ``"ssmax:s=0.43"``), as Nakanishi ("Scalable-Softmax Is
      Superior for Attention") does; gradients reach it through every implementation.
    implementation: ``None`` | ``"dense"`` | ``"blocked"`` | ``"pallas"`` (GPU/TPU; see
      ``core.attention``), or an implementation object with kernel settings
      (``core.Blocked(block_q=128)``). Dropout and weights (``sow_weights``,
      ``return_weights``) need the dense one.
    is_causal: query i attends keys j ≤ i.
    dropout_rate: dropout on the attention weights (``core.attention``'s, flax's RNG use).
    broadcast_dropout: share the dropout mask across batch and heads (as flax).
    use_bias: biases in the q/k/v/out projections.
    qk_norm: LayerNorm (no bias) on projected queries and keys (flax ``normalize_qk``).
    sow_weights: sow the weights [B..., N, T, S] into ``intermediates/attention_weights``.
    rotary: rotary position embeddings (RoPE, :mod:`attnx.nn.rotary`) on the projected queries
      and keys (after ``qk_norm``; for ``metric``, on its features): query/key position t gets
      the rotation R_t, so every score depends on positions only through their offset. With
      ``decode=True`` the positions continue from the cache index. Needs an even head dim.
    rotary_base: the base of the RoPE frequencies θ_i = base^(−2i/H).
    sequence_axis: context parallelism: the name of a mesh axis the sequence is sharded over.
      Inside a ``jax.shard_map`` that binds it (e.g. ``attnx.train`` with
      ``sequence_parallel``), self attention runs as ring attention
      (:func:`attnx.core.ring_attention`) and rotary positions are the global positions of
      the local tokens; where the axis is not bound (evaluation on one device) the same module
      attends over the whole sequence it is given, with the same parameters. Self attention
      only, without ``decode``, weights or attention dropout; every weighting
      ``ring_attention`` streams (not sparsemax / entmax), with ``logits_soft_cap``,
      ``alibi`` / ``learn_alibi`` (at global positions) and ``sinks`` (not
      ``sliding_window``: a ValueError when the module is made). ``implementation`` is the
      ring steps' kernel there: None (automatic), ``"blocked"`` or ``"pallas"`` (with a cap,
      ALiBi and sinks too).
    sequence_layout: how the sequence is cut over ``sequence_axis``: ``"contiguous"`` or
      ``"zigzag"`` (causal load balance; see :func:`attnx.core.zigzag_permute`).
    sliding_window: a local window, ``jax.nn``'s ``local_window_size``: an int w (query i
      attends keys i − w … i + w; with ``is_causal`` the w keys before it and itself) or a
      pair ``(left, right)``; None attends every key. Evaluated per tile by the streaming
      kernels (:func:`attnx.core.masks.sliding_window`); the KV cache honours it.
    logits_soft_cap: c > 0: scores become c·tanh(s/c) before F (Gemma 2).
    sinks: a learned attention sink per head (param ``sinks`` [N], initialized at 0): a
      virtual key of zero value every query attends (gpt-oss); for the weightings with a sum
      for it to enter (:func:`attnx.core.attention`'s ``sinks``).
    alibi: ALiBi (Press et al.): −m_h·(i − j) added to every score (−m_h·abs(i − j) when not
      causal), m the standard slopes (:func:`attnx.core.alibi_slopes`).
    learn_alibi: ``alibi`` with the slopes learned (param ``alibi_slopes`` [N], initialized
      at the standard ones).
    dtype, param_dtype, kernel_init, bias_init: as in flax.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from attnx import nn
    >>> mha = nn.MultiHeadAttention(num_heads=4, weighting="relu", is_causal=True)
    >>> x = jnp.ones((2, 10, 32))  # [B, T, D]
    >>> variables = mha.init(jax.random.key(0), x)
    >>> variables["params"]["query"]["kernel"].shape  # [D, N, H]
    (32, 4, 8)
    >>> y, w = mha.apply(variables, x, return_weights=True)
    >>> y.shape, w.shape  # [B, T, D] and [B, N, T, S]
    ((2, 10, 32), (2, 4, 10, 10))
    >>> bool((w[..., 0, 1:] == 0).all())  # causal: the first query sees only key 0
    True
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  weighting: Any = "softmax"
  score: Any = "scaled_dot"
  score_dim: int | None = None
  scale: float | None = None
  learn_temperature: bool | None = None
  learn_ssmax_s: bool = False
  implementation: str | core.Implementation | None = None
  is_causal: bool = False
  dropout_rate: float = 0.0
  broadcast_dropout: bool = True
  use_bias: bool = True
  qk_norm: bool = False
  sow_weights: bool = False
  rotary: bool = False
  rotary_base: float = rotary_lib.DEFAULT_BASE
  sequence_axis: str | None = None
  sequence_layout: str = "contiguous"
  sliding_window: int | tuple[int, int] | None = None
  logits_soft_cap: float | None = None
  sinks: bool = False
  alibi: bool = False
  learn_alibi: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.linear.default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()

  def __post_init__(self):
    where = type(self).__name__
    _check_modifications(self, where)
    if self.rotary and not self.rotary_base > 0:
      raise ValueError(f"{where}: rotary_base must be positive, got {self.rotary_base}.")
    _util.validate_attention_config(self.weighting, self.score, self.implementation, where)
    _util.check_heads(self.qkv_features or self.num_heads, self.num_heads, self.num_kv_heads,
                      where)
    _util.check_dropout_rate(self.dropout_rate, where)
    if self.score_dim is not None:
      if _util.score_name(self.score) not in SCORE_DIM_SCORES:
        raise ValueError(f"{where}: score_dim applies only to the scores "
                         f"{', '.join(map(repr, SCORE_DIM_SCORES))} (rank of L / hidden width), "
                         f"not to score {self.score!r}.")
      if self.score_dim <= 0:
        raise ValueError(f"{where}: score_dim must be positive, got {self.score_dim}.")
    if self._is_metric:
      if self.num_kv_heads not in (None, self.num_heads):
        raise ValueError(f"{where}: score='metric' shares one map between queries and keys, "
                         f"so keys have the query heads; num_kv_heads={self.num_kv_heads} does "
                         "not apply.")
      if self.qk_norm:
        raise ValueError(f"{where}: qk_norm does not apply to score='metric' (queries and keys "
                         "share one map; separate norms would break the pseudo-metric).")
      if self.scale is not None and not self.scale > 0:
        raise ValueError(f"{where}: scale is the temperature τ > 0 of score='metric', got "
                         f"{self.scale}.")
    elif self.learn_temperature is not None:
      raise ValueError(f"{where}: learn_temperature applies only to score='metric', not to "
                       f"score {self.score!r}.")
    if self.learn_ssmax_s and _ssmax_init(self.weighting) is None:
      raise ValueError(f"{where}: learn_ssmax_s applies only to weighting 'ssmax', not to "
                       f"{self.weighting!r}.")
    _check_sequence_axis(self, where)
    if _util.implementation_name(self.implementation) not in (None, "dense") and (
        self.dropout_rate > 0 or self.sow_weights):
      needs = "dropout_rate > 0" if self.dropout_rate > 0 else "sow_weights=True"
      raise ValueError(f"{where}: {needs} needs the attention weights, which implementation="
                       f"{self.implementation!r} never forms; use implementation='dense' or "
                       "None.")
    super().__post_init__()

  @property
  def _is_metric(self) -> bool:
    return _util.score_name(self.score) == "metric"

  def _score_width(self) -> int | None:
    """``score_dim`` (:class:`~attnx.nn.MetricAttention` also calls it ``rank``)."""
    return self.score_dim

  def _score_params(self, head_dim: int) -> dict[str, Array] | None:
    """The learned parameters the score declares (:class:`attnx.core.scores.LearnedParam`),
    ``score_<name>`` each; None for a score without any (a user callable included)."""
    if _util.score_name(self.score) is None:
      return None
    learned = core.get_score(self.score).learned
    if not learned:
      return None
    n, r = self.num_heads, self._score_width() or head_dim
    return {name: self.param(f"score_{name}", spec.init, spec.shape(n, head_dim, r),
                             self.param_dtype) for name, spec in learned}

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
               mask: Array | None = None, bias: Array | None = None,
               deterministic: bool = True, decode: bool = False,
               return_weights: bool = False, segment_ids: Any = None,
               positions: Array | None = None) -> Array | tuple[Array, Array]:
    """Self attention (``inputs_kv=None``) or cross attention.

    Args:
      inputs_q: ``[B..., T, Dq]``.
      inputs_kv: ``[B..., S, Dkv]`` (default ``inputs_q``).
      mask: boolean (or 0/1 float) mask broadcastable to ``[B..., N, T, S]``; True = attend
        (the mask convention of every ``attnx.nn`` attention module).
      bias: additive score bias broadcastable to ``[B..., N, T, S]``.
      deterministic: disables attention dropout.
      decode: autoregressive decoding with a KV cache in the ``"cache"`` collection (like
        linen MHA's ``decode``): initialize with the full-length input, whose length is the
        cache size ``max_length``, then feed one token ``[B..., 1, Dq]`` per call with
        ``mutable=["cache"]``. Steps past ``max_length`` have no slot: the cache is left as
        it is and their outputs (and weights) are NaN, so an overflow shows up in any
        finiteness check instead of silently overwriting the last position.
      return_weights: also return the weights ``[B..., N, T, S]`` (before dropout; dense path).
      segment_ids: packed documents, ``[B..., T]`` int (self attention) or a pair
        ``(q_ids, kv_ids)``: a query attends only keys of its own document (negative ids:
        padding); :func:`attnx.core.attention`'s ``segment_ids``, never a T×S array.
      positions: ``[B..., T]`` int positions of the tokens for ``rotary`` (default 0 … T − 1),
        e.g. restarting at every packed document (grain's packing emits them). RoPE scores
        depend only on offsets, so within a document they change nothing but the rounding.

    Returns:
      ``[B..., T, out_features]``, and the weights if ``return_weights``.
    """
    if inputs_kv is None:
      inputs_kv = inputs_q
    chex.assert_rank(inputs_q, inputs_kv.ndim)
    if inputs_q.ndim < 2:
      raise ValueError(f"inputs_q must be [B..., T, D], got shape {inputs_q.shape}.")
    chex.assert_equal_shape_prefix([inputs_q, inputs_kv], inputs_q.ndim - 2)
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    where = type(self).__name__
    _util.check_heads(qkv_features, self.num_heads, self.num_kv_heads, where)
    head_dim = qkv_features // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias)
    if self._is_metric:
      query, key = self._metric_features(inputs_q, inputs_kv, head_dim)
      score, score_params, scale = "neg_sq_dist", None, 1.0
    else:
      query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
      key = dense(features=(kv_heads, head_dim), name="key")(inputs_kv)
      if self.qk_norm:
        # Same names/config as flax's normalize_qk (ViT-22B, arXiv 2302.05442).
        ln = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype)
        query = ln(name="query_ln")(query)
        key = ln(name="key_ln")(key)
      score, score_params, scale = self.score, self._score_params(head_dim), self.scale
    value = dense(features=(kv_heads, head_dim), name="value")(inputs_kv)
    if self.rotary:
      query, key = self._rotate(query, key, decode, positions)
    elif positions is not None:
      raise ValueError(f"{where}: positions are read by rotary=True only (ALiBi and the masks "
                       "use offsets, the same in every document).")

    mask = _util.as_bool_mask(mask)
    is_causal = self.is_causal
    in_range = None
    step_position = (self.get_variable("cache", "cache_index") if self._decoding(decode)
                     else None)
    if decode:
      key, value, mask, is_causal, in_range = self._update_cache(query, key, value, mask,
                                                                 is_causal)
    need_weights = return_weights or self.sow_weights
    dropout = self.dropout_rate > 0.0 and not deterministic
    weighting_params = None
    if self.learn_ssmax_s:
      s = self.param("ssmax_s", nn.initializers.constant(_ssmax_init(self.weighting)),
                     (self.num_heads,), self.param_dtype)
      weighting_params = {"s": s}
    modifications = self._modifications(step_position)
    if sequence_shards(self.sequence_axis) is not None:
      if segment_ids is not None:
        raise ValueError(f"{where}: segment_ids with sequence_axis (ring attention): pass "
                         "them as a mask of attnx.core.masks to attnx.core.ring_attention.")
      if inputs_kv is not inputs_q or decode or return_weights:
        raise ValueError(f"{where}: with sequence_axis={self.sequence_axis!r} bound (sequence "
                         "sharded over devices) only self attention runs, without decode or "
                         "return_weights.")
      x = core.ring_attention(
          query, key, value, bias, mask, axis_name=self.sequence_axis,
          weighting=self.weighting, score=score, weighting_params=weighting_params,
          is_causal=is_causal, scale=scale, score_params=score_params,
          layout=self.sequence_layout,
          implementation=(None if _util.implementation_name(self.implementation) in (None, "dense")
                          else self.implementation),
          **modifications)  # the cap, ALiBi and the sinks (a window is refused when made)
      return self._project_out(x, features)
    x = core.attention(
        query, key, value, bias, mask, weighting=self.weighting, score=score,
        weighting_params=weighting_params,
        is_causal=is_causal, scale=scale, score_params=score_params,
        implementation=self.implementation, dropout_rate=self.dropout_rate,
        dropout_rng=self.make_rng("dropout") if dropout else None,
        deterministic=deterministic, broadcast_dropout=self.broadcast_dropout,
        return_weights=need_weights, segment_ids=segment_ids, **modifications)
    x, w = x if need_weights else (x, None)
    if self.sow_weights:
      self.sow("intermediates", "attention_weights", w)
    out = self._project_out(x, features)
    if in_range is not None:  # KV-cache overflow: NaN rather than a silently wrong value
      out = jnp.where(in_range, out, jnp.nan)
      w = None if w is None else jnp.where(in_range, w, jnp.nan)
    return (out, w) if return_weights else out

  def _modifications(self, step_position: Array | None) -> dict[str, Any]:
    """``core.attention``'s keywords for the window, the cap, ALiBi and the sinks (their
    parameters created here). A cached decoding step (``step_position``: the query's
    position) masks the window in the cache step instead, and ALiBi counts from there."""
    kw: dict[str, Any] = {}
    if self.sliding_window is not None and step_position is None:
      kw["local_window_size"] = self.sliding_window
    if self.logits_soft_cap is not None:
      kw["logits_soft_cap"] = self.logits_soft_cap
    if self.alibi or self.learn_alibi:
      slopes = core.alibi_slopes(self.num_heads)
      if self.learn_alibi:
        slopes = self.param("alibi_slopes", lambda *_: slopes, (self.num_heads,),
                            self.param_dtype)
      symmetric = not self.is_causal
      if step_position is None:
        kw["score_mod"] = core.alibi(slopes, symmetric=symmetric)
      else:  # the one query sits at the cache position, not at 0
        kw["score_mod"] = core.ScoreMod(fn=_alibi_from(step_position, symmetric),
                                        params=slopes)
    if self.sinks:
      kw["sinks"] = self.param("sinks", nn.initializers.zeros_init(), (self.num_heads,),
                               self.param_dtype)
    return kw

  def _decoding(self, decode: bool) -> bool:
    """Whether this call is a cached decoding step (not the call that sets the cache up)."""
    return decode and self.has_variable("cache", "cached_key")

  def _project_out(self, x: Array, features: int) -> Array:
    return nn.DenseGeneral(features=features, axis=(-2, -1), kernel_init=self.kernel_init,
                           bias_init=self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
                           param_dtype=self.param_dtype, name="out")(x)

  def _metric_features(self, inputs_q: Array, inputs_kv: Array,
                       head_dim: int) -> tuple[Array, Array]:
    """Queries and keys of ``score="metric"``: √τ_h L_h x, so −‖zq_i − zk_j‖² is the score.

    Folding the per-head τ into the features leaves a plain ``neg_sq_dist`` score, which every
    implementation (blocked included) runs.
    """
    if inputs_q.shape[-1] != inputs_kv.shape[-1]:
      raise ValueError(f"{type(self).__name__}: score='metric' compares queries and keys in one "
                       f"space: inputs_q {inputs_q.shape} and inputs_kv {inputs_kv.shape} need "
                       "equal features.")
    rank = self._score_width() or head_dim
    metric = nn.DenseGeneral(features=(self.num_heads, rank), use_bias=False, dtype=self.dtype,
                             param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                             name="metric")
    zq, zk = metric(inputs_q), metric(inputs_kv)  # [B..., T|S, N, R]
    # Default τ = 1/√R, the scaled-dot analogue.
    init_log_tau = (-0.5 * jnp.log(float(rank)) if self.scale is None
                    else jnp.log(float(self.scale)))
    if self.learn_temperature is None or self.learn_temperature:
      log_tau = self.param("log_temperature", nn.initializers.constant(init_log_tau),
                           (self.num_heads,), self.param_dtype)
    else:
      log_tau = jnp.full((self.num_heads,), init_log_tau)
    root = jnp.exp(0.5 * log_tau)[:, None].astype(zq.dtype)
    return zq * root, zk * root

  def _rotate(self, query: Array, key: Array, decode: bool,
              positions: Array | None = None) -> tuple[Array, Array]:
    """RoPE on queries and keys; positions start at the cache index when decoding, or are
    the ``positions`` given ([B..., T], self attention)."""
    start = 0
    if decode and self.has_variable("cache", "cache_index"):
      start = self.get_variable("cache", "cache_index")
    q_pos = start + jnp.arange(query.shape[-3])
    k_pos = start + jnp.arange(key.shape[-3])
    if positions is not None:
      positions = jnp.asarray(positions)
      if (positions.shape != query.shape[:-2] or query.shape[-3] != key.shape[-3]
          or not jnp.issubdtype(positions.dtype, jnp.integer)):
        raise ValueError(f"{type(self).__name__}: positions must be int [B..., T] = "
                         f"{query.shape[:-2]} of self attention, got {positions.shape} "
                         f"{positions.dtype}.")
      q_pos = k_pos = positions
    if sequence_shards(self.sequence_axis) is not None:  # global positions here
      q_pos = k_pos = shard_positions(query.shape[-3], self.sequence_axis,
                                      self.sequence_layout)
    return (rotary_lib.apply_rotary(query, q_pos, self.rotary_base),
            rotary_lib.apply_rotary(key, k_pos, self.rotary_base))

  def _update_cache(self, query, key, value, mask, is_causal):
    """Linen-MHA-style KV cache: write this step's k/v, mask positions not yet generated.

    Returns key, value, mask, is_causal and ``in_range`` (None at init, else a traced bool:
    whether this step had a cache slot).
    """
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:  # init call with the full-length input: plain forward pass
      return key, value, mask, is_causal, None
    *batch, max_length, kv_heads, head_dim = cached_key.value.shape
    if query.shape[-3] != 1 or tuple(key.shape) != (*batch, 1, kv_heads, head_dim):
      raise ValueError(f"decode=True feeds one position at a time: expected key shape "
                       f"{(*batch, 1, kv_heads, head_dim)} for the cache "
                       f"{cached_key.value.shape}, got query {query.shape}, key {key.shape}.")
    i = cache_index.value
    # dynamic_update_slice would clamp an index ≥ max_length onto the last slot: past the end,
    # rewrite that slot with its own value (the cache is unchanged) and flag the step.
    in_range = i < max_length
    zero = jnp.zeros((), i.dtype)
    idx = (zero,) * len(batch) + (i, zero, zero)
    new = []
    for cache, x in ((cached_key, key), (cached_value, value)):
      old = jax.lax.dynamic_slice(cache.value, idx, x.shape)  # a [B..., 1, K, H] slice
      cache.value = jax.lax.dynamic_update_slice(cache.value, jnp.where(in_range, x, old), idx)
      new.append(cache.value)
    cache_index.value = i + 1
    # The single query at position i sees cached positions ≤ i (this replaces is_causal), and
    # under a sliding window only the last `left` before it.
    seen = jnp.arange(max_length) <= i
    if self.sliding_window is not None:
      left = (self.sliding_window if isinstance(self.sliding_window, int)
              else self.sliding_window[0])
      seen = seen & (jnp.arange(max_length) >= i - left)
    step = jnp.broadcast_to(seen, (*batch, 1, 1, max_length))
    mask = step if mask is None else jnp.logical_and(mask, step)
    return *new, mask, False, in_range


def _alibi_from(offset: Array, symmetric: bool):
  """ALiBi's score_mod for queries whose positions start at ``offset`` (a decoding step)."""
  def fn(score, b, h, q_idx, kv_idx, slopes):
    del b
    d = (q_idx + offset - kv_idx).astype(score.dtype)
    return score - slopes[h].astype(score.dtype) * (jnp.abs(d) if symmetric else d)
  return fn


def _check_modifications(module: Any, where: str) -> None:
  """The window, cap, ALiBi and sinks fields of an attention module, checked when it is made."""
  w = module.sliding_window
  if w is not None:
    pair = (w, w) if isinstance(w, int) else tuple(w) if isinstance(w, tuple | list) else None
    if (pair is None or len(pair) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in pair)):
      raise ValueError(f"{where}: sliding_window must be an int >= 0 or a pair (left, right) "
                       f"of them, got {w!r}.")
    object.__setattr__(module, "sliding_window", w if isinstance(w, int) else pair)
  if module.logits_soft_cap is not None:
    core.soft_cap(module.logits_soft_cap)  # the ValueError of a cap that is not positive
  if module.sinks:
    reason = problem_lib.sinks_reason(core.get_weighting(module.weighting))
    if reason is not None:
      raise ValueError(f"{where}: sinks=True: {reason}")
  if module.alibi and module.learn_alibi:
    raise ValueError(f"{where}: set alibi=True (fixed slopes) or learn_alibi=True (learned), "
                     "not both.")
  if module.sliding_window is not None and module.sequence_axis is not None:
    raise ValueError(f"{where}: sliding_window with sequence_axis (ring attention): "
                     "attnx.core.ring_attention takes a window as a structured mask "
                     "(attnx.core.masks.sliding_window), not as a module field yet; use "
                     "sequence_axis=None.")


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


def _check_sequence_axis(module: Any, where: str) -> None:
  if module.sequence_layout not in ring_lib.LAYOUTS:
    raise ValueError(f"{where}: sequence_layout must be one of {', '.join(ring_lib.LAYOUTS)}, "
                     f"got {module.sequence_layout!r}.")
  if module.sequence_axis is None:
    return
  if module.dropout_rate > 0 or module.sow_weights:
    raise ValueError(f"{where}: sequence_axis={module.sequence_axis!r} (ring attention) never "
                     "forms the attention weights: attention dropout and sow_weights need "
                     "sequence_axis=None.")
  check_ring_attention(module.weighting, module.score, module.sequence_layout,
                       f"{where}: sequence_axis={module.sequence_axis!r}")


def check_ring_attention(weighting: Any, score: Any, layout: str, where: str) -> None:
  """ValueError (prefixed by `where`) when this weighting and score cannot run as ring
  attention in `layout` (``score="metric"`` is a plain ``neg_sq_dist`` on learned features)."""
  score = "neg_sq_dist" if _util.score_name(score) == "metric" else score
  try:
    ring_lib.check_supported(weighting, score, layout)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
