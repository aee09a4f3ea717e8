"""Run in a subprocess with 8 fake CPU devices (tests/core/test_ring.py): ring attention
(attnx.core.ring) against the float64 brute force of the differential net; prints JSON.

Each case is a :class:`support.differential.Case` (its inputs, reference and kink exclusions are
the differential net's) and a layout. The global arrays are cut into 8 shards along the
sequence (zigzag-permuted first for ``layout="zigzag"``), the ring runs inside
``jax.shard_map``, and its output and gradients, put back in the natural order, are compared
with the reference: max |got − want| / scale, the net's scale (the largest Σ|terms| behind an
entry, ≥ max |want|). Usage: ``python ring_check.py [case names...]`` (default: all).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax

from attnx.train import workarounds

workarounds.fake_cpu_devices(8)  # before JAX starts its backend
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from attnx import core  # noqa: E402
from attnx.core import ring  # noqa: E402
from support import differential as diff  # noqa: E402
from support import reference as ref_lib  # noqa: E402
from support.ring_cases import CASES, DEVICES, VMA, VMA_CASES, C, T  # noqa: E402

AXIS = "sp"
VMA_RUNS = [n + VMA for n in (*VMA_CASES, "learned_params")]


def _mesh():
  return jax.make_mesh((DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _spec4(x) -> P:
  """How a [B|1, N|1, T|1, S|1] mask/bias is sharded: along T if it has one, else along S."""
  if x.shape[2] != 1:
    return P(None, None, AXIS, None)
  if x.shape[3] != 1:
    return P(None, None, None, AXIS)
  return P()


def _layout_fns(layout: str):
  """(to the layout, back to the natural order) along one axis."""
  if layout == "contiguous":
    return (lambda x, axis: jnp.asarray(x)), (lambda x, axis: np.asarray(x))
  return ((lambda x, axis: ring.zigzag_permute(jnp.asarray(x), DEVICES, axis)),
          (lambda x, axis: np.asarray(ring.zigzag_unpermute(jnp.asarray(x), DEVICES, axis))))


def _on_axes4(fn, x):
  """fn applied along the T and S axes of a 4-D mask/bias that has them."""
  for axis in (2, 3):
    if x.shape[axis] != 1:
      x = fn(x, axis)
  return x


def run_ring(case: diff.Case, layout: str, arrs: dict, check_vma: bool = False, **extra):
  """(out, grads) of the ring on the case's global arrays, in the natural order."""
  mesh = _mesh()
  fwd, back = _layout_fns(layout)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  q, k, v, ct = (put(fwd(arrs[n], 1), P(None, AXIS)) for n in ("q", "k", "v", "ct"))
  mask, bias = arrs["mask"], arrs["bias"]
  mask_d = None if mask is None else put(_on_axes4(fwd, mask), _spec4(mask))
  bias_d = None if bias is None else put(_on_axes4(fwd, bias), _spec4(bias))
  specs = (P(None, AXIS),) * 3 + (None if bias is None else _spec4(bias),
                                  None if mask is None else _spec4(mask))

  def local(q, k, v, bias, mask):
    return ring.ring_attention(q, k, v, bias, mask, axis_name=AXIS, weighting=case.weighting,
                               score=case.score, score_params=arrs["score_params"] or None,
                               scale=case.scale, is_causal=case.causal, layout=layout, **extra)

  sm = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, AXIS),
                     check_vma=check_vma)
  loss = lambda q, k, v, b: jnp.sum(sm(q, k, v, b, mask_d).astype(jnp.float32) * ct)
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  out, vjp = jax.jit(lambda *a: (sm(*a, mask_d), jax.grad(loss, argnums)(*a)))(q, k, v, bias_d)
  grads = dict(zip(("q", "k", "v"), (back(g, 1) for g in vjp[:3]), strict=True))
  if bias is not None:
    grads["bias"] = _on_axes4(back, np.asarray(vjp[3]))
  return back(out, 1), grads


def check_case(name: str, check_vma: bool = False) -> dict:
  case, layout = CASES[name]
  start = time.perf_counter()
  arrs, ref, want, scales = diff._reference(case)
  keeps = diff._keeps(case, ref)
  out, grads = run_ring(case, layout, arrs, check_vma=check_vma)
  errs = {"out": diff._error(out, want["out"], keeps["out"], scales["out"])}
  for key, g in grads.items():
    errs[key] = diff._error(g, want[key], keeps[key], scales.get(key))
  # The share of each array's entries compared (the rest touch a kink of F).
  kept = {key: 1.0 if keeps[key] is None else
          float(np.mean(np.broadcast_to(keeps[key], np.shape(want[key])))) for key in errs}
  res = {"errors": errs, "kept": kept, "seconds": time.perf_counter() - start,
         "nonzero_out": float(np.max(np.abs(want["out"])))}
  if name == "sigmoid_none_causal":
    res["shard_length_error"] = _shard_length_error(case, arrs, out, scales["out"])
  return res


def _shard_length_error(case: diff.Case, arrs: dict, out: np.ndarray, scale: float) -> float:
  """How far the ring's output is from the answer a shard-length b = −log(S/P) would give:
  σ(z − log(S/P)) = σ(z − log S + log P), the reference with a bias of log P."""
  wrong = ref_lib.reference(arrs["q"], arrs["k"], arrs["v"], weighting=case.weighting,
                            bias=np.full((1, 1, 1, 1), math.log(DEVICES), np.float32),
                            mask=arrs["mask"], is_causal=case.causal)
  return diff._error(out, wrong.out, None, scale)


def learned_params(check_vma: bool = False) -> dict:
  """SSMax with a learned per-head s and a learned scale (replicated arrays): their gradients
  (summed over the devices by shard_map's transpose) against the dense implementation's on
  the global arrays."""
  case = C(seed=40, t=T, s=T, n=2, weighting="ssmax", causal=True, mask="padding")
  arrs = diff.inputs(case)
  mesh = _mesh()
  fwd, back = _layout_fns("zigzag")
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  q, k, v, ct = (put(fwd(arrs[n], 1), P(None, AXIS)) for n in ("q", "k", "v", "ct"))
  mask = put(fwd(arrs["mask"], 3), P(None, None, None, AXIS))
  s0 = jnp.asarray([0.7, 1.3], jnp.float32)
  scale0 = jnp.asarray(0.4, jnp.float32)

  def local(q, k, v, mask, s, scale):
    return ring.ring_attention(q, k, v, None, mask, axis_name=AXIS, weighting="ssmax",
                               weighting_params={"s": s}, scale=scale, is_causal=True,
                               layout="zigzag")

  sm = jax.shard_map(local, mesh=mesh, in_specs=(P(None, AXIS),) * 3
                     + (P(None, None, None, AXIS), P(), P()), out_specs=P(None, AXIS),
                     check_vma=check_vma)
  ring_loss = lambda s, scale: jnp.sum(sm(q, k, v, mask, s, scale) * ct)
  got = jax.jit(jax.grad(ring_loss, (0, 1)))(s0, scale0)

  def dense_loss(s, scale):
    out = core.attention(arrs["q"], arrs["k"], arrs["v"], mask=arrs["mask"], weighting="ssmax",
                         weighting_params={"s": s}, scale=scale, is_causal=True,
                         implementation="dense")
    return jnp.sum(out * arrs["ct"])

  want = jax.jit(jax.grad(dense_loss, (0, 1)))(s0, scale0)
  # The scale's gradient Σ dq·q cancels: against the float64 brute force's central difference
  # (s = 1, the reference's), not the float32 dense implementation's.
  got_scale = jax.jit(jax.grad(ring_loss, 1))(jnp.ones(2, jnp.float32), scale0)
  eps = 1e-4
  sums = [float(np.sum(ref_lib.reference(arrs["q"], arrs["k"], arrs["v"], weighting="ssmax",
                                         mask=arrs["mask"], is_causal=True,
                                         scale=float(scale0) + d).out * arrs["ct"]))
          for d in (-eps, eps)]
  want_scale = (sums[1] - sums[0]) / (2 * eps)
  # A learned score parameter (bilinear W): its gradient comes through autodiff of the score's
  # dot-product form, outside the ring's custom VJP.
  w0 = jnp.asarray(np.random.default_rng(5).standard_normal((case.h, case.h)) / 3, jnp.float32)

  def local_w(q, k, v, mask, w):
    return ring.ring_attention(q, k, v, None, mask, axis_name=AXIS, weighting="sigmoid",
                               score="bilinear", score_params={"W": w}, is_causal=True,
                               layout="zigzag")

  sm_w = jax.shard_map(local_w, mesh=mesh, in_specs=(P(None, AXIS),) * 3
                       + (P(None, None, None, AXIS), P()), out_specs=P(None, AXIS),
                       check_vma=check_vma)
  got_w = jax.jit(jax.grad(lambda w: jnp.sum(sm_w(q, k, v, mask, w) * ct)))(w0)
  want_w = jax.jit(jax.grad(lambda w: jnp.sum(core.attention(
      arrs["q"], arrs["k"], arrs["v"], mask=arrs["mask"], weighting="sigmoid", score="bilinear",
      score_params={"W": w}, is_causal=True, implementation="dense") * arrs["ct"])))(w0)
  return {name: float(np.max(np.abs(np.asarray(g) - np.asarray(w)))
                      / max(float(np.max(np.abs(np.asarray(w)))), 1e-6))
          for name, g, w in zip(("s", "scale", "bilinear_W"), (got[0], got_scale, got_w),
                                (want[0], want_scale, want_w), strict=True)}


def main() -> None:
  assert len(jax.devices()) == DEVICES, jax.devices()
  names = sys.argv[1:] or [*CASES, "learned_params", *VMA_RUNS]
  out = {}
  for name in names:
    base, vma = name.removesuffix(VMA), name.endswith(VMA)
    out[name] = (learned_params(vma) if base == "learned_params" else check_case(base, vma))
    print(name, json.dumps(out[name]), file=sys.stderr, flush=True)
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
