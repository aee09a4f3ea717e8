"""attnx.nn.rotary (RoPE) and MultiHeadAttention(rotary=True), against direct numpy
computations with explicit rotation matrices."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx.nn import MultiHeadAttention
from attnx.nn.rotary import apply_rotary


def rotation(m: float, dim: int, base: float = 10_000.0) -> np.ndarray:
  """Block-diagonal R_m [dim, dim]: pair (2i, 2i+1) rotated by m·base^(−2i/dim)."""
  r = np.zeros((dim, dim))
  for i in range(dim // 2):
    a = m * base ** (-2 * i / dim)
    r[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]
  return r


def test_apply_rotary_is_the_block_rotation():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)  # [B, T, N, H]
  pos = np.array([0, 1, 7, 100, 2048])
  got = np.asarray(apply_rotary(jnp.asarray(x), jnp.asarray(pos)))
  want = np.einsum("tij,btnj->btni", np.stack([rotation(p, 8) for p in pos]), x)
  np.testing.assert_allclose(got, want, atol=2e-4)
  np.testing.assert_allclose(got[:, 0], x[:, 0])  # position 0: identity
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1),
                             rtol=1e-5)  # a rotation keeps norms


@pytest.mark.parametrize("shift", [1, 13, 500])
def test_scores_depend_only_on_the_offset(shift):
  rng = np.random.default_rng(1)
  q = rng.normal(size=(1, 6, 1, 16)).astype(np.float32)
  k = rng.normal(size=(1, 6, 1, 16)).astype(np.float32)
  pos = np.arange(6)

  def scores(offset):
    qr = apply_rotary(jnp.asarray(q), jnp.asarray(pos + offset))
    kr = apply_rotary(jnp.asarray(k), jnp.asarray(pos + offset))
    return np.asarray(jnp.einsum("btnh,bsnh->bnts", qr, kr))[0, 0]

  base = scores(0)
  np.testing.assert_allclose(scores(shift), base, atol=5e-4)
  # Direct numpy: (R_m q)·(R_n k) = q · R_(n−m) k.
  direct = np.array([[q[0, i, 0] @ rotation(j - i, 16) @ k[0, j, 0] for j in range(6)]
                     for i in range(6)])
  np.testing.assert_allclose(base, direct, atol=5e-4)
  assert not np.allclose(base, np.einsum("th,sh->ts", q[0, :, 0], k[0, :, 0]), atol=1e-2)


def test_odd_head_dim_raises():
  with pytest.raises(ValueError, match="head dim must be even"):
    apply_rotary(jnp.ones((1, 2, 1, 5)), jnp.arange(2))


def test_multihead_attention_rotary_matches_numpy():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 8))
  model = MultiHeadAttention(num_heads=2, is_causal=True, rotary=True)
  variables = model.init(jax.random.PRNGKey(1), x)
  out = model.apply(variables, x)
  p = jax.tree.map(np.asarray, variables["params"])
  xn = np.asarray(x, np.float64)
  proj = lambda name: np.einsum("btd,dnh->btnh", xn, p[name]["kernel"]) + p[name]["bias"]
  q, k, v = proj("query"), proj("key"), proj("value")
  rot = np.stack([rotation(t, 4) for t in range(5)])
  q, k = np.einsum("tij,btnj->btni", rot, q), np.einsum("tij,btnj->btni", rot, k)
  s = np.einsum("btnh,bsnh->bnts", q, k) / 2.0
  s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  o = np.einsum("bnts,bsnh->btnh", w, v)
  want = np.einsum("btnh,nhd->btd", o, p["out"]["kernel"]) + p["out"]["bias"]
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-4)
  plain = MultiHeadAttention(num_heads=2, is_causal=True).apply(variables, x)
  assert not np.allclose(np.asarray(plain), want, atol=1e-3)  # rotary changed something


def test_rotary_decode_continues_positions():
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 6, 8))
  model = MultiHeadAttention(num_heads=2, is_causal=True, rotary=True, weighting="relu")
  variables = model.init(jax.random.PRNGKey(3), x, decode=True)
  full = model.apply(variables, x)
  step = jax.jit(lambda cache, xt: model.apply({"params": variables["params"], "cache": cache},
                                               xt, decode=True, mutable=["cache"]))
  cache, steps = variables["cache"], []
  for t in range(6):
    out, mut = step(cache, x[:, t:t + 1])
    cache = mut["cache"]
    steps.append(out)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)
