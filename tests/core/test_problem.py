"""attnx.core.problem: the argument checks every entry point shares, called directly.

`core.attention`'s own errors are tested in test_api.py; here each public check is called the
way `ring_attention` and the dispatcher call it, against hand-written expectations.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import problem


def _zeros(*shape, dtype=jnp.float32):
  return jnp.zeros(shape, dtype)


def test_check_inputs_accepts_gqa_and_broadcast_masks():
  q, k = _zeros(2, 5, 6, 8), _zeros(2, 7, 3, 8)
  mask = jnp.ones((1, 6, 5, 1), bool)  # broadcasts to [B, N, T, S]
  assert problem.check_inputs(q, k, k, None, mask, core.get_score("scaled_dot")) is None


@pytest.mark.parametrize("q,k,v,mask,match", [
    ((2, 5, 6, 8), (2, 7, 4, 8), (2, 7, 4, 8), None, r"multiple of key/value heads K=4"),
    ((2, 5, 6, 8), (2, 7, 3, 8), (2, 6, 3, 8), None, r"same length S"),
    ((2, 5, 6, 8), (2, 7, 3, 4), (2, 7, 3, 4), None, r"equal query/key head dims"),
    ((2, 5, 6, 8), (2, 7, 3, 8), (2, 7, 3, 8), (2, 6, 5, 8), r"does not broadcast"),
])
def test_check_inputs_names_the_shapes(q, k, v, mask, match):
  mask = None if mask is None else jnp.ones(mask, bool)
  with pytest.raises(ValueError, match=match):
    problem.check_inputs(_zeros(*q), _zeros(*k), _zeros(*v), None, mask,
                         core.get_score("scaled_dot"))


def test_resolve_gives_the_objects_and_the_default_scale():
  w, sc, params, scale = problem.resolve("relu:normalization=length", "scaled_dot", None, None,
                                         16)
  assert w.name == core.get_weighting("relu:normalization=length").name
  assert sc.name == "scaled_dot" and params == {}
  assert scale == pytest.approx(1 / math.sqrt(16))
  # An unscaled score keeps scale 1; an explicit scale is kept as given.
  assert problem.resolve("softmax", "dot", None, None, 16)[3] == 1.0
  assert problem.resolve("softmax", "scaled_dot", 0.5, None, 16)[3] == 0.5
  with pytest.raises(ValueError, match="distance"):
    problem.resolve("gaussian", "scaled_dot", None, None, 16)


def test_weighting_params_are_the_ones_a_weighting_declares():
  ssmax = core.get_weighting("ssmax")
  assert [(p.name, p.default, p.kernel_arg) for p in ssmax.learnable] == [("s", 1.0, "ssmax_s")]
  assert problem.check_weighting_params(ssmax, None, 4) == {}
  got = problem.check_weighting_params(ssmax, {"s": np.full(4, 0.5, np.float16)}, 4)
  assert list(got) == ["s"] and got["s"].shape == (4,) and got["s"].dtype == jnp.float32
  assert ssmax.kernel_args(got) == {"ssmax_s": got["s"]}
  with pytest.raises(ValueError, match=r"one value per query head \[N\] = \[4\]"):
    problem.check_weighting_params(ssmax, {"s": jnp.ones(3)}, 4)
  with pytest.raises(ValueError, match=r"do not apply to weighting 'ssmax': it takes \{'s'"):
    problem.check_weighting_params(ssmax, {"t": jnp.ones(4)}, 4)
  for name in ("softmax", "sparsemax", "stick_breaking"):  # pointwise and whole-row
    with pytest.raises(ValueError, match="has no learnable parameters.*only 'ssmax'"):
      problem.check_weighting_params(core.get_weighting(name), {"s": jnp.ones(4)}, 4)


def test_dropout_active_only_for_a_positive_rate_when_not_deterministic():
  assert problem.dropout_active(0.1, False)
  assert not problem.dropout_active(0.1, True)
  assert not problem.dropout_active(0.0, False)
  for bad in (1.0, -0.1, float("nan")):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
      problem.dropout_active(bad, False)
  with pytest.raises(ValueError, match="Python number"):
    jax.jit(lambda r: problem.dropout_active(r, False))(0.1)


def test_plan_describes_the_call_without_arrays():
  q, k = jnp.ones((2, 5, 6, 8)), jnp.ones((2, 7, 3, 8))
  prob, inputs = problem.plan(q, k, k, weighting="sigmoid", is_causal=True)
  assert (prob.t, prob.s, prob.num_heads, prob.num_kv_heads, prob.head_dim) == (5, 7, 6, 3, 8)
  assert prob.is_causal and not hasattr(prob, "block_q")  # tiles: the implementation's
  assert not prob.has_mask and not prob.has_bias and prob.batch == (2,)
  assert inputs.scale == pytest.approx(1 / math.sqrt(8)) and inputs.query is not None
  with pytest.raises(TypeError, match="block_q"):  # kernel settings are not plan's
    problem.plan(q, k, k, block_q=16)
  with pytest.raises(ValueError, match="block_q must be a positive int"):  # checked when made
    core.Blocked(block_q=0)


def test_choose_implementation_is_blocked_for_large_streaming_problems_only():
  w, sc = core.get_weighting("softmax"), core.get_score("scaled_dot")
  assert problem.choose_implementation(None, w, sc, 8, 8) == "dense"
  assert problem.choose_implementation(None, w, sc, 4096, 4096) == "blocked"
  assert problem.choose_implementation("dense", w, sc, 4096, 4096) == "dense"
  additive = core.get_score("additive")
  assert problem.choose_implementation(None, w, additive, 4096, 4096) == "dense"
