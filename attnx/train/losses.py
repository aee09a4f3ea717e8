"""Losses and per-batch metrics: `fn(outputs, batch) -> (scalar loss, {name: scalar})`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

IGNORE_INDEX = -100
LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict[str, jax.Array]]]


def softmax_xent(outputs: jax.Array, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy over positions whose integer target is not IGNORE_INDEX (-100).

  Works for logits [..., C] with targets [...] (classification or per-token targets).
  """
  targets = batch["targets"]
  valid = targets != IGNORE_INDEX
  safe = jnp.where(valid, targets, 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), safe)
  n = jnp.maximum(valid.sum(), 1)
  loss = jnp.where(valid, ce, 0.0).sum() / n
  correct = jnp.where(valid, jnp.argmax(outputs, -1) == safe, False).sum()
  return loss, {"accuracy": correct / n}


def mse(outputs: jax.Array, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean squared error; targets are reshaped to the outputs' shape when sizes agree.

  A float `mask` entry in the batch (same leading shape as targets), if present, weights
  positions (e.g. only the query position of an in-context regression prompt).
  """
  targets = batch["targets"].astype(jnp.float32)
  out = outputs.astype(jnp.float32)
  if targets.shape != out.shape and targets.size == out.size:
    targets = targets.reshape(out.shape)
  err = (out - targets) ** 2
  if "mask" in batch:
    m = batch["mask"].astype(jnp.float32)
    m = m.reshape(m.shape + (1,) * (err.ndim - m.ndim))
    m = jnp.broadcast_to(m, err.shape)
    loss = (err * m).sum() / jnp.maximum(m.sum(), 1.0)
  else:
    loss = err.mean()
  return loss, {"mse": loss}


LOSSES: dict[str, LossFn] = {"softmax_xent": softmax_xent, "mse": mse}


def get_loss(loss: str | LossFn) -> LossFn:
  """Resolve a loss name (see LOSSES) or pass a callable through."""
  if callable(loss):
    return loss
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r} is not one of {tuple(LOSSES)} (or pass a callable)")
  return LOSSES[loss]
