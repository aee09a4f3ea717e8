"""In-context linear regression (Garg et al. 2022, "What can transformers learn in-context?").

Each example is a task w ~ N(0, I_d) with k points x_i ~ N(0, I_d) and
y_i = w . x_i + noise_std * eps_i. Format (as Garg et al., tokens of width d + 1):

  inputs  [2k, d + 1]: interleaved x-tokens (x_i, 0) at even positions 2i and
                       y-tokens (0, ..., 0, y_i) at odd positions 2i + 1;
  targets [k]:         y_i, to be predicted from the output at x-token 2i with
                       a causal model (which has seen pairs 1..i-1 and x_i);
  w       [d]:         the task vector (for analysis/baselines).

`least_squares_baseline(xs, ys)` gives the minimum-norm least-squares
prediction of each y_i from the first i - 1 pairs, the curve a trained
transformer tracks in Garg et al.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, float_tensor


@dataclasses.dataclass(eq=False)
class IclRegressionConfig(AttnxConfig):
  """dim d, num_points k, observation noise_std."""

  dim: int = 5
  num_points: int = 20
  noise_std: float = 0.0
  num_train: int = 10000
  num_test: int = 1000

  def validate(self) -> None:
    if self.dim < 1 or self.num_points < 1 or self.noise_std < 0:
      raise ValueError("icl_regression needs dim >= 1, num_points >= 1, noise_std >= 0.")


def make_icl_regression(
  n: int, seed: int, *, dim: int = 5, num_points: int = 20, noise_std: float = 0.0
) -> dict[str, np.ndarray]:
  """n prompts: inputs [n, 2k, d+1], targets [n, k], w [n, d], xs [n, k, d] (float32)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((n, dim))
  xs = rng.standard_normal((n, num_points, dim))
  ys = np.einsum("nkd,nd->nk", xs, w)
  if noise_std > 0:
    ys = ys + noise_std * rng.standard_normal(ys.shape)
  inputs = np.zeros((n, 2 * num_points, dim + 1))
  inputs[:, 0::2, :dim] = xs
  inputs[:, 1::2, dim] = ys
  f32 = np.float32
  return {
    "inputs": inputs.astype(f32),
    "targets": ys.astype(f32),
    "w": w.astype(f32),
    "xs": xs.astype(f32),
  }


def least_squares_baseline(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
  """Predicts y_i from pairs 1..i-1 with minimum-norm least squares (pred_1 = 0).

  Args:
    xs: [..., k, d] inputs.
    ys: [..., k] targets.

  Returns:
    [..., k] predictions x_i . pinv(X_{<i}) y_{<i}.
  """
  xs = np.asarray(xs, np.float64)
  ys = np.asarray(ys, np.float64)
  preds = np.zeros(ys.shape)
  for i in range(1, xs.shape[-2]):
    w_hat = np.einsum("...di,...i->...d", np.linalg.pinv(xs[..., :i, :]), ys[..., :i])
    preds[..., i] = np.einsum("...d,...d->...", xs[..., i, :], w_hat)
  return preds


def nearest_neighbours_baseline(xs: np.ndarray, ys: np.ndarray, k: int = 3) -> np.ndarray:
  """Predicts y_i as the mean y of the (up to) k earlier x_j nearest to x_i (pred_1 = 0);
  Garg et al.'s "3-nearest neighbours" baseline. xs [..., n, d], ys [..., n] -> [..., n]."""
  xs = np.asarray(xs, np.float64)
  ys = np.asarray(ys, np.float64)
  preds = np.zeros(ys.shape)
  for i in range(1, xs.shape[-2]):
    dist = ((xs[..., :i, :] - xs[..., i:i + 1, :]) ** 2).sum(-1)  # [..., i]
    near = np.argsort(dist, axis=-1)[..., :k]
    preds[..., i] = np.take_along_axis(ys[..., :i], near, axis=-1).mean(-1)
  return preds


def baseline_errors(inputs: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
  """Squared error / d per in-context position of Garg et al.'s baselines on prompts
  ``inputs`` [N, 2k, d + 1] with ``targets`` [N, k]: least squares, 3-nearest-neighbour
  averaging and the zero predictor (error/d ≈ 1 for w, x ~ N(0, I)); each [k]."""
  dim = inputs.shape[-1] - 1
  xs = inputs[:, 0::2, :dim]
  preds = {"least squares": least_squares_baseline(xs, targets),
           "3-nearest neighbours": nearest_neighbours_baseline(xs, targets, 3),
           "zero": np.zeros(targets.shape)}
  return {name: ((p - targets) ** 2).mean(0) / dim for name, p in preds.items()}


class IclRegression(AttnxBuilder):
  """In-context linear regression prompts."""

  BUILDER_CONFIGS = [
    IclRegressionConfig(name="default", description="d=5, k=20, noiseless."),
    IclRegressionConfig(
      name="tiny", description="Small, for tests.", dim=3, num_points=8, num_train=256,
      num_test=64,
    ),
    IclRegressionConfig(
      name="garg", description="Garg et al. sizes: d=20, k=41.", dim=20, num_points=41,
      num_train=20000, num_test=1000,
    ),
  ]
  CITATION = "Garg et al. 2022, What Can Transformers Learn In-Context?"

  @classmethod
  def _features(cls, config):
    d, k = config.dim, config.num_points
    return {
      "inputs": float_tensor((2 * k, d + 1)),
      "targets": float_tensor((k,)),
      "w": float_tensor((d,)),
    }

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    return make_icl_regression(
      n, seed, dim=config.dim, num_points=config.num_points, noise_std=config.noise_std
    )

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="icl_regression",
      task="regression",
      input_shape=(2 * config.num_points, config.dim + 1),
      input_dtype="float32",
      num_classes=None,
      vocab_size=None,
      target_vocab_size=None,
      seq_len=2 * config.num_points,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={
        "target_shape": (config.num_points,),
        "target_positions": "inputs[:, 0::2] (x-tokens)",
        "params": config.params(),
      },
    )
