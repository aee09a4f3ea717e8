"""flax_attention_fn as a drop-in attention_fn for linen and nnx multi-head attention."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attnx import core

X = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16))
X8 = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))  # for 2 heads of 4 features
MASK = nn.make_attention_mask(jnp.ones((2, 6)), jnp.arange(6)[None].repeat(2, 0) < 5)  # float


def _linen(attention_fn=None, **kw):
  extra = {} if attention_fn is None else {"attention_fn": attention_fn}
  return nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, **extra, **kw)


def test_linen_softmax_equals_stock_module_with_float_mask():
  params = _linen().init(jax.random.PRNGKey(1), X, X, mask=MASK)
  ref = _linen().apply(params, X, X, mask=MASK)
  out = _linen(core.flax_attention_fn("softmax")).apply(params, X, X, mask=MASK)
  chex.assert_trees_all_close(out, ref, atol=1e-5)


@pytest.mark.parametrize("broadcast", [True, False])
def test_linen_softmax_equals_stock_module_with_dropout(broadcast):
  params = _linen().init(jax.random.PRNGKey(1), X, X)
  rngs = {"dropout": jax.random.PRNGKey(5)}
  kw = dict(deterministic=False, rngs=rngs)
  drop = dict(dropout_rate=0.3, broadcast_dropout=broadcast)
  ref = _linen(**drop).apply(params, X, X, **kw)
  out = _linen(core.flax_attention_fn("softmax"), **drop).apply(params, X, X, **kw)
  chex.assert_trees_all_close(out, ref, atol=1e-5)
  assert jnp.max(jnp.abs(out - _linen().apply(params, X, X))) > 1e-3  # dropout did something
  # Sown weights are flax's too: before dropout.
  _, ref_state = _linen(**drop).apply(params, X, X, sow_weights=True, mutable=["intermediates"],
                                      **kw)
  _, state = _linen(core.flax_attention_fn("softmax"), **drop).apply(
      params, X, X, sow_weights=True, mutable=["intermediates"], **kw)
  chex.assert_trees_all_close(state, ref_state, atol=1e-6)


def test_blocked_adapter_refuses_dropout_and_sowing():
  params = _linen().init(jax.random.PRNGKey(1), X, X)
  model = _linen(core.flax_attention_fn("relu", implementation="blocked"), dropout_rate=0.3)
  model.apply(params, X, X, deterministic=True)  # no weights needed
  with pytest.raises(ValueError, match="implementation='dense'"):
    model.apply(params, X, X, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
  with pytest.raises(ValueError, match="return_weights.*implementation='dense'"):
    model.apply(params, X, X, deterministic=True, sow_weights=True, mutable=["intermediates"])


def test_linen_relu_runs_differs_and_sows_weights():
  params = _linen().init(jax.random.PRNGKey(1), X, X)
  ref = _linen().apply(params, X, X)
  model = _linen(core.flax_attention_fn("relu"))
  out, state = model.apply(params, X, X, sow_weights=True, mutable=["intermediates"])
  assert jnp.max(jnp.abs(out - ref)) > 1e-3
  (w,) = state["intermediates"]["attention_weights"]
  chex.assert_shape(w, (2, 4, 6, 6))
  rows = w.sum(-1)
  assert jnp.all((jnp.abs(rows - 1) < 1e-5) | (rows == 0))


def test_nnx_softmax_equals_stock_and_sigmoid_runs():
  make = lambda fn=None: nnx.MultiHeadAttention(
      num_heads=4, in_features=16, qkv_features=16, decode=False, rngs=nnx.Rngs(0),
      **({} if fn is None else {"attention_fn": fn}))
  stock, ours = make(), make(core.flax_attention_fn("softmax"))
  chex.assert_trees_all_close(ours(X, mask=MASK), stock(X, mask=MASK), atol=1e-5)
  sig = make(core.flax_attention_fn("sigmoid:normalization=none"))
  out = sig(X)
  chex.assert_tree_all_finite(out)
  assert jnp.max(jnp.abs(out - stock(X))) > 1e-3


def test_unknown_weighting_fails_at_construction():
  with pytest.raises(ValueError, match="Unknown weighting"):
    core.flax_attention_fn("softmaxx")


@pytest.mark.parametrize("kwargs,match", [
    (dict(implementation="fast"), "Unknown implementation 'fast'"),
    (dict(weighting=core.RowNormalizer(name="row_softmax", fn=lambda s, w, ax: s),
          implementation="blocked"), "no streaming form"),
    (dict(score="additive", implementation="blocked",
          score_params={"Wq": 1.0, "Wk": 1.0, "v": 1.0}), "not a dot product"),
    (dict(weighting="gaussian"), "is not a distance"),
    (dict(weighting="boxcar", score="cosine"), "is not a distance"),
    (dict(score="additive"), r"needs score_params \['Wq', 'Wk', 'v'\]"),
    (dict(score="bilinear"), r"needs score_params \['W'\]"),
    (dict(score="metric", weighting="gaussian"), r"needs score_params \['L'\]"),
    (dict(score="bilinear", score_params={"L": 1.0}), r"Unknown parameters \['L'\]"),
    (dict(score="nope"), "Unknown score"),
])
def test_bad_configuration_fails_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    core.flax_attention_fn(**kwargs)


def test_valid_configurations_construct_and_run():
  core.flax_attention_fn("gaussian", "neg_sq_dist", implementation="blocked")
  core.flax_attention_fn("relu", "cosine:temperature=0.5", implementation="dense")
  w = jnp.broadcast_to(jnp.eye(4), (4, 4, 4))  # [N, H, H] identity: bilinear = dot
  q = X.reshape(2, 6, 4, 4)
  fn = core.flax_attention_fn("softmax", "bilinear", score_params={"W": w}, scale=0.5)
  chex.assert_trees_all_close(fn(q, q, q), core.flax_attention_fn()(q, q, q), atol=1e-5)


def test_flax_attention_fn_drop_in_linen_and_nnx():
  stock = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
  params = stock.init(jax.random.PRNGKey(0), X8)
  ref = stock.apply(params, X8)
  for weighting in ("softmax", "relu"):
    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8,
                                        attention_fn=core.flax_attention_fn(weighting))
    out = m.apply(params, X8)
    if weighting == "softmax":
      chex.assert_trees_all_close(out, ref, atol=1e-5)
    else:
      assert jnp.max(jnp.abs(out - ref)) > 1e-3
  make = lambda **kw: nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                             decode=False, rngs=nnx.Rngs(0), **kw)
  nnx_ref = make()(X8)
  chex.assert_trees_all_close(make(attention_fn=core.flax_attention_fn("softmax"))(X8), nnx_ref,
                              atol=1e-5)
  relu = make(attention_fn=core.flax_attention_fn("relu"))(X8)
  chex.assert_tree_all_finite(relu)
  assert jnp.max(jnp.abs(relu - nnx_ref)) > 1e-3
