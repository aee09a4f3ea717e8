"""attnx.train.data: `loader`, the one data path. Its numpy and grain training streams are
deterministic, resumable and cover every example once per epoch (fit trains the same with
either); its evaluation pass is ordered and complete."""

import itertools

import numpy as np
import pytest
from support.train_stand_ins import TinyMLP, make_arrays

from attnx import train

N, B = 50, 8  # 6 full batches per epoch, 2 examples left over


def _arrays():
  return {"inputs": np.arange(N, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32),
          "targets": np.arange(N)}


def _take(stream, k):
  return [b["targets"] for b in itertools.islice(stream, k)]


@pytest.mark.parametrize("pipeline", train.PIPELINES)
def test_deterministic_and_resumable(pipeline):
  fn = train.loader(_arrays(), B, pipeline)
  first = _take(fn(3, 0), 20)
  np.testing.assert_array_equal(np.stack(first), np.stack(_take(fn(3, 0), 20)))
  np.testing.assert_array_equal(np.stack(first[13:]), np.stack(_take(fn(3, 13), 7)))
  assert not np.array_equal(np.stack(first), np.stack(_take(fn(4, 0), 20)))  # seed matters
  for b in first:  # rows of a batch stay aligned
    assert b.shape == (B,) and len(set(b.tolist())) == B


@pytest.mark.parametrize("pipeline", train.PIPELINES)
def test_process_shares_of_a_batch_are_its_rows_and_add_up_to_it(pipeline):
  # What each process of a multi-process run reads: rows a:b of the global batch of the step.
  fn = train.loader(_arrays(), B, pipeline)
  whole = _take(fn(5, 3), 9)
  shares = [_take(fn(5, 3, rows=r), 9) for r in ((0, 2), (2, 6), (6, 8))]
  for t in range(9):
    np.testing.assert_array_equal(np.concatenate([s[t] for s in shares]), whole[t])
  inputs = next(fn(5, 3, rows=(2, 6)))["inputs"]
  np.testing.assert_array_equal(inputs[:, 0], whole[0][2:6])  # every array, same rows
  for bad in ((0, 0), (3, 2), (-1, 4), (0, B + 1)):
    with pytest.raises(ValueError, match=r"rows=.* is not a non-empty range of the 8 rows"):
      next(fn(5, 0, rows=bad))


@pytest.mark.parametrize("pipeline", train.PIPELINES)
def test_shuffled_epochs_cover_the_data(pipeline):
  batches = np.concatenate(_take(train.loader(_arrays(), B, pipeline)(0, 0), 6))
  assert len(set(batches.tolist())) == 48  # 6 batches of one epoch: no repeats
  assert not np.array_equal(np.sort(batches), batches)  # shuffled
  second = np.concatenate(_take(train.loader(_arrays(), B, pipeline)(0, 6), 6))
  assert not np.array_equal(second, batches)  # a new permutation every epoch


def test_grain_pipeline_trains_like_numpy_and_bad_names_fail():
  arrays = make_arrays()
  finals = {}
  for pipeline in train.PIPELINES:
    config = train.FitConfig(loss="softmax_xent", num_steps=60, num_seeds=1, seed=0,
                             optimizer=train.optimizer_config(learning_rate=0.05),
                             progress=False)
    r = train.fit(TinyMLP(), train_data=train.loader(arrays, 16, pipeline), config=config)
    finals[pipeline] = float(np.mean(r.final_metrics["train_loss"]))
  first = float(np.log(int(arrays["targets"].max()) + 1))  # loss of uniform predictions
  assert finals["grain"] < 0.7 * first and finals["numpy"] < 0.7 * first, finals
  with pytest.raises(ValueError, match="numpy, grain"):
    train.loader(arrays, 16, "tf.data")


def test_loader_evaluation_pass_is_ordered_complete_and_repeatable():
  data = train.loader(_arrays(), B)
  passes = [np.concatenate([b["targets"] for b in data]),  # iterating: one pass
            np.concatenate([b["targets"] for b in data()])]  # called without a seed: the same
  for p in passes:
    np.testing.assert_array_equal(p, np.arange(N))  # every example once, in order
  assert [len(b["targets"]) for b in data] == [B] * 6 + [2]  # the last batch is smaller
  assert len(data) == 7
  first = next(iter(data))
  assert first["inputs"].shape == (B, 3)  # rows of all arrays stay aligned
  np.testing.assert_array_equal(first["inputs"][:, 0], first["targets"])


def test_loader_rejects_bad_arrays_and_sizes():
  with pytest.raises(ValueError, match="differ in length"):
    train.loader({"inputs": np.zeros((4, 2)), "targets": np.zeros(5)}, 2)
  with pytest.raises(ValueError, match="batch_size must be >= 1"):
    train.loader(_arrays(), 0)
  with pytest.raises(ValueError, match="larger than the 50 examples"):
    next(train.loader(_arrays(), 64)(0, 0))  # training takes full batches only
