"""SSMax, softpick and stick-breaking against brute-force float64 loops of their formulas."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from attnx.core import weightings as W
from attnx.core.weightings import rownorm

# ---------------------------------------------------------------------------------------------
# Brute-force references (one row at a time, float64, written straight from the papers).
# ---------------------------------------------------------------------------------------------


def _ssmax_row(z, valid, s=1.0):
  idx = [j for j in range(len(z)) if valid[j]]
  out = np.zeros(len(z))
  if not idx:
    return out
  n = len(idx)
  e = {j: n ** (s * float(z[j]) - max(s * float(z[i]) for i in idx)) for j in idx}
  total = sum(e.values())
  for j in idx:
    out[j] = e[j] / total
  return out


def _softpick_row(z, valid, eps=1e-6):
  out = np.zeros(len(z))
  den = eps + sum(abs(math.expm1(float(z[j]))) for j in range(len(z)) if valid[j])
  for j in range(len(z)):
    if valid[j]:
      out[j] = max(math.expm1(float(z[j])), 0.0) / den
  return out


def _stick_row(z, valid):
  out = np.zeros(len(z))
  rest = 1.0
  for j in reversed(range(len(z))):  # the last position breaks the stick first
    if valid[j]:
      beta = 1.0 / (1.0 + math.exp(-float(z[j])))
      out[j] = beta * rest
      rest *= 1.0 - beta
  return out


REFS = {"ssmax": _ssmax_row, "softpick": _softpick_row, "stick_breaking": _stick_row}
FUNCS = {"ssmax": rownorm.ssmax, "softpick": rownorm.softpick,
         "stick_breaking": rownorm.stick_breaking}


def _brute(name, x, mask, axis=-1, **kw):
  mask = np.ones(np.shape(x), bool) if mask is None else np.broadcast_to(mask, np.shape(x))
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  mask = np.moveaxis(mask, axis, -1)
  out = np.zeros_like(x)
  for idx in np.ndindex(x.shape[:-1]):
    out[idx] = REFS[name](x[idx], mask[idx], **kw)
  return np.moveaxis(out, -1, axis)


# ---------------------------------------------------------------------------------------------
# Against the references.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("axis", [-1, 1])
def test_matches_brute_force(name, axis):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 6, 5)).astype(np.float32) * 2
  mask = rng.random(size=(3, 6, 5)) < 0.7
  mask[0, :, :] = True
  for m in (None, mask):
    got = FUNCS[name](x, axis=axis, where=m)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, _brute(name, x, m, axis), atol=1e-6, rtol=1e-5)


def test_parameters_match_brute_force():
  x = np.random.default_rng(1).normal(size=(4, 7)).astype(np.float32)
  np.testing.assert_allclose(rownorm.ssmax(x, s=0.43), _brute("ssmax", x, None, s=0.43),
                             atol=1e-6)
  np.testing.assert_allclose(rownorm.softpick(x, eps=0.5), _brute("softpick", x, None, eps=0.5),
                             atol=1e-6)


def test_ssmax_is_softmax_with_log_n_temperature():
  x = np.random.default_rng(2).normal(size=(2, 9)).astype(np.float32)
  np.testing.assert_allclose(rownorm.ssmax(x, s=0.7), jax.nn.softmax(0.7 * np.log(9) * x),
                             atol=1e-6)
  # Per-row s (e.g. learned per head), broadcast along the normalized axis.
  s = np.array([[0.5], [2.0]], np.float32)
  np.testing.assert_allclose(rownorm.ssmax(x, s=s), jax.nn.softmax(s * np.log(9) * x),
                             atol=1e-6)
  # n counts valid keys only; a single valid key gets all the weight; s = 0 is uniform.
  mask = np.array([True, True, True, False, False, False, False, False, False])
  np.testing.assert_allclose(rownorm.ssmax(x, where=mask)[:, :3],
                             jax.nn.softmax(np.log(3) * x[:, :3]), atol=1e-6)
  one = np.arange(9) == 4
  np.testing.assert_allclose(rownorm.ssmax(x, where=one), np.broadcast_to(one, x.shape) * 1.0)
  np.testing.assert_allclose(rownorm.ssmax(x, s=0.0), np.full(x.shape, 1 / 9), atol=1e-6)


def test_ssmax_sharpens_with_length():
  """The point of SSMax: the top weight does not fade as n grows (Nakanishi 2025, Fig. 1)."""
  tops_soft, tops_ss = [], []
  for n in (16, 256, 4096):
    x = jnp.zeros(n).at[0].set(2.0)
    tops_soft.append(float(jax.nn.softmax(x)[0]))
    tops_ss.append(float(rownorm.ssmax(x)[0]))
  assert tops_soft[-1] < 0.01 and tops_ss == sorted(tops_ss), (tops_soft, tops_ss)


def test_softpick_properties():
  x = np.array([[-1.0, 0.0, 0.5, 2.0], [-3.0, -0.1, -2.0, 0.0]], np.float32)
  p = np.asarray(rownorm.softpick(x))
  assert (p[:, :2] == 0.0).all() and (p[1] == 0.0).all()  # no weight for scores ≤ 0
  assert 0 < p[0].sum() < 1
  # Positive scores only: sums to one up to ε.
  np.testing.assert_allclose(rownorm.softpick(np.array([0.5, 1.0, 3.0])).sum(), 1.0, atol=1e-5)


def test_stick_breaking_properties():
  x = np.random.default_rng(3).normal(size=(5, 8)).astype(np.float32)
  p = np.asarray(rownorm.stick_breaking(x))
  beta = 1 / (1 + np.exp(-x.astype(np.float64)))
  np.testing.assert_allclose(p.sum(-1), 1 - np.prod(1 - beta, -1), atol=1e-6)
  np.testing.assert_allclose(p[:, -1], beta[:, -1], atol=1e-6)  # the last key goes first
  # A decisive last key takes (almost) everything; earlier keys get what is left.
  y = np.array([5.0, 5.0, 30.0], np.float32)
  np.testing.assert_allclose(rownorm.stick_breaking(y), [0, 0, 1], atol=1e-6)


def test_stick_breaking_causal_matches_tan_et_al():
  """A_ij = β_ij Π_{j<k≤i}(1 − β_ik) over keys k ≤ i under a causal mask."""
  t = 6
  s = np.random.default_rng(4).normal(size=(t, t)).astype(np.float32)
  causal = np.tril(np.ones((t, t), bool))
  got = np.asarray(rownorm.stick_breaking(s, where=causal))
  beta = 1 / (1 + np.exp(-s.astype(np.float64)))
  for i in range(t):
    for j in range(t):
      want = beta[i, j] * np.prod([1 - beta[i, k] for k in range(j + 1, i + 1)]) if j <= i else 0
      np.testing.assert_allclose(got[i, j], want, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Masks, extremes and gradients.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FUNCS)
def test_fully_masked_rows(name):
  f = FUNCS[name]
  x = jnp.array([[0.5, -1.0, 2.0], [1.0, 2.0, 3.0]])
  mask = jnp.array([[False, False, False], [True, False, True]])
  p = f(x, where=mask)
  np.testing.assert_array_equal(p[0], 0.0)
  assert p[1, 1] == 0.0 and p[1, 2] > 0
  g = jax.grad(lambda x: jnp.sum(f(x, where=mask) * jnp.arange(1.0, 4.0)))(x)
  assert np.isfinite(g).all()
  np.testing.assert_array_equal(g[0], 0.0)
  np.testing.assert_array_equal(g[1, 1], 0.0)
  # −inf scores count as masked (no NaN from −inf − (−inf)).
  neg = jnp.where(mask, x, -jnp.inf)
  np.testing.assert_allclose(f(neg), p, atol=1e-7)
  assert np.isfinite(jax.grad(lambda x: f(x).sum())(neg)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", FUNCS)
def test_extreme_scores(name, dtype):
  f = FUNCS[name]
  x = jnp.array([[1e4, -1e4, 0.0, 1e4], [-1e4] * 4, [1e4] * 4, [0.0] * 4], dtype)
  p = f(x)
  g = jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(4.0)))(x.astype(jnp.float32))
  assert np.isfinite(p).all() and np.isfinite(g).all()
  assert (p >= 0).all()
  expected = {
      "ssmax": [[0.5, 0, 0, 0.5], [0.25] * 4, [0.25] * 4, [0.25] * 4],
      "softpick": [[0.5, 0, 0, 0.5], [0] * 4, [0.25] * 4, [0] * 4],
      "stick_breaking": [[0, 0, 0, 1], [0] * 4, [0, 0, 0, 1], [1 / 16, 1 / 8, 1 / 4, 1 / 2]],
  }[name]
  np.testing.assert_allclose(p, expected, atol=1e-6)


def test_softpick_large_scores_no_cancellation():
  # Row max > 80 takes the e^{z−m} − e^{−m} branch; compare with the exact ratio.
  x = np.array([100.0, 99.0, 50.0, -3.0], np.float32)
  d = np.expm1(x.astype(np.float64))
  np.testing.assert_allclose(rownorm.softpick(x), np.maximum(d, 0) / (np.abs(d).sum() + 1e-6),
                             rtol=1e-5)
  # Tiny positive scores: expm1 keeps full relative precision.
  y = np.array([1e-4, 2e-4, -1e-4], np.float32)
  np.testing.assert_allclose(rownorm.softpick(y), _brute("softpick", y[None], None)[0],
                             rtol=1e-5)


# Entries away from softpick's kink at 0.
SMOOTH = np.array([[0.3, -0.2, 1.1, 0.75, -1.4], [2.0, 1.25, -0.5, 1.7, 0.1]], np.float32)


@pytest.mark.parametrize("name", FUNCS)
def test_check_grads(name):
  mask = np.array([[True, True, False, True, True], [True, True, True, True, True]])
  for m in (None, mask):
    check_grads(lambda x, m=m: FUNCS[name](x, where=m), (SMOOTH,), order=1, modes=("fwd", "rev"),
                atol=1e-2, rtol=1e-2, eps=1e-3)
  check_grads(lambda s: rownorm.ssmax(SMOOTH, s=s), (np.float32(0.8),), order=1,
              modes=("fwd", "rev"), atol=1e-2, rtol=1e-2, eps=1e-3)


class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_vmap_jit(self):
    x = jnp.asarray(SMOOTH)
    for name, f in FUNCS.items():
      got = self.variant(jax.vmap(lambda r, f=f: f(r)))(x)
      np.testing.assert_allclose(got, _brute(name, SMOOTH, None), atol=1e-6)


def test_registry():
  names = W.list_weightings("row")
  x = np.random.default_rng(5).normal(size=(3, 6)).astype(np.float32)
  mask = np.array([True, False, True, True, True, True])
  for spec, ref in [("ssmax", lambda x, w: _brute("ssmax", x, w)),
                    ("ssmax:s=0.5", lambda x, w: _brute("ssmax", x, w, s=0.5)),
                    ("softpick", lambda x, w: _brute("softpick", x, w)),
                    ("softpick:eps=0.1", lambda x, w: _brute("softpick", x, w, eps=0.1)),
                    ("stick_breaking", lambda x, w: _brute("stick_breaking", x, w))]:
    assert spec.partition(":")[0] in names
    assert isinstance(W.get_weighting(spec), W.RowNormalizer)
    np.testing.assert_allclose(W.weights(x, spec, where=mask), ref(x, mask), atol=1e-6,
                               err_msg=spec)
  assert W.get_weighting("ssmax:s=0.5").name == "ssmax:s=0.5"
  with pytest.raises(ValueError):
    W.get_weighting("softpick:eps=0")
