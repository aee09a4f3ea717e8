"""Kernel-level shift invariance of weightings: what w = F(s)/ΣF(s) does under s -> s + M.

Alam et al. ("Attention in machine learning: how to explain the empirical formula"): adding
the same M to every score leaves w unchanged for all M only if F(a+M)/F(a) = g(M) does not
depend on a, whose only increasing solution is F(a) = c·exp(αa). These functions measure both
sides in float32, for any registered weighting (or callable F):

* :func:`shift_table`: the largest change of a weight, abs(w(s+M) − w(s)), over random score
  rows, per shift M, and whether the weighting is invariant (the *exact* kind of
  :mod:`attnx.train.verdict`: below ``tol``);
* :func:`functional_equation_table`: the relative spread over a of F(a+M)/F(a), and whether
  g(M) is constant in a;
* :func:`invariance_sets`: the sets these give (invariant, g constant, denominator offset,
  predicted, exp family) and where they disagree.

The exp family is :func:`exp_family`: the pointwise weightings that declare the
``shift_invariant`` trait (softmax, exp and gaussian, exp of −‖q−k‖²/2h²).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx import core
from attnx.train import report as report_lib
from attnx.train import verdict
from attnx.train.verdict import within_tolerance

# Weightings defined on distances: they take the score s = −‖q − k‖² (≤ 0).
DISTANCE_KERNELS = ("gaussian", "boxcar", "triangular", "epanechnikov")


def exp_family() -> tuple[str, ...]:
  """The registered pointwise weightings that declare the ``shift_invariant`` trait."""
  return tuple(core.list_weightings("pointwise", shift_invariant=True))


def in_exp_family(name: str) -> bool:
  """Whether the weighting ``name`` (parameters allowed) is in the exp family."""
  w = core.get_weighting(name)
  return w.kind == "pointwise" and w.shift_invariant


def sum_form(name: str) -> bool:
  """True if the pointwise weights are F(s)/ΣF(s), i.e. they declare sums_to_one (the
  functional equation is about this form; softmax_plus_one's 1 + ΣF is not)."""
  return core.get_weighting(name).sums_to_one


def score_rows(name: str, key: jax.Array, num_rows: int, num_keys: int, dim: int) -> jax.Array:
  """Random score rows of the kind the weighting is used with: −‖q − k‖² of random points
  (scale 0.3, dimension ``dim``) for the distance kernels, N(0, 2²) otherwise."""
  if core.parse_weighting_name(name)[0] in DISTANCE_KERNELS:
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (num_rows, 1, dim)) * 0.3
    k = jax.random.normal(kk, (num_rows, num_keys, dim)) * 0.3
    return -jnp.sum((q - k) ** 2, -1)  # −‖q − k‖² ∈ [−few, 0]
  return 2.0 * jax.random.normal(key, (num_rows, num_keys))


def shift_table(specs: Sequence[tuple[str, Any]], *, shifts: Sequence[float],
                large_shift: float, num_rows: int, num_keys: int, dim: int, seed: int,
                tol: float = 1e-5) -> list[dict[str, Any]]:
  """The largest abs(w(s+M) − w(s)) per weighting and shift M (float32), one row per ``(label,
  spec)`` (spec: a weighting name or a callable F, whose rows are drawn as for softmax): a column
  per M, ``max_diff`` over ``shifts`` (NaN where a row overflowed), the column of ``large_shift``
  (beyond exp's float32 range unless the row maximum is subtracted) and ``invariant`` (``max_diff``
  < ``tol``, finite)."""
  if num_keys < 2 or not specs:
    raise ValueError(f"shift_table needs weightings and ≥ 2 keys, got {len(specs)} "
                     f"weightings and {num_keys} keys")
  key = jax.random.PRNGKey(seed)
  rows = []
  for label, spec in specs:
    s = score_rows(spec if isinstance(spec, str) else "softmax", key, num_rows, num_keys,
                   dim).astype(jnp.float32)
    # All shifts in one call: [1 + num_shifts, rows, keys] (0 first, the large shift last).
    all_shifts = np.array([0.0, *shifts, large_shift], np.float32)
    w = np.asarray(core.weights(s[None] + jnp.asarray(all_shifts)[:, None, None], spec))
    with np.errstate(invalid="ignore"):
      d = np.max(np.abs(w[1:] - w[0]), axis=(1, 2))  # NaN where a row overflowed
    row: dict[str, Any] = {"weighting": label}
    for m, dm in zip(shifts, d[:-1], strict=True):
      row[f"M={m:g}"] = float(dm)
    row["max_diff"] = float(np.max(d[:-1]))  # NaN propagates: overflow is not invariance
    row[f"M={large_shift:g}"] = float(d[-1])
    row["invariant"] = within_tolerance(row["max_diff"], tol)
    rows.append(row)
  return rows


def functional_equation_table(names: Sequence[str], *, ratio_shifts: Sequence[float],
                              grid: int, num_keys: int, tol: float = 1e-4
                              ) -> list[dict[str, Any]]:
  """Relative spread over a of r(a) = F(a+M)/F(a), (max r − min r)/median r on a float32
  grid of ``grid`` points where F(a), F(a+M) > 0 (a ∈ [−6, 0] for the distance kernels,
  [−4, 4] otherwise): a column per M, ``defined on`` (the least fraction of the grid where
  both are > 0), ``max_spread`` and ``g(M) constant`` (defined on the whole grid and
  ``max_spread`` < ``tol``: constant in a iff F(a) = c·exp(αa))."""
  rows = []
  for name in names:
    w = core.get_weighting(name)
    lo, hi = (-6.0, 0.0) if core.parse_weighting_name(name)[0] in DISTANCE_KERNELS else (-4.0, 4.0)
    row: dict[str, Any] = {"weighting": name}
    spreads, defined = [], []
    for m in ratio_shifts:
      a = jnp.linspace(lo, hi - m, grid, dtype=jnp.float32)
      fa, fam = w(a, num_keys), w(a + jnp.float32(m), num_keys)
      ok = (fa > 0) & (fam > 0)
      defined.append(float(jnp.mean(ok)))
      if not bool(jnp.any(ok)):
        row[f"spread M={m:g}"] = float("nan")
        spreads.append(float("nan"))
        continue
      r = np.asarray(fam / jnp.where(ok, fa, 1.0))[np.asarray(ok)]
      spread = float((r.max() - r.min()) / np.abs(np.median(r)))
      row[f"spread M={m:g}"] = spread
      spreads.append(spread)
    row["defined on"] = min(defined)  # fraction of the a-grid where F(a), F(a+M) > 0
    row["max_spread"] = float(np.nanmax(spreads)) if not np.all(np.isnan(spreads)) else float("nan")
    # g(M) must exist for every a: a ratio that is constant only on part of the grid is not one.
    row["g(M) constant"] = bool(row["defined on"] == 1.0
                                and within_tolerance(row["max_spread"], tol))
    rows.append(row)
  return rows


def invariance_sets(inv: Sequence[dict[str, Any]], fe: Sequence[dict[str, Any]]
                    ) -> dict[str, list[str]]:
  """The measured sets (sorted names) from :func:`shift_table` rows ``inv`` and
  :func:`functional_equation_table` rows ``fe`` over the same pointwise weightings:
  ``invariant``, ``g_const`` (F(a+M)/F(a) constant in a), ``offset`` (of those, the ones not
  of the form F(s)/ΣF(s)), ``predicted`` (g_const less offset), ``exp_family`` (tested) and
  the four differences ``invariant_not_predicted``, ``predicted_not_invariant``,
  ``family_not_invariant``, ``invariant_outside_family``."""
  names = [r["weighting"] for r in fe]  # the pointwise weightings (fe has no extra rows)
  by_label = {r["weighting"]: r for r in inv}
  missing = [n for n in names if n not in by_label]
  if missing:
    raise ValueError(f"invariance_sets: no shift_table row for {missing}")
  invariant = {n for n in names if by_label[n]["invariant"]}
  g_const = {r["weighting"] for r in fe if r["g(M) constant"]}
  offset = {n for n in g_const if not sum_form(n)}
  predicted = g_const - offset
  family = {n for n in names if in_exp_family(n)}
  return {"invariant": sorted(invariant), "g_const": sorted(g_const), "offset": sorted(offset),
          "predicted": sorted(predicted), "exp_family": sorted(family),
          "invariant_not_predicted": sorted(invariant - predicted),
          "predicted_not_invariant": sorted(predicted - invariant),
          "family_not_invariant": sorted(family - invariant),
          "invariant_outside_family": sorted(invariant - family)}


def kernel_summary(inv: Sequence[dict[str, Any]], fe: Sequence[dict[str, Any]]
                   ) -> dict[str, Any]:
  """The measured sets (:func:`invariance_sets`) and Alam et al.'s claim as ``held``: kind
  *claim* of :mod:`attnx.train.verdict` with one exact part per tested pointwise weighting,
  invariant ⇔ F(a+M)/F(a) constant in a and of the form F(s)/ΣF(s) ⇔ exp family; None
  (untested) if no exp-family member was tested."""
  ks = invariance_sets(inv, fe)
  sets = [set(ks[k]) for k in ("invariant", "predicted", "exp_family")]
  claim = verdict.claim(
      verdict.check(n, (n in sets[0]) == (n in sets[1]) == (n in sets[2]))
      for n in (r["weighting"] for r in fe) if sets[2])
  return {**ks, "held": claim.held}


def kernel_text(ks: dict[str, Any]) -> str:
  """The kernel-level verdict sentence for :func:`kernel_summary`'s result."""
  names = lambda xs: ", ".join(xs) or "none"
  if ks["held"] is None:
    return ("Kernel level: no exp-family weighting (" + ", ".join(exp_family()) + ") was in "
            f"kernel.weightings, so 'only exp' cannot be checked; invariant: "
            f"{names(ks['invariant'])}.")
  if ks["held"]:
    return ("Kernel level: the F(s)/ΣF(s) weightings invariant to every shift M "
            f"({names(ks['invariant'])}) are exactly those with F(a+M)/F(a) constant in a"
            + (f" (less {names(ks['offset'])}, whose denominator has an offset)"
               if ks["offset"] else "")
            + ", and exactly the exp family tested here: only the exp family is "
            "shift-invariant, as the functional equation predicts.")
  problems = [(k, lab) for k, lab in (
      ("invariant_not_predicted", "invariant although F(a+M)/F(a) is not constant"),
      ("predicted_not_invariant", "F(a+M)/F(a) constant but not invariant"),
      ("family_not_invariant", "exp family but not invariant"),
      ("invariant_outside_family", "invariant outside the exp family")) if ks[k]]
  return ("Kernel level: the invariant set (" + names(ks["invariant"]) + ") does not match "
          "the functional equation's prediction (" + names(ks["predicted"]) + "): "
          + "; ".join(f"{lab}: {names(ks[k])}" for k, lab in problems) + ".")


def kernel_notes(inv: Sequence[dict[str, Any]], ks: dict[str, Any], shifts: Sequence[float],
                 large_shift: float) -> str:
  """What the tables show beyond the claim: denominator offsets, a naive exp callable (row
  label "exp (naive callable, no max shift)"), row normalizers (labels "<name> (row
  normalizer)")."""
  by_label = {r["weighting"]: r for r in inv}
  notes = [f"Invariant F(s)/ΣF(s) weightings: {', '.join(ks['invariant']) or 'none'}. "
           f"F with constant F(a+M)/F(a): {', '.join(ks['g_const']) or 'none'}."]
  for n in ks["offset"]:
    row = by_label[n]
    worst = max((f"M={m:g}" for m in shifts), key=lambda c, row=row: row[c])
    notes.append(f"`{n}` has a constant F(a+M)/F(a), but its denominator adds "
                 f"{core.get_weighting(n).denominator_offset:g} to ΣF, so it is not of the form "
                 f"F(s)/ΣF(s): its weights change by up to {row['max_diff']:.2g} (largest at "
                 f"{worst}).")
  naive = by_label.get("exp (naive callable, no max shift)")
  if naive is not None:
    finite = np.isfinite(naive[f"M={large_shift:g}"])
    notes.append("The naive exp callable (no row-max shift) is "
                 + ("invariant" if naive["invariant"] else "not invariant") + " over the grid of M"
                 + (f" and stays finite at M = {large_shift:g}" if finite else
                    f" but overflows in float32 at M = {large_shift:g} (NaN), which is why "
                    "kernels subtract the row maximum") + ".")
  inv_norm = [r["weighting"].split(" ")[0] for r in inv
              if r["weighting"].endswith("(row normalizer)") and r["invariant"]]
  if inv_norm:
    notes.append(f"{', '.join(inv_norm)} (not of the form F(s)/ΣF(s); they threshold the whole "
                 "row) are shift invariant too: the paper's 'only exp' is a statement about "
                 "pointwise F with sum normalization.")
  return " ".join(notes)


def training_summary(tr: Mapping[str, Any], sigmas: Sequence[float],
                     margins: Mapping[str, float] | None = None) -> dict[str, Any]:
  """Per noise level σ > 0: TV ranking, F tied for the least weight change and for the best
  accuracy among dot-product F (*paired*: not shown worse than the best), and whether the exp
  family is among them. held (kind *all or none* over those checks): True if an exp-family F
  is tied-best in both at every σ > 0, False if at no σ in either, None if mixed or if fewer
  than two dot-product F (or no exp-family F) were trained."""
  m = dict(margins or {"tv": 0.01, "accuracy": 0.01})
  dot = [lab for lab in tr["accuracy"] if tr["scores"][lab] == "dot"]
  family = [lab for lab in dot if in_exp_family(lab)]
  per_sigma = []
  for x in (x for x in sigmas if x > min(sigmas)):
    tv = {lab: np.asarray(tr["weight_tv"][lab][x]) for lab in dot}
    acc = {lab: np.asarray(tr["accuracy"][lab][x]) for lab in dot}
    tv_best = verdict.tied_best(tv, margin=m["tv"], higher_is_better=False)
    acc_best = verdict.tied_best(acc, margin=m["accuracy"])
    per_sigma.append({
        "sigma": x, "tv_ranking": sorted(dot, key=lambda lab, tv=tv: float(np.mean(tv[lab]))),
        "tv_mean": {lab: float(np.mean(v)) for lab, v in tv.items()},
        "tv_best": tv_best, "acc_best": acc_best,
        "tv_ok": bool(set(tv_best) & set(family)), "acc_ok": bool(set(acc_best) & set(family))})
  comparable = len(dot) >= 2 and bool(family) and bool(per_sigma)
  claim = verdict.claim((verdict.check(f"{k} at σ={p['sigma']:g}", p[k])
                               for p in per_sigma for k in ("tv_ok", "acc_ok") if comparable),
                              require="all or none")
  return {"per_sigma": per_sigma, "exp_family_trained": family, "comparable": comparable,
          "held": claim.held}


def training_text(summary: dict[str, Any]) -> str:
  """The training-level verdict sentence for :func:`training_summary`'s result."""
  per = summary["per_sigma"]
  fam = ", ".join(summary["exp_family_trained"]) or "none"
  if not summary["comparable"]:
    return ("Training level: not enough to compare (needs an exp-family F and at least one "
            "other dot-product F, and a noise level above the lowest).")

  def where(key: str) -> str:
    yes = [f"{p['sigma']:g}" for p in per if p[key]]
    no = [f"{p['sigma']:g}" for p in per if not p[key]]
    if not no:
      return f"at every σ tested ({', '.join(yes)})"
    return f"at σ = {', '.join(yes)} but not at σ = {', '.join(no)}" if yes else (
        f"at no σ ({', '.join(no)})")

  text = (f"Training level (exp family trained: {fam}): it has the least weight change (ties "
          f"included) {where('tv_ok')}, and the best accuracy {where('acc_ok')}. Least change "
          "per σ: " + "; ".join(f"σ={p['sigma']:g}: {', '.join(p['tv_best'])}" for p in per)
          + ". Most accurate per σ: " + "; ".join(
              f"σ={p['sigma']:g}: {', '.join(p['acc_best'])}" for p in per) + ".")
  if summary["held"] is None:
    text += " Mixed: the claim's practical consequence is only partly borne out."
  elif not summary["held"]:
    text += " The claim's practical consequence did not show here."
  return text


def report_kernel_level(rep: Any, inv: Sequence[dict[str, Any]], fe: Sequence[dict[str, Any]],
                        *, num_rows: int, num_keys: int, shifts: Sequence[float],
                        large_shift: float) -> dict[str, Any]:
  """Section (a) of a shift-invariance report (an :class:`attnx.train.Report`): the two
  tables, the notes, the rule and the verdict; returns :func:`kernel_summary`'s result."""
  rep.text(f"{num_rows} random score rows of {num_keys} keys (float32): s ~ N(0, 2²) for "
           f"dot-type F; s = −‖q−k‖² of random points for the distance kernels "
           f"({', '.join(DISTANCE_KERNELS)}). Entry: max_ij |w(s+M) − w(s)|. 'invariant' "
           "means < 1e-5 for every M in the grid (float32 rounding of s + M alone is "
           "≈ 5e-7 at |M| = 10). NaN: the weights overflowed.")
  rep.table(list(inv), caption="max |w(s+M) − w(s)| per weighting and shift M")
  rep.text("Functional equation (5)–(7): r(a) = F(a+M)/F(a) on a grid of a (where both are > 0). "
           "Entry: (max r − min r)/median r; 0 (to f32 rounding) iff r = g(M).")
  rep.table(list(fe), caption="relative spread of F(a+M)/F(a) over a")
  ks = kernel_summary(inv, fe)
  rep.text(kernel_notes(inv, ks, shifts, large_shift) + " " + verdict.rule("claim")
           + " Its parts are exact: " + verdict.KINDS["exact"])
  rep.verdict(ks["held"], kernel_text(ks))
  return ks


def _training_notes(tr: Mapping[str, Any], summary: Mapping[str, Any],
                    sigmas: Sequence[float]) -> str:
  """softmax_plus_one's ties with softmax, and what the distance-score model saw."""
  notes = []
  plus_one = [lab for lab in tr["accuracy"] if core.parse_weighting_name(lab)[0]
              == "softmax_plus_one" and tr["scores"][lab] == "dot"]
  for lab in plus_one:
    ties = []
    for key, what in (("acc_best", "accuracy"), ("tv_best", "weight change")):
      tied = [p["sigma"] for p in summary["per_sigma"]
              if lab in p[key] and "softmax" in p[key]]
      if tied:
        ties.append(f"in {what} at σ = " + ", ".join(f"{x:g}" for x in tied))
    if ties:
      notes.append(f"{lab} ties with softmax " + " and ".join(ties) + ": the +1 in its "
                   "denominator is negligible once Σexp is large, so this is the same weighting "
                   "in practice, not a separate win for a non-invariant F.")
  for lab in (lab for lab in tr["accuracy"] if tr["scores"][lab] == "neg_sq_dist"):
    tv_max = max(float(np.max(tr["weight_tv"][lab][x])) for x in sigmas)
    acc = [float(np.mean(tr["accuracy"][lab][x])) for x in sigmas]
    seen = ("does not see g (largest weight change " if tv_max < 1e-5 else
            "should not see g (yet its weights change by up to ")
    notes.append(f"{lab}: the distance score {seen}{tv_max:.1e}); its accuracy goes from "
                 f"{acc[0]:.3f} to {acc[-1]:.3f} (the values x_j carry g into y_i).")
  return ("The cross term g·x_j varies with the key, so even softmax's weights move under a "
          "real global-noise component; bounded F saturate at large σ (sigmoid → uniform "
          "weights), so their weight change can stop growing while their accuracy is already "
          "low." + ("" if not notes else " " + " ".join(notes)))


def report_training_level(rep: Any, tr: Mapping[str, Any], sigmas: Sequence[float], *,
                          margins: Mapping[str, float], num_seeds: int, dim: int
                          ) -> dict[str, Any]:
  """Section (b) of a shift-invariance report from trained models evaluated at global-noise
  levels ``sigmas``: ``tr`` = {"accuracy", "weight_tv": {F: {σ: per-seed}}, "histories":
  {F: history}, "scores": {F: score name}}. Tables and figures by level, the ranking per σ,
  the rule, the notes and the verdict; returns :func:`training_summary`'s result."""
  shift = {s: s * s * dim for s in sigmas}
  rep.table(report_lib.level_rows(tr["accuracy"], sigmas, label="F"), floatfmt=".3f",
            caption="object accuracy vs global-noise level σ (mean ± std over seeds)")
  rep.table(report_lib.level_rows(tr["weight_tv"], sigmas, label="F"), floatfmt=".3f",
            caption=f"mean total-variation distance of the attention rows to those at "
            f"σ={min(sigmas):g} (same samples): the weight change the seed's argument is about")
  fig, axes = report_lib.subplots(2, size=(5, 3.8))
  for ax, key, ylabel in zip(axes, ("accuracy", "weight_tv"),
                             ("object accuracy", "mean TV distance of weights"), strict=True):
    report_lib.plot_curves(report_lib.level_curves(tr[key], sigmas), xlabel="global noise σ",
                           ylabel=ylabel, band="errorbar", ax=ax)
  rep.figure(fig, "accuracy_vs_global_noise", "Accuracy (left) and change of the attention "
             "weights (right) as the global noise grows, per F.")
  rep.figure(report_lib.plot_learning_curves(tr["histories"], "loss", logy=True),
             "learning_curves", "Training loss per F (mean ± std over seeds).")
  summary = training_summary(tr, sigmas, margins)
  rank_rows = [{"σ": p["sigma"], "M ≈": shift[p["sigma"]],
                "weight change (TV), least first": " < ".join(
                    f"{lab} {p['tv_mean'][lab]:.3f}" for lab in p["tv_ranking"]),
                "least change (tied: not worse than the best)": ", ".join(p["tv_best"]),
                "most accurate (tied: not worse than the best)": ", ".join(p["acc_best"])}
               for p in summary["per_sigma"]]
  if rank_rows:
    rep.table(rank_rows, caption="dot-product F ranked by weight change at each σ; tied = "
              "not shown worse than the best by the shared verdict rule")
    rep.text(verdict.Comparison.rule(margins["tv"], num_seeds, "weight change "
                                     f"(TV; accuracy: margin ±{margins['accuracy']:g})")
             + " " + verdict.rule("all or none"))
  rep.text(_training_notes(tr, summary, sigmas))
  rep.verdict(summary["held"], training_text(summary))
  return summary
