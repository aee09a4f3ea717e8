"""Small shared helpers for attnx.nn modules (validation, masks).

Dropout on the weights and the weighted sum of values are ``core.attention``'s, not here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from attnx import core

Array = jax.Array


def score_name(score: Any) -> str | None:
  """The registry name of a score spec (None for a user callable)."""
  if isinstance(score, str):
    return score.partition(":")[0]
  if isinstance(score, core.Score):
    return score.name
  return None


def implementation_name(implementation: Any) -> str | None:
  """The name of an implementation given as a name or an object (None: automatic)."""
  return None if implementation is None else core.get_implementation(implementation).name


def validate_attention_config(weighting: Any, score: Any, implementation: Any,
                              where: str) -> None:
  """Raises a clear ValueError, prefixed by ``where``, for an unknown or incompatible
  weighting/score/implementation (:func:`attnx.core.check_compatible`): e.g. a distance
  kernel such as ``gaussian`` on a similarity score such as ``scaled_dot`` or ``additive``.
  """
  try:
    core.check_compatible(weighting, score, implementation)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def check_dropout_rate(rate: float, where: str) -> None:
  """Dropout keeps 1 − rate of the weights and rescales by 1/(1 − rate): rate must be in [0, 1)."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"{where}: dropout_rate must be in [0, 1), got {rate}.")


def check_heads(features: int, num_heads: int, num_kv_heads: int | None, where: str) -> None:
  """Heads must divide the features and kv heads must divide the query heads."""
  if num_heads <= 0:
    raise ValueError(f"{where}: num_heads must be positive, got {num_heads}.")
  if features % num_heads:
    raise ValueError(f"{where}: qkv_features={features} is not divisible by "
                     f"num_heads={num_heads}.")
  if num_kv_heads is not None and (num_kv_heads <= 0 or num_heads % num_kv_heads):
    raise ValueError(f"{where}: num_heads={num_heads} must be a multiple of "
                     f"num_kv_heads={num_kv_heads}.")


def as_bool_mask(mask: Array | None) -> Array | None:
  """Flax builds float 0/1 masks (``nn.make_attention_mask``); core wants booleans."""
  return None if mask is None else jnp.asarray(mask).astype(jnp.bool_)


def check_no_decode(decode: bool, where: str) -> None:
  """Every attention module takes ``decode``; only MultiHeadAttention keeps a KV cache."""
  if decode:
    raise ValueError(f"{where}: decode=True (KV-cache decoding) needs MultiHeadAttention "
                     "(attention type 'dot' or 'metric').")


def options_dataclass(module_cls: type, name: str) -> type:
  """A frozen, keyword-only dataclass with the fields (and defaults) of linen module class
  ``module_cls`` but linen's ``parent`` and ``name``: the options an NNX twin of the module
  keeps, read by the functions the two share, declared once (by the linen module)."""
  fields = [(f.name, f.type, dataclasses.field(default=f.default)
             if f.default is not dataclasses.MISSING else dataclasses.field())
            for f in dataclasses.fields(module_cls) if f.name not in ("parent", "name")]
  return dataclasses.make_dataclass(name, fields, frozen=True, kw_only=True)
