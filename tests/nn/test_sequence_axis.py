"""Context parallelism in attnx.nn (MultiHeadAttention / GPT ``sequence_axis``): a GPT whose
tokens are cut over 8 fake CPU devices (ring attention inside ``jax.shard_map``, subprocess
tests/support/sequence_axis_check.py) equals the same GPT on the whole sequence, for learned
and rotary positions, both layouts and the streamable weighting families; construction-time
errors for what cannot run ring-parallel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support.scripts import script_result
from support.sequence_axis_check import CASES

from attnx import nn


def _results(request) -> dict:
  """The cases this session runs (this JAX end's part, or what -k / -m chose), in one
  subprocess (JAX's start and 8 devices paid once)."""
  chosen = {it.callspec.params["name"] for it in request.session.items
            if getattr(it, "originalname", None) == request.node.originalname}
  return _batch(tuple(sorted(chosen | {request.node.callspec.params["name"]})))


@functools.lru_cache(maxsize=2)
def _batch(names: tuple[str, ...]) -> dict:
  return script_result("sequence_axis_check.py", *names)


@pytest.mark.split_by_jax
@pytest.mark.parametrize("name", list(CASES))
def test_gpt_on_8_sequence_shards_equals_the_whole_sequence(name, request):
  res = _results(request)[name]
  assert res["grad_scale"] > 1e-3, res  # a real gradient, not a vacuous comparison
  assert res["logits"] <= 1e-5, res
  assert res["grads"] <= 1e-4, res


def test_the_same_module_runs_unsharded_where_the_axis_is_not_bound():
  # Evaluation on one device: sequence_axis names an axis no map binds here, and the module
  # attends over the whole sequence with the same parameters.
  tokens = jnp.arange(24).reshape(2, 12) % 7
  plain = nn.GPT(vocab_size=7, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, max_len=12)
  sharded = plain.clone(sequence_axis="seq", sequence_layout="zigzag")
  params = plain.init(jax.random.PRNGKey(0), tokens)["params"]
  assert jax.tree.structure(params) == jax.tree.structure(
      sharded.init(jax.random.PRNGKey(0), tokens)["params"])
  assert jnp.array_equal(plain.apply({"params": params}, tokens),
                         sharded.apply({"params": params}, tokens))


@pytest.mark.parametrize("kwargs, match", [
    (dict(weighting="entmax15"), r"sequence_axis='seq'.*cannot run ring-parallel.*all_gather"),
    (dict(weighting="sparsemax"), r"cannot run ring-parallel.*streamable weighting"),
    (dict(score="additive"), r"not a dot product"),
    (dict(dropout_rate=0.1), r"never forms the attention weights"),
    (dict(sequence_layout="striped"), r"sequence_layout must be one of contiguous, zigzag"),
])
def test_what_cannot_run_ring_parallel_fails_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    nn.MultiHeadAttention(num_heads=2, sequence_axis="seq", **kwargs)


def test_cap_alibi_and_sinks_reach_the_ring():
  # The module's cap, learned ALiBi slopes and sinks run in the ring (one device: the axis is
  # bound, every step the diagonal), with the same parameters and result as unsharded.
  mha = nn.MultiHeadAttention(num_heads=2, is_causal=True, logits_soft_cap=5.0,
                              learn_alibi=True, sinks=True)
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 8))
  params = mha.init(jax.random.PRNGKey(0), x)
  params = jax.tree.map(lambda p: p + 0.5 if p.ndim == 1 and p.shape == (2,) else p, params)
  ring_mha = mha.clone(sequence_axis="seq")
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  run = jax.shard_map(lambda x: ring_mha.apply(params, x), mesh=mesh, in_specs=P(None, "seq"),
                      out_specs=P(None, "seq"), check_vma=False)
  want = mha.apply(params, x)
  assert jnp.allclose(run(x), want, atol=1e-5)
  assert not jnp.allclose(want, mha.clone(sinks=False).apply(
      {"params": {k: v for k, v in params["params"].items() if k != "sinks"}}, x), atol=1e-3)


def test_pallas_implementation_reaches_every_ring_step():
  # implementation="pallas" with the axis bound: the ring runs the Pallas kernels at every
  # step; on this CPU host (no interpret) the kernels' own error says so.
  mha = nn.MultiHeadAttention(num_heads=2, sequence_axis="seq", implementation="pallas")
  x = jnp.ones((1, 8, 4))
  params = mha.clone(implementation=None).init(jax.random.PRNGKey(0), x)
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  run = jax.shard_map(lambda x: mha.apply(params, x), mesh=mesh, in_specs=P(None, "seq"),
                      out_specs=P(None, "seq"), check_vma=False)
  with pytest.raises(ValueError, match="needs a GPU or TPU; this machine runs JAX on 'cpu'"):
    run(x)


def test_gpt_refuses_sequence_axis_for_linear_attention():
  with pytest.raises(ValueError, match=r"sequence_axis \(ring attention\) applies to attention "
                                       r"types 'dot' and 'metric', not to 'linear'"):
    nn.GPT(vocab_size=7, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, max_len=12,
           attention="linear_elu", sequence_axis="seq", positions="learned")
