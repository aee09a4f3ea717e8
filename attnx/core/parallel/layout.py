"""The ring's layouts: which positions each device holds, and what each ring step computes.

``"contiguous"``: device i holds chunk i of the sequence; ``"zigzag"``: the sequence is cut into
2P chunks and device i holds chunks i and 2P − 1 − i (:func:`zigzag_permute`), so that every
causal ring step is half a block on every device (:func:`ring_work`). A step is one of a few
kinds (:func:`step_kind`: skip, full, the diagonal, and zigzag's three), each a tuple of
:class:`Piece` s that the kernels run (:data:`PIECES`).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
LAYOUTS = ("contiguous", "zigzag")

__all__ = ["DIAG", "FULL", "LAYOUTS", "PIECES", "Piece", "SKIP", "ZZ_DIAG", "ZZ_HIGH", "ZZ_LOW",
           "check_chunks", "check_layout", "piece_work", "positions", "ring_work", "step_kind",
           "zigzag_order", "zigzag_permute", "zigzag_unpermute"]


def check_layout(layout: Any) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"Unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}.")


class Piece(NamedTuple):
  """What one ring step computes on a device: local query rows [row_lo, row_hi) against keys
  [key_lo, key_hi) of the visiting shard, in units of half a shard (zigzag chunks), with the
  causal mask of those positions or none."""

  row_lo: int
  row_hi: int
  key_lo: int
  key_hi: int
  causal: bool


# The kinds of ring step, as indices of lax.switch branches.
SKIP, FULL, DIAG, ZZ_DIAG, ZZ_LOW, ZZ_HIGH = range(6)
PIECES = {
    SKIP: (),
    FULL: (Piece(0, 2, 0, 2, False),),
    DIAG: (Piece(0, 2, 0, 2, True),),
    # Own chunks (a, b) = (i, 2P − 1 − i): a×a causal, b×a full, b×b causal, a×b above the
    # diagonal. a comes before b, so that is the plain causal mask of the local positions: one
    # causal block, whose tiles above the diagonal the kernel skips.
    ZZ_DIAG: (Piece(0, 2, 0, 2, True),),
    # From device j < i: both local chunks see chunk j, none sees chunk 2P − 1 − j.
    ZZ_LOW: (Piece(0, 2, 0, 1, False),),
    # From device j > i: chunk i sees neither; chunk 2P − 1 − i sees both.
    ZZ_HIGH: (Piece(1, 2, 0, 2, False),),
}


def step_kind(i: Any, src: Any, layout: str, is_causal: bool, xp: Any = jnp) -> Any:
  """The kind of step device i runs on the shard of device src (ints or traced int32)."""
  if not is_causal:
    return FULL
  if layout == "contiguous":
    return xp.where(src == i, DIAG, xp.where(src < i, FULL, SKIP))
  return xp.where(src == i, ZZ_DIAG, xp.where(src < i, ZZ_LOW, ZZ_HIGH))


def piece_work(piece: Piece) -> float:
  r0, r1, k0, k1, causal = piece
  return (r1 - r0) * (k1 - k0) * (0.5 if causal else 1.0)


def ring_work(num_devices: int, layout: str = "contiguous", is_causal: bool = True, *,
              mask: Any = None, length: int | None = None, batch: tuple[int, ...] = (1,),
              num_heads: int = 1) -> np.ndarray:
  """The work of each device over a whole ring, [P] floats, in tiles of chunk × chunk scores
  (a chunk is T/(2P) positions; a causal triangle counts ½): what the ring schedules, read
  from the same table of step kinds the kernel runs.

  Non-causal: 4P everywhere. Causal contiguous: 4i + 2 (device P − 1 does 2 − 1/P times the
  mean, and the ring waits for it); zigzag: 2P on every device. (Stick-breaking in the zigzag
  layout runs the same total per device, but its two half-shards travel on schedules of their
  own: one step costs up to 3 chunk tiles on some devices, where every step of this table
  costs 2.)

  ``mask``: a structured mask (:mod:`attnx.core.masks`, concrete arrays) of a sequence of
  ``length`` positions (``batch`` dims and ``num_heads`` as the call's): the steps in which it
  lets no query of the device meet a key of the visiting shard count nothing, as the ring
  skips them (stick-breaking in the zigzag layout skips none).

  Example:
    >>> from attnx import core
    >>> print(core.ring_work(4, "contiguous"), core.ring_work(4, "zigzag"))
    [ 2.  6. 10. 14.] [8. 8. 8. 8.]
  """
  check_layout(layout)
  p = int(num_devices)
  meets = np.ones((p, p), bool)
  if mask is not None:
    if length is None or length % (2 * p if layout == "zigzag" else p):
      raise ValueError(f"ring_work with a mask needs the sequence length, a multiple of "
                       f"{2 * p if layout == 'zigzag' else p}; got length={length!r}.")
    bound = mask.bind(tuple(batch), num_heads, length, length)
    t = length // p
    b = np.arange(int(np.prod(batch)))[:, None, None, None]
    h = np.arange(num_heads)[None, :, None, None]
    pos = [positions(d, t, p, layout, np) for d in range(p)]
    meets = np.array([[bool(np.any(bound.mask_mod(b, h, pos[i][:, None], pos[j][None, :])))
                       for j in range(p)] for i in range(p)])
  out = np.zeros(p)
  for i in range(p):
    for r in range(p):
      src = (i - r) % p
      kind = int(step_kind(i, src, layout, is_causal, np))
      if meets[i, src]:
        out[i] += sum(piece_work(pc) for pc in PIECES[kind])
  return out


# --------------------------------------------------------------------------------------------
# The zigzag layout.
# --------------------------------------------------------------------------------------------

def zigzag_order(num_devices: int) -> np.ndarray:
  """The chunk order of the zigzag layout: 0, 2P−1, 1, 2P−2, …, P−1, P."""
  p = num_devices
  return np.array([c for i in range(p) for c in (i, 2 * p - 1 - i)])


def check_chunks(x: Any, num_devices: int, axis: int) -> tuple[int, int]:
  if not isinstance(num_devices, numbers.Integral) or num_devices < 1:
    raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
  n = x.shape[axis]
  if n % (2 * num_devices):
    raise ValueError(f"the zigzag layout cuts the sequence into 2·P = {2 * num_devices} "
                     f"chunks: axis {axis} of length {n} does not split")
  return n // (2 * num_devices), axis % x.ndim


def zigzag_permute(x: Array, num_devices: int, axis: int = 1) -> Array:
  """The natural sequence order along ``axis`` -> the zigzag layout: cut into 2P chunks, device
  i's shard (the i-th of P equal parts of the result) holds chunks i and 2P − 1 − i.

  Shard the result along ``axis`` over the ring's mesh axis (e.g. ``P(None, "sp")`` for
  [B, T, N, H]); :func:`zigzag_unpermute` restores the natural order of the output. A bias or
  mask with both a T and an S axis is permuted along both.

  Example:
    >>> import jax.numpy as jnp
    >>> from attnx import core
    >>> z = core.zigzag_permute(jnp.arange(8)[None], num_devices=2)  # chunks of 2 positions
    >>> print(z)  # device 0: chunks 0 and 3, device 1: chunks 1 and 2
    [[0 1 6 7 2 3 4 5]]
    >>> print(core.zigzag_unpermute(z, num_devices=2))
    [[0 1 2 3 4 5 6 7]]
  """
  c, axis = check_chunks(x, num_devices, axis)
  chunks = x.reshape(x.shape[:axis] + (2 * num_devices, c) + x.shape[axis + 1:])
  out = jnp.take(chunks, jnp.asarray(zigzag_order(num_devices)), axis=axis)
  return out.reshape(x.shape)


def zigzag_unpermute(x: Array, num_devices: int, axis: int = 1) -> Array:
  """The inverse of :func:`zigzag_permute`: zigzag layout -> natural order along ``axis``."""
  c, axis = check_chunks(x, num_devices, axis)
  chunks = x.reshape(x.shape[:axis] + (2 * num_devices, c) + x.shape[axis + 1:])
  inverse = np.argsort(zigzag_order(num_devices))
  return jnp.take(chunks, jnp.asarray(inverse), axis=axis).reshape(x.shape)


def positions(dev: Any, t: int, p: int, layout: str, xp: Any = jnp) -> Array:
  """Global positions of device ``dev``'s t local rows (int32 [t]; ``xp=np`` for a static
  device index)."""
  r = xp.arange(t, dtype=xp.int32)
  if layout == "contiguous":
    return dev * t + r
  c = max(t // 2, 1)
  chunk = xp.where(r < c, dev, 2 * p - 1 - dev)
  return chunk * c + r % c
