"""Models: shapes, padding, greedy decoding, RNN alignments, vmap over seeds."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
SMALL = dict(hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=16)
TOKENS = jnp.array([[3, 4, 5, 0, 0], [2, 2, 2, 2, 1]])
IMAGES = jax.random.normal(KEY, (2, 4, 4, 3))


@pytest.mark.parametrize("attention,pool", [("softmax", "cls"), ("linear_elu", "none"),
                                            ("metric:weighting=relu", "mean")])
def test_sequence_classifier_pools_and_pad_masking(attention, pool):
  model = an.SequenceClassifier(10, 3, max_len=8, pool=pool,
                                attention=an.attention_spec(attention), **SMALL)
  params = model.init(KEY, TOKENS)
  out = model.apply(params, TOKENS)
  chex.assert_shape(out, (2, 5, 3) if pool == "none" else (2, 3))
  # PAD keys are masked out: appending PAD tokens leaves the real tokens' outputs unchanged.
  out2 = model.apply(params, jnp.pad(TOKENS, ((0, 0), (0, 2))))
  if pool == "none":
    chex.assert_trees_all_close(out2[0, :3], out[0, :3], atol=1e-5)
  else:
    chex.assert_trees_all_close(out2, out, atol=1e-5)


def test_vision_transformer_and_regressor_shapes():
  vit = an.VisionTransformer(4, patch_size=2, pool="cls", attention={"weighting": "relu"},
                             **SMALL)
  params = vit.init(KEY, IMAGES)
  chex.assert_shape(vit.apply(params, IMAGES), (2, 4))
  reg = an.SequenceRegressor(out_dim=2, max_len=8, **SMALL)
  x = jax.random.normal(KEY, (2, 5, 3))
  params = reg.init(KEY, x)
  out = reg.apply(params, x)
  chex.assert_shape(out, (2, 5, 2))
  # Causal by default: the first prediction ignores later tokens.
  out2 = reg.apply(params, x.at[:, 1:].set(0.0))
  chex.assert_trees_all_close(out2[:, 0], out[:, 0], atol=1e-5)


def test_seq2seq_teacher_forcing_and_greedy_decode():
  model = an.Seq2Seq(10, max_len=8, attention={"weighting": "sparsemax"}, **SMALL)
  tgt_in = jnp.array([[1, 5, 6, 7], [1, 3, 0, 0]])
  params = model.init(KEY, TOKENS, tgt_in)
  logits = model.apply(params, TOKENS, tgt_in)
  chex.assert_shape(logits, (2, 4, 10))
  decoded = an.greedy_decode(model, params, TOKENS, max_len=3)
  chex.assert_shape(decoded, (2, 3))
  # Greedy output equals argmax of the teacher-forced logits on its own prefix.
  prefix = jnp.concatenate([jnp.ones((2, 1), jnp.int32), decoded[:, :-1]], axis=1)
  ref = jnp.argmax(model.apply(params, TOKENS, prefix), -1)
  chex.assert_trees_all_equal(decoded, ref)


@pytest.mark.parametrize("attention_type,cell,weighting", [
    ("bahdanau", "gru", "softmax"), ("luong_dot", "gru", "softmax"),
    ("luong_general", "lstm", "entmax15"), ("luong_concat", "gru", "sparsemax")])
def test_rnn_seq2seq_alignment_rows_sum_to_one(attention_type, cell, weighting):
  model = an.RNNSeq2Seq(10, embed_dim=6, hidden_dim=8, cell=cell,
                        attention_type=attention_type, weighting=weighting)
  tgt_in = jnp.array([[1, 5, 6], [1, 3, 4]])
  params = model.init(KEY, TOKENS, tgt_in)
  logits, align = model.apply(params, TOKENS, tgt_in, return_alignment=True)
  chex.assert_shape((logits, align), ((2, 3, 10), (2, 3, 5)))
  chex.assert_trees_all_close(align.sum(-1), jnp.ones((2, 3)), atol=1e-5)
  assert jnp.all(align[0, :, 3:] == 0)  # PAD source positions get no weight


def test_rnn_seq2seq_without_attention():
  tgt_in = jnp.array([[1, 5, 6], [1, 3, 4]])
  plain = an.RNNSeq2Seq(10, embed_dim=6, hidden_dim=8, attention_type="none")
  params = plain.init(KEY, TOKENS, tgt_in)
  chex.assert_shape(plain.apply(params, TOKENS, tgt_in), (2, 3, 10))
  with pytest.raises(ValueError, match="no alignment"):
    plain.apply(params, TOKENS, tgt_in, return_alignment=True)


def test_cnn_with_channel_and_spatial_attention():
  model = an.SmallCNN(3, features=(4,), block_attention="cbam", weighting="softmax")
  params = model.init(KEY, IMAGES)
  chex.assert_shape(model.apply(params, IMAGES), (2, 3))
  se = an.SqueezeExcite(reduction=2, weighting="softmax")
  x = jax.random.normal(KEY, (2, 4, 4, 6))
  y = se.apply(se.init(KEY, x), x)
  gate = y / x
  # Normalized gate: per-channel constant over space, mean 1 over channels.
  chex.assert_trees_all_close(gate.mean(-1), jnp.ones((2, 4, 4)), atol=1e-4)


def test_nadaraya_watson_fixed_gaussian_equals_numpy():
  rng = np.random.default_rng(0)
  xt = np.sort(rng.uniform(0, 4, 20)).astype(np.float32)
  yt = (2 * np.sin(xt) + xt + rng.normal(size=20)).astype(np.float32)
  xq = np.linspace(0, 4, 7).astype(np.float32)
  h = 0.5
  model = an.NadarayaWatsonRegressor(kernel="gaussian", bandwidth=h)
  variables = model.init(KEY, xq, xt, yt)
  assert not variables.get("params")
  k = np.exp(-((xq[:, None] - xt[None]) ** 2) / (2 * h * h))
  ref = (k * yt).sum(1) / k.sum(1)
  np.testing.assert_allclose(model.apply(variables, xq, xt, yt), ref, rtol=1e-5, atol=1e-5)
  # Learned forms start at the same estimator and have a gradient for their parameter.
  for mode, name in (("learned_bandwidth", "log_bandwidth"), ("learned_w", "w")):
    m = an.NadarayaWatsonRegressor(kernel="gaussian", bandwidth=h, mode=mode)
    v = m.init(KEY, xq, xt, yt)
    np.testing.assert_allclose(m.apply(v, xq, xt, yt), ref, rtol=1e-5, atol=1e-5)
    if mode == "learned_w":
      g = jax.grad(lambda p, m=m: jnp.sum((m.apply(p, xq, xt, yt) - 1.0) ** 2))(v)
      assert g["params"][name] != 0


def test_vmap_over_params_of_three_seeds_equals_separate_applies():
  # FAVOR+ also checks that the non-trainable "favor" collection is drawn per seed.
  model = an.LinearAttention(num_heads=2, feature_map="favor_plus", num_features=8)
  x = jax.random.normal(KEY, (2, 4, 8))
  keys = jax.random.split(KEY, 3)
  init = jax.jit(model.init)
  stacked = jax.vmap(init, in_axes=(0, None))(keys, x)
  outs = jax.vmap(model.apply, in_axes=(0, None))(stacked, x)
  chex.assert_shape(outs, (3, 2, 4, 8))
  apply = jax.jit(model.apply)
  for i in range(3):
    single = init(keys[i], x)
    chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], stacked), single)
    chex.assert_trees_all_close(outs[i], apply(single, x), atol=1e-5)
  assert not np.allclose(stacked["favor"]["omega"][0], stacked["favor"]["omega"][1])
