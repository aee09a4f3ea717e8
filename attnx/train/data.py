"""Deterministic, resumable batch streams: the batch at step t depends only on (seed, t)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np


def array_stream(arrays: Mapping[str, np.ndarray], batch_size: int, seed: int,
                 start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Endless shuffled batches over in-memory arrays, resumable at any step.

  Epoch e uses the permutation of np.random.default_rng([seed, e]); incomplete final batches
  are dropped. Starting at `start_step` yields exactly the batches an uninterrupted stream
  yields from that step on, which is what makes checkpoint resume exact.
  """
  n = len(next(iter(arrays.values())))
  per_epoch = n // batch_size
  if per_epoch == 0:
    raise ValueError(f"batch_size={batch_size} is larger than the {n} examples")
  step = start_step
  while True:
    epoch, offset = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    for i in range(offset, per_epoch):
      idx = np.sort(perm[i * batch_size:(i + 1) * batch_size])
      yield {k: v[idx] for k, v in arrays.items()}
      step += 1


def stream_fn(arrays: Mapping[str, np.ndarray],
              batch_size: int) -> Callable[[int, int], Iterator[dict[str, np.ndarray]]]:
  """`train_data(seed, start_step)` for `fit` over in-memory arrays."""
  return lambda seed, start_step: array_stream(arrays, batch_size, seed, start_step)


def batches(arrays: Mapping[str, np.ndarray], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """One ordered pass over arrays (the last batch may be smaller): for evaluation."""
  n = len(next(iter(arrays.values())))
  for i in range(0, n, batch_size):
    yield {k: v[i:i + batch_size] for k, v in arrays.items()}
