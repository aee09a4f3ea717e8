"""Pallas kernel benchmark: attnx's Pallas attention for every pointwise F vs cuDNN and JAX's flash.

For each shape (B, T, N, H) with S = T, times the forward pass and forward+backward (grad of
sum(out) w.r.t. q, k, v) on a GPU or TPU of softmax in ``jax.nn.dot_product_attention``
(``"cudnn"`` on a GPU; ``"xla"``, skipped where its T×S scores would not fit) and in JAX's own
Pallas flash attention (Triton ``mha`` on a GPU, ``flash_attention`` on a TPU); optionally
(``"attnx blocked"`` in ``baselines``) attnx's XLA blocked kernel, the fallback of
``implementation=None``, for every F; and ``attnx.core.kernels.pallas`` for every pointwise F
(distance kernels on neg_sq_dist through ``Score.to_dot``, h = √(2H)) and the whole-row
weightings in ``row_weightings`` — in TFLOP/s, 4·B·N·T·S·H FLOPs for fwd and 3.5× that for
fwd+bwd (FlashAttention-2's convention; halved when causal). With ``masks`` (the quick
preset), the ``mask_weightings`` also run causal under a window of ``mask_window`` keys and
``mask_documents`` packed documents through ``core.attention(..., implementation="pallas")``,
beside plain causal attention ("per pair / causal": time per attended pair over plain causal's;
reported, not judged). The "Targets" table checks the kernel issue's target: every pointwise
F at ≥ 60 % of cuDNN softmax's TFLOP/s at T ≥ 4096 (on a TPU, of JAX's flash softmax); the
whole-row weightings have none (their rows do more work per score). On a CPU it writes a
report that says an accelerator is needed and measures nothing.

Command:
  python launch.py --config=experiments/pallas_benchmark.py:default --workdir=runs/pallas_benchmark
  python experiments/pallas_benchmark.py --preset=quick --workdir=/tmp/pb
Runtime on one H100 (2026-11-25): quick at one shape with 4 pointwise F and the 5 whole-row
weightings, 54 s (docs/guides/pallas.md); the full quick and default presets were not timed
there (estimates: ≈ 5 and ≈ 20 min, mostly compilation).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # `python experiments/pallas_benchmark.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402

from attnx import core, train  # noqa: E402
from attnx.train import benchmark as bench  # noqa: E402
from attnx.train import config as train_config  # noqa: E402
from attnx.train.benchmark.ratios import Ratio  # noqa: E402
from attnx.train.benchmark.targets import Target  # noqa: E402

PRESETS = ("default", "quick", "tiny")
# B·T = 16k tokens, 16 heads of 128 (FlashAttention-2's benchmark setup), T = 1k … 32k.
DEFAULT_SHAPES = ("16x1024x16x128,8x2048x16x128,4x4096x16x128,2x8192x16x128,1x16384x16x128,"
                  "1x32768x16x128")
BASELINES = ("cudnn", "xla", "jax pallas flash")
BLOCKED = "attnx blocked"  # optional baseline: attnx's XLA blocked kernel, for every F
MODES = bench.cases.MODES
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
    c.update(dict(shapes="4x4096x16x128,1x16384x16x128", repeats=5, masks=",".join(MASKS)))
  elif name == "tiny":
    c.update(dict(shapes="1x1024x2x128", weightings="softmax,relu,gaussian",
                  row_weightings="stick_breaking", repeats=2, warmup=1))
  return c


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for bad shapes, modes, baselines, weightings, masks or dtype."""
  for key, valid in (("modes", MODES), ("baselines", BASELINES + (BLOCKED,))):
    train_config.check_choices(config, key, train.split_list(config[key]), valid)
  bench.cases.check_weightings(config, pointwise=("weightings",), rows=("row_weightings",),
                               streaming=("mask_weightings",))
  if config.dtype not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"config.dtype must be bfloat16, float16 or float32, got {config.dtype!r}")
  bench.cases.check_masks(config, bench.cases.parse_shapes(config.shapes), MASKS)


def accelerator() -> str | None:
  """``"gpu"`` or ``"tpu"`` if JAX runs on one, else None."""
  platform = jax.default_backend()
  return platform if platform in ("gpu", "tpu") else None


def attention_fn(impl: str, weighting: str, config, platform: str, head_dim: int,
                 mask: str = "", t: int = 0):
  """fn(q, k, v) -> out on [B, T, N, H] arrays, or None where impl does not exist here;
  ``mask`` a masked row's (:data:`MASKS`, or :data:`CAUSAL`): causal, through
  ``core.attention(implementation=core.Pallas(...))``."""
  causal = bool(config.is_causal)
  if impl in BASELINES:
    return bench.programs.baseline_fn(impl, is_causal=causal, platform=platform)
  name, score = bench.cases.case_weighting(weighting, head_dim)
  scale = 1.0 if score == "neg_sq_dist" else 1.0 / math.sqrt(head_dim)
  blocks = dict(block_q=int(config.block_q) or None, block_k=int(config.block_k) or None)
  if impl == BLOCKED or mask:
    return bench.programs.attnx_fn(
        weighting=name, score=score, scale=scale, is_causal=causal or bool(mask),
        implementation="blocked" if impl == BLOCKED else core.Pallas(**blocks),
        **bench.cases.mask_keywords(mask, t, config.mask_window, config.mask_documents))
  return bench.programs.pallas_fn(name, score, scale=scale, is_causal=causal, **blocks)


def attention_for(case: dict[str, Any], config, platform: str):
  """The function a case times (:func:`attention_fn`), or why it is not run."""
  b, t, n, h = case["shape"]
  if case["impl"] == "xla" and b * n * t * t * 6 / GIB > float(config.xla_max_gib):
    return f"skipped: the T×S scores need {b * n * t * t * 6 / GIB:.0f} GiB"
  return (attention_fn(case["impl"], case["weighting"], config, platform, h,
                       case.get("mask", ""), t) or f"n/a on {platform}")


def reference_for(case: dict[str, Any], config, platform: str):
  """The error's reference of a Pallas case: the same call in the blocked kernel."""
  if case["impl"] == OURS:
    return attention_fn(BLOCKED, case["weighting"], config, platform, case["shape"][3],
                        case.get("mask", ""), case["shape"][1])
  return None


def cases(config) -> list[dict[str, Any]]:
  """Per shape and mode: the baselines' softmax, every weighting in the Pallas kernel (and the
  blocked one), and the masked rows with their plain causal twin; errors on the first shape."""
  out = []
  shapes = bench.cases.parse_shapes(config.shapes)
  baselines, masks = train.split_list(config.baselines), train.split_list(config.masks)
  names = bench.cases.pointwise_names(config.weightings) + train.split_list(
      config.row_weightings)
  for shape in shapes:
    for mode in train.split_list(config.modes):
      out += [dict(shape=shape, impl=impl, weighting="softmax", mode=mode)
              for impl in baselines if impl != BLOCKED]
      for name in names:
        out.append(dict(shape=shape, impl=OURS, weighting=name, mode=mode,
                        check_error=shape == shapes[0]))
        if BLOCKED in baselines:
          out.append(dict(shape=shape, impl=BLOCKED, weighting=name, mode=mode))
      out += [dict(shape=shape, impl=OURS, weighting=name, mode=mode, mask=mask,
                   check_error=shape == shapes[0] and mask != CAUSAL)
              for name in (train.split_list(config.mask_weightings) if masks else ())
              for mask in (CAUSAL, *masks)]
  return out


def ratios(config) -> list[Ratio]:
  """TFLOP/s over the baselines' softmax, and the masked rows' time per pair over causal's."""
  over = lambda impl: dict(impl=impl, weighting="softmax", mask="")
  return [Ratio("vs cuDNN softmax", ("shape", "mode"), over("cudnn"), dict(mask=""), "TFLOP/s"),
          Ratio("vs JAX flash", ("shape", "mode"), over("jax pallas flash"), dict(mask=""),
                "TFLOP/s"),
          Ratio("per pair / causal", ("shape", "weighting", "mode"), dict(mask=CAUSAL),
                dict(mask=lambda m: m not in ("", CAUSAL)),
                per=bench.cases.pair_counter(config.mask_window, config.mask_documents))]


def targets(rows: list[dict[str, Any]], config) -> list[dict[str, Any]]:
  """Every pointwise F ≥ target_fraction of cuDNN softmax (TPU: JAX flash) at T ≥ target_min_t.

  One line per (shape, mode): the worst F and its fraction.
  """
  frac, rows_f = float(config.target_fraction), set(train.split_list(config.row_weightings))
  label = lambda f: (f"every F ≥ {frac:.0%} of {f['column'][3:]} TFLOP/s at {f['shape']} "
                     f"({f['mode']}; worst: {f['worst']})")
  where = dict(impl=OURS, weighting=lambda w: w not in rows_f, mask="",
               T=lambda t: t >= int(config.target_min_t))
  return bench.targets.check([Target(label, ("vs cuDNN softmax", "vs JAX flash"), ">=", frac,
                                     where, "{:.0%}", worst=("shape", "mode"), complete=True)],
                             rows)


def caption(config) -> str:
  """The table's caption: how each column was measured."""
  return (
      f"Median of {config.repeats} runs after {config.warmup} warm-up runs; dtype "
      f"{config.dtype}, causal={config.is_causal}, S = T. TFLOP/s counts 4·B·N·T·S·H for fwd "
      "and 3.5× that for fwd+bwd (grad of sum(out) w.r.t. q, k, v)"
      f"{', halved for causal' if config.is_causal else ''}. 'vs cuDNN softmax' / 'vs JAX "
      "flash': TFLOP/s over that baseline's softmax at the same shape and mode. Distance "
      "kernels run on −‖q − k‖² (H + 2 dot-product columns, h = √(2H)) but are counted with "
      "H. Masked rows (causal; 'mask'): TFLOP/s of the pairs they attend; 'per pair / "
      "causal': their time per attended pair over the plain causal row's (mask 'causal'). "
      "Error: max |out − blocked kernel| over the first "
      f"{config.error_queries} queries of the first shape.")


def _report(config, workdir: str) -> train.Report:
  return train.Report(
      "Pallas kernel benchmark: every pointwise F vs cuDNN and JAX's flash softmax", workdir,
      config=config, claim=f"attnx's Pallas kernel runs every pointwise F at ≥ "
      f"{float(config.target_fraction):.0%} of cuDNN softmax's TFLOP/s at T ≥ "
      f"{int(config.target_min_t)}.")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs every case on the accelerator; writes benchmark.md/.json and report.md to `workdir`.

  On a CPU, writes a report saying that an accelerator is needed and returns
  ``{"report": path, "rows": [], "skipped": reason}``.
  """
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  platform = accelerator()
  if platform is None:
    reason = (f"this benchmark needs a GPU or TPU; JAX runs on {jax.default_backend()!r} here "
              f"({jax.devices()}). Nothing was measured.")
    print(f"pallas_benchmark: {reason}")
    rep = _report(config, workdir)
    rep.text(f"**Skipped:** {reason} Run it on a machine with a GPU (CUDA) or TPU, e.g. "
             "`python launch.py --config=experiments/pallas_benchmark.py:quick`.")
    rep.verdict(None, "not measured (no accelerator).")
    return {"report": rep.write(), "rows": [], "skipped": reason}
  t_start = time.time()
  rows = bench.runner.measure_alone(cases(config), config,
                                    lambda c: attention_for(c, config, platform),
                                    lambda c: reference_for(c, config, platform))
  bench.ratios.add_ratios(rows, ratios(config))
  table = train.markdown_table(rows, COLUMNS, caption=caption(config), fmt=bench.format_number)
  elapsed = time.time() - t_start
  bench.save(workdir, {"rows": rows, "columns": COLUMNS, "elapsed_s": elapsed,
                       "platform": platform, "devices": [str(d) for d in jax.devices()],
                       "config": config.to_dict()}, table)
  rep = _report(config, workdir)
  rep.text(f"Devices: {jax.devices()}; total benchmark time {elapsed:.0f} s.")
  goals = targets(rows, config)
  return {"report": bench.targets.write_results(rep, goals, table), "rows": rows,
          "targets": goals}


if __name__ == "__main__":
  from experiments import _common  # noqa: PLC0415

  _common.run_standalone("pallas_benchmark", get_config, run, PRESETS)
