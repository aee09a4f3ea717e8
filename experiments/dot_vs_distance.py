"""Attention from a distance vs from a dot product (Alam et al.; Martínez-Ramón et al.'s slides).

Claim (Martínez-Ramón, Ajith & Kurup's slides, eq. 6–7; Alam et al., section 1):
−‖q − k‖² = 2 q·k − ‖q‖² − ‖k‖², so if the key
norms are about constant, a weighting of the negative squared distance equals a weighting of
2 q·k plus a per-query constant, which softmax ignores: distance attention and dot-product
attention coincide. (The slides write "‖q‖² − ‖k‖² + 2qᵀk"; the sign of ‖q‖² is a typo, and
the factor 2 is a temperature.)

Tested at two levels:

(a) kernel level: softmax(−‖q−k‖²) vs softmax(2 q·k) and softmax(q·k) for keys with constant
    norm, with growing key-norm spread, and for a non-exp F (for which the per-query constant
    does not cancel: Alam et al.'s point);
(b) training level: the same small ViT on ``digits`` with score ``scaled_dot`` (q·k/√H) or
    ``neg_sq_dist`` scaled by 1/(2√H) (= q·k/√H − (‖q‖² + ‖k‖²)/(2√H)), with and without
    normalized queries/keys (``qk_norm``: LayerNorm, which makes every norm √H at init), over
    seeds; same hyper-parameters and budget for all four. One ``attnx.train.experiment``
    Task per qk_norm setting (run_task: evaluators accuracy and loss; neg_sq_dist compared
    with scaled_dot by the shared verdict rule).

Command:
  python launch.py --config=experiments/dot_vs_distance.py:default --workdir=runs/dot_vs_distance
Expected runtime: default ≈ 1.5–3 min on 2 shared CPU cores (92 s measured; 177 s with other jobs
at a load of ≈ 7), tiny ≈ 60 s.
Expected result: (a) identical weights (≲1e-6) for constant key norms with the factor 2,
diverging smoothly as the norms spread; not identical for non-exp F. (b) with qk_norm the two
scores train alike; without it they differ by the learned key-norm bias. The verdict holds only
if every kernel-level statement that was measured holds (see kernel_summary); the training
gaps are reported with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from attnx import core, data, nn, train  # noqa: E402
from attnx.train import config as train_config  # noqa: E402
from experiments import _common  # noqa: E402

SCORES = ("scaled_dot", "neg_sq_dist")


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()  # seed, num_seeds, parallel, progress, ... (launch.py)
  c.experiment = "dot_vs_distance"
  c.seed = 0

  k = c.kernel = ml_collections.ConfigDict()
  k.num_queries = 64
  k.num_keys = 32
  k.dim = 16
  k.norm_spreads = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)  # relative std of the key norms
  k.other_weightings = ("taylor_exp", "sigmoid")

  c.num_seeds = 3
  t = c.train = ml_collections.ConfigDict()
  t.enabled = True
  t.dataset = "digits"
  t.scores = SCORES
  t.qk_norm = (False, True)
  t.margin = 0.01  # verdict margin: accuracy differences below it count as equal
  t.patch_size = 2
  t.hidden_dim = 32
  t.num_layers = 2
  t.num_heads = 4
  t.mlp_dim = 64
  t.batch_size = 64
  t.num_steps = 600
  t.learning_rate = 2e-3
  t.eval_every = 100
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/dot_vs_distance.py:tiny (≈ 30–60 s): 16 queries,
  two norm spreads; the two scores without qk_norm, 1 layer, 20 steps, 2 seeds (a smoke
  test: the training numbers mean little)."""
  c.num_seeds = 2
  c.kernel.update(dict(num_queries=16, norm_spreads=(0.0, 0.3)))
  c.train.update(dict(qk_norm=(False,), num_layers=1, num_steps=20, eval_every=10))


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS` (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "dot_vs_distance")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  _common.check_choices(config, "train.scores", list(config.train.scores), SCORES)
  _common.check_choices(config, "train.qk_norm", list(config.train.qk_norm), (False, True))
  names = [core.parse_weighting_name(w)[0] for w in config.kernel.other_weightings]
  _common.check_choices(config, "kernel.other_weightings", names,
                        core.list_weightings("pointwise"))
  if min(config.kernel.norm_spreads) < 0:
    raise ValueError("config.kernel.norm_spreads must be ≥ 0.")
  if config.train.enabled:
    info = data.get_info(config.train.dataset)
    train.check_batch_size(config, "train.batch_size", info.splits["train"],
                           f"{config.train.dataset!r}")


# ------------------------------------------------------------------------------------------
# (a) Kernel level.
# ------------------------------------------------------------------------------------------

def _qk(config, spread: float, key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Queries ~ N(0, I/D); keys with norm r_j = 1 + spread·z_j (z ~ N(0,1)), random direction."""
  kc = config.kernel
  k1, k2, k3 = jax.random.split(key, 3)
  q = jax.random.normal(k1, (kc.num_queries, kc.dim)) * 2.0 / np.sqrt(kc.dim)
  u = jax.random.normal(k2, (kc.num_keys, kc.dim))
  u = u / jnp.linalg.norm(u, axis=-1, keepdims=True)
  r = jnp.abs(1.0 + spread * jax.random.normal(k3, (kc.num_keys, 1)))
  return q, 2.0 * r * u


def _weights(q, k, weighting: str, score: str, scale: float = 1.0) -> jax.Array:
  # core layout: [T, N, H] with one head.
  return core.attention_weights(q[:, None, :], k[:, None, :], weighting=weighting,
                                score=score, scale=scale)[0]


def _compare(wa, wb) -> dict[str, float]:
  return {"max abs diff": float(jnp.max(jnp.abs(wa - wb))),
          "mean TV": float(0.5 * jnp.mean(jnp.sum(jnp.abs(wa - wb), -1))),
          "argmax agreement": float(jnp.mean(jnp.argmax(wa, -1) == jnp.argmax(wb, -1)))}


def kernel_level(config: ml_collections.ConfigDict) -> list[dict]:
  """Distance-based vs dot-based weights for growing key-norm spread and several F."""
  rows = []
  key = jax.random.PRNGKey(config.seed)
  for spread in config.kernel.norm_spreads:
    q, k = _qk(config, spread, key)
    w_dist = _weights(q, k, "softmax", "neg_sq_dist")
    for label, scale in (("softmax(2 q·k)", 2.0), ("softmax(q·k)", 1.0)):
      rows.append({"key-norm spread": spread, "F": "softmax",
                   "distance weights vs": label,
                   **_compare(w_dist, _weights(q, k, "softmax", "dot", scale))})
    for f in config.kernel.other_weightings:
      # F(−‖q−k‖²) vs F(2q·k − ‖k‖² − ‖q‖²) is the same thing; F(2 q·k) drops the constants.
      rows.append({"key-norm spread": spread, "F": f, "distance weights vs": f"{f}(2 q·k)",
                   **_compare(_weights(q, k, f, "neg_sq_dist"), _weights(q, k, f, "dot", 2.0))})
  return rows


def kernel_summary(rows: list[dict], tol: float = 1e-5, differ: float = 1e-3) -> dict[str, Any]:
  """The three kernel-level statements, each from the measured rows (None: not measured).

  exact: softmax(−‖q−k‖²) == softmax(2 q·k) to ``tol`` at key-norm spread 0. grows: the mean
  TV between them does not decrease as the spread grows (float32 slack ``tol``) and exceeds
  ``differ`` at the largest spread. non_exp_differ: every non-exp F differs by more than
  ``differ`` at spread 0. held: all of those that were measured hold (None without ``exact``).
  """
  pair = sorted((r for r in rows if r["F"] == "softmax"
                 and r["distance weights vs"] == "softmax(2 q·k)"),
                key=lambda r: r["key-norm spread"])
  at0 = [r for r in pair if r["key-norm spread"] == 0.0]
  exact_diff = at0[0]["max abs diff"] if at0 else None
  exact = None if exact_diff is None else bool(exact_diff < tol)
  tv = [(r["key-norm spread"], r["mean TV"]) for r in pair]
  grows = None
  if len(tv) >= 2:
    steady = all(b >= a - tol for (_, a), (_, b) in zip(tv, tv[1:], strict=False))
    grows = bool(steady and tv[-1][1] > differ)
  other = {r["F"]: r["max abs diff"] for r in rows
           if r["key-norm spread"] == 0.0 and r["F"] != "softmax"}
  non_exp_differ = bool(all(d > differ for d in other.values())) if other else None
  parts = [x for x in (grows, non_exp_differ) if x is not None]
  held = None if exact is None else bool(exact and all(parts))
  return {"exact": exact, "exact_diff": exact_diff, "tv_vs_spread": tv, "grows": grows,
          "non_exp_diff_at_constant_norm": other, "non_exp_differ": non_exp_differ,
          "held": held}


def _kernel_text(ks: dict[str, Any]) -> str:
  if ks["exact"] is None:
    out = ["Spread 0 was not measured, so the identity at constant key norms is untested."]
  elif ks["exact"]:
    out = ["With constant key norms softmax(−‖q−k‖²) equals softmax(2 q·k) to float32 "
           f"rounding (max diff {ks['exact_diff']:.1e})."]
  else:
    out = ["With constant key norms softmax(−‖q−k‖²) and softmax(2 q·k) differ (max diff "
           f"{ks['exact_diff']:.1e}): the identity did not hold numerically."]
  tv = ", ".join(f"{s:g}: {t:.2g}" for s, t in ks["tv_vs_spread"])
  if ks["grows"] is None:
    out.append("Only one key-norm spread was measured, so the growth with spread is untested.")
  elif ks["grows"]:
    out.append(f"Their mean TV distance grows with the key-norm spread ({tv}).")
  else:
    out.append(f"Their mean TV distance does not grow steadily with the spread ({tv}).")
  other = ks["non_exp_diff_at_constant_norm"]
  if other:
    diffs = ", ".join(f"{f}: {d:.3f}" for f, d in other.items())
    out.append("For non-exp F the per-query constant −‖q‖² − ‖k‖² does not cancel, so the "
               f"two forms differ even at constant norm (max diff {diffs})."
               if ks["non_exp_differ"] else
               f"Not every non-exp F differs at constant norm (max diff {diffs}).")
  return " ".join(out)


def plot_kernel(rows: list[dict]) -> plt.Figure:
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  labels = sorted({(r["F"], r["distance weights vs"]) for r in rows})
  for f, vs in labels:
    pts = [(r["key-norm spread"], r["mean TV"]) for r in rows
           if r["F"] == f and r["distance weights vs"] == vs]
    x, y = zip(*pts, strict=True)
    ax.plot(np.maximum(x, 1e-3), np.maximum(y, 1e-9), "o-", label=f"{f}(−d²) vs {vs}")
  ax.set_xscale("log"), ax.set_yscale("log")
  ax.set_xlabel("relative key-norm spread (0 plotted at 1e-3)")
  ax.set_ylabel("mean TV distance of weight rows")
  ax.legend(fontsize=7), ax.grid(alpha=0.3)
  return fig


# ------------------------------------------------------------------------------------------
# (b) Training level.
# ------------------------------------------------------------------------------------------

def _variants(tc) -> list[tuple[str, dict[str, Any]]]:
  out = []
  for qk_norm in tc.qk_norm:
    for score in tc.scores:
      spec: dict[str, Any] = {"type": "dot", "weighting": "softmax", "score": score,
                              "qk_norm": bool(qk_norm)}
      if score == "neg_sq_dist":
        head_dim = tc.hidden_dim // tc.num_heads
        spec["scale"] = 1.0 / (2.0 * np.sqrt(head_dim))  # = scaled_dot − norm terms
      rows_label = f"{score}{' + qk_norm' if qk_norm else ''}"
      out.append((rows_label, spec))
  return out


def _budget(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config with config.train's budget at the top level, where
  :mod:`attnx.train.experiment` (``FitConfig.from_config``) reads it."""
  tc = config.train
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.num_steps = tc.num_steps
    c.batch_size = tc.batch_size
    c.optimizer = train.optimizer_config(learning_rate=tc.learning_rate,
                                         warmup_steps=max(tc.num_steps // 20, 1))
    c.eval_every = tc.eval_every
    c.log_every = tc.eval_every
    c.tensorboard = False
  return c


def training_tasks(config: ml_collections.ConfigDict) -> list[tuple[bool, Any, list[Any], str]]:
  """(qk_norm, task, variants, reference) per qk_norm setting: the same ViT on
  ``train.dataset`` with each score; the reference is scaled_dot at that qk_norm."""
  from attnx.train.experiment import Task, Variant

  tc = config.train
  info = data.get_info(tc.dataset)
  out = []
  for qk in tc.qk_norm:
    suffix = " + qk_norm" if qk else ""
    task = Task(name=f"{tc.dataset}{'-qk_norm' if qk else ''}", dataset=tc.dataset,
                metric="accuracy", margin=float(tc.margin), evaluators=("accuracy", "loss"),
                build_model=lambda spec: nn.VisionTransformer(
                    num_classes=info.num_classes, patch_size=tc.patch_size,
                    hidden_dim=tc.hidden_dim, num_layers=tc.num_layers,
                    num_heads=tc.num_heads, mlp_dim=tc.mlp_dim, attention=spec))
    variants = [Variant(label, spec) for label, spec in _variants(tc)
                if spec["qk_norm"] == bool(qk)]
    out.append((qk, task, variants, f"scaled_dot{suffix}"))
  return out


def training_level(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains every (score, qk_norm) variant with attnx.train.experiment.run_task and compares
  neg_sq_dist with scaled_dot at each qk_norm by the shared verdict rule."""
  from attnx.train.experiment import run_task

  budget = _budget(config)
  out: dict[str, Any] = {"final": {}, "histories": {}, "seconds_per_step": {},
                         "comparisons": {}}
  for qk, task, variants, reference in training_tasks(config):
    result = run_task(budget, workdir, task, variants, reference)
    for label, fit in result.fits.items():
      out["final"][label] = {k: np.asarray(v) for k, v in fit.final_metrics.items()}
      out["histories"][label] = fit.history
      out["seconds_per_step"][label] = fit.seconds_per_step
    for c in result.comparisons.values():  # neg_sq_dist vs scaled_dot
      out["comparisons"][f"qk_norm={qk}"] = c
  return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs both levels, writes ``workdir/report.md`` and returns the numbers."""
  validate_config(config)
  t0 = time.time()
  rep = train.Report(
      "Distance vs dot-product attention (Alam et al.; Martínez-Ramón, Ajith & Kurup)",
      workdir, config=config,
      claim="−‖q−k‖² = 2q·k − ‖q‖² − ‖k‖²: with constant key norms, softmax of the negative "
            "squared distance equals softmax of 2q·k, so distance and dot-product attention "
            "coincide.")
  results: dict[str, Any] = {}
  rep.section("(a) Kernel level")
  kc = config.kernel
  rows = kernel_level(config)
  results["kernel"] = rows
  rep.text(f"{kc.num_queries} queries and {kc.num_keys} keys in {kc.dim} dimensions; key "
           "norms r_j = |1 + spread·z_j|. Compared: the weights from −‖q−k‖² against those "
           "from 2q·k (the identity's prediction) and from q·k (forgetting the factor 2).")
  rep.table(rows, caption="distance-based vs dot-based weights (float32)")
  rep.figure(plot_kernel(rows), "kernel_tv_vs_norm_spread",
             "How far distance attention drifts from dot-product attention as key norms spread.")
  ks = kernel_summary(rows)
  results["kernel_summary"] = ks
  results["kernel_exact_at_constant_norm"] = ks["exact_diff"]
  notes = []
  at0 = {r["distance weights vs"]: r for r in rows if r["key-norm spread"] == 0.0}
  if "softmax(q·k)" in at0:
    notes.append("Without the factor 2 (against softmax(q·k)) the max diff at constant norm "
                 f"is {at0['softmax(q·k)']['max abs diff']:.3f}: the 2 is a temperature.")
  taylor = at0.get("taylor_exp(2 q·k)")
  if taylor is not None and taylor["argmax agreement"] < 0.5:
    notes.append(f"taylor_exp's argmax agreement is {taylor['argmax agreement']:.2f}: "
                 "1 + z + z²/2 decreases for z < −1, so on −‖q−k‖² (≪ −1) it prefers the "
                 "farthest key.")
  rep.text(" ".join([_kernel_text(ks), *notes]))
  kernel_held = ks["held"]

  if config.train.enabled:
    rep.section("(b) Training level")
    tc = config.train
    tr = training_level(config, workdir)
    rep.text(f"`{tc.dataset}` (8×8 images, patches {tc.patch_size}×{tc.patch_size} → tokens); "
             f"VisionTransformer with {tc.num_layers} layers, width {tc.hidden_dim}, "
             f"{tc.num_heads} heads, MLP {tc.mlp_dim}; AdamW lr {tc.learning_rate} with "
             f"warmup-cosine, batch {tc.batch_size}, {tc.num_steps} steps, seeds "
             f"{config.seed}..{config.seed + config.num_seeds - 1}: identical for every variant. "
             "`neg_sq_dist` is scaled by 1/(2√H) so that it equals the scaled dot product minus "
             "(‖q‖² + ‖k‖²)/(2√H); `qk_norm` applies LayerNorm to q and k (norm √H at init).")
    trows = []
    for label, fm in tr["final"].items():
      trows.append({"variant": label, "test accuracy": fm.get("accuracy"),
                    "test loss": fm.get("loss"), "train loss": fm.get("train_loss"),
                    "ms/step": 1e3 * tr["seconds_per_step"][label]})
    rep.table(trows, caption="final metrics, mean ± std over seeds")
    rep.figure(train.plot_learning_curves(tr["histories"], "eval_accuracy"),
               "test_accuracy_curves", "Test accuracy during training (mean ± std over seeds).")
    acc = {lab: float(np.mean(fm["accuracy"])) for lab, fm in tr["final"].items()}
    results["training"] = {"accuracy": {k: v["accuracy"] for k, v in tr["final"].items()},
                           "mean_accuracy": acc}
    outcomes = tr["comparisons"]  # neg_sq_dist vs scaled_dot per qk_norm (verdict rule)
    gaps = {k: c.diff for k, c in outcomes.items()}
    results["training"]["accuracy_gap_dist_minus_dot"] = gaps
    results["training"]["comparison"] = {k: c.outcome for k, c in outcomes.items()}
    training_text = " ".join(c.sentence() + "." for c in outcomes.values())
    if outcomes:
      rep.text(train.verdict.Comparison.rule(tc.margin, next(iter(outcomes.values())).n,
                                             "accuracy"))
    rep.text(training_text)
  verdict = _kernel_text(ks)
  if config.train.enabled:
    if not gaps:
      verdict += " Training: no scaled_dot/neg_sq_dist pair was trained, nothing to compare."
    else:
      verdict += " Training: " + training_text
  rep.verdict(kernel_held, verdict)
  results["verdict"] = kernel_held
  results["seconds"] = time.time() - t0
  results["report"] = rep.write()
  _common.save_json(workdir, "dot_vs_distance.json", results)
  return results
