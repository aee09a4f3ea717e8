"""What a structured mask's tile metadata costs per call in the Pallas kernels' path.

    python tools/mask_metadata_cost.py [T]        (default T = 16 384)

Times :func:`attnx.core.kernels.pallas.masking.prepare` — the spans and full runs of the
forward, dQ and dK/dV loops (the GPU tile table's 16-bit tiles at H = 128), computed from the
mask object without a T×S array — jitted, on this machine's default device, for a causal
512-key window and 16 packed documents: the median of 5 calls after one warm-up. FlexAttention
builds its BlockMask the same way once per mask; attnx builds the metadata inside every call.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from attnx.core import masks
from attnx.core.kernels.pallas import masking

TILES = {"fwd": (128, 64), "dq": (64, 32), "dkv": (64, 64)}


def main() -> None:
  t = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
  cases = {"causal 512-key window": masks.causal() & masks.sliding_window(511, 0),
           "16 packed documents": masks.segment_ids(
               np.repeat(np.arange(16, dtype=np.int32), -(-t // 16))[None, :t])}
  prepare = jax.jit(lambda m: masking.prepare(m, TILES, t, t, t, t)[1])
  print(f"T = {t}, tiles {TILES}, {jax.devices()[0].device_kind}")
  for name, mask in cases.items():
    bound = mask.bind((1,), 16, t, t)
    jax.block_until_ready(prepare(bound))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      jax.block_until_ready(prepare(bound))
      times.append(time.perf_counter() - t0)
    print(f"{name}: {np.median(times) * 1e3:.2f} ms")


if __name__ == "__main__":
  main()
