"""attnx.data.digits: the scikit-learn digits, split disjointly and stratified."""

import numpy as np

import attnx.data as D


def test_digits_match_sklearn(data_dir):
  from sklearn.datasets import load_digits

  sk = load_digits()
  train = D.load_arrays("digits", "train", data_dir=data_dir)
  test = D.load_arrays("digits", "test", data_dir=data_dir)
  assert len(train["targets"]) == 1437 and len(test["targets"]) == 360
  idx = np.concatenate([train["index"], test["index"]])
  np.testing.assert_array_equal(np.sort(idx), np.arange(1797))  # disjoint, complete
  for part in (train, test):
    np.testing.assert_allclose(part["inputs"][..., 0], sk.images[part["index"]] / 16.0)
    np.testing.assert_array_equal(part["targets"], sk.target[part["index"]])
    assert part["inputs"].min() >= 0 and part["inputs"].max() <= 1
  counts = np.bincount(test["targets"], minlength=10)
  assert counts.min() >= 35 and counts.max() <= 37  # stratified
