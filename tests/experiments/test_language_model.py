"""experiments/language_model.py: bits per character and the verdict, the attention statistics
on a hand-computed example, the length-generalization windows, and the tiny preset end to end
(report, JSON, figures, sample.py printing text from a trained model)."""

import importlib.util
import json
import math
import os
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attnx.train import verdict  # noqa: E402
from attnx.train.data import loader  # noqa: E402
from attnx.train.evaluate import evaluate  # noqa: E402
from experiments import language_model as exp  # noqa: E402


def test_bits_per_char_and_the_loss_verdict():
  assert np.allclose(exp.bits_per_char([math.log(2), 2 * math.log(2)]), [1.0, 2.0])
  assert float(exp.bits_per_char(exp.NANOGPT_VAL_LOSS)) == pytest.approx(2.7123, abs=1e-4)
  soft = np.array([1.90, 1.91, 1.92])
  # Lower is better: a loss 0.1 nats above softmax in every seed is "worse", one within a few
  # thousandths "within noise" (margin 0.02), and two seeds that disagree "inconclusive".
  worse = verdict.compare(soft + 0.1, soft, margin=0.02, higher_is_better=False)
  same = verdict.compare(soft + [0.001, 0.002, 0.0015], soft, margin=0.02,
                         higher_is_better=False)
  better = verdict.compare(soft - 0.1, soft, margin=0.02, higher_is_better=False)
  unclear = verdict.compare([1.8, 2.0], [1.9, 1.9], margin=0.02, higher_is_better=False)
  assert (worse.outcome, same.outcome, better.outcome, unclear.outcome) == (
      "worse", "within noise", "better", "inconclusive")
  assert worse.not_worse is False and better.diff == pytest.approx(0.1)


def test_length_comparisons_judge_the_loss_increase():
  def fit(loss_by_context):
    return types.SimpleNamespace(final_metrics={"loss_by_context": np.asarray(loss_by_context)})

  nan = float("nan")
  fits = {"softmax": fit([[1.5, 1.9, 2.4], [1.6, 2.0, 2.5]]),  # +0.9 from 1× to 4×
          "ssmax": fit([[1.6, 1.7, 1.8], [1.7, 1.81, 1.91]]),  # +0.2, +0.21: degrades less
          "same": fit([[1.0, 1.5, 1.9], [1.1, 1.6, 2.0]]),  # +0.9 (lower loss, same increase)
          "linear_elu": fit([[1.7, nan, nan], [1.8, nan, nan]])}  # learned positions: n/a
  out = exp.length_comparisons(fits, (1, 2, 4), margin=0.02)
  assert set(out) == {"ssmax", "same"}
  assert out["ssmax"].outcome == "better" and out["ssmax"].diff == pytest.approx(0.695)
  assert out["same"].outcome == "within noise"
  assert exp.length_comparisons(fits, (1,), margin=0.02) == {}
  assert exp.length_comparisons({"ssmax": fits["ssmax"]}, (1, 2, 4), margin=0.02) == {}


def test_attention_statistics_on_a_hand_computed_example():
  w = np.zeros((1, 2, 3, 3))
  # head 0: a sink (mean weight on key 0 over the 3 queries = (1 + .5 + .2) / 3 = .567 > .3)
  w[0, 0] = [[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]
  # head 1: none (mean .0005 / 3); two causal zeros and one weight below 1e-3
  w[0, 1] = [[0, 0, 0], [0, 1, 0], [0.0005, 0.4995, 0.5]]
  s = {k: float(v) for k, v in exp.attention_statistics(w, 0.3, 1e-3).items()}
  # 12 causal entries (6 per head); the 6 above the diagonal do not count
  assert s == pytest.approx({"sink_rate": 0.5, "zero_share": 2 / 12, "small_share": 3 / 12})
  assert float(exp.attention_statistics(w, 0.6)["sink_rate"]) == 0.0
  # Pearson kurtosis over the hidden axis: ±1 -> m4/m2² = 1; one spike of 2 among 8 features:
  # mean 1/4, m2 = 7/16, m4 = 301/256, kurtosis = (301/256) / (49/256) = 43/7.
  h = np.array([[[1.0, -1, 1, -1, 1, -1, 1, -1], [2.0, 0, 0, 0, 0, 0, 0, 0]]])
  assert np.allclose(exp.kurtosis(h), [[1.0, 43 / 7]], rtol=1e-5)


def test_context_windows_cut_the_same_text_longer():
  tokens = np.arange(101)
  w = exp.context_windows(tokens, 8, (1, 2, 4))
  assert [len(w[k]["inputs"]) for k in (1, 2, 4)] == [12, 6, 3]
  assert w[4]["inputs"].shape == (3, 32)
  np.testing.assert_array_equal(w[1]["inputs"][1], np.arange(8, 16))
  np.testing.assert_array_equal(w[4]["inputs"][1], np.arange(32, 64))
  np.testing.assert_array_equal(w[4]["targets"][1], np.arange(33, 65))
  assert len(exp.context_windows(tokens, 8, (4,), limit_tokens=64)[4]["inputs"]) == 2


def test_config_checks_and_positions():
  c = exp.get_config("tiny")
  c.weightings = "relu,softpick"
  with pytest.raises(ValueError, match="must include softmax"):
    exp.validate_config(c)
  c.weightings = "softmax,nope"
  with pytest.raises(ValueError, match="config.weightings: Unknown"):
    exp.validate_config(c)
  c.weightings = "softmax"
  for bad in (2, -1):  # fewer windows than one at 4×; negative
    c.length_windows = bad
    with pytest.raises(ValueError, match="config.length_windows"):
      exp.validate_config(c)
  survey = exp.get_config("survey")
  exp.validate_config(survey)  # every weighting and special variant builds a GPT
  names = survey.weightings.split(",")
  assert {"linear_elu", "linear_favor", "metric", "softpick", "stick_breaking"} <= set(names)
  assert exp.positions_for(exp.nn.attention_spec("linear_elu"), "rotary") == "learned"
  assert exp.positions_for(exp.nn.attention_spec("metric"), "rotary") == "rotary"
  d = exp.get_config()
  assert (d.model.num_layers, d.model.num_heads, d.model.hidden_dim, d.model.context,
          d.batch_size, d.num_steps, d.optimizer.learning_rate) == (4, 4, 128, 64, 12, 2000, 1e-3)


def _sample_module():
  spec = importlib.util.spec_from_file_location("sample", os.path.join(ROOT, "sample.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_tiny_preset_end_to_end(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  c = exp.get_config("tiny")
  c.update(dict(progress=False, num_steps=10, eval_every=10, checkpoint_every=10))
  wd = str(tmp_path / "wd")
  out = exp.run(c, wd)
  fin = out["finish"]
  assert set(fin["val_loss"]) == {"softmax", "relu:normalization=length"}
  assert fin["test_loss"] == {}  # a text file has no test split
  result = out["tasks"][exp.TASK]
  for name, res in result.fits.items():
    m = res.final_metrics
    assert m["loss_by_context"].shape == (2, 3) and np.isfinite(m["loss_by_context"]).all()
    # The one 1× pass of the token stream gives the loss and accuracy that the generic
    # evaluation (attnx.train.evaluate) computes on the dataset's validation windows ...
    model = result.task.build_model(exp.nn.attention_spec(name))
    generic = evaluate(model, res.params, loader(result.arrays["eval"], 3),
                       ("loss", "accuracy"))
    np.testing.assert_allclose(m["loss"], generic["loss"], rtol=1e-5)
    np.testing.assert_allclose(m["accuracy"], generic["accuracy"], rtol=1e-6)
    # ... and the 1× entry of the length table is the loss on the shared first
    # length_windows windows, the text that 2× and 4× cut longer (a separate pass here).
    shared = exp.context_windows(exp.token_stream("validation", exp.TINY_TEXT),
                                 c.model.context, (1, 4), c.length_windows * c.model.context)
    assert [len(shared[k]["inputs"]) for k in (1, 4)] == [4, 1]
    assert len(result.arrays["eval"]["inputs"]) > 4  # so the subset is a real subset
    fn = exp._token_nll(model)
    for i, k in ((0, 1), (2, 4)):
      np.testing.assert_allclose(
          m["loss_by_context"][:, i],
          exp.window_nll(fn, res.params, None, shared[k])["position"].mean(-1), rtol=1e-5)
    assert m["loss_by_position"].shape == (2, 4 * c.model.context)
    assert m["sink_rate"].shape == (2, 1) and np.all(m["max_kurtosis"] >= 1)
    assert np.allclose(fin["val_bpc"][name], np.asarray(m["loss"]) / math.log(2))
  # The verdict of relu vs softmax is the shared rule on validation loss, lower is better.
  c_relu = result.comparisons["relu:normalization=length"]
  again = verdict.compare(result.fits["relu:normalization=length"].final_metrics["loss"],
                          result.fits["softmax"].final_metrics["loss"], margin=0.02,
                          higher_is_better=False)
  assert c_relu.outcome == again.outcome == fin["outcomes"]["relu:normalization=length"]
  assert all(t.startswith("ROMEO:") and len(t) == 6 + 40 for t in fin["samples"].values())

  report = open(out["report"]).read()
  for heading in ("Loss per weighting", "Length generalization", "Attention statistics",
                  "Samples", "Verdicts", "1.88", "Zuhri", "Verdict rule"):
    assert heading in report, heading
  for fig in ("shakespeare_char_curves", "length_generalization", "attention_heatmap"):
    assert os.path.exists(os.path.join(wd, f"{fig}.png"))
  results = json.load(open(os.path.join(wd, "results.json")))
  # one per alternative weighting on the loss, one on the loss increase 1× → 4×
  assert len(results["verdicts"]) == 2
  inc = result.fits["relu:normalization=length"].final_metrics["loss_by_context"]
  ref = result.fits["softmax"].final_metrics["loss_by_context"]
  assert fin["length_outcomes"]["relu:normalization=length"] == verdict.compare(
      inc[:, 2] - inc[:, 0], ref[:, 2] - ref[:, 0], margin=0.02,
      higher_is_better=False).outcome
  assert json.load(open(os.path.join(wd, "language_model.json")))["runs"] == {
      "softmax": "softmax", "relu:normalization=length": "relu_normalization_length"}

  # sample.py reads what the experiment saved and prints the same seeded sample.
  sample = _sample_module()
  s = c.sample
  capsys.readouterr()  # the training log
  code = sample.main([f"--workdir={wd}", "--run=relu_normalization_length",
                      f"--prompt={s.prompt}", f"--num_tokens={s.num_tokens}",
                      f"--temperature={s.temperature}", f"--top_k={s.top_k}", "--seed=0"])
  printed = capsys.readouterr()
  assert code == 0, printed.err
  assert printed.out == fin["samples"]["relu:normalization=length"] + "\n"
  assert "step 10" in printed.err


def test_ablations_preset_keeps_parameters_with_their_variant():
  from attnx import nn
  from experiments import _common

  c = exp.get_config("ablations")
  names = _common.variant_list(c.weightings)
  assert names == list(exp.ABLATIONS) and len(names) == 6
  assert nn.attention_spec(names[2])["weighting"] == "sigmoid:normalization=none,bias=0"
  assert _common.variant_list("softmax, relu:normalization=none ,bias=1,ssmax") == [
      "softmax", "relu:normalization=none,bias=1", "ssmax"]
  assert _common.variant_list("bias=0,softmax") == ["bias=0", "softmax"]  # nothing to continue
  c.weightings = "softmax,sigmoid:normalization=none,bogus=1"
  with pytest.raises(ValueError, match="config.weightings"):
    exp.validate_config(c)
