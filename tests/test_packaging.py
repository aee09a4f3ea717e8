"""What pyproject.toml claims: the JAX range the suite runs on, and requirements.txt mirroring it.

The suite passes on the JAX this environment has (CI runs the oldest and the newest the range
admits); this test fails when a resolver installs one the range does not admit, and when the
range or the mirrored requirements drift apart. That an install keeps a newer JAX a user
already has is checked by .ci/run (its newest leg installs jax first, then attnx).
"""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _requirements(names: list[str]) -> dict[str, Requirement]:
  return {Requirement(r).name.lower(): Requirement(r) for r in names}


#: The ends of the tested range (docs/development.md, "Supported JAX"; CI runs both).
OLDEST_JAX, NEWEST_JAX = "0.10.2", "0.12.0.1"


def test_installed_jax_is_in_the_supported_range():
  deps = _requirements(_pyproject()["project"]["dependencies"])
  for name in ("jax", "flax", "optax", "chex", "orbax-checkpoint"):
    installed = Version(metadata.version(name))
    assert deps[name].specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is outside pyproject's {deps[name]}")
  jax_range = deps["jax"].specifier
  # Both ends pass the suite; 0.10.0 and 0.10.1 fail it (docs/development.md).
  assert jax_range.contains(OLDEST_JAX) and jax_range.contains(NEWEST_JAX)
  assert not any(jax_range.contains(v) for v in ("0.10.0", "0.10.1", "0.9.2"))


def test_python_range_covers_the_tested_interpreters():
  project = _pyproject()["project"]
  python = SpecifierSet(project["requires-python"])
  assert all(python.contains(v) for v in ("3.11.7", "3.12.1", "3.13.0"))
  assert not python.contains("3.10.13")
  listed = {c.rsplit(" ", 1)[-1] for c in project["classifiers"]
            if c.startswith("Programming Language :: Python :: 3.")}
  assert listed == {"3.11", "3.12", "3.13"}


def test_the_aot_extra_takes_the_toolchain_at_the_installed_jaxs_version():
  # jax's own extras pin the CUDA plugin (and its pjrt) to jax's version without CUDA
  # libraries ("cuda12-local") and libtpu as jax[tpu] does: no pin of jax itself, so an
  # install keeps the user's jax.
  aot = _requirements(_pyproject()["project"]["optional-dependencies"]["aot"])
  assert aot["jax"].extras == {"cuda12-local", "tpu"} and not aot["jax"].specifier
  assert not {"jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu"} & set(aot)


def test_requirements_txt_mirrors_pyproject():
  project = _pyproject()["project"]
  want = project["dependencies"] + project["optional-dependencies"]["test"]
  with open(os.path.join(ROOT, "requirements.txt")) as f:
    lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  assert lines == want
  # The optional extras are mirrored as comments, each under its "# NAME extra" line.
  extras, current = {}, None
  with open(os.path.join(ROOT, "requirements.txt")) as f:
    for line in f:
      header = re.match(r"#\s*(\w+) extra \(", line)
      if header:
        current = extras.setdefault(header.group(1), [])
      elif current is not None and re.match(r"#\s*[\w.-]+(\[[\w,.-]+\])?\s*([=<>!~].*)?$",
                                            line.strip()):
        current.append(re.sub(r"^#\s*", "", line.strip()))
  assert extras == {k: v for k, v in project["optional-dependencies"].items() if k != "test"}
  assert set(extras) == {"aot", "docs"}
