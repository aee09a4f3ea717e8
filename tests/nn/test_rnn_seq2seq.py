"""attnx.nn.rnn_seq2seq: alignments, no-attention mode, dropout, bfloat16 parameters."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax.traverse_util import flatten_dict

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
TOKENS = jnp.array([[3, 4, 5, 0, 0], [2, 2, 2, 2, 1]])
TGT_IN = jnp.array([[1, 5, 6], [1, 3, 4]])


def test_rnn_seq2seq_alignment_rows_sum_to_one():
  # Bahdanau's alignments are checked with every weighting in test_weighting_matrix.py.
  configs = [("luong_dot", "gru", "softmax"), ("luong_general", "lstm", "entmax15"),
             ("luong_concat", "gru", "sparsemax")]

  @jax.jit
  def run(src, tgt):  # one program for every configuration
    out = []
    for attention_type, cell, weighting in configs:
      model = an.RNNSeq2Seq(src_vocab_size=10, embed_dim=6, hidden_dim=8, cell=cell,
                            attention_type=attention_type, weighting=weighting)
      out.append(model.apply(model.init(KEY, src, tgt), src, tgt, return_alignment=True))
    return out

  for config, (logits, align) in zip(configs, run(TOKENS, TGT_IN), strict=True):
    chex.assert_shape((logits, align), ((2, 3, 10), (2, 3, 5)))
    chex.assert_trees_all_close(align.sum(-1), jnp.ones((2, 3)), atol=1e-5,
                                custom_message=str(config))
    assert jnp.all(align[0, :, 3:] == 0), config  # PAD source positions get no weight


def test_rnn_seq2seq_without_attention():
  plain = an.RNNSeq2Seq(src_vocab_size=10, embed_dim=6, hidden_dim=8, attention_type="none")
  params = jax.jit(plain.init)(KEY, TOKENS, TGT_IN)
  chex.assert_shape(jax.jit(plain.apply)(params, TOKENS, TGT_IN), (2, 3, 10))
  with pytest.raises(ValueError, match="no alignment"):
    plain.apply(params, TOKENS, TGT_IN, return_alignment=True)


@pytest.mark.parametrize("attention_type", ["bahdanau", "luong_concat"])
def test_rnn_seq2seq_dropout_follows_deterministic(attention_type):
  model = an.RNNSeq2Seq(src_vocab_size=10, embed_dim=6, hidden_dim=8, attention_type=attention_type,
                        dropout_rate=0.3, attention_dropout_rate=0.5)
  attn_only = model.clone(dropout_rate=0.0)
  plain = model.clone(dropout_rate=0.0, attention_dropout_rate=0.0)
  params = jax.jit(model.init)(KEY, TOKENS, TGT_IN)

  @jax.jit
  def run(params):  # one program for all the variants
    apply = lambda m, **kw: m.apply(params, TOKENS, TGT_IN, **kw)
    rngs = lambda i: {"dropout": jax.random.PRNGKey(i)}
    return (apply(plain), apply(model), apply(model, deterministic=False, rngs=rngs(1)),
            apply(model, deterministic=False, rngs=rngs(2)),
            apply(attn_only, deterministic=False, rngs=rngs(1)))

  ref, default, drop1, drop2, attn_drop = run(params)
  chex.assert_trees_all_close(default, ref)  # deterministic by default: no dropout
  chex.assert_tree_all_finite((drop1, drop2, attn_drop))
  assert jnp.max(jnp.abs(drop1 - ref)) > 1e-3 and jnp.max(jnp.abs(drop1 - drop2)) > 1e-3
  # Attention dropout alone changes the weights the decoder uses, so the logits.
  assert jnp.max(jnp.abs(attn_drop - ref)) > 1e-4


def test_rnn_seq2seq_bfloat16_params():
  # LAPACK's QR (orthogonal init) has no bfloat16: recurrent kernels are drawn in f32, cast.
  kw = dict(embed_dim=6, hidden_dim=8, cell="lstm", attention_type="luong_general")
  model = an.RNNSeq2Seq(src_vocab_size=10, param_dtype=jnp.bfloat16, **kw)

  @jax.jit
  def run(src, tgt):
    p32 = an.RNNSeq2Seq(src_vocab_size=10, **kw).init(KEY, src, tgt)["params"]
    p16 = model.init(KEY, src, tgt)["params"]
    return p32, p16, model.apply({"params": p16}, src, tgt)

  p32, p16, logits = run(TOKENS, TGT_IN)
  assert {a.dtype for a in jax.tree.leaves(p16)} == {jnp.dtype(jnp.bfloat16)}
  flat32, flat16 = flatten_dict(p32), flatten_dict(p16)
  recurrent = [k for k in flat32 if k[-2] in ("hi", "hf", "hg", "ho") and k[-1] == "kernel"]
  assert len(recurrent) == 8  # 4 gates in the encoder's and the decoder's cell
  for k in recurrent:
    chex.assert_trees_all_equal(flat16[k], flat32[k].astype(jnp.bfloat16))
    chex.assert_trees_all_close(flat32[k] @ flat32[k].T, jnp.eye(8), atol=1e-5)  # orthogonal
  chex.assert_tree_all_finite(logits)
