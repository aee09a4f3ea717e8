"""Is exp the only weighting F whose attention weights ignore a global score shift? (Alam et al.)

Claim (Alam et al.): global measurement noise adds about the same constant M to every
dot product x_i·x_j; the weights w_ij = F(s_ij)/Σ_l F(s_il) are unchanged by s -> s + M for all
M only if F(a+M)/F(a) = g(M) does not depend on a, whose only increasing solution is
F(a) = c·exp(αa). Hence softmax.

Tested at two levels:

(a) kernel level, for every registered pointwise weighting: max |w(s+M) − w(s)| over random
    score rows and a grid of M (float32), and the spread over a of F(a+M)/F(a);
(b) training level: a small attention classifier is trained on ``noisy_clusters`` with each F
    (same model, data, optimizer and budget for every F) and evaluated with a global noise
    component of growing size, shared by all tokens of a sample. Training goes through
    ``attnx.train.experiment`` (a Task with one Variant per F); the evaluation is the named
    evaluators ``accuracy_by_level`` and ``weight_tv_by_level`` (attnx.train.evaluators).

Two verdicts (attnx.train.verdict). (a) kind *claim* of *exact* parts: held iff the set of
invariant F equals the set with F(a+M)/F(a) constant in a (less softmax_plus_one-style
denominator offsets) and equals the exp family tested (softmax, exp, gaussian). (b) kind *all
or none*: held iff an exp-family F is among the dot-product F with the least weight change and
among the most accurate at every σ > 0 (ties: not shown worse by the *paired* rule); not held
if at no σ; inconclusive if mixed.

Command:
  python launch.py --config=experiments/shift_invariance.py:default --workdir=runs/shift_invariance
Expected runtime: default ≈ 45 s–2 min on 2 shared CPU cores (41 s measured; 72 s with other jobs
at a load of ≈ 7), tiny ≈ 30–60 s.
Expected result: (a) softmax/exp/gaussian invariant to f32 rounding (≲1e-6), every other F
not; F(a+M)/F(a) constant in a only for the exp family. (b) accuracy of non-exp F degrades
faster with the global-noise level; how much the trained models actually depend on this is
what (b) measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attnx import core, data, nn, train
from attnx.analysis import invariance
from attnx.train import config as train_config

# The exp family in F(s)/ΣF(s) form: the pointwise weightings that declare the shift_invariant
# trait (softmax, exp and gaussian). The functional equation says these, and only these, are
# invariant to a global score shift; (a) measures it.
EXP_FAMILY = invariance.exp_family()


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()  # seed, num_seeds, parallel, progress, ... (launch.py)
  c.update(dict(experiment="shift_invariance", seed=0, num_seeds=3))
  c.kernel = ml_collections.ConfigDict(dict(
      weightings=(),  # empty = every registered pointwise weighting
      shifts=(-5.0, -1.0, 0.5, 1.0, 5.0, 10.0),
      large_shift=100.0,  # beyond exp's float32 range (89) unless the row max is subtracted
      num_rows=512, num_keys=16,
      dim=8,  # dimension of the random points behind distance-kernel scores
      row_weightings=("sparsemax", "entmax15"), ratio_shifts=(0.5, 1.0, 2.0), ratio_grid=801))
  c.train = ml_collections.ConfigDict(dict(
      enabled=True, weightings=("softmax", "softmax_plus_one", "relu", "relu2", "softplus",
                                "sigmoid", "elu_plus_one", "taylor_exp"),
      distance_weighting="gaussian",  # trained with score neg_sq_dist (shift-free by design)
      num_classes=8, classes_per_sample=4, dim=16, num_objects=16, num_train=4096,
      within_class_spread=1.0, local_noise=0.5, train_global_noise=0.5,
      eval_global_noise=(0.0, 0.5, 1.0, 2.0, 4.0), hidden_dim=32, num_steps=400, batch_size=64,
      learning_rate=3e-3, num_eval=1024,
      margins=ml_collections.ConfigDict(dict(tv=0.01, accuracy=0.01))))  # verdict margins
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/shift_invariance.py:tiny (≈ 20–60 s): 32 score
  rows; softmax vs relu trained 20 steps on 256 samples, 2 seeds, σ ∈ {0, 2} (a smoke test:
  the training numbers mean little)."""
  c.num_seeds = 2
  c.kernel.update(num_rows=32, ratio_grid=101)
  c.train.update(dict(weightings=("softmax", "relu"), eval_global_noise=(0.0, 2.0),
                      distance_weighting="", num_steps=20, num_eval=128, num_train=256,
                      batch_size=32))


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS` (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "shift_invariance")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  pointwise = core.list_weightings("pointwise")
  names = [core.parse_weighting_name(w)[0] for w in config.kernel.weightings]
  train.check_choices(config, "kernel.weightings", names, pointwise)
  names = [core.parse_weighting_name(w)[0] for w in config.train.weightings]
  train.check_choices(config, "train.weightings", names, pointwise)
  if config.kernel.num_keys < 2:
    raise ValueError("config.kernel.num_keys must be ≥ 2.")
  if config.num_seeds < 1 or config.train.num_steps < 1:
    raise ValueError("config.num_seeds and config.train.num_steps must be ≥ 1.")
  if config.train.enabled:
    train.check_batch_size(config, "train.batch_size", config.train.num_train,
                           "noisy clusters (config.train.num_train)")


# ------------------------------------------------------------------------------------------
# (a) Kernel level: attnx.analysis.invariance measures, the claim is an exact one.
# ------------------------------------------------------------------------------------------

def _naive_exp(z: jax.Array) -> jax.Array:
  """exp without the row-max shift: the same F as softmax, computed the textbook way."""
  return jnp.exp(z)


def kernel_tables(config: ml_collections.ConfigDict) -> tuple[list[dict], list[dict]]:
  """max |w(s+M) − w(s)| per weighting (plus the naive exp and the row normalizers, which are
  not of the form F(s)/ΣF(s) but also shift invariant: the uniqueness is within that form)
  and the spread of F(a+M)/F(a) per pointwise weighting."""
  kc = config.kernel
  names = list(kc.weightings) or core.list_weightings("pointwise")
  specs = [(n, n) for n in names] + [("exp (naive callable, no max shift)", _naive_exp)] + [
      (f"{n} (row normalizer)", n) for n in kc.row_weightings]
  inv = invariance.shift_table(specs, shifts=kc.shifts, large_shift=kc.large_shift,
                               num_rows=kc.num_rows, num_keys=kc.num_keys, dim=kc.dim,
                               seed=config.seed)
  return inv, invariance.functional_equation_table(
      names, ratio_shifts=kc.ratio_shifts, grid=kc.ratio_grid, num_keys=kc.num_keys)


def kernel_level(rep: train.Report, config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Section (a): tables, notes and verdict (attnx.analysis.invariance.report_kernel_level)."""
  kc = config.kernel
  inv, fe = kernel_tables(config)
  ks = invariance.report_kernel_level(rep, inv, fe, num_rows=kc.num_rows, num_keys=kc.num_keys,
                                      shifts=kc.shifts, large_shift=kc.large_shift)
  return {"kernel_invariance": inv, "functional_equation": fe, "kernel_summary": ks,
          "kernel_level_held": ks["held"]}


# ------------------------------------------------------------------------------------------
# (b) Training level: attnx.nn.SimilarityAveraging on attnx.data's noisy_clusters.
# ------------------------------------------------------------------------------------------

def _cluster_params(tc: ml_collections.ConfigDict) -> dict[str, Any]:
  return dict(num_classes=tc.num_classes, dim=tc.dim, num_objects=tc.num_objects,
              within_class_spread=tc.within_class_spread, local_noise=tc.local_noise,
              classes_per_sample=tc.classes_per_sample)


def _variants(tc: ml_collections.ConfigDict) -> list[Any]:
  """One variant per F (spec: (weighting, score)); the distance weighting on −‖q − k‖²."""
  from attnx.train.experiment import Variant

  out = [Variant(w, (w, "dot")) for w in tc.weightings]
  if tc.distance_weighting:
    out.append(Variant(f"{tc.distance_weighting} (neg_sq_dist)",
                       (tc.distance_weighting, "neg_sq_dist")))
  return out


def _budget(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config with config.train's budget at the top level (experiment.with_budget); the
  evaluators run once, on the final parameters."""
  tc = config.train
  return train.experiment.with_budget(
      config, num_steps=tc.num_steps, batch_size=tc.batch_size,
      optimizer=train.optimizer_config(name="adam", learning_rate=tc.learning_rate,
                                       schedule="constant", weight_decay=0.0),
      log_every=max(tc.num_steps // 20, 1), eval_every=0, tensorboard=False)


def noisy_task(config: ml_collections.ConfigDict) -> tuple[Any, dict[str, dict[str, np.ndarray]]]:
  """The training task and its arrays: train on noisy clusters with global noise
  ``train_global_noise``; evaluate with ``accuracy_by_level`` and ``weight_tv_by_level`` on
  fresh samples at every σ of ``eval_global_noise`` (attnx.data.load_by_level:
  same clean objects and direction g at every σ, only its size changes)."""
  tc = config.train
  sigmas = [float(x) for x in tc.eval_global_noise]
  arrays = data.load_by_level(
      "noisy_clusters", "global_noise", sigmas, train_level=tc.train_global_noise,
      num_train=tc.num_train, num_test=tc.num_eval, seed=config.seed, **_cluster_params(tc))
  task = train.experiment.Task(
      name="noisy_clusters", dataset="noisy_clusters", metric="accuracy_by_level",
      build_model=lambda spec: nn.SimilarityAveraging(
          num_classes=tc.num_classes, weighting=spec[0], score=spec[1], hidden_dim=tc.hidden_dim),
      evaluators=("accuracy_by_level", "weight_tv_by_level"),
      eval_options={"levels": sigmas, "weight_examples": 256}, margin=float(tc.margins.accuracy),
      description="noisy clusters, evaluated under growing global noise σ")
  return task, arrays


def training_level(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains one classifier per F (attnx.train.experiment.run_task); per F and σ the per-seed
  accuracy and weight change (TV) of the task's evaluators."""
  task, arrays = noisy_task(config)
  variants = _variants(config.train)
  result = train.experiment.run_task(_budget(config), workdir, task, variants, None, arrays)
  if result.failures:
    raise train.NonFiniteLossError("; ".join(result.failures.values()))
  sigmas = list(config.train.eval_global_noise)
  by_level = lambda fit, key: {x: fit.final_metrics[key][:, i] for i, x in enumerate(sigmas)}
  fits = result.fits
  return {"accuracy": {k: by_level(f, "accuracy_by_level") for k, f in fits.items()},
          "weight_tv": {k: by_level(f, "weight_tv_by_level") for k, f in fits.items()},
          "histories": {k: f.history for k, f in fits.items()},
          "seconds": {k: f.seconds_per_step * config.train.num_steps for k, f in fits.items()},
          "scores": {v.name: v.spec[1] for v in variants}}


def _training_report(rep: train.Report, config: ml_collections.ConfigDict,
                     tr: dict[str, Any]) -> dict[str, Any]:
  """Section (b): the setup, then attnx.analysis.invariance.report_training_level."""
  tc = config.train
  sigmas = list(tc.eval_global_noise)
  shift = {s: s * s * tc.dim for s in sigmas}
  dist = [lab for lab in tr["accuracy"] if tr["scores"][lab] == "neg_sq_dist"]
  rep.text(
      f"Data: `noisy_clusters` ({tc.num_classes} classes, {tc.classes_per_sample} per sample, "
      f"dim {tc.dim}, {tc.num_objects} objects, within-class spread {tc.within_class_spread}, "
      f"local noise {tc.local_noise}); classify every object. Training: {tc.num_train} samples "
      f"with global noise {tc.train_global_noise}; evaluation: {tc.num_eval} fresh samples "
      "whose global component g (one N(0, σ²I) vector per sample, added to all objects) grows; "
      "same clean objects and same direction of g at every σ. Model (identical for every F): "
      "y_i = Σ_j w_ij x_j with learned temperature β, then a per-object MLP; F applied to "
      "β x_i·x_j" + (f", except {', '.join(dist)}, which gets −β‖x_i − x_j‖²" if dist else "")
      + " (`power` is relu2 at its default p = 2; boxcar/triangular/epanechnikov are "
      "compact-support distance kernels, left out); Adam, lr "
      f"{tc.learning_rate}, {tc.num_steps} steps, batch {tc.batch_size}, seeds "
      f"{config.seed}..{config.seed + config.num_seeds - 1} (mean ± std). The expected dot-product "
      "shift is M = σ²·dim: " + ", ".join(f"σ={s:g}→M={shift[s]:g}" for s in sigmas) + ".")
  return invariance.report_training_level(rep, tr, sigmas, margins=dict(tc.margins),
                                         num_seeds=config.num_seeds, dim=tc.dim)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs both levels, writes ``workdir/report.md`` and returns the numbers."""
  validate_config(config)
  t0 = time.time()
  rep = train.Report(
      "Shift invariance of attention weightings (Alam et al.)", workdir, config=config,
      claim="Adding the same constant M to every score leaves w = F(s)/ΣF(s) unchanged for "
            "all M only for F(a) = c·exp(αa); hence softmax is the right weighting under "
            "global noise.")
  rep.section("(a) Kernel level")
  results = kernel_level(rep, config)
  if config.train.enabled:
    rep.section("(b) Training level")
    tr = training_level(config, workdir)
    summary = _training_report(rep, config, tr)
    results["training"] = {"accuracy": tr["accuracy"], "weight_tv": tr["weight_tv"],
                           "seconds": tr["seconds"], **summary}
    results["training_verdict"] = summary["held"]
  # The claim itself is the kernel-level statement; the training level is its consequence.
  results["verdict"] = results["kernel_level_held"]
  results["seconds"] = time.time() - t0
  results["report"] = rep.write()
  rep.save_json("shift_invariance.json", results)
  return results
