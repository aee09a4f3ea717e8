"""The Nadaraya-Watson toy problem of Martínez-Ramón, Ajith & Kurup's slides on attention.

After d2l, "Attention pooling".

y = 2 sin(x) + x + eps with eps ~ N(0, noise_std^2):

  train: n points x ~ U(x_min, x_max), sorted, with noisy y (defaults: 100
         points on [0, 4], noise_std 1, as in the slides; d2l uses 40 on [0, 5]);
  test:  a grid of grid_size points linspace(x_min, x_max) with the noiseless
         truth 2 sin(x) + x.

inputs [1] float32 (x), targets [] float32 (y). `load_arrays("nw_regression",
"train")` gives all keys/values for attention pooling at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, float_tensor


def truth(x: np.ndarray) -> np.ndarray:
  """The noiseless function 2 sin(x) + x."""
  return 2.0 * np.sin(x) + x


@dataclasses.dataclass(eq=False)
class NwRegressionConfig(AttnxConfig):
  """Sample size n, interval [x_min, x_max], noise_std, test grid_size."""

  n: int = 100
  x_min: float = 0.0
  x_max: float = 4.0
  noise_std: float = 1.0
  grid_size: int = 41

  def validate(self) -> None:
    if self.n < 1 or self.grid_size < 2 or not self.x_min < self.x_max or self.noise_std < 0:
      raise ValueError("nw_regression needs n >= 1, grid_size >= 2, x_min < x_max, noise >= 0.")


def make_nw_regression(
  n: int = 100,
  seed: int = 0,
  *,
  x_min: float = 0.0,
  x_max: float = 4.0,
  noise_std: float = 1.0,
  grid_size: int = 41,
) -> dict[str, np.ndarray]:
  """Training sample and test grid as float32 arrays.

  Returns:
    x_train [n] (sorted), y_train [n], x_test [grid_size], y_test [grid_size]
    (noiseless truth).
  """
  rng = np.random.default_rng(seed)
  x = np.sort(rng.uniform(x_min, x_max, size=n))
  y = truth(x) + noise_std * rng.standard_normal(n)
  grid = np.linspace(x_min, x_max, grid_size)
  f32 = np.float32
  return {
    "x_train": x.astype(f32),
    "y_train": y.astype(f32),
    "x_test": grid.astype(f32),
    "y_test": truth(grid).astype(f32),
  }


class NwRegression(AttnxBuilder):
  """y = 2 sin x + x + noise; train sample and noiseless test grid."""

  BUILDER_CONFIGS = [
    NwRegressionConfig(name="default", description="100 points on [0, 4], noise sd 1."),
    NwRegressionConfig(
      name="d2l", description="d2l: 40 points on [0, 5], grid of 50.", n=40, x_max=5.0,
      grid_size=51,
    ),
  ]

  @classmethod
  def _features(cls, config):
    return {"inputs": float_tensor((1,)), "targets": tfds.features.Scalar(dtype=np.float32)}

  @classmethod
  def _split_sizes(cls, config):
    return {"train": config.n, "test": config.grid_size}

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    # One seed for the whole problem: the grid does not depend on it.
    data = make_nw_regression(
      config.n,
      config.seed,
      x_min=config.x_min,
      x_max=config.x_max,
      noise_std=config.noise_std,
      grid_size=config.grid_size,
    )
    x, y = (data["x_train"], data["y_train"]) if split == "train" else (
      data["x_test"], data["y_test"]
    )
    return {"inputs": x[:, None], "targets": y}

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="nw_regression",
      task="regression",
      input_shape=(1,),
      input_dtype="float32",
      num_classes=None,
      vocab_size=None,
      target_vocab_size=None,
      seq_len=None,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={"target_shape": (), "params": config.params()},
    )
