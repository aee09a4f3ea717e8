"""Losses reduce to global sum / global count over a named (data-parallel) axis."""

from __future__ import annotations

import jax
import numpy as np

from attnx import train


def test_losses_over_shards_equal_the_loss_of_the_whole_batch():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 2, 5, 3)).astype(np.float32)  # 4 shards of [2, 5] tokens
  targets = rng.integers(0, 3, size=(4, 2, 5)).astype(np.int32)
  targets[0, :, 1:] = train.IGNORE_INDEX  # shards hold 2, 10, 10 and 0 valid tokens
  targets[3] = train.IGNORE_INDEX
  mask = (targets != train.IGNORE_INDEX).astype(np.float32)
  whole = lambda x: x.reshape((-1,) + x.shape[2:])
  for fn, batch in ((train.softmax_xent, {"targets": targets}),
                    (train.mse, {"targets": logits * 0.5, "mask": mask})):
    per_shard = jax.jit(jax.vmap(lambda o, b, fn=fn: fn(o, b, axis_name="d"), axis_name="d"))(
        logits, batch)
    ref = jax.jit(fn)(whole(logits), {k: whole(v) for k, v in batch.items()})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.broadcast_to(b, a.shape),
                                                         rtol=1e-6), per_shard, ref)
  # Without the axis, the mean of per-shard means differs (the bug this guards against).
  loss, _ = jax.jit(jax.vmap(train.softmax_xent))(logits, {"targets": targets})
  ref, _ = jax.jit(train.softmax_xent)(whole(logits), {"targets": whole(targets)})
  assert abs(float(loss.mean()) - float(ref)) > 1e-2


def test_icl_mse_reads_the_x_tokens():
  from attnx.train.losses import LOSSES

  rng = np.random.default_rng(1)
  outputs = rng.normal(size=(3, 8, 1)).astype(np.float32)  # 4 (x, y) pairs
  targets = rng.normal(size=(3, 4)).astype(np.float32)
  loss, metrics = jax.jit(LOSSES["icl_mse"])(outputs, {"targets": targets})
  ref = np.mean((outputs[:, 0::2, 0] - targets) ** 2)  # the y-token outputs do not count
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  np.testing.assert_allclose(metrics["mse"], ref, rtol=1e-6)
