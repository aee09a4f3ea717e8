"""The edge-case contract of attnx.core.attention (attnx/core/contract.py), fuzzed.

Every registered weighting × score × implementation × {f32, bf16} × masks (with fully masked
rows) / causal / GQA / bias / small ragged tiles, sampled by hypothesis: finite inputs give
finite outputs and gradients, dense and blocked agree, and NaN/Inf inputs reach exactly the
rows the contract says (checked against a brute-force rule written here in numpy).
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core

_DISTANCE_KERNELS = ("gaussian", "boxcar", "triangular", "epanechnikov")
# Every registered name, plus parameter variants whose behaviour differs (normalizations,
# p < 1 with its unbounded F', α-entmax by bisection).
WEIGHTINGS = tuple(core.list_weightings()) + (
    "power:p=0.5", "power:p=3", "relu:normalization=length", "sigmoid:normalization=none",
    "softmax:alpha=2", "gaussian:h=0.5,normalization=none", "triangular:h=2",
    "entmax:alpha=1.3", "entmax:alpha=3")
SCORES = ("scaled_dot", "dot", "cosine:temperature=0.5", "neg_sq_dist", "bilinear")

FUZZ = hypothesis.settings(max_examples=10, deadline=None, derandomize=True,
                           suppress_health_check=list(hypothesis.HealthCheck),
                           print_blob=True)


@dataclasses.dataclass(frozen=True)
class Case:
  weighting: str
  score: str
  dtype: str
  b: int
  t: int
  s: int
  n: int
  kh: int
  h: int
  causal: bool
  mask: str  # none | random | padding
  bias: bool
  magnitude: float  # input scale: scores reach ~1e4 at 100
  block: int
  seed: int

  def implementations(self) -> list[str]:
    out = ["dense"]
    try:
      core.check_compatible(self.weighting, self.score, "blocked")
      out.append("blocked")
    except ValueError:
      pass
    return out


def _compatible(weighting: str, score: str) -> bool:
  try:
    core.check_compatible(weighting, score)
    return True
  except ValueError:
    return False


@st.composite
def cases(draw) -> Case:
  weighting = draw(st.sampled_from(WEIGHTINGS))
  score = draw(st.sampled_from([s for s in SCORES if _compatible(weighting, s)]))
  kh = draw(st.sampled_from([1, 2]))
  distance = "dist" in score or weighting.split(":")[0] in _DISTANCE_KERNELS
  dtype = draw(st.sampled_from(["float32", "bfloat16"]))
  return Case(weighting=weighting, score=score, dtype=dtype,
              b=draw(st.integers(1, 2)), t=draw(st.integers(1, 19)), s=draw(st.integers(1, 19)),
              n=kh * draw(st.sampled_from([1, 2])), kh=kh, h=draw(st.sampled_from([4, 8])),
              causal=draw(st.booleans()), mask=draw(st.sampled_from(["none", "random", "padding"])),
              bias=draw(st.booleans()),
              # Distances of inputs ×100 are ~1e5 and every kernel weight underflows to 0.
              magnitude=1.0 if distance else draw(st.sampled_from([1.0, 10.0, 100.0])),
              block=draw(st.sampled_from([8, 16])), seed=draw(st.integers(0, 2**16)))


def _arrays(c: Case):
  rng = np.random.default_rng(c.seed)
  q = rng.normal(size=(c.b, c.t, c.n, c.h)) * c.magnitude
  k = rng.normal(size=(c.b, c.s, c.kh, c.h)) * c.magnitude
  v = rng.normal(size=(c.b, c.s, c.kh, c.h))
  bias = rng.normal(size=(c.b, c.n, c.t, c.s)) if c.bias else None
  if c.mask == "random":
    mask = rng.random((c.b, c.n, c.t, c.s)) < 0.6
    mask[:, :, rng.integers(c.t)] = False  # a fully masked row
  elif c.mask == "padding":
    mask = np.arange(c.s)[None, None, None, :] < rng.integers(0, c.s + 1, (c.b, 1, 1, 1))
  else:
    mask = None
  params = {"W": rng.normal(size=(c.h, c.h)) / np.sqrt(c.h)} if c.score == "bilinear" else None
  return q, k, v, bias, mask, params


def _valid(c: Case, mask) -> np.ndarray:
  """Brute-force [B, N, T, S] validity of every (query, key) pair."""
  valid = np.ones((c.b, c.n, c.t, c.s), bool)
  if mask is not None:
    valid &= mask
  if c.causal:
    valid &= np.tril(np.ones((c.t, c.s), bool))
  return valid


_jit_attention = jax.jit(core.attention, static_argnames=(
    "weighting", "score", "is_causal", "implementation", "block_q", "block_k"))


def _run(c: Case, impl: str, q, k, v, bias, mask, params):
  dt = jnp.dtype(c.dtype)
  return _jit_attention(jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt),
                        None if bias is None else jnp.asarray(bias, jnp.float32),
                        None if mask is None else jnp.asarray(mask),
                        weighting=c.weighting, score=c.score, is_causal=c.causal,
                        implementation=impl, block_q=c.block, block_k=c.block,
                        score_params=None if params is None else
                        {"W": jnp.asarray(params["W"], jnp.float32)})


def _grads(c: Case, impl: str, q, k, v, bias, mask, params):
  dt = jnp.dtype(c.dtype)
  ct = np.random.default_rng(c.seed + 1).normal(size=(c.b, c.t, c.n, c.h))

  def loss(q, k, v, bias):
    out = _jit_attention(q, k, v, bias, None if mask is None else jnp.asarray(mask),
                         weighting=c.weighting, score=c.score, is_causal=c.causal,
                         implementation=impl, block_q=c.block, block_k=c.block,
                         score_params=None if params is None else
                         {"W": jnp.asarray(params["W"], jnp.float32)})
    return jnp.sum(out.astype(jnp.float32) * ct)

  args = (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt),
          None if bias is None else jnp.asarray(bias, jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3) if bias is not None else (0, 1, 2))(*args)


def _f32(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.float32))


@FUZZ
@hypothesis.given(cases())
def test_finite_inputs_give_finite_outputs_and_gradients_and_implementations_agree(c: Case):
  arrays = _arrays(c)
  outs, grads = {}, {}
  for impl in c.implementations():
    outs[impl] = _f32(_run(c, impl, *arrays))
    assert np.all(np.isfinite(outs[impl])), (impl, c)
    grads[impl] = [_f32(g) for g in _grads(c, impl, *arrays)]
    for name, g in zip("qkvb", grads[impl], strict=False):
      assert np.all(np.isfinite(g)), (impl, name, c)
  # Rows without any valid key are exactly zero (the attnx convention).
  empty = ~_valid(c, arrays[4]).any(-1)  # [B, N, T]
  for impl, out in outs.items():
    assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0), (impl, c)
  if len(outs) == 2 and c.magnitude == 1.0 and not c.weighting.startswith("boxcar"):
    # boxcar is discontinuous: a score that rounds differently flips a weight 0 ↔ 1.
    tol = dict(rtol=2e-2, atol=2e-2) if c.dtype == "bfloat16" else dict(rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(outs["blocked"], outs["dense"], **tol, err_msg=str(c))
    if c.dtype == "float32":
      for gb, gd in zip(grads["blocked"], grads["dense"], strict=True):
        np.testing.assert_allclose(gb, gd, rtol=2e-3, atol=2e-3, err_msg=str(c))


def _poison(c: Case, rng, q, k, v, bias):
  """Non-finite entries at random places of q, k, v and bias (NaN, +Inf, −Inf)."""
  q, k, v = q.copy(), k.copy(), v.copy()
  bad = {"q": np.zeros((c.b, c.t, c.n), bool), "kv": np.zeros((c.b, c.s, c.kh), bool),
         "bias": np.zeros((c.b, c.n, c.t, c.s), bool)}
  values = (np.nan, np.inf, -np.inf)
  for _ in range(rng.integers(1, 3)):
    target = rng.choice(["q", "k", "v", "bias"] if bias is not None else ["q", "k", "v"])
    x = rng.choice(values)
    if target == "q":
      i = (rng.integers(c.b), rng.integers(c.t), rng.integers(c.n))
      q[i + (rng.integers(c.h),)] = x
      bad["q"][i] = True
    elif target in ("k", "v"):
      j = (rng.integers(c.b), rng.integers(c.s), rng.integers(c.kh))
      (k if target == "k" else v)[j + (rng.integers(c.h),)] = x
      bad["kv"][j] = True
    else:
      bias = bias.copy()
      i = (rng.integers(c.b), rng.integers(c.n), rng.integers(c.t), rng.integers(c.s))
      x = rng.choice((np.nan, np.inf))  # −Inf bias is a score of −Inf (a mask-like weight 0)
      bias[i] = x
      bad["bias"][i] = True
  return q, k, v, bias, bad


@FUZZ
@hypothesis.given(cases())
def test_nan_reaches_exactly_the_rows_it_touches_in_every_implementation(c: Case):
  q, k, v, bias, mask, params = _arrays(c)
  rng = np.random.default_rng(c.seed + 7)
  pq, pk, pv, pbias, bad = _poison(c, rng, q, k, v, bias)
  valid = _valid(c, mask)  # [B, N, T, S]
  group = c.n // c.kh
  bad_kv = np.repeat(bad["kv"], group, axis=2).transpose(0, 2, 1)[:, :, None, :]  # [B,N,1,S]
  touched = valid & (bad_kv | bad["bias"])
  expected = valid.any(-1) & (bad["q"].transpose(0, 2, 1) | touched.any(-1))  # [B, N, T]
  # The untouched rows equal those of a clean run with the bad entries replaced by zeros.
  clean = [np.where(np.isfinite(x), x, 0.0) if x is not None else None
           for x in (pq, pk, pv, pbias)]
  for impl in c.implementations():
    out = _f32(_run(c, impl, pq, pk, pv, pbias, mask, params)).transpose(0, 2, 1, 3)
    nan_rows = np.isnan(out).all(-1)
    assert np.array_equal(nan_rows, expected), (impl, c, np.argwhere(nan_rows != expected))
    assert not np.isnan(out[~expected]).any(), (impl, c)  # NaN rows are all-NaN, others none
    ref = _f32(_run(c, impl, *clean, mask, params)).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(out[~expected], ref[~expected], err_msg=f"{impl} {c}")


# --------------------------------------------------------------------------------------------
# The fixed cases of the contract.
# --------------------------------------------------------------------------------------------

IMPLEMENTATIONS = ("dense", "blocked")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("p", [pytest.param(0.1, marks=pytest.mark.exhaustive), 0.5,
                               pytest.param(0.9, marks=pytest.mark.exhaustive)])
def test_power_below_one_has_finite_gradients(implementation, p):
  # The reported case: power:p=0.5 blocked gave NaN/Inf dq and dk on N(0, 1) inputs.
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 16, 1, 8)), jnp.float32) for _ in range(3))
  q = q.at[0, 0].set(0.0)  # a score of exactly 0 in every column of row 0
  loss = lambda q, k, v: jnp.sum(core.attention(q, k, v, weighting=f"power:p={p}",
                                                implementation=implementation) ** 2)
  for g in jax.grad(loss, (0, 1, 2))(q, k, v):
    assert jnp.all(jnp.isfinite(g))
  # Away from 0 the gradient is the exact one: a central difference along a random direction.
  f = lambda q: loss(q, k, v)
  q1 = q.at[0, 0].set(1.0)
  d = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  eps = 1e-3
  fd = (f(q1 + eps * d) - f(q1 - eps * d)) / (2 * eps)
  np.testing.assert_allclose(jnp.vdot(jax.grad(f)(q1), d), fd, rtol=2e-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("t,s", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(implementation, t, s):
  q = jnp.ones((2, t, 4, 8))
  k = jnp.ones((2, s, 2, 8))
  v = jnp.ones((2, s, 2, 3))
  f = lambda q, k, v: core.attention(q, k, v, weighting="relu", implementation=implementation,
                                     is_causal=True)
  out = f(q, k, v)
  assert out.shape == (2, t, 4, 3) and out.dtype == q.dtype
  assert jnp.all(out == 0)
  grads = jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2))(q, k, v)
  assert all(g.shape == x.shape and jnp.all(g == 0) for g, x in zip(grads, (q, k, v),
                                                                      strict=True))
  w = core.attention_weights(q, k, weighting="sparsemax")
  assert w.shape == (2, 4, t, s)
  assert core.weights(jnp.ones((3, 0)), "softmax").shape == (3, 0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("weighting", [w for w in core.list_weightings("pointwise")
                                       if w not in _DISTANCE_KERNELS + ("taylor_exp",)])
def test_minus_inf_bias_is_a_zero_weight(implementation, weighting):
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 12, 2, 8)), jnp.float32) for _ in range(3))
  mask = jnp.asarray(rng.random((1, 2, 12, 12)) < 0.5)
  bias = jnp.where(mask, 0.0, -jnp.inf)
  kw = dict(weighting=weighting, implementation=implementation, block_q=8, block_k=8)
  np.testing.assert_allclose(core.attention(q, k, v, bias, **kw),
                             core.attention(q, k, v, mask=mask, **kw), rtol=1e-5, atol=1e-6)


def test_nan_propagates_through_weights_like_jax_nn_softmax():
  scores = jnp.asarray([[0.0, 1.0, jnp.nan], [0.0, 1.0, 2.0], [jnp.nan, 0.0, 0.0]])
  where = jnp.asarray([[True, True, True], [True, True, True], [False, True, True]])
  for name in core.list_weightings():
    w = np.asarray(core.weights(scores, name, where=where))
    assert np.isnan(w[0]).all(), name  # NaN at a valid entry: the whole row
    assert not np.isnan(w[1:]).any(), name  # a masked NaN is never seen
  ref = np.asarray(jax.nn.softmax(scores[:2]))
  np.testing.assert_array_equal(np.isnan(ref), np.isnan(np.asarray(
      core.weights(scores[:2], "softmax"))))


def test_masked_nan_value_does_not_reach_other_rows():
  # jax.nn multiplies masked values by a zero weight, and 0·NaN = NaN; attnx does not.
  q = jnp.ones((1, 4, 1, 2))
  k = jnp.ones((1, 4, 1, 2))
  v = jnp.arange(8.0).reshape(1, 4, 1, 2).at[0, 3, 0, 0].set(jnp.nan)
  for impl in IMPLEMENTATIONS:
    out = core.attention(q, k, v, is_causal=True, implementation=impl)
    assert not jnp.isnan(out[0, :3]).any() and jnp.isnan(out[0, 3]).all(), impl
