"""attnx.nnx.GPT and its blocks against the linen GPT with the same weights: logits,
gradients, decoding, packed rows, the model file, linen checkpoints loaded into NNX."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnx import nn as attnx_nn
from attnx import nnx as anx

KW = dict(vocab_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, max_len=12)
TOKENS = jax.random.randint(jax.random.key(0), (2, 12), 0, 16)
SEGMENTS = jnp.array([[0] * 5 + [1] * 7, [0] * 12])
POSITIONS = jnp.array([list(range(5)) + list(range(7)), list(range(12))])

CONFIGS = {
    "learned_softmax": dict(),
    "rotary_relu_untied": dict(positions="rotary", attention="relu", tie_embeddings=False),
    "alibi_windows_cap_sinks_ssmax": dict(positions="alibi", sliding_window=[3, None],
                                          logits_soft_cap=20.0, sinks=True,
                                          attention="ssmax_learned"),
    "none_stick_breaking": dict(positions="none", attention="stick_breaking"),
    "metric_rotary": dict(attention="metric", positions="rotary"),
    "gqa_qk_norm_blocked": dict(positions="rotary", implementation="blocked",
                                attention={"weighting": "sigmoid", "num_kv_heads": 1,
                                           "qk_norm": True}),
}


def _twins(extra, seed=0):
  """(NNX model, linen model, the NNX model's parameters as a linen params dict)."""
  model = anx.GPT(**KW, **extra, rngs=nnx.Rngs(seed))
  params = jax.tree.map(jnp.asarray, nnx.state(model, nnx.Param).to_pure_dict())
  return model, attnx_nn.GPT(**KW, **extra), params


@pytest.mark.split_by_jax
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_logits_and_gradients_equal_the_linen_gpt_with_the_same_weights(case):
  model, linen, params = _twins(CONFIGS[case])
  ref_params = linen.init(jax.random.key(1), TOKENS)["params"]
  chex.assert_trees_all_equal_shapes(params, ref_params)  # linen's parameter names
  packed = {} if CONFIGS[case].get("positions") == "none" else dict(segment_ids=SEGMENTS,
                                                                     positions=POSITIONS)
  for call in ({}, packed):
    chex.assert_trees_all_close(model(TOKENS, **call),
                                linen.apply({"params": params}, TOKENS, **call), atol=1e-5)
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)

  def loss_nnx(p):
    return jnp.mean(jnp.sin(nnx.merge(graphdef, p, rest)(TOKENS, **packed)))

  go = jax.grad(loss_nnx)(state).to_pure_dict()
  gf = jax.grad(lambda p: jnp.mean(jnp.sin(linen.apply({"params": p}, TOKENS, **packed))))(
      params)
  chex.assert_trees_all_close(go, gf, atol=1e-6, rtol=1e-5)


def test_packing_isolates_documents_in_the_nnx_model():
  model = anx.GPT(**KW, positions="rotary", attention="sigmoid:normalization=none",
                  rngs=nnx.Rngs(0))
  other = TOKENS.at[0, 5:].set((TOKENS[0, 5:] + 3) % 16)  # another second document
  a = model(TOKENS, segment_ids=SEGMENTS, positions=POSITIONS)
  b = model(other, segment_ids=SEGMENTS, positions=POSITIONS)
  chex.assert_trees_all_close(a[0, :5], b[0, :5], atol=1e-6)  # the first one sees no change
  assert float(jnp.max(jnp.abs(a[0, 5:] - b[0, 5:]))) > 1e-3


@pytest.mark.split_by_jax
@pytest.mark.parametrize("case", ["learned_softmax", "rotary_relu_untied",
                                  "alibi_windows_cap_sinks_ssmax"])
def test_decode_equals_the_linen_cache_and_the_full_pass(case):
  model, linen, params = _twins(CONFIGS[case])
  full = model(TOKENS)
  cache = linen.init(jax.random.key(1), TOKENS, decode=True)["cache"]
  model.init_cache(TOKENS.shape[0], TOKENS.shape[1])
  for t in range(TOKENS.shape[1]):
    ref, mutated = linen.apply({"params": params, "cache": cache}, TOKENS[:, t:t + 1],
                               decode=True, mutable=["cache"])
    cache = mutated["cache"]
    step = model(TOKENS[:, t:t + 1], decode=True)
    chex.assert_trees_all_close(step, ref, atol=1e-5)
    chex.assert_trees_all_close(step[:, 0], full[:, t], atol=1e-5)


def test_paged_cache_decodes_as_the_contiguous_one():
  model, linen, params = _twins(CONFIGS["alibi_windows_cap_sinks_ssmax"])
  full = model(TOKENS)
  model.init_cache(TOKENS.shape[0], TOKENS.shape[1], page_size=3)
  assert model.blocks[0].attention.cached_key is None
  for t in range(TOKENS.shape[1]):
    step = model(TOKENS[:, t:t + 1], decode=True)
    chex.assert_trees_all_close(step[:, 0], full[:, t], atol=1e-5)


def test_a_linen_checkpoint_loads_into_the_nnx_model_and_back():
  linen = attnx_nn.GPT(**KW, positions="rotary", attention="entmax15")
  params = linen.init(jax.random.key(3), TOKENS)["params"]
  model = anx.GPT(**KW, positions="rotary", attention="entmax15", rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  ref = linen.apply({"params": params}, TOKENS)
  chex.assert_trees_all_close(model(TOKENS), ref, atol=1e-5)
  back = jax.tree.map(jnp.asarray, nnx.state(model, nnx.Param).to_pure_dict())
  chex.assert_trees_all_equal(back, jax.tree.map(jnp.asarray, dict(params)))


def test_nnx_bridge_round_trip_of_the_linen_model_into_the_native_one():
  linen = attnx_nn.GPT(**KW, attention="relu")
  bridged = nnx.bridge.ToNNX(linen, rngs=nnx.Rngs(5))
  nnx.bridge.lazy_init(bridged, TOKENS)
  native = anx.GPT(**KW, attention="relu", rngs=nnx.Rngs(0))
  state = nnx.state(native, nnx.Param)
  nnx.replace_by_pure_dict(state, nnx.state(bridged, nnx.Param).to_pure_dict())
  nnx.update(native, state)
  chex.assert_trees_all_close(native(TOKENS), bridged(TOKENS), atol=1e-5)


def test_one_model_file_builds_either_model(tmp_path):
  linen = attnx_nn.GPT(**KW, positions="alibi", sliding_window=[None, 4], sinks=True,
                       attention={"weighting": "softpick"})
  path = tmp_path / "model_spec.json"
  attnx_nn.save_model_spec(path, linen, vocab=[chr(97 + i) for i in range(16)])
  spec = attnx_nn.load_model_spec(path)
  model = anx.gpt_from_spec(spec, rngs=nnx.Rngs(0))
  assert model.layer_windows() == (None, 4) == linen.layer_windows()
  assert model.block_attention(1) == linen.block_attention(1)
  attnx_nn.save_model_spec(tmp_path / "nnx.json", model, vocab=spec["vocab"])
  assert attnx_nn.load_model_spec(tmp_path / "nnx.json")["model"] == spec["model"]


def test_dropout_runs_in_training_mode_and_not_in_evaluation():
  model = anx.GPT(**KW, dropout_rate=0.3, attention_dropout_rate=0.2, rngs=nnx.Rngs(0))
  a, b = model(TOKENS, deterministic=False), model(TOKENS, deterministic=False)
  assert float(jnp.max(jnp.abs(a - b))) > 1e-3
  np.testing.assert_array_equal(model(TOKENS), model(TOKENS))


@pytest.mark.parametrize("kw, match", [
    (dict(attention="linear_elu"), "attention types"),
    (dict(num_layers=0), "num_layers"),
    (dict(positions="sinusoidal"), "positions"),
    (dict(sliding_window=[1, 2, 3]), "sliding_window"),
    (dict(positions="rotary", attention={"weighting": "relu", "bogus": 1}), "bogus"),
])
def test_bad_configurations_raise_a_clear_error(kw, match):
  with pytest.raises(ValueError, match=match):
    anx.GPT(**{**KW, **kw}, rngs=nnx.Rngs(0))


def test_decode_without_a_cache_raises():
  model = anx.GPT(**KW, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="init_cache"):
    model(TOKENS[:, :1], decode=True)


def test_models_without_dropout_build_from_a_params_stream_alone():
  # as Flax's layers: the dropout stream is needed only where something is dropped
  tokens = TOKENS[:, :8]
  assert anx.GPT(**KW, rngs=nnx.Rngs(params=0))(tokens).shape == (2, 8, 16)
  model = anx.to_linen(anx.GPT, **KW)
  params = model.init(jax.random.key(0), tokens)["params"]  # linen's one-key init
  chex.assert_trees_all_equal_structs(params, attnx_nn.GPT(**KW).init(jax.random.key(0),
                                                                      tokens)["params"])
