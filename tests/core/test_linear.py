"""Linear attention against a brute-force quadratic computation with the same feature map, and
FAVOR+ against softmax attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from two_cpu_run import run_on_two_cpus

from attnx.core import linear

B, T, N, K, H, HV = 2, 13, 4, 2, 8, 5


def _qkv(seed=0, t=T, s=T, hv=HV, scale=1.0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)  # numpy: no per-shape compilation of random ops
  q = rng.standard_normal((B, t, N, H)) * scale
  k = rng.standard_normal((B, s, K, H)) * scale
  v = rng.standard_normal((B, s, K, hv))
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _brute(fq, fk, v, causal=False, key_mask=None, eps=1e-6):
  """out_i = Σ_j w_ij v_j / (Σ_j w_ij + ε), w_ij = φ(q_i)·φ(k_j), as an explicit T×S matrix."""
  fq, fk, v = (np.asarray(a, np.float64) for a in (fq, fk, v))
  g = fq.shape[2] // fk.shape[2]
  fk, v = np.repeat(fk, g, axis=2), np.repeat(v, g, axis=2)  # query head n uses kv head n // g
  w = np.einsum("btnm,bsnm->bnts", fq, fk)
  if causal:
    w = w * np.tril(np.ones(w.shape[-2:]))
  if key_mask is not None:
    w = w * np.asarray(key_mask, np.float64)[:, None, None, :]
  return np.einsum("bnts,bsnd->btnd", w, v) / (w.sum(-1) + eps).transpose(0, 2, 1)[..., None]


def _elu1(x):
  return np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)))


# ---------------------------------------------------------------------------------------------
# Exactness against the quadratic form.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_elu_plus_one_matches_brute_force(causal):
  q, k, v = _qkv()
  want = _brute(_elu1(np.asarray(q)), _elu1(np.asarray(k)), v, causal)
  for chunk in (1, 4, 64) if causal else (64,):  # 13 is not a multiple of 4: padding
    got = linear.linear_attention(q, k, v, is_causal=causal, chunk_size=chunk)
    assert got.shape == (B, T, N, HV) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_noncausal_cross_attention_and_key_mask():
  q, k, v = _qkv(t=7, s=11)
  mask = np.random.default_rng(0).random((B, 11)) < 0.6
  mask[:, 0] = True
  want = _brute(_elu1(np.asarray(q)), _elu1(np.asarray(k)), v, key_mask=mask)
  np.testing.assert_allclose(linear.linear_attention(q, k, v, key_mask=mask), want, atol=1e-5)
  qc, kc, vc = _qkv()
  maskc = np.ones((B, T), bool)
  maskc[:, 3:6] = False
  want = _brute(_elu1(np.asarray(qc)), _elu1(np.asarray(kc)), vc, causal=True, key_mask=maskc)
  got = linear.linear_attention(qc, kc, vc, is_causal=True, key_mask=maskc, chunk_size=4)
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_callable_and_favor_features_match_brute_force(causal):
  q, k, v = _qkv(scale=0.5)
  relu_map = lambda x: jax.nn.relu(x) + 1e-3  # the LRA "Performer" map (REFERENCES.md)
  want = _brute(relu_map(q), relu_map(k), v, causal)
  np.testing.assert_allclose(
      linear.linear_attention(q, k, v, feature_map=relu_map, is_causal=causal, chunk_size=4),
      want, atol=1e-5)
  omega = linear.favor_features(jax.random.PRNGKey(1), 32, H)
  fq = linear.favor_plus_features(q, omega, is_query=True)
  fk = linear.favor_plus_features(k, omega, is_query=False)
  np.testing.assert_allclose(
      linear.linear_attention(q, k, v, feature_map="favor_plus", features=omega,
                              is_causal=causal, chunk_size=4),
      _brute(fq, fk, v, causal), atol=1e-5)


def test_gqa_equals_repeated_heads():
  q, k, v = _qkv()
  g = N // K
  rep = linear.linear_attention(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2),
                                is_causal=True)
  np.testing.assert_allclose(linear.linear_attention(q, k, v, is_causal=True), rep, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# FAVOR+.
# ---------------------------------------------------------------------------------------------

def test_favor_features_are_unbiased_gaussian_rows():
  omega = np.asarray(linear.favor_features(jax.random.PRNGKey(0), 8192, H))
  assert omega.shape == (8192, H)
  # Each row is marginally N(0, I): zero mean, identity covariance (a biased QR sign would
  # show up in the mean).
  np.testing.assert_allclose(omega.mean(0), 0.0, atol=0.06)
  np.testing.assert_allclose(np.cov(omega.T), np.eye(H), atol=0.08)
  # Rows within a block are orthogonal.
  block = omega[:H] / np.linalg.norm(omega[:H], axis=1, keepdims=True)
  np.testing.assert_allclose(block @ block.T, np.eye(H), atol=1e-5)
  assert linear.favor_features(jax.random.PRNGKey(0), 10, 4).shape == (10, 4)


@pytest.mark.parametrize("causal", [False, True])
def test_favor_plus_approximates_softmax_attention(causal):
  rng = np.random.default_rng(3)
  q, k = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)) * 0.3, jnp.float32) for _ in "qk")
  v = jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32)
  exact = jax.nn.dot_product_attention(q, k, v, is_causal=causal)  # scale 1/√H

  def err(m):
    errs = [jnp.mean(jnp.abs(linear.linear_attention(
        q, k, v, feature_map="favor_plus", num_features=m, key=jax.random.PRNGKey(s),
        is_causal=causal) - exact)) for s in range(3)]
    return float(np.mean(errs))

  few, many = err(16), err(4096)
  assert many < few / 3, (few, many)
  assert many < 0.01, many


def test_favor_plus_large_inputs_stay_finite():
  q, k, v = _qkv(scale=30.0)
  out = linear.linear_attention(q, k, v, feature_map="favor_plus", key=jax.random.PRNGKey(0),
                                num_features=64)
  assert np.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# Precision, gradients, errors.
# ---------------------------------------------------------------------------------------------

def test_bf16():
  x = jnp.array([-20.0, -8.0, 0.0, 3.0], jnp.bfloat16)
  phi = linear.elu_plus_one_features(x)
  assert phi.dtype == jnp.bfloat16 and np.isfinite(phi.astype(jnp.float32)).all()
  assert (phi > 0).all()
  assert (jax.nn.elu(x) + 1)[0] == 0  # the pitfall being avoided
  q, k, v = _qkv(dtype=jnp.bfloat16)
  out = linear.linear_attention(q * 20, k * 20, v, is_causal=True)
  assert out.dtype == jnp.bfloat16 and np.isfinite(out.astype(jnp.float32)).all()
  ref = linear.linear_attention(*(a.astype(jnp.float32) for a in (q, k, v)), is_causal=True)
  np.testing.assert_allclose(linear.linear_attention(q, k, v, is_causal=True).astype(jnp.float32),
                             ref, atol=3e-2)


@pytest.mark.parametrize("feature_map,causal", [("elu_plus_one", False), ("elu_plus_one", True),
                                                ("favor_plus", True)])
def test_grads(feature_map, causal):
  q, k, v = _qkv(seed=5, t=6, s=6, hv=3)
  f = functools.partial(linear.linear_attention, feature_map=feature_map, is_causal=causal,
                        chunk_size=4, features=linear.favor_features(jax.random.PRNGKey(0), 16, H))
  grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
  assert all(np.isfinite(g).all() for g in grads)
  if feature_map == "elu_plus_one" and causal:  # the scan is the interesting part
    check_grads(f, (q, k, v), order=1, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_vmap():
  q, k, v = _qkv()
  per_example = jax.vmap(lambda q, k, v: linear.linear_attention(q[None], k[None], v[None])[0])
  np.testing.assert_allclose(per_example(q, k, v), linear.linear_attention(q, k, v), atol=1e-6)


def test_errors():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="key"):
    linear.linear_attention(q, k, v, feature_map="favor_plus")
  with pytest.raises(ValueError, match="feature_map"):
    linear.linear_attention(q, k, v, feature_map="cosformer")
  with pytest.raises(ValueError, match="T=7"):
    linear.linear_attention(*_qkv(t=7, s=9), is_causal=True)
  with pytest.raises(ValueError, match="multiple"):
    linear.linear_attention(q[:, :, :3], k, v)
  with pytest.raises(ValueError):
    linear.linear_attention(q[0], k[0], v[0])


def test_orthonormalize_equals_lapack_qr_with_positive_diagonal():
  a = jax.random.normal(jax.random.PRNGKey(3), (4, 32, 32))
  q_ref, r = jnp.linalg.qr(a)
  q_ref = q_ref * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  q = linear._orthonormalize_columns(a)
  np.testing.assert_allclose(q, q_ref, atol=2e-5)
  np.testing.assert_allclose(jnp.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(32), q.shape),
                             atol=2e-6)


def test_concurrent_favor_draws_do_not_deadlock_on_two_cpus():
  # Four independent draws of 4 blocks of 64×64 (e.g. four FAVOR+ layers at head_dim 64): with
  # jnp.linalg.qr this was a set of batched LAPACK QRs that deadlocked XLA's 2-thread pool.
  run_on_two_cpus("""
import jax
from attnx import core
draw = jax.jit(lambda k: [core.favor_features(kk, 256, 64) for kk in jax.random.split(k, 4)])
for i in range(20):
  jax.block_until_ready(draw(jax.random.PRNGKey(i)))
print("OK")
""", timeout=120, what="four favor_features draws in one program")
