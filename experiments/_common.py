"""Small helpers shared by the experiments in this folder (not a public API).

Everything generic (training loops, report writing, plots) lives in ``attnx.train``; this file
only holds glue that several experiment files need: preset checking, JSON files and number
formatting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attnx.train.parallel import is_main_process
from attnx.train.report import jsonable  # the one implementation (also Report.save_json)


def check_choices(config: Any, key: str, values: Sequence[Any], valid: Sequence[Any]) -> None:
  """Raises ValueError naming ``config.<key>`` if any of ``values`` is not in ``valid``."""
  bad = [v for v in values if v not in valid]
  if bad:
    raise ValueError(f"config.{key} has invalid entries {bad}; valid choices: "
                     f"{', '.join(map(str, valid))}.")


def safe_name(label: str) -> str:
  """A run label usable as a file name ("gaussian (neg_sq_dist)" -> "gaussian_neg_sq_dist")."""
  out = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
  return "_".join(p for p in out.split("_") if p)


def fmt(x: Any, digits: int = 3) -> str:
  """Compact number formatting for report tables (scientific for tiny/huge values)."""
  if isinstance(x, (bool, np.bool_)):
    return "yes" if x else "no"
  if isinstance(x, (int, np.integer)):
    return str(int(x))
  if isinstance(x, (float, np.floating)):
    x = float(x)
    if not np.isfinite(x):
      return str(x)
    if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e5):
      return f"{x:.{max(digits - 1, 1)}e}"
    return f"{x:.{digits}f}"
  return str(x)


def mean_std_str(values: Sequence[float], digits: int = 3) -> str:
  """``"m ± s"`` over seeds (population std; a single value prints alone)."""
  v = np.asarray(values, dtype=float).ravel()
  if v.size == 1:
    return fmt(float(v[0]), digits)
  return f"{fmt(float(v.mean()), digits)} ± {fmt(float(v.std()), digits)}"


def save_json(workdir: str, name: str, payload: Any) -> str:
  """Writes experiment-specific numbers next to the report (``<workdir>/<name>.json``) with
  attnx.train's `jsonable` (``Report.save_json`` does the same from a Report)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, name)
  if is_main_process():  # the other processes of a multi-process run write nothing
    with open(path, "w") as f:
      json.dump(jsonable(payload), f, indent=1)
  return path


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


def variant_list(value: Any) -> list[str]:
  """Attention variants from 'a,b:k=v,k2=v2,c' (or a sequence): an item ``k=v`` without a
  ``:`` continues the previous variant's parameters, so
  ``"softmax,sigmoid:normalization=none,bias=0"`` is two variants."""
  from attnx.train.config import split_list

  out: list[str] = []
  for item in split_list(value):
    if out and ":" in out[-1] and ":" not in item and "=" in item:
      out[-1] += "," + item
    else:
      out.append(item)
  return out


def attention_variants(config: Any, key: str = "weightings",
                       reference: str | None = None) -> list[str]:
  """The attention variants named in ``config[key]`` (comma-separated or a sequence), each
  checked with attnx.nn.attention_spec (name and parameters); a ValueError names the key and
  the valid names, or the missing ``reference``."""
  from attnx import nn

  names = variant_list(config[key])
  if not names:
    raise ValueError(f"config.{key} is empty; valid: {', '.join(nn.list_attention_variants())}.")
  for name in names:
    try:
      nn.attention_spec(name)
    except ValueError as e:
      raise ValueError(f"config.{key}: {e}") from None
  if reference is not None and reference not in names:
    raise ValueError(f"config.{key} must include {reference} (the reference).")
  return names


def parse_shapes(value: Any, key: str = "shapes") -> list[tuple[int, int, int, int]]:
  """Benchmark shapes 'BxTxNxH,...' (or a sequence of such strings) as (B, T, N, H) tuples; a
  ValueError names the key and the bad item."""
  from attnx.train.config import split_list

  out = []
  for item in split_list(value):
    try:
      b, t, n, h = (int(x) for x in item.lower().split("x"))
    except ValueError:
      raise ValueError(f"config.{key}: bad shape {item!r}; expected 'BxTxNxH'") from None
    out.append((b, t, n, h))
  return out
