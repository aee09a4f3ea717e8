"""Report sections for what trained models' attention does, written once for every experiment.

:func:`report_attention` turns the ``"attention_stats"`` evaluator's metrics
(:mod:`attnx.train.evaluators`) into a section: how they were measured, a table per layer, a
table per head and a heat map of one layer's weights (:func:`plot_weights`).
:func:`report_length` does the same for the ``"loss_by_length"`` evaluator: loss at each
evaluation length, the kernel each length runs, the verdicts on the loss increase and the
plot of loss vs length. :func:`plot_simplex` shows where weightings map three scores on the
simplex.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.analysis import stats
from attnx.train import evaluators, report, verdict

_LABELS = {"sink_rate": "sink rate", "zero_share": "share = 0", "small_share": "share < {small:g}",
           "entropy": "entropy (nats)", "max_weight": "max weight",
           "max_kurtosis": "max kurtosis", "mean_kurtosis": "mean kurtosis"}


def _cell(values: Any, fmt: str) -> str:
  v = np.asarray(values, np.float64)
  return "n/a" if np.isnan(v).all() else report.mean_std(v, fmt)


def statistics_rows(metrics: Mapping[str, Mapping[str, Any]], *, small: float,
                    label: str = "variant", per_head: bool = False) -> list[dict[str, Any]]:
  """Table rows of the ``"attention_stats"`` metrics, {variant: final_metrics}: one row per
  variant and layer (every statistic, mean ± std over seeds; the layer's weight statistics
  pool its heads) or, ``per_head``, per variant, layer and head (the weight statistics only).
  "n/a" where the statistic is NaN in every seed (linear attention)."""
  rows = []
  for name, m in metrics.items():
    layers = np.asarray(m["sink_rate"]).shape[-1]
    for layer in range(layers):
      base = {label: name, "layer": layer}
      if not per_head:
        row = dict(base)
        for key in (*stats.HEAD_STATS, *stats.HIDDEN_STATS):
          if key in stats.HEAD_STATS or layer < np.asarray(m[key]).shape[-1]:
            fmt = ".3g" if key in stats.HIDDEN_STATS else ".3f"
            row[_LABELS[key].format(small=small)] = _cell(np.asarray(m[key])[:, layer], fmt)
        rows.append(row)
        continue
      for head in range(np.asarray(m["sink_rate_by_head"]).shape[-1]):
        rows.append({**base, "head": head, **{
            _LABELS[key].format(small=small): _cell(np.asarray(m[f"{key}_by_head"])[:, layer,
                                                                                   head], ".3f")
            for key in stats.HEAD_STATS}})
  return rows


def plot_weights(weights: Mapping[str, Any], *, title: str = "head") -> Any:
  """Heat maps of one layer's weights, {variant: [N, T, S] or None (linear attention)}: one
  row per variant, one panel per head (rows: queries, columns: keys; each panel its own
  colour scale); returns the Figure."""
  heads = max((np.shape(w)[0] for w in weights.values() if w is not None), default=1)
  fig, axes = report.subplots(ncols=heads, nrows=len(weights), size=(2.2, 2.2))
  axes = np.asarray(axes, dtype=object).reshape(len(weights), heads)
  for r, (name, w) in enumerate(weights.items()):
    for h in range(heads):
      ax = axes[r, h]
      ax.set_xticks([])
      ax.set_yticks([])
      if w is None:
        ax.text(0.5, 0.5, "n/a (linear)", ha="center", va="center", transform=ax.transAxes)
      else:
        ax.imshow(np.asarray(w)[h], cmap="viridis", interpolation="nearest")
      if r == 0:
        ax.set_title(f"{title} {h}", fontsize=8)
      if h == 0:
        ax.set_ylabel(name, fontsize=7)
  return fig


def plot_simplex(maps: Mapping[str, Callable[[Any], Any]], *, grid: int = 61,
                 extent: float = 3.0, path_scores: Sequence[float] = (1.0, 0.3, -0.5),
                 taus: tuple[float, float] = (0.05, 20.0)) -> Any:
  """Where weightings put three scores on the 2-simplex, one panel per map (titled by its key;
  a map takes scores [..., 3] to weights [..., 3]): the images of the grid of scores
  (s1, s2, 0) ∈ [−extent, extent]² (``grid`` points a side) colored by support size (the
  number of non-zero weights; sparse maps reach the edges and vertices), and in red the path of
  p(s/τ) for the fixed ``path_scores`` as τ goes from ``taus[0]`` (near a vertex) to
  ``taus[1]`` (near the centre). Returns the Figure."""
  if not maps or grid < 2 or len(path_scores) != 3:
    raise ValueError(f"plot_simplex needs maps, grid >= 2 and three path scores; got "
                     f"{len(maps)} maps, grid={grid}, path_scores={tuple(path_scores)}")
  import jax.numpy as jnp  # noqa: PLC0415

  corners = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, np.sqrt(3) / 2]])  # p -> p @ corners
  g = np.linspace(-extent, extent, grid)
  s1, s2 = np.meshgrid(g, g)
  z = jnp.asarray(np.stack([s1.ravel(), s2.ravel(), np.zeros(s1.size)], -1), jnp.float32)
  tau = np.geomspace(taus[0], taus[1], 200)
  s_fixed = np.asarray(path_scores, np.float32)
  fig, axes = report.subplots(len(maps), size=(4, 3.6))
  for ax, (name, fn) in zip(np.atleast_1d(axes), maps.items(), strict=True):
    p = np.asarray(fn(z))
    xy = p @ corners
    sc = ax.scatter(xy[:, 0], xy[:, 1], c=(p > 0).sum(-1), s=6, cmap="viridis", vmin=1, vmax=3)
    path = np.asarray(fn(jnp.asarray(s_fixed[None] / tau[:, None]))) @ corners
    ax.plot(path[:, 0], path[:, 1], "r-", lw=1.5, label=f"p(s/τ), τ: {taus[0]:g}→{taus[1]:g}")
    ax.plot(corners[[0, 1, 2, 0], 0], corners[[0, 1, 2, 0], 1], "k-", lw=0.8)
    ax.set_title(name), ax.set_aspect("equal"), ax.axis("off")
  fig.colorbar(sc, ax=axes, label="support size", ticks=[1, 2, 3])
  np.atleast_1d(axes)[0].legend(loc="upper left", fontsize=7)
  return fig


def layer_weights(model: Any, params: Any, inputs: Any, layer: int,
                  extra_variables: Any = None) -> np.ndarray | None:
  """Attention layer ``layer``'s weights ``[B..., N, T, S]`` of one (unstacked) model on
  ``inputs`` (None for linear attention), in one jitted call."""
  import jax

  fn = jax.jit(lambda p, e, x: stats.probe(model, p, x, extra_variables=e).weights[layer])
  out = fn(params, extra_variables or {}, inputs)
  return None if out is None else np.asarray(out)


def _seed(tree: Any, index: int = 0) -> Any:
  import jax

  return jax.tree.map(lambda a: np.asarray(a)[index], tree)


def report_attention(rep: report.Report, fits: Mapping[str, Any],
                     build_model: Callable[[str], Any], inputs: Any, *, examples: str,
                     threshold: float = stats.SINK_THRESHOLD,
                     small: float = stats.SMALL_WEIGHT, layer: int = -1,
                     label: str = "variant", title: str = "Attention statistics",
                     figure: str = "attention_heatmap") -> dict[str, dict[str, Any]]:
  """The section of the ``"attention_stats"`` metrics of ``fits`` ({variant: FitResult}):
  text, a table per layer, a table per head and a heat map of attention layer ``layer`` of
  every head on ``inputs[:1]`` with seed index 0 (``build_model(variant)`` rebuilds a model).
  ``examples`` says what the statistics read ("the first 32 validation windows of 64
  characters"). Returns {variant: {statistic: per-seed lists}} for a JSON payload."""
  metrics = {n: f.final_metrics for n, f in fits.items() if "sink_rate" in f.final_metrics}
  rep.section(title)
  rep.text(f"On {examples}: *sink rate* = share of heads (averaged over inputs) whose mean "
           f"weight on the first token over all query positions exceeds {threshold:g} (Gu et "
           "al. 2024, 'When Attention Sink Emerges in Language Models: An Empirical View', as "
           f"used by the softpick paper); *= 0* and *< {small:g}*: shares of the valid weights "
           "(those a query may attend: key ≤ query in causal attention, padding excluded); "
           "*entropy*: of each query row's weights as a distribution (w / Σ w), nats, mean over "
           "rows (log n for n equal weights); *max weight*: each row's largest weight, mean "
           "over rows; *kurtosis*: Pearson kurtosis m₄/m₂² of each token's hidden state (the "
           "block's output) over the hidden dimension, 3 for a Gaussian vector, large with "
           "massive activations — the maximum and the mean over tokens. Mean ± std over "
           "seeds; a layer pools its heads; n/a: linear attention forms no weight matrix.")
  rep.table(statistics_rows(metrics, small=small, label=label),
            caption=f"Attention statistics per {label} and layer")
  rep.table(statistics_rows(metrics, small=small, label=label, per_head=True),
            caption=f"Attention statistics per {label}, layer and head")
  x = np.asarray(inputs)[:1]
  shown = {}
  for name, res in fits.items():
    model = build_model(name)
    extra = _seed(res.extra_variables) if res.extra_variables else None
    w = layer_weights(model, _seed(res.params), x, layer, extra)
    shown[name] = None if w is None else w.reshape(-1, *w.shape[-3:])[0]
  num = len(np.asarray(next(iter(metrics.values()))["sink_rate"])[0]) if metrics else 1
  rep.figure(plot_weights(shown), figure,
             f"Attention weights of layer {layer % max(num, 1)} (every head; rows: queries, "
             "columns: keys) on the first input, seed index 0. Each panel has its own colour "
             "scale.")
  return {n: {k: np.asarray(v).tolist() for k, v in m.items()
              if k in (*stats.HEAD_STATS, *stats.HIDDEN_STATS)
              or k.removesuffix("_by_head") in stats.HEAD_STATS} for n, m in metrics.items()}


def report_length(rep: report.Report, fits: Mapping[str, Any], build_model: Callable[[str], Any],
                  stream: Any, *, context: int, multipliers: Sequence[int],
                  judged: Sequence[int], margin: float, num_seeds: int,
                  length_windows: int | None = None, limit_tokens: int | None = None,
                  note: str = "", reference: str = "softmax", label: str = "variant",
                  unit: str = "tokens", figure: str = "length_generalization"
                  ) -> tuple[dict, dict]:
  """The section of the ``"loss_by_length"`` metrics of ``fits`` ({variant: FitResult}) on the
  token ``stream`` it read (with its ``length_windows`` and ``limit_tokens``): what was read,
  then ``note``; loss at k × the training ``context`` for k in ``multipliers``; the
  implementation each length runs (:func:`attnx.analysis.attention_kernel`) with the seconds
  of its pass; for each k in ``judged`` every variant vs ``reference`` on the increase of the
  loss from 1× to k× (:func:`attnx.train.evaluators.length_comparisons`); loss vs length and
  per position. Returns ({k: {variant: Comparison}}, {variant: {length: implementation}})."""
  names, mults = list(fits), [int(k) for k in multipliers]
  losses = {n: fits[n].final_metrics["loss_by_context"] for n in names}  # [seeds, K]
  lengths = [k * context for k in mults]
  rep.section("Length generalization (" + ", ".join(f"{k}×" for k in mults)
              + " the training context)")
  shared = (f"the first {int(length_windows) * context:,} {unit} of the validation text"
            if length_windows else "the validation text")
  windows = evaluators.context_windows(stream, context, mults, evaluators.shared_tokens(
      length_windows, context, limit_tokens))
  rep.text(f"Every model trained on windows of {context} {unit} is evaluated on {shared}, cut "
           f"into windows of k·L {unit} ("
           + ", ".join(f"{len(windows[k]['inputs'])} at {k}×" for k in mults)
           + "); the loss is the mean over every position of a window, so positions beyond "
           f"L are a share 1 − 1/k of it ({1 - 1 / max(mults):.0%} at {max(mults)}×). " + note)
  rep.table(report.length_rows(losses, lengths, label),
            caption="Validation loss (nats) at k × the training context, mean ± std over "
                    "seeds")
  kernels, rows = {}, []
  for n in names:
    model, row = build_model(n), {label: n}
    secs = np.asarray(fits[n].final_metrics["eval_seconds_by_context"], np.float64)[0]
    kernels[n] = {t: stats.attention_kernel(model, t) for t, sec in zip(lengths, secs,
                                                                         strict=True)
                  if np.isfinite(sec)}
    for t, sec in zip(lengths, secs, strict=True):
      row[f"{t // context}× ({t})"] = (f"{kernels[n][t]}, {sec:.3g} s" if t in kernels[n]
                                       else "n/a")
    rows.append(row)
  rep.table(rows, caption="The attention implementation at each evaluation length, as "
                          "attnx.core.explain reports the dispatcher's choice (implementation="
                          "None: blocked = streaming, O(T) memory; dense = the T×T weights), and "
                          "the seconds of that pass for all seeds together (compile included; "
                          f"{context}: the whole validation split, the others the shared text).")
  length_verdicts = {k: v for k in judged if (v := evaluators.length_comparisons(
      losses, mults, margin, at=k, reference=reference))}
  if length_verdicts:
    ks = " and ".join(f"{k}×" for k in length_verdicts)
    rep.text("Does F degrade less than softmax beyond the training context (the claim of "
             "SSMax, Nakanishi 2025, and stick-breaking, Tan et al. 2024)? Metric: the "
             f"*increase* of validation loss from 1× to {ks} (lower is better), each F vs "
             f"{reference}, paired by seed. "
             + verdict.Comparison.rule(margin, num_seeds, f"loss increase 1× → {ks} (nats)"))
    rep.table([c.row() for v in length_verdicts.values() for c in v.values()],
              caption=f"Each {label} (A) vs {reference} (B): increase of the loss from 1× to "
                      f"{ks} the training context")
    for v in length_verdicts.values():
      for c in v.values():
        rep.verdict(c.not_worse, c.sentence() + ".")
  per_pos = {n: fits[n].final_metrics["loss_by_position"] for n in names}
  rep.figure(report.plot_loss_vs_length(losses, lengths, per_position=per_pos,
                                        train_length=context), figure,
             f"Left: validation loss vs evaluation context in {unit} (mean ± std over seeds). "
             "Right: loss per position (octave buckets: 1, 2–3, 4–7, …) at the longest context "
             f"each model can evaluate; dotted: the training context {context}.")
  return length_verdicts, kernels


def loss_rows(result: Any, tokens_per_step: int, *, label: str = "variant",
              reference: str = "softmax", bits: str = "bpc") -> list[dict[str, Any]]:
  """A language model's final losses per variant of a ``TaskResult``: validation (``loss``) and,
  where evaluated, test (``test_loss``) loss in nats and in bits per token (``bits``: the
  column's unit, e.g. "bpc" per character), next-token accuracy, tokens/s per model
  (``tokens_per_step`` / seconds per step), compile seconds and the outcome vs
  ``reference``; a diverged variant gets a row saying so."""
  rows = []
  for name, res in result.fits.items():
    m = res.final_metrics
    row: dict[str, Any] = {label: name}
    for split, key in (("val", "loss"), ("test", "test_loss")):
      if key in m:
        row.update({f"{split} loss (nats)": report.mean_std(m[key], ".4f"),
                    f"{split} {bits}": report.mean_std(np.asarray(m[key]) / np.log(2), ".4f")})
    row["val accuracy"] = report.mean_std(m["accuracy"], ".3f")
    row["tokens/s"] = tokens_per_step / res.seconds_per_step
    row["compile s"] = res.compile_seconds
    if name in result.comparisons:
      row[f"vs {reference} (val loss)"] = result.comparisons[name].outcome
    rows.append(row)
  return rows + [{label: name, "val loss (nats)": "diverged", "note": msg.split(". ")[0]}
                 for name, msg in result.failures.items()]
