"""Experiments as declarations: tasks × variants → train → evaluate → compare → report.

A comparison experiment states *what* it compares and leaves *how* to this module::

    tasks = [Task(name="digits", dataset="digits", build_model=vit, metric="accuracy", ...)]
    variants = [Variant("softmax", attention_spec("softmax")), Variant("relu", ...)]
    return run_comparison(config, workdir, title=..., claim=..., tasks=tasks,
                          variants=variants, reference="softmax")

:func:`run_comparison` reads each task's data once through :mod:`attnx.data`, trains every
variant with :func:`attnx.train.fit` (seeds vmapped, data parallelism, checkpoints and resume
from the config), scores it with the task's named evaluators (:mod:`attnx.train.evaluators`),
compares every variant with the reference by the one verdict rule
(:mod:`attnx.train.verdict`) and writes the report: a table per task, learning curves, a
summary across tasks, the verdicts with the rule stated, ``results.json`` and
``final_metrics.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from attnx.train import evaluators as evaluators_lib
from attnx.train import verdict as verdict_lib
from attnx.train.config import FitConfig
from attnx.train.data import loader
from attnx.train.loop import FitResult, NonFiniteLossError, fit
from attnx.train.parallel import is_main_process
from attnx.train.report import Report, mean_std, plot_learning_curves


@dataclasses.dataclass(frozen=True)
class Task:
  """One task of a comparison: data, model builder, loss, evaluators and the primary metric.

  Attributes:
    name: label in reports and run names.
    dataset: an :mod:`attnx.data` dataset name; ``data_kwargs`` are its builder config.
    build_model: ``variant.spec -> flax module`` (the same builder for every variant).
    loss: a loss name (:data:`attnx.train.LOSSES`) or a loss function.
    evaluators: evaluator names (:func:`attnx.train.evaluators.list_evaluators`).
    metric: the primary metric (an evaluator output) that tables and verdicts use.
    higher_is_better: orientation of ``metric``.
    margin: δ of the verdict rule for ``metric`` (the difference that counts as equal).
    description: one line for the report.
    eval_split, eval_limit: the evaluation split and a cap on its examples (CPU budget);
      ``train_limit`` caps the training split likewise.
    keys: the arrays kept from the dataset (after ``prepare``).
    train_arrays: optional ``() -> arrays``: the training split built by the task itself (e.g.
      packed documents with ``segment_ids`` and ``positions``, :mod:`attnx.data.packing`)
      instead of the dataset's; the evaluation split still comes from the dataset.
    prepare: optional ``{"train": arrays, "eval": arrays} -> same`` applied to the loaded
      arrays (e.g. uint8 images to floats in [0, 1], padded targets to ``IGNORE_INDEX``).
    curve_evaluators, curve_limit: what is evaluated every ``eval_every`` steps during
      training (the learning curve), on the first ``curve_limit`` evaluation examples; None:
      the task's ``evaluators`` on the whole evaluation split. The final metrics always come
      from ``evaluators`` on the whole (``eval_limit``-capped) evaluation split.
    fit_options: :class:`attnx.train.FitConfig` fields that differ from the experiment config
      for this task (e.g. ``optimizer``, ``log_every``, ``tensorboard``).
    extra_report: optional ``(report, task_result) -> None`` adding task-specific tables or
      figures (e.g. a baseline curve) after the standard ones.
    eval_options: settings the task's evaluators read (e.g. ``noise_levels`` for
      ``"noisy_accuracy"``, ``bos_id``/``detokenize`` for ``"greedy_decode"``; see
      :mod:`attnx.train.evaluators`).
  """

  name: str
  dataset: str
  build_model: Callable[[Any], Any]
  metric: str
  higher_is_better: bool = True
  margin: float = 0.01
  loss: Any = "softmax_xent"
  evaluators: tuple[str, ...] = ("accuracy", "loss")
  description: str = ""
  data_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_split: str = "test"
  eval_limit: int | None = None
  keys: tuple[str, ...] = ("inputs", "targets")
  extra_report: Callable[[Report, Any], None] | None = None
  eval_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  train_limit: int | None = None
  prepare: Callable[[dict[str, dict[str, np.ndarray]]], dict[str, dict[str, np.ndarray]]] \
      | None = None
  curve_evaluators: tuple[str, ...] | None = None
  curve_limit: int | None = None
  fit_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  train_arrays: Callable[[], dict[str, np.ndarray]] | None = None


@dataclasses.dataclass(frozen=True)
class Variant:
  """One compared variant: a label, what ``Task.build_model`` takes, and the task evaluators
  that do not apply to it (e.g. ``("alignment",)`` for a model without attention)."""

  name: str
  spec: Any
  skip_evaluators: tuple[str, ...] = ()


@dataclasses.dataclass
class TaskResult:
  """What one task produced: per-variant fits and metrics, failures, comparisons."""

  task: Task
  arrays: dict[str, dict[str, np.ndarray]]  # split -> arrays
  fits: dict[str, FitResult]
  failures: dict[str, str]
  comparisons: dict[str, verdict_lib.Comparison]  # variant -> vs the reference

  def metric(self, variant: str, name: str | None = None) -> np.ndarray:
    return np.asarray(self.fits[variant].final_metrics[name or self.task.metric])

  def compare(self, a: str, b: str) -> verdict_lib.Comparison:
    """Variant ``a`` vs ``b`` on the task's primary metric by the *paired* rule, with the
    task's margin and orientation."""
    task = self.task
    return verdict_lib.compare(self.metric(a), self.metric(b), margin=task.margin,
                               higher_is_better=task.higher_is_better, a_name=a, b_name=b,
                               metric=task.metric)

  def claim(self, requirements: Sequence[tuple[str, str, str]]) -> verdict_lib.Claim:
    """A claim (kind *claim*) over comparisons of this task's variants: each ``(a, b,
    required outcome)`` (e.g. ``("relu ÷L", "softmax", "not worse")``); untested (no parts)
    when a named variant did not train."""
    names = {n for a, b, _ in requirements for n in (a, b)}
    if not names <= set(self.fits):
      return verdict_lib.claim([])
    return verdict_lib.claim(verdict_lib.part(self.compare(a, b), require)
                             for a, b, require in requirements)


def load_task_arrays(task: Task) -> dict[str, dict[str, np.ndarray]]:
  """{"train": arrays, "eval": arrays} of a task through :func:`attnx.data.load_arrays`."""
  from attnx import data

  def read(split: str, limit: int | None) -> dict[str, np.ndarray]:
    if split == "train" and task.train_arrays is not None:
      arrays = task.train_arrays()
    else:
      arrays = data.load_arrays(task.dataset, split=split, **dict(task.data_kwargs))
    return {k: np.asarray(v)[:limit] for k, v in arrays.items()}

  arrays = {"train": read("train", task.train_limit),
            "eval": read(task.eval_split, task.eval_limit)}
  if task.prepare is not None:
    arrays = task.prepare(arrays)
  return {split: {k: a[k] for k in task.keys if k in a} for split, a in arrays.items()}


def images_to_unit_floats(arrays: dict[str, dict[str, np.ndarray]]
                          ) -> dict[str, dict[str, np.ndarray]]:
  """A ``Task.prepare``: uint8 images (the catalog's) to float32 pixels in [0, 1]; float
  inputs (attnx's digits) and every other array stay as they are."""
  return {split: {k: (v.astype(np.float32) / 255.0 if k == "inputs" and v.dtype == np.uint8
                      else v) for k, v in a.items()} for split, a in arrays.items()}


def run_name(task: str, variant: str) -> str:
  """A file-system-safe run name (checkpoints, logs) for a (task, variant) pair."""
  return f"{task}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', variant)}"


def with_budget(config: ml_collections.ConfigDict, **budget: Any) -> ml_collections.ConfigDict:
  """A copy of ``config`` with a study's budget (``num_steps``, ``batch_size``, ``optimizer``,
  ``eval_every``, ...) set at the top level, where :func:`train_variant`
  (``FitConfig.from_config``) reads it: for experiments that keep a study's budget in a
  sub-config (``config.train``, ``config.digits``)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    for key, value in budget.items():
      c[key] = value
  return c


def train_variant(config: ml_collections.ConfigDict, workdir: str, task: Task,
                  variant: Variant, arrays: Mapping[str, Mapping[str, np.ndarray]]) -> FitResult:
  """Trains ``variant`` on ``task`` with the config's budget (changed by ``task.fit_options``);
  evaluates the learning curve every ``eval_every`` steps and the task's evaluators at the
  end (see :class:`Task`)."""
  model = task.build_model(variant.spec)
  skip = set(variant.skip_evaluators)
  names = tuple(n for n in task.evaluators if n not in skip)
  final_fn = evaluators_lib.make_eval_fn(names, model, arrays["eval"], task)
  curve_fn = final_fn
  if task.curve_evaluators is not None or task.curve_limit is not None:
    curve_names = tuple(n for n in (task.curve_evaluators or names) if n not in skip)
    curve_arrays = {k: v[:task.curve_limit] for k, v in arrays["eval"].items()}
    curve_fn = evaluators_lib.make_eval_fn(curve_names, model, curve_arrays, task)
  res = fit(model, train_data=loader(arrays["train"], config.batch_size,
                                     config.get("data_pipeline", "numpy")),
            config=FitConfig.from_config(config, **{"loss": task.loss, **task.fit_options}),
            eval_fn=curve_fn, workdir=workdir, name=run_name(task.name, variant.name))
  if curve_fn is not final_fn:
    res.final_metrics.update(final_fn(res.params, res.extra_variables))
  return res


def _scalar_metrics(res: FitResult) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in res.final_metrics.items() if np.asarray(v).ndim == 1}


def _say(line: str) -> None:
  """A progress line on stdout, from process 0 only (all processes run the same loop)."""
  if is_main_process():
    print(line, flush=True)


def run_task(config: ml_collections.ConfigDict, workdir: str, task: Task,
             variants: Sequence[Variant], reference: str | None,
             arrays: dict[str, dict[str, np.ndarray]] | None = None) -> TaskResult:
  """Trains every variant on one task and compares each with ``reference`` (by the task's
  primary metric). ``arrays``: the task's arrays when already loaded (default:
  :func:`load_task_arrays`)."""
  evaluators_lib.check_evaluators(task.evaluators + (task.curve_evaluators or ()))
  arrays = load_task_arrays(task) if arrays is None else arrays
  fits: dict[str, FitResult] = {}
  failures: dict[str, str] = {}
  for v in variants:
    _say(f"[{task.name}] {v.name}: training {config.num_seeds} seed(s) x {config.num_steps} "
         "steps")
    try:
      res = train_variant(config, workdir, task, v, arrays)
    except NonFiniteLossError as e:
      failures[v.name] = str(e)
      _say(f"[{task.name}] {v.name}: {e}")
      continue
    fits[v.name] = res
    msg = ", ".join(f"{k}={mean_std(x)}" for k, x in _scalar_metrics(res).items())
    _say(f"[{task.name}] {v.name}: {msg}; {1e3 * res.seconds_per_step:.2f} ms/step")
  result = TaskResult(task, arrays, fits, failures, {})
  if reference in fits:
    result.comparisons.update({name: result.compare(name, reference)
                               for name in fits if name != reference})
  return result


def report_task(rep: Report, result: TaskResult, config: ml_collections.ConfigDict,
                reference: str | None, label: str = "variant",
                verdict: bool = True) -> bool | None:
  """Table, learning curves and (``verdict``) the verdict of one task; returns the claim's
  outcome there (kind *claim*): the best alternative is not worse than the reference (None:
  inconclusive or no reference)."""
  import matplotlib.pyplot as plt

  task = result.task
  rep.section(f"Task: {task.name}")
  if task.description:
    rep.text(task.description)
  rows = []
  for name, res in result.fits.items():
    row: dict[str, Any] = {label: name}
    for k in dict.fromkeys((task.metric, "accuracy", "loss", "mse", "train_loss")):
      if k in res.final_metrics:
        row[k] = mean_std(res.final_metrics[k], ".4g")
    if name in result.comparisons:
      c = result.comparisons[name]
      row[f"vs {reference}"] = c.outcome
      row["95 % CI of difference"] = (f"[{c.ci_low:+.3g}, {c.ci_high:+.3g}]" if c.n > 1
                                      else "—")
    row["ms/step"] = 1e3 * res.seconds_per_step
    row["compile s"] = res.compile_seconds
    if res.start_step:
      row["resumed from"] = res.start_step
    rows.append(row)
  for name, msg in result.failures.items():
    rows.append({label: name, task.metric: "diverged", "note": msg.split(". ")[0]})
  rep.table(rows, caption=f"{task.name}: final {task.eval_split} metrics after "
                          f"{config.num_steps} steps (mean ± std over {config.num_seeds} seeds)")

  histories = {w: r.history for w, r in result.fits.items()}
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  plot_learning_curves(histories, "loss", ax=axes[0], logy=True, title="train loss")
  plot_learning_curves(histories, f"eval_{task.metric}", ax=axes[1],
                       title=f"{task.eval_split} {task.metric}", ylabel=task.metric)
  rep.figure(fig, f"{task.name}_curves", f"{task.name}: learning curves (mean ± std over seeds)")
  if task.extra_report is not None and result.fits:
    task.extra_report(rep, result)

  if not result.comparisons or not verdict:
    return None
  scores = {w: result.metric(w) for w in result.comparisons}
  top = verdict_lib.best(scores, task.higher_is_better)
  c = result.comparisons[top]
  held = verdict_lib.claim([verdict_lib.part(c, "not worse")]).held
  rep.text(verdict_lib.Comparison.rule(task.margin, c.n, task.metric) + " "
           + verdict_lib.rule("claim") + " Here: the best alternative is not worse.")
  rep.verdict(held, f"on {task.name}, the best alternative is {c.sentence()}.")
  return held


def report_verdicts(rep: Report, result: TaskResult, num_seeds: int, reference: str,
                    label: str = "variant", metric: str | None = None) -> None:
  """One verdict per variant: each vs ``reference`` on the task's primary metric (``metric``:
  how the rule names it), with the rule and a table; a diverged variant did not reach it."""
  task = result.task
  rep.text(verdict_lib.Comparison.rule(task.margin, num_seeds, metric or task.metric))
  rep.table([c.row() for c in result.comparisons.values()],
            caption=f"Each {label} (A) vs {reference} (B), {metric or task.metric}")
  for c in result.comparisons.values():
    rep.verdict(c.not_worse, c.sentence() + ".")
  for name in result.failures:
    rep.verdict(False, f"{name} diverged (non-finite {task.metric}); it did not reach "
                       f"{reference}'s {task.metric}.")


def run_comparison(config: ml_collections.ConfigDict, workdir: str, *, title: str, claim: str,
                   tasks: Sequence[Task], variants: Sequence[Variant],
                   reference: str | None = None, intro: str = "",
                   label: str = "variant",
                   finish: Callable[[Report, dict[str, TaskResult]], Any] | None = None
                   ) -> dict[str, Any]:
  """Trains every variant on every task, compares with ``reference``, writes the report.

  ``label`` names the variants' column in tables (e.g. "weighting"). By default each task's
  verdict is the claim "the best alternative is not worse than the reference"; an experiment
  with another claim passes ``finish(report, {task: TaskResult})``, which adds its own
  figures, tables and verdict (by :mod:`attnx.train.verdict`) after the per-task sections, and
  whose return value is returned under "finish".

  Returns {"report": path, "final_metrics": {task: {variant: {metric: [per seed]}}},
  "tasks": {task: TaskResult}}.
  """
  rep = Report(title, workdir, config=config, claim=claim)
  if intro:
    rep.text(intro)
  final: dict[str, dict[str, dict[str, list]]] = {}
  summary: dict[str, dict[str, Any]] = {v.name: {label: v.name} for v in variants}
  results: dict[str, TaskResult] = {}
  for task in tasks:
    result = run_task(config, workdir, task, variants, reference)
    results[task.name] = result
    final[task.name] = {w: {k: np.asarray(x).tolist() for k, x in r.final_metrics.items()}
                        for w, r in result.fits.items()}
    report_task(rep, result, config, reference, label, verdict=finish is None)
    for v in variants:
      summary[v.name][task.name] = (mean_std(result.metric(v.name), ".4g")
                                    if v.name in result.fits else "diverged")
  if len(tasks) > 1:
    rep.section("Summary across tasks")
    rep.table(list(summary.values()), [label] + [t.name for t in tasks],
              caption="Primary metric per task, mean ± std over seeds")
  extra = finish(rep, results) if finish is not None else None
  if is_main_process():
    with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
      json.dump(final, f, indent=1)
  return {"report": rep.write(), "final_metrics": final, "tasks": results, "finish": extra}
