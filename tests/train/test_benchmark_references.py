"""attnx.train.benchmark.references: the float64 reference against attnx's dense attention,
and the error measures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.train.benchmark import cases, references


@pytest.mark.parametrize("weighting,score", [("softmax", "scaled_dot"),
                                             ("gaussian:h=4", "neg_sq_dist"),
                                             ("sparsemax", "scaled_dot")])
def test_reference_is_attention_in_float64(weighting, score):
  q, k, v = (jax.random.normal(x, (1, 12, 2, 8)) for x in jax.random.split(
      jax.random.PRNGKey(1), 3))
  nq = 5
  valid = cases.valid_pairs(nq, 12, True, window=4)
  kw = dict(weighting=weighting, score=score, is_causal=True, local_window_size=(3, 0),
            implementation="dense")
  if score == "neg_sq_dist":
    kw["scale"] = 1.0
  out = core.attention(q, k, v, **kw)
  ref = references.reference(q, k, v, weighting, nq, valid, "fwd", score)
  assert ref.dtype == np.float64 and ref.shape == (1, nq, 2, 8)
  assert references.max_abs_error(out, ref, "fwd", nq) < 1e-5
  dq = jax.grad(lambda x: jnp.sum(core.attention(x, k, v, **kw)))(q)
  ref = references.reference(q, k, v, weighting, nq, valid, "fwd+bwd", score)
  assert references.max_abs_error((dq, None, None), ref, "fwd+bwd", nq) < 1e-4


def test_bad_arguments_and_differences():
  q = jnp.ones((1, 4, 1, 2))
  with pytest.raises(ValueError, match="mode"):
    references.reference(q, q, q, "softmax", 2, None, "bwd")
  with pytest.raises(ValueError, match="score"):
    references.reference(q, q, q, "softmax", 2, None, "fwd", "cosine")
  diff = references.max_abs_difference(lambda a, b, c: a + 1.0, lambda a, b, c: a,
                                       (q, q, q), 2)
  assert diff == pytest.approx(1.0)
