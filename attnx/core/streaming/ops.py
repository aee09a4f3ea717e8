"""How the streaming rules' tile math is spelled in a kernel language (:class:`Ops`, and
:data:`XLA`, the blocked kernels' spelling), and the primitives every rule shares."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core.contract import compute_dtype

Array = jax.Array
F32 = jnp.float32
LOG2E = math.log2(math.e)  # natural exponent -> base-2 units (Ops.exp2)


@dataclasses.dataclass(frozen=True)
class Ops:
  """How the tile math is spelled in a kernel language: the primitives it lacks, its layouts.

  The defaults are the XLA forms the blocked kernels use (:data:`XLA`); the Pallas kernels
  (:mod:`attnx.core.kernels.pallas`: ``triton.OPS``, ``mosaic.OPS`` for a pointwise F,
  ``triton_rows.OPS``, ``mosaic_rows.OPS`` for the whole-row families) pick alternatives that
  compute the same functions with other rounding, in other units (exp2) or layouts.

  Attributes:
    cumsum_matmul: stick-breaking's reverse exclusive cumsum along a tile's keys as matmuls
      with the strictly triangular 0/1 matrix (float32 split into three bfloat16 parts, each
      product exact, float32 accumulation): Triton lowers no reverse cumsum, Mosaic no cumsum.
    concat_pv: entmax's Σp·v and Σu·v as one matmul of the stacked rows [p; u] (True) or as
      two: Triton concatenates only [..., 1] arrays.
    all_rows: the threshold loop stops when every row is done, tested with ``jnp.all`` (True)
      or as a float32 minimum (no boolean reductions: Triton).
    sign: softpick's sign(z) by ``jnp.sign`` (True) or by comparisons (Mosaic's sign rule asks
      the TPU for its generation, so it does not lower on a host without one).
    threshold_loop: entmax's threshold passes in a ``lax.while_loop`` that stops once every
      row is done (``"while"``), or in a ``lax.fori_loop`` of
      :data:`~attnx.core.streaming.MAX_THRESHOLD_PASSES` whose passes after that are skipped
      by ``lax.cond`` (``"fori"``).
    exp2: the pointwise online max's scores arrive in base-2 units (z·log₂e, the factor
      folded into the score's scale), so its exponentials are exp2 and its statistic a
      log2-sum-exp (True: the Pallas kernels, as FlashAttention-2), or natural units (False).
    ones_column: a pointwise F with ``"sum"`` gets its row sum Σ F from the F·V matmul, V
      carrying a column of ones the caller appended (True: one pass over the tile fewer), or
      from a separate sum over the tile's keys (False: Triton arrays have power-of-2 dims and
      Mosaic's lanes come by 128, so Hv + 1 columns do not fit).
    lanes: the pointwise rules' row statistics are [..., rows] (0), or [rows, lanes]
      replicated over the lanes (Mosaic: 1-D vectors and [rows, 1] columns lay out badly on
      the TPU's (8, 128) vregs); :meth:`row_max`, :meth:`row_sum` and :meth:`spread` follow.
    matmul: the P·V product of :meth:`pv` where V keeps another layout than [..., keys, Hv]
      (None: :func:`pv`).
    support_stop: sparsemax and 1.5-entmax end their threshold search the pass their support
      is final (True), or by the step size alone (False: the Triton row forward, where the
      search's larger carry spilled registers when compiled for an H100).
  """

  cumsum_matmul: bool = False
  concat_pv: bool = True
  all_rows: bool = True
  sign: bool = True
  threshold_loop: str = "while"
  exp2: bool = False
  ones_column: bool = True
  lanes: int = 0
  matmul: Any = None
  support_stop: bool = True

  def pv(self, p: Array, v: Any) -> Array:
    """Σ_j p_ij v_j of a tile's weights p [..., rows, keys]: :func:`pv` on v [..., keys, Hv],
    or :attr:`matmul` (p, v) where v comes in the layout of a kernel that keeps it as stored
    (the split-KV decoding kernel: v [B, C, L, K, Hv], never transposed)."""
    return pv(p, v) if self.matmul is None else self.matmul(p, v)

  def exp(self, x: Array) -> Array:
    """The online max's exponential: eˣ, or 2ˣ when the scores are in base-2 units."""
    return jnp.exp2(x) if self.exp2 else jnp.exp(x)

  def log(self, x: Array) -> Array:
    """The inverse of :meth:`exp` (for the log-sum-exp statistic)."""
    return jnp.log2(x) if self.exp2 else jnp.log(x)

  def row_max(self, x: Array) -> Array:
    """The max over a tile's keys (last axis), in the layout of the row statistics."""
    return jnp.max(x, axis=-1, keepdims=self.lanes > 0)

  def row_sum(self, x: Array, dtype: Any = None) -> Array:
    """The sum over a tile's keys (last axis), in the layout of the row statistics."""
    return jnp.sum(x, axis=-1, dtype=dtype, keepdims=self.lanes > 0)

  def spread(self, r: Array, n: int) -> Array:
    """A row statistic broadcast against n columns (a tile's keys or an accumulator's)."""
    if not self.lanes:
      return r[..., None]
    if r.dtype == jnp.bool_:  # Mosaic tiles no i1 vectors: through float32
      return _lanes(r.astype(F32), n, self.lanes) > 0
    return _lanes(r, n, self.lanes)


XLA = Ops()


def _lanes(x: Array, n: int, lanes: int) -> Array:
  """A lane-replicated [rows, lanes] value as [rows, n] (tiled, or sliced below ``lanes``)."""
  if n % lanes == 0:
    return jnp.tile(x, (1, n // lanes)) if n != lanes else x
  if n < lanes:
    return x[:, :n]
  return jnp.tile(x, (1, -(-n // lanes)))[:, :n]


def pv(p: Array, v: Array) -> Array:
  """Σ_j p_ij v_j accumulated in max(float32, v's dtype); p [..., rows, keys], v [..., keys,
  Hv]."""
  return jnp.einsum("...qs,...sd->...qd", p.astype(v.dtype), v,
                    preferred_element_type=compute_dtype(v.dtype))


def masked(z: Array, valid: Array, fill: float = 0.0) -> Array:
  """z at the valid keys, ``fill`` elsewhere."""
  return jnp.where(valid, z, fill)


def safe_div(acc: Array, l: Array) -> Array:
  """acc [rows, Hv] divided by l [rows] row by row; 0 in the rows where l = 0 (no weight)."""
  empty = l == 0
  return jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None])


__all__ = ["F32", "XLA", "Array", "Ops", "masked", "pv", "safe_div"]
