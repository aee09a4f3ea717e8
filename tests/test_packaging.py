"""What pyproject.toml claims: the JAX range the suite runs on, and requirements.txt mirroring it.

The suite passes on the JAX this environment has (CI installs the newest the range admits);
this test fails when a resolver installs one the range does not admit, and when the range or
the mirrored requirements drift apart.
"""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _requirements(names: list[str]) -> dict[str, Requirement]:
  return {Requirement(r).name.lower(): Requirement(r) for r in names}


def test_installed_jax_is_in_the_supported_range():
  deps = _requirements(_pyproject()["project"]["dependencies"])
  for name in ("jax", "flax", "optax", "chex", "orbax-checkpoint"):
    installed = Version(metadata.version(name))
    assert deps[name].specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is outside pyproject's {deps[name]}")
  jax_range = deps["jax"].specifier
  # 0.10.2 is what the suite passes on; 0.10.0 and 0.10.1 fail it
  # (docs/development.md, "Supported JAX").
  assert jax_range.contains("0.10.2")
  assert not any(jax_range.contains(v) for v in ("0.10.0", "0.10.1", "0.11.0", "0.9.2"))


def test_the_aot_extra_pins_the_plugin_to_jaxlib():
  aot = _requirements(_pyproject()["project"]["optional-dependencies"]["aot"])
  jaxlib = {str(s) for s in aot["jaxlib"].specifier}
  assert jaxlib == {str(s) for s in aot["jax-cuda12-plugin"].specifier} == {
      str(s) for s in aot["jax-cuda12-pjrt"].specifier} == {str(s) for s in aot["jax"].specifier}
  pinned = Version(next(iter(jaxlib)).removeprefix("=="))
  assert _requirements(_pyproject()["project"]["dependencies"])["jax"].specifier.contains(pinned)


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
      elif current is not None and re.match(r"#\s*\S+[=<>]", line):
        current.append(re.sub(r"^#\s*", "", line.strip()))
  assert extras == {k: v for k, v in project["optional-dependencies"].items() if k != "test"}
  assert set(extras) == {"aot", "docs"}
