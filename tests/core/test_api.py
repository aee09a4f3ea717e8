"""core.attention / core.attention_weights against jax.nn and flax.linen, edge cases, errors."""

import contextlib
import functools
import logging
import re
from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from attnx import core
from attnx.core.kernels import pallas as pallas_lib
from attnx.core.kernels.pallas import verify as pallas_verify
from attnx.core.kernels.xla.rows import blocked_row_attention

KERNELS = set(core.weightings.POINTWISE_KERNELS)


# A whole-row weighting without a streaming family (every built-in one has one).
_STREAM_LESS = core.RowNormalizer(name="row_softmax",
                                  fn=lambda s, w, ax: jax.nn.softmax(s, axis=ax, where=w))


def _score_for(weighting: str) -> str:
  return "neg_sq_dist" if weighting.split(":")[0] in KERNELS else "scaled_dot"


def _inputs(b=2, t=7, s=9, n=4, k=2, h=8, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  kk = jax.random.normal(ks[1], (b, s, k, h), dtype)
  v = jax.random.normal(ks[2], (b, s, k, h), dtype)
  bias = jax.random.normal(ks[3], (b, n, t, s), jnp.float32)
  mask = jax.random.bernoulli(ks[4], 0.7, (b, n, t, s)).at[..., 0].set(True)
  return q, kk, v, bias, mask


CASES = [
    dict(testcase_name="plain"),
    dict(testcase_name="mask", use_mask=True),
    dict(testcase_name="bias", use_bias=True),
    dict(testcase_name="causal", is_causal=True),
    dict(testcase_name="causal_mask_bias", is_causal=True, use_mask=True, use_bias=True),
    dict(testcase_name="gqa_cross", n=6, k=2, t=5, s=11, use_mask=True),
    dict(testcase_name="mha_cross", n=3, k=3, t=13, s=4, use_bias=True),
]


class SoftmaxMatchesReferences(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_matches_jax_nn(self, use_mask=False, use_bias=False, is_causal=False, n=4, k=2,
                          t=7, s=9):
    if is_causal:
      t = s = max(t, s)
    q, kk, v, bias, mask = _inputs(n=n, k=k, t=t, s=s)
    kw = dict(bias=bias if use_bias else None, mask=mask if use_mask else None,
              is_causal=is_causal)
    ref = jax.nn.dot_product_attention(q, kk, v, **kw)
    for impl in ("dense", "blocked", None):
      out = core.attention(q, kk, v, implementation=impl, **kw)
      chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)

  @parameterized.named_parameters(*CASES)
  def test_matches_flax_linen(self, use_mask=False, use_bias=False, is_causal=False, n=4, k=2,
                              t=7, s=9):
    if is_causal:
      t = s = max(t, s)
    q, kk, v, bias, mask = _inputs(n=n, k=n, t=t, s=s)  # flax has no GQA
    m = mask if use_mask else None
    if is_causal:
      c = core.causal_mask(t, s)
      m = c if m is None else m & c
    ref = nn.dot_product_attention(q, kk, v, bias=bias if use_bias else None, mask=m)
    out = core.attention(q, kk, v, bias=bias if use_bias else None, mask=mask if use_mask else
                         None, is_causal=is_causal)
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)

  @parameterized.parameters("dense", "blocked")
  def test_bf16_close_to_jax_nn(self, impl):
    q, kk, v, bias, mask = _inputs(dtype=jnp.bfloat16, t=16, s=16)
    ref = jax.nn.dot_product_attention(q, kk, v, mask=mask, is_causal=True)
    out = core.attention(q, kk, v, mask=mask, is_causal=True, implementation=impl)
    self.assertEqual(out.dtype, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=3e-2, rtol=3e-2)

  def test_extra_batch_dims(self):
    q, kk, v, bias, mask = _inputs(b=6)
    r = lambda x: x.reshape((2, 3) + x.shape[1:])
    out = core.attention(r(q), r(kk), r(v), bias=bias[:1], mask=r(mask))
    ref = core.attention(q, kk, v, bias=bias[:1], mask=mask)
    chex.assert_trees_all_close(out, r(ref), atol=1e-6)


class Variants(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_jit_and_nojit_agree_with_reference(self):
    q, kk, v, bias, mask = _inputs()
    f = self.variant(functools.partial(core.attention, weighting="relu",
                                       implementation="dense"))
    out = f(q, kk, v, bias, mask)
    w = core.weights(jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(kk, 2, 2)) / np.sqrt(8) + bias,
                     "relu", where=mask)
    ref = jnp.einsum("bnts,bsnh->btnh", w, jnp.repeat(v, 2, 2))
    chex.assert_trees_all_close(out, ref, atol=1e-5)

  def test_vmap_and_grad_compose(self):
    q, kk, v, _, _ = _inputs()
    loss = lambda q, k, v: jnp.sum(core.attention(q, k, v, weighting="sigmoid") ** 2)
    per_example = jax.vmap(jax.grad(loss), in_axes=(0, 0, 0))(q[:, None], kk[:, None],
                                                              v[:, None])
    whole = jax.grad(loss)(q, kk, v)
    chex.assert_trees_all_close(per_example[:, 0], whole, atol=1e-5)


class Weights(parameterized.TestCase):

  def test_attention_weights_softmax_rows(self):
    q, kk, _, bias, mask = _inputs()
    w = core.attention_weights(q, kk, bias=bias, mask=mask, is_causal=False)
    chex.assert_shape(w, (2, 4, 7, 9))
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(kk, 2, 2)) / np.sqrt(8) + bias
    ref = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    chex.assert_trees_all_close(w, ref, atol=1e-6)

  def test_shift_invariance_only_for_softmax(self):
    """Adding M to every score leaves exp-weights unchanged, and only them (Alam et al.,
    "Attention in machine learning: how to explain the empirical formula")."""
    s = jax.random.normal(jax.random.PRNGKey(1), (16, 12))
    for name in core.list_weightings("pointwise"):
      w = core.get_weighting(name)
      for shift in (0.5, 3.0):
        diff = float(jnp.max(jnp.abs(core.weights(s + shift, w) - core.weights(s, w))))
        if w.shift_invariant:  # softmax, exp, gaussian: all exp(αs)
          self.assertLess(diff, 1e-6, name)
        else:  # including softmax_plus_one, whose +1 breaks the invariance
          self.assertGreater(diff, 1e-3, f"{name} should not be shift invariant")


class EdgeCases(parameterized.TestCase):

  @parameterized.product(impl=["dense", "blocked"],
                         weighting=["softmax", "relu", "sigmoid", "softmax_plus_one"])
  def test_fully_masked_rows_are_zero_with_finite_grads(self, impl, weighting):
    q, kk, v, _, mask = _inputs()
    mask = mask.at[:, :, 2, :].set(False)
    f = lambda q, k, v: core.attention(q, k, v, mask=mask, weighting=weighting,
                                       implementation=impl)
    out = f(q, kk, v)
    chex.assert_trees_all_close(out[:, 2], jnp.zeros_like(out[:, 2]))
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, kk, v)
    chex.assert_tree_all_finite(grads)

  @parameterized.parameters("dense", "blocked")
  def test_all_zero_relu_rows(self, impl):
    q, kk, v, _, _ = _inputs()
    bias = jnp.full((1, 1, 7, 9), -1e3)  # every score negative: relu gives F = 0 everywhere
    f = lambda q, k, v: core.attention(q, k, v, bias=bias, weighting="relu",
                                       implementation=impl)
    chex.assert_trees_all_close(f(q, kk, v), jnp.zeros((2, 7, 4, 8)))
    chex.assert_tree_all_finite(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, kk, v))

  def test_boxcar_with_no_key_in_range(self):
    xq, xt, y = jnp.array([100.0]), jnp.linspace(0, 1, 5), jnp.arange(5.0)
    pred = core.nadaraya_watson(xq, xt, y, kernel="boxcar", bandwidth=0.5)
    np.testing.assert_array_equal(pred, [0.0])

  @parameterized.product(dtype=[jnp.float32, jnp.bfloat16],
                         weighting=core.list_weightings())
  def test_huge_scores_stay_finite(self, dtype, weighting):
    q, kk, v, _, _ = _inputs(dtype=dtype)
    bias = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(3), 0.5, (2, 4, 7, 9)), 1e4, -1e4)
    f = lambda q, k, v: core.attention(q, k, v, bias=bias, weighting=weighting,
                                       score=_score_for(weighting))
    chex.assert_tree_all_finite(f(q, kk, v))
    chex.assert_tree_all_finite(
        jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, kk, v))


class Errors(parameterized.TestCase):

  def test_unknown_weighting_lists_valid_names(self):
    q, kk, v, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"Unknown weighting 'sofmax'.*relu.*softmax"):
      core.attention(q, kk, v, weighting="sofmax")

  def test_unknown_score_and_implementation(self):
    q, kk, v, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"Unknown score 'cos'.*cosine"):
      core.attention(q, kk, v, score="cos")
    with pytest.raises(ValueError, match=r"Unknown implementation 'flash'.*dense, blocked"):
      core.attention(q, kk, v, implementation="flash")

  def test_bad_weighting_parameter(self):
    with pytest.raises(ValueError, match="power"):
      core.get_weighting("power:q=3")
    with pytest.raises(ValueError, match="expected 'name:key=value"):
      core.get_weighting("power:3")
    with pytest.raises(ValueError, match="normalization"):
      core.get_weighting("relu:normalization=max")

  @parameterized.named_parameters(
      dict(testcase_name="head_dim", shapes=((2, 7, 4, 8), (2, 9, 4, 6), (2, 9, 4, 6)),
           match=r"head dims.*\(2, 7, 4, 8\)"),
      dict(testcase_name="gqa", shapes=((2, 7, 4, 8), (2, 9, 3, 8), (2, 9, 3, 8)),
           match=r"multiple of key/value heads K=3"),
      dict(testcase_name="kv_len", shapes=((2, 7, 4, 8), (2, 9, 4, 8), (2, 8, 4, 8)),
           match=r"same length S"),
      dict(testcase_name="batch", shapes=((2, 7, 4, 8), (3, 9, 4, 8), (3, 9, 4, 8)),
           match=r"batch dims"),
      dict(testcase_name="rank", shapes=((7, 8), (9, 8), (9, 8)),
           match=r"\[batch\.\.\., T, N, H\]"),
  )
  def test_shape_errors_name_the_shapes(self, shapes, match):
    arrays = [jnp.zeros(s) for s in shapes]
    with pytest.raises(ValueError, match=match):
      core.attention(*arrays)

  def test_mask_errors(self):
    q, kk, v, _, mask = _inputs()
    with pytest.raises(ValueError, match=r"mask of shape \(2, 4, 7, 8\)"):
      core.attention(q, kk, v, mask=mask[..., :8])
    with pytest.raises(ValueError, match="mask must be boolean"):
      core.attention(q, kk, v, mask=mask.astype(jnp.float32))
    with pytest.raises(ValueError, match="floating point"):
      core.attention(q.astype(jnp.int32), kk, v)

  def test_unsupported_combinations_say_what_to_use(self):
    q, kk, v, _, _ = _inputs(n=2, k=2)
    with pytest.raises(ValueError, match=r"no streaming form.*implementation='dense'"):
      core.attention(q, kk, v, weighting=_STREAM_LESS, implementation="blocked")
    params = dict(Wq=jnp.ones((8, 3)), Wk=jnp.ones((8, 3)), v=jnp.ones(3))
    with pytest.raises(ValueError, match=r"implementation='dense'"):
      core.attention(q, kk, v, score="additive", score_params=params, implementation="blocked")
    with pytest.raises(ValueError, match=r"needs score_params \['W'\]"):
      core.attention(q, kk, v, score="bilinear")
    with pytest.raises(ValueError, match="only with normalization='sum'"):
      core.get_weighting("softmax:normalization=none")

  def test_auto_implementation_handles_row_normalizers(self):
    q, kk, v, _, _ = _inputs(t=600, s=600, b=1, n=1, k=1)  # large: auto picks blocked if it can
    out = core.attention(q, kk, v, weighting="sparsemax")
    chex.assert_tree_all_finite(out)


# power, relu and relu² weights are invariant to a positive rescaling of the scores. Scaling q
# by λ leaves the output and dL/dk, dL/dv unchanged and divides dL/dq by λ — but with Σ F(s)
# near 1e-28, e / Σ² underflowed and the gradient was inf·0 = NaN (power:p=3 in the survey).
@pytest.mark.parametrize("implementation", ["dense", "blocked"])
@pytest.mark.parametrize("weighting,lam", [("power:p=3", 1e-10), ("relu2", 1e-15),
                                           ("relu", 1e-29)])
def test_homogeneous_weightings_survive_tiny_denominators(implementation, weighting, lam):
  kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(7), 4)
  q = jax.random.normal(kq, (2, 24, 2, 8))
  k = jax.random.normal(kk, (2, 24, 2, 8))
  v = jax.random.normal(kv, (2, 24, 2, 8))
  ct = jax.random.normal(kc, (2, 24, 2, 8))

  def loss(q, k, v):
    out = core.attention(q, k, v, weighting=weighting, score="dot",
                         implementation=implementation)
    return jnp.sum(out * ct)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  ref_val, (rq, rk, rv) = grad(q, k, v)
  val, (gq, gk, gv) = grad(lam * q, k, v)
  for g in (gq, gk, gv):
    assert np.all(np.isfinite(np.asarray(g))), weighting
  np.testing.assert_allclose(val, ref_val, rtol=1e-3)
  np.testing.assert_allclose(gv, rv, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(gk, rk, rtol=1e-2, atol=1e-3)
  np.testing.assert_allclose(gq * lam, rq, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("lam", [1e-13, 3e-14])
def test_blocked_backward_finite_with_a_denormal_row_sum(lam):
  # Σ F(s) ~ 1e-38..1e-40: 1/l overflowed to inf in the blocked backward (f · inf = NaN). The
  # forward itself has lost most digits to denormals here, so only finiteness is asserted.
  kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(7), 4)
  q, k, v, ct = (jax.random.normal(x, (2, 24, 2, 8)) for x in (kq, kk, kv, kc))

  def loss(q, k, v):
    return jnp.sum(core.attention(q, k, v, weighting="power:p=3", score="dot",
                                  implementation="blocked") * ct)

  val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(lam * q, k, v)
  assert np.isfinite(float(val))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


class DropoutAndReturnedWeights(parameterized.TestCase):
  """core.attention's dropout (flax's arguments and RNG use) and return_weights."""

  @parameterized.product(broadcast=[True, False], use_mask=[False, True])
  def test_softmax_dropout_equals_flax_dot_product_attention(self, broadcast, use_mask):
    q, kk, v, bias, mask = _inputs(n=4, k=4)
    r = lambda x: x.reshape((1, 2) + x.shape[1:])  # two batch dims: the broadcast shape counts
    q, kk, v, bias, mask = map(r, (q, kk, v, bias, mask))
    kw = dict(bias=bias, mask=mask if use_mask else None, dropout_rate=0.4,
              dropout_rng=jax.random.PRNGKey(7), broadcast_dropout=broadcast)
    ref = nn.dot_product_attention(q, kk, v, deterministic=False, **kw)
    out = core.attention(q, kk, v, **kw)  # deterministic=False by default, as in flax
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = core.attention(q, kk, v, bias=bias, mask=kw["mask"])
    assert jnp.max(jnp.abs(out - plain)) > 1e-2  # the dropout did something

  def test_broadcast_dropout_shares_one_mask_over_batch_and_heads(self):
    q, kk, v, _, _ = _inputs(n=4, k=2)
    eye = jnp.broadcast_to(jnp.eye(9)[None, :, None, :], (2, 9, 2, 9))  # one-hot values
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(3))
    used = {b: core.attention(q, kk, eye, broadcast_dropout=b, **kw) for b in (True, False)}
    for b, u in used.items():  # output row = the weights used: w ⊙ keep / (1 − rate)
      kept = jnp.moveaxis(u != 0, 1, 2)  # [B, N, T, S]
      same = bool(jnp.all(kept == kept[:1, :1]))
      assert same == b, (b, "one [T, S] mask for every batch entry and head iff broadcast")

  def test_inactive_dropout_equals_no_dropout(self):
    q, kk, v, bias, mask = _inputs()
    plain = core.attention(q, kk, v, bias, mask, weighting="sparsemax")
    key = jax.random.PRNGKey(0)
    for kw in (dict(dropout_rate=0.0, dropout_rng=key),
               dict(dropout_rate=0.0),  # no key needed without dropout
               dict(dropout_rate=0.5, dropout_rng=key, deterministic=True),
               dict(dropout_rate=0.5, deterministic=True)):
      out = core.attention(q, kk, v, bias, mask, weighting="sparsemax", **kw)
      chex.assert_trees_all_equal(out, plain)

  @parameterized.product(weighting=["softmax", "sparsemax", "relu", "gaussian"],
                         is_causal=[False, True])
  def test_return_weights_are_attention_weights_and_out_is_weights_times_values(
      self, weighting, is_causal):
    q, kk, v, bias, mask = _inputs(t=9, s=9)  # GQA: 4 query heads, 2 kv heads
    kw = dict(weighting=weighting, score=_score_for(weighting), is_causal=is_causal)
    out, w = core.attention(q, kk, v, bias, mask, return_weights=True, **kw)
    chex.assert_shape(w, (2, 4, 9, 9))
    self.assertEqual(w.dtype, jnp.float32)
    chex.assert_trees_all_equal(w, core.attention_weights(q, kk, bias, mask, **kw))
    chex.assert_trees_all_close(out, jnp.einsum("bnts,bsnh->btnh", w, jnp.repeat(v, 2, 2)),
                                atol=1e-5)
    chex.assert_trees_all_close(out, core.attention(q, kk, v, bias, mask, **kw), atol=1e-5)
    # With dropout the weights are returned before it; the output uses the dropped ones.
    rate, key = 0.3, jax.random.PRNGKey(4)
    out_d, w_d = core.attention(q, kk, v, bias, mask, return_weights=True, dropout_rate=rate,
                                dropout_rng=key, **kw)
    chex.assert_trees_all_equal(w_d, w)
    keep = jax.random.bernoulli(key, 1 - rate, (1, 1, 9, 9))  # flax's broadcast mask
    ref = jnp.einsum("bnts,bsnh->btnh", w * keep / (1 - rate), jnp.repeat(v, 2, 2))
    chex.assert_trees_all_close(out_d, ref, atol=1e-5)

  def test_dropout_under_jit_and_grad(self):
    q, kk, v, _, _ = _inputs()
    f = jax.jit(lambda q, key: jnp.sum(core.attention(q, kk, v, weighting="relu",
                                                      dropout_rate=0.2, dropout_rng=key) ** 2))
    g1, g2 = (jax.grad(f)(q, jax.random.PRNGKey(i)) for i in (1, 2))
    chex.assert_tree_all_finite((g1, g2))
    assert jnp.max(jnp.abs(g1 - g2)) > 1e-4  # the key matters

  def test_edge_case_contract_with_weights_and_dropout(self):
    q, kk, v, _, mask = _inputs()
    drop = dict(dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(1), broadcast_dropout=False)
    # Empty sequences: empty weights and outputs; no key: zero outputs and weights.
    for t, s in ((0, 9), (7, 0)):
      out, w = core.attention(q[:, :t], kk[:, :s], v[:, :s], return_weights=True, **drop)
      chex.assert_shape((out, w), ((2, t, 4, 8), (2, 4, t, s)))
      assert not jnp.any(out) and not jnp.any(w)
    # A NaN query row stays NaN through dropout (its weights: NaN at its valid keys, 0 at the
    # masked ones, as jax.nn.softmax's with where); a fully masked row stays zero; others finite.
    q = q.at[:, 3, 1].set(jnp.nan)  # row 3, head 1
    mask = mask.at[:, :, 5, :].set(False)  # row 5, every head
    out, w = core.attention(q, kk, v, mask=mask, return_weights=True, **drop)
    assert jnp.all(jnp.isnan(out[:, 3, 1]))
    assert jnp.array_equal(jnp.isnan(w[:, 1, 3]), mask[:, 1, 3])
    assert not jnp.any(w[:, 1, 3][~mask[:, 1, 3]])
    assert not jnp.any(out[:, 5]) and not jnp.any(w[:, :, 5])
    finite = jnp.ones((7,), bool).at[3].set(False)
    chex.assert_tree_all_finite((out[:, finite], w[:, :, finite]))

  def test_errors_name_the_alternative(self):
    q, kk, v, _, _ = _inputs()
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match=r"dropout.*implementation='dense' \(or None"):
      core.attention(q, kk, v, implementation="blocked", dropout_rate=0.1, dropout_rng=key)
    with pytest.raises(ValueError, match=r"return_weights.*implementation='dense'"):
      core.attention(q, kk, v, implementation="blocked", return_weights=True)
    with pytest.raises(ValueError, match="needs dropout_rng.*deterministic=True"):
      core.attention(q, kk, v, dropout_rate=0.1)
    for rate in (-0.1, 1.0, float("nan")):
      with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        core.attention(q, kk, v, dropout_rate=rate, dropout_rng=key)
    # Blocked without weights or active dropout is fine.
    core.attention(q, kk, v, implementation="blocked", dropout_rate=0.1, deterministic=True)


class PallasDispatch(parameterized.TestCase):
  """implementation="pallas" through core.attention, and the automatic choice's wiring."""

  def _qkv(self, t=40, s=33):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(2, t, 4, 16)), jnp.float32),
            jnp.asarray(rng.normal(size=(2, s, 2, 16)), jnp.float32),
            jnp.asarray(rng.normal(size=(2, s, 2, 16)), jnp.float32))

  def test_interpret_matches_dense(self):
    q, k, v = self._qkv()
    for w in ("softmax", "relu:normalization=length"):
      np.testing.assert_allclose(
          core.attention(q, k, v, weighting=w, is_causal=True,
                         implementation=core.Pallas(interpret=True)),
          core.attention(q, k, v, weighting=w, is_causal=True, implementation="dense"),
          rtol=1e-5, atol=1e-5)

  def test_cpu_without_interpret_and_row_weightings_are_clear_errors(self):
    q, k, v = self._qkv()
    with pytest.raises(ValueError, match="interpret=True.*implementation='blocked'"):
      core.attention(q, k, v, implementation="pallas")
    with pytest.raises(ValueError,
                       match="normalizes whole rows.*'pallas'.*implementation='dense'"):
      core.attention(q, k, v, weighting=_STREAM_LESS, implementation="pallas")
    with pytest.raises(ValueError, match="return_weights.*implementation='dense'"):
      core.attention(q, k, v, implementation=core.Pallas(interpret=True), return_weights=True)


# --------------------------------------------------------------------------------------------
# Implementations as objects: the ordered list, supports/declines reasons, explain, and the
# Pallas verification the automatic choice consults.
# --------------------------------------------------------------------------------------------

_KEY = jax.random.PRNGKey(0)
_ADDITIVE = dict(Wq=jnp.ones((8, 3)), Wk=jnp.ones((8, 3)), v=jnp.ones(3))


def _qkv(t=7, s=9, h=8, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(1, t, 2, h)), dtype),
          jnp.asarray(rng.normal(size=(1, s, 1, h)), dtype),
          jnp.asarray(rng.normal(size=(1, s, 1, h)), dtype))


@contextlib.contextmanager
def _platform(name):
  """Problems built inside report platform ``name`` ("gpu", "tpu"), as on that device."""
  with mock.patch.object(jax, "default_backend", lambda: name):
    yield


@contextlib.contextmanager
def _fake_device(check, ran, platform="gpu"):
  """The automatic choice as on a GPU/TPU, on this CPU: the platform says ``platform``, the
  Pallas self-check is ``check`` and the "Pallas kernel" is the blocked one, recording the
  backend it was asked for in ``ran`` (None: chosen per lowering platform, as every call but an
  interpreted one asks). Verifications are forgotten before and after."""

  def fake_pallas(q, k, v, *, backend, interpret, ssmax_s=None, **kw):
    ran.append(backend)
    if isinstance(kw["weighting"], core.Pointwise):
      return core.blocked_attention(q, k, v, **kw)
    return blocked_row_attention(q, k, v, ssmax_s=ssmax_s, **kw)

  pallas_lib.clear_verifications()
  try:
    with _platform(platform), mock.patch.object(pallas_verify, "self_check", check), \
         mock.patch.object(pallas_lib, "pallas_attention", fake_pallas):
      yield
  finally:
    pallas_lib.clear_verifications()


def _self_check_warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING and "self-check failed" in r.getMessage()]


# (implementation: a name or an object with its settings, attention kwargs, platform or None
#  for this machine, reason regex or None)
SUPPORT_CASES = [
    ("blocked", dict(weighting=_STREAM_LESS), None,
     r"^Weighting 'row_softmax' normalizes whole rows .*'blocked'.*implementation='dense'"),
    ("blocked", dict(score="additive", score_params=_ADDITIVE), None,
     r"^Score 'additive' is not a dot product.*implementation='dense'"),
    ("blocked", dict(dropout_rate=0.1, dropout_rng=_KEY), None,
     r"^dropout on the weights needs the \[T, S\] weights.*'blocked'"),
    ("blocked", dict(return_weights=True), None, r"^return_weights=True needs"),
    ("blocked", dict(weighting="sparsemax", is_causal=True), None, None),
    ("pallas", dict(weighting=_STREAM_LESS), "gpu", r"normalizes whole rows.*'pallas'"),
    ("pallas", dict(score="additive", score_params=_ADDITIVE), "gpu", r"^Score 'additive'"),
    (core.Pallas(interpret=True), dict(dropout_rate=0.1, dropout_rng=_KEY), None,
     r"^dropout on the weights.*'pallas'"),
    ("pallas", dict(return_weights=True), "tpu", r"^return_weights=True.*'pallas'"),
    # On a CPU host the call traces for both kinds of device (it fails when lowered for the
    # CPU: test_explicit_pallas_lowers_for_the_platform_it_is_compiled_for).
    ("pallas", dict(), "cpu", None),
    ("pallas", dict(dtype=jnp.float16, h=300), "cpu",  # neither kind: both reasons
     r"head dim 300 exceeds .*; implementation='pallas' cannot run this: dtype float16 .*tpu"),
    (core.Pallas(interpret=True, block_k=48), dict(), "cpu", r"block_k=48 .*power-of-2"),
    (core.Pallas(block_k=64), dict(), "tpu", r"block_k=64 .*multiple of 128"),
    ("pallas", dict(dtype=jnp.float16), "tpu",
     r"^implementation='pallas' cannot run this: dtype float16 .*tpu.*'blocked'"),
    ("pallas", dict(h=300), "gpu", r"cannot run this: head dim 300 exceeds .* 256"),
    ("pallas", dict(score="neg_sq_dist", weighting="gaussian", h=255), "gpu",
     r"cannot run this: head dim 257 exceeds"),  # the dot-product form adds 2 columns
    (core.Pallas(interpret=True), dict(), "cpu", None),
    ("pallas", dict(weighting="entmax15", h=256, dtype=jnp.bfloat16), "gpu", None),
    (core.Pallas(block_q=16, block_k=128), dict(weighting="ssmax", dtype=jnp.bfloat16), "tpu",
     None),
    ("dense", dict(weighting=_STREAM_LESS, score="additive", score_params=_ADDITIVE,
                   return_weights=True, dropout_rate=0.1, dropout_rng=_KEY), None, None),
]


class ImplementationObjects(parameterized.TestCase):

  def test_list_implementations_is_the_dispatch_order(self):
    assert core.list_implementations() == ["pallas", "split_kv", "blocked", "dense"]
    assert sorted(core.list_implementations()) == sorted(core.IMPLEMENTATIONS)
    for name in core.list_implementations():
      impl = core.get_implementation(name)
      assert isinstance(impl, core.Implementation) and impl.name == name
    with pytest.raises(ValueError, match=r"Unknown implementation 'flash'; valid: dense, "
                                         r"blocked, split_kv, pallas, an implementation object "
                                         r"\(core\.Dense\(\), .*\) or None \(automatic\)"):
      core.get_implementation("flash")
    with pytest.raises(ValueError, match="Unknown implementation 'flash'"):
      core.explain(*_qkv(), implementation="flash")

  @parameterized.parameters(*SUPPORT_CASES)
  def test_supports_reason_is_the_explicit_error(self, implementation, kw, platform, match):
    kw = dict(kw)
    q, k, v = _qkv(h=kw.pop("h", 8), dtype=kw.pop("dtype", jnp.float32))
    impl = core.get_implementation(implementation)
    name = impl.name
    with _platform(platform) if platform else contextlib.nullcontext():
      ex = core.explain(q, k, v, implementation=implementation, **kw)
      reason = impl.supports(ex.problem)
      assert ex.reasons[name] == reason and ex.declined == {}
      if match is None:
        assert reason is None and ex.chosen == name
      else:
        assert ex.chosen is None and re.search(match, reason), reason
        with pytest.raises(ValueError, match=re.escape(reason)):
          core.attention(q, k, v, implementation=implementation, **kw)
    if match is None and name != "pallas" and "dropout_rate" not in kw:
      ref = core.attention(q, k, v, **{**kw, "implementation": "dense"})
      chex.assert_trees_all_close(core.attention(q, k, v, implementation=implementation, **kw),
                                  ref, atol=1e-5)

  def test_supports_config_is_what_check_compatible_raises(self):
    for name in core.list_implementations():
      impl = core.get_implementation(name)
      for w, sc in ((_STREAM_LESS, "scaled_dot"), ("softmax", "additive"),
                    ("sparsemax", "cosine")):
        reason = impl.supports_config(core.get_weighting(w), core.get_score(sc))
        if reason is None:
          core.check_compatible(w, sc, name)
        else:
          assert name != "dense"
          with pytest.raises(ValueError, match=re.escape(reason)):
            core.check_compatible(w, sc, name)
    assert core.get_implementation("blocked").supports_config(
        _STREAM_LESS, core.get_score("dot")) is not None

  def test_declines_small_problems_with_the_measured_thresholds(self):
    # Pointwise F streams from BLOCKED_MIN_SCORES, whole-row ones from ROW_BLOCKED_MIN_SCORES.
    assert core.ROW_BLOCKED_MIN_SCORES < 300 * 300 < core.BLOCKED_MIN_SCORES
    q, k, v = _qkv(t=300, s=300)
    relu = core.explain(q, k, v, weighting="relu")
    assert relu.chosen == "dense" and relu.reasons["blocked"] is None
    assert re.search(r"300·300 = 90000 .*BLOCKED_MIN_SCORES = 262144", relu.declined["blocked"])
    rows = core.explain(q, k, v, weighting="sparsemax")
    assert rows.chosen == "blocked" and "blocked" not in rows.declined
    # On this CPU host the Pallas kernels trace (for a GPU or TPU lowering) but the automatic
    # choice declines them; with the interpreter they can run, and the choice declines them too.
    assert rows.reasons["pallas"] is None and "GPU or TPU only" in rows.declined["pallas"]
    with pytest.warns(DeprecationWarning, match="interpret=True"):  # automatic, interpreted
      interp = core.explain(q, k, v, weighting="sparsemax", interpret=True)
    assert interp.reasons["pallas"] is None and interp.chosen == "blocked"
    assert "GPU or TPU only" in interp.declined["pallas"]
    assert "dense: can run it (not chosen)" in str(interp)
    assert "pallas: passed over: the automatic choice uses Pallas" in str(interp)
    # What explain says is what attention runs: here the blocked kernel, equal to dense.
    chex.assert_trees_all_close(
        core.attention(q, k, v, weighting="sparsemax"),
        core.attention(q, k, v, weighting="sparsemax", implementation="dense"), atol=1e-5)
    with mock.patch.object(core.get_implementation("blocked").__class__, "__call__",
                           side_effect=AssertionError("blocked ran")):
      core.attention(q, k, v, weighting="relu")  # dense, as explained
      with pytest.raises(AssertionError, match="blocked ran"):
        core.attention(q, k, v, weighting="sparsemax")

  def test_the_walk_takes_pallas_only_when_verified_and_large_enough(self):
    q, k, v = _qkv(t=512, s=512)
    ref = core.attention(q, k, v, weighting="relu", implementation="dense")
    calls, ran = [], []

    def passing(backend, w, dtype, head_dim):
      calls.append((backend, w.name, dtype, head_dim))

    with _fake_device(passing, ran):
      ex = core.explain(q, k, v, weighting="relu")
      assert ex.chosen == "pallas" and ex.declined == {}
      assert calls == [("gpu", "relu", "float32", 8)]
      chex.assert_trees_all_close(core.attention(q, k, v, weighting="relu"), ref, atol=1e-5)
      assert ran == [None] and len(calls) == 1  # verified once, then cached
      # Small problems never verify: dense; an explicit blocked never consults Pallas.
      small = core.explain(*_qkv(), weighting="relu")
      assert small.chosen == "dense" and "BLOCKED_MIN_SCORES" in small.declined["pallas"]
      core.attention(q, k, v, weighting="relu", implementation="blocked")
      assert ran == [None] and len(calls) == 1
      # A distance score: verified at the dot-product form's head dim (H + 2).
      core.attention(q, k, v, weighting="gaussian", score="neg_sq_dist")
      assert calls[-1][2:] == ("float32", 10) and ran == [None, None]

  def test_a_failing_verification_walks_on_to_blocked_with_one_warning(self):
    q, k, v = _qkv(t=512, s=512)
    ref = core.attention(q, k, v, weighting="relu", implementation="dense")
    calls, ran = [], []

    def failing(backend, w, dtype, head_dim):
      calls.append(w.name)
      return "output differs from the blocked kernel"

    logger = logging.getLogger(pallas_verify.__name__)
    with _fake_device(failing, ran), mock.patch.object(logger, "warning") as warn:
      for _ in range(2):
        ex = core.explain(q, k, v, weighting="relu")
        assert ex.chosen == "blocked" and ex.reasons["pallas"] is None
        assert ex.declined["pallas"] == ("the Pallas self-check failed: output differs from "
                                         "the blocked kernel")
        chex.assert_trees_all_close(core.attention(q, k, v, weighting="relu"), ref, atol=1e-5)
      assert calls == ["relu"] and warn.call_count == 1 and ran == []
      # An explicit "pallas" is never verified and never falls back.
      core.attention(q, k, v, weighting="relu", implementation="pallas")
      assert ran == [None] and calls == ["relu"]

  def test_whole_row_pallas_is_chosen_on_a_gpu_only(self):
    q, k, v = _qkv(t=256, s=256)
    calls = []
    check = lambda *a: calls.append(a[1].name)
    for platform, chosen in (("tpu", "blocked"), ("gpu", "pallas")):
      ran = []
      with _fake_device(check, ran, platform):
        ex = core.explain(q, k, v, weighting="stick_breaking", is_causal=True)
        assert ex.reasons["pallas"] is None and ex.chosen == chosen
        out = core.attention(q, k, v, weighting="stick_breaking", is_causal=True)
      assert ran == ([] if chosen == "blocked" else [None])
      if platform == "tpu":
        assert "GPU only" in ex.declined["pallas"] and calls == []
      chex.assert_trees_all_close(
          out, core.attention(q, k, v, weighting="stick_breaking", is_causal=True,
                              implementation="dense"), atol=1e-5)
    assert calls == ["stick_breaking"]

  def test_verification_runs_outside_the_callers_trace(self):
    q, k, v = _qkv(t=512, s=512)
    seen, ran = [], []

    def check(backend, w, dtype, head_dim):
      x = jnp.cos(jnp.arange(3.0))  # staged into the caller's program if it ran in its trace
      seen.append((isinstance(x, jax.core.Tracer), backend, w.name, dtype, head_dim))
      return None if float(x[0]) == 1.0 else "not concrete"

    f = lambda q: core.attention(q, k, v, weighting="relu")
    with _fake_device(check, ran):
      jaxpr = str(jax.make_jaxpr(f)(q))
      out = jax.jit(f)(q)
      jax.jit(jax.grad(lambda q: jnp.sum(f(q))))(q)  # retraced: answered from the cache
    assert seen == [(False, "gpu", "relu", "float32", 8)]  # only static arguments, once
    assert not re.search(r"= cos\b", jaxpr) and ran and set(ran) == {None}
    chex.assert_trees_all_close(
        out, core.attention(q, k, v, weighting="relu", implementation="dense"), atol=1e-5)

  def test_on_cpu_none_keeps_dense_and_blocked(self):
    assert jax.default_backend() != "cpu" or not pallas_lib.choose_pallas(
        None, core.get_weighting("softmax"), jnp.float32, 64)
    v = core.verify_pallas("softmax", jnp.float32, 64)
    if jax.default_backend() == "cpu":
      assert not v and not v.checked and "needs a GPU or TPU" in v.reason
