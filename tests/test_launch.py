"""launch.py end to end in subprocesses: tiny preset, kill + resume, fast failures on bad flags."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from support import legs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "--config=experiments/compare_weightings.py:tiny"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """Private dataset and compilation caches, shared by this module's subprocesses."""
  base = tmp_path_factory.mktemp("launch_env")
  e = dict(os.environ)
  e.update(PYTHONPATH=ROOT + os.pathsep + e.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
           ATTNX_DATA_DIR=str(base / "data"))
  if legs.persistent_cache_safe():
    e.update(JAX_COMPILATION_CACHE_DIR=str(base / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return e


def _launch(env, *args, timeout=300):
  return subprocess.run([sys.executable, "launch.py", *args], capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(env, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("tiny") / "run")
  t0 = time.time()
  proc = _launch(env, TINY, f"--workdir={workdir}")
  return proc, workdir, time.time() - t0


def test_tiny_preset_end_to_end(tiny_run):
  proc, workdir, seconds = tiny_run
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"Report: {os.path.join(workdir, 'report.md')}" in proc.stdout
  with open(os.path.join(workdir, "report.md")) as f:
    report = f.read()
  assert "| weighting | accuracy |" in report and "| softmax |" in report and "| relu |" in report
  assert "same model, optimizer, budget and seeds" in report
  assert "digits_curves.png" in report and os.path.getsize(
      os.path.join(workdir, "digits_curves.png")) > 1000
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert results["tables"] and results["environment"]["versions"]["jax"]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert {r["run"] for r in records} == {"digits-softmax", "digits-relu"}
  assert all(len(r["loss"]) == 2 for r in records)  # 2 seeds per record
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints", "digits-softmax")))[-1] == "40"
  assert os.listdir(os.path.join(workdir, "tb"))
  final = json.load(open(os.path.join(workdir, "final_metrics.json")))
  acc = np.asarray(final["digits"]["softmax"]["accuracy"])
  assert acc.shape == (2,) and acc.mean() > 0.2  # 10 classes: chance is 0.1


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted(env, tmp_path):
  # One weighting and many short steps so that the kill lands in the middle of training (at
  # the first checkpoint, 10: 90 steps and 9 checkpoints, ≈ 1 s, are left to land it in).
  args = [TINY, "--config.weightings=softmax", "--config.num_steps=100",
          "--config.checkpoint_every=10", "--config.eval_every=50", "--config.log_every=10"]
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "killed")
  ref = subprocess.Popen([sys.executable, "launch.py", *args, f"--workdir={ref_dir}"],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
  victim = subprocess.Popen([sys.executable, "launch.py", *args, f"--workdir={run_dir}"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  ckpt_dir = os.path.join(run_dir, "checkpoints", "digits-softmax")
  deadline = time.time() + 240
  while time.time() < deadline and victim.poll() is None:
    if os.path.isdir(ckpt_dir) and any(d.isdigit() for d in os.listdir(ckpt_dir)):
      break
    time.sleep(0.05)
  assert victim.poll() is None, "run finished before it could be killed"
  victim.send_signal(signal.SIGKILL)
  victim.wait()
  saved = max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  assert saved < 100
  resumed = _launch(env, *args, f"--workdir={run_dir}")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming run 'digits-softmax' from step" in resumed.stderr
  step = int(resumed.stderr.split("Resuming run 'digits-softmax' from step ")[1].split()[0])
  assert 10 <= step < 100
  out, err = ref.communicate(timeout=300)
  assert ref.returncode == 0, err[-3000:]
  a = json.load(open(os.path.join(ref_dir, "final_metrics.json")))["digits"]["softmax"]
  b = json.load(open(os.path.join(run_dir, "final_metrics.json")))["digits"]["softmax"]
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(b[k], a[k], atol=1e-5, err_msg=k)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == sorted(set(steps)) and steps[-1] == 100  # no duplicated records


_EXH = pytest.mark.exhaustive


# Cases that repeat a rule another case checks (a choice list, ">= 1", an unwritable parent)
# run under -m exhaustive, which keeps CI within its 20 minutes.
@pytest.mark.parametrize("flags, expected", [
    ("--config.nope=1", r"^FATAL: unknown config key 'nope'; valid keys: .*num_seeds.*\n$"),
    ("--config.weightings=softmax,foo", r"config\.weightings.*'foo'.*relu.*sparsemax"),
    ("--config.parallel=dp", r"config\.parallel='dp'.*none, shard_map, pmap"),
    ("--config.data_pipeline=tfdata", r"config\.data_pipeline='tfdata'.*numpy, grain"),
    pytest.param("--config.optimizer.name=lion", r"config\.optimizer\.name='lion'.*adamw",
                 marks=_EXH),
    pytest.param("--config.tasks=digits,mnist", r"config\.tasks.*'mnist'.*digits, listops",
                 marks=_EXH),
    ("--config.parallel=pmap --config.num_cpu_devices=2 --config.batch_size=31",
     r"config\.batch_size=31 is not divisible by the 2 devices.*multiple of 2"),
    ("--config.data_dir=/nonexistent/tfds", r"config\.data_dir='/nonexistent/tfds' is not a dir"),
    ("--config=experiments/nope.py", r"no experiment config file 'experiments/nope\.py'"
                                     r"(.|\n)*compare_weightings: .*\n.*presets: default, tiny"),
    ("--config=experiments/compare_weightings.py:nope",
     r"^FATAL: unknown preset 'nope' for compare_weightings; valid presets: default, tiny, .*\n$"),
])
@pytest.mark.split_by_jax
def test_bad_flags_fail_fast_naming_key_and_choices(env, flags, expected):
  t0 = time.time()
  proc = _launch(env, TINY, *flags.split(), "--workdir=/nonexistent/should_not_be_created",
                 timeout=120)
  assert proc.returncode == 2
  assert re.search(expected, proc.stderr), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not os.path.exists("/nonexistent/should_not_be_created")
  assert time.time() - t0 < 60  # no data preparation, no compilation


# Issue 41: config_flags raised a KeyError traceback (exit 1) for these while absl parsed the
# flags, before launch.py's checks ran, whenever --config was left to its default.
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry_run"])
@pytest.mark.parametrize("key, suggestion", [("num_step", "num_steps"),
                                             ("model.num_layer", "model.num_layers")])
@pytest.mark.split_by_jax
def test_misspelt_config_key_is_one_fatal_line_with_the_closest_key(env, tmp_path, key,
                                                                    suggestion, dry_run):
  workdir = tmp_path / "not_created"
  proc = _launch(env, f"--config.{key}=2", f"--workdir={workdir}",
                 *(["--dry_run"] if dry_run else []), timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr == f"FATAL: unknown config key '{key}' (did you mean '{suggestion}'?)\n"
  assert not workdir.exists()


def test_missing_flagfile_is_one_fatal_line(env, tmp_path):
  # config_flags reads --flagfile while launch.py defines its flags, at import.
  proc = _launch(env, f"--flagfile={tmp_path / 'missing.flags'}", "--dry_run", timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.startswith("FATAL: flags parsing error:") and "missing.flags" in proc.stderr
  assert proc.stderr.count("\n") == 1, proc.stderr


def _key_paths(config, prefix: str = ""):
  """Every dotted key of a config: its groups and their keys, depth first."""
  for k in config.keys():
    yield prefix + k
    if hasattr(config[k], "keys"):
      yield from _key_paths(config[k], f"{prefix}{k}.")


def test_every_experiment_and_preset_names_a_misspelt_key_and_its_closest_match():
  """In process over launch.check_overrides (what parse_flags runs before absl parses the
  flags): every key at every depth of every experiment's presets, misspelt (an extra "x")."""
  import launch  # noqa: PLC0415
  from attnx.train import config as train_config  # noqa: PLC0415

  checked = 0
  for e in train_config.list_experiments(launch.EXPERIMENTS_DIR):
    for preset in e["presets"] or [""]:
      arg = f"--config={e['path']}" + (f":{preset}" if preset else "")
      config = train_config.load_module(e["path"]).get_config(preset or None)
      paths = list(_key_paths(config))
      overrides = [f"--config.{p}=1" for p in paths]
      assert launch.check_overrides(["launch.py", arg, *overrides]) is None, arg
      for p in paths:
        head, _, last = p.rpartition(".")
        typo = f"{head}.{last}x" if head else f"{last}x"
        msg = launch.check_overrides(["launch.py", arg, f"--config.{typo}=1"])
        assert msg == f"unknown config key '{typo}' (did you mean '{p}'?)", (arg, msg)
        checked += 1
  assert checked > 1000  # 15 experiments, 38 experiment-preset pairs


def _unwritable_dir(tmp_path) -> str:
  """A directory this user cannot write to: a chmod'ed one, or (as root) read-only /sys."""
  d = tmp_path / "readonly"
  d.mkdir()
  d.chmod(0o555)
  for candidate in (str(d), "/sys"):
    try:
      with tempfile.TemporaryFile(dir=candidate):
        pass
    except OSError:
      return candidate
  pytest.skip("no unwritable directory on this machine")


@pytest.mark.parametrize("flags, expected", [
    ("--workdir={file}", r"--workdir=\S+ is a file, not a directory"),
    ("--workdir={file}/sub", r"--workdir=\S+/sub cannot be created: Not a directory$"),
    ("--workdir={readonly}", r"--workdir=\S+ is not writable: \w+"),
    pytest.param("--workdir={readonly}/sub", r"--workdir=\S+/sub cannot be created: \w+",
                 marks=_EXH),
    ("--config.batch_size=5000", r"config\.batch_size=5000 is larger than the 1437 training "
                                 r"examples of task 'digits'; use at most 1437"),
    ("--config.num_steps=0", r"config\.num_steps must be >= 1, got 0"),
    pytest.param("--config.num_seeds=0", r"config\.num_seeds must be >= 1, got 0",
                 marks=_EXH),
    ("--config.checkpoint_every=-1", r"config\.checkpoint_every must be >= 0 \(0 turns it off"),
    pytest.param("--config.log_every=-1", r"config\.log_every must be >= 0",
                 marks=_EXH),
    pytest.param("--config.keep_checkpoints=0", r"config\.keep_checkpoints must be >= 1, got 0",
                 marks=_EXH),
    pytest.param("--config.model.num_heads=0", r"config\.model\.num_heads must be >= 1, got 0",
                 marks=_EXH),
    ("--config.model.patch_size=3", r"config\.model\.patch_size=3 does not divide the 8x8"),
    ("--config.num_steps=abc", r"flags parsing error: .*--config\.num_steps=abc"),
    ("experiments/compare_weightings.py", r"unexpected positional argument\(s\) "
                                          r"\['experiments/compare_weightings\.py'\]; .*--config="),
    ("--config=experiments/_common.py", r"experiments/_common\.py .* is not an experiment: it "
                                        r"defines no get_config or run"),
])
@pytest.mark.split_by_jax
def test_launch_time_mistakes_are_one_fatal_line_and_status_2(env, tmp_path, flags, expected):
  file = tmp_path / "a_file"
  file.write_text("not a directory")
  readonly = _unwritable_dir(tmp_path) if "{readonly}" in flags else ""
  args = flags.format(file=file, readonly=readonly).split()
  workdir = tmp_path / "not_created"
  if not any(a.startswith("--workdir=") for a in args):
    args.append(f"--workdir={workdir}")
  t0 = time.time()
  proc = _launch(env, TINY, *args, timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.startswith("FATAL: ") and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
  assert re.search(expected, proc.stderr), proc.stderr
  assert "Traceback" not in proc.stderr and not workdir.exists()
  assert time.time() - t0 < 60  # no data preparation, no compilation


STAND_IN = '''"""Stand-in experiment for launch.py's exit paths: a tiny Dense model, 4 steps."""
import os

import ml_collections
import numpy as np

from attnx import train

PRESETS = ("default",)


def get_config(preset=None) -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment, c.preset = "stand_in", preset or "default"
  c.update(learning_rate=0.1, nan=False, num_steps=4, batch_size=8, checkpoint_every=2)
  return c


def run(config, workdir):
  import flax.linen as nn

  import attnx.data

  print("CATALOG_DIR", attnx.data.catalog_data_dir(), flush=True)
  x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
  arrays = {"inputs": x * (np.nan if config.nan else 1.0), "targets": (x[:, 0] > 0) * 1}
  try:
    fit_config = train.FitConfig.from_config(
        config, optimizer=train.optimizer_config(learning_rate=config.learning_rate),
        progress=False, tensorboard=False, log_every=1)
    train.fit(nn.Dense(2), train_data=train.loader(arrays, config.batch_size),
              config=fit_config, workdir=workdir)
  except train.NonFiniteLossError as e:  # like compare_weightings: report the other runs
    print("diverged:", e, flush=True)
  path = os.path.join(workdir, "report.md")
  with open(path, "w") as f:
    f.write("stand-in report")
  return {"report": path}
'''


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
  path = tmp_path_factory.mktemp("experiments") / "stand_in.py"
  path.write_text(STAND_IN)
  return f"--config={path}"


def test_nan_run_exits_nonzero_after_writing_its_report(env, stand_in, tmp_path):
  proc = _launch(env, stand_in, "--config.nan=True", f"--workdir={tmp_path}")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert (tmp_path / "report.md").read_text() == "stand-in report"
  assert "FATAL: 1 run(s) stopped on a NaN/Inf loss" in proc.stderr
  assert "loss became NaN/Inf at step 0" in proc.stderr and "Traceback" not in proc.stderr


def test_changed_setup_on_rerun_fails_naming_it_and_data_dir_is_honoured(env, stand_in,
                                                                         tmp_path):
  wd = str(tmp_path / "wd")
  first = _launch(env, stand_in, f"--config.data_dir={tmp_path}", f"--workdir={wd}")
  assert first.returncode == 0, first.stderr[-3000:]
  assert f"CATALOG_DIR {tmp_path}" in first.stdout  # catalog datasets read from data_dir
  again = _launch(env, stand_in, "--config.learning_rate=0.2", f"--workdir={wd}")
  assert again.returncode == 2
  assert ("FATAL: run 'run': the checkpoint in " in again.stderr
          and "optimizer.learning_rate: 0.1 in the checkpoint, now 0.2" in again.stderr
          and "Use another --workdir" in again.stderr), again.stderr[-3000:]
  assert "Traceback" not in again.stderr


def _listing(root: str) -> dict[str, tuple[int, int]]:
  """Every path under root with its size (files) and modification time."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      st = os.stat(os.path.join(dirpath, name))
      size = st.st_size if name in filenames else 0
      out[os.path.relpath(os.path.join(dirpath, name), root)] = (size, st.st_mtime_ns)
  return out


def test_damaged_checkpoint_resumes_from_the_intact_one_and_none_intact_exits_3(env, stand_in,
                                                                                tmp_path):
  wd = str(tmp_path / "wd")
  ckpt = os.path.join(wd, "checkpoints", "run")
  first = _launch(env, stand_in, f"--workdir={wd}")
  assert first.returncode == 0, first.stderr[-3000:]
  assert sorted(os.listdir(ckpt)) == ["2", "4"]

  def truncate_arrays(step: int) -> None:  # as a full disk leaves them
    files = glob.glob(os.path.join(ckpt, str(step), "state", "**", "d", "*"), recursive=True)
    assert files
    for f in files:
      os.truncate(f, os.path.getsize(f) // 2)

  truncate_arrays(4)
  again = _launch(env, stand_in, f"--workdir={wd}")
  assert again.returncode == 0, again.stderr[-3000:]
  lines = again.stderr.splitlines()
  assert len(lines) == 2, again.stderr[-3000:]  # no orbax/tensorstore tracebacks
  assert lines[0].startswith(f"WARNING: run 'run': checkpoint step 4 in {ckpt} is damaged: ")
  assert lines[0].endswith("; trying step 2") and len(lines[0]) < 400
  assert lines[1] == f"Resuming run 'run' from step 2 ({ckpt})"
  assert "Report: " in again.stdout

  # Now every checkpoint is damaged (step 4 was saved again above): a distinct status, and
  # the files stay as they are for the user to inspect.
  truncate_arrays(2)
  with open(os.path.join(ckpt, "4", "meta", "metadata"), "r+") as f:
    f.truncate(10)
  before = _listing(wd)
  last = _launch(env, stand_in, f"--workdir={wd}")
  assert last.returncode == 3, last.stderr[-3000:]
  lines = last.stderr.splitlines()
  assert [line.split(" is damaged")[0] for line in lines[:2]] == [
      f"WARNING: run 'run': checkpoint step {s} in {ckpt}" for s in (4, 2)], last.stderr
  assert len(lines) == 3 and lines[2].startswith(
      f"FATAL: run 'run': no intact checkpoint in {ckpt} (step(s) 4, 2 cannot be read back; "
      "nothing was changed on disk)"), last.stderr
  assert "Traceback" not in last.stderr and "Report: " not in last.stdout
  assert _listing(wd) == before


def test_list_shows_experiments_and_presets(env):
  proc = _launch(env, "--list", timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "compare_weightings:" in proc.stdout
  from experiments import compare_weightings  # noqa: PLC0415
  assert ", ".join(compare_weightings.PRESETS) in proc.stdout


def test_dry_run_checks_the_command_line_and_runs_nothing(env, tmp_path):
  workdir = tmp_path / "not_created"
  ok = _launch(env, TINY, f"--workdir={workdir}", "--config.num_steps=7", "--dry_run",
               timeout=120)
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "compare_weightings:tiny" in ok.stdout and "nothing was run" in ok.stdout
  assert not workdir.exists()
  bad = _launch(env, TINY, f"--workdir={workdir}", "--config.num_steps=0", "--dry_run",
                timeout=120)
  assert bad.returncode == 2 and bad.stderr.startswith("FATAL: ")
  assert "config.num_steps must be >= 1" in bad.stderr and not workdir.exists()
  file = tmp_path / "a_file"
  file.write_text("x")
  assert _launch(env, TINY, f"--workdir={file}", "--dry_run", timeout=120).returncode == 2
