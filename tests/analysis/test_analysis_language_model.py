"""attnx.analysis.language_model: the introduction of a character language-model report (sizes,
positions per variant, packing, optimizer, seeds), the note on what each positions can read
beyond the context, and the checks of the settings the report reads. The report end to end:
tests/experiments/test_language_model.py."""

from __future__ import annotations

import ml_collections
import pytest

from attnx import nn
from attnx.analysis import language_model as lm_report
from attnx.nn import lm


def _config(**kw) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(
      packing="", num_steps=20, batch_size=8, seed=0, num_seeds=2, curve_windows=4,
      eval_every=10, eval_windows=0, context_multipliers=(1, 2, 4), length_verdicts=(4,),
      length_windows=4, margin=0.02, sink_threshold=0.3, small_weight=1e-3, heatmap_layer=-1))
  c.model = ml_collections.ConfigDict(dict(num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                                           context=16, positions="rotary", dropout_rate=0.0))
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=2, end_learning_rate_ratio=0.1, b2=0.99,
      weight_decay=0.1, grad_clip_norm=1.0))
  c.update(kw)
  return c


def test_the_introduction_names_sizes_positions_and_optimizer():
  specs = {w: nn.attention_spec(w) for w in ("softmax", "linear_elu")}
  text = lm_report.describe(_config(), specs, vocab_size=40, data="a.txt", model="GPT (small)",
                            closing="See the page.")
  assert text.startswith("Data: a.txt, vocabulary 40 characters, context 16. Model: GPT (small) "
                         "with 1 layer(s), 2 heads, width 16, MLP 32, tied embeddings, dropout 0, "
                         "rotary positions (learned for linear_elu: no rotary linear attention")
  assert ("20 steps of batch 8, AdamW lr 0.001 (warmup 2, cosine to 0.0001), β₂ 0.99, weight "
          "decay 0.1, gradient clip 1; seeds 0..1.") in text
  assert text.endswith("final metrics on every validation window. See the page.")
  study = {"softmax@none": lm.Positioned(specs["softmax"], "none")}
  packed = lm_report.describe(_config(packing="best_fit"), study, vocab_size=40, data="d",
                              documents="work", study=["none"])
  assert "; training rows pack each work apart (grain's best-fit packing" in packed
  assert "positions per variant (none)" in packed


def test_the_positions_note():
  assert "F@positions: rotary, none" in lm_report.positions_note("rotary", ["rotary", "none"])
  assert "(RoPE; " in lm_report.positions_note("rotary")
  assert "only 1× is evaluated" in lm_report.positions_note("learned")


@pytest.mark.parametrize("kw,match", [
    (dict(sink_threshold=1.0), "config.sink_threshold and config.small_weight"),
    (dict(small_weight=0.0), "config.sink_threshold and config.small_weight"),
    (dict(margin=0.0), "config.margin must be > 0"),
    (dict(heatmap_layer=1), "config.heatmap_layer=1 is not a layer of 1"),
    (dict(length_verdicts=(8,)), "config.length_verdicts"),
])
def test_report_settings_are_checked(kw, match):
  lm_report.check_config(_config(), None)
  with pytest.raises(ValueError, match=match):
    lm_report.check_config(_config(**kw), None)


def test_length_generalization_needs_the_text_it_reads():
  lm_report.check_config(_config(), 4 * 4 * 16)  # four windows of 4× the context of 16
  with pytest.raises(ValueError, match="fewer than one window at 4×"):
    lm_report.check_config(_config(), 63)
