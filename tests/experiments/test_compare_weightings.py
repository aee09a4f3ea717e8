"""compare_weightings: presets, validation before compilation, a small ICL run in-process."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attnx.train import experiment  # noqa: E402
from experiments import compare_weightings as cw  # noqa: E402


def test_presets_and_docstring():
  assert cw.PRESETS[0] == "default"
  for p in cw.PRESETS:
    c = cw.get_config(p)
    assert c.experiment == "compare_weightings" and c.preset == p
    assert f":{p}" in cw.__doc__ or p == "default"
  assert cw.get_config(None).preset == "default"
  default = cw.get_config()
  assert default.tasks == "digits" and len(default.weightings.split(",")) >= 6
  assert set(cw.get_config("all").tasks.split(",")) == set(cw.TASKS)
  survey = cw.get_config("survey")
  assert set(survey.tasks.split(",")) == set(cw.TASKS)
  for p in cw.PRESETS:
    cw.validate_config(cw.get_config(p))  # every preset is valid as shipped
  with pytest.raises(ValueError, match="valid presets: default, tiny"):
    cw.get_config("huge")


@pytest.mark.parametrize("key, value, pattern", [
    ("weightings", "softmax,nope", r"config\.weightings.*'nope'"),
    ("tasks", "digits,imagenet", r"config\.tasks.*'imagenet'.*digits"),
    ("tasks", "", r"config\.tasks is empty"),
    ("batch_size", 5000, r"config\.batch_size=5000 is larger than the 1437 training examples "
                         r"of task 'digits'"),
])
def test_validate_config_names_key_and_choices(key, value, pattern):
  c = cw.get_config("tiny")
  c[key] = value
  with pytest.raises(ValueError, match=pattern):
    cw.validate_config(c)


def test_all_weightings_are_known_variants():
  c = cw.get_config("all")
  cw.validate_config(c)  # every variant name resolves to an attention spec
  assert c.weightings.split(",") == list(cw.ALL_WEIGHTINGS)  # "power:p=3" survives the split


def test_weighting_lists_have_no_duplicates():
  from attnx import core

  # power's default p = 2 is relu2; the list uses p = 3 instead.
  assert "power:p=3" in cw.ALL_WEIGHTINGS and "power" not in cw.ALL_WEIGHTINGS
  for p in cw.PRESETS:
    names = cw.get_config(p).weightings.split(",")
    assert "power" not in names
  z = np.linspace(-3.0, 3.0, 16, dtype=np.float32)[None]
  pointwise = [w for w in cw.ALL_WEIGHTINGS if core.parse_weighting_name(w)[0]
               in core.list_weightings("pointwise")]
  outs = {w: np.asarray(core.weights(z, w)) for w in pointwise}
  for i, a in enumerate(pointwise):
    for b in pointwise[i + 1:]:
      assert not np.allclose(outs[a], outs[b]), (a, b)
  assert experiment.run_name("survey", "power:p=3") == "survey-power_p_3"


@pytest.mark.slow
def test_icl_regression_run_compares_with_least_squares(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  c = cw.get_config("tiny")
  c.tasks = "icl_regression"
  c.weightings = "softmax"
  c.num_steps = 6
  c.eval_every = 3
  c.checkpoint_every = 0
  c.progress = False
  c.data.icl_regression.update(dim=3, num_points=6, num_train=128)
  c.max_eval_examples = 64
  out = cw.run(c, str(tmp_path / "wd"))
  with open(out["report"]) as f:
    report = f.read()
  assert "least squares" in report
  assert os.path.exists(tmp_path / "wd" / "icl_regression_vs_least_squares.png")
  final = json.load(open(tmp_path / "wd" / "final_metrics.json"))
  assert len(final["icl_regression"]["softmax"]["mse_last"]) == c.num_seeds
