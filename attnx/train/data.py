"""Batches over in-memory arrays: `loader`, used for training and for evaluation.

Training streams are deterministic and resumable: the batch at step t depends only on
(seed, t). Two pipelines over in-memory arrays, both exact on resume:

* ``"numpy"`` (default): a numpy permutation per epoch. Fast: the gather is the only cost.
* ``"grain"``: a ``grain.MapDataset`` (global shuffle with a new permutation every epoch,
  repeat) read by index, the shuffle ``attnx.data.load`` uses. grain reads it one index at a
  time in Python (≈ 0.9 ms of host time per batch of 32 on a 2-core CPU, numpy 0.01 ms): hidden
  behind the ~12 ms steps of the default experiment on CPU, not behind accelerator steps, hence
  not the default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

import numpy as np

PIPELINES = ("numpy", "grain")


def _shuffled_batches(arrays: Mapping[str, np.ndarray], batch_size: int, start_step: int,
                      take: Callable[[int, int, int], np.ndarray],
                      rows: tuple[int, int] | None = None) -> Iterator[dict[str, np.ndarray]]:
  """Batches lo:hi of epoch e's permutation, ``take(e, lo, hi)``, from step `start_step` on.

  `rows` = (a, b): only rows a:b of every batch are gathered (a process's share).
  """
  n = len(next(iter(arrays.values())))
  per_epoch = n // batch_size
  if per_epoch == 0:
    raise ValueError(f"batch_size={batch_size} is larger than the {n} examples")
  a, b = rows if rows is not None else (0, batch_size)
  if not 0 <= a < b <= batch_size:
    raise ValueError(f"rows={rows} is not a non-empty range of the {batch_size} rows of a batch")
  step = start_step
  while True:
    epoch, i = divmod(step, per_epoch)
    idx = np.sort(take(epoch, i * batch_size, (i + 1) * batch_size))[a:b]
    yield {k: v[idx] for k, v in arrays.items()}
    step += 1


def array_stream(arrays: Mapping[str, np.ndarray], batch_size: int, seed: int,
                 start_step: int = 0, rows: tuple[int, int] | None = None
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Endless shuffled batches over in-memory arrays, resumable at any step.

  Epoch e uses the permutation of np.random.default_rng([seed, e]); incomplete final batches
  are dropped. Starting at `start_step` yields exactly the batches an uninterrupted stream
  yields from that step on, which is what makes checkpoint resume exact. `rows` = (a, b):
  rows a:b of each of those batches only.
  """
  n = len(next(iter(arrays.values())))

  @functools.lru_cache(maxsize=1)
  def permutation(epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)

  return _shuffled_batches(arrays, batch_size, start_step,
                           lambda epoch, lo, hi: permutation(epoch)[lo:hi], rows)


def grain_stream(arrays: Mapping[str, np.ndarray], batch_size: int, seed: int,
                 start_step: int = 0, rows: tuple[int, int] | None = None
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Endless shuffled batches over in-memory arrays from a grain ``MapDataset``.

  The dataset is range(n) → shuffle(seed) → repeat, whose epoch e is a fresh permutation;
  batches are consecutive runs of it within an epoch (the incomplete last batch of an epoch is
  dropped, as in :func:`array_stream`). Random access makes the batch of step t a function of
  (seed, t), so resuming at `start_step` is exact without saving iterator state.
  """
  import grain  # noqa: PLC0415 (heavy import, only for this pipeline)

  n = len(next(iter(arrays.values())))
  order = grain.MapDataset.range(n).shuffle(seed=int(seed) % 2**32).repeat(None)

  def take(epoch: int, lo: int, hi: int) -> np.ndarray:
    return np.fromiter((order[epoch * n + j] for j in range(lo, hi)), np.int64, hi - lo)

  return _shuffled_batches(arrays, batch_size, start_step, take, rows)


class Loader:
  """Batches over in-memory arrays, for training and for evaluation alike.

  ``loader(seed, start_step)`` is the training stream `fit` reads (`train_data`): endless,
  shuffled per epoch by `pipeline` (see :data:`PIPELINES`), full batches only, and exact on
  resume. ``loader()`` (or iterating over it) is one ordered pass over every example, the last
  batch possibly smaller: what `fit`'s `eval_data` and `evaluate` read. Build it with
  :func:`loader`.
  """

  def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int,
               pipeline: str = "numpy"):
    if pipeline not in PIPELINES:
      raise ValueError(f"Unknown data pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}.")
    if not arrays:
      raise ValueError("loader: no arrays given")
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) > 1:
      raise ValueError(f"loader: arrays differ in length: {sizes}")
    if int(batch_size) < 1:
      raise ValueError(f"loader: batch_size must be >= 1, got {batch_size!r}")
    self.arrays = arrays
    self.batch_size = int(batch_size)
    self.pipeline = pipeline

  def __call__(self, seed: int | None = None, start_step: int = 0,
               rows: tuple[int, int] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """With a seed: the endless shuffled training stream from `start_step`; else one pass.

    `rows` = (a, b): only rows a:b of every training batch are read, the share of one process
    of a multi-process run (`fit` passes it; the global batch is the same).
    """
    if seed is None:
      return self._ordered()
    stream = grain_stream if self.pipeline == "grain" else array_stream
    return stream(self.arrays, self.batch_size, seed, start_step, rows)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self._ordered()

  def __len__(self) -> int:
    """Batches in one ordered pass."""
    return -(-len(next(iter(self.arrays.values()))) // self.batch_size)

  def _ordered(self) -> Iterator[dict[str, np.ndarray]]:
    n = len(next(iter(self.arrays.values())))
    for i in range(0, n, self.batch_size):
      yield {k: v[i:i + self.batch_size] for k, v in self.arrays.items()}


def loader(arrays: Mapping[str, np.ndarray], batch_size: int, pipeline: str = "numpy") -> Loader:
  """The one data path of attnx.train: a :class:`Loader` over in-memory arrays.

  ``fit(train_data=loader(train, 32, config.data_pipeline), eval_data=loader(test, 500))``;
  ``evaluate(model, params, loader(test, 500))``.

  Example:
    >>> import numpy as np
    >>> from attnx import train
    >>> data = train.loader({"inputs": np.arange(10), "targets": np.arange(10) % 2}, 4)
    >>> [batch["inputs"].tolist() for batch in data]  # one ordered pass
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> stream = data(seed=0)  # the endless shuffled training stream of seed 0
    >>> [next(stream)["inputs"].shape for _ in range(3)]  # full batches only
    [(4,), (4,), (4,)]
  """
  return Loader(arrays, batch_size, pipeline)
