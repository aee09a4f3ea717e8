"""experiments/train_benchmark.py: the device part gets every overridden value; losses compared."""

from __future__ import annotations

import pytest

from experiments import train_benchmark as tb


def test_device_part_is_launched_with_every_overridden_value(tmp_path):
  c = tb.get_config("tiny")
  c.update(num_steps=7, batch_size=8, seed=3, num_seeds=5)
  c.optimizer.learning_rate = 0.02
  c.model.hidden_dim = 8
  cmd = tb.devices_command(c, str(tmp_path))
  flags = [a for a in cmd if a.startswith("--config.")]
  assert flags[:3] == ["--config.part=devices", "--config.num_cpu_devices=2",
                       "--config.devices=2"]
  assert sorted(flags[3:]) == ["--config.batch_size=8", "--config.model.hidden_dim=8",
                               "--config.num_seeds=5", "--config.num_steps=7",
                               "--config.optimizer.learning_rate=0.02", "--config.seed=3"]
  assert cmd[-1] == f"--workdir={tmp_path}"


def test_loss_spread_is_computed_over_all_runs():
  devices = {"1_device": {"none": {"final_train_loss": 0.5}, "shard_map": {"final_train_loss":
             0.5}, "pmap": {"final_train_loss": 0.5}},
             "8_devices": {"none": {"final_train_loss": 0.5}, "shard_map": {"final_train_loss":
                           0.5001}, "pmap": {"final_train_loss": 0.4999}}}
  spread, n = tb.loss_spread(devices)
  assert n == 6 and spread == pytest.approx(2e-4)
