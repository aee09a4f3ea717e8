"""kernel_benchmark: presets, validation, and the tiny preset end to end (files and table)."""

import json
import os
import sys

import pytest
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from attnx.train import benchmark as bench  # noqa: E402
from experiments import kernel_benchmark as exp  # noqa: E402


def test_presets_and_validation():
  assert set(exp.PRESETS) == {"default", "quick", "tiny", "rows", "masks", "mask_costs"}
  assert exp.get_config("masks").masks == "window,documents"
  assert exp.get_config().experiment == "kernel_benchmark"
  assert len(exp.get_config("quick").shapes.split(",")) == 3
  assert len(exp.get_config("default").shapes.split(",")) == 5
  with pytest.raises(ValueError, match="default"):
    exp.get_config("nope")
  assert exp.get_config().causal == "full,causal"
  for key, value, match in (("shapes", "2x64x2", "BxTxNxH"), ("modes", "bwd", "modes"),
                            ("causal", "full,diagonal", "causal"),
                            ("weightings", "softmax,sparsemax", "pointwise"),
                            ("masks", "window,diagonal", "masks"),
                            ("mask_documents", 5, "divide"), ("mask_window", 0, "window")):
    c = exp.get_config("tiny")
    c[key] = value
    with pytest.raises(ValueError, match=match):
      exp.validate_config(c)


@legs.experiment_run
def test_tiny_end_to_end(tmp_path):
  config = exp.get_config("tiny")
  config.shapes = config.shapes.split(",")[0]  # one of its two shapes: half the compiles
  config.weightings = "softmax,gaussian"  # a similarity and a distance kernel
  out = exp.run(config, str(tmp_path))
  for name in ("benchmark.md", "benchmark.json", "report.md"):
    assert (tmp_path / name).exists(), name
  data = json.loads((tmp_path / "benchmark.json").read_text())
  rows = data["rows"]
  assert data["matmul_gflops"] > 0 and rows == json.loads(json.dumps(out["rows"], default=str))
  shapes = {r["shape"] for r in rows}
  assert shapes == {config.shapes}
  weightings = config.weightings.split(",")
  for shape in shapes:
    head_dim = int(shape.split("x")[-1])
    for mode in exp.MODES:
      for causal in (False, True):  # every case full and causal
        got = sorted((r["impl"], r["weighting"], r["score"]) for r in rows
                     if r["shape"] == shape and r["mode"] == mode and r["causal"] == causal
                     and not r["mask"])
        want = [(b, "softmax", "scaled_dot") for b in exp.BASELINES]
        want += [("attnx blocked", *bench.cases.case_weighting(w, head_dim)) for w in weightings]
        want += [(impl, w, "scaled_dot") for w in config.row_weightings.split(",")
                 for impl in ("attnx blocked", "attnx dense")]
        assert got == sorted(want), (shape, mode, causal)
      for mask in config.masks.split(","):  # causal + each structured mask: blocked cases
        got = sorted(r["weighting"] for r in rows if r["shape"] == shape
                     and r["mode"] == mode and r["mask"] == mask and r["causal"])
        assert got == sorted([bench.cases.case_weighting(w, head_dim)[0] for w in weightings]
                             + config.row_weightings.split(",")), (shape, mode, mask)
  for r in rows:
    assert "note" not in r, r
    assert r["time ms"] > 0 and r["GFLOP/s"] > 0 and r["scratch MiB"] >= 0
    assert r["max abs err"] < 1e-4, r
    assert r["impl"] == "attnx dense" or r["mask"] or r["speed-up vs jax.nn"] > 0
    if r["impl"] == "attnx blocked":
      assert r["time / softmax"] > 0
      if (r["weighting"] != "softmax" and r["weighting"] in config.row_weightings
          and not r["mask"]):  # masked rows run blocked only
        assert r["speed-up vs dense"] > 0
    assert (r["causal / full"] > 0) if r["causal"] else ("causal / full" not in r)
    assert (r["per pair / causal"] > 0) if r["mask"] else ("per pair / causal" not in r)
  md = (tmp_path / "benchmark.md").read_text()
  header = md.splitlines()[2]
  for col in exp.COLUMNS:
    assert col in header
  assert md.count("\n| ") == len(rows) + 1  # header + one line per row
  report = (tmp_path / "report.md").read_text()
  assert md.strip() in report and "jax" in report and "Command" in report
  assert (tmp_path / "scaling.png").exists() and "scaling.png" in report
  assert (tmp_path / "row_weightings.png").exists() and "Threshold passes" in report
  assert (tmp_path / "masks.png").exists() and "masks.png" in report
  assert out["targets"] == []  # the tiny shapes check no target
  for r in rows:
    assert r["peak MiB"] >= r["scratch MiB"]


def test_distance_kernels_are_timed_against_their_own_softmax():
  rows = [dict(shape="s", mode="fwd", impl="attnx blocked", weighting=w, score=sc,
               **{"time ms": ms})
          for w, sc, ms in (("softmax", "scaled_dot", 10.0), ("relu", "scaled_dot", 12.0),
                            ("gaussian:h=8", "neg_sq_dist", 20.0),
                            ("boxcar:h=8", "neg_sq_dist", 10.0))]
  bench.ratios.add_ratios(rows, exp.ratios())
  assert [r["time / softmax"] for r in rows] == [1.0, 1.2, 1.0, 0.5]


def _row(shape, mode, impl, weighting, **cols):
  return dict(shape=shape, mode=mode, impl=impl, weighting=weighting, **cols)


def test_targets_compare_measurements_with_the_issue_thresholds():
  t, long = exp.TARGET_SHAPE, exp.LONG_SHAPE
  rows = [
      _row(t, "fwd", "jax.nn (xla)", "softmax", **{"scratch MiB": 500.0}),
      _row(t, "fwd", "attnx blocked", "softmax", **{"speed-up vs jax.nn": 3.5,
                                                   "% matmul": 65.0, "scratch MiB": 20.0,
                                                   "time / softmax": 1.0}),
      _row(t, "fwd", "attnx blocked", "softplus", **{"time / softmax": 1.5}),
      _row(t, "fwd+bwd", "jax.nn (xla)", "softmax", **{"scratch MiB": 800.0}),
      _row(t, "fwd+bwd", "attnx blocked", "softmax", **{"speed-up vs jax.nn": 2.5,
                                                       "scratch MiB": 50.0,
                                                       "time / softmax": 1.0}),
      _row(t, "fwd+bwd", "attnx blocked", "relu", **{"time / softmax": 1.1}),
      _row(long, "fwd+bwd", "attnx blocked", "softmax", **{"peak MiB": 60.0}),
  ]
  goals = bench.targets.check(exp.TARGETS, rows)
  assert len(goals) == 8, goals

  def met(*words):
    hits = [g for g in goals if all(w in g["target"] for w in words)]
    assert len(hits) == 1, (words, goals)
    return hits[0]["met"] == "yes"

  assert not met("fwd ≥ 4× jax.nn")  # 3.5× < 4×
  assert met("60 % of the matmul rate")
  assert met("fwd+bwd ≥ 2× autodiff")
  assert not met("within 1.2×", "(fwd;", "softplus")
  assert met("within 1.2×", "(fwd+bwd;", "relu")
  assert met("20× lower", "(fwd)")  # 25×
  assert not met("20× lower", "(fwd+bwd)")  # 16×
  assert met("2 GiB peak")


def test_causal_rows_get_their_full_twin_ratio_and_target():
  blk = "attnx blocked"
  rows = [_row(s, m, blk, "softmax", causal=c, **{"time ms": ms})
          for s, m, c, ms in (("1x1024x4x64", "fwd", False, 10.0),
                              ("1x1024x4x64", "fwd", True, 5.5),
                              ("1x1024x4x64", "fwd+bwd", False, 30.0),
                              ("1x1024x4x64", "fwd+bwd", True, 21.0),
                              ("1x256x4x64", "fwd", False, 1.0),
                              ("1x256x4x64", "fwd", True, 0.9))]
  rows.append(_row("1x1024x4x64", "fwd", blk, "relu", causal=True, **{"time ms": 11.0}))
  bench.ratios.add_ratios(rows, exp.ratios())
  assert [r.get("causal / full") for r in rows] == [None, 0.55, None, 0.7, None, 0.9, None]
  assert rows[-1]["time / softmax"] == 2.0  # against causal softmax, not full softmax
  goals = {g["target"]: g["met"] for g in bench.targets.check(exp.TARGETS, rows)}
  assert goals == {"blocked softmax causal / full ≤ 0.6 at 1x1024x4x64 (fwd)": "yes",
                   "blocked softmax causal / full ≤ 0.6 at 1x1024x4x64 (fwd+bwd)": "**no**"}


def test_masked_rows_count_their_pairs_and_meet_the_mask_target_by_the_rule():
  t, blk = exp.MASK_TARGET_SHAPE, "attnx blocked"
  c = exp.get_config("masks")
  pairs = {m: bench.cases.attended_pairs(bench.cases.seq_len(t), True, **bench.cases.mask_sizes(
      m, c.mask_window, c.mask_documents)) for m in ("", *exp.MASKS)}
  rows = [_row(t, "fwd+bwd", blk, "softmax", causal=True, mask="", **{"time ms": 100.0}),
          _row(t, "fwd+bwd", blk, "softmax", causal=True, mask="window",
               **{"time ms": 100.0 * 1.2 * pairs["window"] / pairs[""]}),
          _row(t, "fwd+bwd", blk, "softmax", causal=True, mask="documents",
               **{"time ms": 100.0 * 2.0 * pairs["documents"] / pairs[""]})]
  bench.ratios.add_ratios(rows, exp.ratios(c))
  assert [round(r.get("per pair / causal", 0), 6) for r in rows] == [0, 1.2, 2.0]
  goals = {g["target"]: g["met"] for g in bench.targets.check(exp.TARGETS, rows)}
  assert goals == {
      f"softmax causal + window: fwd+bwd time per attended pair ≤ 1.3× plain causal at {t}":
          "yes",
      f"softmax causal + documents: fwd+bwd time per attended pair ≤ 1.3× plain causal at {t}":
          "**no**"}


def test_mask_costs_compare_every_row_per_pair_with_long_plain_causal():
  c = exp.get_config("mask_costs")
  exp.validate_config(c)
  cases = exp.cases(c)
  assert {(x["shape"], x["mask"]) for x in cases if x.get("mask")} >= {
      ((1, 16384, 2, 64), m) for m in ("window", "documents", "dense_window")}
  long, blk = c.pair_reference, "attnx blocked"
  rows = [_row(long, "fwd+bwd", blk, "softmax", causal=True, mask="", **{"time ms": 100.0}),
          _row(long, "fwd+bwd", blk, "softmax", causal=True, mask="dense_window",
               **{"time ms": 100.0}),
          _row("16x1024x2x64", "fwd+bwd", blk, "softmax", causal=True, mask="",
               **{"time ms": 10.0}),
          _row("32x512x2x64", "fwd+bwd", blk, "softmax", causal=False, mask="",
               **{"time ms": 10.0})]
  bench.ratios.add_ratios(rows, exp.ratios(c))
  causal_pairs = 16384 * 16385 / 2
  assert [r["per pair / causal"] for r in rows] == pytest.approx([
      1.0, causal_pairs / bench.cases.attended_pairs(16384, window=512),
      (10 / (16 * 1024 * 1025 / 2)) / (100 / causal_pairs),
      (10 / (32 * 512 * 512)) / (100 / causal_pairs)])
  # The structured-mask target judges the structured masks only.
  assert [g["target"].split(":")[0] for g in bench.targets.check(exp.TARGETS, rows)] == []
