"""Linear attention against a brute-force quadratic computation with the same feature map, and
FAVOR+ against softmax attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support.two_cpu_run import run_on_two_cpus

from attnx.core import linear

B, T, N, K, H, HV = 2, 13, 4, 2, 8, 5


def _qkv(seed=0, t=T, s=T, hv=HV, scale=1.0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)  # numpy: no per-shape compilation of random ops
  q = rng.standard_normal((B, t, N, H)) * scale
  k = rng.standard_normal((B, s, K, H)) * scale
  v = rng.standard_normal((B, s, K, hv))
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _brute(fq, fk, v, causal=False, key_mask=None, eps=1e-6):
  """out_i = Σ_j w_ij v_j / (Σ_j w_ij + ε r_i), w_ij = φ(q_i)·φ(k_j), as an explicit T×S matrix;
  r_i = max_m |φ(q_i)_m| Σ_j Σ_m |φ(k_j)_m| over the keys query i sees (the documented ε)."""
  fq, fk, v = (np.asarray(a, np.float64) for a in (fq, fk, v))
  g = fq.shape[2] // fk.shape[2]
  fk, v = np.repeat(fk, g, axis=2), np.repeat(v, g, axis=2)  # query head n uses kv head n // g
  w = np.einsum("btnm,bsnm->bnts", fq, fk)
  seen = np.ones((fq.shape[0], 1, fq.shape[1], fk.shape[1]))  # [B, 1, T, S]
  if causal:
    seen = seen * np.tril(np.ones(w.shape[-2:]))
  if key_mask is not None:
    seen = seen * np.asarray(key_mask, np.float64)[:, None, None, :]
  w = w * seen
  r = np.abs(fq).max(-1).transpose(0, 2, 1)[..., None] * np.einsum(
      "bots,bsn->bnt", seen, np.abs(fk).sum(-1))[..., None]  # [B, N, T, 1]
  den = w.sum(-1, keepdims=True) + eps * r
  return np.einsum("bnts,bsnd->btnd", w, v) / den.transpose(0, 2, 1, 3)


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
  relu_map = lambda x: jax.nn.relu(x) + 1e-3  # the LRA "Performer" map (docs/references.md)
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
# An example's output depends only on what its queries see (FAVOR+'s stabilizers cancel).
# ---------------------------------------------------------------------------------------------

OMEGA = linear.favor_features(jax.random.PRNGKey(1), 32, H)
# Every registered feature map, plus a callable one.
_MAPS = {name: name for name in linear.FEATURE_MAPS}
_MAPS["relu_callable"] = lambda x: jax.nn.relu(x) + 1e-3
_MASKED = [2, 5, 9]  # key positions of example 0 removed by key_mask


def _largest_key():
  """The key with the largest FAVOR+ exponent ω·x′ − ‖x′‖²/2 for OMEGA: x′ = its longest row.

  A single such key used to set the one global stabilizer of the whole batch, shrinking every
  other example's features against the fixed ε."""
  w = np.asarray(OMEGA, np.float64)
  return w[np.argmax((w * w).sum(1))] * H ** 0.25


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", list(_MAPS))
def test_output_depends_only_on_the_keys_a_query_sees(name, causal):
  rng = np.random.default_rng(7)
  q, k, v = (rng.standard_normal((3, T, n, d)) for n, d in ((N, H), (K, H), (K, HV)))
  k[0] *= 1.5  # example 0's own largest exponent is well below _largest_key()'s
  mask = np.ones((3, T), bool)
  mask[0, _MASKED] = False
  f = jax.jit(lambda q, k, v: linear.linear_attention(
      q, k, v, feature_map=_MAPS[name], features=OMEGA, key_mask=mask, is_causal=causal,
      chunk_size=4))
  run = lambda q, k, v: np.asarray(f(*(jnp.asarray(a, jnp.float32) for a in (q, k, v))))
  base = run(q, k, v)
  assert np.isfinite(base).all()
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
  top = _largest_key()

  # Other examples: the largest-exponent key everywhere in example 1, huge keys and values in 2.
  k2, v2 = k.copy(), v.copy()
  k2[1], k2[2], v2[2] = top, 1e3 * k[2], 1e3 * v[2]
  close(run(q, k2, v2)[0], base[0], err_msg="example 0 depends on the other examples")
  # Masked keys and values: the largest-exponent key and huge values change nothing.
  k3, v3 = k.copy(), v.copy()
  k3[0, _MASKED], v3[0, _MASKED] = top, 1e6
  close(run(q, k3, v3), base, err_msg="the output depends on masked keys")
  # Heads: kv head 1 of example 0 changed; query heads 0 and 1 (kv head 0) are unchanged.
  k4 = k.copy()
  k4[0, :, 1] = top
  close(run(q, k4, v)[0, :, :N // K], base[0, :, :N // K], err_msg="heads depend on each other")
  if causal:  # future keys (positions > 6) are invisible to queries 0..6
    k5, v5 = k.copy(), v.copy()
    k5[0, 7:], v5[0, 7:] = top, 1e3
    close(run(q, k5, v5)[0, :7], base[0, :7], err_msg="causal outputs depend on future keys")


def _favor_reference(q, k, v, omega, causal, key_mask, eps=1e-6):
  """FAVOR+ in float64 numpy, one example at a time, without any stabilizer."""
  omega = np.asarray(omega, np.float64)
  m, h = omega.shape

  def phi(x):  # M^{-1/2} exp(ωx′ − ‖x′‖²/2), x′ = H^{-1/4} x (Choromanski et al. 2020)
    x = np.asarray(x, np.float64) * h ** -0.25
    return np.exp(x @ omega.T - 0.5 * (x * x).sum(-1, keepdims=True)) / np.sqrt(m)

  return np.concatenate([_brute(phi(q[i:i + 1]), phi(k[i:i + 1]), v[i:i + 1], causal,
                                key_mask[i:i + 1], eps) for i in range(q.shape[0])])


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_favor_plus_matches_unstabilized_float64_reference(causal):
  rng = np.random.default_rng(11)
  q, k, v = (rng.standard_normal((3, T, n, d)) for n, d in ((N, H), (K, H), (K, HV)))
  k[0] *= 1.5  # examples at different scales, and a masked largest-exponent key in example 2
  k[1] *= 0.5
  mask = np.ones((3, T), bool)
  mask[0, _MASKED] = mask[2, 4] = False
  k[2, 4] = _largest_key()
  want = _favor_reference(q, k, v, OMEGA, causal, mask)
  got = linear.linear_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                                feature_map="favor_plus", features=OMEGA, key_mask=mask,
                                is_causal=causal, chunk_size=4)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", list(_MAPS))
def test_queries_without_valid_keys_give_zero_with_finite_grads(name, causal):
  q, k, v = _qkv(seed=2, t=6, s=6, hv=3)
  mask = np.ones((B, 6), bool)
  mask[1] = False  # example 1 has no valid key at all
  mask[0, 0] = False  # causal: query 0 of example 0 sees no valid key
  k = k.at[:, 0].set(1e30)  # masked keys are never read, not even by the gradients
  f = functools.partial(linear.linear_attention, feature_map=_MAPS[name], features=OMEGA,
                        key_mask=mask, is_causal=causal, chunk_size=4)
  out = f(q, k, v)
  assert np.isfinite(out).all()
  np.testing.assert_array_equal(out[1], 0.0)
  if causal:
    np.testing.assert_array_equal(out[0, 0], 0.0)
  grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.isfinite(g).all()
    np.testing.assert_array_equal(g[1], 0.0)  # nothing of example 1 reaches its output
  np.testing.assert_array_equal(grads[1][:, 0], 0.0)  # masked keys get no gradient


def test_favor_key_stabilizer_per_example_and_head_over_valid_keys():
  _, k, _ = _qkv(seed=4)
  mask = np.ones((B, T, K), bool)
  mask[0, :, 1] = False  # head 1 of example 0 has no valid key
  mask[1, 3] = False
  k = k.at[1, 3].set(_largest_key())
  fk = np.asarray(linear.favor_plus_features(k, OMEGA, is_query=False, mask=mask))
  assert np.isfinite(fk).all()
  np.testing.assert_array_equal(fk[0, :, 1], 0.0)
  np.testing.assert_array_equal(fk[1, 3], 0.0)
  # Every other example and head has a feature at the maximum M^{-1/2}: its own stabilizer.
  peak = fk.max(axis=(1, 3)) * np.sqrt(OMEGA.shape[0])  # [B, K]
  np.testing.assert_allclose(peak[mask.any(1)], 1.0, rtol=1e-6)
  with pytest.raises(ValueError, match="keys only"):
    linear.favor_plus_features(k, OMEGA, is_query=True, mask=mask)


def test_favor_plus_grads_match_finite_differences():
  q, k, v = _qkv(seed=6, t=6, s=6, hv=3)
  mask = np.ones((B, 6), bool)
  mask[0, 2] = False
  f = functools.partial(linear.linear_attention, feature_map="favor_plus", features=OMEGA,
                        key_mask=mask)
  check_grads(f, (q, k, v), order=1, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2, eps=1e-3)


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
