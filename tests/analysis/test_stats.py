"""attnx.analysis.stats: the statistics against hand-made weights and closed forms (sink rate,
shares of zeros and small weights, entropy, maximum weight, per head and pooled per layer, with
causal and padding masks), the kurtosis, and the probe on real models — a GPT's weights equal
core.attention's dense weights recomputed by hand, whatever kernel the model trains with; a
ViT's (non-causal), a padded sequence model's and linear attention's — plus the
"attention_stats" evaluator over stacked seeds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import analysis, core, nn
from attnx.train import evaluators


def _stats(w, valid=None, **kw):
  return {k: np.asarray(v) for k, v in analysis.attention_statistics(w, valid, **kw).items()}


def test_uniform_causal_rows_have_entropy_log_n():
  t = 8
  valid = np.tril(np.ones((t, t), bool))
  w = valid / valid.sum(-1, keepdims=True)  # row i: 1/(i+1) on keys 0..i
  s = _stats(w[None, None], valid)
  n = np.arange(1, t + 1)
  np.testing.assert_allclose(s["entropy"], [np.log(n).mean()], rtol=1e-6)
  np.testing.assert_allclose(s["max_weight"], [(1 / n).mean()], rtol=1e-6)
  assert s["zero_share"] == 0 and s["small_share"] == 0
  # Mean weight on key 0 over the rows: H_8 / 8 = 0.340 -> a sink at 0.3, none at 0.35.
  assert s["sink_rate"] == 1 and _stats(w[None, None], valid, threshold=0.35)["sink_rate"] == 0
  # The 28 entries above the diagonal are zeros, but not valid ones.
  assert _stats(w[None, None])["zero_share"] == pytest.approx(28 / 64)
  # An unnormalized F (every weight doubled): the entropy of the row's distribution is the
  # same; the maximum weight is the raw one.
  d = _stats(2 * w[None, None], valid)
  np.testing.assert_allclose(d["entropy"], s["entropy"], rtol=1e-6)
  np.testing.assert_allclose(d["max_weight"], 2 * s["max_weight"], rtol=1e-6)


def _entropy(row):
  p = np.asarray(row, np.float64) / np.sum(row)
  return -sum(x * math.log(x) for x in p if x > 0)


def test_hand_made_heads_per_head_and_pooled():
  w = np.zeros((1, 2, 3, 3))
  # head 0: a sink (mean weight on key 0 over the 3 queries = (1 + .5 + .2) / 3 = .567 > .3)
  w[0, 0] = [[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]
  # head 1: none (mean .0005 / 3); two causal zeros and one weight below 1e-3; row 0 has no
  # mass (an all-zero row, e.g. ReLU): it has no entropy, and its maximum weight is 0.
  w[0, 1] = [[0, 0, 0], [0, 1, 0], [0.0005, 0.4995, 0.5]]
  valid = np.tril(np.ones((3, 3), bool))
  s = _stats(w, valid, threshold=0.3, small=1e-3)
  np.testing.assert_allclose(s["sink_rate"], [1, 0])
  np.testing.assert_allclose(s["zero_share"], [0, 2 / 6])
  np.testing.assert_allclose(s["small_share"], [0, 3 / 6])
  h0 = [0.0, math.log(2), _entropy([0.2, 0.3, 0.5])]
  h1 = [0.0, _entropy([0.0005, 0.4995, 0.5])]
  np.testing.assert_allclose(s["entropy"], [np.mean(h0), np.mean(h1)], rtol=1e-5)
  np.testing.assert_allclose(s["max_weight"], [(1 + 0.5 + 0.5) / 3, (0 + 1 + 0.5) / 3])
  # Pooled per layer (statistics()): every head's entries together; 12 causal entries.
  sums = analysis.stats._head_sums(w, valid, 0.3, 1e-3)
  layer = {k: float(n.sum() / d.sum()) for k, (n, d) in sums.items()}
  assert layer["zero_share"] == pytest.approx(2 / 12)
  assert layer["small_share"] == pytest.approx(3 / 12)
  assert layer["sink_rate"] == pytest.approx(0.5)
  assert layer["entropy"] == pytest.approx((sum(h0) + sum(h1)) / 5, rel=1e-5)


def test_padding_keys_are_not_counted():
  # Bidirectional rows uniform over 3 real keys of 4; the last key is padding (weight 0).
  w = np.zeros((2, 1, 4, 4))
  w[..., :3] = 1 / 3
  key_mask = np.array([True, True, True, False])[None, None, None, :]
  s = _stats(w, key_mask)
  assert s["zero_share"] == 0 and s["small_share"] == 0
  np.testing.assert_allclose(s["entropy"], [math.log(3)], rtol=1e-6)
  np.testing.assert_allclose(s["max_weight"], [1 / 3], rtol=1e-6)
  assert _stats(w)["zero_share"] == pytest.approx(0.25)  # counted without the mask


def test_kurtosis_closed_forms():
  rng = np.random.default_rng(0)
  gauss = rng.standard_normal((4, 200_000))
  np.testing.assert_allclose(analysis.kurtosis(gauss), 3.0, atol=0.06)
  assert np.allclose(analysis.kurtosis(np.tile([1.0, -1.0], 8)), 1.0, rtol=1e-6)
  # One massive entry a among D features: (D² − 3D + 3) / (D − 1), whatever a (43/7 at D = 8).
  for d, a in ((8, 2.0), (64, 1e3)):
    x = np.zeros(d)
    x[3] = a
    np.testing.assert_allclose(analysis.kurtosis(x), (d * d - 3 * d + 3) / (d - 1), rtol=1e-4)
  h = np.stack([np.tile([1.0, -1.0], 4), np.eye(8)[0] * 2])  # kurtosis 1 and 43/7
  s = analysis.hidden_statistics(h)
  np.testing.assert_allclose([s["max_kurtosis"], s["mean_kurtosis"]], [43 / 7, (1 + 43 / 7) / 2],
                             rtol=1e-5)


V, T = 11, 8
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, T), 0, V)


def _gpt(**kw):
  args = dict(vocab_size=V, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, max_len=T,
              positions="learned")
  return nn.GPT(**{**args, **kw})


def test_probe_weights_equal_dense_attention_recomputed_by_hand():
  model = _gpt(attention="relu")
  params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
  pr = analysis.probe(model, params, TOKENS)
  assert pr.attention_names == ("block_0/attention", "block_1/attention")
  assert pr.block_names == ("block_0", "block_1") and pr.heads == (2, 2)
  # Layer 0 by hand: embedding + positions, the block's LayerNorm, the q/k/v projections.
  x = params["embed"]["embedding"][TOKENS] + params["pos_embedding"][:T]
  p = params["block_0"]
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  h = (x - mu) / jnp.sqrt(var + 1e-6) * p["ln_attention"]["scale"] + p["ln_attention"]["bias"]
  proj = lambda n: jnp.einsum("btd,dnh->btnh", h, p["attention"][n]["kernel"]) + p[
      "attention"][n]["bias"]
  _, w = core.attention(proj("query"), proj("key"), proj("value"), weighting="relu",
                        is_causal=True, implementation="dense", return_weights=True)
  np.testing.assert_allclose(pr.weights[0], w, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.broadcast_to(pr.valid[0], w.shape),
                                np.broadcast_to(np.tril(np.ones((T, T), bool)), w.shape))
  # The block outputs: the last one, through the final LayerNorm and the tied embedding, gives
  # the model's logits.
  assert [np.shape(b) for b in pr.hidden] == [(2, T, 16)] * 2
  ln = params["ln_final"]
  z = pr.hidden[1]
  z = (z - z.mean(-1, keepdims=True)) / jnp.sqrt(z.var(-1, keepdims=True) + 1e-6)
  logits = (z * ln["scale"] + ln["bias"]) @ params["embed"]["embedding"].T
  np.testing.assert_allclose(logits, model.apply({"params": params}, TOKENS), atol=1e-4)


def test_probe_reads_the_dense_weights_of_a_model_on_another_kernel():
  model = _gpt(attention="softmax", implementation="blocked")
  params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
  assert analysis.dense_model(model).implementation is None
  w = np.asarray(jax.jit(lambda p: analysis.probe(model, p, TOKENS).weights[1])(params))
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
  assert np.all(w[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)  # causal
  assert w.shape == (2, 2, T, T) and np.all(w[..., 0, 0] == 1)


def test_probe_of_a_vit_is_bidirectional():
  model = nn.VisionTransformer(num_classes=3, patch_size=2, hidden_dim=8, num_layers=1,
                               num_heads=2, mlp_dim=16, attention="sigmoid")
  images = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 1))
  params = model.init(jax.random.PRNGKey(1), images)["params"]
  pr = analysis.probe(model, params, images)
  assert pr.attention_names == ("encoder/block_0/attention",)
  assert pr.weights[0].shape == (2, 2, 5, 5) and np.all(np.asarray(pr.valid[0]))  # CLS + 4
  np.testing.assert_allclose(np.sum(pr.weights[0], -1), 1.0, atol=1e-5)
  s = analysis.statistics(model, params, images)
  assert s["entropy_by_head"].shape == (1, 2) and s["max_kurtosis"].shape == (1,)
  assert np.all(np.asarray(s["entropy"]) <= math.log(5) + 1e-5)


def test_padding_keys_and_linear_attention_through_the_probe():
  model = nn.SequenceClassifier(vocab_size=7, num_classes=7, hidden_dim=8, num_layers=1,
                                num_heads=2, mlp_dim=16, max_len=6, pool="none", is_causal=True)
  x = jnp.array([[3, 0, 4, 5, 0, 6], [1, 2, 3, 4, 5, 6]])  # token 0 is padding
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  pr = analysis.probe(model, params, x)
  valid = np.broadcast_to(pr.valid[0], pr.weights[0].shape)
  np.testing.assert_array_equal(valid[0, 0, 5], [1, 0, 1, 1, 0, 1])  # causal and not padding
  np.testing.assert_array_equal(valid[1, 1, 2], [1, 1, 1, 0, 0, 0])
  assert np.all(np.asarray(pr.weights[0])[0, :, :, 1] == 0)  # softmax gives padding nothing
  assert float(analysis.statistics(model, params, x)["zero_share"][0]) == 0.0

  linear = model.clone(attention="linear_elu")
  params = linear.init(jax.random.PRNGKey(1), x)["params"]
  s = {k: np.asarray(v) for k, v in analysis.statistics(linear, params, x).items()}
  assert all(np.isnan(s[k]).all() and s[f"{k}_by_head"].shape == (1, 2)
             for k in analysis.HEAD_STATS)
  assert np.all(np.isfinite(s["max_kurtosis"])) and s["max_kurtosis"][0] >= 1


def test_attention_stats_evaluator_over_stacked_seeds():
  model = _gpt(attention="softmax", num_layers=1)
  seeds = [model.init(jax.random.PRNGKey(i), TOKENS)["params"] for i in (1, 2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *seeds)
  task = type("T", (), {"eval_options": {"stats_examples": 1, "sink_threshold": 0.5}})()
  out = evaluators.make_eval_fn(("attention_stats",), model, {"inputs": np.asarray(TOKENS)},
                                task)(stacked)
  assert out["sink_rate"].shape == (2, 1) and out["entropy_by_head"].shape == (2, 1, 2)
  assert out["max_kurtosis"].shape == (2, 1)
  one = analysis.statistics(model, seeds[1], TOKENS[:1], threshold=0.5)
  for k in ("sink_rate_by_head", "entropy_by_head", "max_weight", "mean_kurtosis"):
    np.testing.assert_allclose(out[k][1], one[k], rtol=1e-5)
