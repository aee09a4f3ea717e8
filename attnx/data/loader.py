"""Loading attnx's own TFDS datasets and catalog datasets, batched with grain.

Data dirs (:mod:`attnx.data.paths`):
  * attnx's own datasets: `data_dir` argument, else `$ATTNX_DATA_DIR`, else
    `~/.cache/attnx/tensorflow_datasets`. They are generated automatically on
    first use (seconds), under a file lock so that concurrent processes
    (e.g. parallel test workers) prepare each dataset once.
  * catalog datasets (mnist, ...): `data_dir` argument, else `$TFDS_DATA_DIR`,
    else `~/tensorflow_datasets`. Never downloaded; see `attnx.data.catalog`.

Reading uses `builder.as_data_source(split)` (array_record random access, no
TensorFlow) and `grain.MapDataset` for deterministic shuffling (global
permutation, reseeded every epoch), repetition and batching.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from attnx.data import catalog
from attnx.data._base import AttnxBuilder, DatasetInfo
from attnx.data.associative_recall import AssociativeRecall
from attnx.data.catalog import CATALOG, DatasetNotFoundError
from attnx.data.copy_reverse_sort import CopyReverseSort
from attnx.data.digits import Digits
from attnx.data.icl_regression import IclRegression
from attnx.data.listops import Listops
from attnx.data.noisy_clusters import NoisyClusters
from attnx.data.nw_regression import NwRegression
from attnx.data.paths import attnx_data_dir, catalog_data_dir
from attnx.data.shakespeare import Shakespeare
from attnx.data.synthetic_translation import SyntheticTranslation

BUILDERS: dict[str, type[AttnxBuilder]] = {
  "associative_recall": AssociativeRecall,
  "copy_reverse_sort": CopyReverseSort,
  "digits": Digits,
  "icl_regression": IclRegression,
  "listops": Listops,
  "noisy_clusters": NoisyClusters,
  "nw_regression": NwRegression,
  "shakespeare": Shakespeare,
  "synthetic_translation": SyntheticTranslation,
}

def list_datasets() -> list[str]:
  """attnx's own datasets followed by the supported TFDS catalog datasets."""
  return sorted(BUILDERS) + sorted(CATALOG)


def _parse_name(name: str, config_kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
  """Handles "name/config" and validates the name."""
  kwargs = dict(config_kwargs)
  if not isinstance(name, str):
    raise ValueError(f"Dataset name must be a string, got {name!r}.")
  if "/" in name:
    name, config_name = name.split("/", 1)
    if "config" in kwargs and kwargs["config"] != config_name:
      raise ValueError(f"Conflicting configs {config_name!r} and {kwargs['config']!r}.")
    kwargs["config"] = config_name
  if name not in BUILDERS and name not in CATALOG:
    raise ValueError(f"Unknown dataset {name!r}; valid names: {list_datasets()}.")
  if name in CATALOG and kwargs.pop("config", None) is not None:
    raise ValueError(f"Catalog dataset {name!r} takes no 'config' in attnx.data.")
  return name, kwargs


def _check_split(name: str, split: str, splits: Sequence[str]) -> None:
  if not isinstance(split, str):
    raise ValueError(f"split must be a string, got {split!r}.")
  for part in split.split("+"):
    base = part.split("[", 1)[0].strip()
    if base not in splits:
      raise ValueError(
        f"Unknown split {split!r} for dataset {name!r}; valid splits: {list(splits)}."
      )


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def get_builder(
  name: str, *, data_dir: str | os.PathLike | None = None, **config_kwargs: Any
) -> AttnxBuilder:
  """The prepared TFDS builder of one of attnx's own datasets (prepares it if needed)."""
  name, kwargs = _parse_name(name, config_kwargs)
  if name not in BUILDERS:
    raise ValueError(f"{name!r} is a catalog dataset; use tfds.builder for it.")
  cls = BUILDERS[name]
  config = cls.resolve_config(**kwargs)
  root = attnx_data_dir(data_dir)
  builder = cls(config=config, data_dir=root, file_format="array_record")
  if builder.is_prepared():
    return builder
  os.makedirs(root, exist_ok=True)
  # One lock per dataset: configs of one dataset share <root>/<name>/.config.
  with _file_lock(os.path.join(root, f".{name}.lock")):
    builder = cls(config=config, data_dir=root, file_format="array_record")
    if not builder.is_prepared():
      previous = getattr(tfds.core.utils.tqdm_utils, "_active", True)
      tfds.display_progress_bar(False)
      try:
        with contextlib.redirect_stdout(io.StringIO()):  # TFDS prints progress
          builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(
              try_download_gcs=False,
              compute_stats=tfds.download.ComputeStatsMode.SKIP,
            )
          )
      finally:
        tfds.display_progress_bar(previous)
  return builder


def get_info(
  name: str, *, data_dir: str | os.PathLike | None = None, **config_kwargs: Any
) -> DatasetInfo:
  """Metadata of a dataset (shapes, classes, vocab, splits) without preparing it.

  `data_dir` is only used for catalog datasets: when prepared there, their
  real split sizes are reported; otherwise the standard sizes.

  Example:
    >>> from attnx import data
    >>> info = data.get_info("listops", config="tiny")
    >>> info.task, info.input_shape, info.num_classes, info.vocab_size
    ('classification', (32,), 10, 16)
    >>> info.splits
    {'train': 256, 'validation': 64, 'test': 64}
    >>> data.get_info("listops", max_length=256).config_name  # a field override
    'default-max_length=256'
  """
  name, kwargs = _parse_name(name, config_kwargs)
  if name in BUILDERS:
    cls = BUILDERS[name]
    config = cls.resolve_config(**kwargs)
    info = cls.describe(config)
    info.name = name
    info.config_name = config.name
    return info
  splits = None
  catalog.catalog_params(name, **kwargs)  # validate kwargs before touching the disk
  builder = tfds.builder(name, data_dir=catalog_data_dir(data_dir), try_gcs=False)
  if builder.is_prepared():
    splits = {s: int(v.num_examples) for s, v in builder.info.splits.items()}
  return catalog.catalog_info(name, splits=splits or None, **kwargs)


def _catalog_source(
  name: str, split: str, data_dir: str | os.PathLike | None, kwargs: dict[str, Any]
) -> tuple[Sequence[Any], Callable[[dict[str, Any]], dict[str, np.ndarray]]]:
  post = catalog.make_postprocess(name, **kwargs)  # validates kwargs first
  root = catalog_data_dir(data_dir)
  builder = tfds.builder(name, data_dir=root, try_gcs=False)
  splits = list(builder.info.splits) or list(CATALOG[name].splits)
  _check_split(name, split, splits)
  try:
    source = builder.as_data_source(split)
  except (NotImplementedError, ValueError, FileNotFoundError, AssertionError, KeyError) as e:
    if not builder.is_prepared():
      raise DatasetNotFoundError(catalog.not_found_message(name, root)) from e
    raise DatasetNotFoundError(
      catalog.not_found_message(
        name, root, f"found at {builder.data_dir} but not readable with random access ({e})"
      )
    ) from e
  return source, post


class _Cast:
  """Casts decoded examples to the feature dtypes (TFDS returns scalars as int64/float64)."""

  def __init__(self, dtypes: dict[str, np.dtype], example_bytes: int):
    self.dtypes = dtypes
    self.example_bytes = example_bytes

  def __call__(self, ex: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, self.dtypes.get(k)) for k, v in ex.items()}


def _source(
  name: str, split: str, data_dir: str | os.PathLike | None, config_kwargs: dict[str, Any]
) -> tuple[Sequence[Any], Callable[[dict[str, Any]], dict[str, Any]]]:
  name, kwargs = _parse_name(name, config_kwargs)
  if name in CATALOG:
    return _catalog_source(name, split, data_dir, kwargs)
  cls = BUILDERS[name]
  config = cls.resolve_config(**kwargs)  # validate before touching the disk
  _check_split(name, split, list(cls._split_sizes(config)))
  builder = get_builder(name, data_dir=data_dir, **kwargs)
  features = cls._features(config)
  dtypes = {k: np.dtype(f.np_dtype) for k, f in features.items()}
  nbytes = sum(int(np.prod(f.shape)) * dtypes[k].itemsize for k, f in features.items())
  return builder.as_data_source(split), _Cast(dtypes, nbytes)


_IN_MEMORY_LIMIT_BYTES = 256 * 2**20


def _get_many(source: Sequence[Any], indices: list[int]) -> list[Any]:
  try:
    return list(source.__getitems__(indices))
  except (AttributeError, TypeError):  # e.g. tfds.testing.mock_data sources
    return [source[i] for i in indices]


def _stack(examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
  return {k: np.stack([np.asarray(ex[k]) for ex in examples]) for k in examples[0]}


def _read_all(
  source: Sequence[Any], post: Callable[[dict[str, Any]], dict[str, Any]], chunk: int = 4096
) -> dict[str, np.ndarray]:
  n = len(source)
  parts = []
  for start in range(0, n, chunk):
    examples = _get_many(source, list(range(start, min(n, start + chunk))))
    parts.append(_stack([post(ex) for ex in examples]))
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class _Gather:
  """Batch of indices -> batch of examples from in-memory arrays (vectorized)."""

  def __init__(self, arrays: dict[str, np.ndarray]):
    self.arrays = arrays

  def __call__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[indices] for k, v in self.arrays.items()}


class _Fetch:
  """Batch of indices -> batch of examples read from the TFDS data source."""

  def __init__(self, source: Sequence[Any], post: Callable[[dict[str, Any]], dict[str, Any]]):
    self.source = source
    self.post = post

  def __call__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    examples = _get_many(self.source, [int(i) for i in indices])
    return _stack([self.post(ex) for ex in examples])


def load(
  name: str,
  split: str = "train",
  *,
  batch_size: int,
  seed: int = 0,
  shuffle: bool = True,
  num_epochs: int | None = None,
  drop_remainder: bool = True,
  data_dir: str | os.PathLike | None = None,
  shard_index: int = 0,
  num_shards: int = 1,
  in_memory: bool | None = None,
  num_threads: int = 1,
  **config_kwargs: Any,
) -> Iterator[dict[str, np.ndarray]]:
  """Batches of numpy arrays from a dataset split.

  The pipeline is a grain `MapDataset` over example indices: shard, shuffle
  (global permutation from `seed`, a different one every epoch), repeat,
  batch, then gather the examples of each batch. The order depends only on
  (seed, shard, batch_size, split size), never on timing or `in_memory`.

  Args:
    name: a name from `list_datasets()`, optionally "name/config".
    split: "train", "validation" or "test" (TFDS slicing such as "train[:10%]" works).
    batch_size: examples per batch (leading axis of every array).
    seed: shuffling seed.
    shuffle: globally shuffle examples (a new permutation every epoch).
    num_epochs: passes over the data; None repeats forever.
    drop_remainder: drop a last incomplete batch.
    data_dir: data dir (see module docstring for defaults).
    shard_index, num_shards: read every `num_shards`-th example starting at
      `shard_index` (e.g. one shard per host), before shuffling.
    in_memory: read the split once into memory and gather batches from numpy
      arrays (much faster than per-example array_record reads). None: on for
      attnx's own datasets below 256 MiB, off for catalog datasets.
    num_threads: grain threads preparing batches ahead (0: in the calling thread).
    **config_kwargs: dataset parameters (`config="tiny"` picks a named config;
      other keys override fields, see `get_info(name).extras["params"]`).

  Returns:
    A grain iterator (checkpointable via get_state/set_state) of dicts with
    "inputs" and "targets" (+ "decoder_inputs" for seq2seq, "mask" for
    token tasks, and dataset-specific extras).
  """
  if int(batch_size) < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  if num_epochs is not None and int(num_epochs) < 1:
    raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}.")
  if not 0 <= shard_index < num_shards:
    raise ValueError(f"Need 0 <= shard_index < num_shards, got {shard_index}, {num_shards}.")
  source, post = _source(name, split, data_dir, config_kwargs)
  n = len(source)
  if in_memory is None:
    in_memory = isinstance(post, _Cast) and n * post.example_bytes <= _IN_MEMORY_LIMIT_BYTES
  fetch = _Gather(_read_all(source, post)) if in_memory else _Fetch(source, post)
  ds = grain.MapDataset.range(n)
  if num_shards > 1:
    ds = ds[shard_index::num_shards]
  if shuffle:
    ds = ds.shuffle(seed=int(seed) % 2**32)
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = ds.batch(int(batch_size), drop_remainder=drop_remainder).map(fetch)
  if num_threads > 0:
    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2)
    return iter(ds.to_iter_dataset(read_options))
  return iter(ds)


def load_arrays(
  name: str,
  split: str = "test",
  *,
  data_dir: str | os.PathLike | None = None,
  **config_kwargs: Any,
) -> dict[str, np.ndarray]:
  """The whole split in memory, in stored order, as a dict of stacked arrays."""
  source, post = _source(name, split, data_dir, config_kwargs)
  if len(source) == 0:
    raise ValueError(f"Split {split!r} of {name!r} is empty.")
  return _read_all(source, post)


def load_by_level(name: str, key: str, levels: Sequence[float], *, train_level: float,
                  num_train: int, num_test: int, data_dir: str | os.PathLike | None = None,
                  **config_kwargs: Any) -> dict[str, dict[str, np.ndarray]]:
  """Training arrays of dataset ``name`` at ``key = train_level`` and evaluation arrays at
  every level of ``levels`` (one prepared config per level, :func:`load_arrays`):
  ``{"train": {inputs, targets}, "eval": {inputs_by_level [levels, N, ...], targets}}`` — the
  input of the ``"accuracy_by_level"`` / ``"weight_tv_by_level"`` evaluators. E.g.
  ``load_by_level("noisy_clusters", "global_noise", [0, 1, 3], train_level=0, num_train=512,
  num_test=128)``: the test split's draws of noisy_clusters do not depend on the level, so
  every level has the same clean objects and direction g; only the size of g changes.
  ``config_kwargs``: the builder's other fields (seed, num_classes, dim, ...).

  Raises:
    ValueError: without levels, or if the levels' evaluation sets do not share their targets
      (a dataset whose draws change with ``key``).
  """
  if not levels:
    raise ValueError("load_by_level needs at least one evaluation level")
  train = load_arrays(name, "train", data_dir=data_dir, **config_kwargs,
                      **{key: train_level}, num_train=num_train, num_test=0)
  evals = [load_arrays(name, "test", data_dir=data_dir, **config_kwargs, **{key: float(x)},
                       num_train=0, num_test=num_test) for x in levels]
  if not all(np.array_equal(e["targets"], evals[0]["targets"]) for e in evals):
    raise ValueError(f"load_by_level: {name}'s evaluation sets at the levels of {key!r} do not "
                     "share their samples")
  return {"train": {k: train[k] for k in ("inputs", "targets")},
          "eval": {"inputs_by_level": np.stack([e["inputs"] for e in evals]),
                   "targets": evals[0]["targets"]}}
