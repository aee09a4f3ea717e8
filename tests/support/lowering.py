"""What a lowered forward+backward Pallas program must contain (tests of the kernels' lowering
for cuda and tpu): the kernels the GPU tile table and the TPU layout call for."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from attnx.core.kernels.pallas import tiles as pa


def expected_kernels(platform: str, dtype: str, h: int, hv: int | None,
                     family: str | None = None) -> set[str]:
  """Kernel names (without ``attnx_pallas_[rows_]``) of a fwd+bwd program: forward, dQ, and
  dK/dV — as two passes, dK and dV, where the GPU table splits them (float32 above H = 64)."""
  padded = -(-max(h, hv or h) // pa.GPU_MIN_BLOCK) * pa.GPU_MIN_BLOCK
  split = platform == "cuda" and pa.gpu_tiles(padded, family, jnp.dtype(dtype)).dkv.two_pass_dkv
  return {"fwd", "dq"} | ({"dk", "dv"} if split else {"dkv"})


def custom_calls(text: str, target: str, expected: set[str]) -> None:
  """Asserts one ``target`` custom call per expected kernel and nothing else, and that the
  kernels named are the expected ones."""
  calls = re.findall(r"custom_call @([\w.$]+)", text)
  assert calls.count(target) == len(expected) and set(calls) == {target}, (calls, expected)
  names = set(re.findall(r"attnx_pallas_(?:rows_)?(fwd|dq|dkv|dk|dv)\b", text))
  assert names == expected, (names, expected)


#: The device a program lowered for ``cuda`` or ``tpu`` from this host is traced for.
CHIPS = {"cuda": jax.sharding.AbstractDevice("NVIDIA H100", None, "gpu"),
         "tpu": jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")}


def chip_mesh(platform: str, axis_sizes: tuple[int, ...],
              axis_names: tuple[str, ...]) -> jax.sharding.AbstractMesh:
  """A mesh of abstract devices of the chip that a ``jax.shard_map`` program traced on this
  CPU host is lowered for: jax >= 0.11 lowers a Triton kernel for the GPU of the mesh it was
  traced in, which a mesh of this host's CPUs does not name (attnx._compat)."""
  return jax.sharding.AbstractMesh(
      axis_sizes, axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(axis_names),
      abstract_device=CHIPS[platform])
