"""The 1,797 8x8 handwritten digits shipped with scikit-learn (real data, offline).

Source: `sklearn.datasets.load_digits` (UCI optical recognition of handwritten
digits). Images are 8x8 with integer intensities 0..16, stored here as float32
[8, 8, 1] in [0, 1] (divided by 16). A fixed stratified split (sklearn
`train_test_split(test_size=360, stratify=labels, random_state=seed)`) gives
1,437 train / 360 test examples; "index" is the row in sklearn's array, and
examples within a split are sorted by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, float_tensor

NUM_EXAMPLES = 1797
NUM_TEST = 360


@dataclasses.dataclass(eq=False)
class DigitsConfig(AttnxConfig):
  """`seed` is the `random_state` of the stratified train/test split."""

  test_size: int = NUM_TEST

  def validate(self) -> None:
    if not 10 <= self.test_size <= NUM_EXAMPLES - 10:
      raise ValueError(f"digits test_size must be in [10, {NUM_EXAMPLES - 10}].")


def split_indices(seed: int = 0, test_size: int = NUM_TEST) -> dict[str, np.ndarray]:
  """Sorted sklearn row indices of the stratified train/test split."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  labels = load_digits().target
  train, test = train_test_split(
    np.arange(len(labels)), test_size=test_size, stratify=labels, random_state=seed
  )
  return {"train": np.sort(train), "test": np.sort(test)}


class Digits(AttnxBuilder):
  """scikit-learn's 8x8 digits as a TFDS dataset."""

  BUILDER_CONFIGS = [DigitsConfig(name="default", description="Stratified 1437/360 split.")]
  HOMEPAGE = "https://scikit-learn.org/stable/modules/generated/sklearn.datasets.load_digits.html"

  @classmethod
  def _features(cls, config):
    return {
      "inputs": float_tensor((8, 8, 1)),
      "targets": tfds.features.Scalar(dtype=np.int32),
      "index": tfds.features.Scalar(dtype=np.int32),
    }

  @classmethod
  def _split_sizes(cls, config):
    return {"train": NUM_EXAMPLES - config.test_size, "test": config.test_size}

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    idx = split_indices(config.seed, config.test_size)[split]
    assert len(idx) == n
    images = (data.images[idx] / 16.0).astype(np.float32)[..., None]
    return {
      "inputs": images,
      "targets": data.target[idx].astype(np.int32),
      "index": idx.astype(np.int32),
    }

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="digits",
      task="classification",
      input_shape=(8, 8, 1),
      input_dtype="float32",
      num_classes=10,
      vocab_size=None,
      target_vocab_size=None,
      seq_len=None,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={"params": config.params()},
    )
