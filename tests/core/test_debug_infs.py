"""``jax.debug_infs`` / ``jax.debug_nans`` on the attention paths (issue 41): finite inputs raise
nothing, forward and gradient, and give the results of the same call without the flags.

A property across modules (attnx/core/weightings/apply.py, api.py, blocked.py,
blocked_rows.py): the flags check every array an eagerly run operation (or a jitted function)
returns, so an intentional ±inf in a masked score, or in a kernel's statistic of a row without
weight, used to stop a user hunting a NaN with JAX's own flags. Pallas is not covered yet (its
kernels return the statistic +inf for a row without weight; docs/guides/implementations.md).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core

WEIGHTINGS = ("softmax", "softmax_plus_one", "relu", "sigmoid", "sparsemax", "entmax15",
              "stick_breaking", "ssmax", "softpick")
B, T, S, N, K, H = 2, 5, 7, 4, 2, 8

# Each case has masked keys; "fullrow" and "causal_fullrow" also a row without any valid key.
_ROW2_NO_KEY = (jnp.arange(T)[:, None] != 2) & (jnp.arange(S)[None, :] != 5)
CASES = {
    "mask": dict(mask=jnp.arange(S) <= 3),
    "causal": dict(is_causal=True),
    "fullrow": dict(mask=_ROW2_NO_KEY),
    "causal_fullrow": dict(is_causal=True, mask=_ROW2_NO_KEY),
}


@contextlib.contextmanager
def _debug_flags():
  with jax.debug_infs(True), jax.debug_nans(True):
    yield


def _inputs():
  kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (B, T, N, H))
  k = jax.random.normal(kk, (B, S, K, H))
  v = jax.random.normal(kv, (B, S, K, H))
  ct = jax.random.normal(kc, (B, T, N, H))  # a cotangent: the gradient sees every output
  return q, k, v, ct


def _value_and_grad(implementation, weighting, kwargs):
  q, k, v, ct = _inputs()
  if implementation == "blocked":
    implementation = core.Blocked(block_q=8, block_k=8)

  def loss(q, k, v):
    out = core.attention(q, k, v, implementation=implementation, weighting=weighting,
                         **kwargs)
    return jnp.sum(out * ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def _assert_same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(g)))


def test_issue_example_dense():
  # The report: any mask, or is_causal, crashed the dense path under jax.debug_infs.
  q, k, v = jnp.zeros((5, 6, 11)), jnp.zeros((7, 3, 11)), jnp.zeros((7, 3, 11))
  for kwargs in ({"mask": jnp.arange(7) <= 3}, {"is_causal": True}):
    want = core.attention(q, k, v, implementation="dense", **kwargs)
    with _debug_flags():
      got = core.attention(q, k, v, implementation="dense", **kwargs)
    _assert_same(got, want)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("implementation", ["dense", "blocked"])
@pytest.mark.split_by_jax
def test_attention_under_debug_flags(implementation, weighting):
  for name, kwargs in CASES.items():
    want = _value_and_grad(implementation, weighting, kwargs)
    with _debug_flags():
      try:
        got = _value_and_grad(implementation, weighting, kwargs)
      except FloatingPointError as e:
        raise AssertionError(f"{implementation}/{weighting}/{name}: {e}") from e
    _assert_same(got, want)


@pytest.mark.parametrize("weighting", ["softmax", "sparsemax"])
def test_automatic_choice_and_jit(weighting):
  # None at T = S = 256 runs blocked for a whole-row weighting and dense for softmax; under
  # jit only what leaves the compiled function is checked.
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (1, 256, 2, 8)) for key in keys)
  mask = jnp.arange(256)[:, None] != 7  # row 7 attends nothing
  f = lambda q, k, v: core.attention(q, k, v, mask=mask, weighting=weighting, is_causal=True)
  g = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1, 2))
  want = (f(q, k, v), g(q, k, v))
  with _debug_flags():
    _assert_same((f(q, k, v), g(q, k, v)), want)
    _assert_same((jax.jit(f)(q, k, v), jax.jit(g)(q, k, v)), want)


@pytest.mark.parametrize("weighting", WEIGHTINGS + ("gaussian",))
def test_weights_with_where(weighting):
  # attention_weights and core.weights(where=) share the dense weighting code.
  q, k, _, _ = _inputs()
  score = "neg_sq_dist" if weighting == "gaussian" else "scaled_dot"
  scores = jnp.einsum("btnh,bsnh->bnts", q[:, :, :K], k)
  want = (core.attention_weights(q, k, mask=_ROW2_NO_KEY, weighting=weighting, score=score),
          core.weights(scores, weighting, where=_ROW2_NO_KEY))
  with _debug_flags():
    got = (core.attention_weights(q, k, mask=_ROW2_NO_KEY, weighting=weighting, score=score),
           core.weights(scores, weighting, where=_ROW2_NO_KEY))
  _assert_same(got, want)
  np.testing.assert_array_equal(np.asarray(got[0])[:, :, 2], 0.0)  # the row without a key


def test_flags_still_catch_a_real_nan():
  # The flags still do their job: a NaN input is reported.
  q, k, v, _ = _inputs()
  q = q.at[0, 1, 0, 0].set(jnp.nan)
  with jax.debug_nans(True), pytest.raises(FloatingPointError):
    core.attention(q, k, v, implementation="dense", mask=jnp.arange(S) <= 3)
