"""Evaluators by name (attnx/train/evaluators.py) against direct computations."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx.train import evaluators


class _Constant(nn.Module):
  """Predicts the same value everywhere: its ICL error has a closed form."""

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    c = self.param("c", nn.initializers.constant(0.5), (1,))
    return jnp.broadcast_to(c, x.shape[:-1] + (1,))


def test_icl_error_matches_numpy():
  rng = np.random.default_rng(0)
  arrays = {"inputs": rng.normal(size=(7, 8, 4)).astype(np.float32),
            "targets": rng.normal(size=(7, 4)).astype(np.float32)}
  model = _Constant()
  params = jax.tree.map(lambda x: jnp.stack([x, x + 1.0]),
                        model.init(jax.random.PRNGKey(0), arrays["inputs"])["params"])
  out = evaluators.make_eval_fn(("icl_error",), model, arrays)(params)
  dim = 3
  for s, c in enumerate((0.5, 1.5)):
    curve = ((c - arrays["targets"]) ** 2).mean(0) / dim
    np.testing.assert_allclose(out["icl_curve"][s], curve, rtol=1e-5)
    np.testing.assert_allclose(out["mse_last"][s], curve[-1], rtol=1e-5)
    np.testing.assert_allclose(out["mse"][s], curve.mean(), rtol=1e-5)


def test_accuracy_and_loss_are_dataset_means():
  class Logits(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
      return nn.Dense(3)(x)

  rng = np.random.default_rng(1)
  arrays = {"inputs": rng.normal(size=(1203, 5)).astype(np.float32),
            "targets": rng.integers(0, 3, 1203).astype(np.int32)}
  model = Logits()
  p = model.init(jax.random.PRNGKey(0), arrays["inputs"])["params"]
  out = evaluators.make_eval_fn(("accuracy", "loss"), model, arrays)(
      jax.tree.map(lambda x: x[None], p))
  logits = np.asarray(model.apply({"params": p}, arrays["inputs"]))
  acc = (logits.argmax(-1) == arrays["targets"]).mean()
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  loss = -logp[np.arange(1203), arrays["targets"]].mean()
  np.testing.assert_allclose(out["accuracy"], [acc], rtol=1e-6)
  np.testing.assert_allclose(out["loss"], [loss], rtol=1e-5)


def test_registry():
  assert {"accuracy", "loss", "mse", "icl_error"} <= set(evaluators.list_evaluators())
  with pytest.raises(ValueError, match="unknown evaluator"):
    evaluators.check_evaluators(("nope",))
  with pytest.raises(ValueError, match="already registered"):
    evaluators.register_evaluator("accuracy", lambda *a: None)
  assert {"noisy_accuracy", "greedy_decode", "alignment"} <= set(evaluators.list_evaluators())
  assert {"accuracy_by_level", "weight_tv_by_level"} <= set(evaluators.list_evaluators())


def _stack(*trees):
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


class _Task:
  def __init__(self, **eval_options):
    self.eval_options = eval_options


def test_noisy_accuracy_matches_direct_computation():
  class Logits(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
      return nn.Dense(4)(x)

  rng = np.random.default_rng(2)
  arrays = {"inputs": rng.normal(size=(613, 6)).astype(np.float32),
            "targets": rng.integers(0, 4, 613).astype(np.int32)}
  model = Logits()
  ps = [model.init(jax.random.PRNGKey(k), arrays["inputs"])["params"] for k in (0, 1)]
  levels = (0.0, 0.5, 2.0)
  out = evaluators.make_eval_fn(("noisy_accuracy",), model, arrays,
                                _Task(noise_levels=levels, noise_seed=7))(_stack(*ps))
  assert out["noisy_accuracy"].shape == (2, 3)
  noise = np.random.default_rng(7).standard_normal((613, 6)).astype(np.float32)
  for s, p in enumerate(ps):
    for i, sigma in enumerate(levels):
      noisy = arrays["inputs"] + np.float32(sigma) * noise
      logits = np.asarray(model.apply({"params": p}, noisy))
      np.testing.assert_allclose(out["noisy_accuracy"][s, i],
                                 (logits.argmax(-1) == arrays["targets"]).mean(), atol=1e-7)
  # σ = 0 is the clean accuracy.
  clean = evaluators.make_eval_fn(("accuracy",), model, arrays)(_stack(*ps))["accuracy"]
  np.testing.assert_allclose(out["noisy_accuracy"][:, 0], clean, atol=1e-7)


def _rnn(attention_type="bahdanau"):
  from attnx import nn as an

  return an.RNNSeq2Seq(src_vocab_size=9, tgt_vocab_size=11, embed_dim=8, hidden_dim=8,
                       cell="gru", attention_type=attention_type)


def test_greedy_decode_matches_step_by_step_decoding():
  rng = np.random.default_rng(3)
  n, t = 12, 6
  src = rng.integers(3, 9, (n, t)).astype(np.int32)
  model = _rnn()
  ps = [model.init(jax.random.PRNGKey(k), src, src)["params"] for k in (0, 1)]

  def decode_loop(p):  # plain Python, one model call per step on the BOS-prefixed prefix
    prefix = np.zeros_like(src)
    prefix[:, 0] = 1
    out = np.zeros_like(src)
    for i in range(t):
      out[:, i] = np.asarray(model.apply({"params": p}, src, prefix))[:, i].argmax(-1)
      if i + 1 < t:
        prefix[:, i + 1] = out[:, i]
    return out

  def words(ids):  # up to EOS (2), without PAD (0) / BOS (1)
    ids = list(ids)
    ids = ids[:ids.index(2)] if 2 in ids else ids
    return [i for i in ids if i not in (0, 1)]

  hyps = [decode_loop(p) for p in ps]
  # Targets: seed 0's output on even rows, something else on odd rows.
  targets = hyps[0].copy()
  targets[1::2] = rng.integers(3, 11, (n // 2, t))
  targets[1::2, -1] = 2
  out = evaluators.make_eval_fn(("greedy_decode",), model, {"inputs": src, "targets": targets},
                                _Task(bos_id=1, eos_id=2))(_stack(*ps))
  refs = [words(r) for r in targets]
  for s in range(2):
    h = [words(r) for r in hyps[s]]
    np.testing.assert_allclose(out["sequence_accuracy"][s],
                               np.mean([a == b for a, b in zip(h, refs, strict=True)]))
    np.testing.assert_allclose(out["bleu"][s], evaluators.corpus_bleu(h, refs))
  assert out["sequence_accuracy"][0] >= 0.5


def test_alignment_matches_direct_computation():
  rng = np.random.default_rng(4)
  n, t = 10, 5
  src = rng.integers(3, 9, (n, t)).astype(np.int32)
  tgt_in = rng.integers(3, 11, (n, t)).astype(np.int32)
  gold = rng.integers(0, t, (n, t))
  gold[:, -2:] = -1  # no gold word (padding)
  model = _rnn("luong_general")
  ps = [model.init(jax.random.PRNGKey(k), src, tgt_in)["params"] for k in (0, 1)]
  out = evaluators.make_eval_fn(("alignment",), model, {"inputs": src, "decoder_inputs": tgt_in,
                                                        "alignment": gold})(_stack(*ps))
  for s, p in enumerate(ps):
    a = np.asarray(model.apply({"params": p}, src, tgt_in, return_alignment=True)[1])
    hits, mass, count = 0, 0.0, 0
    for b in range(n):
      for i in range(t):
        if gold[b, i] >= 0:
          count += 1
          hits += int(a[b, i].argmax() == gold[b, i])
          mass += a[b, i, gold[b, i]]
    np.testing.assert_allclose(out["alignment_accuracy"][s], hits / count, rtol=1e-6)
    np.testing.assert_allclose(out["gold_mass"][s], mass / count, rtol=1e-5)
  # The weights themselves, per seed, for heat maps.
  weights = evaluators.alignment_weights(model, _stack(*ps), src, tgt_in)
  assert weights.shape == (2, n, t, t)
  np.testing.assert_allclose(weights[1], model.apply({"params": ps[1]}, src, tgt_in,
                                                     return_alignment=True)[1], rtol=1e-5)


class _Averaging(nn.Module):
  """Token classifier y_i = Dense(Σ_j w_ij x_j), w = softmax(β x xᵀ): has attention_weights."""

  def setup(self):
    self.beta = self.param("beta", nn.initializers.constant(0.3), ())
    self.out = nn.Dense(3)

  def attention_weights(self, x):
    return jax.nn.softmax(self.beta * jnp.einsum("bid,bjd->bij", x, x), axis=-1)

  def __call__(self, x, deterministic: bool = True):
    return self.out(jnp.einsum("bij,bjd->bid", self.attention_weights(x), x))


def _by_level_case():
  rng = np.random.default_rng(5)
  n, length, d = 9, 5, 4
  base = rng.normal(size=(n, length, d)).astype(np.float32)
  g = rng.normal(size=(n, 1, d)).astype(np.float32)
  levels = [1.0, 0.0, 2.5]  # the reference (lowest) level is not the first
  x = np.stack([base + np.float32(s) * g for s in levels])
  targets = rng.integers(0, 3, (n, length)).astype(np.int32)
  targets[0, :2] = -100  # IGNORE_INDEX: not counted
  model = _Averaging()
  ps = [model.init(jax.random.PRNGKey(k), base)["params"] for k in (0, 1)]
  ps[1] = {**ps[1], "beta": jnp.asarray(-0.7)}
  return model, ps, levels, {"inputs_by_level": x, "targets": targets}


def test_accuracy_by_level_matches_direct_computation():
  model, ps, levels, arrays = _by_level_case()
  out = evaluators.make_eval_fn(("accuracy_by_level",), model, arrays,
                                _Task(levels=levels))(_stack(*ps))
  assert out["accuracy_by_level"].shape == (2, 3)
  t = arrays["targets"]
  for s, p in enumerate(ps):
    for i in range(len(levels)):
      pred = np.asarray(model.apply({"params": p}, arrays["inputs_by_level"][i])).argmax(-1)
      hits = [pred[b, j] == t[b, j] for b in range(t.shape[0]) for j in range(t.shape[1])
              if t[b, j] != -100]
      np.testing.assert_allclose(out["accuracy_by_level"][s, i], np.mean(hits), atol=1e-12)


def test_weight_tv_by_level_matches_direct_computation():
  model, ps, levels, arrays = _by_level_case()
  out = evaluators.make_eval_fn(("weight_tv_by_level",), model, arrays,
                                _Task(levels=levels, weight_examples=4))(_stack(*ps))
  tv = out["weight_tv_by_level"]
  assert tv.shape == (2, 3)
  x = arrays["inputs_by_level"][:, :4].astype(np.float64)
  for s, p in enumerate(ps):
    beta = float(p["beta"])

    def weights(v, beta=beta):
      z = beta * np.einsum("bid,bjd->bij", v, v)
      e = np.exp(z - z.max(-1, keepdims=True))
      return e / e.sum(-1, keepdims=True)

    ref = weights(x[1])  # level 0.0, the lowest
    for i in range(3):
      expected = np.mean([0.5 * np.abs(weights(x[i])[b, r] - ref[b, r]).sum()
                          for b in range(4) for r in range(x.shape[2])])
      np.testing.assert_allclose(tv[s, i], expected, atol=1e-5)
  assert np.all(tv[:, 1] == 0.0)
  # An explicit reference level; a level count that does not match is an error.
  other = evaluators.make_eval_fn(("weight_tv_by_level",), model, arrays,
                                  _Task(levels=levels, reference_level=2.5))(_stack(*ps))
  assert np.all(other["weight_tv_by_level"][:, 2] == 0.0)
  with pytest.raises(ValueError, match="levels"):
    evaluators.make_eval_fn(("weight_tv_by_level",), model, arrays, _Task(levels=[0.0]))


def test_unknown_attention_stats_says_where_it_is_registered(monkeypatch):
  """attnx.analysis (above attnx.train) registers "attention_stats"; without it the error
  says so, and other unknown names get no such hint."""
  monkeypatch.delitem(evaluators._EVALUATORS, "attention_stats", raising=False)
  hint = r"unknown evaluator.*registered by `import attnx\.analysis`"
  with pytest.raises(ValueError, match=hint):
    evaluators.check_evaluators(("accuracy", "attention_stats"))
  with pytest.raises(ValueError) as info:
    evaluators.check_evaluators(("nope",))
  assert "attnx.analysis" not in str(info.value)
