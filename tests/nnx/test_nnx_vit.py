"""attnx.nnx.VisionTransformer and Encoder against the linen ViT with the same weights."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attnx import nn as attnx_nn
from attnx import nnx as anx

IMAGES = jax.random.normal(jax.random.key(0), (2, 8, 12, 3))
KW = dict(num_classes=5, patch_size=4, hidden_dim=16, num_layers=2, num_heads=2, mlp_dim=32)
CONFIGS = {
    "cls_softmax": dict(),
    "mean_relu": dict(pool="mean", attention="relu"),
    "metric_entmax": dict(attention={"type": "metric", "weighting": "entmax15"}),
}


def _nnx(extra, seed=0):
  return anx.VisionTransformer(**{**KW, **extra}, image_size=(8, 12), in_channels=3,
                               rngs=nnx.Rngs(seed))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_logits_and_gradients_equal_the_linen_vit_with_the_same_weights(case):
  model, linen = _nnx(CONFIGS[case]), attnx_nn.VisionTransformer(**KW, **CONFIGS[case])
  params = jax.tree.map(jnp.asarray, nnx.state(model, nnx.Param).to_pure_dict())
  chex.assert_trees_all_equal_shapes(params, linen.init(jax.random.key(1), IMAGES)["params"])
  # The head starts at zero in both: move it so that the gradients reach every layer.
  params["head"]["kernel"] = jax.random.normal(jax.random.key(2), params["head"]["kernel"].shape)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  chex.assert_trees_all_close(model(IMAGES), linen.apply({"params": params}, IMAGES), atol=1e-5)
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  go = jax.grad(lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p, rest)(IMAGES))))(state)
  gf = jax.grad(lambda p: jnp.sum(jnp.sin(linen.apply({"params": p}, IMAGES))))(params)
  chex.assert_trees_all_close(go.to_pure_dict(), gf, atol=1e-5, rtol=1e-5)


def test_a_linen_checkpoint_loads_into_the_nnx_vit():
  linen = attnx_nn.VisionTransformer(**KW, attention="sigmoid")
  params = linen.init(jax.random.key(4), IMAGES)["params"]
  model = _nnx(dict(attention="sigmoid"))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  chex.assert_trees_all_close(model(IMAGES), linen.apply({"params": params}, IMAGES), atol=1e-6)


def test_the_encoder_equals_the_linen_encoder():
  x = jax.random.normal(jax.random.key(5), (2, 6, 16))
  model = anx.Encoder(16, 2, 2, 32, attention="softpick", is_causal=True, rngs=nnx.Rngs(0))
  linen = attnx_nn.Encoder(num_layers=2, num_heads=2, mlp_dim=32, attention="softpick",
                           is_causal=True)
  params = jax.tree.map(jnp.asarray, nnx.state(model, nnx.Param).to_pure_dict())
  key_mask = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
  chex.assert_trees_all_close(model(x, key_mask=key_mask),
                              linen.apply({"params": params}, x, key_mask=key_mask), atol=1e-5)


@pytest.mark.parametrize("kw, images, match", [
    (dict(pool="max"), None, "pool"),
    (dict(hidden_dim=15), None, "divisible"),
    (dict(attention="linear_elu"), None, "attention types"),
    (dict(), jnp.zeros((2, 8, 8, 3)), "image_size"),
])
def test_bad_configurations_and_images_raise(kw, images, match):
  with pytest.raises(ValueError, match=match):
    model = _nnx(kw)
    model(images)
  with pytest.raises(ValueError, match="patch_size"):
    anx.VisionTransformer(**KW, image_size=10, in_channels=3, rngs=nnx.Rngs(0))
