"""Ring attention's per-step entry points on the Pallas kernels (Triton on a GPU, Mosaic on a TPU).

A ring step (:mod:`attnx.core.parallel.ring`) computes the raw streaming state of the local query
rows against one visiting key shard, and in the backward the gradients of that block given the rows'
final (global) output and statistics. The XLA entry points are
:func:`attnx.core.kernels.xla.pointwise.raw_block_state` /
:func:`~attnx.core.kernels.xla.pointwise.block_grads` (pointwise F) and
:func:`attnx.core.kernels.xla.rows.raw_block_state` / :func:`~attnx.core.kernels.xla.rows.
block_grads` (SSMax, softpick, stick-breaking). This module has the same functions, same arguments,
layouts (q [X, G, t, H], k/v [X, s, H], bias/mask [Bb, Kb, Gb, t|1, s|1], X = B·K) and ``cfg``
(:func:`attnx.core.kernels.xla.pointwise.block_config`), same results, computed by the Pallas
kernels (:mod:`attnx.core.kernels.pallas`, through :mod:`.wrapper`'s entry points); the keyword-only
``backend`` ("gpu"/"tpu") and ``interpret`` choose the kernels, ``block_q``/``block_k`` cap their
tiles (the cfg's tiles are the XLA kernel's; Pallas has its own rules, and pads the block).

The Pallas forward returns a *normalized* block (O, row statistic); its raw state is recovered
exactly from them (:mod:`.states`), so that states of Pallas and XLA blocks merge with the
streaming rules (:func:`attnx.core.streaming.pointwise_merge`, :func:`~attnx.core.streaming.merge`)
and are normalized once. The denominator offset (softmax_plus_one) and softpick's
ε belong to the whole row, so the block's kernel runs without them (a weighting with offset 0,
ε = 0) and :func:`~attnx.core.streaming.pointwise_finalize` / ``finalize`` add them once after the
merge, as for the XLA states. F sees ``cfg.num_keys`` keys (sigmoid's default b = −log n of the
global n). The diagonal block (``cfg.is_causal``) is causal, top-left aligned.

The backward runs the Pallas backward of the block with the rows' global statistics (online
max: the lse in base 2, as the kernels read it) and δ = dO·O of the global output. The scale
is folded into q (as :func:`.wrapper.pallas_attention` does with an array
scale), so dscale = Σ dQ'·q. The bias gradient materializes the block's dS [B, N, t, s] in
float32 (the Pallas kernels' rule) and is summed over the bias' broadcast dims. Results are
float32 like the XLA ones, rounded to the input dtype by the kernels first (16-bit inputs).

Whole-row carries (:class:`attnx.core.streaming.GradCarry`): SSMax's dc = Σ z·dy adds the
kernel's dc to the carry in. Stick-breaking's weights in a block are its local weights times
e^{L₀} (L₀ the stick the later keys left): the kernels start from an empty stick, so they get
dO·e^{L₀} and δ − (Σ A·dP of the later keys), which gives exactly the block's gradients. The
carries out (L₀ + L_block, Σ A·dP + e^{L₀}·dO·O_block) need the block's own (O, L), which the
Pallas backward does not return: the backward runs the block's Pallas forward once more for them
(one forward pass per step more than the XLA path; exposing the dQ pass's final carries in
:mod:`.rows` would save it). Sparsemax and α-entmax have no ring form (their
threshold needs every key of the row first): :func:`supported` says so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core import streaming
from attnx.core.kernels import common
from attnx.core.kernels.pallas import tiles, wrapper
from attnx.core.kernels.pallas.common import KernelConfig, grad_rows
from attnx.core.kernels.pallas.states import block_weighting, pointwise_state, row_state
from attnx.core.kernels.xla import tiling as tl
from attnx.core.weightings import Pointwise, get_weighting

Array = jax.Array
F32 = jnp.float32
LN2 = math.log(2.0)

__all__ = ["PallasBlockKernel", "block_grads", "raw_block_state", "raw_row_block_state",
           "row_block_grads", "supported"]


@dataclasses.dataclass(frozen=True)
class PallasBlockKernel:
  """The ring's steps (:class:`attnx.core.parallel.steps.BlockKernel`) on the Pallas kernels:
  the functions below with the ``backend`` ("gpu"/"tpu") and ``interpret`` of this object.
  :class:`attnx.core.kernels.xla.block.XlaBlockKernel` is the same on the XLA kernels."""

  backend: str
  interpret: bool = False
  # A positional modification comes as a block's OffsetMod (attnx.core.parallel.steps): the
  # kernels take it as a relative table at the block's distances, never calling its function.
  offset_mods: ClassVar[bool] = True

  def state(self, *args: Any, mod: Any = None) -> Any:
    """:func:`raw_block_state` (pointwise F)."""
    return raw_block_state(*args, backend=self.backend, interpret=self.interpret, mod=mod)

  def row_state(self, *args: Any, mod: Any = None) -> Any:
    """:func:`raw_row_block_state` (whole-row families)."""
    return raw_row_block_state(*args, backend=self.backend, interpret=self.interpret, mod=mod)

  def grads(self, *args: Any, mod: Any = None) -> Any:
    """:func:`block_grads` (pointwise F)."""
    return block_grads(*args, backend=self.backend, interpret=self.interpret, mod=mod)

  def row_grads(self, *args: Any, mod: Any = None) -> Any:
    """:func:`row_block_grads` (whole-row families)."""
    return row_block_grads(*args, backend=self.backend, interpret=self.interpret, mod=mod)


def supported(weighting: Any, backend: str) -> str | None:
  """Why a ring step cannot run ``weighting`` on the Pallas kernels of ``backend`` ("gpu",
  "tpu" and their aliases), or None when it can: every pointwise F, SSMax, softpick and
  stick-breaking. (Whether a dtype or head size fits the kernels is
  :func:`.tiles.supported`'s; the entry points check it.)"""
  try:
    tiles.resolve_backend(backend)
  except ValueError as e:
    return str(e)
  try:
    w = get_weighting(weighting)
  except (TypeError, ValueError) as e:
    return str(e)
  if isinstance(w, Pointwise):
    return None
  rs = getattr(w, "stream", None)
  if rs is None:
    return (f"weighting {w.name!r} normalizes whole rows and has no streaming form, so it has "
            "no ring step")
  if rs.needs_threshold:
    return (f"weighting {w.name!r} ({rs.family}) has no ring step: its threshold τ_i needs "
            "every key of the row before the first weight")
  return None


# --------------------------------------------------------------------------------------------
# Layouts: the ring's kernel layout (q [X, G, t, H], k/v [X, s, H], rows [X, G, t], bias/mask
# [Bb, Kb, Gb, t|1, s|1]) <-> the Pallas kernels' ([B, T, N, H], rows [B, N, T], [Bb, Nb, T, S]).
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Block:
  """One block's Pallas problem: the kernels' config and padded operands, and its sizes."""
  cfg: KernelConfig
  q: Array
  k: Array
  v: Array
  bias: Array | None
  mask: Array | None
  q_len: Array
  kv_len: Array
  b: int
  kv_heads: int
  t: int
  s: int
  hv: int
  ext: Array | None = None  # a positional modification's relative table at the block
  ext_vjp: Any = None  # d ext -> d params of the modification


def _btnh(x: Array, b: int, kv_heads: int) -> Array:
  """[X, G, t, D] -> [B, t, N, D] (query head n = kv head · G + g)."""
  _, g, t, d = x.shape
  return x.reshape(b, kv_heads, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, kv_heads * g, d)


def _xgtd(x: Array, blk: _Block, d: int) -> Array:
  """The inverse of :func:`_btnh` on a padded kernel output [B, Tp, N, Dp]: [X, G, t, d]."""
  b, _, n, _ = x.shape
  g = n // blk.kv_heads
  x = x[:, :blk.t, :, :d].reshape(b, blk.t, blk.kv_heads, g, d)
  return x.transpose(0, 2, 3, 1, 4).reshape(b * blk.kv_heads, g, blk.t, d)


def _bnt(r: Array, blk: _Block) -> Array:
  """Row values [X, G, t] -> [B, N, Tp] (zero padded)."""
  r = r.astype(F32).reshape(blk.b, -1, blk.t)
  return wrapper.pad_to(r, {2: blk.cfg.tp})


def _xgt(r: Array, blk: _Block) -> Array:
  """Row values [B, N, Tp] -> [X, G, t]."""
  return r[:, :, :blk.t].reshape(blk.b * blk.kv_heads, -1, blk.t)


def _keys(x: Array, b: int) -> Array:
  """[X, s, D] -> [B, s, K, D]."""
  return x.reshape(b, -1, *x.shape[1:]).transpose(0, 2, 1, 3)


def _keys_back(x: Array, blk: _Block, d: int) -> Array:
  """A padded [B, Sp, K, Dp] kernel output -> [X, s, d] float32."""
  return x[:, :blk.s, :, :d].transpose(0, 2, 1, 3).reshape(-1, blk.s, d).astype(F32)


def _heads4(x: Array | None, kv_heads: int, g: int) -> Array | None:
  """A [Bb, Kb, Gb, t|1, s|1] bias/mask -> [Bb, 1|N, t|1, s|1] (each dim 1 or full)."""
  if x is None:
    return None
  bb, kb, gb = x.shape[:3]
  if kb == gb == 1:
    return x[:, 0]
  x = jnp.broadcast_to(x, (bb, kv_heads, g) + x.shape[3:])
  return x.reshape((bb, kv_heads * g) + x.shape[3:])


def _block(q, k, v, bias, mask, scale, cfg: tl.TileConfig, w: Any, backend: str, interpret: bool,
           block_q: int | None, block_k: int | None, mod: Any = None) -> _Block:
  """The Pallas problem of one ring block (its tiles, F's key count, causality from ``cfg``);
  ``w`` the weighting the kernels run (the cfg's, maybe without its offset or ε); ``mod`` the
  block's :class:`~attnx.core.score_mods.ScoreMod` (a soft cap, which reads no position), an
  :class:`~attnx.core.parallel.steps.OffsetMod` (ALiBi or a relative table at the block's
  global distances: :func:`_offset_ext`) or None."""
  cap = _step_cap(mod)
  b, kv_heads, g = cfg.head_dims
  _, _, t, h = q.shape
  s, hv = k.shape[1], v.shape[-1]
  be = tiles.resolve_backend(backend, interpret)
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  reason = tiles.supported(w, backend=be, dtype=q.dtype, head_dim=h, value_head_dim=hv)
  if reason:
    raise ValueError(f"the Pallas ring step cannot run this: {reason}.")
  blocks, launch = tiles.kernel_tiles(be, w, t, s, h, hv, q.dtype, block_q, block_k)
  kcfg, (qp, kp, vp, bp, mp) = wrapper.kernel_inputs(
      _btnh(q, b, kv_heads), _keys(k, b), _keys(v, b), _heads4(bias, kv_heads, g),
      _heads4(mask, kv_heads, g), weighting=w, scale=jnp.asarray(scale, F32), backend=be,
      interpret=interpret, blocks=blocks, launch=launch, is_causal=cfg.is_causal,
      q_bound=False, kv_bound=False, num_keys=cfg.num_keys)
  if cap is not None:  # the plain kernels' tiles otherwise, op for op
    kcfg = dataclasses.replace(kcfg, cap=cap)
  ext = ext_vjp = None
  if _is_offset(mod):
    ext, ext_vjp = jax.vjp(
        lambda params: _offset_ext(mod, params, kv_heads * g, t, s), mod.mod.params)
    kcfg = dataclasses.replace(kcfg, relative=True, rel_offset=s - 1)
  return _Block(kcfg, qp, kp, vp, bp, mp, jnp.full((b,), t, jnp.int32),
                jnp.full((b,), s, jnp.int32), b, kv_heads, t, s, hv, ext, ext_vjp)


def _is_offset(mod: Any) -> bool:
  return mod is not None and hasattr(mod, "delta")


def _offset_ext(mod: Any, params: Any, n: int, t: int, s: int) -> Array:
  """The relative table [n, t + s − 1] float32 of an :class:`~attnx.core.parallel.steps.
  OffsetMod` on a block of t rows and s keys: column u holds the bias of the local distance
  u − (s − 1) (the kernels read it at r − c + ``rel_offset``, rel_offset = s − 1), i.e. of the
  global distance u − (s − 1) + delta, for the pass' query heads [head0, head0 + n). ALiBi's
  −m_h·δ (causal) or −m_h·abs(δ) (symmetric), a table's entry at clip(δ, ±(L − 1)/2): O(n·(t +
  s)) values, built with jnp outside the kernels, so that the gradient of ``params`` is
  autodiff's of this function from the kernels' d ext."""
  smod = mod.mod
  dist = jnp.arange(t + s - 1, dtype=jnp.int32) - (s - 1) + jnp.asarray(mod.delta, jnp.int32)
  rows = lax.dynamic_slice_in_dim(params, jnp.asarray(mod.head0, jnp.int32), n, axis=0)
  rows = rows.astype(F32)
  if smod.linear_bias is not None:
    d = jnp.abs(dist) if smod.linear_bias == "symmetric" else dist
    return -rows[:, None] * d.astype(F32)[None, :]
  if smod.relative:
    half = (rows.shape[1] - 1) // 2
    return jnp.take(rows, jnp.clip(dist, -half, half) + half, axis=1)
  raise ValueError("the Pallas ring step runs ALiBi (core.alibi) and relative tables "
                   "(core.relative_table), not another score_mod function.")


def _step_cap(mod: Any) -> float | None:
  """The soft cap of a ring step's modification (None without one); ValueError for a
  ``score_mod`` function that does not come as an OffsetMod (the kernels' positions would be
  the block's: the ring gives ALiBi and tables as OffsetMods, and refuses other functions)."""
  if mod is None:
    return None
  if _is_offset(mod):
    return mod.mod.cap
  if mod.fn is not None:
    raise ValueError("the Pallas ring step runs a logits_soft_cap, ALiBi or a relative table "
                     "at the blocks' global positions (an OffsetMod), not a score_mod "
                     "function; use the XLA steps.")
  return mod.cap


def _mod_grad(mod: Any, blk: _Block | None = None, d_ext: Array | None = None) -> tuple:
  """What the gradients end with for a step's modification (the XLA steps' contract): its
  cotangent, a ScoreMod (a soft cap's being the ScoreMod itself, no parameters; an OffsetMod's
  the d params that autodiff of its table at the block gives from d ext, zeros for an empty
  block); nothing without one."""
  if mod is None:
    return ()
  if not _is_offset(mod):
    return (mod,)
  if blk is None:
    dparams = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), mod.mod.params)
  else:
    (dparams,) = blk.ext_vjp(d_ext.astype(F32))
  return (dataclasses.replace(mod.mod, params=dparams),)


def _scaled_grads(dq, dk, dv, ds, q, bias, scale, blk: _Block):
  """(dq, dk, dv, dbias, dscale) float32 in the ring's layout from the kernels' padded
  gradients of q' = q·scale (the folded scale)."""
  h = q.shape[-1]
  dq_z = _xgtd(dq, blk, h).astype(F32)  # ∂/∂q' (α included)
  q_fin = jnp.where(jnp.isfinite(q), q, jnp.zeros((), q.dtype)).astype(F32)
  dscale = jnp.sum(dq_z * q_fin)
  dbias = None
  if bias is not None:
    g = dq_z.shape[1]
    ds5 = ds[:, :, :blk.t, :blk.s].reshape(blk.b, blk.kv_heads, g, blk.t, blk.s)
    dbias = common.sum_to(ds5, bias.shape).astype(F32)
  return (dq_z * scale, _keys_back(dk, blk, h), _keys_back(dv, blk, blk.hv), dbias,
          dscale.astype(F32))


def _empty_grads(q, k, v, bias):
  z = lambda x: jnp.zeros(x.shape, F32)
  return z(q), z(k), z(v), None if bias is None else z(bias), jnp.zeros((), F32)


# --------------------------------------------------------------------------------------------
# Pointwise F.
# --------------------------------------------------------------------------------------------

def raw_block_state(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                    scale: Array, cfg: tl.TileConfig, *, backend: str, interpret: bool = False,
                    block_q: int | None = None,
                    block_k: int | None = None, mod: Any = None) -> tuple[Array, Array]:
  """:func:`attnx.core.kernels.xla.pointwise.raw_block_state` on the Pallas forward: the raw state
  (acc, st) of every query row over this block's keys for a pointwise F, in the XLA layout and units
  (merges with XLA states by :func:`attnx.core.streaming.pointwise_merge`)."""
  w = cfg.w
  x, g, t, _ = q.shape
  s, hv = k.shape[1], v.shape[-1]
  if t == 0 or s == 0:
    return streaming.pointwise_empty(w, (x, g, t), hv, F32)
  blk = _block(q, k, v, bias, mask, scale, cfg, block_weighting(w), backend, interpret, block_q,
               block_k, mod)
  o, stat = wrapper.forward(blk.cfg, blk.q, blk.k, blk.v, blk.bias, blk.mask, blk.q_len,
                            blk.kv_len, out_dtype=F32, slopes=blk.ext)
  counted = blk.cfg.needs_valid(mask is not None)
  return pointwise_state(w, _xgtd(o, blk, hv), _xgt(stat, blk), counted, s)


def block_grads(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                scale: Array, out: Array, stat: Array, do: Array, cfg: tl.TileConfig, *,
                backend: str, interpret: bool = False, block_q: int | None = None,
                block_k: int | None = None, mod: Any = None):
  """:func:`attnx.core.kernels.xla.pointwise.block_grads` on the Pallas backward: (dq, dk, dv,
  dbias, dscale) float32 of this block's scores given the rows' final output ``out`` and statistic
  ``stat`` (:func:`attnx.core.streaming.pointwise_finalize` of the merged state)."""
  w = cfg.w
  if q.shape[2] == 0 or k.shape[1] == 0:
    return _empty_grads(q, k, v, bias) + _mod_grad(mod)
  blk = _block(q, k, v, bias, mask, scale, cfg, block_weighting(w), backend, interpret, block_q,
               block_k, mod)
  if w.online_max:  # the kernels' statistic is a log2-sum-exp
    stat = stat * (1.0 / LN2)
  hvp = blk.v.shape[-1]
  pad_rows = lambda a: wrapper.pad_to(_btnh(a.astype(F32), blk.b, blk.kv_heads),
                                      {1: blk.cfg.tp, 3: hvp})
  do_k = pad_rows(do)
  rows = grad_rows(blk.cfg, _bnt(stat, blk), pad_rows(out), do_k)
  dq, dk, dv, ds, *d_ext = wrapper.backward(
      blk.cfg, blk.q, blk.k, blk.v, blk.bias, blk.mask, blk.q_len, blk.kv_len,
      do_k.astype(blk.q.dtype), rows, want_ds=bias is not None, slopes=blk.ext)
  return (_scaled_grads(dq, dk, dv, ds, q, bias, scale, blk)
          + _mod_grad(mod, blk, d_ext[0] if d_ext else None))


# --------------------------------------------------------------------------------------------
# Whole-row families: SSMax, softpick, stick-breaking.
# --------------------------------------------------------------------------------------------

def _row_weighting(w: Any) -> Any:
  """The weighting the block's kernels run: softpick without ε (the row's, added once by
  :func:`attnx.core.streaming.finalize` after the merge); the others as they are."""
  rs = getattr(w, "stream", None)
  if rs is None or rs.needs_threshold:
    raise ValueError(f"the Pallas ring step cannot run this: {supported(w, 'gpu')}.")
  return block_weighting(w)


def _row_forward(blk: _Block, row_scales: Array | None) -> tuple[Array, Array]:
  """The block's normalized (O [X, G, t, Hv] float32, statistic [X, G, t])."""
  rowc = None if row_scales is None else _bnt(row_scales, blk)
  o, stats, _ = wrapper.row_forward(blk.cfg, blk.q, blk.k, blk.v, rowc, blk.bias, blk.mask,
                                    blk.q_len, blk.kv_len, out_dtype=F32, slopes=blk.ext)
  return _xgtd(o, blk, blk.hv), _xgt(stats[0], blk)


def raw_row_block_state(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                        row_scales: Array | None, scale: Array, cfg: tl.TileConfig, *, backend: str,
                        interpret: bool = False, block_q: int | None = None,
                        block_k: int | None = None, mod: Any = None) -> Any:
  """:func:`attnx.core.kernels.xla.rows.raw_block_state` on the Pallas forward: the streaming state
  (``MaxState`` of SSMax and softpick, ``StickState`` of stick-breaking) of every query row
  over this block's keys, leaves [X, G, t, ...] (merges with XLA states by
  :func:`attnx.core.streaming.merge`). ``row_scales``: SSMax's global c_i [X, G, t]."""
  w = cfg.w
  rs = w.stream
  x, g, t, _ = q.shape
  s, hv = k.shape[1], v.shape[-1]
  kw = _row_weighting(w)
  if t == 0 or s == 0:
    return streaming.init(rs, (x, g, t), hv)
  blk = _block(q, k, v, bias, mask, scale, cfg, kw, backend, interpret, block_q, block_k, mod)
  o, lse = _row_forward(blk, row_scales)
  return row_state(rs, o, lse)


def row_block_grads(q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                    row_scales: Array | None, scale: Array, out: Array,
                    stats: tuple[Array, ...], do: Array, carry0: tuple[Array, Array],
                    cfg: tl.TileConfig, *, backend: str, interpret: bool = False,
                    block_q: int | None = None, block_k: int | None = None, mod: Any = None):
  """:func:`attnx.core.kernels.xla.rows.block_grads` on the Pallas backward: (dq, dk, dv, dbias,
  (carry_a, carry_b), dscale) of this block's scores from the rows' final output and
  statistics; ``carry0`` the grad carries after the blocks visited before (SSMax: dc so far;
  stick-breaking, blocks from the last key backwards: L and Σ A·dP of the later keys)."""
  w = cfg.w
  rs = w.stream
  kw = _row_weighting(w)
  if q.shape[2] == 0 or k.shape[1] == 0:
    return (*_empty_grads(q, k, v, bias)[:4], carry0, jnp.zeros((), F32)) + _mod_grad(mod)
  blk = _block(q, k, v, bias, mask, scale, cfg, kw, backend, interpret, block_q, block_k, mod)
  do32 = do.astype(F32)
  delta = jnp.sum(do32 * out.astype(F32), axis=-1)
  carry_a, carry_b = carry0
  carries = (carry_a, carry_b)  # softpick's: nothing to add
  if rs.suffix_carries:  # stick-breaking
    # The block's weights are its own (an empty stick) times e^{L₀}: dO·e^{L₀} makes each
    # A·dP the global one, and δ less the later keys' Σ A·dP is what the block's keys share.
    rest = jnp.exp(carry_a)
    o_blk, l_blk = _row_forward(blk, row_scales)
    do32, delta = do32 * rest[..., None], delta - carry_b
    carries = (carry_a + l_blk, carry_b + rest * jnp.sum(do.astype(F32) * o_blk, axis=-1))
  hvp = blk.v.shape[-1]
  do_k = wrapper.pad_to(_btnh(do32, blk.b, blk.kv_heads), {1: blk.cfg.tp, 3: hvp})
  rows = tuple(_bnt(a, blk) for a in (*stats, delta))
  rowc = None if row_scales is None else _bnt(row_scales, blk)
  dq, dk, dv, ds, dc, *d_ext = wrapper.row_backward(
      blk.cfg, blk.q, blk.k, blk.v, blk.bias, blk.mask, blk.q_len, blk.kv_len,
      do_k.astype(blk.q.dtype), rows, rowc, want_ds=bias is not None, slopes=blk.ext)
  if rs.needs_row_scale:  # SSMax: dc, the cotangent of the row scale
    carries = (carry_a + _xgt(dc, blk), carry_b)
  dq, dk, dv, dbias, dscale = _scaled_grads(dq, dk, dv, ds, q, bias, scale, blk)
  return ((dq, dk, dv, dbias, carries, dscale)
          + _mod_grad(mod, blk, d_ext[0] if d_ext else None))
