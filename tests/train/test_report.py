"""attnx.train.report: Report, tables, figures, verdicts, learning-curve plots."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np
import pytest

from attnx import train


def test_mean_std():
  assert train.mean_std([0.95, 0.96]) == "0.955 ± 0.005"
  assert train.mean_std([0.5]) == "0.5"
  assert train.mean_std([]) == "n/a"


def test_report_writes_markdown_json_and_png(tmp_path):
  cfg = ml_collections.ConfigDict({"lr": 0.1, "weightings": "softmax,relu"})
  rep = train.Report("My experiment", str(tmp_path), config=cfg, claim="relu matches softmax")
  rep.section("Results")
  rep.text("Same budget for every weighting.")
  rows = [{"weighting": "softmax", "accuracy": np.array([0.9, 0.92]), "ms/step": 1.23456},
          {"weighting": "re|lu", "accuracy": np.array([0.88, 0.9]), "ms/step": 2.0}]
  rep.table(rows, caption="final accuracy", floatfmt=".3g")
  hist = {"softmax": [{"step": 10, "loss": [1.0, 1.2]}, {"step": 20, "loss": [0.5, 0.7]}],
          "relu": [{"step": 10, "loss": [1.1, 1.3]}, {"step": 20, "loss": [0.6, 0.8]},
                   {"step": 20, "eval_accuracy": [0.5, 0.6]}]}
  fig = train.plot_learning_curves(hist, "loss", logy=True, title="train loss")
  assert len(fig.axes[0].lines) == 2
  rep.figure(fig, "curves", "learning curves")
  rep.verdict(False, "relu is 2 points lower")
  path = rep.write()
  md = open(path).read()
  assert path == os.path.join(str(tmp_path), "report.md")
  assert "# My experiment" in md and "**Claim under test:** relu matches softmax" in md
  assert "| weighting | accuracy | ms/step |" in md
  assert "| softmax | 0.91 ± 0.01 | 1.23 |" in md and "re\\|lu" in md
  assert "![learning curves](curves.png)" in md and (tmp_path / "curves.png").stat().st_size > 0
  assert "**Claim did not hold:** relu is 2 points lower" in md
  assert "| jax |" in md and "cores" in md and "Command:" in md
  res = json.load(open(tmp_path / "results.json"))
  assert res["verdicts"] == [{"held": False, "text": "relu is 2 points lower"}]
  assert res["tables"][0]["columns"] == ["weighting", "accuracy", "ms/step"]
  assert res["tables"][0]["rows"][0]["accuracy"] == [0.9, 0.92]
  assert res["config"]["lr"] == 0.1 and res["environment"]["versions"]["flax"]


def test_markdown_table_exact_text_and_custom_format():
  rows = [{"impl": "blocked", "time ms": 1.23456, "seeds": np.array([0.5, 0.7])},
          {"impl": "a|b", "time ms": 1234.5}]
  assert train.markdown_table(rows, caption="Timings") == (
      "*Timings*\n"
      "\n"
      "| impl | time ms | seeds |\n"
      "|---|---|---|\n"
      "| blocked | 1.235 | 0.6 ± 0.1 |\n"
      "| a\\|b | 1234 |  |\n")  # pipes escaped, a missing cell empty
  # A benchmark's own number format (kernel_benchmark's), applied to every cell.
  text = train.markdown_table(rows, ["time ms", "impl"],
                              fmt=lambda v: f"{v:.0f}" if isinstance(v, float) else str(v))
  assert text == "| time ms | impl |\n|---|---|\n| 1 | blocked |\n| 1234 | a\\|b |\n"


def test_report_table_returns_its_markdown_and_save_json(tmp_path):
  rep = train.Report("t", str(tmp_path))
  rows = [{"x": 1.0}]
  text = rep.table(rows, fmt=lambda v: f"<{v}>")
  assert text == "| x |\n|---|\n| <1.0> |\n" and text in rep.markdown()
  payload = {"a": np.float32(0.5), "b": np.arange(3), "c": float("nan"), (1, 2): ("u", None),
             "cfg": ml_collections.ConfigDict({"lr": 0.1}), "obj": object}
  path = rep.save_json("numbers", payload)
  assert path == os.path.join(str(tmp_path), "numbers.json")
  with open(path) as f:
    assert json.load(f) == {"a": 0.5, "b": [0, 1, 2], "c": "nan", "(1, 2)": ["u", None],
                            "cfg": {"lr": 0.1}, "obj": "<class 'object'>"}
  rep.write()
  with open(tmp_path / "results.json") as f:
    assert json.load(f)["data_files"] == ["numbers.json"]


def test_plot_curves_one_line_per_variant_with_seed_bands(tmp_path):
  x = np.array([1, 2, 4, 8])
  curves = {"softmax": (x, np.array([[0.5, 0.7], [0.6, 0.8], [0.7, 0.9], [0.8, 1.0]])),
            "relu": (x, np.array([0.4, 0.5, 0.6, 0.7]))}  # one seed: no band
  fig = train.plot_curves(curves, xlabel="width", ylabel="accuracy", logx=2, hline=0.9,
                          references={"chance": (x, np.full(4, 0.1))}, title="acc vs width")
  ax = fig.axes[0]
  lines = {ln.get_label(): ln for ln in ax.lines}
  assert {"softmax", "relu", "chance"} <= set(lines)
  np.testing.assert_allclose(lines["softmax"].get_ydata(), [0.6, 0.7, 0.8, 0.9])  # seed means
  assert len(ax.collections) == 1  # one ±std band: softmax's
  band = ax.collections[0].get_paths()[0].vertices[:, 1]
  assert band.min() == pytest.approx(0.5) and band.max() == pytest.approx(1.0)
  assert ax.get_xscale() == "log" and ax.get_xlabel() == "width" and ax.get_title()
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["chance", "softmax", "relu"]
  rep = train.Report("t", str(tmp_path))
  rep.figure(fig, "acc_vs_width", "accuracy vs width")
  assert (tmp_path / "acc_vs_width.png").stat().st_size > 1000
  # Error bars instead of a band, on a panel of a two-panel figure.
  fig, axes = train.subplots(2, size=(4, 3))
  train.plot_curves(curves, band="errorbar", ax=axes[1])
  assert len(axes[1].containers) == 1  # softmax's error bars (relu has one seed)
  from matplotlib.collections import PolyCollection

  assert not any(isinstance(c, PolyCollection) for c in axes[1].collections)  # no band
  assert fig.get_size_inches().tolist() == [8.0, 3.0]
  with pytest.raises(ValueError, match="band='shade'"):
    train.plot_curves(curves, band="shade")


@pytest.mark.parametrize("chosen", [None, "svg"])
def test_plots_are_headless_unless_the_session_chose_a_backend(chosen):
  """A notebook's inline backend (here: svg, chosen through pyplot) survives attnx's plots."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  choose = (f"import matplotlib.pyplot; import matplotlib; matplotlib.use({chosen!r}); "
            if chosen else "")
  code = (f"{choose}import matplotlib; from attnx.train import report; report.subplots(); "
          "print(matplotlib.get_backend().lower())")
  env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True).stdout.split()[-1]
  assert out == (chosen or "agg")


def test_level_rows_and_curves():
  values = {"a": {0.0: np.array([0.9, 0.8]), 0.5: np.array([0.7, 0.6])},
            "b": {0.0: np.array([1.0, 1.0]), 0.5: np.array([0.5, 0.5])}}
  rows = train.level_rows(values, [0.0, 0.5], label="F")
  assert list(rows[0]) == ["F", "σ=0", "σ=0.5"] and rows[1]["F"] == "b"
  np.testing.assert_array_equal(rows[0]["σ=0.5"], [0.7, 0.6])
  text = train.level_rows(values, [0.5], column=lambda n: f"length {n}", fmt=".2f")
  assert text == [{"variant": "a", "length 0.5": "0.65 ± 0.05"},
                  {"variant": "b", "length 0.5": "0.50 ± 0.00"}]
  curves = train.level_curves(values, [0.0, 0.5])
  x, y = curves["a"]
  np.testing.assert_array_equal(x, [0.0, 0.5])
  assert y.shape == (2, 2) and y[1, 0] == 0.7  # [levels, seeds]


def test_plot_alignments_one_panel_per_model_and_example():
  w = {"m1": np.full((2, 3, 3), 1 / 3), "m2": np.eye(3)[None].repeat(2, 0)}
  fig = train.plot_alignments(w, [["a", "b"], ["c", "d", "e"]], [["x"], ["y", "z"]])
  assert len(fig.axes) == 4 and fig.axes[0].get_ylabel() == "m1"
  with pytest.raises(ValueError, match="targets"):
    train.plot_alignments(w, [["a"]], [])
