"""attnx.train.benchmark.training: the causal LM with attnx's or flax's attention, and the
compiled training steps timed side by side."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from attnx import nn
from attnx.train.benchmark import training

LM = dict(width=32, num_heads=4, num_layers=2, vocab_size=64)


def test_causal_lm_models_compute_the_same_function():
  # Same parameters in both models (flax's attention and attnx's have the same layout): the
  # same loss, so the timed steps compare the same math.
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 0, LM["vocab_size"])
  flax_model, attnx_model = (training.causal_lm(a, **LM) for a in ("flax", "attnx"))
  params = flax_model.init(jax.random.PRNGKey(1), tokens)
  attnx_params = attnx_model.init(jax.random.PRNGKey(1), tokens)
  assert (jax.tree.map(lambda x: x.shape, params)
          == jax.tree.map(lambda x: x.shape, attnx_params))
  np.testing.assert_allclose(attnx_model.apply(params, tokens), flax_model.apply(params, tokens),
                             atol=1e-4, rtol=1e-4)
  with pytest.raises(ValueError, match="attention must be one of"):
    training.causal_lm("torch", **LM)


def test_steps_start_alike_and_are_timed():
  steps = {a: training.lm_step(training.causal_lm(a, **LM), batch_size=2, seq_len=16,
                               vocab_size=LM["vocab_size"], learning_rate=1e-3, seed=0)
           for a in training.ATTENTIONS}
  ms, losses = training.time_steps(steps, 2, lambda out: float(out[2]))
  assert set(ms) == set(losses) == {"flax", "attnx"} and min(ms.values()) > 0
  assert losses["flax"] == pytest.approx(losses["attnx"], abs=1e-4)
  with pytest.raises(ValueError, match="seq_len"):
    training.lm_step(None, batch_size=2, seq_len=0, vocab_size=4, learning_rate=1.0, seed=0)


def test_train_steps_of_two_models_from_the_same_parameters():
  kw = dict(vocab_size=16, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, max_len=8)
  tokens = np.random.default_rng(0).integers(0, 16, (2, 3, 9))
  steps = training.train_steps({"a": nn.GPT(**kw), "b": nn.GPT(**kw)}, tokens)
  losses = {name: np.asarray(fn(*args)[1]["loss"]) for name, (fn, args) in steps.items()}
  assert losses["a"].shape == (2,)
  np.testing.assert_allclose(losses["a"], losses["b"])
  with pytest.raises(ValueError, match="seeds, batch"):
    training.train_steps({"a": nn.GPT(**kw)}, tokens[0])


def test_timed_fit_trains_quietly_and_returns_its_wall_time():
  import flax.linen as flax_nn

  from attnx import train

  config = train.base_config()
  config.update(dict(num_steps=3, batch_size=4))
  config.optimizer = train.optimizer_config(name="adamw", learning_rate=1e-2)
  rng = np.random.default_rng(0)
  arrays = {"inputs": rng.normal(size=(16, 3)).astype(np.float32),
            "targets": rng.integers(0, 2, 16).astype(np.int32)}
  result, seconds = training.timed_fit(flax_nn.Dense(2), arrays, config, num_seeds=2)
  assert seconds > 0 and np.shape(result.final_metrics["train_loss"]) == (2,)
