"""Times blocked fwd+bwd attention with score modifications beside the same call without them.

    python tools/score_mod_benchmark.py [--length 16384] [--window 1024]
    python tools/score_mod_benchmark.py --memory [--length 65536]

Rows, for softmax and sigmoid, all causal under a sliding window of ``--window`` keys: the
call without a modification, with ``logits_soft_cap=30``, with ALiBi
(``score_mod=core.alibi(slopes)``, learned: the slopes get gradients), with learned
``sinks``, and with all three. Each
row: the best of five runs after compiling (the rows of a weighting timed in turn), and its
time over the first row's (the issue's target: within 1.2×). With ``--memory``: the compiled
programs' scratch (XLA's memory analysis, one head, H = 64) instead of times. Run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from attnx import core
from attnx.core import masks
from attnx.train import benchmark

ROWS = (("no modification", {}), ("logits_soft_cap=30", dict(cap=30.0)),
        ("ALiBi (learned slopes)", dict(alibi=True)), ("sinks (learned)", dict(sinks=True)),
        ("soft cap + ALiBi + sinks", dict(cap=30.0, alibi=True, sinks=True)))


def _program(weighting: str, window: int, cap: float | None = None, alibi: bool = False,
             sinks: bool = False):
  def loss(q, k, v, slopes):
    kw = {}
    if cap is not None:
      kw["logits_soft_cap"] = cap
    if alibi:
      kw["score_mod"] = core.alibi(slopes)
    if sinks:  # the slopes' array serves as the sinks' too: both get gradients
      kw["sinks"] = slopes
    out = core.attention(q, k, v, weighting=weighting, is_causal=True,
                         mask=masks.sliding_window(window - 1, 0), implementation="blocked",
                         **kw)
    return jnp.sum(out)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--length", type=int, default=None, help="T (default 16384; --memory 65536)")
  p.add_argument("--window", type=int, default=1024)
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--memory", action="store_true", help="scratch bytes instead of times")
  a = p.parse_args()
  t = a.length or (65536 if a.memory else 16384)
  heads = 1 if a.memory else a.heads
  shape = (1, t, heads, a.head_dim)
  print(f"blocked fwd+bwd, causal + sliding_window({a.window - 1}, 0), T = {t}, N = {heads}, "
        f"H = {a.head_dim}, {jax.devices()[0].device_kind}")
  keys = jax.random.split(jax.random.key(0), 3)
  for weighting in ("softmax", "sigmoid"):
    programs = [(name, _program(weighting, a.window, **kw)) for name, kw in ROWS]
    if a.memory:
      spec = jax.ShapeDtypeStruct(shape, jnp.float32)
      for name, fn in programs:
        mem = benchmark.program_memory(fn.lower(
            spec, spec, spec, jax.ShapeDtypeStruct((heads,), jnp.float32)).compile())
        print(f"  {weighting:8s} {name:24s} {mem.scratch / 2 ** 30:7.3f} GiB scratch",
              flush=True)
      continue
    args = (*(jax.random.normal(key, shape) for key in keys), core.alibi_slopes(heads))
    for _, fn in programs:  # compiled and run once before the timed rounds
      jax.block_until_ready(fn(*args))
    # The best of five rounds, the rows in turn: a slow spell slows every row, not one.
    times = benchmark.time_round_robin([functools.partial(fn, *args) for _, fn in programs], 5,
                                       statistic=min)
    for (name, _), seconds in zip(programs, times, strict=True):
      print(f"  {weighting:8s} {name:24s} {seconds * 1e3:9.1f} ms {seconds / times[0]:6.2f}x",
            flush=True)


if __name__ == "__main__":
  main()
