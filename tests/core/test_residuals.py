"""Residuals (``return_residual``, ``normalize_output=False``), ``merge_attention``, split-KV
decoding and paged attention, against jax.nn and float64 brute forces."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import reference as ref_lib

from attnx import core
from attnx.core import residuals
from attnx.core.kernels.xla import decode

# Every family of row state: pointwise F of each normalization (online max, a log-domain F,
# plain sums, an offset, length, none), SSMax, softpick, stick-breaking, sparsemax/entmax.
WEIGHTINGS = ("softmax", "softmax:alpha=2", "sigmoid", "relu", "power:p=3", "softmax_plus_one",
              "relu:normalization=length", "relu:normalization=none", "ssmax", "softpick",
              "stick_breaking", "sparsemax", "entmax15", "entmax:alpha=1.3")
MERGEABLE = ("softmax", "softmax:alpha=2", "sigmoid", "relu", "power:p=3", "softmax_plus_one",
             "relu:normalization=length", "relu:normalization=none", "softpick",
             "stick_breaking")
PALLAS = core.Pallas(interpret=True, block_q=16, block_k=16)
IMPLS = ("dense", core.SplitKV(num_chunks=3), core.Blocked(block_q=8, block_k=8), PALLAS)
RESIDUAL_GRAD_IMPLS = ("dense", core.SplitKV(num_chunks=2), core.Blocked(block_q=8, block_k=8),
                       PALLAS)


def _qkv(b=2, t=3, s=24, n=4, k=2, h=8, hv=8, seed=0, scale=1.0):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.standard_normal((b, t, n, h)) * scale, jnp.float32)
  kk = jnp.asarray(r.standard_normal((b, s, k, h)) * scale, jnp.float32)
  v = jnp.asarray(r.standard_normal((b, s, k, hv)), jnp.float32)
  return q, kk, v


def _takes_sinks(w: str) -> bool:
  return core.problem.sinks_reason(core.get_weighting(w)) is None


# --------------------------------------------------------------------------------------------
# Residuals against float64 brute forces (support.reference.residual64: the definitions)
# --------------------------------------------------------------------------------------------

def _scores64(q, k, causal=False, mask=None, cap=None):
  """[B, T, N, S] float64 scaled-dot scores (GQA), the valid mask, like attention's."""
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  g = q.shape[2] // k.shape[2]
  kr = np.repeat(k64, g, axis=2)
  z = np.einsum("btnh,bsnh->btns", q64, kr) / math.sqrt(q.shape[-1])
  if cap is not None:
    z = cap * np.tanh(z / cap)
  b, t, n, s = z.shape
  valid = np.ones(z.shape, bool)
  if causal:
    valid &= np.tril(np.ones((t, s), bool))[None, :, None, :]
  if mask is not None:
    valid &= np.moveaxis(np.broadcast_to(mask, (b, n, t, s)), 1, 2)
  return z, valid


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", WEIGHTINGS)
@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: getattr(i, "name", i) + (
    f"{i.num_chunks}" if isinstance(i, core.SplitKV) else ""))
def test_residual_matches_float64(w, impl):
  q, k, v = _qkv(t=3, s=24, seed=1)
  mask = np.random.default_rng(2).random((2, 1, 3, 24)) < 0.7
  mask[1, 0, 2] = False  # one fully masked row
  sinks = (np.random.default_rng(3).standard_normal(4) + 1.0).astype(np.float32)
  kw = dict(sinks=sinks) if _takes_sinks(w) else {}
  out, res = core.attention(q, k, v, mask=jnp.asarray(mask), weighting=w, implementation=impl,
                            return_residual=True, logits_soft_cap=4.0, **kw)
  z, valid = _scores64(q, k, mask=mask, cap=4.0)
  s64 = sinks if kw else None
  want = ref_lib.residual64(w, np.moveaxis(z, 2, 1), np.moveaxis(valid, 2, 1), s64)
  got = res.threshold if isinstance(res, core.EntmaxResidual) else res
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape == (2, 3, 4)
  finite = np.isfinite(want)
  np.testing.assert_array_equal(np.isfinite(got), finite)
  np.testing.assert_array_equal(got[~finite], want[~finite])  # −∞ rows (no weight)
  np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=2e-5)
  ref = core.attention(q, k, v, mask=jnp.asarray(mask), weighting=w, implementation="dense",
                       logits_soft_cap=4.0, **kw)
  chex.assert_trees_all_close(out, ref, atol=2e-6)


@pytest.mark.parametrize("case", ["plain", "mask", "bias", "causal", "gqa", "empty_row"])
def test_softmax_residual_is_jax_nns(case):
  q, k, v = _qkv(b=2, t=5, s=7, n=4, k=4 if case != "gqa" else 2, seed=4)
  kw, jkw = {}, {}
  if case == "mask":
    m = jnp.asarray(np.random.default_rng(5).random((2, 4, 5, 7)) < 0.6).at[..., 0].set(True)
    kw["mask"] = jkw["mask"] = m
  if case == "empty_row":
    kw["mask"] = jkw["mask"] = jnp.ones((2, 4, 5, 7), bool).at[0, :, 1].set(False)
  if case == "bias":
    kw["bias"] = jkw["bias"] = jnp.asarray(np.random.default_rng(6).standard_normal((2, 4, 5, 7)),
                                           jnp.float32)
  if case == "causal":
    kw["is_causal"] = jkw["is_causal"] = True
  kj, vj = (jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2)) if case == "gqa" else (k, v)
  want_out, want = jax.nn.dot_product_attention(q, kj, vj, return_residual=True, **jkw)
  out, got = core.attention(q, k, v, return_residual=True, **kw)
  assert got.shape == want.shape == (2, 5, 4)
  if case == "empty_row":  # jax.nn: −0.7·float32 max (its mask value); attnx: −∞
    assert np.all(np.asarray(want[0, 1]) < -1e37) and np.all(np.isneginf(got[0, 1]))
    keep = np.ones(got.shape, bool)
    keep[0, 1] = False
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], atol=2e-6)
    return
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)
  np.testing.assert_allclose(out, want_out, atol=2e-6)


def test_residual_gradient_is_the_log_sum_exps():
  """d lse/dz = the weights: attnx's residual differentiates like logsumexp of the scores."""
  q, k, v = _qkv(t=4, s=16, seed=7)
  ct = jnp.asarray(np.random.default_rng(8).standard_normal((2, 4, 4)), jnp.float32)

  def ours(q, k, impl):
    return jnp.sum(core.attention(q, k, v, implementation=impl, is_causal=True,
                                  return_residual=True)[1] * ct)

  def lse(q, k):
    z = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)) / math.sqrt(8)
    z = jnp.where(jnp.tril(jnp.ones((4, 16), bool)), z, -jnp.inf)
    return jnp.sum(jnp.swapaxes(jax.nn.logsumexp(z, -1), 1, 2) * ct)

  want = jax.grad(lse, (0, 1))(q, k)
  for impl in ("dense", "split_kv"):
    chex.assert_trees_all_close(jax.grad(ours, (0, 1))(q, k, impl), want, atol=2e-6)


def _residual_score_grad64(w: str, z: np.ndarray, valid: np.ndarray,
                           ct: np.ndarray) -> np.ndarray:
  """d(Σ ct·r)/dz [B, T, N, S] of the residual r of float64 scores z, from the definitions:
  autodiff (float64) of log Σ F, SSMax's lse, softpick's log Σ|e^z − 1| + ε, stick-breaking's
  Σ log(1 − σ(z)); the closed form u/Σu (u = p^{2−α}) of entmax's threshold (implicit
  function theorem on Σp = 1), its τ from support.reference.residual64."""
  wt = core.get_weighting(w)
  rs = getattr(wt, "stream", None)
  ct = ct[..., None]
  with jax.enable_x64(True):
    zz, ok = jnp.asarray(z, jnp.float64), jnp.asarray(valid)
    if rs is not None and rs.needs_threshold:
      tau = ref_lib.residual64(w, np.moveaxis(z, 2, 1), np.moveaxis(valid, 2, 1))[..., None]
      x = np.where(valid, (rs.alpha - 1) * rs.scale * (z - tau), 0.0)  # NaN τ: no key
      u = np.where(x > 0, np.maximum(x, 0.0) ** ((2 - rs.alpha) / (rs.alpha - 1)), 0.0)
      total = u.sum(-1, keepdims=True)
      return np.where(total > 0, ct * u / np.where(total > 0, total, 1.0), 0.0)
    if isinstance(wt, core.Pointwise):
      if wt.normalization != "sum":
        return np.zeros(z.shape)
      r = lambda z: jnp.log(jnp.sum(jnp.where(ok, wt.fn(z, z.shape[-1]), 0.0), -1)
                            + wt.denominator_offset)
    elif rs.family == "ssmax":
      c = rs.s * jnp.log(jnp.maximum(ok.sum(-1, keepdims=True), 1))
      r = lambda z: jax.nn.logsumexp(jnp.where(ok, c * z, -jnp.inf), -1)
    elif rs.family == "softpick":
      r = lambda z: jnp.log(jnp.sum(jnp.where(ok, jnp.abs(jnp.expm1(z)), 0.0), -1) + rs.eps)
    else:  # stick-breaking
      r = lambda z: jnp.sum(jnp.where(ok, -jax.nn.softplus(z), 0.0), -1)
    return np.asarray(jax.grad(lambda z: jnp.sum(r(z) * ct[..., 0]))(zz))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", WEIGHTINGS)
def test_residual_gradient_matches_float64(w):
  """Every implementation's residual differentiates to the float64 definition's: keys that
  are the unit vectors make q the scores (scale 1), so d r/dq is d r/dz, key by key."""
  rng = np.random.default_rng(12)
  b, t, n, kh, s = 2, 5, 4, 2, 12
  q = jnp.asarray(rng.standard_normal((b, t, n, s)) * 1.5, jnp.float32)
  k = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None], (b, s, kh, s))
  v = jnp.asarray(rng.standard_normal((b, s, kh, 4)), jnp.float32)
  mask = rng.random((b, 1, t, s)) < 0.75
  mask[1, 0, 3] = False  # a row without keys
  ct = rng.standard_normal((b, t, n))
  valid = np.moveaxis(np.broadcast_to(mask, (b, n, t, s)), 1, 2)
  want = _residual_score_grad64(w, np.asarray(q, np.float64), valid, ct)

  for impl in RESIDUAL_GRAD_IMPLS:
    def loss(q, impl=impl):
      _, r = core.attention(q, k, v, mask=jnp.asarray(mask), weighting=w, scale=1.0,
                            implementation=impl, return_residual=True)
      r = r.threshold if isinstance(r, core.EntmaxResidual) else r
      return jnp.sum(jnp.where(jnp.isfinite(r), r, 0.0) * ct)
    got = np.asarray(jax.jit(jax.grad(loss))(q))
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4, err_msg=str(impl))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", WEIGHTINGS)
def test_unnormalized_output_is_the_numerator(w):
  q, k, v = _qkv(t=2, s=20, seed=9)
  num, res = core.attention(q, k, v, weighting=w, normalize_output=False, return_residual=True,
                            is_causal=True)
  out = core.attention(q, k, v, weighting=w, is_causal=True, implementation="dense")
  assert num.dtype == jnp.float32
  # numerator = output × normalizer (the normalizer's definition checked by residual64)
  chex.assert_trees_all_close(num, out * residuals.normalizer(core.get_weighting(w), res)[
      ..., None], atol=1e-5, rtol=1e-5)
  if w == "softmax":  # Σ_j e^{z_ij} v_j in float64
    z, valid = _scores64(q, k, causal=True)
    e = np.where(valid, np.exp(z), 0.0)  # [B, T, N, S]
    want = np.einsum("btns,bsnh->btnh", e, np.repeat(np.asarray(v, np.float64), 2, 2))
    np.testing.assert_allclose(num, want, rtol=1e-5, atol=1e-5)
  only = core.attention(q, k, v, weighting=w, normalize_output=False, is_causal=True)
  chex.assert_trees_all_close(only, num)


# --------------------------------------------------------------------------------------------
# merge_attention
# --------------------------------------------------------------------------------------------

def _split(s: int, parts: int, rng: np.random.Generator) -> list[tuple[int, int]]:
  cuts = np.sort(rng.choice(np.arange(1, s), parts - 1, replace=False))
  edges = [0, *cuts.tolist(), s]
  return list(zip(edges[:-1], edges[1:], strict=True))


# Every mergeable F at two chunk counts, every count from 2 to 8 reached.
MERGE_CASES = [(w, parts) for i, w in enumerate(MERGEABLE)
               for parts in ((2, 5) if i % 2 else (3, 8))] + [("softmax", 4), ("softmax", 6),
                                                               ("stick_breaking", 7)]


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w, parts", MERGE_CASES)
def test_merge_of_chunks_is_the_whole_call(w, parts):
  rng = np.random.default_rng([parts, len(w)])
  q, k, v = _qkv(t=3, s=29, seed=parts)
  mask = jnp.asarray(rng.random((2, 1, 3, 29)) < 0.8)
  sinks = jnp.asarray(rng.standard_normal(4) + 1.0, jnp.float32) if _takes_sinks(w) else None
  ct = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
  spans = _split(29, parts, rng)
  order = list(range(parts)) if w == "stick_breaking" else list(rng.permutation(parts))

  def whole(q, k, v, sinks):
    kw = {} if sinks is None else dict(sinks=sinks)
    return core.attention(q, k, v, mask=mask, weighting=w, logits_soft_cap=3.0,
                          implementation="dense", **kw)

  def merged(q, k, v, sinks):
    outs = []
    for i in order:
      lo, hi = spans[i]
      kw = dict(sinks=sinks) if sinks is not None and i == order[0] else {}
      outs.append(core.attention(q, k[:, lo:hi], v[:, lo:hi], mask=mask[..., lo:hi],
                                 weighting=w,
                                 logits_soft_cap=3.0, return_residual=True, **kw))
    return core.merge_attention(outs, weighting=w)[0]

  chex.assert_trees_all_close(merged(q, k, v, sinks), whole(q, k, v, sinks), atol=3e-6)
  argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
  grads = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums))
  g_whole = grads(whole)(q, k, v, sinks)
  g_merged = grads(merged)(q, k, v, sinks)
  chex.assert_trees_all_close(g_merged, g_whole, atol=2e-5, rtol=1e-4)


def test_merged_residual_is_the_whole_calls():
  q, k, v = _qkv(t=2, s=30, seed=11)
  for w in ("softmax", "stick_breaking", "relu:normalization=length"):
    _, whole = core.attention(q, k, v, weighting=w, return_residual=True)
    parts = [core.attention(q, k[:, a:b], v[:, a:b], weighting=w, return_residual=True)
             for a, b in ((0, 7), (7, 19), (19, 30))]
    _, res = core.merge_attention(parts, weighting=w)
    np.testing.assert_allclose(res, whole, atol=2e-6)


def test_ssmax_merges_as_softmax_with_the_whole_rows_count():
  """SSMax's two steps over key chunks (docs/guides/residuals.md): count each row's valid keys
  over every chunk, then softmax parts of c·q (c = s·log n) merge into SSMax attention."""
  q, k, v = _qkv(t=3, s=30, seed=15)
  mask = jnp.asarray(np.random.default_rng(16).random((2, 1, 3, 30)) < 0.7)
  s = 0.8
  want = core.attention(q, k, v, mask=mask, weighting="ssmax", weighting_params={"s": s},
                        implementation="dense", return_residual=True)
  n = jnp.sum(jnp.broadcast_to(mask, (2, 4, 3, 30)), -1)  # step 1: Σ over chunks of counts
  c = s * jnp.log(jnp.maximum(n, 1)).transpose(0, 2, 1)[..., None]  # [B, T, N, 1]
  parts = [core.attention(c * q, k[:, a:b], v[:, a:b], mask=mask[..., a:b],
                          return_residual=True) for a, b in ((0, 11), (11, 12), (12, 30))]
  chex.assert_trees_all_close(core.merge_attention(parts), want, atol=2e-6)


def test_merge_refuses_what_cannot_be_merged():
  q, k, v = _qkv(t=1, s=8)
  part = core.attention(q, k, v, weighting="softmax", return_residual=True)
  for w in ("ssmax", "sparsemax", "entmax15"):
    with pytest.raises(ValueError, match="cannot merge parts of weighting"):
      core.merge_attention([part, part], weighting=w)
  with pytest.raises(ValueError, match="at least one"):
    core.merge_attention([])
  other = core.attention(q[:, :, :2], k, v, return_residual=True)
  with pytest.raises(ValueError, match="must share queries"):
    core.merge_attention([part, other])
  with pytest.raises(ValueError, match="no residual"):
    core.merge_attention([part], weighting=core.RowNormalizer(
        name="row", fn=lambda s, w, ax: jax.nn.softmax(s, axis=ax, where=w)))


def test_residual_arguments_are_checked():
  q, k, v = _qkv(t=1, s=8)
  with pytest.raises(ValueError, match="return_residual must be a Python bool"):
    core.attention(q, k, v, return_residual=jnp.bool_(True))
  with pytest.raises(ValueError, match="cannot both be True"):
    core.attention(q, k, v, return_residual=True, return_weights=True)
  # The automatic choice runs it (split-KV for short queries, dense otherwise).
  assert core.explain(q, k, v, return_residual=True).chosen == "split_kv"
  q2 = jnp.zeros((2, 40, 4, 8))
  assert core.explain(q2, k, v, return_residual=True).chosen == "dense"
  q3, k3 = jnp.zeros((1, 1024, 2, 8)), jnp.zeros((1, 1024, 2, 8))  # streams: blocked, O(T)
  for w in ("softmax", "entmax15"):
    assert core.explain(q3, k3, k3, weighting=w, return_residual=True).chosen == "blocked"


@pytest.mark.parametrize("w", ("softmax", "stick_breaking", "entmax15"))
def test_pallas_residual_lowers_for_gpu_and_tpu(w):
  """core.attention(implementation="pallas", return_residual=True) as a user on a GPU or TPU
  runs it: the platform's kernels (by_platform), forward and backward, lowered for both."""
  from support import lowering
  q, k, v = _qkv(t=128, s=128, n=2, k=2, h=64, hv=64)

  def loss(q, k, v):
    out, res = core.attention(q, k, v, weighting=w, implementation="pallas", is_causal=True,
                              return_residual=True)
    res = res.threshold if isinstance(res, core.EntmaxResidual) else res
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(res))

  for platform, target in (("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")):
    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=(platform,)).as_text()
    family = None if w == "softmax" else w
    lowering.custom_calls(text, target, lowering.expected_kernels(platform, "float32", 64, 64,
                                                                  family))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w, layout, impl", [
    ("sigmoid", "contiguous", "blocked"), ("ssmax", "contiguous", "blocked"),
    ("stick_breaking", "contiguous", PALLAS), ("stick_breaking", "zigzag", "blocked")])
def test_ring_residual_is_attentions(w, layout, impl):
  """ring_attention(return_residual=True): the residual and the gradients through it (its
  cotangent enters as a value column of zeros) equal attention's (the ring's table checks
  the residual against float64 on 8 devices: tests/core/test_ring.py)."""
  from jax.sharding import PartitionSpec as P
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v = _qkv(b=2, t=16 * n, s=16 * n, n=4, k=2, seed=13)
  rng = np.random.default_rng(14)
  ct, ct_r = (jnp.asarray(rng.standard_normal(x), jnp.float32)
              for x in ((2, 16 * n, 4, 8), (2, 16 * n, 4)))
  perm = ((lambda x: core.zigzag_permute(x, n, axis=1)) if layout == "zigzag"
          else (lambda x: x))

  def ring(q, k, v):
    return jax.shard_map(
        lambda q, k, v: core.ring_attention(q, k, v, axis_name="sp", weighting=w,
                                            is_causal=True, layout=layout,
                                            implementation=impl, return_residual=True),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False)(
            perm(q), perm(k), perm(v))

  def whole(q, k, v):
    out, r = core.attention(q, k, v, weighting=w, is_causal=True, implementation="dense",
                            return_residual=True)
    return perm(out), perm(r)

  def run(fn):  # (out, residual) and the gradients of Σ ct·out + Σ ct_r·residual, one trace
    outs, vjp = jax.vjp(fn, q, k, v)
    return outs, vjp((perm(ct), perm(ct_r)))

  (got, got_grads), (want, want_grads) = run(ring), run(whole)
  chex.assert_trees_all_close(got, want, atol=2e-5)
  chex.assert_trees_all_close(got_grads, want_grads, atol=5e-5, rtol=1e-4)


def test_empty_key_sequence_residuals():
  q = jnp.ones((1, 2, 2, 4))
  k = v = jnp.zeros((1, 0, 2, 4))
  out, res = core.attention(q, k, v, return_residual=True)
  assert out.shape == (1, 2, 2, 4) and np.all(out == 0) and np.all(np.isneginf(res))
  _, res = core.attention(q, k, v, return_residual=True, weighting="stick_breaking")
  assert np.all(res == 0)
  _, res = core.attention(q, k, v, return_residual=True, weighting="sparsemax")
  assert isinstance(res, core.EntmaxResidual) and np.all(res.total == 0)


@pytest.mark.parametrize("w", ["softmax", "sigmoid", "softpick", "ssmax", "softmax_plus_one",
                               "relu"])
def test_no_keys_but_a_sink_has_the_sinks_residual(w):
  """S = 0 with sinks: the sink is each row's one key (value 0), so the output is 0 and the
  residual that of the sink alone (float64 definition), in every implementation — not an
  empty row's −∞ (differential configuration 788 found it)."""
  q = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 4, 8)), jnp.float32)
  k, v = jnp.zeros((2, 0, 2, 8)), jnp.zeros((2, 0, 2, 5))
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
  want = ref_lib.residual64(w, np.zeros((2, 4, 3, 0)), np.zeros((1, 1, 1, 0), bool), sinks,
                            num_keys=0)
  for impl in ("dense", "blocked", "split_kv", None):
    out, res = core.attention(q, k, v, weighting=w, sinks=sinks, implementation=impl,
                              return_residual=True)
    assert out.shape == (2, 3, 4, 5) and not np.any(out)
    np.testing.assert_allclose(res, want, atol=1e-6, err_msg=f"{impl}")
  grad = jax.grad(lambda s: jnp.sum(core.attention(q, k, v, weighting=w, sinks=s,
                                                   return_residual=True)[1]))(sinks)
  assert np.all(np.isfinite(grad))


# --------------------------------------------------------------------------------------------
# Split-KV decoding and paged attention
# --------------------------------------------------------------------------------------------

DECODE_WEIGHTINGS = ("softmax", "sigmoid", "stick_breaking", "entmax15", "ssmax", "softpick",
                     "relu", "sparsemax")


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", DECODE_WEIGHTINGS)
def test_split_kv_decoding_is_the_last_row_of_a_causal_forward(w):
  """A batch of prompts of different lengths (right padding), GQA, a window, sinks, a soft cap:
  one query per sequence at its last position against the padded cache equals that row of
  the full causal forward (dense), for every F."""
  r = np.random.default_rng(12)
  b, s, n, kh, h = 3, 64, 6, 2, 16
  lengths = np.array([1, 37, 64])
  q_all = jnp.asarray(r.standard_normal((b, s, n, h)), jnp.float32)
  k = jnp.asarray(r.standard_normal((b, s, kh, h)), jnp.float32)
  v = jnp.asarray(r.standard_normal((b, s, kh, h)), jnp.float32)
  sinks = jnp.asarray(r.standard_normal(n), jnp.float32) if _takes_sinks(w) else None
  kw = dict(weighting=w, logits_soft_cap=5.0, **({} if sinks is None else dict(sinks=sinks)))
  window = 20
  full = core.attention(q_all, k, v, is_causal=True, local_window_size=(window, 0),
                        key_value_seq_lengths=jnp.asarray(lengths), implementation="dense",
                        **kw)
  pos = lengths - 1
  q1 = q_all[np.arange(b), pos][:, None]
  keys = np.arange(s)
  mask = (keys[None] <= pos[:, None]) & (keys[None] >= pos[:, None] - window)
  mask = jnp.asarray(mask[:, None, None, :])
  for impl in (core.SplitKV(num_chunks=4), core.SplitKV(num_chunks=1), core.SplitKV()):
    got = core.attention(q1, k, v, mask=mask, implementation=impl, **kw)
    want = full[np.arange(b), pos][:, None]
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=1e-5)


def test_automatic_choice_decodes_with_split_kv():
  q, k, v = _qkv(b=1, t=1, s=4096, n=4, k=2)
  ex = core.explain(q, k, v)
  assert ex.chosen == "split_kv", str(ex)
  q8, _, _ = _qkv(b=1, t=9, s=16, n=4, k=2)
  ex = core.explain(q8, k, v)
  assert ex.chosen != "split_kv" and "decoding" in ex.declined["split_kv"]
  with pytest.raises(ValueError, match="num_chunks"):
    core.SplitKV(num_chunks=0)


def test_chunk_count_divides_the_keys():
  assert decode.chunk_count(32768, None) == 32
  assert decode.chunk_count(1000, 8) == 8
  assert decode.chunk_count(997, 8) in (1, 997)  # a prime: no cut without a copy
  assert decode.chunk_count(12, 5) in (4, 6)
  for s in (1, 7, 64, 1536):
    c = decode.chunk_count(s, 16)
    assert s % c == 0


@pytest.mark.split_by_jax
@pytest.mark.parametrize("w", ("softmax", "stick_breaking", "entmax15"))
def test_paged_attention_equals_contiguous(w):
  r = np.random.default_rng(13)
  b, n, kh, h, page, pages, pool = 3, 4, 2, 8, 8, 5, 20
  lengths = jnp.asarray([3, 40, 17])
  kp = jnp.asarray(r.standard_normal((pool, page, kh, h)), jnp.float32)
  vp = jnp.asarray(r.standard_normal((pool, page, kh, h)), jnp.float32)
  table = jnp.asarray(r.permutation(pool)[:b * pages].reshape(b, pages), jnp.int32)
  for t in (1, 3):
    q = jnp.asarray(r.standard_normal((b, t, n, h)), jnp.float32)
    got, res = core.paged_attention(q, kp, vp, table, lengths, weighting=w,
                                    return_residual=True)
    for i in range(b):
      length = int(lengths[i])
      k = core.paged.gather_pages(kp, table)[i:i + 1, :length]
      v = core.paged.gather_pages(vp, table)[i:i + 1, :length]
      q_full = jnp.zeros((1, length, n, h)).at[:, length - t:].set(q[i:i + 1])
      want, want_res = core.attention(q_full, k, v, weighting=w, is_causal=True,
                                      implementation="dense", return_residual=True)
      chex.assert_trees_all_close(got[i:i + 1], want[:, length - t:], atol=2e-6)
      row = lambda x, i=i: x[i:i + 1]
      last = lambda x, a=length - t: x[:, a:]
      chex.assert_trees_all_close(jax.tree.map(row, res), jax.tree.map(last, want_res),
                                  atol=2e-5)


def test_paged_attention_errors_and_append():
  kp = jnp.zeros((4, 2, 1, 8))
  q = jnp.ones((2, 1, 2, 8))
  table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
  with pytest.raises(ValueError, match="page indices must be in"):
    core.paged_attention(q, kp, kp, table.at[0, 0].set(9), jnp.asarray([1, 1]))
  with pytest.raises(ValueError, match="lengths must be in"):
    core.paged_attention(q, kp, kp, table, jnp.asarray([5, 1]))
  with pytest.raises(ValueError, match="page_table must be int"):
    core.paged_attention(q, kp, kp, table[0], jnp.asarray([1, 1]))
  with pytest.raises(TypeError, match="builds 'mask'"):
    core.paged_attention(q, kp, kp, table, jnp.asarray([1, 1]), mask=None)
  lengths = jnp.asarray([0, 3])
  key = jnp.ones((2, 1, 8)) * jnp.asarray([1.0, 2.0])[:, None, None]
  kp2, vp2, lengths2 = core.append_to_pages(kp, kp, table, lengths, key, key)
  assert list(lengths2) == [1, 4]
  assert float(kp2[0, 0, 0, 0]) == 1.0 and float(kp2[3, 1, 0, 0]) == 2.0
  assert float(jnp.sum(kp2)) == 8.0 * 3  # nothing else written
  with pytest.raises(ValueError, match="is full"):
    core.append_to_pages(kp, kp, table, jnp.asarray([4, 0]), key, key)


def test_decoding_nan_contract():
  """A NaN key that a row masks reaches no output of that row, in split-KV as in dense."""
  q, k, v = _qkv(b=1, t=1, s=32, n=2, k=1)
  k = k.at[0, 5].set(jnp.nan)
  v = v.at[0, 9, 0, 0].set(jnp.inf)
  mask = jnp.ones((1, 1, 1, 32), bool).at[..., 5].set(False).at[..., 9].set(False)
  for impl in ("dense", core.SplitKV(num_chunks=4)):
    out = core.attention(q, k, v, mask=mask, implementation=impl)
    assert np.all(np.isfinite(out)), impl
    g = jax.grad(lambda q, k, impl=impl: jnp.sum(core.attention(q, k, v, mask=mask,
                                                                implementation=impl)),
                 (0, 1))(q, k)
    assert np.all(np.isfinite(g[0])) and np.all(np.isfinite(np.delete(np.asarray(g[1]), 5, 1)))
    bad = core.attention(q, k, v, implementation=impl)  # the NaN key attended: NaN row
    assert np.all(np.isnan(bad))


@pytest.mark.parametrize("shape", [(1, 1500, 4, 2), (2, 64, 4, 2), (1, 64, 8, 2)])
def test_split_kv_under_jit_packs_grouped_queries_right(shape):
  """Split-KV compiled (jit) with the query heads of a KV head packed as its rows: XLA:CPU of
  jaxlib 0.10 miscompiled the packing fused into the scores' multiply-reduce (outputs off by
  O(1) at these shapes; eager and jaxlib 0.12 right), so this runs on both ends of the JAX
  range, softmax and stick-breaking, against the dense implementation."""
  t, s, n, kh = shape
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = 0.3 * jax.random.normal(ks[0], (1, t, n, 8))
  k = 0.3 * jax.random.normal(ks[1], (1, s, kh, 8))
  v = jax.random.normal(ks[2], (1, s, kh, 8))
  for w in ("softmax", "stick_breaking"):
    got = jax.jit(lambda q, k, v, w=w: core.attention(q, k, v, weighting=w,
                                                      implementation="split_kv"))(q, k, v)
    want = core.attention(q, k, v, weighting=w, implementation="dense")
    np.testing.assert_allclose(got, want, atol=2e-6, err_msg=w)
