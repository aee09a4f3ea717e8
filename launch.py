"""Run an attnx experiment.

  python launch.py --config=experiments/NAME.py[:PRESET] [--config.KEY=VALUE ...] [--workdir=DIR]

With no flags, runs the default experiment (compare_weightings, preset "default": softmax vs
alternative weightings on the bundled digits task; offline, a few minutes on 2 CPU cores) into
runs/<experiment>-<preset>/ and prints where the report is.

Examples:
  python launch.py --config=experiments/compare_weightings.py:tiny
  python launch.py --config=experiments/compare_weightings.py:digits \\
      --config.weightings=softmax,relu,sparsemax --config.num_seeds=4 --workdir=runs/x
  python launch.py --config=experiments/compare_weightings.py:tiny \\
      --config.parallel=shard_map --config.num_cpu_devices=8
  python launch.py --list

Every experiment config has: seed, num_seeds, parallel (none | shard_map | pmap),
num_cpu_devices (>0 fakes that many CPU devices before JAX starts; equivalent to
XLA_FLAGS=--xla_force_host_platform_device_count=N), distributed (True calls
jax.distributed.initialize(coordinator_address, num_processes, process_id); empty values are
auto-detected; `python -m attnx.launch_local -n N -- launch.py ...` starts N such processes on
this machine), data_dir (TFDS data dir of catalog datasets such as mnist), progress,
checkpoint_every, log_every. A rerun with the same --workdir resumes from the latest
checkpoints; a rerun with a different setup (model, optimizer, steps, batch size, seeds, data)
stops with the differences named: use another --workdir for it. A damaged checkpoint (e.g. a
file truncated by a full disk) is reported in one line and the run resumes from the newest
intact one beside it. Exit status:
  0  success;
  1  a run stopped on a NaN/Inf loss (after the experiment wrote what it had);
  2  a launch-time mistake, reported in one "FATAL: ..." line before anything compiles (a bad
     flag, an unknown --config.KEY (with the closest key), a config value, batch size or
     --workdir), or a rerun whose setup differs from the checkpoint's;
  3  a run's checkpoints are all damaged: nothing on disk was changed (move its checkpoint
     directory away to train it from scratch);
  4  an unexpected error: a bug in attnx or in the experiment (its traceback is printed);
  5  (several processes) this process lost a peer: another process died or stopped
     answering; one "FATAL: process I of N lost a peer process: ..." line, no traceback.
With several processes (--config.distributed=True) a process that fails exits at once,
without waiting for its peers at JAX's shutdown barrier, and SIGTERM ends it at once (JAX's
preemption notifier would otherwise catch it).
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import sys
import tempfile
import traceback
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

from attnx.train import config as train_config
from attnx.train import workarounds
from attnx.train.parallel import validate_parallel

_ROOT = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS_DIR = os.path.join(_ROOT, "experiments")
DEFAULT_CONFIG = os.path.join(EXPERIMENTS_DIR, "compare_weightings.py")

__doc__ += "\n" + train_config.format_experiments(EXPERIMENTS_DIR) + "\n"


def _failed(msg: str, status: int = 2) -> int:
  """Writes the one FATAL line of a failed launch (no traceback) and returns its exit status."""
  print(f"FATAL: {msg}", file=sys.stderr, flush=True)
  return status


NAN_STATUS, USAGE_STATUS, DAMAGED_STATUS, CRASH_STATUS, LOST_PEER_STATUS = 1, 2, 3, 4, 5
# How a lost peer reads on CPU (gloo) and through JAX's coordination service.
_LOST_PEER = re.compile(r"gloo|connection (reset|closed|refused)|by peer|heartbeat|"
                        r"coordination service|barrier timed out", re.IGNORECASE)
_processes: tuple[int, int] | None = None  # (process id, count) once jax.distributed started


def _lost_peer(e: BaseException) -> str | None:
  """The line of `e` (or of what caused it) that says a peer process is gone, else None."""
  seen: set[int] = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    for line in str(e).splitlines():
      if _LOST_PEER.search(line):
        return line.strip()[:300]
    e = e.__cause__ or e.__context__
  return None


def _crashed(e: Exception) -> int:
  """The report and status of an exception no check anticipated."""
  if _processes is not None:
    line = _lost_peer(e)
    if line:
      index, count = _processes
      return _failed(f"process {index} of {count} lost a peer process: {line}",
                     LOST_PEER_STATUS)
  traceback.print_exc()
  return _failed(f"unexpected error ({type(e).__name__}): a bug in attnx or the experiment; "
                 "the traceback is above", CRASH_STATUS)


def _fatal(msg: str) -> NoReturn:
  """A launch-time mistake found while parsing flags: the FATAL line and exit status 2."""
  sys.exit(_failed(msg))


# No default here: config_flags would load a default config while this module is imported,
# applying sys.argv's --config.KEY overrides, so a misspelt KEY would be a traceback before
# parse_flags runs. parse_flags passes --config=DEFAULT_CONFIG when the command line has none.
try:  # config_flags reads sys.argv's --flagfile files while it defines the flag
  _CONFIG = config_flags.DEFINE_config_file(
      "config", default=None,
      help_string="Experiment config: experiments/NAME.py[:PRESET] (default: "
                  "experiments/compare_weightings.py); override fields with "
                  "--config.KEY=VALUE (lists as comma-separated strings).\n"
                  + train_config.format_experiments(EXPERIMENTS_DIR))
except flags.Error as e:
  _fatal(f"flags parsing error: {e}")

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (default runs/<experiment>-<preset>); reruns resume.")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and their presets, then exit.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False,
    "Check the command line (config file, preset, overrides, flags, the workdir's path) and "
    "exit: 0 when a launch would start, 2 with the FATAL line it would print (checks that need "
    "the devices JAX finds, e.g. batch vs device count, are not made). Nothing is "
    "written, no data is prepared, JAX does not start.")


def default_workdir(config) -> str:
  name = config.get("experiment") or "experiment"
  preset = config.get("preset") or "default"
  return os.path.join("runs", f"{name}-{preset}")


# How config_flags recognizes --config itself and an override --config.KEY (or
# --noconfig.KEY for a boolean), one or two dashes.
_CONFIG_FLAG = re.compile(r"-{1,2}config(=|$)")
_OVERRIDE_FLAG = re.compile(r"-{1,2}(?:no)?config\.([^=]*)")


def _config_arg(argv: list[str]) -> str:
  """The --config value absl will use (the last one given), else the default experiment."""
  value = DEFAULT_CONFIG
  for i, a in enumerate(argv):
    m = _CONFIG_FLAG.match(a)
    if m and m.group(1) == "=":
      value = a.split("=", 1)[1]
    elif m and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def check_config_arg(argv: list[str]) -> str | None:
  """Error message for a --config file that does not exist or a preset it lacks, else None.

  config_flags would report either with a traceback of its own internals.
  """
  arg = _config_arg(argv)
  path, _, preset = arg.partition(":")
  if not os.path.isfile(path):
    return (f"no experiment config file {path!r} (from --config={arg}).\n"
            + train_config.format_experiments(EXPERIMENTS_DIR))
  try:
    module = train_config.load_module(path)
  except Exception as e:  # noqa: BLE001 - a syntax or import error in the experiment file
    return f"cannot load --config={arg}: {type(e).__name__}: {e}"
  missing = [f for f in ("get_config", "run") if not callable(getattr(module, f, None))]
  if missing:
    return (f"{path} (from --config={arg}) is not an experiment: it defines no "
            f"{' or '.join(missing)}; experiments define get_config(preset) and "
            "run(config, workdir)")
  presets = getattr(module, "PRESETS", None)
  name = os.path.splitext(os.path.basename(path))[0]
  if preset and presets is not None and preset not in presets:
    return f"unknown preset {preset!r} for {name}; valid presets: {', '.join(presets)}"
  try:
    module.get_config(preset or None)
  except ValueError as e:  # e.g. a preset the experiment rejects
    return f"{name}: {e}"
  return None


def _unknown_key(config, key: str) -> str | None:
  """Error message when the dotted `key` (e.g. "model.num_layers") is not in `config`, else None.

  Suggests the closest key at the level that lacks it, with its full dotted path.
  """
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts):
    where = ".".join(parts[:i])
    if not hasattr(node, "keys"):
      return (f"unknown config key {key!r}: {where!r} is a value "
              f"({type(node).__name__}), not a group of keys")
    if part not in node:
      keys = sorted(node.keys())
      close = difflib.get_close_matches(part, keys, n=1)
      if close:
        return (f"unknown config key {key!r} (did you mean "
                f"{'.'.join([*parts[:i], close[0], *parts[i + 1:]])!r}?)")
      return (f"unknown config key {key!r}; valid keys"
              f"{f' in {where!r}' if where else ''}: {', '.join(keys)}")
    node = node[part]
  return None


def check_overrides(argv: list[str]) -> str | None:
  """Error message for the first --config.KEY override whose KEY the config lacks, else None.

  config_flags would raise a KeyError traceback while absl parses the flags.
  """
  overrides = [m.group(1) for m in map(_OVERRIDE_FLAG.match, argv) if m]
  if not overrides:
    return None
  path, _, preset = _config_arg(argv).partition(":")
  try:
    config = train_config.load_module(path).get_config(preset or None)
  except Exception:  # noqa: BLE001 - check_config_arg reports load errors.
    return None
  for key in overrides:
    msg = _unknown_key(config, key)
    if msg:
      return msg
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing with readable errors for bad config files, presets and keys."""
  try:  # --flagfile=F: check the flags in F too (config_flags reads them the same way)
    expanded = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
  except flags.Error as e:
    _fatal(f"flags parsing error: {e}")
  msg = check_config_arg(expanded) or check_overrides(expanded)
  if msg:
    _fatal(msg)
  if not any(_CONFIG_FLAG.match(a) for a in expanded):
    argv = [argv[0], f"--config={DEFAULT_CONFIG}", *argv[1:]]
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    _fatal(f"flags parsing error: {e} (pass --helpfull to see the flags)")
  if len(rest) > 1:  # e.g. `launch.py experiments/x.py`: absl would print the whole --help
    _fatal(f"unexpected positional argument(s) {rest[1:]}; pass the experiment as "
           "--config=experiments/NAME.py[:PRESET] and the rest as --flag=value")
  return rest


def check_workdir(workdir: str, flag: bool = True, create: bool = True) -> str | None:
  """Create `workdir`; an error message when it is not a writable directory, else None.

  Checked before JAX starts: otherwise a file or a read-only path given as --workdir fails
  with an OSError traceback, possibly after the data was prepared. `flag`: whether the user
  gave it (else it is the default). `create=False` (a dry run) only checks that the path is
  not a file, and creates nothing.
  """
  name = f"--workdir={workdir}" if flag else f"the default workdir {workdir!r} (see --workdir)"
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    return f"{name} is a file, not a directory; name a directory for the run's outputs"
  if not create:
    return None
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    return f"{name} cannot be created: {e.strerror or e}"
  try:
    with tempfile.TemporaryFile(dir=workdir):  # a write probe: os.access ignores mounts/root
      pass
  except OSError as e:
    return f"{name} is not writable: {e.strerror or e}"
  return None


def main(argv: list[str]) -> int:
  """launch.py's status (module docstring) for the parsed command line."""
  try:
    status = _launch(argv)
  except Exception as e:  # noqa: BLE001 - anything unanticipated: status 4 (or 5), never 1
    status = _crashed(e)
  if status and _processes is not None and _processes[1] > 1:
    # At interpreter exit jax.distributed waits for every peer at a shutdown barrier: a
    # failed process would hang there until the peers finish or time out. Exit now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  return status


def _launch(argv: list[str]) -> int:
  del argv  # parse_flags rejected positional arguments
  if _LIST.value:
    print(train_config.format_experiments(EXPERIMENTS_DIR))
    return 0
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every save at INFO; keep the console to progress and results.
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":", 1)[0]
  module = train_config.load_module(path)  # parse_flags checked it defines get_config and run
  # Validate everything before JAX compiles (or even initializes) anything.
  try:
    train_config.validate(config, module)
  except ValueError as e:
    return _failed(f"invalid config: {e}")
  workdir = _WORKDIR.value or default_workdir(config)
  msg = check_workdir(workdir, flag=bool(_WORKDIR.value), create=not _DRY_RUN.value)
  if msg:
    return _failed(msg)
  if _DRY_RUN.value:
    print(f"Dry run: {config.get('experiment')}:{config.get('preset')} -> {workdir}: the "
          "command line is valid; nothing was run.")
    return 0

  import jax  # Device settings below must precede JAX's backend initialization.
  n = int(config.get("num_cpu_devices", 0) or 0)
  if n > 0:
    workarounds.fake_cpu_devices(n)  # with a collective timeout for busy machines
  if config.get("distributed", False):
    # Collectives between CPU devices of different processes go through gloo (JAX has none
    # by default); GPUs and TPUs use NCCL / ICI whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**train_config.distributed_kwargs(config))
    # initialize() installs JAX's preemption notifier on SIGTERM, which only logs it: a stop
    # (the launcher's, a scheduler's) would wait for SIGKILL. Checkpoints are written
    # atomically, so ending at once loses nothing beyond the last intact one.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    global _processes
    _processes = (jax.process_index(), jax.process_count())
  train_config.apply_data_dir(config)
  from attnx import train  # after the device settings above

  if "batch_size" in config:  # against the devices JAX found (GPUs, hosts): still no compile
    try:
      validate_parallel(config.get("parallel", "none"), int(config.batch_size),
                        int(config.get("sequence_parallel", 1)))
    except ValueError as e:
      return _failed(f"invalid config: config.{e}")

  main_process = train.is_main_process()
  if main_process:
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    print(f"Experiment {config.get('experiment')}:{config.get('preset')} -> {workdir} "
          f"({len(jax.devices())} {jax.default_backend()} device(s){processes})", flush=True)
  try:
    result = module.run(config, workdir) or {}
  except train.CheckpointMismatchError as e:
    return _failed(str(e))
  except train.CheckpointDamagedError as e:  # every checkpoint of a run; the files are kept
    return _failed(str(e), DAMAGED_STATUS)
  except train.NonFiniteLossError as e:
    return _failed(str(e), NAN_STATUS)
  report = result.get("report") if isinstance(result, dict) else None
  report = report or os.path.join(workdir, "report.md")
  if main_process:
    print(f"Report: {os.path.abspath(report)}", flush=True)
  diverged = train.nonfinite_runs()
  if diverged:  # the experiment reported the other runs; the launch still failed
    return _failed(f"{len(diverged)} run(s) stopped on a NaN/Inf loss:\n  "
                   + "\n  ".join(diverged), NAN_STATUS)
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
