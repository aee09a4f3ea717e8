"""Times the Pallas GPU kernels' tiles on a real GPU: which forward, dQ and dK/dV launches are
fastest, not just spill-free.

The GPU tile table (``attnx.core.kernels.pallas.tiles``) was chosen by compiling for an H100
without one: the first candidate with no register spills. Timed on an H100 (docs/guides/pallas.md,
2026-11-26), those tiles left the forward as it was but cut every fwd+bwd to 0.16-0.17 of cuDNN.
This script measures the candidates instead. For each weighting it times, at one shape:

* the table's tiles (the baseline), forward and forward+backward;
* each forward candidate (forward only; the backward kernels keep the table's tiles);
* each dQ candidate and each dK/dV candidate (forward+backward, the other kernels' tiles
  from the table: the three kernels run one after another, so their times add);
* the best forward, dQ and dK/dV together, forward and forward+backward.

The full sweep runs on the first weighting (the pointwise F share one tile table); each further
weighting is timed with the table's tiles and with the first one's winners.

A candidate whose output or gradients differ from the table tiles' (beyond bf16 rounding) is
reported as wrong, one that fails to compile as failed; neither can win. Results are written
after every measurement (JSON and a Markdown table), so a run cut short keeps what it measured.

  python tools/gpu_tile_sweep.py --out runs/tile_sweep [--weightings softmax,sigmoid]
      [--shape 4x4096x16x128] [--budget 240]

``--interpret`` runs the kernels in Pallas' interpreter on a CPU at a tiny shape: a smoke test of
the script itself, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from attnx.core import weightings as wlib  # noqa: E402
from attnx.core.kernels.pallas import tiles  # noqa: E402
from attnx.core.kernels.pallas.autotune import CANDIDATES  # noqa: E402
from attnx.core.kernels.pallas.wrapper import pallas_attention  # noqa: E402

Tile = tiles.GpuTile
# The autotuner's candidates (attnx.core.autotune: this sweep, as a library function that caches
# its winner).
FWD, DQ, DKV = (list(CANDIDATES[k]) for k in ("fwd", "dq", "dkv"))


def _flops(shape: tuple[int, ...], mode: str) -> float:
  b, t, n, h = shape
  return 4.0 * b * n * t * t * h * (3.5 if mode == "fwd+bwd" else 1.0)


class Sweep:
  """Times one weighting's kernels under tile overrides (``tiles.gpu_tiles`` patched)."""

  def __init__(self, shape, dtype, repeats: int, warmup: int, interpret: bool):
    self.shape, self.repeats, self.warmup, self.interpret = shape, repeats, warmup, interpret
    b, t, n, h = shape
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    self.args = tuple(jax.random.normal(k, (b, t, n, h), jnp.float32).astype(dtype)
                      for k in ks[:3])
    self.cot = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(dtype)
    self.table = tiles.gpu_tiles

  def program(self, weighting, mode: str):
    scale = 1.0 / math.sqrt(self.shape[-1])
    be = "gpu" if self.interpret else None

    def fwd(q, k, v):
      return pallas_attention(q, k, v, weighting=weighting, scale=scale, backend=be,
                              interpret=self.interpret)
    if mode == "fwd":
      return fwd

    def fwd_bwd(q, k, v):
      out, vjp = jax.vjp(fwd, q, k, v)
      return (out, *vjp(self.cot))
    return fwd_bwd

  def run(self, weighting, mode: str, override: dict[str, Tile]) -> dict[str, Any]:
    """Compiles and times ``weighting`` with the table's tiles replaced by ``override``."""
    table = self.table

    def patched(head_dim, family, dtype):
      return table(head_dim, family, dtype)._replace(**override)
    tiles.gpu_tiles = patched
    try:
      t0 = time.perf_counter()
      compiled = jax.jit(self.program(weighting, mode)).lower(*self.args).compile()
      compile_s = time.perf_counter() - t0
      outs = jax.block_until_ready(compiled(*self.args))
      for _ in range(self.warmup):
        jax.block_until_ready(compiled(*self.args))
      ts = []
      for _ in range(self.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*self.args))
        ts.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
      return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"}
    finally:
      tiles.gpu_tiles = table
    seconds = float(np.median(ts))
    outs = outs if isinstance(outs, tuple) else (outs,)
    return {"ms": 1e3 * seconds, "TFLOP/s": _flops(self.shape, mode) / seconds / 1e12,
            "compile_s": compile_s, "outs": [np.asarray(o, np.float32) for o in outs]}


def _err(outs, ref) -> float:
  """The largest difference relative to the reference's largest entry, over all outputs."""
  return max(float(np.max(np.abs(o - r)) / max(1e-6, float(np.max(np.abs(r)))))
             for o, r in zip(outs, ref, strict=True))


def _label(override: dict[str, Tile]) -> str:
  if not override:
    return "table"
  return ", ".join(f"{k} {t.block_q}x{t.block_k}/{t.warps}w" for k, t in override.items())


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/tile_sweep")
  p.add_argument("--weightings", default="softmax,sigmoid,relu")
  p.add_argument("--shape", default="4x4096x16x128", help="BxTxNxH (S = T, not causal)")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--budget", type=float, default=240.0,
                 help="seconds after which no new measurement starts")
  p.add_argument("--tolerance", type=float, default=3e-2,
                 help="largest relative difference from the table tiles' results (bf16)")
  p.add_argument("--interpret", action="store_true", help="CPU smoke test (Pallas interpreter)")
  a = p.parse_args(argv)
  # The sweep times the table's tiles and its own: tuned ones from the cache would replace both.
  os.environ["ATTNX_TILE_CACHE"] = "off"
  shape = tuple(int(x) for x in a.shape.split("x"))
  if not a.interpret and jax.default_backend() != "gpu":
    print(f"gpu_tile_sweep: needs a GPU (JAX runs on {jax.default_backend()}); --interpret "
          "runs a CPU smoke test", file=sys.stderr)
    return 3
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  sweep = Sweep(shape, jnp.dtype(a.dtype), a.repeats, a.warmup, a.interpret)
  t_start = time.perf_counter()
  rows: list[dict[str, Any]] = []
  meta = {"shape": a.shape, "dtype": a.dtype, "repeats": a.repeats,
          "warmup": a.warmup, "devices": [str(d) for d in jax.devices()],
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}

  def record(name, kernel, mode, override, result, ref):
    row = {"weighting": name, "kernel": kernel, "mode": mode, "tiles": _label(override),
           **{k: v for k, v in result.items() if k != "outs"}}
    if "outs" in result and ref is not None:
      row["rel_err"] = _err(result["outs"], ref)
      if row["rel_err"] > a.tolerance:
        row["error"] = f"wrong: differs from the table tiles by {row['rel_err']:.3g}"
    rows.append(row)
    (out / "tile_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _write_md(out / "tile_sweep.md", meta, rows)
    print(f"{name:10s} {kernel:5s} {mode:8s} {row['tiles']:28s} "
          + (row.get("error") or f"{row['ms']:8.2f} ms {row['TFLOP/s']:7.1f} TFLOP/s"),
          flush=True)
    return row

  def over_budget() -> bool:
    return time.perf_counter() - t_start > a.budget

  names = [w for w in a.weightings.split(",") if w]
  best: dict[str, Tile] = {}
  for i, name in enumerate(names):
    w = wlib.get_weighting(name)
    refs = {}
    for mode in ("fwd", "fwd+bwd"):
      if over_budget():
        break
      r = sweep.run(w, mode, {})
      refs[mode] = r.get("outs")
      record(name, "table", mode, {}, r, None)
    if i == 0:  # the full sweep on the first weighting; the others check its winners
      for kernel, cands, mode in (("fwd", FWD, "fwd"), ("dq", DQ, "fwd+bwd"),
                                  ("dkv", DKV, "fwd+bwd")):
        timed = []
        for tile in cands:
          if over_budget():
            break
          row = record(name, kernel, mode, {kernel: tile}, sweep.run(w, mode, {kernel: tile}),
                       refs[mode])
          if "error" not in row:
            timed.append((row["ms"], tile))
        if timed:
          best[kernel] = min(timed)[1]
    for mode in ("fwd", "fwd+bwd"):
      if best and refs.get(mode) is not None and not over_budget():
        record(name, "best", mode, best, sweep.run(w, mode, best), refs[mode])
  print(f"wrote {out / 'tile_sweep.md'} ({time.perf_counter() - t_start:.0f} s)")
  return 0


def _write_md(path: pathlib.Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
  lines = [f"# GPU tile sweep: {meta['shape']} {meta['dtype']}, not causal", "",
           f"{meta['date']}, jax {meta['jax']}, {', '.join(meta['devices'])}; median of "
           f"{meta['repeats']} runs after {meta['warmup']} warm-ups. Tiles: "
           "block_q x block_k / warps; 'table' is attnx's tile table.", "",
           "| weighting | kernel varied | mode | tiles | ms | TFLOP/s | compile s | rel. err |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['weighting']} | {r['kernel']} | {r['mode']} | {r['tiles']} | "
                   f"{r['error']} | | | |")
    else:
      lines.append(f"| {r['weighting']} | {r['kernel']} | {r['mode']} | {r['tiles']} | "
                   f"{r['ms']:.2f} | {r['TFLOP/s']:.1f} | {r['compile_s']:.1f} | "
                   f"{r.get('rel_err', 0):.2g} |")
  path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  sys.exit(main())
