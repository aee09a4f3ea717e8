"""The threshold protocol of sparsemax/entmax over key chunks (attnx.core.thresholds): merged
chunk parts against one attention call over every key (float64: the definition), values and
gradients, on one device and over a mesh axis."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core

WEIGHTINGS = ("sparsemax", "entmax15", "entmax:alpha=1.3", "entmax:alpha=3",
              "entmax:alpha=1.7")


def _inputs(seed: int, s: int = 29, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.standard_normal((2, 3, 4, 8)), dtype)
  k = jnp.asarray(r.standard_normal((2, s, 2, 8)), dtype)
  v = jnp.asarray(r.standard_normal((2, s, 2, 8)), dtype)
  mask = r.random((2, 1, 3, s)) < 0.8
  mask[0, 0, 1] = False  # a row without a valid key
  bias = jnp.asarray(r.standard_normal((1, 4, 3, s)), dtype)
  ct = jnp.asarray(r.standard_normal((2, 3, 4, 8)), dtype)
  return q, k, v, jnp.asarray(mask), bias, ct


def _spans(s: int, parts: int, rng) -> list[tuple[int, int]]:
  cuts = np.sort(rng.choice(np.arange(1, s), parts - 1, replace=False))
  edges = [0, *cuts.tolist(), s]
  return list(zip(edges[:-1], edges[1:], strict=True))


def _protocol(q, k, v, mask, bias, spans, w, **kw):
  """The three steps over the chunks ``spans`` of the keys, in one process."""
  chunks = [(k[:, a:b], v[:, a:b], mask[..., a:b], bias[..., a:b]) for a, b in spans]
  stats = core.combine_threshold_stats(
      [core.threshold_stats(q, kc, bc, mc, weighting=w, **kw) for kc, _, mc, bc in chunks])

  def sums_at(tau):
    each = [core.threshold_sums(q, kc, bc, mc, stats=stats, tau=tau, weighting=w, **kw)
            for kc, _, mc, bc in chunks]
    return jax.tree.map(lambda *x: sum(x), *each)

  tau = core.solve_threshold(stats, sums_at, weighting=w)
  parts = [core.thresholded_attention(q, kc, vc, bc, mc, threshold=tau, weighting=w, **kw)
           for kc, vc, mc, bc in chunks]
  return core.merge_attention(parts, weighting=w)


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", WEIGHTINGS)
@pytest.mark.parametrize("parts", [2, 5])
def test_merged_chunks_are_the_whole_call(w, parts):
  """Values and gradients (q, k, v, bias) of the merged parts against attention over all keys
  in float64 (α = 3's gradient grows without bound at the support's edge: float64 only)."""
  rng = np.random.default_rng([parts, len(w)])
  dtype = jnp.float64 if w == "entmax:alpha=3" else jnp.float32
  with jax.enable_x64(dtype == jnp.float64):
    q, k, v, mask, bias, ct = _inputs(parts, dtype=dtype)
    spans = _spans(k.shape[1], parts, rng)
    kw = dict(logits_soft_cap=4.0)

    def merged(q, k, v, bias):
      return _protocol(q, k, v, mask, bias, spans, w, **kw)[0]

    def whole(q, k, v, bias):
      f64 = lambda x: x.astype(jnp.float64)
      return core.attention(f64(q), f64(k), f64(v), f64(bias), mask, weighting=w,
                            implementation="dense", **kw)

    with jax.enable_x64(True):
      want = whole(q, k, v, bias)
      grads = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), (0, 1, 2, 3)))
      g_want = grads(whole)(q, k, v, bias)
    got = jax.jit(merged)(q, k, v, bias)
    g_got = grads(merged)(q, k, v, bias)
  tol = 1e-12 if dtype == jnp.float64 else 2e-6
  np.testing.assert_allclose(got, want, atol=tol)
  assert not np.any(np.asarray(got)[0, 1]), "a row without a valid key has output 0"
  for a, b in zip(g_got, g_want, strict=True):
    np.testing.assert_allclose(a, b, atol=10 * tol, rtol=1e-5)


def test_threshold_and_totals_are_the_whole_calls_residual():
  q, k, v, mask, bias, _ = _inputs(3)
  for w in ("sparsemax", "entmax:alpha=1.3", "entmax:alpha=1.7"):
    _, res = _protocol(q, k, v, mask, bias, [(0, 10), (10, 29)], w)
    _, want = core.attention(q, k, v, bias, mask, weighting=w, implementation="dense",
                             return_residual=True)
    valid = np.asarray(jnp.any(mask, -1)).transpose(0, 2, 1)  # [B, T, 1]: rows with a key
    valid = np.broadcast_to(valid, res.threshold.shape)
    np.testing.assert_allclose(np.asarray(res.threshold)[valid],
                               np.asarray(want.threshold)[valid], atol=2e-6)
    np.testing.assert_allclose(np.asarray(res.total)[valid], np.asarray(want.total)[valid],
                               atol=2e-6)


def test_merge_refuses_parts_at_their_own_thresholds():
  q, k, v, *_ = _inputs(4)
  w = "entmax15"
  own = [core.attention(q, k[:, a:b], v[:, a:b], weighting=w, return_residual=True)
         for a, b in ((0, 10), (10, 29))]
  with pytest.raises(ValueError, match="protocol of attnx.core.thresholds"):
    core.merge_attention(own, weighting=w)
  tau = jnp.zeros((2, 3, 4))
  parts = [core.thresholded_attention(q, k[:, a:b], v[:, a:b], threshold=t, weighting=w)
           for (a, b), t in (((0, 10), tau), ((10, 29), tau + 0.5))]
  with pytest.raises(ValueError, match="threshold differs"):
    core.merge_attention(parts, weighting=w)


def test_protocol_errors():
  q, k, v, *_ = _inputs(5)
  with pytest.raises(ValueError, match="for sparsemax and entmax"):
    core.threshold_stats(q, k, weighting="softmax")
  with pytest.raises(ValueError, match="no sinks"):
    core.threshold_stats(q, k, weighting="sparsemax", sinks=jnp.zeros(4))
  with pytest.raises(TypeError, match="causal"):
    core.threshold_stats(q, k, weighting="sparsemax", causal=True)  # not is_causal
  with pytest.raises(ValueError, match="at least one"):
    core.combine_threshold_stats([])
  with pytest.raises(ValueError, match="must have the query's rows"):  # no silent broadcast
    core.thresholded_attention(q, k, v, threshold=jnp.zeros((3, 4)), weighting="sparsemax")
  stats = core.threshold_stats(q, k, weighting="sparsemax")
  with pytest.raises(ValueError, match="must have the query's rows"):
    core.threshold_sums(q, k, stats=stats, tau=jnp.zeros((1, 3, 4)), weighting="sparsemax")


def test_nan_rows_and_empty_chunks_as_the_whole_call():
  """A NaN query row is NaN (as in attention), the other rows exact; a chunk without keys adds
  nothing."""
  q, k, v, mask, bias, _ = _inputs(7)
  q = q.at[1, 2, 3, 0].set(jnp.nan)
  w = "entmax15"
  got, _ = _protocol(q, k, v, mask, bias, [(0, 0), (0, 13), (13, 13), (13, 29)], w)
  want = core.attention(q, k, v, bias, mask, weighting=w, implementation="dense")
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert np.isnan(np.asarray(got)[1, 2, 3]).all()
  np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=2e-6)


_MESH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P
    from attnx import core
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((1, 2, 4, 8)), jnp.float32)  # decoding rows
    k = jnp.asarray(r.standard_normal((1, 64, 2, 8)), jnp.float32)
    v = jnp.asarray(r.standard_normal((1, 64, 2, 8)), jnp.float32)
    w = "{w}"
    mesh = jax.make_mesh((4,), ("kv",), axis_types=(jax.sharding.AxisType.Auto,))

    def local(q, k, v):  # q replicated, this device's quarter of the keys
      st = core.threshold_stats(q, k, weighting=w)
      st = core.ThresholdStats(lax.pmax(st.max, "kv"), lax.psum(st.count, "kv"))
      sums_at = lambda t: jax.tree.map(
          lambda x: lax.psum(x, "kv"), core.threshold_sums(q, k, stats=st, tau=t, weighting=w))
      tau = core.solve_threshold(st, sums_at, weighting=w)
      out, res = core.thresholded_attention(q, k, v, threshold=tau, weighting=w)
      parts = jax.tree.map(lambda x: lax.all_gather(x, "kv"), (out, res))
      return core.merge_attention(
          [jax.tree.map(lambda x: x[i], parts) for i in range(4)], weighting=w)[0]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "kv"), P(None, "kv")),
                       out_specs=P(), check_vma=False)
    got = jax.jit(fn)(q, k, v)
    want = core.attention(q, k, v, weighting=w, implementation="dense")
    ct = jnp.ones_like(want)
    g = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * ct), (0, 1, 2))(q, k, v)
    gw = g(lambda q, k, v: core.attention(q, k, v, weighting=w, implementation="dense"))
    gg = g(jax.jit(fn))
    print(float(jnp.max(jnp.abs(got - want))),
          max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(gg, gw)))
    """)


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", ["sparsemax", "entmax:alpha=1.3"])
def test_protocol_over_a_mesh_axis(w):
  """Keys sharded over 4 devices, pmax/psum between the steps: the whole call's output and
  gradients."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=4")
  run = subprocess.run([sys.executable, "-c", _MESH_SCRIPT.format(w=w)], env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  err, gerr = map(float, run.stdout.split())
  assert err < 2e-6 and gerr < 1e-5, (err, gerr)


def test_ring_merges_with_the_public_rule(monkeypatch):
  """ring_attention's steps merge through residuals.merge_parts, merge_attention's rule."""
  from attnx.core import residuals
  calls = []
  rule = residuals.merge_parts
  monkeypatch.setattr(residuals, "merge_parts", lambda w, parts: calls.append(w) or rule(w, parts))
  q, k, v, *_ = _inputs(6, s=12)
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec(None, "sp")
  fn = jax.shard_map(lambda q, k, v: core.ring_attention(q, k, v, axis_name="sp",
                                                         weighting="sigmoid"),
                     mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  got = fn(q[:, :, :2], k[:, :12, :1], v[:, :12, :1])
  assert calls and all(w.name.startswith("sigmoid") for w in calls)
  np.testing.assert_allclose(got, core.attention(q[:, :, :2], k[:, :12, :1], v[:, :12, :1],
                                                 weighting="sigmoid"), atol=2e-6)


def test_exported():
  chex.assert_equal(core.thresholds.solve_threshold, core.solve_threshold)
