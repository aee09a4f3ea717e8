"""ListOps as generated for the Long Range Arena (Tay et al. 2020; Nangia & Bowman 2018).

Expressions nest the operators MIN, MAX, MED (median) and SM (sum mod 10) over
digits 0-9, e.g. "[MAX 2 9 [MIN 4 7 ] 0 ]" -> 9. Generation follows LRA's
`generate_tree`: below `max_depth` every argument is an operator with
probability 0.25 (`VALUE_P`) and otherwise a digit; an operator takes
randint(2, max_args) arguments, and nodes at depth max_depth are digits
(so operators nest at most max_depth - 1 deep); expressions are kept when
min_length <= number of tokens <= max_length. (LRA rejects the trivial
single-digit root through its min_length; here the root is always an
operator, which is the same conditional distribution.)

Defaults are CPU-sized: max_length 128, min_length 32, max_depth 4 (operators
nest at most 3 deep), max_args 10 (median length ~50 tokens). LRA itself uses
max_depth 10, max_args 10 and lengths 500-2000 with 96k/2k/2k examples (the
"lra" config; slow to generate in pure Python).

MED follows the LRA code, `int(np.median(args))`: for an even number of
arguments it is the mean of the two middle values rounded down (truncated),
e.g. MED[1, 2] = 1 and MED[1, 4, 6, 9] = 5.

Tokens: PAD=0, digits d -> d + 1 (1..10), "[MIN"=11, "[MAX"=12, "[MED"=13,
"[SM"=14, "]"=15 (vocab_size 16); padded to max_length. Label = the value.
Splits are generated with independent seeds (not de-duplicated across splits;
with the tiny configs a few test expressions may also occur in train).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, bool_tensor, int_tensor

PAD = "<pad>"
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VOCAB: tuple[str, ...] = (PAD, *(str(d) for d in range(10)), *OPERATORS, END)
TOKEN_TO_ID = {t: i for i, t in enumerate(VOCAB)}
VOCAB_SIZE = len(VOCAB)
PAD_ID = 0
VALUE_P = 0.25  # LRA: probability that a (non-maximal-depth) node is an operator


@dataclasses.dataclass(eq=False)
class ListOpsConfig(AttnxConfig):
  """ListOps parameters (see the module docstring)."""

  max_length: int = 128
  min_length: int = 32
  max_depth: int = 4
  max_args: int = 10
  num_train: int = 20000
  num_validation: int = 2000
  num_test: int = 2000

  def validate(self) -> None:
    check_params(self.max_length, self.min_length, self.max_depth, self.max_args)


def check_params(max_length: int, min_length: int, max_depth: int, max_args: int) -> None:
  """Raises ValueError for settings that cannot generate any expression."""
  if max_args < 2 or max_depth < 2:
    raise ValueError("listops needs max_args >= 2 and max_depth >= 2.")
  if not 4 <= min_length <= max_length:
    raise ValueError("listops needs 4 <= min_length <= max_length.")
  longest = 2 + max_args  # an operator whose arguments are all digits
  for _ in range(max_depth - 2):
    longest = 2 + max_args * longest
  if min_length > longest:
    raise ValueError(
      f"listops min_length {min_length} unreachable: max_depth {max_depth} and max_args "
      f"{max_args} give at most {longest} tokens."
    )


def _apply(op: str, args: Sequence[int]) -> int:
  if op == "[MIN":
    return min(args)
  if op == "[MAX":
    return max(args)
  if op == "[MED":
    return int(np.median(args))
  if op == "[SM":
    return sum(args) % 10
  raise ValueError(f"Unknown operator {op!r}.")


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, out: list[str]) -> int:
  """Appends an operator node's tokens to `out` and returns its value (LRA rules)."""
  op = rng.choice(OPERATORS)
  out.append(op)
  args = []
  for _ in range(rng.randint(2, max_args)):
    if depth + 1 < max_depth and rng.random() < VALUE_P:
      args.append(_tree(rng, depth + 1, max_depth, max_args, out))
    else:
      value = rng.randrange(10)
      out.append(str(value))
      args.append(value)
  out.append(END)
  return _apply(op, args)


def generate_expression(
  rng: random.Random, *, max_length: int, min_length: int, max_depth: int, max_args: int
) -> tuple[list[str], int]:
  """One expression (list of tokens) within the length bounds, and its value."""
  while True:
    tokens: list[str] = []
    value = _tree(rng, 1, max_depth, max_args, tokens)
    if min_length <= len(tokens) <= max_length:
      return tokens, value


def tokenize(expression: str | Sequence[str], max_length: int | None = None) -> np.ndarray:
  """Token ids of an expression string like "[MAX 2 9 ]", padded to max_length."""
  tokens = expression.split() if isinstance(expression, str) else list(expression)
  ids = [TOKEN_TO_ID[t] for t in tokens]
  if max_length is not None:
    if len(ids) > max_length:
      raise ValueError(f"Expression has {len(ids)} tokens > max_length {max_length}.")
    ids = ids + [PAD_ID] * (max_length - len(ids))
  return np.asarray(ids, np.int32)


def detokenize(ids: Sequence[int] | np.ndarray) -> str:
  """Inverse of `tokenize` (padding dropped)."""
  return " ".join(VOCAB[int(i)] for i in np.asarray(ids).reshape(-1) if int(i) != PAD_ID)


def evaluate(expression: str | Sequence[str] | np.ndarray) -> int:
  """Value of an expression given as a string, a token list or token ids."""
  if isinstance(expression, str):
    tokens = expression.split()
  elif isinstance(expression, np.ndarray) or (
    len(expression) and not isinstance(expression[0], str)
  ):
    tokens = detokenize(expression).split()
  else:
    tokens = list(expression)
  stack: list[tuple[str, list[int]]] = []
  result = None
  for tok in tokens:
    if tok in OPERATORS:
      stack.append((tok, []))
    elif tok == END:
      op, args = stack.pop()
      value = _apply(op, args)
      if stack:
        stack[-1][1].append(value)
      else:
        result = value
    elif tok in TOKEN_TO_ID and tok != PAD:
      if not stack:
        result = int(tok)
      else:
        stack[-1][1].append(int(tok))
    else:
      raise ValueError(f"Unknown token {tok!r}.")
  if stack or result is None:
    raise ValueError(f"Malformed expression: {' '.join(tokens)!r}.")
  return int(result)


def make_listops(
  n: int,
  seed: int,
  *,
  max_length: int = 128,
  min_length: int = 32,
  max_depth: int = 4,
  max_args: int = 10,
) -> dict[str, np.ndarray]:
  """n examples: inputs [n, max_length] int32, targets [n] int32, mask [n, max_length].

  Example:
    >>> from attnx import data
    >>> d = data.make_listops(4, seed=0, max_length=16, min_length=4)
    >>> {k: v.shape for k, v in d.items()}
    {'inputs': (4, 16), 'targets': (4,), 'mask': (4, 16)}
    >>> vocab = data.get_info("listops").extras["vocab"]
    >>> " ".join(vocab[t] for t in d["inputs"][0] if t), int(d["targets"][0])
    ('[MAX 1 7 0 6 8 5 4 ]', 8)
  """
  check_params(max_length, min_length, max_depth, max_args)
  rng = random.Random(int(seed))
  inputs = np.zeros((n, max_length), np.int32)
  targets = np.zeros((n,), np.int32)
  for i in range(n):
    tokens, value = generate_expression(
      rng, max_length=max_length, min_length=min_length, max_depth=max_depth, max_args=max_args
    )
    inputs[i, : len(tokens)] = [TOKEN_TO_ID[t] for t in tokens]
    targets[i] = value
  return {"inputs": inputs, "targets": targets, "mask": inputs != PAD_ID}


class Listops(AttnxBuilder):
  """ListOps (LRA rules, CPU-sized defaults)."""

  BUILDER_CONFIGS = [
    ListOpsConfig(name="default", description="Lengths 32-128, max_depth 4, max_args 10."),
    ListOpsConfig(
      name="tiny",
      description="Small and short, for tests.",
      max_length=32,
      min_length=6,
      max_depth=3,
      max_args=4,
      num_train=256,
      num_validation=64,
      num_test=64,
    ),
    ListOpsConfig(
      name="lra",
      description="LRA sizes (slow to generate on CPU).",
      max_length=2000,
      min_length=500,
      max_depth=10,
      max_args=10,
      num_train=96000,
      num_validation=2000,
      num_test=2000,
    ),
  ]
  HOMEPAGE = "https://github.com/google-research/long-range-arena"
  CITATION = "Tay et al. 2020, Long Range Arena: A Benchmark for Efficient Transformers."

  @classmethod
  def _features(cls, config):
    return {
      "inputs": int_tensor((config.max_length,)),
      "targets": tfds.features.Scalar(dtype=np.int32),
      "mask": bool_tensor((config.max_length,)),
    }

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    p = config.params()
    p.pop("seed")
    for k in ("num_train", "num_validation", "num_test"):
      p.pop(k)
    return make_listops(n, seed, **p)

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="listops",
      task="classification",
      input_shape=(config.max_length,),
      input_dtype="int32",
      num_classes=10,
      vocab_size=VOCAB_SIZE,
      target_vocab_size=None,
      seq_len=config.max_length,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={"vocab": list(VOCAB), "pad_id": PAD_ID, "params": config.params()},
    )
