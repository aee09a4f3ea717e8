"""attnx.nn.additive: Bahdanau (AdditiveAttention) and Luong attention against their formulas."""

import chex
import jax
import jax.numpy as jnp
import pytest

from attnx import core
from attnx.nn import AdditiveAttention, LuongAttention

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
