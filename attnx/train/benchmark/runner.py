"""Measuring an attention benchmark's cases (:mod:`attnx.train.benchmark.cases`) into rows.

:func:`measure` is the CPU kernel benchmark's method: per shape, standard normal inputs; per
shape and mode, every case compiled (its XLA scratch and peak memory), run once and checked
against a float64 reference on the first queries (:mod:`attnx.train.benchmark.references`),
then all of them timed round-robin (:func:`attnx.train.benchmark.time_round_robin`: load from
other processes spreads over all of them); the machine's float32 matmul rate is measured
before and after each shape (the best counts: other processes can only slow it down). A row:
``shape``, ``impl``, ``weighting``, ``score``, ``mode``, ``causal``, ``mask``, ``time ms``,
``GFLOP/s``, ``% matmul``, ``scratch MiB``, ``peak MiB``, ``max abs err`` (:data:`CELLS`), or a
``note`` saying why it was not run. :func:`caption` says all this under the benchmark's table,
and :func:`write_report` writes the report around it.

:func:`measure_alone` is the accelerator benchmark's: each case compiled and timed alone
(median of ``config.repeats`` runs after ``config.warmup`` untimed ones), its speed in TFLOP/s
by FlashAttention-2's convention (3.5× the forward's FLOPs for fwd+bwd), its error against a
reference function on the same device
(:func:`attnx.train.benchmark.references.max_abs_difference`).

The config keys :func:`measure` reads: ``seed``, ``dtype``, ``repeats``, ``long_run_s`` (a case
whose first run takes longer is timed once), ``dense_max_gib`` (an implementation other than the
blocked kernel is skipped where its T×S scores or scratch would exceed it),
``memory_only_min_scores`` (longer shapes are compiled only; 0: none), ``error_queries``,
``matmul_size``, ``mask_window``, ``mask_documents``, ``progress``, and for
:func:`attention_fn` ``block_q`` and ``block_k``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from attnx import core
from attnx.core import weightings as wlib
from attnx.core.kernels.xla import rows as blocked_rows
from attnx.train import benchmark
from attnx.train.benchmark import cases as cases_lib
from attnx.train.benchmark import programs, references
from attnx.train.config import split_list

BLOCKED = "attnx blocked"  # the one implementation that never holds the T×S scores
GIB = 2.0**30
CELLS = ["shape", "impl", "weighting", "score", "mode", "causal", "mask", "time ms", "GFLOP/s",
         "% matmul", "scratch MiB", "peak MiB", "max abs err"]
Row = dict[str, Any]
Case = dict[str, Any]
# (case, config) -> the attention function fn(q, k, v) it times (default: attention_fn).
AttentionFor = Callable[[Case, Any], programs.AttentionFn]


def attention_fn(case: Case, config: Any) -> programs.AttentionFn:
  """The function a case of :func:`measure` times: softmax of a baseline
  (:data:`attnx.train.benchmark.programs.BASELINES`), or ``core.attention`` with
  ``implementation`` "attnx dense" (``core.Dense()``) or "attnx blocked" (``core.Blocked``
  with ``config.block_q``/``block_k``, 0 = the kernel's default), on the case's weighting,
  score, causality and mask."""
  impl, causal, mask = case["impl"], bool(case.get("causal", False)), case.get("mask", "")
  if impl in programs.BASELINES:
    return programs.baseline_fn(impl, is_causal=causal)
  if impl not in (BLOCKED, "attnx dense"):
    raise ValueError(f"Unknown implementation {impl!r}: a baseline or {BLOCKED!r} / "
                     "'attnx dense'")
  implementation = (core.Dense() if impl == "attnx dense" else
                    core.Blocked(block_q=int(config.block_q) or None,
                                 block_k=int(config.block_k) or None))
  return programs.attnx_fn(
      weighting=case["weighting"], score=case.get("score", "scaled_dot"), is_causal=causal,
      implementation=implementation, **cases_lib.mask_keywords(
          mask, case["shape"][1], config.mask_window, config.mask_documents))


def _scores_gib(shape) -> float:
  b, t, n, _ = shape
  return b * n * t * t * 4 / GIB


def prepare(case: Case, inputs: tuple[Any, ...], config: Any, refs: dict,
            attention_for: AttentionFor | None = None) -> tuple[Row, Any]:
  """Compiles one case, checks its memory, runs it once and measures its error (against a
  float64 reference cached in ``refs``).

  Returns (row, compiled); compiled is None for a case that is not timed (the row says why).
  """
  b, t, n, h = shape = case["shape"]
  mode, impl, weighting = case["mode"], case["impl"], case["weighting"]
  score = case.get("score", "scaled_dot")
  causal = bool(case.get("causal", False))
  mask = case.get("mask", "")
  sizes = cases_lib.mask_sizes(mask, config.mask_window, config.mask_documents)
  # FLOPs of the scores a row needs: half of them when causal, those a mask keeps.
  pairs = cases_lib.attended_pairs(t, causal, **sizes) if mask else None
  row: Row = {"shape": cases_lib.shape_label(shape), "impl": impl, "weighting": weighting,
              "score": score, "mode": mode, "causal": causal, "mask": mask,
              "flops": cases_lib.flops(shape, mode, pairs, causal=causal)}
  is_baseline = impl != BLOCKED
  if is_baseline and _scores_gib(shape) > float(config.dense_max_gib):
    row["note"] = f"skipped: needs {_scores_gib(shape):.0f} GiB for the T×S scores"
    return row, None
  compiled = programs.compile_program((attention_for or attention_fn)(case, config), mode,
                                      inputs)
  mem = benchmark.program_memory(compiled)
  row["scratch MiB"] = mem.scratch / 2**20
  if mem.peak is not None:  # scratch + inputs + outputs: what the program holds at its peak
    row["peak MiB"] = mem.peak / 2**20
  if is_baseline and mem.scratch > float(config.dense_max_gib) * GIB:
    row["note"] = f"skipped: needs {mem.scratch / GIB:.1f} GiB of scratch for the T×S scores"
    return row, None
  memory_only = int(config.memory_only_min_scores)
  if case.get("memory_only") or (memory_only and t * t > memory_only):
    row["note"] = "compiled for its memory only (not run)"
    return row, None
  try:
    # The first run (also the result checked below).
    result, row["_first_s"] = benchmark.time_call(lambda: compiled(*inputs))
  except Exception as e:  # noqa: BLE001 - out of memory etc. is a result, not a crash
    row["note"] = f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return row, None
  nq = min(int(config.error_queries), t)
  key = (shape, weighting, mode, causal, mask)
  if key not in refs:
    valid = cases_lib.valid_pairs(nq, t, causal, **sizes)
    refs[key] = references.reference(*inputs, weighting, nq, valid, mode, score)
  row["max abs err"] = references.max_abs_error(result, refs[key], mode, nq)
  return row, compiled


def time_prepared(prepared: Sequence[tuple[Row, Any]], inputs: tuple[Any, ...],
                  config: Any) -> None:
  """Times the prepared cases of one shape round-robin (``time ms``); cases slower than
  ``config.long_run_s`` are timed once."""
  timed = [(row, compiled) for row, compiled in prepared if compiled is not None]
  seconds = benchmark.time_round_robin(
      [lambda c=compiled: c(*inputs) for _, compiled in timed], int(config.repeats),
      long_run_s=float(config.long_run_s), first_seconds=[row["_first_s"] for row, _ in timed])
  for (row, _), sec in zip(timed, seconds, strict=True):
    row["time ms"] = 1e3 * sec


def finish(row: Row, rate: float) -> Row:
  """``row`` with its speed (``GFLOP/s``, ``% matmul`` of ``rate`` GFLOP/s) in place of its
  FLOPs and first run's time."""
  flops = row.pop("flops")
  row.pop("_first_s", None)
  if "time ms" in row:
    row["GFLOP/s"] = benchmark.gflops(flops, row["time ms"] / 1e3)
    row["% matmul"] = 100.0 * row["GFLOP/s"] / rate
  return row


def run_case(case: Case, inputs: tuple[Any, ...], config: Any, rate: float, refs: dict,
             attention_for: AttentionFor | None = None) -> Row:
  """Prepares and times a single case; returns its finished row."""
  prepared = [prepare(case, inputs, config, refs, attention_for)]
  if prepared[0][1] is not None:
    time_prepared(prepared, inputs, config)
  return finish(prepared[0][0], rate)


def measure(cases: Sequence[Case], config: Any,
            attention_for: AttentionFor | None = None) -> tuple[list[Row], float]:
  """(rows, matmul rate in GFLOP/s): every case prepared and timed round-robin per shape and
  mode (see the module docstring); ``attention_for(case, config)`` gives the function a case
  times (default :func:`attention_fn`)."""
  from tqdm.auto import tqdm  # noqa: PLC0415

  rates = [benchmark.matmul_rate(int(config.matmul_size))]
  rows: list[Row] = []
  bar = tqdm(total=len(cases), desc="kernel benchmark", disable=not config.get("progress", True))
  for shape in dict.fromkeys(c["shape"] for c in cases):
    inputs = cases_lib.inputs(shape, config.dtype, config.seed)
    refs: dict = {}
    label = cases_lib.shape_label(shape)
    for mode in dict.fromkeys(c["mode"] for c in cases):
      prepared = []
      for case in (c for c in cases if c["shape"] == shape and c["mode"] == mode):
        bar.set_postfix_str(f"{label} {case['impl']} {case['weighting']} {mode}")
        prepared.append(prepare(case, inputs, config, refs, attention_for))
        bar.update()
      bar.set_postfix_str(f"{label} {mode}: timing")
      time_prepared(prepared, inputs, config)
      rows.extend(row for row, _ in prepared)
    rates.append(benchmark.matmul_rate(int(config.matmul_size)))
  bar.close()
  rate = max(rates)
  return [finish(r, rate) for r in rows], rate


def run_alone(case: Case, inputs: tuple[Any, ...], config: Any,
              attention_for: Callable[[Case], programs.AttentionFn | str],
              reference_for: Callable[[Case], programs.AttentionFn | None] | None = None) -> Row:
  """Compiles and times one case alone (see the module docstring): ``shape``, ``impl``,
  ``weighting``, ``mode``, ``mask`` (masked rows), ``time ms``, ``TFLOP/s``, and ``max abs
  err`` for a fwd case with ``check_error`` whose ``reference_for(case)`` is a function.
  ``attention_for(case)``: the function timed, or a string, the note of a case not run; a case
  that fails gets a note too."""
  shape, impl, weighting, mode = case["shape"], case["impl"], case["weighting"], case["mode"]
  t, mask = shape[1], case.get("mask", "")
  row: Row = {"shape": cases_lib.shape_label(shape), "impl": impl,
              "weighting": cases_lib.case_weighting(weighting, shape[3])[0], "mode": mode}
  if mask:
    row["mask"] = mask
  fn = attention_for(case)
  if isinstance(fn, str):
    row["note"] = fn
    return row
  try:
    compiled = programs.compile_program(fn, mode, inputs)
    seconds = benchmark.time_repeated(lambda: compiled(*inputs), config.repeats, config.warmup)
  except Exception as e:  # noqa: BLE001 - a failed case is a result, not a crash
    row["note"] = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    return row
  row["time ms"] = 1e3 * seconds
  sizes = cases_lib.mask_sizes(mask, config.mask_window, config.mask_documents)
  pairs = cases_lib.attended_pairs(t, True, **sizes) if mask else None
  row["TFLOP/s"] = cases_lib.flops(shape, mode, pairs, causal=bool(config.is_causal),
                                   backward=3.5) / seconds / 1e12
  ref = reference_for(case) if reference_for and case.get("check_error") else None
  if ref is not None and mode == "fwd":
    row["max abs err"] = references.max_abs_difference(fn, ref, inputs,
                                                       int(config.error_queries))
  return row


def measure_alone(cases: Sequence[Case], config: Any,
                  attention_for: Callable[[Case], programs.AttentionFn | str],
                  reference_for: Callable[[Case], programs.AttentionFn | None] | None = None
                  ) -> list[Row]:
  """Every case of ``cases`` by :func:`run_alone`, on inputs per shape as in :func:`measure`,
  each row printed as it is measured. Reads ``config.seed``, ``dtype``, ``repeats``, ``warmup``,
  ``is_causal``, ``error_queries``, ``mask_window`` and ``mask_documents``."""
  rows = []
  for shape in dict.fromkeys(c["shape"] for c in cases):
    inputs = cases_lib.inputs(shape, config.dtype, config.seed)
    for case in (c for c in cases if c["shape"] == shape):
      rows.append(r := run_alone(case, inputs, config, attention_for, reference_for))
      print(f"{r['shape']} {r['impl']} {r['weighting']} {r['mode']} {r.get('mask', '')}: "
            f"{benchmark.format_number(r.get('TFLOP/s', r.get('note', '')))}", flush=True)
  return rows


def threshold_passes(config: Any) -> list[Row]:
  """Passes over the key tiles that the sparsemax/entmax weightings of
  ``config.row_weightings`` need to find each row's threshold, on every shape of
  ``config.shapes`` with at most ``config.row_max_scores`` scores per head (inputs as in
  :func:`measure`), for each of ``config.causal``."""
  out = []
  for shape in cases_lib.parse_shapes(config.shapes):
    b, t, n, h = shape
    if t * t > int(config.row_max_scores):
      continue
    q, k, v = cases_lib.inputs(shape, config.dtype, config.seed)
    for name in split_list(config.row_weightings):
      w = wlib.get_weighting(name)
      if w.stream.family != "entmax":
        continue
      for causal in (c == "causal" for c in split_list(config.causal)):
        p = blocked_rows.threshold_passes(q, k, v, weighting=w, scale=1.0 / np.sqrt(h),
                                          is_causal=causal)
        out.append({"shape": cases_lib.shape_label(shape), "weighting": name, "causal": causal,
                    "passes": int(p)})
  return out


def add_threshold_passes(rep: Any, config: Any) -> None:
  """A "Threshold passes" section in ``rep`` (an ``attnx.train.Report``) with
  :func:`threshold_passes`' table; nothing when no row weighting finds a threshold."""
  passes = threshold_passes(config)
  if passes:
    rep.section("Threshold passes")
    rep.text("Passes over the key tiles that sparsemax/entmax need to find every row's "
             "threshold τ before their output pass (the largest over query blocks; the row-max "
             "pass and the exact last step included), on the benchmark's inputs.")
    rep.table(passes, columns=["shape", "weighting", "causal", "passes"])


def write_report(config: Any, workdir: str, rows: Sequence[Row], table: str, *, rate: float,
                 elapsed: float, title: str, claim: str, goals: Sequence[dict[str, str]],
                 mask_target: float) -> str:
  """Writes :func:`measure`'s report.md: the machine, the targets (``goals``, with their
  verdict; :func:`attnx.train.benchmark.targets.add_to_report`), :func:`threshold_passes`, the
  figures (:func:`attnx.train.benchmark.plots.add_to_report`) and ``table``; returns its
  path."""
  from attnx import train  # noqa: PLC0415
  from attnx.train.benchmark import plots, targets  # noqa: PLC0415

  rep = train.Report(title, workdir, config=config, claim=claim)
  rep.text(f"Hardware: `{platform.processor() or platform.machine()}`, {os.cpu_count()} CPU "
           f"cores, jax devices {jax.devices()}; float32 matmul rate {rate:.1f} GFLOP/s. "
           f"Total benchmark time {elapsed:.0f} s.")
  targets.add_to_report(rep, goals)
  add_threshold_passes(rep, config)
  rep.section("Results")
  plots.add_to_report(rep, rows, split_list(config.row_weightings), window=config.mask_window,
                      documents=config.mask_documents, mask_target=mask_target)
  rep.text(table)
  return rep.write()


def caption(config: Any, rate: float) -> str:
  """The caption of :func:`measure`'s table: how each column was measured."""
  return (
      f"Median wall time over ≤ {config.repeats} runs, timed round-robin over the cases of "
      f"a shape and mode (one run when a run takes > {config.long_run_s} s). FLOPs counted "
      "as 4·B·N·T·S·H for fwd and 2.5× that for "
      "fwd+bwd (grad of sum(out) w.r.t. q, k, v), S = T; '% matmul' is relative to this "
      f"machine's float32 matmul rate measured in the same run ({rate:.1f} GFLOP/s: best of "
      f"{config.matmul_size}² jnp.dot timings before and after each shape). Scratch = XLA "
      "temp buffers of the compiled program; peak = scratch + inputs + outputs. "
      f"Error: max |out − ref| (fwd) or max |dq − ref| (fwd+bwd) over the first "
      f"{config.error_queries} queries against a float64 reference. dtype {config.dtype}. "
      "GFLOP/s of causal rows count the T·S/2 scores they need, of masked rows the pairs "
      "they attend. 'causal / full': time of a causal row over the same case's full row, "
      "timed side by side; 'per pair / causal': a masked row's time per attended pair over "
      "the plain causal row's (mask: causal + 'window' of the last mask_window keys, or + "
      "'documents', mask_documents packed documents of equal length). Score scaled_dot, "
      "except for the distance kernels, which run on neg_sq_dist −‖q − k‖² with bandwidth "
      "h = √(2H) (the typical distance of two N(0, I) inputs). 'time / softmax': time over "
      "blocked softmax on the same score — for neg_sq_dist, the Gaussian kernel, which is "
      "softmax(s/2h²). Triangular's F'(s) = 1/(2h√−s) is unbounded as s → 0⁻, so its dq "
      "error measures the conditioning of F, not the kernel."
      + (f" 'per pair / causal' here: every blocked row's time per attended pair of its batch "
         f"over the plain causal row's at {config.pair_reference}; mask 'dense_window': the "
         "window as a dense [T, S] boolean mask." if config.get("pair_reference") else ""))

