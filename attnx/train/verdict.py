"""The one rule by which every attnx experiment decides "A beats B", "within noise" or
"inconclusive" from per-seed results.

The rule (stated in every report that uses it, see :meth:`Comparison.rule`):

1. Pair the runs by seed (seed i of A and seed i of B share initialization and data order)
   and orient the differences so that positive means "A is better":
   d_i = ±(a_i − b_i), + when higher is better.
2. Form the two-sided 95 % confidence interval of the mean difference with Student's t on
   n − 1 degrees of freedom: d̄ ± t₀.₉₇₅,ₙ₋₁ · sd(d)/√n (the paired t-interval).
3. Decide, with a practical margin δ > 0 stated by the experiment (e.g. 0.01 accuracy):

   * **within noise** (equivalent) if the whole interval lies inside (−δ, δ);
   * **better** / **worse** if the interval excludes 0 (above / below) and is not inside
     (−δ, δ);
   * **inconclusive** otherwise: the seeds cannot tell (the interval straddles 0 and reaches
     beyond δ). With one seed there is no interval: inconclusive, unless the experiment is
     deterministic (``deterministic=True``: the single difference is exact).

With few seeds t is large (12.7 for 2 seeds, 4.30 for 3, 2.78 for 5), so small differences
come out inconclusive rather than as a ranking that another seed would reverse.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

OUTCOMES = ("better", "worse", "within noise", "inconclusive")
CONFIDENCE = 0.95

# Two-sided 95 % quantiles t_{0.975, df} of Student's t (df = 1..30); beyond, the normal 1.96
# bounds them from below and the df = 30 value from above (used up to df 60, then 2.0, 1.98).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
  """t_{0.975, df}, the multiplier of the 95 % two-sided interval (conservatively rounded up
  between the tabulated degrees of freedom)."""
  if df < 1:
    raise ValueError(f"degrees of freedom must be ≥ 1, got {df}")
  if df <= len(_T975):
    return _T975[df - 1]
  return 2.042 if df <= 40 else 2.021 if df <= 60 else 2.000 if df <= 120 else 1.980


@dataclasses.dataclass(frozen=True)
class Comparison:
  """The outcome of comparing A with B on one metric (see the module docstring)."""

  a: str
  b: str
  metric: str
  higher_is_better: bool
  n: int  # paired seeds
  a_mean: float
  b_mean: float
  diff: float  # mean oriented difference (> 0: A better)
  ci_low: float
  ci_high: float
  margin: float
  outcome: str  # one of OUTCOMES
  deterministic: bool = False
  sd: float = math.nan  # standard deviation of the paired differences (n ≥ 2)
  a_wins: int = 0  # seeds whose difference favours A (> 0)

  @property
  def not_worse(self) -> bool | None:
    """True if A is better or within noise, False if worse, None if inconclusive."""
    return {"better": True, "within noise": True, "worse": False}.get(self.outcome)

  def sentence(self) -> str:
    """One line for a report, e.g. "relu vs softmax (accuracy ↑): within noise — ..."."""
    arrow = "↑" if self.higher_is_better else "↓"
    ci = ("exact" if self.deterministic else
          f"95 % CI of the paired difference [{self.ci_low:+.4g}, {self.ci_high:+.4g}]"
          if self.n > 1 else "one seed, no interval")
    lean = ""
    if self.outcome == "inconclusive" and self.n > 1 and not self.deterministic:
      need, side = self.seeds_needed(), self._side()
      lean = (f"; the seeds lean towards {side} ({self.a_wins} of {self.n} favour {self.a}), "
              + (f"≈ {need} seeds would decide at this spread" if need else
                 "more than 1000 seeds would be needed at this spread"))
    return (f"{self.a} vs {self.b} ({self.metric} {arrow}): {self.outcome} — "
            f"{self.a_mean:.4g} vs {self.b_mean:.4g}, difference {self.diff:+.4g} "
            f"(A better if > 0), {ci}, margin ±{self.margin:g}, {self.n} seed(s){lean}")

  def row(self) -> dict:
    """A table row: variant, means, difference, interval, outcome."""
    return {"A": self.a, "B": self.b, "metric": self.metric, "A mean": self.a_mean,
            "B mean": self.b_mean, "A − B (better > 0)": self.diff,
            "95 % CI": "exact" if self.deterministic else
            f"[{self.ci_low:+.3g}, {self.ci_high:+.3g}]" if self.n > 1 else "—",
            "outcome": self.outcome}

  def seeds_needed(self, limit: int = 1000) -> int | None:
    """How many seeds the rule would need to decide (better, worse or within noise) if more
    seeds kept this mean difference and spread: the least n ≥ 2 whose interval
    d̄ ± t₀.₉₇₅,ₙ₋₁·sd/√n excludes 0 or lies inside ±margin. ``n`` itself when the outcome is
    decided already; None beyond ``limit`` (or without a spread: one seed)."""
    if self.outcome != "inconclusive" or self.deterministic:
      return self.n
    if not math.isfinite(self.sd):
      return None
    d = abs(self.diff)
    for n in range(max(self.n, 2), limit + 1):
      half = t_quantile(n - 1) * self.sd / math.sqrt(n)
      if half < d or d + half < self.margin:
        return n
    return None

  def _side(self) -> str:
    """The variant the mean difference favours ("neither" at exactly 0)."""
    return self.a if self.diff > 0 else self.b if self.diff < 0 else "neither"

  def lean(self) -> str:
    """For an inconclusive outcome: which side the seeds fall on and how many seeds the rule
    would need at the observed spread (one sentence); empty for a decided one."""
    if self.outcome != "inconclusive":
      return ""
    side, need = self._side(), self.seeds_needed()
    more = (f"at this spread (sd {self.sd:.3g} of the paired differences) the rule would "
            f"decide with about {need} seeds" if need else
            "at this spread the rule would need more than 1000 seeds" if math.isfinite(self.sd)
            else "one seed gives no spread")
    return (f"The {self.n} seed(s) lean towards {side} (mean difference {self.diff:+.4g}; "
            f"{self.a_wins} of {self.n} favour {self.a}); {more}.")

  @staticmethod
  def rule(margin: float, n: int, metric: str = "the metric") -> str:
    """The rule in one paragraph, with this comparison's seed count and margin."""
    return (f"Verdict rule (attnx.train.verdict): runs are paired by seed ({n} seeds); A is "
            f"*better*/*worse* than B when the 95 % paired t-interval of the difference in "
            f"{metric} excludes 0 and is not inside ±{margin:g}, *within noise* when the "
            f"whole interval is inside ±{margin:g}, and *inconclusive* otherwise.")


def compare(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *,
            margin: float, higher_is_better: bool = True, a_name: str = "A",
            b_name: str = "B", metric: str = "metric",
            deterministic: bool = False) -> Comparison:
  """Compares per-seed results ``a`` and ``b`` (same seeds, same order) by the module's rule.

  Args:
    a, b: one value per seed; paired by position, so they must have the same length.
    margin: δ > 0, the difference below which A and B count as equal in practice.
    higher_is_better: orientation of the metric (False for losses and errors).
    a_name, b_name, metric: labels for the sentence and table row.
    deterministic: the values have no seed noise (e.g. a closed-form computation): the
      interval is the point difference itself.

  Raises:
    ValueError: for unequal lengths, no values, non-finite values or margin ≤ 0.
  """
  a_arr, b_arr = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  if a_arr.shape != b_arr.shape or a_arr.size == 0:
    raise ValueError(f"compare needs one value per seed for both, paired; got {a_arr.size} "
                     f"values for {a_name!r} and {b_arr.size} for {b_name!r}")
  if not (np.all(np.isfinite(a_arr)) and np.all(np.isfinite(b_arr))):
    raise ValueError(f"compare: non-finite results for {a_name!r} or {b_name!r} ({metric}); a "
                     "diverged run has no rank")
  if not (margin > 0 and math.isfinite(margin)):
    raise ValueError(f"compare needs a finite margin > 0, got {margin}")
  sign = 1.0 if higher_is_better else -1.0
  d = sign * (a_arr - b_arr)
  n = d.size
  mean = float(d.mean())
  if deterministic:
    low = high = mean
  elif n >= 2:
    half = t_quantile(n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    low, high = mean - half, mean + half
  else:
    low, high = -math.inf, math.inf
  if -margin < low and high < margin:
    outcome = "within noise"
  elif low > 0:
    outcome = "better"
  elif high < 0:
    outcome = "worse"
  else:
    outcome = "inconclusive"
  return Comparison(a=a_name, b=b_name, metric=metric, higher_is_better=higher_is_better, n=n,
                    a_mean=float(a_arr.mean()), b_mean=float(b_arr.mean()), diff=mean,
                    ci_low=low, ci_high=high, margin=float(margin), outcome=outcome,
                    deterministic=deterministic,
                    sd=float(d.std(ddof=1)) if n >= 2 else math.nan,
                    a_wins=int(np.sum(d > 0)))


def best(results: dict[str, Sequence[float]], higher_is_better: bool = True) -> str:
  """The variant with the best seed mean (ties: the first given)."""
  if not results:
    raise ValueError("best: no results")
  key = lambda name: float(np.mean(results[name]))
  return max(results, key=key) if higher_is_better else min(results, key=key)


def tied_best(results: dict[str, Sequence[float]], *, margin: float,
              higher_is_better: bool = True, deterministic: bool = False) -> list[str]:
  """Variants not shown worse than the best one by :func:`compare` (best first, by mean)."""
  top = best(results, higher_is_better)
  order = sorted(results, key=lambda k: float(np.mean(results[k])), reverse=higher_is_better)
  return [k for k in order if k == top or compare(
      results[k], results[top], margin=margin, higher_is_better=higher_is_better,
      deterministic=deterministic).outcome != "worse"]
