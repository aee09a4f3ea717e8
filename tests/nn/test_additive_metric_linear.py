"""Bahdanau/Luong attention against their formulas; metric attention; linear attention."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.nn import (
    AdditiveAttention,
    LinearAttention,
    LuongAttention,
    MetricAttention,
    MultiHeadAttention,
    redraw_features,
)

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
Q = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 6))


def test_additive_matches_bahdanau_formula_and_masks():
  model = AdditiveAttention(attention_dim=5)
  params = model.init(KEY, Q, X)
  p = params["params"]
  mask = jnp.arange(4)[None, None, None, :] < 3  # [B, N, T, S] convention: drop the last key
  ctx, w = model.apply(params, Q, X, mask=mask, return_weights=True)
  s = jnp.einsum("btsa,a->bts", jnp.tanh((Q @ p["query_kernel"])[:, :, None]
                                         + (X @ p["key_kernel"])[:, None]), p["score_v"])
  ref_w = jax.nn.softmax(jnp.where(mask[:, 0], s, -jnp.inf), axis=-1)
  chex.assert_shape(w, (2, 1, 3, 4))  # [B, N, T, S] with one head
  chex.assert_trees_all_close(w[:, 0], ref_w, atol=1e-5)
  chex.assert_trees_all_close(ctx, ref_w @ X, atol=1e-5)
  # One decoder step: query [B, Dq] -> context [B, Dv], weights [B, N, S]; the same mask.
  c1, w1 = model.apply(params, Q[:, 0], X, mask=mask, return_weights=True)
  chex.assert_trees_all_close((c1, w1), (ctx[:, 0], w[:, :, 0]), atol=1e-5)


def test_multi_head_additive_heads_attend_their_value_slices():
  model = AdditiveAttention(num_heads=2, attention_dim=5)
  params = model.init(KEY, Q, X)
  p = params["params"]
  chex.assert_shape((p["query_kernel"], p["key_kernel"], p["score_v"]),
                    ((2, 6, 5), (2, 8, 5), (5,)))
  ctx, w = model.apply(params, Q, X, return_weights=True)
  for h in range(2):  # head h: Bahdanau's score with its own W_q, W_k; values [:, :, 4h:4h+4]
    s = jnp.einsum("btsa,a->bts", jnp.tanh((Q @ p["query_kernel"][h])[:, :, None]
                                           + (X @ p["key_kernel"][h])[:, None]), p["score_v"])
    ref_w = jax.nn.softmax(s, axis=-1)
    chex.assert_trees_all_close(w[:, h], ref_w, atol=1e-5)
    chex.assert_trees_all_close(ctx[..., 4 * h:4 * h + 4], ref_w @ X[..., 4 * h:4 * h + 4],
                                atol=1e-5)
  assert jnp.max(jnp.abs(w[:, 0] - w[:, 1])) > 1e-3  # the heads differ


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
def test_luong_scores_match_their_formulas(score):
  q = Q if score != "dot" else X[:, :3]
  model = LuongAttention(score=score, weighting="sparsemax")
  params = model.init(KEY, q, X)
  p = params.get("params", {})  # "dot" has none
  ctx, w = model.apply(params, q, X, return_weights=True)
  w = w[:, 0]  # one head
  # Scores computed here from the parameters, independently of attnx.core's score functions.
  if score == "dot":
    s = jnp.einsum("btd,bsd->bts", q, X)
  elif score == "general":  # qᵀ W k
    s = jnp.einsum("btd,de,bse->bts", q, p["general_kernel"], X)
  else:  # vᵀ tanh(W [q; k]) with W = [W_q; W_k] stacked over the concatenated features
    pairs = jnp.concatenate([jnp.broadcast_to(q[:, :, None], (2, 3, 4, q.shape[-1])),
                             jnp.broadcast_to(X[:, None], (2, 3, 4, 8))], -1)
    big_w = jnp.concatenate([p["query_kernel"], p["key_kernel"]], axis=0)
    s = jnp.tanh(pairs @ big_w) @ p["score_v"]
  ref = core.weights(s, "sparsemax")
  assert jnp.max(jnp.abs(s - s.mean(-1, keepdims=True))) > 1e-2  # a score that varies
  chex.assert_trees_all_close(w, ref, atol=1e-5)
  chex.assert_trees_all_close(ctx, ref @ X, atol=1e-5)


@pytest.mark.parametrize("module", [AdditiveAttention(attention_dim=5, dropout_rate=0.5),
                                    LuongAttention(score="concat", dropout_rate=0.5)],
                         ids=["additive", "luong"])
def test_additive_and_luong_dropout_on_weights(module):
  params = module.init(KEY, Q, X)
  ctx, w = module.apply(params, Q, X, return_weights=True)
  # One-hot values make the output the weights actually used: w ⊙ keep / (1 − rate).
  eye = jnp.broadcast_to(jnp.eye(4), (2, 4, 4))
  rngs = {"dropout": jax.random.PRNGKey(3)}
  used, w2 = module.apply(params, Q, X, eye, return_weights=True, deterministic=False,
                          rngs=rngs)
  chex.assert_trees_all_equal(w2, w)  # returned weights are before dropout
  dropped = jnp.abs(used) < 1e-7
  assert jnp.all(dropped | (jnp.abs(used - 2 * w[:, 0]) < 1e-5))  # one head
  assert 0 < jnp.mean(dropped) < 1
  # Deterministic (the default) ignores dropout_rate.
  chex.assert_trees_all_close(module.clone(dropout_rate=0.0).apply(params, Q, X), ctx)


def test_metric_attention_is_a_learned_mahalanobis_metric():
  model = MetricAttention(num_heads=2, rank=3, weighting="softmax")
  params = model.init(KEY, X)
  p = params["params"]
  _, w = model.apply(params, X, return_weights=True)
  L = p["metric"]["kernel"]  # [D, N, R]
  tau = jnp.exp(p["log_temperature"])  # [N]
  z = jnp.einsum("btd,dnr->bntr", X, L)
  d2 = jnp.sum((z[:, :, :, None] - z[:, :, None]) ** 2, -1)
  ref = jax.nn.softmax(-tau[None, :, None, None] * d2, axis=-1)
  chex.assert_trees_all_close(w, ref, atol=1e-5)


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


def test_attention_weights_dtype_and_jit_for_each_family():
  for model in (MetricAttention(num_heads=2, dtype=jnp.bfloat16),
                LinearAttention(num_heads=2, dtype=jnp.bfloat16),
                MultiHeadAttention(num_heads=2, dtype=jnp.bfloat16, weighting="sparsemax")):
    params = model.init(KEY, X)
    out = jax.jit(model.apply)(params, X)
    assert out.dtype == jnp.bfloat16, type(model).__name__
    chex.assert_tree_all_finite(out)
