"""attnx.train.benchmark.targets: target tables checked on rows (per row, the worst of a group,
against another row, one of several columns), and their verdict."""

from __future__ import annotations

import pytest

from attnx import train
from attnx.train.benchmark.targets import Target, add_to_report, check, summary


def _row(shape, impl, weighting, mode="fwd", **cells):
  return dict(shape=shape, mode=mode, impl=impl, weighting=weighting, **cells)


ROWS = [_row("1x64x1x8", "ref", "softmax", **{"mem": 40.0}),
        _row("1x64x1x8", "ours", "softmax", **{"mem": 4.0, "x": 1.0}),
        _row("1x64x1x8", "ours", "relu", **{"x": 1.3}),
        _row("1x64x1x8", "ours", "gelu", **{"x": 1.1, "y": 0.2}),
        _row("1x32x1x8", "ours", "relu", **{"x": 0.9})]


def test_per_row_targets_label_with_the_row_and_the_bound():
  goals = check([Target("{weighting} x ≤ {bound} at T = {T}", "x", "<=", 1.2,
                        dict(impl="ours", T=lambda t: t >= 64), "{:.1f}×")], ROWS)
  assert goals == [{"target": "softmax x ≤ 1.2 at T = 64", "measured": "1.0×", "met": "yes"},
                   {"target": "relu x ≤ 1.2 at T = 64", "measured": "1.3×", "met": "**no**"},
                   {"target": "gelu x ≤ 1.2 at T = 64", "measured": "1.1×", "met": "yes"}]
  # A tuple of targets is checked row by row; a bound may depend on the row.
  pair = (Target("a {weighting}", "x", "<", lambda f: 1.2 if f["T"] == 64 else 0.5,
                 dict(weighting="relu")), Target("b {weighting}", "y", ">", 0.1))
  assert [(g["target"], g["met"]) for g in check([pair], ROWS)] == [
      ("a relu", "**no**"), ("b gelu", "yes"), ("a relu", "**no**")]


def test_worst_over_and_column_fallback():
  worst = Target("worst {worst} at {shape}", "x", "<=", 1.2, dict(impl="ours"),
                 worst=("shape", "mode"), min_rows=2)
  assert check([worst], ROWS) == [{"target": "worst relu at 1x64x1x8", "measured": "1.30",
                                   "met": "**no**"}]  # 1x32: a single weighting
  complete = Target("{column} {worst}", ("y", "x"), ">=", 1.0, dict(impl="ours"),
                    worst=("shape",), complete=True)
  assert [g["target"] for g in check([complete], ROWS)] == ["x softmax", "x relu"]
  over = Target("{bound:.0f}× less than ref", "mem", ">=", 20, dict(impl="ours"),
                "{:.0f}×", over=dict(impl="ref"))
  assert check([over], ROWS) == [{"target": "20× less than ref", "measured": "10×",
                                  "met": "**no**"}]
  assert check([Target("none", "x", "<", 1, dict(impl="nobody"))], ROWS) == []
  with pytest.raises(ValueError, match="op must be"):
    Target("t", "x", "=<", 1.0)
  with pytest.raises(ValueError, match="do not combine"):
    Target("t", "x", "<", 1.0, worst=("shape",), over=dict(impl="ref"))


def test_summary_and_report(tmp_path):
  goals = [{"target": "a", "measured": "1", "met": "yes"},
           {"target": "b", "measured": "2", "met": "**no**"}]
  assert summary(goals) == (False, "1 of 2 targets met; missed: b.")
  assert summary(goals, count=False) == (False, "missed: b.")
  assert summary(goals[:1]) == (True, "every target met.")
  assert summary([]) == (None, "no target was checked.")
  rep = train.Report("t", str(tmp_path))
  add_to_report(rep, [])
  assert rep.verdicts == []
  add_to_report(rep, goals)
  assert rep.verdicts == [{"held": False, "text": "1 of 2 targets met; missed: b."}]
  assert "## Targets" in rep.markdown()
