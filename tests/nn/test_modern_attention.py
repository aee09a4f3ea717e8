"""The attention of today's language models in the modules: sliding windows (per layer),
soft-capping, learned sinks, ALiBi, packed documents with restarting positions — against the
same module with the equivalent dense bias or mask, the KV cache against the full pass, and
documents packed in one row against the same documents alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core, nn
from attnx.nn import gpt as gpt_lib

D, N, T = 32, 4, 24


def _x(seed=0, b=2, t=T):
  return jax.random.normal(jax.random.key(seed), (b, t, D))


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_equals_the_same_module_with_alibis_bias(causal):
  x = _x()
  with_alibi = nn.MultiHeadAttention(num_heads=N, is_causal=causal, alibi=True)
  plain = nn.MultiHeadAttention(num_heads=N, is_causal=causal)
  params = plain.init(jax.random.key(1), x)
  d = np.arange(T)[:, None] - np.arange(T)[None, :]
  d = d if causal else np.abs(d)
  bias = -np.asarray(core.alibi_slopes(N))[:, None, None] * d  # [N, T, T]
  np.testing.assert_allclose(with_alibi.apply(params, x), plain.apply(params, x, bias=bias),
                             atol=2e-5)


def test_window_cap_sinks_and_learned_slopes_are_parameters_that_learn():
  x = _x()
  mha = nn.MultiHeadAttention(num_heads=N, is_causal=True, sliding_window=5,
                              logits_soft_cap=3.0, sinks=True, learn_alibi=True,
                              weighting="sigmoid")
  params = mha.init(jax.random.key(1), x)["params"]
  assert params["sinks"].shape == (N,) and params["alibi_slopes"].shape == (N,)
  np.testing.assert_allclose(params["alibi_slopes"], core.alibi_slopes(N))
  grads = jax.grad(lambda p: jnp.sum(mha.apply({"params": p}, x) ** 2))(params)
  assert float(jnp.abs(grads["sinks"]).min()) > 0
  assert float(jnp.abs(grads["alibi_slopes"]).min()) > 0
  # The window: the last query's output does not depend on the keys 6 or more before it.
  y = mha.apply({"params": params}, x)
  x2 = x.at[:, : T - 6].set(0.0)
  np.testing.assert_allclose(mha.apply({"params": params}, x2)[:, -1], y[:, -1], atol=1e-6)


@pytest.mark.parametrize("kw", [
    dict(alibi=True, sliding_window=4),
    dict(learn_alibi=True, sinks=True, logits_soft_cap=5.0, weighting="entmax15"),
    dict(rotary=True, sliding_window=(6, 0), sinks=True),
], ids=["alibi_window", "sinks_cap_entmax", "rotary_window_sinks"])
def test_kv_cache_decoding_equals_the_full_pass(kw):
  """Step-by-step decoding (the window masked in the cache, ALiBi counted from the cache
  position) gives the outputs of one pass over the whole sequence."""
  x = _x(3)
  mha = nn.MultiHeadAttention(num_heads=N, is_causal=True, **kw)
  variables = mha.init(jax.random.key(1), x)
  full = mha.apply(variables, x)
  cache = mha.apply(variables, x, decode=True, mutable=["cache"])[1]["cache"]
  cache = jax.tree.map(jnp.zeros_like, cache)
  steps = []
  for t in range(T):
    y, upd = mha.apply({**variables, "cache": cache}, x[:, t:t + 1], decode=True,
                       mutable=["cache"])
    cache = upd["cache"]
    steps.append(y)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5)


LENGTHS = (5, 11, 8)  # three documents packed in one row of 24


def _packed():
  ids = np.repeat(np.arange(len(LENGTHS)), LENGTHS)[None]
  pos = np.concatenate([np.arange(n) for n in LENGTHS])[None]
  return jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("positions", ["learned", "rotary", "alibi", "none"])
@pytest.mark.parametrize("attention", ["softmax", "sigmoid", "stick_breaking", "ssmax_learned"])
@pytest.mark.split_by_jax
def test_gpt_on_packed_documents_equals_each_document_alone(positions, attention):
  """A packed row with segment ids and restarting positions gives every document the logits
  it gets alone, and changing one document changes no logit of another."""
  model = nn.GPT(vocab_size=17, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                 max_len=T, attention=attention, positions=positions,
                 sinks=attention != "stick_breaking")
  tokens = jax.random.randint(jax.random.key(4), (1, T), 0, 17)
  ids, pos = _packed()
  params = model.init(jax.random.key(5), tokens)["params"]
  packed = model.apply({"params": params}, tokens, segment_ids=ids, positions=pos)
  start = 0
  for n in LENGTHS:
    alone = model.apply({"params": params}, tokens[:, start:start + n])
    np.testing.assert_allclose(packed[:, start:start + n], alone, atol=5e-5)
    start += n
  other = tokens.at[:, : LENGTHS[0]].set((tokens[:, : LENGTHS[0]] + 1) % 17)
  changed = model.apply({"params": params}, other, segment_ids=ids, positions=pos)
  np.testing.assert_array_equal(changed[:, LENGTHS[0]:], packed[:, LENGTHS[0]:])


def test_gpt_local_and_global_layers():
  model = nn.GPT(vocab_size=11, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32,
                 max_len=T, positions="rotary", sliding_window=[4, None, 4],
                 logits_soft_cap=30.0)
  assert model.layer_windows() == (4, None, 4)
  assert model.block_attention(0)["sliding_window"] == 4
  assert "sliding_window" not in model.block_attention(1)
  tokens = jax.random.randint(jax.random.key(6), (2, T), 0, 11)
  params = model.init(jax.random.key(7), tokens)["params"]
  logits = model.apply({"params": params}, tokens)
  kwargs = gpt_lib.model_kwargs(model)
  assert kwargs["sliding_window"] == [4, None, 4] and kwargs["logits_soft_cap"] == 30.0
  again = nn.GPT(**kwargs).apply({"params": params}, tokens)
  np.testing.assert_array_equal(again, logits)
  out = nn.generate(model, params, tokens[:, :3], 5, rng=jax.random.key(8))
  assert out.shape == (2, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(sliding_window=[4, None]), "one int-or-None per layer"),
    (dict(sliding_window=-1), "sliding_window"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(sinks=True, attention="stick_breaking"), "unassigned"),
    (dict(positions="alibi", attention="linear_elu"), "apply to attention types"),
    (dict(positions="sinusoidal"), "positions must be one of"),
])
def test_gpt_refuses_bad_settings(kw, match):
  with pytest.raises(ValueError, match=match):
    nn.GPT(vocab_size=11, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32, max_len=T,
           **kw)


def test_module_errors():
  with pytest.raises(ValueError, match="sliding_window"):
    nn.MultiHeadAttention(num_heads=N, sliding_window=(1, 2, 3))
  with pytest.raises(ValueError, match="not both"):
    nn.MultiHeadAttention(num_heads=N, alibi=True, learn_alibi=True)
  with pytest.raises(ValueError, match="ring attention"):
    nn.MultiHeadAttention(num_heads=N, sliding_window=4, sequence_axis="seq")
  mha = nn.MultiHeadAttention(num_heads=N)
  x = _x()
  params = mha.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="rotary=True only"):
    mha.apply(params, x, positions=jnp.zeros((2, T), jnp.int32))
  assert math.isfinite(float(mha.apply(params, x, segment_ids=jnp.zeros((2, T), jnp.int32)
                                       ).sum()))
