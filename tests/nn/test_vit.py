"""attnx.nn.vit: VisionTransformer shapes, zero-initialized head, per-image independence.

Inits and applies are jitted: compiling a whole model once is several times cheaper than
dispatching (and compiling) its ops one by one.
"""

import chex
import jax
import jax.numpy as jnp
from support.nn_models import perturb_head

import attnx.nn as an

KEY = jax.random.PRNGKey(0)
SMALL = dict(hidden_dim=8, num_layers=1, num_heads=2, mlp_dim=16)
IMAGES = jax.random.normal(KEY, (2, 4, 4, 3))


def test_vision_transformer():
  vit = an.VisionTransformer(num_classes=4, patch_size=2, pool="cls",
                             attention={"weighting": "relu"}, **SMALL)
  params = jax.jit(vit.init)(KEY, IMAGES)
  apply = jax.jit(vit.apply)
  assert jnp.all(apply(params, IMAGES) == 0)  # the zero-initialized head
  params = perturb_head(params, KEY)
  logits = apply(params, IMAGES)
  chex.assert_shape(logits, (2, 4))
  assert jnp.min(jnp.abs(logits)) > 0 and jnp.max(jnp.abs(logits[0] - logits[1])) > 1e-3
  # Images are classified independently: reversing the batch reverses the logits.
  chex.assert_trees_all_close(apply(params, IMAGES[::-1]), logits[::-1], atol=1e-5)
