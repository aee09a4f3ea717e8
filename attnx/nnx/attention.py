"""Multi-head attention with a pluggable score s and weighting F, in Flax NNX.

:class:`MultiHeadAttention` is a drop-in for ``flax.nnx.MultiHeadAttention``: the same
constructor and call arguments where they overlap, the same submodules and parameter names
(``query``/``key``/``value`` ``LinearGeneral`` with features ``(heads, head_dim)``, ``out``
over ``(heads, head_dim)``, ``query_ln``/``key_ln`` with ``normalize_qk``), the same KV cache
(``init_cache``, ``cached_key``/``cached_value``/``cache_index``) and the same dropout RNG use,
so with ``weighting="softmax"`` it computes what Flax's module computes from the same
parameters. Every attnx option of :class:`attnx.nn.MultiHeadAttention` is here too, with the
linen module's parameter names (``score_<name>``, ``ssmax_s``, ``alibi_slopes``, ``sinks``,
``metric``, ``log_temperature``); both modules run the same functions
(:mod:`attnx.nn.attention_ops`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from attnx import core
from attnx.nn import _util
from attnx.nn import attention as linen_attention
from attnx.nn import attention_ops as ops
from attnx.nn import rotary as rotary_lib

Array = jax.Array
# The options of the NNX module: the linen module's fields (declared once, there).
AttentionOptions = _util.options_dataclass(linen_attention.MultiHeadAttention,
                                           "AttentionOptions")
default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


class MultiHeadAttention(nnx.Module):
  """Multi-head attention, ``w_ij = F(s(q_i, k_j)) / Σ_l F(s(q_i, k_l))`` per head, in NNX.

  The arguments are Flax's (``flax.nnx.MultiHeadAttention``) and attnx's: ``weighting``,
  ``score``, ``score_dim``, ``scale``, ``learn_temperature``, ``learn_ssmax_s``,
  ``implementation``, ``is_causal`` (here the default of the call's ``is_causal``), ``rotary``,
  ``rotary_base``, ``sequence_axis``, ``sequence_layout``, ``sliding_window``,
  ``logits_soft_cap``, ``sinks``, ``alibi``, ``learn_alibi``, as
  :class:`attnx.nn.MultiHeadAttention` documents them. The options are kept in
  :attr:`options` (:data:`AttentionOptions`).

  Args:
    num_heads: query heads N.
    in_features: features of ``inputs_q``.
    qkv_features: total q/k/v width (default ``in_features``); divisible by N.
    out_features: output width (default ``in_features``).
    num_kv_heads: key/value heads K for grouped-query attention (default N); N % K == 0.
    in_kv_features: features of the key/value inputs (default ``in_features``).
    dtype: the computation dtype, as in Flax (``param_dtype``, ``precision`` for the
      projections, ``kernel_init``, ``out_kernel_init``, ``bias_init``, ``out_bias_init`` and
      ``use_bias`` too).
    broadcast_dropout: share the dropout mask across batch and heads.
    dropout_rate: dropout on the attention weights (Flax's formula and RNG use).
    deterministic: default of the call's ``deterministic`` (needed only with dropout).
    decode: default of the call's ``decode`` (False: no KV cache).
    normalize_qk: LayerNorm (no bias) on projected queries and keys (``query_ln``, ``key_ln``).
    rngs: ``nnx.Rngs``: ``params`` for the initializers, ``dropout`` (kept when
      ``keep_rngs`` and ``dropout_rate > 0``, as Flax keeps it).
    keep_rngs: keep the dropout stream on the module (Flax's option).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> mha = anx.MultiHeadAttention(num_heads=4, in_features=32, weighting="relu",
    ...                              is_causal=True, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 10, 32))  # [B, T, D]
    >>> mha.query.kernel.shape  # [D, N, H], as Flax's
    (32, 4, 8)
    >>> y, w = mha(x, return_weights=True)
    >>> y.shape, w.shape  # [B, T, D] and [B, N, T, S]
    ((2, 10, 32), (2, 4, 10, 10))
    >>> bool((w[..., 0, 1:] == 0).all())  # causal: the first query sees only key 0
    True
  """

  def __init__(
      self, num_heads: int, in_features: int, qkv_features: int | None = None,
      out_features: int | None = None, num_kv_heads: int | None = None,
      in_kv_features: int | None = None, *,
      weighting: Any = "softmax", score: Any = "scaled_dot", score_dim: int | None = None,
      scale: float | None = None, learn_temperature: bool | None = None,
      learn_ssmax_s: bool = False, implementation: str | core.Implementation | None = None,
      is_causal: bool = False, rotary: bool = False,
      rotary_base: float = rotary_lib.DEFAULT_BASE, sequence_axis: str | None = None,
      sequence_layout: str = "contiguous",
      sliding_window: int | tuple[int, int] | None = None,
      logits_soft_cap: float | None = None, sinks: bool = False, alibi: bool = False,
      learn_alibi: bool = False,
      dtype: Any = None, param_dtype: Any = jnp.float32, broadcast_dropout: bool = True,
      dropout_rate: float = 0.0, deterministic: bool | None = None, precision: Any = None,
      kernel_init: Any = default_kernel_init, out_kernel_init: Any = None,
      bias_init: Any = default_bias_init, out_bias_init: Any = None,
      use_bias: bool = True, decode: bool = False, normalize_qk: bool = False,
      rngs: nnx.Rngs, keep_rngs: bool = True):
    where = type(self).__name__
    self.options = AttentionOptions(
        num_heads=num_heads, qkv_features=qkv_features or in_features,
        num_kv_heads=num_kv_heads, weighting=weighting, score=score, score_dim=score_dim,
        scale=scale, learn_temperature=learn_temperature, learn_ssmax_s=learn_ssmax_s,
        implementation=implementation, is_causal=is_causal, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, qk_norm=normalize_qk, rotary=rotary,
        rotary_base=rotary_base, sequence_axis=sequence_axis, sequence_layout=sequence_layout,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        alibi=alibi, learn_alibi=learn_alibi)
    ops.check_options(self.options, where)
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = qkv_features or in_features
    self.out_features = out_features or in_features
    self.in_kv_features = in_kv_features or in_features
    self.num_kv_heads = num_kv_heads or num_heads
    self.head_dim = self.qkv_features // num_heads
    self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
    self.broadcast_dropout, self.dropout_rate = broadcast_dropout, dropout_rate
    self.deterministic, self.decode = deterministic, decode
    self.use_bias, self.normalize_qk = use_bias, normalize_qk

    linear = functools.partial(
        nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, precision=precision, rngs=rngs)
    n, k, h = num_heads, self.num_kv_heads, self.head_dim
    # Flax's creation order (query, key, value, the norms, out), so that the same Rngs give
    # Flax's parameters; attnx's own parameters come after.
    if ops.is_metric(score):
      rank = score_dim or h
      self.metric = linear(in_features, (n, rank), use_bias=False)
      self.rank = rank
    else:
      self.query = linear(in_features, (n, h))
      self.key = linear(self.in_kv_features, (k, h))
    self.value = linear(self.in_kv_features, (k, h))
    if normalize_qk:
      ln = functools.partial(nnx.LayerNorm, h, use_bias=False, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
      self.query_ln, self.key_ln = ln(), ln()
    else:
      self.query_ln = self.key_ln = nnx.data(None)
    self.out = nnx.LinearGeneral(
        (n, h), self.out_features, axis=(-2, -1), kernel_init=out_kernel_init or kernel_init,
        bias_init=out_bias_init or bias_init, use_bias=use_bias, dtype=dtype,
        param_dtype=param_dtype, precision=precision, rngs=rngs)
    for name, init, shape in ops.score_param_shapes(score, n, h, score_dim):
      setattr(self, f"score_{name}", nnx.Param(init(rngs.params(), shape, param_dtype)))
    if ops.is_metric(score):
      log_tau = jnp.full((n,), ops.metric_log_temperature_init(scale, self.rank), param_dtype)
      learned = learn_temperature is None or learn_temperature
      self.log_temperature = nnx.Param(log_tau) if learned else None
    if learn_ssmax_s:
      self.ssmax_s = nnx.Param(jnp.full((n,), ops.ssmax_init(weighting), param_dtype))
    if learn_alibi:
      self.alibi_slopes = nnx.Param(core.alibi_slopes(n).astype(param_dtype))
    if sinks:
      self.sinks = nnx.Param(jnp.zeros((n,), param_dtype))
    self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None
    # Data attributes that hold a Cache after init_cache (Flax's declaration of them).
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)
    # A paged cache instead (init_cache(..., page_size=P)).
    self.k_pages: nnx.Cache | None = nnx.data(None)
    self.v_pages: nnx.Cache | None = nnx.data(None)
    self.page_table: nnx.Cache | None = nnx.data(None)

  def __call__(self, inputs_q: Array, inputs_k: Array | None = None,
               inputs_v: Array | None = None, *, mask: Array | None = None,
               deterministic: bool | None = None, rngs: nnx.Rngs | nnx.RngStream | None = None,
               sow_weights: bool = False, decode: bool | None = None,
               is_causal: bool | None = None, bias: Array | None = None,
               segment_ids: Any = None, positions: Array | None = None,
               return_weights: bool = False) -> Array | tuple[Array, Array]:
    """Self attention (``inputs_k=None``) or cross attention, Flax's call plus attnx's.

    Args:
      inputs_q: ``[B..., T, in_features]``.
      inputs_k: ``[B..., S, in_kv_features]`` (default ``inputs_q``).
      inputs_v: ``[B..., S, in_kv_features]`` (default ``inputs_k``).
      mask: boolean (or 0/1) mask broadcastable to ``[B..., N, T, S]``; True = attend.
      deterministic: disables attention dropout (default: the module's).
      rngs: the dropout stream (default: the module's; Flax's rule).
      sow_weights: sow the weights [B..., N, T, S] as ``nnx.Intermediate``
        ``attention_weights`` (dense implementation only); read them with
        ``nnx.capture(module, nnx.Intermediate)`` (Flax deprecates sowing outside it).
      decode: one token per call with the KV cache set up by :meth:`init_cache` (default:
        the module's). Steps past the cache's end leave it as it is and return NaN.
      is_causal: query i attends keys j ≤ i (default: the module's ``is_causal``).
      bias: additive score bias broadcastable to ``[B..., N, T, S]``.
      segment_ids: packed documents, ``[B..., T]`` int or a pair ``(q_ids, kv_ids)``
        (:func:`attnx.core.attention`'s).
      positions: ``[B..., T]`` int token positions for ``rotary`` (default 0 … T − 1).
      return_weights: also return the weights ``[B..., N, T, S]`` (dense implementation).

    Returns:
      ``[B..., T, out_features]``, and the weights if ``return_weights``.
    """
    opts, where = self.options, type(self).__name__
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError(f"{where}: inputs_k cannot be None if inputs_v is not None; to use "
                         "one array for both, pass it as inputs_k.")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"{where}: inputs_q has {inputs_q.shape[-1]} features, the module "
                       f"expects in_features={self.in_features}.")
    ops.check_inputs(inputs_q, inputs_k)
    ops.check_inputs(inputs_q, inputs_v)
    need_weights = return_weights or sow_weights
    ops.check_weights_formed(opts, sow_weights, where)
    if ops.is_metric(opts.score):
      ops.check_metric_inputs(inputs_q, inputs_k, where)
      log_tau = (self.log_temperature[...] if self.log_temperature is not None else
                 jnp.full((self.num_heads,), ops.metric_log_temperature_init(opts.scale,
                                                                            self.rank)))
      query, key = ops.metric_features(self.metric(inputs_q), self.metric(inputs_k), log_tau)
      score, score_params, scale = "neg_sq_dist", None, 1.0
    else:
      query, key = self.query(inputs_q), self.key(inputs_k)
      if self.query_ln is not None:
        query, key = self.query_ln(query), self.key_ln(key)
      score_params = {name: getattr(self, f"score_{name}")[...] for name, _, _ in
                      ops.score_param_shapes(opts.score, self.num_heads, self.head_dim,
                                             opts.score_dim)} or None
      score, scale = opts.score, opts.scale
    value = self.value(inputs_v)

    decode = self.decode if decode is None else decode
    if decode and self.cached_key is None and self.k_pages is None:
      raise ValueError(f"{where}: decode=True needs the KV cache: call init_cache(shape) "
                       "first (shape [B..., max_length, in_features]).")
    step_position = self.cache_index[...] if decode else None
    if opts.rotary:
      query, key = ops.rotate(opts, query, key, 0 if step_position is None else step_position,
                              positions, where)
    elif positions is not None:
      raise ops.positions_unused(where)
    causal = opts.is_causal if is_causal is None else bool(is_causal)
    mask = _util.as_bool_mask(mask)
    in_range, attend_causal = None, causal
    if decode and self.k_pages is not None:
      (self.k_pages[...], self.v_pages[...], self.cache_index[...], key, value, mask,
       in_range) = ops.paged_cache_step(self.k_pages[...], self.v_pages[...],
                                        self.page_table[...], step_position, query, key, value,
                                        mask, opts.sliding_window)
      attend_causal = False
    elif decode:
      (self.cached_key[...], self.cached_value[...], self.cache_index[...], mask,
       in_range) = ops.cache_step(self.cached_key[...], self.cached_value[...], step_position,
                                  query, key, value, mask, opts.sliding_window)
      key, value, attend_causal = self.cached_key[...], self.cached_value[...], False
    dropout_rng = self._dropout_rng(deterministic, rngs)
    weighting_params = {"s": self.ssmax_s[...]} if opts.learn_ssmax_s else None
    slopes = (self.alibi_slopes[...] if opts.learn_alibi
              else core.alibi_slopes(self.num_heads) if opts.alibi else None)
    mods = ops.modifications(opts, step_position, slopes,
                             self.sinks[...] if opts.sinks else None, causal=causal)
    x, w = ops.attend(
        opts, query, key, value, bias=bias, mask=mask, is_causal=attend_causal, score=score,
        score_params=score_params, scale=scale, weighting_params=weighting_params, mods=mods,
        dropout_rng=dropout_rng, deterministic=dropout_rng is None,
        need_weights=need_weights, segment_ids=segment_ids,
        self_attention=inputs_k is inputs_q and inputs_v is inputs_q, decode=decode,
        where=where)
    if sow_weights:
      self.sow(nnx.Intermediate, "attention_weights", w)
    out, w = ops.overflow_to_nan(in_range, self.out(x), w)
    return (out, w) if return_weights else out

  def _dropout_rng(self, deterministic: bool | None,
                   rngs: nnx.Rngs | nnx.RngStream | None) -> Array | None:
    """The dropout key of this call (Flax's rule), None when no dropout runs."""
    if self.dropout_rate == 0:
      return None
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError(f"{type(self).__name__}: dropout_rate > 0 needs deterministic, as a call "
                       "argument or a constructor argument.")
    if deterministic:
      return None
    stream = self.rngs if rngs is None else rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
    if stream is None:
      raise ValueError(f"{type(self).__name__}: dropout needs rngs: pass rngs= to the call "
                       "(the module was made with keep_rngs=False).")
    return stream()

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32,
                 page_size: int | None = None) -> None:
    """Sets up the KV cache for decoding (Flax's method): ``input_shape`` is
    ``[B..., max_length, in_features]``; the cache holds ``[B..., max_length, K, H]``. With
    ``page_size``, a paged cache instead (:func:`attnx.core.paged_attention`'s layout:
    ``k_pages``/``v_pages`` [B·P, page_size, K, H], ``page_table`` [B, P], one batch dim);
    the outputs are the same."""
    cache_shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
    if page_size is not None:
      paged = ops.paged_cache_init(cache_shape, page_size, dtype)
      self.cached_key = self.cached_value = None
      self.k_pages, self.v_pages = nnx.Cache(paged["k_pages"]), nnx.Cache(paged["v_pages"])
      self.page_table = nnx.Cache(paged["page_table"])
      self.cache_index = nnx.Cache(paged["cache_index"])
      return
    self.k_pages = self.v_pages = self.page_table = None
    self.cached_key = nnx.Cache(jnp.zeros(cache_shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(cache_shape, dtype))
    self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))
