"""Character-level language modelling with every weighting F: nanoGPT's shakespeare_char on CPU.

Karpathy's nanoGPT CPU configuration for shakespeare_char (a GPT of 4 layers, width 128,
context 64; ≈ 1.88 nats validation loss with softmax) trained once per weighting F on
Gutenberg Shakespeare split by work — or on any UTF-8 text, ``--config.text_file=PATH``,
which the report, run names, claim and sample prompt then name. Setup, deviations from
nanoGPT, what is reported and measured runtimes: docs/results/language_model.md.

Claim under test (one verdict per F): each alternative weighting F reaches softmax's
validation loss, i.e. is not worse than softmax by the shared rule (attnx.train.verdict,
paired 95 % t-interval over seeds; lower is better; margin ``margin`` = 0.02 nats). Also
judged, each F vs softmax: the loss increase from 1× to 16× and 64× the training context.

Presets (:data:`PRESETS`, each the default changed by one small function of PRESET_FNS; what
each runs: docs/results/language_model.md), then sample.py:
  python launch.py --config=experiments/language_model.py --workdir=runs/lm  # default
  python launch.py --config=experiments/language_model.py:claims --workdir=runs/lm_claims
  python launch.py --config=experiments/language_model.py:ablations --workdir=runs/lm_ablations
  python launch.py --config=experiments/language_model.py:survey --workdir=runs/lm_all
  python launch.py --config=experiments/language_model.py:tiny --workdir=/tmp/lm_tiny
  python launch.py --config=experiments/language_model.py:packed --workdir=runs/lm_packed
  python launch.py --config=experiments/language_model.py:positions --workdir=runs/lm_positions
  python launch.py --config=experiments/language_model.py:sequence_parallel
  python sample.py --workdir=runs/lm --list; python sample.py --workdir=runs/lm --run=softmax
"""

from __future__ import annotations

import functools
import os
from typing import Any

import ml_collections

from attnx import core, nn, train
from attnx import nnx as anx
from attnx.analysis import language_model as lm_report
from attnx.data import char_lm, packing
from attnx.nn import lm
from attnx.train import config as train_config
from attnx.train.experiment import Task, Variant, run_comparison
from attnx.train.step import PACKED_KEYS
from experiments import _common

# The positions study: stick-breaking's claim that it needs no position encoding (Tan et al.
# 2024) and sigmoid attention's ALiBi configurations (Ramapuram et al. 2024), side by side.
POSITION_WEIGHTINGS = ("softmax", "sigmoid:normalization=none", "stick_breaking",
                       "ssmax_learned")
POSITION_KINDS = ("rotary", "alibi", "none")
WEIGHTINGS = ("softmax", "relu:normalization=length", "sigmoid:normalization=none",
              "softpick", "ssmax_learned", "stick_breaking", "entmax15", "linear_elu")
SURVEY_EXTRA = ("linear_elu", "linear_favor", "metric")
# The papers' own ablations: sigmoid with and without b = −log n (Ramapuram et al. 2024), ReLU
# ÷ L vs ÷ Σ vs unscaled (Wortsman et al. 2023).
ABLATIONS = ("softmax", "sigmoid:normalization=none", "sigmoid:normalization=none,bias=0",
             "relu:normalization=length", "relu", "relu:normalization=none")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TEXT = os.path.join(ROOT, "tests", "data", "fixtures", "tiny_text.txt")
NANOGPT_VAL_LOSS = 1.88  # nanoGPT README, shakespeare_char on CPU (the default preset's setup)
TASK, PROMPT = "shakespeare_char", "ROMEO:"  # a text file's: task_name(), sample_prompt()


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.update(dict(
      experiment="language_model", seed=0, num_seeds=3, weightings=",".join(WEIGHTINGS),
      # A UTF-8 file (e.g. nanoGPT's input.txt), a directory of them or a comma-separated list
      # (each file a document) instead of Gutenberg Shakespeare.
      text_file="",
      # "first_fit" | "best_fit": each work (file) a document, packed into rows with segment
      # ids and positions restarting per document (attnx.data.char_lm), not windows ("").
      packing="",
      # "rotary,alibi,none": the positions study — every weighting with each of these positions
      # (variants "F@positions", reference softmax@first); "": all with model.positions.
      position_study="",
      # The kernel of the dot/metric models ("": automatic); statistics read the dense one.
      implementation="", num_steps=2000, batch_size=12, eval_every=250, log_every=50,
      checkpoint_every=1000, keep_checkpoints=1,  # sample.py reads the last checkpoint
      curve_windows=128,  # validation windows per learning-curve point (final: all of them)
      eval_windows=0,  # 0: every validation (and test) window for the final metrics
      # Length generalization on the first length_windows·L validation characters (0: all)
      # cut into windows of k·L; length_verdicts: the k whose loss increase is judged.
      length_windows=1024, context_multipliers=(1, 2, 4, 16, 64), length_verdicts=(16, 64),
      stats_windows=32,  # validation windows for the attention statistics and heat map
      sink_threshold=0.3, small_weight=1e-3, heatmap_layer=-1,
      margin=0.02,  # validation-loss differences (nats) below this count as equal
      # > 1: every training sequence sharded over that many devices (ring attention; zigzag
      # balances the causal work); evaluation runs unsharded.
      sequence_parallel=1, sequence_layout="contiguous",
      # "linen": attnx.nn.GPT; "nnx": attnx.nnx.GPT through Flax's bridge (the same parameter
      # tree: the analysis, the model file and sample.py read either).
      model_api="linen"))
  c.model = ml_collections.ConfigDict(dict(
      num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512, context=64, positions="rotary",
      dropout_rate=0.0, tie_embeddings=True))
  c.optimizer = train.optimizer_config(
      name="adamw", learning_rate=1e-3, schedule="warmup_cosine", warmup_steps=100,
      end_learning_rate_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.99, grad_clip_norm=1.0)
  # prompt "": "ROMEO:" for Shakespeare, a text file's own first line (sample_prompt).
  c.sample = ml_collections.ConfigDict(dict(prompt="", num_tokens=300, temperature=0.8,
                                            top_k=20, seed=0))
  return c


def _survey(c: ml_collections.ConfigDict) -> None:
  names = [w for w in core.list_weightings() if w != "softmax"]
  c.update(weightings=",".join(["softmax", *names, *SURVEY_EXTRA]), num_seeds=2)


def _ablations(c: ml_collections.ConfigDict) -> None:
  # 2 seeds: the ablation run of docs/results/language_model.md
  c.update(weightings=",".join(ABLATIONS), num_seeds=2)


def _tiny(c: ml_collections.ConfigDict) -> None:
  c.update(dict(weightings="softmax,relu:normalization=length", text_file=TINY_TEXT,
                num_steps=20, batch_size=8, eval_every=10, log_every=5, checkpoint_every=20,
                curve_windows=4, stats_windows=4, length_windows=4, num_seeds=2,
                context_multipliers=(1, 2, 4), length_verdicts=(4,)))
  c.model.update(num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, context=16)
  c.optimizer.warmup_steps = 2
  c.sample.update(prompt=PROMPT, num_tokens=40)  # the fixture is Shakespeare


def _sequence_parallel(c: ml_collections.ConfigDict) -> None:
  # The tiny model, every training sequence over 8 fake CPU devices (zigzag ring attention).
  _tiny(c)
  c.update(dict(weightings="softmax,relu:normalization=length,sigmoid:normalization=none,"
                           "softpick,ssmax", num_seeds=1, num_cpu_devices=8, parallel="shard_map",
                sequence_parallel=8, sequence_layout="zigzag", context_multipliers=(1, 2),
                length_verdicts=(2,)))
  c.model.context = 32


PRESET_FNS = {"default": lambda c: None, "ablations": _ablations, "survey": _survey,
              "claims": lambda c: c.update(weightings="softmax,stick_breaking,ssmax_learned"),
              "tiny": _tiny, "sequence_parallel": _sequence_parallel,
              "packed": lambda c: c.update(packing="first_fit", weightings=",".join(
                  w for w in WEIGHTINGS if w != "linear_elu")),
              "positions": lambda c: c.update(weightings=",".join(POSITION_WEIGHTINGS),
                                              position_study=",".join(POSITION_KINDS))}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "language_model")


def data_kwargs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ``shakespeare`` dataset config of an experiment config (text_file only when set)."""
  return char_lm.data_kwargs(config.text_file, config.model.context)


def task_name(text_file: str | None) -> str:
  """The task (report, figure and checkpoint names): ``<file stem>_char`` for a text file."""
  first = (text_file or "").split(",")[0].rstrip(os.sep)
  stem = os.path.splitext(os.path.basename(first))[0]
  return _common.safe_name(f"{stem}_char") if text_file else TASK


def sample_prompt(config: ml_collections.ConfigDict) -> str:
  """``config.sample.prompt``, else "ROMEO:" for Shakespeare, a text file's own style."""
  text_file = data_kwargs(config).get("text_file")
  return config.sample.prompt or (char_lm.text_prompt(text_file) if text_file else PROMPT)


def study_positions(config: ml_collections.ConfigDict) -> list[str]:
  """The positions the study crosses with the weightings (empty: no study)."""
  return train_config.split_list(config.position_study)


def variant_specs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{variant: spec}: the weightings, or with ``position_study`` every weighting × positions
  as ``"F@positions"`` (:class:`attnx.nn.lm.Positioned`)."""
  names, kinds = train.variant_list(config.weightings), study_positions(config)
  if not kinds:
    return {w: nn.attention_spec(w) for w in names}
  return {f"{w}@{p}": lm.Positioned(nn.attention_spec(w), p) for w in names for p in kinds}


def reference_name(config: ml_collections.ConfigDict) -> str:
  """The reference variant: softmax (with the study's first positions)."""
  kinds = study_positions(config)
  return f"softmax@{kinds[0]}" if kinds else "softmax"


def build_model(config: ml_collections.ConfigDict, vocab_size: int):
  """``spec -> GPT`` with the config's sizes in ``config.model_api`` (attnx.nn.lm)."""
  sharded = int(config.get("sequence_parallel", 1)) > 1
  return lm.gpt_builder(config.model, vocab_size, api=config.get("model_api", "linen"),
                        implementation=config.get("implementation") or None,
                        sequence_axis=train.SEQUENCE_AXIS if sharded else None,
                        sequence_layout=config.get("sequence_layout", "contiguous"))


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  names = train.attention_variants(config, "weightings", reference="softmax")
  kinds, L = study_positions(config), int(config.model.context)
  lm.check_options(config.model.positions, names, study=config.position_study,
                   implementation=config.get("implementation", ""),
                   api=config.get("model_api", "linen"), packing=config.packing,
                   sequence_parallel=int(config.get("sequence_parallel", 1)),
                   sequence_layout=config.get("sequence_layout", "contiguous"), context=L)
  for spec in variant_specs(config).values():  # every variant builds a GPT (or raises)
    anx.linen_twin(build_model(config, vocab_size=2)(spec))  # the linen checks, either API
  char_lm.check_text_file(config.text_file)
  try:
    packing.check_packing(config.packing, allow_none=True)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  text_file = data_kwargs(config).get("text_file")
  extrapolates = any(p != "learned" for p in kinds or [config.model.positions])
  lm_report.check_config(config, len(char_lm.token_stream("validation", text_file)) - 1
                         if extrapolates else None)  # learned positions read 1× only
  train.check_batch_size(config, "batch_size", char_lm.training_rows(text_file, L, config.packing),
                         f"{L}-character {'packed rows' if config.packing else 'windows'}")


def _task(config: ml_collections.ConfigDict, vocab_size: int) -> Task:
  text_file = data_kwargs(config).get("text_file")
  L, limit = int(config.model.context), int(config.eval_windows) * int(config.model.context)
  source = (f"the text file {text_file} (contiguous 90/10 split)" if text_file
            else "Gutenberg Shakespeare (attnx.data 'shakespeare', split by work)")
  streams = {} if text_file else {"test": functools.partial(char_lm.token_stream, "test")}
  packed = dict(keys=("inputs", "targets", *PACKED_KEYS), train_arrays=functools.partial(
      char_lm.packed_rows, text_file, L, config.packing)) if config.packing else {}
  return Task(
      name=task_name(text_file), dataset="shakespeare", data_kwargs=data_kwargs(config),
      build_model=build_model(config, vocab_size), metric="loss", higher_is_better=False,
      margin=float(config.margin), eval_split="validation",
      eval_limit=int(config.eval_windows) or None,
      # loss_by_length computes loss and accuracy in its 1× pass (no second pass).
      evaluators=("stream_loss", "loss_by_length", "attention_stats"),
      curve_evaluators=("loss",), curve_limit=int(config.curve_windows),
      description=f"Next-character prediction on {source}, context {L}; metric: validation "
                  "cross-entropy in nats per character.",
      eval_options=dict(token_stream=functools.partial(char_lm.token_stream, "validation",
                                                       text_file),
                        loss_streams=streams, context=L, limit_tokens=limit or None,
                        context_multipliers=tuple(int(k) for k in config.context_multipliers),
                        length_windows=int(config.length_windows),
                        stats_examples=int(config.stats_windows),
                        sink_threshold=float(config.sink_threshold),
                        small_weight=float(config.small_weight)), **packed)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains every weighting, writes the report and the sample.py files, returns the numbers."""
  validate_config(config)
  specs, kinds, reference = variant_specs(config), study_positions(config), reference_name(config)
  text_file = data_kwargs(config).get("text_file")
  vocab, corpus = char_lm.vocabulary(text_file), os.path.basename(text_file or "")
  where = (f"a small character-level GPT trained on {corpus}." if corpus else
           "nanoGPT's small character-level Shakespeare model.")
  orientation = (
      f"For orientation: nanoGPT's softmax model reaches ≈ {NANOGPT_VAL_LOSS} nats validation "
      "loss with this configuration on its tiny-shakespeare split (README, ≈ 3 min on a laptop "
      "CPU, learned positions)" + (
          f"; this run uses {text_file} — with nanoGPT's input.txt that number is directly "
          "comparable." if text_file else ". This run's split (by work, Gutenberg edition) "
          "differs, so its numbers are not directly comparable; pass "
          "`--config.text_file=/path/to/input.txt` to train and validate on nanoGPT's text and "
          "split.") + " Bits per character = nats / ln 2.")
  finish = lm_report.finish(
      config, specs, task=task_name(text_file), vocab=vocab, prompt=sample_prompt(config),
      stream=char_lm.token_stream("validation", text_file), data=data_kwargs(config),
      reference=reference, orientation=orientation, study=kinds,
      test_note="validation only (a text file has no test split)." if text_file
      else "test: Macbeth, Much Ado, two poems.")
  return run_comparison(
      config, workdir, title="Character-level language model per weighting" + (
          " and positions" if kinds else "") + f" ({corpus or 'nanoGPT shakespeare_char'})",
      claim=(f"Each weighting F with each position encoding ({', '.join(kinds)}) reaches the "
             f"validation loss of {reference} (not worse by the shared rule, margin "
             f"{config.margin:g} nats) in " + where if kinds else
             f"Each alternative weighting F reaches softmax's validation loss (not worse by the "
             f"shared rule, margin {config.margin:g} nats) when it replaces softmax in " + where),
      intro=lm_report.describe(
          config, specs, vocab_size=len(vocab), study=kinds,
          data=text_file or "attnx.data shakespeare (Gutenberg, split by work)",
          documents="document" if text_file else "work",
          model="GPT (Karpathy's nanoGPT configuration for CPU)",
          closing="The deviations from nanoGPT: docs/results/language_model.md."),
      tasks=[_task(config, len(vocab))], variants=[Variant(w, s) for w, s in specs.items()],
      reference=reference, label="weighting", finish=finish)
