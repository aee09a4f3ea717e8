"""Evaluation of stacked (per-seed) parameters on a shared evaluation stream."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnx.train.losses import mse_sums, softmax_xent_sums
from attnx.train.step import make_apply_fn, model_inputs

METRICS = ("accuracy", "loss", "mse")


def _sums(outputs: jax.Array, batch: dict, metrics: Sequence[str]) -> dict[str, jax.Array]:
  """Per-batch (sum, count) pairs of the training losses' own sums, so that evaluation and
  training measure the same thing and the dataset mean is exact over uneven batches."""
  out: dict[str, jax.Array] = {}
  if "accuracy" in metrics or "loss" in metrics:
    xent = softmax_xent_sums(outputs, batch)
    out.update({k: xent[k] for k in ("accuracy", "loss") if k in metrics})
  if "mse" in metrics:
    out["mse"] = mse_sums(outputs, batch)["mse"]
  return out


def evaluate(model: nn.Module, params_stacked, data_iter: Iterable[dict],
             metrics: Sequence[str] = ("accuracy",),
             inputs_fn: Callable[[dict], tuple] = model_inputs,
             extra_variables: dict | None = None) -> dict[str, np.ndarray]:
  """Dataset-mean metrics per seed: {name: np.ndarray [num_seeds]}.

  `params_stacked` has a leading seed axis; every seed sees the same evaluation batches, e.g.
  ``loader(test_arrays, 500)`` (one ordered pass). Metrics: "accuracy" and "loss"
  (cross-entropy; targets == IGNORE_INDEX ignored), "mse" (weighted by a `mask` entry).
  `extra_variables`: stacked non-trained collections (FitResult.extra_variables), if any.
  """
  for m in metrics:
    if m not in METRICS:
      raise ValueError(f"metric {m!r} is not one of {METRICS}")
  fn = _eval_fn(model, inputs_fn, tuple(metrics))
  totals: dict[str, list] = {}
  for batch in data_iter:
    sums = fn(params_stacked, extra_variables or {},
              {k: jnp.asarray(v) for k, v in batch.items()})
    for k, (s, n) in sums.items():
      acc = totals.setdefault(k, [0.0, 0.0])
      acc[0] = acc[0] + s
      acc[1] = acc[1] + n
  if not totals:
    raise ValueError("evaluate: the evaluation data stream is empty")
  return {k: np.asarray(s, np.float64) / np.maximum(np.asarray(n, np.float64), 1.0)
          for k, (s, n) in totals.items()}


_CACHE: dict = {}


def _eval_fn(model: nn.Module, inputs_fn: Callable, metrics: tuple[str, ...]):
  """The jitted per-seed evaluation, cached so that repeated evaluations do not recompile."""
  try:
    key = (model, inputs_fn, metrics)
    if key in _CACHE:
      return _CACHE[key]
  except TypeError:  # unhashable module: no caching
    key = None
  apply_fn = make_apply_fn(model, inputs_fn)

  def one(params, extra, batch):
    out = apply_fn(params, batch, True, jax.random.PRNGKey(0), extra)
    return _sums(out, batch, metrics)

  fn = jax.jit(jax.vmap(one, in_axes=(0, 0, None)))
  if key is not None:
    if len(_CACHE) >= 32:
      _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = fn
  return fn
