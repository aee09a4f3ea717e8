"""Markdown reports (tables, figures, verdicts, JSON results) and the plots experiments share.

What experiments would otherwise each hand-write lives here once: `markdown_table`,
`plot_curves` ("metric vs x, one line per variant, mean ± std over seeds"; learning curves are
one case), `subplots`, `jsonable` and `Report.save_json`; for language models
`plot_loss_vs_length` (loss vs evaluation length and per position, log axes) with
`length_rows` (its table) and `position_buckets`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.train.parallel import is_main_process

Curve = tuple[Any, Any]  # (x [n], values [n] or [n, num_seeds])


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
  return str(v)


def _cell(text: str) -> str:
  """A table cell: pipes escaped, on one line."""
  return text.replace("|", "\\|").replace("\n", " ")


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
  columns: list[str] = []
  for r in rows:
    columns.extend(k for k in r if k not in columns)
  return columns


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   caption: str | None = None, floatfmt: str = ".4g",
                   fmt: Callable[[Any], str] | None = None) -> str:
  """A Markdown table, with an italic caption line (and a blank line) above it if given.

  `columns`: default every key in order of first appearance. Cells: `fmt(value)` when given
  (e.g. a benchmark's own number format), else floats with `floatfmt`, arrays as
  'mean ± std' over seeds, anything else as str; pipes are escaped; missing cells are empty.
  """
  columns = list(columns) if columns is not None else _columns(rows)
  lines = []
  if caption:
    lines.append(f"*{caption}*\n")
  lines.append("| " + " | ".join(columns) + " |")
  lines.append("|" + "|".join("---" for _ in columns) + "|")
  for r in rows:
    cells = ("" if c not in r else fmt(r[c]) if fmt else _fmt(r[c], floatfmt) for c in columns)
    lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
  return "\n".join(lines) + "\n"


def jsonable(x: Any) -> Any:
  """Plain JSON types, recursively: numpy/jax arrays as lists (0-d as scalars), ConfigDicts as
  dicts, tuples as lists, keys as strings, a non-finite Python float as its string ('nan',
  'inf'); anything else unknown as its str(), so a report is always written."""
  if isinstance(x, Mapping):
    return {str(k): jsonable(v) for k, v in x.items()}
  if hasattr(x, "to_dict"):  # ConfigDict
    return jsonable(x.to_dict())
  if isinstance(x, list | tuple):
    return [jsonable(v) for v in x]
  if isinstance(x, np.ndarray | np.generic) or type(x).__module__.startswith("jax"):
    arr = np.asarray(x)
    return arr.item() if arr.ndim == 0 else arr.tolist()
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if x is None or isinstance(x, bool | int | float | str):
    return x
  return str(x)


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

  In a multi-process run only process 0 writes (report, figures, JSON files); every process
  may build the same report.

  The header records the claim under test, the command line, the config, package versions and
  hardware, so a report can be reproduced and judged on its own. results.json holds the
  tables, verdicts, figures and the names of the JSON files written with `save_json`.
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
    self.data_files: list[str] = []
    os.makedirs(workdir, exist_ok=True)

  def section(self, title: str) -> None:
    """Start a section: a level-2 heading `title`."""
    self._blocks.append(f"## {title}\n")

  def text(self, markdown: str) -> None:
    """Add a paragraph (or any block) of Markdown."""
    self._blocks.append(markdown.rstrip() + "\n")

  def table(self, rows: list[dict], columns: list[str] | None = None,
            caption: str | None = None, floatfmt: str = ".4g",
            fmt: Callable[[Any], str] | None = None) -> str:
    """Add a Markdown table (see `markdown_table`) and keep its rows for results.json.

    Returns the table's Markdown, e.g. to write it to a file of its own as well.
    """
    columns = list(columns) if columns is not None else _columns(rows)
    text = markdown_table(rows, columns, caption, floatfmt, fmt)
    self._blocks.append(text)
    self.tables.append({"caption": caption, "columns": columns, "rows": jsonable(rows)})
    return text

  def figure(self, fig: Any, name: str, caption: str = "") -> str:
    """Save a matplotlib figure as workdir/NAME.png and link it; returns the path."""
    fname = name if name.endswith(".png") else f"{name}.png"
    path = os.path.join(self.workdir, fname)
    if is_main_process():
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

  def save_json(self, name: str, payload: Any) -> str:
    """Write experiment-specific numbers to workdir/NAME(.json) (see `jsonable`); returns the
    path. The file is listed under "data_files" in results.json."""
    fname = name if name.endswith(".json") else f"{name}.json"
    path = os.path.join(self.workdir, fname)
    if is_main_process():
      with open(path, "w") as f:
        json.dump(jsonable(payload), f, indent=1)
    if fname not in self.data_files:
      self.data_files.append(fname)
    return path

  def verdict(self, held: bool | None, text: str) -> None:
    """Record whether the claim held (True), did not hold (False) or is inconclusive (None)."""
    label = {True: "Claim held", False: "Claim did not hold", None: "Inconclusive"}[held]
    self._blocks.append(f"**{label}:** {text}\n")
    self.verdicts.append({"held": held, "text": text})

  def markdown(self) -> str:
    """The whole report as Markdown: title, claim, command, the blocks added so far, then the
    environment and the config."""
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
    """Write report.md and results.json into the workdir; returns the report's path.

    Process 0 writes them; the other processes of a multi-process run only return the path.
    """
    path = os.path.join(self.workdir, "report.md")
    if not is_main_process():
      return path
    with open(path, "w") as f:
      f.write(self.markdown())
    results = {"title": self.title, "claim": self.claim, "command": self.command,
               "created": self.created, "tables": self.tables, "verdicts": self.verdicts,
               "figures": self.figures, "data_files": self.data_files,
               "config": jsonable(self.config), "environment": environment()}
    with open(os.path.join(self.workdir, "results.json"), "w") as f:
      json.dump(results, f, indent=1)
    return path


def _pyplot() -> Any:
  import sys  # noqa: PLC0415

  import matplotlib  # noqa: PLC0415
  if "matplotlib.pyplot" not in sys.modules:
    # Headless by default (reports are files); a session that already chose a backend through
    # pyplot (a notebook's inline one, a GUI) keeps it.
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def subplots(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (6.0, 4.0),
             **kw: Any) -> tuple[Any, Any]:
  """(figure, axes) on the headless backend; `size` is per panel. axes is a flat array when
  there is more than one panel, else the single Axes."""
  plt = _pyplot()
  fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows),
                           squeeze=False, **kw)
  flat = axes.ravel()
  return fig, (flat if flat.size > 1 else flat[0])


def plot_curves(curves: Mapping[str, Curve], *, xlabel: str = "step", ylabel: str = "",
                title: str | None = None, logx: bool | int = False, logy: bool = False,
                band: str = "fill", marker: str | None = None,
                references: Mapping[str, Curve] | None = None, hline: float | None = None,
                ax: Any = None) -> Any:
  """One line per variant: the mean over seeds of a metric vs x, with a ±std band; the Figure.

  `curves`: {label: (x [n], values [n] or [n, num_seeds])} (seeds on the last axis).
  `band`: "fill" (shaded ±std), "errorbar" (±std bars with caps) or "none"; no band for a
  single seed. `references`: {label: (x, y)} drawn as black/gray dashed, dotted and dash-dotted
  lines (baselines);
  `hline`: a dotted horizontal line (a target). `logx`: True or a log base. `ax`: draw into
  an existing Axes (e.g. one panel of `subplots`); its figure is returned.
  """
  if band not in ("fill", "errorbar", "none"):
    raise ValueError(f"band={band!r} is not one of fill, errorbar, none")
  if ax is None:
    fig, ax = subplots()
  else:
    fig = ax.figure
  for i, (label, (x, y)) in enumerate((references or {}).items()):
    ax.plot(np.asarray(x), np.asarray(y, np.float64), ("--", ":", "-.")[i % 3],
            color=("k", "0.45", "0.25")[i % 3], lw=1.3, label=label)
  if band == "errorbar" and marker is None:
    marker = "o"  # error bars mark measured points
  for label, (x, values) in curves.items():
    x = np.asarray(x)
    vals = np.asarray(values, np.float64).reshape(len(x), -1)
    mean, std = vals.mean(1), vals.std(1)
    spread = vals.shape[1] > 1 and band != "none"
    if spread and band == "errorbar":
      ax.errorbar(x, mean, yerr=std, marker=marker, ms=3, capsize=2, label=label)
      continue
    (line,) = ax.plot(x, mean, marker=marker, ms=3, label=label)
    if spread:
      ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
  if hline is not None:
    ax.axhline(hline, color="gray", ls=":", lw=1)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if logx:
    ax.set_xscale("log", **({} if logx is True else {"base": logx}))
  if logy:
    ax.set_yscale("log")
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def history_curve(history: Sequence[Mapping[str, Any]], metric: str) -> Curve | None:
  """(steps, values [n, num_seeds]) of `metric` from a FitResult.history; None if never
  logged."""
  pts = [(h["step"], np.atleast_1d(np.asarray(h[metric], np.float64)))
         for h in history if metric in h]
  if not pts:
    return None
  return np.array([p[0] for p in pts]), np.stack([p[1] for p in pts])


def plot_learning_curves(histories: dict[str, list[dict]], metric: str = "loss", *,
                         title: str | None = None, logy: bool = False,
                         ax: Any = None, ylabel: str | None = None) -> Any:
  """`plot_curves` of `metric` vs step from {label: FitResult.history}; returns the Figure.

  Runs that never logged `metric` are skipped.
  """
  curves = {label: c for label, h in histories.items()
            if (c := history_curve(h, metric)) is not None}
  return plot_curves(curves, xlabel="step", ylabel=ylabel or metric, title=title, logy=logy,
                     ax=ax)


def level_rows(values: Mapping[str, Mapping[Any, Any]], levels: Sequence[Any], *,
               label: str = "variant", column: Callable[[Any], str] = lambda x: f"σ={x:g}",
               fmt: str | None = None) -> list[dict[str, Any]]:
  """Table rows {label: name, column(level): per-seed values} of a metric measured at several
  levels (noise sizes, evaluation lengths) per variant: ``values`` {name: {level: [seeds]}}.
  Cells are the arrays (formatted 'mean ± std' by the table) or, with ``fmt``, the
  `mean_std` strings."""
  return [{label: name, **{column(x): (mean_std(v[x], fmt) if fmt else np.asarray(v[x]))
                           for x in levels}} for name, v in values.items()]


def level_curves(values: Mapping[str, Mapping[Any, Any]], levels: Sequence[Any]
                 ) -> dict[str, Curve]:
  """`plot_curves` input {name: (levels, values [levels, seeds])} from {name: {level:
  [seeds]}}: a metric vs a level per variant (see `level_rows` for its table)."""
  x = np.asarray(levels, np.float64)
  return {name: (x, np.stack([np.asarray(v[level]) for level in levels]))
          for name, v in values.items()}


def plot_alignments(weights: Mapping[str, Any], sources: Sequence[Sequence[str]],
                    targets: Sequence[Sequence[str]]) -> Any:
  """Heat maps of attention weights between words: one row of panels per model, one column
  per example; ``weights`` {model: [examples, T, S]}, ``sources``/``targets`` the words of
  each example (columns / rows of its panel, cropped to their lengths). Returns the Figure."""
  plt = _pyplot()
  rows, cols = len(weights), len(sources)
  if rows == 0 or cols == 0 or len(targets) != cols:
    raise ValueError(f"plot_alignments needs ≥ 1 model and as many targets as sources; got "
                     f"{rows} models, {cols} sources, {len(targets)} targets")
  fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False)
  for r, (name, al) in enumerate(weights.items()):
    for c, (sw, tw) in enumerate(zip(sources, targets, strict=True)):
      ax = axes[r, c]
      ax.imshow(np.asarray(al)[c, :len(tw), :len(sw)], cmap="Greys", vmin=0, vmax=1)
      ax.set_xticks(range(len(sw)), sw, rotation=60, fontsize=7)
      ax.set_yticks(range(len(tw)), tw, fontsize=7)
      if c == 0:
        ax.set_ylabel(name, fontsize=9)
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


def length_rows(losses: Mapping[str, Any], lengths: Sequence[int], label: str = "variant",
                fmt: str = ".4f") -> list[dict[str, Any]]:
  """Table rows {label: name, "<k>× (<T>)": 'mean ± std' or 'n/a'} of loss [seeds, K] at the
  evaluation lengths ``lengths`` (k = T / lengths[0], the first being the training length)."""
  base = int(lengths[0])
  rows = []
  for name, loss in losses.items():
    loss = np.asarray(loss, np.float64).reshape(-1, len(lengths))
    row: dict[str, Any] = {label: name}
    for i, t in enumerate(lengths):
      k = f"{int(t) // base}×" if int(t) % base == 0 else f"{int(t) / base:g}×"
      row[f"{k} ({int(t)})"] = ("n/a" if np.isnan(loss[:, i]).all()
                                else mean_std(loss[:, i], fmt))
    rows.append(row)
  return rows


def position_buckets(per_position: Any) -> Curve:
  """(x [n], values [n, seeds]): a per-position metric [seeds, T] averaged over positions
  1, 2–3, 4–7, … (1-based, one bucket per octave; a last bucket shorter than half an octave
  joins the one before), x the geometric mean of each bucket's first and last position — for
  a log x axis on which the start and the end of a long window are equally readable."""
  v = np.asarray(per_position, np.float64)
  v = v.reshape(-1, v.shape[-1])
  t = v.shape[-1]
  edges = [1 << b for b in range(max(1, t.bit_length())) if 1 << b <= t]  # bucket starts
  edges.append(t + 1)
  if len(edges) > 2 and edges[-1] - edges[-2] < (edges[-2] - edges[-3]) / 2:
    del edges[-2]
  lo, hi = np.asarray(edges[:-1]), np.asarray(edges[1:]) - 1  # 1-based, inclusive
  vals = np.stack([v[:, a - 1:b].mean(1) for a, b in zip(lo, hi, strict=True)])
  return np.sqrt(lo * hi), vals


def plot_loss_vs_length(losses: Mapping[str, Any], lengths: Sequence[int], *,
                        per_position: Mapping[str, Any] | None = None,
                        train_length: int | None = None,
                        ylabel: str = "validation loss (nats)") -> Any:
  """Loss vs evaluation length (log₂ x, mean ± std over seeds as error bars, one line per
  variant; NaN lengths dropped) and, with ``per_position`` ({name: [seeds, T]}), a second
  panel of the loss per position in octave buckets (:func:`position_buckets`, log x) with a
  dotted line at ``train_length``; returns the Figure.

  ``losses``: {name: loss [seeds, K]} at ``lengths`` (K evaluation lengths in tokens).
  """
  x = np.asarray(lengths, np.float64)
  curves = {}
  for name, loss in losses.items():
    loss = np.asarray(loss, np.float64).reshape(-1, len(x))
    ok = ~np.isnan(loss).any(0)
    if ok.any():
      curves[name] = (x[ok], loss[:, ok].T)
  fig, axes = subplots(ncols=2 if per_position else 1, size=(5.5, 4.0))
  ax0 = axes[0] if per_position else axes
  plot_curves(curves, xlabel="evaluation length (tokens)", ylabel=ylabel, logx=2,
              band="errorbar", ax=ax0, title="loss vs evaluation length")
  ax0.set_xticks(x, [f"{t:g}" for t in x])
  if per_position:
    ax1 = axes[1]
    plot_curves({n: position_buckets(v) for n, v in per_position.items()},
                xlabel="position in the window (octave buckets)", ylabel=ylabel, logx=2,
                ax=ax1, title="loss per position at the longest length")
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    ax1.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if train_length:
      ax1.axvline(train_length, color="k", ls=":", lw=1)
  fig.tight_layout()
  return fig
