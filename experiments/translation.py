"""Encoder-decoder translation with and without attention (after the Wikipedia article
"Attention (machine learning)").

Claim: grafting an attention unit onto an RNN encoder-decoder lets each decoding step look at
the relevant source words directly, instead of through one fixed-size "thought vector"; the
attention weights form an interpretable alignment matrix whose off-diagonal mass shows
reordering ("I love you" -> "je t'aime": t' attends to "you", aime to "love"). Bahdanau
(additive) and Luong (dot / general / concat) scoring are the two classic variants.

Setup: ``synthetic_translation`` (English-like SVO -> French-like SOV with agreement and
adjective reordering, so alignments are non-monotonic; gold alignments are known). The same
GRU encoder-decoder (attnx.nn.RNNSeq2Seq) is trained with every attention_type of
:data:`ATTENTION_TYPES`, same hyper-parameters, budget and seeds: one ``Task``
(attnx.train.experiment) with the evaluators ``"greedy_decode"`` (sequence accuracy, corpus
BLEU-4) and, for the attention variants, ``"alignment"`` (how often the attention's argmax is
the gold source word); alignment heat maps for a few sentences and the seed's I/love/you table.

Verdict (attnx.train.verdict, kind *claim* of two sub-claims over *paired* comparisons): every
attention variant *better* than "none" on sequence accuracy and on BLEU-4 (margins
``margins.sequence_accuracy`` / ``margins.bleu``), and its alignment accuracy *better* than
uniform attention's chance (``margins.alignment``); inconclusive if nothing was learned.

Presets (the default changed by one small function each, see PRESET_FNS), run as
``python launch.py --config=experiments/translation.py:PRESET --workdir=runs/translation``:
  default  5 attention types, 2 seeds, 1500 steps. Measured on 2 shared CPU cores: 123 s
           quiet, 182 s at a load average of ≈ 5; 209 s pinned to one core beside another run.
  tiny     bahdanau vs none, 512 pairs, 300 steps: 28–53 s measured at load ≈ 5; bahdanau
           0.60 sequence accuracy vs none 0.00, verdict inconclusive (2 seeds disagree).
Measured (default, seeds 1–2): every attention variant 1.000 sequence accuracy and BLEU-4 vs
none 0.581 / 0.667 (seeds 0.52 and 0.64: with 2 seeds the paired interval still straddles 0,
inconclusive); alignment accuracy 0.55–0.83 vs chance 0.17 (better for Luong dot and concat,
inconclusive for Bahdanau and Luong general, 0.87 / 0.46 on its two seeds); pass
--config.num_seeds=4 or more for a decision (≈ 2× the runtime).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from attnx import nn, train
from attnx.data import synthetic_translation as st
from attnx.train import config as train_config
from attnx.train import experiment, verdict
from attnx.train.evaluators import alignment_weights, corpus_bleu  # noqa: F401  (re-exported)

PRESETS = ("default", "tiny")
ATTENTION_TYPES = ("bahdanau", "luong_dot", "luong_general", "luong_concat", "none")
EXAMPLES = ("i love you", "the big dog sees the cats", "she eats a red apple")
# Verdict margin of alignment accuracy vs the uniform-attention chance (≈ 1/source length).
ALIGN_MARGIN = 0.1
# Below this sequence accuracy and BLEU for every variant, nothing was learned: no verdict.
LEARNED_MIN = 0.01


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()  # seed, num_seeds, parallel, progress, ... (launch.py)
  c.experiment = "translation"
  c.seed = 1
  c.attention_types = ATTENTION_TYPES
  c.weighting = "softmax"
  c.num_train = 10000
  c.num_test = 1000
  c.p_pronoun = 0.3
  c.p_adjective = 0.5
  c.cell = "gru"
  c.embed_dim = 32
  c.hidden_dim = 64
  c.batch_size = 64
  c.num_steps = 1500
  c.learning_rate = 3e-3
  c.num_seeds = 2
  c.examples = EXAMPLES
  # Verdict margins δ (attnx.train.verdict): differences below them count as equal.
  c.margins = ml_collections.ConfigDict(dict(sequence_accuracy=0.01, bleu=0.01,
                                             alignment=ALIGN_MARGIN))
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  # Just enough to learn something measurable (train loss ≈ 4.1 → ≈ 0.1–1.2) in ≈ 20–30 s.
  c.update(dict(attention_types=("bahdanau", "none"), num_train=512, num_test=64,
                hidden_dim=32, embed_dim=16, num_steps=300, learning_rate=1e-2,
                batch_size=32))


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS = {"default": lambda c: None, "tiny": _tiny}
assert tuple(PRESET_FNS) == PRESETS


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "translation")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  train.check_choices(config, "attention_types", list(config.attention_types),
                        ATTENTION_TYPES)
  train.check_choices(config, "cell", [config.cell], ("gru", "lstm"))
  if config.num_seeds < 1 or config.num_steps < 1:
    raise ValueError("config.num_seeds and config.num_steps must be ≥ 1.")
  train.check_batch_size(config, "batch_size", config.num_train,
                         "synthetic pairs (config.num_train)")
  for sentence in config.examples:
    try:
      st.translate(sentence)
    except (KeyError, IndexError):
      raise ValueError(f"config.examples: {sentence!r} is not in the synthetic grammar "
                       f"(e.g. {', '.join(EXAMPLES)}).") from None


def _loss_mask(arrays: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
  """PAD positions do not count in the training loss (greedy decoding stops at EOS anyway);
  the evaluation targets stay as they are (the references of BLEU and sequence accuracy)."""
  tr = dict(arrays["train"])
  tr["targets"] = np.where(tr["mask"], tr["targets"], train.IGNORE_INDEX)
  return {"train": tr, "eval": arrays["eval"]}


def _model(config, attention_type: str) -> nn.RNNSeq2Seq:
  return nn.RNNSeq2Seq(src_vocab_size=len(st.SOURCE_VOCAB), tgt_vocab_size=len(st.TARGET_VOCAB),
                       embed_dim=config.embed_dim, hidden_dim=config.hidden_dim,
                       cell=config.cell, attention_type=attention_type,
                       weighting=config.weighting)


def make_task(config) -> experiment.Task:
  """The declaration: data (attnx.data's ``synthetic_translation`` with this config's sizes,
  grammar probabilities and seed), model builder, the "greedy_decode" (+ "alignment" for
  attention variants) evaluators, the optimizer, and the primary metric with its margin."""
  return experiment.Task(
      name="synthetic_translation", dataset="synthetic_translation",
      data_kwargs=dict(seed=config.seed, num_train=config.num_train, num_test=config.num_test,
                       p_pronoun=config.p_pronoun, p_adjective=config.p_adjective),
      build_model=lambda attention_type: _model(config, attention_type),
      metric="sequence_accuracy", margin=config.margins.sequence_accuracy,
      evaluators=("greedy_decode", "alignment"),
      eval_options=dict(bos_id=st.BOS_ID, eos_id=st.EOS_ID, detokenize=st.decode,
                        max_len=st.SEQ_LEN),
      keys=("inputs", "decoder_inputs", "targets", "alignment"), prepare=_loss_mask,
      fit_options=dict(optimizer=train.optimizer_config(
                           name="adam", learning_rate=config.learning_rate,
                           schedule="warmup_cosine",
                           warmup_steps=max(config.num_steps // 20, 1), weight_decay=0.0,
                           grad_clip_norm=1.0),
                       log_every=max(config.num_steps // 30, 1), tensorboard=False))


def variants(config) -> list[experiment.Variant]:
  """One variant per attention type; "none" has no attention weights to align."""
  return [experiment.Variant(a, a, skip_evaluators=("alignment",) if a == "none" else ())
          for a in config.attention_types]


# Evaluator outputs -> the names in tables and translation.json.
_NAMES = {"sequence_accuracy": "sequence accuracy", "bleu": "BLEU-4",
          "alignment_accuracy": "alignment accuracy", "gold_mass": "mass on gold word"}


def attention_claim(seq: dict[str, np.ndarray], bleu: dict[str, np.ndarray],
                    align: dict[str, np.ndarray], chance: float, margins=None
                    ) -> tuple[verdict.Claim, str]:
  """The claim of the module docstring and its report text, from per-seed sequence accuracy,
  BLEU-4 and alignment accuracy (the first sub-claim is untested without "none"; the claim is
  untested when no variant learned anything measurable)."""
  margins = margins or dict(sequence_accuracy=0.01, bleu=0.01, alignment=ALIGN_MARGIN)
  seq, bleu, align = ({k: np.atleast_1d(np.asarray(v, float)) for k, v in d.items()}
                      for d in (seq, bleu, align))
  n = len(next(iter(seq.values())))
  text = ("Sequence accuracy / BLEU-4 (seed means): " + "; ".join(
      f"{k} {seq[k].mean():.3f} / {bleu[k].mean():.3f}" for k in seq)
      + ". Alignment accuracy: " + ", ".join(f"{a} {v.mean():.2f}" for a, v in align.items())
      + f" (uniform attention: ≈ {chance:.2f}). ")
  if max(max(v.mean() for v in seq.values()), max(v.mean() for v in bleu.values())) \
      < LEARNED_MIN:
    return verdict.claim([]), text + (
        "No variant learned anything measurable (sequence accuracy and BLEU "
        f"< {LEARNED_MIN:g}): inconclusive, train longer.")
  text += (verdict.Comparison.rule(margins["sequence_accuracy"], n, "the metric")
           + f" Margins: sequence accuracy ±{margins['sequence_accuracy']:g}, BLEU-4 "
           f"±{margins['bleu']:g}, alignment accuracy against the uniform-attention chance "
           f"±{margins['alignment']:g}. ")
  improved = verdict.claim(verdict.part(verdict.compare(
      metric[a], metric["none"], margin=margins[m], a_name=a, b_name="none", metric=label),
      "better") for a in align if "none" in seq for metric, m, label in (
          (seq, "sequence_accuracy", "sequence accuracy"), (bleu, "bleu", "BLEU-4")))
  text += (improved.text + " " if improved.tested else "") + improved.say(
      "Every attention variant beats the plain encoder-decoder at equal budget. ",
      "Not every attention variant beat the plain encoder-decoder. ",
      "The seeds cannot tell whether every attention variant beats the plain one. ",
      "No plain encoder-decoder was trained, so the improvement is untested. ")
  aligned = verdict.claim(verdict.part(verdict.compare(
      align[a], chance, margin=margins["alignment"], a_name=a, b_name="uniform attention",
      metric="alignment accuracy"), "better") for a in align)
  text += aligned.text + " " + aligned.say(
      "Every attention variant's alignment is well above chance (interpretable).",
      "Alignment not clearly above chance for {refuted}.",
      "The seeds cannot tell whether alignment is above chance for {undecided}.")
  return verdict.claim([improved, aligned]), text


def _metrics(task: experiment.Task, result: experiment.TaskResult, examples: Sequence[str]
             ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
  """Per attention type: its table metrics, and its teacher-forced attention weights on the
  example sentences [seeds, examples, T, S] (none for "none")."""
  te = result.arrays["eval"]
  src, tgt_in, _, _ = st.example_arrays(examples)
  metrics, example_alignments = {}, {}
  for attention_type, fit in result.fits.items():
    if attention_type != "none":  # with the test set before them: the same compiled shapes
      a = alignment_weights(task.build_model(attention_type), fit.params,
                            jnp.asarray(np.concatenate([te["inputs"], src])),
                            jnp.asarray(np.concatenate([te["decoder_inputs"], tgt_in])))
      example_alignments[attention_type] = a[:, len(te["inputs"]):]
    metrics[attention_type] = {"train loss": fit.final_metrics["train_loss"],
                               **{_NAMES[k]: v for k, v in fit.final_metrics.items()
                                  if k in _NAMES},
                               "ms/step": 1e3 * fit.seconds_per_step}
  return metrics, example_alignments


def _report_alignments(rep: train.Report, config: ml_collections.ConfigDict,
                       example_alignments: dict[str, np.ndarray]) -> None:
  """Heat maps of the first seed's alignments of the example sentences, and the table of the
  first one (the seed's I/love/you table)."""
  _, _, src_words, tgt_words = st.example_arrays(config.examples)
  first_seed = {a: al[0] for a, al in example_alignments.items()}
  rep.section("Alignments")
  rep.figure(train.plot_alignments(first_seed, src_words, tgt_words), "alignments",
             f"Teacher-forced attention weights (seed {config.seed}) for example sentences; "
             "rows: target words, columns: source words.")
  first = next(iter(first_seed))
  table, sw, tw = first_seed[first][0], src_words[0], tgt_words[0]
  rep.text(f"The seed's table for `{config.examples[0]}` ({first}, seed {config.seed}):")
  rep.table([{"": t, **{s: float(table[i, j]) for j, s in enumerate(sw)}}
             for i, t in enumerate(tw)], floatfmt=".2f")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains every attention type, writes ``workdir/report.md`` and returns the numbers."""
  validate_config(config)
  t0 = time.time()
  rep = train.Report(
      "RNN translation with Bahdanau / Luong attention vs none (Wikipedia, 'Attention (machine "
      "learning)')", workdir,
      config=config,
      claim="Attention over the encoder states improves an RNN encoder-decoder translator "
            "and its weights form an interpretable (non-monotonic) alignment matrix.")
  task = make_task(config)
  result = experiment.run_task(config, workdir, task, variants(config), reference="none")
  if result.failures:
    raise train.NonFiniteLossError("; ".join(result.failures.values()))
  metrics, example_alignments = _metrics(task, result, config.examples)
  rep.section("Setup")
  rep.text(f"`synthetic_translation` (attnx.data, seed {config.seed}; "
           f"({config.num_train} training / {config.num_test} held-out pairs, p_pronoun "
           f"{config.p_pronoun}, p_adjective {config.p_adjective}; ≤ 7 words + EOS). "
           f"RNNSeq2Seq: {config.cell.upper()} encoder/decoder, embedding {config.embed_dim}, "
           f"hidden {config.hidden_dim}, weighting {config.weighting}; Adam lr "
           f"{config.learning_rate} (warmup-cosine, grad clip 1), batch {config.batch_size}, "
           f"{config.num_steps} steps, teacher forcing, seeds "
           f"{config.seed}..{config.seed + config.num_seeds - 1}: identical for every "
           "attention type. Evaluation: greedy decoding; sequence accuracy = exact match; "
           "corpus BLEU-4 (no smoothing); alignment accuracy = how often the teacher-forced "
           "attention argmax is the gold source word.")
  rep.section("Results")
  rep.table([{"attention": k, **v} for k, v in metrics.items()],
            columns=["attention", "sequence accuracy", "BLEU-4", "alignment accuracy",
                     "mass on gold word", "train loss", "ms/step"],
            caption="held-out results, mean ± std over seeds")
  rep.figure(train.plot_learning_curves({k: r.history for k, r in result.fits.items()}, "loss",
                                        logy=True), "learning_curves",
             "Training loss (mean ± std over seeds).")
  results: dict[str, Any] = {"metrics": metrics, "verdict": None, **{
      key: {k: float(np.mean(v[name])) for k, v in metrics.items()}
      for key, name in (("sequence_accuracy", "sequence accuracy"), ("bleu", "BLEU-4"))}}
  if example_alignments:  # at least one attention type
    _report_alignments(rep, config, example_alignments)
    inputs = result.arrays["eval"]["inputs"]
    results["alignment_chance"] = chance = float(np.mean(1.0 / np.maximum(
        (inputs != 0).sum(-1), 1)))
    align = {a: metrics[a]["alignment accuracy"] for a in example_alignments}
    results["alignment_accuracy"] = {a: float(np.mean(v)) for a, v in align.items()}
    claim, text = attention_claim({k: v["sequence accuracy"] for k, v in metrics.items()},
                                  {k: v["BLEU-4"] for k, v in metrics.items()}, align, chance,
                                  config.margins)
    rep.text(claim.rule())
    rep.verdict(claim.held, text)
    results["verdict"] = claim.held
  results["seconds"] = time.time() - t0
  results["report"] = rep.write()
  rep.save_json("translation.json", results)
  return results
