"""Every experiment's presets (cross-cutting): the default changed by one small function each,
valid as shipped, and documented in the experiment's docstring."""

from __future__ import annotations

import os

import pytest

from attnx.train import config as train_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ALL = train_config.list_experiments(os.path.join(ROOT, "experiments"))
# pallas_benchmark has one config and needs an accelerator to mean anything.
EXPERIMENTS = [e["name"] for e in _ALL if e["name"] != "pallas_benchmark"]


def _module(name: str):
  return train_config.load_module(os.path.join(ROOT, "experiments", f"{name}.py"))


def test_every_experiment_is_covered():
  assert {"compare_weightings", "shift_invariance", "dot_vs_distance", "metric_attention",
          "translation", "nadaraya_watson", "regularized_argmax", "kernel_benchmark",
          "train_benchmark", "decode_benchmark"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_presets_derive_from_the_default(name):
  exp = _module(name)
  assert tuple(exp.PRESET_FNS) == exp.PRESETS and {"default", "tiny"} <= set(exp.PRESETS)
  for preset, change in exp.PRESET_FNS.items():
    c = exp._default()
    c.preset = preset
    change(c)
    got = exp.get_config(preset)
    assert got.to_dict() == c.to_dict() and got.preset == preset
    if hasattr(exp, "validate_config"):
      exp.validate_config(got)  # every preset is valid as shipped
    assert preset == "default" or preset in exp.__doc__, f"{name}: preset {preset} undocumented"
  assert exp.get_config(None).to_dict() == exp.get_config("default").to_dict()
  with pytest.raises(ValueError, match=f"Unknown preset 'nope' for {name}; valid presets"):
    exp.get_config("nope")
