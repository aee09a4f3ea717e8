"""Generic experiment-config conventions and validation (run before anything compiles)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import ml_collections
import numpy as np
import optax

from attnx.train.data import PIPELINES
from attnx.train.losses import LOSSES, LossFn
from attnx.train.optim import validate_optimizer_config
from attnx.train.parallel import PARALLEL_MODES, SEQUENCE_LAYOUTS


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
      # jax.distributed.initialize arguments; ""/0/-1: auto-detected (SLURM, TPU, ...).
      coordinator_address="",  # host:port of process 0
      num_processes=0,
      process_id=-1,
      # Seconds without a heartbeat after which the other processes count one as dead and
      # stop (0: JAX's default, 100). launch_local stops them at once on its own.
      heartbeat_timeout_seconds=0,
      # TFDS data dir of catalog datasets (mnist, ...); "": $TFDS_DATA_DIR or
      # ~/tensorflow_datasets. attnx's own datasets are unaffected ($ATTNX_DATA_DIR).
      data_dir="",
      # Training batches: "numpy" (fast) or "grain" (grain.MapDataset; see attnx.train.data).
      data_pipeline="numpy",
      progress=True,  # tqdm bar (only shown on a tty)
      checkpoint_every=0,
      log_every=10,
  ))


@dataclasses.dataclass(frozen=True)
class FitConfig:
  """How `fit` trains: everything except the model, the data and where results go.

  Frozen and validated on construction, so a bad value fails before anything compiles, with
  a ValueError naming the field. Build it from an experiment config with `from_config`; make
  variants with ``dataclasses.replace(cfg, num_seeds=1)``.

  Attributes:
    num_steps: optimizer steps (schedules in a ConfigDict optimizer span them).
    optimizer: an `optimizer_config()` ConfigDict (inspected for the checkpoint fingerprint
      and the NaN hint) or a ready optax transformation.
    num_seeds, seed: seeds seed..seed+num_seeds-1, trained at once (vmap).
    loss: a name in LOSSES or a LossFn.
    eval_every, log_every, checkpoint_every: periods in steps (0: only at the end;
      checkpoints also need a workdir).
    keep_checkpoints: how many recent checkpoints stay on disk.
    parallel: data parallelism over devices, one of PARALLEL_MODES.
    sequence_parallel: with parallel="shard_map", the devices along the sequence of a 2-D
      (data, seq) mesh (1: data parallelism only). Every batch array is split along its
      sequence axis too; the model must run its attention ring-parallel over "seq" (it says
      so with a ``sequence_axis="seq"`` field, e.g. ``attnx.nn.GPT``).
    sequence_layout: how the sequence is cut ("contiguous" or "zigzag", the causal load
      balance; the model's own ``sequence_layout`` must match).
    progress: a tqdm bar when stderr is a tty.
    tensorboard: event files next to metrics.jsonl.
  """

  num_steps: int
  optimizer: optax.GradientTransformation | ml_collections.ConfigDict
  num_seeds: int = 1
  seed: int = 0
  loss: str | LossFn = "softmax_xent"
  eval_every: int = 0
  log_every: int = 10
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  parallel: str = "none"
  sequence_parallel: int = 1
  sequence_layout: str = "contiguous"
  progress: bool = True
  tensorboard: bool = True

  def __post_init__(self):
    for name, least in _FIT_COUNTS.items():
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FitConfigError(name, f"FitConfig.{name} must be an integer, got {value!r}")
      if value < least:
        off = " (0: only at the end)" if least == 0 and name != "seed" else ""
        raise FitConfigError(name, f"FitConfig.{name} must be >= {least}{off}, got {value!r}")
      object.__setattr__(self, name, int(value))  # numpy/ConfigDict integers -> int
    for name in ("progress", "tensorboard"):
      if not isinstance(getattr(self, name), bool | np.bool_):
        raise FitConfigError(name, f"FitConfig.{name} must be True or False, got "
                                   f"{getattr(self, name)!r}")
      object.__setattr__(self, name, bool(getattr(self, name)))
    if self.parallel not in PARALLEL_MODES:
      raise FitConfigError("parallel", f"FitConfig.parallel={self.parallel!r} is not one of "
                                       f"{', '.join(PARALLEL_MODES)}")
    if self.sequence_layout not in SEQUENCE_LAYOUTS:
      raise FitConfigError("sequence_layout", f"FitConfig.sequence_layout="
                           f"{self.sequence_layout!r} is not one of {', '.join(SEQUENCE_LAYOUTS)}")
    if self.sequence_parallel > 1 and self.parallel != "shard_map":
      raise FitConfigError("sequence_parallel", f"FitConfig.sequence_parallel="
                           f"{self.sequence_parallel} needs parallel='shard_map' (a (data, seq) "
                           f"mesh), got parallel={self.parallel!r}")
    if not callable(self.loss) and self.loss not in LOSSES:
      raise FitConfigError("loss", f"FitConfig.loss={self.loss!r} is not one of "
                                   f"{', '.join(LOSSES)} (or pass a loss function)")
    if isinstance(self.optimizer, ml_collections.ConfigDict):
      try:
        validate_optimizer_config(self.optimizer, "FitConfig.optimizer")
      except ValueError as e:
        raise FitConfigError("optimizer", str(e)) from None
    elif not isinstance(self.optimizer, optax.GradientTransformation):
      raise FitConfigError("optimizer", "FitConfig.optimizer must be an optimizer_config() "
                                        "ConfigDict or an optax.GradientTransformation, got "
                                        f"{type(self.optimizer).__name__}")

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict | Any, **overrides: Any) -> FitConfig:
    """The FitConfig of an experiment config: its top-level keys named like the fields
    (base_config's seed, num_seeds, parallel, progress, checkpoint_every, log_every, plus
    num_steps, optimizer, eval_every, ... where the experiment defines them), then
    `overrides` (e.g. values from a nested config.train). Other keys are ignored. A bad value
    raises ValueError naming the field and where it came from (config.KEY or KEY=)."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
      raise ValueError(f"FitConfig.from_config: unknown field(s) {', '.join(unknown)}; "
                       f"fields: {', '.join(names)}")
    values, source = {}, {}
    for name in names:
      if name in overrides:
        values[name], source[name] = overrides[name], f"{name}="
      elif config is not None and name in config:
        values[name], source[name] = config[name], f"config.{name}"
    missing = [n for n in ("num_steps", "optimizer") if n not in values]
    if missing:
      raise ValueError(f"FitConfig.{missing[0]} is required: set config.{missing[0]} or pass "
                       f"{missing[0]}= to FitConfig.from_config")
    try:
      return cls(**values)
    except FitConfigError as e:
      raise FitConfigError(e.field, f"{e} (from {source[e.field]})") from None


class FitConfigError(ValueError):
  """A FitConfig field is invalid; `field` names it."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


# Integer fields of FitConfig and their smallest meaningful value.
_FIT_COUNTS = {"num_steps": 1, "num_seeds": 1, "seed": 0, "eval_every": 0, "log_every": 0,
               "checkpoint_every": 0, "keep_checkpoints": 1, "sequence_parallel": 1}


def preset_config(preset: str | None, default: Callable[[], ml_collections.ConfigDict],
                  presets: Mapping[str, Callable[[ml_collections.ConfigDict], None]],
                  experiment: str = "") -> ml_collections.ConfigDict:
  """The config of ``preset``: ``default()`` changed by ``presets[preset]`` (None or "" =
  "default"). Experiments keep presets as small functions of the default, never a chain of
  branches; an unknown name is a ValueError listing the valid ones."""
  name = "default" if preset in (None, "") else preset
  if name not in presets:
    where = f" for {experiment}" if experiment else ""
    raise ValueError(f"Unknown preset {preset!r}{where}; valid presets: {', '.join(presets)}.")
  c = default()
  c.preset = name
  presets[name](c)
  return c


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


def check_choices(config: ml_collections.ConfigDict, key: str, values: Sequence[Any],
                  valid: Sequence[Any]) -> None:
  """Raises ValueError naming ``config.<key>`` and the valid choices if any of ``values`` (the
  entries of that key, or names derived from them) is not in ``valid``."""
  bad = [v for v in values if v not in valid]
  if bad:
    raise ValueError(f"config.{key} has invalid entries {bad}; valid choices: "
                     f"{', '.join(map(str, valid))}.")


def variant_list(value: Any) -> list[str]:
  """Attention variants from 'a,b:k=v,k2=v2,c' (or a sequence): an item ``k=v`` without a
  ``:`` continues the previous variant's parameters, so
  ``"softmax,sigmoid:normalization=none,bias=0"`` is two variants."""
  out: list[str] = []
  for item in split_list(value):
    if out and ":" in out[-1] and ":" not in item and "=" in item:
      out[-1] += "," + item
    else:
      out.append(item)
  return out


def attention_variants(config: ml_collections.ConfigDict, key: str = "weightings",
                       reference: str | None = None) -> list[str]:
  """The attention variants named in ``config[key]`` (:func:`variant_list`), each checked with
  :func:`attnx.nn.attention_spec` (name and parameters); a ValueError names the key and the
  valid names, or the missing ``reference``."""
  from attnx import nn  # noqa: PLC0415  (the model library, only where variants are named)

  names = variant_list(config[key])
  if not names:
    raise ValueError(f"config.{key} is empty; valid: {', '.join(nn.list_attention_variants())}.")
  for name in names:
    try:
      nn.attention_spec(name)
    except ValueError as e:
      raise ValueError(f"config.{key}: {e}") from None
  if reference is not None and reference not in names:
    raise ValueError(f"config.{key} must include {reference} (the reference).")
  return names


def validate(config: ml_collections.ConfigDict, module: ModuleType | None = None) -> None:
  """Generic checks, then the experiment module's `validate_config(config)` if it has one."""
  if "parallel" in config:
    check_choice(config, "parallel", PARALLEL_MODES)
  if "data_pipeline" in config:
    check_choice(config, "data_pipeline", PIPELINES)
  _check_counts(config)
  if "num_cpu_devices" in config and int(config.num_cpu_devices) < 0:
    raise ValueError(f"config.num_cpu_devices must be >= 0, got {config.num_cpu_devices!r}")
  _check_batch_split(config)
  _check_distributed(config)
  if config.get("data_dir") and not os.path.isdir(os.path.expanduser(config.data_dir)):
    raise ValueError(f"config.data_dir={config.data_dir!r} is not a directory (it should be a "
                     "TFDS data dir holding prepared catalog datasets)")
  if "optimizer" in config:
    validate_optimizer_config(config.optimizer, "config.optimizer")
  if module is not None and hasattr(module, "validate_config"):
    module.validate_config(config)


# Fields that `fit` and the experiments read as counts, wherever they sit in a config (e.g.
# config.train.num_steps): the smallest value that means something.
_MIN_COUNT = {"num_seeds": 1, "num_steps": 1, "batch_size": 1, "keep_checkpoints": 1,
              "checkpoint_every": 0, "log_every": 0, "eval_every": 0}


def _check_counts(config: ml_collections.ConfigDict) -> None:
  """Counts below their minimum: `fit` would fail after compiling, or silently do nothing."""
  for key, value in _leaves(config).items():
    least = _MIN_COUNT.get(key.rsplit(".", 1)[-1])
    if least is None or isinstance(value, bool) or not isinstance(value, int | float):
      continue
    if value < least:
      off = " (0 turns it off)" if least == 0 else ""
      raise ValueError(f"config.{key} must be >= {least}{off}, got {value!r}")


def check_batch_size(config: ml_collections.ConfigDict, key: str, num_examples: int,
                     dataset: str) -> None:
  """ValueError when the batch size config.<key> exceeds the `num_examples` it is drawn from.

  Training takes full batches from the training split, so the run would only fail once the
  data is loaded and the model compiled; experiments call this from `validate_config` with
  the size their data has (attnx.data.get_info knows it without preparing anything).
  """
  node: Any = config
  for part in key.split("."):
    node = node[part]
  if int(node) > num_examples:
    raise ValueError(f"config.{key}={node} is larger than the {num_examples} training examples "
                     f"of {dataset}; use at most {num_examples}")


def _check_batch_split(config: ml_collections.ConfigDict) -> None:
  """With faked CPU devices the device count is known before JAX starts: check the split."""
  parallel = config.get("parallel", "none")
  n = int(config.get("num_cpu_devices", 0) or 0)
  if config.get("distributed", False) and int(config.get("num_processes", 0) or 0) > 1:
    n *= int(config.num_processes)  # the same count in every process
  sp = int(config.get("sequence_parallel", 1) or 1)
  if sp < 1:
    raise ValueError(f"config.sequence_parallel must be >= 1, got {sp}")
  if sp > 1 and parallel != "shard_map":
    raise ValueError(f"config.sequence_parallel={sp} needs config.parallel='shard_map' (a "
                     f"(data, seq) mesh), got {parallel!r}")
  if "sequence_layout" in config:
    check_choice(config, "sequence_layout", SEQUENCE_LAYOUTS)
  if sp > 1 and n > 0 and n % sp:
    raise ValueError(f"config.sequence_parallel={sp} does not divide the {n} fake CPU devices "
                     f"(config.num_cpu_devices={config.num_cpu_devices} per process)")
  d = n // sp
  if parallel != "none" and d > 0 and "batch_size" in config and int(config.batch_size) % d:
    per = int(config.num_cpu_devices)
    devices = f"config.num_cpu_devices={per}" + (" per process" if n > per else "")
    across = (f"the {d} devices of {devices}" if sp == 1 else
              f"the {d} data-parallel devices ({devices} / config.sequence_parallel={sp})")
    raise ValueError(
        f"config.batch_size={config.batch_size} is not divisible by {across} "
        f"(config.parallel={parallel!r} splits every batch over them); use a multiple of {d}")


def _check_distributed(config: ml_collections.ConfigDict) -> None:
  num, pid = int(config.get("num_processes", 0)), int(config.get("process_id", -1))
  if num < 0 or pid < -1 or (num > 0 and pid >= num):
    raise ValueError(f"config.num_processes={num} (0: auto) and config.process_id={pid} (-1: "
                     "auto) need 0 <= process_id < num_processes")
  beat = config.get("heartbeat_timeout_seconds", 0)
  if isinstance(beat, bool) or not isinstance(beat, int) or beat < 0:
    raise ValueError(f"config.heartbeat_timeout_seconds={beat!r} must be an integer >= 0 "
                     "(0: JAX's default)")
  if not config.get("distributed", False) and (config.get("coordinator_address") or num > 0
                                               or pid >= 0 or beat):
    raise ValueError("config.coordinator_address, num_processes, process_id and "
                     "heartbeat_timeout_seconds are only used with config.distributed=True")


def distributed_kwargs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Keyword arguments for jax.distributed.initialize (None = let JAX auto-detect)."""
  num, pid = int(config.get("num_processes", 0)), int(config.get("process_id", -1))
  kwargs = {"coordinator_address": config.get("coordinator_address") or None,
            "num_processes": num if num > 0 else None,
            "process_id": pid if pid >= 0 else None}
  if int(config.get("heartbeat_timeout_seconds", 0) or 0) > 0:
    kwargs["heartbeat_timeout_seconds"] = int(config.heartbeat_timeout_seconds)
  return kwargs


def apply_data_dir(config: ml_collections.ConfigDict) -> None:
  """Make `config.data_dir` the TFDS data dir of catalog datasets for this process.

  Through $TFDS_DATA_DIR, which attnx.data reads whenever no `data_dir=` is passed, so every
  experiment's loading honours it unchanged (and so do subprocesses they start).
  """
  if config.get("data_dir"):
    os.environ["TFDS_DATA_DIR"] = os.path.abspath(os.path.expanduser(config.data_dir))


def _leaves(config: Any, prefix: str = "") -> dict[str, Any]:
  if hasattr(config, "items"):
    out = {}
    for k, v in config.items():
      out.update(_leaves(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: config}


def config_overrides(config: ml_collections.ConfigDict, reference: ml_collections.ConfigDict,
                     exclude: Sequence[str] = ()) -> list[str]:
  """`--config.KEY=VALUE` flags that turn `reference` into `config` (for re-launching).

  Lists every leaf whose value differs from (or is missing in) `reference`, except `exclude`.
  """
  ref = _leaves(reference)
  flags = []
  for key, value in _leaves(config).items():
    if key in exclude or (key in ref and ref[key] == value):
      continue
    if isinstance(value, list | tuple):
      text = repr(tuple(value))
    else:
      text = str(value)
    flags.append(f"--config.{key}={text}")
  return flags


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


# The nodes of an expression `list_experiments` evaluates: literals, names bound to literals,
# comparisons, comprehensions and tuple()/list() of them; nothing that runs the module's code.
_STATIC_NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Store, ast.Tuple, ast.List,
                 ast.Set, ast.Dict, ast.DictComp, ast.ListComp, ast.SetComp, ast.comprehension,
                 ast.Compare, ast.BoolOp, ast.UnaryOp, ast.cmpop, ast.boolop, ast.unaryop,
                 ast.JoinedStr, ast.FormattedValue, ast.Call)
_STATIC_CALLS = {"tuple": tuple, "list": list}


class _DictKeys(ast.NodeTransformer):
  """A dict of functions (``PRESET_FNS``) with every value replaced by None: its keys remain,
  also those of a ``**{name: fn(name) for name in NAMES if ...}`` entry."""

  def visit_Dict(self, node: ast.Dict) -> ast.Dict:
    return ast.Dict(keys=node.keys, values=[self.visit(v) if k is None else ast.Constant(None)
                                            for k, v in zip(node.keys, node.values, strict=True)])

  def visit_DictComp(self, node: ast.DictComp) -> ast.DictComp:
    return ast.DictComp(key=node.key, value=ast.Constant(None), generators=node.generators)


def _static(node: ast.expr, names: Mapping[str, Any]) -> Any:
  """The value of ``node`` if it is a constant expression over ``names`` (module-level names
  already read), else None; never calls anything but tuple() and list()."""
  for n in ast.walk(node):
    if not isinstance(n, _STATIC_NODES) or (isinstance(n, ast.Call) and (
        getattr(n.func, "id", None) not in _STATIC_CALLS or n.keywords)):
      return None
  expr = ast.fix_missing_locations(ast.Expression(node))
  try:
    return eval(compile(expr, "<presets>", "eval"),  # noqa: S307  (checked above)
                {"__builtins__": dict(_STATIC_CALLS), **names})
  except Exception:  # noqa: BLE001  (a name bound to something else: not readable)
    return None


def _preset_names(tree: ast.Module) -> list[str]:
  """The names in a module's ``PRESETS``, read without importing or running it: a literal, or
  ``tuple(PRESET_FNS)`` of a dict of preset functions whose keys are constant expressions
  (also ``**{t: fn(t) for t in TASKS if ...}`` over a literal ``TASKS``). The last assignment
  that can be read wins ([] when none can)."""
  names: dict[str, Any] = {}
  presets: list[str] = []
  for n in tree.body:
    if isinstance(n, ast.Assign):
      targets, value = n.targets, n.value
    elif isinstance(n, ast.AnnAssign) and n.value is not None:
      targets, value = [n.target], n.value
    else:
      continue
    for name in (t.id for t in targets if isinstance(t, ast.Name)):
      if name == "PRESET_FNS":
        value = _DictKeys().visit(value)
      names[name] = _static(value, names)
      if name == "PRESETS" and isinstance(names[name], tuple | list):
        presets = [str(p) for p in names[name]]
  return presets


def list_experiments(directory: str) -> list[dict[str, Any]]:
  """Experiments in `directory` (files defining get_config), read with `ast`, not imported.

  Returns [{"name", "path", "summary", "presets": [preset names]}] (see `_preset_names`).
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
    out.append({"name": fname[:-3], "path": path,
                "summary": doc.strip().splitlines()[0] if doc.strip() else "",
                "presets": _preset_names(tree)})
  return out


def format_experiments(directory: str) -> str:
  """Human-readable list of experiments and presets (for --help / --list)."""
  lines = ["Experiments (python launch.py --config=experiments/NAME.py[:PRESET]):"]
  for e in list_experiments(directory):
    lines.append(f"  {e['name']}: {e['summary']}")
    if e["presets"]:
      lines.append(f"    presets: {', '.join(e['presets'])}")
  return "\n".join(lines)
