"""Documents packed into fixed-length rows with segment ids, by grain's packing.

A language model trained on windows cut from one stream of text attends across document
boundaries. Packing keeps documents apart instead: each document (a 1-D array of token ids) is
cut into next-token pieces of at most ``seq_len`` targets, and grain's packing
(``grain.experimental.FirstFitPackIterDataset`` or ``BestFitPackIterDataset``) places the
pieces, in document order, into rows of ``seq_len`` tokens. Every row says which piece each
token belongs to (``segment_ids``, 1, 2, … within the row; 0 for padding) and where it is in
its piece (``positions``, from 0), which is what ``attnx.nn.GPT(...)(tokens, segment_ids=,
positions=)`` reads so that no token attends to another piece and positions restart per piece.
The targets of padding are :data:`attnx.constants.IGNORE_INDEX`, so the loss skips them.

Pieces: a document of n tokens has n − 1 next-token targets; piece p holds the inputs
``doc[p·L : p·L + L]`` and the targets ``doc[p·L + 1 : p·L + L + 1]`` (L = ``seq_len``), the
last piece of a document shorter unless L divides n − 1. Consecutive pieces of one document
overlap by one token, exactly as the windows of :func:`attnx.data.shakespeare.windows`, so
every token after a document's first is a target exactly once. A piece never sees its
predecessor: documents longer than L are trained on as independent pieces, as in every packed
pipeline.

The rows are a deterministic function of the documents, ``seq_len``, ``method`` and
``num_packing_bins`` (no randomness: the training stream shuffles rows per epoch, and resuming
it at any step is exact, see :func:`attnx.train.loader`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnx.constants import IGNORE_INDEX

PACKINGS = ("first_fit", "best_fit")
KEYS = ("inputs", "targets", "segment_ids", "positions")

__all__ = ["KEYS", "PACKINGS", "check_packing", "document_pieces", "pack_documents"]


def check_packing(method: str, allow_none: bool = False) -> None:
  """Raises ValueError unless ``method`` is one of :data:`PACKINGS` (or "" when allowed)."""
  if allow_none and method == "":
    return
  if method not in PACKINGS:
    valid = ("'' (no packing), " if allow_none else "") + ", ".join(map(repr, PACKINGS))
    raise ValueError(f"packing={method!r} is not a packing method; valid: {valid}.")


def document_pieces(documents: Sequence[np.ndarray], seq_len: int) -> list[dict[str, np.ndarray]]:
  """Each document's next-token pieces of at most ``seq_len`` targets, in order (module
  docstring); documents of fewer than two tokens have no target and give none."""
  if int(seq_len) < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len!r}.")
  L = int(seq_len)
  pieces = []
  for i, doc in enumerate(documents):
    doc = np.asarray(doc)
    if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
      raise ValueError(f"document {i} must be a 1-D array of integer token ids, got shape "
                       f"{doc.shape} and dtype {doc.dtype}.")
    doc = doc.astype(np.int32)
    for start in range(0, len(doc) - 1, L):
      stop = min(start + L, len(doc) - 1)
      pieces.append({"inputs": doc[start:stop], "targets": doc[start + 1:stop + 1]})
  return pieces


def pack_documents(documents: Sequence[np.ndarray], seq_len: int, *, method: str = "first_fit",
                   num_packing_bins: int = 64) -> dict[str, np.ndarray]:
  """Documents packed into rows of ``seq_len`` tokens by grain's packing.

  Args:
    documents: 1-D integer arrays of token ids, one per document.
    seq_len: the row length L (the model's context).
    method: ``"first_fit"`` (``grain.experimental.FirstFitPackIterDataset``) or
      ``"best_fit"`` (``BestFitPackIterDataset``).
    num_packing_bins: rows grain keeps open while packing (more: less padding).

  Returns:
    {"inputs", "targets", "segment_ids", "positions"}: int32 arrays [R, seq_len]. Padding has
    segment id 0, position 0, input 0 and target ``IGNORE_INDEX``.

  Raises:
    ValueError: a bad method, length or number of bins, or no document with a target.

  Example:
    >>> import numpy as np
    >>> from attnx.data import packing
    >>> rows = packing.pack_documents([np.arange(1, 5), np.arange(10, 13)], 6)
    >>> rows["inputs"].tolist(), rows["segment_ids"].tolist()
    ([[1, 2, 3, 10, 11, 0]], [[1, 1, 1, 2, 2, 0]])
    >>> rows["targets"].tolist(), rows["positions"].tolist()
    ([[2, 3, 4, 11, 12, -100]], [[0, 1, 2, 0, 1, 0]])
  """
  import grain  # noqa: PLC0415 (heavy import, only when packing)
  from grain import experimental as grain_experimental  # noqa: PLC0415

  check_packing(method)
  if int(num_packing_bins) < 1:
    raise ValueError(f"num_packing_bins must be >= 1, got {num_packing_bins!r}.")
  pieces = document_pieces(documents, seq_len)
  if not pieces:
    raise ValueError("pack_documents: no document has two or more tokens (nothing to predict).")
  L = int(seq_len)
  # A piece of L targets fills a row alone whatever the packer does: it becomes one, and only
  # the shorter pieces (each document's last, short documents) go through grain (Shakespeare's
  # 71k pieces of 64: 25 s through grain, instant so).
  full = [p for p in pieces if len(p["inputs"]) == L]
  short = [p for p in pieces if len(p["inputs"]) < L]
  packer = (grain_experimental.FirstFitPackIterDataset if method == "first_fit"
            else grain_experimental.BestFitPackIterDataset)
  packed = list(packer(grain.MapDataset.source(short).to_iter_dataset(),
                       length_struct={"inputs": L, "targets": L},
                       num_packing_bins=int(num_packing_bins), shuffle_bins=False)
                ) if short else []
  ones, iota = np.ones(L, np.int32), np.arange(L, dtype=np.int32)
  rows = [{"inputs": p["inputs"], "targets": p["targets"], "segment_ids": ones,
           "positions": iota} for p in full]
  rows += [{"inputs": r["inputs"], "targets": r["targets"],
            "segment_ids": r["inputs_segment_ids"], "positions": r["inputs_positions"]}
           for r in packed]
  out = {k: np.stack([np.asarray(r[k], np.int32) for r in rows]) for k in KEYS}
  out["targets"] = np.where(out["segment_ids"] > 0, out["targets"], IGNORE_INDEX
                            ).astype(np.int32)
  return out
