"""Device placement for the data-parallel modes ("none", "shard_map", "pmap")."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PARALLEL_MODES = ("none", "shard_map", "pmap")


def validate_parallel(parallel: str, batch_size: int | None = None) -> None:
  """Raise ValueError for an unknown mode or a batch that does not split over devices."""
  if parallel not in PARALLEL_MODES:
    raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL_MODES}")
  if parallel == "none" or batch_size is None:
    return
  # shard_map splits over the global mesh (data_mesh), pmap over this host's devices.
  n = jax.device_count() if parallel == "shard_map" else jax.local_device_count()
  if batch_size % n:
    raise ValueError(f"batch_size={batch_size} is not divisible by the {n} devices "
                     f"(parallel={parallel!r}); use a multiple of {n}")


def data_mesh() -> Mesh:
  """A 1-D mesh over all devices with axis name `data`."""
  return Mesh(np.asarray(jax.devices()), ("data",))


class Placement:
  """Moves train state and stacked batches [S, B, ...] to devices for one parallel mode."""

  def __init__(self, parallel: str = "none"):
    validate_parallel(parallel)
    self.parallel = parallel
    self.mesh = data_mesh() if parallel == "shard_map" else None
    self.num_devices = jax.local_device_count() if parallel == "pmap" else (
        len(jax.devices()) if parallel == "shard_map" else 1)

  def state(self, state: Any) -> Any:
    """Place a host/unreplicated state (replicated across devices for data parallelism)."""
    if self.parallel == "shard_map":
      return jax.device_put(state, NamedSharding(self.mesh, P()))
    if self.parallel == "pmap":
      # pmap shards a leading device axis of its inputs itself.
      d = self.num_devices
      return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (d,) + np.shape(x)), state)
    return jax.device_put(state)

  def unplace(self, state: Any) -> Any:
    """The single-copy state (drops pmap's device axis)."""
    if self.parallel == "pmap":
      return jax.tree.map(lambda x: x[0], state)
    return state

  def batch(self, batch: dict) -> dict:
    """Place a stacked batch [S, B, ...]: shard B over devices when data-parallel."""
    if self.parallel == "shard_map":
      return jax.device_put(batch, NamedSharding(self.mesh, P(None, "data")))
    if self.parallel == "pmap":
      d = self.num_devices

      def split(x):
        s, b = x.shape[:2]
        return np.moveaxis(x.reshape((s, d, b // d) + x.shape[2:]), 1, 0)

      return {k: split(np.asarray(v)) for k, v in batch.items()}
    return jax.device_put(batch)

  def metrics(self, metrics: Any) -> Any:
    """Metrics with the device axis dropped (they are reduced over devices: all copies agree)."""
    if self.parallel == "pmap":
      return jax.tree.map(lambda x: x[0], metrics)
    return metrics
