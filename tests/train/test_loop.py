"""attnx.train.loop (fit): vmap over seeds == sequential runs, resume, NaN detection, the
reference run.

support/fit_reference.json holds the history, metrics.jsonl records, final metrics and
parameters of one small run (logging, evaluation and checkpoints on different periods, plus a
resume from a mid-run checkpoint), written by the loop as it was before its periodic work became
separate actions. On the platform that wrote it they must match bit for bit (same XLA flags:
tests/conftest.py); elsewhere a different CPU may round differently, so there they are compared
to float32 round-off.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import jaxlib
import numpy as np
import optax
import pytest
from support.kill_run import tensorboard_scalars
from support.train_stand_ins import TinyMLP, make_arrays
from support.two_cpu_run import ROOT

from attnx import train

REFERENCE = os.path.join(ROOT, "tests", "support", "fit_reference.json")


@pytest.fixture
def arrays():
  return make_arrays()


_FIT_ARGS = ("model", "train_data", "workdir", "name", "eval_fn", "eval_data", "eval_metrics",
             "inputs_fn", "fingerprint")


def _fit(arrays, **kw):
  """fit with test defaults; keyword arguments go to fit or to its FitConfig, by name."""
  args = dict(train_data=train.loader(arrays, 16), eval_data=train.loader(arrays, 64))
  config = dict(optimizer=train.optimizer_config(learning_rate=1e-2, warmup_steps=3),
                num_steps=12, log_every=4, progress=False, tensorboard=False)
  for k, v in kw.items():
    (args if k in _FIT_ARGS else config)[k] = v
  model = args.pop("model", TinyMLP(dropout_rate=0.2))
  return train.fit(model, config=train.FitConfig(**config), **args)


def test_vmap_seeds_equal_sequential_runs(arrays):
  stacked = _fit(arrays, num_seeds=3, seed=5, eval_data=None)
  assert stacked.seeds == [5, 6, 7]
  for i in range(3):
    single = _fit(arrays, num_seeds=1, seed=5 + i, eval_data=None)
    jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b[0], atol=1e-5, rtol=1e-5),
                 stacked.params, single.params)
    for k, v in single.final_metrics.items():
      np.testing.assert_allclose(stacked.final_metrics[k][i], v[0], atol=1e-5, err_msg=k)
  # Seeds differ from one another (so the comparison above is not vacuous).
  leaf = jax.tree.leaves(stacked.params)[0]
  assert not np.allclose(leaf[0], leaf[1])
  assert stacked.final_metrics["train_accuracy"].shape == (3,)
  assert stacked.compile_seconds > 0 and stacked.seconds_per_step > 0
  assert [h["step"] for h in stacked.history] == [4, 8, 12]
  assert len(stacked.history[-1]["loss"]) == 3


def test_resume_from_checkpoint_is_exact(arrays, tmp_path):
  wd = str(tmp_path / "wd")
  full = _fit(arrays, num_seeds=2, num_steps=12, workdir=wd, checkpoint_every=4,
              tensorboard=True)
  # Simulate an interruption after step 8: drop the final checkpoint.
  shutil.rmtree(os.path.join(wd, "checkpoints", "run", "12"))
  resumed = _fit(arrays, num_seeds=2, num_steps=12, workdir=wd, checkpoint_every=4,
                 tensorboard=True)
  assert full.start_step == 0 and resumed.start_step == 8
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), full.params,
               resumed.params)
  for k in full.final_metrics:
    np.testing.assert_allclose(resumed.final_metrics[k], full.final_metrics[k], atol=1e-6)
  assert [h["step"] for h in resumed.history] == [4, 8, 12]
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == [4, 8, 12]  # no duplicates after the resume
  # TensorBoard too: the first run's step-12 events are purged, the resumed run's kept.
  tb = tensorboard_scalars(os.path.join(wd, "tb", "run"), "loss/mean")
  assert [s for s, _ in tb] == [4, 8, 12]
  np.testing.assert_allclose(tb[-1][1], np.mean(resumed.history[-1]["loss"]), rtol=1e-6)
  # A finished run resumes at its last step without training, and reports the timing of the
  # processes that trained it.
  again = _fit(arrays, num_seeds=2, num_steps=12, workdir=wd, checkpoint_every=4)
  assert again.start_step == 12
  np.testing.assert_allclose(again.final_metrics["accuracy"], full.final_metrics["accuracy"])
  np.testing.assert_allclose(again.final_metrics["train_loss"], full.final_metrics["train_loss"],
                             atol=1e-6)
  assert np.isfinite(again.seconds_per_step) and again.seconds_per_step > 0
  assert again.seconds_per_step == pytest.approx(resumed.seconds_per_step, rel=0.5)
  assert again.compile_seconds == resumed.compile_seconds


def test_tensorboard_events_survive_sigkill(tmp_path):
  # A real SIGKILL after the step-8 checkpoint (support/kill_run.py): the events logged up to it
  # must be on disk, and the resumed run continues them without duplicates or gaps.
  wd = str(tmp_path / "wd")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  script = os.path.join(ROOT, "tests", "support", "kill_run.py")
  proc = subprocess.run([sys.executable, script, wd, "10"], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=240)
  assert proc.returncode == -9, proc.stderr[-3000:]
  assert sorted(os.listdir(os.path.join(wd, "checkpoints", "run"))) == ["4", "8"]
  from support.kill_run import run

  resumed = run(wd)
  assert resumed.start_step == 8
  tb = tensorboard_scalars(os.path.join(wd, "tb", "run"), "loss/mean")
  assert [s for s, _ in tb] == [2, 4, 6, 8, 10, 12]
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    losses = {r["step"]: r["loss"][0] for r in map(json.loads, f)}
  np.testing.assert_allclose([v for _, v in tb], [losses[s] for s, _ in tb], rtol=1e-6)


def test_resume_with_changed_setup_fails_naming_the_differences(arrays, tmp_path):
  wd = str(tmp_path / "wd")
  first = _fit(arrays, num_seeds=2, num_steps=8, workdir=wd, checkpoint_every=4)
  changes = [
      (dict(optimizer=train.optimizer_config(learning_rate=2e-2, warmup_steps=3)),
       r"optimizer\.learning_rate: 0\.01 in the checkpoint, now 0\.02"),
      (dict(num_seeds=3), r"seeds: \[0, 1\] in the checkpoint, now \[0, 1, 2\]"),
      (dict(model=TinyMLP(features=32, dropout_rate=0.2)), r"model\.features: 16 .* now 32"),
      (dict(num_steps=16), r"num_steps: 8 .* now 16"),
      (dict(train_data=train.loader(make_arrays(seed=1), 16)), r"data\.first_batch"),
      (dict(fingerprint={"task": "other"}), r"task: null in the checkpoint, now \"other\""),
  ]
  for kw, expected in changes:
    with pytest.raises(train.CheckpointMismatchError, match=expected) as e:
      _fit(arrays, **{"num_seeds": 2, "num_steps": 8, "workdir": wd, "checkpoint_every": 4,
                      **kw})
    assert "another --workdir" in str(e.value)
  # The unchanged setup still resumes (the finished run) with the same results.
  again = _fit(arrays, num_seeds=2, num_steps=8, workdir=wd, checkpoint_every=4)
  assert again.start_step == 8
  np.testing.assert_allclose(again.final_metrics["accuracy"], first.final_metrics["accuracy"])


def test_nan_loss_stops_with_step_and_seeds(arrays):
  bad = dict(arrays)

  def data(seed, start):
    for i, b in enumerate(train.array_stream(bad, 16, seed, start), start=start):
      if seed == 1 and i >= 5:
        b = dict(b, inputs=np.full_like(b["inputs"], np.nan))
      yield b

  with pytest.raises(train.NonFiniteLossError, match=r"step 5 for seed\(s\) \[1\]") as e:
    _fit(arrays, train_data=data, num_seeds=2, num_steps=20, log_every=10)
  assert "enable gradient clipping (optimizer.grad_clip_norm" in str(e.value)
  assert train.nonfinite_runs()[-1] == str(e.value)  # launch.py exits non-zero on these
  # With clipping already on, the message does not suggest it.
  clipped = train.optimizer_config(learning_rate=1e-2, grad_clip_norm=1.0)
  with pytest.raises(train.NonFiniteLossError, match="clipping at norm 1 is already on") as e:
    _fit(arrays, train_data=data, num_seeds=2, num_steps=20, log_every=10, optimizer=clipped)
  assert "enable" not in str(e.value)


def test_custom_loss_eval_fn_and_optax_optimizer(arrays):
  def loss(outputs, batch):
    l, m = train.softmax_xent(outputs, batch)
    return l, {"acc": m["accuracy"]}

  calls = []

  def eval_fn(params):
    calls.append(jax.tree.leaves(params)[0].shape[0])
    return {"score": np.arange(2.0)}

  r = _fit(arrays, loss=loss, eval_fn=eval_fn, eval_data=None, optimizer=optax.sgd(0.1),
           num_seeds=2, eval_every=6, model=TinyMLP())
  assert calls == [2, 2]
  np.testing.assert_array_equal(r.final_metrics["score"], [0.0, 1.0])
  assert "train_acc" in r.final_metrics and "eval_score" in r.history[-1]


def _platform() -> dict[str, str]:
  cpu = platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
  except OSError:
    pass
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "backend": jax.default_backend(), "cpu": cpu}


def _run(workdir: str) -> dict:
  arrays = make_arrays()
  # Logs at 3, 6, 9; evaluations at 4, 8 (records of their own); checkpoints at 5 (no record);
  # everything at 10.
  config = train.FitConfig(
      optimizer=train.optimizer_config(learning_rate=1e-2, warmup_steps=3), num_steps=10,
      num_seeds=2, seed=3, log_every=3, eval_every=4, checkpoint_every=5, progress=False,
      tensorboard=False)
  r = train.fit(TinyMLP(dropout_rate=0.2), train_data=train.loader(arrays, 16),
                eval_data=train.loader(arrays, 64), config=config, workdir=workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    jsonl = [json.loads(line) for line in f]
  return {"history": r.history, "jsonl": jsonl,
          "final_metrics": {k: np.asarray(v).tolist() for k, v in r.final_metrics.items()},
          "params": jax.tree.map(lambda x: np.asarray(x).tolist(), r.params),
          "start_step": r.start_step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
  wd = str(tmp_path_factory.mktemp("reference") / "wd")
  full = _run(wd)
  shutil.rmtree(os.path.join(wd, "checkpoints", "run", "10"))  # killed after step 5's save
  return {"full": full, "resumed": _run(wd)}


def _assert_same(got, want, exact: bool, where: str = "") -> None:
  if isinstance(want, dict):
    assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"  # order too
    for k in want:
      _assert_same(got[k], want[k], exact, f"{where}.{k}")
  elif isinstance(want, list) and want and isinstance(want[0], dict | list):
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
      _assert_same(g, w, exact, f"{where}[{i}]")
  elif exact or not isinstance(want, float | list):
    assert got == want, f"{where}: {got} != {want}"
  else:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=where)


@pytest.mark.parametrize("which", ["full", "resumed"])
def test_fit_matches_the_reference_run(runs, which):
  with open(REFERENCE) as f:
    reference = json.load(f)
  exact = reference["platform"] == _platform()
  got, want = runs[which], reference[which]
  assert got["start_step"] == want["start_step"] == (0 if which == "full" else 5)
  assert [h["step"] for h in got["history"]] == [3, 4, 6, 8, 9, 10]
  for key in ("history", "jsonl", "final_metrics", "params"):
    _assert_same(got[key], want[key], exact, f"{which}.{key}")
