"""Optax optimizers and learning-rate schedules built from an ml_collections config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "warmup_cosine", "cosine", "warmup_constant")


def optimizer_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default optimizer config; keyword overrides replace fields.

  An unknown keyword (e.g. ``lr=``) is a TypeError naming it: the config would otherwise
  carry it as a new field that no optimizer reads, leaving the default in place.
  """
  cfg = ml_collections.ConfigDict(dict(
      name="adamw",
      learning_rate=1e-3,
      schedule="warmup_cosine",
      warmup_steps=0,
      end_learning_rate_ratio=0.0,  # final lr = ratio * learning_rate for cosine schedules
      weight_decay=1e-4,
      momentum=0.9,  # sgd only
      b1=0.9,
      b2=0.999,
      grad_clip_norm=0.0,  # 0 disables clipping
  ))
  unknown = sorted(set(overrides) - set(cfg.keys()))
  if unknown:
    raise TypeError(f"optimizer_config() got unexpected keyword argument(s) "
                    f"{', '.join(unknown)}; fields: {', '.join(cfg.keys())}")
  cfg.update(overrides)
  return cfg


def make_schedule(cfg: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """Learning-rate schedule over `num_steps` from `cfg.schedule`."""
  lr = float(cfg.learning_rate)
  warmup = int(cfg.get("warmup_steps", 0))
  end = lr * float(cfg.get("end_learning_rate_ratio", 0.0))
  name = cfg.get("schedule", "constant")
  if name == "constant":
    return optax.constant_schedule(lr)
  if name == "warmup_constant":
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)], [warmup])
  if name in ("warmup_cosine", "cosine"):
    if name == "cosine":
      warmup = 0
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else lr, peak_value=lr, warmup_steps=warmup,
        decay_steps=max(num_steps, warmup + 1), end_value=end)
  raise ValueError(f"optimizer.schedule={name!r} is not one of {SCHEDULES}")


def make_optimizer(cfg: ml_collections.ConfigDict | optax.GradientTransformation,
                   num_steps: int) -> optax.GradientTransformation:
  """An optax transformation from a config (a ready transformation passes through)."""
  if isinstance(cfg, optax.GradientTransformation):
    return cfg
  validate_optimizer_config(cfg)
  sched = make_schedule(cfg, num_steps)
  name = cfg.name
  if name == "adamw":
    tx = optax.adamw(sched, b1=cfg.get("b1", 0.9), b2=cfg.get("b2", 0.999),
                     weight_decay=cfg.get("weight_decay", 0.0))
  elif name == "adam":
    tx = optax.adam(sched, b1=cfg.get("b1", 0.9), b2=cfg.get("b2", 0.999))
  else:
    tx = optax.sgd(sched, momentum=cfg.get("momentum", 0.0) or None)
  clip = float(cfg.get("grad_clip_norm", 0.0) or 0.0)
  if clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(clip), tx)
  return tx


def minimize(loss_fn: Callable[[Any], jax.Array], params: Any,
             optimizer: optax.GradientTransformation, num_steps: int) -> tuple[Any, list[float]]:
  """``num_steps`` full-batch steps of ``optimizer`` on ``loss_fn(params)``, one jitted step
  each; returns the final parameters and the loss before each step.

  For small problems without a data stream or seeds (a bandwidth, a temperature fitted to a
  fixed set); models trained on batches use :func:`attnx.train.fit`.
  """
  if int(num_steps) < 0:
    raise ValueError(f"minimize: num_steps must be >= 0, got {num_steps}")
  state = optimizer.init(params)

  @jax.jit
  def step(params: Any, state: Any) -> tuple[Any, Any, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(int(num_steps)):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return params, losses


def validate_optimizer_config(cfg: ml_collections.ConfigDict, prefix: str = "optimizer") -> None:
  """Raise ValueError naming the key and the valid choices for a bad optimizer config."""
  if cfg.get("name") not in OPTIMIZERS:
    raise ValueError(f"{prefix}.name={cfg.get('name')!r} is not one of {OPTIMIZERS}")
  if cfg.get("schedule", "constant") not in SCHEDULES:
    raise ValueError(f"{prefix}.schedule={cfg.get('schedule')!r} is not one of {SCHEDULES}")
  if not float(cfg.get("learning_rate", 0.0)) > 0:
    raise ValueError(f"{prefix}.learning_rate must be > 0, got {cfg.get('learning_rate')!r}")
  if int(cfg.get("warmup_steps", 0)) < 0:
    raise ValueError(f"{prefix}.warmup_steps must be >= 0, got {cfg.get('warmup_steps')!r}")
