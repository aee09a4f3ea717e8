"""Structured attention masks: which keys each query may attend, as an object, not a T×S array.

A :class:`Mask` answers the question "may query i of batch b, head h attend key j?" in two
forms that every implementation of :func:`attnx.core.attention` reads:

* elementwise, :meth:`Mask.mask_mod` ``(b, h, q_idx, kv_idx) -> bool`` on broadcasting index
  arrays (FlexAttention's ``mask_mod``): the dense implementation evaluates it on the whole
  [T, S] grid (:func:`materialize`), a streaming kernel on one tile at a time;
* per tile, :meth:`Mask.tile_range`: for a rectangle of queries [q0, q1) × keys [k0, k1),
  whether some pair may attend (else the kernel skips the tile) and whether every pair does
  (else it needs the elementwise mask), from analytic bounds or per-tile minima and maxima
  (JAX's splash attention keeps the same mask-to-block metadata apart from its kernel).

The masks (all with top-left aligned positions: query i and key j are positions i and j):

* :func:`causal` — j ≤ i;
* :func:`sliding_window` ``(left, right)`` — i − left ≤ j ≤ i + right
  (``jax.nn.dot_product_attention``'s ``local_window_size``);
* :func:`chunked_causal` ``(c)`` — j ≤ i within chunks of c positions (⌊j/c⌋ = ⌊i/c⌋; Llama 4's
  local layers);
* :func:`prefix_lm` ``(p)`` — every key of the prefix [0, p_b) and keys up to the query itself;
* :func:`segment_ids` ``(q_ids, kv_ids)`` — equal, non-negative document ids (packed
  documents; a negative id is padding: it attends nothing and nothing attends it);
* :func:`seq_lengths` ``(q_lengths, kv_lengths)`` — i < Lq_b and j < Lkv_b (padded batches:
  ``jax.nn``'s ``query_seq_lengths`` / ``key_value_seq_lengths``);
* :func:`from_fn` ``(mask_mod)`` — any ``mask_mod(b, h, q_idx, kv_idx) -> bool``;
* ``a & b``, ``a | b`` — intersection and union.

A mask is a pytree: its arrays (lengths, ids) are leaves that ``jit``, ``vmap`` and ``grad``
trace; its sizes (window, chunk) are static. Per-batch arrays have the call's batch dims
first (``[batch...]`` for lengths, ``[batch..., T]`` for ids), 1 where they broadcast.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

# from_fn's tile metadata evaluates its mask_mod on at most this many pairs at a time.
_TABLE_BUDGET = 1 << 22

__all__ = ["And", "Causal", "ChunkedCausal", "FromFn", "Mask", "Or", "PrefixLM", "SegmentIds",
           "SeqLengths", "SlidingWindow", "causal", "chunked_causal", "combine", "from_fn",
           "from_jax_nn", "materialize", "prefix_lm", "segment_ids", "seq_lengths",
           "sliding_window"]


class Mask(abc.ABC):
  """Which keys each query may attend: :meth:`mask_mod` elementwise, :meth:`tile_range` per
  tile. The masks are frozen dataclasses registered as pytrees (arrays as leaves, sizes as
  static fields); combine them with ``&`` and ``|``."""

  @abc.abstractmethod
  def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Array:
    """Whether query ``q_idx`` may attend key ``kv_idx`` in (flat) batch ``b``, head ``h``:
    boolean, broadcast over the integer index arrays (which broadcast against each other)."""

  @abc.abstractmethod
  def tile_range(self, q0: Any, bq: int, k0: Any, bk: int) -> tuple[Array, Array]:
    """``(some, every)`` for the tile of queries [q0, q0 + bq) and keys [k0, k0 + bk): whether
    some pair of it may attend (False: a kernel may skip the tile) and whether every pair may
    (True: a kernel needs no elementwise mask there), as booleans broadcastable to ``[B, N]``
    (flat batch, heads). ``some`` may be True for a tile without a valid pair (that only
    costs work); ``every`` is exact or False."""

  def block_table(self, bq: int, bk: int, nq: int, nk: int) -> tuple[Array, Array]:
    """:meth:`tile_range` of every tile of a grid — tile (i, j) holds the queries
    [i·bq, (i + 1)·bq) and the keys [j·bk, (j + 1)·bk) — as ``(some, every)`` boolean arrays
    ``[B or 1, N or 1, nq, nk]``: the mask-to-block metadata a streaming kernel reads before
    it runs (O(nq·nk) memory, never T×S)."""
    ranges = jax.vmap(jax.vmap(lambda q0, k0: self.tile_range(q0, bq, k0, bk), (None, 0)),
                      (0, None))(jnp.arange(nq) * bq, jnp.arange(nk) * bk)
    return tuple(_grid_last(x) for x in ranges)

  def bind(self, batch: tuple[int, ...], n: int, t: int, s: int) -> Mask:
    """This mask checked against a call (batch dims, N heads, T queries, S keys), its
    per-batch arrays flattened to one batch axis (the ``b`` of :meth:`mask_mod`)."""
    del batch, n, t, s
    return self

  def sequence_keys(self, t: int, s: int) -> Array | None:
    """On a bound mask: how many keys the sequence of each query holds, ``[B or 1, T]`` int32,
    where the mask splits a row into sequences — packed documents (:func:`segment_ids`: the
    keys with the query's id; 0 for a padding query), padded lengths (:func:`seq_lengths`:
    the row's key length; 0 for a query past its length) — or None where it does not (every
    query's sequence is all S keys). Position masks (causal, windows, chunks, prefixes,
    ``mask_mod``) keep the sequence: a causal query of a 100-key document is in a sequence
    of 100 keys although it attends fewer. ``&`` takes the smaller count of two, ``|`` the
    larger. The "n" of a weighting whose formula counts a sequence's keys (sigmoid's
    b = −log n)."""
    del t, s
    return None

  def leaf_kinds(self) -> tuple[str, ...]:
    """What each array leaf of a bound mask holds, in pytree order: ``"batch"`` (one value per
    flat batch, ``[B or 1]``), ``"q"`` (one per query position, ``[B or 1, T]``) or ``"kv"``
    (one per key position, ``[B or 1, S]``). A fused kernel loads them per tile
    (:meth:`local_mod`)."""
    return ()

  def local_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Array:
    """:meth:`mask_mod` on a mask whose array leaves were replaced by their values at one tile
    (see :meth:`leaf_kinds`): a ``"batch"`` leaf by its scalar at ``b``, a ``"q"`` leaf by its
    values at the tile's query positions (a column, broadcasting against ``q_idx``), a ``"kv"``
    leaf by those at its key positions (a row). How a fused kernel evaluates a mask without
    gathers. Masks without array leaves evaluate :meth:`mask_mod` itself."""
    return self.mask_mod(b, h, q_idx, kv_idx)

  def __and__(self, other: Mask) -> Mask:
    return And(self, _as_mask(other, "&"))

  def __or__(self, other: Mask) -> Mask:
    return Or(self, _as_mask(other, "|"))


def _grid_last(x: Array) -> Array:
  """[nq, nk, *(broadcastable to [B, N])] -> [B|1, N|1, nq, nk]."""
  x = jnp.asarray(x)
  extra = x.shape[2:]
  x = x.reshape(x.shape[:2] + (1,) * (2 - len(extra)) + extra)
  return jnp.moveaxis(x, (0, 1), (2, 3))


def _as_mask(x: Any, op: str) -> Mask:
  if not isinstance(x, Mask):
    raise TypeError(f"a mask combines with {op} only with another attnx.core.masks.Mask, got "
                    f"{type(x).__name__} (a boolean array goes to attention's mask= as is).")
  return x


def _pytree(*data: str):
  """Registers a frozen dataclass as a pytree whose fields ``data`` are leaves."""
  def wrap(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    meta = [f.name for f in dataclasses.fields(cls) if f.name not in data]
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=meta)
  return wrap


def _size(name: str, value: Any, low: int = 0) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  return int(value)


def _last(q0: Any, size: int) -> Any:
  return q0 + (size - 1)


# ---------------------------------------------------------------------------------------------
# Position masks (static sizes).
# ---------------------------------------------------------------------------------------------

@_pytree()
class Causal(Mask):
  """j ≤ i (top-left aligned, as ``jax.nn`` and ``is_causal``)."""

  def mask_mod(self, b, h, q_idx, kv_idx):
    del b, h
    return kv_idx <= q_idx

  def tile_range(self, q0, bq, k0, bk):
    return k0 <= _last(q0, bq), _last(k0, bk) <= q0


@_pytree()
class SlidingWindow(Mask):
  """i − left ≤ j ≤ i + right (``jax.nn.dot_product_attention``'s ``local_window_size``)."""

  left: int
  right: int

  def __post_init__(self):
    object.__setattr__(self, "left", _size("sliding_window's left", self.left))
    object.__setattr__(self, "right", _size("sliding_window's right", self.right))

  def mask_mod(self, b, h, q_idx, kv_idx):
    del b, h
    return (kv_idx >= q_idx - self.left) & (kv_idx <= q_idx + self.right)

  def tile_range(self, q0, bq, k0, bk):
    some = (_last(k0, bk) >= q0 - self.left) & (k0 <= _last(q0, bq) + self.right)
    every = (k0 >= _last(q0, bq) - self.left) & (_last(k0, bk) <= q0 + self.right)
    return some, every


@_pytree()
class ChunkedCausal(Mask):
  """j ≤ i within chunks of ``chunk_size`` positions: ⌊j/c⌋ = ⌊i/c⌋ (Llama 4)."""

  chunk_size: int

  def __post_init__(self):
    object.__setattr__(self, "chunk_size", _size("chunk_size", self.chunk_size, low=1))

  def mask_mod(self, b, h, q_idx, kv_idx):
    del b, h
    c = self.chunk_size
    return (kv_idx <= q_idx) & (kv_idx // c == q_idx // c)

  def tile_range(self, q0, bq, k0, bk):
    c = self.chunk_size
    some = (k0 <= _last(q0, bq)) & (_last(k0, bk) // c >= q0 // c)
    one_chunk = (k0 // c == _last(q0, bq) // c) & (_last(k0, bk) // c == k0 // c)
    return some, (_last(k0, bk) <= q0) & one_chunk


# ---------------------------------------------------------------------------------------------
# Per-batch masks (arrays: pytree leaves).
# ---------------------------------------------------------------------------------------------

def _int_array(name: str, x: Any) -> Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}.")
  return x


def _flat_batch(name: str, x: Array | None, batch: tuple[int, ...], trailing: int) -> Array | None:
  """``x`` of shape ``[batch..., *trailing dims]`` (1 where it broadcasts over a batch dim) as
  ``[B or 1, *trailing dims]``."""
  if x is None:
    return None
  lead = x.shape[:x.ndim - trailing]
  if len(lead) != len(batch) or any(d not in (1, b) for d, b in zip(lead, batch, strict=True)):
    raise ValueError(f"{name} of shape {x.shape} does not fit the call: its leading dims must "
                     f"be the batch dims {batch} (1 where they broadcast), followed by "
                     f"{trailing} more.")
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(lead):])
  x = jnp.broadcast_to(x, batch + x.shape[len(lead):])
  return x.reshape((math.prod(batch),) + x.shape[len(lead):])  # explicit: S may be 0


def _per_batch(x: Array, b: Any) -> Array:
  """x[b] for a flat batch index ``b`` (x's batch axis may be 1: broadcast)."""
  return x[0] if x.shape[0] == 1 else x[b]


def _ids_at(ids: Array, b: Any, idx: Any) -> Array:
  """ids[b, idx] of ids ``[B or 1, L]`` at clamped positions (a kernel's padded positions read
  the last id; the kernel masks them itself)."""
  idx = jnp.clip(idx, 0, ids.shape[1] - 1)
  return ids[0][idx] if ids.shape[0] == 1 else ids[b, idx]


def _check_at_most(name: str, x: Array, limit: int) -> None:
  """Values of a concrete ``x`` in [0, limit] (a traced one is trusted)."""
  try:
    values = np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return
  if values.size and (values.min() < 0 or values.max() > limit):
    raise ValueError(f"{name} must be in [0, {limit}], got values in "
                     f"[{values.min()}, {values.max()}].")


@_pytree("q_lengths", "kv_lengths")
class SeqLengths(Mask):
  """i < Lq_b and j < Lkv_b: padded batches (``jax.nn``'s ``query_seq_lengths`` and
  ``key_value_seq_lengths``). Either may be None (no limit)."""

  q_lengths: Array | None = None
  kv_lengths: Array | None = None

  def bind(self, batch, n, t, s):
    del n
    out = {}
    for name, x, limit in (("q_lengths", self.q_lengths, t), ("kv_lengths", self.kv_lengths, s)):
      if x is not None:
        x = _int_array(f"seq_lengths' {name}", x)
        _check_at_most(f"seq_lengths' {name}", x, limit)
      out[name] = _flat_batch(f"seq_lengths' {name}", x, batch, 0)
    return SeqLengths(**out)

  def sequence_keys(self, t, s):
    if self.q_lengths is None and self.kv_lengths is None:
      return None
    b = _batch_len(self.q_lengths, self.kv_lengths)
    n = jnp.full((b, t), s, jnp.int32)
    if self.kv_lengths is not None:
      n = jnp.broadcast_to(self.kv_lengths[:, None], (b, t)).astype(jnp.int32)
    if self.q_lengths is not None:
      n = jnp.where(jnp.arange(t) < self.q_lengths[:, None], n, 0)
    return n

  def _lengths(self, b):
    lq = None if self.q_lengths is None else _per_batch(self.q_lengths, b)
    lk = None if self.kv_lengths is None else _per_batch(self.kv_lengths, b)
    return lq, lk

  def leaf_kinds(self):
    return ("batch",) * ((self.q_lengths is not None) + (self.kv_lengths is not None))

  def mask_mod(self, b, h, q_idx, kv_idx):
    del h
    return self._within(self._lengths(b), q_idx, kv_idx)

  def local_mod(self, b, h, q_idx, kv_idx):
    del b, h
    return self._within((self.q_lengths, self.kv_lengths), q_idx, kv_idx)

  @staticmethod
  def _within(lengths, q_idx, kv_idx):
    lq, lk = lengths  # seq_lengths has at least one (no constant True: kernels trace this)
    ok = [c for c in (None if lq is None else q_idx < lq, None if lk is None else kv_idx < lk)
          if c is not None]
    return ok[0] & ok[1] if len(ok) == 2 else ok[0]

  def tile_range(self, q0, bq, k0, bk):
    b = jnp.arange(_batch_len(self.q_lengths, self.kv_lengths))[:, None]
    lq, lk = self._lengths(b)
    some = every = jnp.asarray(True)
    if lq is not None:
      some, every = some & (q0 < lq), every & (_last(q0, bq) < lq)
    if lk is not None:
      some, every = some & (k0 < lk), every & (_last(k0, bk) < lk)
    return some, every


def _batch_len(*xs: Array | None) -> int:
  return max([x.shape[0] for x in xs if x is not None] or [1])


@_pytree("prefix_lengths")
class PrefixLM(Mask):
  """Prefix-LM: a query attends every key of its row's prefix [0, p_b) and the keys up to
  itself (j < p_b or j ≤ i); ``prefix_lengths`` ``[batch...]`` (or a scalar)."""

  prefix_lengths: Array

  def bind(self, batch, n, t, s):
    del n, t
    p = _int_array("prefix_lm's prefix_lengths", self.prefix_lengths)
    _check_at_most("prefix_lm's prefix_lengths", p, s)
    if p.ndim == 0:
      p = p.reshape((1,) * len(batch))
    return PrefixLM(_flat_batch("prefix_lm's prefix_lengths", p, batch, 0))

  def leaf_kinds(self):
    return ("batch",)

  def mask_mod(self, b, h, q_idx, kv_idx):
    p = self.prefix_lengths
    return self._local(p if p.ndim == 0 else _per_batch(p, b), q_idx, kv_idx)

  def local_mod(self, b, h, q_idx, kv_idx):
    return self._local(self.prefix_lengths, q_idx, kv_idx)

  @staticmethod
  def _local(p, q_idx, kv_idx):
    return (kv_idx < p) | (kv_idx <= q_idx)

  def tile_range(self, q0, bq, k0, bk):
    p = self.prefix_lengths
    p = p if p.ndim == 0 else p[:, None]
    return (k0 < p) | (k0 <= _last(q0, bq)), (_last(k0, bk) < p) | (_last(k0, bk) <= q0)


@_pytree("q_ids", "kv_ids")
class SegmentIds(Mask):
  """Packed documents: query i attends key j only where their ids are equal and not negative
  (a negative id is padding). ``q_ids`` ``[batch..., T]``, ``kv_ids`` ``[batch..., S]``."""

  q_ids: Array
  kv_ids: Array

  def bind(self, batch, n, t, s):
    del n
    q = _int_array("segment_ids' q_ids", self.q_ids)
    k = _int_array("segment_ids' kv_ids", self.kv_ids)
    if q.shape[-1:] != (t,) or k.shape[-1:] != (s,):
      raise ValueError(f"segment ids must be [batch..., T] and [batch..., S] = [..., {t}] and "
                       f"[..., {s}]; got {q.shape} and {k.shape}.")
    return SegmentIds(_flat_batch("segment_ids' q_ids", q, batch, 1),
                      _flat_batch("segment_ids' kv_ids", k, batch, 1))

  def leaf_kinds(self):
    return ("q", "kv")

  def mask_mod(self, b, h, q_idx, kv_idx):
    del h
    qv, kv = _ids_at(self.q_ids, b, q_idx), _ids_at(self.kv_ids, b, kv_idx)
    return (qv == kv) & (qv >= 0)

  def local_mod(self, b, h, q_idx, kv_idx):
    del b, h, q_idx, kv_idx
    return (self.q_ids == self.kv_ids) & (self.q_ids >= 0)

  def tile_range(self, q0, bq, k0, bk):
    # [B|1, bq] and [B|1, bk] (one row of ids broadcasts over the batch).
    qs = _ids_at(self.q_ids, jnp.arange(self.q_ids.shape[0])[:, None],
                 q0 + jnp.arange(bq)).reshape(-1, bq)
    ks = _ids_at(self.kv_ids, jnp.arange(self.kv_ids.shape[0])[:, None],
                 k0 + jnp.arange(bk)).reshape(-1, bk)
    qlo, qhi = qs.min(axis=1)[:, None], qs.max(axis=1)[:, None]
    klo, khi = ks.min(axis=1)[:, None], ks.max(axis=1)[:, None]
    some = (qhi >= 0) & (khi >= 0) & (qlo <= khi) & (klo <= qhi)
    every = (qlo == qhi) & (klo == khi) & (qlo == klo) & (qlo >= 0)
    return some, every

  def sequence_keys(self, t, s):
    # The keys of each id, counted on the sorted key ids: O((T + S) log S), no T×S array.
    b = max(self.q_ids.shape[0], self.kv_ids.shape[0])
    q_ids = jnp.broadcast_to(self.q_ids, (b, t))
    kv_sorted = jnp.sort(jnp.broadcast_to(self.kv_ids, (b, s)), axis=1)
    count = jax.vmap(lambda keys, ids: jnp.searchsorted(keys, ids, side="right")
                     - jnp.searchsorted(keys, ids, side="left"))(kv_sorted, q_ids)
    return jnp.where(q_ids >= 0, count, 0).astype(jnp.int32)

  def block_table(self, bq, bk, nq, nk):
    # Per-block minima and maxima of the ids, once: O(T + S), not a gather per tile.
    def stats(ids, size, n):
      pos = jnp.minimum(jnp.arange(n * size), ids.shape[1] - 1)
      blocks = ids[:, pos].reshape(ids.shape[0], n, size)
      return blocks.min(axis=2), blocks.max(axis=2)
    (qlo, qhi), (klo, khi) = stats(self.q_ids, bq, nq), stats(self.kv_ids, bk, nk)
    qlo, qhi = qlo[:, None, :, None], qhi[:, None, :, None]
    klo, khi = klo[:, None, None, :], khi[:, None, None, :]
    some = (qhi >= 0) & (khi >= 0) & (qlo <= khi) & (klo <= qhi)
    every = (qlo == qhi) & (klo == khi) & (qlo == klo) & (qlo >= 0)
    return some, every


# ---------------------------------------------------------------------------------------------
# Any mask_mod, and combinations.
# ---------------------------------------------------------------------------------------------

@_pytree()
class FromFn(Mask):
  """Any ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's form; ``b`` is the flat
  batch index, ``h`` the query head). Evaluated per tile, never materialized by a streaming
  kernel; its tile ranges come from evaluating it on the tile."""

  fn: Callable[..., Any]
  batch_size: int = 1
  num_heads: int = 1

  def bind(self, batch, n, t, s):
    bf = math.prod(batch)
    out = jax.eval_shape(self.fn, *(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in
                                    ((bf, 1, 1, 1), (1, n, 1, 1), (1, 1, t, 1), (1, 1, 1, s))))
    if getattr(out, "dtype", None) != jnp.bool_:
      raise ValueError(f"from_fn's mask_mod must return booleans, got "
                       f"{getattr(out, 'dtype', type(out).__name__)}.")
    try:
      jnp.broadcast_shapes(out.shape, (bf, n, t, s))
    except ValueError:
      raise ValueError(f"from_fn's mask_mod returned shape {out.shape}, which does not "
                       f"broadcast with its index arrays' [{bf}, {n}, {t}, {s}].") from None
    return dataclasses.replace(self, batch_size=bf, num_heads=n)

  def mask_mod(self, b, h, q_idx, kv_idx):
    return self.fn(b, h, q_idx, kv_idx)

  def tile_range(self, q0, bq, k0, bk):
    b = jnp.arange(self.batch_size)[:, None, None, None]
    h = jnp.arange(self.num_heads)[None, :, None, None]
    m = jnp.broadcast_to(self.fn(b, h, (q0 + jnp.arange(bq))[:, None], k0 + jnp.arange(bk)),
                         (self.batch_size, self.num_heads, bq, bk))
    return jnp.any(m, axis=(-2, -1)), jnp.all(m, axis=(-2, -1))

  def block_table(self, bq, bk, nq, nk):
    # The tiles in batches of at most _TABLE_BUDGET evaluated pairs: every tile's mask at once
    # would be the whole [B, N, T, S] array.
    per_tile = self.batch_size * self.num_heads * bq * bk
    batch = max(1, min(nq * nk, _TABLE_BUDGET // max(per_tile, 1)))
    q0 = jnp.repeat(jnp.arange(nq) * bq, nk)
    k0 = jnp.tile(jnp.arange(nk) * bk, nq)
    ranges = lax.map(lambda x: self.tile_range(x[0], bq, x[1], bk), (q0, k0), batch_size=batch)
    return tuple(_grid_last(x.reshape((nq, nk) + x.shape[1:])) for x in ranges)


class _Pair(Mask):
  """Two masks combined pair by pair with :attr:`op` (``&`` or ``|``), and so are their tile
  metadata (for ``|``, "every" of either side is "every" of the union: still exact or False)."""

  a: Mask
  b: Mask
  op: Callable[[Any, Any], Array]  # the subclass': jnp.logical_and or jnp.logical_or
  count_op: Callable[[Any, Any], Array]  # of two sequence_keys: jnp.minimum or jnp.maximum

  def bind(self, batch, n, t, s):
    return type(self)(self.a.bind(batch, n, t, s), self.b.bind(batch, n, t, s))

  def mask_mod(self, b, h, q_idx, kv_idx):
    return self.op(self.a.mask_mod(b, h, q_idx, kv_idx), self.b.mask_mod(b, h, q_idx, kv_idx))

  def leaf_kinds(self):
    return self.a.leaf_kinds() + self.b.leaf_kinds()

  def local_mod(self, b, h, q_idx, kv_idx):
    return self.op(self.a.local_mod(b, h, q_idx, kv_idx), self.b.local_mod(b, h, q_idx, kv_idx))

  def tile_range(self, q0, bq, k0, bk):
    (sa, ea), (sb, eb) = self.a.tile_range(q0, bq, k0, bk), self.b.tile_range(q0, bq, k0, bk)
    return self.op(sa, sb), self.op(ea, eb)

  def block_table(self, bq, bk, nq, nk):
    (sa, ea), (sb, eb) = self.a.block_table(bq, bk, nq, nk), self.b.block_table(bq, bk, nq, nk)
    return self.op(sa, sb), self.op(ea, eb)

  def sequence_keys(self, t, s):
    na, nb = self.a.sequence_keys(t, s), self.b.sequence_keys(t, s)
    if na is None or nb is None:
      return nb if na is None else na
    return self.count_op(na, nb)


@_pytree("a", "b")
class And(_Pair):
  """Both masks: a pair may attend where ``a`` and ``b`` allow it."""

  a: Mask
  b: Mask
  op = staticmethod(jnp.logical_and)
  count_op = staticmethod(jnp.minimum)


@_pytree("a", "b")
class Or(_Pair):
  """Either mask: a pair may attend where ``a`` or ``b`` allows it."""

  a: Mask
  b: Mask
  op = staticmethod(jnp.logical_or)
  count_op = staticmethod(jnp.maximum)


# ---------------------------------------------------------------------------------------------
# Constructors, materialization, jax.nn's keywords.
# ---------------------------------------------------------------------------------------------

def causal() -> Causal:
  """Key j ≤ query i (the same as ``is_causal=True``)."""
  return Causal()


def sliding_window(left: int, right: int) -> SlidingWindow:
  """Query i attends keys i − ``left`` ≤ j ≤ i + ``right``: ``jax.nn``'s
  ``local_window_size=(left, right)``; ``sliding_window(w, 0)`` is a causal window of w + 1
  keys (with ``is_causal`` or :func:`causal` the right side is 0 anyway)."""
  return SlidingWindow(left, right)


def chunked_causal(chunk_size: int) -> ChunkedCausal:
  """Causal within chunks of ``chunk_size`` positions: j ≤ i and ⌊j/c⌋ = ⌊i/c⌋."""
  return ChunkedCausal(chunk_size)


def prefix_lm(prefix_lengths: Any) -> PrefixLM:
  """A bidirectional prefix of ``prefix_lengths`` keys (``[batch...]`` or a scalar), causal
  after it: j < p_b or j ≤ i."""
  return PrefixLM(prefix_lengths)


def segment_ids(q_ids: Any, kv_ids: Any = None) -> SegmentIds:
  """Packed documents: ``q_ids`` ``[batch..., T]`` and ``kv_ids`` ``[batch..., S]`` (None: the
  same as ``q_ids``, self-attention); a pair may attend where the ids are equal and ≥ 0."""
  return SegmentIds(q_ids, q_ids if kv_ids is None else kv_ids)


def seq_lengths(q_lengths: Any = None, kv_lengths: Any = None) -> SeqLengths:
  """Padded batches: query i < ``q_lengths[b]``, key j < ``kv_lengths[b]`` (``[batch...]``;
  None: no limit)."""
  if q_lengths is None and kv_lengths is None:
    raise ValueError("seq_lengths needs q_lengths, kv_lengths or both.")
  return SeqLengths(q_lengths, kv_lengths)


def from_fn(mask_mod: Callable[[Any, Any, Any, Any], Any]) -> FromFn:
  """Any ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on broadcasting int arrays (``b`` the flat
  batch index, ``h`` the query head), as FlexAttention's ``mask_mod``."""
  if not callable(mask_mod):
    raise TypeError(f"from_fn needs a callable mask_mod(b, h, q_idx, kv_idx), got "
                    f"{type(mask_mod).__name__}.")
  return FromFn(mask_mod)


def materialize(mask: Mask, batch: tuple[int, ...], n: int, t: int, s: int) -> Array:
  """The boolean [batch... (or 1s), N or 1, T, S] array of a bound mask (:meth:`Mask.bind`):
  what the dense implementation applies, and the reference the kernels are tested against."""
  bf = math.prod(batch)
  m = mask.mask_mod(jnp.arange(bf)[:, None, None, None], jnp.arange(n)[None, :, None, None],
                    jnp.arange(t)[None, None, :, None], jnp.arange(s)[None, None, None, :])
  m = jnp.asarray(m, jnp.bool_)
  m = m.reshape((1,) * (4 - m.ndim) + m.shape)
  m = jnp.broadcast_to(m, (m.shape[0], m.shape[1], t, s))
  lead = batch if m.shape[0] == bf and bf != 1 else (1,) * len(batch)
  return m.reshape(lead + m.shape[1:])


def combine(mask: Array | None, structured: Mask | None, batch: tuple[int, ...], n: int,
            t: int, s: int) -> Array | None:
  """A dense boolean ``mask`` (or None) and a bound structured mask (or None) as one boolean
  array broadcastable to [batch..., N, T, S] (None when both are None): for the code that
  reads masks densely."""
  if structured is None:
    return mask
  dense = materialize(structured, batch, n, t, s)
  return dense if mask is None else jnp.logical_and(mask, dense)


def from_jax_nn(query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
                local_window_size: int | tuple[int, int] | None = None,
                segment_ids: Any = None) -> Mask | None:
  """The mask of ``jax.nn.dot_product_attention``'s keywords (and attnx's ``segment_ids``: an
  int array ``[batch..., T]`` for self-attention or a pair ``(q_ids, kv_ids)``), or None when
  none is given. ``local_window_size`` is an int (symmetric) or ``(left, right)``."""
  parts: list[Mask] = []
  if query_seq_lengths is not None or key_value_seq_lengths is not None:
    parts.append(SeqLengths(query_seq_lengths, key_value_seq_lengths))
  if local_window_size is not None:
    w = local_window_size
    if isinstance(w, numbers.Integral) and not isinstance(w, bool):
      w = (w, w)
    if not (isinstance(w, tuple | list) and len(w) == 2):
      raise ValueError(f"local_window_size must be an int or a (left, right) pair of ints, "
                       f"got {local_window_size!r}.")
    parts.append(SlidingWindow(*w))
  if segment_ids is not None:
    ids = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids,)
    if len(ids) not in (1, 2):
      raise ValueError("segment_ids is an int array [batch..., T] or a pair (q_ids, kv_ids).")
    parts.append(SegmentIds(ids[0], ids[-1]))
  if not parts:
    return None
  out = parts[0]
  for p in parts[1:]:
    out = out & p
  return out
