""":class:`RowStream`, how a whole-row weighting streams, the table of its families
(:data:`FAMILIES`, :func:`get_family`) and the family interface the kernels call: ``init``,
``update``, ``merge``, ``finalize`` and ``tile_grad`` of a stream, each its family's own."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from attnx.core.streaming import entmax, softpick, ssmax, stick_breaking
from attnx.core.streaming.family import Family, GradCarry
from attnx.core.streaming.ops import F32, XLA, Array, Ops

_BY_NAME = {f.name: f for f in (ssmax.FAMILY, softpick.FAMILY, stick_breaking.FAMILY,
                                entmax.FAMILY)}
FAMILIES = tuple(_BY_NAME)


def get_family(name: str) -> Family:
  """The :class:`Family` named ``name``, one of :data:`FAMILIES`."""
  try:
    return _BY_NAME[name]
  except KeyError:
    raise ValueError(f"Unknown streaming family {name!r}; valid: {FAMILIES}") from None


@dataclasses.dataclass(frozen=True)
class RowStream:
  """How a whole-row weighting streams: its family and parameters.

  Attributes:
    family: one of :data:`FAMILIES`.
    s: SSMax's scale of log n (a learned per-head array can also be passed to the kernels).
    eps: softpick's ε.
    alpha: entmax's α (2 = sparsemax).
    scale: entmax's multiplier of the scores (``"sparsemax:scale=2"``).
    renormalize: divide the output by Σp (entmax by bisection, whose dense form does it);
      sparsemax and 1.5-entmax end on the exact threshold of their support instead.

  The properties below are the family's traits (:class:`Family`): kernels ask them, never the
  family's name.
  """

  family: str
  s: float = 1.0
  eps: float = 1e-6
  alpha: float = 2.0
  scale: float = 1.0
  renormalize: bool = False

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"Unknown streaming family {self.family!r}; valid: {FAMILIES}")

  @property
  def rules(self) -> Family:
    """The :class:`Family` named by :attr:`family`: its functions and traits."""
    return _BY_NAME[self.family]

  @property
  def reverse(self) -> bool:
    """Whether key tiles must be visited from the last key backwards."""
    return self.rules.reverse

  @property
  def needs_row_scale(self) -> bool:
    """Whether the kernels need the per-row scale c_i = s·log n_i (SSMax)."""
    return self.rules.needs_row_scale

  @property
  def needs_threshold(self) -> bool:
    """Whether the kernels need the per-row threshold τ_i (sparsemax/entmax), which depends
    on every key of the row: passes over all keys before the first weight."""
    return self.rules.needs_threshold

  @property
  def num_stats(self) -> int:
    """How many [rows] statistics :meth:`finalize` returns for the backward."""
    return self.rules.num_stats

  @property
  def saves_support_mean(self) -> bool:
    """Whether the backward needs Σu·v/Σu ([rows, Hv]) besides the output (entmax)."""
    return self.rules.saves_support_mean

  @property
  def suffix_carries(self) -> bool:
    """Whether the backward of a key tile (or of a ring block) needs the grad carries of the
    keys after it (stick-breaking: the stick L they leave and their Σ A·dP), so that a kernel
    whose dQ and dK/dV passes are apart saves them per key tile."""
    return self.rules.suffix_carries

  @property
  def output_is_state(self) -> bool:
    """Whether :func:`finalize` returns the raw state as it is (stick-breaking: (Σ A·v, L)),
    so that a block's output and statistic are its raw state."""
    return self.rules.output_is_state

  @property
  def takes_sinks(self) -> bool:
    """Whether an attention sink means something for the family (its weights share a sum
    over the row's keys, which the sink's score enters): not stick-breaking's."""
    return self.rules.takes_sinks

  @property
  def max_start(self) -> float | None:
    """The running max m of a :class:`MaxState` that has seen no key: −∞ (SSMax), or 0 where
    m never drops below 0 (softpick: keeps e^{−m} ≤ 1); None for the other families."""
    return self.rules.max_start

  @property
  def block_stream(self) -> RowStream:
    """The stream of one key block whose state is merged with others (ring attention): this
    one without the terms that belong to the whole row (softpick's ε), which :func:`finalize`
    adds once after the merge."""
    whole_row = {name: 0.0 for name in self.rules.row_terms if getattr(self, name)}
    return dataclasses.replace(self, **whole_row) if whole_row else self


def init(rs: RowStream, rows: tuple[int, ...], hv: int, dtype: Any = F32) -> Any:
  """The state of rows that have seen no key, in ``dtype`` (the kernel's compute dtype)."""
  return rs.rules.init(rs, rows, hv, dtype)


def update(rs: RowStream, state: Any, z: Array, valid: Array, v: Array, ctx: Any,
           ops: Ops = XLA) -> Any:
  """The state after one more key tile (see :mod:`attnx.core.streaming`)."""
  return rs.rules.update(rs, state, z, valid, v, ctx, ops)


def merge(rs: RowStream, a: Any, b: Any) -> Any:
  """The state of the union of two disjoint key ranges (``a`` the later keys if reverse)."""
  return rs.rules.merge(rs, a, b)


def finalize(rs: RowStream, state: Any, ctx: Any) -> tuple[Array, tuple[Array, ...], Array | None]:
  """(output rows [rows, Hv], row statistics, Σu·v/Σu or None) of a finished state."""
  return rs.rules.finalize(rs, state, ctx)


def tile_grad(rs: RowStream, z: Array, valid: Array, dp: Array, stats: tuple[Array, ...],
              delta: Array, carry: GradCarry, ctx: Any, ops: Ops = XLA,
              weights_dtype: Any = None) -> tuple[Array, Array, GradCarry]:
  """The backward of one tile: (weights p, dz = ∂loss/∂z, carry).

  ``dp`` = dO·vᵀ on the tile; ``stats`` the row statistics of :func:`finalize`; ``delta`` the
  per-row δ_i: dO_i·O_i, or dO_i·(Σu·v/Σu)_i for entmax; ``ctx`` as in :func:`update`;
  ``weights_dtype`` the dtype the forward rounded the weights to before its P·V matmul (v's).
  """
  return rs.rules.tile_grad(rs, z, valid, dp, stats, delta, carry, ctx, ops, weights_dtype)


def residual_delta(rs: RowStream, stats: tuple[Array, ...], dstats: tuple[Array, ...],
                   u_sum: Array | None = None) -> Array:
  """What joins each row's δ when the row statistics of :func:`finalize` (the residual,
  :mod:`attnx.core.residuals`) get the cotangents ``dstats``: their score gradient has the
  form of :func:`tile_grad`'s δ term, so the kernels' backward carries it in δ.

  SSMax, softpick: lse's dz_j is the −δ term's factor (p_j, e_j·sign): −g. Stick-breaking:
  d log L/dz_j = −σ(z_j) = −β_j, the factor of δ: +g. Sparsemax/entmax: the threshold
  θ = m + τ has dθ/dz_j = (α−1)·scale·u_j/Σu (implicit, Σp = 1), and the δ term's factor is
  scale·u_j: −g_τ·(α−1)/Σu, ``u_sum`` the forward's Σu per row (Σp's cotangent is left out:
  Σp does not move with z at the threshold).
  """
  if rs.reverse:
    return dstats[0]
  if not rs.needs_threshold:
    return -dstats[0]
  _, _, norm = stats
  if rs.renormalize:  # tile_grad's u is of p̂ = p/Σp: u·(1/Σp)^{2−α}
    inv = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
    u_sum = u_sum * jnp.exp((2.0 - rs.alpha) * jnp.log(jnp.where(norm > 0, inv, 1.0)))
  ok = u_sum > 0
  return -jnp.where(ok, dstats[1] * (rs.alpha - 1.0) / jnp.where(ok, u_sum, 1.0), 0.0)


__all__ = ["FAMILIES", "RowStream", "finalize", "get_family", "init", "merge",
           "residual_delta", "tile_grad", "update"]
