"""Catalog datasets: fail fast when missing, go through the loader when mocked."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_datasets as tfds

import attnx.data as D

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_catalog_dataset_fails_fast(tmp_path):
  # In a fresh process with an empty TFDS dir: a clear error, quickly, no network.
  code = textwrap.dedent(f"""
    import sys, time; sys.path.insert(0, {REPO!r})
    import attnx.data as D
    t = time.time()
    try:
      D.load("mnist", batch_size=8)
    except D.DatasetNotFoundError as e:
      assert isinstance(e, FileNotFoundError)
      print(time.time() - t)
      print(e)
  """)
  env = {**os.environ, "TFDS_DATA_DIR": str(tmp_path)}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stderr[-2000:]
  seconds, message = out.stdout.split("\n", 1)
  assert float(seconds) < 10
  assert "tfds build mnist" in message and str(tmp_path) in message


@pytest.mark.parametrize("name", ["cifar10", "imdb_reviews"])
def test_missing_catalog_dataset_in_process(name, tmp_path):
  with pytest.raises(D.DatasetNotFoundError, match=f"tfds build {name}"):
    D.load_arrays(name, "test", data_dir=str(tmp_path))


def test_mock_mnist_through_loader(tmp_path):
  with tfds.testing.mock_data(num_examples=12):
    batches = list(D.load("mnist", "train", batch_size=5, num_epochs=1, data_dir=str(tmp_path)))
    arrays = D.load_arrays("fashion_mnist", "test", data_dir=str(tmp_path))
  assert [len(b["targets"]) for b in batches] == [5, 5]
  x = batches[0]["inputs"]
  assert x.shape == (5, 28, 28, 1) and x.dtype == np.float32
  assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5
  assert batches[0]["targets"].dtype == np.int32
  assert set(np.unique(batches[0]["targets"])) <= set(range(10))
  assert arrays["inputs"].shape == (12, 28, 28, 1)


def test_mock_imdb_bytes(tmp_path):
  with tfds.testing.mock_data(num_examples=4):
    arrays = D.load_arrays("imdb_reviews", "train", data_dir=str(tmp_path), max_length=64)
  assert arrays["inputs"].shape == (4, 64) and arrays["inputs"].dtype == np.int32
  assert arrays["inputs"].max() <= 256
  np.testing.assert_array_equal(arrays["mask"], arrays["inputs"] > 0)
  ids, mask = D.catalog.encode_bytes("hé", 5)
  assert ids.tolist() == [ord("h") + 1, 0xC3 + 1, 0xA9 + 1, 0, 0] and mask.sum() == 3
