"""attnx.core.softplus: one-exp softplus against float64 log(1 + eᶻ) and its exact derivative."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import expit

from attnx.core.softplus import softplus

# Every normal float32 softplus value: below −87, eᶻ is subnormal in float32 for any method.
Z = np.concatenate([np.linspace(-87, 87, 200_001), np.linspace(-1e-3, 1e-3, 2001),
                    [-1e4, 1e4, 0.0]]).astype(np.float32)
REF = np.logaddexp(0.0, Z.astype(np.float64))


class SoftplusTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_relative_error_over_the_float32_range(self):
    out = np.asarray(self.variant(softplus)(Z), np.float64)
    normal = Z >= -87
    rel = np.abs(out - REF)[normal] / REF[normal]
    self.assertLess(rel.max(), 4e-7)  # ≈ 3 ulp; jax.nn.softplus: 1.1e-7
    np.testing.assert_array_equal(out[Z == 1e4], 1e4)
    self.assertEqual(out[Z == -1e4][0], 0.0)
    self.assertTrue(np.all(np.isfinite(out)))

  def test_derivative_is_the_sigmoid(self):
    g = jax.vmap(jax.grad(softplus))(jnp.asarray(Z))
    sig = expit(Z.astype(np.float64))
    np.testing.assert_allclose(g, sig, rtol=2e-7, atol=1e-30)
    # Second derivative σ(1 − σ), through the custom JVP.
    z = jnp.linspace(-6.0, 6.0, 25)
    g2 = jax.vmap(jax.grad(jax.grad(softplus)))(z)
    s = expit(np.asarray(z, np.float64))
    np.testing.assert_allclose(g2, s * (1 - s), rtol=1e-5, atol=1e-7)

  @parameterized.parameters(jnp.bfloat16, jnp.float16)
  def test_low_precision_in_and_out(self, dtype):
    z = jnp.linspace(-10.0, 10.0, 41).astype(dtype)
    out = softplus(z)
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(jax.nn.softplus(z.astype(jnp.float32)).astype(dtype),
                                          np.float32), rtol=1e-2)

  def test_float64_uses_the_exact_formula(self):
    with jax.enable_x64(True):
      z = jnp.asarray([-700.0, -30.0, -1e-9, 0.5, 30.0], jnp.float64)
      np.testing.assert_allclose(softplus(z), np.logaddexp(0.0, np.asarray(z)), rtol=1e-15)


@settings(max_examples=60, deadline=None)
@given(st.floats(-80, 80, width=32))
def test_agrees_with_jax_nn_softplus(z):
  np.testing.assert_allclose(softplus(jnp.float32(z)), jax.nn.softplus(jnp.float32(z)),
                             rtol=5e-7)
