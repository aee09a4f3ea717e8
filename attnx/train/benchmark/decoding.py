"""The decoding benchmark's measurement: one new token's attention against a KV cache, by the
path attnx took before split-KV (dense, K and V repeated per query head), split-KV
(:class:`attnx.core.SplitKV`) and a paged cache (:func:`attnx.core.paged_attention`), side by
side with the time of reading K and V once — the memory bound of a decoding step. On a GPU or
TPU also split-KV and the paged cache on the Pallas kernels (``core.Pallas()``, which splits
decoding shapes by itself: :mod:`attnx.core.kernels.pallas.split`), and the share of the chip's
memory bandwidth each reaches (:data:`HBM_BYTES_PER_S`).

A row is one (weighting, cache length): milliseconds per token of each path (the median of a
block of runs of that program alone, after a warm-up; reading K and V once is timed before and
after the paths, the faster block counts), their ratios, XLA's scratch memory and the largest
difference from the dense path's output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx import core
from attnx.train import benchmark as bench

PATHS = ("before (dense)", "split-KV", "paged")
PALLAS_PATHS = ("split-KV (Pallas)", "paged (Pallas)")
READ = "read K, V once"
# Peak memory bandwidth (bytes/s) of the chips the HBM share is reported for, by a substring
# of jax's device_kind (the vendors' data sheets; the first match counts).
HBM_BYTES_PER_S = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
    ("L4", 0.3e12), ("TPU v5 lite", 0.819e12), ("TPU v5p", 2.765e12), ("TPU v6 lite", 1.64e12),
    ("TPU v4", 1.2e12),
)


def hbm_bytes_per_s(device: Any = None) -> float | None:
  """The peak memory bandwidth of ``device`` (default: the first device) from
  :data:`HBM_BYTES_PER_S`, or None for a chip not in it (a CPU)."""
  kind = (device or jax.devices()[0]).device_kind
  return next((bw for name, bw in HBM_BYTES_PER_S if name in kind), None)


def _inputs(b: int, s: int, n: int, k: int, h: int, page: int, dtype: Any, seed: int):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.standard_normal((b, 1, n, h)), dtype)
  kk = jnp.asarray(r.standard_normal((b, s, k, h)), dtype)
  v = jnp.asarray(r.standard_normal((b, s, k, h)), dtype)
  pages = s // page
  order = r.permutation(b * pages)  # the pool holds the pages shuffled, as a server's would
  inv = np.argsort(order)
  k_pages = kk.reshape(b * pages, page, k, h)[order]
  v_pages = v.reshape(b * pages, page, k, h)[order]
  table = jnp.asarray(inv.reshape(b, pages), jnp.int32)
  return q, kk, v, k_pages, v_pages, table, jnp.full((b,), s, jnp.int32)


def _programs(weighting: str, num_chunks: int | None, pallas: bool) -> dict[str, Any]:
  dense = lambda q, k, v, *_: core.attention(q, k, v, weighting=weighting,
                                             implementation="dense")
  split = lambda q, k, v, *_: core.attention(
      q, k, v, weighting=weighting, implementation=core.SplitKV(num_chunks=num_chunks))
  paged = lambda q, k, v, kp, vp, table, lengths: core.paged_attention(
      q, kp, vp, table, lengths, weighting=weighting)
  read = lambda q, k, v, *_: jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)
  progs = {PATHS[0]: dense, PATHS[1]: split, PATHS[2]: paged, READ: read}
  if pallas:
    impl = core.Pallas(num_splits=num_chunks)
    progs[PALLAS_PATHS[0]] = lambda q, k, v, *_: core.attention(
        q, k, v, weighting=weighting, implementation=impl)
    progs[PALLAS_PATHS[1]] = lambda q, k, v, kp, vp, table, lengths: core.paged_attention(
        q, kp, vp, table, lengths, weighting=weighting, implementation=impl)
  return progs


def measure(weightings: Sequence[str], cache_lengths: Sequence[int], *, batch: int,
            num_heads: int, kv_heads: int, head_dim: int, page_size: int,
            num_chunks: int | None, repeats: int, dtype: Any = jnp.float32,
            dense_max_keys: int = 1 << 20, seed: int = 0, pallas: bool | None = None,
            progress: Any = None) -> list[dict[str, Any]]:
  """One row per (weighting, cache length S): ms per token of each of :data:`PATHS` and of
  :data:`READ`, ``split / read``, ``paged / read``, ``before / split`` (the speed-up), scratch
  MiB of each path and ``max |Δ|`` of split-KV and paged from the dense path. The dense path
  runs up to ``dense_max_keys`` keys (its [N, S] scores per query and K, V repeated per query
  head). ``pallas`` (default: on a GPU or TPU) adds :data:`PALLAS_PATHS` (sparsemax/entmax
  run unsplit there) with their ratios to the read and, on a chip of
  :data:`HBM_BYTES_PER_S`, ``HBM share`` columns: bytes of K and V over the time, over the
  peak bandwidth. ``progress``: called with a line per row."""
  if pallas is None:
    pallas = jax.default_backend() in ("gpu", "tpu")
  peak = hbm_bytes_per_s() if pallas else None
  rows = []
  for s in cache_lengths:
    if s % page_size:
      raise ValueError(f"cache length {s} is not a multiple of page_size={page_size}")
    args = _inputs(batch, s, num_heads, kv_heads, head_dim, page_size, dtype, seed)
    kv_mib = 2 * math.prod(args[1].shape) * jnp.dtype(dtype).itemsize / 2**20
    for w in weightings:
      progs = _programs(w, num_chunks, pallas)
      if s > dense_max_keys:
        progs.pop(PATHS[0])
      compiled = {name: jax.jit(fn).lower(*args).compile() for name, fn in progs.items()}
      outs = {name: fn(*args) for name, fn in compiled.items()}
      names = list(compiled)
      # Each program timed in a block of its own runs (after one warm-up), not round-robin:
      # the dense path's gigabyte of temporaries, run in between, slowed the next program's
      # run 2.3× (cold caches and pages); the memory bound is timed before and after them.
      ms = {}
      for n in [READ] + [n for n in names if n != READ] + [READ]:
        t = 1e3 * bench.time_repeated(lambda f=compiled[n], a=args: f(*a), repeats, warmup=1)
        ms[n] = min(ms.get(n, t), t)
      row: dict[str, Any] = {"weighting": w, "S": s, "K, V MiB": kv_mib}
      for n in names:
        row[f"{n} ms"] = ms[n]
      read = ms[READ]
      row["split / read"] = ms[PATHS[1]] / read
      row["paged / read"] = ms[PATHS[2]] / read
      for n in PALLAS_PATHS:
        if n in ms:
          row[f"{n} / read"] = ms[n] / read
      if peak is not None:
        for n in (READ,) + PALLAS_PATHS:
          row[f"{n} HBM share"] = kv_mib * 2**20 / (ms[n] / 1e3) / peak
      if PATHS[0] in ms:
        row["before / split"] = ms[PATHS[0]] / ms[PATHS[1]]
        ref = np.asarray(outs[PATHS[0]], np.float64)
        for n in PATHS[1:] + tuple(x for x in PALLAS_PATHS if x in outs):
          row[f"{n} max |Δ|"] = float(np.max(np.abs(np.asarray(outs[n], np.float64) - ref)))
      for n in PATHS + PALLAS_PATHS:
        if n in compiled:
          row[f"{n} scratch MiB"] = bench.program_memory(compiled[n]).scratch / 2**20
      rows.append(row)
      if progress is not None:
        progress(f"{w} S={s}: " + ", ".join(f"{n} {ms[n]:.2f} ms" for n in names))
  return rows


def columns(rows: Sequence[dict[str, Any]]) -> list[str]:
  """The table's columns, in the order of the first row that has each."""
  out: list[str] = []
  for r in rows:
    out += [c for c in r if c not in out]
  return out


__all__ = ["HBM_BYTES_PER_S", "PALLAS_PATHS", "PATHS", "READ", "columns", "hbm_bytes_per_s",
           "measure"]
