"""Metric sinks: JSON lines (workdir/metrics.jsonl) and TensorBoard (workdir/tb/<run>)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def _jsonable(v: Any) -> Any:
  if isinstance(v, np.ndarray | np.generic) or hasattr(v, "__array__"):
    arr = np.asarray(v)
    return arr.tolist()
  return v


class MetricWriter:
  """Appends one JSON line per logged step and mirrors seed means/stds to TensorBoard."""

  def __init__(self, workdir: str | None, run: str, tensorboard: bool = True):
    self.run = run
    self.path = os.path.join(workdir, "metrics.jsonl") if workdir else None
    self._tb = None
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(workdir, "tb", run))

  def write(self, step: int, values: dict[str, Any]) -> None:
    """`values`: {name: per-seed array or scalar}."""
    if self.path:
      record = {"run": self.run, "step": int(step)}
      record.update({k: _jsonable(v) for k, v in values.items()})
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in values.items():
        arr = np.asarray(v, dtype=np.float64)
        if arr.dtype.kind not in "fiu" or arr.size == 0:
          continue
        self._tb.add_scalar(f"{k}/mean", float(arr.mean()), step)
        if arr.size > 1:
          self._tb.add_scalar(f"{k}/std", float(arr.std()), step)

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
    with open(self.path, "w") as f:
      f.writelines(kept)
    return mine

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
