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

Command:
  python launch.py --config=experiments/translation.py:default --workdir=runs/translation
Expected runtime: default ≈ 2–2.5 min on 2 shared CPU cores (123 s measured), tiny ≈ 20–35 s.
Expected result: all attention variants beat "none" on sequence accuracy and BLEU at equal
budget; their alignments put most mass on the gold source word (well above the 1/len chance).
The verdict needs both halves: the improvement over "none", and alignment accuracy above
chance + ALIGN_MARGIN for every attention variant; it is inconclusive if nothing was learned.
"""

from __future__ import annotations

import collections
import math
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
from experiments import _common  # noqa: E402

PRESETS = ("default", "tiny")
ATTENTION_TYPES = ("bahdanau", "luong_dot", "luong_general", "luong_concat", "none")
EXAMPLES = ("i love you", "the big dog sees the cats", "she eats a red apple")
# Alignment accuracy must beat the uniform-attention chance (≈ 1/source length) by this much.
ALIGN_MARGIN = 0.1
# Below this sequence accuracy and BLEU for every variant, nothing was learned: no verdict.
LEARNED_MIN = 0.01


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  preset = _common.check_preset(preset, PRESETS)
  c = train.base_config()  # seed, num_seeds, parallel, progress, ... (launch.py)
  c.experiment = "translation"
  c.preset = preset
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
  if preset == "tiny":
    c.attention_types = ("bahdanau", "none")
    c.num_train = 512
    c.num_test = 64
    c.hidden_dim = 32
    c.embed_dim = 16
    # Just enough to learn something measurable (train loss ≈ 4.1 → ≈ 0.1–1.2) in ≈ 20–30 s.
    c.num_steps = 300
    c.learning_rate = 1e-2
    c.batch_size = 32
  return c


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


# ------------------------------------------------------------------------------------------
# Corpus BLEU (Papineni et al. 2002): clipped n-gram precisions summed over the corpus,
# geometric mean over n = 1..max_n, brevity penalty from total lengths. No smoothing.
# ------------------------------------------------------------------------------------------

def _ngrams(words: Sequence[str], n: int) -> collections.Counter:
  return collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def corpus_bleu(hypotheses: Sequence[Sequence[str]], references: Sequence[Sequence[str]],
                max_n: int = 4) -> float:
  """Corpus-level BLEU in [0, 1] with one reference per sentence."""
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
  matches, totals = [0] * max_n, [0] * max_n
  hyp_len = ref_len = 0
  for hyp, ref in zip(hypotheses, references, strict=True):
    hyp_len += len(hyp)
    ref_len += len(ref)
    for n in range(1, max_n + 1):
      h, r = _ngrams(hyp, n), _ngrams(ref, n)
      matches[n - 1] += sum(min(c, r[g]) for g, c in h.items())
      totals[n - 1] += max(len(hyp) - n + 1, 0)
  if hyp_len == 0 or min(matches) == 0:
    return 0.0
  log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / max_n
  bp = 1.0 if hyp_len > ref_len else math.exp(1.0 - ref_len / hyp_len)
  return bp * math.exp(log_p)


# ------------------------------------------------------------------------------------------

def _data(config) -> tuple[dict, dict]:
  kw = dict(p_pronoun=config.p_pronoun, p_adjective=config.p_adjective)
  tr = st.make_synthetic_translation(config.num_train, config.seed, **kw)
  te = st.make_synthetic_translation(config.num_test, 10_000 + config.seed, **kw)
  # PAD positions do not count in the loss (greedy decoding stops at EOS anyway).
  train_arrays = {"inputs": tr["inputs"], "decoder_inputs": tr["decoder_inputs"],
                  "targets": np.where(tr["mask"], tr["targets"], train.IGNORE_INDEX)}
  return train_arrays, te


def _model(config, attention_type: str) -> nn.RNNSeq2Seq:
  return nn.RNNSeq2Seq(src_vocab_size=len(st.SOURCE_VOCAB), tgt_vocab_size=len(st.TARGET_VOCAB),
                       embed_dim=config.embed_dim, hidden_dim=config.hidden_dim,
                       cell=config.cell, attention_type=attention_type,
                       weighting=config.weighting)


def greedy_decode(model, params_stacked, src: np.ndarray) -> np.ndarray:
  """[seeds, B, T] greedy output tokens; the decoder is causal, so rerunning it on the growing
  BOS-prefixed, PAD-filled prefix gives step i's prediction at position i."""
  t = src.shape[1]

  def one(params):
    prefix = jnp.zeros_like(src).at[:, 0].set(st.BOS_ID)

    def step(i, carry):
      prefix, out = carry
      tok = jnp.argmax(model.apply({"params": params}, src, prefix)[:, i], -1).astype(src.dtype)
      out = out.at[:, i].set(tok)
      nxt = jnp.minimum(i + 1, t - 1)
      prefix = prefix.at[:, nxt].set(jnp.where(i + 1 < t, tok, prefix[:, nxt]))
      return prefix, out

    return jax.lax.fori_loop(0, t, step, (prefix, jnp.zeros_like(src)))[1]

  return np.asarray(jax.jit(jax.vmap(one))(params_stacked))


def alignments(model, params_stacked, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
  """[seeds, B, T, S] teacher-forced attention weights."""
  fn = jax.jit(jax.vmap(lambda p: model.apply({"params": p}, src, tgt_in,
                                              return_alignment=True)[1]))
  return np.asarray(fn(params_stacked))


def evaluate(model, params, te: dict, attention_type: str,
             examples: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
  """Per-seed sequence accuracy, BLEU and alignment accuracy on the test set, and the
  alignments [seeds, E, T, S] of the ``examples`` (src, tgt_in), computed in the same call."""
  out = greedy_decode(model, params, jnp.asarray(te["inputs"]))
  refs = [st.decode(r) for r in te["targets"]]
  seq_acc, bleu = [], []
  for per_seed in out:
    hyps = [st.decode(h) for h in per_seed]
    seq_acc.append(np.mean([h == r for h, r in zip(hyps, refs, strict=True)]))
    bleu.append(corpus_bleu(hyps, refs))
  res = {"sequence accuracy": np.asarray(seq_acc), "BLEU-4": np.asarray(bleu)}
  example_alignments = None
  if attention_type != "none":
    src, tgt_in = te["inputs"], te["decoder_inputs"]
    if examples is not None:  # one compiled call for both
      src, tgt_in = np.concatenate([src, examples[0]]), np.concatenate([tgt_in, examples[1]])
    a = alignments(model, params, jnp.asarray(src), jnp.asarray(tgt_in))
    a, example_alignments = a[:, :len(te["inputs"])], a[:, len(te["inputs"]):]
    gold = te["alignment"]  # [B, T], −1 at padding
    ok = gold >= 0
    hit = (a.argmax(-1) == gold[None]) & ok[None]
    res["alignment accuracy"] = hit.sum((1, 2)) / ok.sum()
    # Mass on the gold source word (the quantity the seed's table shows).
    mass = np.take_along_axis(a, np.maximum(gold, 0)[None, ..., None], -1)[..., 0]
    res["mass on gold word"] = (mass * ok[None]).sum((1, 2)) / ok.sum()
  return res, example_alignments


def judge(seq: dict[str, float], bleu: dict[str, float], align: dict[str, float],
          chance: float) -> tuple[bool | None, str]:
  """Verdict and its text from mean sequence accuracy, BLEU-4 and alignment accuracy.

  Both halves of the claim must hold: every attention variant beats "none" on sequence accuracy
  and BLEU (untested without "none"), and its alignment accuracy exceeds chance by
  ALIGN_MARGIN. Inconclusive (None) when no variant learned anything measurable.
  """
  attn = list(align)
  text = ("Sequence accuracy / BLEU-4: " + "; ".join(f"{k} {seq[k]:.3f} / {bleu[k]:.3f}"
                                                    for k in seq)
          + ". Alignment accuracy: " + ", ".join(f"{a} {v:.2f}" for a, v in align.items())
          + f" (uniform attention: ≈ {chance:.2f}; required: > {chance + ALIGN_MARGIN:.2f}). ")
  if max(max(seq.values()), max(bleu.values())) < LEARNED_MIN:
    return None, text + ("No variant learned anything measurable (sequence accuracy and BLEU "
                         f"< {LEARNED_MIN:g}): inconclusive, train longer.")
  improved = None
  if "none" in seq:
    improved = all(seq[a] > seq["none"] and bleu[a] > bleu["none"] for a in attn)
    text += ("Every attention variant beats the plain encoder-decoder at equal budget. "
             if improved else "Not every attention variant beat the plain encoder-decoder. ")
  else:
    text += "No plain encoder-decoder was trained, so the improvement is untested. "
  weak = [a for a in attn if align[a] <= chance + ALIGN_MARGIN]
  text += ("Every attention variant's alignment is well above chance (interpretable)."
           if not weak else f"Alignment not clearly above chance for {', '.join(weak)}.")
  return (not weak) and improved is not False, text


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
  train_arrays, te = _data(config)
  optimizer = train.optimizer_config(name="adam", learning_rate=config.learning_rate,
                                     schedule="warmup_cosine",
                                     warmup_steps=max(config.num_steps // 20, 1),
                                     weight_decay=0.0, grad_clip_norm=1.0)
  src, tgt_in, src_words, tgt_words = _example_arrays(config.examples)
  metrics: dict[str, dict[str, np.ndarray]] = {}
  histories, example_alignments = {}, {}
  for attention_type in config.attention_types:
    model = _model(config, attention_type)
    fit_config = train.FitConfig.from_config(
        config, loss="softmax_xent", optimizer=optimizer,
        log_every=max(config.num_steps // 30, 1), tensorboard=False)
    fit = train.fit(model, train_data=train.loader(train_arrays, config.batch_size,
                                                   config.data_pipeline),
                    config=fit_config, name=attention_type, workdir=workdir)
    histories[attention_type] = fit.history
    res, example_alignments[attention_type] = evaluate(model, fit.params, te, attention_type,
                                                       (src, tgt_in))
    metrics[attention_type] = {"train loss": fit.final_metrics["train_loss"], **res,
                               "ms/step": 1e3 * fit.seconds_per_step}

  rep.section("Setup")
  rep.text(f"`synthetic_translation` generated with `make_synthetic_translation` "
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
    held, text = judge(seq, bleu, align, chance)
    rep.verdict(held, text)
  results["verdict"] = held
  results["seconds"] = time.time() - t0
  results["report"] = rep.write()
  _common.save_json(workdir, "translation.json", results)
  return results
