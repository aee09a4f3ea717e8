"""The attention modules are interchangeable: one call, one mask convention, keyword fields.

MultiHeadAttention, MetricAttention (= MultiHeadAttention(score="metric")), LinearAttention and
AdditiveAttention take ``(inputs_q, inputs_kv, *, mask, deterministic, decode)`` with a boolean
mask broadcastable to [B, N, T, S] (True = attend), so a transformer block calls any of them
the same way.

Cross-cutting: these tests run every attention module through one interface, so they are kept
together here rather than in each module's test_<module>.py (MetricAttention's equivalence to
MultiHeadAttention(score="metric") is in test_metric.py).
"""

import chex
import jax
import jax.numpy as jnp
import pytest

import attnx.nn as an
from attnx.nn.transformer import call_attention

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 8))
VALID = jnp.array([[True] * 4 + [False] * 2, [True] * 5 + [False]])  # [B, S] key padding
MASK = VALID[:, None, None, :]  # the [B, N, T, S] convention
TYPES = ("dot", "linear", "metric", "additive")
CLASSES = {"dot": an.MultiHeadAttention, "linear": an.LinearAttention,
           "metric": an.MetricAttention, "additive": an.AdditiveAttention}


@pytest.mark.parametrize("kind", TYPES)
def test_every_attention_type_works_in_an_encoder_block_with_one_mask(kind):
  block = an.EncoderBlock(num_heads=2, mlp_dim=16, attention={"type": kind})
  attn = an.make_attention({"type": kind}, num_heads=2)
  assert type(attn) is CLASSES[kind]
  # Padded positions hold different values in x and x2: only masking hides them.
  x2 = jnp.where(VALID[..., None], X, 5.0 * jax.random.normal(jax.random.PRNGKey(2), X.shape))

  @jax.jit
  def run(x, x2):
    params = block.init(KEY, x)
    apply = lambda x, **kw: block.apply(params, x, **kw)
    a_params = attn.init(KEY, x)
    direct = lambda x, mask: attn.apply(a_params, x, None, mask=mask, deterministic=True,
                                        decode=False)
    return (apply(x, mask=MASK), apply(x, key_mask=VALID), apply(x2, mask=MASK), apply(x),
            apply(x2), direct(x, MASK), direct(x2, MASK))

  by_mask, by_key_mask, by_mask2, unmasked, unmasked2, direct, direct2 = run(X, x2)
  chex.assert_shape((by_mask, direct), ((2, 6, 8), (2, 6, 8)))
  chex.assert_trees_all_close(by_mask, by_key_mask, atol=1e-6)  # one convention, two spellings
  real = VALID[..., None]
  for a, b in ((by_mask, by_mask2), (direct, direct2)):  # masked keys change nothing ...
    chex.assert_trees_all_close(jnp.where(real, a, 0), jnp.where(real, b, 0), atol=1e-5)
  # ... and without the mask they do: the mask is what hides them.
  assert jnp.max(jnp.abs(jnp.where(real, unmasked - unmasked2, 0))) > 1e-3, kind


def test_what_a_module_cannot_do_raises_clearly():
  general = jnp.tril(jnp.ones((6, 6), bool))[None, None]  # [1, 1, T, S]: not key padding
  lin = an.LinearAttention(num_heads=2)
  params = lin.init(KEY, X)
  with pytest.raises(ValueError, match=r"only key padding masks.*\(1, 1, 6, 6\).*is_causal"):
    lin.apply(params, X, mask=general)
  with pytest.raises(ValueError, match="general"):
    an.EncoderBlock(num_heads=2, mlp_dim=8, attention="linear_elu").init(KEY, X, mask=general)
  for module in (lin, an.AdditiveAttention(), an.LuongAttention(score="dot")):
    with pytest.raises(ValueError, match="decode=True.*MultiHeadAttention"):
      module.init(KEY, X, decode=True)
  with pytest.raises(ValueError, match="decode=True"):
    an.Decoder(num_layers=1, num_heads=2, mlp_dim=8, attention={"type": "additive"}).init(
        KEY, X, X, decode=True)


@pytest.mark.parametrize("build,match", [
    (lambda: an.MultiHeadAttention(num_heads=4, score="metric", num_kv_heads=2),
     "num_kv_heads=2 does not apply"),
    (lambda: an.MultiHeadAttention(num_heads=2, score="metric", qk_norm=True),
     "qk_norm does not apply"),
    (lambda: an.MultiHeadAttention(num_heads=2, score="metric", scale=0.0), "τ > 0"),
    (lambda: an.MultiHeadAttention(num_heads=2, learn_temperature=True),
     "learn_temperature applies only"),
    (lambda: an.MetricAttention(num_heads=2, score="scaled_dot"), "use MultiHeadAttention"),
    (lambda: an.MetricAttention(num_heads=2, rank=2, score_dim=3), "give one"),
    (lambda: an.MetricAttention(num_heads=2, rank=0), "rank must be positive"),
    (lambda: an.MultiHeadAttention(num_heads=2, implementation="blocked", dropout_rate=0.1),
     "dropout_rate > 0 needs the attention weights.*'dense'"),
    (lambda: an.MultiHeadAttention(num_heads=2, implementation="blocked", sow_weights=True),
     "sow_weights=True needs the attention weights"),
    (lambda: an.AdditiveAttention(num_heads=0), "num_heads must be positive"),
])
def test_bad_attention_configuration_raises_at_construction(build, match):
  with pytest.raises(ValueError, match=match):
    build()


@pytest.mark.parametrize("build", [
    lambda: an.MultiHeadAttention(2), lambda: an.MetricAttention(2),
    lambda: an.LinearAttention(2), lambda: an.AdditiveAttention(4),
    lambda: an.LuongAttention("dot"), lambda: an.EncoderBlock(2, 8),
    lambda: an.Encoder(1, 2, 8), lambda: an.VisionTransformer(3),
    lambda: an.SequenceClassifier(5, 2), lambda: an.RNNSeq2Seq(10), lambda: an.SmallCNN(3),
    lambda: an.SqueezeExcite(2), lambda: an.NadarayaWatsonRegressor("gaussian"),
])
def test_modules_are_built_with_keyword_arguments(build):
  with pytest.raises(TypeError, match="positional"):
    build()


def test_blocks_call_any_attention_the_same_way():
  # call_attention has no isinstance dispatch: any callable with the common call works, and
  # gets the block's masks as one mask of the [B, N, T, S] convention.
  calls = []

  def attention(x, kv, *, mask, deterministic, decode):
    calls.append(dict(kv=kv, mask=mask, deterministic=deterministic, decode=decode))
    return x

  out = call_attention(attention, X, None, mask=None, key_mask=VALID, deterministic=True)
  chex.assert_trees_all_equal(out, X)
  chex.assert_trees_all_equal(calls[-1]["mask"], MASK)
  general = jnp.tril(jnp.ones((6, 6), bool))[None, None]
  call_attention(attention, X, X, mask=general, key_mask=VALID, deterministic=False,
                 decode=True)
  chex.assert_trees_all_equal(calls[-1]["mask"], general & MASK)
  assert calls[-1]["kv"] is X and calls[-1]["decode"] and not calls[-1]["deterministic"]


def test_attention_weights_dtype_and_jit_for_each_family():
  for model in (an.MetricAttention(num_heads=2, dtype=jnp.bfloat16),
                an.LinearAttention(num_heads=2, dtype=jnp.bfloat16),
                an.MultiHeadAttention(num_heads=2, dtype=jnp.bfloat16, weighting="sparsemax")):
    params = model.init(KEY, X)
    out = jax.jit(model.apply)(params, X)
    assert out.dtype == jnp.bfloat16, type(model).__name__
    chex.assert_tree_all_finite(out)
