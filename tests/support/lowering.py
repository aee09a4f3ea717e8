"""What a lowered forward+backward Pallas program must contain (tests of the kernels' lowering
for cuda and tpu): the kernels the GPU tile table and the TPU layout call for."""

from __future__ import annotations

import re

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
