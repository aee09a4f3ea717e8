"""Device placement for the data-parallel modes ("none", "shard_map", "pmap").

Multi-process (``jax.distributed.initialize``, one controller per host or per local process):
the mesh spans every process's devices, each process holds only the rows of every global batch
that its own devices hold (:func:`process_rows`) and builds the global batch with
``jax.make_array_from_process_local_data``; the replicated train state and metrics are read
back from this process's own copy. Writers (metrics, TensorBoard, plots, reports, progress)
run on process 0 only (:func:`is_main_process`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PARALLEL_MODES = ("none", "shard_map", "pmap")


def is_main_process() -> bool:
  """Whether this process writes the run's files and prints its progress (process 0)."""
  return jax.process_index() == 0


def validate_parallel(parallel: str, batch_size: int | None = None) -> None:
  """Raise ValueError for an unknown mode or a batch that does not split over devices.

  With several processes, "none" is refused: every process would train the whole batch on its
  first device, the same run N times over.
  """
  if parallel not in PARALLEL_MODES:
    raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL_MODES}")
  if parallel == "none" and jax.process_count() > 1:
    raise ValueError(f"parallel='none' with {jax.process_count()} processes would train the "
                     "same model in every process; use parallel=shard_map (or pmap) to split "
                     "every batch over the devices of all processes")
  if parallel == "none" or batch_size is None:
    return
  # Both split every batch over the devices of all processes.
  n = jax.device_count()
  if batch_size % n:
    raise ValueError(f"batch_size={batch_size} is not divisible by the {n} devices "
                     f"(parallel={parallel!r}); use a multiple of {n}")


def data_mesh() -> Mesh:
  """A 1-D mesh over all devices (of every process) with axis name `data`."""
  return Mesh(np.asarray(jax.devices()), ("data",))


def process_rows(parallel: str, batch_size: int) -> tuple[int, int]:
  """Rows [lo, hi) of every global batch that this process's devices hold.

  (0, batch_size) in a single process or without data parallelism. pmap's devices are
  jax.local_devices(), in process order, as `jax.devices()` lists them; shard_map's are read
  from the batch sharding of the mesh, so they hold whatever order the mesh has.
  """
  if parallel == "none" or jax.process_count() == 1:
    return 0, batch_size
  if parallel == "pmap":
    per = batch_size // jax.device_count()
    first = [d.process_index for d in jax.devices()].index(jax.process_index())
    return first * per, (first + jax.local_device_count()) * per
  sharding = NamedSharding(data_mesh(), P("data"))
  spans = {s[0].indices(batch_size)[:2]
           for s in sharding.addressable_devices_indices_map((batch_size,)).values()}
  lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
  if sum(b - a for a, b in spans) != hi - lo:
    raise ValueError(f"process {jax.process_index()}'s devices hold non-contiguous rows "
                     f"{sorted(spans)} of the batch: order jax.devices() by process")
  return lo, hi


class Placement:
  """Moves train state and stacked batches [S, B, ...] to devices for one parallel mode."""

  def __init__(self, parallel: str = "none"):
    validate_parallel(parallel)
    self.parallel = parallel
    self.mesh = data_mesh() if parallel == "shard_map" else None
    self.num_devices = jax.local_device_count() if parallel == "pmap" else (
        len(jax.devices()) if parallel == "shard_map" else 1)
    self.multi_process = jax.process_count() > 1

  def state(self, state: Any) -> Any:
    """Place a host/unreplicated state (replicated across devices for data parallelism)."""
    if self.parallel == "shard_map":
      if self.multi_process:
        # From the host: JAX moves no device array across processes (the copy of a restored
        # checkpoint sits on this process's first device); every process holds the same state.
        state = jax.tree.map(np.asarray, jax.device_get(state))
      return jax.device_put(state, NamedSharding(self.mesh, P()))
    if self.parallel == "pmap":
      # pmap shards a leading device axis of its inputs itself.
      d = self.num_devices
      return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (d,) + np.shape(x)), state)
    return jax.device_put(state)

  def unplace(self, state: Any) -> Any:
    """The single-copy state (drops pmap's device axis; this process's copy of a replicated
    global array)."""
    if self.parallel == "pmap":
      return jax.tree.map(lambda x: x[0], state)
    if self.multi_process:
      return jax.tree.map(_own_copy, state)
    return state

  def batch(self, batch: dict, batch_size: int | None = None) -> dict:
    """Place a stacked batch [S, B, ...]: shard B over devices when data-parallel.

    With several processes `batch` holds only this process's rows (:func:`process_rows`) of
    the global batch of `batch_size` rows.
    """
    if self.parallel == "shard_map":
      sharding = NamedSharding(self.mesh, P(None, "data"))
      if self.multi_process:
        return {k: jax.make_array_from_process_local_data(
            sharding, v, (v.shape[0], batch_size) + v.shape[2:]) for k, v in batch.items()}
      return jax.device_put(batch, sharding)
    if self.parallel == "pmap":
      d = self.num_devices  # this process's devices: `batch` holds their rows only

      def split(x):
        s, b = x.shape[:2]
        return np.moveaxis(x.reshape((s, d, b // d) + x.shape[2:]), 1, 0)

      return {k: split(np.asarray(v)) for k, v in batch.items()}
    return jax.device_put(batch)

  def metrics(self, metrics: Any) -> Any:
    """Metrics with the device axis dropped (they are reduced over devices: all copies agree)."""
    return self.unplace(metrics)


def _own_copy(x: Any) -> Any:
  """This process's copy of a replicated global array (the array itself when addressable)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x
