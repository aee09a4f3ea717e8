"""Read a run's checkpointed train state back as numpy arrays, without a target structure."""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp


def read_state(workdir: str, run: str, step: int) -> Any:
  """The train state `fit` saved at `step` under workdir/checkpoints/<run> (numpy leaves)."""
  manager = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints", run),
                                  item_names=("state", "meta"))
  try:
    return manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
  finally:
    manager.close()
