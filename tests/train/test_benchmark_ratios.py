"""attnx.train.benchmark.ratios: a row's fields, and ratio columns found by their reference
rows."""

from __future__ import annotations

import pytest

from attnx.train.benchmark.ratios import Ratio, add_ratios, fields, matches


def test_fields_have_defaults_and_derived_cells():
  f = fields({"shape": "2x64x2x16", "weighting": "entmax:alpha=1.3", "causal": 1})
  assert (f["T"], f["family"], f["causal"], f["causality"]) == (64, "entmax", True, "causal")
  assert (f["mask"], f["score"]) == ("", "scaled_dot")
  assert "T" not in fields({"shape": "s"}) and fields({"T": 8, "mask": None})["mask"] == ""
  assert matches(f, dict(T=lambda t: t > 32, family="entmax"))
  assert not matches(f, dict(mask=bool)) and not matches(f, dict(absent=1))


def _row(impl, weighting, ms, **cells):
  return dict(shape="1x8x1x4", mode="fwd", impl=impl, weighting=weighting,
              **{"time ms": ms}, **cells)


def test_ratios_divide_by_the_reference_row():
  rows = [_row("base", "softmax", 4.0), _row("ours", "softmax", 2.0),
          _row("ours", "relu", 3.0), _row("ours", "relu", 1.0, causal=True),
          _row("ours", "relu", 0.5, causal=True, mask="window"), _row("ours", "gelu", 1.0)]
  add_ratios(rows, [
      Ratio("speed-up", ("shape", "mode", "causal"), dict(impl="base", weighting="softmax"),
            invert=True),
      Ratio("/ softmax", ("shape", "mode", "impl", "causal"), dict(weighting="softmax"),
            where=dict(impl="ours")),
      Ratio("per pair", ("shape", "weighting"), dict(causal=True, mask=""),
            where=dict(mask=bool), per=lambda f: 2.0 if f["mask"] else 8.0)])
  assert [r.get("speed-up") for r in rows] == [1.0, 2.0, 4 / 3, None, None, 4.0]
  assert [r.get("/ softmax") for r in rows] == [None, 1.0, 1.5, None, None, 0.5]
  assert [r.get("per pair") for r in rows] == [None] * 4 + [(0.5 / 2) / (1.0 / 8), None]
  assert list(rows[1])[-2:] == ["speed-up", "/ softmax"]  # in the table's order


def test_no_ratio_without_values_or_a_nonzero_reference():
  rows = [_row("base", "softmax", 0.0), _row("ours", "softmax", 1.0), {"shape": "x",
          "mode": "fwd", "impl": "ours", "weighting": "softmax"}]
  add_ratios(rows, [Ratio("r", ("shape", "mode"), dict(impl="base"))])
  assert all("r" not in r for r in rows)
  with pytest.raises(ValueError, match="both shared"):
    Ratio("r", ("impl",), dict(impl="base"))
