"""The public API lowers for the chip it is compiled for, not for the host.

``core.attention(implementation="pallas")`` and the ``attnx.nn`` modules built on it are traced
once on this CPU and lowered for ``cuda``, for ``tpu`` and for both at once (a multi-platform
``jax.export``): the Triton custom calls appear exactly where a GPU runs, the Mosaic ones where
a TPU does, forward and backward. :func:`attnx.core.kernels.pallas.platforms.by_platform` is
checked on its own with plain JAX branches: per-platform lowering, values and gradients
against the branches run directly, ``jax.vmap``, and which operands its branches see as
perturbed.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core, nn
from attnx.core.kernels.pallas import platforms

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"
_NO_SAFETY = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]


def _qkv(t=256, n=4, kh=2, h=64, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (1, t, n, h), dtype),
          jax.random.normal(ks[1], (1, t, kh, h), dtype),
          jax.random.normal(ks[2], (1, t, kh, h), dtype))


def _lowered(fn, args, plats):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=plats).as_text()


def _counts(text):
  return text.count(TRITON), text.count(MOSAIC)


def _loss_grad(fn):
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))


@pytest.mark.parametrize("weighting", ["relu", "sparsemax"])
def test_attention_lowers_for_cuda_tpu_and_both(weighting):
  q, k, v = _qkv()
  bias = jnp.linspace(-1, 1, 256 * 256, dtype=jnp.float32).reshape(256, 256)
  mask = jnp.tril(jnp.ones((256, 256), bool))[None, None]
  attend = functools.partial(core.attention, weighting=weighting, is_causal=True,
                             implementation="pallas")
  fwd = lambda q, k, v: attend(q, k, v, bias, mask)
  grad = _loss_grad(fwd)
  # forward: one kernel; forward + backward: forward, dQ, dK/dV (each once per platform)
  for fn, calls in ((fwd, 1), (grad, 3)):
    assert _counts(_lowered(fn, (q, k, v), ("cuda",))) == (calls, 0)
    assert _counts(_lowered(fn, (q, k, v), ("tpu",))) == (0, calls)
    assert _counts(_lowered(fn, (q, k, v), ("cuda", "tpu"))) == (calls, calls)
  exported = jax.export.export(jax.jit(grad), platforms=["cuda", "tpu"],
                               disabled_checks=_NO_SAFETY)(q, k, v)
  assert exported.platforms == ("cuda", "tpu")
  assert _counts(exported.mlir_module()) == (3, 3)


def test_on_the_cpu_it_is_a_clear_error_eager_and_jitted():
  q, k, v = _qkv()
  f = functools.partial(core.attention, weighting="relu", implementation="pallas")
  for run in (f, jax.jit(f), jax.jit(_loss_grad(f))):
    with pytest.raises(ValueError, match=r"needs a GPU or TPU.*interpret=True.*'blocked'"):
      run(q, k, v)
  with pytest.raises(ValueError, match="needs a GPU or TPU"):
    _lowered(f, (q, k, v), ("cpu",))


def test_a_kernel_only_one_kind_of_device_has_fails_there_only():
  q, k, v = _qkv(dtype=jnp.float16)  # float16: the Triton kernels only
  f = functools.partial(core.attention, weighting="softmax", implementation="pallas")
  assert _counts(_lowered(_loss_grad(f), (q, k, v), ("cuda",))) == (3, 0)
  with pytest.raises(ValueError, match=r"dtype float16 is not supported by the Pallas tpu"):
    _lowered(f, (q, k, v), ("tpu",))
  with pytest.raises(ValueError, match=r"dtype float16 is not supported by the Pallas tpu"):
    _lowered(f, (q, k, v), ("cuda", "tpu"))


def test_interpret_keeps_the_hosts_kernels_and_runs():
  q, k, v = _qkv(t=64, dtype=jnp.float32)
  f = functools.partial(core.attention, weighting="relu",
                        implementation=core.Pallas(interpret=True))
  ref = core.attention(q, k, v, weighting="relu", implementation="dense")
  chex.assert_trees_all_close(jax.jit(f)(q, k, v), ref, atol=2e-5)


@pytest.mark.parametrize("attention", ["softmax", {"weighting": "entmax15"}])
def test_a_gpt_traced_on_the_cpu_lowers_for_a_gpu_and_a_tpu(attention):
  model = nn.GPT(vocab_size=32, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                 max_len=128, attention=attention, implementation="pallas",
                 dtype=jnp.bfloat16)
  tokens = jnp.zeros((2, 128), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)

  def loss(params, tokens):
    logits = model.apply(params, tokens)
    return -jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

  step = jax.value_and_grad(loss)
  for plats, want in ((("cuda",), (6, 0)), (("tpu",), (0, 6)), (("cuda", "tpu"), (6, 6))):
    assert _counts(_lowered(step, (params, tokens), plats)) == want, plats


def test_a_module_exports_for_two_platforms():
  mha = nn.MultiHeadAttention(num_heads=4, implementation="pallas", weighting="sigmoid")
  x = jnp.ones((2, 128, 64), jnp.float32)
  params = jax.eval_shape(mha.init, jax.random.key(0), x)
  exported = jax.export.export(jax.jit(mha.apply), platforms=["cuda", "tpu"],
                               disabled_checks=_NO_SAFETY)(params, x)
  assert _counts(exported.mlir_module()) == (1, 1)


# ------------------------------------------------------------------------------------------
# by_platform on its own, with plain JAX branches.
# ------------------------------------------------------------------------------------------

def _sin_cos_tanh(x, y):
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return platforms.by_platform(
      x, {"y": y}, out=out, gpu=lambda x, d: jnp.sin(x) * d["y"],
      tpu=lambda x, d: jnp.cos(x) + d["y"], other=lambda x, d: jnp.tanh(x * d["y"]) ** 2)


def test_by_platform_lowers_each_branch_for_its_own_platform():
  x, y = jnp.ones(3), jnp.ones(3)
  grad = jax.grad(lambda x, y: jnp.sum(_sin_cos_tanh(x, y)), argnums=(0, 1))
  gpu = _lowered(grad, (x, y), ("cuda",))
  tpu = _lowered(grad, (x, y), ("tpu",))
  assert "stablehlo.sine" in gpu and "stablehlo.cosine" in gpu and "tanh" not in gpu
  assert "stablehlo.cosine" in tpu and "stablehlo.sine" in tpu and "tanh" not in tpu
  both = _lowered(grad, (x, y), ("cuda", "tpu"))
  assert "stablehlo.sine" in both and "stablehlo.cosine" in both and "tanh" not in both


def test_by_platform_values_gradients_and_vmap_match_the_branch_that_runs():
  # On this CPU the "other" branch runs; its residuals come after the other branches' in the
  # custom VJP's residual list, so this reads the right slice of it.
  x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  y = jnp.linspace(0.5, 2.0, 6).reshape(2, 3)
  ref = lambda x, y: jnp.tanh(x * y) ** 2
  loss = lambda f: (lambda x, y: jnp.sum(jnp.sin(f(x, y))))
  chex.assert_trees_all_close(jax.jit(_sin_cos_tanh)(x, y), ref(x, y), atol=1e-6)
  got = jax.jit(jax.grad(loss(_sin_cos_tanh), argnums=(0, 1)))(x, y)
  want = jax.grad(loss(ref), argnums=(0, 1))(x, y)
  chex.assert_trees_all_close(got, want, atol=1e-6)
  got = jax.jit(jax.vmap(jax.grad(loss(_sin_cos_tanh)), in_axes=(0, None)))(x, y[0])
  want = jax.vmap(jax.grad(loss(ref)), in_axes=(0, None))(x, y[0])
  chex.assert_trees_all_close(got, want, atol=1e-6)
  # integer operands have no gradient and pass through
  z = platforms.by_platform(x, jnp.arange(3), out=jax.ShapeDtypeStruct(x.shape, x.dtype),
                            gpu=lambda x, i: x, tpu=lambda x, i: x, other=lambda x, i: x * i)
  np.testing.assert_allclose(z, x * jnp.arange(3))


def test_by_platform_differentiates_only_the_operands_asked_for():
  seen = []

  @jax.custom_vjp
  def inner(x, y):
    return x * y

  def fwd(x, y):
    seen.append((x.perturbed, y.perturbed))
    return x.value * y.value, (x.value, y.value)

  inner.defvjp(fwd, lambda r, g: (g * r[1], g * r[0]), symbolic_zeros=True)
  f = lambda x, y: platforms.by_platform(
      x, y, out=jax.ShapeDtypeStruct((3,), jnp.float32), gpu=inner, tpu=inner, other=inner)
  x, y = jnp.ones(3), 2 * jnp.ones(3)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(f(x, y)))(x), y)
  assert seen and set(seen) == {(True, False)}


def test_by_platform_raises_at_once_when_neither_branch_can():
  def bad(name):
    def f(x):
      raise ValueError(f"no {name}")
    return f

  out = jax.ShapeDtypeStruct((3,), jnp.float32)
  with pytest.raises(ValueError, match="^no gpu"):
    jax.jit(lambda x: platforms.by_platform(x, gpu=bad("gpu"), tpu=bad("tpu"), out=out,
                                            other="none"))(jnp.ones(3))
  f = lambda x: platforms.by_platform(x, gpu=bad("gpu"), tpu=jnp.sin, out=out, other="cpu!")
  assert "stablehlo.sine" in _lowered(f, (jnp.ones(3),), ("tpu",))
  with pytest.raises(ValueError, match="^no gpu"):
    _lowered(f, (jnp.ones(3),), ("cuda",))
  with pytest.raises(ValueError, match="^cpu!"):
    jax.jit(f)(jnp.ones(3))
