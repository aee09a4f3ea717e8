"""`fit`: seed-parallel (vmap), optionally data-parallel training with checkpoints and logging.

The loop itself only runs train steps; the periodic work (NaN check, evaluation, logging,
checkpointing) lives in `attnx.train.actions`, machine-specific workarounds in
`attnx.train.workarounds`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from flax import nnx

from attnx.train import actions, workarounds
from attnx.train.actions import NonFiniteLossError, nonfinite_runs
from attnx.train.checkpoint import CheckpointDamagedError, Checkpointer
from attnx.train.config import FitConfig
from attnx.train.evaluate import evaluate
from attnx.train.losses import get_loss
from attnx.train.optim import make_optimizer
from attnx.train.parallel import (
    SEQUENCE_AXIS,
    Placement,
    is_main_process,
    process_rows,
    validate_parallel,
)
from attnx.train.step import accepts_arg, init_state, make_apply_fn, make_step, model_inputs

log = logging.getLogger("attnx.train")

__all__ = ["CheckpointMismatchError", "FitResult", "NonFiniteLossError", "fit",
           "nonfinite_runs", "run_fingerprint"]


class CheckpointMismatchError(ValueError):
  """The workdir holds a checkpoint of this run made with a different setup (see `fit`)."""


@dataclasses.dataclass
class FitResult:
  """What `fit` returns.

  Attributes:
    params: stacked over seeds (leading axis num_seeds), on the host.
    history: one dict per logged step: {"step", "loss": [per seed], <train metric>: [per
      seed], and at evaluation steps "eval_<metric>": [per seed]}.
    final_metrics: {name: np.ndarray [num_seeds]}: evaluation metrics (unprefixed) from the
      final evaluation, plus "train_loss" and "train_<metric>" from the last step.
    seconds_per_step: wall time per training step after compilation (data loading included),
      over all steps trained, including those of the runs this one resumed from.
    compile_seconds: time to compile the train step (for a run that was already finished,
      the time of the process that trained it).
    seeds: the seeds (seed, seed + 1, ...).
    start_step: the step training (re)started from (> 0 after resuming from a checkpoint).
    opt_state: the final optimizer state (stacked).
    extra_variables: stacked non-trained variable collections (e.g. FAVOR+ features) or
      None; pass ``{"params": p, **extra}`` to ``model.apply``.
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


def _nonfinite_hint(optimizer: Any) -> str:
  """What to try after a NaN/Inf loss; clipping is only suggested when it is known to be off."""
  if isinstance(optimizer, ml_collections.ConfigDict):
    clip = float(optimizer.get("grad_clip_norm", 0.0) or 0.0)
    if clip > 0:
      return (f"Lower the learning rate (gradient clipping at norm {clip:g} is already on) or "
              "check the inputs.")
    return ("Lower the learning rate, enable gradient clipping (optimizer.grad_clip_norm, "
            "e.g. 1.0), or check the inputs.")
  return ("Lower the learning rate, clip gradients (optax.clip_by_global_norm) if the optimizer "
          "does not already, or check the inputs.")


def _describe(value: Any) -> Any:
  """A JSON value for a fingerprint: plain scalars as they are, else repr without addresses."""
  if value is None or isinstance(value, bool | int | float | str):
    return value
  return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _flatten(d: Mapping, prefix: str) -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = _describe(v)
  return out


def run_fingerprint(model: nn.Module, optimizer: Any, loss: Any, num_steps: int,
                    batch_size: int, seeds: list[int], sample: Mapping[str, Any],
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """What determines a run's result, as flat JSON {key: value}; stored with its checkpoints.

  Model fields, optimizer config (a ready optax transformation cannot be inspected: pass what
  defines it in `extra`), loss, num_steps (schedules depend on it), batch size, seeds, the
  shapes/dtypes and a hash of the first training batch (catches changed data), plus `extra`.
  """
  fp: dict[str, Any] = {"model": type(model).__qualname__}
  if dataclasses.is_dataclass(model):  # every linen Module
    for f in dataclasses.fields(model):
      if f.name not in ("parent", "name"):
        fp[f"model.{f.name}"] = _describe(getattr(model, f.name))
  else:
    fp["model"] = _describe(model)
  if isinstance(optimizer, ml_collections.ConfigDict):
    fp.update(_flatten(optimizer.to_dict(), "optimizer."))
  else:
    fp["optimizer"] = "optax transformation (not inspected)"
  fp["loss"] = loss if isinstance(loss, str) else getattr(loss, "__qualname__", repr(loss))
  fp.update(num_steps=int(num_steps), batch_size=int(batch_size), seeds=list(seeds))
  digest = hashlib.sha256()
  for k in sorted(sample):
    v = np.ascontiguousarray(sample[k])
    fp[f"data.{k}"] = f"{list(v.shape)} {v.dtype}"
    digest.update(k.encode() + str(v.shape).encode() + str(v.dtype).encode() + v.tobytes())
  fp["data.first_batch_sha256"] = digest.hexdigest()[:16]
  if extra:
    fp.update(_flatten(extra, ""))
  return json.loads(json.dumps(fp, default=str))  # as it reads back from the checkpoint


def _short(value: Any, width: int = 60) -> str:
  text = " ".join(json.dumps(value).split())
  return text if len(text) <= width else text[:width - 3] + "..."


def _check_resumable(meta: dict, fingerprint: dict, seeds: list[int], directory: str,
                     name: str) -> None:
  """Raise CheckpointMismatchError naming what differs from the checkpointed run."""
  stored = meta.get("fingerprint")
  if stored is None:  # checkpoints from before fingerprints: seeds are all we know
    stored, fingerprint = {"seeds": meta.get("seeds")}, {"seeds": seeds}
  keys = [k for k in {**stored, **fingerprint} if stored.get(k) != fingerprint.get(k)]
  if keys:
    diffs = "; ".join(f"{k}: {_short(stored.get(k))} in the checkpoint, now "
                      f"{_short(fingerprint.get(k))}" for k in keys)
    raise CheckpointMismatchError(
        f"run {name!r}: the checkpoint in {directory} was made with a different setup, so this "
        f"run cannot resume from it ({diffs}). Use another --workdir (workdir=) for the new "
        "setup, or delete that checkpoint directory to train this run from scratch.")


def _init_or_restore(model, tx, seeds, sample, inputs_fn, ckpt, fingerprint, name):
  """Fresh stacked state, or the newest intact checkpoint's; returns (state, step, meta).

  Each checkpoint's fingerprint is compared before anything is compiled or restored, so a
  changed setup fails at once, naming the differences, rather than with a shape error or
  silently with old results. A checkpoint whose metadata or state cannot be read back is
  reported in one line and skipped for the next older one; when none is intact,
  CheckpointDamagedError (nothing on disk is changed). A changed setup is not damage: the
  CheckpointMismatchError of the newest readable checkpoint propagates unchanged.
  """
  steps = [] if ckpt is None else ckpt.all_steps()[::-1]
  arrays = {k: _narrow(np.asarray(v)) for k, v in sample.items()}
  fresh = None
  damaged: list[CheckpointDamagedError] = []
  for i, step in enumerate(steps):
    try:
      meta = ckpt.read_meta(step)
      _check_resumable(meta, fingerprint, seeds, ckpt.directory, name)
      if fresh is None:
        fresh = init_state(model, tx, seeds, arrays, inputs_fn)
      state = ckpt.restore(step, fresh)
    except CheckpointDamagedError as e:
      damaged.append(e)
      then = f"trying step {steps[i + 1]}" if i + 1 < len(steps) else "no earlier checkpoint"
      msg = f"WARNING: run {name!r}: {e}; {then}"
      log.info(msg)  # printed below; a warning would print twice under absl
      print(msg, file=sys.stderr, flush=True)
      continue
    msg = f"Resuming run {name!r} from step {step} ({ckpt.directory})"
    log.info(msg)
    print(msg, file=sys.stderr, flush=True)
    return state, int(step), meta
  if damaged:
    raise CheckpointDamagedError(
        f"run {name!r}: no intact checkpoint in {ckpt.directory} (step(s) "
        f"{', '.join(str(e.step) for e in damaged)} cannot be read back; nothing was changed "
        "on disk). Move that directory away to train this run from scratch, or use another "
        "--workdir (workdir=).", directory=ckpt.directory)
  if fresh is None:
    fresh = init_state(model, tx, seeds, arrays, inputs_fn)
  return fresh, 0, {}


def _check_sequence_model(model: nn.Module, c: FitConfig) -> None:
  """With sequence parallelism the model must attend across shards: refuse one that does not
  say it runs ring attention over the mesh's `seq` axis (its attention would see only the
  device's own positions, a silently different model)."""
  if c.sequence_parallel <= 1:
    return
  axis = getattr(model, "sequence_axis", None)
  if axis != SEQUENCE_AXIS:
    raise ValueError(
        f"fit: sequence_parallel={c.sequence_parallel} splits the sequence over the mesh axis "
        f"{SEQUENCE_AXIS!r}, but {type(model).__name__} has sequence_axis={axis!r}: its "
        f"attention would see only each device's positions. Build it with "
        f"sequence_axis={SEQUENCE_AXIS!r} (attnx.nn.GPT, MultiHeadAttention).")
  layout = getattr(model, "sequence_layout", "contiguous")
  if layout != c.sequence_layout:
    raise ValueError(f"fit: sequence_layout={c.sequence_layout!r} but the model's is "
                     f"{layout!r}; they must agree (the positions of each shard differ)")


def _read_history(writer: Any, start_step: int, main: bool) -> list[dict]:
  """The run's logged records up to `start_step`, dropping later ones from the file.

  Process 0 rewrites the file; the others read it after it has (a barrier between), so that
  every process returns the same history.
  """
  history = writer.truncate_after(start_step) if main else []
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415

    multihost_utils.sync_global_devices("attnx.fit: metrics.jsonl truncated")
    if not main:
      history = writer.truncate_after(start_step)
  return history


def _rows_of(train_data: Callable[..., Iterator[dict]], seed: int, start_step: int,
             rows: tuple[int, int], batch_size: int) -> Iterator[dict]:
  """`train_data`'s stream, with only rows `rows` of every batch (this process's share).

  A stream that takes ``rows=`` (a `Loader`) reads only those rows; any other is read whole
  and sliced.
  """
  if rows == (0, batch_size):
    return iter(train_data(seed, start_step))
  if accepts_arg(train_data, "rows"):
    return iter(train_data(seed, start_step, rows=rows))
  a, b = rows
  return ({k: v[a:b] for k, v in batch.items()} for batch in train_data(seed, start_step))


def fit(model: nn.Module, *,
        train_data: Callable[[int, int], Iterator[dict]],
        config: FitConfig,
        workdir: str | None = None, name: str = "run",
        eval_fn: Callable[[Any], dict] | None = None,
        eval_data: Callable[[], Iterable[dict]] | None = None,
        eval_metrics: tuple[str, ...] | None = None,
        inputs_fn: Callable[[dict], tuple] = model_inputs,
        fingerprint: Mapping[str, Any] | None = None) -> FitResult:
  """Train `config.num_seeds` copies of `model` (seeds seed..seed+num_seeds-1) in one program.

  Seed i is initialized from PRNGKey(seed + i) and reads batches from
  `train_data(seed + i, start_step)` (e.g. a `loader`); the N seeds run as one jax.vmap'd
  step, and equal N separate runs. `config.parallel` ("none" | "shard_map" | "pmap")
  additionally shards every batch over all devices (data parallelism on the global mean
  loss; equals the single-device step). See `FitConfig` for the other settings.

  Several processes (``jax.distributed.initialize``; every process calls `fit` with the same
  arguments): each reads only the rows of every batch its devices hold (`train_data(seed,
  step, rows=(a, b))` when it takes ``rows``, else it slices), the result equals one process
  with the same devices, checkpoints are written collectively, and metrics, TensorBoard and
  the progress bar come from process 0 only. Every process returns the same FitResult.

  The loop only runs steps; periodic work is done by the actions of `attnx.train.actions`,
  each on its own schedule (every n steps and at the end): `CheckFinite`, `Evaluate`, `Log`,
  `Checkpoint`. Their time is not training time (`seconds_per_step`).

  With `workdir` and `config.checkpoint_every > 0`, the state is saved every
  `checkpoint_every` steps and at the end under workdir/checkpoints/<name>, and a later call
  with the same arguments resumes from the latest checkpoint (params, optimizer state, step,
  PRNG keys; the data stream restarts at the checkpointed step via `train_data(seed, step)`),
  so the resumed run ends with the same parameters and metrics as an uninterrupted one.
  Logged values are means since the previous log step; use a `checkpoint_every` that is a
  multiple of `log_every` for identical logged curves as well. Each checkpoint stores a
  fingerprint of the setup (`run_fingerprint`: model fields, optimizer config, loss,
  num_steps, batch size, seeds, first batch, plus the caller's `fingerprint` entries);
  resuming with a different one raises CheckpointMismatchError naming the differences,
  before anything is restored. A damaged checkpoint (one that cannot be read back) is
  reported in one line and the run resumes from the newest intact one, replacing the damaged
  steps as it reaches them; with none intact, CheckpointDamagedError, leaving the files as
  they are.

  Evaluation: `eval_fn(params_stacked) -> {name: [num_seeds]}` (also given `extra_variables=`
  when it takes that argument), or `eval_data()` (a fresh pass per evaluation, e.g. a
  `loader`) scored with `evaluate` on `eval_metrics` (default: accuracy and loss for
  "softmax_xent", mse for "mse"). Runs every `eval_every` steps and at the end. Non-trained
  variable collections of the model (e.g. FAVOR+ random features) are kept fixed and passed
  to every apply.

  Raises NonFiniteLossError (naming step and seeds) when the loss becomes NaN/Inf; what was
  logged until then stays in the workdir.

  An NNX model trains as ``fit(attnx.nnx.to_linen(ModelClass, **kwargs), ...)`` (Flax's
  bridge: one model built per seed); a built NNX model raises a TypeError saying so.

  Example:
    Two seeds of a linear classifier, 20 steps, evaluated on the training set:

    >>> import flax.linen as linen, numpy as np
    >>> from attnx import train
    >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    >>> arrays = {"inputs": x, "targets": (x.sum(-1) > 0).astype(np.int32)}
    >>> config = train.FitConfig(num_steps=20, num_seeds=2, log_every=10, progress=False,
    ...                          tensorboard=False,
    ...                          optimizer=train.optimizer_config(learning_rate=0.1))
    >>> result = train.fit(linen.Dense(2), train_data=train.loader(arrays, 16),
    ...                    eval_data=train.loader(arrays, 64), config=config)
    >>> sorted(result.final_metrics), result.final_metrics["accuracy"].shape
    (['accuracy', 'loss', 'train_accuracy', 'train_loss'], (2,))
    >>> [h["step"] for h in result.history], result.seeds
    ([10, 20], [0, 1])
    >>> bool(np.all(np.array(result.history[-1]["loss"]) < result.history[0]["loss"]))
    True
  """
  if not isinstance(config, FitConfig):
    raise TypeError(f"fit: config must be a FitConfig (FitConfig.from_config(config, ...)), "
                    f"got {type(config).__name__}")
  if isinstance(model, nnx.Module):
    raise TypeError(f"fit: {type(model).__name__} is a built NNX model; fit builds one model per "
                    f"seed, so pass its class and arguments: attnx.nnx.to_linen("
                    f"{type(model).__name__}, **kwargs) (Flax's bridge).")
  c = config
  validate_parallel(c.parallel, sequence_parallel=c.sequence_parallel)
  _check_sequence_model(model, c)
  loss_fn = get_loss(c.loss)
  if eval_metrics is None:
    eval_metrics = ("mse",) if c.loss == "mse" else ("accuracy", "loss")
  tx = make_optimizer(c.optimizer, c.num_steps)
  seeds = [c.seed + i for i in range(c.num_seeds)]
  placement = Placement(c.parallel, c.sequence_parallel, c.sequence_layout)
  apply_fn = make_apply_fn(model, inputs_fn)

  # A sample batch fixes the shapes for init (the stream is re-created for training).
  sample = next(iter(train_data(seeds[0], 0)))
  batch_size = len(next(iter(sample.values())))
  validate_parallel(c.parallel, batch_size, c.sequence_parallel)
  run_fp = run_fingerprint(model, c.optimizer, c.loss, c.num_steps, batch_size, seeds, sample,
                           fingerprint)

  from attnx.train.writers import MetricWriter
  ckpt = Checkpointer(workdir, name, c.checkpoint_every, c.keep_checkpoints) if (
      workdir and c.checkpoint_every > 0) else None
  try:
    state, start_step, meta = _init_or_restore(model, tx, seeds, sample, inputs_fn, ckpt,
                                               run_fp, name)
  except BaseException:
    if ckpt is not None:
      ckpt.close()
    raise
  # Logs beyond the checkpoint belong to steps that will be trained again: drop them.
  main = is_main_process()
  writer = MetricWriter(workdir, name, tensorboard=c.tensorboard, start_step=start_step,
                        readonly=not main)
  history = _read_history(writer, start_step, main)
  timing = meta.get("timing", {})

  step_fn = make_step(apply_fn, loss_fn, tx, c.parallel, placement.mesh)
  state = placement.state(state)
  rows = process_rows(c.parallel, batch_size, c.sequence_parallel)
  iters = [iter(_rows_of(train_data, s, start_step, rows, batch_size)) for s in seeds]

  def next_batch():
    return placement.batch(_stack([next(it) for it in iters]), batch_size)

  t0 = time.perf_counter()
  compiled = step_fn
  # pmap across processes lowers for the global device count and then refuses this process's
  # local arguments: it compiles lazily in its first step, which is then timed as compilation.
  lazy = c.parallel == "pmap" and jax.process_count() > 1
  if start_step < c.num_steps:
    first = next_batch()
    if lazy:
      compile_seconds = float("nan")  # the first step's time, compilation included, below
    else:
      try:
        compiled = step_fn.lower(state, first, np.int32(start_step)).compile()
      except Exception:  # noqa: BLE001 - AOT is only used for timing; fall back to lazy jit.
        compiled = step_fn
      compile_seconds = time.perf_counter() - t0
  else:  # a finished run: report the compile time of the process that trained it
    compile_seconds = float(timing.get("compile_seconds", float("nan")))

  def run_eval(host: dict) -> dict[str, np.ndarray]:
    params, extra = host["params"], host.get("extra")
    if eval_fn is not None:
      kw = {"extra_variables": extra} if accepts_arg(eval_fn, "extra_variables") else {}
      return {k: np.asarray(v) for k, v in eval_fn(params, **kw).items()}
    if eval_data is not None:
      return evaluate(model, params, eval_data(), eval_metrics, inputs_fn, extra)
    return {}

  clock = actions.TrainClock(float(timing.get("train_seconds", 0.0)),
                             int(timing.get("train_steps", 0)), compile_seconds)
  progress = actions.ProgressBar(c.progress and main, name, c.num_steps, start_step)
  log_at = actions.Schedule(c.log_every)
  eval_at = actions.Schedule(c.eval_every) if (
      eval_fn is not None or eval_data is not None) else actions.NEVER
  ckpt_at = actions.Schedule(c.checkpoint_every) if ckpt is not None else actions.NEVER
  # In this order (see attnx.train.actions): a blown-up run is neither evaluated nor saved, an
  # evaluation goes into the record, and the logs reach the disk before the checkpoint.
  periodic: list[actions.Action] = [
      actions.CheckFinite(log_at | eval_at | ckpt_at, seeds, name, _nonfinite_hint(c.optimizer)),
      actions.Evaluate(eval_at, run_eval),
      actions.Log(log_at | eval_at, writer, history, progress),
      actions.Checkpoint(ckpt_at, ckpt, writer, clock,
                         {"seeds": seeds, "name": name, "fingerprint": run_fp}),
  ]
  sync_each_step = workarounds.sync_every_step(c.parallel)
  ctx = actions.StepContext(placement, c.num_steps)
  clock.start()
  try:
    for step in range(start_step, c.num_steps):
      batch = first if step == start_step else next_batch()
      if lazy and step == start_step:
        with clock.excluded():
          state, metrics = compiled(state, batch, np.int32(step))
          jax.block_until_ready(metrics)
        clock.compile_seconds = compile_seconds = time.perf_counter() - t0
        clock.untimed_steps += 1
      else:
        state, metrics = compiled(state, batch, np.int32(step))
      if sync_each_step:
        jax.block_until_ready(metrics)
      clock.steps_run += 1
      ctx.advance(step + 1, state, metrics)
      due = [a for a in periodic if a.due(ctx.step, c.num_steps)]
      if due:
        ctx.sync()
        with clock.excluded():
          for action in due:
            action(ctx)
      progress.update()
    jax.block_until_ready(state)
  finally:
    progress.close()
    writer.close()
    if ckpt is not None:
      ckpt.close()
  seconds_per_step = clock.seconds_per_step()

  host_state = jax.device_get(placement.unplace(state))
  if clock.steps_run == 0:
    # Resumed a finished run: the last step's train metrics were saved with the checkpoint.
    final_eval = run_eval(host_state)
    last_metrics = {k: np.asarray(v) for k, v in (meta.get("last_metrics") or {}).items()}
  else:
    final_eval = {k[len("eval_"):]: np.asarray(v) for k, v in history[-1].items()
                  if k.startswith("eval_")} if history else {}
    last_metrics = ctx.last_metrics()
  final: dict[str, np.ndarray] = {f"train_{k}": np.asarray(v) for k, v in last_metrics.items()}
  final.update(final_eval)
  return FitResult(params=host_state["params"], history=history, final_metrics=final,
                   seconds_per_step=seconds_per_step, compile_seconds=compile_seconds,
                   seeds=seeds, start_step=start_step, opt_state=host_state["opt_state"],
                   extra_variables=host_state.get("extra"))
