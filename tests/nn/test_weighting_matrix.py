"""Every registered weighting × every module: forward and backward, each with a compatible score.

One compiled program per module runs all its weightings (compilation dominates the cost; one
program for 20 weightings compiles several times faster than 20 programs). Checks per weighting:
finite outputs and gradients; the score path is differentiable (the gradient through the
attention weights is non-zero, except for the boxcar kernel whose derivative is 0); padded keys
get exactly zero weight; and the weights of normalized weightings sum to one on every row that
has any weight.

Cross-cutting: a weighting × module matrix over all of attnx.nn, kept as one file rather than
split into the modules' test_<module>.py files.
"""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnx.nn as an
from attnx import core

KEY = jax.random.PRNGKey(0)
# Small inputs keep ‖q − k‖ below the unit bandwidth of the compact distance kernels
# (triangular, epanechnikov, boxcar), so their weights are not all zero.
Q = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (2, 3, 8))
X = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
MASK = jnp.arange(4)[None, :] < jnp.array([[4], [3]])  # [B, S] key padding
IMAGES = jax.random.normal(jax.random.PRNGKey(3), (2, 4, 4, 6))
SRC = jnp.array([[3, 4, 5, 0], [2, 2, 2, 2]])
TGT = jnp.array([[1, 5, 6], [1, 3, 4]])


def _is_distance_kernel(w: str) -> bool:
  return bool(getattr(core.get_weighting(w), "distance_kernel", False))


ALL = core.list_weightings()
SIMILARITY = [w for w in ALL if not _is_distance_kernel(w)]  # for similarity-only scores
NO_DERIVATIVE = ("boxcar",)  # F' = 0 almost everywhere: no gradient through the weights
# Weightings that vanish on scores ≤ 0 (relu, relu2, power, softpick) would give all-zero
# weights on metric attention's −τ‖L(x − y)‖²: core.check_compatible rejects the pair (test below).
ZERO_ON_NONPOSITIVE = core.list_weightings(zero_on_nonpositive=True)
ON_DISTANCES = [w for w in ALL if w not in ZERO_ON_NONPOSITIVE]  # for distance scores


def _normalized(w: str) -> bool:
  """Weightings whose nonzero rows sum to exactly one (the declared trait)."""
  return core.get_weighting(w).traits["sums_to_one"]


def _mha_score(w: str) -> str:
  return "neg_sq_dist" if _is_distance_kernel(w) else "scaled_dot"


class Case(NamedTuple):
  weightings: list[str]
  make: Any  # weighting -> module
  init: Any  # (module, x) -> variables
  apply: Any  # (module, params, x) -> (output, weights [..., S] or None)
  x: jax.Array  # the differentiated input
  score_grad: Any  # (grads of params, grad of x) -> an array on the score path
  padded: jax.Array | None = None  # True at padded keys, broadcastable to the weights


def _cross(m, p, q):  # cross attention: q reaches the output only through the weights
  return m.apply(p, q, X, mask=MASK[:, None, None, :], return_weights=True)


def _single_head(m, p, q):  # the same [B, N, T, S] mask convention as multi-head attention
  return m.apply(p, q, X, mask=MASK[:, None, None, :], return_weights=True)


def _se(m, p, x):
  y = m.apply(p, x)
  gate = (y / x)[:, 0, 0, :]  # C·F(s)/ΣF(s), constant over space
  return y, gate / x.shape[-1]  # the channel weights


def _block(m, p, x):
  y, state = m.apply(p, x, key_mask=MASK, mutable=["intermediates"])
  return y, jax.tree.leaves(state["intermediates"])[0]  # sown by the spec's sow_weights


def _rnn(m, p, _):
  return m.apply(p, SRC, TGT, return_alignment=True)


_x_grad = lambda g, gx: gx
PAD_HEADS = ~MASK[:, None, None, :]  # [B, N, T, S]
CASES = {
    "mha": Case(ALL, lambda w: an.MultiHeadAttention(num_heads=2, weighting=w,
                                                     score=_mha_score(w)),
                lambda m, q: m.init(KEY, q, X), _cross, Q, _x_grad, PAD_HEADS),
    "metric": Case(ON_DISTANCES, lambda w: an.MetricAttention(num_heads=2, weighting=w),
                   lambda m, q: m.init(KEY, q, X), _cross, Q, _x_grad, PAD_HEADS),
    "additive": Case(SIMILARITY, lambda w: an.AdditiveAttention(weighting=w),
                     lambda m, q: m.init(KEY, q, X), _single_head, Q, _x_grad, PAD_HEADS),
    **{f"luong_{s}": Case(SIMILARITY, lambda w, s=s: an.LuongAttention(score=s, weighting=w),
                          lambda m, q: m.init(KEY, q, X), _single_head, Q, _x_grad, PAD_HEADS)
       for s in ("dot", "general", "concat")},
    "squeeze_excite": Case(SIMILARITY, lambda w: an.SqueezeExcite(reduction=2, weighting=w),
                           lambda m, x: m.init(KEY, x), _se, IMAGES,
                           lambda g, gx: g["params"]["expand"]["kernel"]),
    "cbam": Case(SIMILARITY, lambda w: an.CBAM(reduction=2, kernel_size=3, weighting=w),
                 lambda m, x: m.init(KEY, x), lambda m, p, x: (m.apply(p, x), None), IMAGES,
                 lambda g, gx: g["params"]["spatial_conv"]["kernel"]),
    "rnn_bahdanau": Case(SIMILARITY, lambda w: an.RNNSeq2Seq(src_vocab_size=10, embed_dim=6,
                                                             hidden_dim=8, weighting=w),
                         lambda m, _: m.init(KEY, SRC, TGT), _rnn, Q,
                         lambda g, gx: g["params"]["decoder"]["attention"]["query_kernel"],
                         (SRC == 0)[:, None, :]),
    # The dict form: distance kernels get score="neg_sq_dist" from the spec itself.
    "encoder_block": Case(
        ALL, lambda w: an.EncoderBlock(num_heads=2, mlp_dim=16,
                                       attention={"weighting": w, "sow_weights": True}),
        lambda m, x: {"params": m.init(KEY, x)["params"]}, _block, X,
        lambda g, gx: g["params"]["attention"]["query"]["kernel"], PAD_HEADS),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.split_by_jax
def test_every_weighting_runs_forward_and_backward(name):
  case = CASES[name]

  def run_all(x):
    # Parameters do not depend on F: one init serves every weighting (init is a full trace).
    variables = case.init(case.make(case.weightings[0]), x)
    results = {}
    for w in case.weightings:
      m = case.make(w)

      def loss(v, x, m=m):
        out, wts = case.apply(m, v, x)
        return jnp.sum(jnp.square(out.astype(jnp.float32))), (out, wts)

      (value, (out, wts)), (g, gx) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
          variables, x)
      results[w] = (value, out, wts, g, case.score_grad(g, gx))
    return results

  results = jax.jit(run_all)(case.x)
  for w, (value, out, wts, g, score_grad) in results.items():
    chex.assert_tree_all_finite((value, out, g, score_grad))
    assert value > 0, (name, w)
    if w not in NO_DERIVATIVE:
      assert jnp.any(score_grad != 0), (name, w, "no gradient through the weights")
    if case.padded is not None:
      assert jnp.all(jnp.where(case.padded, wts, 0) == 0), (name, w, "weight on padding")
    if wts is not None and _normalized(w):
      rows = np.asarray(wts.sum(-1))
      ones = np.abs(rows - 1) < 1e-4
      assert np.all(ones | (np.abs(rows) < 1e-6)), (name, w, rows)
      assert ones.any(), (name, w, rows)


@pytest.mark.parametrize("w", ZERO_ON_NONPOSITIVE)
def test_positive_part_weightings_are_rejected_on_metric_attention(w):
  # F(s ≤ 0) = 0 and the metric score is ≤ 0: the module would attend to nothing.
  with pytest.raises(ValueError, match="every weight would be 0"):
    an.MetricAttention(num_heads=2, weighting=w).init(KEY, X)


def test_matrix_covers_every_weighting_and_has_weights_to_check():
  assert set(CASES["mha"].weightings) == set(core.list_weightings())
  assert {"gaussian", "boxcar", "triangular", "epanechnikov"} <= set(ALL) - set(SIMILARITY)
  assert {"softmax", "sparsemax", "entmax15", "relu", "gaussian"} <= {
      w for w in ALL if _normalized(w)}
