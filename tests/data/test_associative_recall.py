"""attnx.data.associative_recall: MQAR targets are the values of the queried keys."""

import numpy as np

import attnx.data as D


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
