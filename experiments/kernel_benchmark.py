"""Kernel benchmark: attnx blocked (flash-style) and dense attention vs jax.nn and flax.linen.

For each shape (B, T, N, H) with S = T keys, times the forward pass and forward+backward (grad
of sum(out) w.r.t. q, k, v) of softmax in ``jax.nn.dot_product_attention(implementation="xla")``,
``flax.linen.dot_product_attention`` and ``attnx.core.attention(implementation="dense")`` (they
materialize the T×S scores), and of softmax and every other pointwise F in attnx's blocked
kernel (``implementation="blocked"``: online softmax, Dao et al. 2022 / Rabe & Staats 2021);
with the ``rows`` preset, the whole-row weightings (``row_weightings``: SSMax, softpick,
stick-breaking, sparsemax, 1.5-entmax, α-entmax) blocked and dense up to ``row_max_scores``
scores per head, longer shapes compiled for their memory only. It reports the median time,
GFLOP/s, the fraction of this machine's float32 matmul rate, XLA's scratch and peak memory and
the max abs error against a float64 reference on the first queries. Every case runs full and
causal, timed side by side ("causal / full": ideally 0.5). With ``masks`` (the ``masks``
preset), the blocked causal cases also run under a structured mask — a sliding window, packed
documents (attnx.core.masks; the kernels skip the tiles it empties) — with their time per
attended pair over plain causal attention's; the ``mask_costs`` preset adds the window as a
dense mask and batches of unmasked problems of the same pairs, each row per attended pair over
plain causal at T = 16 384. The report's "Targets" table checks the kernel issue's targets
(:data:`TARGETS`) against the measured values.

This file declares the cases, the ratio and target tables and the report; how they are
measured (timing, memory, the reference, the table's caption, the figures) is
attnx.train.benchmark's.

Command:
  python launch.py --config=experiments/kernel_benchmark.py:default --workdir=runs/kernel_benchmark
  python launch.py --config=experiments/kernel_benchmark.py:masks --workdir=runs/kb_masks
  python experiments/kernel_benchmark.py --preset=tiny --workdir=/tmp/kb
Expected runtime on 2 CPU cores, full rows alone (``--config.causal=full``): tiny < 30 s,
quick ≈ 3 min, default ≈ 7.5 min; causal rows double it. Expected result (2-core Intel Xeon
with AVX-512, jax 0.10.2): blocked softmax forward ≈ 3–4.7× jax.nn at T = 4096 (jax.nn alone
varies by ±20 % between runs) at ≈ 46 % of the matmul rate (65–68 % on a 2-core AMD EPYC),
forward+backward ≈ 3.6×, ≈ 21× less scratch memory; every pointwise F within ≈ 1.15× of
softmax; T = 65536 runs only blocked (the dense T×S scores would need 16 GiB), fwd+bwd in
≈ 60 MiB of scratch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # `python experiments/kernel_benchmark.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402

from attnx import train  # noqa: E402
from attnx.core import weightings as wlib  # noqa: E402
from attnx.train import benchmark as bench  # noqa: E402
from attnx.train import config as train_config  # noqa: E402
from attnx.train.benchmark.ratios import Ratio  # noqa: E402
from attnx.train.benchmark.targets import Target  # noqa: E402

DEFAULT_SHAPES = "8x256x8x64,2x1024x8x64,1x4096x4x64,1x16384x1x64,1x65536x1x64"
ROW_WEIGHTINGS = ("ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15",
                  "entmax:alpha=1.3")
BASELINES = ("jax.nn (xla)", "flax.linen", "attnx dense")
MODES = bench.cases.MODES
CAUSAL = ("full", "causal")
MASKS = bench.cases.MASKS  # on top of causal: a window, packed documents, a dense window
BLK, JNN = "attnx blocked", "jax.nn (xla)"


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment = "kernel_benchmark"
  c.shapes = DEFAULT_SHAPES  # "BxTxNxH,..." (S = T)
  c.weightings = ""  # blocked weightings; empty = every pointwise weighting
  # Shapes with more than this many scores per head time only `large_weightings` (blocked).
  c.all_weightings_max_scores = 4096 * 4096
  c.large_weightings = "softmax,relu"
  # ... and shapes with more than this many scores per head only `huge_weightings`.
  c.huge_min_scores = 32768 * 32768
  c.huge_weightings = "softmax"
  # Whole-row weightings, blocked and dense ("attnx dense"), timed up to this many scores per
  # head; above it their blocked fwd+bwd is compiled for its memory only (not run). Empty in
  # the default preset (the `rows` preset runs them all).
  c.row_weightings = ""
  c.row_max_scores = 4096 * 4096
  # Shapes with more scores per head than this are compiled but not run (0 = run every shape).
  c.memory_only_min_scores = 0
  c.modes = "fwd,fwd+bwd"
  c.baselines = ",".join(BASELINES)
  c.dtype = "float32"
  c.causal = "full,causal"  # "full" and/or "causal" rows of every case
  # Causal rows of the blocked cases under a structured mask too: "window" (the last
  # `mask_window` keys up to the query) and/or "documents" (`mask_documents` packed documents
  # of equal length, segment ids), e.g. "window,documents"; empty = none.
  c.masks = ""  # "dense_window": the window as a dense [T, S] boolean mask (no tile skipped)
  c.mask_window = 512
  c.mask_documents = 16
  c.block_q = 0  # 0 = the kernel's default
  c.block_k = 0
  c.repeats = 5  # timed runs per case, round-robin (median): jax.nn alone varies by ±20 %
  c.long_run_s = 2.0  # a case whose first run takes longer than this is timed once
  c.dense_max_gib = 8.0  # baselines whose scratch memory would exceed this are skipped
  c.error_queries = 256  # float64 reference on the first queries (error column)
  c.matmul_size = 2048
  return c


def _quick(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/kernel_benchmark.py:quick (≈ 3 min): the first
  three default shapes (T ≤ 4096)."""
  c.shapes = ",".join(DEFAULT_SHAPES.split(",")[:3])


def _tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/kernel_benchmark.py:tiny (< 30 s): two small
  shapes, four pointwise weightings and sparsemax, one timed run (a smoke test; the timings
  mean nothing)."""
  c.update(dict(shapes="2x64x2x16,1x128x2x32", repeats=1, matmul_size=512,
                weightings="softmax,relu,gaussian,triangular", error_queries=32,
                row_weightings="sparsemax", masks="window,documents", mask_window=24,
                mask_documents=4))


def _rows(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/kernel_benchmark.py:rows (≈ 25 min): the
  whole-row weightings against blocked softmax and their dense form at T = 256 … 4096, and
  the memory of their blocked fwd+bwd at T = 65 536 (compiled, not run)."""
  c.update(dict(shapes="8x256x8x64,2x1024x8x64,1x4096x4x64,1x65536x1x64",
                weightings="softmax", baselines="", memory_only_min_scores=4096 * 4096,
                row_weightings=",".join(ROW_WEIGHTINGS)))


def _masks(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/kernel_benchmark.py:masks (≈ 5 min): blocked
  fwd+bwd of softmax and stick-breaking, full, causal, causal + a 512-key window and causal +
  16 packed documents, at T = 1024 … 16 384 (N = 2, H = 64): the structured-mask targets and
  figure."""
  c.update(dict(shapes="1x1024x2x64,1x4096x2x64,1x16384x2x64", weightings="softmax",
                baselines="", modes="fwd+bwd", masks="window,documents",
                row_weightings="stick_breaking", row_max_scores=16384 * 16384,
                dense_max_gib=0.0))


def _mask_costs(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/kernel_benchmark.py:mask_costs: what a score costs
  under each mask and without one (docs/guides/masks.md): the ``masks`` preset's rows at
  T = 16 384, the window also as a dense [T, S] mask, and the same pairs as batches of unmasked
  problems — the 16 documents alone (16×1024, causal), rows of 512 keys (32×512, full), tiles
  of side 256 … 1024 — each row's time per attended pair over plain causal's at T = 16 384."""
  _masks(c)
  c.update(dict(shapes="1x16384x2x64,16x1024x2x64,32x512x2x64,64x256x2x64",
                masks="window,documents,dense_window"))
  # Every blocked row's time per attended pair of its batch over the plain causal row's at
  # this shape, across shapes (without it: a masked row's over its own shape's).
  c.pair_reference = "1x16384x2x64"


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "quick": _quick, "tiny": _tiny, "rows": _rows, "masks": _masks,
    "mask_costs": _mask_costs}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS` (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "kernel_benchmark")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for bad shapes, modes, baselines, weightings, masks or dtype."""
  for key, valid in (("modes", MODES), ("baselines", BASELINES), ("causal", CAUSAL)):
    train_config.check_choices(config, key, train.split_list(config[key]), valid)
  bench.cases.check_weightings(config, pointwise=("weightings", "large_weightings",
                                                  "huge_weightings"), rows=("row_weightings",))
  bench.cases.check_masks(config, bench.cases.parse_shapes(config.shapes))
  if config.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"config.dtype must be float32 or bfloat16, got {config.dtype!r}")


def cases(config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """Per shape, mode and causality: the baselines' softmax, every blocked weighting, the
  whole-row weightings blocked and dense; per mask, the blocked causal cases under it."""
  out, case = [], bench.cases.case
  rows = train.split_list(config.row_weightings)
  for shape in bench.cases.parse_shapes(config.shapes):
    t = shape[1]
    names = bench.cases.pointwise_names(config.weightings)
    if t * t > int(config.huge_min_scores):
      names = train.split_list(config.huge_weightings)
    elif t * t > int(config.all_weightings_max_scores):
      names = train.split_list(config.large_weightings)
    row_timed = t * t <= int(config.row_max_scores)
    for mode in train.split_list(config.modes):
      for causal in (c == "causal" for c in train.split_list(config.causal)):
        out += [case(shape, impl, "softmax", mode, causal=causal)
                for impl in train.split_list(config.baselines)]
        out += [case(shape, BLK, name, mode, causal=causal) for name in names]
        if not row_timed and mode == "fwd":
          continue  # long shapes: the memory of fwd+bwd only
        out += [case(shape, impl, name, mode, causal=causal, memory_only=not row_timed)
                for name in rows for impl in ((BLK, "attnx dense") if row_timed else (BLK,))]
      out += [case(shape, BLK, name, mode, causal=True, mask=mask)  # + a structured mask
              for mask in train.split_list(config.masks) for name in names + rows]
  return out


def ratios(config: ml_collections.ConfigDict | None = None) -> list[Ratio]:
  """The ratio columns (per pair / causal needs ``config``'s mask sizes)."""
  # The softmax of each score, against which the cost of every other F on it is measured: on
  # neg_sq_dist the sum-normalized Gaussian kernel is softmax(s / 2h²), streamed the same way.
  softmax_of = {"scaled_dot": "softmax", "neg_sq_dist": "gaussian"}
  same = ("shape", "mode", "causal", "mask")
  out = [Ratio("speed-up vs jax.nn", same, dict(impl=JNN, weighting="softmax"), invert=True),
         Ratio("time / softmax", (*same, "score"),
               dict(impl=BLK, family=lambda f: softmax_of.get(f["score"])), dict(impl=BLK)),
         Ratio("causal / full", ("shape", "mode", "impl", "weighting"),
               dict(causal=False, mask=""), dict(causal=True))]
  if config is not None and config.get("pair_reference"):  # across shapes (mask_costs)
    out.append(Ratio("per pair / causal", ("mode", "impl", "weighting"),
                     dict(shape=config.pair_reference, causal=True, mask=""), dict(impl=BLK),
                     per=bench.cases.pair_counter(config.mask_window, config.mask_documents,
                                                  batch=True)))
  elif config is not None:
    out.append(Ratio("per pair / causal", ("shape", "mode", "impl", "weighting"),
                     dict(causal=True, mask=""), dict(mask=bool),
                     per=bench.cases.pair_counter(config.mask_window, config.mask_documents)))
  return out + [Ratio("speed-up vs dense", (*same, "weighting"), dict(impl="attnx dense"),
                      dict(impl=BLK, weighting=lambda w: w != "softmax"), invert=True)]


COLUMNS = [*bench.runner.CELLS, "speed-up vs jax.nn", "time / softmax", "causal / full",
           "per pair / causal", "speed-up vs dense", "note"]

# The targets of the kernel issue, checked on the T = 4096 and T = 65536 shapes of a run.
TARGET_SHAPE = "1x4096x4x64"
LONG_SHAPE = "1x65536x1x64"
CAUSAL_MIN_T, CAUSAL_TARGET = 1024, 0.6  # causal attention at (about) half the cost
# Whole-row weightings: causal fwd+bwd time over blocked softmax at TARGET_SHAPE (by family
# name: "entmax" is α-entmax by bisection), blocked over dense, scratch memory at LONG_SHAPE.
ROW_TIME_TARGETS = {"ssmax": 1.3, "softpick": 1.3, "stick_breaking": 2.0, "sparsemax": 3.0,
                    "entmax15": 3.0, "entmax": 5.0}
ROW_DENSE_MIN_T, ROW_DENSE_TARGET = 1024, 2.0  # blocked faster from T = 1024, 2× at T = 4096
ROW_MEMORY_TARGET_MIB = 256.0
# Structured masks: time per attended pair within this factor of plain causal attention's,
# fwd+bwd at MASK_TARGET_SHAPE (softmax and a whole-row F).
MASK_TARGET_SHAPE, MASK_TARGET = "1x16384x2x64", 1.3

_FULL = dict(causal=False, mask="")
_SOFTMAX = dict(shape=TARGET_SHAPE, impl=BLK, weighting="softmax", **_FULL)
_ROW = dict(impl=BLK, family=lambda f: f in ROW_TIME_TARGETS, mode="fwd+bwd", mask="")
TARGETS = (
    Target("blocked softmax fwd ≥ 4× jax.nn at {shape}", "speed-up vs jax.nn", ">=", 4,
           dict(_SOFTMAX, mode="fwd"), "{:.2f}×"),
    Target("blocked softmax fwd ≥ 60 % of the matmul rate at {shape}", "% matmul", ">=", 60,
           dict(_SOFTMAX, mode="fwd"), "{:.0f} %"),
    Target("blocked softmax fwd+bwd ≥ 2× autodiff through jax.nn at {shape}",
           "speed-up vs jax.nn", ">=", 2, dict(_SOFTMAX, mode="fwd+bwd"), "{:.2f}×"),
    *(t for mode in MODES for t in (
        Target("every pointwise F within 1.2× of softmax at {shape} ({mode}; worst: {worst})",
               "time / softmax", "<=", 1.2, dict(shape=TARGET_SHAPE, mode=mode, impl=BLK,
                                                 weighting=lambda w: isinstance(
                                                     wlib.get_weighting(w), wlib.Pointwise),
                                                 **_FULL),
               "{:.2f}×", worst=("shape", "mode"), min_rows=2),
        Target("scratch memory ≥ 20× lower than jax.nn at {shape} ({mode})", "scratch MiB",
               ">=", 20, dict(_SOFTMAX, mode=mode), "{:.0f}× lower", over=dict(impl=JNN)))),
    Target("one-head fwd+bwd at {shape} under 2 GiB peak", "peak MiB", "<", 2048,
           dict(_SOFTMAX, shape=LONG_SHAPE, mode="fwd+bwd"), "{:.0f} MiB"),
    (Target("{weighting} causal fwd+bwd ≤ {bound}× blocked softmax at {shape}",
            "time / softmax", "<=", lambda f: ROW_TIME_TARGETS[f["family"]],
            dict(_ROW, causal=True, shape=TARGET_SHAPE), "{:.2f}×"),
     Target("{weighting} blocked ≥ {bound:g}× faster than dense at {shape} ({causality}, "
            "fwd+bwd)", "speed-up vs dense", ">=",
            lambda f: ROW_DENSE_TARGET if f["shape"] == TARGET_SHAPE else 1.0,
            dict(_ROW, T=lambda t: t >= ROW_DENSE_MIN_T), "{:.2f}×"),
     Target("{weighting} blocked fwd+bwd scratch < {bound:.0f} MiB at {shape}", "scratch MiB",
            "<", ROW_MEMORY_TARGET_MIB, dict(_ROW, shape=LONG_SHAPE, causal=False),
            "{:.0f} MiB")),
    Target("blocked softmax causal / full ≤ {bound} at {shape} ({mode})", "causal / full", "<=",
           CAUSAL_TARGET, dict(causal=True, impl=BLK, weighting="softmax", mask="",
                               T=lambda t: t >= CAUSAL_MIN_T)),
    Target("{weighting} causal + {mask}: fwd+bwd time per attended pair ≤ {bound}× plain "
           "causal at {shape}", "per pair / causal", "<=", MASK_TARGET,
           dict(shape=MASK_TARGET_SHAPE, mode="fwd+bwd", mask=lambda m: m in MASKS[:2]),
           "{:.2f}×"),
)


TITLE = "Kernel benchmark: blocked vs dense attention"
CLAIM = ("The blocked kernel is faster than materializing the T×S scores, needs O(T) memory, "
         "every pointwise F costs about the same as softmax, and the whole-row weightings "
         "stream within the issue's factors of blocked softmax.")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs every case; writes benchmark.md, benchmark.json and report.md into `workdir`."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  t_start = time.time()
  rows, rate = bench.runner.measure(cases(config), config)
  bench.ratios.add_ratios(rows, ratios(config))
  table = train.markdown_table(rows, COLUMNS, caption=bench.runner.caption(config, rate),
                               fmt=bench.format_number)
  elapsed = time.time() - t_start
  bench.save(workdir, {"matmul_gflops": rate, "rows": rows, "columns": COLUMNS,
                       "elapsed_s": elapsed, "config": config.to_dict()}, table)
  goals = bench.targets.check(TARGETS, rows)
  path = bench.runner.write_report(config, workdir, rows, table, rate=rate, elapsed=elapsed,
                                   title=TITLE, claim=CLAIM, goals=goals, mask_target=MASK_TARGET)
  return {"report": path, "rows": rows, "matmul_gflops": rate, "targets": goals}


if __name__ == "__main__":
  from experiments import _common  # noqa: PLC0415

  _common.run_standalone("kernel_benchmark", get_config, run, PRESETS)
