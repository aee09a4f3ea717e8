"""Orbax checkpoints of the stacked train state (+ a small JSON of metadata) per run.

A checkpoint that cannot be read back (truncated or missing files, broken JSON) raises
`CheckpointDamagedError` naming its step and directory, so that `fit` can fall back to an
earlier one instead of failing with orbax's and tensorstore's tracebacks.

Layout: ``<workdir>/checkpoints/<run>/<step>/{state,meta}`` (the last `keep` steps of each
run). `load_checkpoint` reads one back for use outside training.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

_T = TypeVar("_T")


class CheckpointDamagedError(RuntimeError):
  """A checkpoint (or every checkpoint of a run) could not be read back; nothing was changed.

  `step` is the damaged step (None when the error is about a whole run), `directory` the run's
  checkpoint directory.
  """

  def __init__(self, message: str, step: int | None = None, directory: str = ""):
    super().__init__(message)
    self.step = step
    self.directory = directory


def _one_line(e: BaseException, width: int = 160) -> str:
  """`Type: first line of the message`, cut to `width` (tensorstore errors embed long specs)."""
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0] if lines else ''}".strip()
  return text if len(text) <= width else text[:width - 3] + "..."


def _is_closed_loop_report(unraisable: Any) -> bool:
  """Whether an unraisable exception is a read finishing after orbax closed its event loop."""
  e = unraisable.exc_value
  if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  while tb is not None:
    if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
      return True
    tb = tb.tb_next
  return False


class _OrphanedReads(logging.Filter):
  """Drops asyncio's "Task/Future exception was never retrieved" reports of orbax's restore
  tasks and tensorstore's reads (newer asyncio/tensorstore versions report bare Futures)."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    orphan = msg.startswith(("Task exception was never retrieved",
                             "Future exception was never retrieved"))
    return not (orphan and ("orbax" in msg or "tensorstore_spec" in msg))


def _quiet_failed_restore_aftermath() -> None:
  """Keep the reads that a failed restore leaves behind from printing dozens of tracebacks.

  When one read of a restore fails, orbax closes its event loop while tensorstore's other reads
  are in flight: each of those later reports RuntimeError('Event loop is closed') through
  sys.unraisablehook, and asyncio logs every failed task that nobody awaited, long after the
  error itself was handled (and reported in one line). Only these reports are dropped.
  """
  asyncio_logger = logging.getLogger("asyncio")
  if not any(isinstance(f, _OrphanedReads) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_OrphanedReads())
  previous = sys.unraisablehook
  if getattr(previous, "_attnx_closed_loop_filter", False):
    return

  def hook(unraisable: Any) -> None:
    if not _is_closed_loop_report(unraisable):
      previous(unraisable)

  hook._attnx_closed_loop_filter = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook


def _dtype(x: Any) -> np.dtype:
  """An array's dtype, or NumPy's for a Python scalar (a jax.Array is not a dtype-like:
  np.result_type of one is deprecated from jax 0.12)."""
  return x.dtype if hasattr(x, "dtype") else np.result_type(x)


class Checkpointer:
  """Saves every `every` steps under workdir/checkpoints/<run>, keeps the last `keep`."""

  def __init__(self, workdir: str, run: str, every: int, keep: int = 3, create: bool = True):
    self.directory = run_directory(workdir, run)
    self.every = every
    # Synchronous saves: a kill right after save() returns still leaves a complete checkpoint.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps on disk, oldest first (damaged ones included: they are only found by reading)."""
    return sorted(int(s) for s in self.manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Save checkpoint `step`, replacing one left at that step (a damaged one `fit` skipped).

    `fit` only trains past a step on disk when it could not read that checkpoint back, and
    orbax refuses to overwrite a step, so that damaged step alone is deleted first.
    """
    host = jax.tree.map(np.asarray, jax.device_get(state))
    if step in self.all_steps():
      self.manager.delete(step)
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(host),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def _read(self, step: int, what: str, read: Callable[[], _T]) -> _T:
    """`read()`, with any failure turned into one CheckpointDamagedError naming the step."""
    _quiet_failed_restore_aftermath()
    try:
      return read()
    except Exception as e:  # noqa: BLE001 - any failure to read back means a damaged checkpoint
      raise CheckpointDamagedError(
          f"checkpoint step {step} in {self.directory} is damaged: its {what} cannot be read "
          f"({_one_line(e)})", step=step, directory=self.directory) from e

  def read_meta(self, step: int) -> dict:
    """The JSON metadata of checkpoint `step` alone (cheap; the state is not read).

    Raises CheckpointDamagedError when it cannot be read back.
    """
    def read() -> dict:
      restored = self.manager.restore(step,
                                      args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      meta = restored["meta"]
      if not isinstance(meta, dict):
        raise TypeError(f"metadata is a {type(meta).__name__}, not a JSON object")
      return dict(meta)

    return self._read(step, "metadata", read)

  def restore(self, step: int, target: Any = None) -> Any:
    """The state of checkpoint `step`, in the structure (and dtypes/shapes) of `target`
    (None: as saved, numpy arrays).

    Raises CheckpointDamagedError when it cannot be read back.
    """
    abstract = None
    if target is not None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=sharding),
          target)

    def read() -> Any:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
      return restored["state"]

    return self._read(step, "train state", read)

  def close(self) -> None:
    self.manager.close()


def run_directory(workdir: str, run: str) -> str:
  """Where the checkpoints of run `run` of `workdir` live: ``<workdir>/checkpoints/<run>``."""
  return os.path.abspath(os.path.join(workdir, "checkpoints", run))


def list_checkpointed_runs(workdir: str) -> list[str]:
  """The runs of `workdir` with a checkpoint directory, sorted."""
  root = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(root):
    return []
  return sorted(r for r in os.listdir(root) if os.path.isdir(os.path.join(root, r)))


@dataclasses.dataclass(frozen=True)
class SavedState:
  """A checkpoint of a run, read back by :func:`load_checkpoint`.

  Attributes:
    run: the run's name (``fit``'s ``name=``; experiments name runs ``<task>-<variant>``).
    step: the training step it was saved at.
    steps: every step of the run on disk, oldest first.
    directory: the run's checkpoint directory, ``<workdir>/checkpoints/<run>``.
    state: the train state as numpy arrays, every leaf stacked over the run's seeds (leading
      axis): ``params``, ``opt_state``, ``key``, ``bad_step`` and, for models with
      non-trained collections, ``extra``.
    meta: ``fit``'s JSON metadata: ``seeds``, ``fingerprint`` (what determines the result:
      model, optimizer, data, steps), ``last_metrics`` and ``timing``.
  """

  run: str
  step: int
  steps: tuple[int, ...]
  directory: str
  state: dict[str, Any]
  meta: dict[str, Any]

  @property
  def seeds(self) -> list[int]:
    """The run's seeds, in the order of the state's leading axis."""
    return [int(s) for s in self.meta.get("seeds", range(self.num_seeds))]

  @property
  def num_seeds(self) -> int:
    return int(np.shape(jax.tree.leaves(self.state["params"])[0])[0])

  @property
  def params(self) -> Any:
    """The parameters of every seed (leading axis: seeds)."""
    return self.state["params"]

  def params_for(self, seed: int | None = None) -> Any:
    """The parameters of one seed (default: the run's first), ready for ``model.apply``.

    Raises a ValueError naming the run's seeds when `seed` is not one of them.
    """
    seeds = self.seeds
    if seed is None:
      seed = seeds[0]
    if seed not in seeds:
      raise ValueError(f"run {self.run!r} has no seed {seed}; its seeds: {seeds}")
    index = seeds.index(seed)
    return jax.tree.map(lambda x: np.asarray(x)[index], self.state["params"])


def load_checkpoint(workdir: str, run: str, step: int | None = None) -> SavedState:
  """Read checkpoint `step` (default: the newest intact one) of run `run` of `workdir`.

  What ``fit`` (and so every ``launch.py`` experiment) saves under
  ``<workdir>/checkpoints/<run>/<step>/``, without the model or its optimizer: the arrays come
  back as numpy, stacked over seeds. ``params_for(seed)`` gives one seed's parameters for
  ``model.apply({"params": ...}, x)``::

    saved = attnx.train.load_checkpoint("runs/compare_weightings-default", "digits-softmax")
    params = saved.params_for(seed=0)

  Raises:
    FileNotFoundError: `workdir` has no checkpoints of `run` (naming the runs it has).
    ValueError: no checkpoint at `step` (naming the steps on disk).
    CheckpointDamagedError: the requested checkpoint (or, with ``step=None``, every one of
      the run) cannot be read back; with ``step=None`` a damaged newest one is reported on
      stderr and the next older one is read.
  """
  directory = run_directory(workdir, run)
  if not os.path.isdir(directory):
    runs = list_checkpointed_runs(workdir)
    raise FileNotFoundError(
        f"no checkpoints of run {run!r} in {os.path.abspath(workdir)} ({directory} does not "
        f"exist); runs with checkpoints there: {', '.join(runs) or 'none'}")
  ckpt = Checkpointer(workdir, run, every=0, create=False)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"{directory} holds no checkpoint")
    if step is not None and step not in steps:
      raise ValueError(f"run {run!r} has no checkpoint at step {step} in {directory}; "
                       f"steps: {steps}")
    damaged: list[CheckpointDamagedError] = []
    for candidate in [step] if step is not None else steps[::-1]:
      try:
        meta = ckpt.read_meta(candidate)
        state = ckpt.restore(candidate)
      except CheckpointDamagedError as e:
        if step is not None:
          raise
        damaged.append(e)
        print(f"WARNING: {e}; reading an older one", file=sys.stderr, flush=True)
        continue
      state = jax.tree.map(np.asarray, state)
      return SavedState(run=run, step=int(candidate), steps=tuple(steps), directory=directory,
                        state=dict(state), meta=meta)
    raise CheckpointDamagedError(
        f"run {run!r}: no intact checkpoint in {directory} (step(s) "
        f"{', '.join(str(e.step) for e in damaged)} cannot be read back)", directory=directory)
  finally:
    ckpt.close()
