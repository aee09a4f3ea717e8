"""Cross-cutting: every attnx.nn module raises a clear error for a bad configuration.

One table over all the modules (construction-time checks, distance kernels on similarity
scores, shapes known only at call time), so it does not belong to one module's test file.
"""

import jax
import jax.numpy as jnp
import pytest

import attnx.nn as an
from attnx import core

X = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))


@pytest.mark.parametrize("build,match", [
    (lambda: an.MultiHeadAttention(num_heads=2, weighting="nope"), "Valid weightings"),
    (lambda: an.MultiHeadAttention(num_heads=3, qkv_features=8), "not divisible"),
    (lambda: an.MultiHeadAttention(num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
    (lambda: an.MultiHeadAttention(num_heads=2, score="additive", implementation="blocked"),
     "cannot stream"),
    (lambda: an.MultiHeadAttention(num_heads=2, weighting=core.RowNormalizer(
        name="row_softmax", fn=lambda s, w, ax: s), implementation="blocked"),
     "no streaming form"),
    (lambda: an.MultiHeadAttention(num_heads=2, implementation="fast"), "Unknown implementation"),
    (lambda: an.MultiHeadAttention(num_heads=2, score="nope"), "Valid scores"),
    (lambda: an.LuongAttention(score="bilinear"), "unknown Luong score"),
    (lambda: an.LinearAttention(num_heads=2, feature_map="relu"), "unknown feature_map"),
    (lambda: an.MetricAttention(num_heads=2, weighting="nope"), "Valid weightings"),
    (lambda: an.RNNSeq2Seq(src_vocab_size=10, attention_type="dot"), "unknown attention_type"),
    (lambda: an.EncoderBlock(num_heads=2, mlp_dim=8, attention={"type": "sparse"}),
     "Unknown attention type"),
    (lambda: an.VisionTransformer(num_classes=3, hidden_dim=10, num_heads=4), "not divisible"),
    (lambda: an.SequenceClassifier(vocab_size=5, num_classes=2, pool="max"), "unknown pool"),
    (lambda: an.NadarayaWatsonRegressor(mode="adaptive"), "unknown mode"),
    (lambda: an.SmallCNN(num_classes=3, block_attention="eca"), "unknown block_attention"),
    (lambda: an.MetricAttention(num_heads=2, dropout_rate=1.0),
     r"dropout_rate must be in \[0, 1\)"),
    (lambda: an.MetricAttention(num_heads=2, dropout_rate=-0.1), "dropout_rate must be"),
    (lambda: an.AdditiveAttention(dropout_rate=1.0), "dropout_rate must be"),
    (lambda: an.LuongAttention(score="dot", dropout_rate=-1), "dropout_rate must be"),
    (lambda: an.RNNSeq2Seq(src_vocab_size=10, attention_dropout_rate=1.0), "dropout_rate must be"),
    (lambda: an.SmallCNN(num_classes=3, dropout_rate=2.0), "dropout_rate must be"),
    (lambda: an.MultiHeadAttention(num_heads=2, score="metric", score_dim=0), "positive"),
    (lambda: an.MultiHeadAttention(num_heads=2, score_dim=4), "score_dim applies only"),
    (lambda: an.MultiHeadAttention(num_heads=2, score="bilinear", score_dim=4),
     "score_dim applies only"),
])
def test_bad_configuration_raises_at_construction(build, match):
  with pytest.raises(ValueError, match=match):
    build()


# A distance kernel (a function of ‖q − k‖ that reads the score as −d²) on a similarity score.
@pytest.mark.parametrize("build", [
    lambda: an.MultiHeadAttention(num_heads=2, weighting="gaussian"),
    lambda: an.MultiHeadAttention(num_heads=2, weighting="boxcar", score="bilinear"),
    lambda: an.AdditiveAttention(weighting="triangular"),
    lambda: an.LuongAttention(score="dot", weighting="epanechnikov"),
    lambda: an.LuongAttention(score="general", weighting="gaussian:h=2"),
    lambda: an.LuongAttention(score="concat", weighting="boxcar"),
    lambda: an.RNNSeq2Seq(src_vocab_size=10, weighting="gaussian"),
    lambda: an.RNNSeq2Seq(src_vocab_size=10, attention_type="luong_dot", weighting="triangular"),
    lambda: an.SqueezeExcite(weighting="gaussian"),
    lambda: an.CBAM(weighting="epanechnikov"),
    lambda: an.SmallCNN(num_classes=3, weighting="boxcar"),
    lambda: an.EncoderBlock(num_heads=2, mlp_dim=8,
                            attention={"weighting": "gaussian", "score": "scaled_dot"}),
    lambda: an.DecoderBlock(num_heads=2, mlp_dim=8,
                            cross_attention={"weighting": "boxcar", "score": "cosine"}),
    lambda: an.VisionTransformer(num_classes=3,
                                 attention={"weighting": "gaussian", "score": "dot"}),
    lambda: an.Seq2Seq(src_vocab_size=10,
                       attention={"weighting": "triangular", "score": "additive"}),
    lambda: an.SequenceClassifier(vocab_size=5, num_classes=2,
                                  attention={"weighting": "epanechnikov",
                                             "score": "scaled_dot"}),
    lambda: core.flax_attention_fn("gaussian"),
])
def test_distance_kernel_on_a_similarity_score_raises_at_construction(build):
  with pytest.raises(ValueError, match="is not a distance"):
    build()


def test_distance_kernels_with_distance_scores_build():
  an.MultiHeadAttention(num_heads=2, weighting="gaussian", score="neg_sq_dist")
  an.MultiHeadAttention(num_heads=2, weighting="boxcar", score="metric", score_dim=2)
  an.MetricAttention(num_heads=2, weighting="triangular")
  # F is unused without attention.
  an.RNNSeq2Seq(src_vocab_size=10, attention_type="none", weighting="gaussian")
  an.EncoderBlock(num_heads=2, mlp_dim=8, attention={"type": "metric", "weighting": "epanechnikov"})


def test_bad_shapes_raise_clear_errors():
  model = an.MultiHeadAttention(num_heads=2, qkv_features=6)
  with pytest.raises(ValueError, match="not divisible"):  # known only at call time
    an.MultiHeadAttention(num_heads=4).init(jax.random.PRNGKey(0), jnp.ones((2, 3, 6)))
  with pytest.raises(AssertionError, match="rank"):
    model.init(jax.random.PRNGKey(0), X, jnp.ones((4, 8)))
  with pytest.raises(ValueError, match="patch_size"):
    an.VisionTransformer(num_classes=3, patch_size=3, **dict(hidden_dim=8, num_heads=2)).init(
        jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 1)))
  with pytest.raises(ValueError, match="general"):
    an.EncoderBlock(num_heads=2, mlp_dim=8, attention="linear_elu").init(
        jax.random.PRNGKey(0), X, mask=jnp.ones((1, 1, 4, 4), bool))
