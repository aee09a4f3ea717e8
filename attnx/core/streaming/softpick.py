"""Softpick, relu(eᶻ − 1)/(Σ|eᶻ − 1| + ε) (Zuhri et al. 2025, "Softpick: No Attention Sink, No
Massive Activations with Rectified Softmax"), streamed with a running max m ≥ 0: the e^{−m} of
the "−1" rescales like e^{z−m}, and m ≥ 0 keeps e^{−m} ≤ 1, exact. With 16-bit values its P·V
takes each weight as two 16-bit parts: the backward multiplies δ = dO·O by e^z/Σ|e^z − 1|, up to
~1/|z|, so O must hold the weights to better than 16 bits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from attnx.core.streaming.family import Family, GradCarry
from attnx.core.streaming.ops import F32, XLA, Array, Ops, masked, safe_div
from attnx.core.streaming.running_max import MaxState, max_init, max_merge

if TYPE_CHECKING:
  from attnx.core.streaming.rowstream import RowStream


# Below this |z| softpick's eᶻ − 1 is a Taylor polynomial: e^{z−m} − e^{−m} would lose up to
# log2(e^z/|e^z − 1|) bits to cancellation (3 bits at |z| = 1/8, all of them as z → 0).
_TAYLOR_Z = 0.125


def scaled_expm1(z: Array, e_shifted: Array, e_neg_shift: Array) -> Array:
  """e^{−c}(eᶻ − 1) from e_shifted = e^{z−c} and e_neg_shift = e^{−c}, with one exponential per
  entry (the caller's e^{z−c}): e^{z−c} − e^{−c} where |z| ≥ 1/8 (≤ 3 bits of cancellation:
  relative error ≲ 1e-6), the degree-6 Taylor polynomial of eᶻ − 1 times e^{−c} below
  (truncation ≤ 1e-9 relative). Nothing overflows where e^{z−c} and e^{−c} are finite, where
  eᶻ − 1 alone overflows past z ≈ 88 (a second exponential for those rows)."""
  taylor = z * (1.0 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z * (1 / 720))))))
  return jnp.where(jnp.abs(z) < _TAYLOR_Z, taylor * e_neg_shift, e_shifted - e_neg_shift)


def _softpick_d(z: Array, valid: Array, m: Array) -> Array:
  """e^{−m}(eᶻ − 1) on valid keys (0 elsewhere), m ≥ max(0, z)."""
  zv = masked(z, valid)
  mm = m[..., None]
  return jnp.where(valid, scaled_expm1(zv, jnp.exp(zv - mm), jnp.exp(-mm)), 0.0)


def _pv_split(p: Array, v: Array, ops: Ops = XLA) -> Array:
  """Σ_j p_ij v_j with p kept to ~2⁻¹⁶ when v is 16-bit: p = hi + lo, both in v's dtype.

  Softpick's backward takes δ_i = dO_i·O_i for Σ_j p_ij dP_ij and multiplies it by
  e^{z − lse} = e^z/(Σ|e^z − 1| + ε), up to ~1/|z| when every score is near 0: O made of p
  rounded to 16 bits (up to 2⁻⁸ relative in bfloat16) would put an error up to |dP|/(256·|z|)
  in dS, while dense autodiff forms Σ p·dP from the float32 weights. hi is p rounded to v's
  dtype, p − hi is exact in float32 and ≤ 2⁻⁸·p (bfloat16; float16: max(2⁻¹¹·p, 2⁻²⁵), its
  subnormals), so lo's own rounding leaves ≤ 2⁻¹⁶·p (float16: max(2⁻²²·p, 2⁻²⁵)): each product
  with a 16-bit v is exact, accumulated in float32. A 32- or 64-bit v: one matmul, as
  :func:`pv` (p is not rounded).
  """
  if jnp.dtype(v.dtype).itemsize >= 4:
    return ops.pv(p, v)
  hi = p.astype(v.dtype)
  lo = (p - hi.astype(F32)).astype(v.dtype)
  return ops.pv(hi, v) + ops.pv(lo, v)



def init(rs: RowStream, rows: tuple[int, ...], hv: int, dtype: Any = F32) -> MaxState:
  return max_init(rows, hv, 0.0, dtype)  # m ≥ 0 keeps e^{−m} ≤ 1


def update(rs: RowStream, st: MaxState, z: Array, valid: Array, v: Array, ctx: Any,
           ops: Ops = XLA) -> MaxState:
  m_new = jnp.maximum(st.m, jnp.max(masked(z, valid, -jnp.inf), axis=-1))  # m starts at 0
  d = _softpick_d(z, valid, m_new)
  corr = jnp.exp(st.m - m_new)
  return MaxState(st.acc * corr[..., None] + _pv_split(jax.nn.relu(d), v, ops),
                  st.l * corr + jnp.sum(jnp.abs(d), axis=-1), m_new)


def merge(rs: RowStream, a: MaxState, b: MaxState) -> MaxState:
  return max_merge(a, b)


def finalize(rs: RowStream, st: MaxState, ctx: Any) -> tuple[Array, tuple[Array, ...], None]:
  denom = st.l + rs.eps * jnp.exp(-st.m)
  empty = denom == 0
  lse = jnp.where(empty, jnp.inf, st.m + jnp.log(jnp.where(empty, 1.0, denom)))
  return safe_div(st.acc, denom), (lse,), None


def tile_grad(rs: RowStream, z: Array, valid: Array, dp: Array, stats: tuple[Array, ...],
              delta: Array, carry: GradCarry, ctx: Any, ops: Ops = XLA,
              weights_dtype: Any = None) -> tuple[Array, Array, GradCarry]:
  row = lambda a: a[..., None]
  (lse,) = stats
  zv = masked(z, valid)
  e = jnp.where(valid, jnp.exp(zv - row(lse)), 0.0)
  # lse ≥ log ε (m ≥ 0 and the denominator ≥ ε·e^{−m}): e^{−lse} ≤ 1/ε, no overflow.
  p = jnp.where(valid, jax.nn.relu(scaled_expm1(zv, e, jnp.exp(-row(lse)))), 0.0)
  sign = (jnp.sign(zv) if ops.sign
          else jnp.where(zv > 0, 1.0, jnp.where(zv < 0, -1.0, zv)))  # zv: ±0 and NaN
  dz = e * (jnp.where(zv > 0, dp, 0.0) - sign * row(delta))
  return p, jnp.where(valid, dz, 0.0), carry


FAMILY = Family("softpick", init, update, merge, finalize, tile_grad, max_start=0.0,
                row_terms=("eps",))

__all__ = ["FAMILY", "finalize", "init", "merge", "scaled_expm1", "tile_grad", "update"]
