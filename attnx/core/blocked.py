"""Flash-style blocked attention with O(T) memory for every pointwise weighting F.

    out_i = Σ_j F(s_ij) v_j / N_i,   s_ij = scale · q_i·k_j + bias_ij

Keys are streamed tile by tile (Dao et al. 2022, "FlashAttention", arXiv 2205.14135; Rabe &
Staats 2021, "Self-attention does not need O(n²) memory", arXiv 2112.05682), so the T×S score
matrix never exists. Two streaming rules cover every :class:`~attnx.core.weightings.Pointwise`:

* softmax-like F = exp(α s) with ``normalization="sum"`` (``w.online_max``): the online softmax
  (Milakov & Gimelshein 2018, arXiv 1805.02867) with a running row maximum m and denominator l;
  ``denominator_offset`` c (quiet softmax, Evan Miller 2023) is a virtual key of score 0, so
  m starts at 0 and l at c.
* any other F: acc += F(S)·V and l += rowsum(F(S)) (``"sum"``), l = number of valid keys
  (``"length"``, Wortsman et al. 2023) or l = 1 (``"none"``, Ramapuram et al. 2024); one
  division at the end. No rescaling is needed because nothing is shifted.

For ``"sum"`` the row sums ride along in the F·V matmul as a column of ones appended to V,
which saves one pass over every tile.

The backward pass is a ``jax.custom_vjp`` that recomputes the tiles (FlashAttention-2, Dao 2023,
arXiv 2307.08691): only the output, one row statistic and the inputs are saved. With
D_i = dO_i·O_i and dP_ij = dO_i·v_j:

* online max: P = exp(α s − lse), dS = α P ∘ (dP − D);
* ``"sum"``: dS = F'(s) ∘ (dP − D) / l;  ``"length"``: dS = F'(s) ∘ dP / n;  ``"none"``:
  dS = F'(s) ∘ dP.

Masked keys contribute exactly nothing, and a row without any valid key (or where every F is
0) gets a zero output with finite, zero gradients, matching
:func:`attnx.core.weightings.pointwise_weights`; NaN/Inf inputs follow the contract of
:mod:`attnx.core.contract`, like the dense path. Causal tiles above the diagonal are skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core.contract import nonfinite_inputs
from attnx.core.weightings import Pointwise

Array = jax.Array

# Tiles are sized by a budget of scores per tile (all heads of a chunk × G query heads × bq ×
# bk). Measured side by side on a 2-core CPU (Intel Xeon, AVX-512) at (B, T, N, H) =
# (1, 4096, 4, 64), forward: one head at a time with 4096×256 tiles 131 ms, 2048×512 147 ms,
# four heads batched with 1024×256 tiles 156 ms (jax.nn: 412 ms). XLA's CPU dots are faster
# on one tall [bq, H] × [H, bk] product than on a batch of shorter ones, so the kernel walks
# the heads in chunks and gives each chunk the tallest tile the budget allows. 2^20 f32
# scores = 4 MiB per tile keeps the scratch memory ≥ 20× below jax.nn's at T = 4096.
TILE_BUDGET = 1 << 20
DEFAULT_BLOCK_K = 256
CAUSAL_BLOCK_Q = 1024  # causal: shorter query tiles let more tiles above the diagonal be skipped
_ALIGN = 8  # tiles are multiples of 8 rows (SIMD-friendly)

__all__ = ["DEFAULT_BLOCK_K", "TILE_BUDGET", "blocked_attention", "default_block_sizes"]


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def default_block_sizes(t: int, s: int, group: int = 1,
                        is_causal: bool = False) -> tuple[int, int]:
  """Default (block_q, block_k) for T queries, S keys and ``group`` query heads per kv head.

  block_k = 256 and block_q as tall as :data:`TILE_BUDGET` allows (group · block_q · block_k
  scores), at most :data:`CAUSAL_BLOCK_Q` when causal; both capped at the (8-aligned) lengths.
  """
  bk = min(DEFAULT_BLOCK_K, _round_up(max(s, 1), _ALIGN))
  bq = max(_ALIGN, (TILE_BUDGET // (bk * max(group, 1))) // _ALIGN * _ALIGN)
  if is_causal:
    bq = min(bq, CAUSAL_BLOCK_Q)
  return min(bq, _round_up(max(t, 1), _ALIGN)), bk


def heads_per_chunk(b: int, kh: int, group: int, bq: int, bk: int) -> int:
  """How many of the X = B·K (batch, kv head) rows one tile holds: the largest count within
  :data:`TILE_BUDGET` that divides K or is a multiple of K dividing B·K (so that a chunk
  covers a rectangle of [batch, kv head] and a bias/mask slice stays a plain slice)."""
  per_row = group * bq * bk
  fits = max(1, TILE_BUDGET // per_row)
  options = [d for d in range(1, kh + 1) if kh % d == 0]
  options += [kh * d for d in range(1, b + 1) if b % d == 0]
  return max(c for c in options if c <= fits) if fits >= 1 else 1


@dataclasses.dataclass(frozen=True)
class _Cfg:
  """Static description of one blocked-attention problem (closed over by the kernels)."""
  w: Pointwise
  t: int
  s: int
  bq: int
  bk: int
  is_causal: bool
  has_mask: bool
  has_bias: bool
  b5: tuple[int, int, int] = (1, 1, 1)  # (B, K, G) of one chunk: X = B·K rows of G query heads
  kh: int = 1  # K of the whole problem (chunks are rectangles of [batch, kv head])
  xc: int = 1  # X rows per chunk

  @property
  def nq(self) -> int:
    return -(-self.t // self.bq)

  @property
  def nk(self) -> int:
    return -(-self.s // self.bk)

  @property
  def pad_k(self) -> bool:
    return self.nk * self.bk != self.s

  @property
  def needs_valid(self) -> bool:
    return self.has_mask or self.is_causal or self.pad_k

  def chunk_b5(self) -> tuple[int, int, int]:
    """(B, K, G) of one chunk of xc consecutive X rows."""
    if self.xc <= self.kh:
      return (1, self.xc, self.b5[2])
    return (self.xc // self.kh, self.kh, self.b5[2])


# --------------------------------------------------------------------------------------------
# Chunks: the kernels run on xc of the X = B·K rows at a time.
# --------------------------------------------------------------------------------------------

def _chunk_rows(x: Array, c: Array, cfg: _Cfg) -> Array:
  return lax.dynamic_slice_in_dim(x, c * cfg.xc, cfg.xc, 0)


def _chunk5_start(x5: Array, c: Array, cfg: _Cfg) -> tuple[tuple[Any, ...], tuple[int, ...]]:
  """Start and size of chunk c's slice of a [Bb, Kb, Gb, Tb, Sb] bias/mask (or its grad)."""
  cb, ck, _ = cfg.chunk_b5()
  x0 = c * cfg.xc
  b0, k0 = x0 // cfg.kh, x0 % cfg.kh
  starts = (b0 if x5.shape[0] != 1 else 0, k0 if x5.shape[1] != 1 else 0, 0, 0, 0)
  sizes = (cb if x5.shape[0] != 1 else 1, ck if x5.shape[1] != 1 else 1) + x5.shape[2:]
  return starts, sizes


def _chunk5(x5: Array | None, c: Array, cfg: _Cfg) -> Array | None:
  if x5 is None:
    return None
  starts, sizes = _chunk5_start(x5, c, cfg)
  return lax.dynamic_slice(x5, starts, sizes)


# --------------------------------------------------------------------------------------------
# Tiles. Internal layout: q [X, G, Tp, H] and k/v [X, Sp, H] with X = B·K (G query heads share a
# kv head), bias/mask [Bb, Kb, Gb, Tb, Sb]. A tile flattens (G, bq) into rows, so scores are one
# batched [G·bq, H] × [H, bk] matmul whose output needs no relayout.
# --------------------------------------------------------------------------------------------

def _slice(x: Array, start: Array, size: int, axis: int) -> Array:
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _rows(x: Array, i: Array, cfg: _Cfg) -> Array:
  """Query block i of a [X, G, Tp, ...] array as [X, G·bq, ...]."""
  x = _slice(x, i * cfg.bq, cfg.bq, 2)
  return x.reshape((x.shape[0], x.shape[1] * cfg.bq) + x.shape[3:])


def _put_rows(buf: Array, x: Array, i: Array, cfg: _Cfg) -> Array:
  x = x.reshape((buf.shape[0], buf.shape[1], cfg.bq) + buf.shape[3:])
  return lax.dynamic_update_slice_in_dim(buf, x, i * cfg.bq, axis=2)


def _tile5(x: Array, i: Array, j: Array, cfg: _Cfg) -> Array:
  """The [Bb, Kb, Gb, bq|1, bk|1] tile (i, j) of a broadcastable bias/mask."""
  if x.shape[3] != 1:
    x = _slice(x, i * cfg.bq, cfg.bq, 3)
  if x.shape[4] != 1:
    x = _slice(x, j * cfg.bk, cfg.bk, 4)
  return x


def _flat_tile(x: Array, i: Array, j: Array, cfg: _Cfg) -> Array:
  x = jnp.broadcast_to(_tile5(x, i, j, cfg), cfg.b5 + (cfg.bq, cfg.bk))
  return x.reshape(cfg.b5[0] * cfg.b5[1], cfg.b5[2] * cfg.bq, cfg.bk)


def _valid_tile(mask: Array | None, i: Array, j: Array, cfg: _Cfg) -> Array | None:
  """Boolean tile broadcastable to [X, G·bq, bk], or None if every entry is valid."""
  if not cfg.needs_valid:
    return None
  valid = _flat_tile(mask, i, j, cfg) if cfg.has_mask else None
  if cfg.is_causal or cfg.pad_k:
    shape = (cfg.b5[2] * cfg.bq, cfg.bk)
    cols = j * cfg.bk + lax.broadcasted_iota(jnp.int32, shape, 1)
    c = None
    if cfg.is_causal:
      rows = i * cfg.bq + lax.broadcasted_iota(jnp.int32, shape, 0) % cfg.bq
      c = cols <= rows
    if cfg.pad_k:
      c = cols < cfg.s if c is None else c & (cols < cfg.s)
    valid = c if valid is None else valid & c
  return valid


def _scores(qi: Array, kj: Array, bias: Array | None, i: Array, j: Array, cfg: _Cfg,
            qk_mult: Array | None, bias_mult: float) -> Array:
  """z = qk_mult · q·k + bias_mult · bias on one tile, [X, G·bq, bk] float32."""
  z = jnp.einsum("xqh,xsh->xqs", qi, kj, preferred_element_type=jnp.float32)
  if qk_mult is not None:
    z = z * qk_mult
  if cfg.has_bias:
    bt = _flat_tile(bias, i, j, cfg).astype(jnp.float32)
    z = z + (bt * bias_mult if bias_mult != 1.0 else bt)
  return z


def _k_range(i: Array, cfg: _Cfg) -> tuple[int, Any]:
  """Key blocks seen by query block i: all, or those not entirely above the diagonal."""
  if not cfg.is_causal:
    return 0, cfg.nk
  return 0, jnp.minimum(cfg.nk, (i * cfg.bq + cfg.bq - 1) // cfg.bk + 1)


def _q_range(j: Array, cfg: _Cfg) -> tuple[Any, int]:
  """Query blocks that see key block j (causal: i·bq + bq − 1 ≥ j·bk)."""
  if not cfg.is_causal:
    return 0, cfg.nq
  return jnp.minimum(cfg.nq, (j * cfg.bk) // cfg.bq), cfg.nq


def _pv(p: Array, vj: Array) -> Array:
  return jnp.einsum("xqs,xsd->xqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)


def _prescale(q: Array, scale: Array, cfg: _Cfg) -> tuple[Array, Array | None, float, float]:
  """Folds the score multiplier into q once (float32) instead of into every tile.

  Returns (q', tile multiplier or None, bias multiplier, α) with z = α·s the exponent for
  online-max weightings (α = 1 otherwise).
  """
  alpha = float(cfg.w.exp_alpha) if cfg.w.online_max else 1.0
  c = scale * alpha
  if q.dtype == jnp.float32:
    return q * c, None, alpha, alpha
  return q, c, alpha, alpha  # low precision: keep q exact, scale the f32 tile


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------

def _forward(q, k, v, bias, mask, scale, cfg: _Cfg):
  """Returns O [X, G, Tp, Hv] (f32) and the row statistic [X, G, Tp] (f32), chunk by chunk."""
  x, g, tp, _ = q.shape
  ccfg = dataclasses.replace(cfg, b5=cfg.chunk_b5())

  def chunk(c, carry):
    out, stat = carry
    o, st = _forward_chunk(_chunk_rows(q, c, cfg), _chunk_rows(k, c, cfg),
                           _chunk_rows(v, c, cfg), _chunk5(bias, c, cfg),
                           _chunk5(mask, c, cfg), scale, ccfg)
    return (lax.dynamic_update_slice_in_dim(out, o, c * cfg.xc, 0),
            lax.dynamic_update_slice_in_dim(stat, st, c * cfg.xc, 0))

  init = (jnp.zeros((x, g, tp, v.shape[-1]), jnp.float32), jnp.zeros((x, g, tp), jnp.float32))
  if cfg.xc == x:
    return _forward_chunk(q, k, v, bias, mask, scale, ccfg)
  return lax.fori_loop(0, x // cfg.xc, chunk, init)


def _forward_chunk(q, k, v, bias, mask, scale, cfg: _Cfg):
  """One chunk of :func:`_forward`: O [xc, G, Tp, Hv] and the row statistic [xc, G, Tp].

  The statistic is lse = m + log l for online-max weightings (+inf where l = 0, which makes
  every recomputed weight 0) and the normalizer l otherwise (1 for ``"none"``).
  """
  w = cfg.w
  x, g, tp, _ = q.shape
  hv = v.shape[-1]
  row_shape = (x, g * cfg.bq)
  offset = float(w.denominator_offset)
  q, qk_mult, bias_mult, _ = _prescale(q, scale, cfg)
  v_fwd = v
  if w.normalization == "sum":
    # Row sums ride along in the F·V matmul as a column of ones appended to V: one pass over
    # the tile fewer than a separate reduction.
    v_fwd = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)

  def q_block(i, carry):
    out, stat = carry
    qi = _rows(q, i, cfg)

    def tile(j):
      kj, vj = _slice(k, j * cfg.bk, cfg.bk, 1), _slice(v_fwd, j * cfg.bk, cfg.bk, 1)
      z = _scores(qi, kj, bias, i, j, cfg, qk_mult, bias_mult)
      return z, vj, _valid_tile(mask, i, j, cfg)

    if w.online_max:
      def k_block(j, c):
        acc, m = c
        z, vj, valid = tile(j)
        if valid is not None:
          z = jnp.where(valid, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked so far: no shift
        p = jnp.exp(z - m_use[..., None])
        corr = jnp.exp(m - m_use)
        acc = acc * corr[..., None] + _pv(p, vj)
        return acc, m_new

      # The offset is a virtual key with z = 0: start m at 0 and l at the offset.
      m0 = jnp.full(row_shape, 0.0 if offset > 0 else -jnp.inf, jnp.float32)
      acc0 = jnp.zeros(row_shape + (hv + 1,), jnp.float32).at[..., hv].set(offset)
      acc, m = lax.fori_loop(*_k_range(i, cfg), k_block, (acc0, m0))
      acc, l = acc[..., :hv], acc[..., hv]
      m = jnp.where(m == -jnp.inf, 0.0, m)
      empty = l == 0  # no valid key; a NaN l (NaN score) propagates to o and the statistic
      o = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None])
      st = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
    else:
      norm = w.normalization

      def k_block(j, c):
        acc, l = c
        s, vj, valid = tile(j)
        if valid is None:
          f = w.fn(s, cfg.s)
        else:
          # F never sees masked scores, so they cannot produce NaN/inf (or their gradients).
          f = jnp.where(valid, w.fn(jnp.where(valid, s, 0.0), cfg.s), 0.0)
        acc = acc + _pv(f, vj)  # for "sum", the last column accumulates rowsum(F)
        if norm == "length" and valid is not None:
          l = l + jnp.sum(jnp.broadcast_to(valid, f.shape), axis=-1, dtype=jnp.float32)
        return acc, l

      l0 = jnp.zeros(row_shape, jnp.float32)
      acc0 = jnp.zeros(row_shape + (v_fwd.shape[-1],), jnp.float32)
      acc, l = lax.fori_loop(*_k_range(i, cfg), k_block, (acc0, l0))
      if norm == "sum":
        acc, l = acc[..., :hv], acc[..., hv]
      if norm == "none":
        o, st = acc, jnp.ones(row_shape, jnp.float32)
      else:
        if norm == "sum":
          l = l + offset
        elif not cfg.needs_valid:
          l = jnp.full(row_shape, float(cfg.s), jnp.float32)
        empty = l == 0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        o, st = acc * inv[..., None], l

    return _put_rows(out, o, i, cfg), _put_rows(stat, st, i, cfg)

  out0 = jnp.zeros((x, g, tp, hv), jnp.float32)
  stat0 = jnp.zeros((x, g, tp), jnp.float32)
  return lax.fori_loop(0, cfg.nq, q_block, (out0, stat0))


# --------------------------------------------------------------------------------------------
# Backward: key blocks outside (dK, dV of a key block stay in the carry), query blocks inside
# (dQ accumulates in place in a [X, G, Tp, H] buffer).
# --------------------------------------------------------------------------------------------

def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
  """Sums the broadcast dims of x down to `shape` (same rank)."""
  axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 and n != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward(q, k, v, bias, mask, scale, out, stat, do, cfg: _Cfg):
  """(dq, dk, dv, dbias, dscale), chunk by chunk; chunks may share a broadcast bias slice."""
  x = q.shape[0]
  ccfg = dataclasses.replace(cfg, b5=cfg.chunk_b5())
  if cfg.xc == x:
    return _backward_chunk(q, k, v, bias, mask, scale, out, stat, do, ccfg)
  f32 = jnp.float32

  def chunk(c, carry):
    dq, dk, dv, dbias, dscale = carry
    rows = lambda a: _chunk_rows(a, c, cfg)
    dq_c, dk_c, dv_c, dbias_c, dscale_c = _backward_chunk(
        rows(q), rows(k), rows(v), _chunk5(bias, c, cfg), _chunk5(mask, c, cfg), scale,
        rows(out), rows(stat), rows(do), ccfg)
    put = lambda buf, a: lax.dynamic_update_slice_in_dim(buf, a, c * cfg.xc, 0)
    if cfg.has_bias:
      starts, sizes = _chunk5_start(bias, c, cfg)
      dbias = lax.dynamic_update_slice(dbias, lax.dynamic_slice(dbias, starts, sizes) + dbias_c,
                                       starts)
    return put(dq, dq_c), put(dk, dk_c), put(dv, dv_c), dbias, dscale + dscale_c

  init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32),
          jnp.zeros(bias.shape, f32) if cfg.has_bias else None, jnp.zeros((), f32))
  return lax.fori_loop(0, x // cfg.xc, chunk, init)


def _backward_chunk(q, k, v, bias, mask, scale, out, stat, do, cfg: _Cfg):
  """One chunk of :func:`_backward`."""
  w = cfg.w
  norm = w.normalization
  f32 = jnp.float32
  q_raw = q
  q, qk_mult, bias_mult, alpha = _prescale(q, scale, cfg)
  # D_i = dO_i·O_i = Σ_j w_ij dP_ij (also correct with a denominator offset).
  delta = jnp.sum(do.astype(f32) * out, axis=-1)
  if not w.online_max:
    # 1/l overflows for a denormal l (F near 0 on a whole row, e.g. power:p=3 on scores near
    # 0) and f·inf would be NaN: such rows use 1/(l·2^100) on F·2^100 instead (f ≤ l there).
    empty = stat == 0
    tiny = jnp.abs(stat) < 2.0 ** -100
    row_mult = jnp.where(tiny, 2.0 ** 100, 1.0)
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, stat * row_mult))
  bias_shape = bias.shape if cfg.has_bias else None

  def k_block(j, carry):
    dq, dkb, dvb, dbias = carry
    kj, vj = _slice(k, j * cfg.bk, cfg.bk, 1), _slice(v, j * cfg.bk, cfg.bk, 1)

    def q_block(i, c):
      # Tiles are computed transposed, [X, bk, G·bq] (keys × queries): then dV = Pᵀ·dO and
      # dK = dZᵀ·Q are plain matmuls and only dQ = dZ·K contracts over the tile's rows.
      dq, dk_j, dv_j, dbias = c
      qi, doi = _rows(q, i, cfg), _rows(do, i, cfg)
      z = jnp.einsum("xsh,xqh->xsq", kj, qi, preferred_element_type=f32)
      if qk_mult is not None:
        z = z * qk_mult
      if cfg.has_bias:
        bt = jnp.swapaxes(_flat_tile(bias, i, j, cfg), 1, 2).astype(f32)
        z = z + (bt * bias_mult if bias_mult != 1.0 else bt)
      valid = _valid_tile(mask, i, j, cfg)
      if valid is not None:
        valid = jnp.swapaxes(valid, -1, -2)
      row = lambda a: _rows(a, i, cfg)[:, None, :]  # per-query statistic, broadcast over keys
      dp = jnp.einsum("xsd,xqd->xsq", vj, doi, preferred_element_type=f32)
      # dz: the cotangent of z = α·s (α = 1 unless online max).
      if w.online_max:
        if valid is not None:
          z = jnp.where(valid, z, -jnp.inf)
        p = jnp.exp(z - row(stat))
        dz = p * (dp - row(delta))
      else:
        sv = z if valid is None else jnp.where(valid, z, 0.0)
        f, fp = jax.jvp(lambda s: w.fn(s, cfg.s), (sv,), (jnp.ones_like(sv),))
        if valid is not None:
          f, fp = jnp.where(valid, f, 0.0), jnp.where(valid, fp, 0.0)
        if norm == "none":
          p, dz = f, fp * dp
        else:
          il = row(inv_l)
          if norm == "sum":
            big = row(row_mult)
            f, fp = f * big, fp * big
            dz = fp * ((dp - row(delta)) * il)
          else:
            dz = fp * (dp * il)
          p = f * il
      dv_j = dv_j + jnp.einsum("xsq,xqd->xsd", p.astype(doi.dtype), doi,
                               preferred_element_type=f32)
      dzc = dz.astype(qi.dtype)
      dk_j = dk_j + jnp.einsum("xsq,xqh->xsh", dzc, qi, preferred_element_type=f32)
      dq_i = _rows(dq, i, cfg) + jnp.einsum("xsq,xsh->xqh", dzc, kj, preferred_element_type=f32)
      dq = _put_rows(dq, dq_i, i, cfg)
      if cfg.has_bias:
        tshape = bias_shape[:3] + tuple(
            1 if bias_shape[a] == 1 else (cfg.bq, cfg.bk)[a - 3] for a in (3, 4))
        start = (0, 0, 0, 0 if bias_shape[3] == 1 else i * cfg.bq,
                 0 if bias_shape[4] == 1 else j * cfg.bk)
        cur = lax.dynamic_slice(dbias, start, tshape)
        dz5 = jnp.swapaxes(dz, 1, 2).reshape(cfg.b5 + (cfg.bq, cfg.bk))
        dbias = lax.dynamic_update_slice(dbias, cur + _sum_to(dz5, tshape), start)
      return dq, dk_j, dv_j, dbias

    dk0 = jnp.zeros((k.shape[0], cfg.bk, k.shape[-1]), f32)
    dv0 = jnp.zeros((v.shape[0], cfg.bk, v.shape[-1]), f32)
    dq, dk_j, dv_j, dbias = lax.fori_loop(*_q_range(j, cfg), q_block, (dq, dk0, dv0, dbias))
    dkb = lax.dynamic_update_slice_in_dim(dkb, dk_j, j * cfg.bk, axis=1)
    dvb = lax.dynamic_update_slice_in_dim(dvb, dv_j, j * cfg.bk, axis=1)
    return dq, dkb, dvb, dbias

  init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32),
          jnp.zeros(bias_shape, f32) if cfg.has_bias else jnp.zeros((), f32))
  # The loop accumulated Σ dz·k (into dq) and Σ dzᵀ·q' (into dk) with q' = q·(scale·α) in
  # float32, or the unscaled q otherwise.
  dq_z, dk_z, dv, dbias_z = lax.fori_loop(0, cfg.nk, k_block, init)
  c = scale * alpha
  dq = dq_z * c
  dk = dk_z if qk_mult is None else dk_z * c
  dscale = alpha * jnp.sum(dq_z * q_raw.astype(f32))
  dbias = dbias_z * bias_mult if cfg.has_bias else None
  return dq, dk, dv, dbias, dscale


# --------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------

def _make_kernel(cfg: _Cfg):
  """A custom-VJP function of internal-layout arrays (q, k, v, bias, mask, scale) -> O."""

  @jax.custom_vjp
  def kernel(q, k, v, bias, mask, scale):
    return _forward(q, k, v, bias, mask, scale, cfg)[0].astype(q.dtype)

  def fwd(q, k, v, bias, mask, scale):
    out, stat = _forward(q, k, v, bias, mask, scale, cfg)
    return out.astype(q.dtype), (q, k, v, bias, mask, scale, out, stat)

  def bwd(res, do):
    q, k, v, bias, mask, scale, out, stat = res
    dq, dk, dv, dbias, dscale = _backward(q, k, v, bias, mask, scale, out, stat, do, cfg)
    dbias = None if bias is None else dbias.astype(bias.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, None,
            dscale.astype(scale.dtype))

  kernel.defvjp(fwd, bwd)
  return kernel


def _as_5d(x: Array | None, n: int, kh: int, name: str) -> Array | None:
  """A [B|1, N|1, T|1, S|1]-broadcastable array -> [B|1, K|1, G|1, T|1, S|1]."""
  if x is None:
    return None
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims [B, N, T, S], got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if x.shape[1] == 1:
    return x[:, :, None]
  if x.shape[1] != n:
    raise ValueError(f"{name} of shape {x.shape} has {x.shape[1]} heads, expected {n} or 1")
  return x.reshape(x.shape[0], kh, n // kh, *x.shape[2:])


def _pad_axis(x: Array, axis: int, size: int, value: Any = 0, keep_one: bool = False) -> Array:
  """Pads `axis` to `size`; a broadcast (size-1) axis stays as is when keep_one."""
  if x.shape[axis] == size or (keep_one and x.shape[axis] == 1):
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pads, constant_values=value)


def blocked_attention(q: Array, k: Array, v: Array, *, weighting: Pointwise, scale: float | Array,
                      bias: Array | None = None, mask: Array | None = None,
                      is_causal: bool = False, block_q: int | None = None,
                      block_k: int | None = None) -> Array:
  """Memory-efficient attention out_i = Σ_j w_ij v_j for a pointwise weighting F.

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H]; N must be a multiple of K (grouped-query attention: query head n
      uses kv head n // (N // K)).
    v: values [B, S, K, Hv].
    weighting: the :class:`~attnx.core.weightings.Pointwise` F and its normalization.
    scale: multiplies q·k (a Python float or a scalar array, which then gets a gradient).
    bias: optional additive bias broadcastable to [B, N, T, S] (4-D, size-1 dims allowed).
    mask: optional boolean mask broadcastable to [B, N, T, S]; True = attend.
    is_causal: query i attends key j ≤ i (top-left aligned, like ``jnp.tril``).
    block_q, block_k: tile sizes (default :func:`default_block_sizes`); T and S need not be
      multiples of them. Heads are processed in chunks that fill :data:`TILE_BUDGET`.

  Returns:
    [B, T, N, Hv] in q's dtype; equal (up to float rounding) to
    ``pointwise_weights(s, weighting, where=valid) @ v`` with float32 accumulation.
  """
  if not isinstance(weighting, Pointwise):
    raise TypeError(f"blocked_attention needs a Pointwise weighting, got {type(weighting)}")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected 4-D [B, T, N, H] inputs, got {q.shape}, {k.shape}, {v.shape}")
  b, t, n, h = q.shape
  _, s, kh, _ = k.shape
  if kh == 0 or n % kh or k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[-1] != h:
    raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean, got {mask.dtype}")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if blk is not None and blk < 1:
      raise ValueError(f"{name} must be a positive tile size, got {blk}")
  if q.size == 0 or s == 0:  # no query, or no key (every row has no valid key)
    return jnp.zeros((b, t, n, v.shape[-1]), q.dtype)
  q, k, v, bias = nonfinite_inputs(q, k, v, bias)
  g = n // kh
  dq, dk = default_block_sizes(t, s, g, is_causal)
  # A tile never needs to be longer than the (8-aligned) sequence.
  bq = min(block_q, _round_up(t, _ALIGN)) if block_q else dq
  bk = min(block_k, _round_up(s, _ALIGN)) if block_k else dk
  cfg = _Cfg(w=weighting, t=t, s=s, bq=bq, bk=bk, is_causal=is_causal,
             has_mask=mask is not None, has_bias=bias is not None, b5=(b, kh, g), kh=kh,
             xc=heads_per_chunk(b, kh, g, bq, bk))
  tp, sp = cfg.nq * bq, cfg.nk * bk

  # [B, T, N, H] -> [X, G, Tp, H] and [B, S, K, H] -> [X, Sp, H] (X = B·K), zero padded.
  q4 = _pad_axis(q.transpose(0, 2, 1, 3).reshape(b * kh, g, t, h), 2, tp)
  k3 = _pad_axis(k.transpose(0, 2, 1, 3).reshape(b * kh, s, h), 1, sp)
  v3 = _pad_axis(v.transpose(0, 2, 1, 3).reshape(b * kh, s, -1), 1, sp)
  bias5 = _as_5d(bias, n, kh, "bias")
  mask5 = _as_5d(mask, n, kh, "mask")
  if bias5 is not None:
    bias5 = _pad_axis(_pad_axis(bias5, 3, tp, keep_one=True), 4, sp, keep_one=True)
  if mask5 is not None:
    mask5 = _pad_axis(_pad_axis(mask5, 3, tp, False, True), 4, sp, False, True)
  scale_arr = jnp.asarray(scale, jnp.float32)
  out = _make_kernel(cfg)(q4, k3, v3, bias5, mask5, scale_arr)
  return out[:, :, :t].reshape(b, n, t, -1).transpose(0, 2, 1, 3)
