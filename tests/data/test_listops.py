"""ListOps: labels equal an independent evaluation of the token string."""

import numpy as np
import pytest

from attnx.data import listops


def _reference_eval(tokens):
  """Independent recursive-descent evaluator (returns value, next position)."""

  def parse(i):
    tok = tokens[i]
    if tok.isdigit():
      return int(tok), i + 1
    assert tok in ("[MIN", "[MAX", "[MED", "[SM"), tok
    args, i = [], i + 1
    while tokens[i] != "]":
      v, i = parse(i)
      args.append(v)
    if tok == "[MIN":
      v = min(args)
    elif tok == "[MAX":
      v = max(args)
    elif tok == "[SM":
      v = sum(args) % 10
    else:  # LRA: int(np.median(args)) = floor of the mean of the middle two
      s = sorted(args)
      m = len(s) // 2
      v = s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2
    return v, i + 1

  value, end = parse(0)
  assert end == len(tokens)
  return value


def _depth(tokens):
  d = best = 0
  for t in tokens:
    if t.startswith("["):
      d += 1
      best = max(best, d)
    elif t == "]":
      d -= 1
  return best


@pytest.mark.parametrize(
  "expr, value",
  [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MIN 3 [MAX 1 8 ] 5 ]", 3),
    ("[SM 9 8 7 ]", 4),
    ("[MED 1 2 ]", 1),  # even count: int(np.median) = floor(1.5)
    ("[MED 1 4 6 9 ]", 5),
    ("[MED 7 1 3 ]", 3),
    ("[SM [MAX 2 9 ] [MED 1 2 3 4 ] ]", 1),
  ],
)
def test_known_examples(expr, value):
  assert listops.evaluate(expr) == value
  assert _reference_eval(expr.split()) == value
  ids = listops.tokenize(expr, max_length=32)
  assert ids.shape == (32,) and ids.dtype == np.int32
  assert listops.detokenize(ids) == expr
  assert listops.evaluate(ids) == value


def test_vocabulary():
  assert listops.VOCAB_SIZE == 16
  assert listops.PAD_ID == 0
  assert listops.tokenize("[MIN 0 9 ]").tolist() == [11, 1, 10, 15]
  with pytest.raises(ValueError):
    listops.evaluate("[MIN 1 2")


def test_generated_labels_match_independent_evaluator():
  data = listops.make_listops(300, seed=1, max_length=64, min_length=8, max_depth=4, max_args=5)
  assert data["inputs"].shape == (300, 64) and data["targets"].shape == (300,)
  lengths = data["mask"].sum(1)
  assert lengths.min() >= 8 and lengths.max() <= 64
  np.testing.assert_array_equal(data["mask"], data["inputs"] != 0)
  for row, label, length in zip(data["inputs"], data["targets"], lengths, strict=True):
    assert (row[length:] == 0).all() and (row[:length] != 0).all()
    tokens = listops.detokenize(row).split()
    assert _reference_eval(tokens) == label
    assert _depth(tokens) <= 3  # operators nest at most max_depth - 1 levels (LRA)
  assert set(np.unique(data["targets"])) <= set(range(10))
  assert len(np.unique(data["targets"])) >= 5


def test_deterministic():
  a = listops.make_listops(20, seed=3)
  b = listops.make_listops(20, seed=3)
  c = listops.make_listops(20, seed=4)
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["inputs"], c["inputs"])
