"""The weighting registry and each pointwise F against its closed form."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attnx import core

Z = np.linspace(-3, 3, 13).astype(np.float32)
SIG = lambda x: 1 / (1 + np.exp(-x))
CLOSED_FORMS = {  # F(z) in float64 numpy, independent of the implementation
    "softmax": np.exp,
    "exp": np.exp,
    "softmax_plus_one": np.exp,
    "relu": lambda z: np.maximum(z, 0),
    "relu2": lambda z: np.maximum(z, 0) ** 2,
    "softplus": lambda z: np.log1p(np.exp(z)),
    "elu_plus_one": lambda z: np.where(z > 0, z + 1, np.exp(z)),
    "taylor_exp": lambda z: 1 + z + z * z / 2,
    "power": lambda z: np.maximum(z, 0) ** 2,
    "sigmoid": SIG,
    "gaussian": lambda z: np.exp(z / 2),  # h = 1, z = −d²
    "boxcar": lambda z: (np.sqrt(np.maximum(-z, 0)) <= 1).astype(float),
    "triangular": lambda z: np.maximum(0, 1 - np.sqrt(np.maximum(-z, 0))),
    "epanechnikov": lambda z: 0.75 * np.maximum(0, 1 - (-z)),
}


class RegistryTest(parameterized.TestCase):

  def test_every_pointwise_weighting_has_a_closed_form_test(self):
    self.assertEqual(set(core.list_weightings("pointwise")), set(CLOSED_FORMS))

  @parameterized.parameters(*sorted(CLOSED_FORMS))
  def test_sum_normalized_matches_closed_form(self, name):
    z = Z - (3.0 if name in core.weightings.POINTWISE_KERNELS else 0.0)  # distances: z ≤ 0
    f = CLOSED_FORMS[name](z.astype(np.float64))
    denom = f.sum() + (1.0 if name == "softmax_plus_one" else 0.0)
    np.testing.assert_allclose(core.weights(z, name), f / denom, rtol=1e-5, atol=1e-7)

  def test_normalization_modes(self):
    z = jnp.asarray(Z)
    where = jnp.asarray(np.arange(13) % 3 != 0)
    f = np.maximum(Z, 0) * np.asarray(where)
    np.testing.assert_allclose(core.weights(z, "relu:normalization=length", where=where),
                               f / np.asarray(where).sum(), rtol=1e-6)
    np.testing.assert_allclose(core.weights(z, "relu:normalization=none", where=where), f,
                               rtol=1e-6)
    # Unnormalized sigmoid: default bias −log n (Ramapuram et al. 2024), n = number of keys.
    np.testing.assert_allclose(core.weights(z, "sigmoid:normalization=none"),
                               SIG(Z - math.log(13)), rtol=1e-5)
    np.testing.assert_allclose(core.weights(z, "sigmoid:normalization=none,bias=0.5"),
                               SIG(Z + 0.5), rtol=1e-5)

  def test_parameters_parse(self):
    self.assertEqual(core.parse_weighting_name("entmax:alpha=1.5,n_iter=30"),
                     ("entmax", {"alpha": 1.5, "n_iter": 30}))
    np.testing.assert_allclose(core.weights(Z, "power:p=3"),
                               np.maximum(Z, 0) ** 3 / (np.maximum(Z, 0) ** 3).sum(), rtol=1e-5)
    np.testing.assert_allclose(core.weights(Z, "softmax:alpha=2"), jax.nn.softmax(2 * Z),
                               rtol=1e-5)

  def test_callable_and_register(self):
    np.testing.assert_allclose(core.weights(Z, lambda z: z * z), Z**2 / (Z**2).sum(), rtol=1e-5)
    core.register_weighting(
        "cube_test", lambda normalization="sum": core.Pointwise(
            "cube_test", lambda z, n: jax.nn.relu(z) ** 3, normalization), overwrite=True)
    try:
      self.assertIn("cube_test", core.list_weightings())
      np.testing.assert_allclose(core.weights(Z, "cube_test"), core.weights(Z, "power:p=3"),
                                 rtol=1e-5)
      with pytest.raises(ValueError, match="already registered"):
        core.register_weighting("cube_test", lambda: None)
    finally:
      core.weightings.unregister_weighting("cube_test")
    self.assertNotIn("cube_test", core.list_weightings())
    with pytest.raises(ValueError, match="may not contain"):
      core.register_weighting("a:b", lambda: None)

  def test_unknown_name_lists_valid(self):
    with pytest.raises(ValueError, match=r"Valid weightings: .*entmax15.*sparsemax"):
      core.weights(Z, "reluu")
    with pytest.raises(ValueError, match=r"where of shape \(3,\)"):
      core.weights(Z, "relu", where=jnp.ones(3, bool))

  def test_unknown_parameter_lists_accepted_ones(self):
    with pytest.raises(ValueError, match=r"\['q'\] for weighting 'power'; it accepts p, "
                                         r"normalization"):
      core.weights(Z, "power:q=3")
    core.register_weighting("fixed_test", lambda: core.Pointwise("fixed_test", lambda z, n: z),
                            overwrite=True)
    try:
      with pytest.raises(ValueError, match="'fixed_test' takes no parameters"):
        core.get_weighting("fixed_test:a=1")
    finally:
      core.weightings.unregister_weighting("fixed_test")

  def test_derivative_matches_autodiff(self):
    for name in core.list_weightings("pointwise"):
      w = core.get_weighting(name)
      z = jnp.asarray(Z) - 3.5  # keep away from kinks of the kernels
      d = w.derivative(z, 13)
      ref = jax.vmap(jax.grad(lambda t, w=w: w.fn(t, 13)))(z)
      chex.assert_trees_all_close(d, ref, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 12),
                  elements=st.floats(-30, 30, width=32)),
       st.sampled_from([n for n in core.list_weightings("pointwise", sums_to_one=True)
                        if not core.get_weighting(n).distance_kernel]))
def test_weights_are_a_distribution_or_zero(s, name):
  w = np.asarray(core.weights(jnp.asarray(s), name))
  assert np.all(w >= 0) and np.all(np.isfinite(w))
  total = w.sum()
  # All zero only if every F(s) is 0: a row of scores ≤ 0 (or, for power, below 2^-126).
  assert abs(total - 1) < 1e-4 or (total == 0 and core.get_weighting(name).zero_on_nonpositive)


@pytest.mark.parametrize("name", ["softmax", "exp:alpha=0.5", "softmax_plus_one"])
def test_online_max_weights_gradients_match_finite_differences_and_closed_form(name):
  """The dense softmax path's custom JVP: check_grads, and grads of a closed form in numpy."""
  from jax.test_util import check_grads
  rng = np.random.default_rng(0)
  s = rng.normal(size=(3, 7)).astype(np.float32)
  mask = rng.random((3, 7)) < 0.7
  mask[1] = False  # a fully masked row
  mask[0, 0] = True
  w = core.get_weighting(name)
  f = lambda x: core.weights(x, w, where=mask)
  check_grads(f, (s,), order=1, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2, eps=1e-2)
  ct = rng.normal(size=s.shape).astype(np.float32)
  g = np.asarray(jax.grad(lambda x: jnp.sum(f(x) * ct))(s), np.float64)
  # closed form: p = e/(Σe + c), dL/ds = α p (ct − Σ p ct) on valid entries, 0 elsewhere.
  alpha = w.exp_alpha
  e = np.where(mask, np.exp(alpha * s.astype(np.float64)), 0.0)
  p = e / np.maximum(e.sum(-1, keepdims=True) + w.denominator_offset, 1e-300)
  want = alpha * p * (ct - np.sum(p * ct, -1, keepdims=True))
  np.testing.assert_allclose(g, want, atol=1e-6)
  assert np.all(g[1] == 0) and np.all(np.isfinite(g))


def test_dense_softmax_gradients_equal_jax_nn():
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, v = (jax.random.normal(kk, (2, 9, 2, 8)) for kk in ks[:3])
  bias = jax.random.normal(ks[3], (2, 2, 9, 9))
  mask = jnp.tril(jnp.ones((9, 9), bool))[None, None]

  def grads(fn):
    return jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3))(q, k, v, bias)

  got = grads(lambda q, k, v, b: core.attention(q, k, v, b, mask, implementation="dense"))
  want = grads(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, mask))
  chex.assert_trees_all_close(got, want, atol=1e-5)


# Sum-normalized sigmoid streams log σ with the running max (core.LogF): its pieces against
# float64 closed forms, on scores far beyond float32's σ, in natural and base-2 units.
@pytest.mark.parametrize("bias", [0.0, -3.0, 110.0])
@pytest.mark.parametrize("unit", [1.0, 1.0 / math.log(2.0)])
def test_sigmoid_log_f_shifted_weight_and_slope_equal_float64(bias, unit):
  lf = core.get_weighting(f"sigmoid:bias={bias}").log_f
  x = np.concatenate([np.linspace(-400, 400, 801), [-1e30, 1e30, -np.inf, np.inf]])
  x = (x - bias).astype(np.float32)  # scores z with z + b on the grid
  xb = x.astype(np.float64) + bias
  log_sig = -np.logaddexp(0.0, -xb)  # float64 log σ(z + b)
  for m_nat in (0.0, -5.0, -300.0, 7.0):  # the running max (≥ log σ) and a backward lse
    m = np.float32(m_nat * unit)
    exp = jnp.exp if unit == 1.0 else jnp.exp2
    r, slope = lf.shifted(jnp.asarray(x), m, exp(m), exp, unit)
    keep = log_sig <= m_nat  # the rule's contract: m bounds log σ
    want = np.exp(log_sig - m_nat)
    np.testing.assert_allclose(np.asarray(r)[keep], want[keep], rtol=2e-5, atol=1e-30)
    sig_neg = np.exp(-np.logaddexp(0.0, xb))  # σ(−x), the derivative of log σ(x)
    np.testing.assert_allclose(np.asarray(slope)[keep], sig_neg[keep], rtol=0, atol=2e-6)
  np.testing.assert_allclose(lf.fn(jnp.asarray(x[np.isfinite(x)])),
                             log_sig[np.isfinite(x)], rtol=2e-6, atol=1e-6)
  bound = np.asarray(lf.bound(jnp.asarray(x)))
  assert np.all(bound >= log_sig - 1e-6) and np.all(np.diff(bound[:801]) >= 0)


@pytest.mark.parametrize("impl", ["dense", "blocked"])
def test_sigmoid_rows_below_float32_range_weigh_as_softmax(impl):
  # σ(x) = eˣ/(1 + eˣ) ≈ eˣ(1 − eˣ): for every x below −100 (σ = 0 in float32) the row's
  # σ(x)/Σσ is softmax(x) to within e^{−100}; σ/Σσ computed as it reads would be 0/0.
  s = -150.0 + 3.0 * jax.random.normal(jax.random.key(0), (4, 37))

  def weights(s):
    if impl == "dense":
      return core.weights(s, "sigmoid")
    # Scores from the bias alone (zero q and k), values the identity: the output is the weights.
    out = core.attention(jnp.zeros((1, 4, 1, 16)), jnp.zeros((1, 37, 1, 16)),
                         jnp.eye(37)[None, :, None, :], bias=s[None, None],
                         weighting="sigmoid", implementation="blocked")
    return out[0, :, 0, :]

  np.testing.assert_allclose(jax.jit(weights)(s), jax.nn.softmax(s), rtol=1e-5, atol=1e-7)
  g = jax.grad(lambda s: jnp.sum(weights(s)[:, 0]))(s)
  np.testing.assert_allclose(g, jax.grad(lambda s: jnp.sum(jax.nn.softmax(s)[:, 0]))(s),
                             rtol=1e-4, atol=1e-7)
