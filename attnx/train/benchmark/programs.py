"""The attention functions a benchmark times, and the programs it compiles from them.

Each function maps [B, T, N, H] arrays ``(q, k, v)`` to the output: attnx's
(:func:`attnx_fn`: ``core.attention`` with any keywords; :func:`pallas_fn`: the Pallas kernel
called directly) and the softmax baselines of other libraries (:func:`baseline_fn`, by the
names in :data:`BASELINES`). :func:`program` turns one into the forward pass or the gradient
that a benchmark's ``mode`` names, and :func:`compile_program` compiles that for given inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attnx import core
from attnx.train.benchmark.cases import MODES

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# Softmax attention by other libraries. "jax.nn (xla)" and "xla" are the same function (two
# benchmarks' names for it); "cudnn" runs on a GPU only, "jax pallas flash" (JAX's own Pallas
# flash attention: Triton on a GPU, Mosaic on a TPU) on a GPU or TPU.
BASELINES = ("jax.nn (xla)", "xla", "cudnn", "flax.linen", "jax pallas flash")


def baseline_fn(name: str, *, is_causal: bool = False,
                platform: str | None = None) -> AttentionFn | None:
  """Softmax attention of the library ``name`` (:data:`BASELINES`), with scale 1/√H; None
  where it does not run on ``platform`` ("gpu", "tpu", or None: a CPU)."""
  if name not in BASELINES:
    raise ValueError(f"Unknown baseline {name!r}; valid: {', '.join(BASELINES)}")
  if name in ("jax.nn (xla)", "xla", "cudnn"):
    if name == "cudnn" and platform != "gpu":
      return None
    implementation = "xla" if name == "jax.nn (xla)" else name
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=is_causal,
                                                        implementation=implementation)
  if name == "flax.linen":
    import flax.linen as nn  # noqa: PLC0415

    def flax_fn(q, k, v):
      mask = nn.make_causal_mask(jnp.ones(q.shape[:2])) if is_causal else None
      return nn.dot_product_attention(q, k, v, mask=mask)
    return flax_fn
  if platform == "gpu":
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # noqa: PLC0415
    return lambda q, k, v: gpu_attention.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(
        q.shape[-1]), causal=is_causal)
  if platform == "tpu":
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # noqa: PLC0415
    bnth = lambda x: x.transpose(0, 2, 1, 3)
    return lambda q, k, v: bnth(tpu_flash.flash_attention(
        bnth(q), bnth(k), bnth(v), causal=is_causal, sm_scale=1.0 / math.sqrt(q.shape[-1])))
  return None


def attnx_fn(**keywords: Any) -> AttentionFn:
  """``core.attention(q, k, v, **keywords)`` (weighting, score, implementation, masks, ...)."""
  return lambda q, k, v: core.attention(q, k, v, **keywords)


def pallas_fn(weighting: str, score: str, *, scale: float, is_causal: bool = False,
              block_q: int | None = None, block_k: int | None = None) -> AttentionFn:
  """attnx's Pallas kernel called directly (``attnx.core.kernels.pallas.pallas_attention``),
  the score turned into a dot product first (``Score.to_dot``, what ``core.attention``
  does): the kernel's own cost, without the dispatcher's checks."""
  from attnx.core.kernels.pallas import pallas_attention  # noqa: PLC0415
  from attnx.core.scores import get_score  # noqa: PLC0415

  w = core.get_weighting(weighting)

  def fn(q, k, v):
    qd, kd = get_score(score).to_dot(q, k)
    dt = q.dtype
    return pallas_attention(qd.astype(dt), kd.astype(dt), v, weighting=w, scale=scale,
                            is_causal=is_causal, block_q=block_q, block_k=block_k)
  return fn


def program(fn: AttentionFn, mode: str) -> Callable[..., Any]:
  """``fn`` itself for mode "fwd"; for "fwd+bwd" the gradient of sum(out) (in float32) w.r.t.
  q, k and v."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if mode == "fwd":
    return fn
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def compile_program(fn: AttentionFn, mode: str, inputs: tuple[Any, ...]) -> Any:
  """The jitted :func:`program` of ``fn`` lowered and compiled for ``inputs``."""
  return jax.jit(program(fn, mode)).lower(*inputs).compile()
