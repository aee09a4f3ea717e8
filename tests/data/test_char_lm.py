"""attnx.data.char_lm: a language model's view of the shakespeare dataset on a text of its own
(settings made absolute, cached streams and vocabulary, packed rows that rebuild the training
documents, the row count either way, the prompt in the text's style, bits per character)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnx.data import char_lm, packing, shakespeare

# Ten short "files" of a corpus, ten lines of 14 characters each: 90 % of a file is 9 lines.
FILES = {f"f{i:02d}.txt": "".join(f"line {i}.{j}: abc\n" for j in range(10)) for i in range(10)}


@pytest.fixture
def corpus(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  root = tmp_path / "corpus"
  root.mkdir()
  for name, text in FILES.items():
    (root / name).write_text(text)
  return char_lm.data_kwargs(str(root), 16)["text_file"]


def test_settings_are_made_absolute_once(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  assert char_lm.data_kwargs(None, 32) == char_lm.data_kwargs("", 32) == {"seq_len": 32}
  kwargs = char_lm.data_kwargs("a.txt, b.txt", 8)
  assert kwargs == {"seq_len": 8, "text_file": f"{tmp_path}/a.txt,{tmp_path}/b.txt"}


def test_streams_vocabulary_and_the_prompt_of_a_corpus(corpus):
  vocab = char_lm.vocabulary(corpus)
  assert vocab == "".join(sorted(set("".join(FILES.values()))))
  stream = char_lm.token_stream("validation", corpus)
  assert stream is char_lm.token_stream("validation", corpus)  # cached: one array for all
  parts = [text[126:] for text in FILES.values()]  # each file's last line, a blank line apart
  assert shakespeare.decode(stream, vocab) == shakespeare.WORK_SEPARATOR.join(parts)
  # The split's first line may start mid-line: the prompt is the first line after it.
  assert char_lm.text_prompt(corpus) == "line 1.9: abc"
  assert char_lm.text_prompt(corpus, max_chars=4) == "line"
  with pytest.raises(ValueError, match="max_chars must be >= 1"):
    char_lm.text_prompt(corpus, max_chars=0)


def test_packed_rows_rebuild_the_training_documents(corpus):
  rows = char_lm.packed_rows(corpus, 16, "best_fit")
  assert rows is char_lm.packed_rows(corpus, 16, "best_fit")
  docs = shakespeare.documents("train", text_file=corpus)
  np.testing.assert_array_equal(
      rows["inputs"], packing.pack_documents(docs, 16, method="best_fit")["inputs"])
  assert char_lm.training_rows(corpus, 16, "best_fit") == len(rows["inputs"])
  # Without packing: the windows of 16 characters of the joined training text.
  train = char_lm.token_stream("train", corpus)
  assert char_lm.training_rows(corpus, 16) == (len(train) - 1) // 16
  with pytest.raises(ValueError, match="packing='next_fit' is not a packing method"):
    char_lm.packed_rows(corpus, 16, "next_fit")


def test_a_missing_text_file_is_named(tmp_path):
  char_lm.check_text_file("")  # Gutenberg Shakespeare: nothing to check
  char_lm.check_text_file(None)
  with pytest.raises(ValueError, match=r"config.text_file='nope.txt': text_file .*does not exist"):
    char_lm.check_text_file("nope.txt")
  with pytest.raises(ValueError, match=r"^corpus=.*holds no files"):
    char_lm.check_text_file(str(tmp_path), key="corpus")


def test_bits_per_char():
  assert np.allclose(char_lm.bits_per_char([math.log(2), 2 * math.log(2)]), [1.0, 2.0])
  assert float(char_lm.bits_per_char(1.88)) == pytest.approx(2.7123, abs=1e-4)
