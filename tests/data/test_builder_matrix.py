"""Cross-cutting: every builder has the documented shapes, dtypes, labels and splits (tiny
configs).

One table over all of attnx's datasets, checked against each builder's DatasetInfo
(attnx/data/_base.py), so it does not belong to one builder's test file; what is particular to
a dataset is tested in tests/data/test_<dataset>.py.
"""

import os

import numpy as np
import pytest

import attnx.data as D
from attnx.data._base import TASKS

TINY = {
  "associative_recall": {"config": "tiny"},
  "copy_reverse_sort": {"config": "tiny"},
  "digits": {},
  "icl_regression": {"config": "tiny"},
  "listops": {"config": "tiny"},
  "noisy_clusters": {"config": "tiny"},
  "nw_regression": {},
  # Offline stand-in for the Gutenberg source (tests/data/test_shakespeare.py covers that).
  "shakespeare": {"text_file": os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "fixtures", "tiny_text.txt"), "seq_len": 16},
  "synthetic_translation": {"config": "tiny"},
}


def test_all_own_datasets_covered():
  assert sorted(TINY) == sorted(D.BUILDERS)


@pytest.mark.parametrize("name", sorted(TINY))
def test_shapes_dtypes_splits_match_info(name, data_dir):
  info = D.get_info(name, **TINY[name])
  assert info.task in TASKS
  for split, n in info.splits.items():
    arrays = D.load_arrays(name, split, data_dir=data_dir, **TINY[name])
    assert set(arrays) >= {"inputs", "targets"}
    assert arrays["inputs"].shape == (n, *info.input_shape), split
    assert arrays["inputs"].dtype == np.dtype(info.input_dtype)
    assert all(len(v) == n for v in arrays.values())
    if info.task == "seq2seq":
      assert arrays["decoder_inputs"].shape == arrays["targets"].shape == (n, info.seq_len)
      np.testing.assert_array_equal(arrays["decoder_inputs"][:, 0], info.extras["bos_id"])
      np.testing.assert_array_equal(arrays["decoder_inputs"][:, 1:], arrays["targets"][:, :-1])
      assert arrays["inputs"].max() < info.vocab_size
      assert arrays["targets"].max() < info.target_vocab_size
    if info.task in ("classification", "token_classification"):
      assert arrays["targets"].dtype == np.int32
      valid = arrays["targets"][arrays["targets"] != D.IGNORE_INDEX]
      assert valid.min() >= 0 and valid.max() < info.num_classes
    if info.task == "token_classification":
      assert arrays["targets"].shape == (n, info.seq_len)
    if info.task == "regression":
      assert arrays["targets"].dtype == np.float32
      assert arrays["targets"].shape == (n, *info.extras["target_shape"])
    if info.vocab_size is not None and info.task != "seq2seq":
      assert arrays["inputs"].min() >= 0 and arrays["inputs"].max() < info.vocab_size


def test_a_builder_without_its_hooks_names_them():
  from attnx.data._base import AttnxBuilder

  class Incomplete(AttnxBuilder, skip_registration=True):
    pass

  for hook, call in (("describe", lambda: Incomplete.describe(None)),
                     ("_features", lambda: Incomplete._features(None)),
                     ("_generate_split", lambda: Incomplete._generate_split(None, "train", 1, 0))):
    with pytest.raises(TypeError, match=f"Incomplete does not define {hook}"):
      call()
