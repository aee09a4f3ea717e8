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
