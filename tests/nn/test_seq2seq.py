"""attnx.nn.seq2seq: Seq2Seq teacher forcing and greedy_decode."""

import functools

import chex
import jax
import jax.numpy as jnp

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
SMALL = dict(hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=16)
TOKENS = jnp.array([[3, 4, 5, 0, 0], [2, 2, 2, 2, 1]])


def test_seq2seq_teacher_forcing_and_greedy_decode():
  model = an.Seq2Seq(src_vocab_size=10, max_len=8, attention={"weighting": "sparsemax"}, **SMALL)
  tgt_in = jnp.array([[1, 5, 6, 7], [1, 3, 0, 0]])
  params = jax.jit(model.init)(KEY, TOKENS, tgt_in)
  apply = jax.jit(model.apply)
  chex.assert_shape(apply(params, TOKENS, tgt_in), (2, 4, 10))
  decoded = jax.jit(functools.partial(an.greedy_decode, model, max_len=3))(params, TOKENS)
  chex.assert_shape(decoded, (2, 3))
  # Greedy output equals argmax of the teacher-forced logits on its own prefix.
  prefix = jnp.concatenate([jnp.ones((2, 1), jnp.int32), decoded[:, :-1]], axis=1)
  chex.assert_trees_all_equal(decoded, jnp.argmax(apply(params, TOKENS, prefix), -1))
