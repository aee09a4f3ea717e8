"""MultiHeadAttention: flax equivalence, KV cache, causality, weights, parametrized scores."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.nn import MultiHeadAttention

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
Y = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 6))
PAD = nn.make_attention_mask(jnp.ones((2, 4)), jnp.arange(3)[None].repeat(2, 0) < 2)  # float


def _pair(**kw):
  ours = MultiHeadAttention(num_heads=2, qkv_features=8, **kw)
  ref_kw = {"normalize_qk": kw.pop("qk_norm")} if "qk_norm" in kw else {}
  ref = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, **kw, **ref_kw)
  return ours, ref


@pytest.mark.parametrize("cross", [False, True])
def test_softmax_equals_flax_linen_on_copied_params(cross):
  # Self attention with a causal mask; cross attention with qk-norm and a padding mask.
  ours, ref = _pair(qk_norm=cross, out_features=5)
  kv = Y if cross else None
  params = ref.init(KEY, X, kv)
  # Identical layout: our init builds the same tree, and flax's params load verbatim.
  chex.assert_trees_all_equal_shapes(ours.init(KEY, X, kv), params)
  mask = PAD if cross else nn.make_causal_mask(jnp.ones((2, 4)))
  for m in (None, mask):
    chex.assert_trees_all_close(ours.apply(params, X, kv, mask=m),
                                ref.apply(params, X, kv, mask=m), atol=1e-5)


def test_is_causal_equals_flax_causal_mask():
  ours, ref = _pair()
  params = ref.init(KEY, X)
  causal = nn.make_causal_mask(jnp.ones((2, 4)))
  out = MultiHeadAttention(num_heads=2, qkv_features=8, is_causal=True).apply(params, X)
  chex.assert_trees_all_close(out, ref.apply(params, X, mask=causal), atol=1e-5)


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_equals_flax_with_same_rng(broadcast):
  ours, ref = _pair(dropout_rate=0.3, broadcast_dropout=broadcast)
  params = ref.init(KEY, X, deterministic=True)
  rngs = {"dropout": jax.random.PRNGKey(7)}
  a = ours.apply(params, X, deterministic=False, rngs=rngs)
  b = ref.apply(params, X, deterministic=False, rngs=rngs)
  chex.assert_trees_all_close(a, b, atol=1e-5)
  assert jnp.max(jnp.abs(a - ours.apply(params, X))) > 1e-3  # dropout did something


def test_kv_cache_decoding_equals_full_causal_pass():
  model = MultiHeadAttention(num_heads=4, qkv_features=8, num_kv_heads=2, is_causal=True,
                             weighting="relu")
  variables = model.init(KEY, X, decode=True)
  full = model.apply(variables, X)
  cache = variables["cache"]
  chex.assert_shape(cache["cached_key"], (2, 4, 2, 2))
  steps = []
  for t in range(X.shape[1]):
    out, mut = model.apply({"params": variables["params"], "cache": cache}, X[:, t:t + 1],
                           decode=True, mutable=["cache"])
    cache = mut["cache"]
    steps.append(out)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5)
  # A step past the cache length (4) has no slot: NaN, not a silently overwritten last slot.
  over, mut = model.apply({"params": variables["params"], "cache": cache}, X[:, :1],
                          decode=True, mutable=["cache"])
  assert jnp.all(jnp.isnan(over)) and int(mut["cache"]["cache_index"]) == 5
  chex.assert_trees_all_equal(mut["cache"]["cached_key"], cache["cached_key"])


def test_paged_kv_cache_decodes_as_the_contiguous_one():
  """cache_page_size: the same steps from pages (page 3 does not divide the 4 positions: the
  last page is part used), the window honoured; the cache holds whole pages (6 positions), and
  a step past them is NaN."""
  for window in (None, 1):
    kw = dict(num_heads=4, qkv_features=8, num_kv_heads=2, is_causal=True, weighting="relu",
              sliding_window=window)
    plain, paged = MultiHeadAttention(**kw), MultiHeadAttention(**kw, cache_page_size=3)
    variables = plain.init(KEY, X, decode=True)
    cache = paged.init(KEY, X, decode=True)["cache"]
    assert cache["k_pages"].shape == (4, 3, 2, 2) and cache["page_table"].tolist() == [[0, 1],
                                                                                       [2, 3]]
    ref_cache = variables["cache"]
    for t in range(X.shape[1]):
      x = X[:, t:t + 1]
      ref, mut = plain.apply({"params": variables["params"], "cache": ref_cache}, x,
                             decode=True, mutable=["cache"])
      got, mut_p = paged.apply({"params": variables["params"], "cache": cache}, x, decode=True,
                               mutable=["cache"])
      ref_cache, cache = mut["cache"], mut_p["cache"]
      chex.assert_trees_all_close(got, ref, atol=1e-6)
    for t in range(3):  # positions 4 and 5 fill the last page; the 7th step has no slot
      got, mut_p = paged.apply({"params": variables["params"], "cache": cache}, X[:, :1],
                               decode=True, mutable=["cache"])
      assert bool(jnp.all(jnp.isnan(got))) == (t == 2)
      if t == 2:
        chex.assert_trees_all_equal(mut_p["cache"]["k_pages"], cache["k_pages"])
      cache = mut_p["cache"]
  with pytest.raises(ValueError, match="cache_page_size must be a positive int"):
    MultiHeadAttention(num_heads=2, is_causal=True, cache_page_size=0).init(KEY, X,
                                                                            decode=True)


def test_kv_cache_rejects_multi_token_step():
  model = MultiHeadAttention(num_heads=2, is_causal=True)
  variables = model.init(KEY, X, decode=True)
  with pytest.raises(ValueError, match="one position at a time"):
    model.apply(variables, X[:, :2], decode=True, mutable=["cache"])


def test_causality_through_gradients():
  weightings = ("softmax", "sparsemax", "sigmoid:normalization=none")

  @jax.jit
  def grads(x):  # [weighting, t] -> d out[:, t] / d x, in one program
    out = []
    for w in weightings:
      model = MultiHeadAttention(num_heads=2, is_causal=True, weighting=w)
      params = model.init(KEY, x)
      out.append([jax.grad(lambda x, t=t, m=model, p=params: jnp.sum(m.apply(p, x)[:, t]))(x)
                  for t in (0, 2)])
    return out

  for w, gs in zip(weightings, grads(X), strict=True):
    for t, g in zip((0, 2), gs, strict=True):
      assert jnp.all(g[:, t + 1:] == 0), w
      assert jnp.all(jnp.any(g[:, t] != 0, axis=-1)), w  # the query itself matters


def test_return_and_sow_weights():
  model = MultiHeadAttention(num_heads=2, sow_weights=True, weighting="sparsemax")
  params = model.init(KEY, X)
  (out, w), state = model.apply(params, X, return_weights=True, mutable=["intermediates"])
  chex.assert_shape(w, (2, 2, 4, 4))
  chex.assert_trees_all_close(w.sum(-1), jnp.ones((2, 2, 4)), atol=1e-5)
  chex.assert_trees_all_equal(state["intermediates"]["attention_weights"][0], w)
  chex.assert_trees_all_close(out, model.apply(params, X), atol=1e-5)


# score="metric" replaces the query/key projections by one shared map (MetricAttention's).
SCORE_PARAMS = {"bilinear": ["score_W"], "metric": ["metric", "log_temperature"],
                "additive": ["score_Wq", "score_Wk", "score_v"], "cosine": []}


def test_scores_with_learned_params():
  # score_dim is a free width only for metric (rank of L) and additive (hidden width).
  models = {s: MultiHeadAttention(num_heads=2, qkv_features=8, score=s,
                                  score_dim=3 if s in ("metric", "additive") else None)
            for s in SCORE_PARAMS}

  @jax.jit
  def run(x):  # one program for every score
    res = {}
    for s, m in models.items():
      params = m.init(KEY, x)
      res[s] = params, *jax.value_and_grad(lambda p, m=m: jnp.sum(m.apply(p, x) ** 2))(params)
    return res

  for score, (params, out, grads) in run(X).items():
    names = SCORE_PARAMS[score]
    assert set(names) <= set(params["params"]), (score, params["params"].keys())
    if models[score].score_dim:
      assert jax.tree.leaves(params["params"][names[0]])[0].shape[-1] == 3, score
    assert ("query" in params["params"]) == (score != "metric"), score
    chex.assert_tree_all_finite((out, grads))
    for n in names:
      assert all(jnp.any(g != 0) for g in jax.tree.leaves(grads["params"][n])), (score, n)


def test_bilinear_identity_init_equals_dot_score():
  dot = MultiHeadAttention(num_heads=2, score="dot")
  bil = MultiHeadAttention(num_heads=2, score="bilinear")
  params = bil.init(KEY, X)
  chex.assert_trees_all_close(bil.apply(params, X), dot.apply(params, X), atol=1e-5)


def test_gqa_matches_repeated_kv_heads():
  gqa = MultiHeadAttention(num_heads=4, num_kv_heads=2, qkv_features=8)
  mha = MultiHeadAttention(num_heads=4, qkv_features=8)
  p = gqa.init(KEY, X)["params"]
  rep = lambda d: {**d, "kernel": jnp.repeat(d["kernel"], 2, axis=1),
                   "bias": jnp.repeat(d["bias"], 2, axis=0)}
  full = {**p, "key": rep(p["key"]), "value": rep(p["value"])}
  chex.assert_trees_all_close(gqa.apply({"params": p}, X), mha.apply({"params": full}, X),
                              atol=1e-5)


@pytest.mark.skipif(not hasattr(core, "blocked_attention"), reason="core blocked kernel absent")
def test_blocked_implementation_equals_dense():
  dense = MultiHeadAttention(num_heads=2, weighting="relu", implementation="dense",
                             is_causal=True)
  blocked = dense.clone(implementation="blocked")
  params = dense.init(KEY, X)
  chex.assert_trees_all_close(blocked.apply(params, X), dense.apply(params, X), atol=1e-4)


def test_a_users_score_with_learned_parameters_is_learned_by_the_module():
  # The module reads a score's learned parameters from the score object (no list of names):
  # a user's Score with one (a per-head scale of q·k) gets it as score_<name>, with gradients.
  from attnx.core.scores import LearnedParam, Score  # noqa: PLC0415

  scaled = Score("head_scaled_dot",
                 lambda q, k, g: core.dot(q, k) * g[:, None, None],
                 lambda q, k, g: (q * g[:, None], k), params=("g",), learned=(
                     ("g", LearnedParam(lambda n, h, r: (n,), jax.nn.initializers.ones)),))
  m = MultiHeadAttention(num_heads=2, qkv_features=8, score=scaled)
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 5, 8))
  variables = m.init(jax.random.PRNGKey(0), x)
  np.testing.assert_array_equal(variables["params"]["score_g"], np.ones(2))
  plain = MultiHeadAttention(num_heads=2, qkv_features=8, score="dot")
  rest = {k: v for k, v in variables["params"].items() if k != "score_g"}
  np.testing.assert_allclose(m.apply(variables, x), plain.apply({"params": rest}, x), atol=1e-6)
  grad = jax.grad(lambda p: jnp.sum(m.apply({"params": p}, x) ** 2))(variables["params"])
  assert np.all(np.asarray(grad["score_g"]) != 0)
