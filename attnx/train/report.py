"""Markdown reports with tables, figures and verdicts; learning-curve plots."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def mean_std(values: Any, fmt: str = ".3g") -> str:
  """'0.953 ± 0.004' (population std over seeds; just the value for a single seed)."""
  arr = np.asarray(values, dtype=np.float64).ravel()
  if arr.size == 0:
    return "n/a"
  if arr.size == 1:
    return format(arr[0], fmt)
  return f"{format(arr.mean(), fmt)} ± {format(arr.std(), fmt)}"


def _fmt(v: Any, floatfmt: str) -> str:
  if isinstance(v, float | np.floating):
    return format(float(v), floatfmt)
  if isinstance(v, np.ndarray):
    return mean_std(v, floatfmt)
  return str(v).replace("|", "\\|").replace("\n", " ")


def _jsonable(v: Any) -> Any:
  if isinstance(v, np.ndarray | np.generic):
    return v.tolist()
  if isinstance(v, dict):
    return {str(k): _jsonable(x) for k, x in v.items()}
  if isinstance(v, list | tuple):
    return [_jsonable(x) for x in v]
  if isinstance(v, float | int | str | bool) or v is None:
    return v
  return str(v)


def environment() -> dict[str, Any]:
  """Package versions and hardware, for reproducibility sections."""
  import importlib.metadata as md

  versions = {}
  for pkg in ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint"):
    try:
      versions[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      versions[pkg] = "not installed"
  env: dict[str, Any] = {"python": platform.python_version(), "versions": versions,
                         "cpu": platform.processor() or platform.machine(),
                         "cores": os.cpu_count()}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          env["cpu"] = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  try:
    import jax
    env["devices"] = [str(d) for d in jax.devices()]
    env["backend"] = jax.default_backend()
  except Exception as e:  # noqa: BLE001 - a report must still be written.
    env["devices"] = f"unavailable ({e})"
  return env


class Report:
  """Accumulates a Markdown report; `write()` saves workdir/report.md and workdir/results.json.

  The header records the claim under test, the command line, the config, package versions and
  hardware, so a report can be reproduced and judged on its own.
  """

  def __init__(self, title: str, workdir: str, config: Any = None, claim: str | None = None):
    self.title = title
    self.workdir = workdir
    self.config = config
    self.claim = claim
    self.command = " ".join(shlex.quote(a) for a in ["python"] + sys.argv)
    self.created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    self._blocks: list[str] = []
    self.tables: list[dict] = []
    self.verdicts: list[dict] = []
    self.figures: list[str] = []
    os.makedirs(workdir, exist_ok=True)

  def section(self, title: str) -> None:
    self._blocks.append(f"## {title}\n")

  def text(self, markdown: str) -> None:
    self._blocks.append(markdown.rstrip() + "\n")

  def table(self, rows: list[dict], columns: list[str] | None = None,
            caption: str | None = None, floatfmt: str = ".4g") -> None:
    """A Markdown table; floats use `floatfmt`, arrays become 'mean ± std'."""
    if columns is None:
      columns = []
      for r in rows:
        columns.extend(k for k in r if k not in columns)
    lines = []
    if caption:
      lines.append(f"*{caption}*\n")
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
      lines.append("| " + " | ".join(_fmt(r.get(c, ""), floatfmt) for c in columns) + " |")
    self._blocks.append("\n".join(lines) + "\n")
    self.tables.append({"caption": caption, "columns": columns, "rows": _jsonable(rows)})

  def figure(self, fig: Any, name: str, caption: str = "") -> str:
    """Save a matplotlib figure as workdir/NAME.png and link it; returns the path."""
    fname = name if name.endswith(".png") else f"{name}.png"
    path = os.path.join(self.workdir, fname)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    try:
      import matplotlib.pyplot as plt
      plt.close(fig)
    except Exception:  # noqa: BLE001
      pass
    block = f"![{caption or name}]({fname})\n"
    self._blocks.append(block + (f"\n*{caption}*\n" if caption else ""))
    self.figures.append(fname)
    return path

  def verdict(self, held: bool | None, text: str) -> None:
    """Record whether the claim held (True), did not hold (False) or is inconclusive (None)."""
    label = {True: "Claim held", False: "Claim did not hold", None: "Inconclusive"}[held]
    self._blocks.append(f"**{label}:** {text}\n")
    self.verdicts.append({"held": held, "text": text})

  def markdown(self) -> str:
    env = environment()
    head = [f"# {self.title}\n", f"Generated {self.created}.\n"]
    if self.claim:
      head.append(f"**Claim under test:** {self.claim}\n")
    head.append(f"Command:\n\n```\n{self.command}\n```\n")
    tail = ["## Environment\n",
            "| | |\n|---|---|\n"
            + f"| python | {env['python']} |\n"
            + "".join(f"| {k} | {v} |\n" for k, v in env["versions"].items())
            + f"| cpu | {env['cpu']} ({env['cores']} cores) |\n"
            + f"| jax devices | {env.get('devices')} |\n"]
    if self.config is not None:
      tail.append(f"## Config\n\n```\n{self.config}\n```\n")
    return "\n".join(head + self._blocks + tail)

  def write(self) -> str:
    """Write report.md and results.json into the workdir; returns the report's path."""
    path = os.path.join(self.workdir, "report.md")
    with open(path, "w") as f:
      f.write(self.markdown())
    config = self.config.to_dict() if hasattr(self.config, "to_dict") else self.config
    results = {"title": self.title, "claim": self.claim, "command": self.command,
               "created": self.created, "tables": self.tables, "verdicts": self.verdicts,
               "figures": self.figures, "config": _jsonable(config),
               "environment": environment()}
    with open(os.path.join(self.workdir, "results.json"), "w") as f:
      json.dump(results, f, indent=1)
    return path


def plot_learning_curves(histories: dict[str, list[dict]], metric: str = "loss", *,
                         title: str | None = None, logy: bool = False,
                         ax: Any = None, ylabel: str | None = None) -> Any:
  """One line per run (mean over seeds) with a ±std band; returns the Figure.

  `histories`: {label: FitResult.history}; entries without `metric` are skipped.
  """
  import matplotlib
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  if ax is None:
    fig, ax = plt.subplots(figsize=(6, 4))
  else:
    fig = ax.figure
  for label, hist in histories.items():
    pts = [(h["step"], np.asarray(h[metric], dtype=np.float64)) for h in hist if metric in h]
    if not pts:
      continue
    steps = np.array([p[0] for p in pts])
    vals = np.stack([np.atleast_1d(p[1]) for p in pts])
    mean, std = vals.mean(1), vals.std(1)
    (line,) = ax.plot(steps, mean, label=label)
    if vals.shape[1] > 1:
      ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel or metric)
  if logy:
    ax.set_yscale("log")
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def summary_rows(results: dict[str, Any], metrics: Sequence[str]) -> list[dict]:
  """Rows {run, <metric>: 'mean ± std', s/step, compile s} from {label: FitResult}."""
  rows = []
  for label, r in results.items():
    row: dict[str, Any] = {"run": label}
    for m in metrics:
      row[m] = mean_std(r.final_metrics[m], ".4g") if m in r.final_metrics else "n/a"
    row["ms/step"] = 1e3 * r.seconds_per_step
    row["compile s"] = r.compile_seconds
    rows.append(row)
  return rows
