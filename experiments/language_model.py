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

Presets (each the default changed by one small function, see PRESET_FNS), then sample.py:
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

import dataclasses
import functools
import math
import os
import re
import shlex
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from attnx import analysis, core, nn, train
from attnx import nnx as anx
from attnx.data import packing
from attnx.train import config as train_config
from attnx.train import evaluators as evaluators_lib
from attnx.train.experiment import Task, TaskResult, Variant, run_comparison, run_name
from attnx.train.step import PACKED_KEYS
from experiments import _common

PRESETS = ("default", "ablations", "survey", "claims", "tiny", "sequence_parallel", "packed",
           "positions")
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
      # "first_fit" | "best_fit": train on each work (the text file's part) as a document,
      # packed into rows by grain with segment ids and positions restarting per document
      # (attnx.data.packing), instead of windows cut across works ("").
      packing="",
      # "rotary,alibi,none": the positions study — every weighting trained with each of these
      # positions (variants "F@positions"; reference softmax with the first); "": every
      # weighting with model.positions.
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
      # "linen": attnx.nn.GPT; "nnx": attnx.nnx.GPT, trained through Flax's bridge
      # (attnx.nnx.to_linen); the same parameter tree, so the analysis, the model file and
      # sample.py read either.
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
assert tuple(PRESET_FNS) == PRESETS


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "language_model")


def data_kwargs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ``shakespeare`` dataset config of an experiment config (text_file only when set)."""
  from attnx.data import shakespeare

  path = shakespeare.absolute_text_file(config.text_file) if config.text_file else None
  return {"seq_len": int(config.model.context), **({"text_file": path} if path else {})}


@functools.lru_cache(maxsize=8)
def token_stream(split: str, text_file: str | None = None) -> np.ndarray:
  """One split as a 1-D int32 token array (cached: evaluators of every variant share it)."""
  from attnx.data import shakespeare

  return shakespeare.token_stream(split, **({"text_file": text_file} if text_file else {}))


def vocabulary(text_file: str | None = None) -> str:
  """The dataset vocabulary (token id -> character)."""
  from attnx import data

  return data.get_info("shakespeare", **({"text_file": text_file} if text_file else {})
                       ).extras["vocab"]


def task_name(text_file: str | None) -> str:
  """The task (report, figure and checkpoint names): ``<file stem>_char`` for a text file."""
  first = (text_file or "").split(",")[0].rstrip(os.sep)
  stem = os.path.splitext(os.path.basename(first))[0]
  return _common.safe_name(f"{stem}_char") if text_file else TASK


def sample_prompt(config: ml_collections.ConfigDict) -> str:
  """``config.sample.prompt``, else "ROMEO:" for Shakespeare and a text file's own style: the
  first complete non-blank line of its validation split (≤ 20 characters)."""
  text_file = data_kwargs(config).get("text_file")
  if config.sample.prompt or not text_file:
    return config.sample.prompt or PROMPT
  vocab = vocabulary(text_file)
  text = "".join(vocab[int(i)] for i in token_stream("validation", text_file)[:4096])
  lines = [line.rstrip() for line in text.split("\n")]
  return next((line for line in lines[1:] + lines[:1] if line.strip()), text)[:20]


@dataclasses.dataclass(frozen=True)
class Positioned:
  """A variant of the positions study: an attention spec trained with its own positions."""

  attention: Any
  positions: str


def study_positions(config: ml_collections.ConfigDict) -> list[str]:
  """The positions the study crosses with the weightings (empty: no study)."""
  from attnx.train.config import split_list

  return list(split_list(config.position_study)) if config.position_study else []


def variant_specs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{variant: spec}: the weightings, or with ``position_study`` every weighting × positions
  as ``"F@positions"`` (:class:`Positioned`)."""
  names = _common.variant_list(config.weightings)
  kinds = study_positions(config)
  if not kinds:
    return {w: nn.attention_spec(w) for w in names}
  return {f"{w}@{p}": Positioned(nn.attention_spec(w), p) for w in names for p in kinds}


def reference_name(config: ml_collections.ConfigDict) -> str:
  """The reference variant: softmax (with the study's first positions)."""
  kinds = study_positions(config)
  return f"softmax@{kinds[0]}" if kinds else "softmax"


def _attention_of(spec: Any) -> Any:
  return spec.attention if isinstance(spec, Positioned) else spec


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  names = _common.attention_variants(config, "weightings", reference="softmax")
  if (impl := config.get("implementation", "")) and impl not in core.IMPLEMENTATIONS:
    raise ValueError(f"config.implementation={impl!r}; valid: '' (automatic), "
                     f"{', '.join(core.IMPLEMENTATIONS)}.")
  if config.get("model_api", "linen") not in ("linen", "nnx"):
    raise ValueError(f"config.model_api={config.model_api!r}; valid: 'linen', 'nnx'.")
  if config.get("model_api", "linen") == "nnx" and int(config.get("sequence_parallel", 1)) > 1:
    raise ValueError("config.model_api='nnx' with sequence_parallel > 1: ring attention "
                     "training runs the linen GPT only (model_api='linen').")
  if config.model.positions not in nn.gpt.POSITIONS:
    raise ValueError(f"config.model.positions={config.model.positions!r} is invalid; valid "
                     f"choices: {', '.join(nn.gpt.POSITIONS)}.")
  kinds = study_positions(config)
  if bad := [p for p in kinds if p not in nn.gpt.POSITIONS]:
    raise ValueError(f"config.position_study names {', '.join(map(repr, bad))}; valid "
                     f"positions: {', '.join(nn.gpt.POSITIONS)}.")
  if len(set(kinds)) != len(kinds):
    raise ValueError(f"config.position_study={config.position_study!r} names a position twice.")
  if kinds and (fixed := [w for w in names if positions_for(nn.attention_spec(w), "rotary")
                          != "rotary"]):
    raise ValueError(f"config.position_study: {', '.join(fixed)} cannot take other positions "
                     "than learned ones (linear attention); leave them out of config.weightings.")
  for spec in variant_specs(config).values():  # every variant builds a GPT (or raises)
    anx.linen_twin(build_model(config, vocab_size=2)(spec))  # the linen checks, either API
  if config.text_file:
    from attnx.data import catalog, shakespeare

    try:
      shakespeare.text_files(data_kwargs(config)["text_file"])
    except catalog.DatasetNotFoundError as e:
      raise ValueError(f"config.text_file={config.text_file!r}: {e}") from None
  try:
    packing.check_packing(config.packing, allow_none=True)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  if config.packing and (unpackable := [w for w in names if not packable(w)]):
    raise ValueError(f"config.packing={config.packing!r} trains on segment ids, which "
                     f"{', '.join(unpackable)} cannot take (linear attention has no segment "
                     "mask in attnx); leave them out of config.weightings.")
  if config.packing and int(config.sequence_parallel) > 1:
    raise ValueError("config.packing with config.sequence_parallel > 1: ring attention takes no "
                     "segment ids in attnx.nn yet; train packed rows on one device per "
                     "sequence.")
  L, text_file = int(config.model.context), data_kwargs(config).get("text_file")
  extrapolates = any(p != "learned" for p in kinds or [config.model.positions])
  evaluators_lib.check_length_options(  # learned positions evaluate 1× only: any text does
      config.context_multipliers, config.length_verdicts, config.length_windows, L,
      len(token_stream("validation", text_file)) - 1 if extrapolates else None,
      int(config.eval_windows) * L)
  sp, layout = int(config.sequence_parallel), config.sequence_layout
  cut = sp * (2 if layout == "zigzag" else 1)
  if sp > 1 and config.model.context % cut:
    raise ValueError(f"config.model.context={config.model.context} must be a multiple of "
                     f"{cut} to split over config.sequence_parallel={sp} devices "
                     f"({layout} layout).")
  if not 0 < config.sink_threshold < 1 or not 0 < config.small_weight < 1:
    raise ValueError("config.sink_threshold and config.small_weight must be in (0, 1).")
  if not config.margin > 0:
    raise ValueError("config.margin must be > 0 (nats).")
  if not -config.model.num_layers <= config.heatmap_layer < config.model.num_layers:
    raise ValueError(f"config.heatmap_layer={config.heatmap_layer} is not a layer of "
                     f"{config.model.num_layers}.")
  from attnx import data

  train.check_batch_size(config, "batch_size", len(packed_rows(config)["inputs"])
                         if config.packing else data.get_info(
      "shakespeare", **data_kwargs(config)).splits["train"],
      f"{L}-character {'packed rows' if config.packing else 'windows'}")


def packed_rows(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The training split's documents packed into rows of ``model.context`` (config.packing)."""
  return _packed_rows(data_kwargs(config).get("text_file"), int(config.model.context),
                      config.packing)


@functools.lru_cache(maxsize=4)
def _packed_rows(text_file: str | None, context: int, method: str) -> dict[str, np.ndarray]:
  from attnx.data import shakespeare

  docs = shakespeare.documents("train", **({"text_file": text_file} if text_file else {}))
  return packing.pack_documents(docs, context, method=method)


def packable(weighting: str) -> bool:
  """Whether a weighting's attention takes packed documents (segment ids): dot and metric."""
  return nn.spec.resolve_attention(nn.attention_spec(weighting))["type"] in ("dot", "metric")


def positions_for(spec: Mapping[str, Any], positions: str) -> str:
  """``positions``, except learned positions for attention types that cannot rotate."""
  kind = nn.spec.resolve_attention(spec)["type"]
  return positions if kind in ("dot", "metric") else "learned"


def build_model(config: ml_collections.ConfigDict, vocab_size: int):
  """``spec -> GPT`` with the config's sizes (training context = ``model.context``), in
  ``config.model_api``."""
  m, impl = config.model, config.get("implementation") or None
  sharded = int(config.get("sequence_parallel", 1)) > 1

  def build(spec: Any) -> Any:
    """``spec``: an attention spec (trained with ``model.positions``) or a
    :class:`Positioned` one (with its own). An :class:`attnx.nn.GPT`, or with
    ``model_api="nnx"`` an :class:`attnx.nnx.GPT` behind Flax's bridge."""
    positions = spec.positions if isinstance(spec, Positioned) else m.positions
    spec = _attention_of(spec)
    kind = nn.spec.resolve_attention(spec)["type"]
    kwargs = dict(vocab_size=int(vocab_size), num_layers=m.num_layers, num_heads=m.num_heads,
                  hidden_dim=m.hidden_dim, mlp_dim=m.mlp_dim, max_len=m.context,
                  attention=spec, positions=positions_for(spec, positions),
                  tie_embeddings=m.tie_embeddings, dropout_rate=m.dropout_rate,
                  implementation=impl if kind in ("dot", "metric") else None,
                  sequence_axis=train.SEQUENCE_AXIS if sharded else None,
                  sequence_layout=config.get("sequence_layout", "contiguous"))
    if config.get("model_api", "linen") == "nnx":
      return anx.to_linen(anx.GPT, **kwargs)
    return nn.GPT(**kwargs)

  return build


def bits_per_char(nats: Any) -> np.ndarray:
  """Cross-entropy in nats per character -> bits per character (÷ ln 2)."""
  return np.asarray(nats, np.float64) / math.log(2.0)


def _task(config: ml_collections.ConfigDict, vocab_size: int) -> Task:
  text_file = data_kwargs(config).get("text_file")
  L, limit = int(config.model.context), int(config.eval_windows) * int(config.model.context)
  source = (f"the text file {text_file} (contiguous 90/10 split)" if text_file
            else "Gutenberg Shakespeare (attnx.data 'shakespeare', split by work)")
  streams = {} if text_file else {"test": functools.partial(token_stream, "test")}
  packed = dict(keys=("inputs", "targets", *PACKED_KEYS),
                train_arrays=functools.partial(packed_rows, config)) if config.packing else {}
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
      eval_options=dict(token_stream=functools.partial(token_stream, "validation", text_file),
                        loss_streams=streams, context=L, limit_tokens=limit or None,
                        context_multipliers=tuple(int(k) for k in config.context_multipliers),
                        length_windows=int(config.length_windows),
                        stats_examples=int(config.stats_windows),
                        sink_threshold=float(config.sink_threshold),
                        small_weight=float(config.small_weight)), **packed)


def linen_model(result: TaskResult, spec: Any) -> nn.GPT:
  """The linen GPT of a trained variant: the model itself, or an NNX model's linen twin (the
  same parameter tree), which the model file, sampling and the analysis read."""
  return anx.linen_twin(result.task.build_model(spec))


def save_models(config: ml_collections.ConfigDict, workdir: str, result: TaskResult,
                specs: Mapping[str, Any], vocab: str) -> dict[str, str]:
  """Writes ``<workdir>/lm/<run>/model.json`` (sample.py's contract) for every trained variant,
  ``run`` its name with characters other than ``A-Za-z0-9_.-`` as "_"; returns {variant: run}."""
  runs = {name: re.sub(r"[^A-Za-z0-9_.-]+", "_", name) for name in result.fits}
  for name in result.fits:
    nn.save_model_spec(os.path.join(workdir, "lm", runs[name], "model.json"),
                       linen_model(result, specs[name]), vocab=vocab,
                       checkpoint=run_name(result.task.name, name), dataset="shakespeare",
                       data=data_kwargs(config), weighting=name, num_steps=int(config.num_steps))
  return runs


def samples(config: ml_collections.ConfigDict, result: TaskResult, specs: Mapping[str, Any],
            vocab: str, text: str) -> dict[str, str]:
  """One sample per trained variant from its seed-0 parameters (config.sample), continuing
  ``text`` (its characters outside the vocabulary dropped)."""
  import jax

  s, table = config.sample, {ch: i for i, ch in enumerate(vocab)}
  ids = np.asarray([[table[ch] for ch in text if ch in table] or [0]], np.int32)
  seed0 = lambda tree: jax.tree.map(lambda a: np.asarray(a)[0], tree) if tree else None
  return {name: "".join(vocab[int(i)] for i in np.asarray(nn.generate(
      linen_model(result, specs[name]), seed0(res.params), ids, int(s.num_tokens),
      rng=jax.random.PRNGKey(int(s.seed)), temperature=float(s.temperature),
      top_k=min(int(s.top_k), len(vocab)) if s.top_k else None,
      extra_variables=seed0(res.extra_variables)))[0]) for name, res in result.fits.items()}


def _finish(config: ml_collections.ConfigDict, specs: Mapping[str, Any], vocab: str,
            prompt: str):
  mults, L = [int(k) for k in config.context_multipliers], int(config.model.context)
  text_file = data_kwargs(config).get("text_file")
  reference, kinds = reference_name(config), study_positions(config)
  positions_note = (f"Positions per variant (F@positions: {', '.join(kinds)}; "
                    "ALiBi and none extrapolate with no table, RoPE rotates further)."
                    if kinds else f"Positions: {config.model.positions} "
        + ("(RoPE; nanoGPT uses learned positions, which cannot evaluate beyond L). Linear "
           "attention has no rotary variant in attnx and keeps learned positions: n/a beyond "
           "1×." if config.model.positions == "rotary" else
           "(learned, as nanoGPT): a table of L positions, so only 1× is evaluated."))

  def finish(rep: train.Report, results: dict[str, TaskResult]) -> dict[str, Any]:
    result = results[task_name(text_file)]
    fits = result.fits  # result.comparisons: each F vs softmax on validation loss
    build = lambda name: linen_model(result, specs[name])
    runs = save_models(config, rep.workdir, result, specs, vocab)
    rep.section("Loss per weighting (nats and bits per character)")
    rep.text(f"For orientation: nanoGPT's softmax model reaches ≈ {NANOGPT_VAL_LOSS} nats "
             "validation loss with this configuration on its tiny-shakespeare split (README, ≈ 3 "
             "min on a laptop CPU, learned positions)"
             + (f"; this run uses {text_file} — with nanoGPT's input.txt that number is directly "
                "comparable." if text_file else ". This run's split (by work, Gutenberg edition) "
                "differs, so its numbers are not directly comparable; pass "
                "`--config.text_file=/path/to/input.txt` to train and validate on nanoGPT's "
                "text and split.") + " Bits per character = nats / ln 2.")
    rep.table(analysis.loss_rows(result, int(config.batch_size) * L, label="weighting",
                                 reference=reference),
              caption=f"Final metrics after {config.num_steps} steps, mean ± std over "
                      f"{config.num_seeds} seeds. tokens/s per model = batch × context / seconds "
                      "per step (the seeds train together, vmapped, so the machine processes "
                      "num_seeds times as many); " + ("validation only (a text file has no test "
                      "split)." if text_file else "test: Macbeth, Much Ado, two poems."))

    length_verdicts, kernels = analysis.report_length(
        rep, fits, build, token_stream("validation", text_file), context=L, multipliers=mults,
        judged=config.length_verdicts, margin=config.margin, num_seeds=config.num_seeds,
        length_windows=config.length_windows, limit_tokens=int(config.eval_windows) * L,
        label="weighting", unit="characters", note=positions_note, reference=reference)

    attention = analysis.report_attention(
        rep, fits, build, result.arrays["eval"]["inputs"],
        examples=f"the first {config.stats_windows} validation windows of {L} characters",
        threshold=config.sink_threshold, small=config.small_weight,
        layer=config.heatmap_layer, label="weighting",
        title="Attention statistics (after Zuhri et al. 2025, softpick)")

    rep.section("Samples")
    s = config.sample
    texts = samples(config, result, specs, vocab, prompt)
    rep.text(f"One sample per weighting: seed index 0, prompt {prompt!r}, {s.num_tokens} "
             f"characters, temperature {s.temperature:g}, top-k {s.top_k}, sampling seed "
             f"{s.seed} (attnx.nn.generate; each character from the latest {L}, the training "
             "context, as nanoGPT crops to its block size). More with `python sample.py "
             f"--workdir={rep.workdir} --run=RUN --prompt={shlex.quote(prompt)}` (runs: "
             f"{', '.join(runs.values())}).")
    for name, text in texts.items():
      rep.text(f"**{name}**\n\n```text\n{text}\n```")

    rep.section(f"Verdicts: each variant vs {reference} on validation loss")
    train.experiment.report_verdicts(rep, result, config.num_seeds, reference, "weighting",
                                     "validation loss (nats; lower is better)")

    metric = lambda key: {w: np.asarray(r.final_metrics[key]).tolist() for w, r in fits.items()
                          if key in r.final_metrics}
    payload = {
        "val_loss": metric("loss"), "test_loss": metric("test_loss"),
        "val_bpc": {w: bits_per_char(v).tolist() for w, v in metric("loss").items()},
        "loss_by_context": metric("loss_by_context"), "context_multipliers": mults,
        "tokens_per_second": {w: config.batch_size * L / r.seconds_per_step
                              for w, r in fits.items()},
        "compile_seconds": {w: r.compile_seconds for w, r in fits.items()},
        "outcomes": {w: c.outcome for w, c in result.comparisons.items()},
        "length_outcomes": {k: {w: c.outcome for w, c in v.items()}
                            for k, v in length_verdicts.items()}, "kernels": kernels,
        "eval_seconds_by_context": {w: v[0] for w, v in metric("eval_seconds_by_context").items()},
        "failures": dict(result.failures), "samples": texts, "runs": runs,
        "task": result.task.name, "prompt": prompt, "attention": attention}
    rep.save_json("language_model", payload)
    return payload

  return finish


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains every weighting, writes the report and the sample.py files, returns the numbers."""
  validate_config(config)
  specs = variant_specs(config)
  names, kinds, reference = list(specs), study_positions(config), reference_name(config)
  text_file = data_kwargs(config).get("text_file")
  vocab, corpus = vocabulary(text_file), os.path.basename(text_file or "")
  m, opt = config.model, config.optimizer
  linear = ", ".join(w for w in names
                     if positions_for(_attention_of(specs[w]), m.positions) != m.positions)
  linear = f" (learned for {linear}: no rotary linear attention in attnx)" if linear else ""
  where = (f"a small character-level GPT trained on {corpus}." if corpus else
           "nanoGPT's small character-level Shakespeare model.")
  positions = (f"positions per variant ({', '.join(kinds)})" if kinds
               else f"{m.positions} positions{linear}")
  return run_comparison(
      config, workdir, title="Character-level language model per weighting"
                             + (" and positions" if kinds else "") + " ("
                             + (corpus or "nanoGPT shakespeare_char") + ")",
      claim=(f"Each weighting F with each position encoding ({', '.join(kinds)}) reaches the "
             f"validation loss of {reference} (not worse by the shared rule, margin "
             f"{config.margin:g} nats) in " + where if kinds else
             f"Each alternative weighting F reaches softmax's validation loss (not worse by the "
             f"shared rule, margin {config.margin:g} nats) when it replaces softmax in " + where),
      intro=f"Data: {text_file or 'attnx.data shakespeare (Gutenberg, split by work)'}, "
            f"vocabulary {len(vocab)} characters, context {m.context}"
            + (f"; training rows pack each {'document' if text_file else 'work'} apart "
               f"(grain's {config.packing.replace('_', '-')} packing, segment ids, positions "
               "restarting per document; a document longer than the context is cut into "
               "pieces, each its own segment), validation on windows as without packing"
               if config.packing else "") + ". Model: GPT (Karpathy's "
            f"nanoGPT configuration for CPU) with {m.num_layers} layer(s), {m.num_heads} heads, "
            f"width {m.hidden_dim}, MLP {m.mlp_dim}, tied embeddings, dropout "
            f"{m.dropout_rate:g}, {positions}. {config.num_steps} steps of "
            f"batch {config.batch_size}, AdamW lr "
            f"{opt.learning_rate:g} (warmup {opt.warmup_steps}, cosine to "
            f"{opt.learning_rate * opt.end_learning_rate_ratio:g}), β₂ {opt.b2:g}, weight "
            f"decay {opt.weight_decay:g}, gradient clip {opt.grad_clip_norm:g}; seeds "
            f"{config.seed}..{config.seed + config.num_seeds - 1}. Learning curves: validation "
            f"loss on the first {config.curve_windows} windows every {config.eval_every} steps; "
            "final metrics on every validation window. The deviations from nanoGPT: "
            "docs/results/language_model.md.",
      tasks=[_task(config, len(vocab))], variants=[Variant(w, specs[w]) for w in names],
      reference=reference, label="weighting",
      finish=_finish(config, specs, vocab, sample_prompt(config)))
