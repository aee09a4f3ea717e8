"""Losses and per-batch metrics: `fn(outputs, batch) -> (scalar loss, {name: scalar})`.

The built-in losses are means over valid positions, computed as (sum, count) pairs: their
`.sums(outputs, batch) -> {name: (sum, count)}` attribute gives the pairs, and the data-parallel
train step adds sums and counts over all devices before dividing, so the loss is the global
mean even when devices hold different numbers of valid tokens (padding, IGNORE_INDEX). A
custom loss without `.sums` counts as one unit per device (its per-device means are averaged);
build one with `from_sums` to get the exact global mean.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from attnx.constants import IGNORE_INDEX

LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict[str, jax.Array]]]
Sums = dict[str, tuple[jax.Array, jax.Array]]
SumsFn = Callable[[jax.Array, dict], Sums]


def reduce_sums(sums: Sums, axis_name: str | None = None) -> tuple[jax.Array, dict]:
  """(loss, metrics) = sum / count per entry; with `axis_name`, both are psum'd first.

  `sums` must have a "loss" entry; the other entries become the metrics. A zero count gives 0
  (the count is clamped to 1), as for a batch without valid positions.
  """
  out = {}
  for k, (s, c) in sums.items():
    if axis_name is not None:
      s, c = jax.lax.psum((s, c), axis_name)
    out[k] = s / jnp.maximum(c, 1)
  loss = out.pop("loss")
  return loss, out


def from_sums(sums_fn: SumsFn) -> LossFn:
  """A LossFn (with optional `axis_name=`) from `sums_fn(outputs, batch) -> {name: (sum, n)}`.

  `sums_fn` must return a "loss" entry. The returned function carries `sums_fn` as `.sums`,
  which `attnx.train` uses to reduce exactly over data-parallel devices.
  """

  def loss_fn(outputs, batch, axis_name: str | None = None):
    return reduce_sums(sums_fn(outputs, batch), axis_name)

  loss_fn.sums = sums_fn
  loss_fn.__name__ = getattr(sums_fn, "__name__", "loss").removesuffix("_sums")
  loss_fn.__doc__ = sums_fn.__doc__
  return loss_fn


def loss_sums(loss_fn: LossFn) -> SumsFn:
  """`loss_fn`'s (sum, count) pairs: its `.sums`, else its means each with count 1."""
  sums = getattr(loss_fn, "sums", None)
  if sums is not None:
    return sums

  def as_sums(outputs, batch):
    loss, metrics = loss_fn(outputs, batch)
    one = jnp.float32(1.0)
    return {"loss": (loss, one), **{k: (v, one) for k, v in metrics.items()}}

  return as_sums


def softmax_xent_sums(outputs: jax.Array, batch: dict) -> Sums:
  """Cross-entropy and accuracy summed over positions whose target is not IGNORE_INDEX."""
  targets = batch["targets"]
  valid = targets != IGNORE_INDEX
  safe = jnp.where(valid, targets, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), safe)
  n = valid.sum()
  correct = jnp.where(valid, jnp.argmax(outputs, -1) == safe, False).sum()
  return {"loss": (jnp.where(valid, ce, 0.0).sum(), n), "accuracy": (correct, n)}


def mse_sums(outputs: jax.Array, batch: dict) -> Sums:
  """Squared error summed over positions (weighted by a float `mask` entry, if present)."""
  targets = batch["targets"].astype(jnp.float32)
  out = outputs.astype(jnp.float32)
  if targets.shape != out.shape and targets.size == out.size:
    targets = targets.reshape(out.shape)
  err = (out - targets) ** 2
  if "mask" in batch:
    m = batch["mask"].astype(jnp.float32)
    m = m.reshape(m.shape + (1,) * (err.ndim - m.ndim))
    m = jnp.broadcast_to(m, err.shape)
    pair = ((err * m).sum(), m.sum())
  else:
    pair = (err.sum(), jnp.float32(err.size))
  return {"loss": pair, "mse": pair}


softmax_xent = from_sums(softmax_xent_sums)
softmax_xent.__doc__ = """Mean cross-entropy over positions whose target is not IGNORE_INDEX.

Works for logits [..., C] with targets [...] (classification or per-token targets); metrics:
accuracy. With `axis_name`, the mean is over the valid positions of all devices on that axis.
"""

mse = from_sums(mse_sums)
mse.__doc__ = """Mean squared error; targets are reshaped to the outputs' shape when sizes agree.

A float `mask` entry in the batch (same leading shape as targets), if present, weights
positions (e.g. only the query position of an in-context regression prompt). With
`axis_name`, the mean is over all devices on that axis.
"""




def icl_mse_sums(outputs: jax.Array, batch: dict) -> Sums:
  """In-context regression (Garg et al. 2022): squared error of the prediction read at each
  x-token (even positions of outputs [..., 2k, 1]) against targets [..., k]."""
  preds = outputs[..., 0::2, 0].astype(jnp.float32)
  err = (preds - batch["targets"].astype(jnp.float32)) ** 2
  pair = (err.sum(), jnp.float32(err.size))
  return {"loss": pair, "mse": pair}


icl_mse = from_sums(icl_mse_sums)
icl_mse.__doc__ = """Mean squared error of in-context regression predictions (read at the
x-tokens, see `attnx.data.icl_regression`); metric: mse."""


LOSSES: dict[str, LossFn] = {"softmax_xent": softmax_xent, "mse": mse, "icl_mse": icl_mse}


def get_loss(loss: str | LossFn) -> LossFn:
  """Resolve a loss name (see LOSSES) or pass a callable through."""
  if callable(loss):
    return loss
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r} is not one of {tuple(LOSSES)} (or pass a callable)")
  return LOSSES[loss]
