"""Noisy clusters: the setting of Alam et al. (why F = exp).

There are C classes with centers mu_c ~ N(0, I_dim) (fixed by `center_seed`,
shared by all splits). Each example is a *set* of L = num_objects objects;
the sample uses `classes_per_sample` classes (all C when 0) and every object
gets one of them uniformly. An object is measured as

  x_i = mu_{c_i} + within_class_spread * z_i + local_noise * n_i + global_noise * g

with z_i, n_i ~ N(0, I) independent per object (large within-class spread:
objects of a class differ a lot) and g ~ N(0, I) drawn once per sample and
added to every object: the global noise component shifts all pairwise dot
products x_i . x_j by about M = global_noise^2 * dim (plus cross terms of
mean 0), which softmax attention (F = exp) is invariant to.

Task (token classification): predict each object's class, targets [L].
Averaging an object with similar objects of the same sample (attention across
objects) reduces the within-class spread, which is what the seed argues
attention is for. With the defaults, nearest-center classification of a
single object (global offset removed by an oracle) is ~60 % accurate, and of
the average of the sample's same-class objects ~99 %. Use
`make_noisy_clusters(n, seed, **params)` directly to vary global_noise (or
anything else) at evaluation time without TFDS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, float_tensor, int_tensor

PARAM_DEFAULTS = {
  "num_classes": 8,
  "dim": 32,
  "num_objects": 32,
  "within_class_spread": 3.0,
  "local_noise": 0.5,
  "global_noise": 1.0,
  "classes_per_sample": 4,
  "center_seed": 0,
}


@dataclasses.dataclass(eq=False)
class NoisyClustersConfig(AttnxConfig):
  """Parameters as in `make_noisy_clusters`; splits num_train/num_test."""

  num_classes: int = 8
  dim: int = 32
  num_objects: int = 32
  within_class_spread: float = 3.0
  local_noise: float = 0.5
  global_noise: float = 1.0
  classes_per_sample: int = 4
  center_seed: int = 0
  num_train: int = 10000
  num_test: int = 1000

  def validate(self) -> None:
    _check(**{k: getattr(self, k) for k in PARAM_DEFAULTS})


def _check(**p) -> None:
  if p["num_classes"] < 1 or p["dim"] < 1 or p["num_objects"] < 1:
    raise ValueError("noisy_clusters needs num_classes, dim, num_objects >= 1.")
  if min(p["within_class_spread"], p["local_noise"], p["global_noise"]) < 0:
    raise ValueError("noisy_clusters noise scales must be >= 0.")
  if not 0 <= p["classes_per_sample"] <= p["num_classes"]:
    raise ValueError("Need 0 <= classes_per_sample <= num_classes (0 = all).")


def class_centers(num_classes: int, dim: int, center_seed: int = 0) -> np.ndarray:
  """[num_classes, dim] class centers mu_c ~ N(0, I) (float32)."""
  rng = np.random.default_rng([int(center_seed), 0x5EED])
  return rng.standard_normal((num_classes, dim)).astype(np.float32)


def make_noisy_clusters(n: int, seed: int, **params) -> dict[str, np.ndarray]:
  """n samples of the noisy-clusters task (no TFDS needed).

  Args:
    n: number of samples (sets of objects).
    seed: sampling seed (centers depend only on `center_seed`).
    **params: any of num_classes=8, dim=32, num_objects=32,
      within_class_spread=3.0, local_noise=0.5, global_noise=1.0,
      classes_per_sample=4 (0 = all classes), center_seed=0.

  Returns:
    inputs [n, L, dim] float32 (measured objects), targets [n, L] int32
    (classes), clean [n, L, dim] float32 (objects before measurement noise),
    global_offset [n, dim] float32 (global_noise * g).
  """
  unknown = sorted(set(params) - set(PARAM_DEFAULTS))
  if unknown:
    raise ValueError(f"Unknown noisy_clusters params {unknown}; valid: {sorted(PARAM_DEFAULTS)}.")
  p = {**PARAM_DEFAULTS, **params}
  _check(**p)
  c, d, num = int(p["num_classes"]), int(p["dim"]), int(p["num_objects"])
  centers = class_centers(c, d, p["center_seed"])
  rng = np.random.default_rng(seed)
  k = int(p["classes_per_sample"]) or c
  chosen = np.argsort(rng.random((n, c)), axis=1)[:, :k]  # classes present in each sample
  labels = np.take_along_axis(chosen, rng.integers(0, k, size=(n, num)), axis=1)
  clean = centers[labels] + p["within_class_spread"] * rng.standard_normal((n, num, d))
  local = p["local_noise"] * rng.standard_normal((n, num, d))
  offset = p["global_noise"] * rng.standard_normal((n, d))
  inputs = clean + local + offset[:, None, :]
  return {
    "inputs": inputs.astype(np.float32),
    "targets": labels.astype(np.int32),
    "clean": clean.astype(np.float32),
    "global_offset": offset.astype(np.float32),
  }


class NoisyClusters(AttnxBuilder):
  """Sets of noisy objects from C classes; classify every object."""

  BUILDER_CONFIGS = [
    NoisyClustersConfig(name="default", description="8 classes, 32-dim, 32 objects."),
    NoisyClustersConfig(
      name="tiny",
      description="Small, for tests.",
      num_classes=4,
      dim=8,
      num_objects=8,
      classes_per_sample=2,
      num_train=256,
      num_test=64,
    ),
  ]

  @classmethod
  def _features(cls, config):
    shape = (config.num_objects, config.dim)
    return {
      "inputs": float_tensor(shape),
      "targets": int_tensor((config.num_objects,)),
      "global_offset": float_tensor((config.dim,)),
    }

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    return make_noisy_clusters(n, seed, **{k: getattr(config, k) for k in PARAM_DEFAULTS})

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="noisy_clusters",
      task="token_classification",
      input_shape=(config.num_objects, config.dim),
      input_dtype="float32",
      num_classes=config.num_classes,
      vocab_size=None,
      target_vocab_size=None,
      seq_len=config.num_objects,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={
        "params": config.params(),
        "dot_product_shift": config.global_noise**2 * config.dim,
      },
    )
