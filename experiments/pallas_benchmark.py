"""Pallas kernel benchmark: attnx's Pallas attention for every pointwise F vs cuDNN and JAX's flash.

For each shape (B, T, N, H) with S = T, times the forward pass and forward+backward (grad of
sum(out) w.r.t. q, k, v) on a GPU or TPU of

* ``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` (GPU) and ``"xla"``
  (softmax; "xla" materializes the T×S scores and is skipped where they would not fit),
* JAX's own Pallas flash softmax: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton)
  on a GPU, ``jax.experimental.pallas.ops.tpu.flash_attention`` on a TPU,
* optionally (``"attnx blocked"`` in ``baselines``) attnx's XLA blocked kernel for every F
  measured, the fallback of ``implementation=None``,
* ``attnx.core.kernels.pallas`` for softmax and every other pointwise F (the distance
  kernels on score neg_sq_dist through ``Score.to_dot``, bandwidth h = √(2H)) and for the
  whole-row weightings in ``row_weightings`` (SSMax, softpick, stick-breaking, sparsemax,
  1.5-entmax; attnx/core/kernels/pallas/rows.py),

in TFLOP/s, counting 4·B·N·T·S·H FLOPs for fwd and 3.5× that for fwd+bwd (FlashAttention-2's
convention: 2 matmuls forward, 5 backward; halved when causal).

With ``masks`` (``"window,documents"``; the quick preset), the weightings in
``mask_weightings`` also run causal under a structured mask through ``core.attention(...,
implementation="pallas")`` — a causal window of ``mask_window`` keys and ``mask_documents``
packed documents (attnx.core.masks; the kernels skip the tiles outside each tile row's span) —
beside plain causal attention with the same kernels: "per pair / causal" is a masked row's time
per attended (query, key) pair over plain causal attention's (the masks issue's 1.3× target is
the blocked kernel's on a CPU; here it is reported, not judged). The "Targets" table checks the
kernel issue's target: every pointwise F at ≥ 60 % of cuDNN softmax's TFLOP/s at T ≥ 4096 (on
a TPU, of JAX's Pallas flash softmax); the whole-row weightings are reported beside them, with
no target (their rows do more work per score: passes, carries). On a CPU the benchmark needs
an accelerator: it writes a report that says so and returns without measuring anything.

Command:
  python launch.py --config=experiments/pallas_benchmark.py:default --workdir=runs/pallas_benchmark
  python experiments/pallas_benchmark.py --preset=quick --workdir=/tmp/pb
Runtime on one H100 (2026-11-25): quick at one shape with 4 pointwise F and the 5 whole-row
weightings, 54 s (the command and table in docs/guides/pallas.md); the full quick and
default presets were not timed there (estimates: ≈ 5 and ≈ 20 min, mostly compilation).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # `python experiments/pallas_benchmark.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from attnx import core, train  # noqa: E402
from attnx.core import api  # noqa: E402
from attnx.core import weightings as wlib  # noqa: E402
from attnx.core.kernels.pallas import pallas_attention  # noqa: E402
from attnx.core.scores import get_score  # noqa: E402

PRESETS = ("default", "quick", "tiny")
# B·T = 16k tokens, 16 heads of 128 (FlashAttention-2's benchmark setup), T = 1k … 32k.
DEFAULT_SHAPES = ("16x1024x16x128,8x2048x16x128,4x4096x16x128,2x8192x16x128,1x16384x16x128,"
                  "1x32768x16x128")
BASELINES = ("cudnn", "xla", "jax pallas flash")
BLOCKED = "attnx blocked"  # optional baseline: attnx's XLA blocked kernel, for every F
MODES = ("fwd", "fwd+bwd")
MASKS = ("window", "documents")
CAUSAL = "causal"  # the plain causal row the masked rows are compared with
OURS = "attnx pallas"
ROW_WEIGHTINGS = ("ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15")
GIB = 2.0**30
COLUMNS = ["shape", "impl", "weighting", "mode", "mask", "time ms", "TFLOP/s",
           "vs cuDNN softmax", "vs JAX flash", "per pair / causal", "max abs err", "note"]


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  name = "default" if preset in (None, "") else preset
  if name not in PRESETS:
    raise ValueError(f"Unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}.")
  c = train.base_config()
  c.experiment = "pallas_benchmark"
  c.preset = name
  c.shapes = DEFAULT_SHAPES  # "BxTxNxH,..." (S = T)
  c.weightings = ""  # empty = every pointwise weighting
  c.row_weightings = ",".join(ROW_WEIGHTINGS)  # whole-row weightings (no target; "" = none)
  c.baselines = ",".join(BASELINES)
  c.modes = "fwd,fwd+bwd"
  c.dtype = "bfloat16"
  c.is_causal = False
  c.block_q = 0  # 0 = the kernel's default tiles
  c.block_k = 0
  c.repeats = 10  # timed runs per case (median), after `warmup` untimed ones
  c.warmup = 2
  c.xla_max_gib = 16.0  # the "xla" baseline is skipped where its T×S scores need more
  c.error_queries = 256  # max |pallas − blocked| over the first queries of the first shape
  c.target_min_t = 4096
  c.target_fraction = 0.6
  c.masks = ""  # "window,documents": causal rows under a structured mask (and plain causal)
  c.mask_weightings = "softmax,stick_breaking"
  c.mask_window = 512
  c.mask_documents = 16
  if name == "quick":
    c.shapes = "4x4096x16x128,1x16384x16x128"
    c.repeats = 5
    c.masks = ",".join(MASKS)
  elif name == "tiny":
    c.shapes = "1x1024x2x128"
    c.weightings = "softmax,relu,gaussian"
    c.row_weightings = "stick_breaking"
    c.repeats = 2
    c.warmup = 1
  return c


def _shapes(config) -> list[tuple[int, int, int, int]]:
  from experiments import _common  # noqa: PLC0415  (as in the standalone entry below)

  return _common.parse_shapes(config.shapes)


def _weightings(config) -> list[str]:
  return train.split_list(config.weightings) or wlib.list_weightings("pointwise")


def _row_weightings(config) -> list[str]:
  return train.split_list(config.get("row_weightings", ""))


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for bad shapes, modes, baselines, weightings or dtype."""
  _shapes(config)
  for key, valid in (("modes", MODES), ("baselines", BASELINES + (BLOCKED,))):
    bad = [m for m in train.split_list(config[key]) if m not in valid]
    if bad:
      raise ValueError(f"config.{key} has invalid entries {bad}; valid: {', '.join(valid)}")
  for name in _weightings(config):
    if not isinstance(wlib.get_weighting(name), wlib.Pointwise):
      raise ValueError(f"config.weightings: {name!r} is not a pointwise (streamable) weighting")
  for name in _row_weightings(config):
    w = wlib.get_weighting(name)
    if w.kind != "row" or not api.streams(w):
      raise ValueError(f"config.row_weightings: {name!r} is not a whole-row weighting with a "
                       f"Pallas kernel; valid: {', '.join(wlib.list_weightings('row'))}")
  if config.dtype not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"config.dtype must be bfloat16, float16 or float32, got {config.dtype!r}")
  bad = [m for m in train.split_list(config.masks) if m not in MASKS]
  if bad:
    raise ValueError(f"config.masks has invalid entries {bad}; valid: {', '.join(MASKS)}")
  for name in train.split_list(config.mask_weightings):
    if not api.streams(wlib.get_weighting(name)):
      raise ValueError(f"config.mask_weightings: {name!r} has no Pallas kernel")
  if train.split_list(config.masks) and min(int(config.mask_window),
                                            int(config.mask_documents)) < 1:
    raise ValueError("config.mask_window and config.mask_documents must be >= 1")


def case_weighting(name: str, head_dim: int) -> tuple[str, str]:
  """(weighting, score): distance kernels run on neg_sq_dist with h = √(2H) unless given."""
  w = wlib.get_weighting(name)
  if not getattr(w, "distance_kernel", False):
    return name, "scaled_dot"
  if "h" not in wlib.parse_weighting_name(name)[1]:
    name = f"{name}{',' if ':' in name else ':'}h={np.sqrt(2.0 * head_dim):.3g}"
  return name, "neg_sq_dist"


def accelerator() -> str | None:
  """``"gpu"`` or ``"tpu"`` if JAX runs on one, else None."""
  platform = jax.default_backend()
  return platform if platform in ("gpu", "tpu") else None


# --------------------------------------------------------------------------------------------
# The functions under test.
# --------------------------------------------------------------------------------------------

def _mask_sizes(mask: str, config) -> dict[str, int | None]:
  return train.benchmark.mask_sizes(mask, config.mask_window, config.mask_documents)


def _attn_fn(impl: str, weighting: str, config, platform: str, head_dim: int, mask: str = "",
             t: int = 0):
  """fn(q, k, v) -> out on [B, T, N, H] arrays, or None where impl does not exist here;
  ``mask`` a masked row's (:data:`MASKS`, or :data:`CAUSAL`): causal, through
  ``core.attention(implementation=core.Pallas(...))``."""
  causal = bool(config.is_causal)
  sm_scale = 1.0 / math.sqrt(head_dim)
  if impl in ("cudnn", "xla"):
    if impl == "cudnn" and platform != "gpu":
      return None
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=impl)
  if impl == "jax pallas flash":
    if platform == "gpu":
      from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # noqa: PLC0415
      return lambda q, k, v: gpu_attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal)
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # noqa: PLC0415
    bnth = lambda x: x.transpose(0, 2, 1, 3)
    return lambda q, k, v: bnth(tpu_flash.flash_attention(bnth(q), bnth(k), bnth(v),
                                                          causal=causal, sm_scale=sm_scale))
  name, score = case_weighting(weighting, head_dim)
  w = wlib.get_weighting(name)
  scale = 1.0 if score == "neg_sq_dist" else sm_scale
  blocks = dict(block_q=int(config.block_q) or None, block_k=int(config.block_k) or None)
  if impl == BLOCKED:
    return lambda q, k, v: core.attention(q, k, v, weighting=name, score=score, scale=scale,
                                          is_causal=causal, implementation="blocked")
  if mask:
    extra = train.benchmark.mask_keywords(t, **_mask_sizes(mask, config))
    return lambda q, k, v: core.attention(q, k, v, weighting=name, score=score, scale=scale,
                                          is_causal=True, implementation=core.Pallas(**blocks),
                                          **extra)

  def ours(q, k, v):
    qd, kd = get_score(score).to_dot(q, k)  # what attnx.core.attention does for a score
    dt = q.dtype
    return pallas_attention(qd.astype(dt), kd.astype(dt), v, weighting=w, scale=scale,
                            is_causal=causal, **blocks)
  return ours


def _program(fn, mode: str):
  if mode == "fwd":
    return fn
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def _flops(shape, mode: str, causal: bool, pairs: float | None = None) -> float:
  """FLOPs of the scores a problem needs: 4·B·N·(pairs)·H, pairs T² (T²/2 causal) unless
  given (a masked row's attended pairs); 3.5× for fwd+bwd."""
  b, t, n, h = shape
  pairs = t * t * (0.5 if causal else 1.0) if pairs is None else pairs
  f = 4.0 * b * n * pairs * h
  return f * (3.5 if mode == "fwd+bwd" else 1.0)


def _pairs(mask: str, t: int, config) -> int:
  """The (query, key) pairs a masked row (or the plain causal one) attends."""
  return train.benchmark.attended_pairs(t, True, **_mask_sizes(mask, config))


def _time(compiled, args, config) -> float:
  for _ in range(max(int(config.warmup), 0)):
    jax.block_until_ready(compiled(*args))
  ts = []
  for _ in range(max(int(config.repeats), 1)):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def run_case(case: dict[str, Any], inputs, config, platform: str) -> dict[str, Any]:
  """Compiles and times one case; a case that cannot run gets a note instead of a time."""
  shape, impl, weighting, mode = case["shape"], case["impl"], case["weighting"], case["mode"]
  b, t, n, h = shape
  mask = case.get("mask", "")
  row: dict[str, Any] = {"shape": "x".join(map(str, shape)), "impl": impl,
                         "weighting": case_weighting(weighting, h)[0], "mode": mode}
  if mask:
    row["mask"] = mask
  if impl == "xla" and b * n * t * t * 6 / GIB > float(config.xla_max_gib):
    row["note"] = f"skipped: the T×S scores need {b * n * t * t * 6 / GIB:.0f} GiB"
    return row
  fn = _attn_fn(impl, weighting, config, platform, h, mask, t)
  if fn is None:
    row["note"] = f"n/a on {platform}"
    return row
  try:
    compiled = jax.jit(_program(fn, mode)).lower(*inputs).compile()
    seconds = _time(compiled, inputs, config)
  except Exception as e:  # noqa: BLE001 - a failed case is a result, not a crash
    row["note"] = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    return row
  row["time ms"] = 1e3 * seconds
  pairs = _pairs(mask, t, config) if mask else None
  row["TFLOP/s"] = _flops(shape, mode, bool(config.is_causal), pairs) / seconds / 1e12
  if case.get("check_error") and impl == OURS and mode == "fwd":
    row["max abs err"] = _error(fn, weighting, inputs, config, h, mask)
  return row


def _error(fn, weighting: str, inputs, config, head_dim: int, mask: str = "") -> float:
  """max |pallas − blocked| over the first `error_queries` queries (same dtype and device)."""
  name, score = case_weighting(weighting, head_dim)
  scale = 1.0 if score == "neg_sq_dist" else 1.0 / math.sqrt(head_dim)
  extra = (train.benchmark.mask_keywords(inputs[0].shape[1], **_mask_sizes(mask, config))
           if mask else {})

  def ref(q, k, v):
    return core.attention(q, k, v, weighting=name, score=score, scale=scale,
                          is_causal=bool(config.is_causal) or bool(mask),
                          implementation="blocked", **extra)
  nq = int(config.error_queries)
  got, want = (np.asarray(jax.jit(f)(*inputs)[:, :nq], np.float32) for f in (fn, ref))
  return float(np.max(np.abs(got - want)))


def _cases(config) -> list[dict[str, Any]]:
  cases = []
  shapes = _shapes(config)
  for shape in shapes:
    for mode in train.split_list(config.modes):
      baselines = train.split_list(config.baselines)
      for impl in baselines:
        if impl != BLOCKED:
          cases.append(dict(shape=shape, impl=impl, weighting="softmax", mode=mode))
      for name in _weightings(config) + _row_weightings(config):
        cases.append(dict(shape=shape, impl=OURS, weighting=name, mode=mode,
                          check_error=shape == shapes[0]))
        if BLOCKED in baselines:
          cases.append(dict(shape=shape, impl=BLOCKED, weighting=name, mode=mode))
      masks = train.split_list(config.masks)
      for name in train.split_list(config.mask_weightings) if masks else ():
        for mask in (CAUSAL, *masks):
          cases.append(dict(shape=shape, impl=OURS, weighting=name, mode=mode, mask=mask,
                            check_error=shape == shapes[0] and mask != CAUSAL))
  return cases


def _add_mask_ratios(rows: list[dict[str, Any]], config) -> None:
  """'per pair / causal' of every masked row: its time per attended pair over the plain
  causal row's (same shape, weighting and mode)."""
  per_pair = {}
  for r in rows:
    if r.get("mask") and "time ms" in r:
      t = int(r["shape"].split("x")[1])
      per_pair[(r["shape"], r["weighting"], r["mode"], r["mask"])] = (
          r["time ms"] / _pairs(r["mask"], t, config))
  for r in rows:
    key = (r["shape"], r["weighting"], r["mode"])
    if r.get("mask") not in (None, CAUSAL) and (*key, r["mask"]) in per_pair:
      base = per_pair.get((*key, CAUSAL))
      if base:
        r["per pair / causal"] = per_pair[(*key, r["mask"])] / base


def _add_ratios(rows: list[dict[str, Any]]) -> None:
  best = {(r["shape"], r["mode"], r["impl"]): r.get("TFLOP/s") for r in rows
          if r["weighting"] == "softmax" and not r.get("mask")}
  for r in rows:
    if "TFLOP/s" not in r or r.get("mask"):
      continue
    for col, impl in (("vs cuDNN softmax", "cudnn"), ("vs JAX flash", "jax pallas flash")):
      ref = best.get((r["shape"], r["mode"], impl))
      if ref:
        r[col] = r["TFLOP/s"] / ref


def targets(rows: list[dict[str, Any]], config) -> list[dict[str, Any]]:
  """Every pointwise F ≥ target_fraction of cuDNN softmax (TPU: JAX flash) at T ≥ target_min_t.

  One line per (shape, mode): the worst F and its fraction.
  """
  out = []
  row_names = set(_row_weightings(config))
  for (shape, mode) in dict.fromkeys((r["shape"], r["mode"]) for r in rows):
    if int(shape.split("x")[1]) < int(config.target_min_t):
      continue
    ours = [r for r in rows if r["shape"] == shape and r["mode"] == mode and r["impl"] == OURS
            and r["weighting"] not in row_names and not r.get("mask")]
    for col in ("vs cuDNN softmax", "vs JAX flash"):
      fractions = {r["weighting"]: r.get(col) for r in ours}
      if any(v is None for v in fractions.values()) or not fractions:
        continue
      worst = min(fractions, key=fractions.get)
      frac = float(config.target_fraction)
      out.append({"target": f"every F ≥ {frac:.0%} of {col[3:]} TFLOP/s at {shape} ({mode}; "
                            f"worst: {worst})",
                  "measured": f"{fractions[worst]:.0%}",
                  "met": "yes" if fractions[worst] >= frac else "**no**"})
      break  # cuDNN when there is one, else JAX's flash kernel
  return out


def markdown_table(rows: list[dict[str, Any]], config) -> str:
  lines = [
      f"*Median of {config.repeats} runs after {config.warmup} warm-up runs; dtype "
      f"{config.dtype}, causal={config.is_causal}, S = T. TFLOP/s counts 4·B·N·T·S·H for fwd "
      "and 3.5× that for fwd+bwd (grad of sum(out) w.r.t. q, k, v)"
      f"{', halved for causal' if config.is_causal else ''}. 'vs cuDNN softmax' / 'vs JAX "
      "flash': TFLOP/s over that baseline's softmax at the same shape and mode. Distance "
      "kernels run on −‖q − k‖² (H + 2 dot-product columns, h = √(2H)) but are counted with "
      "H. Masked rows (causal; 'mask'): TFLOP/s of the pairs they attend; 'per pair / "
      "causal': their time per attended pair over the plain causal row's (mask 'causal'). "
      "Error: max |out − blocked kernel| over the first "
      f"{config.error_queries} queries of the first shape.*",
      "",
      "| " + " | ".join(COLUMNS) + " |",
      "|" + "|".join("---" for _ in COLUMNS) + "|",
  ]
  for r in rows:
    cells = (train.benchmark.format_number(r.get(c, "")) for c in COLUMNS)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs every case on the accelerator; writes benchmark.md/.json and report.md to `workdir`.

  On a CPU, writes a report saying that an accelerator is needed and returns
  ``{"report": path, "rows": [], "skipped": reason}``.
  """
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  title = "Pallas kernel benchmark: every pointwise F vs cuDNN and JAX's flash softmax"
  claim = ("attnx's Pallas kernel runs every pointwise F at ≥ "
           f"{float(config.target_fraction):.0%} of cuDNN softmax's TFLOP/s at T ≥ "
           f"{int(config.target_min_t)}.")
  platform = accelerator()
  if platform is None:
    reason = (f"this benchmark needs a GPU or TPU; JAX runs on {jax.default_backend()!r} here "
              f"({jax.devices()}). Nothing was measured.")
    print(f"pallas_benchmark: {reason}")
    rep = train.Report(title, workdir, config=config, claim=claim)
    rep.text(f"**Skipped:** {reason} Run it on a machine with a GPU (CUDA) or TPU, e.g. "
             "`python launch.py --config=experiments/pallas_benchmark.py:quick`.")
    rep.verdict(None, "not measured (no accelerator).")
    return {"report": rep.write(), "rows": [], "skipped": reason}

  t_start = time.time()
  dtype = jnp.dtype(config.dtype)
  cases = _cases(config)
  rows: list[dict[str, Any]] = []
  for shape in dict.fromkeys(c["shape"] for c in cases):
    ks = jax.random.split(jax.random.PRNGKey(int(config.seed)), 3)
    inputs = tuple(jax.random.normal(kk, shape, dtype) for kk in ks)
    for case in (c for c in cases if c["shape"] == shape):
      rows.append(run_case(case, inputs, config, platform))
      r = rows[-1]
      print(f"{r['shape']} {r['impl']} {r['weighting']} {r['mode']} {r.get('mask', '')}: "
            f"{train.benchmark.format_number(r.get('TFLOP/s', r.get('note', '')))}", flush=True)
  _add_ratios(rows)
  _add_mask_ratios(rows, config)
  table = markdown_table(rows, config)
  elapsed = time.time() - t_start
  with open(os.path.join(workdir, "benchmark.md"), "w") as f:
    f.write(table)
  with open(os.path.join(workdir, "benchmark.json"), "w") as f:
    json.dump({"rows": rows, "columns": COLUMNS, "elapsed_s": elapsed, "platform": platform,
               "devices": [str(d) for d in jax.devices()], "config": config.to_dict()},
              f, indent=1, default=str)

  rep = train.Report(title, workdir, config=config, claim=claim)
  rep.text(f"Devices: {jax.devices()}; total benchmark time {elapsed:.0f} s.")
  goals = targets(rows, config)
  if goals:
    rep.section("Targets")
    rep.table(goals, columns=["target", "measured", "met"])
    missed = [g["target"] for g in goals if g["met"] != "yes"]
    rep.verdict(not missed, "every target met." if not missed else
                f"{len(goals) - len(missed)} of {len(goals)} targets met; missed: "
                + "; ".join(missed) + ".")
  rep.section("Results")
  rep.text(table)
  return {"report": rep.write(), "rows": rows, "targets": goals}


if __name__ == "__main__":
  from experiments import _common  # noqa: PLC0415

  _common.run_standalone("pallas_benchmark", get_config, run, PRESETS)
