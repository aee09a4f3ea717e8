"""The loader API: names, configs, errors, batching, determinism, concurrency."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_datasets as tfds

import attnx.data as D

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_list_datasets():
  names = D.list_datasets()
  for name in ["digits", "listops", "associative_recall", "icl_regression", "noisy_clusters",
               "copy_reverse_sort", "synthetic_translation", "nw_regression", "mnist",
               "fashion_mnist", "cifar10", "imdb_reviews"]:
    assert name in names


@pytest.mark.parametrize("name", D.list_datasets())
def test_get_info_all(name):
  info = D.get_info(name)
  assert info.name == name
  assert info.task in ("classification", "token_classification", "regression", "seq2seq")
  assert info.splits and all(n > 0 for n in info.splits.values())
  assert isinstance(info.input_shape, tuple) and info.description


def test_custom_config_from_kwargs(data_dir):
  info = D.get_info("listops", config="tiny", max_length=40, max_depth=2)
  assert info.config_name == "tiny-max_depth=2-max_length=40"
  assert info.input_shape == (40,)
  arrays = D.load_arrays("listops", "validation", data_dir=data_dir, config="tiny",
                         max_length=40, max_depth=2)
  assert arrays["inputs"].shape == (64, 40)
  assert os.path.isdir(os.path.join(data_dir, "listops", "tiny-max_depth=2-max_length=40"))
  # Same values as the named config -> the named config; "name/config" syntax works.
  assert D.get_info("listops/tiny", max_length=32).config_name == "tiny"
  assert D.get_info("listops", max_length=128).config_name == "default"


def test_errors():
  with pytest.raises(ValueError, match="valid names.*digits"):
    D.load("no_such_dataset", batch_size=2)
  with pytest.raises(ValueError, match="max_lenght.*valid keys.*max_length"):
    D.get_info("listops", max_lenght=3)
  with pytest.raises(ValueError, match="max_lenght"):
    D.load("listops", batch_size=2, max_lenght=3)
  with pytest.raises(ValueError, match="valid configs"):
    D.get_info("listops", config="huge")
  with pytest.raises(ValueError, match="min_length"):
    D.get_info("listops", max_length=2)
  with pytest.raises(ValueError, match="max_length"):
    D.get_info("imdb_reviews", max_lenght=10)


def test_bad_split_lists_splits(data_dir):
  with pytest.raises(ValueError, match=r"valid splits: \['train', 'validation', 'test'\]"):
    D.load("listops", "valid", batch_size=2, data_dir=data_dir, config="tiny")
  with pytest.raises(ValueError, match="valid splits"):
    D.load_arrays("digits", "validation", data_dir=data_dir)
  with pytest.raises(ValueError, match="valid splits"):
    D.load("mnist", "validation", batch_size=2, data_dir=data_dir)


def test_batches_keys_and_sizes(data_dir):
  it = D.load("copy_reverse_sort", batch_size=5, data_dir=data_dir, config="tiny")
  for batch in _take(it, 3):
    assert set(batch) >= {"inputs", "targets", "decoder_inputs", "mask"}
    assert all(v.shape[0] == 5 for v in batch.values())
    assert batch["inputs"].dtype == np.int32 and batch["mask"].dtype == bool


@pytest.mark.parametrize("in_memory", [True, False])
def test_epochs_and_remainder(data_dir, in_memory):
  kw = dict(data_dir=data_dir, config="tiny", in_memory=in_memory, batch_size=100)
  batches = list(D.load("listops", "test", num_epochs=1, drop_remainder=False, **kw))
  assert [len(b["targets"]) for b in batches] == [64]
  batches = list(D.load("listops", "train", num_epochs=2, **kw))
  assert [len(b["targets"]) for b in batches] == [100] * 5  # 512 examples, remainder dropped
  full = D.load_arrays("listops", "test", data_dir=data_dir, config="tiny")
  ordered = next(D.load("listops", "test", shuffle=False, num_epochs=1, drop_remainder=False,
                        **kw))
  for k in full:
    np.testing.assert_array_equal(ordered[k], full[k])


def test_determinism_and_seeds(data_dir):
  kw = dict(batch_size=8, data_dir=data_dir, config="tiny")
  a = _take(D.load("associative_recall", seed=1, **kw), 4)
  b = _take(D.load("associative_recall", seed=1, **kw), 4)
  c = _take(D.load("associative_recall", seed=2, **kw), 4)
  d = _take(D.load("associative_recall", seed=1, in_memory=False, num_threads=0, **kw), 4)
  for x, y, z in zip(a, b, d, strict=True):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["inputs"], z["inputs"])
  assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c, strict=True))


def test_epochs_are_permutations_reshuffled(data_dir):
  kw = dict(batch_size=64, data_dir=data_dir, config="tiny", num_epochs=2)
  batches = list(D.load("nw_regression", **{**kw, "config": "default", "batch_size": 50}))
  x = np.concatenate([b["inputs"][:, 0] for b in batches])
  first, second = np.sort(x[:100]), np.sort(x[100:])
  np.testing.assert_array_equal(first, second)  # each epoch sees every example once
  assert not np.array_equal(x[:100], x[100:])  # in a different order


def test_sharding_partitions_examples(data_dir):
  kw = dict(batch_size=32, data_dir=data_dir, config="tiny", num_epochs=1, shuffle=False)
  parts = [next(D.load("icl_regression", "test", shard_index=i, num_shards=2, **kw))
           for i in range(2)]
  full = D.load_arrays("icl_regression", "test", data_dir=data_dir, config="tiny")
  np.testing.assert_array_equal(parts[0]["w"], full["w"][0::2])
  np.testing.assert_array_equal(parts[1]["w"], full["w"][1::2])


def test_iterator_state_roundtrip(data_dir):
  it = D.load("listops", batch_size=4, data_dir=data_dir, config="tiny")
  next(it)
  state = it.get_state()
  a = next(it)
  it.set_state(state)
  b = next(it)
  np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_readable_with_tfds_data_source(data_dir):
  D.get_builder("listops", data_dir=data_dir, config="tiny")
  src = tfds.data_source("listops/tiny", split="test", data_dir=data_dir, download=False,
                         try_gcs=False)
  assert len(src) == 64 and src[0]["inputs"].shape == (32,)


def test_concurrent_preparation(tmp_path):
  code = textwrap.dedent(f"""
    import sys; sys.path.insert(0, {REPO!r})
    import attnx.data as D
    a = D.load_arrays("noisy_clusters", "test", data_dir={str(tmp_path)!r}, config="tiny")
    print(float(a["inputs"].sum()))
  """)
  procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, err[-2000:]
  assert outs[0][0] == outs[1][0]
  version = str(D.BUILDERS["noisy_clusters"].VERSION)
  assert os.listdir(tmp_path / "noisy_clusters" / "tiny") == [version]  # no incomplete.* dirs


def test_env_data_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path))
  assert D.attnx_data_dir() == str(tmp_path)
  assert D.attnx_data_dir("/x/y") == "/x/y"
  monkeypatch.delenv("ATTNX_DATA_DIR")
  assert D.attnx_data_dir().endswith(os.path.join(".cache", "attnx", "tensorflow_datasets"))


@pytest.mark.parametrize(
  "name, kwargs, match",
  [
    ("listops", {"max_depth": 2, "max_args": 3, "min_length": 20, "max_length": 64},
     "unreachable"),
    ("associative_recall", {"num_kv_pairs": 40}, "num_kv_pairs"),
    ("associative_recall", {"num_queries": 9}, "num_queries"),
    ("copy_reverse_sort", {"task": "shuffle"}, "task"),
    ("nw_regression", {"x_min": 5.0}, "x_min < x_max"),
    ("noisy_clusters", {"classes_per_sample": 99}, "classes_per_sample"),
    ("listops", {"max_length": "long"}, "max_length"),
  ],
)
def test_invalid_config_values(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    D.get_info(name, **kwargs)


def test_bad_load_arguments(data_dir):
  with pytest.raises(ValueError, match="batch_size"):
    D.load("listops", batch_size=0, data_dir=data_dir, config="tiny")
  with pytest.raises(ValueError, match="num_epochs"):
    D.load("listops", batch_size=2, num_epochs=0, data_dir=data_dir, config="tiny")


def test_load_by_level_shares_samples_across_levels():
  params = dict(num_classes=3, classes_per_sample=2, num_objects=4, dim=8, seed=0)
  out = D.load_by_level("noisy_clusters", "global_noise", [0.0, 2.0], train_level=0.0,
                        num_train=6, num_test=5, **params)
  by_level = out["eval"]["inputs_by_level"]
  assert by_level.shape[:2] == (2, 5) and out["eval"]["targets"].shape[0] == 5
  assert not np.array_equal(by_level[0], by_level[1])  # the global noise grows
  zero = D.load_arrays("noisy_clusters", "test", global_noise=0.0, num_train=0, num_test=5,
                       **params)
  np.testing.assert_array_equal(by_level[0], zero["inputs"])  # each level as load_arrays reads it
  assert out["train"]["inputs"].shape[0] == 6
  with pytest.raises(ValueError, match="at least one"):
    D.load_by_level("noisy_clusters", "global_noise", [], train_level=0.0, num_train=6,
                    num_test=5, **params)
