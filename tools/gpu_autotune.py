"""Tunes the Pallas GPU kernels' tiles on this GPU for the benchmark's shapes
(:func:`attnx.core.autotune`), and writes the winners into the tile cache that later calls —
the benchmark's too — read (``$ATTNX_TILE_CACHE``, default ``~/.cache/attnx/pallas_tiles.json``).

  python tools/gpu_autotune.py [--weightings softmax,relu,...] [--shape 4x4096x16x128]
      [--dtype bfloat16] [--causal both] [--budget 20] [--out runs/autotune]

``--budget`` bounds each (weighting, causality) search in seconds (the candidates measured by
then count). Writes OUT/autotune.md (a table: the table's and the winner's fwd+bwd ms, the
speed-up, the winning launches) and OUT/autotune.json. Needs a GPU (the tuner refuses to time
Pallas' interpreter).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from attnx import core  # noqa: E402

POINTWISE = "softmax,relu,sigmoid,power"
ROWS = "ssmax,softpick,stick_breaking,sparsemax,entmax15"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--weightings", default=f"{POINTWISE},{ROWS}")
  p.add_argument("--shape", default="4x4096x16x128", help="BxTxNxH (S = T)")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--causal", default="both", choices=("no", "yes", "both"))
  p.add_argument("--budget", type=float, default=20.0, help="seconds per search")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default="runs/autotune")
  a = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    print(f"gpu_autotune: needs a GPU (JAX runs on {jax.default_backend()})", file=sys.stderr)
    return 3
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  shape = tuple(int(x) for x in a.shape.split("x"))
  causals = {"no": (False,), "yes": (True,), "both": (False, True)}[a.causal]
  rows = []
  for name in [w for w in a.weightings.split(",") if w]:
    for causal in causals:
      t0 = time.perf_counter()
      try:
        r = core.autotune(name, shape=shape, dtype=a.dtype, causal=causal, repeats=a.repeats,
                          budget_s=a.budget)
      except ValueError as e:
        rows.append({"weighting": name, "causal": causal, "error": str(e)[:200]})
        print(f"{name} causal={causal}: {e}", flush=True)
        continue
      rows.append({"weighting": name, "causal": causal, "table ms": r.table_ms,
                   "tuned ms": r.ms, "speed-up": r.speedup,
                   "launches": {k: list(getattr(r.launches, k)) for k in ("fwd", "dq", "dkv")},
                   "measured": len(r.rows), "seconds": time.perf_counter() - t0,
                   "cache": str(r.path)})
      print(f"{name} causal={causal}: table {r.table_ms:.3f} ms -> {r.ms:.3f} ms "
            f"({r.speedup:.2f}x) {rows[-1]['launches']}", flush=True)
      (out / "autotune.json").write_text(json.dumps(
          {"chip": jax.devices()[0].device_kind, "shape": a.shape, "dtype": a.dtype,
           "rows": rows}, indent=1))
  lines = [f"# Tuned tiles on {jax.devices()[0].device_kind} ({a.shape}, {a.dtype}, "
           f"{time.strftime('%Y-%m-%d', time.gmtime())})", "",
           "| F | causal | table fwd+bwd ms | tuned ms | speed-up | fwd, dQ, dK/dV (bq, bk, warps, "
           "two-pass) |", "|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['weighting']} | {r['causal']} | {r['error']} | | | |")
    else:
      lines.append(f"| {r['weighting']} | {r['causal']} | {r['table ms']:.3f} | "
                   f"{r['tuned ms']:.3f} | {r['speed-up']:.2f}× | {r['launches']} |")
  (out / "autotune.md").write_text("\n".join(lines) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
