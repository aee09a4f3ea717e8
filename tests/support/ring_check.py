"""Run in a subprocess with 8 fake CPU devices (tests/core/test_ring.py): ring attention
(attnx.core.parallel.ring) against the float64 brute force of the differential net; prints JSON.

Each case is a :class:`support.differential.Case` (its inputs, reference and kink exclusions are
the differential net's) and a layout. The global arrays are cut into 8 shards along the
sequence (zigzag-permuted first for ``layout="zigzag"``), the ring runs inside
``jax.shard_map``, and its output and gradients, put back in the natural order, are compared
with the reference: max |got − want| / scale, the net's scale (the largest Σ|terms| behind an
entry, ≥ max |want|). Usage: ``python ring_check.py [case names...]`` (default: all).

Random draws (:mod:`support.ring_draws`): ``python ring_check.py --ci`` runs the CI sample,
``python ring_check.py --random N --seed S [--kind pointwise|row]`` the N large-run draws of
seeds S, S + 1, ...: each on its own mesh of the draw's first P devices, one line of JSON per
draw, with a ``failure`` (errors over the tolerances, or what the ring raised) or null. A
draw's score modification and sinks (replicated parameters) are compared with their
gradients, as q, k, v and the bias are.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

import jax

from attnx.train import workarounds

workarounds.fake_cpu_devices(8)  # before JAX starts its backend
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from attnx import core  # noqa: E402
from attnx.core import score_mods  # noqa: E402
from attnx.core.parallel import ring, steps  # noqa: E402
from support import differential as diff  # noqa: E402
from support import reference as ref_lib  # noqa: E402
from support import ring_draws  # noqa: E402
from support.ring_cases import (  # noqa: E402
    CASES,
    DEVICES,
    PALLAS,
    PASSES,
    VMA,
    VMA_CASES,
    C,
    T,
)

AXIS = "sp"
VMA_RUNS = [n + VMA for n in (*VMA_CASES, "learned_params")]


def _mesh(devices: int = DEVICES):
  return jax.make_mesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])


def _spec4(x) -> P:
  """How a [B|1, N|1, T|1, S|1] mask/bias is sharded: along T if it has one, else along S."""
  if x.shape[2] != 1:
    return P(None, None, AXIS, None)
  if x.shape[3] != 1:
    return P(None, None, None, AXIS)
  return P()


def _layout_fns(layout: str, devices: int = DEVICES):
  """(to the layout, back to the natural order) along one axis."""
  if layout == "contiguous":
    return (lambda x, axis: jnp.asarray(x)), (lambda x, axis: np.asarray(x))
  return ((lambda x, axis: ring.zigzag_permute(jnp.asarray(x), devices, axis)),
          (lambda x, axis: np.asarray(ring.zigzag_unpermute(jnp.asarray(x), devices, axis))))


def _on_axes4(fn, x):
  """fn applied along the T and S axes of a 4-D mask/bias that has them."""
  for axis in (2, 3):
    if x.shape[axis] != 1:
      x = fn(x, axis)
  return x


def run_ring(case: diff.Case, layout: str, arrs: dict, check_vma: bool = False,
             residual: bool = False, **extra):
  """(out, grads) of the ring on the case's global arrays, in the natural order; with
  ``residual`` (out, grads, residual): the ring returns its residual too (return_residual,
  whose cotangent is then zero: the gradients go through the residual's backward)."""
  mesh = _mesh()
  fwd, back = _layout_fns(layout)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  q, k, v, ct = (put(fwd(arrs[n], 1), P(None, AXIS)) for n in ("q", "k", "v", "ct"))
  mask, bias = arrs["mask"], arrs["bias"]
  mask_d = None if mask is None else put(_on_axes4(fwd, mask), _spec4(mask))
  bias_d = None if bias is None else put(_on_axes4(fwd, bias), _spec4(bias))
  specs = (P(None, AXIS),) * 3 + (None if bias is None else _spec4(bias),
                                  None if mask is None else _spec4(mask))

  structured = arrs["structured"]  # a mask object of the global sequence (replicated)
  # The case's score modification and sinks: replicated parameters (their gradients summed
  # over the devices: by shard_map's transpose, or with check_vma=True by the ring).
  mp = {name: jnp.asarray(x) for name, x in arrs["mod_params"].items()}

  def local(q, k, v, bias, mask, *mods):
    return ring.ring_attention(q, k, v, bias, mask if structured is None else structured,
                               axis_name=AXIS, weighting=case.weighting,
                               score=case.score, score_params=arrs["score_params"] or None,
                               scale=case.scale, is_causal=case.causal, layout=layout,
                               return_residual=residual, **extra,
                               **(diff.score_mod_keywords(case, mods[0]) if mods else {}))

  if mp:
    specs += (P(),)
  sm_both = jax.shard_map(local, mesh=mesh, in_specs=specs,
                          out_specs=(P(None, AXIS),) * 2 if residual else P(None, AXIS),
                          check_vma=check_vma)
  sm = (lambda *a: sm_both(*a)[0]) if residual else sm_both
  mods = (mp,) if mp else ()
  loss = lambda q, k, v, b, *m: jnp.sum(sm(q, k, v, b, mask_d, *m).astype(jnp.float32) * ct)
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  if mp:
    argnums += (4,)
  out, vjp = jax.jit(lambda q, k, v, b, *m: (sm_both(q, k, v, b, mask_d, *m),
                                             jax.grad(loss, argnums)(q, k, v, b, *m)))(
      q, k, v, bias_d, *mods)
  res = None
  if residual:
    out, res = out
    res = back(res, 1)
  grads = dict(zip(("q", "k", "v"), (back(g, 1) for g in vjp[:3]), strict=True))
  if bias is not None:
    grads["bias"] = _on_axes4(back, np.asarray(vjp[3]))
  if mp:
    grads.update({f"mod_{name}": np.asarray(g, np.float64) for name, g in vjp[-1].items()})
  if residual:
    return back(out, 1), grads, res
  return back(out, 1), grads


def check_case(name: str, check_vma: bool = False, pallas: bool = False) -> dict:
  case, layout = CASES[name]
  kernel = dict(implementation=core.Pallas(interpret=True)) if pallas else {}
  start = time.perf_counter()
  arrs, ref, want, scales = diff._reference(case)
  keeps = diff._keeps(case, ref)
  out, grads, residual = run_ring(case, layout, arrs, check_vma=check_vma, residual=True,
                                  kv_head_block=PASSES.get(name), **kernel)
  errs = {"out": diff._error(out, want["out"], keeps["out"], scales["out"])}
  for key, g in grads.items():
    errs[key] = diff._error(g, want[key], keeps[key], scales.get(key))
  # The share of each array's entries compared (the rest touch a kink of F).
  kept = {key: 1.0 if keeps[key] is None else
          float(np.mean(np.broadcast_to(keeps[key], np.shape(want[key])))) for key in errs}
  errs["residual"] = diff.residual_error(case, residual, arrs, ref, keeps["out"])
  kept["residual"] = kept["out"]
  res = {"errors": errs, "kept": kept, "seconds": time.perf_counter() - start,
         "nonzero_out": float(np.max(np.abs(want["out"])))}
  if name == "sigmoid_none_causal":
    res["shard_length_error"] = _shard_length_error(case, arrs, out, scales["out"])
  if name == "softmax_alibi_sinks_zigzag_gqa" and not (check_vma or pallas):
    res["local_positions_error"] = _local_positions_error(case, layout, arrs, want["out"],
                                                          scales["out"], PASSES.get(name))
  return res


def _local_positions_error(case: diff.Case, layout: str, arrs: dict, want: np.ndarray,
                           scale: float, kv_head_block: int | None) -> float:
  """How far the ring's output is from the reference when its score_mod sees the positions
  local to each step's block (the kernels' own) instead of the global ones: what the ALiBi
  case would measure if the ring forgot them."""
  global_piece = steps.StepMod.piece

  def local_piece(self, r0, r1, k0, k1):
    mod, head0 = self.mod, self.head0
    return score_mods.ScoreMod(
        cap=mod.cap, params=mod.params,
        fn=lambda z, b, h, qi, ki, params: mod.fn(z, b, h + head0, qi, ki, params))

  steps.StepMod.piece = local_piece
  try:
    out, _ = run_ring(case, layout, arrs, kv_head_block=kv_head_block)
  finally:
    steps.StepMod.piece = global_piece
  return diff._error(out, want, None, scale)


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

# --------------------------------------------------------------------------------------------
# Random draws (support.ring_draws): the differential net's random sample for the ring.
# --------------------------------------------------------------------------------------------

OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # as tests/core/test_ring.py: relative to the net's scale
# Past those, a draw still passes when the ring is as close to the float64 reference as the
# single-device blocked kernel on the same problem (within this factor): large scores (|z| in
# the tens: magnitude 2, scale 1.7, α = 2) and long stick-breaking rows (dq, a [.., T, 1] bias'
# dbias over 1600 keys) cost the streaming kernels' float32 more than the table's cases, and
# that error is the kernel's, which the ring runs on every shard; a ring bug is orders above it.
KERNEL_FACTOR = 2.0


@functools.lru_cache(maxsize=4)
def _draw_program(case: diff.Case, layout: str, devices: int, bias_spec, mask_spec,
                  scalar_params: tuple, learned: bool, kv_head_block: int | None,
                  pallas: bool):
  """The jitted (output, vjp) program of a draw's configuration: inputs, masks, score
  parameters and the learned s are arguments, so that the arrays are not compiled in."""
  mesh = _mesh(devices)

  def local(q, k, v, bias, mask, params, s, mp):
    return ring.ring_attention(
        q, k, v, bias, mask, axis_name=AXIS, weighting=case.weighting, score=case.score,
        score_params={**params, **dict(scalar_params)} or None,
        weighting_params=None if s is None else {"s": s}, scale=case.scale,
        is_causal=case.causal, layout=layout, kv_head_block=kv_head_block,
        implementation=(core.Pallas(block_q=case.block_q, block_k=case.block_k, interpret=True)
                        if pallas else core.Blocked(block_q=case.block_q, block_k=case.block_k)),
        **diff.score_mod_keywords(case, mp))

  # The score modification's parameters and the sinks (mp): replicated, their gradients summed
  # over the devices by shard_map's transpose.
  specs = (P(None, AXIS),) * 3 + (bias_spec, mask_spec, P(), P() if learned else None, P())
  sm = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, AXIS),
                     check_vma=False)

  @jax.jit
  def both(q, k, v, bias, mask, ct, params, s, mp):
    out, vjp = jax.vjp(lambda q, k, v, bias, mp: sm(q, k, v, bias, mask, params, s, mp),
                       q, k, v, bias, mp)
    return out, vjp(ct)

  return both


def run_draw(d: ring_draws.RingDraw, arrs: dict):
  """(out, grads) of the ring on the draw's global arrays, in the natural order."""
  case, p = d.case, d.devices
  mesh = _mesh(p)
  fwd, back = _layout_fns(d.layout, p)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  q, k, v, ct = (put(fwd(arrs[n], 1), P(None, AXIS)) for n in ("q", "k", "v", "ct"))
  mask, bias = arrs["mask"], arrs["bias"]
  mask_spec = None if mask is None else _spec4(mask)
  bias_spec = None if bias is None else _spec4(bias)
  mask_d = None if mask is None else put(_on_axes4(fwd, mask), mask_spec)
  bias_d = None if bias is None else put(_on_axes4(fwd, bias), bias_spec)
  sp = arrs["score_params"]
  scalars = tuple(sorted((key, val) for key, val in sp.items() if np.isscalar(val)))
  params = {key: put(jnp.asarray(val), P()) for key, val in sp.items() if not np.isscalar(val)}
  s = None if d.learned_s is None else put(jnp.asarray(d.learned_s, jnp.float32), P())
  mp = {key: put(jnp.asarray(val), P()) for key, val in arrs["mod_params"].items()}
  program = _draw_program(case, d.layout, p, bias_spec, mask_spec, scalars,
                          d.learned_s is not None, d.kv_head_block, d.pallas)
  out, grads = program(q, k, v, bias_d, mask_d, ct, params, s, mp)
  got = dict(zip(("q", "k", "v"), (back(g, 1) for g in grads[:3]), strict=True))
  if bias is not None:
    got["bias"] = _on_axes4(back, np.asarray(grads[3]))
  got.update({f"mod_{key}": np.asarray(g, np.float64) for key, g in grads[4].items()})
  return back(out, 1), got


def _reference_per_head(d: ring_draws.RingDraw, arrs: dict):
  """(want, scales, keeps) of SSMax with a learned per-head s: the float64 brute force one
  query head at a time (s_h in the weighting's name), put together like the net's
  :func:`support.differential._reference` (dk, dv and their bounds summed over each group;
  the score modification's per-head parameters and the sinks sliced to the head, their
  gradients put back together along the heads)."""
  case = d.case
  g = case.n // case.kh
  outs, dqs, bias_grads, b_out, b_q, b_bias = [], [], [], [], [], []
  mod_grads: dict[str, list] = {}
  mod_bounds: dict[str, list] = {}
  mp = arrs["mod_params"]  # slopes [N], table [N, W], sinks [N]: the head's rows
  dk, dv = np.zeros(arrs["k"].shape), np.zeros(arrs["v"].shape)
  b_k, b_v = np.zeros(arrs["k"].shape), np.zeros(arrs["v"].shape)
  for h in range(case.n):
    j = h // g
    head = lambda x, h=h: None if x is None else x[:, h:h + 1] if x.shape[1] != 1 else x
    sp = dict(arrs["score_params"])
    if "W" in sp and np.ndim(sp["W"]) == 3:
      sp["W"] = sp["W"][h:h + 1]
    ref = ref_lib.reference(
        arrs["q"][:, :, h:h + 1], arrs["k"][:, :, j:j + 1], arrs["v"][:, :, j:j + 1],
        weighting=f"ssmax:s={d.learned_s[h]!r}", score=case.score, score_params=sp,
        scale=case.scale, bias=head(arrs["bias"]), mask=head(arrs["mask"]),
        is_causal=case.causal, cotangent=arrs["ct"][:, :, h:h + 1],
        score_mod=case.score_mod, cap=diff.soft_cap(case),
        sinks=mp["sinks"][h:h + 1] if "sinks" in mp else None,
        mod_params={key: x[h:h + 1] for key, x in mp.items() if key != "sinks"})
    for key, grad in ref.grads.get("mod", {}).items():
      mod_grads.setdefault(f"mod_{key}", []).append(grad)
      mod_bounds.setdefault(f"mod_{key}", []).append(ref.bounds["mod"][key])
    if "sinks" in ref.grads:
      mod_grads.setdefault("mod_sinks", []).append(ref.grads["sinks"])
      mod_bounds.setdefault("mod_sinks", []).append(ref.bounds["sinks"])
    outs.append(ref.out)
    dqs.append(ref.grads["q"])
    dk[:, :, j] += ref.grads["k"][:, :, 0]
    dv[:, :, j] += ref.grads["v"][:, :, 0]
    b_out.append(ref.bounds["out"])
    b_q.append(ref.bounds["q"])
    b_k[:, :, j] += ref.bounds["k"][:, :, 0]
    b_v[:, :, j] += ref.bounds["v"][:, :, 0]
    if case.bias:
      bias_grads.append(ref.grads["bias"])
      b_bias.append(ref.bounds["bias"])
  want = {"out": np.concatenate(outs, 2), "q": np.concatenate(dqs, 2), "k": dk, "v": dv}
  bounds = {"out": np.concatenate(b_out, 2), "q": np.concatenate(b_q, 2), "k": b_k, "v": b_v}
  if case.bias:
    axes = tuple(a for a, c in enumerate(case.bias) if c == "1")
    want["bias"] = np.concatenate(bias_grads, 1).sum(axis=axes, keepdims=True)
    bounds["bias"] = np.concatenate(b_bias, 1).sum(axis=axes, keepdims=True)
  for key, grads in mod_grads.items():
    want[key] = np.concatenate(grads, 0)
    bounds[key] = np.concatenate(mod_bounds[key], 0)
  scales = {key: float(np.max(b, initial=0.0)) for key, b in bounds.items()}
  floor = 1e-3 * max(scales.values(), default=0.0)
  scales = {key: max(val, floor) for key, val in scales.items()}
  return want, scales, dict.fromkeys(want)  # SSMax has no kink


def _blocked_errors(d: ring_draws.RingDraw, arrs: dict, want: dict, scales: dict,
                    keeps: dict) -> dict:
  """The errors of the single-device blocked kernel (attnx.core.attention) on the draw's
  global arrays, measured like the ring's."""
  case = d.case
  sp = arrs["score_params"]
  wp = None if d.learned_s is None else {"s": jnp.asarray(d.learned_s, jnp.float32)}
  mask = None if arrs["mask"] is None else jnp.asarray(arrs["mask"])

  def fn(q, k, v, bias, mp):
    return core.attention(q, k, v, bias=bias, mask=mask, weighting=case.weighting,
                          score=case.score, score_params=sp or None, weighting_params=wp,
                          scale=case.scale, is_causal=case.causal, implementation="blocked",
                          **diff.score_mod_keywords(case, mp))

  args = [None if arrs[n] is None else jnp.asarray(arrs[n]) for n in ("q", "k", "v", "bias")]
  args.append({key: jnp.asarray(x) for key, x in arrs["mod_params"].items()})
  out, grads = jax.jit(lambda *a: (lambda o, vjp: (o, vjp(jnp.asarray(arrs["ct"]))))(
      *jax.vjp(fn, *a)))(*args)
  got = {"out": out, **dict(zip(("q", "k", "v", "bias"), grads[:4], strict=True)),
         **{f"mod_{key}": g for key, g in grads[4].items()}}
  return {key: diff._error(np.asarray(got[key], np.float64), want[key], keeps[key],
                           scales.get(key)) for key in want}


def check_draw(d: ring_draws.RingDraw) -> dict:
  """One draw against the float64 reference: errors, the share of each array compared, and
  the failure (None when every error is within the tolerances)."""
  start = time.perf_counter()
  res: dict = {"label": d.label()}
  try:
    arrs = diff.inputs(d.case)
    if d.learned_s is None:
      _, ref, want, scales = diff._reference(d.case)
      keeps = diff._keeps(d.case, ref)
      diff._reference.cache_clear()  # the large draws' references are big
    else:
      want, scales, keeps = _reference_per_head(d, arrs)
    res["reference_seconds"] = time.perf_counter() - start
    out, grads = run_draw(d, arrs)
  except Exception as e:  # noqa: BLE001 - any crash is a failure of the draw
    res.update(errors={}, kept={}, nonzero_out=0.0, seconds=time.perf_counter() - start,
               failure=f"raised {type(e).__name__}: {str(e)[:600]}",
               traceback=traceback.format_exc()[-3000:])
    return res
  errs = {"out": diff._error(out, want["out"], keeps["out"], scales["out"])}
  for key, g in grads.items():
    errs[key] = diff._error(g, want[key], keeps[key], scales.get(key))
  kept = {key: 1.0 if keeps[key] is None else
          float(np.mean(np.broadcast_to(keeps[key], np.shape(want[key])))) for key in errs}
  expected = ({"out", "q", "k", "v"} | ({"bias"} if d.case.bias else set())
              | {f"mod_{key}" for key in diff.mod_params(d.case)})
  bad = {key: e for key, e in errs.items()
         if not e <= (OUT_TOL if key == "out" else GRAD_TOL)}
  failure = None
  if bad and set(errs) == expected:
    kernel = _blocked_errors(d, arrs, want, scales, keeps)
    res["blocked_errors"] = kernel
    bad = {key: e for key, e in bad.items() if not e <= KERNEL_FACTOR * kernel[key]}
  if set(errs) != expected:
    failure = f"compared {sorted(errs)}, expected {sorted(expected)}"
  elif bad:
    failure = ", ".join(f"{key} error {e:.3g}" for key, e in bad.items()) + (
        f" (tolerance {OUT_TOL:g}, gradients {GRAD_TOL:g}, or {KERNEL_FACTOR:g} × the "
        f"blocked kernel's: {res.get('blocked_errors')})")
  res.update(errors=errs, kept=kept, nonzero_out=float(np.max(np.abs(want["out"]),
                                                                initial=0.0)),
             seconds=time.perf_counter() - start, failure=failure)
  return res


def run_draws(draws: list[ring_draws.RingDraw]) -> dict:
  out = {}
  for d in draws:
    out[str(d.seed)] = res = check_draw(d)
    print(d.seed, json.dumps({k: v for k, v in res.items() if k != "traceback"}),
          file=sys.stderr, flush=True)
    _draw_program.cache_clear()  # every draw is a configuration of its own
    jax.clear_caches()
  return out


def main() -> None:
  assert len(jax.devices()) == DEVICES, jax.devices()
  if sys.argv[1:2] in (["--ci"], ["--random"]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--ci", action="store_true")
    parser.add_argument("--random", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kind", default=None)
    parser.add_argument("--pallas", action="store_true")
    parser.add_argument("--only", default=None, help="with --ci: the draws' indices, a,b,...")
    args = parser.parse_args()
    draws = (ring_draws.ci_sample() if args.ci
             else ring_draws.large_sample(args.seed, args.random, args.kind, args.pallas))
    if args.only is not None:
      draws = [draws[int(i)] for i in args.only.split(",")]
    print("RESULT " + json.dumps(run_draws(draws)))
    return
  names = sys.argv[1:] or [*CASES, "learned_params", *VMA_RUNS]
  out = {}
  for name in names:
    base, vma, pallas = name.removesuffix(VMA).removesuffix(PALLAS), name.endswith(VMA), \
        name.endswith(PALLAS)
    out[name] = (learned_params(vma) if base == "learned_params"
                 else check_case(base, vma, pallas))
    print(name, json.dumps(out[name]), file=sys.stderr, flush=True)
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
