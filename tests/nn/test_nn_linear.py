"""attnx.nn.linear: LinearAttention against its formula and key mask; FAVOR+ features."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from attnx.nn import LinearAttention, redraw_features

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))


def test_linear_attention_elu_matches_formula_and_key_mask():
  model = LinearAttention(num_heads=2, feature_map="elu_plus_one")
  params = model.init(KEY, X)
  mask = jnp.array([[True, True, True, False], [True, True, False, False]])[:, None, None, :]
  out = model.apply(params, X, mask=mask)
  # The same model with padded keys removed from the inputs gives the same first row.
  short = model.apply(params, X[:1], X[:1, :3])
  chex.assert_trees_all_close(out[:1], short, atol=1e-5)
  causal = LinearAttention(num_heads=2, is_causal=True)
  g = jax.grad(lambda x: jnp.sum(causal.apply(params, x)[:, 1]))(X)
  assert jnp.all(g[:, 2:] == 0)


def test_favor_features_variable_and_redraw():
  model = LinearAttention(num_heads=2, feature_map="favor_plus", num_features=16)
  variables = model.init(KEY, X)
  chex.assert_shape(variables["favor"]["omega"], (16, 4))
  assert "omega" not in variables["params"]  # not trainable
  out = model.apply(variables, X)
  chex.assert_tree_all_finite(out)
  out2, state = model.apply(variables, X, redraw=True, rngs={"favor": jax.random.PRNGKey(9)},
                            mutable=["favor"])
  assert not np.allclose(state["favor"]["omega"], variables["favor"]["omega"])
  chex.assert_trees_all_close(model.apply({**variables, **state}, X), out2)
  new = redraw_features(variables, jax.random.PRNGKey(3))
  chex.assert_trees_all_equal_shapes(new, variables)
  assert not np.allclose(new["favor"]["omega"], variables["favor"]["omega"])
