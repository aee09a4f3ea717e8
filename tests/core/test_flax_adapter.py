"""flax_attention_fn as a drop-in attention_fn for linen and nnx multi-head attention."""

import inspect

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


# --- Every argument Flax passes is honoured, argument by argument against Flax's own ---------

def _nnx_mha(attention_fn=None, **kw):
  extra = {} if attention_fn is None else {"attention_fn": attention_fn}
  return nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=16, decode=False,
                                rngs=nnx.Rngs(0), **extra, **kw)


_Q, _K, _V = (jax.random.normal(jax.random.PRNGKey(i), (2, 6, 4, 8)) for i in (10, 11, 12))
_BIAS = 0.3 * jax.random.normal(jax.random.PRNGKey(13), (2, 4, 6, 6))
_BOOL_MASK = jax.random.bernoulli(jax.random.PRNGKey(14), 0.7, (2, 1, 6, 6)).at[..., 0].set(True)

# nnx takes is_causal from flax 0.12.2 on; before, the same attention is a tril mask.
_HAS_IS_CAUSAL = "is_causal" in inspect.signature(nnx.dot_product_attention).parameters
_needs_is_causal = pytest.mark.skipif(
    not _HAS_IS_CAUSAL, reason="flax < 0.12.2: nnx.MultiHeadAttention takes no is_causal")


def _flax_reference(q, k, v, **kw):
  """nnx.dot_product_attention, with is_causal as Flax ≥ 0.12.2 defines it on every version."""
  if kw.get("is_causal") and not _HAS_IS_CAUSAL:
    del kw["is_causal"]
    causal = jnp.tril(jnp.ones((q.shape[-3], k.shape[-3]), bool))
    mask = kw.get("mask")
    kw["mask"] = causal if mask is None else jnp.logical_and(mask.astype(bool), causal)
  return nnx.dot_product_attention(q, k, v, **kw)


# Each case: the keywords one call of Flax's dot_product_attention gets, as Flax's modules pass
# them. nnx's function is the reference (it takes is_causal; linen's takes the rest the same).
_CASES = {
    "plain": {},
    "bias": dict(bias=_BIAS),
    "bool_mask": dict(mask=_BOOL_MASK),
    "float_mask": dict(mask=_BOOL_MASK.astype(jnp.float32)),
    "is_causal": dict(is_causal=True),
    "is_causal_and_mask": dict(is_causal=True, mask=_BOOL_MASK),
    "is_causal_mask_bias": dict(is_causal=True, mask=_BOOL_MASK, bias=_BIAS),
    "dropout_broadcast": dict(dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(7),
                              broadcast_dropout=True),
    "dropout_per_weight": dict(dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(7),
                               broadcast_dropout=False, is_causal=True),
    "deterministic": dict(dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(7),
                          deterministic=True),
    "precision": dict(precision=jax.lax.Precision.HIGHEST, mask=_BOOL_MASK),
    "dtype_float32": dict(dtype=jnp.float32, is_causal=True),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_each_flax_keyword_equals_flax_dot_product_attention_values_and_gradients(case):
  kw = _CASES[case]
  ours = core.flax_attention_fn("softmax")

  def loss(fn, q, k, v, bias):
    call = dict(kw, bias=bias) if "bias" in kw else kw
    return fn(q, k, v, **call)

  args = (_Q, _K, _V, kw.get("bias"))
  ref = loss(_flax_reference, *args)
  out = loss(ours, *args)
  chex.assert_trees_all_close(out, ref, atol=2e-6, rtol=2e-6)
  argnums = (1, 2, 3, 4) if "bias" in kw else (1, 2, 3)
  g = jax.random.normal(jax.random.PRNGKey(3), out.shape)
  grads = lambda fn: jax.grad(lambda *a: jnp.sum(loss(*a) * g), argnums=argnums)(fn, *args)
  chex.assert_trees_all_close(grads(ours), grads(_flax_reference), atol=1e-5,
                              rtol=1e-5)
  if "is_causal" in kw:  # the case must be able to fail: without the flag, outputs differ
    free = {k_: v_ for k_, v_ in kw.items() if k_ != "is_causal"}
    assert jnp.max(jnp.abs(ours(_Q, _K, _V, **free) - ref)) > 1e-2


def test_precision_reaches_the_matmuls():
  fn = core.flax_attention_fn("softmax")
  jaxpr = lambda **kw: str(jax.make_jaxpr(lambda q, k, v: fn(q, k, v, **kw))(_Q, _K, _V))
  assert "HIGHEST" in jaxpr(precision=jax.lax.Precision.HIGHEST)
  assert "HIGHEST" in jaxpr(precision="highest")
  assert "HIGHEST" in jaxpr(precision=(jax.lax.Precision.HIGHEST,) * 2)
  assert "HIGHEST" not in jaxpr()
  with pytest.raises(ValueError, match="differs between the two operands"):
    fn(_Q, _K, _V, precision=(jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT))


def test_low_precision_dtype_matches_flax_to_bf16_rounding():
  ref = _flax_reference(_Q, _K, _V, dtype=jnp.bfloat16, is_causal=True)
  out = core.flax_attention_fn("softmax")(_Q, _K, _V, dtype=jnp.bfloat16, is_causal=True)
  assert out.dtype == jnp.bfloat16
  chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), atol=3e-2)


def test_unknown_keyword_is_a_type_error_naming_it():
  fn = core.flax_attention_fn("softmax")
  with pytest.raises(TypeError, match="is_casual"):
    fn(_Q, _K, _V, is_casual=True)
  params = inspect.signature(fn).parameters.values()
  assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params)


def test_custom_einsums_are_refused_not_dropped():
  fn = core.flax_attention_fn("softmax")
  with pytest.raises(ValueError, match="qk_attn_weights_einsum is not supported"):
    fn(_Q, _K, _V, qk_attn_weights_einsum=jnp.einsum)
  model = _linen(fn, qk_attn_weights_einsum_cls=lambda: jnp.einsum)
  params = _linen().init(jax.random.PRNGKey(1), X, X)
  with pytest.raises(ValueError, match="qk_attn_weights_einsum is not supported"):
    model.apply(params, X, X)


@pytest.mark.parametrize("force_fp32", [False, True])
def test_linen_every_module_keyword_equals_stock(force_fp32):
  kw = dict(dropout_rate=0.2, broadcast_dropout=False, precision=jax.lax.Precision.HIGHEST,
            force_fp32_for_softmax=force_fp32)
  params = _linen().init(jax.random.PRNGKey(1), X, X)
  call = dict(mask=MASK, deterministic=False, rngs={"dropout": jax.random.PRNGKey(4)},
              sow_weights=True, mutable=["intermediates"])
  ref = _linen(**kw).apply(params, X, X, **call)
  out = _linen(core.flax_attention_fn("softmax"), **kw).apply(params, X, X, **call)
  chex.assert_trees_all_close(out, ref, atol=1e-5)
  grad = lambda m: jax.grad(lambda p: jnp.sum(m.apply(p, X, X, **call)[0] ** 2))(params)
  chex.assert_trees_all_close(grad(_linen(core.flax_attention_fn("softmax"), **kw)),
                              grad(_linen(**kw)), atol=1e-4, rtol=1e-4)


@_needs_is_causal
@pytest.mark.parametrize("mask", [None, "padding"])
def test_nnx_is_causal_equals_stock_module_values_and_gradients(mask):
  m = None if mask is None else MASK
  stock, ours = _nnx_mha(), _nnx_mha(core.flax_attention_fn("softmax"))
  ref = stock(X, mask=m, is_causal=True)
  chex.assert_trees_all_close(ours(X, mask=m, is_causal=True), ref, atol=1e-5)
  assert jnp.max(jnp.abs(ours(X, mask=m) - ref)) > 1e-2  # the flag matters here
  loss = lambda model, x: jnp.sum(model(x, mask=m, is_causal=True) ** 2)
  grads = lambda model: nnx.grad(loss, argnums=(0, 1))(model, X)
  chex.assert_trees_all_close(grads(ours), grads(stock), atol=1e-4, rtol=1e-4)


@_needs_is_causal
def test_nnx_every_module_keyword_equals_stock():
  kw = dict(dropout_rate=0.3, broadcast_dropout=False, precision=jax.lax.Precision.HIGHEST)
  run = lambda model: nnx.capture(model, nnx.Intermediate)(  # Flax's way to read sown values
      X, mask=MASK, is_causal=True, deterministic=False, rngs=nnx.Rngs(dropout=3),
      sow_weights=True)
  stock, ours = _nnx_mha(**kw), _nnx_mha(core.flax_attention_fn("softmax"), **kw)
  (out, sown), (ref, ref_sown) = run(ours), run(stock)
  chex.assert_trees_all_close(out, ref, atol=1e-5)
  weights = lambda state: jax.tree.leaves(state["attention_weights"])
  assert len(weights(sown)) == 1
  chex.assert_trees_all_close(weights(sown), weights(ref_sown), atol=1e-6)


def _causal_case(weighting: str) -> tuple[str, str]:
  distance = getattr(core.get_weighting(weighting), "distance_kernel", False)
  return weighting, "neg_sq_dist" if distance else "scaled_dot"


@pytest.mark.parametrize("implementation", ["dense", "blocked", "pallas"])
@pytest.mark.parametrize("weighting", core.list_weightings())
def test_is_causal_no_earlier_output_sees_a_later_token(weighting, implementation):
  # The NNX user's failure: a causal model whose outputs depend on later tokens. Changing the
  # last token (its query, key and value) must leave every earlier output exactly as it was.
  weighting, score = _causal_case(weighting)
  if implementation == "pallas":
    implementation = core.Pallas(interpret=True)
  fn = core.flax_attention_fn(weighting, score, implementation=implementation)
  q, noise, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 7, 2, 8)) for i in (20, 21, 22))
  k = q + 0.1 * noise  # keys near their queries: compact distance kernels have weights too
  q2, k2, v2 = (x.at[:, -1].multiply(0.5) for x in (q, k, v))
  run = jax.jit(lambda *a: fn(*a, is_causal=True))
  out, out2 = run(q, k, v), run(q2, k2, v2)
  chex.assert_tree_all_finite((out, out2))
  chex.assert_trees_all_close(out2[:, :-1], out[:, :-1], atol=1e-6)
  assert jnp.max(jnp.abs(out2[:, -1] - out[:, -1])) > 1e-3  # the change reached the last one


@_needs_is_causal
@pytest.mark.parametrize("weighting", ["softmax", "sigmoid", "stick_breaking", "entmax15"])
def test_nnx_causal_model_sees_no_future(weighting):
  # The issue's own check, through flax.nnx.MultiHeadAttention(is_causal=True).
  model = _nnx_mha(core.flax_attention_fn(weighting))
  x2 = X.at[:, -1].add(5.0)
  out, out2 = model(X, is_causal=True), model(x2, is_causal=True)
  chex.assert_trees_all_close(out2[:, :-1], out[:, :-1], atol=1e-5)
  assert jnp.max(jnp.abs(model(x2)[:, :-1] - model(X)[:, :-1])) > 1e-3  # not causal: it leaks


def test_weighting_params_at_construction_and_call_time_with_gradients():
  s = jnp.array([0.3, 0.5, 0.7, 0.9])
  want = lambda s_: core.attention(_Q, _K, _V, weighting="ssmax", is_causal=True,
                                   weighting_params={"s": s_})
  fixed = core.flax_attention_fn("ssmax", weighting_params={"s": s})
  chex.assert_trees_all_close(fixed(_Q, _K, _V, is_causal=True), want(s), atol=1e-6)
  fn = core.flax_attention_fn("ssmax")
  got = lambda s_: fn(_Q, _K, _V, is_causal=True, weighting_params={"s": s_})
  chex.assert_trees_all_close(got(s), want(s), atol=1e-6)
  g_got = jax.grad(lambda s_: jnp.sum(got(s_) ** 2))(s)
  g_want = jax.grad(lambda s_: jnp.sum(want(s_) ** 2))(s)
  chex.assert_trees_all_close(g_got, g_want, atol=1e-6)
  assert jnp.all(jnp.abs(g_got) > 0)


def test_nnx_module_learns_ssmax_s_through_the_adapter():
  class SSMaxAttention(nnx.Module):
    def __init__(self, rngs):
      self.s = nnx.Param(jnp.full((4,), 0.43))
      self.fn = core.flax_attention_fn("ssmax")

    def __call__(self, q, k, v):
      return self.fn(q, k, v, is_causal=True, weighting_params={"s": self.s[...]})

  model = SSMaxAttention(nnx.Rngs(0))
  grads = nnx.grad(lambda m: jnp.sum(m(_Q, _K, _V) ** 2))(model)
  assert jnp.all(jnp.abs(grads["s"][...]) > 0)
