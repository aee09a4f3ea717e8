"""Score modifications (attnx.core.score_mods): logits_soft_cap, score_mod with learned
parameters, ALiBi and relative tables — against jax.nn.dot_product_attention with the
equivalent dense bias, closed forms, and the errors of bad input. The float64 brute force of
every F × implementation is the differential net's (tests/support/reference.score_mod64)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import masks
from attnx.core.kernels import pallas as pallas_lib

B, T, S, N, K, H = 2, 40, 52, 4, 2, 8
IMPLS = ["dense", core.Blocked(block_q=16, block_k=16)]
# The Pallas kernels run a soft cap, ALiBi and sinks (and on the GPU's a relative table), for a
# pointwise F (Triton's kernels in the interpreter here, both lowerings in test_pallas_alibi_*;
# the differential net's cases 121-131, 143-144).
PALLAS = core.Pallas(block_q=16, block_k=16, interpret=True)
WITH_PALLAS = [*IMPLS, PALLAS]


def _qkv(seed=0, t=T, s=S, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, t, N, H), dtype), jax.random.normal(kk, (B, s, K, H), dtype),
          jax.random.normal(kv, (B, s, K, H), dtype))


def _distance(t, s):
  return (np.arange(t)[:, None] - np.arange(s)[None, :]).astype(np.float32)


def test_alibi_slopes_are_press_et_al_geometric_sequence():
  np.testing.assert_allclose(core.alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
  np.testing.assert_allclose(core.alibi_slopes(4), [2.0 ** (-2 * (i + 1)) for i in range(4)])
  # Not a power of two: the 4 slopes of 4 heads, then every other one of 8 heads' (the
  # reference implementation's get_slopes).
  np.testing.assert_allclose(core.alibi_slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6,
                                                    2.0 ** -8, 2.0 ** -1, 2.0 ** -3])
  with pytest.raises(ValueError, match="num_heads"):
    core.alibi_slopes(0)


@pytest.mark.parametrize("impl", WITH_PALLAS, ids=["dense", "blocked", "pallas"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_equals_jax_nn_with_the_alibi_bias(impl, causal):
  """Softmax with core.alibi(slopes) equals jax.nn with the bias −m_h·(i − j) (causal) or
  −m_h·|i − j|, values and gradients, the slopes' too."""
  q, k, v = _qkv()
  slopes = core.alibi_slopes(N) * 1.5
  dist = _distance(T, S)
  rel = dist if causal else np.abs(dist)

  def ours(q, k, v, slopes):
    return core.attention(q, k, v, is_causal=causal, implementation=impl,
                          score_mod=core.alibi(slopes, symmetric=not causal))

  def theirs(q, k, v, slopes):
    bias = -slopes[None, :, None, None] * rel
    return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=causal)

  np.testing.assert_allclose(ours(q, k, v, slopes), theirs(q, k, v, slopes), atol=2e-5)
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  got = jax.grad(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, slopes)
  want = jax.grad(loss(theirs), argnums=(0, 1, 2, 3))(q, k, v, slopes)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", WITH_PALLAS, ids=["dense", "blocked", "pallas"])
def test_soft_cap_is_c_tanh_of_the_raw_score_before_the_bias(impl):
  """logits_soft_cap=c: softmax(c·tanh(s/c) + bias) in float64 numpy, values; gradients of
  the bias equal jax.nn's with the capped scores as its bias."""
  q, k, v = _qkv(1)
  q = q * 4.0  # scores large enough that the cap bends them
  bias = jax.random.normal(jax.random.key(9), (1, N, T, S))
  c = 2.0
  out = core.attention(q, k, v, bias, logits_soft_cap=c, implementation=impl)
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  kk, vv = np.repeat(k64, N // K, axis=2), np.repeat(v64, N // K, axis=2)
  z = c * np.tanh(np.einsum("btnh,bsnh->bnts", q64, kk) / math.sqrt(H) / c)
  z = z + np.asarray(bias, np.float64)
  w = np.exp(z - z.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum("bnts,bsnh->btnh", w, vv), atol=2e-5)
  assert np.abs(z).max() < c + 4.0  # the cap bounded the raw part

  def ours(bias):
    return jnp.sum(core.attention(q, k, v, bias, logits_soft_cap=c, implementation=impl) ** 2)

  def theirs(bias):
    kr = jnp.repeat(k, N // K, axis=2)
    capped = c * jnp.tanh(jnp.einsum("btnh,bsnh->bnts", q, kr) / math.sqrt(H) / c)
    # A zero query: jax.nn's own q·k adds nothing to the capped scores given as its bias.
    return jnp.sum(jax.nn.dot_product_attention(jnp.zeros_like(q), k, v, bias=capped + bias)
                   ** 2)

  np.testing.assert_allclose(jax.grad(ours)(bias), jax.grad(theirs)(bias), atol=2e-5)
  # dq and dk through the cap's derivative 1 − tanh², against JAX's derivative of the formula.
  loss_qk = lambda f: lambda q, k: jnp.sum(f(q, k) ** 2)
  got = jax.grad(loss_qk(lambda q, k: core.attention(q, k, v, bias, logits_soft_cap=c,
                                                     implementation=impl)), (0, 1))(q, k)
  want = jax.grad(loss_qk(lambda q, k: core.attention(q, k, v, bias, logits_soft_cap=c,
                                                      implementation="dense")), (0, 1))(q, k)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS, ids=["dense", "blocked"])
@pytest.mark.parametrize("weighting", ["sigmoid", "stick_breaking", "entmax15"])
def test_relative_table_learns_through_every_family(impl, weighting):
  """A learned relative-position table of 2·max(T, S) − 1 entries per head: the table's
  gradient equals that of the same attention with the table gathered into a dense bias."""
  q, k, v = _qkv(2)
  table = 0.3 * jax.random.normal(jax.random.key(3), (N, 2 * S - 1))
  idx = np.clip(_distance(T, S).astype(np.int32), -(S - 1), S - 1) + S - 1

  def ours(table):
    out = core.attention(q, k, v, weighting=weighting, is_causal=True, implementation=impl,
                         score_mod=core.relative_table(table))
    return jnp.sum(out ** 2)

  def dense_bias(table):
    out = core.attention(q, k, v, table[:, idx][None], weighting=weighting, is_causal=True,
                         implementation="dense")
    return jnp.sum(out ** 2)

  np.testing.assert_allclose(ours(table), dense_bias(table), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(ours)(table), jax.grad(dense_bias)(table), atol=2e-4,
                             rtol=1e-3)


def test_score_mod_function_sees_global_positions_heads_and_batches():
  """A user's score_mod reads b, h and the global positions: with a window mask and tiles of
  16 the blocked kernel's tiles agree with the dense grid, and params get gradients."""
  q, k, v = _qkv(4)

  def fn(score, b, h, q_idx, kv_idx, params):
    return score + params["w"][h] * jnp.cos(0.1 * (q_idx - 2 * kv_idx)) + 0.5 * b

  params = {"w": jnp.linspace(-1.0, 1.0, N)}

  def run(impl, params):
    out = core.attention(q, k, v, mask=masks.sliding_window(9, 3), implementation=impl,
                         score_mod=fn, score_mod_params=params, weighting="relu")
    return jnp.sum(out ** 2)

  dense, blocked = (jax.value_and_grad(run, argnums=1)(impl, params) for impl in IMPLS)
  np.testing.assert_allclose(blocked[0], dense[0], rtol=1e-5)
  np.testing.assert_allclose(blocked[1]["w"], dense[1]["w"], rtol=1e-4, atol=1e-4)
  assert np.all(np.abs(dense[1]["w"]) > 0)


def test_jit_vmap_and_grad_trace_the_parameters():
  q, k, v = _qkv(5)
  slopes = core.alibi_slopes(N)
  fn = jax.jit(lambda s: core.attention(q, k, v, is_causal=True, score_mod=core.alibi(s),
                                        implementation="blocked"))
  np.testing.assert_allclose(fn(slopes), core.attention(
      q, k, v, is_causal=True, score_mod=core.alibi(slopes)), atol=2e-5)
  batched = jax.vmap(fn)(jnp.stack([slopes, 2 * slopes]))
  np.testing.assert_allclose(batched[1], fn(2 * slopes), atol=1e-6)
  assert jnp.all(jnp.isfinite(jax.grad(lambda s: jnp.sum(fn(s)))(slopes)))


def test_blocked_with_cap_alibi_and_sinks_never_forms_t_by_s():
  """The modifications and sinks add O(N) to the blocked program's scratch: equal to the same
  masked call without them (which holds no [T, S] array: tests/core/test_masks.py)."""
  t = 1024
  q = k = v = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  slopes = jax.ShapeDtypeStruct((2,), jnp.float32)

  def compiled(modified):
    def loss(q, k, v, slopes):
      kw = (dict(logits_soft_cap=30.0, score_mod=core.alibi(slopes), sinks=slopes)
            if modified else {})
      return jnp.sum(core.attention(
          q, k, v, is_causal=True, mask=masks.sliding_window(128, 0),
          implementation=core.Blocked(block_q=64, block_k=64), **kw))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, slopes).compile()

  with_them, without = compiled(True), compiled(False)
  assert f"{t},{t}]" not in with_them.as_text()
  memory, base = with_them.memory_analysis(), without.memory_analysis()
  if memory is not None:
    assert memory.temp_size_in_bytes <= base.temp_size_in_bytes + 64 * 1024


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_a_cap_that_is_not_positive_is_refused(cap):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="logits_soft_cap"):
    core.attention(q, k, v, logits_soft_cap=cap)


@pytest.mark.parametrize("fn, match", [
    (lambda s, b, h, qi, ki, p: s[..., :1], "shape and dtype"),  # a smaller tile
    (lambda s, b, h, qi, ki, p: qi - ki, "shape and dtype"),  # ignores the score: int32
    (lambda s, b, h, qi, ki, p: s.astype(jnp.bfloat16), "shape and dtype"),
    (lambda s, b, h, qi, ki, p: s + p["missing"], "score_mod failed"),
])
def test_a_score_mod_that_changes_the_tile_is_refused(fn, match):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match):
    core.attention(q, k, v, score_mod=fn, score_mod_params={"w": jnp.ones(N)})


def test_bad_score_mod_arguments_are_refused():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="without a score_mod"):
    core.attention(q, k, v, score_mod_params={"w": jnp.ones(N)})
  with pytest.raises(ValueError, match="carries its own parameters"):
    core.attention(q, k, v, score_mod=core.alibi(core.alibi_slopes(N)),
                   score_mod_params={"w": jnp.ones(N)})
  with pytest.raises(ValueError, match="must be a function"):
    core.attention(q, k, v, score_mod="alibi")
  with pytest.raises(ValueError, match="float arrays"):
    core.attention(q, k, v, score_mod=lambda s, b, h, qi, ki, p: s + p[h],
                   score_mod_params=jnp.arange(N))
  with pytest.raises(ValueError, match="slopes must be a float array"):
    core.alibi(jnp.ones((2, 2)))
  with pytest.raises(ValueError, match="L odd"):
    core.relative_table(jnp.ones((N, 4)))


def test_pallas_refuses_score_mod_functions_and_row_families_and_the_choice_runs_blocked():
  """Pallas runs a cap, ALiBi and a relative table with a pointwise or a whole-row F (both
  lowerings); any other score_mod function (a user's — even one that computes ALiBi or a table
  without declaring it) is refused with the reason, and the automatic choice runs the blocked
  kernel (on a CPU it never takes Pallas; explain says why for each)."""
  q, k, v = _qkv(t=512, s=512)
  slopes = core.alibi_slopes(N)
  alibi = core.alibi(slopes)
  table = core.relative_table(jnp.zeros((N, 3)))
  undeclared = dataclasses.replace(alibi, linear_bias=None)  # ALiBi's fn, no declaration
  for mod in (dataclasses.replace(table, relative=False), undeclared):
    with pytest.raises(ValueError, match="not another score_mod function"):
      core.attention(q, k, v, score_mod=mod, implementation=core.Pallas(interpret=True))
  with pytest.raises(ValueError, match="not another score_mod function"):
    core.attention(q, k, v, logits_soft_cap=5.0, score_mod=lambda s, *_: s,
                   implementation=core.Pallas(interpret=True))
  ex = core.explain(q, k, v, score_mod=lambda s, *_: s)
  assert ex.chosen == "blocked" and "not another score_mod function" in ex.reasons["pallas"]
  assert ex.problem.has_score_mod and ex.problem.has_score_mod_fn
  assert ex.problem.score_mod_kind == "fn"
  # A relative table: supported by both lowerings (compared in float64 below), and the
  # automatic choice still passes over Pallas.
  ex = core.explain(q, k, v, score_mod=table)
  assert ex.problem.score_mod_kind == "relative" and ex.chosen == "blocked"
  assert ex.reasons["pallas"] is None
  # ALiBi: supported, and the automatic choice still passes over Pallas (on a GPU too).
  ex = core.explain(q, k, v, score_mod=alibi)
  assert ex.problem.score_mod_kind == "alibi" and ex.reasons["pallas"] is None
  assert ex.chosen == "blocked"
  on_gpu = dataclasses.replace(ex.problem, platform="gpu")
  assert "covers no logits_soft_cap, ALiBi" in core.Pallas().declines(on_gpu)
  ex = core.explain(q, k, v, logits_soft_cap=5.0)
  assert ex.chosen == "blocked" and ex.problem.has_score_mod
  assert not ex.problem.has_score_mod_fn
  assert ex.reasons["pallas"] is None and "GPU or TPU" in ex.declined["pallas"]
  # On a GPU the automatic choice passes over it too: its one-time self-check of a
  # combination compares kernels without a cap or sinks.
  on_gpu = dataclasses.replace(ex.problem, platform="gpu")
  assert "covers no logits_soft_cap" in core.Pallas().declines(on_gpu)


def test_attention_weights_take_the_same_modification():
  q, k, _ = _qkv(6)
  slopes = core.alibi_slopes(N)
  w = core.attention_weights(q, k, is_causal=True, logits_soft_cap=3.0,
                             score_mod=core.alibi(slopes))
  kk = jnp.repeat(k, N // K, axis=2)
  z = 3.0 * jnp.tanh(jnp.einsum("btnh,bsnh->bnts", q, kk) / math.sqrt(H) / 3.0)
  z = z - slopes[None, :, None, None] * _distance(T, S)
  want = jax.nn.softmax(jnp.where(np.tril(np.ones((T, S), bool)), z, -jnp.inf), axis=-1)
  np.testing.assert_allclose(w, want, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Attention sinks.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", WITH_PALLAS, ids=["dense", "blocked", "pallas"])
def test_sinks_are_gpt_oss_extra_logit(impl):
  """softmax with sinks: softmax over [scores, sinks[h]] with the sink's column dropped (the
  gpt-oss reference), values in float64 numpy, gradients (the sinks' too) against the
  formula differentiated by JAX."""
  q, k, v = _qkv(7)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.1])
  mask = np.tril(np.ones((T, S), bool))

  def formula(q, k, v, sinks):
    kr, vr = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    z = jnp.einsum("btnh,bsnh->bnts", q, kr) / math.sqrt(H)
    z = jnp.where(mask, z, -jnp.inf)
    col = jnp.broadcast_to(sinks[None, :, None, None], z.shape[:-1] + (1,))
    w = jax.nn.softmax(jnp.concatenate([z, col], axis=-1), axis=-1)[..., :S]
    return jnp.einsum("bnts,bsnh->btnh", w, vr)

  def ours(q, k, v, sinks):
    return core.attention(q, k, v, is_causal=True, sinks=sinks, implementation=impl)

  np.testing.assert_allclose(ours(q, k, v, sinks), formula(q, k, v, sinks), atol=2e-6)
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  got = jax.grad(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  want = jax.grad(loss(formula), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  # A sink only takes weight away: every row's weights on the keys sum to less than one.
  weights = core.attention_weights(q, k, is_causal=True, sinks=sinks)
  assert float(weights.sum(-1).max()) < 1.0


@pytest.mark.parametrize("impl, weighting", [
    *[pytest.param(impl, w, id=f"{name}-{w}")
      for impl, name in zip(IMPLS, ("dense", "blocked"), strict=True)
      for w in ("sigmoid", "ssmax", "softpick", "entmax15")],
    # The Pallas kernels' sinks: a pointwise F's sum (sigmoid, relu) and online max with a
    # denominator offset (softmax_plus_one: the offset's key and the sink both start the row).
    *[pytest.param(PALLAS, w, id=f"pallas-{w}") for w in ("sigmoid", "relu",
                                                           "softmax_plus_one")]])
@pytest.mark.split_by_jax
def test_a_sink_is_one_more_key_of_zero_value(impl, weighting):
  """For every family that takes them, sinks equal the same attention (dense) with one more
  key of zero vector and zero value whose bias column holds sinks[h] — SSMax counts it,
  entmax's threshold sees it."""
  q, k, v = _qkv(8)
  sinks = jnp.array([0.3, -0.7, 1.2, -2.0])
  pad = lambda x: jnp.concatenate([x, jnp.zeros(x.shape[:1] + (1,) + x.shape[2:])], axis=1)
  bias = jnp.concatenate([jnp.zeros((1, N, T, S)),
                          jnp.broadcast_to(sinks[None, :, None, None], (1, N, T, 1))], -1)
  window = masks.sliding_window(12, 0)
  extra_key = np.ones((T, S + 1), bool)
  extra_key[:, :S] = np.asarray(masks.materialize(window.bind((B,), N, T, S), (B,), N, T, S))[0, 0]

  def ours(sinks):
    return core.attention(q, k, v, weighting=weighting, mask=window, sinks=sinks,
                          implementation=impl)

  def one_more_key(sinks):
    b = bias.at[..., S].set(jnp.broadcast_to(sinks[None, :, None], (1, N, T)))
    return core.attention(q, pad(k), pad(v), b, mask=extra_key, weighting=weighting,
                          implementation="dense")

  np.testing.assert_allclose(ours(sinks), one_more_key(sinks), atol=2e-5)
  g_ours = jax.grad(lambda s: jnp.sum(ours(s) ** 2))(sinks)
  g_key = jax.grad(lambda s: jnp.sum(one_more_key(s) ** 2))(sinks)
  np.testing.assert_allclose(g_ours, g_key, atol=2e-4, rtol=1e-3)


def test_a_row_without_keys_and_a_sink_stays_zero():
  q, k, v = _qkv(9)
  lengths = jnp.array([0, S], jnp.int32)
  sinks = jnp.ones(N)
  for impl in WITH_PALLAS:
    fn = lambda q, sinks, impl=impl: core.attention(
        q, k, v, key_value_seq_lengths=lengths, sinks=sinks, implementation=impl)
    out = fn(q, sinks)
    assert float(jnp.abs(out[0]).max()) == 0.0
    dq, ds = jax.grad(lambda q, s, fn=fn: jnp.sum(fn(q, s)), argnums=(0, 1))(q, sinks)
    assert float(jnp.abs(dq[0]).max()) == 0.0 and bool(jnp.all(jnp.isfinite(ds)))


@pytest.mark.parametrize("weighting, match", [
    ("relu:normalization=length", "divides by no sum"),
    ("sigmoid:normalization=none", "divides by no sum"),
    ("stick_breaking", "unassigned"),
])
def test_sinks_where_they_mean_nothing_are_refused(weighting, match):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match):
    core.attention(q, k, v, weighting=weighting, sinks=jnp.zeros(N))


def test_sinks_of_the_wrong_shape_or_dtype_are_refused():
  q, k, v = _qkv()
  for bad in (jnp.zeros(N + 1), jnp.zeros((1, N)), jnp.zeros(N, jnp.int32), 0.5):
    with pytest.raises(ValueError, match=r"sinks must be a float array \[N\]"):
      core.attention(q, k, v, sinks=bad)
  # A whole-row F takes sinks in the Pallas kernels too (their refusal is gone).
  run = lambda impl: core.attention(q, k, v, weighting="ssmax", sinks=jnp.zeros(N),
                                    implementation=impl)
  np.testing.assert_allclose(run(PALLAS), run("dense"), atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=["dense", "blocked"])
@pytest.mark.parametrize("weighting", ["softmax", "entmax15"])
def test_a_masked_nan_key_touches_nothing_under_a_cap_alibi_and_sinks(impl, weighting):
  """The contract (attnx.core.contract): a NaN in a key that every row masks changes no output
  and no gradient but its own, with a soft cap and ALiBi (whose derivatives are taken at the
  finite scores) and sinks."""
  q, k, v = _qkv(10)
  lengths = jnp.array([S - 3, S], jnp.int32)  # batch 0 masks its last 3 keys
  bad = k.at[0, S - 1].set(jnp.nan)
  kw = dict(key_value_seq_lengths=lengths, logits_soft_cap=2.0, is_causal=False,
            score_mod=core.alibi(core.alibi_slopes(N), symmetric=True), sinks=jnp.ones(N),
            weighting=weighting, implementation=impl)

  def run(k):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(core.attention(q, k, v, **kw) ** 2),
                              argnums=(0, 1, 2))(q, k, v)

  (clean_val, clean), (nan_val, grads) = run(k), run(bad)
  np.testing.assert_allclose(nan_val, clean_val, rtol=1e-6)
  np.testing.assert_allclose(grads[0], clean[0], atol=1e-6)  # dq: every row unaffected
  np.testing.assert_allclose(grads[2], clean[2], atol=1e-6)
  keep = np.ones(k.shape, bool)
  keep[0, S - 1] = False  # the NaN key's own gradient
  np.testing.assert_allclose(np.asarray(grads[1])[keep], np.asarray(clean[1])[keep], atol=1e-6)


@pytest.mark.parametrize("weighting", ["softmax", "sigmoid"])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_a_masked_nan_key_touches_nothing_under_a_cap_and_sinks(backend, weighting):
  """The NaN contract in the Pallas kernels (Triton and Mosaic, interpreted): a NaN key that
  every row masks changes no output and no gradient but its own under a soft cap and sinks —
  the cap's derivative 1 − tanh² is taken at the finite raw scores, as in the blocked kernel,
  so the masked pair's zero cotangent does not become 0·NaN in dQ."""
  q, k, v = _qkv(10)
  bad = k.at[0, S - 1].set(jnp.nan)
  lengths = jnp.array([S - 3, S], jnp.int32)  # batch 0 masks its last 3 keys
  w = core.get_weighting(weighting)

  def run(k):
    def loss(q, k, v, sinks):
      return jnp.sum(pallas_lib.pallas_attention(
          q, k, v, weighting=w, scale=1 / math.sqrt(H), kv_lengths=lengths, block_q=16,
          block_k=128, backend=backend, interpret=True, score_mod=core.soft_cap(2.0),
          sinks=sinks) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, jnp.ones(N))

  (clean_val, clean), (nan_val, grads) = run(k), run(bad)
  np.testing.assert_allclose(nan_val, clean_val, rtol=1e-6)
  for i in (0, 2, 3):  # dq, dv, d sinks
    np.testing.assert_allclose(grads[i], clean[i], atol=1e-6)
  keep = np.ones(k.shape, bool)
  keep[0, S - 1] = False  # the NaN key's own gradient
  np.testing.assert_allclose(np.asarray(grads[1])[keep], np.asarray(clean[1])[keep], atol=1e-6)


# --------------------------------------------------------------------------------------------
# ALiBi in the Pallas kernels (kernels/pallas/common.py alibi_tile; Triton and Mosaic).
# --------------------------------------------------------------------------------------------

_PT, _PS = 20, 27  # not multiples of the tiles (16 | 128)


def _pallas_alibi(backend, weighting, causal, *, cap=None, sinks=None, q_lengths=None,
                  kv_lengths=None):
  """fn(q, k, v, slopes) of the Pallas kernels (``backend``'s lowering, interpreted) and of
  the dense implementation, with ALiBi (causal or symmetric), an optional cap, sinks and
  lengths: the keywords core.attention passes them with."""
  w = core.get_weighting(weighting)
  symmetric = not causal

  def pallas(q, k, v, slopes):
    mod = core.score_mods.make(cap, core.alibi(slopes, symmetric=symmetric))
    return pallas_lib.pallas_attention(
        q, k, v, weighting=w, scale=1 / math.sqrt(H), is_causal=causal, q_lengths=q_lengths,
        kv_lengths=kv_lengths, block_q=16, block_k=16 if backend == "gpu" else 128,
        backend=backend, interpret=True, score_mod=mod, sinks=sinks)

  def dense(q, k, v, slopes):
    return core.attention(
        q, k, v, weighting=weighting, is_causal=causal, logits_soft_cap=cap,
        score_mod=core.alibi(slopes, symmetric=symmetric),
        sinks=None if sinks is None else jnp.asarray(sinks, q.dtype),
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        implementation="dense")

  return pallas, dense


def _matches_float64(pallas, dense, args, names, atol, grad_tol, loss=None):
  """Values and gradients (of every argument, named ``names``) of ``pallas`` against ``dense``
  in float64 on the same (rounded) inputs; gradients to ``grad_tol`` of each one's largest
  entry. Returns the float64 (output, gradients)."""
  loss = loss or (lambda f: lambda *a: jnp.sum(
      f(*a).astype(jnp.float32 if f is pallas else None) ** 2))
  argnums = tuple(range(len(args)))
  out = pallas(*args)
  grads = jax.grad(loss(pallas), argnums=argnums)(*args)
  with jax.enable_x64(True):
    a64 = [np.asarray(x, np.float64) for x in args]
    want = dense(*a64)
    want_g = jax.grad(loss(dense), argnums=argnums)(*a64)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=atol)
  for name, g, w in zip(names, grads, want_g, strict=True):
    w = np.asarray(w)
    err = np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), 1e-6)
    assert err < grad_tol, f"{name}: relative error {err:.2e}"
  return want, want_g


def _against_float64(pallas, dense, args, atol, grad_tol):
  """:func:`_matches_float64` of (q, k, v, slopes); every head's slope reaches the loss."""
  _, want_g = _matches_float64(pallas, dense, args, ("dq", "dk", "dv", "dslopes"), atol,
                               grad_tol)
  assert np.all(np.abs(np.asarray(want_g[3])) > 0)


_SIN_LOSS = lambda f: lambda *a: jnp.sum(jnp.sin(3.0 * f(*a)))  # noqa: E731


# Each F once per lowering, causal and symmetric ALiBi alternating (both forms in each
# lowering, each online-max and "sum" rule in each form).
@pytest.mark.parametrize(("weighting", "causal"), [
    ("softmax", True), ("sigmoid", False), ("relu", True), ("softmax_plus_one", False)])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.split_by_jax
def test_pallas_alibi_equals_float64_dense(backend, weighting, causal):
  """ALiBi in the Pallas kernels (Triton and Mosaic, interpreted): GQA (each query head its
  own slope, G = 2), T and S not multiples of the tiles, key lengths (and query lengths when
  causal), with a soft cap (softmax, relu) and sinks (the sums): values and the gradients of
  q, k, v and the slopes equal the float64 dense implementation's."""
  q, k, v = _qkv(11, t=_PT, s=_PS)
  q = 2.0 * q  # scores the cap bends
  slopes = core.alibi_slopes(N) * jnp.array([1.0, 3.0, 0.5, 2.0])
  cap = 2.0 if weighting in ("softmax", "relu") else None
  sinks = None if weighting == "softmax" else np.array([0.5, -1.0, 1.5, 0.0], np.float32)
  pallas, dense = _pallas_alibi(
      backend, weighting, causal, cap=cap, sinks=sinks,
      q_lengths=jnp.array([_PT - 3, _PT], jnp.int32) if causal else None,
      kv_lengths=jnp.array([_PS, _PS - 6], jnp.int32))
  _against_float64(pallas, dense, (q, k, v, slopes), atol=3e-6, grad_tol=2e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_alibi_with_alpha_not_one(backend):
  """softmax with α = 2 (z = α·s in the kernels' units): ALiBi's bias is scaled with the
  score, and d slopes carries α (dS = α·dz), against float64 dense."""
  q, k, v = _qkv(14, t=_PT, s=_PS)
  slopes = core.alibi_slopes(N) * 2.0
  pallas, dense = _pallas_alibi(backend, "softmax:alpha=2", True, cap=3.0,
                                kv_lengths=jnp.array([_PS - 4, _PS], jnp.int32))
  _against_float64(pallas, dense, (q, k, v, slopes), atol=3e-6, grad_tol=2e-5)


def test_pallas_alibi_bfloat16():
  """bf16 inputs (Triton, causal softmax with a cap and GQA): the float64 dense result of the
  same rounded inputs, to bf16's precision."""
  q, k, v = _qkv(12, t=_PT, s=_PS, dtype=jnp.bfloat16)
  slopes = core.alibi_slopes(N) * 2.0
  pallas, dense = _pallas_alibi("gpu", "softmax", True, cap=3.0)
  _against_float64(pallas, dense, (q, k, v, slopes), atol=2e-2, grad_tol=3e-2)


def test_pallas_alibi_through_attention_takes_learned_slopes_under_jit():
  """implementation=core.Pallas runs core.alibi: under jit, with learned slopes (their
  gradient equals the blocked kernel's), a cap and sinks."""
  q, k, v = _qkv(13, t=_PT, s=_PS)
  sinks = jnp.array([0.2, -0.3, 1.0, 0.0])

  def run(impl):
    @jax.jit
    def loss(slopes):
      out = core.attention(q, k, v, weighting="sigmoid", is_causal=True, logits_soft_cap=5.0,
                           score_mod=core.alibi(slopes), sinks=sinks, implementation=impl)
      return jnp.sum(out ** 2)
    return jax.value_and_grad(loss)(core.alibi_slopes(N))

  (val, g), (want, want_g) = run(PALLAS), run(IMPLS[1])
  np.testing.assert_allclose(val, want, rtol=1e-5)
  np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_alibi_a_masked_nan_key_touches_nothing(backend):
  """The NaN contract with ALiBi (and a cap) in the Pallas kernels: a NaN key that every row
  masks changes no output and no gradient but its own — the slopes' included (their
  gradient is the sum of dS·distance, and dS is zero at masked pairs)."""
  q, k, v = _qkv(10)
  bad = k.at[0, S - 1].set(jnp.nan)
  lengths = jnp.array([S - 3, S], jnp.int32)  # batch 0 masks its last 3 keys

  def run(k):
    def loss(q, k, v, slopes):
      mod = core.score_mods.make(2.0, core.alibi(slopes, symmetric=True))
      return jnp.sum(pallas_lib.pallas_attention(
          q, k, v, weighting=core.get_weighting("softmax"), scale=1 / math.sqrt(H),
          kv_lengths=lengths, block_q=16, block_k=128, backend=backend, interpret=True,
          score_mod=mod) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, core.alibi_slopes(N))

  (clean_val, clean), (nan_val, grads) = run(k), run(bad)
  np.testing.assert_allclose(nan_val, clean_val, rtol=1e-6)
  for i in (0, 2, 3):  # dq, dv, d slopes
    np.testing.assert_allclose(grads[i], clean[i], atol=1e-5, rtol=1e-6)
  keep = np.ones(k.shape, bool)
  keep[0, S - 1] = False  # the NaN key's own gradient
  np.testing.assert_allclose(np.asarray(grads[1])[keep], np.asarray(clean[1])[keep], atol=1e-6)


def test_a_score_mod_declares_alibi_by_a_static_field():
  """core.alibi declares its linear bias on the ScoreMod, core.relative_table its table
  (static: jit retraces on a change, the slopes / the table are the only leaf), make() and
  dataclasses.replace keep them, and a wrong one is refused."""
  mod = core.alibi(core.alibi_slopes(N), symmetric=True)
  assert mod.linear_bias == "symmetric" and core.alibi(jnp.ones(N)).linear_bias == "causal"
  assert len(jax.tree.leaves(mod)) == 1
  assert jax.tree.map(lambda x: x, mod).linear_bias == "symmetric"
  assert core.score_mods.make(3.0, mod).linear_bias == "symmetric"
  assert core.score_mods.kind(mod) == "alibi"
  table = core.relative_table(jnp.zeros((N, 3)))
  assert table.relative and not mod.relative and len(jax.tree.leaves(table)) == 1
  assert jax.tree.map(lambda x: x, table).relative
  assert core.score_mods.make(3.0, table).relative
  assert core.score_mods.kind(table) == "relative"
  assert core.score_mods.kind(dataclasses.replace(table, relative=False)) == "fn"
  assert core.score_mods.kind(core.soft_cap(2.0)) is None
  with pytest.raises(ValueError, match="linear_bias"):
    core.ScoreMod(fn=lambda s, *_: s, linear_bias="both")
  with pytest.raises(ValueError, match="give fn too"):
    core.ScoreMod(linear_bias="causal")
  with pytest.raises(ValueError, match="give fn too"):
    core.ScoreMod(relative=True)
  with pytest.raises(ValueError, match="one fn"):
    dataclasses.replace(table, linear_bias="causal")


# --------------------------------------------------------------------------------------------
# A soft cap in the whole-row Pallas kernels (kernels/pallas/rows.py; Triton and Mosaic).
# --------------------------------------------------------------------------------------------

# (family, causal, lengths): each family once per lowering, features combined.
_ROW_CAP_CASES = [("ssmax", True, True), ("softpick", False, True),
                  ("stick_breaking", True, False), ("sparsemax", False, False),
                  ("entmax15", True, True)]


@pytest.mark.parametrize(("weighting", "causal", "lengths"), _ROW_CAP_CASES,
                         ids=[c[0] for c in _ROW_CAP_CASES])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.split_by_jax
def test_pallas_whole_row_soft_cap_equals_float64_dense(backend, weighting, causal, lengths):
  """logits_soft_cap in the whole-row kernels (Triton and Mosaic, interpreted): GQA (G = 2),
  T and S not multiples of the tiles, causal or not, query and key lengths, a learned bias
  (its gradient is the cotangent of the capped score, not through 1 − tanh²): values and the
  gradients of q, k, v and the bias equal the float64 dense implementation's."""
  q, k, v = _qkv(21, t=_PT, s=_PS)
  q = 2.0 * q  # scores the cap bends
  bias = 0.3 * jax.random.normal(jax.random.key(22), (1, N, _PT, _PS))
  q_len = jnp.array([_PT - 3, _PT], jnp.int32) if lengths else None
  kv_len = jnp.array([_PS, _PS - 6], jnp.int32) if lengths else None
  cap = 1.5
  w = core.get_weighting(weighting)

  def pallas(q, k, v, bias):
    return pallas_lib.pallas_attention(
        q, k, v, weighting=w, scale=1 / math.sqrt(H), bias=bias, is_causal=causal,
        q_lengths=q_len, kv_lengths=kv_len, block_q=16,
        block_k=16 if backend == "gpu" else 128, backend=backend, interpret=True,
        score_mod=core.soft_cap(cap))

  def dense(q, k, v, bias):
    return core.attention(q, k, v, bias, weighting=weighting, is_causal=causal,
                          logits_soft_cap=cap, query_seq_lengths=q_len,
                          key_value_seq_lengths=kv_len, implementation="dense")

  _matches_float64(pallas, dense, (q, k, v, bias), ("dq", "dk", "dv", "dbias"), 3e-6, 3e-5,
                   loss=_SIN_LOSS)


def test_pallas_whole_row_soft_cap_bfloat16_and_through_attention():
  """bf16 inputs through core.attention(implementation=Pallas) under jit (Triton, entmax15,
  causal GQA, a cap): the float64 dense result of the same rounded inputs, to bf16's
  precision; the automatic choice still passes over Pallas for a capped call."""
  q, k, v = _qkv(23, t=_PT, s=_PS, dtype=jnp.bfloat16)
  q = (2.0 * q).astype(jnp.bfloat16)
  impl = core.Pallas(block_q=16, block_k=16, interpret=True)

  def run(impl):
    def f(q, k, v):
      return core.attention(q, k, v, weighting="entmax15", is_causal=True, logits_soft_cap=1.5,
                            implementation=impl)
    return f

  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
  out = jax.jit(run(impl))(q, k, v)
  grads = jax.jit(jax.grad(loss(run(impl)), argnums=(0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    a64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)]
    want = run("dense")(*a64)
    want_g = jax.grad(loss(run("dense")), argnums=(0, 1, 2))(*a64)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-2)
  for g, wg in zip(grads, want_g, strict=True):
    wg = np.asarray(wg)
    assert np.abs(np.asarray(g, np.float64) - wg).max() / np.abs(wg).max() < 3e-2
  ex = core.explain(q, k, v, weighting="entmax15", logits_soft_cap=1.5)
  assert ex.reasons["pallas"] is None and ex.chosen != "pallas"
  on_gpu = dataclasses.replace(ex.problem, platform="gpu")
  assert "covers no logits_soft_cap" in core.Pallas().declines(on_gpu)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_whole_row_a_masked_nan_key_touches_nothing_under_a_cap(backend):
  """The NaN contract in the whole-row kernels under a soft cap: a NaN key that every row
  masks changes no output and no gradient but its own (1 − tanh² taken at the finite raw
  scores, as the blocked kernel)."""
  q, k, v = _qkv(10)
  bad = k.at[0, S - 1].set(jnp.nan)
  lengths = jnp.array([S - 3, S], jnp.int32)
  w = core.get_weighting("sparsemax")

  def run(k):
    def loss(q, k, v):
      return jnp.sum(pallas_lib.pallas_attention(
          q, k, v, weighting=w, scale=1 / math.sqrt(H), kv_lengths=lengths, block_q=16,
          block_k=128 if backend == "tpu" else 16, backend=backend, interpret=True,
          score_mod=core.soft_cap(2.0)) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  (clean_val, clean), (nan_val, grads) = run(k), run(bad)
  np.testing.assert_allclose(nan_val, clean_val, rtol=1e-6)
  for i in (0, 2):
    np.testing.assert_allclose(grads[i], clean[i], atol=1e-6)
  keep = np.ones(k.shape, bool)
  keep[0, S - 1] = False
  np.testing.assert_allclose(np.asarray(grads[1])[keep], np.asarray(clean[1])[keep], atol=1e-6)


# (family, causal, lengths, cap): sinks in each family that has a sum, once per lowering.
_ROW_SINK_CASES = [("ssmax", True, True, None), ("softpick", False, True, 1.5),
                   ("sparsemax", False, False, None), ("entmax15", True, True, 1.5)]


@pytest.mark.parametrize(("weighting", "causal", "lengths", "cap"), _ROW_SINK_CASES,
                         ids=[c[0] for c in _ROW_SINK_CASES])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.split_by_jax
def test_pallas_whole_row_sinks_equal_float64_dense(backend, weighting, causal, lengths, cap):
  """Attention sinks in the whole-row kernels (Triton and Mosaic, interpreted): a virtual key
  of score sinks[h] and zero value folded into each row's threshold passes and starting state
  (SSMax counts it in n_i, entmax's τ takes it as a key), d sinks and SSMax's dc term from
  the saved row statistics outside the kernels. GQA (G = 2), T and S not multiples of the
  tiles, causal or not, query and key lengths, a cap in two families: values and the
  gradients of q, k, v and the sinks equal the float64 dense implementation's."""
  q, k, v = _qkv(26, t=_PT, s=_PS)
  q = 2.0 * q
  sinks = jnp.array([0.8, -0.5, 1.5, 0.2], jnp.float32)
  q_len = jnp.array([_PT - 3, _PT], jnp.int32) if lengths else None
  kv_len = jnp.array([_PS, _PS - 6], jnp.int32) if lengths else None
  w = core.get_weighting(weighting)

  def pallas(q, k, v, sinks):
    return pallas_lib.pallas_attention(
        q, k, v, weighting=w, scale=1 / math.sqrt(H), is_causal=causal, q_lengths=q_len,
        kv_lengths=kv_len, block_q=16, block_k=16 if backend == "gpu" else 128,
        backend=backend, interpret=True,
        score_mod=None if cap is None else core.soft_cap(cap), sinks=sinks)

  def dense(q, k, v, sinks):
    return core.attention(q, k, v, weighting=weighting, is_causal=causal, logits_soft_cap=cap,
                          sinks=sinks, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                          implementation="dense")

  want, want_g = _matches_float64(pallas, dense, (q, k, v, sinks), ("dq", "dk", "dv", "dsinks"),
                                  3e-6, 3e-5, loss=_SIN_LOSS)
  with jax.enable_x64(True):
    without = core.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                             weighting=weighting, is_causal=causal, logits_soft_cap=cap,
                             query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                             implementation="dense")
  assert np.abs(np.asarray(want) - np.asarray(without)).max() > 1e-2  # the sinks matter
  assert np.abs(np.asarray(want_g[3])).max() > 1e-3  # the sinks reached the loss


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_whole_row_sinks_with_a_learned_ssmax_s_match_the_xla_kernel(backend):
  """SSMax with a learned s per head and sinks: the sink's term of the per-row carry Σ z·dy
  (the cotangent of c_i = s·log n_i, n_i counting the sink), added outside the kernels,
  reaches d s as in the XLA whole-row kernel's backward; values and the gradients of q, k, v,
  the sinks and s equal that kernel's (GQA, causal, key lengths, T and S ragged)."""
  from attnx.core.kernels.xla.rows import blocked_row_attention

  q, k, v = _qkv(27, t=_PT, s=_PS)
  q = 2.0 * q
  sinks = jnp.array([0.8, -0.5, 1.5, 0.2], jnp.float32)
  s_heads = jnp.array([0.5, 1.0, 1.7, 2.5], jnp.float32)
  kv_len = jnp.array([_PS, _PS - 6], jnp.int32)
  w = core.get_weighting("ssmax")

  def pallas(q, k, v, sinks, s):
    return pallas_lib.pallas_attention(
        q, k, v, weighting=w, scale=1 / math.sqrt(H), is_causal=True, kv_lengths=kv_len,
        block_q=16, block_k=16 if backend == "gpu" else 128, backend=backend, interpret=True,
        ssmax_s=s, sinks=sinks)

  def xla(q, k, v, sinks, s):
    return blocked_row_attention(q, k, v, weighting=w, scale=1 / math.sqrt(H), is_causal=True,
                                 mask=(jnp.arange(_PS)[None, :] < kv_len[:, None])[
                                     :, None, None, :],
                                 block_q=16, block_k=16, ssmax_s=s, sinks=sinks)

  args = (q, k, v, sinks, s_heads)
  loss = _SIN_LOSS
  np.testing.assert_allclose(pallas(*args), xla(*args), atol=3e-6)
  grads = jax.grad(loss(pallas), argnums=(0, 1, 2, 3, 4))(*args)
  want = jax.grad(loss(xla), argnums=(0, 1, 2, 3, 4))(*args)
  for name, g, wg in zip(("dq", "dk", "dv", "dsinks", "ds"), grads, want, strict=True):
    wg = np.asarray(wg)
    err = np.abs(np.asarray(g) - wg).max() / max(np.abs(wg).max(), 1e-6)
    assert err < 3e-5, f"{name}: relative error {err:.2e}"


def test_pallas_whole_row_sinks_refused_for_stick_breaking_and_run_through_attention():
  """Stick-breaking takes no sink (refused with the reason, core.attention and the kernel
  entry point); core.attention(implementation=Pallas) runs sinks with a whole-row F (softpick,
  jit, Triton interpreted) as the dense implementation does."""
  q, k, v = _qkv(24, t=_PT, s=_PS)
  w = core.get_weighting("stick_breaking")
  with pytest.raises(ValueError, match="takes no attention sinks"):
    pallas_lib.pallas_attention(q, k, v, weighting=w, scale=1.0, interpret=True,
                                sinks=jnp.zeros(N))
  with pytest.raises(ValueError, match="sink"):
    core.attention(q, k, v, weighting="stick_breaking", sinks=jnp.zeros(N),
                   implementation=PALLAS)
  sinks = jnp.linspace(-1.0, 1.0, N)
  run = lambda impl: core.attention(q, k, v, weighting="softpick", sinks=sinks,
                                    implementation=impl)
  np.testing.assert_allclose(jax.jit(lambda: run(PALLAS))(), run("dense"), atol=2e-5)


# (family, causal, cap): ALiBi (causal or symmetric) in each family once per lowering.
_ROW_ALIBI_CASES = [("ssmax", True, 1.5), ("softpick", False, None),
                    ("stick_breaking", True, 1.5), ("sparsemax", False, 1.5),
                    ("entmax15", True, None)]


@pytest.mark.parametrize(("weighting", "causal", "cap"), _ROW_ALIBI_CASES,
                         ids=[c[0] for c in _ROW_ALIBI_CASES])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.split_by_jax
def test_pallas_whole_row_alibi_equals_float64_dense(backend, weighting, causal, cap):
  """ALiBi in the whole-row kernels (Triton and Mosaic, interpreted), with a cap in three
  families: GQA (each query head its own slope, G = 2), T and S not multiples of the tiles,
  causal or symmetric, key lengths (and query lengths when causal): values and the gradients
  of q, k, v and the slopes (from the dQ kernels' per-row sums) equal float64 dense."""
  q, k, v = _qkv(25, t=_PT, s=_PS)
  q = 2.0 * q
  slopes = core.alibi_slopes(N) * jnp.array([1.0, 3.0, 0.5, 2.0])
  pallas, dense = _pallas_alibi(
      backend, weighting, causal, cap=cap,
      q_lengths=jnp.array([_PT - 3, _PT], jnp.int32) if causal else None,
      kv_lengths=jnp.array([_PS, _PS - 6], jnp.int32))
  _against_float64(pallas, dense, (q, k, v, slopes), atol=3e-6, grad_tol=3e-5)


# ---- Relative-position tables in the Mosaic kernels (interpreted) ---------------------------
# T ≠ S, neither a multiple of the TPU tiles (16 queries | 128 keys): 2 query × 2 key tiles, so
# that each tile reads its own window of the table and adds its own diagonal sums.
_MT, _MS = 20, 150


def _pallas_relative(weighting, causal, *, cap=None, sinks=None, q_lengths=None,
                     kv_lengths=None, backend="tpu"):
  """fn(q, k, v, table) of the ``backend`` Pallas kernels (interpreted; 16 queries × 128 keys
  on the TPU's, 16 × 16 on the GPU's) and of the dense implementation, with a
  relative-position table, an optional cap, sinks and lengths."""
  w = core.get_weighting(weighting)
  block_k = 128 if backend == "tpu" else 16

  def pallas(q, k, v, table):
    mod = core.score_mods.make(cap, core.relative_table(table))
    return pallas_lib.pallas_attention(
        q, k, v, weighting=w, scale=1 / math.sqrt(H), is_causal=causal, q_lengths=q_lengths,
        kv_lengths=kv_lengths, block_q=16, block_k=block_k, backend=backend, interpret=True,
        score_mod=mod, sinks=sinks)

  def dense(q, k, v, table):
    return core.attention(
        q, k, v, weighting=weighting, is_causal=causal, logits_soft_cap=cap,
        score_mod=core.relative_table(table),
        sinks=None if sinks is None else jnp.asarray(sinks, q.dtype),
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, implementation="dense")

  return pallas, dense


def _mosaic_relative_case(seed, weighting, causal, length, **kw):
  """(pallas, dense, args) of :func:`_pallas_relative` (the TPU kernels) on (q, k, v, table):
  ``length`` the table's L ("full": 2·max(T, S) − 1, every distance its own entry; else
  clipped)."""
  q, k, v = _qkv(seed, t=_MT, s=_MS)
  el = 2 * max(_MT, _MS) - 1 if length == "full" else length
  table = jax.random.normal(jax.random.key(seed + 1), (N, el), jnp.float32)
  return (*_pallas_relative(weighting, causal, **kw), (2.0 * q, k, v, table))


# (F, causal, table length, cap, sinks): a pointwise F with the online max and one with a sum.
_MOSAIC_REL_POINTWISE = [("softmax", True, "full", 2.0, False), ("sigmoid", False, 9, None, True)]


@pytest.mark.split_by_jax
@pytest.mark.parametrize(("weighting", "causal", "length", "cap", "sinks"), [
    pytest.param(*c, id=c[0], marks=[pytest.mark.exhaustive] if c[0] == "sigmoid" else [])
    for c in _MOSAIC_REL_POINTWISE])  # sigmoid's "sum": -m exhaustive (CI time)
def test_pallas_mosaic_relative_table_equals_float64_dense(weighting, causal, length, cap,
                                                           sinks):
  """A relative table in the Mosaic pointwise kernels (interpreted): GQA (each query head its
  own row), T ≠ S over 2 × 2 tiles, key lengths (and query lengths when causal), a full or a
  clipped table, a cap (softmax) or sinks (sigmoid): values and the gradients of q, k, v and
  the table (the dQ kernel's diagonal sums of dS, folded back to the table) equal float64
  dense."""
  pallas, dense, args = _mosaic_relative_case(
      41, weighting, causal, length, cap=cap,
      sinks=np.array([0.5, -1.0, 1.5, 0.0], np.float32) if sinks else None,
      q_lengths=jnp.array([_MT - 3, _MT], jnp.int32) if causal else None,
      kv_lengths=jnp.array([_MS, _MS - 30], jnp.int32))
  _, want_g = _matches_float64(pallas, dense, args, ("dq", "dk", "dv", "dtable"), 1e-5, 3e-5,
                               loss=_SIN_LOSS)
  assert np.all(np.abs(np.asarray(want_g[3])) > 0) or causal  # every entry is read


# (F, causal, table length, cap): whole-row families, each reading the table in its passes.
_MOSAIC_REL_ROWS = [("entmax15", True, "full", None), ("ssmax", False, 9, 1.5),
                    ("softpick", True, 15, None)]


@pytest.mark.split_by_jax
@pytest.mark.parametrize(("weighting", "causal", "length", "cap"), [
    pytest.param(*c, id=c[0], marks=[pytest.mark.exhaustive] if c[0] == "softpick" else [])
    for c in _MOSAIC_REL_ROWS])  # softpick: -m exhaustive (CI time)
def test_pallas_mosaic_whole_row_relative_table_equals_float64_dense(weighting, causal, length,
                                                                     cap):
  """A relative table in the Mosaic whole-row kernels (interpreted; entmax's threshold passes,
  SSMax's and softpick's sums, the dQ kernel's d ext over its key-tile loop): as the
  pointwise test, values and the gradients of q, k, v and the table equal float64 dense."""
  pallas, dense, args = _mosaic_relative_case(
      42, weighting, causal, length, cap=cap,
      q_lengths=jnp.array([_MT - 3, _MT], jnp.int32) if causal else None,
      kv_lengths=jnp.array([_MS - 30, _MS], jnp.int32))
  _matches_float64(pallas, dense, args, ("dq", "dk", "dv", "dtable"), 1e-5, 3e-5,
                   loss=_SIN_LOSS)


def test_pallas_mosaic_relative_table_bfloat16():
  """bf16 inputs under jit (causal softmax, GQA, a full table, key lengths): the float64
  dense result of the same rounded inputs, to bf16's precision, the table's gradient
  included."""
  q, k, v = _qkv(43, t=_MT, s=_MS, dtype=jnp.bfloat16)
  table = jax.random.normal(jax.random.key(44), (N, 2 * _MS - 1), jnp.float32)
  pallas, dense = _pallas_relative("softmax", True,
                                   kv_lengths=jnp.array([_MS - 30, _MS], jnp.int32))
  _matches_float64(jax.jit(pallas), dense, (q, k, v, table), ("dq", "dk", "dv", "dtable"),
                   2e-2, 3e-2)


def test_mosaic_relative_windows_fit_and_keep_rotates_within_a_vreg():
  """What the interpreter cannot check (Mosaic on a chip): every tile's window of the
  reversed table starts at a multiple of 128 inside it, and both strided rotates' amounts
  (the bias: W − e; d ext: e − bq + 1) are 0 and 1 mod 8, so each 8-row vreg's lane rotate
  stays within 128 lanes (Mosaic's strided rotate blends one neighbouring vreg only)."""
  from attnx.core.kernels.pallas import mosaic
  from attnx.core.kernels.pallas.common import KernelConfig

  w = core.get_weighting("softmax")
  for tp, sp, off, bq, bk in [(32, 256, 299, 16, 128), (2048, 2048, 2047, 256, 512),
                              (1008, 3072, 2999, 48, 256), (16, 128, 4, 16, 128)]:
    cfg = KernelConfig(
        w=w, backend="tpu", interpret=True, s=sp, tp=tp, sp=sp, g=1, scale=1.0,
        is_causal=False, q_bound=False, kv_bound=False, bq=bq, bk=bk, bq_dq=bq, bk_dq=bk,
        bq_dkv=bq, bk_dkv=bk, relative=True, rel_offset=off)
    m, lr = mosaic.rel_layout(cfg)
    width = mosaic.rel_width(bq, bk)
    for i in range(tp // bq):
      for j in range(sp // bk):
        start, e = (int(x) for x in mosaic.rel_window(cfg, i * bq, j * bk, bq))
        assert start % 128 == 0 and 0 <= start and start + width <= lr
        assert bq <= e <= bq + 127 and e + bk <= width
        assert (width - e) % 8 == 0 and (e - bq + 1) % 8 == 1
        # the window's lane u = c − r + e holds ext[i·bq + r − (j·bk + c) + off]
        assert m - start - e == i * bq - j * bk + off


# --------------------------------------------------------------------------------------------
# A relative-position table in the Pallas kernels (the GPU's Triton lowering, interpreted):
# the wrapper's extended table (common.relative_ext) read per tile, d ext from the dQ kernels.
# --------------------------------------------------------------------------------------------

# L = 7 clips (distances up to ±26 read the ends, whose gradient sums the pad columns'); 53 =
# 2·max(T, S) − 1 covers every pair (no pad).
_CLIPPED, _FULL = 7, 2 * max(_PT, _PS) - 1


def _table(seed, length):
  return 0.7 * jax.random.normal(jax.random.key(seed), (N, length), jnp.float32)


# (F, causal, table length, cap, sinks): pointwise F (online max, "sum", "none") and every
# whole-row family, each table length, cap and sinks in some.
# (ReLU's "sum" repeats sigmoid's, sparsemax entmax's threshold passes: -m exhaustive.)
_REL_CASES = [("softmax", True, _CLIPPED, 2.0, False), ("sigmoid", False, _FULL, None, True),
              ("relu", True, _FULL, 2.0, False), ("ssmax", False, _CLIPPED, None, True),
              ("softpick", True, _FULL, 2.0, False),
              ("stick_breaking", False, _CLIPPED, 2.0, False),
              ("entmax15", True, _CLIPPED, None, True), ("sparsemax", False, _FULL, 2.0, False),
              ("softmax:alpha=2", False, _CLIPPED, None, False)]


@pytest.mark.parametrize(("weighting", "causal", "length", "cap", "sinks"), [
    pytest.param(*c, id=f"{c[0]}-L{c[2]}",
                 marks=[pytest.mark.exhaustive] if c[0] in ("relu", "sparsemax") else [])
    for c in _REL_CASES])
@pytest.mark.split_by_jax
def test_pallas_relative_table_equals_float64_dense(weighting, causal, length, cap, sinks):
  """A relative table in the Triton kernels (interpreted), pointwise and whole-row F: GQA
  (G = 2), T ≠ S, neither a multiple of the 16×16 tiles, key lengths (and query lengths when
  causal), a clipped table or one covering every distance, a cap and sinks in some: values
  and the gradients of q, k, v and the table (d ext from the dQ kernels' atomic adds, folded
  back) equal the float64 dense implementation's, and every head's table gets a gradient."""
  q, k, v = _qkv(31, t=_PT, s=_PS)
  q = 2.0 * q  # scores the cap bends
  pallas, dense = _pallas_relative(
      weighting, causal, cap=cap,
      sinks=np.array([0.5, -1.0, 1.5, 0.0], np.float32) if sinks else None,
      q_lengths=jnp.array([_PT - 3, _PT], jnp.int32) if causal else None,
      kv_lengths=jnp.array([_PS, _PS - 6], jnp.int32), backend="gpu")
  _, want_g = _matches_float64(pallas, dense, (q, k, v, _table(length, length)),
                               ("dq", "dk", "dv", "dtable"), 3e-6, 3e-5)
  assert np.all(np.abs(np.asarray(want_g[3])).max(axis=1) > 0)


def test_pallas_relative_table_bfloat16():
  """bf16 inputs (Triton, causal softmax with a cap, a clipped table): the float64 dense
  result of the same rounded inputs, to bf16's precision."""
  q, k, v = _qkv(32, t=_PT, s=_PS, dtype=jnp.bfloat16)
  pallas, dense = _pallas_relative("softmax", True, cap=3.0, backend="gpu")
  _matches_float64(pallas, dense, (q, k, v, _table(3, _CLIPPED).astype(jnp.bfloat16)),
                   ("dq", "dk", "dv", "dtable"), 2e-2, 3e-2)


def test_pallas_relative_table_through_attention_learns_under_jit():
  """implementation=core.Pallas runs core.relative_table under jit with a learned table
  (its gradient equals the blocked kernel's), a cap and sinks."""
  q, k, v = _qkv(33, t=_PT, s=_PS)
  sinks = jnp.array([0.2, -0.3, 1.0, 0.0])

  def run(impl):
    @jax.jit
    def loss(table):
      out = core.attention(q, k, v, weighting="softmax", logits_soft_cap=5.0,
                           score_mod=core.relative_table(table), sinks=sinks,
                           implementation=impl)
      return jnp.sum(out ** 2)
    return jax.value_and_grad(loss)(_table(4, 11))

  (val, g), (want, want_g) = run(PALLAS), run(IMPLS[1])
  np.testing.assert_allclose(val, want, rtol=1e-5)
  np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-5)
