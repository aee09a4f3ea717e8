"""Structured masks (:mod:`attnx.core.masks`) inside the Pallas kernels, never as a T×S array.

A bound mask reaches a kernel as two things, the mask-to-block metadata apart from the kernel
(as JAX's splash attention keeps them):

* **spans**, computed before the kernels from :meth:`~attnx.core.masks.Mask.block_table`: for
  every query tile the first and one-past-last key tile that some pair of it may attend (the
  forward and dQ kernels loop over those key tiles only), for every key tile the query tiles
  (the dK/dV kernel's loop); int32 ``[B or 1, tiles]``, the union over heads; and inside each
  span the run of tiles whose every pair attends for every head (**full spans**: there the
  kernels run without the elementwise mask, as splash attention's full blocks and
  FlexAttention's ``full_kv`` blocks; only the span's boundary tiles evaluate it);
* **the mask's arrays**, loaded tile by tile: a per-batch leaf (lengths, prefixes) as one
  scalar, a per-position leaf (segment ids) as the tile's slice. Inside the kernel the mask is
  rebuilt from those values and evaluated with :meth:`~attnx.core.masks.Mask.local_mod` on the
  tile's positions (:meth:`KernelMask.tile`): no gathers, nothing but the tile.

The GPU kernels get every piece as an ordinary operand (a block of one entry per program for
the spans and scalars); the TPU kernels get the scalars and spans as scalar prefetch (SMEM; the
index maps read the spans too, so a skipped tile issues no DMA) and the ids in lane-friendly
layouts (query ids ``[B, Tp, 128]``, key ids ``[B, 8, Sp]``, as splash attention lays out its
segment ids).

A ``from_fn`` mask whose ``mask_mod`` closes over arrays cannot be traced inside a kernel
(a Pallas kernel captures no constants): :func:`kernel_reason` says so and the caller
materializes it instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from attnx.core.kernels.common import tile_span

Array = jax.Array
LANES = 128  # TPU lanes (query ids replicated over them)
SUBLANES = 8  # TPU sublanes (key ids replicated over them)

__all__ = ["KernelMask", "MaskPlan", "gpu_operands", "gpu_view", "kernel_reason", "narrow",
           "prepare", "tile_counts", "tpu_ids", "tpu_prefetch", "tpu_span", "tpu_view"]

# The three loops a mask bounds: the forward's and dQ's key tiles per query tile, dK/dV's
# query tiles per key tile.
KINDS = ("fwd", "dq", "dkv")
# The span arrays per kind: (lo, hi) of the visited tiles, (full_lo, full_hi) of the unmasked.
SPAN_REFS = 4


@dataclasses.dataclass(frozen=True)
class MaskPlan:
  """The static side of a bound mask in the kernels (part of the kernels' config).

  Attributes:
    treedef: the mask's pytree structure (its sizes: windows, chunks, ``mask_mod``).
    kinds: per array leaf, ``"batch"``, ``"q"`` or ``"kv"`` (:meth:`Mask.leaf_kinds`).
    batched: per array leaf, whether it has the full batch (else one row for every batch).
    spans_batched: whether the spans differ per batch.
  """

  treedef: Any
  kinds: tuple[str, ...]
  batched: tuple[bool, ...]
  spans_batched: bool

  @property
  def scalars(self) -> tuple[bool, ...]:
    """The per-batch leaves' ``batched`` flags, in leaf order."""
    return tuple(f for k, f in zip(self.kinds, self.batched, strict=True) if k == "batch")

  @property
  def ids(self) -> tuple[tuple[str, bool], ...]:
    """``(kind, batched)`` of the per-position leaves, in leaf order."""
    return tuple((k, f) for k, f in zip(self.kinds, self.batched, strict=True) if k != "batch")

  @property
  def num_scalars(self) -> int:
    return len(self.scalars)

  @property
  def num_ids(self) -> int:
    return len(self.ids)

  @property
  def num_prefetch(self) -> int:
    """The scalar-prefetch refs of a TPU kernel (:func:`tpu_prefetch`): scalars, then spans."""
    return self.num_scalars + SPAN_REFS


def kernel_reason(mask: Any) -> str | None:
  """Why a bound mask cannot be evaluated inside a Pallas kernel, or None."""
  treedef = jax.tree.structure(mask)
  i32 = jax.ShapeDtypeStruct((8, 8), jnp.int32)
  s32 = jax.ShapeDtypeStruct((), jnp.int32)
  # The leaves as the kernel sees them (tile values): arguments, so only captures are consts.
  closed = jax.make_jaxpr(lambda leaves, b, h, q, k: jax.tree.unflatten(treedef, leaves)
                          .local_mod(b, h, q, k))([i32] * treedef.num_leaves, s32, s32, i32, i32)
  if closed.consts:
    return ("its mask_mod closes over arrays, which a Pallas kernel cannot capture (pass "
            "them as a mask's leaves: segment_ids, seq_lengths, prefix_lm)")
  return None


# --------------------------------------------------------------------------------------------
# Before the kernels: the plan, the spans and the laid-out leaves.
# --------------------------------------------------------------------------------------------

def _spans(mask: Any, bq: int, bk: int, nq: int, nk: int, axis: int, t: int | None = None,
           s: int | None = None) -> tuple[Array, Array, Array, Array]:
  """(lo, hi, full_lo, full_hi) int32 [B|1, nq or nk]: the tiles along ``axis`` (1: key tiles
  of each query tile, 0: query tiles of each key tile) that some pair of some head may attend,
  among the real T queries and S keys (``t``, ``s``: rows and keys past them, the kernels'
  padding, attend nothing, so a tile only they could attend is not visited), and within them
  the first run of tiles whose every pair attends for every head (empty: ``full_lo =
  full_hi``). The full run ignores padding: a kernel bounded by lengths narrows it itself
  (:func:`attnx.core.kernels.pallas.common.kv_full`)."""
  some, every = mask.block_table(bq, bk, nq, nk)  # [B|1, N|1, nq, nk]
  some, every = jnp.any(some, axis=1), jnp.all(every, axis=1)
  if t is not None and s is not None:
    some = _real_tiles(mask, some, bq=bq, bk=bk, t=t, s=s)
  lo, hi = jax.vmap(lambda k: tile_span(k.astype(jnp.int32), axis))(some)
  every = jnp.broadcast_to(every, jnp.broadcast_shapes(every.shape, some.shape[:1] + (1, 1)))
  flo, fhi = jax.vmap(lambda e, lo_, hi_: _full_run(e, axis, lo_, hi_))(every, lo, hi)
  return tuple(x.astype(jnp.int32) for x in (lo, hi, flo, fhi))


def _full_run(every: Array, axis: int, lo: Array, hi: Array) -> tuple[Array, Array]:
  """The first run [full_lo, full_hi) of True along ``axis`` of a [nq, nk] table, inside
  [lo, hi) of each tile of the other axis (full_lo = full_hi where there is none)."""
  n = every.shape[axis]
  idx = jnp.expand_dims(jnp.arange(n), 1 - axis)
  inside = (idx >= jnp.expand_dims(lo, axis)) & (idx < jnp.expand_dims(hi, axis))
  every = every & inside
  flo = jnp.min(jnp.where(every, idx, n), axis=axis)
  fhi = jnp.min(jnp.where(~every & (idx >= jnp.expand_dims(flo, axis)), idx, n), axis=axis)
  flo = jnp.minimum(flo, hi)
  return flo, jnp.clip(fhi, flo, hi)


@functools.partial(jax.jit, static_argnames=("bq", "bk", "t", "s"))
def _real_tiles(mask: Any, some: Array, *, bq: int, bk: int, t: int, s: int) -> Array:
  """``some`` [B|1, nq, nk] of the padded grid restricted to the real positions: tiles past
  the last real query or key tile attend nothing, and the last real row and column of tiles
  are asked again at their real extents (:meth:`~attnx.core.masks.Mask.tile_range` of the
  real rows and keys only: the padded ones would widen the tile's span). Unchanged (no op)
  when T and S fill whole tiles."""
  nq, nk = some.shape[-2:]
  iq, ik = (max(t, 1) - 1) // bq, (max(s, 1) - 1) // bk
  rq, rk = t - iq * bq, s - ik * bk  # the last real tiles' real rows and keys
  if iq == nq - 1 and ik == nk - 1 and rq == bq and rk == bk:
    return some
  some = some & (jnp.arange(nq) <= iq)[:, None] & (jnp.arange(nk) <= ik)[None, :]
  heads = lambda x: jnp.any(jnp.asarray(x), axis=-1) if jnp.ndim(x) >= 2 else jnp.asarray(x)

  def at(q0, sq, k0, sk):  # some pair of the tile, [B|1] (any head)
    some_, _ = mask.tile_range(q0, sq, k0, sk)
    return heads(jnp.broadcast_to(some_, jnp.broadcast_shapes(jnp.shape(some_), (1, 1))))

  b = some.shape[0]
  fix = lambda x: jnp.broadcast_to(x, (b,))
  corner = fix(at(iq * bq, rq, ik * bk, rk))
  if rq < bq:  # the last real query tile's row (its last real key tile: the corner)
    row = jax.vmap(lambda k0: fix(at(iq * bq, rq, k0, bk)), out_axes=1)(jnp.arange(ik) * bk)
    row = jnp.concatenate([row, corner[:, None]], axis=1)
    some = some.at[:, iq, :ik + 1].set(some[:, iq, :ik + 1] & row)
  if rk < bk:  # the last real key tile's column
    col = jax.vmap(lambda q0: fix(at(q0, bq, ik * bk, rk)), out_axes=1)(jnp.arange(iq) * bq)
    col = jnp.concatenate([col, corner[:, None]], axis=1)
    some = some.at[:, :iq + 1, ik].set(some[:, :iq + 1, ik] & col)
  return some


def prepare(mask: Any, tiles: dict[str, tuple[int, int]], tp: int, sp: int,
            t: int | None = None, s: int | None = None) -> tuple[MaskPlan, dict[str, Any]]:
  """The plan and the operands of a bound mask for kernels whose tiles are ``tiles`` (``{"fwd":
  (bq, bk), "dq": ..., "dkv": ...}``) on sequences of ``t`` queries and ``s`` keys (default:
  ``tp``, ``sp``) padded to ``tp`` and ``sp``: the spans hold the tiles with an attended pair
  among the real positions.

  Operands: ``leaves`` (the mask's arrays as int32, ids padded with their last value; padded
  positions are masked by the kernels' bounds anyway) and per kernel kind its spans ``(lo,
  hi, full_lo, full_hi)`` (:func:`_spans`)."""
  leaves, treedef = jax.tree.flatten(mask)
  kinds = mask.leaf_kinds()
  if len(kinds) != len(leaves):
    raise ValueError(f"{type(mask).__name__}.leaf_kinds() names {len(kinds)} leaves, the mask "
                     f"has {len(leaves)}.")
  out = []
  for kind, x in zip(kinds, leaves, strict=True):
    x = jnp.asarray(x, jnp.int32)
    if kind == "batch":
      x = x.reshape(-1)
    else:
      size = tp if kind == "q" else sp
      x = jnp.pad(x, ((0, 0), (0, size - x.shape[1])), mode="edge")
    out.append(x)
  spans = {}
  for name, (bq, bk) in tiles.items():
    spans[name] = _spans(mask, bq, bk, tp // bq, sp // bk, 0 if name == "dkv" else 1, t, s)
  spans_batched = any(v[0].shape[0] > 1 for v in spans.values())
  if spans_batched:
    b = max(v[0].shape[0] for v in spans.values())
    spans = {k: tuple(jnp.broadcast_to(x, (b, x.shape[1])) for x in v) for k, v in spans.items()}
  plan = MaskPlan(treedef=treedef, kinds=tuple(kinds),
                  batched=tuple(x.shape[0] > 1 for x in out), spans_batched=spans_batched)
  return plan, {"leaves": out, **spans}


def tile_counts(mask: Any, bq: int, bk: int, t: int, s: int) -> dict[str, Any]:
  """How the forward kernel (tiles ``bq`` × ``bk``) meets a bound mask over all its rows, for
  :func:`attnx.core.explain`: the key tiles its loops leave out ("skipped"), those they run
  without the elementwise mask ("unmasked": the full spans) and those they run with it
  ("masked": the spans' boundary tiles)."""
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  lo, hi, flo, fhi = (np.asarray(x) for x in _spans(mask, bq, bk, tp // bq, sp // bk, 1, t, s))
  total = lo.shape[0] * (tp // bq) * (sp // bk)
  # The kernels mask the padded rows and keys of the last tiles: those are never full.
  whole_rows = (np.arange(tp // bq) + 1) * bq <= t
  full = np.where(whole_rows, np.maximum(np.minimum(fhi, s // bk) - flo, 0), 0)
  run = int((hi - lo).sum()) if lo.shape[0] else 0
  full = int(full.sum()) if lo.shape[0] else 0
  return {"tiles": (bq, bk), "skipped": total - run, "unmasked": full, "masked": run - full}


def _batch(batched: bool, bb: Any) -> Any:
  return bb if batched else 0


def _split(plan: MaskPlan, leaves: list) -> tuple[list, list]:
  """(per-batch scalars, per-position ids) of the leaves, each with its batched flag."""
  scal = [(x, f) for k, x, f in zip(plan.kinds, leaves, plan.batched, strict=True)
          if k == "batch"]
  ids = [(k, x, f) for k, x, f in zip(plan.kinds, leaves, plan.batched, strict=True)
         if k != "batch"]
  return scal, ids


# --------------------------------------------------------------------------------------------
# In a kernel.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KernelMask:
  """A structured mask inside one kernel program.

  Attributes:
    plan: the :class:`MaskPlan`.
    b: the program's flat batch index (``mask_mod``'s ``b``).
    lo, hi: the span of the program's loop (key tiles of its query tile, or query tiles of its
      key tile).
    full_lo, full_hi: the run of tiles inside it that need no elementwise mask.
    scalars: the per-batch leaves' values at ``b``, in leaf order.
    ids: the per-position leaves' refs, in leaf order.
    q_ids, kv_ids: ``(ref, r0 | c0, shape) -> [bq, bk] int32``: a query leaf's values at rows
      [r0, r0 + bq) broadcast along the keys, a key leaf's at columns [c0, c0 + bk) along the
      queries (each lowering's layout).
  """

  plan: MaskPlan
  b: Any
  lo: Any
  hi: Any
  full_lo: Any
  full_hi: Any
  scalars: list
  ids: list
  q_ids: Callable[..., Array]
  kv_ids: Callable[..., Array]

  def tile(self, h: Any, shape: tuple[int, int], r0: Any, c0: Any) -> Array:
    """Boolean ``shape`` = [bq, bk]: the mask on queries [r0, r0 + bq) × keys [c0, c0 + bk)
    of query head ``h``."""
    rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    scalars, ids = iter(self.scalars), iter(self.ids)
    leaves = []
    for kind in self.plan.kinds:
      if kind == "batch":
        leaves.append(next(scalars))
      else:
        ref = next(ids)
        leaves.append(self.q_ids(ref, r0, shape) if kind == "q" else self.kv_ids(ref, c0, shape))
    m = jax.tree.unflatten(self.plan.treedef, leaves).local_mod(self.b, h, rows, cols)
    # Compared as int32 after the broadcast (Triton: no broadcasts of i1 arrays).
    return jnp.broadcast_to(jnp.asarray(m).astype(jnp.int32), shape) != 0

  def clip(self, lo: Any, hi: Any) -> tuple[Any, Any]:
    """The kernel's own span [lo, hi) (causal, lengths) narrowed to the mask's."""
    return narrow((self.lo, self.hi), lo, hi)

  def clip_full(self, lo: Any, hi: Any) -> tuple[Any, Any]:
    """The kernel's own full run [lo, hi) narrowed to the mask's."""
    return narrow((self.full_lo, self.full_hi), lo, hi)


def narrow(span: tuple[Any, Any], lo: Any, hi: Any) -> tuple[Any, Any]:
  """[lo, hi) narrowed to a mask's ``span`` (empty: lo = hi)."""
  lo = jnp.maximum(lo, span[0])
  return lo, jnp.maximum(jnp.minimum(hi, span[1]), lo)


# GPU (Triton): every piece an operand; grids are (tile, batch, head) for every kernel.

def gpu_operands(plan: MaskPlan, ops: dict[str, Any], kind: str, bq: int, bk: int, tp: int,
                 sp: int) -> tuple[list[Array], list[pl.BlockSpec]]:
  """The arrays and BlockSpecs of a GPU kernel of ``kind`` (its grid's first axis: query tiles
  for "fwd"/"dq", key tiles for "dkv"): scalars, ids, then the spans (lo, hi, full_lo,
  full_hi)."""
  scal, ids = _split(plan, ops["leaves"])
  arrays, specs = [], []
  for x, f in scal:
    arrays.append(x)
    specs.append(pl.BlockSpec((1,), lambda t, bb, h, f=f: (_batch(f, bb),)))
  for k, x, f in ids:
    own = (k == "q") == (kind != "dkv")  # the program's own tile of this axis
    size = (bq if k == "q" else bk) if own else (tp if k == "q" else sp)
    arrays.append(x)
    specs.append(pl.BlockSpec((None, size), lambda t, bb, h, f=f, own=own:
                              (_batch(f, bb), t if own else 0)))
  for x in ops[kind]:
    arrays.append(x)
    specs.append(pl.BlockSpec((None, 1), lambda t, bb, h, f=plan.spans_batched:
                              (_batch(f, bb), t)))
  return arrays, specs


def gpu_view(plan: MaskPlan, refs: list, kind: str, bq: int, bk: int) -> KernelMask:
  """The :class:`KernelMask` of a GPU program from its refs (:func:`gpu_operands`' order)."""
  it = iter(refs)
  scalars = [next(it)[0] for _ in range(plan.num_scalars)]
  ids = [next(it) for _ in range(plan.num_ids)]
  lo, hi, flo, fhi = (next(it)[0] for _ in range(SPAN_REFS))
  q_own, kv_own = kind != "dkv", kind == "dkv"

  def q_ids(ref, r0, shape):
    x = ref[...] if q_own else ref[pl.ds(r0, bq)]
    return jnp.broadcast_to(x[:, None], shape)

  def kv_ids(ref, c0, shape):
    x = ref[...] if kv_own else ref[pl.ds(c0, bk)]
    return jnp.broadcast_to(x[None, :], shape)

  return KernelMask(plan, pl.program_id(1), lo, hi, flo, fhi, scalars, ids, q_ids, kv_ids)


# TPU (Mosaic): scalars and spans as scalar prefetch, ids in lane-friendly layouts.

def tpu_prefetch(plan: MaskPlan, ops: dict[str, Any], kind: str) -> list[Array]:
  """The scalar-prefetch arrays of a TPU kernel of ``kind`` (after its lengths): the scalars,
  then the spans (lo, hi, full_lo, full_hi) flattened to 1-D."""
  scal, _ = _split(plan, ops["leaves"])
  return [x for x, _ in scal] + [x.reshape(-1) for x in ops[kind]]


def tpu_ids(plan: MaskPlan, ops: dict[str, Any]) -> list[Array]:
  """The id leaves laid out for the TPU: query ids [B|1, Tp, 128], key ids [B|1, 8, Sp]."""
  _, ids = _split(plan, ops["leaves"])
  return [jnp.broadcast_to(x[:, :, None], x.shape + (LANES,)) if k == "q"
          else jnp.broadcast_to(x[:, None, :], (x.shape[0], SUBLANES, x.shape[1]))
          for k, x, _ in ids]


def tpu_span(plan: MaskPlan, pre: list, bb: Any, t: Any, n: int,
             full: bool = False) -> tuple[Any, Any]:
  """(lo, hi) of tile ``t`` of batch ``bb`` from a kernel's mask prefetch refs (``n`` tiles
  per batch), or with ``full`` its (full_lo, full_hi); usable in index maps."""
  first = plan.num_scalars + (2 if full else 0)
  idx = _batch(plan.spans_batched, bb) * n + t
  return pre[first][idx], pre[first + 1][idx]


def tpu_view(plan: MaskPlan, pre: list, ids: list, bb: Any, t: Any, n: int, bq: int, bk: int,
             q_whole: bool, kv_whole: bool) -> KernelMask:
  """The :class:`KernelMask` of a TPU program: ``pre`` its mask prefetch refs, ``ids`` its id
  refs, ``t`` its tile along its grid's looped axis (``n`` per batch); ``q_whole`` /
  ``kv_whole``: whether an id block holds the whole padded sequence (sliced per tile) or
  the program's tile."""
  scalars = [pre[i][_batch(f, bb)] for i, f in enumerate(plan.scalars)]
  lo, hi = tpu_span(plan, pre, bb, t, n)
  flo, fhi = tpu_span(plan, pre, bb, t, n, full=True)

  def q_ids(ref, r0, shape):
    x = ref[pl.ds(pl.multiple_of(r0, SUBLANES), bq), :] if q_whole else ref[...]
    return jnp.broadcast_to(x[:, :1], shape)

  def kv_ids(ref, c0, shape):
    x = ref[:, pl.ds(pl.multiple_of(c0, LANES), bk)] if kv_whole else ref[...]
    return jnp.broadcast_to(x[:1, :], shape)

  return KernelMask(plan, bb, lo, hi, flo, fhi, scalars, ids, q_ids, kv_ids)
