"""The GPT language model in NNX: :class:`attnx.nn.GPT`'s model with NNX's state.

The same constructor arguments (so a config or a ``model_spec.json`` builds either:
:func:`gpt_from_spec`), the same call and the same parameter names (``embed``,
``pos_embedding``, ``block_<i>`` with the :class:`~attnx.nnx.EncoderBlock` names,
``ln_final``, ``lm_head``), so a linen checkpoint's ``params`` load into it with
``nnx.replace_by_pure_dict``. The checks, the blocks' attention specs and the position rows are
the linen model's functions (:mod:`attnx.nn.gpt_ops`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnx.nn import _util, gpt_ops
from attnx.nn import gpt as linen_gpt
from attnx.nn.attention_ops import sequence_shards
from attnx.nn.rotary import DEFAULT_BASE
from attnx.nn.spec import freeze_attention_fields
from attnx.nnx.transformer import EncoderBlock, make_dropout

Array = jax.Array
# The options of the NNX model: the linen model's fields (declared once, there).
GPTOptions = _util.options_dataclass(linen_gpt.GPT, "GPTOptions")


class GPT(nnx.Module):
  """Decoder-only transformer LM in NNX: ``tokens [B, T] int -> logits [B, T, vocab_size]``.

  Args: the fields of :class:`attnx.nn.GPT` (``vocab_size``, ``num_layers``, ``num_heads``,
  ``hidden_dim``, ``mlp_dim``, ``max_len``, ``attention``, ``tie_embeddings``, ``positions``,
  ``rotary_base``, ``sliding_window``, ``logits_soft_cap``, ``sinks``, ``dropout_rate``,
  ``attention_dropout_rate``, ``implementation``, ``sequence_axis``, ``sequence_layout``,
  ``dtype``, ``param_dtype``), keyword-only, and ``rngs`` (``params``; ``dropout`` when a
  rate is set). Attention types ``"dot"`` and ``"metric"``. The options are kept in
  :attr:`options` (:data:`GPTOptions`).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from attnx import nnx as anx
    >>> model = anx.GPT(vocab_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
    ...                 max_len=8, attention="relu", rngs=nnx.Rngs(0))
    >>> tokens = jnp.arange(16).reshape(2, 8)  # [B, T]
    >>> model(tokens).shape  # [B, T, vocab_size]
    (2, 8, 16)
  """

  def __init__(self, *, vocab_size: int, num_layers: int, num_heads: int, hidden_dim: int,
               mlp_dim: int, max_len: int, attention: Mapping[str, Any] | str | None = None,
               tie_embeddings: bool = True, positions: str = "learned",
               rotary_base: float = DEFAULT_BASE,
               sliding_window: int | Sequence[int | None] | None = None,
               logits_soft_cap: float | None = None, sinks: bool = False,
               dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0,
               implementation: str | None = None, sequence_axis: str | None = None,
               sequence_layout: str = "contiguous", dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    opts = GPTOptions(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads,
        hidden_dim=hidden_dim, mlp_dim=mlp_dim, max_len=max_len, attention=attention,
        tie_embeddings=tie_embeddings, positions=positions, rotary_base=rotary_base,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate,
        implementation=implementation, sequence_axis=sequence_axis,
        sequence_layout=sequence_layout, dtype=dtype, param_dtype=param_dtype)
    gpt_ops.check_gpt(opts, type(self).__name__)
    freeze_attention_fields(opts, "attention")  # hashable, as NNX's static fields must be
    self.options = opts
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(vocab_size, hidden_dim, embedding_init=init, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
    if positions == "learned":
      self.pos_embedding = nnx.Param(init(rngs.params(), (max_len, hidden_dim), param_dtype))
    self.dropout = make_dropout(dropout_rate, rngs)
    for i in range(num_layers):
      setattr(self, f"block_{i}", EncoderBlock(
          hidden_dim, num_heads, mlp_dim, dropout_rate=dropout_rate,
          attention_dropout_rate=attention_dropout_rate,
          attention=gpt_ops.block_attention(opts, i), is_causal=True, dtype=dtype,
          param_dtype=param_dtype, rngs=rngs))
    self.ln_final = nnx.LayerNorm(hidden_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if not tie_embeddings:
      self.lm_head = nnx.Linear(hidden_dim, vocab_size, use_bias=False, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)
    self.position: nnx.Cache | None = nnx.data(None)  # learned positions' decoding index

  @property
  def blocks(self) -> list[EncoderBlock]:
    """The transformer blocks, ``block_0`` first."""
    return [getattr(self, f"block_{i}") for i in range(self.options.num_layers)]

  @property
  def supports_kv_cache(self) -> bool:
    """Whether ``decode=True`` works (attention types ``"dot"`` and ``"metric"``: all here)."""
    return gpt_ops.supports_kv_cache(self.options)

  def layer_windows(self) -> tuple[int | None, ...]:
    """The sliding window of each layer (None: global attention)."""
    return gpt_ops.layer_windows(self.options, type(self).__name__)

  def block_attention(self, layer: int = 0) -> dict[str, Any]:
    """The attention spec block ``layer`` has (:meth:`attnx.nn.GPT.block_attention`)."""
    return gpt_ops.block_attention(self.options, layer)

  def __call__(self, tokens: Array, *, deterministic: bool = True, decode: bool = False,
               segment_ids: Array | None = None, positions: Array | None = None) -> Array:
    """Logits ``[B, T, vocab_size]`` of the next token at every position; the arguments are
    :meth:`attnx.nn.GPT.__call__`'s (``decode=True`` after :meth:`init_cache`)."""
    opts = self.options
    shards = sequence_shards(opts.sequence_axis)
    positions = gpt_ops.check_call(opts, tokens, positions, segment_ids, decode, shards)
    if decode and self.position is None and opts.positions == "learned":
      raise ValueError("GPT: decode=True needs the KV cache: call init_cache(batch_size, "
                       "max_length) first.")
    x = self.embed(tokens.astype(jnp.int32))
    if opts.positions == "learned":
      start = None
      if decode:
        start = self.position[...]
        self.position[...] = start + tokens.shape[1]
      x = gpt_ops.add_learned_positions(opts, x, self.pos_embedding[...], start=start,
                                        positions=positions, shards=shards)
    x = self.dropout(x, deterministic=deterministic)
    for block in self.blocks:
      x = block(x, deterministic=deterministic, decode=decode, segment_ids=segment_ids,
                positions=positions if opts.positions == "rotary" else None)
    x = self.ln_final(x)
    return self.embed.attend(x) if opts.tie_embeddings else self.lm_head(x)

  def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32,
                 page_size: int | None = None) -> None:
    """Sets up every layer's KV cache for ``decode=True``: ``max_length`` positions of
    ``batch_size`` sequences (with ``page_size``, in pages of that many positions:
    :meth:`attnx.nnx.MultiHeadAttention.init_cache`)."""
    shape = (batch_size, max_length, self.options.hidden_dim)
    for block in self.blocks:
      block.attention.init_cache(shape, dtype, page_size=page_size)
    if self.options.positions == "learned":
      self.position = nnx.Cache(jnp.array(0, jnp.int32))


def gpt_from_spec(spec: Mapping[str, Any], *, rngs: nnx.Rngs, **overrides: Any) -> GPT:
  """The NNX :class:`GPT` of a model file's dict (:func:`attnx.nn.load_model_spec`) or of bare
  kwargs, with overrides: the same spec builds :class:`attnx.nn.GPT`
  (:func:`attnx.nn.gpt_from_spec`).

  Example:
    >>> from flax import nnx
    >>> from attnx import nn, nnx as anx
    >>> linen = nn.GPT(vocab_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
    ...                max_len=8, positions="alibi", sinks=True)
    >>> model = anx.gpt_from_spec(nn.gpt.model_kwargs(linen), rngs=nnx.Rngs(0))
    >>> model.block_attention(0) == linen.block_attention(0)
    True
  """
  return GPT(**gpt_ops.kwargs_from_spec(spec, **overrides), rngs=rngs)
