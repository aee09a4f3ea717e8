"""Attention against a paged KV cache (vLLM's layout; JAX's Pallas ``paged_attention`` and
flash-attn's ``page_table`` take the same): the keys and values of every sequence live in
fixed-size pages of one shared pool, and a page table lists each sequence's pages in order.

:func:`paged_attention` gathers each sequence's pages (its keys in position order), masks the
positions at or past its length, and runs :func:`attnx.core.attention` on them: every
weighting, mask, score modification and sink it takes, the split-KV implementation for short
queries (:class:`attnx.core.SplitKV`, whose chunks are whole pages where the page count
allows). :func:`append_to_pages` writes new tokens into the pool.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _check(q: Array, k_pages: Array, v_pages: Array, page_table: Array, lengths: Array) -> None:
  if q.ndim != 4:
    raise ValueError(f"paged_attention: query must be [B, T, N, H], got shape {q.shape}.")
  if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
    raise ValueError(f"paged_attention: k_pages and v_pages must be [num_pages, page_size, K, "
                     f"H] and [num_pages, page_size, K, Hv] with the same first three dims; got "
                     f"{k_pages.shape} and {v_pages.shape}.")
  b = q.shape[0]
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"paged_attention: page_table must be int [B, pages_per_sequence] with "
                     f"B = {b}, got shape {page_table.shape}.")
  if not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(f"paged_attention: page_table must hold int page indices, got "
                     f"{page_table.dtype}.")
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"paged_attention: lengths must be int [B] = [{b}], got "
                     f"{lengths.dtype}{list(lengths.shape)}.")
  if q.shape[-1] != k_pages.shape[-1]:
    raise ValueError(f"paged_attention: query head dim {q.shape[-1]} != key head dim "
                     f"{k_pages.shape[-1]}.")
  if q.shape[2] % k_pages.shape[2]:
    raise ValueError(f"paged_attention: {q.shape[2]} query heads are not a multiple of "
                     f"{k_pages.shape[2]} KV heads.")
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if not isinstance(x, jax.core.Tracer):
      a = np.asarray(x)
      limit = k_pages.shape[0] if name == "page_table" else page_table.shape[1] * k_pages.shape[1]
      if a.size and (a.min() < 0 or a.max() > (limit - 1 if name == "page_table" else limit)):
        raise ValueError(
            f"paged_attention: {name} out of range: "
            + (f"page indices must be in [0, {limit})" if name == "page_table" else
               f"lengths must be in [0, pages_per_sequence·page_size = {limit}]")
            + f", got min {a.min()}, max {a.max()}.")


def gather_pages(pages: Array, page_table: Array) -> Array:
  """[num_pages, page_size, K, H] pages and [B, P] table -> [B, P·page_size, K, H]: each
  sequence's keys (or values) in position order."""
  g = pages[page_table]  # [B, P, page_size, K, H]
  return g.reshape((g.shape[0], g.shape[1] * g.shape[2]) + g.shape[3:])


def paged_attention(query: Array, k_pages: Array, v_pages: Array, page_table: Array,
                    lengths: Array, *, is_causal: bool = True, weighting: Any = "softmax",
                    implementation: Any = None, **kwargs: Any) -> Any:
  """Attention of the latest tokens of B sequences against their paged KV cache.

  Args:
    query: ``[B, T, N, H]``: the last T tokens of each sequence (T = 1: one decoding step).
    k_pages, v_pages: the pool, ``[num_pages, page_size, K, H]`` and
      ``[num_pages, page_size, K, Hv]``, N a multiple of K.
    page_table: int ``[B, P]``: sequence b's keys at positions p·page_size … (p+1)·page_size − 1
      are in page ``page_table[b, p]``. Entries past a sequence's length are read but masked
      (any valid page index).
    lengths: int ``[B]``: how many positions of each sequence hold keys (the T queries
      included), at most P·page_size.
    is_causal: query t of sequence b sits at position ``lengths[b] − T + t`` and sees the keys
      up to it (True, the default); False: every query sees all ``lengths[b]`` keys.
    weighting: F, as :func:`attnx.core.attention`.
    implementation: as :func:`attnx.core.attention` (None: split-KV for short queries, with
      whole pages as its chunks where their count allows).
    **kwargs: the other keywords of :func:`attnx.core.attention` (``scale``, ``sinks``,
      ``logits_soft_cap``, ``score_mod``, ``return_residual``, …), except the masks it builds
      itself (``key_value_seq_lengths``, ``mask``); a score modification's ``q_idx`` is the
      query's index among the T, ``kv_idx`` the key's position in its sequence.

  Returns:
    What :func:`attnx.core.attention` returns: ``[B, T, N, Hv]`` (and the residual with
    ``return_residual=True``). A sequence of length 0 gives zero rows.
  """
  from attnx.core import api  # noqa: PLC0415 (api imports the implementations, which import this)
  from attnx.core.implementations import SplitKV  # noqa: PLC0415

  q, kp, vp = jnp.asarray(query), jnp.asarray(k_pages), jnp.asarray(v_pages)
  table, lengths = jnp.asarray(page_table), jnp.asarray(lengths)
  _check(q, kp, vp, table, lengths)
  for name in ("key_value_seq_lengths", "mask", "query_seq_lengths"):
    if name in kwargs:
      raise TypeError(f"paged_attention builds {name!r} from lengths itself; it takes no "
                      f"{name} keyword.")
  t = q.shape[1]
  k, v = gather_pages(kp, table), gather_pages(vp, table)
  s = k.shape[1]
  key_pos = jnp.arange(s)[None, None, None, :]
  mask = key_pos < lengths[:, None, None, None]  # [B, 1, 1, S]
  if is_causal:
    q_pos = lengths[:, None, None, None] - t + jnp.arange(t)[None, None, :, None]
    mask = mask & (key_pos <= q_pos)  # [B, 1, T, S]
  if implementation is None:
    pages = table.shape[1]
    implementation = SplitKV(num_chunks=pages if 1 < pages <= 64 else None)
    if t > 8:
      implementation = None
  return api.attention(q, k, v, mask=mask, weighting=weighting, implementation=implementation,
                       **kwargs)


def append_to_pages(k_pages: Array, v_pages: Array, page_table: Array, lengths: Array,
                    key: Array, value: Array) -> tuple[Array, Array, Array]:
  """Writes one new token per sequence into the pool: key/value ``[B, K, H]`` at position
  ``lengths[b]`` of sequence b (page ``page_table[b, lengths[b] // page_size]``). Returns the
  new pools and ``lengths + 1``. The caller keeps the page table long enough (a full table is
  a ValueError when ``lengths`` is concrete; under ``jit`` the write goes to the table's last
  page)."""
  page_size = k_pages.shape[1]
  cap = page_table.shape[1] * page_size
  if not isinstance(lengths, jax.core.Tracer) and np.any(np.asarray(lengths) >= cap):
    raise ValueError(f"append_to_pages: a sequence is full ({cap} positions = "
                     f"{page_table.shape[1]} pages of {page_size}); give it more pages.")
  slot = jnp.minimum(lengths, cap - 1)
  page = jnp.take_along_axis(page_table, (slot // page_size)[:, None], axis=1)[:, 0]
  offset = slot % page_size
  k_pages = k_pages.at[page, offset].set(key.astype(k_pages.dtype))
  v_pages = v_pages.at[page, offset].set(value.astype(v_pages.dtype))
  return k_pages, v_pages, lengths + 1


__all__ = ["append_to_pages", "gather_pages", "paged_attention"]
