"""attnx.nn.nadaraya_watson: NadarayaWatsonRegressor against numpy, learned forms, dtypes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnx.nn as an

KEY = jax.random.PRNGKey(0)


def _nw_data():
  rng = np.random.default_rng(0)
  xt = np.sort(rng.uniform(0, 4, 20)).astype(np.float32)
  yt = (2 * np.sin(xt) + xt + rng.normal(size=20)).astype(np.float32)
  return np.linspace(0, 4, 7).astype(np.float32), xt, yt


def test_nadaraya_watson_fixed_gaussian_equals_numpy():
  xq, xt, yt = _nw_data()
  h = 0.5
  model = an.NadarayaWatsonRegressor(kernel="gaussian", bandwidth=h)
  variables = model.init(KEY, xq, xt, yt)
  assert not variables.get("params")
  k = np.exp(-((xq[:, None] - xt[None]) ** 2) / (2 * h * h))
  ref = (k * yt).sum(1) / k.sum(1)
  np.testing.assert_allclose(model.apply(variables, xq, xt, yt), ref, rtol=1e-5, atol=1e-5)
  # Learned forms start at the same estimator.
  grads = {}
  for mode, name in (("learned_bandwidth", "log_bandwidth"), ("learned_w", "w")):
    m = an.NadarayaWatsonRegressor(kernel="gaussian", bandwidth=h, mode=mode)
    v = m.init(KEY, xq, xt, yt)
    np.testing.assert_allclose(m.apply(v, xq, xt, yt), ref, rtol=1e-5, atol=1e-5)
    loss = lambda p, m=m: jnp.sum((m.apply(p, xq, xt, yt) - 1.0) ** 2)
    grads[name] = float(jax.grad(loss)(v)["params"][name])
    if name == "log_bandwidth":  # against a central finite difference
      eps = 1e-2
      shift = lambda d, v=v: {"params": {"log_bandwidth": v["params"]["log_bandwidth"] + d}}
      fd = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
      np.testing.assert_allclose(grads[name], fd, rtol=2e-2)
  assert grads["w"] != 0
  # w = 1/h = exp(−log h): the two parametrizations' gradients are linked by the chain rule.
  np.testing.assert_allclose(grads["log_bandwidth"], -grads["w"] / h, rtol=1e-4)


def test_nadaraya_watson_dtypes_and_shape_checks():
  xq, xt, yt = _nw_data()
  model = an.NadarayaWatsonRegressor(bandwidth=0.5, mode="learned_bandwidth",
                                     dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  v = model.init(KEY, xq, xt, yt)
  assert v["params"]["log_bandwidth"].dtype == jnp.bfloat16
  out = model.apply(v, xq, xt, yt)
  assert out.dtype == jnp.bfloat16
  ref = an.NadarayaWatsonRegressor(bandwidth=0.5).apply({}, xq, xt, yt)
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=0.1)
  with pytest.raises(AssertionError, match="shape prefix"):  # one target per training point
    model.init(KEY, xq, xt, yt[:-1])
  with pytest.raises(AssertionError, match="shape suffix"):  # same feature dim
    model.init(KEY, np.ones((3, 2)), np.ones((20, 3)), yt)


def test_leave_one_out_mse_predicts_each_point_from_the_others():
  _, xt, yt = _nw_data()
  xt, yt = xt[:6], yt[:6]
  model = an.NadarayaWatsonRegressor(bandwidth=0.7, mode="learned_bandwidth")
  params = model.init(KEY, xt[:1], xt, yt)["params"]
  fixed = an.NadarayaWatsonRegressor(bandwidth=0.7)
  want = np.mean([(float(fixed.apply({}, xt[i:i + 1], np.delete(xt, i, 0),
                                     np.delete(yt, i, 0))[0]) - float(yt[i])) ** 2
                  for i in range(6)])
  loss = an.leave_one_out_mse(model, params, xt, yt)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  # Unlike the in-sample loss, it does not fall to 0 as h -> 0 (each point is left out).
  small = {"log_bandwidth": jnp.log(1e-3)}
  assert float(an.leave_one_out_mse(model, small, xt, yt)) > 0.1 * float(np.var(yt))
  with pytest.raises(ValueError, match="at least 2"):
    an.leave_one_out_mse(model, params, xt[:1], yt[:1])
