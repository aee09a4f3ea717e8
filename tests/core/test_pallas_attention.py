"""attnx.core.kernels.pallas: values and gradients in Pallas' interpreter against the dense
reference, the API's errors and rules, and the automatic choice with its self-check.

Interpret mode compiles a large program per case (≈ 4 s on one core), so the default run
samples the combinations (every normalization, online max with and without offset, the
distance kernels, a user F, bf16, causal/mask/bias/lengths/GQA/ragged T, both backends); the
exhaustive sweep (every pointwise weighting × both backends) is marked `exhaustive` (deselected by
default; run it with `-m exhaustive`).
"""

import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import weightings as wlib
from attnx.core.kernels import pallas as pa
from attnx.core.kernels.pallas import tiles as pallas_tiles
from attnx.core.kernels.xla.pointwise import blocked_attention
from attnx.core.scores import get_score

POINTWISE = wlib.list_weightings("pointwise")
VARIANTS = ["relu:normalization=length", "sigmoid:normalization=none",
            "gaussian:normalization=none", "softmax:alpha=0.5", "power:p=0.5"]
# Tolerances: max |pallas − dense| ≤ TOL · max(1, max |dense|), per output and gradient
# (measured: ≤ 3.2e-6 in float32, ≤ 7.4e-3 in bfloat16, where both round P to bfloat16).
TOL = {"float32": 5e-5, "bfloat16": 2e-2}
BLOCKS = {"gpu": (16, 32), "tpu": (8, 128)}  # several query and key tiles at these sizes


def _bandwidth(name: str, head_dim: int) -> str:
  """Distance kernels with h = √(2H) (the typical distance of two N(0, I) vectors), so that
  compactly supported kernels see about half of the keys."""
  w = wlib.get_weighting(name)
  if not w.distance_kernel or "h=" in name:
    return name
  return f"{name}{',' if ':' in name else ':'}h={np.sqrt(2.0 * head_dim):.3g}"


def _inputs(b=2, t=37, s=53, n=4, kh=2, h=8, seed=0, bias_shape=(1, 4, 37, 53),
            mask_shape=(2, 1, 37, 53), hv=None):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  hv = hv or h
  q, k, v = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, hv)
  bias = None if bias_shape is None else normal(*bias_shape)
  mask = None
  if mask_shape is not None:
    mask = rng.random(mask_shape) < 0.7
    mask[(0,) * (len(mask_shape) - 2) + (min(3, mask_shape[-2] - 1),)] = False  # an empty row
  return q, k, v, bias, mask, normal(b, t, n, hv)


def _lengths_mask(b, t, s, q_lengths, kv_lengths):
  rows = np.arange(t)[None, :, None] < np.asarray(q_lengths)[:, None, None]
  cols = np.arange(s)[None, None, :] < np.asarray(kv_lengths)[:, None, None]
  return (rows & cols)[:, None]


def _compare(case: dict, backend: str, dtype=jnp.float32):
  """Output and VJP (q, k, v[, bias]) of pallas (interpret) vs the dense implementation."""
  name = case["weighting"]
  t, s = case.get("t", 37), case.get("s", 53)
  b, n, kh, h = 2, case.get("n", 4), case.get("kh", 2), case.get("h", 8)
  bias_shape = case.get("bias_shape", (1, n, t, s))
  q, k, v, bias, mask, ct = _inputs(b, t, s, n, kh, h, case.get("seed", 0), bias_shape,
                                    case.get("mask_shape", (b, 1, t, s)), case.get("hv"))
  w = wlib.get_weighting(name)
  distance = not callable(name) and w.distance_kernel
  score = "neg_sq_dist" if distance else "scaled_dot"
  scale = 1.0 if distance else 0.35
  causal = case.get("causal", False)
  ql, kl = case.get("q_lengths"), case.get("kv_lengths")
  ref_mask = mask
  if ql is not None or kl is not None:
    lm = _lengths_mask(b, t, s, [t] * b if ql is None else ql, [s] * b if kl is None else kl)
    ref_mask = lm if mask is None else (mask & lm)
  bq, bk = BLOCKS[backend]
  if dtype == jnp.bfloat16 and backend == "tpu":
    bq = 16

  def f_pallas(q, k, v, bias):
    qd, kd = get_score(score).to_dot(q, k)
    return pa.pallas_attention(
        qd.astype(q.dtype), kd.astype(q.dtype), v, weighting=w, scale=scale, bias=bias,
        mask=mask, is_causal=causal, q_lengths=None if ql is None else jnp.asarray(ql),
        kv_lengths=None if kl is None else jnp.asarray(kl), block_q=bq, block_k=bk,
        backend=backend, interpret=True)

  def f_dense(q, k, v, bias):
    return core.attention(q, k, v, bias, ref_mask, weighting=w, score=score, scale=scale,
                          is_causal=causal, implementation="dense")

  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  args.append(None if bias is None else jnp.asarray(bias))
  results = []
  for f in (f_pallas, f_dense):
    out, vjp = jax.vjp(jax.jit(f), *args)
    results.append([out, *vjp(jnp.asarray(ct, dtype))])
  tol = TOL[jnp.dtype(dtype).name]
  labels = ["out", "dq", "dk", "dv", "dbias"]
  for label, got, want in zip(labels, *results, strict=False):
    if want is None:
      continue
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, label
    assert np.all(np.isfinite(got)), label
    bound = tol * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= bound, f"{label}: max abs error {err:.3g} > {bound:.3g}"
  return results


def _user_f(z):
  return jnp.exp(-0.5 * z * z) + 0.1


# Sampled cases (each compiles fwd + bwd in the interpreter). Every case has GQA (N = 4,
# K = 2), T ≠ S and ragged T, S (not multiples of the tiles).
CASES = [
    ("gpu", jnp.float32, dict(weighting="softmax", causal=True)),  # causal + mask + bias
    ("gpu", jnp.float32, dict(weighting="softmax_plus_one", q_lengths=[30, 37],
                              kv_lengths=[53, 20], mask_shape=None)),
    # Head dims 40 and 80: GPU chunks 32 + 16 and 64 + 16.
    ("gpu", jnp.float32, dict(weighting="relu", bias_shape=(2, 1, 1, 53), h=40, hv=80)),
    ("gpu", jnp.float32, dict(weighting="relu:normalization=length", causal=True,
                              bias_shape=None)),
    ("gpu", jnp.float32, dict(weighting="sigmoid:normalization=none", kv_lengths=[40, 53],
                              bias_shape=(1, 1, 37, 1))),
    ("gpu", jnp.float32, dict(weighting="power:p=3", causal=True, t=70, s=40,
                              bias_shape=None, mask_shape=None)),
    ("gpu", jnp.float32, dict(weighting="triangular:normalization=none", h=6)),
    ("gpu", jnp.float32, dict(weighting=_user_f, mask_shape=(37, 53))),
    ("gpu", jnp.bfloat16, dict(weighting="softmax", causal=True, bias_shape=None)),
    # float32 at head dims 72 / 40 (padded 80: the tier whose dK and dV run as two passes).
    ("gpu", jnp.float32, dict(weighting="sigmoid", causal=True, h=72, hv=40)),
    ("tpu", jnp.float32, dict(weighting="softmax", causal=True, s=150)),
    ("tpu", jnp.float32, dict(weighting="gaussian", kv_lengths=[150, 90], s=150, h=6,
                              bias_shape=(2, 4, 1, 150), mask_shape=None)),
    ("tpu", jnp.bfloat16, dict(weighting="elu_plus_one", causal=True, s=150,
                               bias_shape=None, mask_shape=(1, 4, 37, 150))),
]


def _case_id(c):
  backend, dtype, case = c
  name = case["weighting"] if isinstance(case["weighting"], str) else "user_F"
  return f"{backend}-{jnp.dtype(dtype).name}-{name}"


@pytest.mark.parametrize("backend,dtype,case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.split_by_jax
def test_matches_dense_values_and_gradients(backend, dtype, case):
  case = dict(case)
  if isinstance(case["weighting"], str):
    case["weighting"] = _bandwidth(case["weighting"], case.get("h", 8))
  _compare(case, backend, dtype)


@pytest.mark.exhaustive
@pytest.mark.parametrize("backend", pa.BACKENDS)
@pytest.mark.parametrize("name", POINTWISE + VARIANTS)
def test_every_weighting_matches_dense(backend, name):
  _compare(dict(weighting=_bandwidth(name, 8), causal=True, s=150), backend)


def test_edge_case_contract():
  """As the dense path: masked NaN/Inf keys do not reach the output; a row without a valid key
  is zero with zero gradients; T = 0 and S = 0."""
  q, k, v, _, mask, ct = _inputs(2, 20, 40, 2, 1, 8, bias_shape=None, mask_shape=(2, 1, 20, 40))
  mask[1, :, 3] = False  # row 3 of batch 1 has no valid key
  mask[0, ..., 5] = False  # key 5 of batch 0 is masked everywhere ...
  k[0, 5], v[0, 5] = np.nan, np.inf  # ... so its NaN/Inf must not reach any output
  w = wlib.get_weighting("softmax")
  f = jax.jit(lambda q, k, v: pa.pallas_attention(
      q, k, v, weighting=w, scale=0.3, mask=mask, block_q=16, block_k=16, interpret=True))
  dense = lambda q, k, v: core.attention(q, k, v, mask=mask, scale=0.3, implementation="dense")
  got, want = ([out, *vjp(jnp.asarray(ct))] for out, vjp in (jax.vjp(fn, q, k, v)
                                                              for fn in (f, dense)))
  for a, b in zip(got, want, strict=True):  # NaN where the dense gradients have NaN
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
  out, dq = np.asarray(got[0]), np.asarray(got[1])
  assert np.all(np.isfinite(out)) and np.all(out[1, 3] == 0) and np.all(dq[1, 3] == 0)
  assert np.all(np.isfinite(dq[1]))
  # T = 0 and S = 0 need no kernel: an empty output, and zeros with zero gradients.
  assert pa.pallas_attention(q[:, :0], k, v, weighting=w, scale=1.0, interpret=True).shape == (
      2, 0, 2, 8)
  g = jax.grad(lambda q: jnp.sum(pa.pallas_attention(q, k[:, :0], v[:, :0], weighting=w,
                                                     scale=1.0, interpret=True)))(q)
  assert not np.any(np.asarray(g))


def test_traced_scale_gets_a_gradient():
  q, k, v, *_ = _inputs(1, 16, 16, 2, 1, 8, bias_shape=None, mask_shape=None)
  w = wlib.get_weighting("sigmoid:normalization=none")

  def loss(scale, fn):
    return jnp.sum(fn(q, k, v, weighting=w, scale=scale) ** 2)

  pallas = functools.partial(pa.pallas_attention, interpret=True, block_q=16, block_k=16)
  got = jax.jit(jax.value_and_grad(lambda s: loss(s, pallas)))(jnp.float32(0.4))
  want = jax.value_and_grad(lambda s: loss(s, blocked_attention))(jnp.float32(0.4))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert abs(float(want[1])) > 1e-2


# --------------------------------------------------------------------------------------------
# Errors, support and tile rules (no compilation).
# --------------------------------------------------------------------------------------------

def test_cpu_needs_interpret_and_unsupported_combinations_name_the_alternative():
  q = jnp.zeros((1, 8, 2, 8))
  w = wlib.get_weighting("softmax")
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="interpret=True.*implementation='blocked'"):
      pa.pallas_attention(q, q, q, weighting=w, scale=1.0)
  # A whole-row weighting without a streaming family (the built-in ones all have one:
  # test_pallas_rows.py) runs dense only.
  stream_less = wlib.RowNormalizer(name="rows", fn=lambda s, w, ax: jax.nn.softmax(s, axis=ax))
  with pytest.raises(ValueError, match="implementation='dense'"):
    pa.pallas_attention(q, q, q, weighting=stream_less, scale=1.0)
  assert "implementation='dense'" in pa.supported(stream_less, backend="gpu")
  assert pa.supported(wlib.get_weighting("entmax15"), backend="gpu") is None
  assert "blocked" in pa.supported(w, backend="gpu", dtype=np.float64)
  assert "blocked" in pa.supported(w, backend="tpu", dtype=jnp.float16)
  assert pa.supported(w, backend="gpu", dtype=jnp.float16) is None
  assert "256" in pa.supported(w, backend="gpu", head_dim=300)
  assert pa.supported(w, backend="gpu", head_dim=256, value_head_dim=250) is None
  assert pa.supported(w, backend="tpu", head_dim=300) is None
  assert pa.supported(w, backend="gpu", dtype=jnp.bfloat16, head_dim=128) is None
  with pytest.raises(ValueError, match="Unknown Pallas backend"):
    pa.resolve_backend("metal")
  assert [pa.resolve_backend(b) for b in ("cuda", "rocm", "triton", "mosaic")] == [
      "gpu", "gpu", "gpu", "tpu"]
  with pytest.raises(ValueError, match="mask must be boolean"):
    pa.pallas_attention(q, q, q, weighting=w, scale=1.0, mask=jnp.ones((8, 8)), interpret=True)
  with pytest.raises(ValueError, match="does not broadcast"):
    pa.pallas_attention(q, q, q, weighting=w, scale=1.0, bias=jnp.ones((3, 8)), interpret=True)
  with pytest.raises(ValueError, match="kv_lengths must be an integer array"):
    pa.pallas_attention(q, q, q, weighting=w, scale=1.0, kv_lengths=jnp.ones((2,)),
                        interpret=True)
  with pytest.raises(ValueError, match="incompatible shapes"):
    pa.pallas_attention(q, q[:, :, :1, :4], q[:, :, :1], weighting=w, scale=1.0,
                        interpret=True)


def test_block_size_rules():
  with pytest.raises(ValueError, match="power-of-2.*e.g. 32"):
    pa.check_block_sizes("gpu", block_q=48)
  with pytest.raises(ValueError, match="at least 16"):
    pa.check_block_sizes("gpu", block_k=8)
  with pytest.raises(ValueError, match="multiple of 128"):
    pa.check_block_sizes("tpu", block_k=64)
  with pytest.raises(ValueError, match="multiple of 16"):
    pa.check_block_sizes("tpu", jnp.bfloat16, block_q=8)
  with pytest.raises(ValueError, match="positive int"):
    pa.check_block_sizes("tpu", block_q=0)
  pa.check_block_sizes("tpu", jnp.float32, block_q=8, block_k=384)
  pa.check_block_sizes("gpu", block_q=16, block_k=256)
  # Defaults, capped at the (aligned) sequence lengths; an override applies to every kernel.
  assert pa.default_block_sizes("gpu", 4096, 4096) == pa.BlockSizes(128, 32, 64, 16, 16, 32)
  assert pa.default_block_sizes("gpu", 37, 53, jnp.bfloat16) == pa.BlockSizes(64, 64, 64, 64,
                                                                              64, 64)
  assert pa.default_block_sizes("tpu", 4096, 4096) == pa.BlockSizes(256, 512, 256, 256, 256,
                                                                     256)
  assert pa.default_block_sizes("tpu", 37, 53, jnp.bfloat16) == pa.BlockSizes(
      48, 128, 48, 128, 48, 128)
  assert pa.default_block_sizes("gpu", 4096, 4096, block_q=32, block_k=128) == pa.BlockSizes(
      32, 128, 32, 128, 32, 128)
  # GPU tiles by dtype width and padded head size, per family where measured (no register
  # spills when compiled for an H100 and an A100: tests/experiments/test_kernel_compile.py; the
  # 16-bit dQ and dK/dV tiles up to H = 128 timed on an H100); an override still applies to
  # every kernel; warps come with the tiles.
  gpu = functools.partial(pa.default_block_sizes, "gpu", 4096, 4096)
  assert gpu(jnp.bfloat16, head_dim=64) == gpu(jnp.bfloat16) == pa.BlockSizes(128, 64, 64, 64,
                                                                              64, 64)
  assert gpu(jnp.float32, head_dim=64) == gpu() == pa.BlockSizes(128, 32, 64, 16, 16, 32)
  assert gpu(jnp.bfloat16, head_dim=128) == pa.BlockSizes(128, 32, 64, 32, 64, 64)
  assert gpu(jnp.bfloat16, head_dim=144) == gpu(jnp.bfloat16, head_dim=256) == pa.BlockSizes(
      64, 64, 64, 16, 16, 64)
  assert gpu(jnp.float32, head_dim=256) == pa.BlockSizes(32, 32, 16, 16, 16, 16)
  assert gpu(jnp.bfloat16, head_dim=128, family="entmax").block_q == 32
  assert gpu(jnp.bfloat16, head_dim=128, family="softpick") == pa.BlockSizes(64, 64, 64, 32, 64,
                                                                             64)
  assert gpu(jnp.bfloat16, head_dim=128, family="ssmax") == gpu(jnp.bfloat16, head_dim=128)
  stick = gpu(jnp.bfloat16, head_dim=128, family="stick_breaking")
  assert (stick.block_q_dq, stick.block_q_dkv, stick.block_k_dkv) == (32, 16, 32)
  assert pa.default_block_sizes("gpu", 20, 40, jnp.float32, head_dim=256,
                                family="entmax") == pa.BlockSizes(32, 32, 32, 16, 16, 16)
  # dK and dV in two passes where the fused one spilled: float32 above H = 64 only.
  assert [hp for hp in (64, 80, 128, 144, 256)
          if pallas_tiles.gpu_tiles(hp, None, jnp.float32).dkv.two_pass_dkv] == [80, 128, 144, 256]
  assert not any(pallas_tiles.gpu_tiles(hp, f, jnp.bfloat16).dkv.two_pass_dkv
                 for hp in (64, 128, 256) for f in (None, "entmax", "stick_breaking"))
  assert gpu(block_q=32, block_k=128, head_dim=256) == pa.BlockSizes(32, 128, 32, 128, 32, 128)
  for wide in (jnp.bfloat16, jnp.float32):  # every tier and family: warps of 4 or 8, tiles ≥ 16
    for hp in (16, 64, 80, 128, 144, 256):
      for family in (None, "entmax", "softpick", "ssmax", "stick_breaking"):
        t = pallas_tiles.gpu_tiles(hp, family, wide)
        assert {kernel.warps for kernel in t} <= {4, 8}
        pa.check_block_sizes("gpu", **dataclasses.asdict(t.block_sizes()))
  with pytest.raises(ValueError, match="power-of-2"):
    pa.pallas_attention(jnp.zeros((1, 8, 1, 8)), jnp.zeros((1, 8, 1, 8)),
                        jnp.zeros((1, 8, 1, 8)), weighting=wlib.get_weighting("relu"),
                        scale=1.0, block_q=24, backend="gpu", interpret=True)


@pytest.mark.parametrize("name", ["softmax", "entmax15", "stick_breaking"])
def test_two_pass_dkv_matches_the_fused_pass(monkeypatch, name):
  # The two passes (dK, then dV without V or dP) give the fused pass's dK and dV bit for bit,
  # pointwise and whole-row (sparsemax/entmax skip zero tiles in the fused pass only; stick-
  # breaking reads its carries in both); the names say which kernels ran.
  w = wlib.get_weighting(name)
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((1, 40, 4, 24), (1, 56, 2, 24), (1, 56, 2, 24)))
  tiles = pallas_tiles.gpu_tiles

  def grads(split: bool):
    monkeypatch.setattr(pallas_tiles, "gpu_tiles", lambda *a: tiles(*a)._replace(
        dkv=tiles(*a).dkv._replace(two_pass_dkv=split)))
    loss = lambda q, k, v: jnp.sum(jnp.square(pa.pallas_attention(
        q, k, v, weighting=w, scale=0.3, is_causal=True, block_q=16, block_k=16, backend="gpu",
        interpret=True)))
    g = jax.grad(loss, argnums=(0, 1, 2))
    jaxpr = str(jax.make_jaxpr(g)(q, k, v))
    names = set(re.findall(r"attnx_pallas(?:_rows)?_(dkv|dk|dv)\b", jaxpr))
    return names, g(q, k, v)

  (split_names, split), (fused_names, fused) = grads(True), grads(False)
  assert split_names == {"dk", "dv"} and fused_names == {"dkv"}
  for a, b in zip(split, fused, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------
# The verification (verify_pallas): self-check, one warning, cache; the automatic choice's
# policy (decline_reason / choose_pallas); explicit "pallas" never falls back.
# --------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _fresh_verifications():
  pa.clear_verifications()
  yield
  pa.clear_verifications()


def _warnings(caplog):
  return [r for r in caplog.records if r.levelno == logging.WARNING
          and "self-check failed" in r.getMessage()]


def test_verify_pallas_caches_and_warns_once(caplog):
  calls = []

  def ok(backend, w, dtype, head_dim):
    calls.append((backend, w.name, dtype, head_dim))

  def broken(backend, w, dtype, head_dim):
    calls.append("broken")
    raise RuntimeError("Mosaic failed to compile\nsecond line")

  softmax = lambda: wlib.get_weighting("softmax")  # new objects with equal math
  v = pa.verify_pallas(softmax(), jnp.bfloat16, 128, backend="gpu", check_fn=ok)
  assert v and v == pa.PallasVerification(ok=True, reason=None, backend="gpu",
                                          weighting="softmax", dtype="bfloat16", head_dim=128,
                                          checked=True)
  assert pa.verify_pallas("softmax", "bfloat16", 128, backend="cuda", check_fn=broken)  # cached
  assert pa.choose_pallas("gpu", softmax(), jnp.bfloat16, 128, check_fn=broken)
  assert calls == [("gpu", "softmax", "bfloat16", 128)]
  assert not _warnings(caplog)
  with caplog.at_level(logging.WARNING):
    for _ in range(3):
      v = pa.verify_pallas(softmax(), jnp.bfloat16, 128, backend="tpu", check_fn=broken)
      assert not v and v.checked and v.backend == "tpu"
      assert v.reason == "RuntimeError: Mosaic failed to compile"
      assert not pa.choose_pallas("tpu", softmax(), jnp.bfloat16, 128, check_fn=ok)
  assert calls.count("broken") == 1 and len(calls) == 2
  (rec,) = _warnings(caplog)
  msg = rec.getMessage()
  assert "backend=tpu, weighting=softmax, dtype=bfloat16, head_dim=128" in msg
  assert "RuntimeError: Mosaic failed to compile" in msg and "second line" not in msg
  assert "blocked" in msg
  # A reason returned (results differ) also fails, once; the choice's reason says so.
  with caplog.at_level(logging.WARNING):
    assert pa.decline_reason("gpu", softmax(), jnp.float32, 64,
                             check_fn=lambda *a: "off") == "the Pallas self-check failed: off"
    assert pa.verify_pallas(softmax(), jnp.float32, 64, backend="gpu", check_fn=ok).reason == "off"
  assert len(_warnings(caplog)) == 2
  # Forgetting the answers checks again.
  pa.clear_verifications()
  assert pa.verify_pallas(softmax(), jnp.float32, 64, backend="gpu", check_fn=ok)
  assert calls[-1] == ("gpu", "softmax", "float32", 64)


def test_unsupported_combinations_are_not_verified_nor_chosen(caplog):
  calls = []
  broken = lambda *a: calls.append(a) or "broken"
  softmax = wlib.get_weighting("softmax")
  stream_less = wlib.RowNormalizer(name="rows", fn=lambda s, w, ax: jax.nn.softmax(s, axis=ax))
  for args, kw, match in (
      ((stream_less, jnp.float32, 64), dict(backend="gpu"), "normalizes whole rows"),
      ((softmax, jnp.float16, 64), dict(backend="tpu"), "dtype float16"),
      ((softmax, jnp.float32, 64), dict(backend="gpu", value_head_dim=512), "value head dim"),
      ((softmax, jnp.float32, 64), dict(backend="cpu"), "Unknown Pallas backend 'cpu'"),
  ):
    v = pa.verify_pallas(*args, check_fn=broken, **kw)
    assert not v and not v.checked and match in v.reason, v
    assert not pa.choose_pallas(kw.pop("backend"), *args, check_fn=broken, **kw)
  if jax.default_backend() == "cpu":
    v = pa.verify_pallas(softmax, jnp.float32, 64, check_fn=broken)
    assert not v and v.backend is None and "needs a GPU or TPU" in v.reason
    assert not pa.choose_pallas(None, softmax, jnp.float32, 64, check_fn=broken)
  # Whole-row weightings: verified on a TPU too when asked, but never chosen there.
  sparsemax = wlib.get_weighting("sparsemax")
  assert pa.verify_pallas(sparsemax, jnp.float32, 64, backend="tpu", check_fn=lambda *a: None)
  assert "GPU only" in pa.decline_reason("tpu", sparsemax, jnp.float32, 64)
  assert calls == [] and not _warnings(caplog)


def test_weighting_key_separates_different_math():
  key = lambda name: pa.weighting_key(wlib.get_weighting(name))
  assert key("power:p=3") == key("power:p=3") and key("power:p=3") != key("power:p=2")
  assert key("sigmoid") != key("sigmoid:bias=1.0") and key("relu") != key("relu2")
  f1, f2 = (wlib.get_weighting(lambda z: z * z), wlib.get_weighting(lambda z: z * z * z))
  assert f1.name == f2.name and pa.weighting_key(f1) != pa.weighting_key(f2)


def _zeros_kernel(q, k, v, **kw):
  return jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)


def _failing_kernel(q, k, v, **kw):
  raise NotImplementedError("lowering rule for 'sort' is not implemented")


def test_self_check_falls_back_on_wrong_or_failing_kernels_also_under_jit(caplog):
  w = wlib.get_weighting("relu")
  wrong = functools.partial(pa.self_check, kernel=_zeros_kernel, interpret=True)
  assert "output differs from the blocked kernel" in wrong("gpu", w, "float32", 8)
  failing = functools.partial(pa.self_check, kernel=_failing_kernel, interpret=True)
  chosen = []

  def model(x):  # dispatch verifies while the caller's function is traced
    chosen.append(pa.verify_pallas(w, x.dtype, 8, backend="gpu", check_fn=wrong))
    chosen.append(pa.verify_pallas(w, x.dtype, 8, backend="tpu", check_fn=failing))
    return x

  with caplog.at_level(logging.WARNING):
    jaxpr = str(jax.make_jaxpr(model)(jnp.zeros(3)))
    jax.jit(model)(jnp.ones(4))  # retraced: answered from the cache
  assert [v.ok for v in chosen] == [False] * 4 and all(v.checked for v in chosen)
  assert "output differs" in chosen[0].reason and chosen[2] == chosen[0]
  assert "NotImplementedError: lowering rule for 'sort'" in chosen[1].reason
  # The checks ran their own programs eagerly: nothing of them is in the caller's.
  assert "pallas_call" not in jaxpr and "custom_vjp" not in jaxpr and "dot_general" not in jaxpr
  msgs = [r.getMessage() for r in _warnings(caplog)]
  assert len(msgs) == 2 and "output differs" in msgs[0]
  assert "NotImplementedError: lowering rule for 'sort'" in msgs[1]


def test_self_check_passes_for_the_real_kernel_and_explicit_pallas_never_falls_back():
  w = wlib.get_weighting("softmax_plus_one")
  check = functools.partial(pa.self_check, interpret=True)
  assert check("gpu", w, "float32", 8) is None
  assert not pa.verify_pallas(w, jnp.float32, 8, backend="gpu",
                              check_fn=lambda *a: "forced failure")
  # The cached failure does not affect an explicit call: the Pallas kernel still runs.
  q = jnp.zeros((1, 16, 2, 8))
  jaxpr = str(jax.make_jaxpr(lambda q: pa.pallas_attention(
      q, q, q, weighting=w, scale=1.0, backend="gpu", interpret=True))(q))
  assert "pallas_call" in jaxpr
