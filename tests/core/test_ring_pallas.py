"""attnx.core.kernels.pallas.block: ring attention's per-step entry points on the Pallas kernels.

Differential: the keys of a problem are cut into 2–3 blocks (a ring step each; the last one,
when causal, the diagonal block of the local rows); each block's raw state comes from the
Pallas entry point (Pallas' interpreter, "gpu" or "tpu" kernels) or from the XLA one
(attnx.core.kernels.xla.pointwise / blocked_rows), in a mix; the states are merged and normalized
with the streaming rules, the blocks' gradients are taken from the global output and statistics (the
whole-row carries going from block to block), and all of it is compared with the float64
brute force (tests/support/reference.py): values within 1e-5 · max(1, max |ref|), gradients
within 1e-4 · max(1, max |ref|). Every case has GQA, t ≠ s, lengths that are no powers of 2
and several kernel tiles, key masks that leave some rows without a key in a block (and one
row without any), and a bias.

The CI cases are one program each (about 2–4 s in the interpreter); the sweep over every
pointwise weighting, both backends and all-Pallas blocks is ``-m differential``. The step
functions also lower for cuda and tpu from this CPU host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import lowering
from support.reference import reference

from attnx.core import streaming
from attnx.core import weightings as wlib
from attnx.core.kernels.pallas import block as ring_pallas
from attnx.core.kernels.xla import pointwise as bl
from attnx.core.kernels.xla import rows as blocked_rows

OUT_TOL, GRAD_TOL = 1e-5, 1e-4
SCALE = 0.4


@dataclasses.dataclass(frozen=True)
class Case:
  """One problem: t local rows, key blocks of the given lengths (the last one the causal
  diagonal block when ``causal``, then of length t), which of them run on Pallas."""
  weighting: str
  backend: str
  t: int = 40
  blocks: tuple[int, ...] = (24, 40)
  pallas: tuple[bool, ...] = (True, False)
  causal: bool = False
  b: int = 1
  kv_heads: int = 2
  group: int = 2
  h: int = 8
  hv: int = 8
  bias: str = "rows"  # "rows": [1, N, t, S]; "keys": [B, 1, 1, S]; "none"
  block_q: int | None = None  # Pallas tiles (None: the backend's defaults)
  block_k: int | None = None
  seed: int = 0

  @property
  def s(self) -> int:
    return sum(self.blocks)


def _inputs(c: Case):
  """[B, T, N, H] inputs, the [B, 1, t, S] mask (no causal part), the bias, the cotangent."""
  rng = np.random.default_rng(c.seed)
  n = c.kv_heads * c.group
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k, v = normal(c.b, c.t, n, c.h), normal(c.b, c.s, c.kv_heads, c.h), normal(
      c.b, c.s, c.kv_heads, c.hv)
  mask = rng.random((c.b, 1, c.t, c.s)) < 0.75
  mask[:, :, 3] = False  # a row without any key
  mask[:, :, 5, :c.blocks[0]] = False  # a row without a key in the first block
  mask[:, :, 7, c.blocks[0]:] = False  # ... and one without a key in the later blocks
  bias = {"rows": lambda: normal(1, n, c.t, c.s), "keys": lambda: normal(c.b, 1, 1, c.s),
          "none": lambda: None}[c.bias]()
  return q, k, v, mask, bias, normal(c.b, c.t, n, c.hv)


def _full_mask(c: Case, mask: np.ndarray) -> np.ndarray:
  """The mask of the whole problem: the diagonal block causal (local positions)."""
  if not c.causal:
    return mask
  lo = c.s - c.t
  keys, rows = np.arange(c.s)[None, :], np.arange(c.t)[:, None]
  return mask & ((keys < lo) | (keys - lo <= rows))


def _to5(x, c: Case):
  """A [Bb, N|1, T|1, S|1] array -> the ring's [Bb, K|1, G|1, T|1, S|1]."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], c.kv_heads, c.group, *x.shape[2:])


def _ring_program(c: Case, w):
  """(q, k, v, bias5, mask5, row_scales, scale, do) in the ring's layout -> (out, dq, dk, dv,
  dbias, dscale), each block on Pallas or XLA as ``c.pallas`` says."""
  rows = not isinstance(w, wlib.Pointwise)
  rs = getattr(w, "stream", None)
  edges = np.cumsum((0,) + c.blocks)
  spans = list(zip(edges[:-1], edges[1:], strict=True))
  head_dims = (c.b, c.kv_heads, c.group)
  kw = dict(backend=c.backend, interpret=True, block_q=c.block_q, block_k=c.block_k)
  cfgs = [bl.block_config(w, c.t, int(hi - lo), head_dims,
                          is_causal=c.causal and j == len(spans) - 1, has_mask=True,
                          has_bias=c.bias != "none", num_keys=c.s, whole_chunk=rows)
          for j, (lo, hi) in enumerate(spans)]

  def program(q, k, v, bias, mask, rsc, scale, do):
    def cut(j):
      lo, hi = (int(e) for e in spans[j])
      key = lambda a, axis: None if a is None else a[(slice(None),) * axis + (slice(lo, hi),)]
      return q, key(k, 1), key(v, 1), key(bias, 4), key(mask, 4)

    # Forward: raw states, merged (stick-breaking: the later keys first), normalized once.
    states = []
    for j, cfg in enumerate(cfgs):
      args = cut(j)
      if rows:
        fn = ring_pallas.raw_row_block_state if c.pallas[j] else blocked_rows.raw_block_state
        states.append(fn(*args, rsc, scale, cfg, **(kw if c.pallas[j] else {})))
      else:
        fn = ring_pallas.raw_block_state if c.pallas[j] else bl.raw_block_state
        states.append(fn(*args, scale, cfg, **(kw if c.pallas[j] else {})))
    state = states[-1]
    for st in states[-2::-1]:
      state = streaming.merge(rs, state, st) if rows else streaming.pointwise_merge(w, state,
                                                                                     st)
    if rows:
      out, stats, _ = streaming.finalize(rs, state, rsc)
    else:
      out, stat = streaming.pointwise_finalize(w, *state)
    # Backward: every block from the global out/statistics, the last block first.
    dq, dscale = jnp.zeros(q.shape, jnp.float32), jnp.zeros((), jnp.float32)
    dks, dvs, dbs = [None] * len(cfgs), [None] * len(cfgs), [None] * len(cfgs)
    carries = (jnp.zeros(q.shape[:3]), jnp.zeros(q.shape[:3]))
    for j in reversed(range(len(cfgs))):
      args, cfg = cut(j), cfgs[j]
      more = kw if c.pallas[j] else {}
      if rows:
        fn = ring_pallas.row_block_grads if c.pallas[j] else blocked_rows.block_grads
        gq, gk, gv, gb, carries, gs = fn(*args, rsc, scale, out, stats, do, carries, cfg,
                                         **more)
      else:
        fn = ring_pallas.block_grads if c.pallas[j] else bl.block_grads
        gq, gk, gv, gb, gs = fn(*args, scale, out, stat, do, cfg, **more)
      dq, dscale = dq + gq, dscale + gs
      dks[j], dvs[j], dbs[j] = gk, gv, gb
    dbias = None if bias is None else jnp.concatenate(dbs, axis=4)
    return (out, dq, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1), dbias, dscale)

  return jax.jit(program)


def _check(c: Case):
  w = wlib.get_weighting(c.weighting)
  q, k, v, mask, bias, ct = _inputs(c)
  full = _full_mask(c, mask)
  ref = reference(q, k, v, weighting=c.weighting, scale=SCALE, bias=bias, mask=full,
                  cotangent=ct)
  b, t, n, h = q.shape
  x = b * c.kv_heads
  # The ring's kernel layout: q [X, G, t, H], k/v [X, S, H], rows [X, G, t].
  q_r = jnp.asarray(q.transpose(0, 2, 1, 3).reshape(x, c.group, t, h))
  kv_r = lambda a: jnp.asarray(a.transpose(0, 2, 1, 3).reshape(x, c.s, a.shape[-1]))
  do_r = jnp.asarray(ct.transpose(0, 2, 1, 3).reshape(x, c.group, t, c.hv))
  rsc = None
  if getattr(w, "stream", None) is not None and w.stream.needs_row_scale:
    counts = np.broadcast_to(full.sum(-1), (b, n, t)).astype(np.float32)
    rsc = streaming.row_scale(w.stream, jnp.asarray(counts)).reshape(x, c.group, t)
  bias5 = None if bias is None else jnp.asarray(_to5(bias, c))
  got = _ring_program(c, w)(q_r, kv_r(k), kv_r(v), bias5, jnp.asarray(_to5(mask, c)), rsc,
                            jnp.float32(SCALE), do_r)
  out, dq, dk, dv, dbias, dscale = (None if a is None else np.asarray(a, np.float64)
                                    for a in got)
  back_q = lambda a: a.reshape(b, n, t, -1).transpose(0, 2, 1, 3)
  back_kv = lambda a: a.reshape(b, c.kv_heads, c.s, -1).transpose(0, 2, 1, 3)
  pairs = {"out": (back_q(out), ref.out), "q": (back_q(dq), ref.grads["q"]),
           "k": (back_kv(dk), ref.grads["k"]), "v": (back_kv(dv), ref.grads["v"])}
  if bias is not None:
    want = ref.grads["bias"]
    axes = tuple(a for a in range(4) if bias.shape[a] == 1)
    want = want.sum(axis=axes, keepdims=True) if axes else want
    pairs["bias"] = (dbias.reshape(bias.shape), want)
  # dL/dscale = Σ_ij dz_ij q_i·k_j = Σ dq·q / scale.
  dscale_ref = np.sum(ref.grads["q"] * q) / SCALE
  pairs["scale"] = (np.asarray(dscale), np.asarray(dscale_ref))
  assert np.max(np.abs(ref.out)) > 0.1  # not trivially zero
  assert not np.any(ref.out[:, 3]) and not np.any(out.reshape(b, n, t, -1)[:, :, 3])
  for name, (a, want) in pairs.items():
    tol = OUT_TOL if name == "out" else GRAD_TOL
    bound = tol * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(a - want)))
    assert np.all(np.isfinite(a)), name
    assert err <= bound, f"{c.weighting} {name}: max abs error {err:.3g} > {bound:.3g}"


# CI: every pointwise family (online max with and without offset, "sum", "length", "none"
# with F seeing the global key count) and the whole-row families, both backends, the causal
# diagonal block on Pallas and on XLA, 2 and 3 blocks, biases of both shapes.
CASES = {
    "softmax-gpu-causal": Case("softmax", "gpu", causal=True, pallas=(False, True)),
    "softmax_plus_one-tpu": Case("softmax_plus_one", "tpu", t=48, blocks=(40, 56),
                                 block_q=16),
    "relu-sum-gpu-3blocks": Case("relu", "gpu", t=56, blocks=(24, 40, 32),
                                 pallas=(False, True, False), bias="keys", b=2, group=3,
                                 kv_heads=1),
    "relu-length-tpu-causal": Case("relu:normalization=length", "tpu", causal=True,
                                   pallas=(False, True), block_q=16),
    "sigmoid-none-gpu": Case("sigmoid:normalization=none", "gpu", t=24, blocks=(72, 24),
                             hv=12),
    "ssmax-gpu-causal": Case("ssmax", "gpu", causal=True, pallas=(True, True)),
    "softpick-tpu": Case("softpick", "tpu", blocks=(40, 24), pallas=(True, False),
                         block_q=16),
    "stick_breaking-gpu-causal": Case("stick_breaking", "gpu", causal=True, blocks=(24, 32, 40),
                                      pallas=(True, False, True), bias="keys"),
    # The XLA diagonal block merged with a Pallas one before it.
    "sigmoid-tpu-causal": Case("sigmoid", "tpu", causal=True, pallas=(True, False), block_q=16),
    "softpick-gpu-causal": Case("softpick", "gpu", causal=True, pallas=(False, True), t=32,
                                blocks=(56, 32), bias="keys"),
    "stick_breaking-tpu": Case("stick_breaking", "tpu", blocks=(40, 24), pallas=(False, True),
                               block_q=16),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.split_by_jax
def test_mixed_pallas_and_xla_blocks_equal_float64_reference(name):
  _check(CASES[name])


POINTWISE = wlib.list_weightings("pointwise")
# Not power:p=0.5: its F' is unbounded at 0, so float32 scores near 0 put its gradients off
# the float64 ones by more than the tolerance (the XLA blocks alike).
VARIANTS = ["relu:normalization=length", "sigmoid:normalization=none", "softmax:alpha=0.5",
            "power:p=3", "softplus:normalization=none"]


@pytest.mark.differential
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("name", [n for n in POINTWISE + VARIANTS
                                  if not wlib.get_weighting(n).distance_kernel]
                         + ["ssmax", "softpick", "stick_breaking"])
def test_every_weighting_all_pallas_blocks(name, backend):
  for seed, causal in ((1, True), (2, False)):
    _check(Case(name, backend, t=40, blocks=(40, 32, 40), pallas=(True, True, True),
                causal=causal, seed=seed, block_q=16))


def test_supported():
  for name in ("softmax", "sigmoid:normalization=none", "ssmax", "softpick", "stick_breaking"):
    assert ring_pallas.supported(name, "gpu") is None
    assert ring_pallas.supported(name, "tpu") is None
  assert "threshold" in ring_pallas.supported("sparsemax", "gpu")
  assert "threshold" in ring_pallas.supported("entmax15", "tpu")
  assert "Unknown Pallas backend" in ring_pallas.supported("softmax", "cpu")


PLATFORMS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("name", ["softmax", "stick_breaking"])
def test_step_functions_lower(name, platform):
  # The forward step (one kernel) and the backward step (dQ and dK/dV kernels; stick-breaking
  # also the forward, for its carries) lower for the real targets from this CPU host.
  backend, target = PLATFORMS[platform]
  w = wlib.get_weighting(name)
  rows = not isinstance(w, wlib.Pointwise)
  b, kv_heads, g, t, s, h = 2, 2, 2, 96, 160, 64
  x = b * kv_heads
  cfg = bl.block_config(w, t, s, (b, kv_heads, g), is_causal=False, has_mask=True,
                        has_bias=True, num_keys=2 * s, whole_chunk=rows)
  sds = jax.ShapeDtypeStruct
  bf16, f32 = jnp.bfloat16, jnp.float32
  qs, kvs = sds((x, g, t, h), bf16), sds((x, s, h), bf16)
  bias, mask = sds((1, kv_heads, g, t, s), f32), sds((b, 1, 1, 1, s), jnp.bool_)
  rows_f32 = sds((x, g, t), f32)
  kw = dict(backend=backend, interpret=False)
  if rows:
    fwd = lambda q, k, v, bi, m, sc: ring_pallas.raw_row_block_state(q, k, v, bi, m, None, sc,
                                                                     cfg, **kw)
    bwd = lambda q, k, v, bi, m, sc, o, st, do, c0, c1: ring_pallas.row_block_grads(
        q, k, v, bi, m, None, sc, o, (st,), do, (c0, c1), cfg, **kw)
    extra = (rows_f32, rows_f32)
  else:
    fwd = lambda q, k, v, bi, m, sc: ring_pallas.raw_block_state(q, k, v, bi, m, sc, cfg, **kw)
    bwd = lambda q, k, v, bi, m, sc, o, st, do: ring_pallas.block_grads(
        q, k, v, bi, m, sc, o, st, do, cfg, **kw)
    extra = ()
  args = (qs, kvs, kvs, bias, mask, sds((), f32))
  out = sds((x, g, t, h), f32)
  lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=(platform,)).as_text()
  lowering.custom_calls(lower(fwd, *args), target, {"fwd"})
  want = lowering.expected_kernels(platform, "bfloat16", h, h, getattr(w.stream, "family", None)
                                   if rows else None)
  if not rows:
    want = want - {"fwd"}
  lowering.custom_calls(lower(bwd, *args, out, rows_f32, out, *extra), target, want)
