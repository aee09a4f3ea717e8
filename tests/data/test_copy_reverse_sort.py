"""attnx.data.copy_reverse_sort: targets are the copied, reversed or sorted source."""

import numpy as np
import pytest

import attnx.data as D


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
