"""The shared verdict rule (attnx/train/verdict.py) against scipy's t-distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from attnx.train import verdict


@pytest.mark.parametrize("df", list(range(1, 31)) + [31, 35, 40, 41, 60, 61, 120, 121, 1000])
def test_t_quantile_is_scipys_rounded_up(df):
  exact = scipy.stats.t.ppf(0.975, df)
  got = verdict.t_quantile(df)
  assert exact - 5e-4 <= got <= exact + 0.025


def _interval(a, b, higher=True):
  d = (np.asarray(a) - np.asarray(b)) * (1 if higher else -1)
  lo, hi = scipy.stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=scipy.stats.sem(d))
  return lo, hi


def test_interval_matches_scipy_paired_t():
  rng = np.random.default_rng(0)
  a, b = rng.normal(0.8, 0.02, 5), rng.normal(0.79, 0.02, 5)
  c = verdict.compare(a, b, margin=0.01)
  lo, hi = _interval(a, b)
  assert c.ci_low == pytest.approx(lo, abs=1e-4) and c.ci_high == pytest.approx(hi, abs=1e-4)
  assert c.n == 5 and c.diff == pytest.approx(float(np.mean(a - b)))


@pytest.mark.parametrize("a,b,margin,higher,outcome", [
    # Consistently 0.05 higher across seeds, tight: better.
    ([0.90, 0.915, 0.92], [0.85, 0.86, 0.87], 0.01, True, "better"),
    ([0.85, 0.86, 0.87], [0.90, 0.915, 0.92], 0.01, True, "worse"),
    # A loss: lower is better.
    ([1.0, 1.1, 1.2], [1.5, 1.65, 1.7], 0.05, False, "better"),
    # Differences tiny and consistent: inside ±margin, so within noise.
    ([0.900, 0.910, 0.920], [0.901, 0.909, 0.921], 0.01, True, "within noise"),
    # Seeds disagree in sign and size: inconclusive.
    ([0.90, 0.80, 0.95], [0.85, 0.88, 0.86], 0.01, True, "inconclusive"),
    # Two seeds: t = 12.7, even a clear-looking gap can be inconclusive.
    ([0.90, 0.95], [0.88, 0.88], 0.01, True, "inconclusive"),
])
def test_outcomes(a, b, margin, higher, outcome):
  c = verdict.compare(a, b, margin=margin, higher_is_better=higher, a_name="x", b_name="y")
  assert c.outcome == outcome
  # The decision is the documented one, recomputed from scipy's interval.
  lo, hi = _interval(a, b, higher)
  expected = ("within noise" if -margin < lo and hi < margin else
              "better" if lo > 0 else "worse" if hi < 0 else "inconclusive")
  assert c.outcome == expected
  assert c.outcome in c.sentence() and "x vs y" in c.sentence()


def test_one_seed_is_inconclusive_unless_deterministic():
  assert verdict.compare([0.9], [0.5], margin=0.01).outcome == "inconclusive"
  exact = verdict.compare([0.9], [0.5], margin=0.01, deterministic=True)
  assert exact.outcome == "better" and exact.ci_low == exact.ci_high == pytest.approx(0.4)
  assert verdict.compare([1e-9], [0.0], margin=0.01, deterministic=True).outcome == \
      "within noise"


def test_not_worse_and_rule_text():
  assert verdict.compare([1, 2], [1, 2], margin=0.1).not_worse is True  # zero spread: equal
  assert verdict.compare([0.0, 0.5], [0.2, 0.2], margin=0.01).not_worse is None
  text = verdict.Comparison.rule(0.01, 3, "accuracy")
  assert "3 seeds" in text and "±0.01" in text and "95 %" in text


@pytest.mark.parametrize("a,b,margin", [([1, 2], [1], 0.1), ([], [], 0.1),
                                        ([1, math.nan], [1, 2], 0.1), ([1, 2], [1, 2], 0.0)])
def test_bad_input_is_a_clear_error(a, b, margin):
  with pytest.raises(ValueError):
    verdict.compare(a, b, margin=margin)


def test_tied_best():
  results = {"a": [0.90, 0.91, 0.92], "b": [0.899, 0.909, 0.919], "c": [0.50, 0.52, 0.51]}
  assert verdict.best(results) == "a"
  assert verdict.tied_best(results, margin=0.01) == ["a", "b"]
  assert verdict.tied_best({k: [-x for x in v] for k, v in results.items()}, margin=0.01,
                           higher_is_better=False) == ["a", "b"]


def test_seeds_needed_and_lean_of_an_inconclusive_comparison():
  # Two seeds, 0.02 and 0.07 better (loss, lower is better): d̄ = 0.045, sd = 0.0354.
  a, b = [1.00, 1.00], [1.02, 1.07]
  c = verdict.compare(a, b, margin=0.01, higher_is_better=False, a_name="x", b_name="y")
  assert c.outcome == "inconclusive" and c.a_wins == 2
  assert c.sd == pytest.approx(float(np.std([0.02, 0.07], ddof=1)))
  need = c.seeds_needed()
  # Independently from scipy: the least n whose interval at this mean and sd excludes 0.
  half = lambda n: scipy.stats.t.ppf(0.975, n - 1) * c.sd / math.sqrt(n)
  assert half(need) < c.diff and half(need - 1) >= c.diff and need == 5
  assert "lean towards x" in c.lean() and "about 5 seeds" in c.lean()
  assert "2 of 2 favour x" in c.lean()
  assert c.sentence().endswith("the seeds lean towards x (2 of 2 favour x), ≈ 5 seeds would "
                               "decide at this spread")
  # Decided outcomes say nothing and need the seeds they have.
  d = verdict.compare([0.9, 0.91, 0.92], [0.85, 0.86, 0.87], margin=0.01)
  assert d.lean() == "" and d.seeds_needed() == 3
  # A difference near zero with a tight spread: decided "within noise" with more seeds.
  e = verdict.compare([1.0, 1.001], [1.0, 0.9995], margin=0.01, higher_is_better=False)
  assert e.outcome == "inconclusive" and e.seeds_needed() == 3
  assert "one seed gives no spread" in verdict.compare([1.0], [1.1], margin=0.01).lean()


# ------------------------------------------------------------------------------------------
# The named kinds over several results.


def _c(outcome_values, margin=0.01):
  """A comparison with a chosen outcome (3 seeds, higher is better)."""
  a, b = outcome_values
  return verdict.compare(a, b, margin=margin, a_name="x", b_name="y")


BETTER = _c(([0.90, 0.915, 0.92], [0.85, 0.86, 0.87]))
WORSE = _c(([0.85, 0.86, 0.87], [0.90, 0.915, 0.92]))
EQUAL = _c(([0.900, 0.910, 0.920], [0.901, 0.909, 0.921]))
OPEN = _c(([0.90, 0.80, 0.95], [0.85, 0.88, 0.86]))


def test_the_comparisons_used_below_have_their_outcomes():
  assert [c.outcome for c in (BETTER, WORSE, EQUAL, OPEN)] == [
      "better", "worse", "within noise", "inconclusive"]


@pytest.mark.parametrize("require,expected", [
    ("better", (True, False, False, None)), ("not worse", (True, False, True, None)),
    ("worse", (False, True, False, None)), ("within noise", (False, False, True, None))])
def test_part_requirements(require, expected):
  got = tuple(verdict.part(c, require).met for c in (BETTER, WORSE, EQUAL, OPEN))
  assert got == expected
  p = verdict.part(BETTER, require, name="n")
  assert p.name == "n" and p.text == BETTER.sentence()
  with pytest.raises(ValueError, match="requirement"):
    verdict.part(BETTER, "greater")


def test_claim_all_held_refuted_inconclusive_untested():
  met, refuted, open_ = (verdict.part(BETTER, "better"), verdict.part(EQUAL, "better"),
                         verdict.part(OPEN, "better"))
  assert verdict.claim([met, verdict.part(EQUAL, "not worse")]).held is True
  assert verdict.claim([met, open_, refuted]).held is False  # any refuted part refutes
  c = verdict.claim([met, open_])
  assert c.held is None and c.undecided() == ["x"] and c.refuted() == []
  empty = verdict.claim([])
  assert empty.held is None and not empty.tested
  # Nested: an untested sub-claim is left out, a decided one counts as a part.
  assert verdict.claim([verdict.claim([met]), verdict.claim([])]).held is True
  assert verdict.claim([verdict.claim([met, refuted]), met]).held is False
  assert c.rule().startswith("Verdict rule *claim*")
  with pytest.raises(ValueError, match="requirement"):
    verdict.claim([met], require="most")


def test_claim_all_or_none():
  yes, no, open_ = (verdict.check("a", True), verdict.check("b", False),
                    verdict.check("c", None))
  assert verdict.claim([yes, yes], require="all or none").held is True
  assert verdict.claim([no, no], require="all or none").held is False
  assert verdict.claim([yes, no], require="all or none").held is None  # mixed
  assert verdict.claim([no, open_], require="all or none").held is None
  assert verdict.claim([], require="all or none").held is None
  assert verdict.claim([yes], require="all or none").kind == "all or none"


def test_claim_any():
  yes, no, open_ = (verdict.check("a", True), verdict.check("b", False),
                    verdict.check("c", None))
  assert verdict.claim([no, open_, yes], require="any").held is True  # one point is enough
  assert verdict.claim([no, no], require="any").held is False  # refuted at every point
  assert verdict.claim([no, open_], require="any").held is None
  assert verdict.claim([], require="any").held is None and not verdict.claim([]).tested
  assert verdict.claim([yes], require="any").rule().startswith("Verdict rule *any*")


def test_claim_text_and_say():
  c = verdict.claim([verdict.part(BETTER, "better", "p"), verdict.part(EQUAL, "better", "q"),
                     verdict.part(OPEN, "better", "r")])
  assert c.text == f"{BETTER.sentence()}. {EQUAL.sentence()}. {OPEN.sentence()}."
  assert c.say("all", "not for {refuted}", "open for {undecided}") == "not for q"
  assert verdict.claim([]).say("a", "b", "c", "untested") == "untested"
  assert verdict.claim([verdict.part(OPEN, "better", "r")]).say(
      "a", "b", "open for {undecided}") == "open for r"


@pytest.mark.parametrize("value,reference,tol,expect,met", [
    (5e-7, 0.0, 1e-5, "equal", True), (2e-5, 0.0, 1e-5, "equal", False),
    (1e-5, 0.0, 1e-5, "equal", False),  # strict: at the tolerance is not within it
    (0.9999999, 1.0, 1e-6, "equal", True), (math.nan, 0.0, 1e-5, "equal", False),
    (math.inf, 0.0, 1e-5, "differ", False), (0.3, 0.0, 1e-3, "differ", True),
    (1e-4, 0.0, 1e-3, "differ", False)])
def test_exact(value, reference, tol, expect, met):
  assert verdict.within_tolerance(value, tol, reference, expect) is met
  p = verdict.exact("e", value, reference, tol=tol, expect=expect)
  assert p.met is met and p.tested  # deterministic: never undecided


def test_exact_bad_input():
  with pytest.raises(ValueError, match="expect"):
    verdict.within_tolerance(0.0, 1e-5, expect="close")
  with pytest.raises(ValueError, match="tolerance"):
    verdict.exact("e", 0.0, tol=-1.0)


@pytest.mark.parametrize("outcomes,combined,held", [
    (["better", "better"], "better", True),
    (["better", "worse", "inconclusive"], "worse", False),
    (["within noise", "within noise"], "within noise", None),
    (["better", "within noise"], "inconclusive", None),
    (["better", "untested"], "inconclusive", None),
    ([], "untested", None)])
def test_unanimous(outcomes, combined, held):
  assert verdict.unanimous(outcomes) == combined
  assert verdict.unanimous_held(outcomes) is held
  assert verdict.unanimous_held(dict(enumerate(outcomes))) is held


def test_unanimous_bad_outcome_and_rule_names():
  with pytest.raises(ValueError, match="unknown outcomes"):
    verdict.unanimous(["greater"])
  assert set(verdict.KINDS) == {"paired", "claim", "all or none", "any", "unanimous",
                                "exact"}
  for kind in verdict.KINDS:
    assert verdict.rule(kind).startswith(f"Verdict rule *{kind}* (attnx.train.verdict): ")
  with pytest.raises(ValueError, match="unknown verdict kind"):
    verdict.rule("majority")


def test_a_scalar_b_is_a_reference_without_seed_noise():
  a = [0.6, 0.62, 0.61]
  assert verdict.compare(a, 0.17, margin=0.1) == verdict.compare(a, [0.17] * 3, margin=0.1)
  with pytest.raises(ValueError):
    verdict.compare(a, [0.17], margin=0.1)  # a one-element list is one seed, not a constant
