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
