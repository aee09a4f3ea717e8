"""Multi-query associative recall vs model width, Zoology-style (Arora et al. 2023).

Arora et al., "Zoology: Measuring and Improving Recall in Efficient Language Models"
(arXiv 2312.04927), figure 2: on MQAR, attention solves the task at every model width d they
try, while gated-convolution and linear-attention models need a larger d (their recurrent state
grows with d) to reach the same accuracy.

Claim under test: softmax attention reaches ≥ 0.99 query accuracy at a modest width, and linear
attention (elu+1 and FAVOR+ features) needs a larger width than softmax for the same accuracy.
Also measured: relu, sigmoid and sparsemax weightings. Also reported, per width: what each
F's attention does (attnx.analysis: sink rate, shares of zero and small weights, entropy and
maximum weight per layer and head, hidden-state kurtosis; a heat map) on ``stats_examples``
test sequences.

Setup (a documented scale-down of Zoology's smallest setting: sequence length 64, 4 key-value
pairs, all 4 keys queried, 2 layers): data from attnx.data's ``associative_recall`` with
Zoology's generator (keys and values distinct, drawn without replacement; queries at
power-law gaps with a = 0.01; random filler tokens), vocabulary 256 instead of 8192 (Zoology
requires vocabulary > sequence length; 256 keeps the embedding and output layers CPU-sized),
20 000 training examples instead of 100 000 and a fixed number of steps instead of 64 epochs,
one learning rate (3e-3, AdamW, warmup-cosine) instead of their sweep. Model: a causal
pre-LN transformer (attnx.nn.SequenceClassifier, per-token logits) with 2 layers, one head
(Zoology's attention baseline uses one), learned positions and an MLP of width 2d in each
block (Zoology's MQAR models have none; we kept attnx's standard block). Metric: accuracy of the
predicted value at the query positions on 1000 held-out examples.

Verdict (attnx.train.verdict, kind *claim*; see :func:`mqar_claim`): (1) softmax "solves"
MQAR at width d when the 95 % t-interval of its seed accuracies lies above
``solve_threshold`` (0.99; kind *unanimous* against the constant) — reported per d; met if it
does at some d ≤ the largest width tried; (2) "linear attention needs a larger d": at the
smallest width where softmax solves it, each linear feature map is *worse* than softmax
(*paired*, margin ``margin``) and its accuracy rises with d. Inconclusive when the seeds
cannot tell. Measured results (default, ``conv``, 3-seed runs) and what they mean:
docs/results/reproductions.md, "MQAR vs model width".

Presets (each the default changed by one small function, see PRESET_FNS):
  default  python launch.py --config=experiments/mqar.py --workdir=runs/mqar
           6 weightings × d ∈ {32, 64}, 2 seeds, 1200 steps of batch 64 (runtime in
           docs/results/reproductions.md).
  wide     python launch.py --config=experiments/mqar.py:wide --workdir=runs/mqar_wide
           the same plus d = 128 (≈ 3× the default's runtime; the default's two widths are
           identical runs, so a wide run's first columns are the default's results).
  conv     python launch.py --config=experiments/mqar.py:conv --workdir=runs/mqar_conv
           softmax and linear attention (elu+1, FAVOR+) at d ∈ {32, 64, 128} with a short
           causal convolution of width 3 on the embeddings for every F (``short_conv``, as in
           Zoology's gated-convolution models and Based): it does the previous-token step of
           recall that linear attention cannot learn, leaving the lookup whose capacity
           grows with the state (why: docs/results/reproductions.md).
  tiny     python launch.py --config=experiments/mqar.py:tiny --workdir=/tmp/mqar_tiny
           softmax vs linear_elu, d ∈ {16, 32}, 30 steps: a smoke test (seconds).
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np

from attnx import analysis, nn, train
from attnx.train import config as train_config
from attnx.train import verdict
from attnx.train.experiment import Task, TaskResult, Variant, run_comparison

WEIGHTINGS = ("softmax", "linear_elu", "linear_favor", "relu", "sigmoid", "sparsemax")
LINEAR = ("linear_elu", "linear_favor")


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.update(dict(
      experiment="mqar", seed=0, num_seeds=2, weightings=",".join(WEIGHTINGS), widths=(32, 64),
      num_layers=2, num_heads=1, mlp_ratio=2,
      short_conv=0,  # > 0: a depthwise causal convolution of this width on the embeddings
      num_steps=1200, batch_size=64, eval_every=300, log_every=100, checkpoint_every=600,
      keep_checkpoints=1))
  c.optimizer = train.optimizer_config(name="adamw", learning_rate=3e-3,
                                       schedule="warmup_cosine", warmup_steps=60,
                                       weight_decay=0.1, grad_clip_norm=1.0)
  # attnx.data associative_recall config: Zoology's smallest setting, scaled down (docstring).
  c.data = ml_collections.ConfigDict(dict(
      vocab_size=256, seq_len=64, num_kv_pairs=4, num_queries=4, query_power_a=0.01,
      random_non_queries=True, num_train=20000, num_test=1000))
  c.update(dict(solve_threshold=0.99,
                margin=0.01,  # accuracy differences below this count as equal
                stats_examples=16))  # test sequences for the attention statistics (analysis)
  return c


def _wide(c: ml_collections.ConfigDict) -> None:
  c.widths = (32, 64, 128)


def _conv(c: ml_collections.ConfigDict) -> None:
  c.weightings = ",".join(("softmax", *LINEAR))
  c.widths = (32, 64, 128)
  c.short_conv = 3


def _tiny(c: ml_collections.ConfigDict) -> None:
  c.update(dict(weightings="softmax,linear_elu", widths=(16, 32), num_steps=30, eval_every=15,
                log_every=5, checkpoint_every=0))
  c.optimizer.warmup_steps = 3
  c.data.update(vocab_size=32, seq_len=24, num_train=512, num_test=64)


PRESET_FNS = {"default": lambda c: None, "wide": _wide, "conv": _conv, "tiny": _tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "mqar")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  train.attention_variants(config, "weightings", reference="softmax")
  widths = [int(d) for d in config.widths]
  if not widths or min(widths) < 1 or any(d % config.num_heads for d in widths):
    raise ValueError(f"config.widths={tuple(config.widths)} must be ≥ 1 and divisible by "
                     f"config.num_heads={config.num_heads}.")
  if int(config.short_conv) < 0:
    raise ValueError(f"config.short_conv={config.short_conv} must be ≥ 0 (0: none).")
  if not 0 < config.solve_threshold <= 1:
    raise ValueError("config.solve_threshold must be in (0, 1].")
  if int(config.stats_examples) < 1:
    raise ValueError(f"config.stats_examples={config.stats_examples} must be ≥ 1.")
  train.check_batch_size(config, "batch_size", config.data.num_train,
                         "MQAR examples (config.data.num_train)")


def _task(config: ml_collections.ConfigDict, d: int) -> Task:
  data = dict(config.data)

  def build(spec: Any) -> nn.SequenceClassifier:
    return nn.SequenceClassifier(
        vocab_size=data["vocab_size"], num_classes=data["vocab_size"], hidden_dim=d,
        num_layers=config.num_layers, num_heads=config.num_heads,
        mlp_dim=config.mlp_ratio * d, max_len=data["seq_len"], pool="none", is_causal=True,
        short_conv=int(config.short_conv), attention=spec)

  return Task(name=f"d={d}", dataset="associative_recall", data_kwargs=data, build_model=build,
              metric="accuracy", margin=float(config.margin),
              evaluators=("accuracy", "attention_stats"), curve_evaluators=("accuracy",),
              eval_options=dict(stats_examples=int(config.stats_examples)),
              description=f"MQAR, model width d = {d}: accuracy at the query positions")


def mqar_claim(acc: dict[str, dict[int, np.ndarray]], threshold: float, margin: float
               ) -> tuple[verdict.Claim, str, dict[str, Any]]:
  """The claim of the module docstring (kind *claim*) from per-seed accuracies, its text and
  its numbers.

  Parts: (1) softmax solves MQAR at some width (kind *any* over the widths: refuted when it
  solves at none): at width d when its seed accuracies clear ``threshold`` by the kind
  *unanimous* against the constant
  (the 95 % t-interval of the mean above it; never with one seed, a diverged seed never).
  (2) Per linear feature map, at the smallest width where softmax solves it — or, if the
  seeds cannot certify that, where its mean first reaches the threshold: *worse* than
  softmax (*paired*; better or within noise refutes it), and *better* at the largest width
  than at the smallest (it needs a larger d; not improving leaves it open: it may need a much
  larger d or budget). Without such a width only part (1) is tested.
  """
  widths = sorted(acc["softmax"])
  soft = {d: np.asarray(acc["softmax"][d], float) for d in widths}
  solve = {d: False if np.isnan(a).any() else verdict.unanimous_held(
      [verdict.compare(a, threshold, margin=1e-9).outcome])
           for d, a in soft.items()}
  n = len(acc["softmax"][widths[0]])
  text = [f"Softmax accuracy ≥ {threshold:g} (95 % t-interval over {n} seeds above it): "
          + ", ".join(f"d={d}: {'yes' if s else 'no' if s is False else 'unclear'}"
                      for d, s in solve.items()) + "."]
  first = next((d for d in widths if solve[d]), None)
  parts = [verdict.claim([verdict.check(f"d={d}", s) for d, s in solve.items()],
                        require="any", name="softmax solves")]
  ref = first or next((d for d in widths if np.nanmean(acc["softmax"][d]) >= threshold), None)
  info: dict[str, Any] = {"softmax_solves": solve, "first_solved_width": first,
                          "reference_width": ref}
  if ref is None:
    text.append(f"Softmax's mean accuracy stays below {threshold:g} at every width tried.")
    return verdict.claim(parts), " ".join(text), info
  if first is None:
    text.append(f"Softmax's mean reaches {threshold:g} at d={ref} (seeds: "
                f"{', '.join(f'{x:.4f}' for x in acc['softmax'][ref])}), but {n} seeds cannot "
                "certify it.")
  info["linear"] = []
  for w in (x for x in LINEAR if x in acc):
    c = verdict.compare(acc[w][ref], acc["softmax"][ref], margin=margin, a_name=w,
                        b_name="softmax", metric=f"accuracy at d={ref}")
    grows = verdict.compare(acc[w][widths[-1]], acc[w][widths[0]], margin=margin,
                            a_name=f"{w} at d={widths[-1]}", b_name=f"d={widths[0]}",
                            metric="accuracy")
    parts.append(verdict.claim([verdict.part(c, "worse"),  # only a gain with d counts:
                                verdict.check("grows", grows.outcome == "better" or None)], name=w))
    info["linear"].append(f"{c.sentence()}; {grows.sentence()}")
  if info["linear"]:
    text.append(f"Linear attention at d={ref}: " + "; ".join(info["linear"]) + ".")
  return verdict.claim(parts), " ".join(text), info


def finish(config: ml_collections.ConfigDict, rep: train.Report,
           results: dict[str, TaskResult]) -> dict[str, Any]:
  """run_comparison's ``finish``: accuracy vs width (table, figure), the verdict, and what
  each F's attention does at each width."""
  widths = [int(d) for d in config.widths]
  weightings = train.variant_list(config.weightings)
  nan = lambda r: np.full(len(next(iter(r.fits.values())).seeds), np.nan)  # diverged
  acc = {w: {d: r.metric(w) if w in r.fits else nan(r) for d in widths
             for r in [results[f"d={d}"]]} for w in weightings}  # per-seed accuracy
  rep.section("Accuracy vs model width (Zoology, figure 2)")
  rep.table(train.level_rows(acc, widths, label="weighting", column=lambda d: f"d={d}",
                             fmt=".3f"), caption=f"MQAR query accuracy, mean ± std over "
            f"{config.num_seeds} seeds ({config.num_steps} steps)")
  fig = train.plot_curves(train.level_curves(acc, widths), xlabel="model width d",
                          ylabel="MQAR accuracy", band="errorbar", logx=2, marker="o",
                          hline=config.solve_threshold)
  rep.figure(fig, "mqar_accuracy_vs_width",
             "Accuracy at the query positions vs model width (mean ± std over seeds), "
             "one line per weighting, as in Zoology's figure 2.")
  claim, text, info = mqar_claim(acc, config.solve_threshold, config.margin)
  rep.text(verdict.Comparison.rule(config.margin, config.num_seeds, "accuracy"))
  rep.text(claim.rule())
  rep.verdict(claim.held, text)
  attention = {}
  for d in widths:  # what the attention of each F does: sinks, sparsity, entropy, kurtosis
    r = results[f"d={d}"]
    attention[d] = analysis.report_attention(
        rep, r.fits, lambda w, r=r: r.task.build_model(nn.attention_spec(w)),
        r.arrays["eval"]["inputs"], label="weighting", figure=f"attention_heatmap_d{d}",
        examples=f"the first {config.stats_examples} test sequences, width d = {d} (keys: "
                 "the causal prefix without padding tokens)",
        title=f"Attention statistics at d = {d} (attnx.analysis)")
  return {"accuracy": {w: {d: acc[w][d].tolist() for d in widths} for w in weightings},
          "held": claim.held, "attention": attention, **info}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains every weighting at every width, writes the report, returns the numbers."""
  validate_config(config)
  variants = [Variant(w, nn.attention_spec(w)) for w in train.variant_list(config.weightings)]
  d = config.data
  return run_comparison(
      config, workdir, title="MQAR vs model width (Arora et al., Zoology)",
      claim="Softmax attention reaches ≥ 0.99 MQAR accuracy at a modest width; linear "
            "attention needs a larger width for the same accuracy.",
      intro=f"MQAR: length {d.seq_len}, {d.num_kv_pairs} key-value pairs, {d.num_queries} "
            f"queries (power-law gaps, a = {d.query_power_a:g}), vocabulary {d.vocab_size}, "
            f"{d.num_train} training / {d.num_test} test examples. Causal transformer, "
            f"{config.num_layers} layers, {config.num_heads} head(s), MLP {config.mlp_ratio}d"
            + (f", a short causal convolution of width {config.short_conv} on the embeddings "
               "(every weighting)" if config.short_conv else "") + "; "
            f"{config.num_steps} steps of batch {config.batch_size}, AdamW lr "
            f"{config.optimizer.learning_rate:g} (warmup-cosine); seeds {config.seed}.."
            f"{config.seed + config.num_seeds - 1}.",
      tasks=[_task(config, int(w)) for w in config.widths], variants=variants,
      reference="softmax", label="weighting",
      finish=lambda rep, results: finish(config, rep, results))
