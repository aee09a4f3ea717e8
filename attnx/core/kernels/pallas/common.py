"""What the Pallas kernels of both lowerings share: the static :class:`KernelConfig` of a
problem and the tile math on values (not refs).

The pointwise tile math is :mod:`attnx.core.streaming`'s two rules, the blocked kernel's
(:mod:`attnx.core.kernels.xla.pointwise`; same masking, same empty-row and NaN rules): the online
max (:func:`~attnx.core.streaming.online_max_update`) for ``w.online_max``, ``acc += F(S)·V``
with one division at the end otherwise (:func:`~attnx.core.streaming.pointwise_update`), both
ended by :func:`~attnx.core.streaming.pointwise_finalize`; the backward's dS from the saved
statistic is :func:`~attnx.core.streaming.pointwise_tile_grad` (:func:`bwd_tile`): α·P∘(dP − D)
(online max), F'(s)∘(dP − D)/l (``"sum"``), F'(s)∘dP/n (``"length"``), F'(s)∘dP (``"none"``).
Scores are in base-2 units for the online max (exp2, log₂e folded into the score's scale:
:attr:`KernelConfig.z_mult`). Each lowering spells the rules with its own
:class:`~attnx.core.streaming.Ops` (:data:`.triton.OPS`, :data:`.mosaic.OPS`).

All arrays the kernels get are already padded (T to Tp, S to Sp, and on the GPU the head dims);
padded rows/keys are excluded through the ``q_len``/``kv_len`` bounds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attnx.core import streaming
from attnx.core.contract import finite
from attnx.core.weightings import Pointwise

Array = jax.Array
LOG2E = streaming.LOG2E
LANES = 128  # TPU vector lanes: row statistics are stored replicated over 128 lanes
NT = (((1,), (1,)), ((), ()))  # dot_general dimensions of a @ b.T

__all__ = ["LANES", "LOG2E", "NT", "ROW_OPS", "KernelConfig", "accumulate_dkv", "alibi_dist",
           "alibi_tile", "bcast_index", "bnth", "bwd_tile", "capped_grad", "dot_chunks",
           "grad_rows", "in_span", "kv_hi", "kv_span", "q_range", "q_span", "ref_cols",
           "relative_ext", "relative_index", "sink_grad", "sink_start",
           "tile_scores", "tile_scores_grad", "tile_valid", "uncounted"]
# The units of the row statistic the kernels save (a log2-sum-exp for the online max), as
# the custom VJPs read it outside the kernels (:func:`sink_grad`).
ROW_OPS = streaming.Ops(exp2=True)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static description of one problem (closed over by the kernels).

  Tiles: (bq, bk) forward, (bq_dq, bk_dq) for dQ, (bq_dkv, bk_dkv) for dK/dV. ``q_bound`` /
  ``kv_bound``: rows i ≥ q_len[b] / keys j ≥ kv_len[b] are invalid (lengths or padding).
  """

  w: Pointwise
  backend: str  # "gpu" | "tpu"
  interpret: bool
  s: int  # true number of keys S (F's num_keys argument)
  tp: int  # padded T
  sp: int  # padded S
  g: int  # query heads per kv head
  scale: float
  is_causal: bool
  q_bound: bool
  kv_bound: bool
  bq: int
  bk: int
  bq_dq: int
  bk_dq: int
  bq_dkv: int
  bk_dkv: int
  num_warps: int = 4  # GPU forward
  num_warps_bwd: int = 4  # GPU dK/dV
  num_warps_dq: int = 4  # GPU dQ
  num_stages: int = 2
  num_stages_bwd: int = 2
  # GPU: dK and dV in two passes of one accumulator each (their registers, at wide heads).
  two_pass_dkv: bool = False
  # Sparsemax/entmax: skip the work of key tiles whose every weight is zero (:mod:`.rows`).
  skip_zero_tiles: bool = True
  # Sparsemax/entmax: the forward also writes Σu per row (u = p^{2−α}), which the gradient of
  # the residual's threshold needs (attnx.core.streaming.residual_delta).
  keep_u_sum: bool = False
  # A structured mask's static plan (:class:`.masking.MaskPlan`), or None.
  smask: Any = None
  # logits_soft_cap c (s = c·tanh(scale·q·k / c) before the bias, :func:`tile_scores`), or
  # None: the tiles are those of the plain kernels, op for op.
  cap: float | None = None
  # Attention sinks: the forward kernels take sinks [N] and start each row's state from its
  # head's sink (:func:`sink_start`); the backward kernels read the statistic that counts it.
  sinks: bool = False
  # ALiBi ("causal": s − m_h·(i − j); "symmetric": s − m_h·abs(i − j)) after the cap and the
  # bias (:func:`alibi_tile`): the kernels take the slopes m [N] as one more operand and the dQ
  # kernel writes per-row partial sums of d m; None: no operand, no op.
  alibi: str | None = None
  # A relative-position table (core.relative_table) after the cap and the bias: the kernels
  # take its extended table ext [N, Lx] (:func:`relative_ext`) as one more operand, in ALiBi's
  # slot, read at column i − j + rel_offset (:func:`relative_index`), and the backward returns
  # d ext [N, Lx] float32 in d slopes' slot. False: no operand, no op.
  relative: bool = False
  rel_offset: int = 0
  # Split-KV (decoding): the forward runs the keys as this many chunks side by side, merged
  # after (:mod:`.split`); 1: one pass over every key. The backward is the same either way.
  kv_splits: int = 1

  @property
  def mod_operand(self) -> bool:
    """Whether the kernels take the score modification's operand (ALiBi's slopes [N] or a
    relative table's ext [N, Lx]; never both, a ScoreMod has one function)."""
    return self.alibi is not None or self.relative

  @property
  def alpha(self) -> float:
    return self.w.alpha

  @property
  def z_mult(self) -> tuple[float, float]:
    """(q·k, bias) multipliers of the tile score z (base-2 exponent for online max; the
    natural score for a log-domain F, ``w.log_f``, which the streaming rules take as is)."""
    if self.w.online_max and self.w.log_f is None:
      return self.scale * self.alpha * LOG2E, self.alpha * LOG2E
    return self.scale, 1.0

  @property
  def grad_mult(self) -> tuple[float, float]:
    """(q·k, bias) multipliers turning the cotangent of z (natural units) into gradients."""
    return self.scale * self.alpha, self.alpha

  def needs_valid(self, has_mask: bool) -> bool:
    return (has_mask or self.is_causal or self.q_bound or self.kv_bound
            or self.smask is not None)

  @property
  def num_smask_refs(self) -> int:
    """The refs of a structured mask a GPU kernel gets (:func:`.masking.gpu_operands`)."""
    p = self.smask
    return 0 if p is None else p.num_prefetch + p.num_ids


def _cdiv(a, b: int):
  return lax.div(a + (b - 1), b)


def kv_hi(cfg: KernelConfig, i, bq: int, bk: int, q_len, kv_len):
  """Number of key tiles seen by query tile i (causal: not above the diagonal)."""
  hi = jnp.int32(cfg.sp // bk)
  if cfg.is_causal:  # up to the diagonal of the tile's last real row
    last = i * bq + bq if not cfg.q_bound else jnp.minimum(i * bq + bq, q_len)
    hi = jnp.minimum(hi, lax.div(last + bk - 1, bk))
  if cfg.kv_bound:
    hi = jnp.minimum(hi, _cdiv(kv_len, bk))
  if cfg.q_bound:
    hi = jnp.where(i * bq < q_len, hi, 0)
  return hi


def q_range(cfg: KernelConfig, j, bq: int, bk: int, q_len, kv_len):
  """[lo, hi) of the query tiles that see key tile j."""
  lo = lax.div(j * bk, bq) if cfg.is_causal else jnp.int32(0)
  hi = jnp.int32(cfg.tp // bq)
  if cfg.q_bound:
    hi = jnp.minimum(hi, _cdiv(q_len, bq))
  if cfg.kv_bound:
    hi = jnp.where(j * bk < kv_len, hi, lo)
  return lo, jnp.maximum(hi, lo)


def kv_span(cfg: KernelConfig, i, bq: int, bk: int, q_len, kv_len, sm=None):
  """[lo, hi) of the key tiles query tile i visits: :func:`kv_hi`'s, narrowed to a structured
  mask's span (``sm``, a :class:`.masking.KernelMask`)."""
  hi = kv_hi(cfg, i, bq, bk, q_len, kv_len)
  return (0, hi) if sm is None else sm.clip(0, hi)


def q_span(cfg: KernelConfig, j, bq: int, bk: int, q_len, kv_len, sm=None):
  """[lo, hi) of the query tiles that visit key tile j: :func:`q_range`'s, narrowed to a
  structured mask's span."""
  lo, hi = q_range(cfg, j, bq, bk, q_len, kv_len)
  return (lo, hi) if sm is None else sm.clip(lo, hi)


def kv_full(cfg: KernelConfig, i, bq: int, bk: int, q_len, kv_len, span, has_mask: bool,
            sm=None):
  """[lo, hi) of the key tiles inside ``span`` (:func:`kv_span`'s) whose every pair query
  tile i attends: there the kernels skip the elementwise mask. None when no tile needs one
  (nothing masks: the kernels keep one loop); empty (lo = hi) under a dense mask."""
  if not cfg.needs_valid(has_mask):
    return None
  lo, hi = span
  if has_mask:
    return hi, hi
  f_hi = hi
  if cfg.is_causal:  # key tile j lies wholly at or below the diagonal of query row i·bq
    f_hi = jnp.minimum(f_hi, lax.div(i * bq + 1, bk))
  if cfg.kv_bound:
    f_hi = jnp.minimum(f_hi, lax.div(kv_len, bk))
  if cfg.q_bound:
    f_hi = jnp.where((i + 1) * bq <= q_len, f_hi, lo)
  f_lo = lo
  if sm is not None:
    f_lo, f_hi = sm.clip_full(f_lo, f_hi)
  return _inside(span, f_lo, f_hi)


def q_full(cfg: KernelConfig, j, bq: int, bk: int, q_len, kv_len, span, has_mask: bool,
           sm=None):
  """[lo, hi) of the query tiles inside ``span`` (:func:`q_span`'s) that attend every key of
  key tile j: :func:`kv_full`'s along the other axis."""
  if not cfg.needs_valid(has_mask):
    return None
  lo, hi = span
  if has_mask:
    return hi, hi
  f_lo, f_hi = lo, hi
  if cfg.is_causal:  # query tile i starts at or below key tile j's last key
    f_lo = jnp.maximum(f_lo, _cdiv(j * bk + bk - 1, bq))
  if cfg.q_bound:
    f_hi = jnp.minimum(f_hi, lax.div(q_len, bq))
  if cfg.kv_bound:
    f_hi = jnp.where((j + 1) * bk <= kv_len, f_hi, f_lo)
  if sm is not None:
    f_lo, f_hi = sm.clip_full(f_lo, f_hi)
  return _inside(span, f_lo, f_hi)


def _inside(span, f_lo, f_hi):
  lo, hi = span
  f_lo = jnp.minimum(jnp.maximum(f_lo, lo), hi)
  return f_lo, jnp.minimum(jnp.maximum(f_hi, f_lo), hi)


def span_loop(span, full, body, carry, reverse: bool = False):
  """``lax.fori_loop`` of ``body(t, carry, masked)`` over the tiles of ``span``: the boundary
  tiles before and after the ``full`` run with ``masked=True``, the run itself with
  ``masked=False`` (no elementwise mask); one loop, every tile masked, when ``full`` is
  None (:func:`kv_full`). ``reverse``: last tile first (stick-breaking; with ``full``)."""
  lo, hi = span
  if full is None:
    return lax.fori_loop(lo, hi, lambda t, c: body(t, c, True), carry)
  f_lo, f_hi = full
  runs = ((lo, f_lo, True), (f_lo, f_hi, False), (f_hi, hi, True))
  for a, b, masked in (runs[::-1] if reverse else runs):
    if reverse:
      carry = lax.fori_loop(0, b - a, lambda r, c, b=b, m=masked: body(b - 1 - r, c, m), carry)
    else:
      carry = lax.fori_loop(a, b, lambda t, c, m=masked: body(t, c, m), carry)
  return carry


def span_when(t, span, full, run) -> None:
  """:func:`span_loop` where the grid is the loop (the TPU kernels): at grid step ``t``,
  ``run(True)`` on the boundary tiles of ``span``, ``run(False)`` on the ``full`` run, or
  ``run(True)`` on every tile of the span when ``full`` is None."""
  if full is None:
    pl.when(in_span(t, span))(lambda: run(True))
    return
  inner = in_span(t, full)
  pl.when(in_span(t, span) & jnp.logical_not(inner))(lambda: run(True))
  pl.when(inner)(lambda: run(False))


def in_span(t, span):
  """Whether grid step t runs a tile of span (lo, hi) (lo the Python int 0: ``t < hi``)."""
  lo, hi = span
  return t < hi if isinstance(lo, int) and lo == 0 else (t >= lo) & (t < hi)


def tile_valid(cfg: KernelConfig, shape: tuple[int, int], r0, c0, mask_tile, q_len, kv_len,
               sm=None, head=None):
  """Boolean [bq, bk] validity of a tile (None when every entry is valid); ``sm`` a structured
  mask (:class:`.masking.KernelMask`) evaluated for query head ``head``."""
  valid = None
  if mask_tile is not None:  # broadcast as int32, compare after (no i1 broadcasts)
    valid = jnp.broadcast_to(mask_tile.astype(jnp.int32), shape) != 0
  if sm is not None:
    st = sm.tile(head, shape, r0, c0)
    valid = st if valid is None else valid & st
  if cfg.is_causal or cfg.q_bound or cfg.kv_bound:
    rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    conds = []
    if cfg.is_causal:
      conds.append(cols <= rows)
    if cfg.q_bound:
      conds.append(rows < q_len)
    if cfg.kv_bound:
      conds.append(cols < kv_len)
    for c in conds:
      valid = c if valid is None else valid & c
  return valid


def alibi_dist(cfg: KernelConfig, shape: tuple[int, int], r0, c0):
  """−(i − j) (``cfg.alibi == "causal"``) or −abs(i − j) (``"symmetric"``) on a [bq, bk] tile
  whose first row is query ``r0`` and first column key ``c0`` (global positions, as the
  dense grid's ``q_idx``/``kv_idx``), float32: ALiBi's bias is slope·this, and the slope's
  gradient Σ dS·this."""
  rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
  d = rows - cols
  if cfg.alibi == "symmetric":
    d = jnp.abs(d)
  return -d.astype(jnp.float32)


def alibi_tile(cfg: KernelConfig, slope, shape: tuple[int, int], r0, c0):
  """(ALiBi's bias slope·dist of a tile, dist) of :func:`alibi_dist`, or (None, None) without
  ALiBi (``slope`` None)."""
  if cfg.alibi is None:
    return None, None
  dist = alibi_dist(cfg, shape, r0, c0)
  return dist * slope, dist


def relative_ext(table: Array, t: int, s: int) -> tuple[Array, int]:
  """(ext [N, Lx] float32, off): a relative-position table [N, L] (L odd, half = (L − 1)/2;
  :func:`attnx.core.score_mods.relative_table`) extended so that the bias of query i and key j
  (global, unpadded positions; i < ``t``, j < ``s``) is ``ext[h, i − j + off]`` without
  clipping: P = max(0, max(t, s) − 1 − half) copies of the first and of the last column on
  either side (the clip to ±half), Lx = L + 2P, off = half + P.

  The kernels of both lowerings read and differentiate ``ext``; built here with ``jnp``
  outside the kernels, its gradient (d ext [N, Lx], summed over the batch) folds back to the
  table by autodiff of this function: the pad columns' sums into the end columns, the middle
  one to one."""
  n, el = table.shape
  half = (el - 1) // 2
  p = max(0, max(t, s) - 1 - half)
  ext = table.astype(jnp.float32)
  if p:
    ext = jnp.concatenate([jnp.broadcast_to(ext[:, :1], (n, p)), ext,
                           jnp.broadcast_to(ext[:, -1:], (n, p))], axis=1)
  return ext, half + p


def relative_index(cfg: KernelConfig, shape: tuple[int, int], r0, c0, size: int):
  """ext's column i − j + ``cfg.rel_offset`` (:func:`relative_ext`) on a [bq, bk] tile whose
  first row is query ``r0`` and first column key ``c0`` (int32), clamped into [0, ``size``):
  rows and keys past the true lengths (padding) read an end column, and are masked."""
  rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
  return jnp.clip(rows - cols + cfg.rel_offset, 0, size - 1)


def tile_scores(cfg: KernelConfig, qs, ks, bias_tile, lin=None):
  """The tile score z [bq, bk] float32 (base-2 exponent for online-max weightings).

  ``qs``/``ks``: the [bq, c] / [bk, c] chunks of the head dim (one chunk but on the GPU).
  With a soft cap (``cfg.cap``) z = α·(c·tanh(scale·q·k / c) + bias) (times log₂e for the
  online max): :func:`tile_scores_grad`. ``lin``: ALiBi's bias tile (:func:`alibi_tile`) or a
  relative table's (ext at :func:`relative_index`) in natural units, added after the cap and
  the bias, or None.
  """
  if cfg.cap is not None:
    return tile_scores_grad(cfg, qs, ks, bias_tile, lin)[0]
  zq, zb = cfg.z_mult
  z = None
  for q, k in zip(qs, ks, strict=True):
    d = lax.dot_general(q, k, NT, preferred_element_type=jnp.float32)
    z = d if z is None else z + d
  if zq != 1.0:
    z = z * zq
  if bias_tile is not None:
    b = bias_tile.astype(jnp.float32)
    z = z + (b * zb if zb != 1.0 else b)
  if lin is not None:
    z = z + (lin * zb if zb != 1.0 else lin)
  return z


def tile_scores_grad(cfg: KernelConfig, qs, ks, bias_tile, lin=None):
  """(z, d) of a tile: :func:`tile_scores`'s z, and under a soft cap the derivative
  d = 1 − tanh²(scale·q·k / c) of the capped score by the raw one (None without a cap), by
  which the backward kernels multiply the cotangent of z before it reaches q·k (dQ, dK): the
  bias's cotangent (dS) is the cotangent of z itself, since the bias is added after the cap.

  The cap works in natural units, as the blocked kernel's (:mod:`attnx.core.score_mods`): the
  raw score scale·q·k is capped, the bias added, and only then multiplied by α (by α·log₂e for
  the online max's exp2). A raw score that is NaN (a NaN query or key, :mod:`attnx.core.contract`)
  keeps z NaN but gets d = 1, as the blocked kernel takes the cap's derivative at the finite
  raw scores: a pair a mask hides has a zero cotangent, and 0·NaN would reach dQ and dK.
  """
  if cfg.cap is None:
    return tile_scores(cfg, qs, ks, bias_tile, lin), None
  raw = dot_chunks(qs, ks)
  if cfg.scale != 1.0:
    raw = raw * cfg.scale
  th = jnp.tanh(raw / cfg.cap)
  z = th * cfg.cap
  if bias_tile is not None:
    z = z + bias_tile.astype(jnp.float32)
  if lin is not None:
    z = z + lin
  _, zb = cfg.z_mult  # α·log₂e for the online max, 1 otherwise
  if zb != 1.0:
    z = z * zb
  th = jnp.where(jnp.isnan(raw), 0.0, th)
  return z, 1.0 - th * th


def capped_grad(dz, d):
  """The cotangent of the raw score scale·q·k from that of z: dz·d under a soft cap (``d``
  from :func:`tile_scores_grad`), dz itself without one (``d`` None)."""
  return dz if d is None else dz * d


def sink_start(cfg: KernelConfig, m, l, sink, ops: streaming.Ops):
  """(m, l): a row's starting state (m, l of :func:`attnx.core.streaming.online_max_start`;
  for ``"sum"`` m is None and l = 0) with its head's sink folded in, as one more key of score
  ``sink`` (broadcast against l) and zero value: the blocked kernel's rule, so that the sink
  enters the normalizer exactly once and a row whose keys are all masked keeps O = 0.

  Online max (base-2 units): m' = max(m, z), l' = l·2^(m − m') + 2^(z − m'), z = α·log₂e·sink
  (:func:`attnx.core.streaming.online_max_update` on a one-key tile); ``"sum"``: l' = l + F(sink).
  """
  w = cfg.w
  if not w.online_max:
    return m, l + w.fn(sink, cfg.s)
  z = sink if w.log_f is not None else sink * (cfg.alpha * LOG2E)
  m_new = jnp.maximum(m, streaming.online_max_bound(w.log_f, z, ops=ops))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  return m_new, l * ops.exp(m - m_use) + streaming.online_max_shifted(w.log_f, z, m_use, ops=ops)


def sink_grad(cfg: KernelConfig, sinks: Array, rows: list[Array]) -> Array:
  """d sinks [N] from the backward's row values (r0, r1, δ) [B, N, Tp] of :func:`grad_rows`,
  outside the kernels: a sink is a key of zero value, so dP = 0 there and its score's
  cotangent is the tile rule's on that key (:func:`attnx.core.streaming.pointwise_tile_grad`),
  summed over the batch and the rows of each head: −α·P_sink·δ_i with
  P_sink = 2^(α·log₂e·sink − lse) (online max), F'(sink)·(0 − δ_i)/l (``"sum"``). Padding rows
  and rows past their length have O = 0, hence δ = 0, and add nothing."""
  w = cfg.w
  z = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], rows[2].shape)
  if w.online_max and w.log_f is None:
    z = z * (cfg.alpha * LOG2E)
  _, dz = streaming.pointwise_tile_grad(w, z, None, jnp.zeros_like(z), tuple(rows), cfg.s,
                                        ops=ROW_OPS)
  return (jnp.sum(dz, axis=(0, 2)) * cfg.alpha).astype(sinks.dtype)


def bwd_tile(cfg: KernelConfig, z, valid, dp, rows, ops: streaming.Ops):
  """(P, dZ) of one tile: the weights (for dV) and the cotangent of z in natural units.

  ``rows``: (r0, r1, δ) of :func:`attnx.core.streaming.pointwise_grad_rows`, broadcast
  against the tile (zeros where the rule reads nothing); ``ops`` the lowering's spelling.
  """
  return streaming.pointwise_tile_grad(cfg.w, z, valid, dp, rows, cfg.s, ops=ops)


def ref_cols(ref, c0, size: int):
  """Columns [c0, c0 + size) of a 2-D ref (all of it when its last dim is broadcast)."""
  if ref.shape[-1] == 1:
    return ref[...]
  return ref[:, pl.ds(c0, size)]


def bcast_index(shape: tuple[int, ...], full: tuple[Any, ...]) -> tuple[Any, ...]:
  """Block indices of a bias/mask with broadcast (size-1) dims: 0 along those."""
  return tuple(0 if d == 1 else x for d, x in zip(shape, full, strict=True))


def dot_chunks(as_, bs):
  """Σ_c a_c @ b_cᵀ (float32)."""
  out = None
  for a, b in zip(as_, bs, strict=True):
    d = lax.dot_general(a, b, NT, preferred_element_type=jnp.float32)
    out = d if out is None else out + d
  return out


def accumulate_dkv(dkv: tuple, p: Array, dz: Array, qs: list, dos: list) -> tuple:
  """(dK + dZᵀ·Q, dV + Pᵀ·dO) in float32, per head-dim chunk, for the accumulators held (an
  empty tuple: that one is not wanted, as in a pass of the two-pass form)."""
  dk, dv = dkv
  # The transposes first: the order in which the fused pass compiled without spills.
  pt = p.astype(dos[0].dtype).T if dv else None
  dzt = dz.astype(qs[0].dtype).T if dk else None
  if dv:
    dv = tuple(a + jnp.dot(pt, do, preferred_element_type=jnp.float32)
               for a, do in zip(dv, dos, strict=True))
  if dk:
    dk = tuple(a + jnp.dot(dzt, finite(q), preferred_element_type=jnp.float32)
               for a, q in zip(dk, qs, strict=True))
  return dk, dv


def uncounted(cfg: KernelConfig, has_mask: bool) -> int | None:
  """pointwise_finalize's ``num_keys``: S when no tile is masked (so no key was counted)."""
  return None if cfg.needs_valid(has_mask) else cfg.s


def grad_rows(cfg: KernelConfig, stat: Array, o: Array, do: Array) -> list[Array]:
  """The per-row values (r0, r1, δ) [B, N, Tp] of :func:`backward`, from the forward's row
  statistic [B, N, Tp] and O, dO [B, Tp, N, Hv]: those of
  :func:`attnx.core.streaming.pointwise_grad_rows`, zeros where the rule reads nothing."""
  # δ_i = dO_i·O_i; XLA drops it where the rule does not read it ("length", "none").
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
  zeros = jnp.zeros_like(stat)
  return [zeros if r is None else r for r in streaming.pointwise_grad_rows(cfg.w, stat, delta)]


def bnth(x: Array) -> Array:
  """[B, T, N, H] <-> [B, N, T, H] (the Mosaic kernels' layout)."""
  return x.transpose(0, 2, 1, 3)
