"""attnx.core.streaming: the per-family streaming states against the dense whole-row weightings.

Each family's state is driven tile by tile over the keys of one block of rows, exactly as a
kernel would (stick-breaking from the last tile backwards), and compared with the dense
weights of ``attnx.core.weights`` (a separate implementation that sees the whole row):

* init/update/finalize give Σ_j p_ij v_j, with masked keys, a fully masked row and a row with
  one valid key;
* merge of the states of two disjoint key ranges equals the state of all keys;
* tile_grad gives the weights and ∂L/∂z of autodiff through the dense weights (and SSMax's
  ∂L/∂c of the per-row scale);
* entmax_threshold finds the τ of a float64 bisection written here, in few passes;
* softpick stays finite on rows of extreme scores.

The families: SSMax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"), softpick
(Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive Activations with Rectified
Softmax"), stick-breaking (Tan et al. 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study"), sparsemax (Martins & Astudillo 2016, "From Softmax to
Sparsemax") and α-entmax (Peters, Niculae & Martins 2019, "Sparse Sequence-to-Sequence
Models").

Compilation dominates: every family's whole tile-by-tile program is one jitted function,
cached, and the tests index its results.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import streaming
from attnx.core import weightings as wlib

# The parametrized variants (ssmax:s, softpick:eps, sparsemax:scale) only change constants of
# the same code; test_blocked_rows.py runs them through the kernel, and the threshold test
# below runs a scale.
NAMES = ["ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15", "entmax:alpha=1.3",
         "entmax:alpha=3"]
ROWS, KEYS, HV = 6, 40, 3
TILE = 16  # tiles of 16, 16 and 8 keys
SPLIT = 21  # merge: keys [0, 21) and [21, 40), neither a whole number of tiles
EMPTY_ROW, ONE_KEY_ROW = 2, 4


def _spans(lo, hi, width=TILE):
  return [(a, min(a + width, hi)) for a in range(lo, hi, width)]


def _stream(name):
  rs = wlib.get_weighting(name).stream
  assert isinstance(rs, streaming.RowStream), name
  return rs


def _data(seed=0):
  rng = np.random.default_rng(seed)
  z = (1.5 * rng.standard_normal((ROWS, KEYS))).astype(np.float32)
  z[1] += 2.0  # a row of mostly positive scores (softpick weights most keys)
  valid = rng.random((ROWS, KEYS)) < 0.75
  valid[EMPTY_ROW] = False
  valid[ONE_KEY_ROW] = False
  valid[ONE_KEY_ROW, 30] = True
  valid[0, SPLIT:] = False  # row 0: every valid key in the first half of the merge split
  valid[3, :SPLIT] = False  # row 3: every valid key in the second half
  v = rng.standard_normal((KEYS, HV)).astype(np.float32)
  do = rng.standard_normal((ROWS, HV)).astype(np.float32)
  return z, valid, v, do


def _tile_pass(z, valid, spans):
  """entmax_threshold's tile_pass: folds fn(carry, z, valid) over the tiles of ``spans``."""
  def tile_pass(fn, init):
    c = init
    for a, b in spans:
      c = fn(c, z[:, a:b], valid[:, a:b])
    return c
  return tile_pass


def _ctx(rs, z, valid):
  """The per-row constants, from the whole row (all keys)."""
  if rs.needs_row_scale:
    return streaming.row_scale(rs, jnp.sum(valid, axis=-1))
  if rs.needs_threshold:
    return streaming.entmax_threshold(_tile_pass(z, valid, _spans(0, KEYS)), (ROWS,), rs)
  return None


def _fold(rs, z, valid, v, ctx, spans):
  state = streaming.init(rs, (ROWS,), v.shape[-1])
  for a, b in (reversed(spans) if rs.reverse else spans):
    state = streaming.update(rs, state, z[:, a:b], valid[:, a:b], v[a:b], ctx)
  return state


def _tile_grads(rs, z, valid, v, do, ctx, stats, delta):
  """(p, dz, final GradCarry) of the whole row from tile_grad over the tiles in order."""
  spans = _spans(0, KEYS)
  carry = streaming.GradCarry(jnp.zeros((ROWS,)), jnp.zeros((ROWS,)))
  ps, dzs = {}, {}
  for a, b in (reversed(spans) if rs.reverse else spans):
    dp = do @ v[a:b].T
    ps[a], dzs[a], carry = streaming.tile_grad(rs, z[:, a:b], valid[:, a:b], dp, stats, delta,
                                               carry, ctx)
  cat = lambda d: jnp.concatenate([d[a] for a, _ in spans], axis=-1)
  return cat(ps), cat(dzs), carry


@functools.cache
def _run(name):
  """Everything streamed for one weighting, and the dense references, in one program."""
  rs = _stream(name)
  z, valid, v, do = _data()

  @jax.jit
  def run(z, valid, v, do):
    ctx = _ctx(rs, z, valid)
    full = _fold(rs, z, valid, v, ctx, _spans(0, KEYS))
    out, stats, smean = streaming.finalize(rs, full, ctx)
    first = _fold(rs, z, valid, v, ctx, _spans(0, SPLIT))
    second = _fold(rs, z, valid, v, ctx, _spans(SPLIT, KEYS))
    # Two disjoint ranges; reverse families take the later keys first.
    merged = streaming.merge(rs, second, first) if rs.reverse else streaming.merge(
        rs, first, second)
    merged_out, merged_stats, merged_smean = streaming.finalize(rs, merged, ctx)
    # The wrong order for reverse families (the earlier keys breaking the stick first).
    swapped_out = streaming.finalize(rs, streaming.merge(rs, first, second), ctx)[0]
    delta = jnp.sum(do * (smean if rs.saves_support_mean else out), axis=-1)
    p, dz, carry = _tile_grads(rs, z, valid, v, do, ctx, stats, delta)
    # The dense references.
    w_dense = core.weights(z, name, where=valid)
    dp = do @ v.T
    dz_dense = jax.vjp(lambda zz: core.weights(zz, name, where=valid), z)[1](dp)[0]
    dc_dense = None
    if rs.needs_row_scale:  # ∂L/∂c of L = Σ_i dO_i·O_i through softmax(c_i·z_i) written here
      dc_dense = jax.grad(lambda c: jnp.sum(do * (_softmax_scaled(c, z, valid) @ v)))(ctx)
    return dict(out=out, stats=stats, smean=smean, merged_out=merged_out,
                merged_stats=merged_stats, merged_smean=merged_smean, swapped_out=swapped_out,
                p=p, dz=dz, carry=carry, w_dense=w_dense, dz_dense=dz_dense, dc_dense=dc_dense,
                ctx=ctx)

  return jax.device_get(run(z, valid, v, do)), (z, valid, v, do)


def _close(actual, desired, rel=1e-5, err_msg=""):
  """|a − d| ≤ rel · max(1, |d|) elementwise, and a finite."""
  a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  assert a.shape == d.shape, (a.shape, d.shape)
  assert np.all(np.isfinite(a)), f"non-finite values {err_msg}"
  np.testing.assert_array_less(np.abs(a - d), rel * np.maximum(1.0, np.abs(d)) + 1e-30,
                               err_msg=err_msg)


@pytest.mark.parametrize("name", NAMES)
def test_fold_and_finalize_equal_dense_weights_times_v(name):
  res, (z, valid, v, _) = _run(name)
  want = np.asarray(res["w_dense"], np.float64) @ v.astype(np.float64)
  _close(res["out"], want, err_msg=name)
  # Masked keys take nothing: the fully masked row is exactly zero, the one-key row is either
  # that key's value (the simplex families, SSMax) or a multiple of it (softpick, stick).
  np.testing.assert_array_equal(res["out"][EMPTY_ROW], 0.0)
  ratio = res["out"][ONE_KEY_ROW] / v[30]
  np.testing.assert_allclose(ratio, ratio[0], rtol=1e-5)
  for stat in res["stats"]:  # the empty row's log-normalizer is +inf by design
    assert np.all(np.isfinite(np.delete(stat, EMPTY_ROW, axis=0))), name
  if _stream(name).needs_threshold:  # renormalized or not, simplex weights sum to one
    p = np.asarray(res["p"], np.float64)
    np.testing.assert_allclose(p.sum(-1)[valid.any(-1)], 1.0, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_merge_of_a_split_equals_the_whole_row(name):
  res, _ = _run(name)
  _close(res["merged_out"], res["out"], err_msg=name)
  for got, want in zip(res["merged_stats"], res["stats"], strict=True):
    inf = ~np.isfinite(want)  # the empty row's log-normalizer (+inf)
    np.testing.assert_array_equal(got[inf], want[inf])
    _close(got[~inf], want[~inf], err_msg=name)
  if res["smean"] is not None:
    _close(res["merged_smean"], res["smean"], err_msg=name)


def test_merge_order_matters_for_stick_breaking():
  # merge(later, earlier) is the contract (checked above); the other order breaks the stick
  # from the wrong end and must give a different answer, or the check above proves nothing.
  res, (_, valid, _, _) = _run("stick_breaking")
  both = valid[:, :SPLIT].any(-1) & valid[:, SPLIT:].any(-1)
  assert both.sum() >= 2
  assert np.max(np.abs(res["swapped_out"] - res["out"])[both]) > 1e-2


@pytest.mark.parametrize("name", NAMES)
def test_tile_grad_equals_autodiff_of_dense_weights(name):
  res, (_, valid, _, _) = _run(name)
  _close(res["p"], res["w_dense"], err_msg=name)
  dz, want = np.asarray(res["dz"]), np.asarray(res["dz_dense"])
  assert np.all(np.isfinite(dz))
  np.testing.assert_array_equal(dz[~valid], 0.0)
  scale = max(float(np.max(np.abs(want))), 1e-6)
  assert float(np.max(np.abs(dz - want))) <= 1e-5 * scale, name


def _softmax_scaled(c, z, valid):
  """softmax(c_i · z_ij) over the valid keys: SSMax with the per-row scale c as a variable."""
  y = jnp.where(valid, c[:, None] * z, -jnp.inf)
  m = jnp.max(y, axis=-1, keepdims=True)
  e = jnp.where(valid, jnp.exp(y - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  s = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(s > 0, s, 1.0)


def test_ssmax_carry_is_the_gradient_of_the_row_scale():
  res, (_, valid, _, _) = _run("ssmax")
  # row_scale is c_i = s·log n_i (n_i ≥ 1), s = 1 here.
  np.testing.assert_allclose(res["ctx"], np.log(np.maximum(valid.sum(-1), 1)), rtol=1e-6)
  want = np.asarray(res["dc_dense"])
  assert np.max(np.abs(want)) > 1e-2
  np.testing.assert_allclose(res["carry"].a, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The entmax threshold.
# --------------------------------------------------------------------------------------------

def _tau64(z, valid, alpha, scale):
  """τ of Σ_j [x_j − τ]₊^{1/(α−1)} = 1, x = (α−1)·scale·z minus the row max, by float64
  bisection (τ ∈ [−1, 0]: the max key alone has [0 − τ]^q ≤ 1)."""
  x = np.where(valid, (alpha - 1.0) * scale * z.astype(np.float64), -np.inf)
  x = x - np.max(x, axis=-1, keepdims=True)
  lo, hi = np.full(len(z), -1.0), np.zeros(len(z))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    mass = np.sum(np.maximum(x - mid[:, None], 0.0) ** (1.0 / (alpha - 1.0)), axis=-1)
    lo, hi = np.where(mass >= 1.0, mid, lo), np.where(mass >= 1.0, hi, mid)
  return 0.5 * (lo + hi)


def _threshold_rows(seed=3, rows=48, keys=150):
  """Rows from peaked (one key in the support) to flat (every key), ties and one-key rows."""
  rng = np.random.default_rng(seed)
  temps = np.geomspace(0.05, 20.0, rows)[:, None]
  z = (temps * rng.standard_normal((rows, keys))).astype(np.float32)
  z[0] = 0.25  # all tied: τ = −n^{1−α}
  z[1, :5] = z[1, :5].max()  # a tie at the top
  valid = rng.random((rows, keys)) < 0.9
  valid[2] = False
  valid[2, 7] = True  # one valid key: p = 1 there
  valid[3] = False  # fully masked
  return z, valid


@functools.cache
def _threshold(alpha, scale):
  rs = streaming.RowStream("entmax", alpha=alpha, scale=scale)
  z, valid = _threshold_rows()
  th = jax.jit(lambda z, valid: streaming.entmax_threshold(
      _tile_pass(z, valid, _spans(0, z.shape[1], 32)), (z.shape[0],), rs))(z, valid)
  return jax.device_get(th), z, valid


@pytest.mark.parametrize("alpha,scale", [(1.3, 1.0), (1.5, 1.0), (2.0, 1.0), (2.0, 2.0),
                                         (3.0, 1.0)])
def test_entmax_threshold_matches_float64_bisection(alpha, scale):
  th, z, valid = _threshold(alpha, scale)
  rows = valid.any(-1)
  x = np.where(valid, (alpha - 1.0) * scale * z.astype(np.float64), -np.inf)
  np.testing.assert_allclose(th.m[rows], np.max(x, axis=-1)[rows], rtol=1e-6)
  np.testing.assert_array_equal(th.m[~rows], 0.0)  # an empty row is not shifted
  tau = _tau64(z[rows], valid[rows], alpha, scale)
  assert np.all(np.isfinite(th.tau))
  np.testing.assert_allclose(th.tau[rows], tau, atol=1e-6, rtol=0)  # measured ≤ 3e-7
  n = valid.sum(-1)
  np.testing.assert_allclose(th.tau[0], -float(n[0]) ** (1.0 - alpha), rtol=1e-5)
  np.testing.assert_allclose(th.tau[2], -1.0, atol=1e-6)  # one key: [0 − τ]^q = 1
  passes = int(th.passes)
  assert 2 <= passes <= streaming.MAX_THRESHOLD_PASSES
  if alpha <= 2.0:
    assert passes < 20, passes


# --------------------------------------------------------------------------------------------
# Extreme scores.
# --------------------------------------------------------------------------------------------

@functools.cache
def _softpick_extreme():
  rs = _stream("softpick")
  rng = np.random.default_rng(5)
  z = np.zeros((ROWS, KEYS), np.float32)
  z[0] = -1e4  # every key very negative: all weights 0, denominator n
  z[1] = -1e4 + rng.standard_normal(KEYS).astype(np.float32)
  z[2] = 100.0 + 10 * rng.standard_normal(KEYS).astype(np.float32)  # e^z beyond float32
  z[3] = 1e4 * rng.standard_normal(KEYS).astype(np.float32)  # both signs, huge
  z[4] = rng.standard_normal(KEYS).astype(np.float32)
  z[5, :20] = -1e4
  z[5, 20:] = 0.5 * rng.standard_normal(20).astype(np.float32)
  valid = np.ones((ROWS, KEYS), bool)
  valid[4, ::3] = False
  v = rng.standard_normal((KEYS, HV)).astype(np.float32)
  do = rng.standard_normal((ROWS, HV)).astype(np.float32)

  @jax.jit
  def run(z, valid, v, do):
    out, stats, _ = streaming.finalize(rs, _fold(rs, z, valid, v, None, _spans(0, KEYS)), None)
    delta = jnp.sum(do * out, axis=-1)
    p, dz, _ = _tile_grads(rs, z, valid, v, do, None, stats, delta)
    w = core.weights(z, "softpick", where=valid)
    return out, stats, p, dz, w, w @ v

  return jax.device_get(run(z, valid, v, do))


def test_softpick_extreme_scores_stay_finite():
  out, stats, p, dz, w, want = _softpick_extreme()
  for x in (out, *stats, p, dz):
    assert np.all(np.isfinite(x))
  np.testing.assert_array_equal(out[0], 0.0)  # relu(e^z − 1) = 0 for every key
  np.testing.assert_array_equal(p[0], 0.0)
  assert np.all(np.isfinite(w)) and np.all(np.isfinite(want))
  _close(p, w, rel=1e-5)
  _close(out, want, rel=1e-5)
