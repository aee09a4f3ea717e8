"""Checkpointer: a damaged checkpoint is skipped for the newest intact one, never fatal or noisy.

Damage is done to a real run's files the way a full disk or a killed copy leaves them (a
truncated array file, a deleted one, truncated JSON), then the same `fit` is called again.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import sys
import types

import jax
import numpy as np
import pytest
from support.train_stand_ins import TinyMLP, make_arrays

from attnx import train
from attnx.train import checkpoint

STEPS, EVERY = 12, 4  # checkpoints at 4, 8, 12


def _fit(workdir: str, **kw) -> train.FitResult:
  """The reference run's fit; keyword arguments replace FitConfig fields."""
  arrays = make_arrays()
  config = train.FitConfig(
      optimizer=train.optimizer_config(learning_rate=1e-2, warmup_steps=3), num_seeds=2,
      num_steps=STEPS, log_every=4, progress=False, tensorboard=False, checkpoint_every=EVERY)
  return train.fit(TinyMLP(dropout_rate=0.2), train_data=train.loader(arrays, 16),
                   eval_data=train.loader(arrays, 64), workdir=workdir,
                   config=dataclasses.replace(config, **kw))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An undamaged finished run: its workdir (to copy) and its result."""
  wd = str(tmp_path_factory.mktemp("reference") / "wd")
  return wd, _fit(wd)


def _copy(reference, tmp_path) -> tuple[str, str]:
  wd = str(tmp_path / "wd")
  shutil.copytree(reference[0], wd)
  return wd, os.path.join(wd, "checkpoints", "run")


def _data_files(step_dir: str) -> list[str]:
  """The array chunk files of a checkpoint's state (what its OCDBT manifest points into)."""
  files = sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True))
  assert files, os.listdir(os.path.join(step_dir, "state"))
  return files


def _truncate(path: str, keep: float = 0.5) -> None:
  size = os.path.getsize(path)
  assert size > 2
  with open(path, "r+b") as f:
    f.truncate(int(size * keep))


def _truncate_data(step_dir: str) -> None:
  for f in _data_files(step_dir):
    _truncate(f)


def _delete_data(step_dir: str) -> None:
  for f in _data_files(step_dir):
    os.remove(f)


def _truncate_meta_json(step_dir: str) -> None:  # the "meta" item: fit's own JSON
  _truncate(os.path.join(step_dir, "meta", "metadata"))


def _truncate_orbax_metadata(step_dir: str) -> None:  # orbax's tree metadata of the state
  _truncate(os.path.join(step_dir, "state", "_METADATA"))


def _delete_manifest(step_dir: str) -> None:
  os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))


def _delete_meta_item(step_dir: str) -> None:
  shutil.rmtree(os.path.join(step_dir, "meta"))


DAMAGES = [_truncate_data, _delete_data, _truncate_meta_json, _truncate_orbax_metadata,
           _delete_manifest, _delete_meta_item]


def _listing(root: str) -> dict[str, tuple[int, int]]:
  """Every path under root with its size and modification time."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      p = os.path.join(dirpath, name)
      st = os.stat(p)
      out[os.path.relpath(p, root)] = (st.st_size if name in filenames else 0, st.st_mtime_ns)
  return out


@pytest.fixture
def unraisables(monkeypatch):
  """Unraisable exceptions reported while the test runs (past attnx's filter)."""
  seen: list[BaseException] = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
  return seen


def _assert_same(result: train.FitResult, ref: train.FitResult) -> None:
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), result.params,
               ref.params)
  for k in ref.final_metrics:
    np.testing.assert_allclose(result.final_metrics[k], ref.final_metrics[k], atol=1e-6,
                               err_msg=k)


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.split_by_jax
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path, damage,
                                                                   capsys, caplog, unraisables):
  wd, ckpt_dir = _copy(reference, tmp_path)
  damage(os.path.join(ckpt_dir, "12"))
  capsys.readouterr()
  with caplog.at_level(logging.DEBUG):
    resumed = _fit(wd)
  err = capsys.readouterr().err
  assert resumed.start_step == 8
  _assert_same(resumed, reference[1])
  lines = err.strip().splitlines()
  warnings = [line for line in lines if line.startswith("WARNING")]
  assert len(warnings) == 1, err
  assert (warnings[0].startswith("WARNING: run 'run': checkpoint step 12 in ")
          and f"{ckpt_dir} is damaged" in warnings[0] and "trying step 8" in warnings[0]), err
  assert len(warnings[0]) < 400, warnings[0]
  assert lines[-1] == f"Resuming run 'run' from step 8 ({ckpt_dir})", err
  assert len(lines) == 2 and "Traceback" not in err, err
  # No stray reports of the failed read (unraisable tracebacks, error logs).
  import gc

  gc.collect()
  assert not unraisables, unraisables
  noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
  assert not noisy, [r.getMessage()[:200] for r in noisy]
  # Training past step 8 replaced the damaged step 12 with an intact one.
  assert sorted(os.listdir(ckpt_dir)) == ["12", "4", "8"]
  again = _fit(wd)
  assert again.start_step == 12
  _assert_same(again, reference[1])


def test_damage_in_two_checkpoints_falls_back_two_steps(reference, tmp_path, capsys):
  wd, ckpt_dir = _copy(reference, tmp_path)
  _truncate_data(os.path.join(ckpt_dir, "12"))
  _truncate_meta_json(os.path.join(ckpt_dir, "8"))
  resumed = _fit(wd)
  err = capsys.readouterr().err
  assert resumed.start_step == 4
  _assert_same(resumed, reference[1])
  assert "checkpoint step 12 in" in err and "checkpoint step 8 in" in err
  assert "trying step 4" in err and "Resuming run 'run' from step 4" in err


def test_no_intact_checkpoint_stops_with_a_clear_error_and_changes_nothing(reference, tmp_path,
                                                                           capsys):
  wd, ckpt_dir = _copy(reference, tmp_path)
  _truncate_data(os.path.join(ckpt_dir, "12"))
  _delete_data(os.path.join(ckpt_dir, "8"))
  _truncate_meta_json(os.path.join(ckpt_dir, "4"))
  before = _listing(wd)
  with pytest.raises(train.CheckpointDamagedError) as e:
    _fit(wd)
  msg = str(e.value)
  assert (f"no intact checkpoint in {ckpt_dir}" in msg and "step(s) 12, 8, 4" in msg
          and "nothing was changed" in msg and "another --workdir" in msg), msg
  assert e.value.directory == ckpt_dir and e.value.step is None
  assert _listing(wd) == before  # nothing deleted, rewritten or added
  err = capsys.readouterr().err
  assert [s for s in (12, 8, 4) if f"checkpoint step {s} in" in err] == [12, 8, 4], err
  assert "no earlier checkpoint" in err and "Traceback" not in err


def test_changed_setup_is_a_mismatch_not_damage(reference, tmp_path):
  # The latest state is damaged but its metadata is readable: a changed setup is reported as
  # such (before any restore), not skipped as damage.
  wd, ckpt_dir = _copy(reference, tmp_path)
  _truncate_data(os.path.join(ckpt_dir, "12"))
  before = _listing(wd)
  with pytest.raises(train.CheckpointMismatchError, match=r"optimizer\.learning_rate"):
    _fit(wd, optimizer=train.optimizer_config(learning_rate=2e-2, warmup_steps=3))
  assert _listing(wd) == before


def test_checkpointer_names_step_and_directory_and_replaces_a_damaged_step(reference,
                                                                           tmp_path):
  wd, ckpt_dir = _copy(reference, tmp_path)
  _truncate_meta_json(os.path.join(ckpt_dir, "8"))
  ckpt = checkpoint.Checkpointer(wd, "run", EVERY)
  try:
    assert ckpt.all_steps() == [4, 8, 12]
    assert ckpt.read_meta(12)["step"] == 12
    with pytest.raises(checkpoint.CheckpointDamagedError, match="JSONDecodeError") as e:
      ckpt.read_meta(8)
    assert (e.value.step, e.value.directory) == (8, ckpt_dir)
    assert str(e.value).startswith(f"checkpoint step 8 in {ckpt_dir} is damaged: its metadata")
    # orbax refuses to save over an existing step: the damaged one is replaced.
    state = {"w": np.arange(3.0, dtype=np.float32)}
    ckpt.save(8, state, {"step": 8})
    assert ckpt.read_meta(8) == {"step": 8}
    np.testing.assert_array_equal(ckpt.restore(8, state)["w"], state["w"])
    assert ckpt.all_steps() == [4, 8, 12] and ckpt.read_meta(4)["step"] == 4
  finally:
    ckpt.close()


def test_only_the_closed_loop_reports_of_failed_reads_are_dropped(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
  checkpoint._quiet_failed_restore_aftermath()

  def call_soon_threadsafe(msg):  # stands for asyncio's, called by a late tensorstore read
    raise RuntimeError(msg)

  reports = []
  for msg in ("Event loop is closed", "something else"):
    try:
      call_soon_threadsafe(msg)
    except RuntimeError as e:
      reports.append(types.SimpleNamespace(exc_type=RuntimeError, exc_value=e,
                                           exc_traceback=e.__traceback__, err_msg=None,
                                           object=None))
  elsewhere = RuntimeError("Event loop is closed")  # not from call_soon_threadsafe
  reports.append(types.SimpleNamespace(exc_type=RuntimeError, exc_value=elsewhere,
                                       exc_traceback=None, err_msg=None, object=None))
  for r in reports:
    sys.unraisablehook(r)
  assert [str(e) for e in seen] == ["something else", "Event loop is closed"]
  assert seen[1] is elsewhere
  hook = sys.unraisablehook
  checkpoint._quiet_failed_restore_aftermath()  # idempotent: no second wrapper
  assert sys.unraisablehook is hook


def test_only_asyncio_reports_of_orbax_tasks_are_dropped(caplog):
  checkpoint._quiet_failed_restore_aftermath()
  log = logging.getLogger("asyncio")
  orbax_task = ("Task exception was never retrieved\nfuture: <Task finished coro=<"
                "async_deserialize() done, defined at /x/orbax/checkpoint/serialization.py:1>>")
  # Newer asyncio/tensorstore: a bare Future whose error carries the tensorstore spec.
  tensorstore_read = ("Future exception was never retrieved\nfuture: <Future finished "
                      "exception=ValueError('OUT_OF_RANGE: Error opening \"zarr\" driver "
                      "[tensorstore_spec=...]')>")
  other_task = "Task exception was never retrieved\nfuture: <Task finished coro=<mine()>>"
  other_future = "Future exception was never retrieved\nfuture: <Future finished exception=X>"
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    for msg in (orbax_task, tensorstore_read, other_task, other_future):
      log.error(msg)
  assert [r.getMessage() for r in caplog.records] == [other_task, other_future]


def test_load_checkpoint_reads_back_what_fit_trained(reference, tmp_path):
  wd, result = reference
  saved = train.load_checkpoint(wd, "run")
  assert saved.step == STEPS and saved.steps == (4, 8, 12) and saved.run == "run"
  assert saved.seeds == [0, 1] and saved.num_seeds == 2
  assert saved.meta["fingerprint"]["num_steps"] == STEPS
  jax.tree.map(np.testing.assert_array_equal, saved.params, result.params)
  # One seed's parameters drive the model as trained: its accuracy is fit's final one.
  arrays = make_arrays()
  for index, seed in enumerate(saved.seeds):
    params = saved.params_for(seed)
    jax.tree.map(lambda a, b, i=index: np.testing.assert_array_equal(a, b[i]), params,
                 result.params)
    pred = TinyMLP(dropout_rate=0.2).apply({"params": params}, arrays["inputs"])
    accuracy = np.mean(np.argmax(np.asarray(pred), -1) == arrays["targets"])
    np.testing.assert_allclose(accuracy, result.final_metrics["accuracy"][index], atol=1e-6)
  earlier = train.load_checkpoint(wd, "run", step=8)
  assert earlier.step == 8
  assert not np.array_equal(jax.tree.leaves(earlier.params)[0],
                            jax.tree.leaves(saved.params)[0])


def test_load_checkpoint_names_what_exists_when_asked_for_what_does_not(reference, tmp_path):
  wd, _ = reference
  with pytest.raises(FileNotFoundError, match=r"no checkpoints of run 'nope'.*runs with "
                                              r"checkpoints there: run"):
    train.load_checkpoint(wd, "nope")
  with pytest.raises(ValueError, match=r"no checkpoint at step 5 .*steps: \[4, 8, 12\]"):
    train.load_checkpoint(wd, "run", step=5)
  with pytest.raises(ValueError, match=r"no seed 7; its seeds: \[0, 1\]"):
    train.load_checkpoint(wd, "run").params_for(7)
  assert train.list_checkpointed_runs(wd) == ["run"]
  assert train.list_checkpointed_runs(str(tmp_path)) == []


def test_load_checkpoint_skips_a_damaged_newest_step_unless_that_step_is_asked_for(
    reference, tmp_path, capsys):
  wd, ckpt_dir = _copy(reference, tmp_path)
  _truncate_data(os.path.join(ckpt_dir, "12"))
  capsys.readouterr()
  assert train.load_checkpoint(wd, "run").step == 8
  err = capsys.readouterr().err
  assert "checkpoint step 12 in" in err and "is damaged" in err and "Traceback" not in err
  with pytest.raises(train.CheckpointDamagedError, match="checkpoint step 12 in"):
    train.load_checkpoint(wd, "run", step=12)
