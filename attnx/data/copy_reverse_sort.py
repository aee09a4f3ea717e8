"""Seq2seq toy tasks: copy, reverse or sort a sequence of tokens.

A source sequence of length uniform in [min_length, max_length] over
num_symbols symbols is mapped to its copy / reversal / ascending sort.
Ids: PAD=0, BOS=1, EOS=2, symbol s -> s + 3 (vocab_size = num_symbols + 3,
shared by source and target). With T = max_length + 1:

  inputs         [T] source + EOS, padded with PAD;
  targets        [T] transformed source + EOS, padded;
  decoder_inputs [T] BOS + targets[:-1] (teacher forcing);
  mask           [T] targets != PAD (loss mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, bool_tensor, int_tensor

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
TASK_NAMES = ("copy", "reverse", "sort")


@dataclasses.dataclass(eq=False)
class CopyReverseSortConfig(AttnxConfig):
  """task in {"copy", "reverse", "sort"}; lengths and alphabet size."""

  task: str = "copy"
  num_symbols: int = 10
  min_length: int = 4
  max_length: int = 16
  num_train: int = 20000
  num_test: int = 1000

  def validate(self) -> None:
    if self.task not in TASK_NAMES:
      raise ValueError(f"task must be one of {TASK_NAMES}, got {self.task!r}.")
    if not 1 <= self.min_length <= self.max_length or self.num_symbols < 1:
      raise ValueError("Need 1 <= min_length <= max_length and num_symbols >= 1.")


def vocab(num_symbols: int) -> list[str]:
  """id -> token string."""
  return ["<pad>", "<bos>", "<eos>", *(str(s) for s in range(num_symbols))]


def shift_right(targets: np.ndarray, bos_id: int = BOS_ID) -> np.ndarray:
  """Decoder inputs for teacher forcing: BOS followed by targets[..., :-1]."""
  out = np.empty_like(targets)
  out[..., 0] = bos_id
  out[..., 1:] = targets[..., :-1]
  return out


def make_copy_reverse_sort(
  n: int,
  seed: int,
  *,
  task: str = "copy",
  num_symbols: int = 10,
  min_length: int = 4,
  max_length: int = 16,
) -> dict[str, np.ndarray]:
  """n examples of `task` (see the module docstring for the keys)."""
  if task not in TASK_NAMES:
    raise ValueError(f"task must be one of {TASK_NAMES}, got {task!r}.")
  rng = np.random.default_rng(seed)
  t = max_length + 1
  lengths = rng.integers(min_length, max_length + 1, size=n)
  symbols = rng.integers(0, num_symbols, size=(n, max_length)) + NUM_SPECIAL
  inputs = np.full((n, t), PAD_ID, np.int32)
  targets = np.full((n, t), PAD_ID, np.int32)
  for i, (length, seq) in enumerate(zip(lengths, symbols, strict=True)):
    src = seq[:length]
    out = {"copy": src, "reverse": src[::-1], "sort": np.sort(src)}[task]
    inputs[i, :length], inputs[i, length] = src, EOS_ID
    targets[i, :length], targets[i, length] = out, EOS_ID
  return {
    "inputs": inputs,
    "targets": targets,
    "decoder_inputs": shift_right(targets),
    "mask": targets != PAD_ID,
  }


class CopyReverseSort(AttnxBuilder):
  """Copy / reverse / sort."""

  BUILDER_CONFIGS = [
    CopyReverseSortConfig(name="default", description="copy, lengths 4-16, 10 symbols."),
    CopyReverseSortConfig(name="reverse", description="reverse.", task="reverse"),
    CopyReverseSortConfig(name="sort", description="sort.", task="sort"),
    CopyReverseSortConfig(
      name="tiny",
      description="Small, for tests (reverse).",
      task="reverse",
      num_symbols=6,
      min_length=2,
      max_length=8,
      num_train=256,
      num_test=64,
    ),
  ]

  @classmethod
  def _features(cls, config):
    t = (config.max_length + 1,)
    return {
      "inputs": int_tensor(t),
      "targets": int_tensor(t),
      "decoder_inputs": int_tensor(t),
      "mask": bool_tensor(t),
    }

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    return make_copy_reverse_sort(
      n,
      seed,
      task=config.task,
      num_symbols=config.num_symbols,
      min_length=config.min_length,
      max_length=config.max_length,
    )

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    size = config.num_symbols + NUM_SPECIAL
    return DatasetInfo(
      name="copy_reverse_sort",
      task="seq2seq",
      input_shape=(config.max_length + 1,),
      input_dtype="int32",
      num_classes=size,
      vocab_size=size,
      target_vocab_size=size,
      seq_len=config.max_length + 1,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={
        "source_vocab": vocab(config.num_symbols),
        "target_vocab": vocab(config.num_symbols),
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "params": config.params(),
      },
    )
