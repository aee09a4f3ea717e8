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

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx import core
from attnx.nn import _util
from attnx.nn import attention_ops as ops
from attnx.nn import rotary as rotary_lib

Array = jax.Array


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
    cache_page_size: with ``decode=True``, keep the KV cache in pages of this many positions
      (:func:`attnx.core.paged_attention`'s layout: a pool ``k_pages``/``v_pages``
      [B·P, page_size, K, H], a ``page_table`` [B, P] and ``cache_index``) instead of one
      [B, max_length, K, H] array; None (default): the contiguous cache. One batch dim. It
      holds whole pages, P = ⌈max_length / page_size⌉ of them: steps past P·page_size are
      NaN (the contiguous cache's end is max_length).
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
  cache_page_size: int | None = None
  logits_soft_cap: float | None = None
  sinks: bool = False
  alibi: bool = False
  learn_alibi: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.linear.default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()

  def __post_init__(self):
    ops.check_options(self, type(self).__name__, sow_weights=self.sow_weights)
    super().__post_init__()

  @property
  def _is_metric(self) -> bool:
    return ops.is_metric(self.score)

  def _score_width(self) -> int | None:
    """``score_dim`` (:class:`~attnx.nn.MetricAttention` also calls it ``rank``)."""
    return self.score_dim

  def _score_params(self, head_dim: int) -> dict[str, Array] | None:
    """The learned parameters the score declares (:class:`attnx.core.scores.LearnedParam`),
    ``score_<name>`` each; None for a score without any (a user callable included)."""
    shapes = ops.score_param_shapes(self.score, self.num_heads, head_dim, self._score_width())
    return {name: self.param(f"score_{name}", init, shape, self.param_dtype)
            for name, init, shape in shapes} or None

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
    ops.check_inputs(inputs_q, inputs_kv)
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
    decoding = decode and self._cache_ready()  # not the call that sets up
    step_position = self.get_variable("cache", "cache_index") if decoding else None
    if self.rotary:
      query, key = ops.rotate(self, query, key, 0 if step_position is None else step_position,
                              positions, where)
    elif positions is not None:
      raise ops.positions_unused(where)

    mask = _util.as_bool_mask(mask)
    is_causal = self.is_causal
    in_range = None
    if decode:
      key, value, mask, is_causal, in_range = self._update_cache(query, key, value, mask,
                                                                 is_causal)
    need_weights = return_weights or self.sow_weights
    dropout = self.dropout_rate > 0.0 and not deterministic
    weighting_params = None
    if self.learn_ssmax_s:
      s = self.param("ssmax_s", nn.initializers.constant(ops.ssmax_init(self.weighting)),
                     (self.num_heads,), self.param_dtype)
      weighting_params = {"s": s}
    mods = ops.modifications(self, step_position, *self._modification_params())
    x, w = ops.attend(
        self, query, key, value, bias=bias, mask=mask, is_causal=is_causal, score=score,
        score_params=score_params, scale=scale, weighting_params=weighting_params, mods=mods,
        dropout_rng=self.make_rng("dropout") if dropout else None,
        deterministic=deterministic, need_weights=need_weights, segment_ids=segment_ids,
        self_attention=inputs_kv is inputs_q, decode=decode, where=where)
    if self.sow_weights:
      self.sow("intermediates", "attention_weights", w)
    out, w = ops.overflow_to_nan(in_range, self._project_out(x, features), w)
    return (out, w) if return_weights else out

  def _modification_params(self) -> tuple[Array | None, Array | None]:
    """(ALiBi's slopes, the sinks): parameters where learned, None where not used."""
    slopes = sinks = None
    if self.alibi or self.learn_alibi:
      slopes = core.alibi_slopes(self.num_heads)
      if self.learn_alibi:
        slopes = self.param("alibi_slopes", lambda *_: slopes, (self.num_heads,),
                            self.param_dtype)
    if self.sinks:
      sinks = self.param("sinks", nn.initializers.zeros_init(), (self.num_heads,),
                         self.param_dtype)
    return slopes, sinks

  def _project_out(self, x: Array, features: int) -> Array:
    return nn.DenseGeneral(features=features, axis=(-2, -1), kernel_init=self.kernel_init,
                           bias_init=self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
                           param_dtype=self.param_dtype, name="out")(x)

  def _metric_features(self, inputs_q: Array, inputs_kv: Array,
                       head_dim: int) -> tuple[Array, Array]:
    """Queries and keys of ``score="metric"`` (:func:`attention_ops.metric_features`)."""
    ops.check_metric_inputs(inputs_q, inputs_kv, type(self).__name__)
    rank = self._score_width() or head_dim
    metric = nn.DenseGeneral(features=(self.num_heads, rank), use_bias=False, dtype=self.dtype,
                             param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                             name="metric")
    zq, zk = metric(inputs_q), metric(inputs_kv)  # [B..., T|S, N, R]
    init_log_tau = ops.metric_log_temperature_init(self.scale, rank)
    if self.learn_temperature is None or self.learn_temperature:
      log_tau = self.param("log_temperature", nn.initializers.constant(init_log_tau),
                           (self.num_heads,), self.param_dtype)
    else:
      log_tau = jnp.full((self.num_heads,), init_log_tau)
    return ops.metric_features(zq, zk, log_tau)

  def _cache_ready(self) -> bool:
    return (self.has_variable("cache", "cached_key")
            or self.has_variable("cache", "k_pages"))

  def _update_cache(self, query, key, value, mask, is_causal):
    """Linen-MHA-style KV cache (:func:`attention_ops.cache_step`): write this step's k/v,
    mask positions not yet generated; with ``cache_page_size``, a paged cache
    (:func:`attention_ops.paged_cache_step`).

    Returns key, value, mask, is_causal and ``in_range`` (None at init, else a traced bool:
    whether this step had a cache slot).
    """
    if self.cache_page_size is not None:
      return self._update_paged_cache(query, key, value, mask, is_causal)
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:  # init call with the full-length input: plain forward pass
      return key, value, mask, is_causal, None
    cached_key.value, cached_value.value, cache_index.value, mask, in_range = ops.cache_step(
        cached_key.value, cached_value.value, cache_index.value, query, key, value, mask,
        self.sliding_window)
    return cached_key.value, cached_value.value, mask, False, in_range

  def _update_paged_cache(self, query, key, value, mask, is_causal):
    initialized = self.has_variable("cache", "k_pages")
    empty = ops.paged_cache_init(key.shape, self.cache_page_size, key.dtype)
    cache = {name: self.variable("cache", name, lambda x=x: x) for name, x in empty.items()}
    if not initialized:  # init call with the full-length input: plain forward pass
      return key, value, mask, is_causal, None
    (cache["k_pages"].value, cache["v_pages"].value, cache["cache_index"].value, key, value,
     mask, in_range) = ops.paged_cache_step(
        cache["k_pages"].value, cache["v_pages"].value, cache["page_table"].value,
        cache["cache_index"].value, query, key, value, mask, self.sliding_window)
    return key, value, mask, False, in_range
