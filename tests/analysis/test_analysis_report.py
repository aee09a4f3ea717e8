"""attnx.analysis.report: the statistics tables (per layer, per head, n/a for linear attention),
the heat-map figure, the language-model loss rows; and the "stream_loss" evaluator and the
length options check in attnx.train.evaluators that the language-model reports rest on."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import analysis, nn
from attnx.train import evaluators

NAN = float("nan")


def _metrics(sink, entropy_by_head, kurt):
  """Fake "attention_stats" metrics of 2 seeds × 1 layer × 2 heads."""
  m = {"sink_rate": np.array([[sink[0]], [sink[1]]])}
  for k in analysis.HEAD_STATS:
    m.setdefault(k, np.full((2, 1), 0.25))
    m[f"{k}_by_head"] = np.full((2, 1, 2), 0.5)
  m["entropy_by_head"] = np.asarray(entropy_by_head, float).reshape(2, 1, 2)
  m["max_kurtosis"] = m["mean_kurtosis"] = np.full((2, 1), kurt)
  return m


def test_statistics_rows_per_layer_and_per_head():
  lin = _metrics([NAN, NAN], [NAN] * 4, 4.0)
  for k in analysis.HEAD_STATS:
    lin[k] = np.full((2, 1), NAN)
  metrics = {"softmax": _metrics([0.0, 1.0], [1.0, 2.0, 3.0, 4.0], 3.0), "linear": lin}
  rows = analysis.statistics_rows(metrics, small=1e-3, label="weighting")
  assert [r["weighting"] for r in rows] == ["softmax", "linear"]
  assert rows[0]["sink rate"] == "0.500 ± 0.500" and rows[0]["max kurtosis"] == "3 ± 0"
  assert rows[0]["share < 0.001"] == "0.250 ± 0.000" and rows[1]["entropy (nats)"] == "n/a"
  assert rows[1]["max kurtosis"] == "4 ± 0"  # linear attention's hidden states are measured
  heads = analysis.statistics_rows(metrics, small=1e-3, label="weighting", per_head=True)
  assert [(r["weighting"], r["layer"], r["head"]) for r in heads] == [
      ("softmax", 0, 0), ("softmax", 0, 1), ("linear", 0, 0), ("linear", 0, 1)]
  # entropy_by_head [seed, layer, head]: head 0 has 1 and 3 over the seeds, head 1 has 2 and 4
  assert heads[0]["entropy (nats)"] == "2.000 ± 1.000" and heads[1]["entropy (nats)"] == (
      "3.000 ± 1.000")
  assert heads[2]["entropy (nats)"] == "n/a" and "max kurtosis" not in heads[0]


def test_plot_weights_one_panel_per_head_and_variant():
  w = np.random.default_rng(0).random((3, 5, 5))
  fig = analysis.plot_weights({"softmax": w, "linear_elu": None})
  axes = fig.axes
  assert len(axes) == 6 and axes[0].get_title() == "head 0"
  assert len(axes[0].images) == 1 and not axes[3].images  # linear: a note, no image
  assert axes[3].texts[0].get_text() == "n/a (linear)"


def test_plot_simplex_one_panel_per_map_coloured_by_support():
  from attnx import core

  maps = {"softmax": lambda z: jax.nn.softmax(z, -1), "sparsemax": core.sparsemax}
  fig = analysis.plot_simplex(maps, grid=5)
  panels = [ax for ax in fig.axes if ax.get_title()]
  assert [ax.get_title() for ax in panels] == ["softmax", "sparsemax"]
  supports = [ax.collections[0].get_array() for ax in panels]
  assert set(np.asarray(supports[0])) == {3}  # softmax never leaves the interior
  assert {1, 2} <= set(np.asarray(supports[1]))  # sparsemax reaches edges and vertices
  assert panels[0].get_legend_handles_labels()[1] == ["p(s/τ), τ: 0.05→20"]
  with pytest.raises(ValueError, match="three path scores"):
    analysis.plot_simplex(maps, path_scores=(1.0, 0.0))


def test_loss_rows_of_a_task_result():
  fit = lambda loss: types.SimpleNamespace(
      final_metrics={"loss": np.array(loss), "accuracy": np.array([0.5, 0.7])},
      seconds_per_step=0.5, compile_seconds=2.0)
  result = types.SimpleNamespace(
      fits={"softmax": fit([np.log(2), 3 * np.log(2)]), "relu": fit([1.0, 1.0])},
      comparisons={"relu": types.SimpleNamespace(outcome="worse")},
      failures={"sigmoid": "non-finite loss at step 3. More text"})
  rows = analysis.loss_rows(result, 64, label="weighting")
  assert rows[0]["val bpc"] == "2.0000 ± 1.0000" and rows[0]["tokens/s"] == 128
  assert rows[1]["vs softmax (val loss)"] == "worse" and "test loss (nats)" not in rows[0]
  assert rows[2] == {"weighting": "sigmoid", "val loss (nats)": "diverged",
                     "note": "non-finite loss at step 3"}


def test_stream_loss_is_the_mean_next_token_loss_of_each_stream():
  model = nn.GPT(vocab_size=7, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, max_len=4)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
  stacked = jax.tree.map(lambda a: a[None], params)
  stream = np.arange(14) % 7  # 3 windows of 4 (13 targets), the last token unused
  task = types.SimpleNamespace(eval_options=dict(context=4, loss_streams={"test": lambda: stream}))
  out = evaluators.make_eval_fn(("stream_loss",), model, {}, task)(stacked)
  x = stream[:12].reshape(3, 4)
  y = stream[1:13].reshape(3, 4)
  lp = jax.nn.log_softmax(model.apply({"params": params}, x), -1)
  ref = -np.take_along_axis(np.asarray(lp), y[..., None], -1).mean()
  np.testing.assert_allclose(out["test_loss"], [ref], rtol=1e-5)
  none = types.SimpleNamespace(eval_options=dict(context=4))
  assert evaluators.make_eval_fn(("stream_loss",), model, {}, none)(stacked) == {}


def test_length_options_name_the_config_keys():
  evaluators.check_length_options((1, 2, 4), (4,), 4, 16, available=64)
  with pytest.raises(ValueError, match=r"config.context_multipliers=\(2, 4\)"):
    evaluators.check_length_options((2, 4), (), 4, 16)
  with pytest.raises(ValueError, match=r"config.length_verdicts=\(8,\)"):
    evaluators.check_length_options((1, 2, 4), (8,), 4, 16)
  with pytest.raises(ValueError, match="config.length_windows=2"):
    evaluators.check_length_options((1, 2, 4), (4,), 2, 16)
  with pytest.raises(ValueError, match="shares 63 tokens.*at most 100.*split of 63.*4× = 64"):
    evaluators.check_length_options((1, 4), (4,), 0, 16, available=63, limit_tokens=100)
  evaluators.check_length_options((1, 4), (4,), 0, 16, available=None)  # not checked
