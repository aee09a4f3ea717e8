"""Stick-breaking (Tan et al. 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study"): β = σ(z), keys visited from the last one backwards carrying
L = Σ log(1 − β) of the keys already visited; every log-weight is ≤ 0, so no running max is
needed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from attnx.core.softplus import log_sigmoid_pair
from attnx.core.streaming.family import Family, GradCarry
from attnx.core.streaming.ops import F32, XLA, Array, Ops, masked

if TYPE_CHECKING:
  from attnx.core.streaming.rowstream import RowStream


class StickState(NamedTuple):
  acc: Array  # [rows, Hv] Σ A·v over the keys visited
  log_rest: Array  # [rows] L = Σ log(1 − β) over the keys visited (≤ 0)


def _reverse_exclusive_cumsum(x: Array, ops: Ops = XLA) -> Array:
  """y_j = Σ_{l > j} x_l along the last axis (shifting the inclusive sum: no cancellation)."""
  if ops.cumsum_matmul:  # x @ M, M_lj = 1 for l > j: a sum of the later terms, no cancellation
    n = x.shape[-1]
    later = (lax.broadcasted_iota(jnp.int32, (n, n), 0)
             > lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.bfloat16)
    # x = x₁ + x₂ + x₃ in bfloat16 (8 + 8 + 8 bits of float32's 24): three bf16 matmuls with
    # the exact 0/1 matrix and float32 accumulation run on tensor cores / the MXU, where a
    # float32 matmul at HIGHEST precision does not (Triton runs it without tensor cores).
    x = x.astype(F32)
    parts = []
    for _ in range(3):
      hi = x.astype(jnp.bfloat16)
      parts.append(hi)
      x = x - hi.astype(F32)
    dot = lambda p: jnp.dot(p, later, preferred_element_type=F32)
    return dot(parts[0]) + (dot(parts[1]) + dot(parts[2]))
  incl = lax.cumsum(x, axis=x.ndim - 1, reverse=True)
  return jnp.concatenate([incl[..., 1:], jnp.zeros_like(incl[..., :1])], axis=-1)


def _stick_weights(z: Array, valid: Array, log_rest: Array,
                   ops: Ops = XLA) -> tuple[Array, Array, Array]:
  """(A, b, β) of one tile: b = log(1 − β) (0 at masked keys), A the weights given the stick
  L left by the later tiles, β = σ(z)."""
  log_beta, b, beta = log_sigmoid_pair(masked(z, valid))
  b = jnp.where(valid, b, 0.0)
  log_a = log_beta + _reverse_exclusive_cumsum(b, ops) + log_rest[..., None]
  return jnp.where(valid, jnp.exp(log_a), 0.0), b, beta


def init(rs: RowStream, rows: tuple[int, ...], hv: int, dtype: Any = F32) -> StickState:
  return StickState(jnp.zeros(rows + (hv,), dtype), jnp.zeros(rows, dtype))


def update(rs: RowStream, st: StickState, z: Array, valid: Array, v: Array, ctx: Any,
           ops: Ops = XLA) -> StickState:
  a, b, _ = _stick_weights(z, valid, st.log_rest, ops)
  return StickState(st.acc + ops.pv(a, v), st.log_rest + jnp.sum(b, axis=-1))


def merge(rs: RowStream, later: StickState, earlier: StickState) -> StickState:
  """Keys of ``later`` come after those of ``earlier``: they break the stick first."""
  rest = jnp.exp(later.log_rest)
  return StickState(later.acc + rest[..., None] * earlier.acc,
                    later.log_rest + earlier.log_rest)


def finalize(rs: RowStream, state: StickState,
             ctx: Any) -> tuple[Array, tuple[Array, ...], None]:
  return state.acc, (state.log_rest,), None


def tile_grad(rs: RowStream, z: Array, valid: Array, dp: Array, stats: tuple[Array, ...],
              delta: Array, carry: GradCarry, ctx: Any, ops: Ops = XLA,
              weights_dtype: Any = None) -> tuple[Array, Array, GradCarry]:
  row = lambda a: a[..., None]
  a, b, beta = _stick_weights(z, valid, carry.a, ops)
  # δ = dO·O sums the weights as the forward's P·V saw them (rounded to v's dtype): round
  # them the same way here, or δ − Σ_{j > k} a_j cancels to the rounding error of 16-bit
  # weights (Tan et al.'s and flash-linear-attention's kernels take c_i = ⟨dO, O⟩ likewise).
  a_seen = (a if weights_dtype is None or jnp.dtype(weights_dtype).itemsize >= 4
            else a.astype(weights_dtype).astype(a.dtype))
  ad = a_seen * dp
  # dz_k = a_k − σ(z_k)·Σ_{j ≤ k} a_j, and Σ_{j ≤ k} a_j = δ − Σ_{j > k} a_j (δ = dO·O).
  later = _reverse_exclusive_cumsum(ad, ops) + row(carry.b)
  dz = ad - beta * (row(delta) - later)
  return a, jnp.where(valid, dz, 0.0), GradCarry(carry.a + jnp.sum(b, axis=-1),
                                                 carry.b + jnp.sum(ad, axis=-1))


FAMILY = Family("stick_breaking", init, update, merge, finalize, tile_grad, reverse=True,
                suffix_carries=True, output_is_state=True, takes_sinks=False)

__all__ = ["FAMILY", "StickState", "finalize", "init", "merge", "tile_grad", "update"]
