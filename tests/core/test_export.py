"""``jax.export`` with a symbolic batch (issue 41): every implementation exports, forward and
``jax.grad``, and the exported function gives the non-exported results on any batch size.

A property across modules (attnx/core/api.py, implementations/, blocked.py,
blocked_rows.py, platforms.py): serving exports a model with a polymorphic batch. The batch
dims may be symbolic; T, S, heads and head dims stay static for the streaming kernels, and the
compiled Pallas kernels take no symbolic batch (a JAX limit: their grid holds it), which
raises a clear ValueError (docs/guides/implementations.md, "Exporting with a symbolic batch").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from attnx import core

N, H = 2, 16


def _spec(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _qkv(batch, t, seed=0):
  return tuple(jax.random.normal(key, (batch, t, N, H))
               for key in jax.random.split(jax.random.key(seed), 3))


def _check(fn, t, batches=(1, 3), extra_specs=lambda b: (), extra_args=lambda b: ()):
  """Exports jit(fn) with q, k, v of shape (b, t, N, H), b symbolic, and compares the exported
  function on each batch size with jit(fn)."""
  b, = export.symbolic_shape("b")
  exp = export.export(jax.jit(fn))(*([_spec(b, t, N, H)] * 3), *extra_specs(b))
  for size in batches:
    args = (*_qkv(size, t, seed=size), *extra_args(size))
    got, want = exp.call(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.shape == w.shape
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _with_grad(attn, t):
  ct = jax.random.normal(jax.random.key(7), (1, t, N, H))
  loss = lambda q, k, v: jnp.sum(attn(q, k, v) * ct)
  return lambda q, k, v: (attn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("weighting", ["softmax", "relu", "sparsemax", "stick_breaking",
                                       "ssmax"])
@pytest.mark.parametrize("implementation", ["dense", "blocked"])
@pytest.mark.split_by_jax
def test_symbolic_batch(implementation, weighting, is_causal):
  t = 64
  # A mask and a bias broadcast over the batch (and, for the mask, the heads).
  mask = (jnp.arange(t) % 5 != 3)[None, None, None, :]
  bias = 0.1 * jnp.sin(jnp.arange(N * t * t, dtype=jnp.float32)).reshape(1, N, t, t)
  attn = lambda q, k, v: core.attention(q, k, v, bias=bias, mask=mask, weighting=weighting,
                                        is_causal=is_causal, implementation=implementation)
  _check(_with_grad(attn, t), t)


def test_automatic_choice_at_long_t():
  # The report: (b, 2048, 2, 16) causal, implementation=None (the blocked kernel here).
  t = 2048
  attn = lambda q, k, v: core.attention(q, k, v, is_causal=True)
  assert core.explain(*_qkv(1, t), is_causal=True).chosen != "dense"
  _check(attn, t, batches=(1, 2))


def test_per_example_mask_and_two_batch_dims():
  t = 32
  attn = lambda q, k, v, m: core.attention(q, k, v, mask=m, implementation="blocked",
                                           weighting="sparsemax")
  lengths = lambda size: jnp.arange(t)[None, None, None, :] < (5 * jnp.arange(size) + 1)[
      :, None, None, None]
  _check(attn, t, extra_specs=lambda b: [_spec(b, 1, 1, t, dtype=jnp.bool_)],
         extra_args=lambda size: (lengths(size),))
  b1, b2 = export.symbolic_shape("b1, b2")
  two = lambda q, k, v: core.attention(q, k, v, is_causal=True, implementation="blocked")
  exp = export.export(jax.jit(two))(*([_spec(b1, b2, t, N, H)] * 3))
  q, k, v = (x.reshape(2, 3, t, N, H) for x in _qkv(6, t))
  np.testing.assert_allclose(exp.call(q, k, v), jax.jit(two)(q, k, v), rtol=2e-5, atol=2e-5)


def test_pallas_interpret():
  t = 32
  attn = lambda q, k, v: core.attention(q, k, v, implementation=core.Pallas(interpret=True),
                                        weighting="softmax", is_causal=True,
                                        mask=(jnp.arange(t) != 4)[None, None, None, :])
  _check(_with_grad(attn, t), t, batches=(2,))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_compiled_pallas_says_why_not(platform):
  # Triton lowers no symbolic grid, Mosaic no scalar-prefetch array of symbolic shape: a
  # ValueError at trace time naming the limit and the alternative.
  b, = export.symbolic_shape("b")
  attn = lambda q, k, v: core.attention(q, k, v, implementation="pallas")
  spec = _spec(b, 256, N, 64, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="symbolic batch.*implementation='blocked'"):
    export.export(jax.jit(attn), platforms=[platform])(spec, spec, spec)


def test_static_dims_but_batch():
  b, t = export.symbolic_shape("b, t")
  spec = _spec(b, t, N, H)
  blocked = lambda q, k, v: core.attention(q, k, v, implementation="blocked")
  with pytest.raises(ValueError, match="needs static T, S"):
    export.export(jax.jit(blocked))(spec, spec, spec)
  # The automatic choice runs dense, which takes a symbolic T.
  auto = lambda q, k, v: core.attention(q, k, v, weighting="sparsemax", is_causal=True)
  exp = export.export(jax.jit(auto))(spec, spec, spec)
  args = _qkv(2, 40)
  np.testing.assert_allclose(exp.call(*args), jax.jit(auto)(*args), rtol=2e-5, atol=2e-5)
