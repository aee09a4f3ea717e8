"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology").

Each sequence of length seq_len starts with num_kv_pairs key-value pairs
k_1 v_1 k_2 v_2 ... as in Zoology's generator: keys distinct, drawn from
[1, vocab_size // 2), values distinct, drawn from [vocab_size // 2,
vocab_size) (both without replacement, so no two keys share a value); the rest
of the sequence holds num_queries queries: distinct keys from the context,
each at an even offset of the query region (a query slot is two positions),
uniform over the slots (query_power_a = 0) or, like Zoology, from the power law
p(gap) ∝ a·gap^(a−1) with a = query_power_a (Zoology: 0.01, which puts most
queries soon after the context). The other positions hold filler: random
tokens when random_non_queries (Zoology's default), else 0. Zoology also
requires vocab_size > seq_len (not enforced here: small test configs break it).

Targets follow Zoology's convention (its labels are shifted by one so that
position t predicts token t + 1): targets[t] is the value paired with the key
at inputs[t] when t is a query position, and IGNORE_INDEX (-100, from
attnx.constants) everywhere else. So the model must predict the value *at
the query position*. "mask" is targets != IGNORE_INDEX. Query positions are
uniform here (Zoology draws them from a power law).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from attnx.constants import IGNORE_INDEX
from attnx.data._base import (
  AttnxBuilder,
  AttnxConfig,
  DatasetInfo,
  bool_tensor,
  int_tensor,
)


@dataclasses.dataclass(eq=False)
class MQARConfig(AttnxConfig):
  """MQAR parameters (see the module docstring)."""

  vocab_size: int = 64
  seq_len: int = 64
  num_kv_pairs: int = 8
  num_queries: int = 8
  random_non_queries: bool = True
  query_power_a: float = 0.0
  num_train: int = 20000
  num_test: int = 1000

  def validate(self) -> None:
    check_params(self.vocab_size, self.seq_len, self.num_kv_pairs, self.num_queries,
                 self.query_power_a)


def check_params(vocab_size: int, seq_len: int, num_kv_pairs: int, num_queries: int,
                 query_power_a: float = 0.0) -> None:
  if num_kv_pairs < 1 or num_kv_pairs > vocab_size // 2 - 1:
    raise ValueError(f"Need 1 <= num_kv_pairs <= vocab_size // 2 - 1 = {vocab_size // 2 - 1}.")
  if not 0 <= query_power_a <= 1:
    raise ValueError(f"Need 0 <= query_power_a <= 1 (0: uniform), got {query_power_a}.")
  if not 1 <= num_queries <= num_kv_pairs:
    raise ValueError("Need 1 <= num_queries <= num_kv_pairs.")
  if seq_len < 2 * num_kv_pairs + 2 * num_queries:
    raise ValueError("Need seq_len >= 2 * num_kv_pairs + 2 * num_queries.")


def make_associative_recall(
  n: int,
  seed: int,
  *,
  vocab_size: int = 64,
  seq_len: int = 64,
  num_kv_pairs: int = 8,
  num_queries: int = 8,
  random_non_queries: bool = True,
  query_power_a: float = 0.0,
) -> dict[str, np.ndarray]:
  """MQAR examples: inputs/targets [n, seq_len] int32, mask [n, seq_len] bool."""
  check_params(vocab_size, seq_len, num_kv_pairs, num_queries, query_power_a)
  rng = np.random.default_rng(seed)
  half = vocab_size // 2
  # Distinct keys per example: the first num_kv_pairs of a random permutation.
  keys = np.argsort(rng.random((n, half - 1)), axis=1)[:, :num_kv_pairs] + 1
  values = np.argsort(rng.random((n, vocab_size - half)), axis=1)[:, :num_kv_pairs] + half
  context = 2 * num_kv_pairs
  num_slots = (seq_len - context) // 2
  inputs = np.zeros((n, seq_len), np.int64)
  if random_non_queries:
    inputs[:, context:] = rng.integers(0, vocab_size, size=(n, seq_len - context))
  inputs[:, 0:context:2] = keys
  inputs[:, 1:context:2] = values
  which = np.argsort(rng.random((n, num_kv_pairs)), axis=1)[:, :num_queries]
  slots = _query_slots(rng, n, num_slots, num_queries, query_power_a)
  pos = context + 2 * slots
  targets = np.full((n, seq_len), IGNORE_INDEX, np.int64)
  np.put_along_axis(inputs, pos, np.take_along_axis(keys, which, axis=1), axis=1)
  np.put_along_axis(targets, pos, np.take_along_axis(values, which, axis=1), axis=1)
  return {
    "inputs": inputs.astype(np.int32),
    "targets": targets.astype(np.int32),
    "mask": targets != IGNORE_INDEX,
  }


def _query_slots(rng: np.random.Generator, n: int, num_slots: int, num_queries: int,
                 power_a: float) -> np.ndarray:
  """[n, num_queries] distinct slots per example: uniform, or drawn without replacement with
  p(slot s) ∝ a·(s + 1)^(a − 1) (Zoology's power law; Gumbel top-k = sequential sampling
  without replacement)."""
  if power_a == 0:
    return np.argsort(rng.random((n, num_slots)), axis=1)[:, :num_queries]
  logp = np.log(power_a) + (power_a - 1) * np.log(np.arange(1, num_slots + 1))
  gumbel = -np.log(-np.log(rng.random((n, num_slots))))
  return np.argsort(-(logp + gumbel), axis=1)[:, :num_queries]


class AssociativeRecall(AttnxBuilder):
  """MQAR (Zoology)."""

  VERSION = tfds.core.Version("1.2.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {
    **AttnxBuilder.RELEASE_NOTES,
    "1.2.0": "Values drawn without replacement (distinct, as in Zoology); query_power_a.",
  }

  BUILDER_CONFIGS = [
    MQARConfig(name="default", description="64 tokens, 8 pairs, 8 queries."),
    MQARConfig(
      name="tiny",
      description="Small, for tests.",
      vocab_size=32,
      seq_len=32,
      num_kv_pairs=4,
      num_queries=4,
      num_train=256,
      num_test=64,
    ),
  ]
  HOMEPAGE = "https://github.com/HazyResearch/zoology"
  CITATION = "Arora et al. 2023, Zoology: Measuring and Improving Recall in Efficient LMs."

  @classmethod
  def _features(cls, config):
    return {
      "inputs": int_tensor((config.seq_len,)),
      "targets": int_tensor((config.seq_len,)),
      "mask": bool_tensor((config.seq_len,)),
    }

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    return make_associative_recall(
      n,
      seed,
      vocab_size=config.vocab_size,
      seq_len=config.seq_len,
      num_kv_pairs=config.num_kv_pairs,
      num_queries=config.num_queries,
      random_non_queries=config.random_non_queries,
      query_power_a=config.query_power_a,
    )

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="associative_recall",
      task="token_classification",
      input_shape=(config.seq_len,),
      input_dtype="int32",
      num_classes=config.vocab_size,
      vocab_size=config.vocab_size,
      target_vocab_size=None,
      seq_len=config.seq_len,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={"ignore_index": IGNORE_INDEX, "params": config.params()},
    )
