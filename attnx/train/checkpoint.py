"""Orbax checkpoints of the stacked train state (+ a small JSON of metadata) per run."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves every `every` steps under workdir/checkpoints/<run>, keeps the last `keep`."""

  def __init__(self, workdir: str, run: str, every: int, keep: int = 3):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints", run))
    self.every = every
    # Synchronous saves: a kill right after save() returns still leaves a complete checkpoint.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    host = jax.tree.map(np.asarray, jax.device_get(state))
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(host),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    """The JSON metadata of checkpoint `step` alone (cheap; the state is not read)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored["meta"])

  def restore(self, step: int, target: Any) -> Any:
    """The state of checkpoint `step`, in the structure (and dtypes/shapes) of `target`."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x), sharding=sharding), target)
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    return restored["state"]

  def close(self) -> None:
    self.manager.close()
