"""attnx.data.packing: documents packed into rows by grain, checked by rebuilding every document
from the rows (an independent reading: segments, positions and targets must give back exactly
the documents' next-token pairs, each once)."""

from __future__ import annotations

import numpy as np
import pytest

from attnx.constants import IGNORE_INDEX
from attnx.data import packing, shakespeare


def _documents(seed: int, count: int, max_len: int) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 50, size=int(rng.integers(0, max_len))).astype(np.int32)
          for _ in range(count)]


def _pairs_of_rows(rows: dict[str, np.ndarray]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
  """Every segment of every row as (inputs, targets), read from segment ids alone."""
  out = []
  for r in range(len(rows["inputs"])):
    ids = rows["segment_ids"][r]
    for s in sorted(set(ids.tolist()) - {0}):
      where = np.flatnonzero(ids == s)
      assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), "segment not contiguous"
      np.testing.assert_array_equal(rows["positions"][r, where], np.arange(len(where)))
      out.append((tuple(rows["inputs"][r, where]), tuple(rows["targets"][r, where])))
  return out


@pytest.mark.parametrize("method", packing.PACKINGS)
@pytest.mark.parametrize("seed,seq_len,max_len", [(0, 8, 30), (1, 16, 5), (2, 7, 100),
                                                  (3, 1, 6)])
def test_rows_hold_every_next_token_pair_once_within_its_document(method, seed, seq_len,
                                                                  max_len):
  docs = _documents(seed, 40, max_len)
  rows = packing.pack_documents(docs, seq_len, method=method)
  assert set(rows) == set(packing.KEYS)
  assert all(a.shape == (len(rows["inputs"]), seq_len) and a.dtype == np.int32
             for a in rows.values())
  pad = rows["segment_ids"] == 0
  assert np.all(rows["targets"][pad] == IGNORE_INDEX) and np.all(rows["targets"][~pad] >= 0)
  # Each segment is a consecutive run of one document's pairs: target = next input.
  segments = _pairs_of_rows(rows)
  for inputs, targets in segments:
    assert inputs[1:] == targets[:-1]
  expected = sorted((tuple(d[i:min(i + seq_len, len(d) - 1)]), tuple(d[i + 1:i + seq_len + 1]))
                    for d in docs for i in range(0, len(d) - 1, seq_len))
  assert sorted(segments) == expected
  # Rows are full but for the packer's leftovers: no more rows than bins of pieces need.
  lengths = sum(len(d) - 1 for d in docs if len(d) > 1)
  assert int((~pad).sum()) == lengths


def test_packing_short_documents_shares_rows_and_is_deterministic():
  docs = _documents(4, 200, 12)
  rows = packing.pack_documents(docs, 64)
  assert np.max(rows["segment_ids"]) > 3  # several documents per row
  assert (rows["segment_ids"] == 0).mean() < 0.2
  again = packing.pack_documents(docs, 64)
  for k in packing.KEYS:
    np.testing.assert_array_equal(rows[k], again[k])


def test_bad_input_is_a_clear_error():
  docs = [np.arange(5)]
  with pytest.raises(ValueError, match="packing='next_fit'"):
    packing.pack_documents(docs, 4, method="next_fit")
  with pytest.raises(ValueError, match="seq_len must be >= 1"):
    packing.pack_documents(docs, 0)
  with pytest.raises(ValueError, match="num_packing_bins"):
    packing.pack_documents(docs, 4, num_packing_bins=0)
  with pytest.raises(ValueError, match="document 1 must be a 1-D array of integer"):
    packing.pack_documents([np.arange(3), np.ones((2, 2), np.int32)], 4)
  with pytest.raises(ValueError, match="document 0 must be .* integer"):
    packing.pack_documents([np.linspace(0, 1, 4)], 4)
  with pytest.raises(ValueError, match="no document has two or more tokens"):
    packing.pack_documents([np.arange(1), np.arange(0)], 4)


def test_a_text_files_documents_are_its_split_parts(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("abcdefghij" * 10)
  train = shakespeare.documents("train", text_file=str(path))
  valid = shakespeare.documents("validation", text_file=str(path))
  assert [len(d) for d in train] == [90] and [len(d) for d in valid] == [10]
  vocab = "abcdefghij"
  assert shakespeare.decode(np.concatenate(train + valid), vocab) == "abcdefghij" * 10
  with pytest.raises(ValueError, match="Unknown split 'test'"):
    shakespeare.documents("test", text_file=str(path))


def test_a_corpus_of_files_is_one_document_per_file(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  texts = {"b.txt": "hello world\n" * 5, "a.txt": "abc" * 20, ".hidden": "zzz"}
  for name, text in texts.items():
    (corpus / name).write_text(text)
  files = shakespeare.text_files(str(corpus))
  assert [p.rsplit("/", 1)[1] for p in files] == ["a.txt", "b.txt"]
  docs = shakespeare.documents("train", text_file=str(corpus))
  listed = shakespeare.documents("train", text_file=f"{corpus}/a.txt, {corpus}/b.txt")
  vocab = "".join(sorted(set(texts["a.txt"] + texts["b.txt"])))
  want = [t[:int(len(t) * 0.9)] for t in (texts["a.txt"], texts["b.txt"])]
  assert [shakespeare.decode(d, vocab) for d in docs] == want
  assert [d.tolist() for d in listed] == [d.tolist() for d in docs]
  # The windows read the files joined by a blank line, as the works.
  stream = shakespeare.token_stream("train", text_file=str(corpus))
  assert shakespeare.decode(stream, vocab) == shakespeare.WORK_SEPARATOR.join(want)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(shakespeare.DatasetNotFoundError, match="holds no files"):
    shakespeare.text_files(str(empty))
  with pytest.raises(shakespeare.DatasetNotFoundError, match="nope.txt' does not exist"):
    shakespeare.documents("train", text_file=f"{corpus}/a.txt,{corpus}/nope.txt")
