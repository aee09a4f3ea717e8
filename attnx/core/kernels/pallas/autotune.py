"""Tiles tuned by time on the user's GPU: :func:`autotune`.

The built-in tile table (:mod:`.tiles`) was chosen on one H100; another chip, another F or
another shape may want other tiles. :func:`autotune` times candidate launches of the three GPU
kernels for one call signature on the GPU it runs on, as tokamax's autotuner and the
tile sweep of ``tools/gpu_tile_sweep.py`` do:

1. the table's launches, forward and forward + backward (the baseline);
2. each forward candidate (forward only), each dQ and each dK/dV candidate (forward +
   backward, the other kernels at the table's): the three kernels run one after another, so
   their times add and each is chosen on its own;
3. the best forward, dQ and dK/dV together; the faster of it and the table wins.

Every candidate's output and gradients are first compared with the blocked kernel's (the
self-check's tolerance, :data:`.verify.SELF_CHECK_RTOL`): a candidate that differs, or does not
compile, cannot win, so tuning never changes results. A time is the median of ``repeats`` runs
after ``warmup`` runs, recorded with its spread (min and max). The winner goes into the cache
file (:mod:`.tile_cache`) under the chip, the jaxlib and the signature, with every measurement;
later calls of that signature on that chip read it.

It refuses to run where no GPU runs JAX (Pallas' interpreter times nothing); a ``timer`` stands
in for the clock in tests (then the kernels run in the interpreter, ``interpret=True``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx.core.kernels.pallas import tile_cache, tiles, verify
from attnx.core.kernels.pallas.tiles import GpuTile, GpuTiles
from attnx.core.kernels.pallas.wrapper import pallas_attention
from attnx.core.weightings import get_weighting

__all__ = ["CANDIDATES", "TuneResult", "autotune", "median_timer"]

# The candidates of each kernel (tools/gpu_tile_sweep.py's grid): powers of 2, the warps that
# suit them.
CANDIDATES: Mapping[str, tuple[GpuTile, ...]] = {
    "fwd": (GpuTile(128, 32, 8), GpuTile(128, 64, 8), GpuTile(64, 64, 4), GpuTile(64, 128, 8),
            GpuTile(128, 128, 8), GpuTile(64, 32, 4)),
    "dq": (GpuTile(64, 16, 8), GpuTile(64, 32, 4), GpuTile(64, 64, 4), GpuTile(64, 64, 8),
           GpuTile(128, 32, 8), GpuTile(128, 64, 8), GpuTile(32, 64, 4), GpuTile(128, 128, 8)),
    "dkv": (GpuTile(32, 64, 8), GpuTile(64, 64, 4), GpuTile(64, 64, 8), GpuTile(32, 128, 8),
            GpuTile(64, 128, 8), GpuTile(128, 64, 8), GpuTile(128, 128, 8), GpuTile(16, 64, 4)),
}

Timer = Callable[[Callable[[], Any], GpuTiles], Sequence[float]]


def median_timer(repeats: int = 7, warmup: int = 2) -> Timer:
  """The clock: ``run`` ``warmup`` times, then ``repeats`` times timed (seconds each)."""
  def timer(run: Callable[[], Any], launches: GpuTiles) -> list[float]:
    del launches
    for _ in range(warmup):
      jax.block_until_ready(run())
    out = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(run())
      out.append(time.perf_counter() - t0)
    return out
  return timer


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """What :func:`autotune` found: the winning ``launches``, its fwd+bwd milliseconds and the
  table's (``speedup`` = table / winner), the signature and chip it is cached under, the cache
  file (None when off) and every measurement (``rows``: kernel, launches, mode, ms, spread, or
  the error that kept it out)."""

  launches: GpuTiles
  ms: float
  table_ms: float
  signature: dict[str, Any]
  chip: str
  path: Any
  rows: tuple[dict[str, Any], ...]

  @property
  def speedup(self) -> float:
    return self.table_ms / self.ms


def _label(launches: GpuTiles) -> dict[str, list]:
  return {k: list(getattr(launches, k)) for k in tile_cache.KERNELS}


def autotune(weighting: Any = "softmax", *, shape: tuple[int, int, int, int] = (4, 4096, 16, 128),
             kv_heads: int | None = None, dtype: Any = "bfloat16", causal: bool = False,
             candidates: Mapping[str, Sequence[GpuTile]] | None = None, repeats: int = 7,
             warmup: int = 2, budget_s: float | None = None, timer: Timer | None = None,
             interpret: bool = False, write: bool = True,
             check: Callable[[GpuTiles, list, list], str | None] | None = None,
             progress: Callable[[str], None] | None = None) -> TuneResult:
  """Times the GPU kernels' candidate launches for one call signature and caches the winner.

  Args:
    weighting: F (a name or a weighting) whose kernels are tuned.
    shape: ``(B, T, N, H)`` of the queries (S = T, Hv = H).
    kv_heads: K (GQA; default N).
    dtype: the inputs' dtype.
    causal: tune the causal kernels (their own cache entry).
    candidates: per kernel (``"fwd"``, ``"dq"``, ``"dkv"``) the launches to try (default
      :data:`CANDIDATES`; a kernel left out keeps the table's).
    repeats, warmup: the clock's runs per measurement.
    budget_s: no new measurement starts after this many seconds (what was measured counts).
    timer: ``timer(run, launches) -> seconds per run`` in place of the clock (tests); the
      default refuses to run where JAX has no GPU.
    interpret: run the kernels in Pallas' interpreter (with a ``timer``: tests on a CPU).
    write: write the winner into the cache file (:mod:`.tile_cache`).
    check: ``check(launches, outs, ref) -> reason | None`` in place of the comparison with the
      blocked kernel (tests).
    progress: called with a line per measurement.

  Returns:
    A :class:`TuneResult`.

  Raises:
    ValueError: where JAX runs on no GPU and no ``timer`` is given, or for bad arguments.
  """
  if timer is None and jax.default_backend() != "gpu":
    raise ValueError(
        f"autotune times the Pallas GPU kernels on the GPU it runs on; JAX runs on "
        f"{jax.default_backend()!r} here, where Pallas' interpreter would time nothing "
        "meaningful. Run it on the GPU whose tiles you want (the cache file then serves every "
        "later call of the signature there).")
  if timer is not None and not interpret and jax.default_backend() != "gpu":
    raise ValueError("autotune(timer=...) on a machine without a GPU needs interpret=True")
  w = get_weighting(weighting)
  b, t, n, h = (int(x) for x in shape)
  kh = n if kv_heads is None else int(kv_heads)
  if min(b, t, n, h, kh) < 1 or n % kh:
    raise ValueError(f"autotune: shape (B, T, N, H) = {shape} and kv_heads={kv_heads} must be "
                     "positive with N a multiple of K")
  dtype = jnp.dtype(dtype)
  reason = tiles.supported(w, backend="gpu", dtype=dtype, head_dim=h, value_head_dim=h,
                           interpret=interpret)
  if reason:
    raise ValueError(f"autotune: {reason}")
  cands = CANDIDATES if candidates is None else candidates
  unknown = set(cands) - set(tile_cache.KERNELS)
  if unknown:
    raise ValueError(f"autotune: candidates for unknown kernels {sorted(unknown)}; valid: "
                     f"{list(tile_cache.KERNELS)}")
  timer = median_timer(repeats, warmup) if timer is None else timer
  say = progress or (lambda _: None)
  chip = "interpreter" if interpret else jax.devices()[0].device_kind
  sig = tile_cache.signature(w, t, t, h, h, dtype, causal, n // kh)

  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
  k, v = (jax.random.normal(x, (b, t, kh, h), jnp.float32).astype(dtype) for x in keys[1:3])
  ct = jax.random.normal(keys[3], (b, t, n, h), jnp.float32).astype(dtype)
  scale = 1.0 / math.sqrt(h)
  backend = "gpu" if interpret else None

  def program(mode: str, blocked: bool = False):
    def fwd(q, k, v):
      if blocked:
        from attnx.core import api  # noqa: PLC0415 (api imports the implementations)
        return api.attention(q, k, v, weighting=w, scale=scale, is_causal=causal,
                             implementation="blocked")
      return pallas_attention(q, k, v, weighting=w, scale=scale, is_causal=causal,
                              backend=backend, interpret=interpret)
    if mode == "fwd":
      return lambda q, k, v: (fwd(q, k, v),)
    def both(q, k, v):
      out, vjp = jax.vjp(fwd, q, k, v)
      return (out, *vjp(ct))
    return both

  f32 = lambda outs: [np.asarray(x, np.float32) for x in outs]
  ref = {m: f32(jax.jit(program(m, blocked=True))(q, k, v)) for m in ("fwd", "fwd+bwd")}
  rtol = verify.SELF_CHECK_RTOL.get(dtype.name, 8e-2)

  def compare(launches: GpuTiles, outs: list, want: list) -> str | None:
    err = max(float(np.max(np.abs(o - r)) / max(1e-6, float(np.max(np.abs(r)))))
              for o, r in zip(outs, want, strict=True))
    return None if err <= rtol else f"differs from the blocked kernel by {err:.3g} (> {rtol})"

  check = compare if check is None else check
  t_start = time.perf_counter()
  rows: list[dict[str, Any]] = []

  def measure(kernel: str, launches: GpuTiles, mode: str) -> float | None:
    """Median ms of ``launches`` in ``mode``, or None (an error, recorded)."""
    row: dict[str, Any] = {"kernel": kernel, "mode": mode, "launches": _label(launches)}
    try:
      with tile_cache.override(launches):
        compiled = jax.jit(program(mode)).lower(q, k, v).compile()
      outs = compiled(q, k, v)
      why = check(launches, f32(outs), ref[mode])
      if why is None:
        ts = [1e3 * x for x in timer(lambda: compiled(q, k, v), launches)]
        row.update(ms=float(np.median(ts)), spread=[float(min(ts)), float(max(ts))])
      else:
        row["error"] = why
    except Exception as e:  # noqa: BLE001 - a launch that does not compile is a result
      row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    rows.append(row)
    say(f"{kernel:5s} {mode:8s} {row['launches']}: "
        + (row.get("error") or f"{row['ms']:.3f} ms"))
    return row.get("ms")

  def over_budget() -> bool:
    return budget_s is not None and time.perf_counter() - t_start > budget_s

  family = None if not hasattr(w, "stream") or w.stream is None else w.stream.family
  table = tiles.gpu_tiles(-(-h // 16) * 16, family, dtype)
  table_ms = measure("table", table, "fwd+bwd")
  if table_ms is None:
    raise ValueError(f"autotune: the table's own launches failed: {rows[-1]['error']}")
  table_fwd = measure("table", table, "fwd")
  best: dict[str, GpuTile] = {}
  for kernel in tile_cache.KERNELS:
    mode = "fwd" if kernel == "fwd" else "fwd+bwd"
    base = table_fwd if kernel == "fwd" else table_ms
    timed = [] if base is None else [(base, getattr(table, kernel))]
    for tile in cands.get(kernel, ()):
      if over_budget():
        break
      if tile == getattr(table, kernel):
        continue
      ms = measure(kernel, table._replace(**{kernel: tile}), mode)
      if ms is not None:
        timed.append((ms, tile))
    if timed:
      best[kernel] = min(timed, key=lambda x: x[0])[1]
  combo = table._replace(**best)
  winner, win_ms = table, table_ms
  if combo != table and not over_budget():
    combo_ms = measure("all", combo, "fwd+bwd")
    if combo_ms is not None and combo_ms < table_ms:
      winner, win_ms = combo, combo_ms
  path = None
  if write:
    path = tile_cache.store(sig, chip, _label(winner), {
        "ms": win_ms, "table_ms": table_ms, "shape": [b, t, n, h], "kv_heads": kh,
        "repeats": repeats, "warmup": warmup, "rows": rows})
  return TuneResult(winner, win_ms, table_ms, sig, chip, path, tuple(rows))
