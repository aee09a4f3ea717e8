"""attnx.train.benchmark.programs: the timed functions (baselines by name, attnx's) and their
forward or gradient programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.train.benchmark import programs


def _qkv(shape=(1, 16, 2, 8)):
  return tuple(jax.random.normal(k, shape) for k in jax.random.split(jax.random.PRNGKey(0), 3))


@pytest.mark.parametrize("name", ["jax.nn (xla)", "xla", "flax.linen"])
def test_baselines_are_softmax_attention(name):
  q, k, v = _qkv()
  for causal in (False, True):
    want = core.attention(q, k, v, is_causal=causal, implementation="dense")
    got = programs.baseline_fn(name, is_causal=causal)(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_baselines_that_need_an_accelerator_are_none_on_a_cpu():
  assert programs.baseline_fn("cudnn") is None
  assert programs.baseline_fn("jax pallas flash", platform=None) is None
  with pytest.raises(ValueError, match="Unknown baseline 'flash3'"):
    programs.baseline_fn("flash3")


def test_attnx_fn_and_programs():
  q, k, v = _qkv()
  fn = programs.attnx_fn(weighting="relu", implementation="blocked", is_causal=True)
  want = core.attention(q, k, v, weighting="relu", implementation="dense", is_causal=True)
  np.testing.assert_allclose(fn(q, k, v), want, atol=1e-5)
  assert programs.program(fn, "fwd") is fn
  grads = programs.compile_program(fn, "fwd+bwd", (q, k, v))(q, k, v)
  want = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(grads, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5)
  with pytest.raises(ValueError, match="mode"):
    programs.program(fn, "bwd")


def test_pallas_fn_lowers_the_kernel_for_a_gpu_only():
  fn = programs.pallas_fn("gaussian:h=4", "neg_sq_dist", scale=1.0)
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="GPU or TPU"):  # a CPU host: the kernels need one
    jax.jit(fn).lower(q, k, v)
