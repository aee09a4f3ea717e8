"""attnx.core.kernels.pallas: the kernels lower for the real targets from this CPU machine.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",) | ("tpu",))`` runs Pallas' Triton
lowering (kernel → Triton IR, the ``__gpu$xla.gpu.triton`` custom call) and its Mosaic TPU
lowering (kernel → Mosaic MLIR, ``tpu_custom_call``), which reject what the hardware cannot do
(non-power-of-2 Triton arrays, TPU blocks off the (8, 128) tiling, unsupported primitives). The
interpreter accepts all of that, so values are tested in test_pallas_attention.py and lowering
here. Compiling the Triton IR to PTX and the Mosaic MLIR to TPU code needs the device.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from support import lowering

from attnx import core
from attnx.core import weightings as wlib
from attnx.core.kernels import pallas as pa
from attnx.core.kernels.pallas import common, triton, wrapper

POINTWISE = wlib.list_weightings("pointwise")
VARIANTS = ["relu:normalization=length", "sigmoid:normalization=none",
            "gaussian:normalization=none", "softmax:alpha=0.5", "power:p=0.5",
            "triangular:normalization=length"]
PLATFORMS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One lowering problem: q [b, t, n, h], k/v [b, s, kh, h|hv]."""
  b: int = 2
  t: int = 200
  s: int = 256
  n: int = 4
  kh: int = 2
  h: int = 64
  hv: int | None = None
  dtype: str = "bfloat16"
  causal: bool = True
  mask: tuple[int, ...] | None = (2, 1, 200, 256)
  bias: tuple[int, ...] | None = (1, 4, 200, 256)
  lengths: bool = False
  block_q: int | None = None
  block_k: int | None = None


# A: everything at once (GQA, ragged T, causal, mask, differentiated bias), H = 64.
FULL = Shape()
# B: H = 128, float32, key lengths, no mask/bias (forward and backward).
LONG = Shape(b=1, t=512, s=512, n=2, kh=2, h=128, dtype="float32", causal=False, mask=None,
             bias=None, lengths=True)
# Sampled variations.
SHAPES = {
    "h128-gqa8-ragged-causal-lengths": Shape(b=1, t=1000, s=1000, n=8, kh=1, h=128,
                                             mask=None, bias=None, lengths=True),
    "h128-t4096-default-tiles": Shape(b=1, t=4096, s=4096, n=2, kh=1, h=128, mask=None,
                                      bias=None),
    "h130-distance-keybias": Shape(b=2, t=100, s=300, n=2, kh=1, h=130, hv=128,
                                   dtype="float32", causal=False, mask=None,
                                   bias=(2, 1, 1, 300)),
    "h200-hv80": Shape(b=1, t=128, s=128, n=2, kh=1, h=200, hv=80, mask=None, bias=None),
    "h64-small-tiles-int32-mask": Shape(block_q=16, block_k=128),
}


def _lower(name: str, shape: Shape, platform: str, grad: bool) -> str:
  backend, _ = PLATFORMS[platform]
  w = wlib.get_weighting(name)
  dt = jnp.dtype(shape.dtype)
  sds = jax.ShapeDtypeStruct
  args = [sds((shape.b, shape.t, shape.n, shape.h), dt), sds((shape.b, shape.s, shape.kh,
                                                               shape.h), dt),
          sds((shape.b, shape.s, shape.kh, shape.hv or shape.h), dt),
          None if shape.bias is None else sds(shape.bias, jnp.float32),
          None if shape.mask is None else sds(shape.mask, jnp.bool_),
          sds((shape.b,), jnp.int32)]

  def f(q, k, v, bias, mask, lengths):
    return pa.pallas_attention(
        q, k, v, weighting=w, scale=0.125, bias=bias, mask=mask, is_causal=shape.causal,
        q_lengths=lengths if shape.lengths else None,
        kv_lengths=lengths if shape.lengths else None, block_q=shape.block_q,
        block_k=shape.block_k, backend=backend)

  fn = f
  if grad:
    argnums = (0, 1, 2) if shape.bias is None else (0, 1, 2, 3)
    # Σ out²: the cotangent reads the output, so no JAX version drops the forward kernel.
    fn = jax.grad(lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32))), argnums=argnums)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _check(name, shape, platform, grad):
  text = _lower(name, shape, platform, grad)
  _, target = PLATFORMS[platform]
  # Forward: one kernel; forward + backward: forward, dQ (+ dS) and dK/dV (or dK, dV) kernels.
  lowering.custom_calls(text, target, lowering.expected_kernels(
      platform, shape.dtype, shape.h, shape.hv) if grad else {"fwd"})


def _alternate(names, platforms=tuple(PLATFORMS)):
  """(name, platform) pairs: CI lowers each name for one platform, alternating, and
  -m exhaustive for the other (20 minutes of CI)."""
  return [(n, p) if i % len(platforms) == platforms.index(p)
          else pytest.param(n, p, marks=pytest.mark.exhaustive)
          for i, n in enumerate(names) for p in platforms]


@pytest.mark.parametrize("name,platform", _alternate(POINTWISE + VARIANTS))
def test_every_weighting_lowers_fwd_and_bwd(name, platform):
  _check(name, FULL, platform, grad=True)
  _check(name, LONG, platform, grad=False)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,platform", _alternate(
    ["softmax_plus_one", "relu", "gaussian:normalization=none"]))
def test_sampled_shapes_lower(name, shape, platform):
  _check(name, SHAPES[shape], platform, grad=True)


def test_head_chunks():
  assert triton.head_chunks(64) == ((0, 64),)
  assert triton.head_chunks(130) == ((0, 128), (128, 16))  # neg_sq_dist of H = 128
  assert triton.head_chunks(66) == ((0, 64), (64, 16))
  assert triton.head_chunks(200) == ((0, 128), (128, 64), (192, 16))
  assert triton.head_chunks(8) == ((0, 16),)


def test_float16_lowers_for_cuda():
  _check("softplus", dataclasses.replace(FULL, dtype="float16", h=32), "cuda", grad=True)


@pytest.mark.exhaustive
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", ["full", "long", *SHAPES])
@pytest.mark.parametrize("name", POINTWISE + VARIANTS)
def test_full_lowering_matrix(name, shape, platform):
  s = {"full": FULL, "long": LONG}.get(shape) or SHAPES[shape]
  for grad in (False, True):
    _check(name, s, platform, grad)


def _raw_forward(backend: str, bq: int, bk: int, t: int = 64, s: int = 256, h: int = 64):
  """Lowers wrapper.forward (with a [1, 1, T, S] bias: (bq, bk) blocks in memory) with tiles
  that bypass pallas_attention's checks."""
  cfg = common.KernelConfig(
      w=wlib.get_weighting("relu"), backend=backend, interpret=False, s=s, tp=t, sp=s, g=1,
      scale=1.0, is_causal=False, q_bound=False, kv_bound=False, bq=bq, bk=bk, bq_dq=bq,
      bk_dq=bk, bq_dkv=bq, bk_dkv=bk)
  q = jax.ShapeDtypeStruct((1, t, 1, h), jnp.float32)
  k = jax.ShapeDtypeStruct((1, s, 1, h), jnp.float32)
  bias = jax.ShapeDtypeStruct((1, 1, t, s), jnp.float32)
  lens = jax.ShapeDtypeStruct((1,), jnp.int32)
  f = lambda q, k, b, lq, lk: wrapper.forward(cfg, q, k, k, b, None, lq, lk)
  platform = "cuda" if backend == "gpu" else "tpu"
  return jax.jit(f).trace(q, k, bias, lens, lens).lower(lowering_platforms=(platform,))


def test_the_tile_rules_are_the_lowerings_rules():
  """What check_block_sizes rejects, the lowerings reject too (the interpreter does not)."""
  _raw_forward("gpu", 32, 64)
  with pytest.raises(Exception, match="power of 2"):
    _raw_forward("gpu", 48, 64, t=96)
  _raw_forward("tpu", 8, 128)
  with pytest.raises(Exception, match="divisible by 8 and 128"):
    _raw_forward("tpu", 8, 64)
  with pytest.raises(Exception, match="divisible by 8 and 128"):
    _raw_forward("tpu", 12, 128, t=96)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("weighting", ["softmax", "sigmoid"])
def test_a_soft_cap_and_sinks_lower_fwd_and_bwd(weighting, platform):
  """core.attention with logits_soft_cap and sinks through core.Pallas lowers for each chip:
  the cap's tanh in the forward, dQ and dK/dV kernels, the sinks as a forward operand (a
  [1] block per program on the GPU, a lane-replicated (1, 128) block on the TPU), GQA, a
  ragged T, causal, a differentiated bias; the sinks' gradient is XLA outside the kernels."""
  _, target = PLATFORMS[platform]
  sds = jax.ShapeDtypeStruct
  args = (sds((2, 200, 4, 64), jnp.bfloat16), sds((2, 256, 2, 64), jnp.bfloat16),
          sds((2, 256, 2, 64), jnp.bfloat16), sds((1, 4, 200, 256), jnp.float32),
          sds((4,), jnp.float32))

  def loss(q, k, v, bias, sinks):
    out = core.attention(q, k, v, bias, weighting=weighting, is_causal=True,
                         logits_soft_cap=30.0, sinks=sinks, implementation=core.Pallas())
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  lowering.custom_calls(text, target, lowering.expected_kernels(platform, "bfloat16", 64, 64))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(("weighting", "alibi"), [("stick_breaking", False), ("entmax15", True),
                                                  ("ssmax", True)])
def test_a_soft_cap_with_a_whole_row_weighting_lowers_fwd_and_bwd(weighting, alibi, platform):
  """core.attention with logits_soft_cap (and ALiBi with learned slopes) and a whole-row
  weighting through core.Pallas lowers for each chip: the cap's tanh in the forward (entmax:
  its threshold passes too), dQ and dK/dV row kernels, 1 − tanh² in the backward ones,
  stick-breaking's carries; ALiBi's slopes an operand of every kernel (GPU: a [1] block, a
  [Gp] row per kv head in dK/dV; TPU: SMEM) and the dQ kernel's per-row d slope sums one more
  output; G = 3 with ALiBi, a ragged T, causal, a differentiated bias."""
  _, target = PLATFORMS[platform]
  sds = jax.ShapeDtypeStruct
  n = 6 if alibi else 4
  args = (sds((2, 200, n, 64), jnp.bfloat16), sds((2, 256, 2, 64), jnp.bfloat16),
          sds((2, 256, 2, 64), jnp.bfloat16), sds((1, n, 200, 256), jnp.float32),
          sds((n,), jnp.float32))

  def loss(q, k, v, bias, slopes):
    out = core.attention(q, k, v, bias, weighting=weighting, is_causal=True,
                         logits_soft_cap=30.0, implementation=core.Pallas(),
                         score_mod=core.alibi(slopes) if alibi else None)
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4) if alibi else (0, 1, 2, 3))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  assert "attnx_pallas_rows_fwd" in text
  lowering.custom_calls(text, target, lowering.expected_kernels(
      platform, "bfloat16", 64, 64, wlib.get_weighting(weighting).stream.family))


# q, k, v (G = 3, a ragged T), a bias, sinks and slopes of the modified programs lowered below.
_MODDED_ARGS = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
    ((2, 200, 6, 64), jnp.bfloat16), ((2, 256, 2, 64), jnp.bfloat16),
    ((2, 256, 2, 64), jnp.bfloat16), ((1, 6, 200, 256), jnp.float32), ((6,), jnp.float32),
    ((6,), jnp.float32)))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(("weighting", "alibi"), [("entmax15", False), ("ssmax", True),
                                                  ("softpick", False)])
def test_sinks_with_a_whole_row_weighting_lower_fwd_and_bwd(weighting, alibi, platform):
  """core.attention with learned sinks (a cap, and ALiBi for SSMax) and a whole-row weighting
  through core.Pallas lowers for each chip: the sinks an operand of the forward row kernel
  only (GPU: a [1] block at the query head; TPU: the whole [N] in SMEM), folded in as a full
  key tile (entmax: its threshold passes too), d sinks outside the kernels; G = 3, a ragged T,
  causal, a differentiated bias."""
  _, target = PLATFORMS[platform]
  args = _MODDED_ARGS

  def loss(q, k, v, bias, sinks, slopes):
    out = core.attention(q, k, v, bias, weighting=weighting, is_causal=True,
                         logits_soft_cap=30.0, sinks=sinks, implementation=core.Pallas(),
                         score_mod=core.alibi(slopes) if alibi else None)
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5) if alibi else (0, 1, 2, 3, 4))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  assert "attnx_pallas_rows_fwd" in text
  lowering.custom_calls(text, target, lowering.expected_kernels(
      platform, "bfloat16", 64, 64, wlib.get_weighting(weighting).stream.family))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "symmetric"])
def test_alibi_with_a_cap_and_sinks_lowers_fwd_and_bwd(causal, platform):
  """core.attention with core.alibi (learned slopes), a cap and sinks through core.Pallas
  lowers for each chip: the slopes as an operand of the forward, dQ and dK/dV kernels (GPU:
  a [1] block per program, a [Gp] row per kv head in dK/dV; TPU: the whole [N] in SMEM), the
  dQ kernel's per-row d slope sums as one more output, G = 3 (not a power of 2), a ragged T,
  a differentiated bias."""
  _, target = PLATFORMS[platform]
  args = _MODDED_ARGS

  def loss(q, k, v, bias, sinks, slopes):
    out = core.attention(q, k, v, bias, weighting="softmax", is_causal=causal,
                         logits_soft_cap=30.0, sinks=sinks,
                         score_mod=core.alibi(slopes, symmetric=not causal),
                         implementation=core.Pallas())
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  lowering.custom_calls(text, target, lowering.expected_kernels(platform, "bfloat16", 64, 64))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("weighting", ["softmax", "ssmax", "stick_breaking"])
def test_a_relative_table_with_a_cap_lowers_fwd_and_bwd(weighting, platform):
  """core.attention with core.relative_table (a learned, clipped table [N, 31]) and a cap
  through core.Pallas lowers for a GPU, pointwise and whole-row: the extended table an
  operand of the forward, dQ and dK/dV kernels (gathered loads: a [Lx] row per program, G
  rows per kv head in dK/dV), d ext the dQ kernel's output, zero-initialised through an
  input/output alias and added to with atomic adds (tt.atomic_rmw); G = 3, a ragged T, causal,
  a differentiated bias. And for a TPU (Mosaic): each tile's window of the reversed table,
  d ext from the dQ kernel's diagonal sums."""
  _, target = PLATFORMS[platform]
  q, k, v, bias = _MODDED_ARGS[:4]

  def loss(q, k, v, bias, table):
    out = core.attention(q, k, v, bias, weighting=weighting, is_causal=True,
                         logits_soft_cap=30.0, score_mod=core.relative_table(table),
                         implementation=core.Pallas())
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  traced = grad.trace(q, k, v, bias, jax.ShapeDtypeStruct((6, 31), jnp.float32))
  text = traced.lower(lowering_platforms=(platform,)).as_text()
  if platform == "cuda":
    assert "atomic_rmw" in text  # in the dQ kernel's serialized Triton IR
  family = None if weighting == "softmax" else wlib.get_weighting(weighting).stream.family
  lowering.custom_calls(text, target, lowering.expected_kernels(
      platform, "bfloat16", 64, 64, *([family] if family else [])))
