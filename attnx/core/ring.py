"""Context-parallel (ring) attention for every streamable weighting F.

The sequence is split over the devices of one mesh axis (inside ``jax.shard_map``, with or
without ``check_vma``): device i holds its query rows and its key/value shard. The K/V
shards travel around the ring with ``lax.ppermute`` (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers", arXiv 2310.01889; Brandon et al. 2023, "Striped
Attention", arXiv 2311.09431 for the load balance of causal rings): at step r device i holds
the shard of device (i − r) mod P, runs attnx's blocked kernel on its queries against it (the
transfer of the next shard is issued before, so that XLA may overlap the two) and merges the
partial row states, exactly, with the streaming module's rules (:mod:`attnx.core.streaming`):

* pointwise F with the online max (softmax-like): rescale by e^{m_a − m} and add
  (:func:`~attnx.core.streaming.pointwise_merge`); ``"sum"``, ``"length"`` and ``"none"``:
  plain sums of Σ F·V and of Σ F / the valid-key count;
* SSMax and softpick: the running max's rescaling (:func:`~attnx.core.streaming.merge`);
* stick-breaking: the later keys break the stick first, so the state of a key range that lies
  after another is merged in front of it. Shards arrive in the order i, i − 1, …, 0 (each
  before the previous) and then P − 1, …, i + 1 (after all of those): two states are kept,
  one per run, and merged at the end. In the zigzag layout the two chunks of a shard travel
  apart, in opposite directions, so that every chunk still arrives before the earlier chunks
  of its run (five runs; see "Stick-breaking in the zigzag layout" below).

After the last step the state is normalized once. What depends on the length of the row uses
the whole (global) sequence, never the shard's: F sees the global key count S = P·S_local
(sigmoid's default b = −log S), ``"length"`` counts the valid keys of every shard (the merged
count), SSMax's n_i is the row's count of valid keys over all shards (found before the ring:
from the masks, gathered along the key axis when they are sharded).

Causal attention (T = S) with ``layout="contiguous"`` (device i holds chunk i): the shards of
devices after i are above the diagonal of every local row and are skipped (``lax.switch``), so
device P − 1 does P − ½ blocks of work and device 0 only ½: the ring waits for the slowest.
``layout="zigzag"`` cuts the sequence into 2P chunks and gives device i chunks i and 2P − 1 − i
(:func:`zigzag_permute`): every step is then half a block on every device (:func:`ring_work`).
Without ``is_causal`` the layout changes nothing but which positions a device holds.

The backward is a ``jax.custom_vjp`` that runs the ring again (FlashAttention-2's recomputation
at the scale of shards): only the local output and the row statistics are saved, O(T/P) per
device. Autodiff through the forward ring would save every visiting K/V shard for the
backward (the loop's carries), O(T) per device — the memory ring attention exists to avoid.
dQ accumulates locally; the dK/dV accumulators (and a key-sharded bias' gradient) travel
around the ring with their K/V shard, one hop after each step: after P hops they are home.

A ring holds about 12 buffers of its shard's size (the visiting K/V, the next one and XLA's
copy of the one it sends, dK/dV sent and received, dQ, the kernel's own accumulators), so the
kv heads run in passes (``kv_head_block`` per pass, by default as many as keep a pass' query
shard within :data:`PASS_BUDGET` elements): one whole ring per pass, one pass after the other,
each over its heads only. The contract's input step runs per pass too, and stick-breaking's
saved states are reduced to per-row carries before the backward's passes. Measured at
T = 65 536 over 8 devices (B = 1, N = 8, H = 64, XLA CPU, compiled fwd+bwd temp bytes per
device ÷ the single-device blocked kernel's): causal zigzag softmax 0.014, SSMax 0.067,
stick-breaking 0.137, non-causal softmax 0.094 (0.24 in one pass of all heads).

Masks and biases follow :func:`attnx.core.attention` ([batch..., N, T, S]-broadcastable, True
= attend), with their T and S axes given per device as:

* T axis: 1 (broadcast) or the local query length (sharded with q);
* S axis: 1 (broadcast); the local key length, sharded with k (a key padding mask
  [B, 1, 1, S]: it travels with the K/V shards; its T axis must be 1); or the whole key
  length P·S_local in the layout's order (the shards of devices 0, …, P − 1 concatenated,
  i.e. :func:`zigzag_permute` of the natural order for zigzag), with the T axis sharded: each
  step slices the visiting shard's columns.

Sparsemax and α-entmax cannot run here: their threshold τ_i needs every key of the row before
the first weight (several passes over all keys; each would be a ring of its own).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnx.core import blocked as bl
from attnx.core import blocked_rows, dispatch, streaming
from attnx.core import scores as scores_lib
from attnx.core.contract import compute_dtype, nonfinite_inputs
from attnx.core.kernels import common
from attnx.core.kernels import pallas as pa
from attnx.core.kernels.pallas import block as ring_pallas
from attnx.core.kernels.xla import tiling as tl
from attnx.core.weightings import Pointwise, get_weighting

Array = jax.Array
F32 = jnp.float32
LAYOUTS = ("contiguous", "zigzag")
FAMILIES = ("pointwise", "ssmax", "softpick", "stick_breaking")

__all__ = ["LAYOUTS", "PASS_BUDGET", "ring_attention", "ring_work", "zigzag_permute",
           "zigzag_unpermute"]

# What one ring step computes on a device: (row lo, row hi, key lo, key hi, causal) pieces of
# the local rows against the visiting shard, in units of half a shard (zigzag chunks).
_SKIP, _FULL, _DIAG, _ZZ_DIAG, _ZZ_LOW, _ZZ_HIGH = range(6)
_PIECES = {
    _SKIP: (),
    _FULL: ((0, 2, 0, 2, False),),
    _DIAG: ((0, 2, 0, 2, True),),
    # Own chunks (a, b) = (i, 2P − 1 − i): a×a causal, b×a full, b×b causal, a×b above the
    # diagonal. a comes before b, so that is the plain causal mask of the local positions: one
    # causal block, whose tiles above the diagonal the kernel skips.
    _ZZ_DIAG: ((0, 2, 0, 2, True),),
    # From device j < i: both local chunks see chunk j, none sees chunk 2P − 1 − j.
    _ZZ_LOW: ((0, 2, 0, 1, False),),
    # From device j > i: chunk i sees neither; chunk 2P − 1 − i sees both.
    _ZZ_HIGH: ((1, 2, 0, 2, False),),
}


def _step_kind(i: Any, src: Any, layout: str, is_causal: bool, xp: Any = jnp) -> Any:
  """The kind of step device i runs on the shard of device src (ints or traced int32)."""
  if not is_causal:
    return _FULL
  if layout == "contiguous":
    return xp.where(src == i, _DIAG, xp.where(src < i, _FULL, _SKIP))
  return xp.where(src == i, _ZZ_DIAG, xp.where(src < i, _ZZ_LOW, _ZZ_HIGH))


def _piece_work(piece: tuple[int, int, int, int, bool]) -> float:
  r0, r1, k0, k1, causal = piece
  return (r1 - r0) * (k1 - k0) * (0.5 if causal else 1.0)


def ring_work(num_devices: int, layout: str = "contiguous",
              is_causal: bool = True) -> np.ndarray:
  """The work of each device over a whole ring, [P] floats, in tiles of chunk × chunk scores
  (a chunk is T/(2P) positions; a causal triangle counts ½): what the ring schedules, read
  from the same table of step kinds the kernel runs.

  Non-causal: 4P everywhere. Causal contiguous: 4i + 2 (device P − 1 does 2 − 1/P times the
  mean, and the ring waits for it); zigzag: 2P on every device. (Stick-breaking in the zigzag
  layout runs the same total per device, but its two half-shards travel on schedules of their
  own: one step costs up to 3 chunk tiles on some devices, where every step of this table
  costs 2.)

  Example:
    >>> from attnx import core
    >>> print(core.ring_work(4, "contiguous"), core.ring_work(4, "zigzag"))
    [ 2.  6. 10. 14.] [8. 8. 8. 8.]
  """
  _check_layout(layout)
  p = int(num_devices)
  out = np.zeros(p)
  for i in range(p):
    for r in range(p):
      kind = int(_step_kind(i, (i - r) % p, layout, is_causal, np))
      out[i] += sum(_piece_work(pc) for pc in _PIECES[kind])
  return out


# --------------------------------------------------------------------------------------------
# The zigzag layout.
# --------------------------------------------------------------------------------------------

def _zigzag_order(num_devices: int) -> np.ndarray:
  """The chunk order of the zigzag layout: 0, 2P−1, 1, 2P−2, …, P−1, P."""
  p = num_devices
  return np.array([c for i in range(p) for c in (i, 2 * p - 1 - i)])


def _check_chunks(x: Any, num_devices: int, axis: int) -> tuple[int, int]:
  if not isinstance(num_devices, numbers.Integral) or num_devices < 1:
    raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
  n = x.shape[axis]
  if n % (2 * num_devices):
    raise ValueError(f"the zigzag layout cuts the sequence into 2·P = {2 * num_devices} "
                     f"chunks: axis {axis} of length {n} does not split")
  return n // (2 * num_devices), axis % x.ndim


def zigzag_permute(x: Array, num_devices: int, axis: int = 1) -> Array:
  """The natural sequence order along ``axis`` -> the zigzag layout: cut into 2P chunks, device
  i's shard (the i-th of P equal parts of the result) holds chunks i and 2P − 1 − i.

  Shard the result along ``axis`` over the ring's mesh axis (e.g. ``P(None, "sp")`` for
  [B, T, N, H]); :func:`zigzag_unpermute` restores the natural order of the output. A bias or
  mask with both a T and an S axis is permuted along both.

  Example:
    >>> import jax.numpy as jnp
    >>> from attnx import core
    >>> z = core.zigzag_permute(jnp.arange(8)[None], num_devices=2)  # chunks of 2 positions
    >>> print(z)  # device 0: chunks 0 and 3, device 1: chunks 1 and 2
    [[0 1 6 7 2 3 4 5]]
    >>> print(core.zigzag_unpermute(z, num_devices=2))
    [[0 1 2 3 4 5 6 7]]
  """
  c, axis = _check_chunks(x, num_devices, axis)
  chunks = x.reshape(x.shape[:axis] + (2 * num_devices, c) + x.shape[axis + 1:])
  out = jnp.take(chunks, jnp.asarray(_zigzag_order(num_devices)), axis=axis)
  return out.reshape(x.shape)


def zigzag_unpermute(x: Array, num_devices: int, axis: int = 1) -> Array:
  """The inverse of :func:`zigzag_permute`: zigzag layout -> natural order along ``axis``."""
  c, axis = _check_chunks(x, num_devices, axis)
  chunks = x.reshape(x.shape[:axis] + (2 * num_devices, c) + x.shape[axis + 1:])
  inverse = np.argsort(_zigzag_order(num_devices))
  return jnp.take(chunks, jnp.asarray(inverse), axis=axis).reshape(x.shape)


def _positions(dev: Any, t: int, p: int, layout: str, xp: Any = jnp) -> Array:
  """Global positions of device ``dev``'s t local rows (int32 [t]; ``xp=np`` for a static
  device index)."""
  r = xp.arange(t, dtype=xp.int32)
  if layout == "contiguous":
    return dev * t + r
  c = max(t // 2, 1)
  chunk = xp.where(r < c, dev, 2 * p - 1 - dev)
  return chunk * c + r % c


# --------------------------------------------------------------------------------------------
# The static description of one ring problem.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Ring:
  axis: str
  p: int
  layout: str
  is_causal: bool
  w: Any
  family: str
  t: int  # local query rows
  s: int  # local keys
  head_dims: tuple[int, int, int]  # (B, K, G)
  bias_kind: str  # "none", "const" (S axis 1), "travel" (sharded with k), "rows" (all keys)
  mask_kind: str
  block_q: int | None
  block_k: int | None
  vma: tuple[str, ...] = ()  # axes the inputs vary over (check_vma=True): see blocked.vary
  pallas: str | None = None  # the Pallas kernels' backend ("gpu"/"tpu") of every step, or XLA
  interpret: bool = False  # the Pallas kernels in Pallas' interpreter
  dtype: Any = F32  # the compute dtype (contract.compute_dtype): float32, or float64

  @property
  def num_keys(self) -> int:
    return self.p * self.s

  @property
  def pallas_kw(self) -> dict[str, Any]:
    """The Pallas step functions' backend arguments (empty for the blocked kernel)."""
    return {} if self.pallas is None else dict(backend=self.pallas, interpret=self.interpret)

  @property
  def pointwise(self) -> bool:
    return self.family == "pointwise"

  def cfg(self, t: int, s: int, causal: bool) -> tl.TileConfig:
    return bl.block_config(
        self.w, t, s, self.head_dims, is_causal=causal, has_mask=self.mask_kind != "none",
        has_bias=self.bias_kind != "none", num_keys=self.num_keys, block_q=self.block_q,
        block_k=self.block_k, whole_chunk=not self.pointwise)


def _kind_of(x: Array | None, t: int, s: int, p: int, name: str) -> str:
  """Which of the documented shardings a [Bb, Nb, Tb, Sb] local bias/mask has."""
  if x is None:
    return "none"
  tb, sb = x.shape[2:]
  if tb not in (1, t):
    raise ValueError(f"{name}'s T axis must be 1 or the local query length {t} (sharded with "
                     f"the queries); got local shape {x.shape}.")
  # With one key per device (s = 1) a key padding mask/bias sharded with the keys has a local
  # S axis of 1, like a broadcast one: with the T axis broadcast (tb = 1 < t) both are right
  # travelling with the keys (a broadcast one holds the same values on every device).
  if p > 1 and t == s == 1 and tb == sb == 1:
    raise ValueError(
        f"With one query and one key per device, a local {name} of shape {x.shape} may be "
        f"sharded with the queries or with the keys, which need different rings: give each "
        f"device more than one position, or pass the {name} with its whole S axis ({p}) on "
        f"each device.")
  if sb == 1 and not (s == 1 and tb == 1 < t):
    return "const"
  if sb == p * s:
    return "rows"
  if sb == s:
    if tb != 1:
      raise ValueError(
          f"{name} of local shape {x.shape}: an S axis sharded with the keys ({s}) travels "
          f"around the ring and must not have a T axis (use [B, N, 1, S], a key padding "
          f"{name}); a {name} with both axes needs its whole S axis ({p * s}) on each device.")
    return "travel"
  raise ValueError(f"{name}'s S axis must be 1, the local key length {s} (sharded with the "
                   f"keys) or the whole key length {p * s}; got local shape {x.shape}.")


# A local length whose tiles (its divisors) would all be shorter than this is refused: the
# kernels would crawl through tiles of a few rows.
_MIN_TILE, _SHORT = 8, 64


def _check_tiles(rc: _Ring) -> None:
  """Every block of the ring runs unpadded tiles that divide its length (the blocks of all
  steps must share the rows' layout): refuse lengths whose tiles would be a few rows."""
  half_t, half_s = rc.t // 2, rc.s // 2
  shapes = {(rc.t, rc.s, rc.is_causal)}
  if rc.layout == "zigzag" and rc.is_causal:
    shapes |= {(rc.t, half_s, False), (half_t, rc.s, False)}
  if rc.layout == "zigzag" and rc.family == "stick_breaking":
    shapes |= {(rc.t, half_s, False), (half_t, half_s, rc.is_causal), (half_t, half_s, False)}
  for t, s, causal in shapes:
    cfg = rc.cfg(t, s, causal)
    for name, length, tile in (("query", t, cfg.bq), ("key", s, cfg.bk)):
      if tile < min(_MIN_TILE, length) and length >= _SHORT:
        raise ValueError(
            f"ring_attention tiles its blocks without padding, and a {name} block of {length} "
            f"positions only splits into tiles of {tile}: use local lengths (zigzag: chunk "
            f"lengths) that are multiples of {_MIN_TILE} (pad the sequence and mask the "
            "padding keys).")


def _check_layout(layout: Any) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"Unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}.")


def _family(w: Any) -> str:
  if isinstance(w, Pointwise):
    return "pointwise"
  stream = getattr(w, "stream", None)
  if stream is None:
    raise ValueError(f"Weighting {w.name!r} normalizes whole rows and has no streaming form, so "
                     "it cannot run ring-parallel: gather K/V (lax.all_gather(..., tiled=True) "
                     "along the sequence) and call attnx.core.attention, or use a streamable "
                     "weighting.")
  if stream.family == "entmax":
    raise ValueError(
        f"Weighting {w.name!r} cannot run ring-parallel: its threshold τ_i needs every key of "
        "the row before the first weight (several passes over all keys). Gather K/V with "
        "lax.all_gather(..., axis=1, tiled=True) and call attnx.core.attention on the local "
        "queries (O(T) memory per device), or use a streamable weighting (softmax, sigmoid, "
        "ssmax, softpick, ...).")
  return stream.family


def _axis_size(axis_name: Any) -> int:
  try:
    return int(lax.axis_size(axis_name))
  except (NameError, KeyError, TypeError, ValueError):
    raise ValueError(
        f"ring_attention must run inside jax.shard_map (or another map) over a mesh axis "
        f"named {axis_name!r}, with q, k, v sharded along the sequence over it; no axis "
        f"{axis_name!r} is bound here.") from None


# --------------------------------------------------------------------------------------------
# Slices of the kernel-layout arrays (q [X, G, T, H], k/v [X, S, H], bias/mask
# [Bb, Kb, Gb, T|1, S|1], states [X, G, T, ...]).
# --------------------------------------------------------------------------------------------

def _sl(x: Array, axis: int, lo: int, size: int) -> Array:
  return x if x.shape[axis] == 1 else lax.slice_in_dim(x, lo, lo + size, axis=axis)


def _add_at(full: Array, part: Array, axis: int, lo: Any) -> Array:
  """full with `part` added at offset `lo` along `axis` (no-op offset on a size-1 axis)."""
  if full.shape[axis] == part.shape[axis]:
    return full + part
  cur = lax.dynamic_slice_in_dim(full, lo, part.shape[axis], axis=axis)
  return lax.dynamic_update_slice_in_dim(full, cur + part, lo, axis=axis)


def _add_rows_keys(full: Array, part: Array, r0: int, k0: Any) -> Array:
  starts = [0, 0, 0, r0 if full.shape[3] != 1 else 0, k0 if full.shape[4] != 1 else 0]
  if full.shape == part.shape:
    return full + part
  cur = lax.dynamic_slice(full, starts, part.shape)
  return lax.dynamic_update_slice(full, cur + part, starts)


def _rows(tree: Any, lo: int, size: int) -> Any:
  return jax.tree.map(lambda a: lax.slice_in_dim(a, lo, lo + size, axis=2), tree)


def _put_rows(tree: Any, part: Any, lo: int) -> Any:
  return jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b, lo, axis=2), tree,
                      part)


def _select(pred: Array, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


# --------------------------------------------------------------------------------------------
# The family interface: empty state, merge, finalize, block state and block gradients.
# --------------------------------------------------------------------------------------------

def _zeros(rc: _Ring, shape: tuple[int, ...]) -> Array:
  """Zeros of the compute dtype typed like the ring's inputs (loop starts and branch
  results)."""
  return bl.vary(jnp.zeros(shape, rc.dtype), rc.vma)


def _empty(rc: _Ring, rows: tuple[int, ...], hv: int) -> Any:
  """The state of rows that have seen no key."""
  if rc.pointwise:
    cols = hv + 1 if rc.w.normalization == "sum" else hv
    st0 = -jnp.inf if rc.w.online_max else 0.0
    return bl.vary((jnp.zeros(rows + (cols,), rc.dtype), jnp.full(rows, st0, rc.dtype)), rc.vma)
  return bl.vary(streaming.init(rc.w.stream, rows, hv, rc.dtype), rc.vma)


def _merge(rc: _Ring, a: Any, b: Any) -> Any:
  """a ∪ b; for stick-breaking ``a`` holds the later keys."""
  if rc.pointwise:
    return streaming.pointwise_merge(rc.w, a, b)
  return streaming.merge(rc.w.stream, a, b)


def _block_state(rc: _Ring, q, kv, bias, mask, rsc, scale, r0, r1, k0, k1, causal):
  """The raw state of local rows [r0, r1) against keys [k0, k1) of the visiting shard."""
  k, v = kv
  cfg = rc.cfg(r1 - r0, k1 - k0, causal)
  qp = lax.slice_in_dim(q, r0, r1, axis=2)
  kp, vp = lax.slice_in_dim(k, k0, k1, axis=1), lax.slice_in_dim(v, k0, k1, axis=1)
  bp = None if bias is None else _sl(_sl(bias, 3, r0, r1 - r0), 4, k0, k1 - k0)
  mp = None if mask is None else _sl(_sl(mask, 3, r0, r1 - r0), 4, k0, k1 - k0)
  rp = None if rsc is None else lax.slice_in_dim(rsc, r0, r1, axis=2)
  if rc.pallas is not None:
    if rc.pointwise:
      return ring_pallas.raw_block_state(qp, kp, vp, bp, mp, scale, cfg, **rc.pallas_kw)
    return ring_pallas.raw_row_block_state(qp, kp, vp, bp, mp, rp, scale, cfg, **rc.pallas_kw)
  if rc.pointwise:
    return bl.raw_block_state(qp, kp, vp, bp, mp, scale, cfg)
  return blocked_rows.raw_block_state(qp, kp, vp, bp, mp, rp, scale, cfg)


def _kind_state(rc: _Ring, pieces, q, kv, bias, mask, rsc, scale, hv: int) -> Any:
  """The raw state of every local row over the visiting keys (``kv``: a shard, or half of
  one), from the ``pieces`` of a kind of step (:data:`_PIECES`; empty rows where none)."""
  half, s_blk = rc.t // 2, kv[0].shape[1]
  rows_of = lambda a: rc.t if a == 2 else a * half  # in halves: 0, 1 or 2 (odd lengths: 2)
  keys_of = lambda a: s_blk if a == 2 else a * (s_blk // 2)
  state = _empty(rc, q.shape[:2] + (rc.t,), hv)
  for r0, r1, k0, k1, causal in pieces:
    lo, hi = rows_of(r0), rows_of(r1)
    part = _block_state(rc, q, kv, bias, mask, rsc, scale, lo, hi, keys_of(k0), keys_of(k1),
                        causal)
    if (lo, hi) == (0, rc.t):  # the only piece of its kind: nothing to merge with
      state = part
    else:
      state = _put_rows(state, _merge(rc, _rows(state, lo, hi - lo), part), lo)
  return bl.vary(state, rc.vma)  # every kind of step: the same type


def _kind_grads(rc: _Ring, pieces, q, kv, bias, mask, rsc, scale, out, stats, do, carries):
  """(dq, (dk, dv), dbias block, carries, dscale) of one kind of step (its ``pieces``), zeros
  where the step computes nothing. (Adding into the running sums inside the step's branch
  instead measured more scratch: XLA copies the operands of the branches.)"""
  k, v = kv
  half, s_blk = rc.t // 2, k.shape[1]
  rows_of = lambda a: rc.t if a == 2 else a * half  # in halves: 0, 1 or 2 (odd lengths: 2)
  keys_of = lambda a: s_blk if a == 2 else a * (s_blk // 2)
  dq = _zeros(rc, q.shape)
  dk, dv = _zeros(rc, k.shape), _zeros(rc, v.shape)
  db = None if bias is None else _zeros(rc, bias.shape)
  dscale = _zeros(rc, ())
  for r0, r1, k0, k1, causal in pieces:
    lo, hi, klo, khi = rows_of(r0), rows_of(r1), keys_of(k0), keys_of(k1)
    cfg = rc.cfg(hi - lo, khi - klo, causal)
    rows = lambda a, lo=lo, hi=hi: lax.slice_in_dim(a, lo, hi, axis=2)
    keys = lambda a, lo=klo, hi=khi: lax.slice_in_dim(a, lo, hi, axis=1)
    bp = None if bias is None else _sl(_sl(bias, 3, lo, hi - lo), 4, klo, khi - klo)
    mp = None if mask is None else _sl(_sl(mask, 3, lo, hi - lo), 4, klo, khi - klo)
    kw = rc.pallas_kw
    if rc.pointwise:
      grads = ring_pallas.block_grads if rc.pallas else bl.block_grads
      gq, gk, gv, gb, gs = grads(rows(q), keys(k), keys(v), bp, mp, scale, rows(out),
                                 rows(stats[0]), rows(do), cfg, **kw)
    else:
      rp = None if rsc is None else rows(rsc)
      grads = ring_pallas.row_block_grads if rc.pallas else blocked_rows.block_grads
      gq, gk, gv, gb, part_carries, gs = grads(
          rows(q), keys(k), keys(v), bp, mp, rp, scale, rows(out), tuple(map(rows, stats)),
          rows(do), _rows(carries, lo, hi - lo), cfg, **kw)
      carries = _put_rows(carries, part_carries, lo)
    dq, dk, dv = _add_at(dq, gq, 2, lo), _add_at(dk, gk, 1, klo), _add_at(dv, gv, 1, klo)
    if db is not None:
      db = _add_rows_keys(db, gb, lo, klo)
    dscale = dscale + gs
  return bl.vary((dq, (dk, dv), db, carries, dscale), rc.vma)  # every kind: the same type


# --------------------------------------------------------------------------------------------
# The ring: forward, backward, custom VJP.
# --------------------------------------------------------------------------------------------

def _perm(p: int) -> list[tuple[int, int]]:
  return [(j, (j + 1) % p) for j in range(p)]  # device i receives from i − 1


def _step_inputs(rc: _Ring, travel, bias, mask, src):
  """(k, v), bias block, mask block of the step on the shard of device ``src``."""
  k, v, bias_t, mask_t = travel

  def pick(local, travelling, kind):
    if kind == "travel":
      return travelling
    if kind == "rows":
      return lax.dynamic_slice_in_dim(local, src * rc.s, rc.s, axis=4)
    return local

  return (k, v), pick(bias, bias_t, rc.bias_kind), pick(mask, mask_t, rc.mask_kind)


def _travelling(rc: _Ring, k, v, bias, mask):
  return (k, v, bias if rc.bias_kind == "travel" else None,
          mask if rc.mask_kind == "travel" else None)


def _kinds(rc: _Ring) -> tuple[int, ...]:
  """The kinds of step this ring runs, in the order :func:`_branch` numbers them."""
  if not rc.is_causal:
    return (_FULL,)
  if rc.layout == "contiguous":
    return (_DIAG, _FULL, _SKIP)
  return (_ZZ_DIAG, _ZZ_LOW, _ZZ_HIGH)


def _branch(rc: _Ring, i: Array, src: Array) -> Array:
  """Which of :func:`_kinds` device i runs on the shard of device ``src``: the decision of
  :func:`_step_kind`, as an index for ``lax.switch``."""
  kind = _step_kind(i, src, rc.layout, rc.is_causal)
  kinds = _kinds(rc)
  return sum(jnp.where(kind == kd, n, 0) for n, kd in enumerate(kinds) if n)


def _switch(rc: _Ring, i: Array, src: Array, run, *operands):
  """run(kind)(*operands) for the step's kind: one instance of each kind's kernel in the
  program (one loop over the steps, ``lax.switch`` inside), which keeps both the compile
  time and XLA's scratch memory (each instance gets its own) down."""
  kinds = _kinds(rc)
  if len(kinds) == 1:
    return run(kinds[0])(*operands)
  return lax.switch(_branch(rc, i, src), [run(kd) for kd in kinds], *operands)


def _forward(rc: _Ring, q, k, v, bias, mask, rsc, scale):
  """(out [X, G, T, Hv] in the compute dtype, row statistics, stick-breaking's (O, L) of the
  later run)."""
  p, hv = rc.p, v.shape[-1]
  i = lax.axis_index(rc.axis)
  rows = q.shape[:2] + (rc.t,)
  stick = rc.family == "stick_breaking"

  def body(r, c):
    travel, low, high = c
    src = (i - r) % p
    # The next shard's transfer is issued before this step's work, which does not depend on
    # it, so XLA may overlap them (at the last step it is not used).
    after = lax.ppermute(travel, rc.axis, _perm(p)) if p > 1 else travel
    kv, b, m = _step_inputs(rc, travel, bias, mask, src)
    run = lambda kind: (lambda: _kind_state(rc, _PIECES[kind], q, kv, b, m, rsc, scale,
                                                      hv))
    part = _switch(rc, i, src, run)
    if not stick:
      return after, _merge(rc, low, part), high
    # Shards i, i−1, …, 0 and then P−1, …, i+1 each come before the previous one: two runs,
    # each merged behind the state of the keys after it.
    later = src > i
    acc = _select(later, high, low)
    merged = _merge(rc, acc, part)
    return after, _select(later, low, merged), _select(later, merged, high)

  init = (_travelling(rc, k, v, bias, mask), _empty(rc, rows, hv), _empty(rc, rows, hv))
  _, low, high = lax.fori_loop(0, p, body, init)
  if stick:
    state = _merge(rc, high, low)
    out, stats, _ = streaming.finalize(rc.w.stream, state, None)
    return out, stats, (high.acc, high.log_rest)
  if rc.pointwise:
    out, stat = streaming.pointwise_finalize(rc.w, *low)
    return out, (stat,), None
  out, stats, _ = streaming.finalize(rc.w.stream, low, None)
  return out, stats, None


def _backward(rc: _Ring, res, do):
  q, k, v, bias, mask, rsc, scale, out, stats, extra = res
  p = rc.p
  i = lax.axis_index(rc.axis)
  do = do.astype(rc.dtype)
  rows = q.shape[:3]
  stick = rc.family == "stick_breaking"
  zero_rows = _zeros(rc, rows)
  # Carries of the whole-row backward. SSMax: dc, summed over every shard. Stick-breaking, run
  # from the later keys backwards: the run of shards after i (high) starts empty, the run of
  # shards up to i (low) starts after all of them: with their L and Σ A·dP = dO·O_high.
  if stick:
    low_c = extra  # (L, Σ A·dP) of the later run: _start_carries
    high_c = (zero_rows, zero_rows)
  else:
    low_c = high_c = (zero_rows, zero_rows)
  dbias_local = None
  if bias is not None and rc.bias_kind != "travel":
    dbias_local = _zeros(rc, bias.shape)

  def bias_home(dbias_local, db, tgrad_b, src):
    """Adds a step's bias gradient where it belongs: the local bias (broadcast S axis, or
    the visiting shard's columns of the whole S axis) or the travelling accumulator."""
    if db is None:
      return dbias_local, tgrad_b
    if rc.bias_kind == "travel":
      return dbias_local, tgrad_b + db
    if rc.bias_kind == "rows":
      return _add_at(dbias_local, db, 4, src * rc.s), tgrad_b
    return dbias_local + db, tgrad_b

  def body(r, c):
    travel, tgrads, (dq, dscale, dbias_local, low_c, high_c) = c
    src = (i - r) % p
    after = lax.ppermute(travel, rc.axis, _perm(p)) if p > 1 else travel
    kv, b, m = _step_inputs(rc, travel, bias, mask, src)
    later = src > i if stick else False
    carries = _select(later, high_c, low_c) if stick else low_c
    run = lambda kind: (lambda c: _kind_grads(rc, _PIECES[kind], q, kv, b, m, rsc, scale, out,
                                              stats, do, c))
    gq, (gk, gv), db, carries, gs = _switch(rc, i, src, run, carries)
    if stick:
      low_c, high_c = _select(later, low_c, carries), _select(later, carries, high_c)
    else:
      low_c = carries
    dk, dv, dbt = tgrads
    dbias_local, dbt = bias_home(dbias_local, db, dbt, src)
    tgrads = (dk + gk, dv + gv, dbt)
    # The visiting shard's dK/dV go on with it; after P hops they are home.
    if p > 1:
      tgrads = lax.ppermute(tgrads, rc.axis, _perm(p))
    return after, tgrads, (dq + gq, dscale + gs, dbias_local, low_c, high_c)

  tgrads = (_zeros(rc, k.shape), _zeros(rc, v.shape),
            _zeros(rc, bias.shape) if rc.bias_kind == "travel" else None)
  acc = (_zeros(rc, q.shape), _zeros(rc, ()), dbias_local, low_c, high_c)
  init = (_travelling(rc, k, v, bias, mask), tgrads, acc)
  _, tgrads, acc = lax.fori_loop(0, p, body, init)
  dk, dv, dbias_t = tgrads
  dq, dscale, dbias_local, low_c, _ = acc
  dbias = dbias_t if rc.bias_kind == "travel" else dbias_local
  drsc = low_c[0] if rc.family == "ssmax" else None
  return dq, dk, dv, dbias, drsc, dscale


# --------------------------------------------------------------------------------------------
# Stick-breaking in the zigzag layout: the keys of a row must merge in order, and a zigzag
# shard holds two distant chunks, j and 2P − 1 − j. Its halves travel apart: the low chunks
# (j) around the ring as usual, arriving i, i − 1, …, 0, P − 1, …, i + 1, the high chunks
# (2P − 1 − j) the other way round, arriving 2P − 1 − i, then P + … down to P, then 2P − 1
# down to 2P − i. Every chunk then arrives before the chunks of its run that come before it:
# five runs, L1 (chunks ≤ i), L2 (up to P − 1), H2 (from P, below 2P − 1 − i), H0 (chunk
# 2P − 1 − i) and H3 (after it), each merged behind its later keys as they come, and the runs
# merged at the end, later first. The backward walks the same runs in the same order, each
# starting from the carries (L and Σ A·dP) of the runs after it, from their saved totals.
# --------------------------------------------------------------------------------------------

# Pieces of a half-shard visit (rows in halves of the local rows; keys: the whole half), by
# where the visiting device j is relative to i (−1: j < i, 0: j = i, 1: j > i).
_LOW_PIECES = {-1: ((0, 2, 0, 2, False),), 0: ((0, 1, 0, 2, True), (1, 2, 0, 2, False)),
               1: ((1, 2, 0, 2, False),)}
_HIGH_PIECES = {-1: (), 0: ((1, 2, 0, 2, True),), 1: ((1, 2, 0, 2, False),)}
_RUNS = ("H3", "H0", "H2", "L2", "L1")  # later first


def _reverse_perm(p: int) -> list[tuple[int, int]]:
  return [(j, (j - 1) % p) for j in range(p)]  # device i receives from i + 1


def _half(rc: _Ring, travel, lo: int, size: int):
  """The key half [lo, lo + size) of travelling (k, v, bias, mask)."""
  k, v, b, m = travel
  cut = lambda x, axis: None if x is None else lax.slice_in_dim(x, lo, lo + size, axis=axis)
  return cut(k, 1), cut(v, 1), cut(b, 4), cut(m, 4)


def _half_inputs(rc: _Ring, half, bias, mask, src, off: int):
  """(k, v), bias block, mask block of a visit by half a shard of device ``src`` (its keys
  [off, off + S/2) of the shard)."""
  k, v, bias_t, mask_t = half
  size = k.shape[1]

  def pick(local, travelling, kind):
    if kind == "travel":
      return travelling
    if kind == "rows":
      return lax.dynamic_slice_in_dim(local, src * rc.s + off, size, axis=4)
    return local

  return (k, v), pick(bias, bias_t, rc.bias_kind), pick(mask, mask_t, rc.mask_kind)


def _rel_switch(rc: _Ring, i, src, table, run, *operands):
  """run(pieces)(*operands) with the pieces of ``table`` for src relative to i."""
  if not rc.is_causal:
    return run(((0, 2, 0, 2, False),))(*operands)
  return lax.switch(jnp.sign(src - i) + 1, [run(table[r]) for r in (-1, 0, 1)], *operands)


def _runs_update(runs: dict, names: tuple[str, ...], which: Array, new: Any, fn) -> dict:
  """runs[names[which]] = fn(runs[names[which]], new), the others unchanged."""
  picked = runs[names[-1]]
  for n, name in enumerate(names[:-1]):
    picked = _select(which == n, runs[name], picked)
  merged = fn(picked, new)
  return {**runs, **{name: _select(which == n, merged, runs[name])
                     for n, name in enumerate(names)}}


def _high_run(i, src):
  return jnp.where(src == i, 0, jnp.where(src > i, 1, 2))  # H0, H2, H3


def _stick_zigzag_forward(rc: _Ring, q, k, v, bias, mask, scale):
  p, hv, c = rc.p, v.shape[-1], rc.s // 2
  i = lax.axis_index(rc.axis)
  rows = q.shape[:2] + (rc.t,)
  merge = lambda acc, new: _merge(rc, acc, new)  # acc holds the later keys

  def visit(half, src, off, table):
    kv, b, m = _half_inputs(rc, half, bias, mask, src, off)
    run = lambda pieces: (lambda: _kind_state(rc, pieces, q, kv, b, m, None, scale, hv))
    return _rel_switch(rc, i, src, table, run)

  def body(r, carry):
    low, high, runs = carry
    src_l, src_h = (i - r) % p, (i + r) % p
    after_l = lax.ppermute(low, rc.axis, _perm(p)) if p > 1 else low
    after_h = lax.ppermute(high, rc.axis, _reverse_perm(p)) if p > 1 else high
    runs = _runs_update(runs, ("L1", "L2"), (src_l > i).astype(jnp.int32),
                        visit(low, src_l, 0, _LOW_PIECES), merge)
    runs = _runs_update(runs, ("H0", "H2", "H3"), _high_run(i, src_h),
                        visit(high, src_h, c, _HIGH_PIECES), merge)
    return after_l, after_h, runs

  travel = _travelling(rc, k, v, bias, mask)
  init = (_half(rc, travel, 0, c), _half(rc, travel, c, c),
          {name: _empty(rc, rows, hv) for name in _RUNS})
  _, _, runs = lax.fori_loop(0, p, body, init)
  state = runs["L1"]
  for name in ("L2", "H2", "H0", "H3"):
    state = _merge(rc, runs[name], state)
  out, stats, _ = streaming.finalize(rc.w.stream, state, None)
  return out, stats, tuple(runs[name] for name in _RUNS[:-1])


def _stick_zigzag_backward(rc: _Ring, res, do):
  q, k, v, bias, mask, _, scale, out, stats, extra = res
  p, c = rc.p, rc.s // 2
  i = lax.axis_index(rc.axis)
  do = do.astype(rc.dtype)
  carries = dict(zip(_RUNS, extra, strict=True))  # _start_carries
  dbias_local = None
  if bias is not None and rc.bias_kind != "travel":
    dbias_local = _zeros(rc, bias.shape)

  def visit(half, src, off, table, run_carries):
    kv, bb, m = _half_inputs(rc, half, bias, mask, src, off)
    run = lambda pieces: (lambda cc: _kind_grads(rc, pieces, q, kv, bb, m, None, scale, out,
                                                 stats, do, cc))
    return _rel_switch(rc, i, src, table, run, run_carries)

  def add_bias(dbias_local, db, tgrad_b, src, off):
    if db is None:
      return dbias_local, tgrad_b
    if rc.bias_kind == "travel":
      return dbias_local, tgrad_b + db
    if rc.bias_kind == "rows":
      return _add_at(dbias_local, db, 4, src * rc.s + off), tgrad_b
    return dbias_local + db, tgrad_b

  def body(r, carry):
    low, high, t_low, t_high, (dq, dscale, dbias_local, carries) = carry
    src_l, src_h = (i - r) % p, (i + r) % p
    after_l = lax.ppermute(low, rc.axis, _perm(p)) if p > 1 else low
    after_h = lax.ppermute(high, rc.axis, _reverse_perm(p)) if p > 1 else high
    grads = {}

    def one(names, which, half, src, off, table):
      nonlocal carries
      box = {}

      def fn(cc, _):
        gq, gkv, db, cc, gs = visit(half, src, off, table, cc)
        box.update(gq=gq, gkv=gkv, db=db, gs=gs)
        return cc

      carries = _runs_update(carries, names, which, None, fn)
      return box

    grads["low"] = one(("L1", "L2"), (src_l > i).astype(jnp.int32), low, src_l, 0, _LOW_PIECES)
    grads["high"] = one(("H0", "H2", "H3"), _high_run(i, src_h), high, src_h, c, _HIGH_PIECES)
    new_t = []
    for key, tg, src, off in (("low", t_low, src_l, 0), ("high", t_high, src_h, c)):
      g = grads[key]
      dk, dv, dbt = tg
      dbias_local, dbt = add_bias(dbias_local, g["db"], dbt, src, off)
      new_t.append((dk + g["gkv"][0], dv + g["gkv"][1], dbt))
      dq, dscale = dq + g["gq"], dscale + g["gs"]
    t_low, t_high = new_t
    if p > 1:  # each half's dK/dV go on with it, in its direction; after P hops: home
      t_low = lax.ppermute(t_low, rc.axis, _perm(p))
      t_high = lax.ppermute(t_high, rc.axis, _reverse_perm(p))
    return after_l, after_h, t_low, t_high, (dq, dscale, dbias_local, carries)

  travel = _travelling(rc, k, v, bias, mask)
  zeros_half = lambda: (_zeros(rc, (k.shape[0], c, k.shape[2])),
                        _zeros(rc, (v.shape[0], c, v.shape[2])),
                        _zeros(rc, bias.shape[:4] + (c,)) if rc.bias_kind == "travel"
                        else None)
  init = (_half(rc, travel, 0, c), _half(rc, travel, c, c), zeros_half(), zeros_half(),
          (_zeros(rc, q.shape), _zeros(rc, ()), dbias_local, carries))
  _, _, t_low, t_high, (dq, dscale, dbias_local, _) = lax.fori_loop(0, p, body, init)
  dk = jnp.concatenate([t_low[0], t_high[0]], axis=1)
  dv = jnp.concatenate([t_low[1], t_high[1]], axis=1)
  dbias = (jnp.concatenate([t_low[2], t_high[2]], axis=4) if rc.bias_kind == "travel"
           else dbias_local)
  return dq, dk, dv, dbias, None, dscale


# --------------------------------------------------------------------------------------------
# Passes over head groups: the custom VJP.
# --------------------------------------------------------------------------------------------

def _heads(x: Array | None, lo: Any, size: int) -> Array | None:
  """Heads [lo, lo + size) of a [Bb, Nb, ...] bias/mask/row array (all of a broadcast one)."""
  if x is None or x.shape[1] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, lo, size, axis=1)


def _pass_inputs(rc: _Ring, c: Any, qd, kd, vd, bias4, mask4, rsc):
  """The kernel-layout inputs of pass c (kv heads [c·kc, (c+1)·kc), query heads with them):
  q [X, G, t, H], k/v [X, s, H], bias/mask [Bb, Kb, Gb, t|1, s|1], row scales [X, G, t].

  The contract's input step (:func:`~attnx.core.contract.nonfinite_inputs`) runs here, on
  the pass' heads: on the whole inputs it would keep a cleaned copy of each (O(T/P) per
  input, for the whole backward); :func:`_clean_grads` is its gradient."""
  b, kc, g = rc.head_dims
  hq = kc * g
  q, k, v, bias = nonfinite_inputs(lax.dynamic_slice_in_dim(qd, c * hq, hq, axis=2),
                                   lax.dynamic_slice_in_dim(kd, c * kc, kc, axis=2),
                                   lax.dynamic_slice_in_dim(vd, c * kc, kc, axis=2),
                                   _heads(bias4, c * hq, hq))
  kv = lambda x: x.transpose(0, 2, 1, 3).reshape(b * kc, x.shape[1], x.shape[3])
  q4 = q.transpose(0, 2, 1, 3).reshape(b * kc, g, rc.t, q.shape[3])
  r3 = None if rsc is None else _heads(rsc, c * hq, hq).reshape(b * kc, g, rc.t)
  return (q4, kv(k), kv(v), common.as_5d(bias, hq, kc, "bias"),
          common.as_5d(_heads(mask4, c * hq, hq), hq, kc, "mask"), r3)


def _clean_grads(qd, kd, vd, bias4, dq, dk, dv, dbias):
  """The gradients through :func:`~attnx.core.contract.nonfinite_inputs`: zero at the entries
  it replaces (a non-finite q or k entry, every k entry of a key with a non-finite value, a
  non-finite value entry, a bias of +Inf), passed through elsewhere."""
  k_ok = jnp.isfinite(kd) & jnp.all(jnp.isfinite(vd), axis=-1, keepdims=True)
  dq = jnp.where(jnp.isfinite(qd), dq, 0)
  dk = jnp.where(k_ok, dk, 0)
  dv = jnp.where(jnp.isfinite(vd), dv, 0)
  if dbias is not None and jnp.issubdtype(bias4.dtype, jnp.floating):
    dbias = jnp.where(bias4 == jnp.inf, 0, dbias)
  return dq, dk, dv, dbias


def _pass_rows(rc: _Ring, c: Any, x: Array) -> Array:
  """Query heads of pass c of a [B, t, N, D] array, in the kernel layout [X, G, t, D]."""
  b, kc, g = rc.head_dims
  x = lax.dynamic_slice_in_dim(x, c * kc * g, kc * g, axis=2)
  return x.transpose(0, 2, 1, 3).reshape(b * kc, g, rc.t, x.shape[3])


def _put_heads(full: Array, part: Array, lo: Any, axis: int) -> Array:
  return lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), lo, axis=axis)


_PLAIN_DOTS = (scores_lib.get_score("dot"), scores_lib.get_score("scaled_dot"))
def _step_backend(implementation: str | None, backend: str | None, interpret: bool, w: Any,
                  vma: tuple[str, ...], dtype: Any, head_dim: int,
                  value_head_dim: int) -> str | None:
  """The Pallas backend ("gpu"/"tpu") every ring step runs, or None for the blocked kernel."""
  if implementation == "blocked":
    return None
  if implementation is None:  # attention's automatic choice, where the kernels can run
    if vma or ring_pallas.supported(w, "gpu") is not None or pa.decline_reason(
        backend, w, dtype, head_dim, value_head_dim=value_head_dim):
      return None
    return pa.resolve_backend(backend)
  be = pa.resolve_backend(backend, interpret)
  why = ring_pallas.supported(w, be) or pa.supported(
      w, backend=be, dtype=dtype, head_dim=head_dim, value_head_dim=value_head_dim,
      interpret=interpret)
  if why is None and vma:
    why = ("its inputs are typed by shard_map(check_vma=True), and the Pallas kernels' "
           "outputs carry no varying mesh axes yet: use check_vma=False")
  if why is not None:
    raise ValueError(f"ring_attention(implementation='pallas'): {why}.")
  return be


PASS_BUDGET = 1 << 19  # elements of one pass' query shard (B·t·heads·H) under the default


def _kv_heads_per_pass(block: int | None, b: int, kv_heads: int, g: int, length: int,
                       head_dim: int) -> int:
  """How many kv heads one pass of the ring carries: ``block`` when given (it must divide K),
  else the most whose query shard (B · length · kc·G · head dim) stays within
  :data:`PASS_BUDGET` elements (at least one)."""
  if block is not None:
    if (not isinstance(block, numbers.Integral) or isinstance(block, bool) or block < 1
        or kv_heads % block):
      raise ValueError(f"kv_head_block must be a positive int dividing the {kv_heads} kv "
                       f"heads, got {block!r}.")
    return int(block)
  fits = [d for d in range(1, kv_heads + 1)
          if kv_heads % d == 0 and b * length * d * g * head_dim <= PASS_BUDGET]
  return max(fits, default=1)


def _start_carries(rc: _Ring, extra: Any, do: Array) -> Any:
  """Stick-breaking: the carries each run of the backward starts from, (L, Σ A·dP) of the
  keys after the run, from the later runs' forward states (``extra``) and dO [X, G, t, Hv].
  They are rows only: computed before the backward's ring, the saved states die first."""
  if rc.family != "stick_breaking":
    return extra
  if rc.layout == "contiguous":
    o_high, l_high = extra
    return l_high, jnp.sum(do * o_high, axis=-1)
  # Each run starts from the carries of the runs after it: L = Σ log(1 − β) and Σ A·dP, whose
  # global weights are a run's own times e^{L of the later runs}.
  a = b = _zeros(rc, do.shape[:3])
  carries = []
  for st in extra + (None,):
    carries.append((a, b))
    if st is not None:
      b = b + jnp.exp(a) * jnp.sum(do * st.acc, axis=-1)
      a = a + st.log_rest
  return tuple(carries)


def _make_ring(rc: _Ring, passes: int):
  """A custom-VJP function (q [B, t, N, H], k/v [B, s, K, H|Hv], bias/mask [Bb, Nb, Tb, Sb],
  row scales [B, N, t], scale) -> O [B, t, N, Hv] of the local shards (see the module
  docstring for why the backward is not autodiff). ``rc`` describes one pass: its kv heads
  ``rc.head_dims[1]``, of ``passes`` passes that run one after another (``lax.scan``), each a
  whole ring over its heads, so that every ring buffer holds only the pass' heads."""

  zigzag_stick = rc.family == "stick_breaking" and rc.layout == "zigzag"
  forward = ((lambda rc, q, k, v, bias, mask, rsc, scale:
              _stick_zigzag_forward(rc, q, k, v, bias, mask, scale))
             if zigzag_stick else _forward)
  backward = _stick_zigzag_backward if zigzag_stick else _backward
  b, kc, g = rc.head_dims
  hq = kc * g

  def bthd(x: Array) -> Array:  # [X, G, t, D] of one pass -> [B, t, hq, D]
    return x.reshape(b, hq, x.shape[2], x.shape[3]).transpose(0, 2, 1, 3)

  def run(qd, kd, vd, bias4, mask4, rsc, scale):
    """(O [B, t, N, Hv] in q's dtype, per pass (row statistics, extra[, O in the compute
    dtype]))."""
    keep_f32 = qd.dtype != rc.dtype  # else O itself is the backward's compute-dtype output

    def one(out, c):
      o, stats, extra = forward(rc, *_pass_inputs(rc, c, qd, kd, vd, bias4, mask4, rsc),
                                scale)
      return _put_heads(out, bthd(o), c * hq, 2), (stats, extra, o if keep_f32 else None)

    out = bl.vary(jnp.zeros(qd.shape[:3] + vd.shape[3:], qd.dtype), rc.vma)
    if passes == 1:
      out, saved = one(out, 0)
      return out, jax.tree.map(lambda x: x[None], saved)
    return lax.scan(one, out, jnp.arange(passes))

  @jax.custom_vjp
  def ring(qd, kd, vd, bias4, mask4, rsc, scale):
    return run(qd, kd, vd, bias4, mask4, rsc, scale)[0]

  def fwd(qd, kd, vd, bias4, mask4, rsc, scale):
    out, saved = run(qd, kd, vd, bias4, mask4, rsc, scale)
    return out, (qd, kd, vd, bias4, mask4, rsc, scale, out, saved)

  def bwd(res, do):
    qd, kd, vd, bias4, mask4, rsc, scale, out, saved = res
    head_bias = bias4 is not None and bias4.shape[1] != 1

    def one(acc, xs):
      dq, dk, dv, dbias, drsc, dscale = acc
      c, (stats, extra, o32) = xs
      inputs = _pass_inputs(rc, c, qd, kd, vd, bias4, mask4, rsc)
      o = _pass_rows(rc, c, out).astype(rc.dtype) if o32 is None else o32
      gq, gk, gv, gb, gr, gs = backward(rc, inputs[:6] + (scale, o, stats, extra),
                                        _pass_rows(rc, c, do))
      dq = _put_heads(dq, bthd(gq), c * hq, 2)
      dk = _put_heads(dk, gk.reshape(b, kc, rc.s, -1).transpose(0, 2, 1, 3), c * kc, 2)
      dv = _put_heads(dv, gv.reshape(b, kc, rc.s, -1).transpose(0, 2, 1, 3), c * kc, 2)
      if gb is not None:
        gb = gb.reshape(gb.shape[0], -1, *gb.shape[3:])
        dbias = _put_heads(dbias, gb, c * hq, 1) if head_bias else dbias + gb
      if gr is not None:
        drsc = _put_heads(drsc, gr.reshape(b, hq, rc.t), c * hq, 1)
      return (dq, dk, dv, dbias, drsc, dscale + gs), None

    zeros = lambda x, dtype: None if x is None else _zeros(rc, x.shape).astype(dtype)
    acc = (zeros(qd, qd.dtype), zeros(kd, kd.dtype), zeros(vd, vd.dtype),
           zeros(bias4, rc.dtype), zeros(rsc, rc.dtype), _zeros(rc, ()))
    stats, extra, o32 = saved
    do_passes = (do.reshape(b, rc.t, passes, hq, -1).transpose(2, 0, 3, 1, 4)
                 .reshape(passes, b * kc, g, rc.t, -1).astype(rc.dtype))
    saved = (stats, jax.vmap(lambda e, d: _start_carries(rc, e, d))(extra, do_passes), o32)
    if passes == 1:
      acc, _ = one(acc, (0, jax.tree.map(lambda x: x[0], saved)))
    else:
      acc, _ = lax.scan(one, acc, (jnp.arange(passes), saved))
    dq, dk, dv, dbias, drsc, dscale = acc
    dq, dk, dv, dbias = _clean_grads(qd, kd, vd, bias4, dq, dk, dv, dbias)

    def like(ct, x):
      """The cotangent of an input that does not vary over the ring's axis (a replicated
      scale or bias, with check_vma=True) is the sum of every device's."""
      missing = tuple(a for a in bl.manual_axes(ct) if a not in bl.manual_axes(x))
      return (lax.psum(ct, missing) if missing else ct).astype(x.dtype)

    return (like(dq, qd), like(dk, kd), like(dv, vd),
            None if bias4 is None else like(dbias, bias4), None,
            None if rsc is None else like(drsc, rsc), like(dscale, scale))

  ring.defvjp(fwd, bwd)
  return ring


# --------------------------------------------------------------------------------------------
# SSMax: the global count of valid keys per row.
# --------------------------------------------------------------------------------------------

def _valid_counts(rc: _Ring, bias4: Array | None, mask4: Array | None, b: int,
                  n: int) -> Array:
  """[B, N, T_local] float32: how many keys of the whole sequence each local row attends."""
  p, t, s = rc.p, rc.t, rc.s
  i = lax.axis_index(rc.axis)
  qpos = _positions(i, t, p, rc.layout)
  kpos = np.concatenate([_positions(j, s, p, rc.layout, np) for j in range(p)])
  keys, rows, full = [], [], []
  for x, kind, is_bias in ((mask4, rc.mask_kind, False), (bias4, rc.bias_kind, True)):
    if x is None:
      continue
    valid = (x != -jnp.inf) if is_bias else x
    if kind == "const":
      rows.append(valid)
    elif kind == "travel":
      keys.append(lax.all_gather(valid, rc.axis, axis=3, tiled=True))
    else:
      full.append(valid)
  if full:
    valid = jnp.ones((1, 1, t, p * s), bool)
    for x in keys + rows + full:
      valid = valid & x
    if rc.is_causal:
      valid = valid & (jnp.asarray(kpos)[None, :] <= qpos[:, None])
    counts = jnp.sum(valid, axis=-1, dtype=F32)
  else:
    if keys:
      key = keys[0] if len(keys) == 1 else keys[0] & keys[1]
      if rc.is_causal:  # Σ_{j ≤ pos_i} valid_j from the natural order's running count
        natural = jnp.take(key, jnp.asarray(np.argsort(kpos)), axis=3).astype(F32)
        counts = jnp.take(jnp.cumsum(natural, axis=3)[:, :, 0], qpos, axis=2)
      else:
        counts = jnp.sum(key, axis=3, dtype=F32)  # [Bb, Nb, 1]
    else:
      counts = (qpos + 1).astype(F32) if rc.is_causal else jnp.full((t,), float(p * s), F32)
      counts = counts[None, None]
    for x in rows:
      counts = counts * x[..., 0].astype(F32)
  return jnp.broadcast_to(counts, (b, n, t))


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------

def _to_4d(x: Array | None, batch: tuple[int, ...], name: str) -> Array | None:
  """A [batch..., N|1, T|1, S|1]-broadcastable local bias/mask -> [B|1, N|1, T|1, S|1]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  full_rank = len(batch) + 3
  if x.ndim > full_rank:
    raise ValueError(f"{name} of local shape {x.shape} has more dims than [batch..., N, T, S].")
  x = x.reshape((1,) * (full_rank - x.ndim) + x.shape)
  lead = x.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(batch):])
  if any(d not in (1, b) for d, b in zip(lead, batch, strict=True)):
    raise ValueError(f"{name} of local shape {x.shape}: its batch dims must broadcast to "
                     f"{batch}.")
  x = jnp.broadcast_to(x, batch + x.shape[len(batch):])
  return x.reshape((-1,) + x.shape[len(batch):])


def ring_attention(q: Array, k: Array, v: Array, bias: Array | None = None,
                   mask: Array | None = None, *, axis_name: Any, weighting: Any = "softmax",
                   score: Any = "scaled_dot", scale: float | Array | None = None,
                   score_params: dict[str, Any] | None = None,
                   weighting_params: dict[str, Any] | None = None, is_causal: bool = False,
                   layout: str = "contiguous", block_q: int | None = None,
                   block_k: int | None = None, kv_head_block: int | None = None,
                   implementation: str | None = None, pallas_backend: str | None = None,
                   interpret: bool = False) -> Array:
  """Attention over a sequence sharded along mesh axis ``axis_name``: call it inside
  ``jax.shard_map`` (``check_vma`` either way) on the local shards.

  Args:
    q: the local queries ``[batch..., T/P, N, H]`` (P = ``lax.axis_size(axis_name)``).
    k: the local keys ``[batch..., S/P, K, H]``; N a multiple of K (GQA).
    v: the local values ``[batch..., S/P, K, Hv]``.
    bias, mask: as in :func:`attnx.core.attention` (additive; boolean, True = attend), local
      shards whose T axis is 1 or sharded with q and whose S axis is 1, sharded with k (then
      T must be 1: a key padding mask, which travels with K/V) or the whole S in the layout's
      order (see the module docstring).
    axis_name: the mesh axis the sequence is sharded over.
    weighting: F, as in :func:`attnx.core.attention`: every pointwise weighting, and the
      whole-row ``ssmax``, ``softpick`` and ``stick_breaking``. Sparsemax and α-entmax raise
      a ValueError naming the alternatives.
    score, scale, score_params, weighting_params: as in :func:`attnx.core.attention` (every
      score with a dot-product form; ``weighting_params={"s": s}`` for SSMax).
    is_causal: query i attends keys j ≤ i of the global sequence (needs T = S).
    layout: how the global sequence is laid out over the devices: ``"contiguous"`` (device i
      holds positions [i·T/P, (i+1)·T/P)) or ``"zigzag"`` (:func:`zigzag_permute`: 2P chunks,
      device i holds chunks i and 2P − 1 − i, which balances causal work: :func:`ring_work`).
      Without ``is_causal`` it changes nothing but which positions the outputs belong to.
    block_q, block_k: caps on the kernel's tiles (the tiles divide the local lengths).
    kv_head_block: kv heads per pass (a divisor of K; their query heads go with them): the
      ring runs once per pass, and its buffers hold only the pass' heads. None: as many as
      keep a pass' query shard (B · T/P · heads · H) within :data:`PASS_BUDGET` elements, one
      at least. More heads per pass: fewer, larger transfers and kernels; fewer: less memory.
    implementation: the kernel of every ring step: ``"blocked"`` (attnx's XLA blocked
      kernel), ``"pallas"`` (the Pallas kernels, :mod:`attnx.core.kernels.pallas.block`: Triton on a
      GPU, Mosaic on a TPU) or None: Pallas where the automatic choice of
      :func:`attnx.core.attention` would take it for this weighting, dtype and head size on
      ``jax.default_backend()`` (a GPU or TPU, a verified combination:
      :func:`attnx.core.kernels.pallas.verify.decline_reason`) and the inputs are not typed by
      ``check_vma=True`` (the Pallas kernels' outputs carry no varying axes yet), else blocked.
    pallas_backend: ``"gpu"`` or ``"tpu"``: the Pallas kernels to build (to lower for a chip
      from another host); None: ``jax.default_backend()``'s.
    interpret: run the Pallas kernels in Pallas' interpreter (any machine; slow, for tests).

  Returns:
    The local output ``[batch..., T/P, N, Hv]`` in q's dtype: the rows of the global attention
    this device holds.

  Raises:
    ValueError: outside a map over ``axis_name``, an unknown
      layout, shapes that do not split (causal needs equal local T and S, zigzag even ones;
      tiles divide the local lengths, which must not leave tiles of a few rows), a bias/mask
      sharded otherwise than documented, a weighting that cannot stream (sparsemax, entmax:
      the message names the alternatives), or the checks of :func:`attnx.core.attention`.

  Example:
    A causal ring over every device (one on a plain CPU: the ring then has one step); the
    result equals single-device attention:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from attnx import core
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q, k, v = (jax.random.normal(key, (2, 16 * n, 4, 8)) for key in (kq, kk, kv))
    >>> ring = jax.shard_map(
    ...     lambda q, k, v: core.ring_attention(q, k, v, axis_name="sp", is_causal=True),
    ...     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    >>> out = ring(q, k, v)  # [2, 16 n, 4, 8], sharded over "sp"
    >>> bool(jnp.allclose(out, core.attention(q, k, v, is_causal=True), atol=1e-3))
    True
  """
  p = _axis_size(axis_name)
  _check_layout(layout)
  if implementation not in (None, "blocked", "pallas"):
    raise ValueError(f"ring_attention runs attnx's blocked kernel or the Pallas kernels on "
                     f"every step: implementation must be None, 'blocked' or 'pallas', got "
                     f"{implementation!r}.")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    bad = not isinstance(blk, numbers.Integral) or isinstance(blk, bool) or blk < 1
    if blk is not None and bad:
      raise ValueError(f"{name} must be a positive int tile size or None, got {blk!r}.")
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  sc = scores_lib.get_score(score)
  dispatch._check_inputs(q, k, v, None, None, sc)
  w, sc, params, scale = dispatch._resolve(weighting, score, scale, score_params, q.shape[-1])
  family = check_supported(w, sc, layout)
  batch = q.shape[:-3]
  t, n, h = q.shape[-3:]
  s, kv_heads = k.shape[-3], k.shape[-2]
  if is_causal and t != s:
    raise ValueError(f"causal ring attention needs as many local queries as keys (T = S), "
                     f"got T/P = {t}, S/P = {s}.")
  if layout == "zigzag" and is_causal and t % 2:
    raise ValueError(f"the zigzag layout holds two chunks per device: the local length {t} "
                     f"must be even (the global length a multiple of 2·P = {2 * p}).")
  if layout == "zigzag" and family == "stick_breaking" and s % 2:
    raise ValueError(f"stick_breaking in the zigzag layout sends the two chunks of a shard "
                     f"around the ring apart: the local key length {s} must be even.")
  ssmax_s = dispatch._ssmax_param(w, weighting_params, n)
  if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = attend), got dtype "
                     f"{jnp.asarray(mask).dtype}.")
  bias4 = _to_4d(bias, batch, "bias")
  mask4 = _to_4d(mask, batch, "mask")
  for name, x in (("bias", bias4), ("mask", mask4)):
    if x is not None and x.shape[1] not in (1, n):
      raise ValueError(f"{name} of local shape {x.shape} has {x.shape[1]} heads, expected "
                       f"{n} or 1.")
  b = int(np.prod(batch)) if batch else 1
  rc = _Ring(axis=axis_name, p=p, layout=layout, is_causal=bool(is_causal), w=w, family=family,
             t=t, s=s, head_dims=(b, kv_heads, n // kv_heads),
             bias_kind=_kind_of(bias4, t, s, p, "bias"),
             mask_kind=_kind_of(mask4, t, s, p, "mask"), block_q=block_q, block_k=block_k,
             vma=bl.manual_axes(q, k, v, bias4, mask4, lax.axis_index(axis_name)))
  g = n // kv_heads
  kc = _kv_heads_per_pass(kv_head_block, b, kv_heads, g, max(t, s),
                          max(q.shape[-1], v.shape[-1]))
  backend = _step_backend(implementation, pallas_backend, interpret, w, rc.vma,
                          jnp.result_type(q.dtype, k.dtype, v.dtype), q.shape[-1], v.shape[-1])
  rc = dataclasses.replace(rc, head_dims=(b, kc, g), pallas=backend, interpret=interpret)
  if t == 0 or s == 0:
    return jnp.zeros(batch + (t, n, v.shape[-1]), q.dtype)
  _check_tiles(rc)

  query, key, value = q, k, v
  if sc not in _PLAIN_DOTS:  # the score's own vectors: from inputs the contract has cleaned
    query, key, value, _ = nonfinite_inputs(q, k, v, None)
  qd, kd = sc.to_dot(query, key, **params)
  compute = jnp.result_type(qd.dtype, kd.dtype, value.dtype)
  flat = lambda x: x.astype(compute).reshape((b,) + x.shape[len(batch):])
  qd, kd, value = flat(qd), flat(kd), flat(value)
  rc = dataclasses.replace(rc, dtype=compute_dtype(compute))  # float64 inputs: float64
  rsc = None
  if family == "ssmax":
    sv = jnp.asarray(w.stream.s if ssmax_s is None else ssmax_s, rc.dtype)
    if sv.ndim:
      sv = jnp.broadcast_to(sv.reshape(-1), (n,))[None, :, None]
    rsc = streaming.row_scale(w.stream, _valid_counts(rc, bias4, mask4, b, n), sv, rc.dtype)
  out = _make_ring(rc, kv_heads // kc)(qd, kd, value, bias4, mask4, rsc,
                                       jnp.asarray(scale, rc.dtype))
  return out.reshape(batch + out.shape[1:]).astype(q.dtype)


def check_supported(weighting: Any = "softmax", score: Any = "scaled_dot",
                    layout: str = "contiguous") -> str:
  """The streaming family :func:`ring_attention` runs ``weighting`` with (``"pointwise"``,
  ``"ssmax"``, ``"softpick"``, ``"stick_breaking"``); a ValueError naming the alternatives
  when the weighting, the score or the layout cannot run ring-parallel. For checks at
  construction (``attnx.nn``), before any shard_map."""
  _check_layout(layout)
  family = _family(get_weighting(weighting))
  sc = scores_lib.get_score(score)
  if sc.to_dot is None:
    raise ValueError(f"Score {sc.name!r} is not a dot product of transformed vectors and "
                     "cannot stream: ring_attention needs one (every built-in score but "
                     "'additive').")
  return family
