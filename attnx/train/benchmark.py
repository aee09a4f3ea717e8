"""Measuring cost: wall time and memory of compiled programs, a machine's matmul rate, the
steps a training run needs to reach a target, and the number format of benchmark tables.

Benchmarks (``experiments/kernel_benchmark.py``) declare their cases and time them with
:func:`time_call` (one run, e.g. the first, which is also checked) and
:func:`time_round_robin` (repeated runs of several programs, interleaved so that load from
other processes spreads over all of them), read XLA's memory estimate with
:func:`program_memory`, express speed as :func:`gflops` and as a fraction of
:func:`matmul_rate`, and write their tables with :func:`attnx.train.markdown_table` and
``fmt=``:func:`format_number`. Training efficiency (``experiments/metric_attention.py``) is
:func:`steps_to_target` of a fit's history, written with :func:`format_steps`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attnx.train.report import mean_std


def time_call(fn: Callable[[], Any]) -> tuple[Any, float]:
  """``(fn(), seconds)``: one call of ``fn`` and its wall time until its result is ready
  (``jax.block_until_ready``)."""
  t0 = time.perf_counter()
  result = fn()
  jax.block_until_ready(result)
  return result, time.perf_counter() - t0


def time_round_robin(fns: Sequence[Callable[[], Any]], repeats: int, *,
                     long_run_s: float = float("inf"),
                     first_seconds: Sequence[float] | None = None) -> list[float]:
  """Median wall time in seconds of each ``fn()`` (until its result is ready).

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
  return [float(np.median(ts)) for ts in times]


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


def mask_sizes(mask: str, window: int, documents: int) -> dict[str, int | None]:
  """The sizes of a masked benchmark row named ``mask`` (``"window"``, ``"documents"``, or
  anything else: none), as keywords of :func:`mask_keywords` and :func:`attended_pairs`."""
  return dict(window=int(window) if mask == "window" else None,
              documents=int(documents) if mask == "documents" else None)


def mask_keywords(t: int, window: int | None = None,
                  documents: int | None = None) -> dict[str, Any]:
  """``attnx.core.attention``'s keywords of a masked benchmark row (with ``is_causal=True``):
  a causal ``window`` of keys (``local_window_size=(window − 1, 0)``), or ``documents``
  packed documents of equal length (``segment_ids`` [1, T]); the pairs they attend are
  :func:`attended_pairs`'."""
  if window is not None:
    return dict(local_window_size=(window - 1, 0))
  if documents is not None:
    return dict(segment_ids=jnp.repeat(jnp.arange(documents, dtype=jnp.int32),
                                       t // documents)[None])
  return {}


def attended_pairs(t: int, causal: bool = True, window: int | None = None,
                   documents: int | None = None) -> int:
  """The (query, key) pairs a row of T positions attends, the unit of the masked benchmarks'
  time per pair: T² (full), T(T+1)/2 (causal), and for causal attention the pairs within a
  ``window`` of the last keys up to the query, or within each of ``documents`` packed
  documents of equal length."""
  if window is not None:
    w = min(window, t)
    return w * (w + 1) // 2 + (t - w) * w
  if documents is not None:
    n = t // documents
    return documents * n * (n + 1) // 2
  return t * (t + 1) // 2 if causal else t * t


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
