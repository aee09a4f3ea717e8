"""Small helpers shared by the experiments in this folder (not a public API).

Everything generic (training loops, config checks, report writing, plots) lives in
``attnx.train``; this file only holds glue that several experiment files need.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def safe_name(label: str) -> str:
  """A run label usable as a file name ("gaussian (neg_sq_dist)" -> "gaussian_neg_sq_dist")."""
  out = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
  return "_".join(p for p in out.split("_") if p)


def run_standalone(name: str, get_config: Callable[[str | None], Any],
                   run: Callable[[Any, str], Any], presets: Sequence[str]) -> None:
  """``python experiments/NAME.py [--preset=P] [--workdir=DIR]``: the launcher-free entry of
  the benchmarks (launch.py is the usual one)."""
  from absl import app, flags  # noqa: PLC0415

  flags.DEFINE_string("workdir", None, "Output directory (default runs/NAME-PRESET).")
  flags.DEFINE_string("preset", "default", f"One of {tuple(presets)}.")

  def main(argv: list[str]) -> None:
    del argv
    config = get_config(flags.FLAGS.preset)
    run(config, flags.FLAGS.workdir or os.path.join("runs", f"{name}-{config.preset}"))

  app.run(main)


def icl_report(rep: Any, result: Any, label: str = "weighting") -> dict[str, np.ndarray]:
  """Garg et al.-style report of in-context regression: squared error / d vs the number of
  in-context examples per trained variant (mean over seeds) against least squares,
  3-nearest-neighbour averaging and the zero predictor on the same test prompts; a table at
  the last position. ``result``: an attnx.train.experiment.TaskResult whose variants ran the
  "icl_error" evaluator. Returns the baselines' curves."""
  from attnx.data.icl_regression import baseline_errors
  from attnx.train import mean_std, plot_curves

  te = result.arrays["eval"]
  base = baseline_errors(te["inputs"], te["targets"])
  k = np.arange(len(base["zero"]), dtype=float)  # in-context examples before the query
  curves = {w: (k, np.asarray(r.final_metrics["icl_curve"]).T) for w, r in result.fits.items()}
  # Linear y as in Garg et al.'s figure: least squares' ~1e-15 would flatten a log axis.
  fig = plot_curves(curves, xlabel="in-context examples", ylabel="squared error / d",
                    references={n: (k, c) for n, c in base.items()})
  rows = [{label: w, "error/d at last": mean_std(np.asarray(r.final_metrics["icl_curve"])[:, -1],
                                                 ".4g"),
           **{f"{n} at last": float(c[-1]) for n, c in base.items()}}
          for w, r in result.fits.items()]
  rep.table(rows, caption="In-context error at the last position (mean ± std over seeds) vs "
                          "the baselines on the same test prompts")
  rep.figure(fig, f"{result.task.name}_vs_least_squares",
             "Squared error / d vs number of in-context examples (mean ± std over seeds; "
             "black/gray: baselines), as in Garg et al.'s figure 2.")
  return base
