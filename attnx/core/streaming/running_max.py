"""The running maximum that SSMax and softpick stream with: :class:`MaxState`, its empty
state and its merge."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from attnx.core.streaming.ops import F32, Array


class MaxState(NamedTuple):
  acc: Array  # [rows, Hv] Σ weight·v, in units of e^{m}
  l: Array  # [rows] the denominator's running sum, in the same units
  m: Array  # [rows] the running maximum


def max_init(rows: tuple[int, ...], hv: int, m0: float, dtype: Any = F32) -> MaxState:
  return MaxState(jnp.zeros(rows + (hv,), dtype), jnp.zeros(rows, dtype),
                  jnp.full(rows, m0, dtype))


def max_merge(a: MaxState, b: MaxState) -> MaxState:
  m = jnp.maximum(a.m, b.m)
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  ca, cb = jnp.exp(a.m - m_use), jnp.exp(b.m - m_use)
  return MaxState(a.acc * ca[..., None] + b.acc * cb[..., None], a.l * ca + b.l * cb, m)


__all__ = ["MaxState", "max_init", "max_merge"]
