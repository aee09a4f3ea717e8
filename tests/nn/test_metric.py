"""attnx.nn.metric: MetricAttention is a learned Mahalanobis metric and is
MultiHeadAttention(score="metric"), KV cache included."""

import chex
import jax
import jax.numpy as jnp
import pytest

import attnx.nn as an
from attnx.nn import MetricAttention

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 8))
VALID = jnp.array([[True] * 4 + [False] * 2, [True] * 5 + [False]])  # [B, S] key padding
MASK = VALID[:, None, None, :]  # the [B, N, T, S] convention


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


def test_metric_attention_is_multi_head_attention_with_the_metric_score():
  assert issubclass(an.MetricAttention, an.MultiHeadAttention)
  kw = dict(num_heads=2, weighting="sparsemax", dropout_rate=0.3)
  for metric_kw, mha_kw in ((dict(rank=3), dict(score_dim=3)),
                            (dict(learn_temperature=False, scale=0.7),
                             dict(learn_temperature=False, scale=0.7))):
    metric = an.MetricAttention(**kw, **metric_kw)
    mha = an.MultiHeadAttention(score="metric", **kw, **mha_kw)
    params = metric.init(KEY, X)
    chex.assert_trees_all_equal(mha.init(KEY, X), params)  # the same parameters ...
    rngs = {"dropout": jax.random.PRNGKey(3)}
    for det in (True, False):  # ... and the same function, dropout included
      a = metric.apply(params, X, mask=MASK, deterministic=det, return_weights=True, rngs=rngs)
      b = mha.apply(params, X, mask=MASK, deterministic=det, return_weights=True, rngs=rngs)
      chex.assert_trees_all_equal(a, b)
    assert ("log_temperature" in params["params"]) == ("rank" in metric_kw)
  # A different rank is a different model: rank is MetricAttention's name for score_dim.
  chex.assert_shape(an.MetricAttention(num_heads=2, rank=3).clone(rank=2).init(
      KEY, X)["params"]["metric"]["kernel"], (8, 2, 2))


def test_metric_score_decodes_with_a_kv_cache():
  model = an.MetricAttention(num_heads=2, is_causal=True)
  variables = model.init(KEY, X, decode=True)
  full = model.apply(variables, X)
  cache, steps = variables["cache"], []
  for t in range(X.shape[1]):
    out, mut = model.apply({"params": variables["params"], "cache": cache}, X[:, t:t + 1],
                           decode=True, mutable=["cache"])
    cache = mut["cache"]
    steps.append(out)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_metric_score_needs_one_input_space():
  model = an.MultiHeadAttention(num_heads=2, score="metric")
  with pytest.raises(ValueError, match="equal features"):
    model.init(KEY, X, jnp.ones((2, 3, 6)))
