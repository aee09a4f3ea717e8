"""The logic of the GPT language model that the linen and the NNX model share.

:class:`attnx.nn.GPT` (linen) and :class:`attnx.nnx.GPT` (NNX) differ only in how they own
parameters and the KV cache. The configuration checks, the attention spec of each block and the
position rows are here, as functions of ``opts``: the linen model itself, or the NNX model's
``options`` (a dataclass of the linen model's fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict

from attnx import core
from attnx.core import problem as problem_lib
from attnx.nn.attention_ops import check_ring_attention, shard_positions
from attnx.nn.spec import resolve_attention

Array = jax.Array

POSITIONS = ("learned", "rotary", "alibi", "none")
# Attention types with query/key projections (rotary) and a KV cache (decode=True).
ROTARY_TYPES = CACHE_TYPES = ("dot", "metric")


def check_gpt(opts: Any, where: str) -> None:
  """ValueError (naming ``where``) for a GPT configuration that cannot be built; turns a list
  ``sliding_window`` into a tuple (hashable). Call when the model is made (the attention
  spec already validated and frozen)."""
  for name in ("vocab_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim", "max_len"):
    value = getattr(opts, name)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
      raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")
  if opts.positions not in POSITIONS:
    raise ValueError(f"{where}: positions must be one of {', '.join(POSITIONS)}, got "
                     f"{opts.positions!r}.")
  kind = resolve_attention(opts.attention)["type"]
  if isinstance(opts.sliding_window, list):  # hashable, as a linen field must be
    object.__setattr__(opts, "sliding_window", tuple(opts.sliding_window))
  windows = layer_windows(opts, where)  # checks the per-layer list
  uses = ([f"positions={opts.positions!r}"] if opts.positions == "alibi" else []) + [
      name for name, on in (("sliding_window", any(w is not None for w in windows)),
                            ("logits_soft_cap", opts.logits_soft_cap is not None),
                            ("sinks", opts.sinks)) if on]
  if uses and kind not in ROTARY_TYPES:
    raise ValueError(f"{where}: {', '.join(uses)} apply to attention types 'dot' and "
                     f"'metric' (MultiHeadAttention), not to {kind!r} ({opts.attention!r}).")
  if opts.sinks:
    reason = problem_lib.sinks_reason(core.get_weighting(
        resolve_attention(opts.attention).get("weighting", "softmax")))
    if reason is not None:
      raise ValueError(f"{where}: sinks=True: {reason}")
  if opts.logits_soft_cap is not None:
    core.soft_cap(opts.logits_soft_cap)  # the ValueError of a cap that is not positive
  if opts.positions == "rotary":
    if kind not in ROTARY_TYPES:
      raise ValueError(f"{where}: positions='rotary' rotates the query and key projections, "
                       f"which attention type {kind!r} ({opts.attention!r}) does not have; "
                       "use positions='learned' or an attention of type 'dot' or 'metric'.")
    if (opts.hidden_dim // opts.num_heads) % 2:
      raise ValueError(f"{where}: positions='rotary' needs an even head dim, got "
                       f"hidden_dim / num_heads = {opts.hidden_dim} / {opts.num_heads}.")
  if opts.sequence_axis is not None and kind not in ROTARY_TYPES:
    raise ValueError(f"{where}: sequence_axis (ring attention) applies to attention types "
                     f"'dot' and 'metric', not to {kind!r} ({opts.attention!r}).")
  if opts.sequence_axis is not None:
    spec = resolve_attention(opts.attention)
    check_ring_attention(spec.get("weighting", "softmax"),
                         "metric" if kind == "metric" else spec.get("score", "scaled_dot"),
                         opts.sequence_layout, f"{where}: sequence_axis={opts.sequence_axis!r}")
  if opts.implementation is not None and kind not in ROTARY_TYPES:
    raise ValueError(f"{where}: implementation={opts.implementation!r} applies to attention "
                     f"types 'dot' and 'metric', not to {kind!r} ({opts.attention!r}).")
  # Validates the full block specs (implementation + weighting) at construction.
  for layer in range(opts.num_layers):
    resolve_attention(block_attention(opts, layer))


def layer_windows(opts: Any, where: str = "GPT") -> tuple[int | None, ...]:
  """The sliding window of each layer (None: global attention)."""
  w = opts.sliding_window
  windows = (w,) * opts.num_layers if w is None or isinstance(w, int) else tuple(w)
  if len(windows) != opts.num_layers or any(
      x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0)
      for x in windows):
    raise ValueError(f"{where}: sliding_window must be an int >= 0, None, or "
                     f"one int-or-None per layer ({opts.num_layers}), got {w!r}.")
  return windows


def block_attention(opts: Any, layer: int = 0) -> dict[str, Any]:
  """The attention spec block ``layer`` gets: ``attention`` + positions + window, cap,
  sinks + ``implementation``."""
  spec = resolve_attention(opts.attention)
  if opts.positions == "rotary":
    spec.update(rotary=True, rotary_base=float(opts.rotary_base))
  if opts.positions == "alibi":
    spec["alibi"] = True
  window = layer_windows(opts)[layer]
  if window is not None:
    spec["sliding_window"] = window
  if opts.logits_soft_cap is not None:
    spec["logits_soft_cap"] = float(opts.logits_soft_cap)
  if opts.sinks:
    spec["sinks"] = True
  if getattr(opts, "cache_page_size", None) is not None:
    spec["cache_page_size"] = int(opts.cache_page_size)
  if opts.implementation is not None:
    spec["implementation"] = opts.implementation
  if opts.sequence_axis is not None:
    spec.update(sequence_axis=opts.sequence_axis, sequence_layout=opts.sequence_layout)
  return spec


def supports_kv_cache(opts: Any) -> bool:
  """Whether ``decode=True`` works (attention types ``"dot"`` and ``"metric"``)."""
  return resolve_attention(opts.attention)["type"] in CACHE_TYPES


def check_call(opts: Any, tokens: Array, positions: Array | None, segment_ids: Any,
               decode: bool, shards: int | None) -> Array | None:
  """The checks of a call on ``tokens [B, T]``; returns ``positions`` as an array (or None)."""
  chex.assert_rank(tokens, 2)
  if (segment_ids is not None or positions is not None) and decode:
    raise ValueError("GPT: segment_ids and positions are for training and evaluation on "
                     "packed rows, not for decode=True.")
  if positions is not None:
    positions = jnp.asarray(positions)
    if positions.shape != tokens.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"GPT: positions must be int [B, T] = {tokens.shape}, got "
                       f"{positions.shape} {positions.dtype}.")
  length_all = tokens.shape[1] * (shards or 1)
  if opts.positions == "learned" and length_all > opts.max_len:
    raise ValueError(f"GPT: sequence length {length_all} exceeds max_len={opts.max_len} of the "
                     "learned position embedding (positions='learned' cannot evaluate "
                     "longer contexts; use positions='rotary').")
  return positions


def add_learned_positions(opts: Any, x: Array, table: Array, *, start: Any,
                          positions: Array | None, shards: int | None) -> Array:
  """``x [B, T, D]`` plus the rows of the learned ``pos_embedding`` table its tokens sit at:
  from ``start`` when decoding, ``positions`` when given, the global positions of a sharded
  sequence, else 0 … T − 1."""
  length = x.shape[1]
  if start is not None:
    pos = jax.lax.dynamic_slice_in_dim(table, start, length)
  elif positions is not None:
    pos = table[positions]
  elif shards is not None:
    pos = table[shard_positions(length, opts.sequence_axis, opts.sequence_layout)]
  else:
    pos = table[:length]
  return x + (pos.astype(x.dtype) if pos.ndim == 3 else pos.astype(x.dtype)[None])


# The constructor kwargs a model file (attnx.nn.save_model_spec) records.
SPEC_FIELDS = ("vocab_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim", "max_len",
               "attention", "tie_embeddings", "positions", "rotary_base", "sliding_window",
               "logits_soft_cap", "sinks", "dropout_rate", "attention_dropout_rate",
               "implementation", "dtype", "param_dtype")


def plain(value: Any) -> Any:
  """``value`` with FrozenDicts, tuples and numpy scalars turned into JSON's types."""
  if isinstance(value, FrozenDict | Mapping):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, tuple | list):
    return [plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


def model_kwargs(opts: Any) -> dict[str, Any]:
  """The JSON-able constructor kwargs of a GPT's options (dtypes as names)."""
  out = {}
  for name in SPEC_FIELDS:
    value = getattr(opts, name)
    if name in ("dtype", "param_dtype") and value is not None:
      value = jnp.dtype(value).name
    out[name] = plain(value)
  return out


def kwargs_from_spec(spec: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
  """The GPT constructor kwargs of a model file's dict (or of bare kwargs), with overrides."""
  kwargs = dict(spec["model"] if "model" in spec else spec)
  kwargs.update(overrides)
  for name in ("dtype", "param_dtype"):
    if isinstance(kwargs.get(name), str):
      kwargs[name] = jnp.dtype(kwargs[name])
  return kwargs
