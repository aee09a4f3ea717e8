"""SSMax, softmax of c_i·z (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"):
the online softmax with the per-row scale c_i = s·log n_i (``ctx``, from :func:`row_scale`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from attnx.core.streaming.family import Family, GradCarry
from attnx.core.streaming.ops import F32, XLA, Array, Ops, masked, safe_div
from attnx.core.streaming.running_max import MaxState, max_init, max_merge

if TYPE_CHECKING:
  from attnx.core.streaming.rowstream import RowStream


def init(rs: RowStream, rows: tuple[int, ...], hv: int, dtype: Any = F32) -> MaxState:
  return max_init(rows, hv, -jnp.inf, dtype)


def update(rs: RowStream, st: MaxState, z: Array, valid: Array, v: Array, c: Array,
           ops: Ops = XLA) -> MaxState:
  y = masked(c[..., None] * masked(z, valid), valid, -jnp.inf)
  m_new = jnp.maximum(st.m, jnp.max(y, axis=-1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing valid yet: no shift
  p = jnp.exp(y - m_use[..., None])
  corr = jnp.exp(st.m - m_use)
  return MaxState(st.acc * corr[..., None] + ops.pv(p, v), st.l * corr + jnp.sum(p, axis=-1), m_new)


def merge(rs: RowStream, a: MaxState, b: MaxState) -> MaxState:
  return max_merge(a, b)


def finalize(rs: RowStream, st: MaxState, ctx: Any) -> tuple[Array, tuple[Array, ...], None]:
  m = jnp.where(st.m == -jnp.inf, 0.0, st.m)
  empty = st.l == 0  # no valid key; a NaN l propagates
  lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, st.l)))
  return safe_div(st.acc, st.l), (lse,), None


def tile_grad(rs: RowStream, z: Array, valid: Array, dp: Array, stats: tuple[Array, ...],
              delta: Array, carry: GradCarry, ctx: Any, ops: Ops = XLA,
              weights_dtype: Any = None) -> tuple[Array, Array, GradCarry]:
  row = lambda a: a[..., None]
  (lse,) = stats
  zv = masked(z, valid)
  y = masked(row(ctx) * zv, valid, -jnp.inf)
  p = masked(jnp.exp(y - row(lse)), valid)  # e^(−∞ − lse) is NaN where lse is
  dy = jnp.where(valid, p * (dp - row(delta)), 0.0)
  return p, row(ctx) * dy, GradCarry(carry.a + jnp.sum(zv * dy, axis=-1), carry.b)


def row_scale(rs: RowStream, n_valid: Array, s: Array | float | None = None,
              dtype: Any = F32) -> Array:
  """SSMax's c_i = s·log max(n_i, 1) from the count of valid keys per row, in ``dtype``."""
  s = rs.s if s is None else s
  return jnp.asarray(s, dtype) * jnp.log(jnp.maximum(n_valid.astype(dtype), 1.0))


FAMILY = Family("ssmax", init, update, merge, finalize, tile_grad, needs_row_scale=True,
                max_start=-float("inf"))

__all__ = ["FAMILY", "finalize", "init", "merge", "row_scale", "tile_grad", "update"]
