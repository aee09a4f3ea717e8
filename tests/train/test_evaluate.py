"""attnx.train.evaluate: dataset means over valid positions, IGNORE_INDEX and masks."""

from __future__ import annotations

import numpy as np

from attnx import train


def test_evaluate_ignores_ignore_index_and_weights_mse_by_mask():
  import flax.linen as nn

  class Const(nn.Module):
    @nn.compact
    def __call__(self, x):
      b = self.param("b", lambda k: np.array([0.0, 1.0], np.float32))
      return x[..., None] * 0 + b

  params = {"b": np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)}  # 2 seeds: predict 1 / 0
  targets = np.array([[1, 1, train.IGNORE_INDEX], [0, 1, 1]])
  batch = {"inputs": np.zeros((2, 3), np.float32), "targets": targets}
  # Two uneven batches: the means are over all 5 valid positions, not means of batch means.
  m = train.evaluate(Const(), params, train.loader(batch, 1), metrics=("accuracy", "loss"))
  np.testing.assert_allclose(m["accuracy"], [4 / 5, 1 / 5])
  lse = np.log(1 + np.e)  # log-sum-exp of logits (0, 1)
  ce = {0: [lse - 1, lse - 1, lse, lse - 1, lse - 1], 1: [lse, lse, lse - 1, lse, lse]}
  np.testing.assert_allclose(m["loss"], [np.mean(ce[0]), np.mean(ce[1])], rtol=1e-5)
  # mse: positions weighted by `mask` (the third position of each row is left out).
  reg = {"inputs": np.zeros((2, 3), np.float32),
         "targets": np.ones((2, 3, 2), np.float32), "mask": np.array([[1, 1, 0], [1, 1, 0]])}
  reg["targets"][:, 2] = 100.0  # masked out: would dominate the mean
  m = train.evaluate(Const(), params, [reg], metrics=("mse",))
  np.testing.assert_allclose(m["mse"], [0.5, 0.5])
