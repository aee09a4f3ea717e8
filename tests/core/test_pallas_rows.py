"""attnx.core.kernels.pallas.*rows: the Pallas kernels of the whole-row weightings.

``implementation="pallas"`` runs SSMax (Nakanishi 2025, "Scalable-Softmax Is Superior for
Attention"), softpick (Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive Activations
with Rectified Softmax"), stick-breaking (Tan et al. 2024, "Scaling Stick-Breaking Attention:
An Efficient Implementation and In-depth Study"), sparsemax (Martins & Astudillo 2016, "From
Softmax to Sparsemax") and α-entmax (Peters, Niculae & Martins 2019, "Sparse Sequence-to-Sequence
Models") as Triton (GPU) and Mosaic (TPU) kernels built on :mod:`attnx.core.streaming`.

* Values and gradients (q, k, v, bias, SSMax's learned s) of both kernels in Pallas' interpreter
  against ``implementation="dense"``: several ragged query and key tiles per row, GQA, T ≠ S,
  causal with skipped tiles, masks with fully masked rows, bias, key and query lengths.
* The edge-case contract: empty sequences, rows without a valid key (zero output, zero finite
  gradients), NaN rows, masked NaN keys.
* Lowering of forward and backward for ``cuda`` (Triton) and ``tpu`` (Mosaic) from this CPU
  (see test_pallas_kernels.py for what lowering checks), and the tile rules.
* The streaming.Ops spellings the kernels use agree with the XLA ones.

Compilation dominates: each (case, weighting, backend) is one jitted program, cached.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import lowering

from attnx import core
from attnx.core import streaming
from attnx.core import weightings as wlib
from attnx.core.kernels import pallas as pa
from attnx.core.kernels.pallas import mosaic_rows, triton_rows
from attnx.core.kernels.pallas import rows as pallas_rows

BASE = ["ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15", "entmax:alpha=1.3",
        "entmax:alpha=3"]
VARIANTS = ["ssmax:s=0.5", "sparsemax:scale=2"]
BLOCKS = {"gpu": (16, 32), "tpu": (8, 128)}  # several query and key tiles at these sizes
SCALE = 0.5
H = 8
# Tolerances as for the blocked kernel (test_blocked_rows.py): values ≤ VALUE_TOL·max(1, |ref|)
# elementwise, gradients ≤ GRAD_TOL·max |ref|; α = 3 has dp/dz = p^{−1}, unbounded at the edge
# of the support, which amplifies float32 rounding of scores near the threshold.
VALUE_TOL, GRAD_TOL = 1e-5, 1e-4
LOOSE = {"entmax:alpha=3": (1e-4, 3e-4)}


@dataclasses.dataclass(frozen=True)
class Case:
  b: int
  t: int
  s: int
  n: int
  kh: int
  causal: bool
  bias: tuple[int, ...] | None
  mask: str | None  # "rows": [B, 1, T, S] with EMPTY rows; "keys": [1, 1, 1, S], key 0 masked
  lengths: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (q_lengths, kv_lengths)


CASES = {
    # GQA, T < S, a per-head bias and a mask that empties query 3 of batch 0.
    "full": Case(2, 37, 150, 4, 2, False, (1, 4, 37, 150), "rows"),
    # Causal with T > S (tiles above the diagonal skipped, rows past S see every key), a
    # per-key bias, key 0 masked (query 0 sees no key), query and key lengths.
    "causal": Case(2, 150, 140, 2, 1, True, (2, 1, 1, 140), "keys", ((150, 101), (140, 77))),
}
EMPTY = {"full": [(0, 3)], "causal": [(0, 0), (1, 0), (1, 120)]}  # (batch, row): no valid key
MATRIX = ([("full", n, be) for n in BASE for be in pa.BACKENDS]
          + [("full", "ssmax:s=0.5", "tpu"), ("full", "sparsemax:scale=2", "gpu")]
          + [("causal", n, be) for n in BASE[:5] for be in pa.BACKENDS])
# CI runs every family on the GPU kernel and a sample on the TPU kernel (the two share the
# tile math); -m exhaustive runs the rest.
_SAMPLE = {("full", n, "gpu") for n in BASE} | {
    ("full", "stick_breaking", "tpu"), ("full", "sparsemax", "tpu"),
    ("causal", "stick_breaking", "gpu"), ("causal", "sparsemax", "gpu"),
    ("causal", "stick_breaking", "tpu")}
_EXHAUSTIVE = {m for m in MATRIX if m not in _SAMPLE}
MATRIX = [pytest.param(*m, marks=pytest.mark.exhaustive) if m in _EXHAUSTIVE else m
          for m in MATRIX]


def _bf16_exact(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@functools.cache
def _inputs(case_name, seed=0):
  c = CASES[case_name]
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k = _bf16_exact(normal(c.b, c.t, c.n, H)), _bf16_exact(normal(c.b, c.s, c.kh, H))
  # The last value column is 1: its output is Σ_j p_ij (1 for the simplex families).
  v = _bf16_exact(np.concatenate([normal(c.b, c.s, c.kh, H - 1),
                                  np.ones((c.b, c.s, c.kh, 1), np.float32)], axis=-1))
  bias = None if c.bias is None else normal(*c.bias)
  if c.mask == "rows":
    mask = rng.random((c.b, 1, c.t, c.s)) < 0.7
    for bi, ti in EMPTY[case_name]:
      mask[bi, :, ti] = False
  else:
    mask = rng.random((1, 1, 1, c.s)) < 0.8
    mask[..., 0] = False
  return q, k, v, bias, mask, normal(c.b, c.t, c.n, H)


def _dense_mask(case_name):
  """The mask that gives dense the kernel's key and query lengths."""
  c = CASES[case_name]
  mask = _inputs(case_name)[4]
  if c.lengths is None:
    return mask
  ql, kl = (np.asarray(x) for x in c.lengths)
  rows = np.arange(c.t)[None, :, None] < ql[:, None, None]
  cols = np.arange(c.s)[None, None, :] < kl[:, None, None]
  return mask & (rows & cols)[:, None]


def _out_and_grads(f, q, k, v, bias, ct):
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
  return f(q, k, v, bias), jax.grad(loss, argnums=argnums)(q, k, v, bias)


@functools.cache
def _dense(case_name, name):
  c = CASES[case_name]
  q, k, v, bias, _, ct = _inputs(case_name)
  mask = _dense_mask(case_name)
  f = lambda q, k, v, bias: core.attention(q, k, v, bias, mask, weighting=name, scale=SCALE,
                                           is_causal=c.causal, implementation="dense")
  return jax.device_get(jax.jit(functools.partial(_out_and_grads, f))(q, k, v, bias, ct))


def _pallas_fn(case_name, name, backend, **kw):
  c = CASES[case_name]
  mask = _inputs(case_name)[4]
  bq, bk = BLOCKS[backend]
  ql, kl = (None, None) if c.lengths is None else (jnp.asarray(x) for x in c.lengths)
  w = wlib.get_weighting(name)
  return lambda q, k, v, bias: pa.pallas_attention(
      q, k, v, weighting=w, scale=SCALE, bias=bias, mask=mask, is_causal=c.causal,
      q_lengths=ql, kv_lengths=kl, block_q=bq, block_k=bk, backend=backend, interpret=True,
      **kw)


@functools.cache
def _pallas(case_name, name, backend):
  q, k, v, bias, _, ct = _inputs(case_name)
  f = _pallas_fn(case_name, name, backend)
  return jax.device_get(jax.jit(functools.partial(_out_and_grads, f))(q, k, v, bias, ct))


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


@pytest.mark.parametrize("case,name,backend", MATRIX)
@pytest.mark.split_by_jax
def test_pallas_matches_dense(case, name, backend):
  out, grads = _pallas(case, name, backend)
  want_out, want_grads = _dense(case, name)
  value_tol, grad_tol = LOOSE.get(name, (VALUE_TOL, GRAD_TOL))
  _check_values(out, want_out, value_tol, "out")
  for label, g, w in zip("q k v bias".split(), grads, want_grads, strict=False):
    _check_grad(g, w, grad_tol, f"d{label}")
  for bi, ti in EMPTY[case]:  # a row with no valid key: zero output, no gradient to q
    np.testing.assert_array_equal(out[bi, ti], 0.0)
    np.testing.assert_array_equal(grads[0][bi, ti], 0.0)
  if name.startswith(("sparsemax", "entmax")):  # the ones column: rows with a key sum to 1
    has_key = np.ones(out.shape[:-1], bool)
    for bi, ti in EMPTY[case]:
      has_key[bi, ti] = False
    if case == "causal":
      has_key[1, 101:] = False  # q_lengths
    np.testing.assert_allclose(np.asarray(out[..., -1], np.float64)[has_key], 1.0, atol=1e-5)


def test_cases_cover_several_ragged_tiles_per_row():
  for c in CASES.values():
    for bq, bk in BLOCKS.values():
      assert c.s % bk and c.s > bk and c.t > 2 * bq, (c, bq, bk)
  causal = CASES["causal"]
  assert causal.t > causal.s and causal.causal and causal.lengths
  assert CASES["full"].n != CASES["full"].kh and CASES["full"].t != CASES["full"].s


# bfloat16 inputs (float32 scores, state and accumulators) against float32 dense on the same
# (bf16-exact) values: ≤ 3e-2·max(1, |ref|) (the output's bf16 rounding, bf16 weights in P·V).
BF16_TOL = 3e-2


@pytest.mark.parametrize("name,backend", [
    ("softpick", "gpu"), ("stick_breaking", "gpu"), ("entmax15", "gpu"), ("ssmax", "tpu"),
    ("sparsemax", "tpu")])
def test_bf16_close_to_f32_dense(name, backend):
  q, k, v, bias, mask, _ = _inputs("full")
  bq, bk = (16, BLOCKS[backend][1])  # the TPU's bf16 query tiles: multiples of 16
  f = jax.jit(lambda q, k, v: pa.pallas_attention(
      q, k, v, weighting=wlib.get_weighting(name), scale=SCALE, bias=bias, mask=mask,
      block_q=bq, block_k=bk, backend=backend, interpret=True))
  got = f(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
  assert got.dtype == jnp.bfloat16
  want, _ = _dense("full", name)
  _check_values(np.asarray(got, np.float32), want, BF16_TOL, name)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[0, 3], 0.0)


# --------------------------------------------------------------------------------------------
# SSMax with a learned s per head, through core.attention (GPU kernels) and directly (TPU).
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", pa.BACKENDS)
def test_learned_ssmax_s_gets_the_dense_gradient(backend):
  q, k, v, bias, mask, ct = _inputs("full")
  s_heads = jnp.asarray([0.5, 1.0, 1.5, 2.0], jnp.float32)

  def dense(q, k, v, s):
    return core.attention(q, k, v, bias, mask, weighting="ssmax", scale=SCALE,
                          implementation="dense", weighting_params={"s": s})

  if backend == "gpu":  # the dispatcher's route (the interpreter runs the GPU kernels)
    bq, bk = BLOCKS["gpu"]

    def pallas(q, k, v, s):
      return core.attention(q, k, v, bias, mask, weighting="ssmax", scale=SCALE,
                            implementation=core.Pallas(block_q=bq, block_k=bk, interpret=True),
                            weighting_params={"s": s})
  else:
    def pallas(q, k, v, s):
      return pa.pallas_attention(q, k, v, weighting=wlib.get_weighting("ssmax"), scale=SCALE,
                                 bias=bias, mask=mask, block_q=BLOCKS["tpu"][0],
                                 block_k=BLOCKS["tpu"][1], backend="tpu", interpret=True,
                                 ssmax_s=s)

  def run(f):
    loss = lambda *a: jnp.sum(f(*a) * ct)
    return jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 3)))(q, k, v, s_heads))

  (got, (gq, gs)), (want, (wq, ws)) = run(pallas), run(dense)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  _check_grad(gq, wq, GRAD_TOL, "dq")
  _check_grad(gs, ws, GRAD_TOL, "ds")
  assert np.all(np.abs(ws) > 1e-3)  # every head's s matters


def test_ssmax_row_scale_counts_the_keys_each_row_attends():
  rs = wlib.get_weighting("ssmax").stream
  kv_len, s_heads = jnp.asarray([5, 9]), jnp.asarray([0.5, 1.0, 2.0])
  rows, keys = np.arange(7)[:, None], np.arange(9)[None, :]
  for causal in (False, True):
    for lens in (None, kv_len):
      counts = np.broadcast_to((keys <= rows) if causal else np.ones((7, 9), bool), (2, 7, 9))
      if lens is not None:
        counts = counts & (keys < np.asarray(lens)[:, None, None])
      want = np.asarray(s_heads)[None, :, None] * np.log(np.maximum(counts.sum(-1), 1))[:, None]
      closed = pallas_rows.row_scale(rs, 2, 3, 7, 9, None, None, causal, lens, s_heads)
      masked = pallas_rows.row_scale(rs, 2, 3, 7, 9, None, jnp.ones((1, 1, 1, 9), bool),
                                     causal, lens, s_heads)
      np.testing.assert_allclose(closed, want, rtol=1e-6)
      np.testing.assert_allclose(masked, want, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# The edge-case contract (attnx.core.contract), identical to dense.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", pa.BACKENDS)
def test_empty_sequences_give_zeros(backend):
  rng = np.random.default_rng(0)
  for t, s in ((0, 7), (5, 0)):
    q = rng.standard_normal((2, t, 4, H)).astype(np.float32)
    k = rng.standard_normal((2, s, 2, H)).astype(np.float32)
    v = rng.standard_normal((2, s, 2, 3)).astype(np.float32)
    for name in ("stick_breaking", "entmax15"):
      f = lambda q, k, v, name=name: pa.pallas_attention(
          q, k, v, weighting=wlib.get_weighting(name), scale=SCALE, is_causal=True,
          backend=backend, interpret=True)
      out, grads = jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, k, v)
      np.testing.assert_array_equal(out, 0.0)
      assert f(q, k, v).shape == (2, t, 4, 3)
      for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape
        np.testing.assert_array_equal(g, 0.0)


NAN_ROW, NAN_KEY = (1, 5), 2  # a (batch, row) with valid keys; a key masked for every row


@functools.cache
def _nan(name, backend):
  """Pallas and dense outputs (and dq, dk of a cotangent) of the "full" inputs with a NaN in q
  of NAN_ROW (head 2) and a NaN in the value of the masked key NAN_KEY of batch 0."""
  q, k, v, bias, mask, ct = _inputs("full")
  mask = mask.copy()
  mask[0, ..., NAN_KEY] = False
  q, v = q.copy(), v.copy()
  q[NAN_ROW + (2,)] = np.nan
  v[0, NAN_KEY, 1, 0] = np.nan
  bq, bk = BLOCKS[backend]
  w = wlib.get_weighting(name)
  fs = [lambda q, k, v: pa.pallas_attention(q, k, v, weighting=w, scale=SCALE, bias=bias,
                                            mask=mask, block_q=bq, block_k=bk, backend=backend,
                                            interpret=True),
        lambda q, k, v: core.attention(q, k, v, bias, mask, weighting=name, scale=SCALE,
                                       implementation="dense")]

  def run(q, k, v):
    outs = []
    for f in fs:
      out, vjp = jax.vjp(f, q, k, v)
      outs.append((out, *vjp(jnp.asarray(ct))[:2]))
    return outs

  return jax.device_get(jax.jit(run)(q, k, v))


@pytest.mark.parametrize("name,backend", [
    ("ssmax", "gpu"), ("softpick", "tpu"), ("stick_breaking", "gpu"),
    pytest.param("stick_breaking", "tpu", marks=pytest.mark.exhaustive),  # CI: one backend
    ("sparsemax", "gpu"), pytest.param("sparsemax", "tpu", marks=pytest.mark.exhaustive),
    ("entmax:alpha=1.3", "gpu")])
def test_nan_rows_and_masked_nan_keys_follow_dense(name, backend):
  (out, dq, dk), (want, wdq, wdk) = _nan(name, backend)
  expected = np.zeros(out.shape, bool)
  expected[NAN_ROW + (2,)] = True
  np.testing.assert_array_equal(np.isnan(out), expected)  # only the NaN row; the key never
  np.testing.assert_array_equal(np.isnan(want), expected)
  np.testing.assert_allclose(out[~expected], want[~expected], atol=1e-5, rtol=1e-5)
  # Gradients: NaN exactly where dense has NaN, the rest agrees.
  for got_g, want_g in ((dq, wdq), (dk, wdk)):
    np.testing.assert_array_equal(np.isnan(got_g), np.isnan(want_g))
    ok = ~np.isnan(want_g)
    np.testing.assert_allclose(got_g[ok], want_g[ok], atol=1e-4 * np.max(np.abs(want_g[ok])))


# --------------------------------------------------------------------------------------------
# Zero-tile skipping (sparsemax, entmax): bit-identical, and every kernel takes the branch.
# --------------------------------------------------------------------------------------------

CLUSTERS = 3


@functools.cache
def _clustered(backend):
  """Causal GQA inputs whose query tile i and key tile j point along directions i mod 3 and
  j mod 3 (scores ≈ 8 apart): a query tile's weights on the key tiles of other directions are
  all zero, except where a causal row sees no key of its own direction."""
  bq, bk = BLOCKS[backend]
  b, t, s, n, kh = 1, 3 * bk + 5, 3 * bk + 5, 2, 1  # causal: rows reach every key tile
  rng = np.random.default_rng(7)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  dirs = 4.0 * np.eye(H, dtype=np.float32)[:CLUSTERS]
  q = dirs[(np.arange(t) // bq) % CLUSTERS][None, :, None] + 0.3 * normal(b, t, n, H)
  k = dirs[(np.arange(s) // bk) % CLUSTERS][None, :, None] + 0.3 * normal(b, s, kh, H)
  return q, k, normal(b, s, kh, H), normal(b, t, n, H)


def _skip_run(name, backend, skip, ct=None, patch=None):
  q, k, v, ct0 = _clustered(backend)
  bq, bk = BLOCKS[backend]
  w = wlib.get_weighting(name)
  f = lambda q, k, v, bias: pa.pallas_attention(
      q, k, v, weighting=w, scale=SCALE, is_causal=True, block_q=bq, block_k=bk,
      backend=backend, interpret=True, skip_zero_tiles=skip)
  with pytest.MonkeyPatch.context() as mp:
    if patch is not None:
      mp.setattr(streaming, "entmax_zero_tile", patch)
    return jax.device_get(jax.jit(functools.partial(_out_and_grads, f))(
        q, k, v, None, ct0 if ct is None else ct))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("name,backend", [
    ("sparsemax", "gpu"), ("entmax15", "tpu"), ("entmax:alpha=1.3", "gpu"),
    pytest.param("sparsemax", "tpu", marks=pytest.mark.exhaustive),
    pytest.param("entmax15", "gpu", marks=pytest.mark.exhaustive)])
def test_skipping_zero_tiles_is_bit_identical_and_matches_dense(name, backend):
  # Bit for bit against the same program whose zero test never holds (a test XLA cannot fold
  # away): the skipped tiles add exact zeros. Against skip_zero_tiles=False (no branch) only
  # within the tolerances: XLA:CPU at the suite's optimization level 0 rounds a loop body
  # with and without the branch differently (jax 0.10.2, 1.3-entmax: ≤ 5e-7).
  never = lambda z, *args, **kw: jnp.max(z) > jnp.inf
  (out, grads), (out_never, grads_never), (out_off, grads_off) = (
      _skip_run(name, backend, True), _skip_run(name, backend, True, patch=never),
      _skip_run(name, backend, False))
  np.testing.assert_array_equal(out, out_never)
  for g, g_never in zip(grads, grads_never, strict=True):
    np.testing.assert_array_equal(g, g_never)
  q, k, v, ct = _clustered(backend)
  dense = lambda q, k, v, bias: core.attention(q, k, v, weighting=name, scale=SCALE,
                                               is_causal=True, implementation="dense")
  want_out, want_grads = jax.device_get(jax.jit(functools.partial(_out_and_grads, dense))(
      q, k, v, None, ct))
  value_tol, grad_tol = LOOSE.get(name, (VALUE_TOL, GRAD_TOL))
  for got, got_grads in ((out, grads), (out_off, grads_off)):
    _check_values(got, want_out, value_tol, "out")
    for label, g, w in zip("qkv", got_grads, want_grads, strict=True):
      _check_grad(g, w, grad_tol, f"d{label}")
  # The inputs do have zero tiles: whole (query tile, key tile) blocks of zero dense weights.
  bq, bk = BLOCKS[backend]
  weights = np.asarray(core.attention_weights(q, k, weighting=name, scale=SCALE,
                                              is_causal=True))[0, 0]
  t, s = weights.shape
  blocks = [weights[i:i + bq, j:j + bk] for i in range(0, t, bq) for j in range(0, s, bk)
            if j <= i + bq - 1]
  assert sum(np.all(b == 0) for b in blocks) >= 3


@pytest.mark.parametrize("backend", pa.BACKENDS)
def test_every_kernel_leaves_out_the_tiles_the_zero_test_names(backend):
  # With a zero test that names every tile, the output pass adds nothing (zero output) and
  # the dQ and dK/dV kernels add nothing (zero gradients): each kernel asks the test and
  # skips on its answer. The threshold passes are not skipped (the test is not asked there).
  out, grads = _skip_run("sparsemax", backend, True, patch=lambda *a, **kw: jnp.bool_(True))
  np.testing.assert_array_equal(out, 0.0)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)
  out_off, _ = _skip_run("sparsemax", backend, False, patch=lambda *a, **kw: jnp.bool_(True))
  assert np.abs(out_off).max() > 0.1  # skip_zero_tiles=False never asks


@pytest.mark.parametrize("backend", pa.BACKENDS)
def test_wide_float32_heads_skip_except_in_the_gpus_two_pass_dkv(backend):
  # float32 at a head size of 72 (padded 80): the GPU runs dK and dV as two passes, which
  # do not skip (the branch spilled registers there); the TPU keeps its one dK/dV kernel,
  # which does. A zero test that names every tile shows who asks it.
  rng = np.random.default_rng(5)
  q, k, v, ct = (jnp.asarray(rng.standard_normal((1, 48, 2, 72)), jnp.float32)
                 for _ in range(4))
  bq, bk = BLOCKS[backend]
  f = lambda q, k, v, bias: pa.pallas_attention(
      q, k, v, weighting=wlib.get_weighting("sparsemax"), scale=SCALE, is_causal=True,
      block_q=bq, block_k=bk, backend=backend, interpret=True)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(streaming, "entmax_zero_tile", lambda *a, **kw: jnp.bool_(True))
    out, (dq, dk, dv) = jax.device_get(jax.jit(functools.partial(_out_and_grads, f))(
        q, k, v, None, ct))
  np.testing.assert_array_equal(out, 0.0)
  np.testing.assert_array_equal(dq, 0.0)
  for g in (dk, dv):
    if backend == "gpu":
      assert np.abs(g).max() > 1e-3
    else:
      np.testing.assert_array_equal(g, 0.0)


def test_skipping_keeps_the_nan_of_a_nan_cotangent_in_pallas():
  # A NaN in dO reaches every tile of its row's query tile, zero weights included (0·NaN), as
  # autodiff of the dense weights gives: that query tile's tiles are not left out.
  ct = _clustered("gpu")[3].copy()
  ct[0, 40, 1, 2] = np.nan
  (_, on), (_, off) = (_skip_run("sparsemax", "gpu", s, ct=ct) for s in (True, False))
  for g_on, g_off in zip(on, off, strict=True):
    np.testing.assert_array_equal(g_on, g_off)  # NaN in the same places
  assert np.isnan(on[1]).any() and not np.isnan(on[1]).all()


@pytest.mark.parametrize("ops", [streaming.XLA, triton_rows.OPS, mosaic_rows.OPS])
def test_the_one_tile_zero_test_is_the_table_test(ops):
  rs = streaming.RowStream("entmax", alpha=1.5)
  rng = np.random.default_rng(3)
  # Six key tiles, each lower than the one before: at each τ some tiles are zero, some not.
  z = rng.standard_normal((6, 8, 16)) - 2.0 * np.arange(6)[:, None, None]
  z = jnp.asarray(z, jnp.float32)
  valid = jnp.asarray(rng.random((6, 8, 16)) < 0.8)
  m = jnp.max(streaming.entmax_x(z, valid, rs), axis=(0, 2))
  seen = set()
  for tau in (-0.5, -1.0, -2.0):
    tau_rows = jnp.full((8,), tau, jnp.float32).at[3].set(tau - 0.3)
    table = streaming.entmax_zero_tiles(streaming.entmax_tile_max(z, valid, rs), m, tau_rows)
    one = [bool(streaming.entmax_zero_tile(z[j], valid[j], m, tau_rows, rs, ops))
           for j in range(6)]
    np.testing.assert_array_equal(one, np.asarray(table))
    seen.update(one)
  assert seen == {True, False}
  nan_m = m.at[2].set(jnp.nan)  # a NaN row never passes
  assert not any(bool(streaming.entmax_zero_tile(z[j], valid[j], nan_m, jnp.full(8, -3.0), rs,
                                                 ops)) for j in range(6))


def test_pallas_skip_flag_must_be_bool():
  q, k, v, _ = _clustered("gpu")
  with pytest.raises(ValueError, match="skip_zero_tiles"):
    pa.pallas_attention(q, k, v, weighting=wlib.get_weighting("sparsemax"), scale=SCALE,
                        backend="gpu", interpret=True, skip_zero_tiles=1)


# --------------------------------------------------------------------------------------------
# Lowering for the real targets (Triton IR, Mosaic MLIR) from this CPU, and the tile rules.
# --------------------------------------------------------------------------------------------

PLATFORMS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int = 2
  t: int = 200
  s: int = 256
  n: int = 4
  kh: int = 2
  h: int = 64
  hv: int | None = None
  dtype: str = "bfloat16"
  causal: bool = True
  mask: tuple[int, ...] | None = (2, 1, 200, 256)
  bias: tuple[int, ...] | None = (1, 4, 200, 256)
  lengths: bool = False


# Everything at once (GQA, ragged T, causal, mask, differentiated bias, learned s), bf16.
FULL = Shape()
# float32, key and query lengths, H = 130 (GPU head chunks 128 + 16), Hv = 80 (padded to 128).
ODD = Shape(b=1, t=100, s=300, n=2, kh=1, h=130, hv=80, dtype="float32", causal=False,
            mask=None, bias=(1, 1, 1, 300), lengths=True)


def _lower(name, shape, platform):
  backend, _ = PLATFORMS[platform]
  w = wlib.get_weighting(name)
  dt = jnp.dtype(shape.dtype)
  sds = jax.ShapeDtypeStruct
  args = [sds((shape.b, shape.t, shape.n, shape.h), dt),
          sds((shape.b, shape.s, shape.kh, shape.h), dt),
          sds((shape.b, shape.s, shape.kh, shape.hv or shape.h), dt),
          None if shape.bias is None else sds(shape.bias, jnp.float32),
          sds((shape.n,), jnp.float32), sds((shape.b,), jnp.int32)]
  mask = None if shape.mask is None else jnp.ones(shape.mask, bool)
  ssmax = w.stream.family == "ssmax"

  def f(q, k, v, bias, s, lengths):
    lens = lengths if shape.lengths else None
    return pa.pallas_attention(q, k, v, weighting=w, scale=0.125, bias=bias, mask=mask,
                               is_causal=shape.causal, q_lengths=lens, kv_lengths=lens,
                               backend=backend, ssmax_s=s if ssmax else None)

  argnums = (0, 1, 2) + ((3,) if shape.bias is not None else ()) + ((4,) if ssmax else ())
  # Σ out²: the cotangent reads the output, so no JAX version drops the forward kernel.
  fn = jax.grad(lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32))), argnums=argnums)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name,shape", [(n, "full") for n in BASE] + [
    (n, "odd") for n in ("ssmax", "stick_breaking", "entmax15")])
def test_every_family_lowers_fwd_and_bwd(name, shape, platform):
  sh = {"full": FULL, "odd": ODD}[shape]
  text = _lower(name, sh, platform)
  assert "attnx_pallas_rows_fwd" in text
  lowering.custom_calls(text, PLATFORMS[platform][1], lowering.expected_kernels(
      platform, sh.dtype, sh.h, sh.hv, wlib.get_weighting(name).stream.family))


def test_tile_rules_are_the_pointwise_ones():
  q = jnp.zeros((1, 8, 1, 8))
  w = wlib.get_weighting("stick_breaking")
  with pytest.raises(ValueError, match="power-of-2.*e.g. 16"):
    pa.pallas_attention(q, q, q, weighting=w, scale=1.0, block_q=24, backend="gpu",
                        interpret=True)
  with pytest.raises(ValueError, match="at least 16"):
    pa.pallas_attention(q, q, q, weighting=w, scale=1.0, block_k=8, backend="gpu",
                        interpret=True)
  with pytest.raises(ValueError, match="multiple of 128"):
    pa.pallas_attention(q, q, q, weighting=w, scale=1.0, block_k=64, backend="tpu",
                        interpret=True)
  with pytest.raises(ValueError, match="multiple of 16"):
    pa.pallas_attention(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16), q.astype(jnp.bfloat16),
                        weighting=w, scale=1.0, block_q=8, backend="tpu", interpret=True)
  with pytest.raises(ValueError, match="power-of-2"):  # the dispatcher checks the same rules
    core.attention(q, q, q, weighting="sparsemax",
                   implementation=core.Pallas(block_k=48, interpret=True))


def test_support_and_the_automatic_choice():
  stream_less = wlib.RowNormalizer(name="rows", fn=lambda s, w, ax: jax.nn.softmax(s, axis=ax))
  assert "implementation='dense'" in pa.supported(stream_less, backend="gpu")
  with pytest.raises(ValueError, match="no streaming form"):
    pa.pallas_attention(jnp.zeros((1, 8, 1, 8)), jnp.zeros((1, 8, 1, 8)),
                        jnp.zeros((1, 8, 1, 8)), weighting=stream_less, scale=1.0,
                        interpret=True)
  for name in BASE:
    for be in pa.BACKENDS:
      assert pa.supported(wlib.get_weighting(name), backend=be) is None, (name, be)
    # implementation=None picks the row kernels on a GPU once verified, never on a TPU (whole
    # sequences in VMEM: explicit "pallas" only), even where they pass the verification.
    pa.clear_verifications()
    for be in pa.BACKENDS:
      assert pa.verify_pallas(name, jnp.float32, 64, backend=be, check_fn=lambda *a: None)
    assert pa.choose_pallas("gpu", wlib.get_weighting(name), jnp.float32, 64)
    assert "GPU only" in pa.decline_reason("tpu", wlib.get_weighting(name), jnp.float32, 64)
  pa.clear_verifications()
  # The TPU kernels hold whole sequences in VMEM: too long a sequence is a clear error.
  big = jax.ShapeDtypeStruct((1, 65536, 1, 256), jnp.float32)
  with pytest.raises(ValueError, match="VMEM.*implementation='blocked'"):
    jax.eval_shape(lambda q: pa.pallas_attention(q, q, q, weighting=wlib.get_weighting("ssmax"),
                                                 scale=1.0, backend="tpu"), big)


def test_dispatch_runs_the_row_kernels():
  q, k, v, bias, mask, _ = _inputs("full")
  jaxpr = str(jax.make_jaxpr(lambda q: core.attention(
      q, k, v, bias, mask, weighting="softpick",
      implementation=core.Pallas(interpret=True)))(q))
  assert "attnx_pallas_rows_fwd" in jaxpr
  jaxpr = str(jax.make_jaxpr(lambda q: core.attention(
      q, k, v, bias, mask, weighting="softpick"))(q))
  assert "pallas_call" not in jaxpr  # the automatic choice does not pick Pallas for rows


# --------------------------------------------------------------------------------------------
# The spellings of streaming.Ops the kernels use, against the XLA ones (plain XLA, no Pallas).
# --------------------------------------------------------------------------------------------

def _ops_results(name, ops):
  rng = np.random.default_rng(3)
  rows, keys, tile = 6, 40, 16
  z = (2.0 * rng.standard_normal((rows, keys))).astype(np.float32)
  z[1, :5] = [0.0, -0.0, 1e-9, -1e-9, 85.0]  # expm1 near 0, past its exact range
  valid = rng.random((rows, keys)) < 0.8
  valid[2] = False
  v = rng.standard_normal((keys, 3)).astype(np.float32)
  dp = rng.standard_normal((rows, keys)).astype(np.float32)
  rs = wlib.get_weighting(name).stream
  spans = [(a, min(a + tile, keys)) for a in range(0, keys, tile)]
  order = spans[::-1] if rs.reverse else spans
  c = jnp.full((rows,), 1.3, jnp.float32)

  def tile_pass(fn, init):
    for a, b in spans:
      init = fn(init, z[:, a:b], valid[:, a:b])
    return init

  ctx = c if rs.needs_row_scale else None
  if rs.needs_threshold:
    ctx = streaming.entmax_threshold(tile_pass, (rows,), rs, ops)
  state = streaming.init(rs, (rows,), 3)
  for a, b in order:
    state = streaming.update(rs, state, z[:, a:b], valid[:, a:b], v[a:b], ctx, ops)
  out, stats, _ = streaming.finalize(rs, state, ctx)
  delta = jnp.sum(out, axis=-1)
  carry = streaming.GradCarry(jnp.zeros((rows,)), jnp.zeros((rows,)))
  dzs = []
  for a, b in order:
    _, dz, carry = streaming.tile_grad(rs, z[:, a:b], valid[:, a:b], dp[:, a:b], stats, delta,
                                       carry, c, ops)
    dzs.append(dz)
  return [np.asarray(x) for x in (out, *stats, *dzs, *carry)]


@pytest.mark.parametrize("backend", pa.BACKENDS)
@pytest.mark.parametrize("name", ["softpick", "stick_breaking", "sparsemax", "entmax15",
                                  "entmax:alpha=1.3"])
def test_kernel_ops_agree_with_xla_ops(name, backend):
  ops = triton_rows.OPS if backend == "gpu" else mosaic_rows.OPS
  for got, want in zip(_ops_results(name, ops), _ops_results(name, streaming.XLA), strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * max(1.0, np.max(np.abs(want))))


def test_softpick_scaled_expm1_matches_float64():
  # e^{−c}(eᶻ − 1) from one exponential: Taylor below |z| = 1/8, a difference above, for the
  # shifts the kernels use (the running max m ≥ max(0, z) and lse ≥ log ε).
  x = np.asarray([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 0.1249, -0.1249, 0.125, -0.125, 0.3,
                  -0.3, 5.0, -20.0, -200.0, 80.0, 95.0], np.float32)
  for c in (-13.8, 0.0, 5.0, 95.0, 300.0):
    z = x[x <= max(c, 0.0)] if c >= 0 else x[np.abs(x) < 1]
    zj = jnp.asarray(z)
    got = streaming.softpick.scaled_expm1(zj, jnp.exp(zj - c), jnp.exp(jnp.float32(-c)))
    want = np.exp(-c) * np.expm1(z.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-37, err_msg=f"c = {c}")
    normal = np.abs(want) > 1e-30  # e^{−95} and below are float32 subnormals
    np.testing.assert_array_equal(np.signbit(np.asarray(got)[normal]), np.signbit(want[normal]))
  assert np.isnan(streaming.softpick.scaled_expm1(jnp.float32(np.nan), jnp.float32(np.nan), 1.0))


def test_comparison_sign_matches_xla():
  x = jnp.asarray([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 0.3, -0.3, 5.0, -20.0, -200.0, 80.0,
                   np.nan], jnp.float32)
  rs = wlib.get_weighting("softpick").stream
  z = x[None, :-1]
  ok = jnp.ones(z.shape, bool)
  args = (rs, z, ok, jnp.ones_like(z), (jnp.asarray([1.0]),), jnp.asarray([0.5]),
          streaming.GradCarry(jnp.zeros(1), jnp.zeros(1)), None)
  a = streaming.tile_grad(*args, streaming.Ops(sign=False))[1]
  b = streaming.tile_grad(*args)[1]
  np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
  np.testing.assert_allclose(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["stick_breaking"])
def test_self_check_compares_the_row_kernels_with_blocked(name):
  # What implementation=None runs on a GPU before choosing a row kernel (here the GPU kernels
  # in the interpreter): it passes for the real kernel and names a wrong one.
  w = wlib.get_weighting(name)
  assert pa.self_check("gpu", w, "float32", 16, interpret=True) is None
  wrong = lambda q, k, v, **kw: 0.5 * pa.pallas_attention(q, k, v, **kw)
  assert "output differs" in pa.self_check("gpu", w, "float32", 16, kernel=wrong,
                                           interpret=True)
