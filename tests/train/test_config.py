"""Config keys shared by every experiment: distributed init, data_dir, re-launch overrides."""

from __future__ import annotations

import os

import ml_collections
import pytest

from attnx import train
from attnx.train import config as tc


def test_distributed_keys_reach_jax_distributed_initialize():
  c = train.base_config()
  assert tc.distributed_kwargs(c) == {"coordinator_address": None, "num_processes": None,
                                      "process_id": None}  # all auto-detected
  c.update(distributed=True, coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)
  train.validate(c)
  assert tc.distributed_kwargs(c) == {"coordinator_address": "10.0.0.1:1234",
                                      "num_processes": 4, "process_id": 3}
  c.process_id = 4
  with pytest.raises(ValueError, match=r"config\.num_processes=4 .*process_id=4"):
    train.validate(c)
  c.update(distributed=False, process_id=0)
  with pytest.raises(ValueError, match=r"only used with config\.distributed=True"):
    train.validate(c)


def test_data_dir_becomes_the_catalog_data_dir(tmp_path, monkeypatch):
  import attnx.data

  monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
  c = train.base_config()
  tc.apply_data_dir(c)  # "" leaves the default alone
  assert attnx.data.catalog_data_dir() == os.path.expanduser("~/tensorflow_datasets")
  c.data_dir = str(tmp_path)
  train.validate(c)
  tc.apply_data_dir(c)
  assert attnx.data.catalog_data_dir() == str(tmp_path)
  expected = f"dir '{tmp_path}'.*--config.data_dir="
  with pytest.raises(attnx.data.DatasetNotFoundError, match=expected):
    attnx.data.load_arrays("mnist", "test")  # no data_dir= argument: the config's is used
  c.data_dir = str(tmp_path / "missing")
  with pytest.raises(ValueError, match=r"config\.data_dir=.*missing' is not a directory"):
    train.validate(c)


def test_config_overrides_list_every_changed_leaf():
  ref = train.base_config()
  ref.optimizer = train.optimizer_config()
  ref.names = ("a", "b")
  c = ml_collections.ConfigDict(ref.to_dict())
  c.update(num_seeds=3, parallel="pmap", progress=False, names=("a",))
  c.optimizer.learning_rate = 0.02
  flags = tc.config_overrides(c, ref, exclude=("parallel",))
  assert sorted(flags) == ["--config.names=('a',)", "--config.num_seeds=3",
                           "--config.optimizer.learning_rate=0.02", "--config.progress=False"]


@pytest.mark.parametrize("key, value, pattern", [
    ("num_steps", 0, r"config\.num_steps must be >= 1, got 0"),
    ("train.num_steps", -3, r"config\.train\.num_steps must be >= 1, got -3"),  # nested too
    ("train.batch_size", 0, r"config\.train\.batch_size must be >= 1"),
    ("checkpoint_every", -1, r"config\.checkpoint_every must be >= 0 \(0 turns it off\)"),
    ("log_every", -10, r"config\.log_every must be >= 0"),
    ("train.eval_every", -1, r"config\.train\.eval_every must be >= 0"),
    ("keep_checkpoints", 0, r"config\.keep_checkpoints must be >= 1"),
])
def test_validate_rejects_counts_fit_cannot_use(key, value, pattern):
  c = train.base_config()
  c.update(keep_checkpoints=2, train=ml_collections.ConfigDict(
      dict(num_steps=5, batch_size=4, eval_every=0)))
  train.validate(c)  # valid as built: 0 turns checkpoints and evaluation off
  node = c
  *parents, leaf = key.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ValueError, match=pattern):
    train.validate(c)


def test_check_batch_size_names_key_size_and_dataset():
  c = ml_collections.ConfigDict(dict(train=dict(batch_size=64)))
  train.check_batch_size(c, "train.batch_size", 64, "'digits'")  # a batch may take them all
  with pytest.raises(ValueError, match=r"config\.train\.batch_size=64 is larger than the 63 "
                                       r"training examples of 'digits'; use at most 63"):
    train.check_batch_size(c, "train.batch_size", 63, "'digits'")
