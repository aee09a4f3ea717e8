"""attnx.nn.transformer: Decoder KV-cache decoding equals the full causal pass."""

import functools

import chex
import jax
import jax.numpy as jnp

import attnx.nn as an

KEY = jax.random.PRNGKey(0)


def test_decoder_kv_cache_decoding_equals_full_causal_pass():
  dec = an.Decoder(num_layers=2, num_heads=2, mlp_dim=16, attention="relu")
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
  memory = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 8))
  mem_mask = jnp.array([[True, True, False], [True, True, True]])
  variables = jax.jit(functools.partial(dec.init, decode=True))(KEY, x, memory)
  params, cache = variables["params"], variables["cache"]
  chex.assert_shape(cache["block_0"]["self_attention"]["cached_key"], (2, 4, 2, 4))
  full = jax.jit(dec.apply)({"params": params}, x, memory, memory_key_mask=mem_mask)

  @jax.jit
  def step(cache, x_t):
    return dec.apply({"params": params, "cache": cache}, x_t, memory, memory_key_mask=mem_mask,
                     decode=True, mutable=["cache"])

  outs = []
  for t in range(4):
    out, mut = step(cache, x[:, t:t + 1])
    cache = mut["cache"]
    outs.append(out)
  chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), full, atol=1e-5)
  assert jnp.max(jnp.abs(full[:, 1:] - full[:, :1])) > 1e-3  # positions really differ
