"""Decoding benchmark: one new token's attention against a KV cache, every path side by side.

For each weighting and cache length S: the time per generated token of the path attnx took
before split-KV (dense: the [N, S] scores, K and V repeated per query head), of split-KV
(``attnx.core.SplitKV``: the cache in chunks merged by the family's rule, K and V read as
stored) and of a paged cache (``attnx.core.paged_attention``: the cache in shuffled pages of a
pool, gathered per call), next to the time of reading K and V once (a sum over both: the
memory bound of a decoding step). On a GPU or TPU also split-KV and the paged cache on the
Pallas kernels (flash-decoding) and the share of the chip's memory bandwidth they reach. The
report's "Targets" table checks the decoding issue's targets at the 32k cache
(:data:`TARGETS`; the bandwidth one only where a GPU ran the ``gpu`` preset).

This file declares the shapes, weightings and targets; the measurement is
attnx.train.benchmark.decoding's.

Command:
  python launch.py --config=experiments/decode_benchmark.py:default --workdir=runs/decode
  python experiments/decode_benchmark.py --preset=tiny --workdir=/tmp/decode
  python experiments/decode_benchmark.py --preset=gpu --workdir=runs/decode_gpu   (a GPU)
Expected runtime on 2 CPU cores: tiny < 30 s, default ≈ 5 min; gpu preset ≈ 2 min on a GPU.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # `python experiments/decode_benchmark.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402

from attnx import train  # noqa: E402
from attnx.train import benchmark as bench  # noqa: E402
from attnx.train import config as train_config  # noqa: E402
from attnx.train.benchmark import decoding  # noqa: E402
from attnx.train.benchmark.targets import Target  # noqa: E402

WEIGHTINGS = ("softmax", "sigmoid", "stick_breaking", "entmax15")
TARGET_S = 32768


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment = "decode_benchmark"
  c.weightings = ",".join(WEIGHTINGS)
  c.cache_lengths = "1024,4096,16384,32768,65536"
  # The shape: B = 4 sequences, N = 8 query heads over K = 2 KV heads, H = 64.
  c.batch, c.num_heads, c.kv_heads, c.head_dim = 4, 8, 2, 64
  c.page_size = 256
  c.num_chunks = 0  # split-KV's chunks (0: its default, ~1024 keys each)
  c.repeats = 7
  c.dense_max_keys = 65536
  c.dtype = "float32"
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/decode_benchmark.py:tiny (< 30 s): two short
  caches, two weightings, one run (a smoke test; the timings mean nothing)."""
  c.update(dict(cache_lengths="512,2048", weightings="softmax,stick_breaking", repeats=1,
                batch=2, page_size=128))


def _gpu(c: ml_collections.ConfigDict) -> None:
  """python experiments/decode_benchmark.py --preset=gpu (a GPU, ≈ 2 min): the issue's shape
  in bfloat16, the Pallas paths beside the XLA ones, the HBM share of each."""
  c.update(dict(dtype="bfloat16", repeats=20, cache_lengths="4096,32768,65536"))


PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny, "gpu": _gpu}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS` (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "decode_benchmark")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for bad weightings, lengths, heads or dtype."""
  bench.cases.check_weightings(config, streaming=("weightings",))
  lengths = [int(x) for x in train.split_list(config.cache_lengths)]
  bad = [s for s in lengths if s < 1 or s % config.page_size]
  if not lengths or bad:
    raise ValueError(f"config.cache_lengths must be positive multiples of page_size="
                     f"{config.page_size}, got {config.cache_lengths!r}.")
  if config.num_heads % config.kv_heads:
    raise ValueError(f"config.num_heads={config.num_heads} must be a multiple of "
                     f"config.kv_heads={config.kv_heads}.")
  if config.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"config.dtype must be float32 or bfloat16, got {config.dtype!r}")


# The targets at the 32k cache: a token within 5× the time of reading K and V once
# for softmax and sigmoid, and every F at least 3× faster than the path before split-KV.
TARGETS = (
    Target("{weighting}: split-KV token ≤ {bound}× reading K, V once at S = {S}",
           "split / read", "<=", 5.0,
           dict(S=TARGET_S, weighting=lambda w: w in ("softmax", "sigmoid")), "{:.2f}×"),
    Target("{weighting}: split-KV ≥ {bound}× faster than before at S = {S}", "before / split",
           ">=", 3.0, dict(S=TARGET_S), "{:.1f}×"),
    # Rows with an HBM share come from a GPU/TPU only (decoding.hbm_bytes_per_s).
    Target("{weighting}: split-KV on the Pallas kernels reads K, V at ≥ {bound:.0%} of the "
           "chip's memory bandwidth at S = {S}", "split-KV (Pallas) HBM share", ">=", 0.6,
           dict(S=TARGET_S, weighting="softmax"), "{:.0%}"),
)

TITLE = "Decoding benchmark: a token against a KV cache"
CLAIM = ("Split-KV decodes one token within a few times the time of reading the cache once "
         "(softmax, sigmoid), every F several times faster than attnx's path before it, and a "
         "paged cache costs one gather of the sequence's pages more.")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Measures every (weighting, cache length); writes benchmark.md/.json and report.md."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  rows = decoding.measure(
      train.split_list(config.weightings),
      [int(x) for x in train.split_list(config.cache_lengths)], batch=config.batch,
      num_heads=config.num_heads, kv_heads=config.kv_heads, head_dim=config.head_dim,
      page_size=config.page_size, num_chunks=config.num_chunks or None,
      repeats=config.repeats, dtype=config.dtype, dense_max_keys=config.dense_max_keys,
      progress=print)
  cols = decoding.columns(rows)
  caption = (f"Median wall time per token (one query per sequence) of {config.repeats} runs of "
             "each program in a row after a warm-up (the read timed before and after the "
             f"paths, the faster counts): B = {config.batch}, N = {config.num_heads} query "
             f"heads over K = {config.kv_heads} KV heads, H = {config.head_dim}, "
             f"{config.dtype}; pages of {config.page_size} positions, shuffled in the pool. "
             "'read K, V once': jnp.sum over both caches. Scratch: XLA's temp buffers. "
             "max |Δ|: against the dense path's output.")
  table = train.markdown_table(rows, cols, caption=caption, fmt=bench.format_number)
  elapsed = time.time() - t0
  bench.save(workdir, {"rows": rows, "columns": cols, "elapsed_s": elapsed,
                       "config": config.to_dict()}, table)
  goals = bench.targets.check(TARGETS, rows)
  rep = train.Report(TITLE, workdir, config=config, claim=CLAIM)
  rep.text(f"Hardware: `{platform.processor() or platform.machine()}`, {os.cpu_count()} CPU "
           f"cores, jax {jax.__version__}, devices {jax.devices()}. Total {elapsed:.0f} s.")
  return {"report": bench.targets.write_results(rep, goals, table), "rows": rows,
          "targets": goals}


if __name__ == "__main__":
  from experiments import _common  # noqa: PLC0415

  _common.run_standalone("decode_benchmark", get_config, run, PRESETS)
