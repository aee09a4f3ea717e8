"""Models: shapes, padding, decoding, RNN alignments, CNN attention, kernel regression, seeds.

Inits and applies are jitted: compiling a whole model once is several times cheaper than
dispatching (and compiling) its ops one by one.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
SMALL = dict(hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=16)
TOKENS = jnp.array([[3, 4, 5, 0, 0], [2, 2, 2, 2, 1]])
TGT_IN = jnp.array([[1, 5, 6], [1, 3, 4]])
IMAGES = jax.random.normal(KEY, (2, 4, 4, 3))


def _perturb_head(variables, key=KEY):
  """ViT's head is zero-initialized (logits are exactly 0 at init): give it random weights."""
  head = variables["params"]["head"]
  new = {"kernel": jax.random.normal(key, head["kernel"].shape), "bias": head["bias"]}
  return {**variables, "params": {**variables["params"], "head": new}}


@pytest.mark.parametrize("attention,pool", [("softmax", "cls"), ("linear_elu", "none"),
                                            ("metric:weighting=sparsemax", "mean")])
def test_sequence_classifier_pools_and_pad_masking(attention, pool):
  model = an.SequenceClassifier(vocab_size=10, num_classes=3, max_len=8, pool=pool,
                                attention=an.attention_spec(attention), **SMALL)
  params = jax.jit(model.init)(KEY, TOKENS)
  apply = jax.jit(model.apply)
  out = apply(params, TOKENS)
  chex.assert_shape(out, (2, 5, 3) if pool == "none" else (2, 3))
  # PAD keys are masked out: appending PAD tokens leaves the real tokens' outputs unchanged.
  out2 = apply(params, jnp.pad(TOKENS, ((0, 0), (0, 2))))
  if pool == "none":
    chex.assert_trees_all_close(out2[0, :3], out[0, :3], atol=1e-5)
  else:
    chex.assert_trees_all_close(out2, out, atol=1e-5)


def test_vision_transformer_and_regressor():
  vit = an.VisionTransformer(num_classes=4, patch_size=2, pool="cls",
                             attention={"weighting": "relu"}, **SMALL)
  params = jax.jit(vit.init)(KEY, IMAGES)
  apply = jax.jit(vit.apply)
  assert jnp.all(apply(params, IMAGES) == 0)  # the zero-initialized head
  params = _perturb_head(params)
  logits = apply(params, IMAGES)
  chex.assert_shape(logits, (2, 4))
  assert jnp.min(jnp.abs(logits)) > 0 and jnp.max(jnp.abs(logits[0] - logits[1])) > 1e-3
  # Images are classified independently: reversing the batch reverses the logits.
  chex.assert_trees_all_close(apply(params, IMAGES[::-1]), logits[::-1], atol=1e-5)
  reg = an.SequenceRegressor(out_dim=2, max_len=8, **SMALL)
  x = jax.random.normal(KEY, (2, 5, 3))
  params = jax.jit(reg.init)(KEY, x)
  apply = jax.jit(reg.apply)
  out = apply(params, x)
  chex.assert_shape(out, (2, 5, 2))
  # Causal by default: the first prediction ignores later tokens.
  out2 = apply(params, x.at[:, 1:].set(0.0))
  chex.assert_trees_all_close(out2[:, 0], out[:, 0], atol=1e-5)


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


def test_decoder_kv_cache_decoding_equals_full_causal_pass():
  dec = an.Decoder(num_layers=2, num_heads=2, mlp_dim=16, attention="relu")
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
  memory = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 8))
  mem_mask = jnp.array([[True, True, False], [True, True, True]])
  variables = jax.jit(functools.partial(dec.init, decode=True))(KEY, x, memory)
  params, cache = variables["params"], variables["cache"]
  chex.assert_shape(cache["block_0"]["self_attention"]["cached_key"], (2, 4, 2, 4))
  full = jax.jit(dec.apply)({"params": params}, x, memory, memory_key_mask=mem_mask)

  @jax.jit
  def step(cache, x_t):
    return dec.apply({"params": params, "cache": cache}, x_t, memory, memory_key_mask=mem_mask,
                     decode=True, mutable=["cache"])

  outs = []
  for t in range(4):
    out, mut = step(cache, x[:, t:t + 1])
    cache = mut["cache"]
    outs.append(out)
  chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), full, atol=1e-5)
  assert jnp.max(jnp.abs(full[:, 1:] - full[:, :1])) > 1e-3  # positions really differ


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


def _cbam_reference(p, x, gate_c, gate_s):
  """CBAM (Woo et al. 2018) written out from its parameters, independently of the module."""
  dense = lambda q, v: v @ q["kernel"] + q["bias"]
  mlp = lambda v: dense(p["mlp_expand"], jax.nn.relu(dense(p["mlp_reduce"], v)))
  x = x * gate_c(mlp(x.mean((1, 2))) + mlp(x.max((1, 2))))[:, None, None, :]
  pooled = jnp.stack([x.mean(-1), x.max(-1)], -1)  # [B, H, W, 2]
  conv = jax.lax.conv_general_dilated(pooled, p["spatial_conv"]["kernel"], (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  s = conv[..., 0] + p["spatial_conv"]["bias"][0]  # [B, H, W]
  return x * gate_s(s)[..., None]


def _softmax_gate_over(axes):
  def gate(logits):  # F/ΣF over `axes`, times their size: mean gate 1
    n = np.prod([logits.shape[a] for a in axes])
    return jax.nn.softmax(logits, axis=axes) * n
  return gate


@pytest.mark.parametrize("weighting", [None, "softmax"])
def test_cbam_and_squeeze_excite_match_independent_computation(weighting):
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 4, 4, 6))
  cbam = an.CBAM(reduction=2, kernel_size=3, weighting=weighting)
  params = jax.jit(cbam.init)(KEY, x)
  gate_c, gate_s = ((jax.nn.sigmoid, jax.nn.sigmoid) if weighting is None
                    else (_softmax_gate_over((-1,)), _softmax_gate_over((1, 2))))
  ref = _cbam_reference(params["params"], x, gate_c, gate_s)
  chex.assert_trees_all_close(jax.jit(cbam.apply)(params, x), ref, atol=1e-5)
  se = an.SqueezeExcite(reduction=2, weighting=weighting)
  params = jax.jit(se.init)(KEY, x)
  p = params["params"]
  h = jax.nn.relu(x.mean((1, 2)) @ p["reduce"]["kernel"] + p["reduce"]["bias"])
  ref = x * gate_c(h @ p["expand"]["kernel"] + p["expand"]["bias"])[:, None, None, :]
  chex.assert_trees_all_close(jax.jit(se.apply)(params, x), ref, atol=1e-5)


def test_small_cnn_dtype_and_dropout():
  model = an.SmallCNN(num_classes=3, features=(4,), block_attention="cbam", weighting="softmax",
                      dropout_rate=0.5)
  params = jax.jit(model.init)(KEY, IMAGES)
  apply = jax.jit(model.apply, static_argnames="deterministic")
  out = apply(params, IMAGES)
  chex.assert_shape(out, (2, 3))
  dropped = apply(params, IMAGES, deterministic=False, rngs={"dropout": KEY})
  assert jnp.max(jnp.abs(dropped - out)) > 1e-4
  # bfloat16 computation gives bfloat16 outputs, blocks included.
  for m in (an.SqueezeExcite(reduction=2, dtype=jnp.bfloat16),
            an.CBAM(reduction=2, kernel_size=3, dtype=jnp.bfloat16),
            model.clone(dtype=jnp.bfloat16, block_attention="se")):
    y = jax.jit(m.apply)(jax.jit(m.init)(KEY, IMAGES), IMAGES)
    assert y.dtype == jnp.bfloat16, type(m).__name__


def _nw_data():
  rng = np.random.default_rng(0)
  xt = np.sort(rng.uniform(0, 4, 20)).astype(np.float32)
  yt = (2 * np.sin(xt) + xt + rng.normal(size=20)).astype(np.float32)
  return np.linspace(0, 4, 7).astype(np.float32), xt, yt


def test_nadaraya_watson_fixed_gaussian_equals_numpy():
  xq, xt, yt = _nw_data()
  h = 0.5
  model = an.NadarayaWatsonRegressor(kernel="gaussian", bandwidth=h)
  variables = model.init(KEY, xq, xt, yt)
  assert not variables.get("params")
  k = np.exp(-((xq[:, None] - xt[None]) ** 2) / (2 * h * h))
  ref = (k * yt).sum(1) / k.sum(1)
  np.testing.assert_allclose(model.apply(variables, xq, xt, yt), ref, rtol=1e-5, atol=1e-5)
  # Learned forms start at the same estimator.
  grads = {}
  for mode, name in (("learned_bandwidth", "log_bandwidth"), ("learned_w", "w")):
    m = an.NadarayaWatsonRegressor(kernel="gaussian", bandwidth=h, mode=mode)
    v = m.init(KEY, xq, xt, yt)
    np.testing.assert_allclose(m.apply(v, xq, xt, yt), ref, rtol=1e-5, atol=1e-5)
    loss = lambda p, m=m: jnp.sum((m.apply(p, xq, xt, yt) - 1.0) ** 2)
    grads[name] = float(jax.grad(loss)(v)["params"][name])
    if name == "log_bandwidth":  # against a central finite difference
      eps = 1e-2
      shift = lambda d, v=v: {"params": {"log_bandwidth": v["params"]["log_bandwidth"] + d}}
      fd = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
      np.testing.assert_allclose(grads[name], fd, rtol=2e-2)
  assert grads["w"] != 0
  # w = 1/h = exp(−log h): the two parametrizations' gradients are linked by the chain rule.
  np.testing.assert_allclose(grads["log_bandwidth"], -grads["w"] / h, rtol=1e-4)


def test_nadaraya_watson_dtypes_and_shape_checks():
  xq, xt, yt = _nw_data()
  model = an.NadarayaWatsonRegressor(bandwidth=0.5, mode="learned_bandwidth",
                                     dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  v = model.init(KEY, xq, xt, yt)
  assert v["params"]["log_bandwidth"].dtype == jnp.bfloat16
  out = model.apply(v, xq, xt, yt)
  assert out.dtype == jnp.bfloat16
  ref = an.NadarayaWatsonRegressor(bandwidth=0.5).apply({}, xq, xt, yt)
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=0.1)
  with pytest.raises(AssertionError, match="shape prefix"):  # one target per training point
    model.init(KEY, xq, xt, yt[:-1])
  with pytest.raises(AssertionError, match="shape suffix"):  # same feature dim
    model.init(KEY, np.ones((3, 2)), np.ones((20, 3)), yt)


def _mha():
  return an.MultiHeadAttention(num_heads=2, weighting="sparsemax"), (
      jax.random.normal(KEY, (2, 4, 8)),)


def _vit():
  return an.VisionTransformer(num_classes=3, patch_size=2, attention="relu", **SMALL), (IMAGES,)


def _favor():
  # FAVOR+ also checks that the non-trainable "favor" collection is drawn per seed.
  return an.LinearAttention(num_heads=2, feature_map="favor_plus", num_features=8), (
      jax.random.normal(KEY, (2, 4, 8)),)


@pytest.mark.parametrize("build", [_favor, _mha, _vit], ids=["favor", "mha", "vit"])
def test_vmap_over_params_of_three_seeds_equals_separate_applies(build):
  model, args = build()
  keys = jax.random.split(KEY, 3)
  stacked = jax.jit(jax.vmap(model.init, in_axes=(0,) + (None,) * len(args)))(keys, *args)
  init = jax.jit(model.init)
  for i in range(3):
    chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], stacked), init(keys[i], *args))
  if isinstance(model, an.VisionTransformer):  # else the logits are 0 for every seed
    stacked = jax.vmap(_perturb_head)(stacked, keys)
  outs = jax.jit(jax.vmap(lambda v: model.apply(v, *args)))(stacked)
  apply = jax.jit(lambda v: model.apply(v, *args))
  for i in range(3):
    chex.assert_trees_all_close(outs[i], apply(jax.tree.map(lambda a, i=i: a[i], stacked)),
                                atol=1e-5)
  assert jnp.max(jnp.abs(outs[0] - outs[1])) > 1e-3  # each seed uses its own parameters
  if "favor" in stacked:
    assert not np.allclose(stacked["favor"]["omega"][0], stacked["favor"]["omega"][1])
