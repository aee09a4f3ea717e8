"""Stand-in model and data for the attnx.train tests (generic machinery, no attnx.nn needed)."""

from __future__ import annotations

import flax.linen as nn
import numpy as np


class TinyMLP(nn.Module):
  """Two-layer MLP with optional dropout, following attnx's `deterministic` convention."""

  features: int = 16
  num_classes: int = 3
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x, *, deterministic: bool = True):
    x = nn.relu(nn.Dense(self.features)(x))
    x = nn.Dropout(self.dropout_rate, deterministic=deterministic)(x)
    return nn.Dense(self.num_classes)(x)


def make_arrays(n: int = 128, dim: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, dim)).astype(np.float32)
  y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
  return {"inputs": x, "targets": y}
