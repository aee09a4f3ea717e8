"""attnx.train.optim: optimizer_config validation and the warmup schedule."""

from __future__ import annotations

import pytest

from attnx import train


def test_optimizer_config_validation():
  for bad, key in ((dict(name="lion"), "name"), (dict(schedule="step"), "schedule"),
                   (dict(learning_rate=0.0), "learning_rate")):
    with pytest.raises(ValueError, match=f"optimizer.{key}"):
      train.make_optimizer(train.optimizer_config(**bad), 10)
  sched = train.make_schedule(train.optimizer_config(learning_rate=1.0, warmup_steps=10), 100)
  assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
  assert float(sched(100)) == pytest.approx(0.0, abs=1e-6)


def test_optimizer_config_rejects_unknown_keywords():
  # cfg.update() would add `lr` as a field no optimizer reads, keeping learning_rate=1e-3.
  with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) foo, lr; fields: .*"
                                      r"learning_rate"):
    train.optimizer_config(lr=0.1, foo=1)
  assert train.optimizer_config(learning_rate=0.1).learning_rate == 0.1


def test_minimize_follows_the_loss_and_returns_the_final_parameters():
  import jax.numpy as jnp
  import optax

  params, losses = train.minimize(lambda p: jnp.sum((p["x"] - 3.0) ** 2),
                                  {"x": jnp.zeros(2)}, optax.sgd(0.25), num_steps=5)
  # Each step halves the distance to 3: losses 18, 4.5, 1.125, ... (before each step).
  assert losses == pytest.approx([18.0 / 4 ** i for i in range(5)])
  assert params["x"] == pytest.approx([3.0 - 3.0 / 2 ** 5] * 2)
  assert train.minimize(lambda p: p ** 2, 1.0, optax.sgd(0.1), 0) == (1.0, [])
  with pytest.raises(ValueError, match="num_steps must be >= 0"):
    train.minimize(lambda p: p ** 2, 1.0, optax.sgd(0.1), -1)
