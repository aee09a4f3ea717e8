"""Cross-cutting: models vmapped over the parameters of three seeds equal separate applies.

One test over three kinds of parameter collection (MultiHeadAttention's, FAVOR+'s
non-trainable "favor" features, the Vision Transformer's zero-initialized head), so it does
not belong to one module's test file.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.nn_models import perturb_head

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
SMALL = dict(hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=16)
IMAGES = jax.random.normal(KEY, (2, 4, 4, 3))


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
    stacked = jax.vmap(perturb_head)(stacked, keys)
  outs = jax.jit(jax.vmap(lambda v: model.apply(v, *args)))(stacked)
  apply = jax.jit(lambda v: model.apply(v, *args))
  for i in range(3):
    chex.assert_trees_all_close(outs[i], apply(jax.tree.map(lambda a, i=i: a[i], stacked)),
                                atol=1e-5)
  assert jnp.max(jnp.abs(outs[0] - outs[1])) > 1e-3  # each seed uses its own parameters
  if "favor" in stacked:
    assert not np.allclose(stacked["favor"]["omega"][0], stacked["favor"]["omega"][1])
