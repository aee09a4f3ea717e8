"""The rules by which every attnx experiment turns its results into a verdict.

One comparison of two variants over seeds follows the **paired** rule below; a claim that
rests on several comparisons or on deterministic values follows one of the other named kinds
(:data:`KINDS`, documented on docs/results/index.md, "Verdict rules"):

* **paired** — :func:`compare` → :class:`Comparison`: A vs B, better / worse / within noise /
  inconclusive (below).
* **claim** — :func:`claim` → :class:`Claim`: several parts, each a comparison with a required
  outcome (:func:`part`, :data:`REQUIREMENTS`), an exact check (:func:`exact`, :func:`check`)
  or a claim itself; held when every part is met, not held when any part is refuted,
  inconclusive otherwise.
* **all or none** — ``claim(parts, require="all or none")``: one statement checked at several
  points (e.g. noise levels): held at every point, not held at none, inconclusive when mixed.
* **any** — ``claim(parts, require="any")``: one statement that needs one point (e.g. "solves
  the task at some width"): held when met at some point, not held when refuted at every one.
* **unanimous** — :func:`unanimous` / :func:`unanimous_held`: the outcome of several
  comparisons together (better only if better on every one, worse if worse on any).
* **exact** — :func:`exact`: deterministic values (closed forms, kernels) against a tolerance;
  no seeds, so never inconclusive.

Each report names its kind with :func:`rule` (and, for comparisons, :meth:`Comparison.rule`).

The paired rule (stated in every report that uses it, see :meth:`Comparison.rule`):

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
from collections.abc import Iterable, Mapping, Sequence

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


def compare(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray | float, *,
            margin: float, higher_is_better: bool = True, a_name: str = "A",
            b_name: str = "B", metric: str = "metric",
            deterministic: bool = False) -> Comparison:
  """Compares per-seed results ``a`` and ``b`` (same seeds, same order) by the module's rule.

  Args:
    a, b: one value per seed; paired by position, so they must have the same length. ``b``
      may be a scalar: a reference without seed noise (chance, a closed form, a threshold),
      the same for every seed.
    margin: δ > 0, the difference below which A and B count as equal in practice.
    higher_is_better: orientation of the metric (False for losses and errors).
    a_name, b_name, metric: labels for the sentence and table row.
    deterministic: the values have no seed noise (e.g. a closed-form computation): the
      interval is the point difference itself.

  Raises:
    ValueError: for unequal lengths, no values, non-finite values or margin ≤ 0.
  """
  a_arr, b_arr = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  if np.ndim(b) == 0:
    b_arr = np.full_like(a_arr, b_arr[0])
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


# ------------------------------------------------------------------------------------------
# Verdicts over several results: the named kinds.
# ------------------------------------------------------------------------------------------

KINDS: dict[str, str] = {
    "paired": "A vs B over seeds: the 95 % paired t-interval of the difference against a "
              "margin δ gives better / worse (excludes 0, not inside ±δ), within noise (inside "
              "±δ) or inconclusive.",
    "claim": "several parts, each a paired comparison with a required outcome, an exact check "
             "or a claim itself: held when every part is met, not held when any part is "
             "refuted (a decided outcome other than the required one), inconclusive "
             "otherwise; untested without parts.",
    "all or none": "one statement checked at several points (e.g. noise levels): held when "
                   "it is met at every point, not held when it is met at none, inconclusive "
                   "when mixed or undecided; untested without points.",
    "any": "one statement that needs a single point (e.g. \"solves the task at some width\"): "
           "held when it is met at some point, not held when it is refuted at every point, "
           "inconclusive otherwise; untested without points.",
    "unanimous": "several comparisons taken together: better only if better on every one, "
                 "worse if worse on any, within noise if within noise on all, inconclusive "
                 "otherwise (untested without comparisons); the claim \"better\" holds when "
                 "better and fails when worse.",
    "exact": "deterministic values (closed forms, kernels, float32 rounding): met when "
             "|value − reference| < tol (\"equal\") or > tol (\"differ\"); a non-finite "
             "value is never met; no seeds, so never inconclusive.",
}

# Required outcome of a compared part -> (outcomes that meet it, outcomes that refute it);
# "inconclusive" leaves every requirement undecided.
REQUIREMENTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "better": (frozenset({"better"}), frozenset({"worse", "within noise"})),
    "not worse": (frozenset({"better", "within noise"}), frozenset({"worse"})),
    "worse": (frozenset({"worse"}), frozenset({"better", "within noise"})),
    "within noise": (frozenset({"within noise"}), frozenset({"better", "worse"})),
}
CLAIM_KINDS = ("claim", "all or none", "any")


def rule(kind: str) -> str:
  """The named kind's rule in one sentence, for a report: "Verdict rule *claim*
  (attnx.train.verdict): ..." (the seed count and margins of the comparisons underneath are
  stated by :meth:`Comparison.rule`)."""
  if kind not in KINDS:
    raise ValueError(f"unknown verdict kind {kind!r}; valid: {', '.join(KINDS)}")
  return f"Verdict rule *{kind}* (attnx.train.verdict): {KINDS[kind]}"


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of a claim: met (True), refuted (False) or undecided (None), with a name and
  the sentence that reports it."""

  name: str
  met: bool | None
  text: str = ""
  tested: bool = True


def part(c: Comparison, require: str, name: str | None = None) -> Part:
  """A paired comparison as a claim part that needs the outcome ``require`` (a key of
  :data:`REQUIREMENTS`): met by it, refuted by a decided other outcome, undecided when
  inconclusive. ``name`` defaults to A's name; the text is the comparison's sentence."""
  if require not in REQUIREMENTS:
    raise ValueError(f"unknown requirement {require!r}; valid: {', '.join(REQUIREMENTS)}")
  meets, refutes = REQUIREMENTS[require]
  met = True if c.outcome in meets else False if c.outcome in refutes else None
  return Part(c.a if name is None else name, met, c.sentence())


def check(name: str, met: bool | None, text: str = "") -> Part:
  """A deterministic statement as a claim part (e.g. "the error falls with k" on every seed);
  None: not decidable here."""
  return Part(name, None if met is None else bool(met), text)


def within_tolerance(value: float, tol: float, reference: float = 0.0,
                     expect: str = "equal") -> bool:
  """The *exact* kind's test: ``|value − reference| < tol`` (``expect="equal"``) or
  ``> tol`` (``"differ"``); a non-finite value meets neither."""
  if expect not in ("equal", "differ"):
    raise ValueError(f"expect must be 'equal' or 'differ', got {expect!r}")
  if not tol >= 0:
    raise ValueError(f"tolerance must be ≥ 0, got {tol}")
  d = abs(float(value) - float(reference))
  if not math.isfinite(d):
    return False
  return d < tol if expect == "equal" else d > tol


def exact(name: str, value: float, reference: float = 0.0, *, tol: float,
          expect: str = "equal", text: str = "") -> Part:
  """A deterministic value as a claim part (kind *exact*): met by :func:`within_tolerance`,
  refuted otherwise (never undecided: there is no seed noise)."""
  return Part(name, within_tolerance(value, tol, reference, expect), text)


@dataclasses.dataclass(frozen=True)
class Claim:
  """A verdict over several parts (kind *claim*, *all or none* or *any*, see :data:`KINDS`). A
  claim is itself a part (``met`` is ``held``), so claims nest; an untested claim (no tested
  parts) is left out of the claim above it."""

  parts: tuple[Part, ...]
  kind: str = "claim"
  name: str = ""

  @property
  def tested(self) -> bool:
    """Whether any part was tested (a claim without parts is *untested*)."""
    return any(p.tested for p in self.parts)

  @property
  def held(self) -> bool | None:
    """True (held), False (not held) or None (inconclusive or untested), by the kind's rule."""
    states = [p.met for p in self.parts if p.tested]
    if not states:
      return None
    if self.kind == "all or none":
      return True if all(states) else False if all(s is False for s in states) else None
    if self.kind == "any":
      return True if True in states else False if all(s is False for s in states) else None
    return False if False in states else True if all(states) else None

  @property
  def met(self) -> bool | None:
    return self.held

  @property
  def text(self) -> str:
    """The parts' sentences, each ending with a full stop."""
    return " ".join(p.text + "." for p in self.parts if p.text)

  def refuted(self) -> list[str]:
    """Names of the parts that are refuted."""
    return [p.name for p in self.parts if p.tested and p.met is False]

  def undecided(self) -> list[str]:
    """Names of the parts that are undecided."""
    return [p.name for p in self.parts if p.tested and p.met is None]

  def say(self, held: str, not_held: str, inconclusive: str, untested: str = "") -> str:
    """The sentence for this claim's state; ``{refuted}`` and ``{undecided}`` in it are
    replaced by the comma-separated names of those parts."""
    text = (untested if not self.tested else
            {True: held, False: not_held, None: inconclusive}[self.held])
    return text.format(refuted=", ".join(self.refuted()),
                       undecided=", ".join(self.undecided()))

  def rule(self) -> str:
    """This claim's rule for a report (:func:`rule` of its kind)."""
    return rule(self.kind)


def claim(parts: Iterable[Part | Claim], require: str = "all", name: str = "") -> Claim:
  """A claim over ``parts`` (:class:`Part`, e.g. from :func:`part`, :func:`exact`,
  :func:`check`, or nested :class:`Claim`): ``require="all"`` is the kind *claim* (held when
  every part is met, not held when any is refuted, inconclusive otherwise), ``"all or none"``
  the kind *all or none* (held when met at every part, not held when at none), ``"any"`` the
  kind *any* (held when met at some part, not held when refuted at every one)."""
  kinds = {"all": "claim", "all or none": "all or none", "any": "any"}
  if require not in kinds:
    raise ValueError(f"unknown claim requirement {require!r}; valid: {', '.join(kinds)}")
  return Claim(tuple(parts), kinds[require], name)


def unanimous(outcomes: Iterable[str]) -> str:
  """The outcome of several comparisons together (kind *unanimous*): "better" only if better
  on every one, "worse" if worse on any, "within noise" if within noise on all, "untested"
  without outcomes, else "inconclusive". Also combines such combined outcomes."""
  outcomes = list(outcomes)
  bad = [o for o in outcomes if o not in OUTCOMES + ("untested",)]
  if bad:
    raise ValueError(f"unanimous: unknown outcomes {bad}; valid: {', '.join(OUTCOMES)}, "
                     "untested")
  if not outcomes:
    return "untested"
  if all(o == "better" for o in outcomes):
    return "better"
  if any(o == "worse" for o in outcomes):
    return "worse"
  if all(o == "within noise" for o in outcomes):
    return "within noise"
  return "inconclusive"


def unanimous_held(outcomes: Iterable[str] | Mapping[str, str]) -> bool | None:
  """Whether the claim "better" holds over ``outcomes`` by the kind *unanimous*: True when
  :func:`unanimous` gives "better", False when "worse", else None (also when untested)."""
  values = outcomes.values() if isinstance(outcomes, Mapping) else outcomes
  return {"better": True, "worse": False}.get(unanimous(values))
