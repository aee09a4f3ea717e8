"""Every builder: documented shapes, dtypes, labels and splits (tiny configs)."""

import numpy as np
import pytest

import attnx.data as D
from attnx.data import synthetic_translation as st
from attnx.data._base import TASKS

TINY = {
  "associative_recall": {"config": "tiny"},
  "copy_reverse_sort": {"config": "tiny"},
  "digits": {},
  "icl_regression": {"config": "tiny"},
  "listops": {"config": "tiny"},
  "noisy_clusters": {"config": "tiny"},
  "nw_regression": {},
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


def test_mqar_targets_are_values_of_queried_keys():
  data = D.make_associative_recall(
    50, seed=0, vocab_size=40, seq_len=48, num_kv_pairs=6, num_queries=5
  )
  for x, y, m in zip(data["inputs"], data["targets"], data["mask"], strict=True):
    kv = dict(zip(x[0:12:2].tolist(), x[1:12:2].tolist(), strict=True))
    assert len(kv) == 6 and min(kv) >= 1 and max(kv) < 20 and min(kv.values()) >= 20
    np.testing.assert_array_equal(m, y != D.IGNORE_INDEX)
    assert m.sum() == 5 and not m[:12].any()
    positions = np.flatnonzero(m)
    assert len({x[p] for p in positions}) == 5  # distinct queried keys
    for p in positions:
      assert y[p] == kv[x[p]]


def test_icl_regression_targets_are_w_dot_x():
  data = D.make_icl_regression(20, seed=0, dim=4, num_points=9)
  x_tokens, y_tokens = data["inputs"][:, 0::2], data["inputs"][:, 1::2]
  xs = x_tokens[..., :4]
  np.testing.assert_allclose(data["targets"], np.einsum("nkd,nd->nk", xs, data["w"]), atol=1e-5)
  np.testing.assert_array_equal(x_tokens[..., 4], 0)
  np.testing.assert_array_equal(y_tokens[..., :4], 0)
  np.testing.assert_array_equal(y_tokens[..., 4], data["targets"])
  np.testing.assert_array_equal(xs, data["xs"])
  noisy = D.make_icl_regression(20, seed=0, dim=4, num_points=9, noise_std=0.5)
  assert 0.2 < np.std(noisy["targets"] - data["targets"]) < 1.0


def test_least_squares_baseline():
  data = D.make_icl_regression(5, seed=1, dim=3, num_points=8)
  preds = D.least_squares_baseline(data["xs"], data["targets"])
  assert preds.shape == (5, 8)
  np.testing.assert_array_equal(preds[:, 0], 0)
  # With >= d noiseless points the task vector is identified exactly.
  np.testing.assert_allclose(preds[:, 3:], data["targets"][:, 3:], atol=1e-4)
  assert np.abs(preds[:, 1] - data["targets"][:, 1]).max() > 1e-2
  # Minimum-norm solution from one point: w_hat = x1 y1 / |x1|^2.
  x1, y1, x2 = data["xs"][:, 0], data["targets"][:, 0], data["xs"][:, 1]
  w_hat = x1 * (y1 / (x1 * x1).sum(-1))[:, None]
  np.testing.assert_allclose(preds[:, 1], (x2 * w_hat).sum(-1), rtol=1e-4, atol=1e-5)


def test_nw_regression_truth_and_sample(data_dir):
  test = D.load_arrays("nw_regression", "test", data_dir=data_dir)
  x = test["inputs"][:, 0].astype(np.float64)
  np.testing.assert_allclose(x, np.linspace(0, 4, 41), atol=1e-6)
  np.testing.assert_allclose(test["targets"], 2 * np.sin(x) + x, atol=1e-5)
  train = D.load_arrays("nw_regression", "train", data_dir=data_dir)
  xt = train["inputs"][:, 0]
  assert len(xt) == 100 and (np.diff(xt) >= 0).all() and xt.min() >= 0 and xt.max() <= 4
  resid = train["targets"] - (2 * np.sin(xt) + xt)
  assert 0.7 < resid.std() < 1.3
  raw = D.make_nw_regression(100, seed=0)
  np.testing.assert_allclose(raw["x_train"], xt)
  np.testing.assert_allclose(raw["y_test"], test["targets"])


def test_noisy_clusters_structure():
  params = dict(num_classes=5, dim=6, num_objects=10, classes_per_sample=3)
  clean = D.make_noisy_clusters(
    30, seed=0, within_class_spread=0.0, local_noise=0.0, global_noise=0.0, **params
  )
  centers = D.class_centers(5, 6, center_seed=0)
  np.testing.assert_allclose(clean["inputs"], centers[clean["targets"]], atol=1e-6)
  assert max(len(np.unique(t)) for t in clean["targets"]) <= 3
  # Varying global_noise (same seed) adds one shared vector to every object of a sample.
  a = D.make_noisy_clusters(30, seed=1, global_noise=0.5, **params)
  b = D.make_noisy_clusters(30, seed=1, global_noise=3.0, **params)
  np.testing.assert_array_equal(a["targets"], b["targets"])
  diff = b["inputs"] - a["inputs"]
  np.testing.assert_allclose(diff, np.broadcast_to(diff[:, :1], diff.shape), atol=1e-5)
  np.testing.assert_allclose(diff[:, 0], b["global_offset"] - a["global_offset"], atol=1e-5)
  # Pairwise dot products shift by about M = global_noise^2 * dim.
  big = D.make_noisy_clusters(400, seed=2, global_noise=2.0, **params)
  small = D.make_noisy_clusters(400, seed=2, global_noise=0.0, **params)
  dots = lambda x: np.einsum("nid,njd->nij", x, x)
  shift = (dots(big["inputs"]) - dots(small["inputs"])).mean()
  assert abs(shift - 4.0 * 6) < 3.0
  with pytest.raises(ValueError, match="unknown_param"):
    D.make_noisy_clusters(2, seed=0, unknown_param=1)


@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
def test_copy_reverse_sort(task):
  data = D.make_copy_reverse_sort(40, seed=0, task=task, num_symbols=7, min_length=3, max_length=9)
  assert data["inputs"].shape == (40, 10)
  for x, y in zip(data["inputs"], data["targets"], strict=True):
    n = int(np.argmax(x == 2))
    assert 3 <= n <= 9 and y[n] == 2 and (x[n + 1 :] == 0).all() and (y[n + 1 :] == 0).all()
    src = x[:n]
    expected = {"copy": src, "reverse": src[::-1], "sort": np.sort(src)}[task]
    np.testing.assert_array_equal(y[:n], expected)
  np.testing.assert_array_equal(data["mask"], data["targets"] != 0)


def test_synthetic_translation_alignment_and_vocab(data_dir):
  info = D.get_info("synthetic_translation")
  assert info.extras["source_vocab"][:3] == ["<pad>", "<bos>", "<eos>"]
  assert len(info.extras["target_vocab"]) == info.target_vocab_size
  data = D.load_arrays("synthetic_translation", "test", data_dir=data_dir, config="tiny")
  verbs = {e: row for row in st.VERBS for e in row[:2]}
  nonmonotonic = 0
  for x, y, a in zip(data["inputs"], data["targets"], data["alignment"], strict=True):
    src, tgt = st.decode(x, st.SOURCE_VOCAB), st.decode(y, st.TARGET_VOCAB)
    assert 3 <= len(src) == len(tgt) <= 7
    align = a[: len(tgt)]
    assert sorted(align.tolist()) == list(range(len(src)))  # a permutation (1:1 words)
    assert a[len(tgt)] == len(src)  # EOS <-> EOS
    nonmonotonic += bool((np.diff(align) < 0).any())
    # SOV: the last target word is the conjugated source verb.
    src_verb = src[align[-1]]
    assert tgt[-1] in verbs[src_verb][2:]
  assert nonmonotonic == len(data["inputs"])  # the verb always moves to the end


def test_synthetic_translation_examples():
  import random

  assert st.translate("i love you") == (["je", "te", "aime"], [0, 2, 1])
  assert st.translate("the big apples see a cat")[0] == "les pommes grandes un chat voient".split()
  assert st.translate("she eats some old flowers")[0] == "elle des fleurs vieilles mange".split()
  assert st.translate("we find him")[0] == "nous le trouvons".split()
  rng = random.Random(0)
  for _ in range(500):  # the sampler agrees with the independent rule-based translator
    src, tgt, align = st.make_sentence(rng)
    assert st.translate(src) == (tgt, align)
