"""Scores against brute-force per-pair computations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from attnx import core

T, S, N, H = 5, 6, 2, 4


def _qk(seed=0):
  a, b = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(a, (2, T, N, H)), jax.random.normal(b, (2, S, N, H))


def _brute(q, k, pair):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  out = np.zeros((q.shape[0], N, T, S))
  for b in range(q.shape[0]):
    for n in range(N):
      for i in range(T):
        for j in range(S):
          out[b, n, i, j] = pair(q[b, i, n], k[b, j, n], n)
  return out


class ScoresTest(parameterized.TestCase):

  def test_plain_scores(self):
    q, k = _qk()
    np.testing.assert_allclose(core.dot(q, k), _brute(q, k, lambda a, b, n: a @ b), atol=1e-5)
    np.testing.assert_allclose(core.scaled_dot(q, k),
                               _brute(q, k, lambda a, b, n: a @ b / 2.0), atol=1e-5)
    np.testing.assert_allclose(
        core.cosine(q, k, temperature=0.5),
        _brute(q, k, lambda a, b, n: a @ b / np.linalg.norm(a) / np.linalg.norm(b) / 0.5),
        atol=1e-5)
    np.testing.assert_allclose(core.neg_sq_dist(q, k),
                               _brute(q, k, lambda a, b, n: -np.sum((a - b) ** 2)), atol=1e-4)

  def test_parametrized_scores(self):
    q, k = _qk(1)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(H, H))
    wh = rng.normal(size=(N, H, H))
    lm = rng.normal(size=(H, 3))
    wq, wk, v = rng.normal(size=(H, 3)), rng.normal(size=(H, 3)), rng.normal(size=3)
    np.testing.assert_allclose(core.bilinear(q, k, w), _brute(q, k, lambda a, b, n: a @ w @ b),
                               atol=1e-4)
    np.testing.assert_allclose(core.bilinear(q, k, wh),
                               _brute(q, k, lambda a, b, n: a @ wh[n] @ b), atol=1e-4)
    np.testing.assert_allclose(core.metric(q, k, lm),
                               _brute(q, k, lambda a, b, n: -np.sum(((a - b) @ lm) ** 2)),
                               atol=1e-4)
    np.testing.assert_allclose(core.additive(q, k, wq, wk, v),
                               _brute(q, k, lambda a, b, n: v @ np.tanh(a @ wq + b @ wk)),
                               atol=1e-5)

  @parameterized.parameters("dense", "blocked")
  def test_attention_with_every_streamable_score(self, impl):
    """The blocked kernel's dot-product rewrite of each score equals the dense score."""
    q, k = _qk(2)
    v = jax.random.normal(jax.random.PRNGKey(9), (2, S, N, 3))
    rng = np.random.default_rng(1)
    params = {"bilinear": {"W": rng.normal(size=(H, H))},
              "metric": {"L": rng.normal(size=(N, H, 2)) * 0.5},
              "cosine": {"temperature": 0.2}}
    for name in ("dot", "scaled_dot", "cosine", "neg_sq_dist", "bilinear", "metric"):
      p = params.get(name, {})
      distance = core.get_score(name).distance
      # relu vanishes on distances, a distance kernel is meaningless on similarities: both
      # rejected (test_distance_kernels_need_a_distance_score).
      for weighting in ("softmax", "sigmoid" if distance else "relu",
                        "gaussian:h=2.0" if distance else "taylor_exp"):
        out = core.attention(q, k, v, score=name, score_params=p, weighting=weighting,
                             implementation=impl)
        s = core.get_score(name).dense(q, k, **p) * (0.5 if name == "scaled_dot" else 1.0)
        ref = jnp.einsum("bnts,bsnh->btnh", core.weights(s, weighting), v)
        chex.assert_trees_all_close(out, ref, atol=2e-4, rtol=2e-4)

  def test_distance_kernels_need_a_distance_score(self):
    q, k = _qk(2)
    v = jnp.ones((2, S, N, 3))
    for kernel in core.weightings.POINTWISE_KERNELS:
      for score in ("dot", "scaled_dot", "cosine", "bilinear", "additive"):
        with self.assertRaisesRegex(ValueError, "neg_sq_dist"):
          core.attention(q, k, v, weighting=kernel, score=score)
        with self.assertRaisesRegex(ValueError, "not a distance"):
          core.check_compatible(kernel, score)
      core.check_compatible(kernel, "metric")
      out = core.attention(q, k, v, weighting=kernel, score="neg_sq_dist")
      self.assertTrue(bool(jnp.all(jnp.isfinite(out))))
    # Weightings that vanish for every s ≤ 0 give all-zero weights on a distance score.
    zero = core.list_weightings(zero_on_nonpositive=True)
    self.assertTrue({"relu", "softpick"} <= set(zero), zero)
    for name in [*zero, "power:p=3"]:
      for score in ("neg_sq_dist", "metric"):
        with self.assertRaisesRegex(ValueError, "every weight would be 0"):
          core.check_compatible(name, score)
    for name in core.list_weightings(zero_on_nonpositive=False):
      core.check_compatible(name, "neg_sq_dist")
    with self.assertRaisesRegex(ValueError, "every weight would be 0"):
      core.attention(q, k, v, weighting="relu", score="neg_sq_dist")
    # A user's own score is trusted.
    core.attention(q, k, v, weighting="gaussian", score=lambda a, b: -core.neg_sq_dist(a, b) * 0)
    core.check_compatible("softmax", "neg_sq_dist")

  def test_callable_score_and_inline_params(self):
    q, k = _qk(3)
    v = jnp.ones((2, S, N, 1))
    out = core.attention(q, k, v, score=lambda a, b: core.dot(a, b) * 0.0)
    chex.assert_trees_all_close(out, jnp.ones_like(out))  # uniform weights over ones
    a = core.attention(q, k, v * 2, score="cosine:temperature=0.1")
    b = core.attention(q, k, v * 2, score="cosine", score_params={"temperature": 0.1})
    chex.assert_trees_all_close(a, b)

  def test_errors(self):
    q, k = _qk()
    with pytest.raises(ValueError, match="does not match head dim"):
      core.bilinear(q, k, jnp.ones((3, 3)))
    with pytest.raises(ValueError, match=r"Unknown parameters \['tau'\]"):
      core.attention(q, k, k, score="cosine", score_params={"tau": 1.0})
    assert core.list_scores() == sorted(["dot", "scaled_dot", "cosine", "neg_sq_dist",
                                         "bilinear", "additive", "metric"])


def test_learned_parameters_are_declared_by_the_score():
  # What attnx.nn modules learn for a score comes from the score object: names, shapes from
  # (heads, head dim, width), initializers.
  bilinear, additive = core.get_score("bilinear"), core.get_score("additive")
  assert [name for name, _ in bilinear.learned] == ["W"]
  assert [name for name, _ in additive.learned] == ["Wq", "Wk", "v"]
  shapes = {name: spec.shape(4, 8, 5) for name, spec in additive.learned}
  assert shapes == {"Wq": (4, 8, 5), "Wk": (4, 8, 5), "v": (5,)}
  assert all(spec.uses_width for _, spec in additive.learned)
  (_, w_spec), = bilinear.learned
  assert w_spec.shape(4, 8, 5) == (4, 8, 8) and not w_spec.uses_width
  w0 = w_spec.init(jax.random.PRNGKey(0), (2, 3, 3), jnp.float32)
  np.testing.assert_array_equal(w0, np.broadcast_to(np.eye(3), (2, 3, 3)))  # starts as the dot
  for name in ("dot", "scaled_dot", "cosine", "neg_sq_dist"):
    assert core.get_score(name).learned == ()
