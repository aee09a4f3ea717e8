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


def test_values_are_distinct_like_zoology():
  """Zoology draws values without replacement: no two keys of an example share a value (the
  earlier generator repeated a value in most examples)."""
  data = D.make_associative_recall(500, seed=1, vocab_size=64, seq_len=64, num_kv_pairs=8,
                                   num_queries=8)
  values = data["inputs"][:, 1:16:2]
  assert all(len(set(v.tolist())) == 8 for v in values)
  assert values.min() >= 32 and values.max() < 64
  # Every value appears (the draw covers the value range, not a fixed subset).
  assert len(np.unique(values)) == 32


def test_power_law_query_positions():
  """query_power_a = 0.01 (Zoology) puts queries soon after the context; 0 is uniform."""
  kw = dict(vocab_size=256, seq_len=128, num_kv_pairs=4, num_queries=4)
  slots = {}
  for a in (0.0, 0.01):
    d = D.make_associative_recall(2000, seed=2, query_power_a=a, **kw)
    pos = np.argwhere(d["mask"])[:, 1]
    slots[a] = (pos - 8) // 2  # slot index in the query region (60 slots)
    assert d["mask"].sum(1).min() == 4  # distinct slots: every query lands
  assert abs(slots[0.0].mean() - 29.5) < 1.5  # uniform over the 60 slots 0..59
  # Power law a·s^(a−1), s = 1..60, renormalized per draw without replacement: the first
  # slots dominate; the mean slot is far below uniform.
  assert slots[0.01].mean() < 15 and np.mean(slots[0.01] < 4) > 0.3


def test_bad_power_is_rejected():
  import pytest

  with pytest.raises(ValueError, match="query_power_a"):
    D.make_associative_recall(4, seed=0, query_power_a=2.0)
