"""Softmax vs alternative attention weightings F across tasks, at equal model and budget.

Every weighting trains the same model with the same optimizer, steps, batch size and seeds
(seeds run in parallel with jax.vmap); only the attention weighting changes. Reported per task:
test accuracy (or in-context squared error) mean ± std over seeds, time per step, compile time,
learning curves; plus a summary table across tasks.

Presets (expected results are what we observed with jax 0.10.2 on a 2-core x86 CPU):
  default  python launch.py
           digits (real 8x8 images, ViT with 2x2 patches = 16 tokens + CLS), 8 weightings
           (softmax, relu, relu2, sigmoid, sparsemax, entmax15, linear_elu, metric), 3 seeds,
           300 steps of batch 32. Measured on 2 cores: 1.5 min wall when the machine is quiet,
           3.1 min at a load of ≈ 5 from other jobs; compiling the 8 programs is about half
           of it. Results are deterministic (two runs agreed). Expected test accuracy
           ≈ 0.87-0.89 ± 0.02 for softmax, relu, relu2, sigmoid and entmax15; sparsemax
           0.82-0.84, linear_elu and metric ≈ 0.85 (3-6 points lower at this budget).
  tiny     python launch.py --config=experiments/compare_weightings.py:tiny
           digits, softmax vs relu, 2 seeds, 40 steps, 1-layer model, checkpoints every 10
           steps (CI). Measured: 40-70 s wall on the loaded machine, mostly compilation. Test
           accuracy 0.3-0.5 (chance 0.1): a smoke test, not a result.
  survey   python launch.py --config=experiments/compare_weightings.py:survey
           all four tasks at CPU scale (ListOps length ≤ 48, MQAR length 32 with 4 pairs, ICL
           d=4 with 16 points), all 13 weightings, 2 seeds, 600 steps of batch 32, and the
           summary table across tasks. Measured: 18 min wall on 2 cores. Expected: every F
           within ≈ 2.5 points of softmax on digits (sparsemax lowest), 0.29-0.32 on ListOps,
           only metric attention solves MQAR at this budget (≈ 0.98 vs ≈ 0.34), ICL error/d
           ≈ 0.5 (softmax, sigmoid, softplus) to 1.0 (metric).
  quick    python launch.py --config=experiments/compare_weightings.py:quick
           digits, softmax/relu/sparsemax/linear_elu, 2 seeds, 200 steps of batch 32.
           Measured: 71 s wall on 2 cores (one run); expect about twice that under load,
           as for default.
  The presets below were not timed or run to completion here; runtimes are estimates from the
  per-step times above and the results are what the literature leads one to expect.
  digits   ...:digits   all 13 weightings, 5 seeds, 1000 steps of batch 64 (≈15-30 min).
  listops  ...:listops  ListOps (max length 128), all weightings, 3 seeds, 2000 steps (hours);
           LRA-style accuracies are low (LRA reports 0.36 for softmax at length 2000).
  associative_recall   ...:associative_recall   MQAR, causal model, all weightings, 3 seeds;
           Arora et al. 2023 find softmax solves it while linear attention needs more state.
  icl_regression       ...:icl_regression   in-context linear regression (Garg et al. 2022),
           causal model, all weightings; the error at the last in-context position is compared
           with least squares (minimum-norm OLS from the preceding pairs), as in their Fig. 2.
  all      ...:all      all four tasks and all weightings, with the summary table (many hours).

Override anything from the command line, e.g. --config.weightings=softmax,relu,sparsemax
--config.num_seeds=4 --config.num_steps=2000 --config.tasks=digits,associative_recall.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

from attnx.train.config import base_config, check_batch_size, split_list
from attnx.train.optim import optimizer_config

PRESETS = ("default", "tiny", "quick", "survey", "digits", "listops", "associative_recall",
           "icl_regression", "all")
TASKS = ("digits", "listops", "associative_recall", "icl_regression")
# power at p = 3: its default p = 2 is relu2, already in the list.
ALL_WEIGHTINGS = ("softmax", "relu", "relu2", "sigmoid", "sigmoid:normalization=none",
                  "softplus", "power:p=3", "taylor_exp", "sparsemax", "entmax15", "linear_elu",
                  "linear_favor", "metric")
DEFAULT_WEIGHTINGS = ("softmax", "relu", "relu2", "sigmoid", "sparsemax", "entmax15",
                      "linear_elu", "metric")
CLAIM = ("At the same model, budget and hyper-parameters, the best alternative weighting F "
         "comes within one seed-standard-deviation (or 1 point / 5 % relative error) of softmax.")


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for `preset` (None = "default"); see the module docstring for the presets."""
  preset = preset or "default"
  if preset not in PRESETS:
    raise ValueError(f"Unknown preset {preset!r} for compare_weightings; valid presets: "
                     f"{', '.join(PRESETS)}")
  c = base_config()
  c.experiment = "compare_weightings"
  c.preset = preset
  c.tasks = "digits"  # comma-separated subset of TASKS
  c.weightings = ",".join(DEFAULT_WEIGHTINGS)  # comma-separated attention variants
  c.num_seeds = 3
  c.num_steps = 300
  c.batch_size = 32
  c.eval_every = 50
  c.log_every = 10
  c.checkpoint_every = 100
  c.keep_checkpoints = 2
  c.max_eval_examples = 1000  # cap on test examples per evaluation (CPU budget)
  c.model = ml_collections.ConfigDict(dict(
      hidden_dim=32, num_layers=2, num_heads=4, mlp_dim=64, dropout_rate=0.0, patch_size=2))
  c.optimizer = optimizer_config(name="adamw", learning_rate=3e-3, schedule="warmup_cosine",
                                 warmup_steps=30, weight_decay=1e-4, grad_clip_norm=1.0)
  # Dataset builder kwargs per task (attnx.data config fields).
  c.data = ml_collections.ConfigDict(dict(
      digits=ml_collections.ConfigDict(dict()),
      listops=ml_collections.ConfigDict(dict(max_length=128, num_train=20000)),
      associative_recall=ml_collections.ConfigDict(dict(
          vocab_size=64, seq_len=64, num_kv_pairs=8, num_queries=8, num_train=20000)),
      icl_regression=ml_collections.ConfigDict(dict(dim=5, num_points=20, num_train=10000)),
  ))

  if preset == "tiny":
    c.weightings = "softmax,relu"
    c.num_seeds = 2
    c.num_steps = 40
    c.batch_size = 32
    c.eval_every = 20
    c.log_every = 10
    c.checkpoint_every = 10
    c.max_eval_examples = 360
    c.model.update(hidden_dim=16, num_layers=1, num_heads=2, mlp_dim=32)
    c.optimizer.update(learning_rate=1e-2, warmup_steps=5)
  elif preset == "quick":
    c.weightings = "softmax,relu,sparsemax,linear_elu"
    c.num_seeds = 2
    c.num_steps = 200
  elif preset == "survey":
    # Every task at CPU scale: short sequences, small data, one budget for all.
    c.update(dict(tasks=",".join(TASKS), weightings=",".join(ALL_WEIGHTINGS), num_seeds=2,
                  num_steps=600, eval_every=100, checkpoint_every=200, max_eval_examples=500))
    c.data.listops.update(max_length=48, num_train=10000)
    c.data.associative_recall.update(vocab_size=32, seq_len=32, num_kv_pairs=4, num_queries=4,
                                     num_train=10000)
    c.data.icl_regression.update(dim=4, num_points=16, num_train=10000)
  elif preset == "digits":
    c.update(dict(weightings=",".join(ALL_WEIGHTINGS), num_seeds=5, num_steps=1000,
                  batch_size=64, eval_every=100, checkpoint_every=250))
    c.optimizer.warmup_steps = 50
  elif preset in ("listops", "associative_recall", "icl_regression", "all"):
    c.tasks = ",".join(TASKS) if preset == "all" else preset
    c.weightings = ",".join(ALL_WEIGHTINGS)
    c.num_seeds = 3
    c.num_steps = 2000
    c.batch_size = 64
    c.eval_every = 250
    c.checkpoint_every = 500
    c.model.update(hidden_dim=64, num_layers=2, num_heads=4, mlp_dim=128)
    c.optimizer.update(learning_rate=1e-3, warmup_steps=200)
  return c


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Experiment-specific checks (names the key and the valid choices); no compilation."""
  tasks = split_list(config.tasks)
  if not tasks:
    raise ValueError(f"config.tasks is empty; valid choices: {', '.join(TASKS)}")
  for t in tasks:
    if t not in TASKS:
      raise ValueError(f"config.tasks has unknown task {t!r}; valid choices: {', '.join(TASKS)}")
  weightings = split_list(config.weightings)
  if not weightings:
    raise ValueError("config.weightings is empty")
  from attnx import nn as attnx_nn  # lazy: --help/--list stay fast

  for w in weightings:
    try:
      attnx_nn.attention_spec(w)
    except ValueError as e:
      raise ValueError(f"config.weightings: {e}") from None
  if config.batch_size < 1 or config.max_eval_examples < 1:
    raise ValueError("config.batch_size and config.max_eval_examples must be >= 1")
  m = config.model
  for key in ("hidden_dim", "num_layers", "num_heads", "mlp_dim", "patch_size"):
    if m[key] < 1:
      raise ValueError(f"config.model.{key} must be >= 1, got {m[key]!r}")
  if m.hidden_dim % m.num_heads:
    raise ValueError(f"config.model.hidden_dim={m.hidden_dim} must be divisible by "
                     f"config.model.num_heads={m.num_heads}")
  from attnx import data  # sizes and shapes without preparing any data

  for t in tasks:
    info = data.get_info(t, **dict(config.data.get(t, {})))
    check_batch_size(config, "batch_size", info.splits["train"], f"task {t!r}")
    if t == "digits" and any(d % m.patch_size for d in info.input_shape[:2]):
      raise ValueError(f"config.model.patch_size={m.patch_size} does not divide the "
                       f"{info.input_shape[0]}x{info.input_shape[1]} digits images")


# ----------------------------------------------------------------------------------------------
# Tasks: data + model + loss + evaluation, identical for every weighting.


@dataclasses.dataclass
class Task:
  name: str
  model_fn: Callable[[dict], Any]  # attention spec -> flax module
  train_arrays: dict[str, np.ndarray]
  test_arrays: dict[str, np.ndarray]
  loss: Any
  metric: str  # primary metric in FitResult.final_metrics
  higher_is_better: bool
  description: str
  eval_metrics: tuple[str, ...] = ("accuracy", "loss")
  eval_fn_factory: Callable[[Any], Callable] | None = None
  extras: dict[str, Any] = dataclasses.field(default_factory=dict)


def _load(name: str, split: str, kwargs: dict, keys: tuple[str, ...],
          limit: int | None = None) -> dict[str, np.ndarray]:
  from attnx import data

  arrays = data.load_arrays(name, split=split, **kwargs)
  out = {k: np.asarray(arrays[k]) for k in keys if k in arrays}
  if limit is not None:
    out = {k: v[:limit] for k, v in out.items()}
  return out


def _setup_task(name: str, config: ml_collections.ConfigDict) -> Task:
  from attnx import data
  from attnx import nn as attnx_nn

  m = config.model
  kwargs = dict(config.data.get(name, {}))
  common = dict(hidden_dim=m.hidden_dim, num_layers=m.num_layers, num_heads=m.num_heads,
                mlp_dim=m.mlp_dim, dropout_rate=m.dropout_rate)
  info = data.get_info(name, **kwargs)
  limit = int(config.max_eval_examples)
  if name == "digits":
    tr = _load(name, "train", kwargs, ("inputs", "targets"))
    te = _load(name, "test", kwargs, ("inputs", "targets"), limit)
    return Task(
        name, lambda att: attnx_nn.VisionTransformer(
            num_classes=info.num_classes, patch_size=m.patch_size, pool="cls", attention=att,
            **common),
        tr, te, "softmax_xent", "accuracy", True,
        f"sklearn digits 8x8 ({len(tr['targets'])} train / {len(te['targets'])} test), ViT "
        f"with {m.patch_size}x{m.patch_size} patches")
  if name == "listops":
    tr = _load(name, "train", kwargs, ("inputs", "targets"))
    te = _load(name, "test", kwargs, ("inputs", "targets"), limit)
    return Task(
        name, lambda att: attnx_nn.SequenceClassifier(
            vocab_size=info.vocab_size, num_classes=info.num_classes, max_len=info.seq_len,
            pool="cls", attention=att, **common),
        tr, te, "softmax_xent", "accuracy", True,
        f"ListOps (length ≤ {info.seq_len}), bidirectional encoder, CLS pooling")
  if name == "associative_recall":
    tr = _load(name, "train", kwargs, ("inputs", "targets"))
    te = _load(name, "test", kwargs, ("inputs", "targets"), limit)
    return Task(
        name, lambda att: attnx_nn.SequenceClassifier(
            vocab_size=info.vocab_size, num_classes=info.num_classes or info.vocab_size,
            max_len=info.seq_len, pool="none", is_causal=True, attention=att, **common),
        tr, te, "softmax_xent", "accuracy", True,
        f"multi-query associative recall (length {info.seq_len}), causal decoder, accuracy at "
        "query positions")
  if name == "icl_regression":
    tr = _load(name, "train", kwargs, ("inputs", "targets"))
    te = _load(name, "test", kwargs, ("inputs", "targets"), limit)
    dim = int(te["inputs"].shape[-1]) - 1
    xs = te["inputs"][:, 0::2, :dim]  # x-tokens are (x_i, 0); kept for the OLS baseline
    return Task(
        name, lambda att: attnx_nn.SequenceRegressor(
            out_dim=1, max_len=int(tr["inputs"].shape[1]), is_causal=True, attention=att,
            **common),
        tr, te, _icl_loss, "mse_last", False,
        f"in-context linear regression, d={dim}, k={te['targets'].shape[1]} (Garg et al. "
        "2022); squared error / d at the last position",
        eval_metrics=(), eval_fn_factory=lambda model: _icl_eval_fn(model, te, dim),
        extras={"xs": xs})
  raise ValueError(f"unknown task {name!r}; valid: {TASKS}")


def _icl_loss(outputs, batch):
  """MSE of the prediction read at each x-token (even positions) against y_i."""
  preds = outputs[..., 0::2, 0]
  err = (preds - batch["targets"]) ** 2
  loss = err.mean()
  return loss, {"mse": loss}


def _icl_curve(model, params_stacked, arrays: dict, extra=None,
               batch_size: int = 250) -> np.ndarray:
  """Squared error per in-context position, [num_seeds, k] (averaged over the test set)."""
  import jax

  @jax.jit
  def f(params, extra, inputs, targets):
    def one(p, e):
      return model.apply({"params": p, **e}, inputs, deterministic=True)

    out = jax.vmap(one)(params, extra)
    return ((out[..., 0::2, 0] - targets) ** 2).sum(1)

  total = 0.0
  n = len(arrays["inputs"])
  for i in range(0, n, batch_size):
    total = total + np.asarray(f(params_stacked, extra or {}, arrays["inputs"][i:i + batch_size],
                                 arrays["targets"][i:i + batch_size]))
  return total / n


def _icl_eval_fn(model, arrays: dict, dim: int) -> Callable:
  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    curve = _icl_curve(model, params_stacked, arrays, extra_variables) / dim
    return {"mse": curve.mean(-1), "mse_last": curve[:, -1]}

  return eval_fn


# ----------------------------------------------------------------------------------------------


def _run_name(task: str, weighting: str) -> str:
  return f"{task}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', weighting)}"


def _close_to(best: np.ndarray, ref: np.ndarray, higher_is_better: bool) -> bool:
  tol = max(float(np.std(ref)), float(np.std(best)))
  if higher_is_better:
    return float(np.mean(best)) >= float(np.mean(ref)) - max(tol, 0.01)
  return float(np.mean(best)) <= float(np.mean(ref)) * 1.05 + tol


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train every weighting on every task; write report.md, results.json, final_metrics.json."""
  import matplotlib.pyplot as plt

  from attnx import nn as attnx_nn
  from attnx import train

  validate_config(config)
  tasks = split_list(config.tasks)
  weightings = split_list(config.weightings)
  rep = train.Report(f"Attention weightings compared ({config.preset}): {', '.join(tasks)}",
                     workdir, config=config, claim=CLAIM)
  rep.text(
      f"Every weighting uses the **same model, optimizer, budget and seeds**: "
      f"{config.num_steps} steps of batch {config.batch_size}, {config.optimizer.name} "
      f"(lr {config.optimizer.learning_rate}, {config.optimizer.schedule}), model "
      f"{dict(config.model)}, seeds {config.seed}..{config.seed + config.num_seeds - 1} trained "
      f"in parallel with jax.vmap. Only the attention weighting F differs. Values are mean ± std "
      f"over seeds; time per step covers all {config.num_seeds} seeds at once.")
  final: dict[str, dict[str, dict[str, list[float]]]] = {}
  summary: dict[str, dict[str, Any]] = {w: {"weighting": w} for w in weightings}
  for task_name in tasks:
    task = _setup_task(task_name, config)
    rep.section(f"Task: {task_name}")
    rep.text(task.description)
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for w in weightings:
      model = task.model_fn(attnx_nn.attention_spec(w))
      print(f"[{task_name}] {w}: training {config.num_seeds} seed(s) x {config.num_steps} steps",
            flush=True)
      try:
        res = train.fit(
            model,
            train_data=train.stream_fn(task.train_arrays, config.batch_size,
                                       config.data_pipeline),
            loss=task.loss,
            eval_data=(None if task.eval_fn_factory else
                       (lambda t=task: train.batches(t.test_arrays, 500))),
            eval_fn=task.eval_fn_factory(model) if task.eval_fn_factory else None,
            eval_metrics=task.eval_metrics or None,
            optimizer=config.optimizer, num_steps=config.num_steps,
            num_seeds=config.num_seeds, seed=config.seed, workdir=workdir,
            name=_run_name(task_name, w), checkpoint_every=config.checkpoint_every,
            keep_checkpoints=config.keep_checkpoints, eval_every=config.eval_every,
            log_every=config.log_every, parallel=config.parallel, progress=config.progress)
      except train.NonFiniteLossError as e:
        failures[w] = str(e)
        print(f"[{task_name}] {w}: {e}", flush=True)
        continue
      results[w] = res
      msg = ", ".join(f"{k}={train.mean_std(v)}" for k, v in res.final_metrics.items())
      print(f"[{task_name}] {w}: {msg}; {1e3 * res.seconds_per_step:.2f} ms/step", flush=True)
    final[task_name] = {w: {k: np.asarray(v).tolist() for k, v in r.final_metrics.items()}
                        for w, r in results.items()}
    _report_task(rep, task, results, failures, config, plt)
    for w in weightings:
      summary[w][task_name] = (train.mean_std(results[w].final_metrics[task.metric], ".4g")
                               if w in results else "diverged")
  if len(tasks) > 1:
    rep.section("Summary across tasks")
    rep.table(list(summary.values()), ["weighting"] + tasks,
              caption="Primary metric per task (accuracy ↑; icl_regression: error/d at the "
                      "last in-context position ↓), mean ± std over seeds")
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(final, f, indent=1)
  path = rep.write()
  return {"report": path, "final_metrics": final}


def _report_task(rep, task: Task, results: dict, failures: dict, config, plt) -> None:
  from attnx import train

  rows = []
  for w, r in results.items():
    row = {"weighting": w}
    for k in (task.metric, "accuracy", "loss", "mse", "train_loss"):
      if k in r.final_metrics and k not in row:
        row[k] = train.mean_std(r.final_metrics[k], ".4g")
    row["ms/step"] = 1e3 * r.seconds_per_step
    row["compile s"] = r.compile_seconds
    if r.start_step:
      row["resumed from"] = r.start_step
    rows.append(row)
  for w, msg in failures.items():
    rows.append({"weighting": w, task.metric: "diverged", "note": msg.split(". ")[0]})
  rep.table(rows, caption=f"{task.name}: final test metrics after {config.num_steps} steps")

  if task.name == "icl_regression" and results:
    _icl_figure(rep, task, results, plt)

  histories = {w: r.history for w, r in results.items()}
  eval_key = f"eval_{task.metric}"
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  train.plot_learning_curves(histories, "loss", ax=axes[0], logy=True, title="train loss")
  train.plot_learning_curves(histories, eval_key, ax=axes[1], title=f"test {task.metric}",
                             ylabel=task.metric)
  rep.figure(fig, f"{task.name}_curves", f"{task.name}: learning curves (mean ± std over seeds)")

  if "softmax" in results and len(results) > 1:
    ref = np.asarray(results["softmax"].final_metrics[task.metric])
    others = {w: np.asarray(r.final_metrics[task.metric]) for w, r in results.items()
              if w != "softmax"}
    pick = max if task.higher_is_better else min
    best = pick(others, key=lambda w: float(np.mean(others[w])))
    held = _close_to(others[best], ref, task.higher_is_better)
    rep.verdict(held, f"on {task.name}, the best alternative is {best} with {task.metric} "
                      f"{train.mean_std(others[best], '.4g')} vs softmax "
                      f"{train.mean_std(ref, '.4g')} ({config.num_seeds} seeds, "
                      f"{config.num_steps} steps).")


def _icl_figure(rep, task: Task, results: dict, plt) -> None:
  """Garg et al.-style plot: error vs number of in-context examples, with least squares."""
  from attnx import nn as attnx_nn
  from attnx import train
  from attnx.data.icl_regression import least_squares_baseline

  te = task.test_arrays
  xs = task.extras["xs"]
  dim = xs.shape[-1]
  ols = ((least_squares_baseline(xs, te["targets"]) - te["targets"]) ** 2).mean(0) / dim
  fig, ax = plt.subplots(figsize=(6, 4))
  k = np.arange(len(ols))
  ax.plot(k, ols, "k--", label="least squares")
  rows = []
  for w, r in results.items():
    model = task.model_fn(attnx_nn.attention_spec(w))
    curve = _icl_curve(model, r.params, te, r.extra_variables) / dim
    ax.plot(k, curve.mean(0), label=w)
    rows.append({"weighting": w, "error/d at last": train.mean_std(curve[:, -1], ".4g"),
                 "least squares at last": float(ols[-1])})
  ax.set_xlabel("in-context examples")
  ax.set_ylabel("squared error / d")
  ax.set_yscale("log")
  ax.legend(fontsize=7)
  rep.table(rows, caption="In-context error at the last position vs least squares")
  rep.figure(fig, "icl_regression_vs_least_squares",
             "Squared error / d vs number of in-context examples (mean over seeds)")
