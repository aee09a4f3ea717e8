"""Device placement for the data-parallel modes ("none", "shard_map", "pmap").

Multi-process (``jax.distributed.initialize``, one controller per host or per local process):
the mesh spans every process's devices, each process holds only the rows of every global batch
that its own devices hold (:func:`process_rows`) and builds the global batch with
``jax.make_array_from_process_local_data``; the replicated train state and metrics are read
back from this process's own copy. Writers (metrics, TensorBoard, plots, reports, progress)
run on process 0 only (:func:`is_main_process`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PARALLEL_MODES = ("none", "shard_map", "pmap")
SEQUENCE_LAYOUTS = ("contiguous", "zigzag")
DATA_AXIS, SEQUENCE_AXIS = "data", "seq"


def is_main_process() -> bool:
  """Whether this process writes the run's files and prints its progress (process 0)."""
  return jax.process_index() == 0


def validate_parallel(parallel: str, batch_size: int | None = None,
                      sequence_parallel: int = 1) -> None:
  """Raise ValueError for an unknown mode or a batch that does not split over devices.

  With several processes, "none" is refused: every process would train the whole batch on its
  first device, the same run N times over. `sequence_parallel` > 1 (shard_map only) splits
  the devices into a (data, seq) mesh with that many along the sequence.
  """
  if parallel not in PARALLEL_MODES:
    raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL_MODES}")
  if parallel == "none" and jax.process_count() > 1:
    raise ValueError(f"parallel='none' with {jax.process_count()} processes would train the "
                     "same model in every process; use parallel=shard_map (or pmap) to split "
                     "every batch over the devices of all processes")
  n = jax.device_count()
  if sequence_parallel > 1:
    if parallel != "shard_map":
      raise ValueError(f"sequence_parallel={sequence_parallel} needs parallel='shard_map' (a "
                       f"(data, seq) mesh), got parallel={parallel!r}")
    if n % sequence_parallel:
      raise ValueError(f"sequence_parallel={sequence_parallel} does not divide the {n} devices")
  if parallel == "none" or batch_size is None:
    return
  # Every batch splits over the data axis: all devices, or n / sequence_parallel of them.
  d = n // max(sequence_parallel, 1)
  if batch_size % d:
    raise ValueError(f"batch_size={batch_size} is not divisible by the {d} devices "
                     f"(parallel={parallel!r}"
                     + (f", sequence_parallel={sequence_parallel}" if sequence_parallel > 1
                        else "") + f"); use a multiple of {d}")


def data_mesh(sequence_parallel: int = 1) -> Mesh:
  """A mesh over all devices (of every process): 1-D with axis `data`, or with
  `sequence_parallel` > 1 2-D (data, seq) with that many devices along `seq` (neighbours in
  jax.devices(), so a ring of sequence shards stays within a host where it can)."""
  devices = np.asarray(jax.devices())
  if sequence_parallel <= 1:
    return Mesh(devices, (DATA_AXIS,))
  return Mesh(devices.reshape(-1, sequence_parallel), (DATA_AXIS, SEQUENCE_AXIS))


@functools.lru_cache(maxsize=64)  # fixed for the process's life; Placement asks every step
def process_block(parallel: str, batch_size: int, seq_len: int | None = None,
                  sequence_parallel: int = 1) -> tuple[tuple[int, int], tuple[int, int] | None]:
  """Rows [a, b) of every global batch, and with `sequence_parallel` > 1 the positions [c, d)
  of its sequence axis, that this process's devices hold.

  The whole batch in a single process or without data parallelism. pmap's devices are
  jax.local_devices(), in process order, as `jax.devices()` lists them; shard_map's are read
  from the batch sharding of the mesh, so they hold whatever order the mesh has.
  """
  cols = (0, seq_len) if sequence_parallel > 1 and seq_len is not None else None
  if parallel == "none" or jax.process_count() == 1:
    return (0, batch_size), cols
  if parallel == "pmap":
    per = batch_size // jax.device_count()
    first = [d.process_index for d in jax.devices()].index(jax.process_index())
    return (first * per, (first + jax.local_device_count()) * per), None
  mesh = data_mesh(sequence_parallel)
  shape = (batch_size,) if cols is None else (batch_size, seq_len)
  spec = P(*mesh.axis_names[:len(shape)])
  index = NamedSharding(mesh, spec).addressable_devices_indices_map(shape).values()
  blocks = [tuple(sl.indices(n)[:2] for sl, n in zip(ix, shape, strict=True)) for ix in index]
  box = [(min(b[k][0] for b in blocks), max(b[k][1] for b in blocks)) for k in range(len(shape))]
  held = set(blocks)  # replicas of one block count once
  area = sum(int(np.prod([hi - lo for lo, hi in b])) for b in held)
  if area != int(np.prod([hi - lo for lo, hi in box])):
    raise ValueError(f"process {jax.process_index()}'s devices hold a non-rectangular part "
                     f"{sorted(held)} of the batch: order jax.devices() by process")
  return box[0], (box[1] if cols is not None else None)


def process_rows(parallel: str, batch_size: int, sequence_parallel: int = 1) -> tuple[int, int]:
  """Rows [lo, hi) of every global batch that this process's devices hold (see
  :func:`process_block`)."""
  return process_block(parallel, batch_size, sequence_parallel=sequence_parallel)[0]


class Placement:
  """Moves train state and stacked batches [S, B, ...] to devices for one parallel mode."""

  def __init__(self, parallel: str = "none", sequence_parallel: int = 1,
               sequence_layout: str = "contiguous"):
    validate_parallel(parallel, sequence_parallel=sequence_parallel)
    if sequence_layout not in SEQUENCE_LAYOUTS:
      raise ValueError(f"sequence_layout={sequence_layout!r} is not one of {SEQUENCE_LAYOUTS}")
    self.parallel = parallel
    self.sequence_parallel = max(int(sequence_parallel), 1)
    self.sequence_layout = sequence_layout
    self.mesh = data_mesh(self.sequence_parallel) if parallel == "shard_map" else None
    self.num_devices = jax.local_device_count() if parallel == "pmap" else (
        len(jax.devices()) if parallel == "shard_map" else 1)
    self.multi_process = jax.process_count() > 1

  @property
  def batch_spec(self) -> P:
    """How a stacked batch [S, B, T, ...] is sharded: B over `data`, T over `seq` (if any)."""
    if self.sequence_parallel > 1:
      return P(None, DATA_AXIS, SEQUENCE_AXIS)
    return P(None, DATA_AXIS)

  @property
  def axis_name(self) -> str | tuple[str, ...] | None:
    """The mesh axes a train step reduces its loss and gradients over."""
    if self.parallel == "none":
      return None
    return (DATA_AXIS, SEQUENCE_AXIS) if self.sequence_parallel > 1 else DATA_AXIS

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
    """Place a stacked batch [S, B, ...]: shard B over devices when data-parallel, and with
    sequence parallelism every array's axis 2 (the sequence: [S, B, T, ...]) over `seq`.

    With several processes `batch` holds only this process's rows (:func:`process_block`) of
    the global batch of `batch_size` rows, with every position of the sequence. The zigzag
    layout reorders the sequence (``core.zigzag_permute``) before it is cut into shards; the
    loss, a sum over positions, does not see the order.
    """
    if self.parallel == "shard_map":
      sharding = NamedSharding(self.mesh, self.batch_spec)
      if self.sequence_parallel > 1:
        batch = {k: self._sequence_order(k, v) for k, v in batch.items()}
      if self.multi_process:
        return {k: self._global(sharding, v, batch_size) for k, v in batch.items()}
      return jax.device_put(batch, sharding)
    if self.parallel == "pmap":
      d = self.num_devices  # this process's devices: `batch` holds their rows only

      def split(x):
        s, b = x.shape[:2]
        return np.moveaxis(x.reshape((s, d, b // d) + x.shape[2:]), 1, 0)

      return {k: split(np.asarray(v)) for k, v in batch.items()}
    return jax.device_put(batch)

  def _sequence_order(self, key: str, x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 3 or x.shape[2] % self.sequence_parallel:
      raise ValueError(
          f"sequence_parallel={self.sequence_parallel}: batch[{key!r}] of shape {x.shape[1:]} "
          f"per seed has no sequence axis (axis 1 of an example) of a length divisible by "
          f"{self.sequence_parallel}; sequence parallelism splits every array along it")
    if self.sequence_layout == "zigzag":
      from attnx.core.parallel import ring  # noqa: PLC0415

      x = np.asarray(ring.zigzag_permute(x, self.sequence_parallel, axis=2))
    return x

  def _global(self, sharding: NamedSharding, x: np.ndarray, batch_size: int | None) -> Any:
    """The global array of which `x` holds this process's rows (all positions)."""
    shape = (x.shape[0], batch_size) + x.shape[2:]
    if self.sequence_parallel > 1:
      _, (c, d) = process_block(self.parallel, batch_size, x.shape[2], self.sequence_parallel)
      x = x[:, :, c:d]
    return jax.make_array_from_process_local_data(sharding, x, shape)

  def metrics(self, metrics: Any) -> Any:
    """Metrics with the device axis dropped (they are reduced over devices: all copies agree)."""
    return self.unplace(metrics)


def _own_copy(x: Any) -> Any:
  """This process's copy of a replicated global array (the array itself when addressable)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x
