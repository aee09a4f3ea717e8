"""attnx.nn.channel_spatial: CBAM and squeeze-excite against independent computations;
SmallCNN dtype and dropout."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
IMAGES = jax.random.normal(KEY, (2, 4, 4, 3))


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
