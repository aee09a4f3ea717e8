"""Kernel settings on implementation objects (core.Dense/Blocked/Pallas), and the deprecated
keywords block_q/block_k/interpret they replace: every public entry point takes the objects,
the keywords still give the same programs for one release (with a DeprecationWarning), and
nothing is accepted twice or silently."""

import dataclasses
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from attnx import core
from attnx import nn as attnx_nn

DEPRECATED = "is deprecated and will be removed in the next release"


def _qkv(t=64, s=64, n=2, kh=2, h=8, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (1, t, n, h)), jax.random.normal(kk, (1, s, kh, h)),
          jax.random.normal(kv, (1, s, kh, h)))


def _program(fn, *args) -> str:
  return str(jax.make_jaxpr(fn)(*args))


def _quiet(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return fn(*args)


# ---------------------------------------------------------------------------------------------
# The objects.
# ---------------------------------------------------------------------------------------------

def test_names_stand_for_objects_with_defaults():
  assert core.get_implementation("dense") == core.Dense()
  assert core.get_implementation("blocked") == core.Blocked()
  assert core.get_implementation("pallas") == core.Pallas()
  assert core.get_implementation("split_kv") == core.SplitKV()
  obj = core.Pallas(block_q=64, interpret=True)
  assert core.get_implementation(obj) is obj
  assert [type(i) for i in core.implementations.dispatch_order()] == [
      core.Pallas, core.SplitKV, core.Blocked, core.Dense]
  assert repr(core.Blocked(block_q=32)) == "Blocked(block_q=32, block_k=None)"


def test_objects_are_frozen_and_hashable():
  obj = core.Blocked(block_q=16)
  with pytest.raises(dataclasses.FrozenInstanceError):
    obj.block_q = 32
  assert hash(obj) == hash(core.Blocked(block_q=16))
  assert core.Blocked(block_q=16) != core.Blocked(block_q=32)
  assert core.Dense().block_sizes == (None, None)
  assert core.Pallas(block_q=32, block_k=64).block_sizes == (32, 64)


@pytest.mark.parametrize("cls", [core.Blocked, core.Pallas])
@pytest.mark.parametrize("bad", [0, -16, 2.5, True, "64"])
def test_bad_tile_sizes_fail_at_construction(cls, bad):
  with pytest.raises(ValueError, match="block_q must be a positive int tile size"):
    cls(block_q=bad)
  with pytest.raises(ValueError, match="block_k must be a positive int tile size"):
    cls(block_k=bad)


def test_numpy_tile_sizes_become_ints():
  assert type(core.Blocked(block_q=np.int64(32)).block_q) is int


def test_bad_interpret_fails_at_construction():
  with pytest.raises(ValueError, match="interpret must be True or False"):
    core.Pallas(interpret="yes")


def test_unknown_implementation_names_the_objects():
  with pytest.raises(ValueError, match=r"Unknown implementation 'flash'.*core\.Pallas"):
    core.attention(*_qkv(), implementation="flash")
  with pytest.raises(ValueError, match="Unknown implementation 3"):
    core.attention(*_qkv(), implementation=3)


# ---------------------------------------------------------------------------------------------
# attention() and explain(): the settings reach the kernels.
# ---------------------------------------------------------------------------------------------

def test_blocked_tiles_reach_the_kernel():
  q, k, v = _qkv(t=128, s=128)
  run = lambda impl: (lambda q, k, v: core.attention(q, k, v, implementation=impl))
  small = _program(run(core.Blocked(block_q=16, block_k=16)), q, k, v)
  large = _program(run(core.Blocked(block_q=64, block_k=64)), q, k, v)
  assert small != large  # another tiling: another program
  dense = core.attention(q, k, v, implementation="dense")
  for impl in (core.Blocked(block_q=16, block_k=16), core.Blocked(block_q=64)):
    chex.assert_trees_all_close(core.attention(q, k, v, implementation=impl), dense,
                                atol=1e-5, rtol=1e-5)


def test_pallas_settings_reach_the_kernel():
  q, k, v = _qkv(t=64, s=64)
  dense = core.attention(q, k, v, implementation="dense")
  out = core.attention(q, k, v, implementation=core.Pallas(interpret=True, block_q=32,
                                                            block_k=16))
  chex.assert_trees_all_close(out, dense, atol=1e-5, rtol=1e-5)
  # The backend's tile rules see the object's tiles (Triton: powers of 2, at least 16).
  with pytest.raises(ValueError, match="block_q=24 is not valid"):
    core.attention(q, k, v, implementation=core.Pallas(interpret=True, block_q=24))
  # Without interpret, a CPU cannot run the kernels: the message names the object to use.
  with pytest.raises(ValueError, match=r"Pallas\(interpret=True\)"):
    core.attention(q, k, v, implementation=core.Pallas())


def test_explain_judges_the_object_it_is_given():
  q, k, v = _qkv()
  ex = core.explain(q, k, v, implementation=core.Pallas(interpret=True, block_q=24))
  assert ex.chosen is None and "block_q=24" in ex.reasons["pallas"]
  ex = core.explain(q, k, v, implementation=core.Pallas(interpret=True, block_q=32))
  assert ex.chosen == "pallas" and ex.reasons["pallas"] is None
  assert core.explain(q, k, v, implementation=core.Blocked(block_q=8)).chosen == "blocked"


@pytest.mark.parametrize("legacy, obj", [
    (dict(implementation="blocked", block_q=16), core.Blocked(block_q=16)),
    (dict(implementation="blocked", block_q=16, block_k=32),
     core.Blocked(block_q=16, block_k=32)),
    (dict(implementation="pallas", interpret=True), core.Pallas(interpret=True)),
    (dict(implementation="pallas", interpret=True, block_k=16),
     core.Pallas(interpret=True, block_k=16)),
])
def test_deprecated_keywords_warn_and_give_the_same_program(legacy, obj):
  q, k, v = _qkv()
  new = lambda q, k, v: core.attention(q, k, v, is_causal=True, implementation=obj)
  old = lambda q, k, v: core.attention(q, k, v, is_causal=True, **legacy)
  with pytest.warns(DeprecationWarning, match=DEPRECATED) as record:
    old_program = _program(old, q, k, v)
  assert record[0].filename == __file__  # points at the caller's line
  assert old_program == _program(new, q, k, v)
  with pytest.warns(DeprecationWarning, match=DEPRECATED):
    core.explain(q, k, v, **legacy)


def test_deprecated_tiles_with_the_automatic_choice_reach_the_streaming_kernel():
  q, k, v = _qkv(t=600, s=600)  # large enough for the automatic choice to stream on a CPU
  auto = lambda q, k, v: core.attention(q, k, v, block_q=32)
  with pytest.warns(DeprecationWarning, match=DEPRECATED):
    program = _program(auto, q, k, v)
  assert program == _program(
      lambda q, k, v: core.attention(q, k, v, implementation=core.Blocked(block_q=32)), q, k, v)


def test_deprecated_tile_keyword_is_still_checked():
  with pytest.raises(ValueError, match="block_q must be a positive int tile size"):
    _quiet(lambda: core.attention(*_qkv(), implementation="dense", block_q=0))


def test_settings_given_twice_are_an_error():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="set kernel settings on the implementation object"):
    _quiet(lambda: core.attention(q, k, v, implementation=core.Blocked(), block_q=16))
  with pytest.raises(ValueError, match="set kernel settings on the implementation object"):
    _quiet(lambda: core.attention(q, k, v, implementation=core.Pallas(), interpret=True))


def test_no_warning_without_deprecated_keywords():
  q, k, v = _qkv()
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    core.attention(q, k, v, implementation=core.Blocked(block_q=16))
    core.attention(q, k, v, implementation="blocked", block_q=None, interpret=False)
    core.explain(q, k, v, implementation=core.Pallas(interpret=True))


def test_problem_has_no_kernel_settings():
  fields = {f.name for f in dataclasses.fields(core.Problem)}
  assert not fields & {"block_q", "block_k", "interpret"}


# ---------------------------------------------------------------------------------------------
# ring_attention(): its steps run through the implementation object.
# ---------------------------------------------------------------------------------------------

def _ring(**kw):
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  return jax.shard_map(lambda q, k, v: core.ring_attention(q, k, v, axis_name="sp", **kw),
                       mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"),
                       check_vma=False)


@pytest.mark.parametrize("weighting", ["softmax", "stick_breaking"])
@pytest.mark.parametrize("impl", [core.Blocked(block_q=16, block_k=16),
                                  core.Pallas(interpret=True, block_q=16)])
@pytest.mark.split_by_jax
def test_ring_runs_the_object(weighting, impl):
  q, k, v = _qkv(t=32, s=32)
  out = _ring(weighting=weighting, is_causal=True, implementation=impl)(q, k, v)
  ref = core.attention(q, k, v, weighting=weighting, is_causal=True, implementation="dense")
  chex.assert_trees_all_close(out, ref, atol=2e-5, rtol=2e-5)


def test_ring_step_kernel_follows_the_object():
  q, k, v = _qkv(t=32, s=32)
  blocked = _program(_ring(implementation=core.Blocked(block_q=16)), q, k, v)
  pallas = _program(_ring(implementation=core.Pallas(interpret=True, block_q=16)), q, k, v)
  assert "pallas_call" in pallas and "pallas_call" not in blocked
  with pytest.warns(DeprecationWarning, match=DEPRECATED):
    legacy = _program(_ring(implementation="pallas", interpret=True, block_q=16), q, k, v)
  assert legacy == pallas


def test_ring_refuses_dense():
  with pytest.raises(ValueError, match="implementation must be None, 'blocked' or 'pallas'"):
    _ring(implementation=core.Dense())(*_qkv(t=32, s=32))


# ---------------------------------------------------------------------------------------------
# The Flax adapter and attnx.nn take the objects too.
# ---------------------------------------------------------------------------------------------

def test_flax_attention_fn_takes_the_object():
  q, k, v = _qkv()
  fn = core.flax_attention_fn(implementation=core.Pallas(interpret=True, block_q=32))
  chex.assert_trees_all_close(fn(q, k, v, is_causal=True),
                              nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(
                                  jnp.ones(q.shape[:2]))), atol=1e-5, rtol=1e-5)
  with pytest.warns(DeprecationWarning, match=DEPRECATED):
    legacy = core.flax_attention_fn(implementation="pallas", interpret=True)
  assert _program(legacy, q, k, v) == _program(
      core.flax_attention_fn(implementation=core.Pallas(interpret=True)), q, k, v)


def test_multi_head_attention_takes_the_object():
  x = jax.random.normal(jax.random.key(1), (2, 32, 16))
  kw = dict(num_heads=2, qkv_features=16, is_causal=True)
  stock = attnx_nn.MultiHeadAttention(implementation="dense", **kw)
  params = stock.init(jax.random.key(2), x)
  tiled = attnx_nn.MultiHeadAttention(implementation=core.Blocked(block_q=8, block_k=8), **kw)
  chex.assert_trees_all_close(tiled.apply(params, x), stock.apply(params, x), atol=1e-5,
                              rtol=1e-5)
  with pytest.raises(ValueError, match="needs the attention weights"):
    attnx_nn.MultiHeadAttention(implementation=core.Blocked(), dropout_rate=0.1,
                                **kw).init(jax.random.key(2), x)
  # Dense as an object is dense: dropout is fine.
  attnx_nn.MultiHeadAttention(implementation=core.Dense(), dropout_rate=0.1,
                              **kw).init(jax.random.key(2), x)
