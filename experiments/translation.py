"""Encoder-decoder translation with and without attention.

After the Wikipedia article "Attention (machine learning)".

Claim (Wikipedia, "Attention (machine learning)"): grafting an attention unit onto an RNN encoder-
decoder lets each decoding step look at the relevant source words directly, instead of through one
fixed-size "thought vector"; the attention weights form an interpretable alignment matrix whose
off-diagonal mass shows reordering ("I love you" -> "je t'aime": t' attends to "you", aime to
"love"). Bahdanau (additive) and Luong (dot / general / concat) scoring are the two classic
variants.

Setup: ``synthetic_translation`` (English-like SVO -> French-like SOV with agreement and
adjective reordering, so alignments are non-monotonic; gold alignments are known). The same
GRU encoder-decoder (attnx.nn.RNNSeq2Seq) is trained with attention_type ∈ {bahdanau,
luong_dot, luong_general, luong_concat, none}, same hyper-parameters and budget, over seeds.
Reported: greedy-decoding sequence accuracy and corpus BLEU-4 on held-out sentences, and how
often the attention's argmax points at the gold source word (alignment accuracy); alignment
heatmaps for a few sentences, and the seed's I/love/you table.

Declared on the shared path: one ``Task`` (attnx.train.experiment) whose evaluators are
``"greedy_decode"`` (sequence accuracy, corpus BLEU-4; attnx.nn.greedy_decode) and, for the
attention variants, ``"alignment"`` (attnx.train.evaluators); the verdicts use the shared rule
(attnx.train.verdict) with the margins in ``config.margins``.

Presets (each the default changed by one small function, see PRESET_FNS):
  default
  python launch.py --config=experiments/translation.py:default --workdir=runs/translation
           5 attention types, 2 seeds, 1500 steps. Measured on 2 shared CPU cores: 123 s
           quiet, 182 s at a load average of ≈ 5; 209 s pinned to one core beside another
           run.
  tiny     python launch.py --config=experiments/translation.py:tiny --workdir=/tmp/tr_tiny
           bahdanau vs none, 512 pairs, 300 steps: 28–53 s measured at load ≈ 5; bahdanau
           0.60 sequence accuracy vs none 0.00, verdict inconclusive (2 seeds disagree).
Expected result: all attention variants beat "none" on sequence accuracy and BLEU at equal
budget; their alignments put most mass on the gold source word (well above the 1/len chance).
The verdict needs both halves, each by the shared rule (95 % paired t-interval over seeds):
every attention variant *better* than "none" on sequence accuracy and on BLEU-4 (margin
``margins.sequence_accuracy`` / ``margins.bleu``), and its alignment accuracy *better* than
uniform attention's chance (margin ``margins.alignment`` = ALIGN_MARGIN); it is inconclusive
if nothing was learned or the seeds cannot tell. Measured (default, seeds 1–2, data from
attnx.data's synthetic_translation): every attention variant 1.000 sequence accuracy and BLEU-4
vs none 0.581 / 0.667 (seeds 0.52 and 0.64: with 2 seeds the paired interval still straddles
0, inconclusive); alignment accuracy 0.55–0.83 vs chance 0.17 (better for Luong dot and concat,
inconclusive for Bahdanau and Luong general, 0.87 / 0.46 on its two seeds); pass
--config.num_seeds=4 or more for a decision (≈ 2× the runtime).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from attnx import nn, train  # noqa: E402
from attnx.data import synthetic_translation as st  # noqa: E402
from attnx.train import config as train_config  # noqa: E402
from attnx.train import experiment  # noqa: E402
from attnx.train.evaluators import corpus_bleu  # noqa: E402, F401  (re-exported)
from experiments import _common  # noqa: E402

PRESETS = ("default", "tiny")
ATTENTION_TYPES = ("bahdanau", "luong_dot", "luong_general", "luong_concat", "none")
EXAMPLES = ("i love you", "the big dog sees the cats", "she eats a red apple")
# Margin of the verdict rule for alignment accuracy against the uniform-attention chance
# (≈ 1/source length).
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
  _common.check_choices(config, "attention_types", list(config.attention_types),
                        ATTENTION_TYPES)
  _common.check_choices(config, "cell", [config.cell], ("gru", "lstm"))
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


def alignments(model, params_stacked, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
  """[seeds, B, T, S] teacher-forced attention weights."""
  fn = jax.jit(jax.vmap(lambda p: model.apply({"params": p}, src, tgt_in,
                                              return_alignment=True)[1]))
  return np.asarray(fn(params_stacked))


def judge(seq: dict[str, np.ndarray], bleu: dict[str, np.ndarray],
          align: dict[str, np.ndarray], chance: float, margins=None
          ) -> tuple[bool | None, str]:
  """Verdict and its text from per-seed sequence accuracy, BLEU-4 and alignment accuracy.

  Both halves of the claim must hold, each by the shared rule (attnx.train.verdict.compare):
  every attention variant is *better* than "none" on sequence accuracy and on BLEU (untested
  without "none"), and its alignment accuracy is *better* than the uniform-attention chance.
  False if any comparison is worse (or alignment within noise of chance), None (inconclusive)
  when the seeds cannot tell or no variant learned anything measurable.
  """
  margins = margins or dict(sequence_accuracy=0.01, bleu=0.01, alignment=ALIGN_MARGIN)
  seq = {k: np.atleast_1d(np.asarray(v, float)) for k, v in seq.items()}
  bleu = {k: np.atleast_1d(np.asarray(v, float)) for k, v in bleu.items()}
  align = {k: np.atleast_1d(np.asarray(v, float)) for k, v in align.items()}
  attn = list(align)
  n = len(next(iter(seq.values())))
  text = ("Sequence accuracy / BLEU-4 (seed means): " + "; ".join(
      f"{k} {seq[k].mean():.3f} / {bleu[k].mean():.3f}" for k in seq)
      + ". Alignment accuracy: " + ", ".join(f"{a} {v.mean():.2f}" for a, v in align.items())
      + f" (uniform attention: ≈ {chance:.2f}). ")
  if max(max(v.mean() for v in seq.values()), max(v.mean() for v in bleu.values())) \
      < LEARNED_MIN:
    return None, text + ("No variant learned anything measurable (sequence accuracy and BLEU "
                         f"< {LEARNED_MIN:g}): inconclusive, train longer.")
  text += (train.verdict.Comparison.rule(margins["sequence_accuracy"], n, "the metric")
           + f" Margins: sequence accuracy ±{margins['sequence_accuracy']:g}, BLEU-4 "
           f"±{margins['bleu']:g}, alignment accuracy against the uniform-attention chance "
           f"±{margins['alignment']:g}. ")
  improved = None
  if "none" in seq:
    comps = [train.verdict.compare(metric[a], metric["none"], margin=margins[m], a_name=a,
                                   b_name="none", metric=label)
             for a in attn for metric, m, label in ((seq, "sequence_accuracy",
                                                     "sequence accuracy"),
                                                    (bleu, "bleu", "BLEU-4"))]
    text += " ".join(c.sentence() + "." for c in comps) + " "
    if all(c.outcome == "better" for c in comps):
      improved = True
      text += "Every attention variant beats the plain encoder-decoder at equal budget. "
    elif any(c.outcome in ("worse", "within noise") for c in comps):
      improved = False
      text += "Not every attention variant beat the plain encoder-decoder. "
    else:
      text += "The seeds cannot tell whether every attention variant beats the plain one. "
  else:
    text += "No plain encoder-decoder was trained, so the improvement is untested. "
  acomps = {a: train.verdict.compare(align[a], np.full_like(align[a], chance),
                                     margin=margins["alignment"], a_name=a,
                                     b_name="uniform attention", metric="alignment accuracy")
            for a in attn}
  text += " ".join(c.sentence() + "." for c in acomps.values()) + " "
  weak = [a for a, c in acomps.items() if c.outcome in ("worse", "within noise")]
  unclear = [a for a, c in acomps.items() if c.outcome == "inconclusive"]
  if weak:
    text += f"Alignment not clearly above chance for {', '.join(weak)}."
  elif unclear:
    text += f"The seeds cannot tell whether alignment is above chance for {', '.join(unclear)}."
  else:
    text += "Every attention variant's alignment is well above chance (interpretable)."
  if weak or improved is False:
    return False, text
  if unclear or ("none" in seq and improved is None):
    return None, text
  return True, text


def _example_arrays(sentences: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list, list]:
  src, tgt_in, src_words, tgt_words = [], [], [], []
  for s in sentences:
    words = s.split()
    tw, _ = st.translate(words)
    src.append(st.encode(words, st.SOURCE_IDS))
    tgt = st.encode(tw, st.TARGET_IDS)
    tgt_in.append(st.shift_right(tgt[None])[0])
    src_words.append(words + ["<eos>"])
    tgt_words.append(tw + ["<eos>"])
  return np.stack(src), np.stack(tgt_in), src_words, tgt_words


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
  te = result.arrays["eval"]
  src, tgt_in, src_words, tgt_words = _example_arrays(config.examples)
  metrics: dict[str, dict[str, np.ndarray]] = {}
  histories, example_alignments = {}, {}
  for attention_type, fit in result.fits.items():
    histories[attention_type] = fit.history
    if attention_type != "none":  # with the test set before them: the same compiled shapes
      a = alignments(task.build_model(attention_type), fit.params,
                     jnp.asarray(np.concatenate([te["inputs"], src])),
                     jnp.asarray(np.concatenate([te["decoder_inputs"], tgt_in])))
      example_alignments[attention_type] = a[:, len(te["inputs"]):]
    metrics[attention_type] = {"train loss": fit.final_metrics["train_loss"],
                               **{_NAMES[k]: v for k, v in fit.final_metrics.items()
                                  if k in _NAMES},
                               "ms/step": 1e3 * fit.seconds_per_step}

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
  rows = [{"attention": k, **v} for k, v in metrics.items()]
  cols = ["attention", "sequence accuracy", "BLEU-4", "alignment accuracy", "mass on gold word",
          "train loss", "ms/step"]
  rep.table(rows, columns=cols, caption="held-out results, mean ± std over seeds")
  rep.figure(train.plot_learning_curves(histories, "loss", logy=True), "learning_curves",
             "Training loss (mean ± std over seeds).")

  attn_types = [a for a in config.attention_types if a != "none"]
  if attn_types:
    rep.section("Alignments")
    fig, axes = plt.subplots(len(attn_types), len(config.examples),
                             figsize=(3.2 * len(config.examples), 2.9 * len(attn_types)),
                             squeeze=False)
    tables = {}
    for r, a in enumerate(attn_types):
      al = example_alignments[a][0]
      for c, (sw, tw) in enumerate(zip(src_words, tgt_words, strict=True)):
        ax = axes[r, c]
        ax.imshow(al[c, :len(tw), :len(sw)], cmap="Greys", vmin=0, vmax=1)
        ax.set_xticks(range(len(sw)), sw, rotation=60, fontsize=7)
        ax.set_yticks(range(len(tw)), tw, fontsize=7)
        if c == 0:
          ax.set_ylabel(a, fontsize=9)
      tables[a] = al[0]
    fig.tight_layout()
    rep.figure(fig, "alignments", f"Teacher-forced attention weights (seed {config.seed}) "
               "for example sentences; rows: target words, columns: source words.")
    first = attn_types[0]
    sw, tw = src_words[0], tgt_words[0]
    rep.text(f"The seed's table for `{config.examples[0]}` ({first}, seed {config.seed}):")
    rep.table([{"": t, **{s: float(tables[first][i, j]) for j, s in enumerate(sw)}}
               for i, t in enumerate(tw)], floatfmt=".2f")

  seq = {k: float(np.mean(v["sequence accuracy"])) for k, v in metrics.items()}
  bleu = {k: float(np.mean(v["BLEU-4"])) for k, v in metrics.items()}
  results: dict[str, Any] = {"metrics": metrics, "sequence_accuracy": seq, "bleu": bleu}
  held = None
  if attn_types:
    chance = float(np.mean(1.0 / np.maximum((te["inputs"] != 0).sum(-1), 1)))
    align = {a: float(np.mean(metrics[a]["alignment accuracy"])) for a in attn_types}
    results["alignment_accuracy"] = align
    results["alignment_chance"] = chance
    held, text = judge({k: v["sequence accuracy"] for k, v in metrics.items()},
                       {k: v["BLEU-4"] for k, v in metrics.items()},
                       {a: metrics[a]["alignment accuracy"] for a in attn_types}, chance,
                       config.margins)
    rep.verdict(held, text)
  results["verdict"] = held
  results["seconds"] = time.time() - t0
  results["report"] = rep.write()
  _common.save_json(workdir, "translation.json", results)
  return results
