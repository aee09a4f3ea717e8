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
from jax import lax

from attnx import core
from attnx.core import streaming
from attnx.core import weightings as wlib
from attnx.core.kernels.pallas import mosaic, triton

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


@pytest.mark.parametrize("alpha", [2.0, 1.5])
def test_entmax_threshold_stops_the_pass_its_support_is_final(alpha):
  """Sparsemax and 1.5-entmax: from τ = −1 (the shifted max at 0) the first sums pass sees
  the support {0, −0.1} (the other keys lie below −1), whose exact root keeps both keys in it,
  so the search ends there: the row-max pass and one more, at the closed-form τ (the root of
  Σ [x − τ]₊^{1/(α−1)} = 1 on the two keys). Searching on until the step is below float32
  resolution takes a third pass."""
  rs = streaming.RowStream("entmax", alpha=alpha, scale=1.0 / (alpha - 1.0))
  z = np.full((2, 64), -5.0, np.float32)
  z[:, 0], z[:, 1] = 0.0, -0.1  # x = (α − 1)·scale·z = z
  valid = np.ones(z.shape, bool)
  th = jax.jit(lambda z, valid: streaming.entmax_threshold(
      _tile_pass(z, valid, _spans(0, 64, 16)), (2,), rs))(z, valid)
  if alpha == 2.0:  # (0 − τ) + (−0.1 − τ) = 1
    want = (-0.1 - 1.0) / 2
  else:  # (0 − τ)² + (−0.1 − τ)² = 1, the smaller root
    want = (-0.2 - np.sqrt(0.04 - 8 * (0.01 - 1.0))) / 4
  np.testing.assert_allclose(np.asarray(th.tau), want, rtol=1e-6)
  assert int(th.passes) == 2


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


# --------------------------------------------------------------------------------------------
# Zero tiles of sparsemax/entmax: the test the kernels use to leave tiles out, and the hooks of
# entmax_threshold that let them.
# --------------------------------------------------------------------------------------------

ZERO_TILE = 32


def _peaked_rows(seed=5, rows=12, keys=150):
  """Rows whose large scores all lie in keys [32, 64) (tile 1 of 32): the other tiles are all
  zero for every row (NaN row: see the test)."""
  rng = np.random.default_rng(seed)
  z = rng.standard_normal((rows, keys)).astype(np.float32)
  z[:, ZERO_TILE:2 * ZERO_TILE] += 6.0
  valid = rng.random((rows, keys)) < 0.9
  valid[3] = False  # a fully masked row
  return z, valid


@functools.cache
def _zero_tile_program(alpha):
  rs = streaming.RowStream("entmax", alpha=alpha)
  spans = _spans(0, 150, ZERO_TILE)

  @jax.jit
  def run(z, valid):
    plain = streaming.entmax_threshold(_tile_pass(z, valid, spans), (z.shape[0],), rs)
    tile_max = jnp.stack([streaming.entmax_tile_max(z[:, a:b], valid[:, a:b], rs)
                          for a, b in spans])  # [tiles, rows]
    m = jnp.max(tile_max, axis=0)
    n = jnp.sum(valid, axis=-1, dtype=jnp.float32)
    # The tiles built to be zero (all but tile 1) hold NaN scores when computed: a result
    # without NaN shows that the passes left them out.
    poison = z.at[:, :ZERO_TILE].set(jnp.nan).at[:, 2 * ZERO_TILE:].set(jnp.nan)

    def sums_pass(fn, init, m_row, tau):
      zero = streaming.entmax_zero_tiles(tile_max, m_row, tau)
      c = init
      for j, (a, b) in enumerate(spans):
        c = lax.cond(zero[j], lambda c: c,
                     lambda c, a=a, b=b: fn(c, poison[:, a:b], valid[:, a:b]), c)
      return c

    hooked = streaming.entmax_threshold(None, (z.shape[0],), rs, row_max=(m, n),
                                        sums_pass=sums_pass)
    # Elementwise, as the output pass computes r: [rows, keys].
    r = jnp.maximum(streaming.entmax_x(z, valid, rs, plain.m) - plain.tau[:, None], 0.0)
    per_row = jnp.stack([streaming.entmax_zero_tiles(tile_max[:, i:i + 1], plain.m[i:i + 1],
                                                     plain.tau[i:i + 1])
                         for i in range(z.shape[0])])  # [rows, tiles]
    return plain, hooked, r, per_row, streaming.entmax_zero_tiles(tile_max, plain.m, plain.tau)

  return run


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0])
def test_entmax_zero_tiles_are_exactly_the_tiles_of_zero_weights(alpha):
  z, valid = _peaked_rows()
  _, _, r, per_row, block = jax.device_get(_zero_tile_program(alpha)(z, valid))
  spans = _spans(0, z.shape[1], ZERO_TILE)
  for j, (a, b) in enumerate(spans):
    # Row by row: zero iff every r of the row's tile is 0 (computed key by key).
    np.testing.assert_array_equal(per_row[:, j], np.all(r[:, a:b] == 0.0, axis=-1))
  np.testing.assert_array_equal(block, [True, False, True, True, True])
  # The float64 threshold agrees: no weight in a zero tile (x ≤ τ).
  rows = valid.any(-1)
  x = np.where(valid, (alpha - 1.0) * z.astype(np.float64), -np.inf)[rows]
  x = x - np.max(x, axis=-1, keepdims=True)
  tau = _tau64(z[rows], valid[rows], alpha, 1.0)
  for j, (a, b) in enumerate(spans):
    assert block[j] == np.all(x[:, a:b] <= tau[:, None]), j


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0])
def test_entmax_threshold_with_zero_tiles_left_out_is_bit_identical(alpha):
  z, valid = _peaked_rows()
  plain, hooked, *_ = jax.device_get(_zero_tile_program(alpha)(z, valid))
  for field in ("m", "tau", "passes"):
    np.testing.assert_array_equal(getattr(hooked, field), getattr(plain, field), err_msg=field)


def test_entmax_zero_tiles_keeps_the_tiles_of_a_nan_row():
  tile_max = jnp.asarray([[-5.0, -5.0], [-5.0, jnp.nan], [jnp.nan, jnp.nan]])  # [tiles, rows]
  m, tau = jnp.asarray([0.0, 0.0]), jnp.asarray([-1.0, -1.0])
  np.testing.assert_array_equal(streaming.entmax_zero_tiles(tile_max, m, tau),
                                [True, False, False])
  nan_m = jnp.asarray([0.0, jnp.nan])  # a NaN score makes the row max NaN: never zero
  np.testing.assert_array_equal(streaming.entmax_zero_tiles(tile_max, nan_m, tau),
                                [False, False, False])
  # −∞ (no valid key in the tile) is zero for any finite threshold.
  np.testing.assert_array_equal(
      streaming.entmax_zero_tiles(jnp.full((1, 2), -jnp.inf), m, tau), [True])


# --------------------------------------------------------------------------------------------
# Pointwise F: the two rules (online max; acc += F·V) in every kernel's spelling, against the
# dense pointwise weights of attnx.core.weightings (and closed forms in float64).
# XLA: the blocked kernel's (natural units, Σ F in V's column of ones, [rows] statistics);
# GPU_OPS / TPU_OPS: the Pallas kernels' (base-2 scores, Σ F summed apart, head-dim chunks of
# V on the GPU, statistics replicated over 128 lanes on the TPU).
# --------------------------------------------------------------------------------------------

PW_ROWS, PW_KEYS, PW_HV = 6, 40, 24
PW_CHUNKS = ((0, 16), (16, 8))  # the GPU's head-dim chunks of Hv = 24
PW_SPELLINGS = {"xla": (streaming.XLA, False), "gpu": (triton.OPS, True),
                "tpu": (mosaic.OPS, False)}
PW_NAMES = ["softmax", "softmax_plus_one", "softmax:alpha=0.5", "relu",
            "relu:normalization=length", "sigmoid:normalization=none"]


def _pw_data(seed=5):
  rng = np.random.default_rng(seed)
  s = (1.5 * rng.standard_normal((PW_ROWS, PW_KEYS))).astype(np.float32)
  valid = rng.random((PW_ROWS, PW_KEYS)) < 0.75
  valid[EMPTY_ROW] = False  # no valid key: O = 0
  valid[ONE_KEY_ROW] = False
  valid[ONE_KEY_ROW, 30] = True
  v = rng.standard_normal((PW_KEYS, PW_HV)).astype(np.float32)
  do = rng.standard_normal((PW_ROWS, PW_HV)).astype(np.float32)
  return jnp.asarray(s), jnp.asarray(valid), jnp.asarray(v), jnp.asarray(do)


def _pw_z(w, ops, s):
  """The kernels' tile exponent: α·s for the online max (times log₂e in base 2), else s."""
  if not w.online_max:
    return s
  return s * (float(w.exp_alpha) * (np.log2(np.e) if ops.exp2 else 1.0))


def _pw_rows(ops, x):
  """A [rows] start value in the spelling's layout."""
  return jnp.full((PW_ROWS, ops.lanes) if ops.lanes else (PW_ROWS,), x, jnp.float32)


def _pw_forward(w, ops, chunked, s, valid, v, with_offset=True):
  """O [rows, Hv] and the row statistic [rows] streamed over tiles of 16, 16 and 8 keys."""
  z = _pw_z(w, ops, s)
  vv = v
  if ops.ones_column and w.normalization == "sum":
    vv = jnp.concatenate([v, jnp.ones((PW_KEYS, 1), v.dtype)], axis=-1)
  if chunked:
    vv = tuple(v[:, o:o + c] for o, c in PW_CHUNKS)
  acc = jax.tree.map(lambda a: jnp.zeros((PW_ROWS, a.shape[-1]), jnp.float32), vv)
  tile = lambda x, a, b: None if x is None else x[:, a:b]
  if w.online_max:
    m0, l0 = streaming.online_max_start(w, with_offset)
    state = (acc.at[:, -1].set(l0), _pw_rows(ops, m0)) if ops.ones_column else (
        acc, _pw_rows(ops, m0), _pw_rows(ops, l0))
    for a, b in _spans(0, PW_KEYS):
      va = jax.tree.map(lambda x, a=a, b=b: x[a:b], vv)
      state = streaming.online_max_update(state[0], state[1], z[:, a:b], tile(valid, a, b), va,
                                          *state[2:], ops=ops)
    o, st = streaming.pointwise_finalize(w, *state, add_offset=not with_offset, ops=ops)
  else:
    acc, l = acc, _pw_rows(ops, 0.0)
    for a, b in _spans(0, PW_KEYS):
      va = jax.tree.map(lambda x, a=a, b=b: x[a:b], vv)
      acc, l = streaming.pointwise_update(w, acc, l, s[:, a:b], tile(valid, a, b), va, PW_KEYS,
                                          ops=ops)
    o, st = streaming.pointwise_finalize(w, acc, l, num_keys=PW_KEYS if valid is None else None,
                                         ops=ops)
  if chunked:
    o = jnp.concatenate(o, axis=-1)
  return o, (st[:, 0] if ops.lanes else st)


def _pw_stat64(w, s, valid):
  """The row statistic in float64: natural log-sum-exp (online max), Σ F + c, n, or 1."""
  s64 = np.asarray(s, np.float64)
  ok = np.ones(s64.shape, bool) if valid is None else np.asarray(valid)
  c = float(w.denominator_offset)
  if w.online_max:
    total = np.sum(np.where(ok, np.exp(float(w.exp_alpha) * s64), 0.0), axis=-1) + c
    with np.errstate(divide="ignore"):
      return np.where(total > 0, np.log(total), np.inf)
  if w.normalization == "sum":
    f = np.asarray(w.fn(jnp.where(ok, s, 0.0), PW_KEYS), np.float64)
    return np.sum(np.where(ok, f, 0.0), axis=-1) + c
  if w.normalization == "length":
    return np.sum(ok, axis=-1).astype(np.float64)
  return np.ones(s64.shape[0])


@pytest.mark.parametrize("spelling", PW_SPELLINGS)
@pytest.mark.parametrize("name", PW_NAMES)
def test_pointwise_rules_stream_the_dense_weights(name, spelling):
  w = wlib.get_weighting(name)
  ops, chunked = PW_SPELLINGS[spelling]
  s, valid, v, _ = _pw_data()
  # The offset (softmax_plus_one) as the state's start and added at the end (raw states);
  # "length" also on tiles without a mask (nothing counted: num_keys).
  variants = [(valid, True)] + ([(valid, False)] if w.denominator_offset else []) + (
      [(None, True)] if w.normalization == "length" else [])
  for where, with_offset in variants:
    o, st = _pw_forward(w, ops, chunked, s, where, v, with_offset)
    o_dense = wlib.pointwise_weights(s, w, where=where, num_keys=PW_KEYS) @ v
    msg = f"{name} {spelling} masked={where is not None} with_offset={with_offset}"
    _close(o, o_dense, rel=2e-5, err_msg=msg)
    st = np.asarray(st, np.float64) * (np.log(2.0) if ops.exp2 and w.online_max else 1.0)
    st64 = _pw_stat64(w, s, where)
    np.testing.assert_array_equal(np.isinf(st), np.isinf(st64), err_msg=msg)
    fin = np.isfinite(st64)
    _close(st[fin], st64[fin], rel=1e-5, err_msg=msg)
    if where is not None and not w.denominator_offset:
      np.testing.assert_array_equal(np.asarray(o)[EMPTY_ROW], 0.0, err_msg=msg)


def _pw_backward(w, ops, s, valid, v, do, st, o):
  """(P, dz) of the whole row from pointwise_tile_grad over the tiles, the Pallas way (row
  values broadcast against the tile beforehand) or the blocked kernel's (``row``)."""
  if ops.lanes:  # the TPU's [rows, 128] statistics, spread over a tile's keys
    st = jnp.broadcast_to(st[:, None], (PW_ROWS, ops.lanes))
  delta = jnp.sum(do * o, axis=-1)
  if ops.lanes:
    delta = jnp.broadcast_to(delta[:, None], (PW_ROWS, ops.lanes))
  rows = streaming.pointwise_grad_rows(w, st, delta)
  z = _pw_z(w, ops, s)
  ps, dzs = [], []
  for a, b in _spans(0, PW_KEYS):
    dp = do @ v[a:b].T
    zt, vt = z[:, a:b], valid[:, a:b]
    if ops.lanes:
      tile_rows = tuple(None if r is None else ops.spread(r, b - a) for r in rows)
      p, dz = streaming.pointwise_tile_grad(w, zt, vt, dp, tile_rows, PW_KEYS, ops=ops)
    else:
      p, dz = streaming.pointwise_tile_grad(w, zt, vt, dp, rows, PW_KEYS,
                                            row=lambda r: r[:, None], ops=ops)
    ps.append(p)
    dzs.append(dz)
  return jnp.concatenate(ps, axis=-1), jnp.concatenate(dzs, axis=-1)


@pytest.mark.parametrize("spelling", PW_SPELLINGS)
@pytest.mark.parametrize("name", PW_NAMES)
def test_pointwise_tile_grad_equals_autodiff_of_dense_weights(name, spelling):
  w = wlib.get_weighting(name)
  ops, chunked = PW_SPELLINGS[spelling]
  s, valid, v, do = _pw_data()
  o, st = _pw_forward(w, ops, chunked, s, valid, v)
  p, dz = _pw_backward(w, ops, s, valid, v, do, st, o)
  dense = lambda ss: wlib.pointwise_weights(ss, w, where=valid, num_keys=PW_KEYS)
  w_dense, vjp = jax.vjp(dense, s)
  ds_dense = vjp(do @ v.T)[0]
  alpha = float(w.exp_alpha) if w.online_max else 1.0  # dz is the cotangent of z = α·s
  _close(p, w_dense, rel=2e-5, err_msg=f"{name} {spelling} weights")
  _close(alpha * dz, ds_dense, rel=5e-5, err_msg=f"{name} {spelling} ds")
  np.testing.assert_array_equal(np.asarray(dz)[~np.asarray(valid)], 0.0)


def test_pointwise_grad_rows_scale_a_tiny_normalizer():
  """power:p=3 on scores ~1e-12: l = Σ s³ < 2^-100, so the rows scale F by μ = 2^100 and 1/l
  by 2^-100 (a denormal l, which GPUs keep, would overflow 1/l; XLA's CPU flushes it to 0,
  so here the scaled path is checked on a small normal l): P, dz match the float64 closed
  form P = F/l, ds = F'(s)(dP − δ)/l, next to an ordinary row (μ = 1)."""
  w = wlib.get_weighting("power:p=3")
  rng = np.random.default_rng(7)
  s = (rng.uniform(1.0, 2.0, (2, 4)) * 1e-12).astype(np.float32)
  s[1] = rng.uniform(0.5, 2.0, 4)
  v = rng.standard_normal((4, 3)).astype(np.float32)
  do = rng.standard_normal((2, 3)).astype(np.float32)
  s64, v64, do64 = (np.asarray(x, np.float64) for x in (s, v, do))
  f64 = s64 ** 3
  l64 = f64.sum(-1, keepdims=True)
  p64 = f64 / l64
  dp64 = do64 @ v64.T
  delta64 = np.sum(p64 * dp64, axis=-1, keepdims=True)
  ds64 = 3 * s64 ** 2 * (dp64 - delta64) / l64
  rows = streaming.pointwise_grad_rows(w, jnp.asarray(l64[:, 0], jnp.float32),
                                       jnp.asarray(delta64[:, 0], jnp.float32))
  np.testing.assert_array_equal(rows[0], [2.0 ** 100, 1.0])
  p, dz = streaming.pointwise_tile_grad(w, jnp.asarray(s), None, jnp.asarray(dp64, jnp.float32),
                                        rows, 4, row=lambda r: r[:, None])
  _close(p, p64, rel=1e-5)
  np.testing.assert_allclose(np.asarray(dz, np.float64), ds64, rtol=1e-5)


def test_online_max_l_rides_in_the_ones_column_or_apart_never_both():
  w = wlib.get_weighting("softmax")
  z, v, rows = jnp.zeros((2, 4)), jnp.ones((4, 3)), jnp.zeros(2)
  with pytest.raises(ValueError, match="ones_column"):  # XLA: l is acc's last column
    streaming.online_max_update(jnp.zeros((2, 3)), rows, z, None, v, rows)
  with pytest.raises(ValueError, match="ones_column"):  # GPU_OPS: l must be passed
    streaming.pointwise_finalize(w, jnp.zeros((2, 3)), rows, ops=triton.OPS)
