"""decode_benchmark: presets, validation, the targets, and the tiny preset end to end (its rows
checked against the paths they time)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from attnx.train import benchmark as bench  # noqa: E402
from attnx.train.benchmark import decoding  # noqa: E402
from experiments import decode_benchmark as exp  # noqa: E402


def test_presets_and_validation():
  assert set(exp.PRESETS) == {"default", "tiny", "gpu"}
  assert exp.get_config("gpu").dtype == "bfloat16"
  c = exp.get_config()
  assert [int(x) for x in c.cache_lengths.split(",")] == [1024, 4096, 16384, 32768, 65536]
  assert (c.batch, c.num_heads, c.kv_heads, c.head_dim) == (4, 8, 2, 64)
  for key, value, match in (("cache_lengths", "1000", "multiples of page_size"),
                            ("weightings", "softmax,row_softmax_x", "Unknown"),
                            ("kv_heads", 3, "multiple"), ("dtype", "int8", "dtype")):
    c = exp.get_config("tiny")
    c[key] = value
    with pytest.raises(ValueError, match=match):
      exp.validate_config(c)


def test_targets_read_the_rows():
  rows = [{"weighting": w, "S": 32768, "split / read": r, "before / split": b}
          for w, r, b in (("softmax", 4.0, 10.0), ("sigmoid", 6.0, 2.0),
                          ("stick_breaking", 9.0, 5.0))]
  goals = bench.targets.check(exp.TARGETS, rows)
  met = {g["target"]: g["met"] for g in goals}
  assert len(goals) == 5  # the read target for softmax and sigmoid, the speed-up for all
  assert met["softmax: split-KV token ≤ 5.0× reading K, V once at S = 32768"] == "yes"
  assert met["sigmoid: split-KV token ≤ 5.0× reading K, V once at S = 32768"] == "**no**"
  assert met["sigmoid: split-KV ≥ 3.0× faster than before at S = 32768"] == "**no**"
  # The bandwidth target reads the Pallas path's HBM share (rows of a GPU only).
  rows[0]["split-KV (Pallas) HBM share"] = 0.55
  goals = bench.targets.check(exp.TARGETS, rows)
  line = [g for g in goals if "memory bandwidth" in g["target"]]
  assert [(g["measured"], g["met"]) for g in line] == [("55%", "**no**")]


def test_hbm_table_and_the_pallas_paths():
  class Dev:
    def __init__(self, kind):
      self.device_kind = kind
  assert decoding.hbm_bytes_per_s(Dev("NVIDIA H100 80GB HBM3")) == 3.35e12
  assert decoding.hbm_bytes_per_s(Dev("NVIDIA H100 PCIe")) == 2.0e12
  assert decoding.hbm_bytes_per_s(Dev("NVIDIA H200")) == 4.8e12
  assert decoding.hbm_bytes_per_s(Dev("cpu")) is None
  # The Pallas paths lower for a GPU (they run where one is; here: lowered only).
  import jax  # noqa: PLC0415
  args = decoding._inputs(2, 2048, 4, 2, 16, 256, "float32", 0)
  progs = decoding._programs("softmax", 8, pallas=True)
  for name in decoding.PALLAS_PATHS:
    text = jax.jit(progs[name]).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower(), name


def test_tiny_preset_runs(tmp_path):
  c = exp.get_config("tiny")
  c.cache_lengths = "256"
  out = exp.run(c, str(tmp_path))
  rows = out["rows"]
  assert {(r["weighting"], r["S"]) for r in rows} == {("softmax", 256), ("stick_breaking", 256)}
  for r in rows:
    for path in decoding.PATHS:
      assert r[f"{path} ms"] > 0
    assert r["split-KV max |Δ|"] < 1e-5 and r["paged max |Δ|"] < 1e-5
    assert r["split / read"] == pytest.approx(r["split-KV ms"] / r["read K, V once ms"])
  saved = json.load(open(tmp_path / "benchmark.json"))
  assert len(saved["rows"]) == 2
  assert "Decoding benchmark" in open(out["report"]).read()
