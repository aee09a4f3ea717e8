"""The periodic actions of `fit`: NaN check, evaluation, logging, checkpointing.

`fit`'s loop only runs train steps. After each step it asks every action whether it is due
(`Schedule`: every n steps and/or at the last step); when any is, it waits for the step once
(`StepContext.sync`, the only host sync), stops the training clock, and runs the due actions in
order on the shared `StepContext`. Order matters and is fixed by `fit`: the NaN check first (a
blown-up run must not be evaluated or checkpointed), then evaluation (its metrics go into the
record), then the log record, then the checkpoint (after the logs reach the disk, so a run
killed after a save loses none of them).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from attnx.train.parallel import Placement


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When an action is due: at multiples of any period in `every` (0 never) and/or at the end.

  ``Schedule(10)``: steps 10, 20, ... and the last; ``Schedule(0)``: only the last;
  ``a | b``: whenever either is due.
  """

  every: tuple[int, ...] | int = ()
  at_end: bool = True

  def __post_init__(self):
    every = (self.every,) if isinstance(self.every, int) else tuple(self.every)
    if any(n < 0 for n in every):
      raise ValueError(f"Schedule periods must be >= 0 (0: never), got {every}")
    object.__setattr__(self, "every", every)

  def due(self, step: int, num_steps: int) -> bool:
    """Whether the action runs after `step` steps (1-based) of `num_steps`."""
    return (self.at_end and step == num_steps) or any(n > 0 and step % n == 0
                                                      for n in self.every)

  def __or__(self, other: Schedule) -> Schedule:
    return Schedule(self.every + other.every, self.at_end or other.at_end)


NEVER = Schedule((), at_end=False)


class TrainClock:
  """Training time: wall time of the steps (data loading included), without the time spent in
  actions (evaluation, checkpointing), summed over the processes a run resumed from."""

  def __init__(self, prev_seconds: float = 0.0, prev_steps: int = 0,
               compile_seconds: float = float("nan")):
    self.prev_seconds = prev_seconds
    self.prev_steps = prev_steps
    self.compile_seconds = compile_seconds
    self.steps_run = 0
    self.untimed_steps = 0  # steps run but not timed (a first step that also compiled)
    self._start = time.perf_counter()
    self._excluded = 0.0
    self._paused_at: float | None = None

  def start(self) -> None:
    """Training starts now (after compilation)."""
    self._start = time.perf_counter()
    self._excluded = 0.0

  @contextlib.contextmanager
  def excluded(self) -> Iterator[None]:
    """Time inside is not training time (`timing()` reads the clock as of entering)."""
    self._paused_at = time.perf_counter()
    try:
      yield
    finally:
      self._excluded += time.perf_counter() - self._paused_at
      self._paused_at = None

  def timing(self) -> dict[str, float]:
    """What a checkpoint stores, so that a resumed run reports the time of every step."""
    now = self._paused_at if self._paused_at is not None else time.perf_counter()
    return {"train_seconds": self.prev_seconds + (now - self._start - self._excluded),
            "train_steps": self.prev_steps + self.steps_run - self.untimed_steps,
            "compile_seconds": self.compile_seconds}

  def seconds_per_step(self) -> float:
    """Per-step time over every step trained, by this process and the ones it resumed from."""
    elapsed = time.perf_counter() - self._start - self._excluded
    total = self.prev_steps + self.steps_run - self.untimed_steps
    if not total:
      return float("nan")
    return (self.prev_seconds + (elapsed if self.steps_run else 0.0)) / total


class StepContext:
  """What the actions of one host sync share.

  Between syncs the loop only appends each step's device metrics (`advance`); `sync` fetches
  the NaN flag (waiting for the step), and the actions read the state and metrics from here.
  """

  def __init__(self, placement: Placement, num_steps: int):
    self.placement = placement
    self.num_steps = num_steps
    self.step = 0  # steps done
    self.state: Any = None  # the placed train state after `step` steps
    self.pending: list = []  # device metrics of the steps since the last log record
    self.latest: Any = None  # device metrics of the latest step
    self.bad_step: np.ndarray | None = None  # per seed: first NaN/Inf step, -1 if none
    self.eval_metrics: dict[str, np.ndarray] = {}  # this sync's evaluation, if any
    self._host_state: Any = None

  def advance(self, step: int, state: Any, metrics: Any) -> None:
    """Step `step` (1-based) has been dispatched."""
    self.step, self.state, self.latest = step, state, metrics
    self.pending.append(metrics)
    self._host_state = None

  def sync(self) -> None:
    """Wait for the step and fetch the NaN flag; clears the previous sync's evaluation."""
    self.bad_step = np.asarray(jax.device_get(self.host_state["bad_step"]))
    self.eval_metrics = {}

  @property
  def host_state(self) -> Any:
    """The single-copy state (device arrays; pmap's device axis dropped)."""
    if self._host_state is None:
      self._host_state = self.placement.unplace(self.state)
    return self._host_state

  def last_metrics(self) -> dict[str, np.ndarray]:
    """The latest step's train metrics on the host: {name: [num_seeds]}."""
    return {k: np.asarray(v)
            for k, v in jax.device_get(self.placement.metrics(self.latest)).items()}

  def take_train_means(self) -> dict[str, list]:
    """Means of the train metrics over the steps since the last record (then forgotten)."""
    ms = jax.device_get([self.placement.metrics(m) for m in self.pending])
    self.pending = []
    return {k: np.mean([np.asarray(m[k]) for m in ms], axis=0).tolist() for k in ms[0]}


class Action(abc.ABC):
  """A periodic piece of `fit`: due per its `schedule`, acts on the shared StepContext."""

  schedule: Schedule = NEVER

  def due(self, step: int, num_steps: int) -> bool:
    """Whether the action runs after `step` steps (1-based) of `num_steps`: its schedule's."""
    return self.schedule.due(step, num_steps)

  @abc.abstractmethod
  def __call__(self, ctx: StepContext) -> None:
    """Acts at a step where the action is due."""


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or Inf; the message names the step and the seeds."""


_NONFINITE: list[str] = []  # messages of the runs that stopped on NaN/Inf in this process


def nonfinite_runs() -> list[str]:
  """Messages of every run that stopped on a NaN/Inf loss in this process (oldest first).

  Experiments may catch NonFiniteLossError to report the other runs; launch.py uses this to
  exit non-zero anyway.
  """
  return list(_NONFINITE)


class CheckFinite(Action):
  """Raise NonFiniteLossError when a seed's loss became NaN/Inf.

  The device tracks the first bad step per seed (`bad_step` in the state), so checking costs
  no extra sync: run it at every sync (the union of the other actions' schedules).
  """

  def __init__(self, schedule: Schedule, seeds: list[int], name: str, hint: str):
    self.schedule, self.seeds, self.name, self.hint = schedule, seeds, name, hint

  def __call__(self, ctx: StepContext) -> None:
    bad = np.asarray(ctx.bad_step)
    if (bad >= 0).any():
      which = [s for s, b in zip(self.seeds, bad, strict=True) if b >= 0]
      first = int(bad[bad >= 0].min())
      msg = (f"run {self.name!r}: loss became NaN/Inf at step {first} for seed(s) {which} "
             f"(per-seed first bad step: {dict(zip(self.seeds, bad.tolist(), strict=True))}). "
             + self.hint)
      _NONFINITE.append(msg)
      raise NonFiniteLossError(msg)


class Evaluate(Action):
  """Evaluate the current parameters; the metrics go into this sync's log record."""

  def __init__(self, schedule: Schedule, run_eval: Callable[[dict], dict[str, np.ndarray]]):
    self.schedule, self.run_eval = schedule, run_eval

  def __call__(self, ctx: StepContext) -> None:
    host = jax.device_get({k: v for k, v in ctx.host_state.items() if k in ("params", "extra")})
    ctx.eval_metrics = self.run_eval(host)


class ProgressBar:
  """A tqdm bar on a terminal (nothing otherwise): one tick per step, the last logged loss."""

  def __init__(self, enabled: bool, name: str, num_steps: int, start_step: int):
    self._bar = None
    if enabled and sys.stderr.isatty() and start_step < num_steps:
      from tqdm.auto import tqdm  # noqa: PLC0415

      self._bar = tqdm(total=num_steps, initial=start_step, desc=name, unit="step",
                       dynamic_ncols=True)

  def update(self) -> None:
    if self._bar is not None:
      self._bar.update(1)

  def show_loss(self, loss: Any) -> None:
    if self._bar is not None:
      self._bar.set_postfix(loss=f"{np.mean(loss):.4g}")

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


class Log(Action):
  """Write a record: the step, train-metric means since the last record, this sync's eval.

  Records are due every `log_every` steps and whenever an evaluation ran (its record carries
  the train metrics since the previous one): `Schedule(log_every) | eval_schedule`.
  """

  def __init__(self, schedule: Schedule, writer: Any, history: list[dict],
               progress: ProgressBar | None = None):
    self.schedule, self.writer, self.history, self.progress = schedule, writer, history, progress

  def __call__(self, ctx: StepContext) -> None:
    record: dict[str, Any] = {"step": ctx.step, **ctx.take_train_means()}
    for k, v in ctx.eval_metrics.items():
      record[f"eval_{k}"] = np.asarray(v).tolist()
    self.writer.write(ctx.step, {k: v for k, v in record.items() if k != "step"})
    self.history.append(record)
    if self.progress is not None and "loss" in record:
      self.progress.show_loss(record["loss"])


class Checkpoint(Action):
  """Save the state with its metadata, after flushing the logs up to this step.

  Logs reach the disk before the checkpoint a resume starts from, so a kill after the save
  loses none of them. `meta`: the run's fixed metadata (seeds, name, fingerprint); the step,
  the last train metrics and the clock's timing are added per save.
  """

  def __init__(self, schedule: Schedule, checkpointer: Any, writer: Any, clock: TrainClock,
               meta: dict[str, Any]):
    self.schedule, self.checkpointer, self.writer = schedule, checkpointer, writer
    self.clock, self.meta = clock, meta

  def __call__(self, ctx: StepContext) -> None:
    self.writer.flush()
    self.checkpointer.save(ctx.step, ctx.host_state, {
        "step": ctx.step, **self.meta,
        "last_metrics": {k: v.tolist() for k, v in ctx.last_metrics().items()},
        "timing": self.clock.timing()})
