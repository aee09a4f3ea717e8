"""sparsemax / entmax against closed forms, a brute-force simplex solver and finite differences.

The brute-force reference solves max_{p∈Δ} ⟨p, z⟩ − Ω(p) with scipy's SLSQP (attention as a
regularized argmax, after Blondel et al. 2020): Gini → sparsemax, Tsallis-α → α-entmax,
Shannon → softmax.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.test_util import check_grads
from scipy import optimize

from attnx.core import weightings as W
from attnx.core.weightings import simplex

EXAMPLE = np.array([-2.0, 0.0, 0.5], np.float32)
# Rows without ties and with no entry near the support boundary (finite differences are valid).
SMOOTH = np.array([[0.3, -0.2, 1.1, 0.75, -1.4], [2.0, 1.25, -0.5, 1.7, 0.1]], np.float32)

FUNCS = {
    "sparsemax": simplex.sparsemax,
    "entmax15": simplex.entmax15,
    "entmax_bisect_1.3": lambda x, **kw: simplex.entmax_bisect(x, alpha=1.3, **kw),
    "entmax_bisect_3": lambda x, **kw: simplex.entmax_bisect(x, alpha=3.0, **kw),
}


# ---------------------------------------------------------------------------------------------
# Brute-force reference.
# ---------------------------------------------------------------------------------------------

def _regularized_argmax(z: np.ndarray, reg: str, alpha: float = 1.5) -> np.ndarray:
  """argmax_{p∈Δ} ⟨p, z⟩ − Ω(p) by SLSQP, in float64."""
  z = np.asarray(z, np.float64)
  n = z.size

  def omega(p):
    p = np.maximum(p, 0.0)
    if reg == "gini":
      return 0.5 * p @ p - 0.5, p
    if reg == "tsallis":
      return (np.sum(p ** alpha) - 1.0) / (alpha * (alpha - 1.0)), p ** (alpha - 1) / (alpha - 1)
    if reg == "shannon":
      q = np.maximum(p, 1e-300)
      return np.sum(q * np.log(q)), np.log(q) + 1.0
    raise ValueError(reg)

  def neg_obj(p):
    val, grad = omega(p)
    return -(p @ z - val), -(z - grad)

  res = optimize.minimize(
      neg_obj, np.full(n, 1.0 / n), jac=True, method="SLSQP", bounds=[(0.0, 1.0)] * n,
      constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1.0, "jac": lambda p: np.ones(n)}],
      options={"ftol": 1e-14, "maxiter": 1000})
  assert res.success, res.message
  return np.maximum(res.x, 0.0)


def test_brute_force_recovers_softmax():
  """Sanity check of the reference itself: Shannon regularization gives softmax."""
  z = np.array([0.3, -1.0, 2.0, 0.5])
  np.testing.assert_allclose(_regularized_argmax(z, "shannon"), jax.nn.softmax(z), atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name,reg,alpha", [
    ("sparsemax", "gini", 2.0), ("entmax15", "tsallis", 1.5), ("bisect", "tsallis", 1.25),
    ("bisect", "tsallis", 1.5), ("bisect", "tsallis", 3.0)])
def test_matches_brute_force(seed, name, reg, alpha):
  z = np.random.default_rng(seed).normal(size=7).astype(np.float32) * 1.5
  expected = _regularized_argmax(z, reg, alpha)
  if name == "sparsemax":
    got = simplex.sparsemax(z)
  elif name == "entmax15":
    got = simplex.entmax15(z)
  else:
    got = simplex.entmax_bisect(z, alpha=alpha)
  np.testing.assert_allclose(got, expected, atol=2e-4)


# ---------------------------------------------------------------------------------------------
# Closed forms and basic properties.
# ---------------------------------------------------------------------------------------------

def test_reference_examples():
  np.testing.assert_allclose(simplex.sparsemax(EXAMPLE), [0.0, 0.25, 0.75], atol=1e-6)
  np.testing.assert_allclose(simplex.entmax15(EXAMPLE), [0.0, 0.326, 0.674], atol=1e-3)
  # Closed form on the support {1, 2}: (0 − τ)² + (0.25 − τ)² = 1, τ = (0.5 − √7.75)/4.
  tau = (0.5 - np.sqrt(7.75)) / 4
  np.testing.assert_allclose(simplex.entmax15(EXAMPLE), [0.0, tau ** 2, (0.25 - tau) ** 2],
                             atol=1e-6)


@pytest.mark.parametrize("name", FUNCS)
def test_simplex_and_exact_zeros(name):
  x = np.random.default_rng(0).normal(size=(4, 3, 9)).astype(np.float32) * 3
  p = np.asarray(FUNCS[name](x))
  assert p.dtype == np.float32
  np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
  assert (p >= 0).all()
  assert (p == 0.0).any(), "sparse maps must produce exact zeros at this score scale"


def test_one_hot_and_uniform():
  for f in FUNCS.values():
    np.testing.assert_allclose(f(jnp.array([0.0, 10.0, 0.0])), [0, 1, 0], atol=1e-6)
    np.testing.assert_allclose(f(jnp.zeros(5)), np.full(5, 0.2), atol=1e-6)


def test_bisect_matches_exact_and_limits():
  x = np.random.default_rng(1).normal(size=(8, 11)).astype(np.float32) * 2
  np.testing.assert_allclose(simplex.entmax_bisect(x, 1.5), simplex.entmax15(x), atol=1e-5)
  np.testing.assert_allclose(simplex.entmax_bisect(x, 2.0), simplex.sparsemax(x), atol=1e-5)
  # α → 1⁺: the Tsallis entropy tends to Shannon's, entmax to softmax (error O(α − 1)).
  np.testing.assert_allclose(simplex.entmax_bisect(x, 1.001), jax.nn.softmax(x), atol=2e-3)
  np.testing.assert_allclose(simplex.entmax_bisect(x, 1.0 + 1e-5), jax.nn.softmax(x),
                             atol=1e-4)
  # Larger α is sparser.
  counts = [int((simplex.entmax_bisect(x, a) > 0).sum()) for a in (1.2, 1.5, 2.0, 4.0)]
  assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts


@pytest.mark.parametrize("alpha", [1.0, 0.5, -2.0, float("inf")])
def test_bad_alpha(alpha):
  with pytest.raises(ValueError, match="alpha"):
    simplex.entmax_bisect(EXAMPLE, alpha=alpha)
  with pytest.raises(ValueError):
    W.get_weighting(f"entmax:alpha={alpha}")


def test_alpha_one_error_mentions_softmax():
  with pytest.raises(ValueError, match="softmax"):
    simplex.entmax_bisect(EXAMPLE, alpha=1.0)


@pytest.mark.parametrize("name", FUNCS)
def test_axis(name):
  x = np.random.default_rng(2).normal(size=(5, 4, 3)).astype(np.float32)
  f = FUNCS[name]
  np.testing.assert_allclose(f(x, axis=0), np.moveaxis(np.asarray(f(np.moveaxis(x, 0, -1))),
                                                       -1, 0), atol=1e-6)
  np.testing.assert_allclose(f(x, axis=1), f(np.swapaxes(x, 1, 2)).swapaxes(1, 2), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Masks and extremes.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FUNCS)
def test_where_equals_dropping_entries(name):
  f = FUNCS[name]
  x = np.array([[0.4, 3.0, -0.1, 0.2, 0.9]], np.float32)
  mask = np.array([[True, False, True, True, True]])
  p = np.asarray(f(x, where=mask))
  assert p[0, 1] == 0.0
  np.testing.assert_allclose(p[:, mask[0]], f(x[:, mask[0]]), atol=1e-6)
  # A masked huge score must not leak; nor must −inf scores (treated as masked).
  x_inf = np.where(mask, x, -np.inf).astype(np.float32)
  np.testing.assert_allclose(f(x_inf), p, atol=1e-6)


@pytest.mark.parametrize("name", FUNCS)
def test_fully_masked_rows_are_zero_with_finite_grads(name):
  f = FUNCS[name]
  x = jnp.array([[0.5, -1.0, 2.0], [1.0, 2.0, 3.0]])
  mask = jnp.array([[False, False, False], [True, True, False]])
  p = f(x, where=mask)
  np.testing.assert_array_equal(p[0], 0.0)
  np.testing.assert_allclose(p[1].sum(), 1.0, atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(f(x, where=mask) * jnp.arange(3.0)))(x)
  assert np.isfinite(g).all()
  np.testing.assert_array_equal(g[0], 0.0)
  np.testing.assert_array_equal(g[1, 2], 0.0)
  # The known entmax pitfall: a row of −inf (no where) must give zeros, not NaN.
  neg_inf = jnp.full((2, 4), -jnp.inf)
  np.testing.assert_array_equal(f(neg_inf), 0.0)
  assert np.isfinite(jax.grad(lambda x: f(x)[0, 0])(neg_inf)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", FUNCS)
def test_extreme_scores(name, dtype):
  f = FUNCS[name]
  big = 1e4 if dtype != jnp.float16 else 6e4
  x = jnp.array([[big, -big, 0.0, big], [-big, -big, -big, -big]], dtype)
  p = f(x)
  assert p.dtype == jnp.float32
  assert np.isfinite(p).all()
  np.testing.assert_allclose(p, [[0.5, 0, 0, 0.5], [0.25] * 4], atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(4.0)))(x.astype(jnp.float32))
  assert np.isfinite(g).all()
  # Shift invariance at large offsets is exact after the max shift.
  if dtype == jnp.float32:
    x = jnp.array([1e4, 1e4 - 0.5, -1e4], jnp.float32)
    np.testing.assert_allclose(f(x), f(jnp.array([0.0, -0.5, -2e4])), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Gradients.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("axis", [-1, 0])
def test_check_grads(name, axis):
  f = FUNCS[name]
  x = SMOOTH if axis == -1 else SMOOTH.T.copy()
  check_grads(lambda x: f(x, axis=axis), (x,), order=1, modes=("fwd", "rev"), atol=1e-2,
              rtol=1e-2, eps=1e-3)


def test_check_grads_masked():
  mask = np.array([[True, True, False, True, True], [True, False, True, True, True]])
  for f in FUNCS.values():
    check_grads(lambda x, f=f: f(x, where=mask), (SMOOTH,), order=1, modes=("fwd", "rev"),
                atol=1e-2, rtol=1e-2, eps=1e-3)


def test_sparsemax_jacobian_closed_form():
  """Martins & Astudillo 2016: J = diag(s) − s sᵀ/|S| (s the support indicator)."""
  x = SMOOTH[0]
  p = simplex.sparsemax(x)
  s = (np.asarray(p) > 0).astype(np.float32)
  np.testing.assert_allclose(jax.jacobian(simplex.sparsemax)(x),
                             np.diag(s) - np.outer(s, s) / s.sum(), atol=1e-6)


def test_entmax_jacobian_closed_form():
  """Peters et al. 2019, Prop. 2: J = diag(s) − s sᵀ/Σs with s = p^{2−α}."""
  x = SMOOTH[1]
  for alpha, f in [(1.5, simplex.entmax15), (1.3, FUNCS["entmax_bisect_1.3"]),
                   (3.0, FUNCS["entmax_bisect_3"])]:
    p = np.asarray(f(x), np.float64)
    s = np.power(p, 2 - alpha, out=np.zeros_like(p), where=p > 0)
    np.testing.assert_allclose(jax.jacobian(f)(x), np.diag(s) - np.outer(s, s) / s.sum(),
                               atol=1e-5)


def test_vmap_and_grad_compose():
  x = np.random.default_rng(3).normal(size=(3, 7)).astype(np.float32)
  v = np.linspace(-1.0, 1.0, 7, dtype=np.float32)
  for alpha, f in [(2.0, simplex.sparsemax), (1.5, simplex.entmax15),
                   (1.3, FUNCS["entmax_bisect_1.3"])]:
    batched = jax.vmap(jax.grad(lambda row, f=f: f(row) @ v))(x)
    # Closed-form vector-Jacobian product (J is symmetric): s⊙v − (⟨s, v⟩/Σs) s.
    p = np.asarray(f(x), np.float64)
    s = np.power(p, 2 - alpha, out=np.zeros_like(p), where=p > 0)
    want = s * v - (s @ v / s.sum(-1))[:, None] * s
    np.testing.assert_allclose(batched, want, atol=1e-5)
  # Second order differentiates the custom JVP rule itself.
  hess = jax.hessian(lambda row: simplex.entmax15(row) @ v)(x[0])
  assert np.isfinite(hess).all()


# ---------------------------------------------------------------------------------------------
# Properties, jit and the registry.
# ---------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(x=hnp.arrays(np.float32, st.sampled_from([1, 2, 7]),
                    elements=st.floats(-50, 50, width=32, allow_subnormal=False)),
       c=st.floats(-100, 100, width=32), name=st.sampled_from(sorted(FUNCS)))
def test_properties(x, c, name):
  f = FUNCS[name]
  p = np.asarray(f(x))
  assert (p >= 0).all()
  np.testing.assert_allclose(p.sum(), 1.0, atol=1e-5)
  np.testing.assert_allclose(f(x + np.float32(c)), p, atol=1e-4)
  # Order preserving: a larger score never gets a smaller weight.
  order = np.argsort(x, kind="stable")
  assert (np.diff(p[order]) >= -1e-6).all()


class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_jit_and_no_jit_agree(self):
    x = jnp.asarray(SMOOTH)
    mask = jnp.array([[True, True, True, False, True]])
    for f in FUNCS.values():
      got = self.variant(lambda x, m, f=f: f(x, where=m))(x, mask)
      np.testing.assert_allclose(got, f(np.asarray(x), where=np.asarray(mask)), atol=1e-6)
      np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_registered_row_normalizers():
  names = W.list_weightings("row")
  for name in ("sparsemax", "entmax15", "entmax"):
    assert name in names
  x = np.random.default_rng(4).normal(size=(3, 6)).astype(np.float32)
  mask = np.array([True, True, False, True, True, True])
  for spec, ref in [("sparsemax", simplex.sparsemax), ("entmax15", simplex.entmax15),
                    ("entmax", simplex.entmax15), ("entmax:alpha=2", simplex.sparsemax),
                    ("entmax:alpha=1.5,n_iter=40", simplex.entmax15),
                    ("entmax:alpha=1.3", FUNCS["entmax_bisect_1.3"])]:
    w = W.get_weighting(spec)
    assert isinstance(w, W.RowNormalizer), spec
    np.testing.assert_allclose(W.weights(x.T, spec, axis=0, where=mask[:, None]),
                               ref(x, where=mask).T, atol=1e-5, err_msg=spec)
  np.testing.assert_allclose(W.weights(x, "sparsemax:scale=2"), simplex.sparsemax(2 * x),
                             atol=1e-6)
  assert W.get_weighting("entmax:alpha=1.3").name == "entmax:alpha=1.3"
  with pytest.raises(ValueError, match="scale"):
    W.get_weighting("entmax15:scale=0")


# ---------------------------------------------------------------------------------------------
# Long rows: the sort-free solvers against the papers' sort-based algorithms (numpy, float64).
# ---------------------------------------------------------------------------------------------

def _np_sparsemax(z: np.ndarray) -> np.ndarray:
  """Martins & Astudillo (2016), Algorithm 1."""
  zs = np.sort(z)[::-1]
  k = np.arange(1, z.size + 1)
  cs = np.cumsum(zs)
  k_z = np.max(k[1 + k * zs > cs])
  return np.maximum(z - (cs[k_z - 1] - 1) / k_z, 0.0)


def _np_entmax15(z: np.ndarray) -> np.ndarray:
  """Peters, Niculae & Martins (2019), Algorithm 2 (exact 1.5-entmax)."""
  zs = np.sort(z / 2)[::-1]
  k = np.arange(1, z.size + 1)
  mean = np.cumsum(zs) / k
  ss = k * (np.cumsum(zs**2) / k - mean**2)
  tau = mean - np.sqrt(np.maximum((1 - ss) / k, 0))
  k_z = np.sum(tau <= zs)
  return np.maximum(z / 2 - tau[k_z - 1], 0.0) ** 2


@pytest.mark.parametrize("family", ["normal", "wide", "linear", "log", "ties"])
def test_long_rows_match_sort_based_algorithms(family):
  n = 2000
  rng = np.random.default_rng(0)
  z = {"normal": rng.normal(size=n), "wide": 1e3 * rng.normal(size=n),
       "linear": -0.002 * np.arange(n), "log": -0.3 * np.log1p(np.arange(n)),
       "ties": np.repeat(rng.normal(size=n // 100), 100)}[family]
  z = rng.permutation(z).astype(np.float32)
  for fn, ref in ((simplex.sparsemax, _np_sparsemax), (simplex.entmax15, _np_entmax15)):
    expected = ref(z.astype(np.float64))
    got = np.asarray(fn(z))
    np.testing.assert_allclose(got, expected, atol=2e-6, err_msg=f"{fn.__name__} {family}")
    np.testing.assert_array_equal(got > 0, expected > 1e-12, err_msg=f"{fn.__name__} {family}")
