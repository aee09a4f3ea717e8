"""RNN encoder-decoder with Bahdanau or Luong attention.

The translation example of the Wikipedia article "Attention (machine learning)".

The decoder attends over the encoder states at every target step; the weights form the
alignment matrix ``[B, T_tgt, T_src]`` (that article's "je t'aime" example). Any weighting F of a
similarity can replace softmax by name (Bahdanau and Luong scores are similarities, so the
distance kernels are rejected at construction).
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx import core
from attnx.nn import _util
from attnx.nn.additive import LUONG_CORE_SCORES, AdditiveAttention, LuongAttention

Array = jax.Array

ATTENTION_TYPES = ("bahdanau", "luong_dot", "luong_general", "luong_concat", "none")
CELLS = ("gru", "lstm")
PAD_ID = 0


def _float32_init(init):
  """Draws in float32 and casts: the orthogonal init's LAPACK QR has no bfloat16 kernel."""
  return lambda key, shape, dtype=jnp.float32: init(key, shape, jnp.float32).astype(dtype)


def _make_cell(cell: str, features: int, dtype: Any, param_dtype: Any, name: str | None = None):
  cls = nn.GRUCell if cell == "gru" else nn.LSTMCell
  return cls(features=features, dtype=dtype, param_dtype=param_dtype, name=name,
             recurrent_kernel_init=_float32_init(nn.initializers.orthogonal()))


def _core_score(attention_type: str) -> str | None:
  """The attnx.core score an attention type uses (None: no attention)."""
  if attention_type == "bahdanau":
    return "additive"
  return LUONG_CORE_SCORES.get(attention_type.removeprefix("luong_"))


def _hidden(carry: Any, cell: str) -> Array:
  return carry[1] if cell == "lstm" else carry  # LSTM carry is (c, h)


class _BahdanauStep(nn.Module, kw_only=True):
  """One decoder step: c_t = Attn(s_{t-1}, H); s_t = Cell(s_{t-1}, [y_{t-1}; c_t])."""

  cell: str
  hidden_dim: int
  attention_dim: int | None
  weighting: Any
  dtype: Any
  param_dtype: Any
  attention_dropout_rate: float
  deterministic: bool

  @nn.compact
  def __call__(self, carry, y_emb: Array, memory: Array, mask: Array):
    """``mask``: key padding ``[B, 1, 1, S]`` (True = real source token)."""
    attn = AdditiveAttention(attention_dim=self.attention_dim, weighting=self.weighting,
                             dtype=self.dtype, param_dtype=self.param_dtype,
                             dropout_rate=self.attention_dropout_rate, name="attention")
    # One query (the previous state) over the memory: weights [B, 1(head), S].
    ctx, w = attn(_hidden(carry, self.cell), memory, mask=mask, return_weights=True,
                  deterministic=self.deterministic)
    w = w[:, 0]
    cell = _make_cell(self.cell, self.hidden_dim, self.dtype, self.param_dtype, name="cell")
    carry, s = cell(carry, jnp.concatenate([y_emb, ctx.astype(y_emb.dtype)], -1))
    return carry, (jnp.concatenate([s, ctx.astype(s.dtype)], -1), w)


class RNNSeq2Seq(nn.Module, kw_only=True):
  """GRU/LSTM encoder-decoder with attention; teacher forcing in ``__call__``.

  * ``"bahdanau"``: additive score on the previous decoder state, context fed to the cell,
    output from [s_t; c_t] (Bahdanau et al. 2015).
  * ``"luong_dot"`` / ``"luong_general"`` / ``"luong_concat"``: global attention on the current
    state s_t, h̃_t = tanh(W_c [c_t; s_t]), output from h̃_t (Luong et al. 2015, no input
    feeding, so all steps attend in parallel).
  * ``"none"``: plain encoder-decoder from the final encoder state (Sutskever et al. 2014).

  Source token 0 is PAD (right padding): masked out of attention; the encoder's final state is
  taken at each row's last real token.

  Attributes:
    src_vocab_size, tgt_vocab_size: vocabularies (target defaults to source).
    embed_dim, hidden_dim: embedding and RNN widths (Luong dot needs equal enc/dec widths:
      both are ``hidden_dim``).
    cell: ``"gru"`` or ``"lstm"``.
    attention_type: one of ``ATTENTION_TYPES``.
    weighting: F for the attention weights (any ``core.get_weighting`` spec of a similarity).
    attention_dim: hidden width of additive/concat scores (default hidden_dim).
    dtype, param_dtype: as in flax (recurrent kernels are drawn in float32, then cast).
    dropout_rate: dropout on the source/target embeddings and on the features before the
      output layer (``deterministic=False``, ``"dropout"`` RNG).
    attention_dropout_rate: dropout on the attention weights (a fresh mask at every step).
  """

  src_vocab_size: int
  tgt_vocab_size: int | None = None
  embed_dim: int = 32
  hidden_dim: int = 64
  cell: str = "gru"
  attention_type: str = "bahdanau"
  weighting: Any = "softmax"
  attention_dim: int | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0

  def __post_init__(self):
    where = type(self).__name__
    if self.attention_type not in ATTENTION_TYPES:
      raise ValueError(f"{where}: unknown attention_type {self.attention_type!r}; valid: "
                       f"{', '.join(ATTENTION_TYPES)}.")
    if self.cell not in CELLS:
      raise ValueError(f"{where}: unknown cell {self.cell!r}; valid: {', '.join(CELLS)}.")
    score = _core_score(self.attention_type)
    if score is not None:
      _util.validate_attention_config(self.weighting, score, None, where)
    else:  # no attention: F is unused, but a typo should still fail
      try:
        core.get_weighting(self.weighting)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    _util.check_dropout_rate(self.dropout_rate, where)
    _util.check_dropout_rate(self.attention_dropout_rate, where)
    super().__post_init__()

  @nn.compact
  def __call__(self, src_tokens: Array, tgt_in_tokens: Array, *,
               return_alignment: bool = False,
               deterministic: bool = True) -> Array | tuple[Array, Array]:
    """``src_tokens [B, S]``, ``tgt_in_tokens [B, T]`` -> logits ``[B, T, V_tgt]``.

    With ``return_alignment=True`` also returns the alignment (attention weights, before
    dropout) ``[B, T, S]``; rows sum to one for normalized weightings. ``deterministic=False``
    enables dropout (``dropout_rate``, ``attention_dropout_rate``).
    """
    chex.assert_rank([src_tokens, tgt_in_tokens], 2)
    chex.assert_type([src_tokens, tgt_in_tokens], int)
    chex.assert_equal_shape_prefix([src_tokens, tgt_in_tokens], 1)
    if return_alignment and self.attention_type == "none":
      raise ValueError("attention_type='none' has no alignment to return.")
    tgt_vocab = self.tgt_vocab_size or self.src_vocab_size
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    valid = src_tokens != PAD_ID
    lengths = jnp.sum(valid, axis=-1)
    drop = lambda x: nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    src = drop(nn.Embed(self.src_vocab_size, self.embed_dim, name="src_embed", **kw)(src_tokens))
    tgt = drop(nn.Embed(tgt_vocab, self.embed_dim, name="tgt_embed", **kw)(tgt_in_tokens))
    enc_cell = _make_cell(self.cell, self.hidden_dim, self.dtype, self.param_dtype)
    carry, memory = nn.RNN(enc_cell, return_carry=True, name="encoder")(
        src, seq_lengths=lengths)  # memory [B, S, H]

    alignment = None
    key_padding = valid[:, None, None, :]  # [B, 1, 1, S]: the attnx.nn mask convention
    if self.attention_type == "bahdanau":
      scan = nn.scan(_BahdanauStep, variable_broadcast="params",
                     split_rngs={"params": False, "dropout": True},
                     in_axes=(1, nn.broadcast, nn.broadcast), out_axes=1)
      step = scan(cell=self.cell, hidden_dim=self.hidden_dim, attention_dim=self.attention_dim,
                  weighting=self.weighting, dtype=self.dtype, param_dtype=self.param_dtype,
                  attention_dropout_rate=self.attention_dropout_rate,
                  deterministic=deterministic, name="decoder")
      _, (feats, alignment) = step(carry, tgt, memory, key_padding)
    else:
      dec_cell = _make_cell(self.cell, self.hidden_dim, self.dtype, self.param_dtype)
      states = nn.RNN(dec_cell, name="decoder")(tgt, initial_carry=carry)  # [B, T, H]
      feats = states
      if self.attention_type != "none":
        attn = LuongAttention(score=self.attention_type.removeprefix("luong_"),
                              attention_dim=self.attention_dim, weighting=self.weighting,
                              dropout_rate=self.attention_dropout_rate, name="attention", **kw)
        ctx, alignment = attn(states, memory, mask=key_padding, return_weights=True,
                              deterministic=deterministic)
        alignment = alignment[:, 0]  # one head: [B, T, S]
        feats = jnp.tanh(nn.Dense(self.hidden_dim, use_bias=False, name="combine", **kw)(
            jnp.concatenate([ctx.astype(states.dtype), states], -1)))
    logits = nn.Dense(tgt_vocab, name="head", **kw)(drop(feats))
    if return_alignment:
      chex.assert_shape(alignment, (*tgt_in_tokens.shape, src_tokens.shape[1]))
      return logits, alignment
    return logits
