"""The alternative-weighting papers' own ablations, at CPU scale.

Three published claims, each tested with the variant the paper says matters and the one it
says fails, under the same model, budget and seeds:

* Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"
  (arXiv 2409.04431): unnormalized sigmoid attention σ(s + b) matches softmax when the bias is
  b = −log n (n keys, attnx's default); without it (b = 0) training suffers (:data:`SIGMOID`).
* Wortsman et al. 2023, "Replacing softmax with ReLU in Vision Transformers"
  (arXiv 2309.08586): ReLU attention matches softmax when divided by the sequence length L,
  not without (:data:`RELU`; ÷ Σ relu is attnx's default).
* Nakanishi 2025, "Scalable-Softmax Is Superior for Attention" (arXiv 2501.19570): SSMax,
  softmax of (s · log n) · z, degrades less than softmax at contexts longer than the training
  length ``train_len`` (evaluated at every length of ``eval_lens``).

Tasks: sigmoid and ReLU on ``digits`` (the compare_weightings ViT, 17 tokens); SSMax on
attnx.data's ``associative_recall`` (4 key-value pairs, queries uniform over the query region,
so longer sequences put them farther from the context; a 2-layer causal transformer with
sinusoidal positions, which exist at every length).

Verdicts (kind *claim* of attnx.train.verdict over *paired* comparisons, margin ``margin``):
sigmoid / ReLU — held if the paper's variant is not worse than softmax and the other one is
worse than it (:data:`PAIRS`); SSMax — held if its accuracy drop from ``train_len`` to the
longest length is smaller than softmax's (better on −drop).

Measured (default, 13 min on one shared CPU core): all three inconclusive. digits: softmax
0.952, sigmoid b = −log n 0.960 and b = 0 0.954, relu ÷L 0.963, ÷Σ 0.947, none 0.957 (3 seeds:
no difference resolved; with 17 tokens −log n and 1/L change little). MQAR: neither model
solves it at the training length at this budget (softmax 0.37, ssmax 0.27); both lose ≈ 0.1
from length 64 to 256. The same ablations where they can discriminate — a 4-layer GPT on
Shakespeare at context 64, SSMax read at 2× and 4× its context — are the ``ablations`` preset
and the length generalization of experiments/language_model.py (docs/results/reproductions.md).

Presets (each the default changed by one small function, see PRESET_FNS):
  default  python launch.py --config=experiments/ablations.py --workdir=runs/ablations
           digits: 6 variants × 3 seeds × 1000 steps; MQAR: 2 variants × 2 seeds × 1500 steps
           (runtime in docs/results/reproductions.md).
  tiny     python launch.py --config=experiments/ablations.py:tiny --workdir=/tmp/abl
           20 steps each, smaller data: a smoke test.
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np

from attnx import data, nn, train
from attnx.train import config as train_config
from attnx.train import verdict
from attnx.train.experiment import Task, TaskResult, Variant, report_task, run_task, with_budget

PRESETS = ("default", "tiny")
SIGMOID = {"sigmoid b=−log n": "sigmoid:normalization=none",
           "sigmoid b=0": "sigmoid:normalization=none,bias=0"}
RELU = {"relu ÷L": "relu:normalization=length", "relu ÷Σ": "relu",
        "relu none": "relu:normalization=none"}
LENGTH = {"softmax": "softmax", "ssmax": "ssmax"}
# The digits ablations (the paper's variant, the one it says fails): held if the first is not
# worse than softmax and the second is worse than the first.
PAIRS = {"sigmoid": ("sigmoid b=−log n", "sigmoid b=0"), "relu": ("relu ÷L", "relu none")}
# A study's budget: its sub-config's values replace the global ones (seed, parallel, ... stay).
_BUDGET = ("num_seeds", "num_steps", "batch_size", "eval_every", "optimizer")


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment = "ablations"
  c.seed = 0
  c.margin = 0.01  # accuracy differences below this count as equal
  c.digits = ml_collections.ConfigDict(dict(
      num_seeds=3, num_steps=1000, batch_size=64, eval_every=250,
      model=ml_collections.ConfigDict(dict(hidden_dim=32, num_layers=2, num_heads=4,
                                           mlp_dim=64, patch_size=2)),
      optimizer=train.optimizer_config(name="adamw", learning_rate=3e-3,
                                       schedule="warmup_cosine", warmup_steps=50,
                                       weight_decay=1e-4, grad_clip_norm=1.0)))
  c.mqar = ml_collections.ConfigDict(dict(
      num_seeds=2, num_steps=1500, batch_size=64, eval_every=500, hidden_dim=64,
      num_layers=2, num_heads=1, train_len=64, eval_lens=(64, 128, 256),
      data=ml_collections.ConfigDict(dict(vocab_size=256, num_kv_pairs=4, num_queries=4,
                                          query_power_a=0.0, num_train=20000, num_test=1000)),
      optimizer=train.optimizer_config(name="adamw", learning_rate=3e-3,
                                       schedule="warmup_cosine", warmup_steps=75,
                                       weight_decay=0.1, grad_clip_norm=1.0)))
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  c.digits.update(dict(num_seeds=2, num_steps=20, eval_every=10))
  c.mqar.update(dict(num_steps=20, eval_every=10, hidden_dim=16, train_len=24,
                     eval_lens=(24, 48)))
  c.mqar.data.update(vocab_size=32, num_train=512, num_test=64)


PRESET_FNS = {"default": lambda c: None, "tiny": _tiny}
assert tuple(PRESET_FNS) == PRESETS


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "ablations")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys."""
  m = config.mqar
  if min(m.eval_lens) != m.train_len or sorted(m.eval_lens) != list(m.eval_lens):
    raise ValueError(f"config.mqar.eval_lens={tuple(m.eval_lens)} must be increasing and "
                     f"start at config.mqar.train_len={m.train_len}.")
  if not 0 <= config.margin < 1:
    raise ValueError("config.margin must be in [0, 1).")
  train.check_batch_size(config.mqar, "batch_size", m.data.num_train,
                         "MQAR examples (config.mqar.data.num_train)")


def _digits_task(config: ml_collections.ConfigDict) -> Task:
  m = config.digits.model
  return Task(name="digits", dataset="digits", metric="accuracy", margin=config.margin,
              build_model=lambda spec: nn.VisionTransformer(
                  num_classes=10, patch_size=m.patch_size, hidden_dim=m.hidden_dim,
                  num_layers=m.num_layers, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
                  attention=spec),
              description="sklearn digits, the compare_weightings ViT (17 tokens)")


def _mqar_task(config: ml_collections.ConfigDict) -> Task:
  m = config.mqar
  kw = dict(m.data, seq_len=m.train_len)
  return Task(name="mqar", dataset="associative_recall", data_kwargs=kw, metric="accuracy",
              margin=config.margin,
              build_model=lambda spec: nn.SequenceClassifier(
                  vocab_size=kw["vocab_size"], num_classes=kw["vocab_size"],
                  hidden_dim=m.hidden_dim, num_layers=m.num_layers, num_heads=m.num_heads,
                  mlp_dim=2 * m.hidden_dim, max_len=max(m.eval_lens), pool="none",
                  is_causal=True, position="sinusoidal", attention=spec),
              description=f"MQAR trained at length {m.train_len} (sinusoidal positions)")


def accuracy_by_length(config: ml_collections.ConfigDict, result: TaskResult
                       ) -> dict[str, dict[int, np.ndarray]]:
  """Per variant and evaluation length: per-seed query accuracy on fresh MQAR test sets of
  that length (same pairs/queries/vocabulary, more filler)."""
  m = config.mqar
  out: dict[str, dict[int, np.ndarray]] = {v: {} for v in result.fits}
  for length in m.eval_lens:
    arrays = data.load_arrays("associative_recall", "test",
                              **dict(m.data, seq_len=length, num_train=0))
    arrays = {k: arrays[k] for k in ("inputs", "targets")}
    for v, fit in result.fits.items():
      model = result.task.build_model(nn.attention_spec(LENGTH[v]))
      out[v][length] = train.evaluate(model, fit.params, train.loader(arrays, 250),
                                      ("accuracy",), extra_variables=fit.extra_variables
                                      )["accuracy"]
  return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the three ablations, writes the report, returns the numbers."""
  validate_config(config)
  rep = train.Report(
      "The alternative-weighting papers' ablations (Ramapuram et al.; Wortsman et al.; "
      "Nakanishi)", workdir, config=config,
      claim="Sigmoid attention needs b = −log n, ReLU attention needs 1/L, and SSMax "
            "degrades less than softmax at longer contexts.")
  out: dict[str, Any] = {}

  dc = with_budget(config, **{k: config.digits[k] for k in _BUDGET})
  variants = [Variant("softmax", nn.attention_spec("softmax"))] + [
      Variant(k, nn.attention_spec(v)) for k, v in {**SIGMOID, **RELU}.items()]
  digits = run_task(dc, workdir, _digits_task(config), variants, "softmax")
  report_task(rep, digits, dc, "softmax", verdict=False)
  for study, (good, bad) in PAIRS.items():
    claim = digits.claim([(good, "softmax", "not worse"), (bad, good, "worse")])
    text = claim.text if claim.tested else (
        f"Not every variant trained ({', '.join(digits.failures) or 'none'} failed).")
    rep.text(verdict.Comparison.rule(config.margin, dc.num_seeds, "accuracy") + " "
             + claim.rule())
    rep.verdict(claim.held, f"{study}: {text}")
    out[study] = {"held": claim.held, "accuracy": {v: digits.metric(v).tolist()
                                                   for v in digits.fits}}

  mc = with_budget(config, **{k: config.mqar[k] for k in _BUDGET})
  mqar = run_task(mc, workdir, _mqar_task(config),
                  [Variant(k, nn.attention_spec(v)) for k, v in LENGTH.items()], "softmax")
  report_task(rep, mqar, mc, "softmax", verdict=False)
  acc = accuracy_by_length(config, mqar)
  lens = list(config.mqar.eval_lens)
  rep.table(train.level_rows(acc, lens, column=lambda n: f"length {n}", fmt=".3f"),
            caption=f"MQAR query accuracy by evaluation length (trained at {lens[0]}; mean ± "
                    f"std over {mc.num_seeds} seeds)")
  rep.figure(train.plot_curves(train.level_curves(acc, lens), xlabel="evaluation length",
                               ylabel="MQAR accuracy", logx=2, band="errorbar"),
             "mqar_accuracy_vs_length", "Accuracy vs evaluation length (trained at "
             f"{lens[0]}).")
  drop = {v: a[lens[0]] - a[lens[-1]] for v, a in acc.items()}
  held = None
  if set(LENGTH) <= set(drop):
    c = verdict.compare(-drop["ssmax"], -drop["softmax"], margin=config.margin,
                        a_name="ssmax", b_name="softmax",
                        metric=f"−(accuracy drop {lens[0]} → {lens[-1]})")
    held = verdict.claim([verdict.part(c, "better")]).held  # a smaller drop than softmax's
    rep.text(verdict.Comparison.rule(config.margin, mc.num_seeds, "the accuracy drop") + " "
             + verdict.rule("claim"))
    rep.verdict(held, f"ssmax: {c.sentence()} (a smaller drop is better).")
  out["ssmax"] = {"held": held, "accuracy_by_length": {
      v: {n: a[n].tolist() for n in lens} for v, a in acc.items()}}
  out["report"] = rep.write()
  return out
