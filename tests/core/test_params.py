"""Parameter validation of weightings and scores (attnx/core/params.py) at parse time."""

from __future__ import annotations

import inspect
import math

import pytest

from attnx import core
from attnx.core import params as params_lib
from attnx.core import weightings as weightings_lib


def _numeric_params() -> list[tuple[str, str]]:
  """(weighting, parameter) for every numeric parameter of every registered weighting."""
  out = []
  for name in core.list_weightings():
    factory = weightings_lib.BUILTIN[name]
    for p, spec in inspect.signature(factory).parameters.items():
      if p != "normalization" and not isinstance(spec.default, str):
        out.append((name, p))
  return out


def test_every_numeric_parameter_is_found():
  found = set(_numeric_params())
  for expected in [("power", "p"), ("sigmoid", "bias"), ("softmax", "alpha"), ("gaussian", "h"),
                   ("entmax", "alpha"), ("ssmax", "s"), ("softpick", "eps")]:
    assert expected in found


@pytest.mark.parametrize("weighting,param", _numeric_params())
@pytest.mark.parametrize("bad", ["abc", "nan", "inf", "-inf", "true"])
def test_non_numbers_are_rejected_naming_the_parameter(weighting, param, bad):
  with pytest.raises(ValueError, match=rf"'{param}'.*must be .*got"):
    core.get_weighting(f"{weighting}:{param}={bad}")


@pytest.mark.parametrize("spec,needle", [
    ("power:p=0", "'p' must be a finite number > 0"),
    ("power:p=-1", "> 0"),
    ("softmax:alpha=0", "'alpha' must be a finite number > 0"),
    ("softmax_plus_one:alpha=-2", "> 0"),
    ("gaussian:h=0", "'h' must be a finite number > 0"),
    ("boxcar:h=-1", "> 0"), ("triangular:h=0", "> 0"), ("epanechnikov:h=0", "> 0"),
    ("entmax:alpha=0.5", "'alpha' must be a finite number > 1"),
    ("entmax:alpha=1", "alpha = 1 is softmax"),
    ("entmax:alpha=1.5,n_iter=0", "'n_iter' must be an integer ≥ 1"),
    ("entmax:alpha=1.5,n_iter=2.5", "'n_iter' must be an integer"),
    ("sparsemax:scale=0", "'scale' must be a finite number > 0"),
    ("entmax15:scale=-1", "> 0"),
    ("softpick:eps=0", "'eps' must be a finite number > 0"),
    ("relu:normalization=max", "Unknown normalization 'max'"),
    ("relu:normalization=3", "Unknown normalization 3"),
])
def test_out_of_range_values_name_the_range(spec, needle):
  with pytest.raises(ValueError, match=".*" + needle.replace("(", r"\(").replace(")", r"\)")):
    core.get_weighting(spec)


@pytest.mark.parametrize("spec", ["power:p=0.5", "power:p=1e-3", "sigmoid:bias=-3.5",
                                  "ssmax:s=-1", "entmax:alpha=4", "gaussian:h=1e-3",
                                  "entmax:alpha=1.5,n_iter=12"])
def test_valid_values_are_accepted(spec):
  core.get_weighting(spec)


@pytest.mark.parametrize("score", ["cosine:temperature=0", "cosine:temperature=-1",
                                   "cosine:temperature=abc", "cosine:temperature=inf"])
def test_cosine_temperature_checked_when_a_model_is_configured(score):
  with pytest.raises(ValueError, match="'temperature' must be a finite number > 0"):
    core.check_compatible("softmax", score)


def test_number_helper_bounds():
  assert params_lib.number("x", "a", 3) == 3.0
  assert params_lib.number("x", "n", 4.0, low=1, low_open=False, integer=True) == 4
  assert params_lib.number("x", "a", 2, low=1, high=2) == 2.0
  with pytest.raises(ValueError, match=r"in \(1, 2\]"):
    params_lib.number("x", "a", 2.5, low=1, high=2)
  with pytest.raises(ValueError, match="got True"):
    params_lib.number("x", "a", True)
  with pytest.raises(ValueError):
    params_lib.number("x", "a", math.nan)
