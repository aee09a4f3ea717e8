"""Metric-attention vs standard self-attention (Ruan & Zhang, "Towards understanding how
attention mechanism works in deep learning", arXiv 2412.18288).

Claim: attention decomposes into a learnable pseudo-metric and a similarity-based
propagation; "metric-attention", which learns the pseudo-metric explicitly, has better
training efficiency, accuracy and robustness than standard self-attention.

The paper's exact parametrization is not public; attnx.nn.MetricAttention implements the idea
as a learned Mahalanobis pseudo-metric per head, s_ij = −τ_h‖L_h(x_i − x_j)‖², so this tests
that version, not a reproduction. Both variants run in the same VisionTransformer (same width,
depth, heads, optimizer, steps and seeds); only the attention module differs.

Measured on ``digits`` (and on catalog image datasets such as mnist when prepared locally;
skipped with a note otherwise), one ``Task`` per dataset (attnx.train.experiment): final test
accuracy, the steps until test accuracy first reaches a target (efficiency,
attnx.train.benchmark.steps_to_target), and the accuracy drop from clean images to the largest
level of Gaussian pixel noise (robustness; the ``"noisy_accuracy"`` evaluator) — not the noisy
accuracy, which would reward a variant for its clean accuracy alone. Verdict (attnx.train.verdict):
each variant vs the baseline by the *paired* rule, combined per claim and over the three claims
by the kind *unanimous* (better only if better on every one, worse if worse on any).

Presets (the default changed by one small function each, see PRESET_FNS), run as
``python launch.py --config=experiments/metric_attention.py:PRESET --workdir=runs/ma``:
  default  digits (mnist when prepared locally), 3 seeds, 600 steps. Measured on 2 shared CPU
           cores (digits only): 46 s quiet, 75–96 s at a load average of ≈ 5.
  tiny     digits, 2 seeds, 1 layer, 20 steps, noise σ ∈ {0, 0.3}: a smoke test (28–30 s
           measured at load ≈ 5; accuracy 0.36–0.53, claims inconclusive / within noise).
Expected result: unknown a priori — this is the test (default, digits: metric attention 0.904
vs softmax 0.929 accuracy, 358 vs 225 steps to 0.9, the same accuracy drop under pixel noise).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import ml_collections
import numpy as np

from attnx import data, nn, train
from attnx.train import config as train_config
from attnx.train import experiment
from attnx.train.benchmark import format_steps, steps_to_target

PRESETS = ("default", "tiny")
# Patch sizes giving 16 tokens per image for the datasets we know.
_PATCH = {"digits": 2, "mnist": 7, "fashion_mnist": 7, "cifar10": 8}


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()  # seed, num_seeds, parallel, progress, ... (launch.py)
  c.experiment = "metric_attention"
  c.seed = 3
  c.num_seeds = 3
  c.variants = ("softmax", "metric")  # attnx.nn.attention_spec names; the first is the baseline
  c.datasets = ("digits", "mnist")  # catalog sets are skipped when not prepared
  c.max_train_examples = 10000  # caps catalog datasets on CPU
  c.max_test_examples = 2000
  c.hidden_dim = 32
  c.num_layers = 2
  c.num_heads = 4
  c.mlp_dim = 64
  c.batch_size = 64
  c.num_steps = 600
  c.learning_rate = 2e-3
  c.eval_every = 25
  c.target_accuracy = 0.9
  # Verdict margins (attnx.train.verdict): accuracy (and accuracy drop) differences below 0.01,
  # and step counts below 5 % of the budget, count as equal.
  c.margins = ml_collections.ConfigDict(dict(accuracy=0.01, steps_fraction=0.05))
  c.noise_levels = (0.0, 0.1, 0.2, 0.3, 0.5)  # std of Gaussian pixel noise (pixels in [0, 1])
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  c.update(dict(num_seeds=2, datasets=("digits",), num_layers=1, num_steps=20, eval_every=10,
                target_accuracy=0.2, noise_levels=(0.0, 0.3)))


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS = {"default": lambda c: None, "tiny": _tiny}
assert tuple(PRESET_FNS) == PRESETS


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "metric_attention")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  train.attention_variants(config, "variants")
  if len(config.variants) < 2:
    raise ValueError("config.variants needs at least two variants to compare.")
  train.check_choices(config, "datasets", list(config.datasets), tuple(_PATCH))
  if not 0 < config.target_accuracy <= 1:
    raise ValueError("config.target_accuracy must be in (0, 1].")
  if min(config.noise_levels) < 0:
    raise ValueError("config.noise_levels must be ≥ 0.")
  for name in config.datasets:  # catalog sets: their standard size unless prepared otherwise
    n = data.get_info(name).splits["train"]
    capped = config.max_train_examples < n
    train.check_batch_size(config, "batch_size", min(n, config.max_train_examples),
                           f"{name!r}{' (config.max_train_examples)' if capped else ''}")


def make_task(name: str, config) -> experiment.Task:
  """One dataset's task: the ViT, test accuracy (curve: first 1000 test images every
  ``eval_every`` steps) and ``"noisy_accuracy"`` (one N(0, σ²) pixel-noise draw, from
  config.seed, for every model)."""
  num_classes = data.get_info(name).num_classes
  return experiment.Task(
      name=name, dataset=name, metric="accuracy", margin=config.margins.accuracy,
      evaluators=("accuracy", "noisy_accuracy"), curve_evaluators=("accuracy",),
      curve_limit=1000, train_limit=config.max_train_examples,
      eval_limit=config.max_test_examples, prepare=experiment.images_to_unit_floats,
      eval_options=dict(noise_levels=tuple(config.noise_levels), noise_seed=config.seed),
      fit_options=dict(optimizer=train.optimizer_config(
                           learning_rate=config.learning_rate,
                           warmup_steps=max(config.num_steps // 20, 1)),
                       log_every=config.eval_every, tensorboard=False),
      build_model=lambda att: nn.VisionTransformer(
          num_classes=num_classes, patch_size=_PATCH[name], hidden_dim=config.hidden_dim,
          num_layers=config.num_layers, num_heads=config.num_heads, mlp_dim=config.mlp_dim,
          attention=att))


def run_dataset(task: experiment.Task, arrays: dict, config, workdir: str) -> dict[str, Any]:
  """Trains every variant on one dataset (experiment.run_task); per-variant metrics."""
  variants = [experiment.Variant(v, nn.attention_spec(v)) for v in config.variants]
  result = experiment.run_task(config, workdir, task, variants, config.variants[0], arrays)
  if result.failures:
    raise train.NonFiniteLossError("; ".join(result.failures.values()))
  out: dict[str, Any] = {}
  for variant, fit in result.fits.items():
    scores = fit.final_metrics["noisy_accuracy"]
    num_params = sum(x.size for x in jax.tree.leaves(fit.params)) // config.num_seeds
    out[variant] = {"history": fit.history,
                    "accuracy": np.asarray(fit.final_metrics["accuracy"]),
                    "noisy": {s: scores[:, i] for i, s in enumerate(config.noise_levels)},
                    "steps_to_target": steps_to_target(fit.history, config.target_accuracy,
                                                       config.num_seeds),
                    "train_loss": np.asarray(fit.final_metrics["train_loss"]),
                    "ms_per_step": 1e3 * fit.seconds_per_step, "num_params": int(num_params)}
  return out


def accuracy_drop(r: dict[str, Any], sigma: float) -> np.ndarray:
  """Per seed, clean test accuracy minus test accuracy at noise level ``sigma``."""
  return np.asarray(r["accuracy"]) - np.asarray(r["noisy"][sigma])


def report_dataset(rep: train.Report, name: str, res: dict[str, Any], arrays: dict,
                   config: ml_collections.ConfigDict) -> None:
  """One dataset's tables (results; accuracy per noise level) and figure (curves)."""
  hi = max(config.noise_levels)
  rows = []
  for v, r in res.items():
    rows.append({"variant": v, "test accuracy": r["accuracy"],
                 f"steps to {config.target_accuracy:g}": format_steps(r["steps_to_target"]),
                 f"accuracy at noise σ={hi:g}": r["noisy"][hi],
                 "accuracy drop": accuracy_drop(r, hi),
                 "mean accuracy over σ>0": np.mean(
                     [r["noisy"][x] for x in config.noise_levels if x > 0] or [np.nan], 0),
                 "train loss": r["train_loss"], "params": r["num_params"],
                 "ms/step": r["ms_per_step"]})
  rep.text(f"{len(arrays['train']['targets'])} training / {len(arrays['eval']['targets'])} "
           "test images.")
  rep.table(rows, caption=f"{name}: mean ± std over {config.num_seeds} seeds; accuracy drop "
            f"= test accuracy − accuracy at σ={hi:g} (per seed; smaller = more robust)")
  noisy = {v: r["noisy"] for v, r in res.items()}
  rep.table(train.level_rows(noisy, config.noise_levels),
            caption="test accuracy under Gaussian pixel noise")
  fig, axes = train.subplots(2, size=(5, 3.8))
  train.plot_learning_curves({v: r["history"] for v, r in res.items()}, "eval_accuracy",
                             ax=axes[0], ylabel="test accuracy")
  axes[0].axhline(config.target_accuracy, color="gray", ls=":", lw=1)
  train.plot_curves(train.level_curves(noisy, config.noise_levels), xlabel="noise σ",
                    ylabel="test accuracy", band="errorbar", ax=axes[1])
  rep.figure(fig, f"{name}_curves", f"{name}: test accuracy during training (left) and "
             "under input noise (right), mean ± std over seeds.")


def dataset_outcomes(res: dict[str, Any], config: ml_collections.ConfigDict
                     ) -> dict[str, list[str]]:
  """{claim: outcomes} of every non-baseline variant vs the baseline on one dataset, by the
  *paired* rule (higher is better): accuracy, efficiency (fewer steps to the target; never
  reaching it counts as the full budget + 1) and robustness (a smaller accuracy drop at the
  largest noise level; untested without noise)."""
  base, hi, mg = config.variants[0], max(config.noise_levels), config.margins
  fill = lambda x: np.where(np.isfinite(x), x, config.num_steps + 1)
  outcome = lambda a, b, margin: train.verdict.compare(a, b, margin=margin).outcome
  out: dict[str, list[str]] = {"accuracy": [], "efficiency": [], "robustness": []}
  for v in config.variants[1:]:
    a, b = res[v], res[base]
    out["accuracy"].append(outcome(a["accuracy"], b["accuracy"], mg.accuracy))
    out["efficiency"].append(outcome(-fill(a["steps_to_target"]), -fill(b["steps_to_target"]),
                                     mg.steps_fraction * config.num_steps))
    if hi > 0:  # robustness = a smaller drop; the noisy accuracy alone mixes in clean accuracy
      out["robustness"].append(outcome(-accuracy_drop(a, hi), -accuracy_drop(b, hi),
                                       mg.accuracy))
  return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains all variants on all available datasets, writes the report, returns the numbers."""
  validate_config(config)
  t0 = time.time()
  rep = train.Report(
      "Metric-attention vs standard self-attention (Ruan & Zhang)", workdir, config=config,
      claim="Metric-attention (a learned pseudo-metric as the score) trains more efficiently, "
            "reaches higher accuracy and is more robust to input noise than standard "
            "self-attention.")
  rep.text(f"Same VisionTransformer for every variant ({config.num_layers} layers, width "
           f"{config.hidden_dim}, {config.num_heads} heads, MLP {config.mlp_dim}, 16 patch "
           f"tokens + CLS); AdamW lr {config.learning_rate} warmup-cosine, batch "
           f"{config.batch_size}, {config.num_steps} steps, seeds {config.seed}.."
           f"{config.seed + config.num_seeds - 1}. Variants: "
           + ", ".join(f"`{v}` = {nn.attention_spec(v)}" for v in config.variants)
           + ". Steps-to-target uses the test accuracy evaluated every "
           f"{config.eval_every} steps (first 1000 test images).")
  results: dict[str, Any] = {"datasets": {}, "skipped": {}}
  claims: dict[str, list[str]] = {"accuracy": [], "efficiency": [], "robustness": []}
  for name in config.datasets:
    task = make_task(name, config)
    rep.section(f"Dataset: {name}")
    try:
      arrays = experiment.load_task_arrays(task)
    except data.DatasetNotFoundError as e:
      reason = str(e).splitlines()[0]
      rep.text(f"Skipped: `{name}` is not available offline here ({reason}).")
      results["skipped"][name] = reason
      continue
    res = run_dataset(task, arrays, config, workdir)
    report_dataset(rep, name, res, arrays, config)
    for k, outcomes in dataset_outcomes(res, config).items():
      claims[k].extend(outcomes)
    results["datasets"][name] = {
        v: {"accuracy": r["accuracy"], "noisy": r["noisy"], "steps_to_target":
            r["steps_to_target"], "ms_per_step": r["ms_per_step"]} for v, r in res.items()}
  results["claims"] = verdicts = {k: train.verdict.unanimous(v) for k, v in claims.items()}
  results["verdict"] = held = train.verdict.unanimous_held(verdicts)
  rep.text(train.verdict.rule("unanimous"))
  rep.verdict(held, f"Metric-attention against {config.variants[0]}: "
              + "; ".join(f"{k}: {o}" for k, o in verdicts.items())
              + ". " + train.verdict.Comparison.rule(config.margins.accuracy, config.num_seeds)
              + " Margins: accuracy and accuracy drop "
              f"±{config.margins.accuracy:g}, steps to target "
              f"±{config.margins.steps_fraction:g} of the budget (accuracy: "
              "final test accuracy; efficiency: steps to the target accuracy; robustness: the "
              "accuracy drop from clean inputs to the largest noise level "
              f"σ={max(config.noise_levels):g}, smaller is better — a variant near chance "
              "accuracy has little to lose, so read it with the clean accuracy). This tests "
              "attnx's metric-attention (learned Mahalanobis pseudo-metric), not the paper's "
              "unpublished code, on small CPU-sized models.")
  results["seconds"] = time.time() - t0
  results["report"] = rep.write()
  rep.save_json("metric_attention.json", results)
  return results
