"""The data of a character-level language model: Gutenberg Shakespeare or a text of your own.

What an experiment that trains a character GPT reads from the ``"shakespeare"`` dataset
(:mod:`attnx.data.shakespeare`; with ``text_file`` set, a UTF-8 file, a directory of them or a
comma-separated list): the builder config of a setting (:func:`data_kwargs`), a split as one
token stream and the vocabulary (cached, since every variant's evaluators read the same
arrays), the training documents packed into rows whose positions restart per document
(:func:`packed_rows`, :mod:`attnx.data.packing`), the number of training rows either way, and
a prompt in the text's own style (:func:`text_prompt`). ``text_file=None`` (or ``""``) means
Gutenberg Shakespeare throughout; a setting is made absolute once, by :func:`data_kwargs`, so
that the caches and the model files name one path.

Example:
  >>> from attnx.data import char_lm
  >>> char_lm.data_kwargs(None, 64)
  {'seq_len': 64}
  >>> round(float(char_lm.bits_per_char(1.88)), 4)
  2.7123
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from attnx.data import catalog, packing, shakespeare
from attnx.data.loader import get_info

__all__ = ["bits_per_char", "check_text_file", "data_kwargs", "packed_rows", "text_prompt",
           "token_stream", "training_rows", "vocabulary"]


def data_kwargs(text_file: str | None, seq_len: int) -> dict[str, Any]:
  """The ``"shakespeare"`` builder config of a setting: ``seq_len`` and, when a text file is
  set, its absolute path (:func:`attnx.data.shakespeare.absolute_text_file`)."""
  path = shakespeare.absolute_text_file(text_file) if text_file else None
  return {"seq_len": int(seq_len), **({"text_file": path} if path else {})}


def _text_kwargs(text_file: str | None) -> dict[str, str]:
  return {"text_file": text_file} if text_file else {}


@functools.lru_cache(maxsize=8)
def token_stream(split: str, text_file: str | None = None) -> np.ndarray:
  """One split as a 1-D int32 token array (cached: the evaluators of every variant read it).

  ``text_file``: an absolute setting (:func:`data_kwargs`), or None for Shakespeare.
  """
  return shakespeare.token_stream(split, **_text_kwargs(text_file))


def vocabulary(text_file: str | None = None) -> str:
  """The dataset vocabulary (token id -> character)."""
  return get_info("shakespeare", **_text_kwargs(text_file)).extras["vocab"]


def text_prompt(text_file: str, max_chars: int = 20) -> str:
  """A prompt in a text's own style: the first complete non-blank line of its validation split
  (the split's first line only when no later one has text), cut at ``max_chars``."""
  if int(max_chars) < 1:
    raise ValueError(f"text_prompt: max_chars must be >= 1, got {max_chars!r}.")
  vocab = vocabulary(text_file)
  text = "".join(vocab[int(i)] for i in token_stream("validation", text_file)[:4096])
  lines = [line.rstrip() for line in text.split("\n")]
  return next((line for line in lines[1:] + lines[:1] if line.strip()), text)[:int(max_chars)]


@functools.lru_cache(maxsize=4)
def packed_rows(text_file: str | None, seq_len: int, method: str) -> dict[str, np.ndarray]:
  """The training split's documents (each work, or each file of a corpus) packed into rows of
  ``seq_len`` by ``method`` (:func:`attnx.data.packing.pack_documents`; cached)."""
  packing.check_packing(method)
  docs = shakespeare.documents("train", **_text_kwargs(text_file))
  return packing.pack_documents(docs, int(seq_len), method=method)


def training_rows(text_file: str | None, seq_len: int, method: str = "") -> int:
  """How many training examples a setting has: packed rows (``method`` a packing), else the
  windows of ``seq_len`` characters (:func:`attnx.data.get_info`, nothing prepared)."""
  if method:
    return len(packed_rows(text_file, int(seq_len), method)["inputs"])
  return get_info("shakespeare", **data_kwargs(text_file, seq_len)).splits["train"]


def check_text_file(text_file: str | None, key: str = "config.text_file") -> None:
  """Raises ValueError, naming ``key``, when a ``text_file`` setting names no readable file
  (none set, ``""`` or None, is Gutenberg Shakespeare: nothing to check)."""
  if not text_file:
    return
  try:
    shakespeare.text_files(shakespeare.absolute_text_file(text_file))
  except catalog.DatasetNotFoundError as e:
    raise ValueError(f"{key}={text_file!r}: {e}") from None


def bits_per_char(nats: Any) -> np.ndarray:
  """Cross-entropy in nats per character -> bits per character (÷ ln 2)."""
  return np.asarray(nats, np.float64) / math.log(2.0)
