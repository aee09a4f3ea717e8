"""attnx.nnx.MultiHeadAttention: against flax.nnx.MultiHeadAttention (softmax, argument by
argument) and against attnx.nn.MultiHeadAttention (linen) with the same parameters for every
attnx option."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnx import nn as attnx_nn
from attnx import nnx as anx

X = jax.random.normal(jax.random.key(0), (2, 7, 16))
XK = jax.random.normal(jax.random.key(1), (2, 5, 12))
XV = jax.random.normal(jax.random.key(2), (2, 5, 12))
MASK = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 7, 7)).at[..., 0].set(True)


def _pair(**kw):
  """(attnx's, Flax's) module from the same Rngs: the same parameters."""
  kw.setdefault("num_heads", 4)
  kw.setdefault("in_features", 16)
  return (anx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0, dropout=7)),
          nnx.MultiHeadAttention(**kw, decode=False, rngs=nnx.Rngs(0, dropout=7)))


def _params(module):
  return nnx.state(module, nnx.Param)


def _loss_grad(module, *args, **kw):
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(p):
    m = nnx.merge(graphdef, p, rest)
    return jnp.sum(jnp.sin(m(*args, **kw)))

  return jax.value_and_grad(loss)(params)


CASES = {
    "self": (dict(), (X,), {}),
    "mask": (dict(), (X,), dict(mask=MASK)),
    "causal": (dict(), (X,), dict(is_causal=True)),
    "gqa_qk_norm": (dict(num_kv_heads=2, normalize_qk=True), (X,), dict(is_causal=True)),
    "cross_k_v": (dict(in_kv_features=12, qkv_features=8, out_features=6), (X, XK, XV), {}),
    "no_bias": (dict(use_bias=False), (X, X), dict(mask=MASK[:, :, :, :])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_softmax_equals_flax_values_and_gradients(case):
  kw, args, call = CASES[case]
  ours, flax_mha = _pair(**kw)
  chex.assert_trees_all_equal(_params(ours), _params(flax_mha))  # Flax's names and init
  (lo, go), (lf, gf) = _loss_grad(ours, *args, **call), _loss_grad(flax_mha, *args, **call)
  np.testing.assert_allclose(lo, lf, rtol=1e-5)
  chex.assert_trees_all_close(go, gf, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(ours(*args, **call), flax_mha(*args, **call), atol=1e-5)


def test_is_causal_as_a_constructor_default_and_a_call_argument():
  _, flax_mha = _pair()
  causal = anx.MultiHeadAttention(num_heads=4, in_features=16, is_causal=True,
                                  rngs=nnx.Rngs(0, dropout=7))
  ref = flax_mha(X, is_causal=True)
  chex.assert_trees_all_close(causal(X), ref, atol=1e-5)
  chex.assert_trees_all_close(causal(X, is_causal=False), flax_mha(X), atol=1e-5)
  assert float(jnp.max(jnp.abs(causal(X) - flax_mha(X)))) > 1e-3


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_equals_flax_with_the_same_rng_stream(broadcast):
  ours, flax_mha = _pair(dropout_rate=0.3, broadcast_dropout=broadcast)
  first = ours(X, deterministic=False)
  chex.assert_trees_all_close(first, flax_mha(X, deterministic=False), atol=1e-5)
  second = ours(X, deterministic=False)  # the stream advances as Flax's does
  chex.assert_trees_all_close(second, flax_mha(X, deterministic=False), atol=1e-5)
  assert float(jnp.max(jnp.abs(first - second))) > 1e-3
  chex.assert_trees_all_close(ours(X, deterministic=True), flax_mha(X, deterministic=True),
                              atol=1e-5)
  rngs = nnx.Rngs(dropout=3)
  chex.assert_trees_all_close(ours(X, deterministic=False, rngs=rngs),
                              flax_mha(X, deterministic=False, rngs=nnx.Rngs(dropout=3)),
                              atol=1e-5)


def test_sow_weights_equals_flax():
  # Read under nnx.capture, as Flax asks (sowing outside it is deprecated from flax 0.12.10).
  sown = lambda model: nnx.capture(model, nnx.Intermediate)(
      X, mask=MASK, sow_weights=True)[1]["attention_weights"]
  ours, flax_mha = _pair()
  w_ours, w_flax = sown(ours), sown(flax_mha)
  assert len(jax.tree.leaves(w_ours)) == 1
  chex.assert_trees_all_close(w_ours, w_flax, atol=1e-6)
  assert not nnx.state(ours, nnx.Intermediate)  # captured, not stored on the module


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_decode_cache_equals_flax_and_the_full_causal_pass(kv_heads):
  ours, flax_mha = _pair(num_kv_heads=kv_heads)
  full = ours(X, is_causal=True)
  for m in (ours, flax_mha):
    m.init_cache(X.shape)
  for t in range(X.shape[1]):
    step = ours(X[:, t:t + 1], decode=True)
    chex.assert_trees_all_close(step, flax_mha(X[:, t:t + 1], decode=True), atol=1e-5)
    chex.assert_trees_all_close(step[:, 0], full[:, t], atol=1e-5)
  chex.assert_trees_all_close(ours.cached_key[...], flax_mha.cached_key[...])
  # Past the cache's end: NaN, the cache unchanged (Flax would overwrite its last slot).
  before = ours.cached_value[...]
  assert bool(jnp.isnan(ours(X[:, :1], decode=True)).all())
  chex.assert_trees_all_equal(ours.cached_value[...], before)


# --- every attnx option, against the linen module with the same parameters ------------------

OPTION_CASES = {
    "relu_causal": dict(weighting="relu", is_causal=True),
    "ssmax_learned": dict(weighting="ssmax", learn_ssmax_s=True, is_causal=True),
    "bilinear": dict(score="bilinear", num_heads=2),
    "additive": dict(score="additive", score_dim=6, num_heads=2),
    "metric": dict(score="metric", score_dim=4),
    "metric_fixed_tau": dict(score="metric", learn_temperature=False, scale=0.3),
    "rotary_gqa_qk_norm": dict(rotary=True, num_kv_heads=2, normalize_qk=True, is_causal=True),
    "window_cap_sinks_learned_alibi": dict(is_causal=True, sliding_window=3,
                                           logits_soft_cap=5.0, sinks=True, learn_alibi=True),
    "symmetric_alibi_window_pair": dict(alibi=True, sliding_window=(2, 1), weighting="sigmoid"),
    "blocked_entmax": dict(implementation="blocked", weighting="entmax15", is_causal=True,
                           rotary=True),
}


def _linen_twin(kw):
  linen_kw = {k: v for k, v in kw.items() if k != "normalize_qk"}
  return attnx_nn.MultiHeadAttention(num_heads=kw.get("num_heads", 4),
                                     qk_norm=kw.get("normalize_qk", False),
                                     **{k: v for k, v in linen_kw.items() if k != "num_heads"})


def _linen_params(module):
  return jax.tree.map(jnp.asarray, nnx.state(module, nnx.Param).to_pure_dict())


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
@pytest.mark.split_by_jax
def test_every_option_equals_the_linen_module_with_the_same_parameters(case):
  kw = OPTION_CASES[case]
  ours = anx.MultiHeadAttention(in_features=16, **{"num_heads": 4, **kw}, rngs=nnx.Rngs(1))
  linen = _linen_twin(kw)
  params = _linen_params(ours)
  ref_params = linen.init(jax.random.key(0), X)["params"]
  chex.assert_trees_all_equal_shapes(params, ref_params)  # linen's names and shapes
  weights = kw.get("implementation") is None
  out = ours(X, return_weights=weights)
  ref = linen.apply({"params": params}, X, return_weights=weights)
  chex.assert_trees_all_close(out, ref, atol=1e-5)
  (lo, go) = _loss_grad(ours, X)
  lf, gf = jax.value_and_grad(
      lambda p: jnp.sum(jnp.sin(linen.apply({"params": p}, X))))(params)
  np.testing.assert_allclose(lo, lf, rtol=1e-5)
  chex.assert_trees_all_close(go.to_pure_dict(), gf, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["window_cap_sinks_learned_alibi", "rotary_gqa_qk_norm"])
def test_decode_with_options_equals_the_linen_cache(case):
  kw = OPTION_CASES[case]
  ours = anx.MultiHeadAttention(in_features=16, **{"num_heads": 4, **kw}, rngs=nnx.Rngs(1))
  linen = _linen_twin(kw)
  params = _linen_params(ours)
  cache = linen.init(jax.random.key(0), X, decode=True)["cache"]
  ours.init_cache(X.shape)
  full = ours(X)
  for t in range(X.shape[1]):
    ref, mutated = linen.apply({"params": params, "cache": cache}, X[:, t:t + 1], decode=True,
                               mutable=["cache"])
    cache = mutated["cache"]
    step = ours(X[:, t:t + 1], decode=True)
    chex.assert_trees_all_close(step, ref, atol=1e-5)
    chex.assert_trees_all_close(step[:, 0], full[:, t], atol=1e-5)


def test_runs_under_nnx_jit_and_split_merge():
  ours = anx.MultiHeadAttention(num_heads=4, in_features=16, weighting="sigmoid", sinks=True,
                                rngs=nnx.Rngs(0))
  jitted = nnx.jit(lambda m, x: m(x, is_causal=True))(ours, X)
  chex.assert_trees_all_close(jitted, ours(X, is_causal=True), atol=1e-6)
  graphdef, state = nnx.split(ours)
  chex.assert_trees_all_close(nnx.merge(graphdef, state)(X), ours(X), atol=0)


@pytest.mark.parametrize("kw, call, match", [
    (dict(num_heads=3), {}, "divisible|num_heads"),
    (dict(weighting="softmax", learn_ssmax_s=True), {}, "learn_ssmax_s"),
    (dict(alibi=True, learn_alibi=True), {}, "alibi"),
    (dict(logits_soft_cap=-1.0), {}, "cap"),
    (dict(score="metric", num_kv_heads=2), {}, "num_kv_heads"),
    (dict(score_dim=4), {}, "score_dim"),
    (dict(implementation="blocked"), dict(sow_weights=True), "sow_weights"),
    (dict(dropout_rate=0.1), {}, "deterministic"),
    (dict(), dict(decode=True), "init_cache"),
    (dict(), dict(positions=jnp.zeros((2, 7), jnp.int32)), "rotary"),
])
def test_bad_options_and_calls_raise_a_clear_error(kw, call, match):
  with pytest.raises(ValueError, match=match):
    anx.MultiHeadAttention(**{"num_heads": 4, "in_features": 16, **kw},
                           rngs=nnx.Rngs(0))(X, **call)


def test_inputs_of_the_wrong_width_raise():
  m = anx.MultiHeadAttention(num_heads=4, in_features=16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="in_features=16"):
    m(jnp.ones((2, 7, 8)))
  with pytest.raises(ValueError, match="inputs_k cannot be None"):
    m(X, None, X)


@pytest.mark.parametrize("kw", [dict(attention_fn=lambda *a, **k: None),
                                dict(qkv_promote_dtype=lambda *a, **k: a)])
def test_flax_arguments_it_does_not_implement_are_refused_not_swallowed(kw):
  nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=False, rngs=nnx.Rngs(0), **kw)
  with pytest.raises(TypeError, match=next(iter(kw))):
    anx.MultiHeadAttention(num_heads=4, in_features=16, rngs=nnx.Rngs(0), **kw)
  with pytest.raises(TypeError, match="out_sharding"):
    anx.MultiHeadAttention(num_heads=4, in_features=16, rngs=nnx.Rngs(0))(X, out_sharding=None)
