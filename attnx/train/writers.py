"""Metric sinks: JSON lines (workdir/metrics.jsonl) and TensorBoard (workdir/tb/<run>)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np


def _jsonable(v: Any) -> Any:
  if isinstance(v, np.ndarray | np.generic) or hasattr(v, "__array__"):
    arr = np.asarray(v)
    return arr.tolist()
  return v


class MetricWriter:
  """Appends one JSON line per logged step and mirrors seed means/stds to TensorBoard.

  TensorBoard events are written synchronously (tensorboardX's EventsWriter, not its
  SummaryWriter, whose flush() misses events still in its background queue), so `flush()`
  puts every event logged so far on disk; `fit` calls it before each checkpoint.

  `readonly`: read the history, write nothing (the processes other than 0 of a multi-process
  run).

  `start_step`: the step training (re)starts from. Events an earlier process logged after it
  (it was killed after its last checkpoint) are hidden from TensorBoard by a purge event
  (SessionLog.START at start_step + 1), as `truncate_after` drops them from the JSON lines, so
  neither has duplicates.
  """

  def __init__(self, workdir: str | None, run: str, tensorboard: bool = True,
               start_step: int = 0, readonly: bool = False):
    self.run = run
    self.path = os.path.join(workdir, "metrics.jsonl") if workdir else None
    self.readonly = readonly  # the other processes of a multi-process run: reads only
    self._tb = None
    if workdir and not readonly:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2

        logdir = os.path.join(workdir, "tb", run)
        os.makedirs(logdir, exist_ok=True)
        earlier = any(f.startswith("events.") for f in os.listdir(logdir))
        # The suffix orders files created within the same second by start step.
        self._tb = EventsWriter(os.path.join(logdir, "events"), f".from{start_step:09d}")
        if earlier:
          # TensorBoard hides earlier events with step >= this one; those <= start_step were
          # flushed before the checkpoint this run resumes from, so they stay.
          self._tb.write_event(event_pb2.Event(
              wall_time=time.time(), step=start_step + 1,
              session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

  def write(self, step: int, values: dict[str, Any]) -> None:
    """`values`: {name: per-seed array or scalar}."""
    if self.path and not self.readonly:
      record = {"run": self.run, "step": int(step)}
      record.update({k: _jsonable(v) for k, v in values.items()})
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      from tensorboardX.proto import event_pb2
      from tensorboardX.summary import scalar

      for k, v in values.items():
        arr = np.asarray(v, dtype=np.float64)
        if arr.dtype.kind not in "fiu" or arr.size == 0:
          continue
        stats = [("mean", arr.mean())] + ([("std", arr.std())] if arr.size > 1 else [])
        for stat, x in stats:
          self._tb.write_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                               summary=scalar(f"{k}/{stat}", float(x))))

  def truncate_after(self, step: int) -> list[dict]:
    """On resume: drop this run's records beyond `step`; return the kept ones (its history)."""
    if not self.path or not os.path.exists(self.path):
      return []
    kept, mine = [], []
    with open(self.path) as f:
      for line in f:
        if not line.strip():
          continue
        rec = json.loads(line)
        if rec.get("run") == self.run:
          if rec["step"] > step:
            continue
          mine.append({k: v for k, v in rec.items() if k != "run"})
        kept.append(line if line.endswith("\n") else line + "\n")
    if self.readonly:
      return mine
    with open(self.path, "w") as f:
      f.writelines(kept)
    return mine

  def flush(self) -> None:
    """Put every TensorBoard event so far on disk (JSON lines are written per record)."""
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
