"""fit's periodic actions: each is due on its own schedule and does its one job."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from support.train_stand_ins import TinyMLP, make_arrays

from attnx import train
from attnx.train import actions


def _due(schedule: train.Schedule, num_steps: int = 10) -> list[int]:
  return [s for s in range(1, num_steps + 1) if schedule.due(s, num_steps)]


def test_schedule_due_steps():
  assert _due(train.Schedule(3)) == [3, 6, 9, 10]  # every 3 steps and at the end
  assert _due(train.Schedule(5)) == [5, 10]  # the end once, not twice
  assert _due(train.Schedule(0)) == [10]  # 0: only at the end
  assert _due(train.Schedule(3, at_end=False)) == [3, 6, 9]
  assert _due(actions.NEVER) == []
  assert _due(train.Schedule(3) | train.Schedule(4)) == [3, 4, 6, 8, 9, 10]
  assert _due(train.Schedule(0, at_end=False) | train.Schedule(4, at_end=False)) == [4, 8]
  assert _due(train.Schedule(20)) == [10]
  with pytest.raises(ValueError, match="periods must be >= 0"):
    train.Schedule(-1)


class _Recorder:
  """A stand-in writer / checkpointer that records the order of calls."""

  def __init__(self, calls: list):
    self.calls = calls

  def write(self, step, values):
    self.calls.append(("write", step, values))

  def flush(self):
    self.calls.append(("flush",))

  def save(self, step, state, meta):
    self.calls.append(("save", step, meta))


def _context(losses: list[list[float]], bad_step=(-1, -1)) -> actions.StepContext:
  """A context after len(losses) steps of 2 seeds, synced."""
  ctx = actions.StepContext(train.Placement("none"), num_steps=len(losses))
  for i, loss in enumerate(losses):
    state = {"params": {"w": np.full((2, 1), float(i))}, "bad_step": np.asarray(bad_step)}
    ctx.advance(i + 1, state, {"loss": np.asarray(loss), "accuracy": np.asarray([i, i])})
  ctx.sync()
  return ctx


def test_log_writes_means_since_the_last_record_with_this_syncs_evaluation():
  calls: list = []
  history: list = []
  log = actions.Log(train.Schedule(2), _Recorder(calls), history)
  ctx = _context([[1.0, 3.0], [2.0, 5.0]])
  ctx.eval_metrics = {"accuracy": np.asarray([0.5, 0.25])}
  log(ctx)
  assert history == [{"step": 2, "loss": [1.5, 4.0], "accuracy": [0.5, 0.5],
                      "eval_accuracy": [0.5, 0.25]}]
  assert calls == [("write", 2, {k: v for k, v in history[0].items() if k != "step"})]
  assert ctx.pending == []  # the next record averages only the steps after this one
  ctx.advance(3, ctx.state, {"loss": np.asarray([7.0, 8.0]), "accuracy": np.asarray([1, 1])})
  ctx.sync()  # a new sync forgets the previous evaluation
  log(ctx)
  assert history[-1] == {"step": 3, "loss": [7.0, 8.0], "accuracy": [1.0, 1.0]}


def test_evaluate_scores_the_current_params():
  seen = []
  ev = actions.Evaluate(train.Schedule(4), lambda host: seen.append(host) or {"acc": [1, 2]})
  ctx = _context([[1.0, 1.0]] * 3)
  ev(ctx)
  assert ctx.eval_metrics == {"acc": [1, 2]}
  assert list(seen[0]) == ["params"]  # params (and extra variables), not the optimizer state
  np.testing.assert_array_equal(seen[0]["params"]["w"], np.full((2, 1), 2.0))


def test_checkpoint_flushes_the_logs_before_saving():
  calls: list = []
  rec = _Recorder(calls)
  clock = actions.TrainClock(prev_seconds=1.0, prev_steps=4, compile_seconds=0.5)
  ckpt = actions.Checkpoint(train.Schedule(5), rec, rec, clock, {"name": "run", "seeds": [0, 1]})
  ctx = _context([[1.0, 2.0], [3.0, 4.0]])
  clock.steps_run = 2
  with clock.excluded():
    ckpt(ctx)
  assert [c[0] for c in calls] == ["flush", "save"]
  _, step, meta = calls[1]
  assert step == 2 and list(meta) == ["step", "name", "seeds", "last_metrics", "timing"]
  assert meta["last_metrics"] == {"loss": [3.0, 4.0], "accuracy": [1, 1]}  # the latest step
  assert meta["timing"]["train_steps"] == 6 and meta["timing"]["compile_seconds"] == 0.5
  assert meta["timing"]["train_seconds"] >= 1.0


def test_check_finite_raises_naming_the_first_bad_step_and_seeds():
  check = actions.CheckFinite(train.Schedule(1), [5, 6], "r", "Hint.")
  check(_context([[1.0, 1.0]]))  # all finite: nothing happens
  expected = r"run 'r': .* at step 3 for seed\(s\) \[6\] .*\{5: -1, 6: 3\}\)\. Hint\."
  with pytest.raises(train.NonFiniteLossError, match=expected):
    check(_context([[1.0, np.nan]], bad_step=(-1, 3)))


def test_train_clock_excludes_action_time():
  clock = actions.TrainClock()
  clock.start()
  time.sleep(0.05)
  clock.steps_run = 1
  with clock.excluded():
    time.sleep(0.3)
    inside = clock.timing()["train_seconds"]  # as of the sync: the action's time not counted
  assert 0.04 < inside < 0.2
  assert 0.04 < clock.seconds_per_step() < 0.2
  resumed = actions.TrainClock(prev_seconds=10.0, prev_steps=10)
  assert resumed.seconds_per_step() == 1.0  # a finished run: the earlier processes' time
  assert np.isnan(actions.TrainClock().seconds_per_step())


def _config(**kw) -> train.FitConfig:
  base = dict(optimizer=train.optimizer_config(learning_rate=1e-2), num_steps=10, num_seeds=2,
              progress=False, tensorboard=False)
  return train.FitConfig(**{**base, **kw})


def test_fit_runs_each_action_on_its_schedule(tmp_path):
  arrays = make_arrays()
  evals = []

  def eval_fn(params):
    evals.append(1)
    return {"score": np.arange(2.0) + len(evals)}

  saves = []
  real_save = train.checkpoint.Checkpointer.save

  def save(self, step, state, meta):
    saves.append(step)
    return real_save(self, step, state, meta)

  mp = pytest.MonkeyPatch()
  mp.setattr(train.checkpoint.Checkpointer, "save", save)
  try:
    r = train.fit(TinyMLP(), train_data=train.loader(arrays, 16), eval_fn=eval_fn,
                  config=_config(log_every=3, eval_every=4, checkpoint_every=5,
                                 keep_checkpoints=5), workdir=str(tmp_path))
  finally:
    mp.undo()
  assert len(evals) == 3  # steps 4, 8 and the end
  assert [h["step"] for h in r.history if "eval_score" in h] == [4, 8, 10]
  assert [h["step"] for h in r.history] == [3, 4, 6, 8, 9, 10]  # logs, evaluations, end
  assert saves == [5, 10]
  assert sorted(os.listdir(tmp_path / "checkpoints" / "run"), key=int) == ["5", "10"]
  np.testing.assert_array_equal(r.final_metrics["score"], [3.0, 4.0])  # the last evaluation
  # No schedule but the end: one record, one evaluation, no checkpoints without a period.
  evals.clear()
  r = train.fit(TinyMLP(), train_data=train.loader(arrays, 16), eval_fn=eval_fn,
                config=_config(log_every=0), workdir=str(tmp_path / "end"))
  assert [h["step"] for h in r.history] == [10] and len(evals) == 1
  assert not os.path.exists(tmp_path / "end" / "checkpoints")


def test_nan_check_runs_at_every_sync_before_the_record(tmp_path):
  arrays = make_arrays()

  def data(seed, start):
    for i, b in enumerate(train.array_stream(arrays, 16, seed, start), start=start):
      yield dict(b, inputs=b["inputs"] * np.nan) if i >= 4 else b  # step 5 (1-based) on

  # Syncs at 3 (log) and 4 (evaluation): the blow-up at step 5 is caught at 6, the next log,
  # before step 6's record is written.
  with pytest.raises(train.NonFiniteLossError, match=r"at step 4 for seed\(s\) \[0, 1\]"):
    train.fit(TinyMLP(), train_data=data, eval_fn=lambda p: {"s": np.zeros(2)},
              config=_config(log_every=3, eval_every=4), workdir=str(tmp_path))
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [3, 4]


def test_evaluation_and_checkpoint_time_is_not_training_time(tmp_path):
  def slow_eval(params):
    time.sleep(1.0)
    return {"s": np.zeros(2)}

  r = train.fit(TinyMLP(), train_data=train.loader(make_arrays(), 16), eval_fn=slow_eval,
                config=_config(eval_every=4, checkpoint_every=5), workdir=str(tmp_path))
  assert r.seconds_per_step * 10 < 1.0  # three 1 s evaluations ran; none of it counted
