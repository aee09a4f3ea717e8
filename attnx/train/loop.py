"""`fit`: seed-parallel (vmap), optionally data-parallel training with checkpoints and logging."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from attnx.train.checkpoint import Checkpointer
from attnx.train.evaluate import evaluate
from attnx.train.losses import LossFn, get_loss
from attnx.train.optim import make_optimizer
from attnx.train.parallel import Placement, validate_parallel
from attnx.train.step import accepts_arg, init_state, make_apply_fn, make_step, model_inputs

log = logging.getLogger("attnx.train")


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or Inf; the message names the step and the seeds."""


@dataclasses.dataclass
class FitResult:
  """What `fit` returns.

  params: stacked over seeds (leading axis num_seeds), on the host.
  history: one dict per logged step: {"step", "loss": [per seed], <train metric>: [per seed],
    and at evaluation steps "eval_<metric>": [per seed]}.
  final_metrics: {name: np.ndarray [num_seeds]}: evaluation metrics (unprefixed) from the final
    evaluation, plus "train_loss" and "train_<metric>" from the last step.
  seconds_per_step: wall time per training step after compilation (data loading included).
  compile_seconds: time to compile the train step.
  seeds: the seeds (seed, seed + 1, ...).
  start_step: the step training (re)started from (> 0 after resuming from a checkpoint).
  opt_state: the final optimizer state (stacked).
  extra_variables: stacked non-trained variable collections (e.g. FAVOR+ features) or None;
    pass {"params": p, **extra} to model.apply.
  """
  params: Any
  history: list[dict]
  final_metrics: dict[str, np.ndarray]
  seconds_per_step: float
  compile_seconds: float
  seeds: list[int]
  start_step: int = 0
  opt_state: Any = None
  extra_variables: Any = None


def _narrow(x: np.ndarray) -> np.ndarray:
  """64-bit host arrays to the 32-bit types JAX uses by default (avoids truncation warnings)."""
  if x.dtype == np.int64:
    return x.astype(np.int32)
  if x.dtype == np.float64:
    return x.astype(np.float32)
  return x


def _stack(batches: list[dict]) -> dict[str, np.ndarray]:
  return {k: _narrow(np.stack([np.asarray(b[k]) for b in batches])) for k in batches[0]}


def _check_finite(bad_step: np.ndarray, seeds: list[int], name: str) -> None:
  bad_step = np.asarray(bad_step)
  if (bad_step >= 0).any():
    which = [s for s, b in zip(seeds, bad_step, strict=True) if b >= 0]
    first = int(bad_step[bad_step >= 0].min())
    raise NonFiniteLossError(
        f"run {name!r}: loss became NaN/Inf at step {first} for seed(s) {which} "
        f"(per-seed first bad step: {dict(zip(seeds, bad_step.tolist(), strict=True))}). "
        "Lower the learning rate, enable optimizer.grad_clip_norm, or check the inputs.")


def _init_or_restore(model, tx, seeds, train_data, inputs_fn, parallel, ckpt, writer, name):
  """Fresh stacked state, or the latest checkpoint's; returns (state, step, history, last)."""
  # A sample batch fixes the shapes for init (the stream is re-created for training).
  sample = next(iter(train_data(seeds[0], 0)))
  batch_size = len(next(iter(sample.values())))
  validate_parallel(parallel, batch_size)
  state = init_state(model, tx, seeds, {k: _narrow(np.asarray(v)) for k, v in sample.items()},
                     inputs_fn)
  if ckpt is None or ckpt.latest_step() is None:
    return state, 0, [], None
  start_step = int(ckpt.latest_step())
  state, meta = ckpt.restore(start_step, state)
  if meta.get("seeds") != seeds:
    raise ValueError(f"checkpoint in {ckpt.directory} has seeds {meta.get('seeds')}, "
                     f"this run has {seeds}; use another workdir or name")
  history = writer.truncate_after(start_step)
  msg = f"Resuming run {name!r} from step {start_step} ({ckpt.directory})"
  log.info(msg)
  print(msg, file=sys.stderr, flush=True)
  return state, start_step, history, meta.get("last_metrics")


def fit(model: nn.Module, *,
        train_data: Callable[[int, int], Iterator[dict]],
        loss: str | LossFn = "softmax_xent",
        eval_fn: Callable[[Any], dict] | None = None,
        eval_data: Callable[[], Iterator[dict]] | None = None,
        eval_metrics: tuple[str, ...] | None = None,
        optimizer: optax.GradientTransformation | ml_collections.ConfigDict,
        num_steps: int, num_seeds: int = 1, seed: int = 0,
        workdir: str | None = None, name: str = "run", checkpoint_every: int = 0,
        keep_checkpoints: int = 3, eval_every: int = 0, log_every: int = 10,
        parallel: str = "none", progress: bool = True,
        inputs_fn: Callable[[dict], tuple] = model_inputs,
        tensorboard: bool = True) -> FitResult:
  """Train `num_seeds` copies of `model` (seeds seed..seed+num_seeds-1) in one program.

  Seed i is initialized from PRNGKey(seed + i) and reads batches from
  `train_data(seed + i, start_step)`; the N seeds run as one jax.vmap'd step, and equal N
  separate runs. `parallel` ("none" | "shard_map" | "pmap") additionally shards every batch over
  all devices (data parallelism, gradients pmean'd over the `data` axis).

  With `workdir` and `checkpoint_every > 0`, the state is saved every `checkpoint_every` steps
  and at the end under workdir/checkpoints/<name>, and a later call with the same arguments
  resumes from the latest checkpoint (params, optimizer state, step, PRNG keys; the data stream
  restarts at the checkpointed step via `train_data(seed, step)`), so the resumed run ends with
  the same parameters and metrics as an uninterrupted one. Logged values are means since the
  previous log step; use a `checkpoint_every` that is a multiple of `log_every` for identical
  logged curves as well.

  Evaluation: `eval_fn(params_stacked) -> {name: [num_seeds]}` (also given `extra_variables=`
  when it takes that argument), or `eval_data()` (a fresh iterator per evaluation) scored with
  `evaluate` on `eval_metrics` (default: accuracy and loss for "softmax_xent", mse for "mse").
  Runs every `eval_every` steps and at the end. Non-trained variable collections of the model
  (e.g. FAVOR+ random features) are kept fixed and passed to every apply.

  Raises NonFiniteLossError (naming step and seeds) when the loss becomes NaN/Inf.
  """
  if num_steps < 1 or num_seeds < 1:
    raise ValueError(f"num_steps={num_steps} and num_seeds={num_seeds} must be >= 1")
  validate_parallel(parallel)
  loss_fn = get_loss(loss)
  if eval_metrics is None:
    eval_metrics = ("mse",) if loss == "mse" else ("accuracy", "loss")
  tx = make_optimizer(optimizer, num_steps)
  seeds = [seed + i for i in range(num_seeds)]
  placement = Placement(parallel)
  apply_fn = make_apply_fn(model, inputs_fn)

  from attnx.train.writers import MetricWriter
  writer = MetricWriter(workdir, name, tensorboard=tensorboard)
  ckpt = Checkpointer(workdir, name, checkpoint_every, keep_checkpoints) if (
      workdir and checkpoint_every > 0) else None

  try:
    state, start_step, history, restored_last = _init_or_restore(
        model, tx, seeds, train_data, inputs_fn, parallel, ckpt, writer, name)
  except BaseException:
    writer.close()
    if ckpt is not None:
      ckpt.close()
    raise
  if workdir and start_step == 0:
    writer.truncate_after(-1)

  step_fn = make_step(apply_fn, loss_fn, tx, parallel, placement.mesh)
  state = placement.state(state)
  iters = [iter(train_data(s, start_step)) for s in seeds]

  def next_batch():
    return placement.batch(_stack([next(it) for it in iters]))

  t0 = time.perf_counter()
  compiled = step_fn
  if start_step < num_steps:
    first = next_batch()
    try:
      compiled = step_fn.lower(state, first, np.int32(start_step)).compile()
    except Exception:  # noqa: BLE001 - AOT is only used for timing; fall back to lazy jit.
      compiled = step_fn
  compile_seconds = time.perf_counter() - t0

  def run_eval(host: dict) -> dict[str, np.ndarray]:
    params, extra = host["params"], host.get("extra")
    if eval_fn is not None:
      kw = {"extra_variables": extra} if accepts_arg(eval_fn, "extra_variables") else {}
      return {k: np.asarray(v) for k, v in eval_fn(params, **kw).items()}
    if eval_data is not None:
      return evaluate(model, params, eval_data(), eval_metrics, inputs_fn, extra)
    return {}

  pbar = None
  if progress and sys.stderr.isatty() and start_step < num_steps:
    from tqdm.auto import tqdm
    pbar = tqdm(total=num_steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True)

  pending: list = []  # per-step device metrics since the last log
  # XLA's CPU collectives can deadlock when several data-parallel steps are in flight on fake
  # devices that share few cores (device threads of the next step take the pool while the
  # all-reduce of the previous one waits); one step at a time avoids it.
  sync_each_step = parallel != "none" and jax.default_backend() == "cpu"
  last_metrics: dict[str, np.ndarray] = {}
  t_start = time.perf_counter()
  steps_run = 0
  t_excluded = 0.0
  try:
    for step in range(start_step, num_steps):
      batch = first if step == start_step else next_batch()
      state, metrics = compiled(state, batch, np.int32(step))
      if sync_each_step:
        jax.block_until_ready(metrics)
      pending.append(metrics)
      steps_run += 1
      done = step + 1
      is_last = done == num_steps
      do_log = is_last or (log_every > 0 and done % log_every == 0)
      do_eval = (eval_fn is not None or eval_data is not None) and (
          is_last or (eval_every > 0 and done % eval_every == 0))
      do_ckpt = ckpt is not None and (is_last or done % checkpoint_every == 0)
      if do_log or do_eval or do_ckpt:
        host_state = placement.unplace(state)
        _check_finite(jax.device_get(host_state["bad_step"]), seeds, name)
        t_sync = time.perf_counter()
        record: dict[str, Any] = {"step": done}
        last_metrics = {k: np.asarray(v)
                        for k, v in jax.device_get(placement.metrics(pending[-1])).items()}
        if do_log or do_eval:
          ms = jax.device_get([placement.metrics(m) for m in pending])
          for k in ms[0]:
            record[k] = np.mean([np.asarray(m[k]) for m in ms], axis=0).tolist()
          pending = []
        if do_eval:
          for k, v in run_eval(jax.device_get(host_state)).items():
            record[f"eval_{k}"] = np.asarray(v).tolist()
        if do_log or do_eval:
          writer.write(done, {k: v for k, v in record.items() if k != "step"})
          history.append(record)
          if pbar is not None and "loss" in record:
            pbar.set_postfix(loss=f"{np.mean(record['loss']):.4g}")
        if do_ckpt:
          ckpt.save(done, host_state, {"step": done, "seeds": seeds, "name": name,
                                       "last_metrics": {k: v.tolist()
                                                        for k, v in last_metrics.items()}})
        # Evaluation and checkpointing are not training time.
        t_excluded += time.perf_counter() - t_sync
      if pbar is not None:
        pbar.update(1)
    jax.block_until_ready(state)
  finally:
    if pbar is not None:
      pbar.close()
    writer.close()
    if ckpt is not None:
      ckpt.close()
  elapsed = time.perf_counter() - t_start - t_excluded
  seconds_per_step = elapsed / steps_run if steps_run else float("nan")

  host_state = jax.device_get(placement.unplace(state))
  final: dict[str, np.ndarray] = {}
  if steps_run == 0:
    # Resumed a finished run: the last step's train metrics were saved with the checkpoint.
    final_eval = run_eval(host_state)
    last_metrics = {k: np.asarray(v) for k, v in (restored_last or {}).items()}
  else:
    final_eval = {k[len("eval_"):]: np.asarray(v) for k, v in history[-1].items()
                  if k.startswith("eval_")} if history else {}
  for k, v in last_metrics.items():
    final[f"train_{k}"] = np.asarray(v)
  final.update(final_eval)
  return FitResult(params=host_state["params"], history=history, final_metrics=final,
                   seconds_per_step=seconds_per_step, compile_seconds=compile_seconds,
                   seeds=seeds, start_step=start_step, opt_state=host_state["opt_state"],
                   extra_variables=host_state.get("extra"))
