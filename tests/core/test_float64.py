"""Float64 inputs (``jax_enable_x64``): every implementation computes in float64 or refuses.

The contract (:mod:`attnx.core.contract`, "Precision"): the kernels compute in
max(float32, the input dtype). With x64 enabled, float64 inputs run in float64 in the dense and
blocked kernels (pointwise and whole-row) and the ring's blocked steps; the Pallas kernels have
no float64 form and ``implementation="pallas"`` raises a ValueError naming float64 and the
alternative. Before, the blocked kernels and the dense whole-row weightings
(attnx.core.weightings.rownorm and .simplex) computed float64 inputs in float32 (1e-7 from a
float64 reference, dense pointwise 5e-16).

The references are float64 brute force in jax.numpy: the T×S scores, the weighting's weights
written out, the weighted sum, and jax.grad through that. x64 is switched on only inside each
test (``jax.enable_x64`` is a context manager), so the flag cannot leak into other tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core.parallel import ring

# Float64 results against the float64 brute force: summing a few dozen O(1) terms leaves
# ~1e-15; 1e-12 is far below float32's 1e-7 and above any float64 ordering difference.
TOL = 1e-12

B, T, S, N, K, H = 2, 40, 56, 4, 2, 16  # GQA (2 query heads per kv head), ragged tiles of 16
BLOCKED = core.Blocked(block_q=16, block_k=16)


def _inputs(seed=0, t=T, s=S, n=N, kv=K, h=H, dtype=np.float64):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, t, n, h))
  k = rng.standard_normal((B, s, kv, h))
  v = rng.standard_normal((B, s, kv, h))
  g = rng.standard_normal((B, t, n, h))
  return tuple(jnp.asarray(x.astype(dtype)) for x in (q, k, v, g))


def _scores(q, k):
  """[B, N, T, S] float64 scores q·k/√H (kv heads repeated for GQA)."""
  k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
  return jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])


def _sparsemax(z):
  """Sparsemax along the last axis (Martins & Astudillo 2016), by sorting."""
  zs = -jnp.sort(-z, axis=-1)
  cs = jnp.cumsum(zs, axis=-1)
  r = jnp.arange(1, z.shape[-1] + 1, dtype=z.dtype)
  support = 1 + r * zs > cs
  kz = jnp.sum(support, axis=-1, keepdims=True)
  tau = (jnp.take_along_axis(cs, kz - 1, axis=-1) - 1) / kz
  return jnp.maximum(z - tau, 0.0)


def _entmax15(z):
  """1.5-entmax along the last axis by sorting (Peters et al. 2019, Algorithm 2)."""
  zh = (z - jax.lax.stop_gradient(jnp.max(z, -1, keepdims=True))) / 2  # shift invariant
  zs = -jnp.sort(-zh, axis=-1)
  r = jnp.arange(1, z.shape[-1] + 1, dtype=z.dtype)
  mean = jnp.cumsum(zs, -1) / r
  ss = r * (jnp.cumsum(zs * zs, -1) / r - mean * mean)  # Σ_{top r} (z/2 − mean)²
  d = (1 - ss) / r
  tau = mean - jnp.where(d > 0, jnp.sqrt(jnp.where(d > 0, d, 1.0)), 0.0)  # grads finite at d ≤ 0
  kz = jnp.sum(tau <= zs, axis=-1, keepdims=True)
  return jnp.maximum(zh - jnp.take_along_axis(tau, kz - 1, axis=-1), 0.0) ** 2


def _entmax(z, alpha):
  """α-entmax [(α−1)z − τ]₊^{1/(α−1)} along the last axis: τ by 200 bisection steps (to the
  last bit), then one Newton step on Σp = 1, which gives dτ/dz = −f_z/f_τ (implicit function
  theorem) to autodiff."""
  am1 = alpha - 1.0
  x = am1 * (z - jax.lax.stop_gradient(jnp.max(z, -1, keepdims=True)))  # max 0
  power = lambda tau, e: jnp.maximum(x - tau, 0.0) ** e
  lo = jnp.full(x.shape[:-1] + (1,), -1.0, x.dtype)  # Σp ≥ 1 (the max alone gives 1)
  hi = jnp.full_like(lo, -float(z.shape[-1]) ** -am1)  # every p ≤ 1/n: Σp ≤ 1

  def bisect(_, c):
    lo, hi = c
    mid = (lo + hi) / 2
    big = jnp.sum(power(mid, 1 / am1), -1, keepdims=True) >= 1
    return jnp.where(big, mid, lo), jnp.where(big, hi, mid)

  lo, hi = jax.lax.fori_loop(0, 200, bisect, (lo, hi))
  tau0 = jax.lax.stop_gradient((lo + hi) / 2)
  f = jnp.sum(power(tau0, 1 / am1), -1, keepdims=True) - 1
  tau = tau0 + f / (jnp.sum(power(tau0, 1 / am1 - 1), -1, keepdims=True) / am1)
  return power(tau, 1 / am1)


def _stick_breaking(z, valid):
  """A_j = σ(z_j) · Π_{l > j valid} (1 − σ(z_l)): the later keys break the stick first."""
  log_rest = jnp.where(valid, jax.nn.log_sigmoid(-z), 0.0)  # log(1 − σ(z))
  later = jnp.flip(jnp.cumsum(jnp.flip(log_rest, -1), -1), -1) - log_rest  # Σ_{l > j}
  return jnp.where(valid, jnp.exp(jax.nn.log_sigmoid(z) + later), 0.0)


def _below_support(s, valid):
  """s with masked entries 10 below the row's smallest valid score: outside the support of
  sparsemax and entmax (α ≥ 1.3), whose thresholds lie at most 1/(α − 1) below the max."""
  low = jnp.min(jnp.where(valid, s, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(valid, s, jax.lax.stop_gradient(low) - 10.0)


def _weights(name, s, valid, ssmax_s=None):
  """The [B, N, T, S] weights of ``name`` on float64 scores, written out (every row has a valid
  key); ``ssmax_s`` is SSMax's s per head [N] (default 1)."""
  n_valid = jnp.sum(valid, axis=-1, keepdims=True)
  if name == "softmax":
    z = jnp.where(valid, s, -jnp.inf)
    e = jnp.where(valid, jnp.exp(z - jnp.max(z, -1, keepdims=True)), 0.0)
    return e / jnp.sum(e, -1, keepdims=True)
  if name in ("relu", "sigmoid"):
    f = jnp.where(valid, jax.nn.relu(s) if name == "relu" else jax.nn.sigmoid(s), 0.0)
    den = jnp.sum(f, -1, keepdims=True)
    return f / jnp.where(den == 0, 1.0, den)
  if name == "ssmax":  # softmax of (s·log n)·z (Nakanishi 2025)
    c = jnp.log(n_valid.astype(s.dtype))
    if ssmax_s is not None:
      c = ssmax_s[:, None, None] * c
    return jax.nn.softmax(jnp.where(valid, c * s, -jnp.inf), axis=-1)
  if name == "softpick":  # relu(eᶻ − 1)/(Σ|eᶻ − 1| + 1e-6) (Zuhri et al. 2025)
    d = jnp.where(valid, jnp.expm1(s), 0.0)
    return jax.nn.relu(d) / (jnp.sum(jnp.abs(d), -1, keepdims=True) + 1e-6)
  if name == "stick_breaking":
    return _stick_breaking(s, valid)
  z = _below_support(s, valid)
  if name == "sparsemax":
    return _sparsemax(z)
  if name == "entmax15":
    return _entmax15(z)
  if name == "entmax:alpha=1.3":
    return _entmax(z, 1.3)
  raise ValueError(name)


def _reference(name, q, k, v, is_causal=False, mask=None, ssmax_s=None):
  s = _scores(q, k)
  valid = jnp.ones(s.shape, bool)
  if mask is not None:
    valid = valid & mask
  if is_causal:
    valid = valid & jnp.tril(jnp.ones(s.shape[-2:], bool))
  w = _weights(name, s, valid, ssmax_s)
  v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
  return jnp.einsum("bnts,bsnh->btnh", w, v)


def _value_and_grads(fn, q, k, v, g):
  """(out, dq, dk, dv) of ``fn`` with the loss Σ out·g."""
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(g))


def _assert_close(got, ref, what):
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
    assert a.dtype == jnp.float64, f"{what} {name}: {a.dtype}"
    err = float(jnp.max(jnp.abs(a - b)))
    scale = max(1.0, float(jnp.max(jnp.abs(b))))
    assert err <= TOL * scale, f"{what} {name}: max |got − ref| = {err:.3g}"


POINTWISE_CASES = [("softmax", {}), ("softmax", {"is_causal": True}), ("softmax", {"mask": 1}),
                   ("relu", {}), ("relu", {"is_causal": True}), ("sigmoid", {}),
                   ("sigmoid", {"mask": 1})]


@pytest.mark.parametrize("weighting,kw", POINTWISE_CASES)
@pytest.mark.split_by_jax
def test_blocked_pointwise_computes_in_float64(weighting, kw):
  with jax.enable_x64(True):
    q, k, v, g = _inputs()
    mask = None
    if kw.get("mask"):
      rng = np.random.default_rng(1)
      mask = jnp.asarray(rng.uniform(size=(B, 1, T, S)) > 0.3)
    causal = kw.get("is_causal", False)
    got = _value_and_grads(
        lambda q, k, v: core.attention(q, k, v, mask=mask, weighting=weighting,
                                       is_causal=causal, implementation=BLOCKED),
        q, k, v, g)
    ref = _value_and_grads(lambda q, k, v: _reference(weighting, q, k, v, causal, mask),
                           q, k, v, g)
    _assert_close(got, ref, f"blocked {weighting} {kw}")


@pytest.mark.parametrize("weighting", ["ssmax", "sparsemax", "stick_breaking"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "zerobias"])
@pytest.mark.split_by_jax
def test_blocked_whole_row_computes_in_float64(weighting, bias):
  # A (zero) bias sends SSMax through the whole-row kernel (attnx.core.kernels.xla.rows) instead of
  # the pointwise kernel's softmax of (c_i·q_i)·k; the other two always run it.
  with jax.enable_x64(True):
    q, k, v, g = _inputs(seed=2)
    b = jnp.zeros((1, 1, T, S), jnp.float64) if bias else None
    got = _value_and_grads(
        lambda q, k, v: core.attention(q, k, v, b, weighting=weighting,
                                       implementation=BLOCKED), q, k, v, g)
    ref = _value_and_grads(lambda q, k, v: _reference(weighting, q, k, v), q, k, v, g)
    _assert_close(got, ref, f"blocked {weighting} bias={bias}")


def test_blocked_tokamax_case_float64():
  # Inputs uniform in [1, 2): scores ≈ 20, where float32's lse is off by 2⁻²⁰ relative.
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.uniform(1, 2, (2, n, 2, 64))) for n in (256, 8, 8))
    g = jnp.asarray(rng.standard_normal((2, 256, 2, 64)))
    got = _value_and_grads(lambda q, k, v: core.attention(q, k, v, implementation="blocked"),
                           q, k, v, g)
    ref = _value_and_grads(lambda q, k, v: _reference("softmax", q, k, v), q, k, v, g)
    _assert_close(got, ref, "blocked tokamax case")


def test_float32_inputs_unchanged_under_x64():
  # The flag alone changes nothing for float32 inputs: float32 out, the same numbers.
  q, k, v, g = _inputs(dtype=np.float32)
  fn = lambda q, k, v: core.attention(q, k, v, implementation=BLOCKED, is_causal=True)
  want = _value_and_grads(fn, q, k, v, g)
  with jax.enable_x64(True):
    got = _value_and_grads(fn, q, k, v, g)
  for a, b in zip(got, want, strict=True):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("interpret", [False, True])
def test_pallas_refuses_float64(interpret):
  with jax.enable_x64(True):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"float64.*implementation='blocked'"):
      core.attention(q, k, v, implementation=core.Pallas(interpret=interpret))
    # On a GPU or TPU too: Pallas cannot run it, so the automatic choice never takes it.
    problem = core.explain(q, k, v).problem
    pallas = core.Pallas(interpret=interpret)
    for platform in ("gpu", "tpu"):
      reason = pallas.supports(dataclasses.replace(problem, platform=platform))
      assert reason is not None and "float64" in reason, (platform, reason)


@pytest.mark.parametrize("t,chosen", [(T, "dense"), (512, "blocked")])
def test_automatic_choice_computes_in_float64(t, chosen):
  # Small problems run dense, from BLOCKED_MIN_SCORES = 512² score entries per head blocked.
  with jax.enable_x64(True):
    q, k, v, g = _inputs(seed=3, t=t, s=t, n=1, kv=1, h=8)
    assert core.explain(q, k, v).chosen == chosen
    got = _value_and_grads(lambda q, k, v: core.attention(q, k, v), q, k, v, g)
    ref = _value_and_grads(lambda q, k, v: _reference("softmax", q, k, v), q, k, v, g)
    _assert_close(got, ref, f"auto ({chosen})")


@pytest.mark.parametrize("weighting", ["softmax", "ssmax", "stick_breaking"])
@pytest.mark.split_by_jax
def test_ring_blocked_steps_compute_in_float64(weighting):
  # A ring of one device: its blocked steps, merges and carries in float64.
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  with jax.enable_x64(True):
    q, k, v, g = _inputs(seed=4, t=32, s=32, n=2, kv=1, h=8)
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    fn = jax.shard_map(
        lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", weighting=weighting,
                                            implementation="blocked"),
        mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
    got = _value_and_grads(fn, q, k, v, g)
    ref = _value_and_grads(lambda q, k, v: _reference(weighting, q, k, v), q, k, v, g)
    _assert_close(got, ref, f"ring {weighting}")


# The last by bisection (attnx.core.weightings.simplex.entmax_bisect).
WHOLE_ROW = ["ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15",
             "entmax:alpha=1.3"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("weighting", WHOLE_ROW)
def test_dense_whole_row_computes_in_float64(weighting, causal):
  # attnx.core.weightings.rownorm and .simplex: before, float32 inside (5e-8 from float64).
  with jax.enable_x64(True):
    q, k, v, g = _inputs(seed=5)
    got = _value_and_grads(
        lambda q, k, v: core.attention(q, k, v, weighting=weighting, is_causal=causal,
                                       implementation="dense"), q, k, v, g)
    ref = _value_and_grads(lambda q, k, v: _reference(weighting, q, k, v, causal), q, k, v, g)
    _assert_close(got, ref, f"dense {weighting} causal={causal}")


def test_dense_ssmax_learned_s_float64():
  # weighting_params={"s": ...} in float64 stays float64 (the dispatcher used to round it to
  # float32), and so does its gradient.
  with jax.enable_x64(True):
    q, k, v, g = _inputs(seed=6)
    s = jnp.asarray([0.3, 0.7, 1.1, 1.7])  # not float32 numbers

    def got_fn(q, k, v, s):
      return core.attention(q, k, v, weighting="ssmax", is_causal=True, implementation="dense",
                            weighting_params={"s": s})

    got, vjp = jax.vjp(got_fn, q, k, v, s)
    ref, ref_vjp = jax.vjp(lambda q, k, v, s: _reference("ssmax", q, k, v, True, ssmax_s=s),
                           q, k, v, s)
    grads, ref_grads = vjp(g), ref_vjp(g)
    _assert_close((got, *grads[:3]), (ref, *ref_grads[:3]), "dense ssmax learned s")
    assert grads[3].dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(grads[3]), np.asarray(ref_grads[3]), rtol=0,
                               atol=TOL * max(1.0, float(jnp.max(jnp.abs(ref_grads[3])))))


def test_entmax_bisect_steps_follow_the_dtype():
  # n_iter=None (the default) is 30 steps in float32, as before, and 59 in float64.
  from attnx.core.weightings import simplex  # noqa: PLC0415

  x = np.random.default_rng(7).standard_normal((4, 33)) * 3
  for dt in (jnp.float32, jnp.bfloat16):
    xa = jnp.asarray(x, dt)
    np.testing.assert_array_equal(simplex.entmax_bisect(xa, alpha=1.3),
                                  simplex.entmax_bisect(xa, alpha=1.3, n_iter=30))
  assert simplex.default_n_iter(jnp.float32) == 30
  with jax.enable_x64(True):
    assert simplex.default_n_iter(jnp.float64) == 59
    x64 = jnp.asarray(x)
    np.testing.assert_array_equal(simplex.entmax_bisect(x64, alpha=1.3),
                                  simplex.entmax_bisect(x64, alpha=1.3, n_iter=59))
    # 30 steps leave 2e-10 (float32 resolution), the default rounding only (3e-15; 50 steps
    # already reach it).
    want = _entmax(x64, 1.3)
    err = lambda n: float(jnp.max(jnp.abs(simplex.entmax_bisect(x64, alpha=1.3, n_iter=n)
                                          - want)))
    assert err(None) < 1e-14 and err(30) > 1e-12
