"""translation: corpus BLEU on hand-computed cases; tiny preset end to end."""

import json
import math
import os
import sys

import numpy as np
import pytest
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import translation as exp  # noqa: E402

CAND = "the cat sat on the mat".split()
REF = "the cat is on the mat".split()


def test_bleu_hand_computed():
  # Unigrams 5/6 match, bigrams 3/5 (the cat, on the, the mat), equal lengths: BP = 1.
  assert exp.corpus_bleu([CAND], [REF], max_n=2) == pytest.approx(math.sqrt(5 / 6 * 3 / 5))
  # Trigrams 1/4 (on the mat), no 4-gram match: unsmoothed BLEU-4 is 0.
  assert exp.corpus_bleu([CAND], [REF], max_n=3) == pytest.approx((5 / 6 * 3 / 5 / 4) ** (1 / 3))
  assert exp.corpus_bleu([CAND], [REF]) == 0.0
  # Brevity penalty: a 2-word hypothesis of a 6-word reference, all n-grams correct.
  assert exp.corpus_bleu([["the", "cat"]], [REF], max_n=2) == pytest.approx(math.exp(1 - 6 / 2))
  # Clipping: "the the the" against a reference with one "the" scores 1/3 unigram precision.
  assert exp.corpus_bleu([["the"] * 3], [["the", "cat", "sat"]], max_n=1) == pytest.approx(1 / 3)
  # Corpus level: counts are pooled before the geometric mean.
  assert exp.corpus_bleu([REF, REF], [REF, REF]) == pytest.approx(1.0)
  with pytest.raises(ValueError):
    exp.corpus_bleu([CAND], [])


def test_bad_config():
  c = exp.get_config("tiny")
  c.attention_types = ("bahdanau", "luong_fancy")
  with pytest.raises(ValueError, match="attention_types.*luong_concat"):
    exp.validate_config(c)
  c = exp.get_config("tiny")
  c.examples = ("the zebra sings",)
  with pytest.raises(ValueError, match="examples"):
    exp.validate_config(c)


@legs.experiment_run
def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  assert set(out["metrics"]) == {"bahdanau", "none"}
  for m in out["metrics"].values():
    assert np.all((m["BLEU-4"] >= 0) & (m["BLEU-4"] <= 1)) and m["BLEU-4"].shape == (2,)
  a = out["metrics"]["bahdanau"]["alignment accuracy"]
  assert np.all((a >= 0) & (a <= 1))
  # tiny learns: from ln(87) ≈ 4.47 (uniform over the target vocabulary) to ≈ 0.06-0.19
  # (bahdanau) and ≈ 1.0-1.25 (none) over seeds 1-3; bahdanau BLEU-4 0.64-0.94 per seed and
  # alignment accuracy 0.32-0.62 vs chance ≈ 0.17.
  uniform = math.log(len(exp.st.TARGET_VOCAB))
  for m in out["metrics"].values():
    assert np.all(np.asarray(m["train loss"]) < 0.5 * uniform)
  assert np.mean(out["metrics"]["bahdanau"]["BLEU-4"]) > 0.3
  assert out["alignment_accuracy"]["bahdanau"] > out["alignment_chance"] + exp.ALIGN_MARGIN
  # By the shared rule with 2 seeds (t = 12.7) the seeds' spread in tiny leaves the verdict
  # inconclusive (seed 1: 0.80 vs 0.02 sequence accuracy, seed 2: 0.47 vs 0.0); never "worse".
  assert out["verdict"] is not False
  assert "Verdict rule (attnx.train.verdict)" in results_text(tmp_path)
  results = json.loads((tmp_path / "results.json").read_text())
  rows = {r["attention"] for r in results["tables"][0]["rows"]}
  assert rows == {"bahdanau", "none"}
  # The seed-style alignment table for "i love you": rows je/te/aime/<eos>, columns the source.
  table = results["tables"][1]["rows"]
  assert [r[""] for r in table] == ["je", "te", "aime", "<eos>"]
  for r in table:
    assert sum(r[w] for w in ("i", "love", "you", "<eos>")) == pytest.approx(1.0, abs=1e-4)
  assert (tmp_path / "alignments.png").exists()


def results_text(path) -> str:
  return (path / "report.md").read_text()


def test_claim_needs_both_halves_and_learning():
  # Per-seed results, compared by the shared rule (attnx.train.verdict).
  held = lambda *args: exp.attention_claim(*args)[0].held
  seq = {"bahdanau": [0.8, 0.82], "none": [0.1, 0.11]}
  bleu = {"bahdanau": [0.9, 0.91], "none": [0.2, 0.22]}
  assert held(seq, bleu, {"bahdanau": [0.6, 0.62]}, 0.17) is True
  # Better translations but alignments at chance: the "interpretable alignment" half fails.
  claim, text = exp.attention_claim(seq, bleu, {"bahdanau": [0.17, 0.172]}, 0.17)
  assert claim.held is False and "not clearly above chance for bahdanau" in text
  assert "Verdict rule (attnx.train.verdict)" in text
  worse = {"bahdanau": [0.1, 0.1], "none": [0.2, 0.21]}
  assert held(worse, bleu, {"bahdanau": [0.6, 0.62]}, 0.17) is False
  # Seeds that disagree: the interval straddles 0 and reaches beyond the margin.
  noisy = {"bahdanau": [0.8, 0.1], "none": [0.1, 0.2]}
  claim, text = exp.attention_claim(noisy, bleu, {"bahdanau": [0.6, 0.62]}, 0.17)
  assert claim.held is None and "cannot tell" in text
  # Nothing learned anywhere: inconclusive, not "did not hold".
  zeros = {"bahdanau": [0.0, 0.0], "none": [0.0, 0.0]}
  claim, text = exp.attention_claim(zeros, zeros, {"bahdanau": [0.16, 0.16]}, 0.17)
  assert claim.held is None and not claim.tested and "inconclusive" in text
  # Without "none" only the alignment half is tested.
  claim, text = exp.attention_claim({"bahdanau": [0.8, 0.8]}, {"bahdanau": [0.9, 0.9]},
                                    {"bahdanau": [0.6, 0.61]}, 0.17)
  assert claim.held is True and "improvement is untested" in text


def test_task_declaration():
  c = exp.get_config("tiny")
  task = exp.make_task(c)
  assert task.evaluators == ("greedy_decode", "alignment")
  assert task.dataset == "synthetic_translation"
  assert task.data_kwargs["num_train"] == c.num_train and task.data_kwargs["seed"] == c.seed
  assert [v.skip_evaluators for v in exp.variants(c)] == [(), ("alignment",)]  # bahdanau, none
  assert task.metric == "sequence_accuracy" and task.margin == c.margins.sequence_accuracy
  assert task.eval_options["detokenize"] is exp.st.decode


def test_padding_is_ignored_in_the_training_loss_only():
  targets = np.array([[5, 6, 0]])
  arrays = {"train": {"targets": targets, "mask": targets != 0},
            "eval": {"targets": targets, "mask": targets != 0}}
  out = exp._loss_mask(arrays)
  np.testing.assert_array_equal(out["train"]["targets"], [[5, 6, exp.train.IGNORE_INDEX]])
  np.testing.assert_array_equal(out["eval"]["targets"], targets)
