"""Run in a subprocess with 8 fake CPU devices (tests/core/test_ring.py, ``-m slow``): the
scratch memory of ring attention's forward + backward per device against the single-device
blocked kernel's, from XLA's ``memory_analysis()`` of the compiled programs (nothing runs).

Prints ``RESULT {json}`` with the temp bytes of both and their ratio. Usage:
``python ring_memory.py [T] [weighting] [causal 0/1] [layout] [documents 0/1]`` (default 65536
softmax 1, the zigzag layout when causal, no mask; documents: 16 packed documents of segment ids
with a 1024-key window, a structured mask of the whole sequence, in both programs).
"""

from __future__ import annotations

import json
import sys
import time

import jax

from attnx.train import workarounds

DEVICES = 8
workarounds.fake_cpu_devices(DEVICES)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from attnx import core  # noqa: E402
from attnx.core import weightings as wlib  # noqa: E402
from attnx.core.parallel import ring  # noqa: E402

B, N, H = 1, 8, 64


def temp_bytes(fn, *args) -> tuple[int, float]:
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - start


def main() -> None:
  t = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
  weighting = sys.argv[2] if len(sys.argv) > 2 else "softmax"
  causal = bool(int(sys.argv[3])) if len(sys.argv) > 3 else True
  layout = sys.argv[4] if len(sys.argv) > 4 else ("zigzag" if causal else "contiguous")
  documents = len(sys.argv) > 5 and bool(int(sys.argv[5]))
  x = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32)
  ids = jax.ShapeDtypeStruct((B, t), jnp.int32)
  w = wlib.get_weighting(weighting)

  def mask_of(ids):
    return (core.masks.segment_ids(ids) & core.masks.sliding_window(1024, 0) if documents
            else None)

  def single(q, k, v, ids):
    out = core.attention(q, k, v, weighting=w, scale=0.125, is_causal=causal,
                         mask=mask_of(ids), implementation="blocked")
    return jnp.sum(out * out)

  one, one_s = temp_bytes(jax.grad(single, (0, 1, 2)), x, x, x, ids)
  mesh = jax.make_mesh((DEVICES,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32,
                            sharding=NamedSharding(mesh, P(None, "sp")))
  sm = jax.shard_map(
      lambda q, k, v, ids: ring.ring_attention(q, k, v, axis_name="sp", weighting=weighting,
                                               scale=0.125, is_causal=causal,
                                               layout=layout, mask=mask_of(ids)),
      mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),), out_specs=P(None, "sp"),
      check_vma=False)

  def ringed(q, k, v, ids):
    out = sm(q, k, v, ids)
    return jnp.sum(out * out)

  per_device, ring_s = temp_bytes(jax.grad(ringed, (0, 1, 2)), xs, xs, xs, ids)
  print("RESULT " + json.dumps({
      "t": t, "weighting": weighting, "causal": causal, "layout": layout,
      "documents": documents,
      "blocked_temp_bytes": one,
      "ring_temp_bytes_per_device": per_device, "ratio": per_device / one,
      "compile_seconds": {"blocked": one_s, "ring": ring_s}}))


if __name__ == "__main__":
  main()
