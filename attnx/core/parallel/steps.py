"""The ring's building blocks: its static description, the per-family state interface (empty,
merge, block state and gradients of a kind of step), what travels between devices and the
switch over the kinds of step. :mod:`attnx.core.parallel.ring` composes them into the forward
and backward rings, :mod:`attnx.core.parallel.stick_zigzag` into stick-breaking's zigzag runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import residuals, score_mods, streaming
from attnx.core.kernels import common
from attnx.core.kernels.xla import block as xla_block
from attnx.core.kernels.xla import pointwise as bl
from attnx.core.kernels.xla import sweep
from attnx.core.kernels.xla import tiling as tl
from attnx.core.parallel import layout as ring_layout
from attnx.core.weightings import Pointwise

Array = jax.Array
F32 = jnp.float32
# The families a ring runs: a pointwise F, and every whole-row family that streams in one pass
# over the keys (not sparsemax/entmax, whose threshold needs every key of the row first).
FAMILIES = ("pointwise",) + tuple(name for name in streaming.FAMILIES
                                  if not streaming.get_family(name).needs_threshold)


# --------------------------------------------------------------------------------------------
# The static description of one ring problem, and the kernels of its steps.
# --------------------------------------------------------------------------------------------

class BlockKernel(Protocol):
  """The kernels every ring step runs, given by the implementation object
  (:meth:`attnx.core.implementations.Implementation.ring_kernel`):
  :class:`attnx.core.kernels.xla.block.XlaBlockKernel` and
  :class:`attnx.core.kernels.pallas.block.PallasBlockKernel`.

  Layouts: q ``[X, G, t, H]``, k/v ``[X, s, H]``, bias/mask ``[Bb, Kb, Gb, t|1, s|1]``
  (X = B·K), row scales ``[X, G, t]``; ``cfg`` from :meth:`RingConfig.cfg`. With a score
  modification (``cfg.score_mod``) each method also takes ``mod=`` the block's
  :class:`~attnx.core.score_mods.ScoreMod` (:meth:`StepMod.piece`), and the gradients end
  with its cotangent.
  """

  def state(self, q, k, v, bias, mask, scale, cfg) -> Any:
    """The raw streaming state of a pointwise F over the block."""

  def row_state(self, q, k, v, bias, mask, row_scales, scale, cfg) -> Any:
    """The raw state of a whole-row family over the block."""

  def grads(self, q, k, v, bias, mask, scale, out, stat, do, cfg) -> Any:
    """(dq, dk, dv, dbias, dscale) of a pointwise F's block, given the rows' final output
    and statistic."""

  def row_grads(self, q, k, v, bias, mask, row_scales, scale, out, stats, do, carries,
                cfg) -> Any:
    """(dq, dk, dv, dbias, carries, dscale) of a whole-row family's block."""


@dataclasses.dataclass(frozen=True)
class RingConfig:
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
  mask_kind: str  # the same, or "structured" (a MaskRows: each step's block evaluated then)
  block_q: int | None = None  # caps on the step kernel's tiles
  block_k: int | None = None
  vma: tuple[str, ...] = ()  # axes the inputs vary over (check_vma=True): see sweep.vary
  kernel: BlockKernel = xla_block.XLA_BLOCK_KERNEL  # the kernels of every step
  dtype: Any = F32  # the compute dtype (contract.compute_dtype): float32, or float64
  # A structured mask: a step whose block allows no pair is skipped.
  skip_empty_steps: bool = False
  # A score modification (soft cap, score_mod): the kernels apply it per tile, at the global
  # positions of each step's rows and keys (:class:`StepMod`).
  score_mod: bool = False
  # Attention sinks: folded once into each device's first row state (:func:`sink_state`).
  sinks: bool = False

  @property
  def num_keys(self) -> int:
    return self.p * self.s

  @property
  def pointwise(self) -> bool:
    """Whether F is pointwise (the rules of :mod:`attnx.core.streaming.pointwise`)."""
    return isinstance(self.w, Pointwise)

  @property
  def stream(self) -> streaming.RowStream | None:
    """The whole-row weighting's stream; None for a pointwise F."""
    return stream_of(self.w)

  @property
  def reverse(self) -> bool:
    """Whether a merge takes the later keys first (:attr:`streaming.RowStream.reverse`): the
    ring keeps two runs of states, the shards up to this device's and those after it, and
    merges them at the end."""
    return self.stream is not None and self.stream.reverse

  @property
  def chunks_apart(self) -> bool:
    """Whether the two zigzag chunks of a shard travel around the ring apart, in opposite
    directions (:mod:`attnx.core.parallel.stick_zigzag`), so that every chunk arrives before
    the earlier chunks of its run: a reverse family in the zigzag layout."""
    return self.layout == "zigzag" and self.reverse

  @property
  def suffix_carries(self) -> bool:
    """Whether a block's backward starts from the carries of the keys after it
    (:attr:`streaming.RowStream.suffix_carries`): :func:`start_carries`."""
    return self.stream is not None and self.stream.suffix_carries

  @property
  def needs_row_scale(self) -> bool:
    """Whether the kernels take the per-row scale c_i of the whole row (SSMax), whose
    gradient the backward returns."""
    return self.stream is not None and self.stream.needs_row_scale

  def cfg(self, t: int, s: int, causal: bool) -> tl.TileConfig:
    cfg = bl.block_config(
        self.w, t, s, self.head_dims, is_causal=causal, has_mask=self.mask_kind != "none",
        has_bias=self.bias_kind != "none", num_keys=self.num_keys, block_q=self.block_q,
        block_k=self.block_k, whole_chunk=not self.pointwise)
    return dataclasses.replace(cfg, score_mod=True) if self.score_mod else cfg


@dataclasses.dataclass(frozen=True)
class StepMod:
  """The call's score modification on one ring step: its function sees the global positions
  (in the whole sequence, natural order) of this device's rows and of the visiting keys, and
  the global query head, where the step kernels' tiles give positions and heads local to
  their block and pass (:func:`attnx.core.kernels.xla.tiling.tile_positions`)."""

  mod: score_mods.ScoreMod  # the call's: cap, function, parameters
  qpos: Array  # int32 [t]: global positions of the local rows
  kpos: Array  # int32 [size]: global positions of the visiting keys (a shard, or half of one)
  head0: Any  # the pass' first query head

  def piece(self, r0: int, r1: int, k0: int, k1: int) -> score_mods.ScoreMod:
    """The modification of the block of local rows [r0, r1) and visiting keys [k0, k1)."""
    fn = self.mod.fn
    if fn is None:  # a cap alone reads no position
      return self.mod
    qpos = lax.slice_in_dim(self.qpos, r0, r1)
    kpos = lax.slice_in_dim(self.kpos, k0, k1)
    head0 = self.head0

    def at_global(score, b, h, q_idx, kv_idx, params):
      return fn(score, b, h + head0, qpos[q_idx], kpos[kv_idx], params)

    return score_mods.ScoreMod(cap=self.mod.cap, fn=at_global, params=self.mod.params)


@dataclasses.dataclass(frozen=True)
class OffsetMod:
  """A positional score modification (ALiBi, a relative-position table: a
  :class:`~attnx.core.score_mods.ScoreMod` with ``linear_bias`` or ``relative``) on a block
  whose rows and keys are each a contiguous run of global positions: the bias of the block's
  local row r and key c is the modification's at the global distance (r − c) + ``delta``, for
  the query heads [``head0``, ``head0`` + N of the block). What the kernels that take the
  modification as an operand rather than calling its function get
  (:class:`attnx.core.kernels.pallas.block.PallasBlockKernel`, whose ``offset_mods`` is
  True): their gradients end with the cotangent of ``mod`` (a ScoreMod of d params)."""

  mod: score_mods.ScoreMod
  delta: Array  # int32 scalar: global position of the block's first row − of its first key
  head0: Any


def offset_blocks(rc: RingConfig, mod: StepMod | None) -> bool:
  """Whether the step kernels run ``mod`` as :class:`OffsetMod` s on contiguous blocks (a
  positional modification on kernels that never call its function): each piece of a step
  then runs as its contiguous sub-blocks (:func:`blocks`)."""
  return (mod is not None and mod.mod.fn is not None
          and bool(getattr(rc.kernel, "offset_mods", False)))


def _runs(lo: int, hi: int, cut: int | None) -> list[tuple[int, int]]:
  """[lo, hi) cut at ``cut`` (the end of the first zigzag chunk), or whole."""
  if cut is None or not lo < cut < hi:
    return [(lo, hi)]
  return [(lo, cut), (cut, hi)]


def blocks(rc: RingConfig, pieces, s_blk: int, mod: StepMod | None):
  """The blocks (rows [lo, hi), keys [klo, khi), causal, kernel keywords) the kernels run for
  the ``pieces`` of a kind of step (in halves: :data:`attnx.core.parallel.layout.PIECES`)
  against ``s_blk`` visiting keys. Each piece is one block, with ``mod.piece``'s modification;
  with :func:`offset_blocks`, each piece runs as the blocks of its contiguous runs of rows and
  of keys (zigzag: each local chunk, each chunk of a visiting whole shard), with an
  :class:`OffsetMod`, the later keys' blocks of a row run first (the order of
  stick-breaking's merges and carries). A piece's causal mask is top-left aligned on its own
  rows and keys: a sub-block on its diagonal stays causal, one below it is full, one above
  it is skipped."""
  half = rc.t // 2
  rows_of = lambda a: rc.t if a == 2 else a * half  # in halves: 0, 1 or 2 (odd lengths: 2)
  keys_of = lambda a: s_blk if a == 2 else a * (s_blk // 2)
  out = []
  for r0, r1, k0, k1, causal in pieces:
    lo, hi, klo, khi = rows_of(r0), rows_of(r1), keys_of(k0), keys_of(k1)
    if not offset_blocks(rc, mod):
      kw = {} if mod is None else {"mod": mod.piece(lo, hi, klo, khi)}
      out.append((lo, hi, klo, khi, causal, kw))
      continue
    zigzag = rc.layout == "zigzag"
    row_cut = max(rc.t // 2, 1) if zigzag else None
    key_cut = s_blk // 2 if zigzag and s_blk == rc.s else None  # a half shard: one chunk
    for a, b in _runs(lo, hi, row_cut):
      for c, d in reversed(_runs(klo, khi, key_cut)):
        sub = causal
        if causal:
          ra, rb, ka, kb = a - lo, b - lo, c - klo, d - klo
          if rb <= ka:  # above the piece's diagonal: no pair
            continue
          if ra >= kb:
            sub = False
          elif (ra, rb) != (ka, kb):
            raise ValueError(f"a causal ring block of rows [{a}, {b}) and keys [{c}, {d}) "
                             "straddles its diagonal")
        off = OffsetMod(mod.mod, mod.qpos[a] - mod.kpos[c], mod.head0)
        out.append((a, b, c, d, sub, {"mod": off}))
  return out


def step_mod(rc: RingConfig, mod: tuple[Any, Any] | None, src: Any, off: int = 0,
             size: int | None = None) -> StepMod | None:
  """The :class:`StepMod` of a visit by the keys [off, off + size) of device ``src``'s shard;
  ``mod`` the pass' (ScoreMod, first query head), or None."""
  if mod is None:
    return None
  size = rc.s if size is None else size
  kpos = ring_layout.positions(src, rc.s, rc.p, rc.layout)
  if off or size != rc.s:
    kpos = lax.slice_in_dim(kpos, off, off + size)
  # The parameters typed as varying like the step's inputs (check_vma=True): the kernels'
  # VJP of a replicated one would sum its cotangent over the devices inside every step; the
  # ring sums the total once (the custom VJP's ``like``).
  smod = dataclasses.replace(mod[0], params=sweep.vary(mod[0].params, rc.vma))
  return StepMod(smod, ring_layout.positions(lax.axis_index(rc.axis), rc.t, rc.p, rc.layout),
                 kpos, mod[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskRows:
  """A structured mask of the whole sequence (:mod:`attnx.core.masks`, bound to the global
  problem: flat batch, N heads, P·t queries, P·s keys) on this device's rows: each ring step
  evaluates its block against the visiting shard's keys at their global positions (the ids and
  lengths are the mask's; only positions change), so a device holds one [t, s] block at a time,
  never its rows against every key. ``head0`` is the first query head of a pass over heads,
  ``heads`` how many it has."""

  mask: Any
  head0: Any
  heads: int = dataclasses.field(metadata=dict(static=True))

  def block4(self, rc: RingConfig, src: Any, off: int = 0, size: int | None = None) -> Array:
    """The block [Bb, N|1, t, size] of this device's rows against the keys [off, off + size)
    of device ``src``'s shard."""
    size = rc.s if size is None else size
    qpos = ring_layout.positions(lax.axis_index(rc.axis), rc.t, rc.p, rc.layout)
    kpos = ring_layout.positions(src, rc.s, rc.p, rc.layout)
    if off or size != rc.s:
      kpos = lax.slice_in_dim(kpos, off, off + size)
    heads = self.head0 + jnp.arange(self.heads)
    m = self.mask.mask_mod(jnp.arange(rc.head_dims[0])[:, None, None, None],
                           heads[None, :, None, None], qpos[None, None, :, None],
                           kpos[None, None, None, :])
    m = jnp.asarray(m, bool)
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    return jnp.broadcast_to(m, m.shape[:2] + (rc.t, size))

  def block(self, rc: RingConfig, src: Any, off: int = 0, size: int | None = None) -> Array:
    """:meth:`block4` in the step kernels' layout [Bb, K|1, G|1, t, size]."""
    return common.as_5d(self.block4(rc, src, off, size), self.heads, rc.head_dims[1], "mask")


def kind_of(x: Array | None, t: int, s: int, p: int, name: str) -> str:
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
MIN_TILE, SHORT = 8, 64


def check_tiles(rc: RingConfig) -> None:
  """Every block of the ring runs unpadded tiles that divide its length (the blocks of all
  steps must share the rows' layout): refuse lengths whose tiles would be a few rows."""
  half_t, half_s = rc.t // 2, rc.s // 2
  shapes = {(rc.t, rc.s, rc.is_causal)}
  if rc.layout == "zigzag" and rc.is_causal:
    shapes |= {(rc.t, half_s, False), (half_t, rc.s, False)}
  if rc.chunks_apart:
    shapes |= {(rc.t, half_s, False), (half_t, half_s, rc.is_causal), (half_t, half_s, False)}
  for t, s, causal in shapes:
    cfg = rc.cfg(t, s, causal)
    for name, length, tile in (("query", t, cfg.bq), ("key", s, cfg.bk)):
      if tile < min(MIN_TILE, length) and length >= SHORT:
        raise ValueError(
            f"ring_attention tiles its blocks without padding, and a {name} block of {length} "
            f"positions only splits into tiles of {tile}: use local lengths (zigzag: chunk "
            f"lengths) that are multiples of {MIN_TILE} (pad the sequence and mask the "
            "padding keys).")


def stream_of(w: Any) -> streaming.RowStream | None:
  """The stream of a whole-row weighting ``w``; None for a pointwise F."""
  return None if isinstance(w, Pointwise) else w.stream


def family_of(w: Any) -> str:
  if isinstance(w, Pointwise):
    return "pointwise"
  stream = getattr(w, "stream", None)
  if stream is None:
    raise ValueError(f"Weighting {w.name!r} normalizes whole rows and has no streaming form, so "
                     "it cannot run ring-parallel: gather K/V (lax.all_gather(..., tiled=True) "
                     "along the sequence) and call attnx.core.attention, or use a streamable "
                     "weighting.")
  if stream.needs_threshold:
    raise ValueError(
        f"Weighting {w.name!r} cannot run ring-parallel: its threshold τ_i needs every key of "
        "the row before the first weight (several passes over all keys). Gather K/V with "
        "lax.all_gather(..., axis=1, tiled=True) and call attnx.core.attention on the local "
        "queries (O(T) memory per device), or use a streamable weighting (softmax, sigmoid, "
        "ssmax, softpick, ...).")
  return stream.family


def axis_size(axis_name: Any) -> int:
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

def sl(x: Array, axis: int, lo: int, size: int) -> Array:
  return x if x.shape[axis] == 1 else lax.slice_in_dim(x, lo, lo + size, axis=axis)


def add_at(full: Array, part: Array, axis: int, lo: Any) -> Array:
  """full with `part` added at offset `lo` along `axis` (no-op offset on a size-1 axis)."""
  if full.shape[axis] == part.shape[axis]:
    return full + part
  cur = lax.dynamic_slice_in_dim(full, lo, part.shape[axis], axis=axis)
  return lax.dynamic_update_slice_in_dim(full, cur + part, lo, axis=axis)


def add_rows_keys(full: Array, part: Array, r0: int, k0: Any) -> Array:
  starts = [0, 0, 0, r0 if full.shape[3] != 1 else 0, k0 if full.shape[4] != 1 else 0]
  if full.shape == part.shape:
    return full + part
  cur = lax.dynamic_slice(full, starts, part.shape)
  return lax.dynamic_update_slice(full, cur + part, starts)


def tree_rows(tree: Any, lo: int, size: int) -> Any:
  return jax.tree.map(lambda a: lax.slice_in_dim(a, lo, lo + size, axis=2), tree)


def put_tree_rows(tree: Any, part: Any, lo: int) -> Any:
  return jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b, lo, axis=2), tree,
                      part)


def select(pred: Array, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


# --------------------------------------------------------------------------------------------
# The family interface: empty state, merge, finalize, block state and block gradients.
# --------------------------------------------------------------------------------------------

def zeros(rc: RingConfig, shape: tuple[int, ...]) -> Array:
  """Zeros of the compute dtype typed like the ring's inputs (loop starts and branch
  results)."""
  return sweep.vary(jnp.zeros(shape, rc.dtype), rc.vma)


def empty(rc: RingConfig, rows: tuple[int, ...], hv: int) -> Any:
  """The state of rows that have seen no key."""
  if rc.pointwise:
    return sweep.vary(streaming.pointwise_empty(rc.w, rows, hv, rc.dtype), rc.vma)
  return sweep.vary(streaming.init(rc.w.stream, rows, hv, rc.dtype), rc.vma)


def merge(rc: RingConfig, a: Any, b: Any) -> Any:
  """a ∪ b; for stick-breaking ``a`` holds the later keys."""
  if rc.pointwise:
    return streaming.pointwise_merge(rc.w, a, b)
  return streaming.merge(rc.w.stream, a, b)


def part(rc: RingConfig, state: Any) -> tuple[Array, Any]:
  """A raw state's public part ``(out, residual)`` (:mod:`attnx.core.residuals`): the form in
  which the ring merges its steps, with the public merge rule (:func:`merge_parts`)."""
  if rc.pointwise:
    out, stat = streaming.pointwise_finalize(rc.w, *state)
    return out, residuals.from_stats(rc.w, (stat,))
  out, stats, _ = streaming.finalize(rc.w.stream, state, None)
  return out, residuals.from_stats(rc.w, stats)


def merge_parts(rc: RingConfig, a: tuple[Array, Any], b: tuple[Array, Any]) -> tuple[Array, Any]:
  """a ∪ b of two parts by :func:`attnx.core.residuals.merge_parts`, the rule behind
  :func:`attnx.core.merge_attention`; for stick-breaking ``a`` holds the later keys."""
  return residuals.merge_parts(rc.w, [b, a] if rc.reverse else [a, b])


def block_state(rc: RingConfig, q, kv, bias, mask, rsc, scale, r0, r1, k0, k1, causal,
                kw: dict):
  """The raw state of local rows [r0, r1) against keys [k0, k1) of the visiting shard
  (``kw``: the kernels' keywords, :func:`blocks`)."""
  k, v = kv
  cfg = rc.cfg(r1 - r0, k1 - k0, causal)
  qp = lax.slice_in_dim(q, r0, r1, axis=2)
  kp, vp = lax.slice_in_dim(k, k0, k1, axis=1), lax.slice_in_dim(v, k0, k1, axis=1)
  bp = None if bias is None else sl(sl(bias, 3, r0, r1 - r0), 4, k0, k1 - k0)
  mp = None if mask is None else sl(sl(mask, 3, r0, r1 - r0), 4, k0, k1 - k0)
  rp = None if rsc is None else lax.slice_in_dim(rsc, r0, r1, axis=2)
  if rc.pointwise:
    return rc.kernel.state(qp, kp, vp, bp, mp, scale, cfg, **kw)
  return rc.kernel.row_state(qp, kp, vp, bp, mp, rp, scale, cfg, **kw)


def kind_state(rc: RingConfig, pieces, q, kv, bias, mask, rsc, scale, hv: int,
               mod: StepMod | None = None) -> Any:
  """The raw state of every local row over the visiting keys (``kv``: a shard, or half of
  one), from the ``pieces`` of a kind of step (:data:`attnx.core.parallel.layout.PIECES`; empty
  rows where none). ``mod``: the step's score modification, or None."""
  state = empty(rc, q.shape[:2] + (rc.t,), hv)
  todo = blocks(rc, pieces, kv[0].shape[1], mod)
  for lo, hi, klo, khi, causal, kw in todo:
    part = block_state(rc, q, kv, bias, mask, rsc, scale, lo, hi, klo, khi, causal, kw)
    if (lo, hi) == (0, rc.t) and len(todo) == 1:  # the only block: nothing to merge with
      state = part
    else:  # (stick-breaking: the state holds the later keys, :func:`blocks`' order)
      state = put_tree_rows(state, merge(rc, tree_rows(state, lo, hi - lo), part), lo)
  return sweep.vary(state, rc.vma)  # every kind of step: the same type


def kind_grads(rc: RingConfig, pieces, q, kv, bias, mask, rsc, scale, out, stats, do, carries,
               mod: StepMod | None = None):
  """(dq, (dk, dv), dbias block, carries, dscale) of one kind of step (its ``pieces``), zeros
  where the step computes nothing, and with a score modification ``mod`` the gradient of its
  parameters last. (Adding into the running sums inside the step's branch instead measured
  more scratch: XLA copies the operands of the branches.)"""
  k, v = kv
  dq = zeros(rc, q.shape)
  dk, dv = zeros(rc, k.shape), zeros(rc, v.shape)
  db = None if bias is None else zeros(rc, bias.shape)
  dscale = zeros(rc, ())
  dmod = None if mod is None else jax.tree.map(lambda x: zeros(rc, x.shape), mod.mod.params)
  for lo, hi, klo, khi, causal, kw in blocks(rc, pieces, k.shape[1], mod):
    cfg = rc.cfg(hi - lo, khi - klo, causal)
    rows = lambda a, lo=lo, hi=hi: lax.slice_in_dim(a, lo, hi, axis=2)
    keys = lambda a, lo=klo, hi=khi: lax.slice_in_dim(a, lo, hi, axis=1)
    bp = None if bias is None else sl(sl(bias, 3, lo, hi - lo), 4, klo, khi - klo)
    mp = None if mask is None else sl(sl(mask, 3, lo, hi - lo), 4, klo, khi - klo)
    if rc.pointwise:
      gq, gk, gv, gb, gs, *gm = rc.kernel.grads(rows(q), keys(k), keys(v), bp, mp, scale,
                                                rows(out), rows(stats[0]), rows(do), cfg, **kw)
    else:
      rp = None if rsc is None else rows(rsc)
      gq, gk, gv, gb, part_carries, gs, *gm = rc.kernel.row_grads(
          rows(q), keys(k), keys(v), bp, mp, rp, scale, rows(out), tuple(map(rows, stats)),
          rows(do), tree_rows(carries, lo, hi - lo), cfg, **kw)
      carries = put_tree_rows(carries, part_carries, lo)
    if mod is not None:
      dmod = jax.tree.map(lambda a, g: a + g.astype(a.dtype), dmod, gm[0].params)
    dq, dk, dv = add_at(dq, gq, 2, lo), add_at(dk, gk, 1, klo), add_at(dv, gv, 1, klo)
    if db is not None:
      db = add_rows_keys(db, gb, lo, klo)
    dscale = dscale + gs
  res = (dq, (dk, dv), db, carries, dscale) + (() if mod is None else (dmod,))
  return sweep.vary(res, rc.vma)  # every kind: the same type


# --------------------------------------------------------------------------------------------
# Ring steps: what travels, which kind of step, the switch.
# --------------------------------------------------------------------------------------------

def perm(p: int) -> list[tuple[int, int]]:
  return [(j, (j + 1) % p) for j in range(p)]  # device i receives from i − 1


def step_inputs(rc: RingConfig, travel, bias, mask, src):
  """(k, v), bias block, mask block of the step on the shard of device ``src``."""
  k, v, bias_t, mask_t = travel

  def pick(local, travelling, kind):
    if kind == "travel":
      return travelling
    if kind == "rows":
      return lax.dynamic_slice_in_dim(local, src * rc.s, rc.s, axis=4)
    if kind == "structured":
      return local.block(rc, src)
    return local

  return (k, v), pick(bias, bias_t, rc.bias_kind), pick(mask, mask_t, rc.mask_kind)


def travelling_arrays(rc: RingConfig, k, v, bias, mask):
  return (k, v, bias if rc.bias_kind == "travel" else None,
          mask if rc.mask_kind == "travel" else None)


def step_kinds(rc: RingConfig) -> tuple[int, ...]:
  """The kinds of step this ring runs, in the order :func:`branch` numbers them."""
  if not rc.is_causal:
    return (ring_layout.FULL,)
  if rc.layout == "contiguous":
    return (ring_layout.DIAG, ring_layout.FULL, ring_layout.SKIP)
  return (ring_layout.ZZ_DIAG, ring_layout.ZZ_LOW, ring_layout.ZZ_HIGH)


def branch(rc: RingConfig, i: Array, src: Array) -> Array:
  """Which of :func:`kinds` device i runs on the shard of device ``src``: the decision of
  :func:`ring_layout.step_kind`, as an index for ``lax.switch``."""
  kind = ring_layout.step_kind(i, src, rc.layout, rc.is_causal)
  kinds = step_kinds(rc)
  return sum(jnp.where(kind == kd, n, 0) for n, kd in enumerate(kinds) if n)


def switch(rc: RingConfig, i: Array, src: Array, run, *operands, mask: Array | None = None):
  """run(kind)(*operands) for the step's kind: one instance of each kind's kernel in the
  program (one loop over the steps, ``lax.switch`` inside), which keeps both the compile
  time and XLA's scratch memory (each instance gets its own) down. With
  ``rc.skip_empty_steps``, a step whose ``mask`` block allows no pair runs the skipped kind
  (no work: an empty state, zero gradients)."""
  kinds = step_kinds(rc)
  if rc.skip_empty_steps and mask is not None:
    index = branch(rc, i, src) if len(kinds) > 1 else 0
    index = jnp.where(jnp.any(mask), index, len(kinds))
    fns = [run(kd) for kd in kinds] + [run(ring_layout.SKIP)]
    return lax.switch(index, fns, *operands)
  if len(kinds) == 1:
    return run(kinds[0])(*operands)
  return lax.switch(branch(rc, i, src), [run(kd) for kd in kinds], *operands)


def start_carries(rc: RingConfig, extra: Any, do: Array) -> Any:
  """Stick-breaking: the carries each run of the backward starts from, (L, Σ A·dP) of the
  keys after the run, from the later runs' forward states (``extra``) and dO [X, G, t, Hv].
  They are rows only: computed before the backward's ring, the saved states die first."""
  if not rc.suffix_carries:
    return extra
  if rc.layout == "contiguous":
    o_high, l_high = extra
    return l_high, jnp.sum(do * o_high, axis=-1)
  # Each run starts from the carries of the runs after it: L = Σ log(1 − β) and Σ A·dP, whose
  # global weights are a run's own times e^{L of the later runs}.
  a = b = zeros(rc, do.shape[:3])
  carries = []
  for part in extra + (None,):
    carries.append((a, b))
    if part is not None:  # (O, log survival) of a run
      b = b + jnp.exp(a) * jnp.sum(do * part[0], axis=-1)
      a = a + part[1]
  return tuple(carries)


# --------------------------------------------------------------------------------------------
# Attention sinks: a virtual key of score sinks[h] and zero value in every row, folded once
# into each device's first row state; its gradient from the rows' saved statistics.
# --------------------------------------------------------------------------------------------

def _row_heads(rc: RingConfig) -> Array:
  """The query head (within the pass) of each [X, G] row of the kernel layout."""
  b, kc, g = rc.head_dims
  x = jnp.arange(b * kc, dtype=jnp.int32)[:, None]
  return (x % kc) * g + jnp.arange(g, dtype=jnp.int32)[None, :]


def _sink_z(rc: RingConfig, sinks: Array, rows: tuple[int, ...]) -> Array:
  """The sink's score of every local row, [X, G, t, 1] (a key tile of one key)."""
  z = sinks.astype(rc.dtype)[_row_heads(rc)]
  return jnp.broadcast_to(z[:, :, None, None], rows + (1,))


def sink_state(rc: RingConfig, sinks: Array, rows: tuple[int, ...], hv: int,
               rsc: Array | None) -> Any:
  """The raw state of rows [X, G, t] that have seen only the sink (``sinks``: the pass' [hq]):
  the first state of every device's rows, into which each step's state merges (so the sink
  counts once per row, whatever the number of steps)."""
  z = _sink_z(rc, sinks, rows)
  w = rc.w
  if rc.pointwise:
    acc, st = streaming.pointwise_empty(w, rows, hv, rc.dtype)
    v = jnp.zeros(rows[:2] + (1, acc.shape[-1]), rc.dtype)
    if w.divides_by_sum:  # Σ F rides in the ones column
      v = v.at[..., hv].set(1.0)
    if w.online_max:
      state = streaming.online_max_update(acc, st, z * w.alpha, None, v, log_f=w.log_f)
    else:
      state = streaming.pointwise_update(w, acc, st, z, None, v, rc.num_keys)
  else:
    rs = w.stream
    state = streaming.update(rs, streaming.init(rs, rows, hv, rc.dtype), z,
                             jnp.ones(z.shape, bool), jnp.zeros(rows[:2] + (1, hv), rc.dtype),
                             rsc)
  return sweep.vary(state, rc.vma)


def sink_grads(rc: RingConfig, sinks: Array, out: Array, stats: tuple[Array, ...], do: Array,
               carries: Any, rsc: Array | None) -> tuple[Array, Any]:
  """(d sinks [hq], carries) of the pass' rows: the sink is a key of zero value (dP = 0), so
  its cotangent comes from the rows' final output and statistics alone (the blocked kernels'
  rule, :func:`attnx.core.kernels.xla.sweep.sink_grad`); a whole-row family's grad carries
  (SSMax's dc) gain the sink's term."""
  w = rc.w
  delta = jnp.sum(do.astype(rc.dtype) * out, axis=-1)  # [X, G, t]
  if rc.pointwise:
    grad_rows = streaming.pointwise_grad_rows(w, stats[0], delta)
    ds = sweep.sink_grad(sinks.astype(rc.dtype), 0, rc.cfg(rc.t, rc.s, False), grad_rows,
                         sinks.shape[0])
    return ds, carries
  z = _sink_z(rc, sinks, delta.shape)
  _, dz, gc = streaming.tile_grad(w.stream, z, jnp.ones(z.shape, bool),
                                  jnp.zeros(z.shape, rc.dtype), stats, delta,
                                  streaming.GradCarry(*carries), rsc)
  heads = _row_heads(rc)
  per_head = jnp.sum(dz[..., 0], axis=2)  # [X, G]
  ds = jnp.zeros(sinks.shape, rc.dtype).at[heads.reshape(-1)].add(per_head.reshape(-1))
  return ds, (gc.a, gc.b)
