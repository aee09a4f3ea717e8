"""Generic experiment-config conventions and validation (run before anything compiles)."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import ml_collections

from attnx.train.optim import validate_optimizer_config
from attnx.train.parallel import PARALLEL_MODES


def base_config() -> ml_collections.ConfigDict:
  """Fields every experiment config carries (launch.py and `validate` rely on them)."""
  return ml_collections.ConfigDict(dict(
      experiment="",
      preset="",
      seed=0,
      num_seeds=1,
      parallel="none",  # none | shard_map | pmap (data parallelism over all devices)
      num_cpu_devices=0,  # >0: fake this many CPU devices (set before JAX initializes)
      distributed=False,  # True: jax.distributed.initialize() (multi-host)
      progress=True,  # tqdm bar (only shown on a tty)
      checkpoint_every=0,
      log_every=10,
  ))


def split_list(value: Any) -> list[str]:
  """'a,b , c' or ('a', 'b') -> ['a', 'b', 'c'] (command-line friendly list fields)."""
  if value is None:
    return []
  if isinstance(value, str):
    return [v.strip() for v in value.split(",") if v.strip()]
  return [str(v).strip() for v in value]


def check_choice(config: ml_collections.ConfigDict, key: str, choices: Sequence[str]) -> None:
  """Raise ValueError naming `key` and the valid choices when config[key] is not allowed."""
  value = config[key]
  values = split_list(value) if isinstance(value, str) and "," in value else [value]
  for v in values:
    if v not in choices:
      raise ValueError(f"config.{key}={v!r} is invalid; valid choices: {', '.join(choices)}")


def validate(config: ml_collections.ConfigDict, module: ModuleType | None = None) -> None:
  """Generic checks, then the experiment module's `validate_config(config)` if it has one."""
  if "parallel" in config:
    check_choice(config, "parallel", PARALLEL_MODES)
  for key in ("num_seeds", "num_steps"):
    if key in config and int(config[key]) < 1:
      raise ValueError(f"config.{key} must be >= 1, got {config[key]!r}")
  if "num_cpu_devices" in config and int(config.num_cpu_devices) < 0:
    raise ValueError(f"config.num_cpu_devices must be >= 0, got {config.num_cpu_devices!r}")
  if "optimizer" in config:
    validate_optimizer_config(config.optimizer, "config.optimizer")
  if module is not None and hasattr(module, "validate_config"):
    module.validate_config(config)


def load_module(path: str) -> ModuleType:
  """Import an experiment file (experiments/NAME.py) by path."""
  path = os.path.abspath(path)
  name = os.path.splitext(os.path.basename(path))[0]
  mod_name = f"experiments.{name}"
  if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == path:
    return sys.modules[mod_name]
  spec = importlib.util.spec_from_file_location(mod_name, path)
  if spec is None or spec.loader is None:
    raise ImportError(f"cannot import experiment {path}")
  module = importlib.util.module_from_spec(spec)
  sys.modules[mod_name] = module
  spec.loader.exec_module(module)
  return module


def list_experiments(directory: str) -> list[dict[str, Any]]:
  """Experiments in `directory` (files defining get_config), read with `ast`, not imported.

  Returns [{"name", "path", "summary", "presets": [(preset, first docstring line)]}].
  """
  out = []
  if not os.path.isdir(directory):
    return out
  for fname in sorted(os.listdir(directory)):
    if not fname.endswith(".py") or fname.startswith("_"):
      continue
    path = os.path.join(directory, fname)
    try:
      with open(path) as f:
        tree = ast.parse(f.read())
    except (OSError, SyntaxError):
      continue
    if not any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body):
      continue
    doc = ast.get_docstring(tree) or ""
    presets: list[str] = []
    for n in tree.body:
      if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "PRESETS"
                                           for t in n.targets):
        try:
          presets = list(ast.literal_eval(n.value))
        except ValueError:
          pass
    out.append({"name": fname[:-3], "path": path,
                "summary": doc.strip().splitlines()[0] if doc.strip() else "",
                "presets": presets})
  return out


def format_experiments(directory: str) -> str:
  """Human-readable list of experiments and presets (for --help / --list)."""
  lines = ["Experiments (python launch.py --config=experiments/NAME.py[:PRESET]):"]
  for e in list_experiments(directory):
    lines.append(f"  {e['name']}: {e['summary']}")
    if e["presets"]:
      lines.append(f"    presets: {', '.join(e['presets'])}")
  return "\n".join(lines)
