"""FitConfig: fit's settings as one validated, frozen object built from experiment configs."""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np
import optax
import pytest

from attnx import train


def _experiment_config() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.update(num_steps=40, eval_every=20, keep_checkpoints=2, batch_size=32, weightings="softmax",
           optimizer=train.optimizer_config(learning_rate=0.01))
  return c


def test_from_config_reads_the_standard_keys_and_overrides_win():
  c = _experiment_config()
  c.update(seed=7, num_seeds=3, parallel="pmap", progress=False, checkpoint_every=10,
           log_every=5)
  fc = train.FitConfig.from_config(c)
  assert (fc.num_steps, fc.num_seeds, fc.seed, fc.eval_every, fc.log_every) == (40, 3, 7, 20, 5)
  assert (fc.checkpoint_every, fc.keep_checkpoints, fc.parallel) == (10, 2, "pmap")
  assert fc.progress is False and fc.optimizer.learning_rate == 0.01
  assert fc.loss == "softmax_xent" and fc.tensorboard is True  # not in the config: defaults
  # Overrides (e.g. from a nested config.train) win; the config is not changed.
  fc = train.FitConfig.from_config(c, num_steps=5, loss="mse", tensorboard=False)
  assert (fc.num_steps, fc.loss, fc.tensorboard, fc.num_seeds) == (5, "mse", False, 3)
  assert c.num_steps == 40
  # Without the keys: what the caller passes, else the defaults.
  fc = train.FitConfig.from_config(ml_collections.ConfigDict(), num_steps=3,
                                   optimizer=optax.sgd(0.1))
  assert (fc.num_seeds, fc.seed, fc.log_every, fc.parallel) == (1, 0, 10, "none")


def test_frozen_and_replaceable():
  fc = train.FitConfig(num_steps=10, optimizer=optax.sgd(0.1))
  with pytest.raises(dataclasses.FrozenInstanceError):
    fc.num_steps = 20  # type: ignore[misc]
  other = dataclasses.replace(fc, num_seeds=4)
  assert (other.num_seeds, fc.num_seeds) == (4, 1)
  # numpy integers (e.g. from array arithmetic) become plain ints.
  assert type(train.FitConfig(num_steps=np.int64(5), optimizer=optax.sgd(0.1)).num_steps) is int


@pytest.mark.parametrize("field, value, pattern", [
    ("num_steps", 0, r"FitConfig\.num_steps must be >= 1, got 0"),
    ("num_seeds", 0, r"FitConfig\.num_seeds must be >= 1, got 0"),
    ("seed", -1, r"FitConfig\.seed must be >= 0, got -1"),
    ("log_every", -1, r"FitConfig\.log_every must be >= 0 \(0: only at the end\), got -1"),
    ("eval_every", -5, r"FitConfig\.eval_every must be >= 0"),
    ("checkpoint_every", -1, r"FitConfig\.checkpoint_every must be >= 0"),
    ("keep_checkpoints", 0, r"FitConfig\.keep_checkpoints must be >= 1"),
    ("num_steps", 2.5, r"FitConfig\.num_steps must be an integer, got 2\.5"),
    ("num_seeds", True, r"FitConfig\.num_seeds must be an integer, got True"),
    ("progress", "yes", r"FitConfig\.progress must be True or False, got 'yes'"),
    ("parallel", "dp", r"FitConfig\.parallel='dp' is not one of none, shard_map, pmap"),
    ("loss", "hinge", r"FitConfig\.loss='hinge' is not one of softmax_xent, mse"),
    ("optimizer", "adam", r"FitConfig\.optimizer must be an optimizer_config\(\) ConfigDict"),
    ("optimizer", train.optimizer_config(name="lion"),
     r"FitConfig\.optimizer\.name='lion' is not one of"),
    ("optimizer", train.optimizer_config(learning_rate=0.0),
     r"FitConfig\.optimizer\.learning_rate must be > 0"),
])
def test_invalid_fields_fail_naming_the_field(field, value, pattern):
  ok = dict(num_steps=10, optimizer=train.optimizer_config())
  train.FitConfig(**ok)  # valid as built
  with pytest.raises(ValueError, match=pattern) as e:
    train.FitConfig(**{**ok, field: value})
  assert e.value.field == field
  # From an experiment config, the message also says where the value came from.
  c = ml_collections.ConfigDict({**_experiment_config().to_dict(), field: value})
  with pytest.raises(ValueError, match=pattern + r".* \(from config\." + field + r"\)$"):
    train.FitConfig.from_config(c)
  with pytest.raises(ValueError, match=r"\(from " + field + r"=\)$"):
    train.FitConfig.from_config(_experiment_config(), **{field: value})


def test_from_config_requires_steps_and_optimizer_and_rejects_unknown_fields():
  with pytest.raises(ValueError, match=r"FitConfig\.num_steps is required: set "
                                       r"config\.num_steps or pass num_steps="):
    train.FitConfig.from_config(train.base_config(), optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"FitConfig\.optimizer is required"):
    train.FitConfig.from_config(train.base_config(), num_steps=3)
  with pytest.raises(ValueError, match=r"unknown field\(s\) batch_size, lr; fields: num_steps"):
    train.FitConfig.from_config(_experiment_config(), lr=0.1, batch_size=3)


def test_fit_takes_only_a_fit_config():
  with pytest.raises(TypeError, match=r"config must be a FitConfig \(FitConfig\.from_config"):
    train.fit(None, train_data=None, config=_experiment_config())
  with pytest.raises(TypeError, match="num_steps"):  # the old keyword list is gone
    train.fit(None, train_data=None, config=None, num_steps=3)  # type: ignore[call-arg]
