"""experiments/language_model.py: the loss verdict, the length-generalization
windows and verdicts, the long-context evaluation through the streaming kernels (against dense
attention), the config checks, the tiny preset end to end (report, JSON, figures, attention
statistics per layer and head, sample.py printing text from a trained model), and a user's own
text file as the corpus (names, claim, prompt). The statistics themselves: tests/analysis."""

import importlib.util
import json
import math
import os
import sys
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import legs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attnx import analysis  # noqa: E402
from attnx.data import char_lm  # noqa: E402
from attnx.train import evaluators, verdict  # noqa: E402
from attnx.train.data import loader  # noqa: E402
from attnx.train.evaluate import evaluate  # noqa: E402
from experiments import language_model as exp  # noqa: E402


def test_the_loss_verdict():
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
  nan = float("nan")
  losses = {"softmax": [[1.5, 1.9, 2.4], [1.6, 2.0, 2.5]],  # +0.9 from 1× to 4×
            "ssmax": [[1.6, 1.7, 1.8], [1.7, 1.81, 1.91]],  # +0.2, +0.21: degrades less
            "same": [[1.0, 1.5, 1.9], [1.1, 1.6, 2.0]],  # +0.9 (lower loss, same increase)
            "linear_elu": [[1.7, nan, nan], [1.8, nan, nan]]}  # learned positions: n/a
  out = evaluators.length_comparisons(losses, (1, 2, 4), margin=0.02)
  assert set(out) == {"ssmax", "same"}
  assert out["ssmax"].outcome == "better" and out["ssmax"].diff == pytest.approx(0.695)
  assert out["same"].outcome == "within noise"
  assert "1×→4×" in out["ssmax"].metric
  # at=2: +0.4 (softmax) vs +0.1, +0.11: the 2× column, not the last one
  at2 = evaluators.length_comparisons(losses, (1, 2, 4), margin=0.02, at=2)
  assert at2["ssmax"].diff == pytest.approx(0.295) and "1×→2×" in at2["ssmax"].metric
  assert evaluators.length_comparisons(losses, (1, 2, 4), margin=0.02, at=1) == {}
  assert evaluators.length_comparisons(losses, (1,), margin=0.02) == {}  # only 1× evaluated
  assert evaluators.length_comparisons({"ssmax": losses["ssmax"]}, (1, 2, 4), 0.02) == {}
  with pytest.raises(ValueError, match="at=16"):
    evaluators.length_comparisons(losses, (1, 2, 4), margin=0.02, at=16)


def test_context_windows_cut_the_same_text_longer():
  tokens = np.arange(101)
  w = evaluators.context_windows(tokens, 8, (1, 2, 4, 16))
  assert [len(w[k]["inputs"]) for k in (1, 2, 4, 16)] == [12, 6, 3, 0]  # 16·8 > 100
  assert w[4]["inputs"].shape == (3, 32) and w[16]["inputs"].shape == (0, 128)
  np.testing.assert_array_equal(w[1]["inputs"][1], np.arange(8, 16))
  np.testing.assert_array_equal(w[4]["inputs"][1], np.arange(32, 64))
  np.testing.assert_array_equal(w[4]["targets"][1], np.arange(33, 65))
  assert len(evaluators.context_windows(tokens, 8, (4,), limit_tokens=64)[4]["inputs"]) == 2


def test_window_nll_batches_pad_and_match_a_float64_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 7, 5))  # [seeds, vocab-indexed table]: logits depend on x
  calls = []

  def fn(params, extra, x, y):  # a stand-in LM: logits = table[seed, token]
    calls.append(x.shape)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(lp[:, x], y[None, ..., None], axis=-1)[..., 0]
    return nll, (lp[:, x].argmax(-1) == y[None]).sum(-1)

  x, y = rng.integers(0, 5, (5, 4)), rng.integers(0, 5, (5, 4))
  out = evaluators.window_nll(fn, None, None, {"inputs": x, "targets": y}, tokens_per_batch=8)
  assert calls == [(2, 4)] * 3  # 5 windows in batches of 2, the last padded to the same shape
  lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ref = -np.take_along_axis(lp[:, x], y[None, ..., None], axis=-1)[..., 0]  # [seeds, N, T]
  np.testing.assert_allclose(out["position"], ref.mean(1))
  np.testing.assert_allclose(out["window"], ref.mean(2))
  np.testing.assert_allclose(out["accuracy"], (lp[:, x].argmax(-1) == y).mean((1, 2)))
  with pytest.raises(ValueError, match="non-empty shape"):
    evaluators.window_nll(fn, None, None, {"inputs": x[:0], "targets": y[:0]})


def test_length_table_and_octave_buckets_of_the_report():
  from attnx.train import report

  nan = float("nan")
  rows = report.length_rows({"a": [[1.0, 2.0], [3.0, 4.0]], "b": [[1.0, nan], [1.0, nan]]},
                            [64, 4096], "weighting")
  assert rows == [
      {"weighting": "a", "1× (64)": "2.0000 ± 1.0000", "64× (4096)": "3.0000 ± 1.0000"},
      {"weighting": "b", "1× (64)": "1.0000 ± 0.0000", "64× (4096)": "n/a"}]
  # Position p (1-based) holds the value p: each octave bucket's mean is the mean of its
  # positions, 1 | 2-3 | 4-7 | ... | 32-64 (a last bucket of one position joins the one before).
  x, v = report.position_buckets(np.tile(np.arange(1.0, 65.0), (2, 1)))
  bounds = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 64)]
  np.testing.assert_allclose(v[:, 0], [np.mean(np.arange(a, b + 1)) for a, b in bounds])
  np.testing.assert_allclose(x, [math.sqrt(a * b) for a, b in bounds])
  assert v.shape == (6, 2)
  x3, v3 = report.position_buckets(np.array([[5.0, 6.0, 7.0]]))  # 1 | 2-3
  np.testing.assert_allclose(v3[:, 0], [5.0, 6.5])


def _spy(monkeypatch, fn):
  """A Mock wrapping ``fn``, installed wherever an attnx module binds it (the dispatcher
  imports the kernels by name)."""
  spy = mock.Mock(wraps=fn)
  for name, module in list(sys.modules.items()):
    if name.startswith("attnx") and module is not None:
      for attr, value in list(vars(module).items()):
        if value is fn:
          monkeypatch.setattr(module, attr, spy)
  return spy


@pytest.mark.split_by_jax
@pytest.mark.parametrize("weighting,kind", [("softmax", "pointwise"),
                                            ("stick_breaking", "whole-row")])
def test_long_contexts_stream_and_equal_dense_attention(weighting, kind, monkeypatch):
  import jax

  from attnx.core.kernels.xla import pointwise as blocked
  from attnx.core.kernels.xla import rows as blocked_rows

  c = exp.get_config("tiny")
  c.model.context = 8  # 64× is 512 characters: past both streaming thresholds (256², 512²)
  model = exp.build_model(c, vocab_size=11)(exp.nn.attention_spec(weighting))
  params = model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
  # Two seeds of random parameters (std 0.3: sharp attention, so the weighting matters).
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(0)
  params = jax.tree.unflatten(tree, [0.3 * rng.standard_normal((2, *a.shape), np.float32)
                                     for a in leaves])
  stream = rng.integers(0, 11, 1100).astype(np.int32)
  monkeypatch.setattr(evaluators, "EVAL_TOKENS", 512)  # several batches per length
  spies = {"pointwise": _spy(monkeypatch, blocked.blocked_attention),
           "whole-row": _spy(monkeypatch, blocked_rows.blocked_row_attention)}
  # Count traces of the model (one per compiled program) through a proxy: jit's own cache
  # counters depend on its C++ fast path, which earlier tests in the process can turn off.
  made, traced = [], []

  class Counting:
    def apply(self, *args, **kwargs):
      traced.append(args[1].shape)
      return model.apply(*args, **kwargs)

  real = evaluators.token_nll_fn
  monkeypatch.setattr(evaluators, "token_nll_fn",
                      lambda m: made.append(real(Counting())) or made[-1])
  task = types.SimpleNamespace(eval_options=dict(
      token_stream=lambda: stream, context=8, context_multipliers=(1, 64), limit_tokens=None,
      length_windows=128))
  m = evaluators.make_eval_fn(("loss_by_length",), model, {}, task)(params)

  # The 512-long windows ran the streaming kernel of this kind of F, the 8-long ones did not,
  # and the dispatcher's own answer (attention_kernel, the report's column) says the same.
  calls = spies[kind].call_args_list
  assert calls and all(call.args[0].shape[-3] == 512 for call in calls)
  assert all(s.call_count == 0 for k, s in spies.items() if k != kind)
  assert (analysis.attention_kernel(model, 512), analysis.attention_kernel(model, 8)) == (
      "blocked", "dense")
  # One compiled program per length: 1100 tokens are 3 batches at 1× and 2 at 64×.
  assert len(made) == 1 and sorted(shape[-1] for shape in traced) == [8, 512]

  # Reference: the same parameters with dense attention on the same two 512-long windows,
  # the log-softmax in float64.
  win = evaluators.context_windows(stream, 8, (64,), 128 * 8)[64]
  assert len(win["inputs"]) == 2
  dense = model.clone(implementation="dense")
  nll = []
  for s in range(2):
    p = jax.tree.map(lambda a, s=s: a[s], params)
    z = np.asarray(dense.apply({"params": p}, win["inputs"]), np.float64)
    lp = z - z.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    nll.append(-np.take_along_axis(lp, win["targets"][..., None], -1)[..., 0])
  nll = np.asarray(nll)  # [seeds, windows, T]
  np.testing.assert_allclose(m["loss_by_context"][:, 1], nll.mean((1, 2)), rtol=1e-5)
  np.testing.assert_allclose(m["loss_by_position"], nll.mean(1), rtol=1e-4, atol=1e-5)
  assert m["loss_by_context"].shape == (2, 2) and np.isfinite(m["loss_by_context"]).all()


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
  c.length_windows = 4
  for bad in ((2, 4), (1, 4, 2), (1, 1, 2), (1, 2.5), (1, True), ()):
    c.context_multipliers = bad
    with pytest.raises(ValueError, match="config.context_multipliers.*increasing positive"):
      exp.validate_config(c)
  c.context_multipliers = (1, 2, 4)
  for bad in ((8,), (1,), (2, 3)):
    c.length_verdicts = bad
    with pytest.raises(ValueError, match=r"config.length_verdicts.*above 1, \(2, 4\)"):
      exp.validate_config(c)
  # 16× the context of 16 is 256 characters; the tiny text's validation split has 105.
  c.update(dict(context_multipliers=(1, 2, 4, 16), length_verdicts=(16,), length_windows=16))
  with pytest.raises(ValueError, match="split of 105.*fewer than one window at 16× = 256"):
    exp.validate_config(c)
  c.model.positions = "learned"  # evaluates 1× only: the length of the text does not matter
  exp.validate_config(c)
  survey = exp.get_config("survey")
  exp.validate_config(survey)  # every weighting and special variant builds a GPT
  names = survey.weightings.split(",")
  assert {"linear_elu", "linear_favor", "metric", "softpick", "stick_breaking"} <= set(names)
  d = exp.get_config()
  assert tuple(d.context_multipliers) == (1, 2, 4, 16, 64) and d.length_windows >= 64 * 4
  assert tuple(d.length_verdicts) == (16, 64)
  assert (d.model.num_layers, d.model.num_heads, d.model.hidden_dim, d.model.context,
          d.batch_size, d.num_steps, d.optimizer.learning_rate) == (4, 4, 128, 64, 12, 2000, 1e-3)


def test_implementation_applies_to_training_and_not_to_the_weight_probe():
  c = exp.get_config("tiny")
  c.implementation = "fast"
  with pytest.raises(ValueError, match="config.implementation='fast'; valid"):
    exp.validate_config(c)
  c.implementation = "blocked"
  exp.validate_config(c)
  build = exp.build_model(c, vocab_size=11)
  model = build(exp.nn.attention_spec("softmax"))
  assert model.implementation == "blocked" and build(
      exp.nn.attention_spec("linear_elu")).implementation is None
  tokens = jnp.arange(2 * 16).reshape(2, 16) % 11
  params = model.init(jax.random.key(0), tokens)["params"]
  probe = analysis.probe(model, params, tokens)  # blocked forms no weights: the dense kernel
  weights, hidden = probe.weights, probe.hidden
  assert len(weights) == c.model.num_layers and weights[0].shape == (2, c.model.num_heads, 16, 16)
  np.testing.assert_allclose(np.sum(weights[0], -1), 1.0, atol=1e-5)
  assert hidden[0].shape == (2, 16, c.model.hidden_dim)


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
  assert exp.task_name(exp.TINY_TEXT) == "tiny_text_char" == fin["task"]
  result = out["tasks"][fin["task"]]
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
    shared = evaluators.context_windows(char_lm.token_stream("validation", exp.TINY_TEXT),
                                        c.model.context, (1, 4),
                                        c.length_windows * c.model.context)
    assert [len(shared[k]["inputs"]) for k in (1, 4)] == [4, 1]
    assert len(result.arrays["eval"]["inputs"]) > 4  # so the subset is a real subset
    fn = evaluators.token_nll_fn(model)
    for i, k in ((0, 1), (2, 4)):
      np.testing.assert_allclose(
          m["loss_by_context"][:, i],
          evaluators.window_nll(fn, res.params, None, shared[k])["position"].mean(-1),
          rtol=1e-5)
    assert m["eval_seconds_by_context"].shape == (2, 3)
    assert np.all(m["eval_seconds_by_context"] > 0)
    # Short windows (16-64 characters) run the dense implementation, as the dispatcher says.
    assert fin["kernels"][name] == {16: "dense", 32: "dense", 64: "dense"}
    assert m["loss_by_position"].shape == (2, 4 * c.model.context)
    assert m["sink_rate"].shape == (2, 1) and np.all(m["max_kurtosis"] >= 1)
    assert m["entropy_by_head"].shape == m["max_weight_by_head"].shape == (2, 1, 2)
    if name == "softmax":  # row i: at most log(i + 1) nats, a maximum weight ≥ 1/(i + 1)
      assert np.all(m["entropy"] <= np.log(np.arange(1, 17)).mean() + 1e-5)
      assert np.all(m["max_weight"] >= (1 / np.arange(1, 17)).mean() - 1e-6)
    assert set(fin["attention"][name]) >= {"sink_rate", "entropy_by_head", "max_weight",
                                           "max_kurtosis", "zero_share_by_head"}
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
                  "Samples", "Verdicts", "1.88", "Zuhri", "Verdict rule", "entropy (nats)",
                  "max weight", "per weighting, layer and head", "tiny_text.txt"):
    assert heading in report, heading
  for fig in ("tiny_text_char_curves", "length_generalization", "attention_heatmap"):
    assert os.path.exists(os.path.join(wd, f"{fig}.png"))
  results = json.load(open(os.path.join(wd, "results.json")))
  # one per alternative weighting on the loss, one on the loss increase 1× → 4×
  assert len(results["verdicts"]) == 2
  inc = result.fits["relu:normalization=length"].final_metrics["loss_by_context"]
  ref = result.fits["softmax"].final_metrics["loss_by_context"]
  assert fin["length_outcomes"][4]["relu:normalization=length"] == verdict.compare(
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
  from attnx import nn, train

  c = exp.get_config("ablations")
  names = train.variant_list(c.weightings)
  assert names == list(exp.ABLATIONS) and len(names) == 6
  assert nn.attention_spec(names[2])["weighting"] == "sigmoid:normalization=none,bias=0"
  c.weightings = "softmax,sigmoid:normalization=none,bogus=1"
  with pytest.raises(ValueError, match="config.weightings"):
    exp.validate_config(c)


@pytest.mark.slow
@legs.experiment_run
def test_sequence_parallel_preset_trains_the_unsharded_losses(tmp_path):
  # The GPT with every training sequence cut over 8 fake CPU devices (zigzag ring attention)
  # against the same run on one device: the logged train and validation losses agree. One of
  # the preset's weightings beside the reference softmax, one whose F reads a global count
  # (SSMax's n_i): tests/core/test_ring.py checks every family's ring, sigmoid's global
  # b = −log n among them (test_sigmoid_uses_the_global_length).
  import subprocess  # noqa: PLC0415

  from support.scripts import cpu_env, metric_records  # noqa: PLC0415

  env = cpu_env(ATTNX_DATA_DIR=str(tmp_path / "data"))
  preset = "--config=experiments/language_model.py:sequence_parallel"
  two = "--config.weightings=softmax,ssmax"
  runs = {"sharded": [two], "whole": [two, "--config.sequence_parallel=1",
                                      "--config.parallel=none", "--config.num_cpu_devices=0"]}
  for name, extra in runs.items():
    proc = subprocess.run([sys.executable, "launch.py", preset, *extra,
                           f"--workdir={tmp_path / name}"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
  sharded, whole = metric_records(tmp_path / "sharded"), metric_records(tmp_path / "whole")
  assert sharded.keys() == whole.keys() and len(sharded) >= 2 * 4
  for key, rec in whole.items():
    for metric in ("loss", "eval_loss"):
      if metric in rec:
        np.testing.assert_allclose(sharded[key][metric], rec[metric], rtol=1e-5,
                                   err_msg=f"{key} {metric}")
  c = exp.get_config("sequence_parallel")
  assert (c.sequence_parallel, c.sequence_layout, c.num_cpu_devices) == (8, "zigzag", 8)


def test_sequence_parallel_config_checks():
  c = exp.get_config("sequence_parallel")
  exp.validate_config(c)
  c.weightings = "softmax,entmax15"  # the threshold of entmax needs every key: no ring
  with pytest.raises(ValueError, match="entmax15.*cannot run ring-parallel.*all_gather"):
    exp.validate_config(c)
  c.weightings = "softmax,linear_elu"
  with pytest.raises(ValueError, match="sequence_axis.*not to 'linear'"):
    exp.validate_config(c)
  c.weightings = "softmax"
  c.model.context = 40  # 2·8 zigzag chunks do not divide it
  with pytest.raises(ValueError, match=r"context=40 must be a multiple of 16 .*zigzag"):
    exp.validate_config(c)


# A user's own corpus: Python-like source, 60 small functions (≈ 2.3 kB).
SOURCE = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60))


def test_a_text_file_names_the_task_and_prompts_in_its_own_style(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  path = tmp_path / "tiny project.py"
  path.write_text(SOURCE)
  c = exp.get_config("tiny")
  c.update(dict(text_file=str(path)))
  c.sample.prompt = ""  # the tiny preset's "ROMEO:" off: the text's own
  assert exp.task_name(str(path)) == "tiny_project_char" and exp.task_name(None) == exp.TASK
  val = "".join(char_lm.vocabulary(str(path))[i]
                for i in char_lm.token_stream("validation", str(path)))
  prompt = exp.sample_prompt(c)
  # The first complete non-blank line of the validation text, cut at 20 characters.
  first = next(line for line in val.split("\n")[1:] if line.strip())
  assert prompt == first[:20] and 0 < len(prompt) <= 20 and prompt in SOURCE
  c.sample.prompt = "def g("
  assert exp.sample_prompt(c) == "def g("  # the user's prompt wins
  exp.validate_config(c)


@legs.experiment_run
def test_a_text_file_run_end_to_end(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  path = tmp_path / "tiny project.py"
  path.write_text(SOURCE)
  c = exp.get_config("tiny")
  c.update(dict(text_file=str(path), weightings="softmax", num_seeds=1, num_steps=4,
                eval_every=4, checkpoint_every=4, progress=False))
  c.sample.update(prompt="", num_tokens=12)
  wd = str(tmp_path / "wd")
  fin = exp.run(c, wd)["finish"]
  prompt = exp.sample_prompt(c)
  assert fin["task"] == "tiny_project_char" and fin["prompt"] == prompt
  assert fin["samples"]["softmax"].startswith(prompt)
  results = json.load(open(os.path.join(wd, "results.json")))
  assert results["claim"].endswith("a small character-level GPT trained on tiny project.py.")
  assert "tiny project.py" in results["title"] and "Shakespeare" not in results["claim"]
  assert "ROMEO" not in open(os.path.join(wd, "report.md")).read()
  assert os.path.exists(os.path.join(wd, "tiny_project_char_curves.png"))
  assert os.path.isdir(os.path.join(wd, "checkpoints", "tiny_project_char-softmax"))
  # sample.py finds the run and prints the report's sample from its checkpoint.
  sample = _sample_module()
  capsys.readouterr()
  assert sample.main([f"--workdir={wd}", "--list"]) == 0
  assert capsys.readouterr().out.split() == ["softmax"]
  s = c.sample
  assert sample.main([f"--workdir={wd}", f"--prompt={prompt}", f"--num_tokens={s.num_tokens}",
                      f"--temperature={s.temperature}", f"--top_k={s.top_k}", "--seed=0"]) == 0
  assert capsys.readouterr().out == fin["samples"]["softmax"] + "\n"


@legs.experiment_run
def test_a_corpus_directory_trains_packed_each_file_a_document(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  corpus = tmp_path / "project"
  corpus.mkdir()
  for i in range(60):  # one small function per file, shorter than half a context
    (corpus / f"f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n")
  c = exp.get_config("tiny")
  c.update(dict(text_file=str(corpus), packing="first_fit", weightings="softmax,sigmoid",
                num_seeds=1, num_steps=4, eval_every=4, checkpoint_every=4, progress=False))
  c.model.context = 64
  c.sample.update(prompt="def g(", num_tokens=8)
  exp.validate_config(c)
  text_file = exp.data_kwargs(c)["text_file"]
  rows = char_lm.packed_rows(text_file, c.model.context, c.packing)
  # Every file is a document: 60 of them, none longer than 38 characters, packed several to a
  # row of 64; the rows rebuild the files' training parts exactly, one segment each.
  assert rows["segment_ids"].max() >= 2 and len(rows["inputs"]) < 60
  vocab = char_lm.vocabulary(text_file)
  pieces = sorted("".join(vocab[t] for t in rows["inputs"][r][rows["segment_ids"][r] == s])
                  + vocab[rows["targets"][r][rows["segment_ids"][r] == s][-1]]
                  for r in range(len(rows["inputs"])) for s in set(rows["segment_ids"][r]) - {0})
  texts = [(corpus / f"f{i:02d}.py").read_text() for i in range(60)]
  parts = sorted(t[:int(len(t) * 0.9)] for t in texts)
  assert pieces == parts
  wd = str(tmp_path / "wd")
  fin = exp.run(c, wd)["finish"]
  assert fin["task"] == "project_char"
  assert all(np.isfinite(v).all() for v in fin["val_loss"].values())
  report = open(os.path.join(wd, "report.md")).read()
  assert "training rows pack each document apart (grain's first-fit packing" in report
  # Bad settings are named.
  c.packing = "next_fit"
  with pytest.raises(ValueError, match="config.packing='next_fit' is not a packing method"):
    exp.validate_config(c)
  c.packing, c.text_file = "first_fit", str(corpus / "missing.py")
  with pytest.raises(ValueError, match="config.text_file=.*missing.py.*does not exist"):
    exp.validate_config(c)
  c = exp.get_config("sequence_parallel")
  c.packing = "best_fit"
  with pytest.raises(ValueError, match="config.packing with config.sequence_parallel > 1"):
    exp.validate_config(c)


@legs.experiment_run
def test_the_positions_study_crosses_weightings_with_positions(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  c = exp.get_config("positions")
  specs = exp.variant_specs(c)
  assert list(specs) == [f"{w}@{p}" for w in exp.POSITION_WEIGHTINGS for p in exp.POSITION_KINDS]
  assert exp.reference_name(c) == "softmax@rotary" and c.num_seeds == 3
  for name, spec in specs.items():  # each variant's GPT has its own positions
    assert exp.build_model(c, 5)(spec).positions == name.split("@")[1]
  # The study end to end at the tiny size: 2 weightings x 2 positions, judged vs softmax@rotary.
  t = exp.get_config("tiny")
  t.update(dict(weightings="softmax,stick_breaking", position_study="rotary,none", num_seeds=1,
                num_steps=4, eval_every=4, checkpoint_every=4, context_multipliers=(1, 2),
                length_verdicts=(2,), progress=False))
  t.sample.num_tokens = 4
  fin = exp.run(t, str(tmp_path / "wd"))["finish"]
  variants = {"softmax@rotary", "softmax@none", "stick_breaking@rotary", "stick_breaking@none"}
  assert set(fin["val_loss"]) == variants and set(fin["outcomes"]) == variants - {
      "softmax@rotary"}
  assert set(fin["length_outcomes"][2]) == variants - {"softmax@rotary"}
  report = open(os.path.join(str(tmp_path / "wd"), "report.md")).read()
  assert "Verdicts: each variant vs softmax@rotary on validation loss" in report
  assert "Positions per variant (F@positions: rotary, none" in report
  # Bad studies are named.
  for study, match in (("rotary,rope", "position_study names 'rope'"),
                       ("none,none", "names a position twice")):
    t.position_study = study
    with pytest.raises(ValueError, match=match):
      exp.validate_config(t)
  t.update(position_study="alibi", weightings="softmax,linear_elu")
  with pytest.raises(ValueError, match="linear_elu cannot take other positions"):
    exp.validate_config(t)
