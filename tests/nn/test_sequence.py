"""attnx.nn.sequence: SequenceClassifier pooling and padding, SequenceRegressor causality.

Inits and applies are jitted: compiling a whole model once is several times cheaper than
dispatching (and compiling) its ops one by one.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
SMALL = dict(hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=16)
TOKENS = jnp.array([[3, 4, 5, 0, 0], [2, 2, 2, 2, 1]])


class _ShortConv(nn.Module):
  @nn.compact
  def __call__(self, x):
    return an.sequence.short_convolution(x, 3)


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


def test_sequence_regressor_is_causal_by_default():
  reg = an.SequenceRegressor(out_dim=2, max_len=8, **SMALL)
  x = jax.random.normal(KEY, (2, 5, 3))
  params = jax.jit(reg.init)(KEY, x)
  apply = jax.jit(reg.apply)
  out = apply(params, x)
  chex.assert_shape(out, (2, 5, 2))
  # Causal by default: the first prediction ignores later tokens.
  out2 = apply(params, x.at[:, 1:].set(0.0))
  chex.assert_trees_all_close(out2[:, 0], out[:, 0], atol=1e-5)


def test_short_convolution_is_a_causal_depthwise_filter():
  x = jax.random.normal(KEY, (2, 6, 3))
  conv = _ShortConv()
  params = jax.jit(conv.init)(KEY, x)
  out = conv.apply(params, x)
  w = params["params"]["short_conv"]["kernel"]  # [width, 1, D]
  b = params["params"]["short_conv"]["bias"]
  # Brute force: y_t = Σ_i w[i] · x_{t − (width − 1) + i} + b, zero before the start.
  xp = jnp.pad(x, ((0, 0), (2, 0), (0, 0)))
  want = sum(w[i, 0] * xp[:, i:i + 6] for i in range(3)) + b
  chex.assert_trees_all_close(out, want, atol=1e-5)


def test_sequence_classifier_short_conv_stays_causal_and_checks_its_width():
  model = an.SequenceClassifier(vocab_size=10, num_classes=3, max_len=8, pool="none",
                                is_causal=True, short_conv=3,
                                attention=an.attention_spec("linear_elu"), **SMALL)
  params = jax.jit(model.init)(KEY, TOKENS)
  assert params["params"]["short_conv"]["kernel"].shape == (3, 1, SMALL["hidden_dim"])
  apply = jax.jit(model.apply)
  out = apply(params, TOKENS)
  # Changing token 3 leaves positions 0..2 unchanged and changes position 3.
  out2 = apply(params, TOKENS.at[:, 3].set(7))
  chex.assert_trees_all_close(out2[:, :3], out[:, :3], atol=1e-5)
  assert not jnp.allclose(out2[:, 3], out[:, 3])
  with pytest.raises(ValueError, match="short_conv"):
    an.SequenceClassifier(vocab_size=10, num_classes=3, short_conv=-1)

