"""attnx.train.benchmark.cases: shapes, the distance kernels' score and bandwidth, the pairs a
structured mask attends (against the reference's valid pairs), FLOPs and config checks."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from attnx.train.benchmark import cases


def test_parse_shapes_and_labels():
  assert cases.parse_shapes("2x64x2x16, 1x128x2x32") == [(2, 64, 2, 16), (1, 128, 2, 32)]
  assert cases.parse_shapes(["1X8x1x4"]) == [(1, 8, 1, 4)]
  with pytest.raises(ValueError, match=r"config.sizes: bad shape '2x64x2'; expected 'BxTxNxH'"):
    cases.parse_shapes("2x64x2", key="sizes")
  assert cases.shape_label((1, 4096, 4, 64)) == "1x4096x4x64"
  assert cases.seq_len("1x4096x4x64") == 4096


def test_distance_kernels_run_on_a_distance_score_with_a_matched_bandwidth():
  assert cases.case_weighting("relu", 64) == ("relu", "scaled_dot")
  assert cases.case_weighting("triangular", 64) == ("triangular:h=11.3", "neg_sq_dist")
  assert cases.case_weighting("triangular", 128) == ("triangular:h=16", "neg_sq_dist")
  assert cases.case_weighting("boxcar:h=2", 64) == ("boxcar:h=2", "neg_sq_dist")
  assert cases.case_weighting("gaussian:normalization=none", 8) == (
      "gaussian:normalization=none,h=4", "neg_sq_dist")
  assert cases.case_weighting("sparsemax", 8) == ("sparsemax", "scaled_dot")
  assert cases.case((1, 8, 1, 8), "attnx blocked", "gaussian", "fwd", causal=True) == dict(
      shape=(1, 8, 1, 8), impl="attnx blocked", weighting="gaussian:h=4", score="neg_sq_dist",
      mode="fwd", causal=True)
  assert "softmax" in cases.pointwise_names("") and cases.pointwise_names("relu") == ["relu"]


def test_attended_pairs_are_the_valid_pairs_of_the_masks():
  for mask in ("", "causal", *cases.MASKS):  # "causal" (no size): plain causal
    sizes = cases.mask_sizes(mask, 5, 3)
    assert cases.attended_pairs(12, True, **sizes) == cases.valid_pairs(12, 12, True,
                                                                         **sizes).sum()
    counted = cases.pair_counter(5, 3)({"T": 12, "mask": mask, "causal": True})
    assert counted == cases.attended_pairs(12, True, **sizes)
  assert cases.attended_pairs(12, False) == 144 and cases.valid_pairs(12, 12, False) is None
  assert cases.attended_pairs(4, window=8) == 10  # a window wider than the row: causal
  assert cases.mask_keywords("window", 8, 3, 2) == {"local_window_size": (2, 0)}
  np.testing.assert_array_equal(cases.mask_keywords("documents", 6, 3, 3)["segment_ids"],
                                [[0, 0, 1, 1, 2, 2]])
  dense = cases.mask_keywords("dense_window", 6, 3, 3)["mask"]  # with is_causal: the window
  np.testing.assert_array_equal(np.tril(dense), cases.valid_pairs(6, 6, True, window=3))
  assert cases.mask_keywords("", 6, 3, 3) == cases.mask_keywords("causal", 6, 3, 3) == {}
  batch = cases.pair_counter(3, 2, batch=True)
  assert batch({"shape": "4x6x1x8", "T": 6, "causal": False, "mask": ""}) == 4 * 36
  assert batch({"shape": "4x6x1x8", "T": 6, "mask": "dense_window"}) == 4 * 15


def test_flops_count_the_scores_a_case_needs():
  shape = (1, 1024, 2, 128)
  assert cases.flops(shape, "fwd") == 4 * 2 * 1024**2 * 128
  assert cases.flops(shape, "fwd+bwd", causal=True, backward=3.5) == pytest.approx(
      4 * 2 * 1024**2 * 128 * 0.5 * 3.5)
  assert cases.flops(shape, "fwd+bwd", pairs=10) == 4 * 2 * 10 * 128 * 2.5
  with pytest.raises(ValueError, match="mode"):
    cases.flops(shape, "bwd")
  q, k, v = cases.inputs((1, 4, 2, 8), "bfloat16", 0)
  assert q.shape == (1, 4, 2, 8) and q.dtype == "bfloat16" and not np.allclose(q, k)


def test_config_checks_name_the_key():
  c = ml_collections.ConfigDict(dict(weightings="softmax,sparsemax", rows="sparsemax",
                                     masks="window", mask_window=4, mask_documents=3))
  with pytest.raises(ValueError, match="config.weightings: 'sparsemax' is not a pointwise"):
    cases.check_weightings(c, pointwise=("weightings",))
  with pytest.raises(ValueError, match="config.weightings: 'softmax' is not a streaming whole"):
    cases.check_weightings(c, rows=("weightings",))
  cases.check_weightings(c, rows=("rows",), streaming=("weightings",))
  cases.check_masks(c, [(1, 8, 1, 4)])
  c.masks = "window,documents"
  with pytest.raises(ValueError, match="must divide every T; it does not divide \\[8\\]"):
    cases.check_masks(c, [(1, 6, 1, 4), (1, 8, 1, 4)])
  c.masks, c.mask_window = "window", 0
  with pytest.raises(ValueError, match="mask_window must be >= 1"):
    cases.check_masks(c, [])
  c.masks = "diagonal"
  with pytest.raises(ValueError, match="config.masks has invalid entries"):
    cases.check_masks(c, [])
