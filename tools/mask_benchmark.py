"""Times blocked fwd+bwd attention under structured masks (docs/guides/masks.md's table).

    python tools/mask_benchmark.py [--length 16384] [--weighting softmax]

Rows: plain causal, causal + a 512-key sliding window, causal + 16 packed documents (segment
ids), and the same window as a dense [T, S] boolean mask (what such a mask cost before
attnx.core.masks). With ``--bounds``, two rows with no mask at all that bound what any masking
can reach per unmasked score: the documents attended alone (a batch of 16 causal problems of
T/16), and rows of exactly ``window`` keys (a batch of T/window full problems of T = S =
window). With ``--tiles``, what one score costs in square problems of side L (full and causal,
no mask, a batch of T/L of them, L = 256, 512, 1024): the cost of covering a band or a
triangle with tiles of that side. Each row: the best of three runs after compiling, and the
time per unmasked score.
Runs on whatever JAX runs on; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from attnx import core
from attnx.core import masks
from attnx.train.benchmark import attended_pairs


def _time(fn, *args, repeats: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--length", type=int, default=16384)
  p.add_argument("--weighting", default="softmax")
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--documents", type=int, default=16)
  p.add_argument("--bounds", action="store_true",
                 help="add the no-mask lower bounds (documents alone, rows of window keys)")
  p.add_argument("--tiles", action="store_true",
                 help="add full and causal problems of side 256, 512, 1024 (no mask)")
  a = p.parse_args()
  t, window, docs = a.length, a.window, a.documents
  if t % docs:
    p.error(f"--length {t} must be a multiple of --documents {docs}")
  if a.bounds and t % window:
    p.error(f"--bounds: --length {t} must be a multiple of --window {window}")
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, t, a.heads, a.head_dim)) for key in keys)
  ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None]
  rows = jnp.arange(t)[:, None]
  dense_window = jnp.arange(t)[None, :] >= rows - (window - 1)
  in_window = attended_pairs(t, window=window)
  shape = (1, t, a.heads, a.head_dim)
  cases = [
      ("plain causal", {}, attended_pairs(t)),
      (f"causal + sliding_window({window - 1}, 0)",
       dict(mask=masks.sliding_window(window - 1, 0)), in_window),
      (f"causal + {docs} packed documents", dict(segment_ids=ids),
       attended_pairs(t, documents=docs)),
      ("causal + the window as a dense [T, S] mask", dict(mask=dense_window), in_window),
  ]
  cases = [(name, kw, pairs, shape, True) for name, kw, pairs in cases]
  if a.bounds:
    cases += [
        (f"bound: {docs} documents alone (no mask)", {}, attended_pairs(t, documents=docs),
         (docs, t // docs, a.heads, a.head_dim), True),
        (f"bound: rows of {window} keys (no mask)", {}, (t // window) * window * window,
         (t // window, window, a.heads, a.head_dim), False),
    ]
  if a.tiles:
    for side in (256, 512, 1024):
      if t % side:
        p.error(f"--tiles: --length {t} must be a multiple of {side}")
      batch = (t // side, side, a.heads, a.head_dim)
      if not (a.bounds and side == window):  # the bound's rows of window keys already
        cases.append((f"tiles: {t // side} full problems of {side}", {}, t * side, batch,
                      False))
      cases.append((f"tiles: {t // side} causal problems of {side}", {},
                    attended_pairs(t, documents=t // side), batch, True))
  print(f"blocked fwd+bwd, {a.weighting}, T = {t}, N = {a.heads}, H = {a.head_dim}, "
        f"{jax.devices()[0].device_kind}")
  base = None
  for name, kw, unmasked, case_shape, causal in cases:
    fn = jax.jit(jax.grad(lambda q, k, v, kw=kw, causal=causal: core.attention(
        q, k, v, weighting=a.weighting, is_causal=causal, implementation="blocked",
        **kw).sum(), argnums=(0, 1, 2)))
    seconds = _time(fn, *(x.reshape(case_shape) for x in (q, k, v)))
    per = seconds / unmasked * 1e9
    base = base or per
    print(f"  {name:45s} {seconds * 1e3:9.1f} ms {per:8.2f} ns/unmasked score "
          f"{per / base:6.2f}x", flush=True)


if __name__ == "__main__":
  main()
