"""Figures of an attention benchmark's rows (:mod:`attnx.train.benchmark.runner`'s cells) against
the sequence length T: softmax's scaling per implementation (:func:`scaling`), whole-row
weightings over blocked softmax (:func:`rows_over_softmax`), structured masks
(:func:`masks`), and :func:`add_to_report`, which adds those that a run's rows can draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnx.train.benchmark.cases import seq_len

BLOCKED = "attnx blocked"


def _pyplot():
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt


def scaling(rows: Sequence[dict[str, Any]]):
  """Time, fraction of the matmul rate and scratch memory vs T of softmax (full), per
  implementation and mode."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  impls = ["jax.nn (xla)", "flax.linen", "attnx dense", BLOCKED]
  for impl in impls:
    for mode, style in (("fwd", "-o"), ("fwd+bwd", "--s")):
      pts = sorted((seq_len(r["shape"]), r) for r in rows
                   if r["impl"] == impl and r["weighting"] == "softmax" and r["mode"] == mode
                   and "time ms" in r and not r.get("causal", False))
      if not pts:
        continue
      ts = [p[0] for p in pts]
      axes[0].plot(ts, [p[1]["time ms"] for p in pts], style, label=f"{impl} {mode}")
      axes[1].plot(ts, [p[1]["% matmul"] for p in pts], style, label=f"{impl} {mode}")
      axes[2].plot(ts, [p[1]["scratch MiB"] for p in pts], style, label=f"{impl} {mode}")
  for ax, title in zip(axes, ("time (ms)", "% of the matmul rate", "scratch (MiB)"),
                       strict=True):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (= S)")
    ax.set_title(f"softmax (full): {title}")
    ax.grid(alpha=0.3)
  axes[0].set_yscale("log")
  axes[2].set_yscale("log")
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  return fig


def rows_over_softmax(rows: Sequence[dict[str, Any]], row_weightings: Sequence[str]):
  """fwd+bwd time of each whole-row weighting vs T, blocked and dense, over blocked softmax
  ("time / softmax"), full and causal."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
  for ax, causal in zip(axes, (False, True), strict=True):
    for i, name in enumerate(row_weightings):
      for impl, style in ((BLOCKED, "-o"), ("attnx dense", ":x")):
        pts = sorted((seq_len(r["shape"]), r["time / softmax"]) for r in rows
                     if r["weighting"] == name and r["impl"] == impl
                     and r["mode"] == "fwd+bwd" and bool(r.get("causal")) == causal
                     and not r.get("mask") and "time / softmax" in r)
        if pts:
          ax.plot(*zip(*pts, strict=True), style, color=f"C{i}",
                  label=f"{name} ({impl.split()[1]})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (= S)")
    ax.set_title(f"fwd+bwd time / blocked softmax ({'causal' if causal else 'full'})")
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=7, ncol=2)
  fig.tight_layout()
  return fig


def masks(rows: Sequence[dict[str, Any]], target: float):
  """Blocked fwd+bwd under structured masks vs T: the time of full, causal, causal + window and
  causal + documents per weighting, and the time per attended pair over plain causal's
  ("per pair / causal"; dotted: ``target``)."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  names = list(dict.fromkeys(r["weighting"] for r in rows if r.get("mask")))
  kinds = (("full", "-o"), ("causal", "--s"), ("window", "-^"), ("documents", "-.d"),
           ("dense_window", ":v"))
  kind = lambda r: r.get("mask") or ("causal" if r.get("causal") else "full")
  for i, name in enumerate(names):
    for label, style in kinds:
      pts = sorted((seq_len(r["shape"]), r) for r in rows
                   if r["weighting"] == name and r["impl"] == BLOCKED
                   and r["mode"] == "fwd+bwd" and kind(r) == label and "time ms" in r)
      if not pts:
        continue
      ts = [p[0] for p in pts]
      axes[0].plot(ts, [p[1]["time ms"] for p in pts], style, color=f"C{i}",
                   label=f"{name}: {label}")
      per_pair = [p for p in pts if "per pair / causal" in p[1]]
      if per_pair:
        axes[1].plot([p[0] for p in per_pair], [p[1]["per pair / causal"] for p in per_pair],
                     style, color=f"C{i}", label=f"{name}: {label}")
  axes[0].set_yscale("log")
  axes[0].set_title("blocked fwd+bwd time (ms)")
  axes[1].axhline(1.0, color="k", lw=0.8)
  axes[1].axhline(target, color="k", lw=0.8, ls=":")
  axes[1].set_title("time per attended pair / plain causal's")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (= S)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def add_to_report(rep: Any, rows: Sequence[dict[str, Any]], row_weightings: Sequence[str], *,
                  window: int, documents: int, mask_target: float) -> None:
  """Adds to ``rep`` (an ``attnx.train.Report``) :func:`scaling`, and :func:`masks` and
  :func:`rows_over_softmax` where the rows have masked and whole-row timings."""
  rep.figure(scaling(rows), "scaling", "Softmax attention: time, fraction of the matmul "
             "rate and scratch memory vs sequence length (the shapes' batch and heads differ).")
  if any(r.get("mask") and "time ms" in r for r in rows):
    rep.figure(masks(rows, mask_target), "masks", "Structured masks (blocked fwd+bwd, tiles "
               f"skipped): time vs T for full, causal, causal + a {window}-key window and "
               f"causal + {documents} packed documents, and the time per attended "
               f"pair over plain causal attention's (dotted: the {mask_target}× target).")
  if any("time / softmax" in r and r["weighting"] in row_weightings and not r.get("mask")
         for r in rows):
    rep.figure(rows_over_softmax(rows, row_weightings), "row_weightings", "Whole-row "
               "weightings: fwd+bwd time over blocked softmax, blocked kernel (solid) and "
               "dense (dotted).")
