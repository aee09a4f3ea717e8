"""Encoder-decoder transformer (Vaswani et al. 2017) with pluggable attention and greedy
decoding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx.nn.spec import freeze_attention_fields
from attnx.nn.transformer import Decoder, Encoder, position_embedding

Array = jax.Array

PAD_ID = 0


class Seq2Seq(nn.Module, kw_only=True):
  """Transformer encoder-decoder over tokens; token 0 is PAD (masked out of the source keys).

  Attributes:
    src_vocab_size: source vocabulary.
    tgt_vocab_size: target vocabulary (default: ``src_vocab_size``).
    hidden_dim, num_layers, num_heads, mlp_dim: size (same for encoder and decoder).
    max_len: longest source/target sequence (position table size).
    position: ``"learned"``, ``"sinusoidal"`` or ``"none"``.
    dropout_rate, attention_dropout_rate: dropout on residual branches / attention weights.
    attention: attention dict for encoder self-, decoder self- and (by default) cross-attention.
    cross_attention: attention dict for cross-attention (default: ``attention``).
    dtype, param_dtype: as in flax.
  """

  src_vocab_size: int
  tgt_vocab_size: int | None = None
  hidden_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 128
  max_len: int = 128
  position: str = "learned"
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention: Mapping[str, Any] | str | None = None
  cross_attention: Mapping[str, Any] | str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if self.hidden_dim % self.num_heads:
      raise ValueError(f"Seq2Seq: hidden_dim={self.hidden_dim} is not divisible by "
                       f"num_heads={self.num_heads}.")
    freeze_attention_fields(self, "attention", "cross_attention")
    super().__post_init__()

  def setup(self):
    tgt_vocab = self.tgt_vocab_size or self.src_vocab_size
    emb = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    self.src_embed = nn.Embed(self.src_vocab_size, self.hidden_dim, **emb)
    self.tgt_embed = nn.Embed(tgt_vocab, self.hidden_dim, **emb)
    self.src_pos = position_embedding(self.position, self.max_len, self.param_dtype)
    self.tgt_pos = position_embedding(self.position, self.max_len, self.param_dtype)
    common = dict(num_layers=self.num_layers, num_heads=self.num_heads, mlp_dim=self.mlp_dim,
                  dropout_rate=self.dropout_rate,
                  attention_dropout_rate=self.attention_dropout_rate,
                  attention=self.attention, dtype=self.dtype, param_dtype=self.param_dtype)
    self.encoder = Encoder(**common)
    self.decoder = Decoder(cross_attention=self.cross_attention, **common)
    self.head = nn.Dense(tgt_vocab, **emb)
    self.dropout = nn.Dropout(self.dropout_rate)

  def _embed(self, tokens, embed, pos, deterministic):
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"tokens {tokens.shape} longer than max_len={self.max_len}.")
    x = embed(tokens)
    if pos is not None:
      x = pos(x)
    return self.dropout(x, deterministic=deterministic)

  def encode(self, src_tokens: Array, *, deterministic: bool = True) -> tuple[Array, Array]:
    """``src_tokens [B, S]`` -> memory ``[B, S, D]`` and its key mask ``[B, S]``."""
    chex.assert_rank(src_tokens, 2)
    chex.assert_type(src_tokens, int)
    valid = src_tokens != PAD_ID
    x = self._embed(src_tokens, self.src_embed, self.src_pos, deterministic)
    return self.encoder(x, key_mask=valid, deterministic=deterministic), valid

  def decode_logits(self, memory: Array, memory_mask: Array, tgt_in_tokens: Array, *,
                    deterministic: bool = True) -> Array:
    """Teacher-forced decoder: ``tgt_in_tokens [B, T]`` -> logits ``[B, T, V_tgt]``."""
    chex.assert_rank(tgt_in_tokens, 2)
    chex.assert_equal_shape_prefix([memory, tgt_in_tokens], 1)
    y = self._embed(tgt_in_tokens, self.tgt_embed, self.tgt_pos, deterministic)
    y = self.decoder(y, memory, memory_key_mask=memory_mask, deterministic=deterministic)
    return self.head(y)

  def __call__(self, src_tokens: Array, tgt_in_tokens: Array, *,
               deterministic: bool = True) -> Array:
    """``src_tokens [B, S]``, ``tgt_in_tokens [B, T]`` (BOS-shifted) -> logits ``[B, T, V]``."""
    memory, mask = self.encode(src_tokens, deterministic=deterministic)
    return self.decode_logits(memory, mask, tgt_in_tokens, deterministic=deterministic)


def greedy_decode(model: Seq2Seq, variables: Any, src_tokens: Array, *, max_len: int,
                  bos_id: int = 1, eos_id: int | None = None) -> Array:
  """Greedy autoregressive decoding: ``src_tokens [B, S]`` -> tokens ``[B, max_len]``.

  Re-runs the causal decoder on the growing (fixed-size, PAD-filled) prefix each step, so it
  works for every attention type and under ``jit``. After ``eos_id`` a row emits PAD (0).
  A model without ``encode``/``decode_logits`` (e.g. :class:`attnx.nn.RNNSeq2Seq`) is called
  whole, ``model(src, prefix)``, at every step.
  """
  chex.assert_rank(src_tokens, 2)
  b = src_tokens.shape[0]
  if hasattr(model, "encode") and hasattr(model, "decode_logits"):  # encode once
    memory, mask = model.apply(variables, src_tokens, method=model.encode)
    logits_fn = lambda prefix: model.apply(variables, memory, mask, prefix,
                                           method=model.decode_logits)
  else:  # any causal encoder-decoder called as model(src, tgt_in), e.g. RNNSeq2Seq
    logits_fn = lambda prefix: model.apply(variables, src_tokens, prefix)
  prefix = jnp.zeros((b, max_len), jnp.int32).at[:, 0].set(bos_id)
  out = jnp.zeros((b, max_len), jnp.int32)
  done = jnp.zeros((b,), bool)

  def step(i, carry):
    prefix, out, done = carry
    logits = logits_fn(prefix)
    tok = jnp.argmax(logits[:, i], axis=-1).astype(jnp.int32)
    tok = jnp.where(done, PAD_ID, tok)
    out = out.at[:, i].set(tok)
    # Feed the token at i+1 (dropped by the clamp on the last step: index max_len - 1 is
    # rewritten with its own value).
    nxt = jnp.minimum(i + 1, max_len - 1)
    prefix = prefix.at[:, nxt].set(jnp.where(i + 1 < max_len, tok, prefix[:, nxt]))
    if eos_id is not None:
      done = done | (tok == eos_id)
    return prefix, out, done

  _, out, _ = jax.lax.fori_loop(0, max_len, step, (prefix, out, done))
  return out
