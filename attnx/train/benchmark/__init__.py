"""Measuring cost: wall time and memory of compiled programs, a machine's matmul rate, the
steps a training run needs to reach a target, the number format of benchmark tables — and, in
its submodules, the machinery of the attention benchmarks.

Every benchmark times with :func:`time_call` (one run, e.g. the first, which is also checked),
:func:`time_round_robin` (repeated runs of several programs, interleaved so that load from
other processes spreads over all of them; :func:`time_round_robin_ms` for named steps) or
:func:`time_repeated` (one program, after warm-up runs), reads XLA's memory estimate with
:func:`program_memory`, expresses speed as :func:`gflops` and as a fraction of
:func:`matmul_rate`, and writes its tables with :func:`attnx.train.markdown_table` and
``fmt=``:func:`format_number`. Training efficiency (``experiments/metric_attention.py``) is
:func:`steps_to_target` of a fit's history, written with :func:`format_steps`.

The attention benchmarks (``experiments/kernel_benchmark.py``, ``pallas_benchmark.py``,
``train_benchmark.py``) declare their cases, baselines, ratio and target tables and report;
the how is here:

* :mod:`~attnx.train.benchmark.cases`: shapes, weightings (distance kernels on their score),
  structured masks and the pairs they attend, FLOPs, inputs;
* :mod:`~attnx.train.benchmark.programs`: the functions timed (attnx's, other libraries'
  baselines) and their forward or gradient programs;
* :mod:`~attnx.train.benchmark.references`: float64 references and error measures;
* :mod:`~attnx.train.benchmark.runner`: the CPU kernel benchmark's measurement of its cases;
* :mod:`~attnx.train.benchmark.ratios` and :mod:`~attnx.train.benchmark.targets`: ratio
  columns and target tables as data;
* :mod:`~attnx.train.benchmark.plots`: figures of the rows against the sequence length;
* :mod:`~attnx.train.benchmark.training`: training steps of language models to time side by side.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attnx.train.report import mean_std

__all__ = ["time_call", "time_round_robin", "time_round_robin_ms", "time_repeated", "matmul_rate",
           "gflops", "ProgramMemory", "program_memory", "format_number", "save",
           "steps_to_target", "format_steps", "cases", "programs", "references", "runner",
           "ratios", "targets", "plots", "training"]


def time_call(fn: Callable[[], Any]) -> tuple[Any, float]:
  """``(fn(), seconds)``: one call of ``fn`` and its wall time until its result is ready
  (``jax.block_until_ready``)."""
  t0 = time.perf_counter()
  result = fn()
  jax.block_until_ready(result)
  return result, time.perf_counter() - t0


def time_round_robin(fns: Sequence[Callable[[], Any]], repeats: int, *,
                     long_run_s: float = float("inf"),
                     first_seconds: Sequence[float] | None = None,
                     statistic: Callable[[Sequence[float]], float] = np.median) -> list[float]:
  """Median wall time in seconds of each ``fn()`` (until its result is ready), or another
  ``statistic`` of its times (``min``: the best run, what a quiet machine gives).

  The functions run round-robin, ``max(repeats, 1)`` rounds of one call each, so that load
  from other processes spreads over all of them. A function whose ``first_seconds`` (the time
  of a run before this one, e.g. its checked first run) exceeds ``long_run_s`` is called in
  the first round only.
  """
  first = list(first_seconds) if first_seconds is not None else [0.0] * len(fns)
  if len(first) != len(fns):
    raise ValueError(f"{len(fns)} functions but {len(first)} first_seconds")
  times: list[list[float]] = [[] for _ in fns]
  for r in range(max(int(repeats), 1)):
    for i, fn in enumerate(fns):
      if r > 0 and first[i] > float(long_run_s):
        continue
      times[i].append(time_call(fn)[1])
  return [float(statistic(ts)) for ts in times]


def time_round_robin_ms(steps: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]],
                        repeats: int) -> dict[str, float]:
  """{name: median milliseconds} of compiled steps ``fn(*args)`` (``steps``: {name: (fn,
  args)}), timed by :func:`time_round_robin`."""
  calls = [functools.partial(fn, *args) for fn, args in steps.values()]
  secs = time_round_robin(calls, int(repeats))
  return {name: 1e3 * t for name, t in zip(steps, secs, strict=True)}


def time_repeated(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> float:
  """Median wall time in seconds of ``max(repeats, 1)`` calls of ``fn()`` in a row, after
  ``warmup`` untimed ones."""
  for _ in range(max(int(warmup), 0)):
    jax.block_until_ready(fn())
  return float(np.median([time_call(fn)[1] for _ in range(max(int(repeats), 1))]))


def matmul_rate(n: int, repeats: int = 5) -> float:
  """This machine's float32 matmul rate in GFLOP/s (median of ``repeats`` n×n×n products)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
  jax.block_until_ready(f(x, x))
  ts = [time_call(lambda: f(x, x))[1] for _ in range(repeats)]
  return 2 * n**3 / float(np.median(ts)) / 1e9


def gflops(flops: float, seconds: float) -> float:
  """Speed in GFLOP/s of ``flops`` floating-point operations done in ``seconds``."""
  return flops / seconds / 1e9


class ProgramMemory(NamedTuple):
  """XLA's memory estimate of a compiled program, in bytes.

  ``scratch``: its temporary buffers (``memory_analysis().temp_size_in_bytes``; NaN when XLA
  gives no estimate); ``peak``: scratch + arguments + outputs, what the program holds at its
  peak at most (None without an estimate).
  """

  scratch: float
  peak: float | None


def program_memory(compiled: Any) -> ProgramMemory:
  """:class:`ProgramMemory` of ``compiled`` (a ``jax.stages.Compiled``)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return ProgramMemory(float("nan"), None)
  temp = float(mem.temp_size_in_bytes)
  return ProgramMemory(temp, temp + float(mem.argument_size_in_bytes)
                       + float(mem.output_size_in_bytes))


def format_number(v: Any) -> str:
  """A benchmark table cell: floats to 3 significant digits (no decimals from 100 on,
  ``1.2e-03`` / ``1.2e+05`` below 0.01 and from 1e5), non-finite floats and everything else
  as ``str`` (``fmt=`` of :func:`attnx.train.markdown_table`)."""
  if isinstance(v, float):
    if not np.isfinite(v):
      return str(v)
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
      return f"{v:.1e}"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
  return str(v)


def save(workdir: str, payload: Mapping[str, Any], table: str | None = None) -> str:
  """Writes a benchmark's ``table`` (Markdown) to ``<workdir>/benchmark.md`` if given and
  ``payload`` to ``<workdir>/benchmark.json`` (values JSON cannot hold as their str);
  returns the JSON's path."""
  if table is not None:
    with open(os.path.join(workdir, "benchmark.md"), "w") as f:
      f.write(table)
  path = os.path.join(workdir, "benchmark.json")
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=str)
  return path


def steps_to_target(history: Sequence[Mapping[str, Any]], target: float, num_seeds: int,
                    metric: str = "eval_accuracy") -> np.ndarray:
  """Per seed, the first logged step whose ``metric`` (per-seed values) is ≥ ``target``; NaN
  for a seed that never reaches it. ``history``: a fit's log entries ({"step", metric, ...};
  entries without ``metric`` are skipped)."""
  out = np.full(num_seeds, np.nan)
  for h in history:
    if metric not in h:
      continue
    value = np.asarray(h[metric], float)
    newly = np.isnan(out) & (value >= target)
    out[newly] = h["step"]
  return out


def format_steps(steps: Any) -> str:
  """A table cell of :func:`steps_to_target`: mean ± std over the seeds that reached the
  target, "(k/n seeds reached)" when not all did, "not reached" when none did."""
  steps = np.asarray(steps, np.float64)
  reached = np.isfinite(steps)
  if not reached.any():
    return "not reached"
  s = mean_std(steps[reached], ".0f")
  return s if reached.all() else f"{s} ({reached.sum()}/{len(steps)} seeds reached)"


# The attention benchmarks' machinery (below the timing above, which it uses).
from attnx.train.benchmark import (  # noqa: E402  (namespaces: benchmark.cases, ...)
    cases,
    plots,
    programs,
    ratios,
    references,
    runner,
    targets,
    training,
)
