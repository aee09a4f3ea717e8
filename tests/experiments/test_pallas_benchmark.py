"""pallas_benchmark: presets, validation, the target table, and a clean exit on a CPU."""

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from attnx import core  # noqa: E402
from attnx.train import benchmark as bench  # noqa: E402
from experiments import pallas_benchmark as exp  # noqa: E402


def test_presets_and_validation():
  assert set(exp.PRESETS) == {"default", "quick", "tiny"}
  c = exp.get_config()
  assert c.experiment == "pallas_benchmark" and c.dtype == "bfloat16"
  ts = [int(s.split("x")[1]) for s in c.shapes.split(",")]
  assert min(ts) == 1024 and max(ts) == 32768
  assert {int(s.split("x")[3]) for s in c.shapes.split(",")} == {128}
  with pytest.raises(ValueError, match="default"):
    exp.get_config("nope")
  for key, value, match in (("shapes", "2x64x2", "BxTxNxH"), ("modes", "bwd", "modes"),
                            ("baselines", "flash3", "baselines"),
                            ("weightings", "softmax,sparsemax", "pointwise"),
                            ("row_weightings", "relu", "whole-row"),
                            ("dtype", "int8", "dtype")):
    c = exp.get_config("tiny")
    c[key] = value
    with pytest.raises(ValueError, match=match):
      exp.validate_config(c)


def test_cases_ratios_and_targets():
  c = exp.get_config("tiny")
  c.shapes = "1x1024x2x128,1x4096x2x128"
  cases = exp.cases(c)
  assert len(cases) == 2 * 2 * (len(exp.BASELINES) + 3 + 1)  # + stick_breaking
  assert {x["check_error"] for x in cases if x["shape"][1] == 1024 and x["impl"] == exp.OURS} == {
      True}
  rows = []
  for shape in ("1x1024x2x128", "1x4096x2x128"):
    rows.append({"shape": shape, "impl": "cudnn", "weighting": "softmax", "mode": "fwd",
                 "TFLOP/s": 100.0})
    for w, tf in (("softmax", 80.0), ("relu", 65.0), ("gaussian:h=16", 55.0),
                  ("stick_breaking", 20.0)):  # a whole-row weighting: no target
      rows.append({"shape": shape, "impl": exp.OURS, "weighting": w, "mode": "fwd",
                   "TFLOP/s": tf})
  bench.ratios.add_ratios(rows, exp.ratios(c))
  assert rows[1]["vs cuDNN softmax"] == pytest.approx(0.8) and "vs JAX flash" not in rows[1]
  (goal,) = exp.targets(rows, c)  # only T ≥ 4096
  assert "1x4096x2x128" in goal["target"] and "gaussian" in goal["target"]
  assert goal["measured"] == "55%" and goal["met"] == "**no**"


@pytest.mark.skipif(exp.accelerator() is not None, reason="measures on an accelerator")
def test_cpu_exits_cleanly_with_a_report(tmp_path, capsys):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  assert out["rows"] == [] and "needs a GPU or TPU" in out["skipped"]
  report = (tmp_path / "report.md").read_text()
  assert "needs a GPU or TPU" in report and "Inconclusive" in report
  assert "needs a GPU or TPU" in capsys.readouterr().out
  assert not (tmp_path / "benchmark.json").exists()


def test_blocked_baseline_runs_every_weighting_measured():
  c = exp.get_config("tiny")
  c.baselines = "cudnn,attnx blocked"
  cases = exp.cases(c)
  blocked = {x["weighting"] for x in cases if x["impl"] == exp.BLOCKED}
  assert blocked == {x["weighting"] for x in cases if x["impl"] == exp.OURS}
  assert {x["impl"] for x in cases if x["weighting"] == "softmax"} == {"cudnn", exp.OURS,
                                                                         exp.BLOCKED}
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 40, 2, 16))
  fn = exp.attention_fn(exp.BLOCKED, "stick_breaking", c, "gpu", 16)
  want = core.attention(q, q, q, weighting="stick_breaking", scale=0.25, implementation="dense")
  np.testing.assert_allclose(fn(q, q, q), want, atol=1e-5)


def test_masked_rows_compare_with_plain_causal():
  c = exp.get_config("tiny")
  c.masks = "window,documents"
  c.mask_window, c.mask_documents = 16, 4
  cases = [x for x in exp.cases(c) if x.get("mask")]
  # Per mask weighting and mode: the plain causal row and one per mask, errors on masked rows.
  assert {(x["weighting"], x["mask"]) for x in cases} == {
      (w, m) for w in ("softmax", "stick_breaking") for m in ("causal", "window", "documents")}
  assert all(x["check_error"] == (x["mask"] != "causal") for x in cases)
  assert exp.get_config("quick").masks == "window,documents"
  rows = [{"shape": "1x64x2x16", "impl": exp.OURS, "weighting": "softmax", "mode": "fwd",
           "mask": m, "time ms": ms} for m, ms in (("causal", 2.0), ("window", 0.5),
                                                  ("documents", 1.0))]
  bench.ratios.add_ratios(rows, exp.ratios(c))
  causal_pp = 2.0 / (64 * 65 / 2)
  window_pairs = 16 * 17 / 2 + (64 - 16) * 16
  assert "per pair / causal" not in rows[0]
  assert rows[1]["per pair / causal"] == pytest.approx(0.5 / window_pairs / causal_pp)
  assert rows[2]["per pair / causal"] == pytest.approx(1.0 / (4 * 16 * 17 / 2) / causal_pp)
  # The masked function is the public path with the Pallas kernels: equal to dense.
  q = jax.random.normal(jax.random.PRNGKey(1), (1, 64, 2, 16))
  fn = exp.attention_fn(exp.OURS, "softmax", c, "gpu", 16, "documents", 64)
  ids = np.repeat(np.arange(4), 16)[None]
  with pytest.raises(ValueError, match="GPU or TPU"):  # a CPU host: the kernels need one
    jax.jit(fn).lower(q, q, q)
  want = core.attention(q, q, q, segment_ids=ids, is_causal=True, scale=0.25,
                        implementation="dense")
  got = core.attention(q, q, q, segment_ids=ids, is_causal=True, scale=0.25,
                       implementation=core.Pallas(interpret=True, block_q=16, block_k=16))
  np.testing.assert_allclose(got, want, atol=1e-5)
  for key, value, match in (("masks", "banded", "masks"), ("mask_weightings", "additive_x",
                                                          "Unknown weighting")):
    bad = exp.get_config("tiny")
    bad[key] = value
    with pytest.raises(ValueError, match=match):
      exp.validate_config(bad)
