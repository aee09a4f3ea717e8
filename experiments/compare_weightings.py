"""Softmax vs alternative attention weightings F across tasks, at equal model and budget.

Every weighting trains the same model with the same optimizer, steps, batch size and seeds
(seeds run in parallel with jax.vmap); only the attention weighting changes. Reported per task:
test accuracy (or in-context squared error) mean ± std over seeds, time per step, compile time,
learning curves, a summary table across tasks, and per task the verdict (attnx.train.verdict,
kind *claim* over *paired* comparisons, margins ``config.margins``): the best alternative is
not worse than softmax.

Presets, run as ``python launch.py --config=experiments/compare_weightings.py:PRESET`` (results
as observed with jax 0.10.2 on a 2-core x86 CPU):
  :default digits (real 8x8 images, ViT with 2x2 patches = 16 tokens + CLS), 8 weightings
           (softmax, relu, relu2, sigmoid, sparsemax, entmax15, linear_elu, metric), 3 seeds,
           300 steps of batch 32: 1.5 min wall on 2 quiet cores, 3.1 min at a load of ≈ 5,
           about half of it compiling; deterministic (two runs agreed). Test accuracy
           ≈ 0.87-0.89 ± 0.02 for softmax, relu, relu2, sigmoid and entmax15; sparsemax
           0.82-0.84, linear_elu and metric ≈ 0.85 (3-6 points lower at this budget).
  :tiny    digits, softmax vs relu, 2 seeds, 40 steps, 1-layer model, checkpoints every 10
           steps (CI): 40-70 s on the loaded machine, mostly compilation; test accuracy
           0.3-0.5 (chance 0.1): a smoke test, not a result.
  :survey  all four tasks at CPU scale (ListOps length ≤ 48, MQAR length 32 with 4 pairs, ICL
           d=4 with 16 points), all 13 weightings, 2 seeds, 600 steps of batch 32, and the
           summary table across tasks: 18 min on 2 cores. Every F within ≈ 2.5 points of
           softmax on digits (sparsemax lowest), 0.29-0.32 on ListOps, only metric attention
           solves MQAR at this budget (≈ 0.98 vs ≈ 0.34), ICL error/d ≈ 0.5 (softmax,
           sigmoid, softplus) to 1.0 (metric).
  :quick   digits, softmax/relu/sparsemax/linear_elu, 2 seeds, 200 steps of batch 32: 71 s on
           2 cores (one run; about twice that under load).
  Not timed or run to completion here (runtimes estimated from the per-step times above):
  :digits  all 13 weightings, 5 seeds, 1000 steps of batch 64 (≈15-30 min).
  :listops ListOps (max length 128), all weightings, 3 seeds, 2000 steps (hours); LRA-style
           accuracies are low (LRA reports 0.36 for softmax at length 2000).
  :associative_recall  MQAR, causal model, all weightings, 3 seeds; Arora et al. 2023 find
           softmax solves it while linear attention needs more state.
  :icl_regression  in-context linear regression (Garg et al. 2022), causal model, all
           weightings; the error at the last in-context position against least squares.
  :all     all four tasks and all weightings, with the summary table (many hours).

Override anything from the command line, e.g. --config.weightings=softmax,relu,sparsemax
--config.num_seeds=4 --config.num_steps=2000 --config.tasks=digits,associative_recall.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from attnx.train import config as train_config
from attnx.train.config import base_config, check_batch_size, split_list
from attnx.train.optim import optimizer_config
from experiments import _common

TASKS = ("digits", "listops", "associative_recall", "icl_regression")
# power at p = 3: its default p = 2 is relu2, already in the list.
ALL_WEIGHTINGS = ("softmax", "relu", "relu2", "sigmoid", "sigmoid:normalization=none",
                  "softplus", "power:p=3", "taylor_exp", "sparsemax", "entmax15", "linear_elu",
                  "linear_favor", "metric")
DEFAULT_WEIGHTINGS = ("softmax", "relu", "relu2", "sigmoid", "sparsemax", "entmax15",
                      "linear_elu", "metric")
CLAIM = ("At the same model, budget and hyper-parameters, the best alternative weighting F is "
         "not worse than softmax: better or within noise by the shared verdict rule (95 % "
         "paired t-interval over seeds; margin 0.01 accuracy, 0.025 ICL error/d).")


def _default() -> ml_collections.ConfigDict:
  c = base_config()
  c.experiment = "compare_weightings"
  c.tasks = "digits"  # comma-separated subset of TASKS
  c.weightings = ",".join(DEFAULT_WEIGHTINGS)  # comma-separated attention variants
  c.update(dict(num_seeds=3, num_steps=300, batch_size=32, eval_every=50, log_every=10,
                checkpoint_every=100, keep_checkpoints=2))
  c.max_eval_examples = 1000  # cap on test examples per evaluation (CPU budget)
  # Kernel of the dot/metric attention variants: "" (automatic), dense, blocked or pallas
  # (GPU/TPU; see core.attention). Linear attention has its own kernel.
  c.implementation = ""
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
  # Verdict margins δ per task: differences below them count as equal (attnx.train.verdict).
  c.margins = ml_collections.ConfigDict(dict(digits=0.01, listops=0.01,
                                             associative_recall=0.01, icl_regression=0.025))
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  c.update(dict(weightings="softmax,relu", num_seeds=2, num_steps=40, eval_every=20,
                checkpoint_every=10, max_eval_examples=360))
  c.model.update(hidden_dim=16, num_layers=1, num_heads=2, mlp_dim=32)
  c.optimizer.update(learning_rate=1e-2, warmup_steps=5)


def _quick(c: ml_collections.ConfigDict) -> None:
  c.update(dict(weightings="softmax,relu,sparsemax,linear_elu", num_seeds=2, num_steps=200))


def _survey(c: ml_collections.ConfigDict) -> None:
  # Every task at CPU scale: short sequences, small data, one budget for all.
  c.update(dict(tasks=",".join(TASKS), weightings=",".join(ALL_WEIGHTINGS), num_seeds=2,
                num_steps=600, eval_every=100, checkpoint_every=200, max_eval_examples=500))
  c.data.listops.update(max_length=48, num_train=10000)
  c.data.associative_recall.update(vocab_size=32, seq_len=32, num_kv_pairs=4, num_queries=4,
                                   num_train=10000)
  c.data.icl_regression.update(dim=4, num_points=16, num_train=10000)


def _digits(c: ml_collections.ConfigDict) -> None:
  c.update(dict(weightings=",".join(ALL_WEIGHTINGS), num_seeds=5, num_steps=1000,
                batch_size=64, eval_every=100, checkpoint_every=250))
  c.optimizer.warmup_steps = 50


def _long(tasks: str) -> Callable[[ml_collections.ConfigDict], None]:
  def preset(c: ml_collections.ConfigDict) -> None:
    c.update(dict(tasks=tasks, weightings=",".join(ALL_WEIGHTINGS), num_seeds=3,
                  num_steps=2000, batch_size=64, eval_every=250, checkpoint_every=500))
    c.model.update(hidden_dim=64, num_layers=2, num_heads=4, mlp_dim=128)
    c.optimizer.update(learning_rate=1e-3, warmup_steps=200)
  return preset


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny, "quick": _quick, "survey": _survey,
    "digits": _digits, **{t: _long(t) for t in TASKS if t != "digits"}, "all": _long(
        ",".join(TASKS))}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for `preset` (None = "default"); see the module docstring for the presets."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "compare_weightings")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Experiment-specific checks (names the key and the valid choices); no compilation."""
  tasks = split_list(config.tasks)
  if not tasks:
    raise ValueError(f"config.tasks is empty; valid choices: {', '.join(TASKS)}")
  train_config.check_choices(config, "tasks", tasks, TASKS)
  weightings = split_list(config.weightings)
  if not weightings:
    raise ValueError("config.weightings is empty")
  from attnx import core  # lazy: --help/--list stay fast
  from attnx import nn as attnx_nn
  impl = config.get("implementation", "")
  train_config.check_choice(config, "implementation", ("", *core.IMPLEMENTATIONS))  # "": automatic
  for w in weightings:
    try:
      attnx_nn.resolve_attention(_spec(w, impl))
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


def _tasks(config: ml_collections.ConfigDict) -> list:
  """The tasks (data, model, loss, evaluation), identical for every weighting."""
  from attnx import data
  from attnx import nn as attnx_nn
  from attnx.train.experiment import Task

  m = config.model
  common = dict(hidden_dim=m.hidden_dim, num_layers=m.num_layers, num_heads=m.num_heads,
                mlp_dim=m.mlp_dim, dropout_rate=m.dropout_rate)
  limit = int(config.max_eval_examples)
  out = []
  for name in split_list(config.tasks):
    kwargs = dict(config.data.get(name, {}))
    info = data.get_info(name, **kwargs)
    base = dict(name=name, dataset=name, data_kwargs=kwargs, eval_limit=limit,
                margin=float(config.margins[name]))
    if name == "digits":
      out.append(Task(**base, metric="accuracy", build_model=lambda att, info=info:
                      attnx_nn.VisionTransformer(num_classes=info.num_classes,
                                                 patch_size=m.patch_size, pool="cls",
                                                 attention=att, **common),
                      description=f"sklearn digits 8x8 ({info.splits['train']} train), ViT "
                                  f"with {m.patch_size}x{m.patch_size} patches"))
    elif name == "listops":
      out.append(Task(**base, metric="accuracy", build_model=lambda att, info=info:
                      attnx_nn.SequenceClassifier(vocab_size=info.vocab_size,
                                                  num_classes=info.num_classes,
                                                  max_len=info.seq_len, pool="cls",
                                                  attention=att, **common),
                      description=f"ListOps (length ≤ {info.seq_len}), bidirectional "
                                  "encoder, CLS pooling"))
    elif name == "associative_recall":
      out.append(Task(**base, metric="accuracy", build_model=lambda att, info=info:
                      attnx_nn.SequenceClassifier(vocab_size=info.vocab_size,
                                                  num_classes=info.num_classes
                                                  or info.vocab_size, max_len=info.seq_len,
                                                  pool="none", is_causal=True, attention=att,
                                                  **common),
                      description=f"multi-query associative recall (length {info.seq_len}), "
                                  "causal decoder, accuracy at query positions"))
    elif name == "icl_regression":
      out.append(Task(**base, metric="mse_last", higher_is_better=False, loss="icl_mse",
                      evaluators=("icl_error",), extra_report=_common.icl_report,
                      build_model=lambda att, n=info.seq_len:
                      attnx_nn.SequenceRegressor(out_dim=1, max_len=n, is_causal=True,
                                                 attention=att, **common),
                      description="in-context linear regression (Garg et al. 2022, \"What "
                                  "Can Transformers Learn In-Context?\"); squared error / d "
                                  "at the last in-context position"))
  return out


def _spec(weighting: str, implementation: str) -> dict[str, Any]:
  """The attention spec of a weighting name, with the configured kernel where one applies."""
  from attnx import nn as attnx_nn

  spec = dict(attnx_nn.attention_spec(weighting))
  if implementation and spec.get("type") != "linear":
    spec["implementation"] = implementation
  return spec


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train every weighting on every task; write report.md, results.json, final_metrics.json."""
  from attnx.train.experiment import Variant, run_comparison

  validate_config(config)
  tasks = _tasks(config)
  variants = [Variant(w, _spec(w, config.implementation))
              for w in split_list(config.weightings)]
  intro = (f"Every weighting uses the **same model, optimizer, budget and seeds**: "
           f"{config.num_steps} steps of batch {config.batch_size}, {config.optimizer.name} "
           f"(lr {config.optimizer.learning_rate}, {config.optimizer.schedule}), model "
           f"{dict(config.model)}, seeds {config.seed}..{config.seed + config.num_seeds - 1} "
           f"trained in parallel with jax.vmap. Only the attention weighting F differs. Values "
           f"are mean ± std over seeds; time per step covers all {config.num_seeds} seeds.")
  return run_comparison(config, workdir, title=f"Attention weightings compared "
                        f"({config.preset}): {', '.join(t.name for t in tasks)}", claim=CLAIM,
                        tasks=tasks, variants=variants, reference="softmax", intro=intro,
                        label="weighting")
