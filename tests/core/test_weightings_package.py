"""attnx.core.weightings as a package: every name resolves to what it did before the split.

``weightings_recorded.json`` was written by :func:`_record` on commit 6ae0cc7, when
attnx/core/weightings.py registered the pointwise families and rownorm.py/simplex.py registered
theirs on import: for each spec of :data:`SPECS` (every registered name, with and without
parameters) the resolved object's fields, label and traits and its weights on one row (also
masked), and ``describe_weightings()``/``list_weightings()``. The public constructors give the
objects their names give (``weightings.power(p=3) == get_weighting("power:p=3")`` field by
field, F by its values), and no module of the package reaches into another's private names.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import weightings

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED = os.path.join(HERE, "weightings_recorded.json")
PACKAGE_DIR = os.path.dirname(weightings.__file__)

SPECS = (
    "softmax", "softmax:alpha=2", "exp", "exp:alpha=0.5", "softmax_plus_one",
    "softmax_plus_one:alpha=2", "relu", "relu:normalization=length", "relu2",
    "relu2:normalization=none", "softplus", "softplus:normalization=length", "elu_plus_one",
    "elu_plus_one:normalization=none", "taylor_exp", "taylor_exp:normalization=length",
    "power", "power:p=3", "power:p=0.5,normalization=length", "sigmoid",
    "sigmoid:normalization=none", "sigmoid:bias=-1", "sigmoid:bias=0.5,normalization=length",
    "gaussian", "gaussian:h=2", "gaussian:h=0.5,normalization=none", "boxcar",
    "boxcar:h=2,normalization=length", "triangular", "triangular:h=2",
    "triangular:normalization=none", "epanechnikov", "epanechnikov:h=0.5,normalization=none",
    "ssmax", "ssmax:s=2", "softpick", "softpick:eps=0.001", "stick_breaking", "sparsemax",
    "sparsemax:scale=2", "entmax15", "entmax15:scale=0.5", "entmax", "entmax:alpha=2",
    "entmax:alpha=1.5", "entmax:alpha=1.3", "entmax:alpha=1.3,n_iter=40",
    "entmax:alpha=2,n_iter=10,scale=2", "entmax:scale=3",
)
SCORES = jnp.array([0.7, -1.3, 2.1, 0.0, -0.2, 1.1], jnp.float32)
WHERE = jnp.array([True, True, False, True, True, True])

# name -> public constructor.
CONSTRUCTORS = {
    "softmax": weightings.softmax, "exp": weightings.exp,
    "softmax_plus_one": weightings.softmax_plus_one, "relu": weightings.relu,
    "relu2": weightings.relu2, "softplus": weightings.softplus,
    "elu_plus_one": weightings.elu_plus_one, "taylor_exp": weightings.taylor_exp,
    "power": weightings.power, "sigmoid": weightings.sigmoid,
    "gaussian": weightings.gaussian, "boxcar": weightings.boxcar,
    "triangular": weightings.triangular, "epanechnikov": weightings.epanechnikov,
    "ssmax": weightings.ssmax_weighting, "softpick": weightings.softpick_weighting,
    "stick_breaking": weightings.stick_breaking_weighting,
    "sparsemax": weightings.sparsemax_weighting, "entmax15": weightings.entmax15_weighting,
    "entmax": weightings.entmax_weighting,
}


def _fields(w, repr_learnable: bool = False) -> dict:
  """Everything a weighting declares except its function F (compared by its values)."""
  out = {"type": type(w).__name__, "kind": w.kind}
  for f in dataclasses.fields(w):
    if f.name not in ("fn", "bind", "sequence_shift", "log_f"):  # functions: by their values
      v = getattr(w, f.name)
      out[f.name] = repr(v) if f.name == "stream" or (repr_learnable and
                                                      f.name == "learnable") else v
  out["traits"] = w.traits
  out["online_max"] = w.online_max
  return out


def _scores(spec: str):
  return -SCORES * SCORES if spec.split(":")[0] in weightings.POINTWISE_KERNELS else SCORES


def _values(w, spec: str) -> dict:
  s = _scores(spec)
  return {"weights": np.asarray(core.weights(s, w)).tolist(),
          "weights_where": np.asarray(core.weights(s, w, where=WHERE)).tolist()}


def _record() -> dict:
  return {"describe": core.describe_weightings(), "list": core.list_weightings(),
          "list_row": core.list_weightings("row"),
          "specs": {spec: {"fields": _fields(w := core.get_weighting(spec)), **_values(w, spec)}
                    for spec in SPECS}}


@pytest.fixture(scope="module")
def recorded() -> dict:
  with open(RECORDED, encoding="utf-8") as f:
    return json.load(f)


def test_the_specs_cover_every_name_and_every_name_has_a_constructor():
  assert {s.split(":")[0] for s in SPECS} == set(core.list_weightings())
  assert set(CONSTRUCTORS) == set(weightings.BUILTIN) == set(core.list_weightings())
  assert all(weightings.BUILTIN[n] is f for n, f in CONSTRUCTORS.items())


def test_names_and_descriptions_are_those_recorded(recorded):
  assert core.describe_weightings() == recorded["describe"]
  assert core.list_weightings() == recorded["list"]
  assert core.list_weightings("row") == recorded["list_row"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_spec_resolves_to_the_recorded_weighting(spec, recorded):
  w = core.get_weighting(spec)
  # JSON has lists where the fields have tuples: compare through the same round trip.
  fields = json.loads(json.dumps(_fields(w, repr_learnable=True)))
  # Declared since the recording: the learnable parameters (tests/core/test_problem.py).
  assert fields.pop("learnable", "()") == ("()" if spec.split(":")[0] != "ssmax" else
                                          repr(w.learnable))
  name, params = core.parse_weighting_name(spec)
  # Since the recording: sum-normalized sigmoid streams log σ with the running max.
  log_domain = name == "sigmoid" and params.get("normalization", "sum") == "sum"
  assert (w.log_f is not None) == log_domain
  if log_domain:
    assert fields["online_max"] and fields["traits"]["stream"] == "online_max"
    fields["online_max"], fields["traits"]["stream"] = False, "sum"
  assert fields == recorded["specs"][spec]["fields"]
  # Declared since the recording: sigmoid's b = −log n of the query's sequence.
  counts = (name == "sigmoid" and params.get("normalization") == "none"
            and "bias" not in params)
  assert (getattr(w, "sequence_shift", None) is not None) == counts
  got = _values(w, spec)
  for key in ("weights", "weights_where"):
    np.testing.assert_allclose(got[key], recorded["specs"][spec][key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", SPECS)
def test_the_constructor_gives_what_the_name_gives(spec):
  name, params = core.parse_weighting_name(spec)
  built, named = CONSTRUCTORS[name](**params), core.get_weighting(spec)
  assert _fields(built) == _fields(named)
  got, want = _values(built, spec), _values(named, spec)
  for key in got:
    np.testing.assert_array_equal(got[key], want[key])


def test_power_3_is_the_name_power_p_3():
  built, named = core.weightings.power(p=3), core.get_weighting("power:p=3")
  assert dataclasses.replace(built, fn=None) == dataclasses.replace(named, fn=None)
  z = jnp.linspace(-2.0, 2.0, 9)
  np.testing.assert_array_equal(built(z, 9), named(z, 9))


def test_a_constructors_first_docstring_line_is_its_description():
  docs = core.describe_weightings()
  for name, f in weightings.BUILTIN.items():
    assert f.__doc__.strip().split("\n")[0] == docs[name], name


def _private_uses(path: str) -> list[str]:
  """``from m import _x`` and ``m._x`` for a module ``m`` this file imports."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  modules, out = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnx"):
      for a in node.names:
        if a.name.startswith("_"):
          out.append(f"from {node.module} import {a.name}")
        else:
          modules.add(a.asname or a.name)  # a module or a public name: either may be a module
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      out.append(f"{node.value.id}.{node.attr}")
  return out


@pytest.mark.parametrize("filename", sorted(f for f in os.listdir(PACKAGE_DIR)
                                            if f.endswith(".py")))
def test_no_module_of_the_package_uses_another_modules_private_names(filename):
  assert _private_uses(os.path.join(PACKAGE_DIR, filename)) == []
