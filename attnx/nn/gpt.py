"""A decoder-only GPT language model with any attention, and sampling from it.

``GPT`` (Radford et al. 2018/2019): token embedding (+ learned absolute position embedding, or
rotary embeddings inside every attention), ``num_layers`` pre-LN blocks with causal
self-attention (:class:`attnx.nn.EncoderBlock` with ``is_causal=True``, so the attention is
any ``attention`` spec: a weighting and score by name, linear attention, metric attention...),
a final LayerNorm, and logits ``[B, T, vocab_size]`` from the transposed token embedding
(``tie_embeddings=True``) or a separate ``lm_head``. Called as ``GPT(...)(tokens,
deterministic=...)`` with the ``"dropout"`` RNG, which is how :func:`attnx.train.fit` calls a
model (``inputs`` [B, T] int32 -> logits; targets are the next tokens).

Positions:

* ``"learned"``: a learned ``pos_embedding [max_len, D]`` added to the token embedding
  (GPT-2). Sequences longer than ``max_len`` raise a ValueError at trace time.
* ``"rotary"``: RoPE (:mod:`attnx.nn.rotary`) on the queries and keys of every attention
  layer (``MultiHeadAttention(rotary=True)``); nothing is learned per position, so any length
  works (``max_len`` is then only the training context, recorded for reference). Needs query
  and key projections: attention types ``"dot"`` and ``"metric"``; ``"linear"`` and
  ``"additive"`` raise.
* ``"alibi"``: ALiBi (Press et al., "Train Short, Test Long") in every attention layer
  (``MultiHeadAttention(alibi=True)``: −m_h·(i − j) added to the scores, for every F); any
  length works. Attention types ``"dot"`` and ``"metric"``.
* ``"none"``: no position information but the causal mask (the stick-breaking paper's
  setting: its weights already depend on order).

Packed documents: ``GPT(...)(tokens, segment_ids=ids, positions=pos)`` attends within each
document only (``segment_ids [B, T]``, negative ids padding) and restarts the positions
(learned or rotary) at each document; grain's packing emits both.

Generation (:func:`generate`): with attention types ``"dot"`` and ``"metric"``
(:class:`~attnx.nn.MultiHeadAttention`, every weighting and score and implementation) a KV
cache (``decode=True``, the ``"cache"`` collection) makes each new token one step of O(T)
work. Linear attention (``linear_elu``, ``linear_favor``) and ``additive`` keep no KV cache
in attnx: for them — and for learned positions when the prompt plus the new tokens exceed
``max_len`` — :func:`generate` falls back to recomputing the forward pass over the last
``window`` tokens at every step (the whole prefix for rotary, the last ``max_len`` tokens for
learned positions, as nanoGPT crops its context). Both paths give the same tokens.

Model files for ``sample.py``: :func:`save_model_spec` writes the constructor kwargs and the
vocabulary as JSON, :func:`load_model_spec` reads them back and :func:`gpt_from_spec` builds
the model.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnx.nn import gpt_ops
from attnx.nn.attention_ops import sequence_shards
from attnx.nn.gpt_ops import POSITIONS
from attnx.nn.rotary import DEFAULT_BASE, apply_rotary, rotary_angles
from attnx.nn.spec import freeze_attention_fields, resolve_attention
from attnx.nn.transformer import EncoderBlock

Array = jax.Array


__all__ = ["GPT", "POSITIONS", "apply_rotary", "generate", "gpt_from_spec", "load_model_spec",
           "model_kwargs", "rotary_angles", "save_model_spec", "supports_kv_cache"]


class GPT(nn.Module, kw_only=True):
  """Decoder-only transformer LM: ``tokens [B, T] int -> logits [B, T, vocab_size]``.

  Attributes:
    vocab_size: number of token ids.
    num_layers, num_heads, hidden_dim, mlp_dim: depth, heads, model width D, MLP width.
    max_len: longest sequence for ``positions="learned"`` (the size of ``pos_embedding``);
      for ``"rotary"`` only a record of the training context.
    attention: an attention spec or variant name (``"softmax"``, ``"relu"``,
      ``"sigmoid"``, ``"linear_elu"``, ``"metric"``, ``{"weighting": "entmax:alpha=1.5"}``,
      ...; see :func:`attnx.nn.attention_spec`). None = softmax.
    tie_embeddings: logits from the transposed token embedding (one shared parameter
      ``embed/embedding``); else a separate ``lm_head`` Dense without bias.
    positions: ``"learned"`` | ``"rotary"`` | ``"alibi"`` | ``"none"`` (module docstring).
    rotary_base: RoPE frequency base.
    sliding_window: local attention: an int w (each token attends itself and the w before
      it), the same for every layer, or a sequence of ``num_layers`` entries, each an int or
      None (a global layer) — Gemma's local/global layers. Types ``"dot"``/``"metric"``.
    logits_soft_cap: c > 0: every attention score becomes c·tanh(s/c) (Gemma 2).
    sinks: a learned attention sink per head in every layer (gpt-oss).
    dropout_rate: dropout on the embeddings and the residual branches.
    attention_dropout_rate: dropout on the attention weights (dense implementation only).
    implementation: the attention implementation (``None``, ``"dense"``, ``"blocked"``,
      ``"pallas"``) for types ``"dot"``/``"metric"``; overrides the spec's.
    sequence_axis: context parallelism (types ``"dot"``/``"metric"``): the mesh axis the
      sequence is sharded over. Inside a shard_map binding it (``attnx.train`` with
      ``sequence_parallel``), every attention is ring attention and positions (learned or
      rotary) are the global positions of the local tokens; elsewhere the model runs on the
      whole sequence it is given. See :class:`~attnx.nn.MultiHeadAttention`.
    sequence_layout: ``"contiguous"`` or ``"zigzag"`` (the causal load balance).
    cache_page_size: ``decode=True`` keeps each layer's KV cache in pages of this many
      positions (:class:`~attnx.nn.MultiHeadAttention`'s ``cache_page_size``); None: one
      contiguous array. :func:`generate` sets it from its own ``cache_page_size``.
    dtype, param_dtype: as in flax.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from attnx import nn
    >>> model = nn.GPT(vocab_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
    ...                max_len=8, attention="relu")
    >>> tokens = jnp.arange(16).reshape(2, 8)  # [B, T]
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> model.apply({"params": params}, tokens).shape  # [B, T, vocab_size]
    (2, 8, 16)
    >>> nn.generate(model, params, tokens[:, :3], 4, rng=jax.random.key(1)).shape
    (2, 7)
  """

  vocab_size: int
  num_layers: int
  num_heads: int
  hidden_dim: int
  mlp_dim: int
  max_len: int
  attention: Mapping[str, Any] | str | None = None
  tie_embeddings: bool = True
  positions: str = "learned"
  rotary_base: float = DEFAULT_BASE
  sliding_window: int | Sequence[int | None] | None = None
  logits_soft_cap: float | None = None
  sinks: bool = False
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  implementation: str | None = None
  sequence_axis: str | None = None
  sequence_layout: str = "contiguous"
  cache_page_size: int | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    gpt_ops.check_gpt(self, type(self).__name__)
    freeze_attention_fields(self, "attention")
    super().__post_init__()

  def layer_windows(self) -> tuple[int | None, ...]:
    """The sliding window of each layer (None: global attention)."""
    return gpt_ops.layer_windows(self, type(self).__name__)

  def block_attention(self, layer: int = 0) -> dict[str, Any]:
    """The attention spec block ``layer`` gets: ``attention`` + positions + window, cap,
    sinks + ``implementation``."""
    return gpt_ops.block_attention(self, layer)

  @property
  def supports_kv_cache(self) -> bool:
    """Whether ``decode=True`` works (attention types ``"dot"`` and ``"metric"``)."""
    return gpt_ops.supports_kv_cache(self)

  @nn.compact
  def __call__(self, tokens: Array, *, deterministic: bool = True,
               decode: bool = False, segment_ids: Array | None = None,
               positions: Array | None = None) -> Array:
    """Logits ``[B, T, vocab_size]`` of the next token at every position.

    Args:
      tokens: ``[B, T]`` integer ids.
      deterministic: disables dropout (the ``"dropout"`` RNG is needed otherwise).
      decode: KV-cache decoding (see :func:`generate`): initialize the ``"cache"`` collection
        with a call on the full-length input, then feed ``[B, 1]`` tokens with
        ``mutable=["cache"]``.
      segment_ids: ``[B, T]`` int: packed documents, each token attends only the tokens of
        its own document (negative ids: padding, attending nothing).
      positions: ``[B, T]`` int positions (restarting per document) for learned and rotary
        positions; default 0 … T − 1.
    """
    shards = sequence_shards(self.sequence_axis)
    positions = gpt_ops.check_call(self, tokens, positions, segment_ids, decode, shards)
    embed = nn.Embed(self.vocab_size, self.hidden_dim, embedding_init=nn.initializers.normal(
        0.02), dtype=self.dtype, param_dtype=self.param_dtype, name="embed")
    x = embed(tokens.astype(jnp.int32))
    if self.positions == "learned":
      start = None
      if decode:
        start = 0
        initialized = self.has_variable("cache", "position")
        index = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
        if initialized:
          start = index.value
          index.value = start + tokens.shape[1]
      table = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (self.max_len, self.hidden_dim), self.param_dtype)
      x = gpt_ops.add_learned_positions(self, x, table, start=start, positions=positions,
                                        shards=shards)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    for i in range(self.num_layers):
      x = EncoderBlock(num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                       dropout_rate=self.dropout_rate,
                       attention_dropout_rate=self.attention_dropout_rate,
                       attention=self.block_attention(i), is_causal=True, dtype=self.dtype,
                       param_dtype=self.param_dtype, name=f"block_{i}")(
                           x, deterministic=deterministic, decode=decode,
                           segment_ids=segment_ids,
                           positions=positions if self.positions == "rotary" else None)
    x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="ln_final")(x)
    if self.tie_embeddings:
      return embed.attend(x)
    return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype,
                    param_dtype=self.param_dtype, name="lm_head")(x)


# --- generation -----------------------------------------------------------------------------


def supports_kv_cache(model: GPT) -> bool:
  """Whether :func:`generate` can use the KV cache for ``model`` (types "dot"/"metric")."""
  return model.supports_kv_cache


def _variables(params: Any, extra_variables: Mapping[str, Any] | None) -> dict[str, Any]:
  """A params tree or a full variables dict -> variables (plus e.g. the ``"favor"`` ω)."""
  variables = dict(params) if "params" in params else {"params": params}
  variables.update(extra_variables or {})
  variables.pop("cache", None)
  return variables


def _sample_logits(logits: Array, key: Array, temperature: Array, top_k: int | None) -> Array:
  """``logits [B, V]`` -> ids ``[B]``: argmax at temperature 0, else top-k categorical."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1)
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  sampled = jax.random.categorical(key, scaled, axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def _empty_cache_leaf(path: Any, shape: Any) -> Array:
  """The value a cache variable starts from (without running the init call): zeros, and a
  paged cache's page table giving sequence b pages b·P … b·P + P − 1
  (:func:`attnx.nn.attention_ops.paged_cache_init`)."""
  if getattr(path[-1], "key", None) == "page_table":
    b, pages = shape.shape
    return jnp.arange(b * pages, dtype=shape.dtype).reshape(b, pages)
  return jnp.zeros(shape.shape, shape.dtype)


@functools.partial(jax.jit, static_argnames=("model", "prompt_len", "top_k"))
def _generate_cached(model: GPT, variables: dict, buf: Array, rng: Array, temperature: Array,
                     lengths: Array, *, prompt_len: int, top_k: int | None) -> Array:
  total = buf.shape[1]
  shapes = jax.eval_shape(
      lambda: model.apply(variables, buf, decode=True, mutable=["cache"])[1]["cache"])
  cache = jax.tree_util.tree_map_with_path(_empty_cache_leaf, shapes)

  def step(t, carry):
    cache, buf = carry
    tok = jax.lax.dynamic_slice_in_dim(buf, t, 1, axis=1)
    logits, upd = model.apply({**variables, "cache": cache}, tok, decode=True,
                              mutable=["cache"])
    nxt = _sample_logits(logits[:, -1], jax.random.fold_in(rng, t), temperature, top_k)
    keep = jax.lax.dynamic_slice_in_dim(buf, t + 1, 1, axis=1)[:, 0]
    nxt = jnp.where(t + 1 < lengths, keep, nxt)  # each row's own prompt first
    buf = jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None], t + 1, axis=1)
    return upd["cache"], buf

  return jax.lax.fori_loop(0, total - 1, step, (cache, buf))[1]


@functools.partial(jax.jit, static_argnames=("model", "prompt_len", "top_k", "window"))
def _generate_recompute(model: GPT, variables: dict, buf: Array, rng: Array,
                        temperature: Array, lengths: Array, *, prompt_len: int,
                        top_k: int | None, window: int) -> Array:
  total = buf.shape[1]

  def step(t, buf):
    # Predict token t from tokens < t: the window of `window` tokens ending at t - 1 (causal,
    # so the not yet generated tokens after it do not matter).
    start = jnp.clip(t - window, 0, total - window)
    x = jax.lax.dynamic_slice_in_dim(buf, start, window, axis=1)
    logits = model.apply(variables, x)
    last = jax.lax.dynamic_index_in_dim(logits, t - 1 - start, axis=1, keepdims=False)
    nxt = _sample_logits(last, jax.random.fold_in(rng, t - 1), temperature, top_k)
    keep = jax.lax.dynamic_slice_in_dim(buf, t, 1, axis=1)[:, 0]
    nxt = jnp.where(t < lengths, keep, nxt)  # each row's own prompt first
    return jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None], t, axis=1)

  return jax.lax.fori_loop(prompt_len, total, step, buf)


def generate(model: GPT, params: Any, prompt: Array | np.ndarray, num_new_tokens: int, *,
             rng: Array, temperature: float = 1.0, top_k: int | None = None,
             use_cache: bool | None = None, context: int | None = None,
             extra_variables: Mapping[str, Any] | None = None,
             prompt_lengths: Any = None, cache_page_size: int | None = None) -> Array:
  """Samples ``num_new_tokens`` continuations of ``prompt``: ``[B, T0] -> [B, T0 + n]`` int32.

  One jitted loop (compiled once per model, shapes and ``top_k``). Token t is drawn with the
  key ``fold_in(rng, t - 1)``, so the same ``rng`` gives the same text, on either path.

  Args:
    model: a :class:`GPT`.
    params: its ``params`` tree, or a variables dict with a ``"params"`` key.
    prompt: ``[B, T0]`` token ids, T0 ≥ 1.
    num_new_tokens: n ≥ 0 tokens to append.
    rng: a PRNG key.
    temperature: softmax temperature; 0 = greedy (argmax).
    top_k: sample among the k most likely tokens only (None: all).
    use_cache: True: KV cache (a ValueError for attention types without one, or when the
      sequence outgrows ``context``: the cache does not slide); False: recompute the window
      every step; None: the cache when possible.
    context: how many of the latest tokens the model sees when it predicts the next one.
      None: ``model.max_len``, the context it was trained with — nanoGPT's crop to its
      block size, so a long sample never asks the model for positions it has not seen.
      Rotary models may look further (e.g. ``context=4 * model.max_len``); learned
      positions cannot exceed ``max_len``.
    extra_variables: non-trained collections, e.g. ``{"favor": ...}`` for FAVOR+ (what
      ``attnx.train.fit`` returns as ``extra_variables``).
    prompt_lengths: int ``[B]``: a batch of prompts of different lengths, each row of
      ``prompt`` its prompt followed by padding (any ids); row b keeps its first
      ``prompt_lengths[b]`` tokens and samples the rest, so it ends with
      ``T0 + n − prompt_lengths[b]`` new tokens. None: every row's prompt is all T0 tokens.
    cache_page_size: with the KV cache, keep it in pages of this many positions
      (:func:`attnx.core.paged_attention`'s layout) instead of one array per layer; the text
      is the same.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"generate: prompt must be [B, T0] token ids with T0 >= 1, got shape "
                     f"{prompt.shape}.")
  n = int(num_new_tokens)
  if n < 0:
    raise ValueError(f"generate: num_new_tokens must be >= 0, got {num_new_tokens}.")
  if top_k is not None and not 1 <= int(top_k) <= model.vocab_size:
    raise ValueError(f"generate: top_k must be in [1, vocab_size={model.vocab_size}], got "
                     f"{top_k}.")
  if not temperature >= 0:
    raise ValueError(f"generate: temperature must be >= 0, got {temperature}.")
  prompt_len = prompt.shape[1]
  total = prompt_len + n
  lengths = np.full((prompt.shape[0],), prompt_len, np.int32)
  if prompt_lengths is not None:
    lengths = np.asarray(prompt_lengths)
    if (lengths.shape != (prompt.shape[0],) or not np.issubdtype(lengths.dtype, np.integer)
        or lengths.min(initial=1) < 1 or lengths.max(initial=1) > prompt_len):
      raise ValueError(f"generate: prompt_lengths must be int [B] = [{prompt.shape[0]}] in "
                       f"[1, {prompt_len}], got {prompt_lengths!r}.")
    lengths = lengths.astype(np.int32)
  if model.positions == "learned" and prompt_len > model.max_len:
    raise ValueError(f"generate: prompt length {prompt_len} exceeds max_len={model.max_len} of "
                     "the learned position embedding; give a shorter prompt.")
  ctx = model.max_len if context is None else context
  if not isinstance(ctx, int | np.integer) or isinstance(ctx, bool) or ctx < 1:
    raise ValueError(f"generate: context must be a positive int (tokens the model sees), got "
                     f"{context!r}.")
  if model.positions == "learned" and ctx > model.max_len:
    raise ValueError(f"generate: context={ctx} exceeds max_len={model.max_len} of the learned "
                     "position embedding.")
  ctx = int(ctx)
  if n == 0:
    return prompt
  fits = total <= ctx
  if use_cache is None:
    use_cache = model.supports_kv_cache and fits
  elif use_cache and not model.supports_kv_cache:
    kind = resolve_attention(model.attention)["type"]
    raise ValueError(f"generate: attention {model.attention!r} (type {kind!r}) keeps no KV "
                     "cache in attnx (only types 'dot' and 'metric' do); use use_cache=False "
                     "or None to recompute the prefix at every step.")
  elif use_cache and not fits:
    raise ValueError(f"generate: {total} tokens exceed context={ctx} (default: max_len="
                     f"{model.max_len}); the KV cache cannot slide (use_cache=None crops the "
                     "context to the latest tokens instead, or pass a larger context for "
                     "rotary positions).")
  if cache_page_size is not None:
    if use_cache is False:
      raise ValueError("generate: cache_page_size sets how the KV cache is stored; it needs "
                       "use_cache=True or None.")
    if not model.supports_kv_cache:
      raise ValueError(f"generate: attention {model.attention!r} keeps no KV cache, paged or "
                       "not.")
    model = model.clone(cache_page_size=int(cache_page_size))
  variables = _variables(params, extra_variables)
  buf = jnp.zeros((prompt.shape[0], total), jnp.int32).at[:, :prompt_len].set(prompt)
  temp = jnp.asarray(temperature, jnp.float32)
  k = None if top_k is None else int(top_k)
  if use_cache:
    return _generate_cached(model, variables, buf, rng, temp, jnp.asarray(lengths),
                            prompt_len=prompt_len, top_k=k)
  window = min(total, ctx)
  return _generate_recompute(model, variables, buf, rng, temp, jnp.asarray(lengths),
                             prompt_len=int(lengths.min()), top_k=k, window=window)


# --- model files ------------------------------------------------------------------------------

SPEC_FORMAT = "attnx.gpt/1"
ENCODING = "utf-8 characters"


def model_kwargs(model: GPT) -> dict[str, Any]:
  """The JSON-able constructor kwargs of ``model`` (dtypes as names)."""
  return gpt_ops.model_kwargs(model)


def save_model_spec(path: str | os.PathLike, model: GPT | Mapping[str, Any], *,
                    vocab: str | Sequence[str], **extra: Any) -> None:
  """Writes ``{"format", "model": GPT kwargs, "vocab": [chars], "encoding", **extra}`` as JSON.

  ``model`` is a :class:`GPT` (linen, or :class:`attnx.nnx.GPT`) or its kwargs; ``vocab``
  the dataset vocabulary (token id -> character, e.g.
  ``attnx.data.get_info("shakespeare").extras["vocab"]``). The parent directory is created.
  """
  kwargs = (gpt_ops.model_kwargs(getattr(model, "options", model))
            if isinstance(model, GPT) or hasattr(model, "options") else gpt_ops.plain(dict(model)))
  vocab = list(vocab)
  if len(vocab) != int(kwargs["vocab_size"]):
    raise ValueError(f"save_model_spec: the vocabulary has {len(vocab)} tokens but the model's "
                     f"vocab_size is {kwargs['vocab_size']}.")
  spec = {"format": SPEC_FORMAT, "model": kwargs, "vocab": vocab, "encoding": ENCODING,
          **gpt_ops.plain(extra)}
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(spec, f, indent=2, ensure_ascii=False)
  os.replace(tmp, path)


def load_model_spec(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a :func:`save_model_spec` file; a ValueError names what is missing or wrong."""
  path = os.fspath(path)
  with open(path, encoding="utf-8") as f:
    spec = json.load(f)
  if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT:
    raise ValueError(f"{path} is not a GPT model file (format {SPEC_FORMAT!r} written by "
                     "attnx.nn.gpt.save_model_spec).")
  for key in ("model", "vocab"):
    if key not in spec:
      raise ValueError(f"{path}: missing {key!r}.")
  if len(spec["vocab"]) != int(spec["model"]["vocab_size"]):
    raise ValueError(f"{path}: vocabulary of {len(spec['vocab'])} tokens for vocab_size "
                     f"{spec['model']['vocab_size']}.")
  return spec


def gpt_from_spec(spec: Mapping[str, Any], **overrides: Any) -> GPT:
  """The :class:`GPT` of a :func:`load_model_spec` dict (or of bare kwargs), with overrides."""
  return GPT(**gpt_ops.kwargs_from_spec(spec, **overrides))
