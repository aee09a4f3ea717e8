"""Every registered weighting × every attention module: forward and backward are finite."""

import chex
import jax
import jax.numpy as jnp
import pytest

from attnx import core
from attnx.nn import AdditiveAttention, LuongAttention, MetricAttention, MultiHeadAttention
from attnx.nn.spec import DISTANCE_KERNELS

X = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
MASK = jnp.arange(4)[None, :] < jnp.array([[4], [3]])  # [B, S] key padding


def _score(weighting: str) -> str:
  # Distance kernels are functions of −‖q − k‖²; everything else gets the scaled dot product.
  return "neg_sq_dist" if weighting in DISTANCE_KERNELS else "scaled_dot"


def _modules(w: str):
  return {
      "mha": (MultiHeadAttention(num_heads=2, weighting=w, score=_score(w), is_causal=True),
              lambda m, p: m.apply(p, X, mask=MASK[:, None, None, :])),
      "metric": (MetricAttention(num_heads=2, weighting=w),
                 lambda m, p: m.apply(p, X, mask=MASK[:, None, None, :])),
      "additive": (AdditiveAttention(weighting=w),
                   lambda m, p: m.apply(p, X, X, mask=MASK[:, None, :])),
      "luong_general": (LuongAttention("general", weighting=w),
                        lambda m, p: m.apply(p, X, X, mask=MASK[:, None, :])),
  }


@pytest.mark.parametrize("weighting", core.list_weightings())
def test_every_module_runs_forward_and_backward(weighting):
  for name, (module, call) in _modules(weighting).items():
    params = module.init(jax.random.PRNGKey(0), X, X)
    def loss(p, m=module, c=call):
      out = c(m, p)
      return jnp.sum(jnp.square(out)), out
    (value, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
    chex.assert_shape(out, (2, 4, 8))
    chex.assert_tree_all_finite((value, grads, out))
    if name == "metric" and weighting == "softmax":  # the learned temperature trains
      assert jnp.all(grads["params"]["log_temperature"] != 0)
    assert name and value >= 0
