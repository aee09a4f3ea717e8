"""experiments/train_benchmark.py: the device part gets every overridden value; losses compared."""

from __future__ import annotations

import numpy as np
import pytest
from support import legs

from attnx.train import benchmark
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


def test_causal_lm_presets_and_validation():
  c = tb.get_config("causal_lm")
  assert c.part == "causal_lm" and c.lm.seq_lens == "256,1024,4096"
  assert (c.lm.width, c.lm.num_heads, c.lm.num_layers, c.lm.batch_size) == (256, 4, 2, 2)
  for key, value, match in (("seq_lens", "1,64", "seq_lens"), ("seq_lens", "x", "seq_lens"),
                            ("num_heads", 3, "divisible")):
    c = tb.get_config("causal_lm_tiny")
    c.lm[key] = value
    with pytest.raises(ValueError, match=match):
      tb.validate_config(c)


@legs.experiment_run
def test_causal_lm_tiny_end_to_end(tmp_path):
  out = tb.run(tb.get_config("causal_lm_tiny"), str(tmp_path))
  assert [r["T"] for r in out["rows"]] == [32, 64]
  for r in out["rows"]:
    assert r["flax step ms"] > 0 and r["attnx step ms"] > 0 and r["attnx / flax"] > 0
    assert abs(r["flax first loss"] - r["attnx first loss"]) < 1e-4
  assert (tmp_path / "report.md").exists() and (tmp_path / "benchmark.json").exists()
  assert benchmark.targets.check(tb.TARGETS, out["rows"]) == []  # none at these lengths
  goals = benchmark.targets.check(tb.TARGETS, [{"T": 1024, "attnx / flax": 0.6},
                                               {"T": 4096, "attnx / flax": 0.5}])
  assert goals == [{"target": "attnx / flax ≤ 0.67 at T = 1024", "measured": "0.60", "met": "yes"},
                   {"target": "attnx / flax ≤ 0.4 at T = 4096", "measured": "0.50",
                    "met": "**no**"}]


def test_nnx_gpt_tiny_end_to_end(tmp_path):
  c = tb.get_config("nnx_gpt_tiny")
  assert c.part == "nnx_gpt" and tb.get_config("nnx_gpt").nnx.num_layers == 4
  out = tb.run(c, str(tmp_path))
  # Both steps start from the same parameters and compute the same function.
  np.testing.assert_allclose(out["nnx first loss"], out["linen first loss"], rtol=1e-6)
  assert out["linen step ms"] > 0 and out["nnx step ms"] > 0
  assert out["nnx / linen"] == pytest.approx(out["nnx step ms"] / out["linen step ms"])
  with open(out["report"], encoding="utf-8") as f:
    text = f.read()
  assert "NNX / linen" in text and "target ≤ 1.05" in text
