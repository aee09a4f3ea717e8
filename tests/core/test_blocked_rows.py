"""attnx.core.kernels.xla.rows: the blocked kernel of the whole-row weightings against the dense
ones.

``attention(..., implementation="blocked")`` runs SSMax (Nakanishi 2025, "Scalable-Softmax Is
Superior for Attention"), softpick (Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive
Activations with Rectified Softmax"), stick-breaking (Tan et al. 2024, "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study"), sparsemax (Martins & Astudillo
2016, "From Softmax to Sparsemax") and α-entmax (Peters, Niculae & Martins 2019, "Sparse
Sequence-to-Sequence Models") tile by tile; ``implementation="dense"`` materializes the weights
and is the reference here: outputs and the gradients of q, k, v, bias and the scale.

Tiles are small (16 query rows, 24 keys) and the lengths no multiple of them, so every row
crosses several ragged key tiles. Compilation dominates the runtime: each (case, weighting) is
one jitted program of both implementations, cached, and the tests index its results.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import reference

from attnx import core
from attnx.core import streaming
from attnx.core import weightings as wlib
from attnx.core.kernels import common
from attnx.core.kernels.xla import pointwise as blocked_lib
from attnx.core.kernels.xla import sizes
from attnx.core.kernels.xla.rows import (
  blocked_row_attention,
  causal_block_sizes,
  threshold_passes,
  zero_tiles,
)

BASE = ["ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15", "entmax:alpha=1.3",
        "entmax:alpha=3"]
VARIANTS = ["ssmax:s=0.5", "softpick:eps=1e-3", "sparsemax:scale=2"]
ALL = BASE + VARIANTS
SIMPLEX = ["sparsemax", "entmax15", "entmax:alpha=1.3", "entmax:alpha=3", "sparsemax:scale=2"]
BQ, BK = 16, 24
SCALE = 0.5
H = 8

# name: (B, T, S, N, K, causal, bias shape or None, mask kind or None, fully masked (b, t) rows)
CASES = {
    # GQA, a [B, 1, T, S] mask that empties query 3 of batch 0, a per-head bias.
    "full": (2, 37, 53, 4, 2, False, (1, 4, 37, 53), "rows", [(0, 3)]),
    # Causal with more queries than keys, a key mask (key 0 masked: query 0 sees no key) and
    # a bias shared by the heads.
    "causal_t_gt_s": (1, 61, 53, 4, 2, True, (1, 1, 61, 53), "keys", [(0, 0)]),
    # Causal with more keys than queries, no mask and no bias (the kernel's plain path).
    "causal_t_lt_s": (2, 37, 77, 2, 2, True, None, None, []),
}
CASE_NAMES = [("full", n) for n in ALL] + [(c, n) for c in ("causal_t_gt_s", "causal_t_lt_s")
                                           for n in BASE]
# CI runs causal T < S for two families (the rest under -m exhaustive: 20 minutes of CI).
CASE_NAMES = [pytest.param(*c, marks=pytest.mark.exhaustive)
              if c[0] == "causal_t_lt_s" and c[1] not in ("stick_breaking", "entmax:alpha=3")
              else c for c in CASE_NAMES]

# Tolerances: values ≤ VALUE_TOL · max(1, |dense|) elementwise, gradients ≤ GRAD_TOL · max |dense
# gradient|. Measured on these cases: values ≤ 1.0e-6, gradients ≤ 5.2e-5 (stick-breaking's
# d scale; the others ≤ 2e-5). α = 3 entmax has dp/dz ∝ p^{2−α} = p^{−1}, unbounded at the
# edge of the support, so float32 rounding of a score near the threshold τ is amplified:
# measured values 2.3e-4 · max(1, |ref|) (causal_t_gt_s; against the float64 reference of
# support.reference the blocked kernel is off by 1.8e-4 there and dense by 5.1e-5) and
# gradients ≤ 2.3e-5.
VALUE_TOL, GRAD_TOL = 1e-5, 1e-4
LOOSE = {"entmax:alpha=3": (5e-4, 2e-4)}
NAN_ROW = (0, 7, 1)  # (batch, query, head) whose q holds a NaN in the NaN tests
NAN_KEY = 5  # a key masked for every query ("full" case), whose value holds a NaN there


def _bf16_exact(x):
  """f32 values that bf16 represents exactly: the bf16 test reuses the f32 dense results."""
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@functools.cache
def _inputs(case, seed=0):
  b, t, s, n, kh, _, bias_shape, mask_kind, empty = CASES[case]
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k = _bf16_exact(normal(b, t, n, H)), _bf16_exact(normal(b, s, kh, H))
  # The last value column is 1: its output is Σ_j p_ij, which is 1 for the simplex families.
  v = _bf16_exact(np.concatenate([normal(b, s, kh, H - 1), np.ones((b, s, kh, 1), np.float32)],
                                 axis=-1))
  bias = None if bias_shape is None else normal(*bias_shape)
  mask = None
  if mask_kind == "rows":
    mask = rng.random((b, 1, t, s)) < 0.7
    mask[..., NAN_KEY] = False  # a key no query attends (see the NaN tests)
  elif mask_kind == "keys":
    mask = rng.random((1, 1, 1, s)) < 0.8
    mask[..., 0] = False
  for bi, ti in empty:
    if mask_kind == "rows":
      mask[bi, :, ti, :] = False
  ct = normal(b, t, n, H)
  return q, k, v, bias, mask, ct


def _tiled(impl):
  """``impl`` with this file's tiles (BQ × BK) where it has tiles: blocked; dense has none."""
  return core.Blocked(block_q=BQ, block_k=BK) if impl == "blocked" else impl


def _attention(impl, name, case, mask):
  causal = CASES[case][5]
  return lambda q, k, v, bias, scale: core.attention(
      q, k, v, bias, mask, weighting=name, scale=scale, is_causal=causal,
      implementation=_tiled(impl))


def _out_and_grads(attn, q, k, v, bias, ct, scale):
  """Output and the gradients of ⟨out, ct⟩ for q, k, v, bias (if any) and the scale."""
  def f(q, k, v, bias, scale):
    o = attn(q, k, v, bias, scale)
    return jnp.sum(o.astype(jnp.float32) * ct), o
  args = (q, k, v, bias, scale)
  argnums = (0, 1, 2, 3, 4) if bias is not None else (0, 1, 2, 4)
  (_, o), g = jax.value_and_grad(f, argnums=argnums, has_aux=True)(*args)
  return o, g


@functools.cache
def _case(case, name):
  q, k, v, bias, mask, ct = _inputs(case)

  @jax.jit
  def run(q, k, v, bias, ct, scale):
    return (_out_and_grads(_attention("blocked", name, case, mask), q, k, v, bias, ct, scale),
            _out_and_grads(_attention("dense", name, case, mask), q, k, v, bias, ct, scale))

  return jax.device_get(run(q, k, v, bias, ct, jnp.float32(SCALE)))


def _check_values(got, want, tol, what=""):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), f"non-finite {what}"
  err = np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want)), initial=0.0)
  assert err <= tol, f"{what}: {err:.2e} > {tol:.0e}"


def _check_grad(got, want, tol, what=""):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), f"non-finite {what}"
  scale = float(np.max(np.abs(want)))
  assert scale > 0, what
  err = float(np.max(np.abs(got - want))) / scale
  assert err <= tol, f"{what}: {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case,name", CASE_NAMES)
@pytest.mark.split_by_jax
def test_blocked_matches_dense(case, name):
  (ob, gb), (od, gd) = _case(case, name)
  value_tol, grad_tol = LOOSE.get(name, (VALUE_TOL, GRAD_TOL))
  _check_values(ob, od, value_tol, "out")
  labels = ("q", "k", "v", "bias", "scale") if CASES[case][6] else ("q", "k", "v", "scale")
  for label, g, w in zip(labels, gb, gd, strict=True):
    _check_grad(g, w, grad_tol, f"d{label}")
  for bi, ti in CASES[case][8]:  # a row with no valid key: zero output, no gradient to q
    np.testing.assert_array_equal(ob[bi, ti], 0.0)
    np.testing.assert_array_equal(gb[0][bi, ti], 0.0)
  if name in SIMPLEX:  # the ones column: Σ_j p_ij = 1 on every row with a valid key
    sums = np.asarray(ob[..., -1], np.float64)
    has_key = np.ones(sums.shape, bool)
    for bi, ti in CASES[case][8]:
      has_key[bi, ti] = False
    np.testing.assert_allclose(sums[has_key], 1.0, atol=1e-5)


def test_cases_cover_several_ragged_tiles_per_row():
  for _, t, s, *_ in CASES.values():
    assert t % BQ and s % BK and s > 2 * BK and t > BQ
  assert CASES["causal_t_gt_s"][1] > CASES["causal_t_gt_s"][2]
  assert CASES["causal_t_lt_s"][1] < CASES["causal_t_lt_s"][2]


# --------------------------------------------------------------------------------------------
# bfloat16: the blocked kernel on bf16 inputs against the f32 dense results on the same values.
# --------------------------------------------------------------------------------------------

BF16_TOL = 3e-2  # values ≤ 3e-2 · max(1, |ref|): bf16 output (2⁻⁸) and bf16 weights in P·V


@functools.cache
def _bf16(name):
  q, k, v, bias, mask, _ = _inputs("full")
  f = jax.jit(lambda q, k, v: _attention("blocked", name, "full", mask)(q, k, v, bias, SCALE))
  return jax.device_get(f(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))))


@pytest.mark.parametrize("name", BASE)
def test_bf16_close_to_f32_dense(name):
  got = _bf16(name)
  assert got.dtype == jnp.bfloat16
  (_, _), (want, _) = _case("full", name)  # dense f32 on the same (bf16-exact) inputs
  _check_values(np.asarray(got, np.float32), want, BF16_TOL, name)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[0, 3], 0.0)


def test_bf16_softpick_gradients_of_a_row_with_one_tiny_score():
  # Query 0 sees key 0 alone, score 2⁻⁸: Σ|e^z − 1| ≈ 2⁻⁸, so dS = e^z/Σ|e^z − 1|·(dP − δ)
  # multiplies an error in δ = Σ p·dP by ~256. The weight 1 − e^{−z} (in the kernel's units
  # e^{−m}) sits half-way between two bf16 numbers: the forward's P·V with p rounded to bf16
  # put an error of 2⁻⁹·dP in δ (here dq and dk off by 3.5 · max |dense|); dense forms δ from
  # float32 weights. Queries 1 and 2 see every key.
  rng = np.random.default_rng(1)
  t, s = 3, 5
  q, k, v, ct = (np.array(_bf16_exact(rng.standard_normal((1, n, 1, H)))) for n in (t, s, s, t))
  q[0, 0, 0] = np.eye(H)[0]
  k[0, 0, 0, 0] = 2.0 ** -8  # q_0·k_0 = 2⁻⁸
  mask = np.ones((1, 1, t, s), bool)
  mask[0, 0, 0, 1:] = False

  def grads(impl, dtype):
    loss = lambda q, k, v: jnp.sum(core.attention(
        q, k, v, None, mask, weighting="softpick", scale=1.0,
        implementation=_tiled(impl)).astype(jnp.float32) * ct)
    return jax.jit(jax.grad(loss, (0, 1, 2)))(*(jnp.asarray(x, dtype) for x in (q, k, v)))

  got, want = grads("blocked", jnp.bfloat16), grads("dense", jnp.float32)
  assert float(jnp.sum(q[0, 0, 0] * k[0, 0, 0])) == 2.0 ** -8
  # Measured: dense bf16 against dense f32 ≤ 3.3e-3 · max |dense|, blocked ≤ 4.5e-3.
  for label, g, w in zip("qkv", got, want, strict=True):
    assert g.dtype == jnp.bfloat16
    _check_grad(np.asarray(g, np.float32), w, 2e-2, f"d{label}")


# --------------------------------------------------------------------------------------------
# The edge-case contract (attnx.core.contract), identical to dense.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,s", [(0, 7), (5, 0), (0, 0)])
@pytest.mark.parametrize("name", ALL)
def test_empty_sequences_give_zeros(name, t, s):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, t, 4, H)).astype(np.float32)
  k = rng.standard_normal((2, s, 2, H)).astype(np.float32)
  v = rng.standard_normal((2, s, 2, 3)).astype(np.float32)
  for impl in ("blocked", "dense"):
    f = lambda q, k, v, impl=impl: core.attention(q, k, v, weighting=name, is_causal=True,
                                                  implementation=_tiled(impl))
    out, grads = jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_array_equal(out, 0.0)
    assert f(q, k, v).shape == (2, t, 4, 3)
    for g, x in zip(grads, (q, k, v), strict=True):
      assert g.shape == x.shape
      np.testing.assert_array_equal(g, 0.0)
  direct = blocked_row_attention(q, k, v, weighting=wlib.get_weighting(name), scale=SCALE)
  assert direct.shape == (2, t, 4, 3)
  np.testing.assert_array_equal(direct, 0.0)


@functools.cache
def _nan(name):
  """The blocked outputs of three copies of the "full" inputs stacked on the batch axis (one
  program): clean, a NaN in q of NAN_ROW, a NaN in the value of the masked key NAN_KEY."""
  q, k, v, bias, mask, _ = _inputs("full")
  assert not mask[..., NAN_KEY].any()
  q_nan, v_nan = q.copy(), v.copy()
  q_nan[NAN_ROW + (2,)] = np.nan
  v_nan[0, NAN_KEY, 1, 0] = np.nan
  qs, vs = np.concatenate([q, q_nan, q]), np.concatenate([v, v, v_nan])
  ks, masks = np.concatenate([k] * 3), np.concatenate([mask] * 3)
  run = jax.jit(lambda q, k, v: _attention("blocked", name, "full", masks)(q, k, v, bias, SCALE))
  return np.split(jax.device_get(run(qs, ks, vs)), 3)


NAN_NAMES = BASE


# The contract (attnx.core.contract), which dense keeps (tests/core/test_contract.py): row i of
# the output is all NaN iff q_i holds a NaN (and the row has a valid key); a masked key's value
# is never touched.
@pytest.mark.parametrize("name", NAN_NAMES)
def test_nan_in_q_touches_only_its_row(name):
  clean, nan_q, _ = _nan(name)
  expected = np.zeros(clean.shape, bool)
  expected[NAN_ROW] = True
  np.testing.assert_array_equal(np.isnan(nan_q), expected)
  np.testing.assert_array_equal(nan_q[~expected], clean[~expected])


@pytest.mark.parametrize("name", BASE)
def test_nan_value_of_a_masked_key_changes_nothing(name):
  clean, _, nan_v = _nan(name)
  (_, _), (dense, _) = _case("full", name)  # the same inputs, without the NaN
  _check_values(clean, dense, LOOSE.get(name, (VALUE_TOL,))[0])
  np.testing.assert_array_equal(nan_v, clean)


ALL_MASKED_NAMES = ["entmax15"]


@functools.cache
def _all_masked():
  q, k, v, bias, _, ct = _inputs("full")
  mask = np.zeros((1, 1, 1, k.shape[1]), bool)

  @jax.jit
  def run(q, k, v, bias, ct):
    return {name: _out_and_grads(_attention("blocked", name, "full", mask), q, k, v, bias, ct,
                                 jnp.float32(SCALE)) for name in ALL_MASKED_NAMES}

  return jax.device_get(run(q, k, v, bias, ct))


@pytest.mark.parametrize("name", ALL_MASKED_NAMES)
def test_fully_masked_gives_zero_output_and_zero_grads(name):
  # Every row empty (the main cases check single empty rows for every weighting).
  out, grads = _all_masked()[name]
  np.testing.assert_array_equal(out, 0.0)
  for g in grads:
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g, 0.0)


# --------------------------------------------------------------------------------------------
# SSMax with a learned s per head.
# --------------------------------------------------------------------------------------------

def _ssmax_dense(q, k, v, bias, mask, s, causal):
  """softmax((s_n · log n_i) · z) by core.ssmax on the whole [B, N, T, S] scores."""
  g = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  z = jnp.einsum("btnh,bsnh->bnts", q, kk) * SCALE + bias
  t, sl = q.shape[1], k.shape[1]
  valid = jnp.ones((1, 1, t, sl), bool) & mask
  if causal:
    valid = valid & jnp.tril(jnp.ones((t, sl), bool))
  p = core.ssmax(z, where=valid, s=s[:, None, None])
  return jnp.einsum("bnts,bsnh->btnh", p, vv)


def _ssmax_learned(case, causal, with_bias=True):
  q, k, v, bias, mask, ct = _inputs(case)
  if not with_bias:  # blocked: no bias (the softmax kernel on scaled q); dense: a zero bias
    bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
  if mask is None:
    mask = np.ones((1, 1, 1, k.shape[1]), bool)
  s = jnp.asarray([0.5, 1.0, 1.7, 2.5][:q.shape[2]], jnp.float32)
  w = wlib.get_weighting("ssmax")
  blocked = lambda q, k, v, bias, s: blocked_row_attention(
      q, k, v, weighting=w, scale=SCALE, bias=bias if with_bias else None, mask=mask,
      is_causal=causal, block_q=BQ, block_k=BK, ssmax_s=s)
  dense = lambda q, k, v, bias, s: _ssmax_dense(q, k, v, bias, mask, s, causal)

  @jax.jit
  def run(q, k, v, bias, s):
    res = []
    for f in (blocked, dense):
      loss = lambda *a, f=f: jnp.sum(f(*a) * ct)
      res.append((f(q, k, v, bias, s), jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, bias, s)))
    return res

  return jax.device_get(run(q, k, v, bias, s))


@pytest.mark.parametrize("case,causal,chunk", [("full", False, None), ("full", True, 1)])
def test_ssmax_learned_s_gradient(case, causal, chunk, monkeypatch):
  if chunk is not None:  # a small tile budget: one (batch, kv head) row per chunk of heads
    b, _, _, n, kh = CASES[case][:5]
    monkeypatch.setattr(sizes, "TILE_BUDGET", chunk * (n // kh) * BQ * BK)
    assert sizes.heads_per_chunk(b, kh, n // kh, BQ, BK) == chunk < b * kh
  (ob, gb), (od, gd) = _ssmax_learned(case, causal)
  _check_values(ob, od, VALUE_TOL, "out")
  for label, g, w in zip(("q", "k", "v", "bias", "s"), gb, gd, strict=True):
    _check_grad(g, w, GRAD_TOL, f"d{label}")
  assert gb[4].shape == (4,) and np.all(np.abs(gd[4]) > 1e-3)  # every head's s matters


@pytest.mark.parametrize("case,causal", [("full", False), ("causal_t_lt_s", False),
                                         ("causal_t_lt_s", True)])
def test_ssmax_without_bias_runs_softmax_on_scaled_queries(case, causal, monkeypatch):
  # float32 SSMax on full rows without a bias is softmax of (c_i·q_i)·k: the pointwise kernel
  # runs it. Causal rows stay in the row kernel (O(T) scratch, unlike the causal triangle).
  calls = []
  real = blocked_lib.blocked_attention
  monkeypatch.setattr(blocked_lib, "blocked_attention",
                      lambda *a, **kw: calls.append(kw["weighting"].name) or real(*a, **kw))
  (ob, gb), (od, gd) = _ssmax_learned(case, causal, with_bias=False)
  assert (calls == []) if causal else (calls and set(calls) == {"softmax"})
  _check_values(ob, od, VALUE_TOL, "out")
  for label, g, w in zip(("q", "k", "v", "s"), gb[:3] + gb[4:], gd[:3] + gd[4:], strict=True):
    _check_grad(g, w, GRAD_TOL, f"d{label}")
  assert np.all(np.abs(gd[4]) > 1e-3)  # every head's s matters


def test_ssmax_nan_query_of_an_empty_row_does_not_reach_a_learned_s():
  # Query 3 of batch 0 has no valid key ("full"'s mask): a NaN there changes no gradient.
  q, k, v, _, mask, ct = _inputs("full")
  s = jnp.asarray([0.5, 1.0, 1.7, 2.5], jnp.float32)
  w = wlib.get_weighting("ssmax")

  def grads(q):
    loss = lambda q, k, v, s: jnp.sum(blocked_row_attention(
        q, k, v, weighting=w, scale=SCALE, mask=mask, block_q=BQ, block_k=BK, ssmax_s=s) * ct)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, s)

  q = jnp.asarray(q)
  clean, poisoned = grads(q), grads(q.at[0, 3].set(jnp.nan))
  for label, a, b in zip("qkvs", clean, poisoned, strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"d{label}")


# --------------------------------------------------------------------------------------------
# Chunks of heads for the family with the most row statistics (entmax by bisection: 3, and
# Σu·v/Σu); SSMax's per-row scale is chunked in test_ssmax_learned_s_gradient.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["entmax:alpha=1.3"])
def test_chunks_of_heads_match_dense(name, monkeypatch):
  b, _, _, n, kh = CASES["full"][:5]
  monkeypatch.setattr(sizes, "TILE_BUDGET", (n // kh) * BQ * BK)
  assert sizes.heads_per_chunk(b, kh, n // kh, BQ, BK) == 1
  q, k, v, bias, mask, ct = _inputs("full")
  bias = bias[:, :1]  # [1, 1, T, S]: broadcast over batch and heads
  run = lambda impl: jax.jit(lambda *a: _out_and_grads(
      _attention(impl, name, "full", mask), *a, jnp.float32(SCALE)))(q, k, v, bias, ct)
  (ob, gb), (od, gd) = run("blocked"), run("dense")
  _check_values(ob, od, VALUE_TOL, "out")
  for label, g, w in zip(("q", "k", "v", "bias", "scale"), gb, gd, strict=True):
    _check_grad(g, w, GRAD_TOL, f"d{label}")


# --------------------------------------------------------------------------------------------
# implementation=None, long rows, threshold passes.
# --------------------------------------------------------------------------------------------

@functools.cache
def _auto(name):
  rng = np.random.default_rng(2)
  big = int(np.sqrt(core.BLOCKED_MIN_SCORES))  # T·S = BLOCKED_MIN_SCORES: blocked
  args = {t: tuple(rng.standard_normal((1, t, 1, H)).astype(np.float32) for _ in range(3))
          for t in (big,)}

  @jax.jit
  def run(args):
    return {t: {impl or "auto": core.attention(*a, weighting=name, is_causal=True,
                                               implementation=impl)
                for impl in (None, "blocked", "dense")} for t, a in args.items()}

  assert big * big >= core.BLOCKED_MIN_SCORES
  return big, jax.device_get(run(args))


@pytest.mark.parametrize("name", ["sparsemax"])
def test_implementation_none_picks_blocked_for_large_problems(name):
  big, res = _auto(name)
  large = res[big]
  _check_values(large["blocked"], large["dense"], VALUE_TOL)
  # Bitwise: the blocked and dense results differ in rounding, so they tell which one ran.
  assert not np.array_equal(large["blocked"], large["dense"])
  np.testing.assert_array_equal(large["auto"], large["blocked"])


LONG = 1100


@functools.cache
def _long(name):
  rng = np.random.default_rng(3)
  q, k = (rng.standard_normal((1, LONG, 1, 16)).astype(np.float32) for _ in range(2))
  v = np.concatenate([rng.standard_normal((1, LONG, 1, 7)).astype(np.float32),
                      np.ones((1, LONG, 1, 1), np.float32)], axis=-1)
  ct = rng.standard_normal((1, LONG, 1, 8)).astype(np.float32)

  def attn(impl):
    # Default query blocks (blocked_rows.causal_block_sizes: 256 or 512 rows), 18 key tiles of 64.
    impl = core.Blocked(block_k=64) if impl == "blocked" else impl
    return lambda q, k, v: core.attention(q, k, v, weighting=name, is_causal=True,
                                          implementation=impl)

  @jax.jit
  def run(q, k, v):
    res = []
    for impl in ("blocked", "dense"):
      o, vjp = jax.vjp(attn(impl), q, k, v)
      res.append((o, vjp(ct)))
    return res

  return jax.device_get(run(q, k, v))


@pytest.mark.parametrize("name", ["sparsemax", "stick_breaking"])
def test_long_causal_rows_match_dense(name):
  (ob, gb), (od, gd) = _long(name)
  _check_values(ob, od, VALUE_TOL, "out")
  for label, g, w in zip("qkv", gb, gd, strict=True):
    _check_grad(g, w, GRAD_TOL, f"d{label}")
  if name == "sparsemax":
    np.testing.assert_allclose(ob[..., -1], 1.0, atol=1e-5)


@functools.cache
def _passes():
  q, k, v, bias, mask, _ = _inputs("full")
  f = jax.jit(lambda q, k, v, bias: {
      name: threshold_passes(q, k, v, weighting=wlib.get_weighting(name), scale=SCALE,
                             bias=bias, mask=mask, block_q=BQ, block_k=BK)
      for name in ("sparsemax", "entmax15", "softpick")})
  return jax.device_get(f(q, k, v, bias))


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_threshold_passes_are_few(name):
  passes = _passes()[name]
  assert np.issubdtype(np.asarray(passes).dtype, np.integer)
  # The row-max pass, at least one Newton/bisection pass, and (α ∈ {1.5, 2}) the exact step.
  assert 2 <= int(passes) <= streaming.MAX_THRESHOLD_PASSES
  assert int(passes) < 20


def test_threshold_passes_is_zero_for_families_without_threshold():
  assert int(_passes()["softpick"]) == 0


# --------------------------------------------------------------------------------------------
# Zero tiles (sparsemax/entmax): the key tiles in which every weight of a query block is zero
# are left out of the later threshold passes, the output pass and the backward, bit for bit.
# --------------------------------------------------------------------------------------------

SKIP_NAMES = ["sparsemax", "entmax15", "entmax:alpha=1.3", "entmax:alpha=3"]
# name: (B, T, S, N, K, causal, bias shape, mask kind, fully masked (b, t) rows, chunk of heads)
SKIP_CASES = {
    # GQA, ragged T and S, a per-head bias, a row mask with an empty row, chunks of one
    # (batch, kv head) row: the table of zero tiles per chunk.
    "full": (2, 45, 77, 4, 2, False, (1, 4, 45, 77), "rows", [(1, 20)], 1),
    # Causal with T > S, a key mask (query 0 sees no key), a bias shared by the heads.
    "causal": (1, 61, 53, 2, 1, True, (1, 1, 61, 53), "keys", [(0, 0)], None),
}
CLUSTERS = 3


@functools.cache
def _clustered(case, seed=4):
  """Queries of block i and keys of tile j point along direction (i mod 3) and (j mod 3):
  a query block attends the key tiles of its own direction (scores ≈ 8 apart), so the tiles
  of the other directions are all zero for every row of the block, except where a causal
  row sees no key of its own direction."""
  b, t, s, n, kh, _, bias_shape, mask_kind, empty, _ = SKIP_CASES[case]
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  dirs = 4.0 * np.eye(H, dtype=np.float32)[:CLUSTERS]
  q = dirs[(np.arange(t) // BQ) % CLUSTERS][None, :, None] + 0.3 * normal(b, t, n, H)
  k = dirs[(np.arange(s) // BK) % CLUSTERS][None, :, None] + 0.3 * normal(b, s, kh, H)
  v = normal(b, s, kh, H)
  bias = 0.3 * normal(*bias_shape)
  if mask_kind == "rows":
    mask = rng.random((b, 1, t, s)) < 0.8
  else:
    mask = rng.random((1, 1, 1, s)) < 0.9
    mask[..., 0] = False
  for bi, ti in empty:
    if mask_kind == "rows":
      mask[bi, :, ti] = False
  return q, k, v, bias, mask, normal(b, t, n, H)


def _skip_kernel(case, name, skip):
  causal = SKIP_CASES[case][5]
  _, _, _, bias, mask, _ = _clustered(case)
  return lambda q, k, v, bias, scale: blocked_row_attention(
      q, k, v, weighting=wlib.get_weighting(name), scale=scale, bias=bias, mask=mask,
      is_causal=causal, block_q=BQ, block_k=BK, skip_zero_tiles=skip)


@functools.cache
def _skip_case(case, name):
  """(out, grads) with skipping on and off, the kernel's zero-tile table and visited tiles."""
  q, k, v, bias, mask, ct = _clustered(case)
  chunk = SKIP_CASES[case][9]
  with pytest.MonkeyPatch.context() as mp:
    if chunk is not None:
      b, _, _, n, kh = SKIP_CASES[case][:5]
      mp.setattr(sizes, "TILE_BUDGET", chunk * (n // kh) * BQ * BK)
      assert sizes.heads_per_chunk(b, kh, n // kh, BQ, BK) == chunk < b * kh

    @jax.jit
    def run(q, k, v, bias, ct, scale):
      res = [_out_and_grads(_skip_kernel(case, name, skip), q, k, v, bias, ct, scale)
             for skip in (True, False)]
      tiles = zero_tiles(q, k, v, weighting=wlib.get_weighting(name), scale=scale, bias=bias,
                         mask=mask, is_causal=SKIP_CASES[case][5], block_q=BQ, block_k=BK)
      return res, tiles

    return jax.device_get(run(q, k, v, bias, ct, jnp.float32(SCALE)))


@functools.cache
def _skip_reference(case, name):
  """The float64 brute force (tests/support/reference.py) and its weights [B, N, T, S]."""
  q, k, v, bias, mask, ct = _clustered(case)
  causal = SKIP_CASES[case][5]
  ref = reference.reference(q, k, v, weighting=name, scale=SCALE, bias=bias, mask=mask,
                            is_causal=causal, cotangent=ct)
  base, params = wlib.parse_weighting_name(name)
  with jax.enable_x64(True):
    weights = np.asarray(reference.row_weights64(jnp.asarray(ref.scores), jnp.asarray(ref.valid),
                                                 base, params))
  return ref, weights


def _zero_tiles64(weights, case):
  """[chunks, q blocks, k tiles]: tiles whose float64 weights are all 0 for every row of the
  chunk's (batch, kv head) rows and query heads."""
  b, t, s, n, kh, *_ = SKIP_CASES[case]
  chunk = SKIP_CASES[case][9] or b * kh
  nq, nk = -(-t // BQ), -(-s // BK)
  w = np.zeros((b, n, nq * BQ, nk * BK))
  w[:, :, :t, :s] = weights
  w = w.reshape(b * kh, n // kh, nq, BQ, nk, BK).reshape(b * kh // chunk, -1, nq, BQ, nk, BK)
  return np.all(w == 0.0, axis=(1, 3, 5))


# CI runs three (sparsemax full; 1.5-entmax and entmax by bisection causal), the rest under
# -m exhaustive (≈ 8 s each).
SKIP_CI = {("full", "sparsemax"), ("causal", "entmax15"), ("causal", "entmax:alpha=1.3")}


@pytest.mark.parametrize("case,name", [
    (c, n) if (c, n) in SKIP_CI else pytest.param(c, n, marks=pytest.mark.exhaustive)
    for c in SKIP_CASES for n in SKIP_NAMES])
def test_skipping_zero_tiles_is_bit_identical_and_matches_float64(case, name):
  (on, off), (skipped, visited) = _skip_case(case, name)
  ref, weights = _skip_reference(case, name)
  # The tiles left out are exactly those of zero float64 weights (among the visited ones).
  np.testing.assert_array_equal(skipped, _zero_tiles64(weights, case) & visited)
  assert 0 < skipped.sum() < visited.sum()
  # Skipping changes no bit of the output or of any gradient.
  np.testing.assert_array_equal(on[0], off[0])
  for g_on, g_off in zip(on[1], off[1], strict=True):
    np.testing.assert_array_equal(g_on, g_off)
  # Against the float64 brute force: values, and the gradients of q, k, v and the bias.
  value_tol, grad_tol = LOOSE.get(name, (VALUE_TOL, GRAD_TOL))
  _check_values(on[0], ref.out, value_tol, "out")
  bias_shape = SKIP_CASES[case][6]
  want = dict(ref.grads, bias=common.sum_to(ref.grads["bias"], bias_shape))
  for label, g in zip("qkv", on[1][:3], strict=True):
    _check_grad(g, want[label], grad_tol, f"d{label}")
  _check_grad(on[1][3], want["bias"], grad_tol, "dbias")
  for bi, ti in SKIP_CASES[case][8]:  # a row with no valid key: zero output, no gradient
    np.testing.assert_array_equal(on[0][bi, ti], 0.0)
    np.testing.assert_array_equal(on[1][0][bi, ti], 0.0)


def test_skip_cases_cover_ragged_tiles_and_chunks():
  for _, t, s, *_ in SKIP_CASES.values():
    assert t % BQ and s % BK and s > 2 * BK and t > BQ
  full, causal = SKIP_CASES["full"], SKIP_CASES["causal"]
  assert full[3] != full[4] and full[9] is not None  # GQA, chunks of heads
  assert causal[5] and causal[1] > causal[2]  # causal, T > S


@functools.cache
def _nan_cotangent():
  """Gradients with a NaN in one row of dO, skipping on and off (sparsemax, causal case)."""
  q, k, v, bias, _, ct = _clustered("causal")
  ct = ct.copy()
  ct[0, 40, 1, 2] = np.nan

  @jax.jit
  def run(q, k, v, bias, ct):
    return [_out_and_grads(_skip_kernel("causal", "sparsemax", skip), q, k, v, bias, ct,
                           jnp.float32(SCALE))[1] for skip in (True, False)]

  return jax.device_get(run(q, k, v, bias, ct))


def test_skipping_keeps_the_nan_of_a_nan_cotangent():
  # A NaN in dO reaches every tile of its query block, zero weights included (0 · NaN), as
  # autodiff of the dense weights gives: that block's tiles are not left out.
  on, off = _nan_cotangent()
  for g_on, g_off in zip(on, off, strict=True):
    np.testing.assert_array_equal(g_on, g_off)  # NaN in the same places
  assert np.isnan(on[1]).any() and not np.isnan(on[1]).all()


def test_zero_tiles_hook_rejects_other_families_and_skip_flag_must_be_bool():
  q, k, v, *_ = _clustered("causal")
  with pytest.raises(ValueError, match="sparsemax/entmax"):
    zero_tiles(q, k, v, weighting=wlib.get_weighting("softpick"), scale=SCALE)
  with pytest.raises(ValueError, match="skip_zero_tiles"):
    blocked_row_attention(q, k, v, weighting=wlib.get_weighting("sparsemax"), scale=SCALE,
                          skip_zero_tiles=1)


# --------------------------------------------------------------------------------------------
# Default tiles.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", streaming.FAMILIES)
@pytest.mark.parametrize("t,s,group", [(1, 1, 1), (37, 53, 4), (1100, 1100, 1), (4096, 4096, 1),
                                       (4096, 300, 16), (65536, 65536, 64)])
def test_causal_block_sizes_fit_lengths_and_budget(family, t, s, group):
  bq, bk = causal_block_sizes(family, t, s, group)
  assert bq % 8 == 0 and bk % 8 == 0 and bq >= 8 and bk >= 8
  assert bq <= max(8, -(-t // 8) * 8) and bk <= max(8, -(-s // 8) * 8)
  assert group * bq * bk <= max(sizes.TILE_BUDGET, group * 8 * bk)


def test_default_causal_tiles_are_causal_block_sizes():
  # The kernel with default tiles is the kernel with causal_block_sizes' tiles, bit for bit, at
  # a length where the families' tiles differ (stick-breaking 256 × 256, the others 512 × 512).
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((1, 1100, n, 16)).astype(np.float32) for n in (2, 1, 1))
  for name in ("softpick", "stick_breaking", "sparsemax"):
    w = wlib.get_weighting(name)
    bq, bk = causal_block_sizes(w.stream.family, 1100, 1100, 2)
    run = lambda w=w, **kw: np.asarray(blocked_row_attention(
        q, k, v, weighting=w, scale=0.25, is_causal=True, **kw))
    np.testing.assert_array_equal(run(), run(block_q=bq, block_k=bk), err_msg=name)


@pytest.mark.parametrize("name", ["ssmax", "softpick", "stick_breaking"])
def test_raw_block_states_of_key_blocks_merge_to_the_whole(name):
  # The entry points of ring attention (attnx.core.parallel.ring): the streaming states of two key
  # blocks merge to the whole row (stick-breaking: the later block first), and the blocks'
  # gradients, the later block's carries going on to the earlier one, add up to the whole.
  from attnx.core.kernels.xla import rows as blocked_rows

  w = wlib.get_weighting(name)
  rs = w.stream
  rng = np.random.default_rng(4)
  x, g, t, s, h = 2, 2, 24, 40, 8
  q = jnp.asarray(rng.standard_normal((x, g, t, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((x, s, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((x, s, h)), jnp.float32)
  do = jnp.asarray(rng.standard_normal((x, g, t, h)), jnp.float32)
  scale = jnp.float32(0.35)
  q4, k4, v4 = q.transpose(0, 2, 1, 3), k[:, :, None], v[:, :, None]
  want, vjp = jax.vjp(lambda q, k, v: blocked_row_attention(q, k, v, weighting=w, scale=0.35,
                                                            is_causal=True), q4, k4, v4)
  dq_w, dk_w, dv_w = vjp(do.transpose(0, 2, 1, 3))
  # Causal over T = 24 rows and S = 40 keys: rows see keys j ≤ i; keys past 24 none.
  mask = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None, None, None]
  n = jnp.sum(mask, -1, dtype=jnp.float32)[0, 0]  # [1, T]
  rsc = jnp.broadcast_to(streaming.row_scale(rs, n), (x, g, t)) if rs.needs_row_scale else None
  blocks = ((16, s), (0, 16))  # the later block first
  cfgs = [blocked_lib.block_config(w, t, hi - lo, (x, 1, g), is_causal=False, has_mask=True,
                                   has_bias=False, num_keys=s, whole_chunk=True)
          for lo, hi in blocks]
  states = [blocked_rows.raw_block_state(q, k[:, lo:hi], v[:, lo:hi], None,
                                         mask[..., lo:hi], rsc, scale, cfg)
            for (lo, hi), cfg in zip(blocks, cfgs, strict=True)]
  out, stats, _ = streaming.finalize(rs, streaming.merge(rs, *states), rsc)
  np.testing.assert_allclose(out.transpose(0, 2, 1, 3), want, atol=1e-5)
  carries = (jnp.zeros((x, g, t)), jnp.zeros((x, g, t)))
  dq, dks, dvs = 0.0, [], []
  for (lo, hi), cfg in zip(blocks, cfgs, strict=True):
    gq, gk, gv, _, carries, _ = blocked_rows.block_grads(
        q, k[:, lo:hi], v[:, lo:hi], None, mask[..., lo:hi], rsc, scale, out, stats, do,
        carries, cfg)
    dq, dks, dvs = dq + gq, dks + [gk], dvs + [gv]
  np.testing.assert_allclose(dq.transpose(0, 2, 1, 3), dq_w, atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate(dks[::-1], 1)[:, :, None], dk_w, atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate(dvs[::-1], 1)[:, :, None], dv_w, atol=1e-5)
