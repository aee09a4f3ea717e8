"""Key chunks held side by side: their merge, and the state of a sink.

Split-KV decoding cuts a row's keys into C chunks whose states are computed at once, the chunks
an axis of the state's leaves; :func:`fold` merges them along that axis with the family's merge
(in key order, or from the last chunk for a ``reverse`` family). A sink is one virtual key of
the row with zero value: :func:`pointwise_sink` and :func:`row_sink` give its state, merged
once. Used by :mod:`attnx.core.kernels.xla.decode` (XLA) and :mod:`attnx.core.kernels.pallas.split`
(the Pallas kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core.streaming.rowstream import RowStream, init, update

Array = jax.Array

__all__ = ["fold", "pointwise_sink", "row_sink"]


def fold(merge: Callable[[Any, Any], Any], state: Any, axis: int, reverse: bool = False) -> Any:
  """The merge of the chunk states along ``axis`` of every leaf of ``state`` (``reverse``:
  the later chunk first, as a reverse family's merge takes it)."""
  c = jax.tree.leaves(state)[0].shape[axis]
  part = lambda i: jax.tree.map(lambda a: lax.index_in_dim(a, i, axis, keepdims=False), state)
  acc = None
  for i in (range(c - 1, -1, -1) if reverse else range(c)):
    acc = part(i) if acc is None else merge(acc, part(i))
  return acc


def pointwise_sink(w: Any, z: Array, hv: int, num_keys: int) -> tuple[Array, Array]:
  """The raw state (XLA's layout: Σ F in acc's last column) of rows whose one key is a sink of
  score ``z`` [rows] and zero value, for a pointwise F with a sum (F reads ``num_keys``)."""
  rows, cd = z.shape, z.dtype
  if w.online_max:
    ex = w.alpha * z if w.log_f is None else w.log_f.fn(z)
    return jnp.concatenate([jnp.zeros(rows + (hv,), cd), jnp.ones(rows + (1,), cd)], -1), ex
  return (jnp.concatenate([jnp.zeros(rows + (hv,), cd), w.fn(z, num_keys)[..., None]], -1),
          jnp.zeros(rows, cd))


def row_sink(rs: RowStream, z: Array, hv: int, ctx: Any) -> Any:
  """The state of rows whose one key is a sink of score ``z`` [rows, 1] and zero value, for a
  whole-row family (``ctx`` its per-row constants, SSMax's scale)."""
  rows = z.shape[:-1]
  return update(rs, init(rs, rows, hv, z.dtype), z, jnp.ones(z.shape, bool),
                jnp.zeros(rows[:-1] + (1, hv), z.dtype), ctx)
