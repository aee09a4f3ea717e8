"""attnx.launch_local: N JAX processes on this machine, end to end in subprocesses.

Two processes with two fake CPU devices each (gloo collectives) against one process with four:
the same parameters after 20 SGD steps; a dead process stops the others within seconds; a
SIGKILLed two-process run resumes from its last checkpoint and ends bit-identical to an
uninterrupted one; only process 0 writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.checkpoints import read_state
from support.scripts import ROOT, cpu_env, metric_records

TINY = "--config=experiments/compare_weightings.py:tiny"
# The default experiment's model family (a ViT on digits) at the tiny preset's size, one seed,
# plain SGD: an update proportional to the gradient shows a wrongly reduced gradient (adam is
# invariant to its scale), and without clipping or decay nothing else enters.
SGD = [TINY, "--config.weightings=softmax", "--config.num_seeds=1", "--config.num_steps=20",
       "--config.checkpoint_every=10", "--config.eval_every=0", "--config.progress=False",
       "--config.optimizer.name=sgd", "--config.optimizer.momentum=0.0",
       "--config.optimizer.schedule=constant", "--config.optimizer.learning_rate=0.02",
       "--config.optimizer.weight_decay=0.0", "--config.optimizer.grad_clip_norm=0.0",
       "--config.max_eval_examples=100"]
RUN = "digits-softmax"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return cpu_env(ATTNX_DATA_DIR=str(tmp_path_factory.mktemp("launch_local_env") / "data"))


def _local(env, n, *args, devices=2, timeout=300, grace=5.0, **kw):
  cmd = [sys.executable, "-m", "attnx.launch_local", "-n", str(n),
         f"--devices_per_process={devices}", f"--grace_seconds={grace}", "--", *args]
  return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=timeout, **kw)


def _launch(env, *args, timeout=300):
  return subprocess.run([sys.executable, "launch.py", *args], capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=timeout)


def _params(workdir: str, step: int) -> list[np.ndarray]:
  import jax  # noqa: PLC0415

  return [np.asarray(x) for x in jax.tree.leaves(read_state(workdir, RUN, step)["params"])]


def _max_rel(a: list[np.ndarray], b: list[np.ndarray]) -> float:
  """max |a - b| over every parameter / max |b| over every parameter."""
  diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))
  return diff / max(float(np.max(np.abs(y))) for y in b)


# -m exhaustive (CI time): two processes against one; and below, the SIGKILL-resume of a
# two-process run (CI runs tests/test_launch.py's one-process SIGKILL resume and the launcher's
# kill handling here) and the data-by-sequence mesh across two processes (CI runs the
# sequence-parallel preset on fake devices in one process:
# tests/experiments/test_language_model.py).
@pytest.mark.exhaustive
def test_two_processes_train_the_default_model_like_one_with_four_devices(env, tmp_path):
  two = _local(env, 2, "launch.py", *SGD, "--config.parallel=shard_map",
               f"--workdir={tmp_path / 'two'}")
  assert two.returncode == 0, two.stderr[-3000:]
  # Process 0 alone reports; its lines carry its rank.
  assert "[0] Experiment compare_weightings:tiny" in two.stdout
  assert "(4 cpu device(s) in 2 processes)" in two.stdout
  assert "[1] Experiment" not in two.stdout and "[1] Report" not in two.stdout
  assert "[0] Report: " in two.stdout
  for args, name in ((["--config.num_cpu_devices=4", "--config.parallel=shard_map"], "four"),
                     (["--config.parallel=none"], "one")):
    proc = _launch(env, *SGD, *args, f"--workdir={tmp_path / name}")
    assert proc.returncode == 0, proc.stderr[-3000:]
  pmap = _local(env, 2, "launch.py", *SGD, "--config.parallel=pmap",
                f"--workdir={tmp_path / 'two_pmap'}")
  assert pmap.returncode == 0, pmap.stderr[-3000:]
  two_p, four_p, one_p, pmap_p = (_params(str(tmp_path / n), 20)
                                  for n in ("two", "four", "one", "two_pmap"))
  assert _max_rel(two_p, four_p) <= 1e-6, _max_rel(two_p, four_p)
  assert _max_rel(two_p, one_p) <= 1e-6, _max_rel(two_p, one_p)
  assert _max_rel(pmap_p, one_p) <= 1e-6, _max_rel(pmap_p, one_p)
  # Not vacuous: the last 10 steps alone moved the parameters far beyond that tolerance.
  assert _max_rel(_params(str(tmp_path / "one"), 10), one_p) > 1e-3
  # One set of report files, from process 0 (metrics.jsonl has one record per log step).
  with open(tmp_path / "two" / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == [10, 20]
  assert (tmp_path / "two" / "report.md").is_file()
  assert len(os.listdir(tmp_path / "two" / "tb" / RUN)) == 1  # one TensorBoard event file


def _pids(workdir: str, rank: int) -> list[int]:
  """PIDs of the launch.py processes of `workdir` with process id `rank`."""
  found = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if (f"--workdir={workdir}".encode() in argv
        and f"--config.process_id={rank}".encode() in argv):
      found.append(int(pid))
  return found


def test_a_dead_process_stops_the_others(env, tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(
      "import sys, time\n"
      "rank = int([a for a in sys.argv if a.startswith('--config.process_id=')][0][-1])\n"
      "print(f'hello from {rank}', flush=True)\n"
      "if rank == 1:\n"
      "  print('giving up', file=sys.stderr, flush=True)\n"
      "  time.sleep(0.5)\n"
      "  sys.exit(3)\n"
      "time.sleep(120)\n")
  t0 = time.time()
  proc = _local(env, 2, str(script), devices=0, timeout=60)
  assert proc.returncode == 3, (proc.returncode, proc.stderr)
  assert time.time() - t0 < 15
  assert "[0] hello from 0" in proc.stdout and "[1] hello from 1" in proc.stdout
  assert "[1] giving up" in proc.stderr
  assert "launch_local: process 1 exited with status 3; stopping the others" in proc.stderr


FAILING = "--config=" + os.path.join(ROOT, "tests", "support", "failing_experiment.py")


@pytest.mark.parametrize("command", [
    ["--config=experiments/compare_weightings.py:tiny"],  # launch.py left out
    ["no_such_script.py", "--config=x"],
    ["no-such-program-attnx", "--flag"],
], ids=["a_flag", "a_missing_script", "a_missing_program"])
def test_a_command_that_cannot_run_is_one_line_and_status_2_before_anything_starts(env,
                                                                                   command):
  proc = _local(env, 2, *command, timeout=60)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("launch_local: "), proc.stderr[-2000:]
  assert "-- launch.py --config=" in lines[0]  # how the command should look
  assert "Traceback" not in proc.stderr and not proc.stdout


def test_an_unexpected_error_is_status_4_not_the_nan_status(env, tmp_path):
  proc = _launch(env, FAILING, "--config.rank=0", f"--workdir={tmp_path}", timeout=120)
  assert proc.returncode == 4, (proc.returncode, proc.stderr[-2000:])
  assert "RuntimeError: the experiment broke" in proc.stderr  # the traceback, for a bug
  assert proc.stderr.strip().splitlines()[-1].startswith("FATAL: unexpected error")


def _timed_local(env, *args, grace=60):
  t0 = time.time()
  proc = _local(env, 2, "launch.py", *args, devices=0, timeout=200, grace=grace)
  return proc, time.time() - t0


@pytest.mark.parametrize("behaviour,status,line", [
    ("raise", 4, "process 1 exited with status 4; stopping the others"),
    ("kill", 137, "process 1 was killed by signal 9 (SIGKILL; status 137); stopping the others"),
])
def test_a_failed_rank_gives_its_status_and_sigterm_stops_the_others_at_once(
    env, tmp_path, behaviour, status, line):
  # Process 0 sleeps outside JAX: only the launcher's SIGTERM can end it, within the grace
  # of 60 s. Before, JAX's preemption notifier swallowed SIGTERM (every stop took the grace),
  # and a raising process hung at JAX's shutdown barrier until its peers were done.
  proc, seconds = _timed_local(env, FAILING, f"--config.behaviour={behaviour}",
                               "--config.talk=False", f"--workdir={tmp_path}")
  assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
  assert f"launch_local: {line}" in proc.stderr, proc.stderr[-3000:]
  assert "launch_local: stopped process 0 (SIGTERM)" in proc.stderr, proc.stderr[-3000:]
  assert seconds < 40, seconds
  assert "[0] Traceback" not in proc.stderr


def test_a_lost_peer_is_one_line_per_survivor_and_the_cause_gives_the_status(env, tmp_path):
  # Process 0 keeps calling collectives with the dead process 1: gloo fails at once.
  proc, seconds = _timed_local(env, FAILING, "--config.behaviour=kill", "--config.talk=True",
                               f"--workdir={tmp_path}")
  assert proc.returncode == 137, (proc.returncode, proc.stderr[-3000:])  # the cause, not 5
  assert "launch_local: process 1 was killed by signal 9" in proc.stderr
  assert seconds < 40, seconds
  zero = [x for x in proc.stderr.splitlines() if x.startswith("[0] ")]
  assert not any("Traceback" in x for x in zero), proc.stderr[-3000:]
  fatal = [x for x in zero if "FATAL" in x]
  # Either process 0 saw the loss first (its one line), or the launcher stopped it first.
  assert (fatal == [x for x in zero if x.startswith("[0] FATAL: process 0 of 2 lost a peer "
                                                    "process: ")]), proc.stderr[-3000:]
  assert len(fatal) == 1 or "stopped process 0 (SIGTERM)" in proc.stderr, proc.stderr[-3000:]


def test_without_the_launcher_a_lost_peer_ends_the_survivor_with_status_5(env, tmp_path):
  port = subprocess.check_output([sys.executable, "-c", "from attnx.launch_local import "
                                  "free_port; print(free_port())"], env=env, text=True).strip()
  common = [sys.executable, "launch.py", FAILING, "--config.behaviour=kill", "--config.talk=True",
            "--config.distributed=True", f"--config.coordinator_address=127.0.0.1:{port}",
            "--config.num_processes=2", "--config.heartbeat_timeout_seconds=30",
            f"--workdir={tmp_path}"]
  t0 = time.time()
  procs = [subprocess.Popen(common + [f"--config.process_id={r}"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for r in (0, 1)]
  try:
    out, err = procs[0].communicate(timeout=120)
  finally:
    for p in procs:
      p.kill()
      p.wait()
  assert procs[0].returncode == 5, (procs[0].returncode, err[-3000:])
  assert time.time() - t0 < 25  # not the heartbeat timeout's 30 s
  assert "Traceback" not in err, err[-3000:]
  fatal = [x for x in err.splitlines() if x.startswith("FATAL")]
  assert len(fatal) == 1 and fatal[0].startswith("FATAL: process 0 of 2 lost a peer process: ")


def test_bad_launcher_arguments_fail_with_usage(env):
  proc = _local(env, 0, "launch.py", timeout=60)
  assert proc.returncode == 2 and "-n must be >= 1" in proc.stderr
  proc = subprocess.run([sys.executable, "-m", "attnx.launch_local", "-n", "2"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
  assert proc.returncode == 2 and "no command" in proc.stderr


@pytest.mark.exhaustive
def test_sigkill_of_one_training_process_then_resume_is_bit_identical(env, tmp_path):
  # 60 steps, a checkpoint every 10, killed once the second (step 20) is committed: 40 steps
  # (seconds: a two-process step takes tens of ms) are left to land the kill in, and the
  # resumed run passes an evaluation (every 30) and more checkpoints.
  args = [TINY, "--config.weightings=softmax", "--config.num_seeds=1", "--config.num_steps=60",
          "--config.checkpoint_every=10", "--config.log_every=10", "--config.eval_every=30",
          "--config.parallel=shard_map", "--config.progress=False"]
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "killed")
  ref = _local(env, 2, "launch.py", *args, f"--workdir={ref_dir}")
  assert ref.returncode == 0, ref.stderr[-3000:]
  cmd = [sys.executable, "-m", "attnx.launch_local", "-n", "2", "--devices_per_process=2",
         "--", "launch.py", *args, f"--workdir={run_dir}"]
  launcher = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
  ckpt = os.path.join(run_dir, "checkpoints", RUN)
  deadline = time.time() + 240
  while time.time() < deadline and launcher.poll() is None:
    if os.path.exists(os.path.join(ckpt, "20", "commit_success.txt")):
      break
    time.sleep(0.02)
  assert launcher.poll() is None, "run finished before it could be killed"
  victims = _pids(run_dir, 1)
  assert len(victims) == 1, victims
  os.kill(victims[0], signal.SIGKILL)
  killed_at = time.time()
  out, err = launcher.communicate(timeout=60)
  assert time.time() - killed_at < 30
  # Process 1's SIGKILL is the cause, even when process 0 reports the lost peer first.
  assert launcher.returncode == 137, err[-2000:]
  assert "launch_local: process 1 was killed by signal 9 (SIGKILL; status 137)" in err, (
      err[-2000:])
  assert "[0] Traceback" not in err, err[-2000:]
  assert not _pids(run_dir, 0), "process 0 outlived the launcher"
  saved = max(int(d) for d in os.listdir(ckpt) if d.isdigit())
  assert 20 <= saved < 60
  resumed = _local(env, 2, "launch.py", *args, f"--workdir={run_dir}")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Resuming run '{RUN}' from step" in resumed.stderr
  a, b = read_state(ref_dir, RUN, 60), read_state(run_dir, RUN, 60)
  import jax  # noqa: PLC0415

  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(10, 61, 10))  # no duplicated or lost records


@pytest.mark.exhaustive
def test_data_by_sequence_mesh_across_two_processes_trains_the_one_device_losses(env, tmp_path):
  # The language model's sequence-parallel preset (GPT, zigzag ring attention) on 2 processes
  # x 2 fake CPU devices: a 2 x 2 (data, seq) mesh (each process holds half the rows), and a
  # 1 x 4 one (each process holds half of every sequence), against one device.
  lm = ["--config=experiments/language_model.py:sequence_parallel",
        "--config.weightings=softmax", "--config.num_steps=10", "--config.log_every=5",
        "--config.eval_every=10", "--config.batch_size=4"]
  whole = _launch(env, *lm, "--config.sequence_parallel=1", "--config.parallel=none",
                  "--config.num_cpu_devices=0", f"--workdir={tmp_path / 'whole'}")
  assert whole.returncode == 0, whole.stderr[-3000:]
  ref = metric_records(tmp_path / "whole")
  for sp in (2, 4):
    proc = _local(env, 2, "launch.py", *lm, f"--config.sequence_parallel={sp}",
                  f"--workdir={tmp_path / f'sp{sp}'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metric_records(tmp_path / f"sp{sp}")
    assert got.keys() == ref.keys() and len(ref) == 2
    for key, rec in ref.items():
      for metric in ("loss", "eval_loss"):
        if metric in rec:
          np.testing.assert_allclose(got[key][metric], rec[metric], rtol=1e-5,
                                     err_msg=f"sp={sp} {key} {metric}")

