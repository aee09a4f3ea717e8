"""attnx.train.benchmark.runner: cases measured into rows on a CPU — skipped, compiled for
memory only, timed round-robin, or timed alone with a reference — and their functions."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from attnx import core
from attnx.train.benchmark import cases, programs, runner


def _config(**kw):
  return ml_collections.ConfigDict({**dict(
      seed=0, dtype="float32", repeats=1, warmup=0, long_run_s=2.0, dense_max_gib=8.0,
      memory_only_min_scores=0, error_queries=8, matmul_size=64, mask_window=4,
      mask_documents=2, block_q=0, block_k=0, progress=False, is_causal=False), **kw})


def test_skips_baselines_that_need_too_much_memory():
  row = runner.run_case(dict(shape=(1, 64, 1, 8), impl="jax.nn (xla)", weighting="softmax",
                             mode="fwd"), None, _config(dense_max_gib=1e-9), 1.0, {})
  assert row["note"].startswith("skipped: needs") and "time ms" not in row


def test_measure_times_checks_and_notes_every_case():
  shape = (1, 16, 2, 8)
  todo = [cases.case(shape, "attnx blocked", "gaussian", "fwd+bwd", causal=True,
                     mask="documents"),
          cases.case(shape, "jax.nn (xla)", "softmax", "fwd"),
          cases.case(shape, "attnx dense", "sparsemax", "fwd", memory_only=True),
          cases.case(shape, "attnx blocked", "softmax", "fwd", causal=True, mask="dense_window")]
  rows, rate = runner.measure(todo, _config())
  # Per shape, the modes in the order the cases first name them.
  assert rate > 0 and [r["impl"] for r in rows] == ["attnx blocked", "jax.nn (xla)",
                                                     "attnx dense", "attnx blocked"]
  blocked, base, dense, dense_window = rows
  assert dense_window["max abs err"] < 1e-5 and dense_window["mask"] == "dense_window"
  assert blocked["max abs err"] < 1e-5 and base["max abs err"] < 1e-5
  for r in (blocked, base):
    assert r["time ms"] > 0 and r["GFLOP/s"] > 0 and r["% matmul"] > 0
    assert r["peak MiB"] >= r["scratch MiB"] >= 0 and "flops" not in r and "_first_s" not in r
  assert dense["note"] == "compiled for its memory only (not run)" and "time ms" not in dense
  assert runner.CELLS[:7] == ["shape", "impl", "weighting", "score", "mode", "causal", "mask"]
  with pytest.raises(ValueError, match="Unknown implementation 'attnx pallas'"):
    runner.attention_fn(dict(todo[0], impl="attnx pallas"), _config())


def test_run_alone_times_a_case_and_measures_its_error_against_a_reference():
  shape = (1, 32, 2, 8)
  inputs = cases.inputs(shape, "float32", 0)
  blocked = lambda c: programs.attnx_fn(weighting=c["weighting"], implementation="blocked",
                                        is_causal=True, **cases.mask_keywords(c["mask"], 32, 4, 2))
  dense = lambda c: programs.attnx_fn(weighting=c["weighting"], implementation="dense",
                                      is_causal=True, **cases.mask_keywords(c["mask"], 32, 4, 2))
  case = dict(shape=shape, impl="ours", weighting="relu", mode="fwd", mask="window",
              check_error=True)
  row = runner.run_alone(case, inputs, _config(), blocked, dense)
  assert row["mask"] == "window" and row["time ms"] > 0 and row["max abs err"] < 1e-5
  pairs = cases.attended_pairs(32, True, window=4)
  assert row["TFLOP/s"] == pytest.approx(4 * 2 * pairs * 8 / (row["time ms"] / 1e3) / 1e12)
  assert runner.run_alone(dict(case, mode="fwd+bwd"), inputs, _config(), blocked,
                          dense).keys() == {"shape", "impl", "weighting", "mode", "mask",
                                            "time ms", "TFLOP/s"}  # errors on fwd only
  assert runner.run_alone(case, inputs, _config(), lambda c: "n/a here")["note"] == "n/a here"

  def broken(q, k, v):
    raise RuntimeError("no kernel\nhere")
  failed = runner.run_alone(case, inputs, _config(), lambda c: broken)
  assert failed["note"] == "failed: RuntimeError: no kernel" and "time ms" not in failed
  rows = runner.measure_alone([case], _config(), blocked)
  assert len(rows) == 1 and "max abs err" not in rows[0]


def test_threshold_passes_of_the_entmax_rows():
  c = _config(shapes="1x32x1x8,1x64x1x8", row_weightings="sparsemax,ssmax",
              causal="full,causal", row_max_scores=32 * 32)
  passes = runner.threshold_passes(c)
  assert [(p["shape"], p["weighting"], p["causal"]) for p in passes] == [
      ("1x32x1x8", "sparsemax", False), ("1x32x1x8", "sparsemax", True)]
  assert all(p["passes"] >= 1 for p in passes)
  q = np.asarray(cases.inputs((1, 8, 1, 4), "float32", 0)[0])
  assert np.isfinite(q).all() and core.get_weighting("sparsemax").stream.family == "entmax"
