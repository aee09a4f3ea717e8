"""Tile and chunk sizes of the XLA blocked kernels (:mod:`.pointwise`, :mod:`.rows`,
the causal triangle :mod:`.triangle`): a budget of scores per tile, the default tiles, the
causal triangle's leaves and how many (batch, kv head) rows one tile holds."""

from __future__ import annotations

from jax import export

from attnx.core.kernels import common
from attnx.core.kernels.xla import tiling as tl

__all__ = ["CAUSAL_LEAF", "DEFAULT_BLOCK_K", "STRUCTURED_BLOCK_K", "STRUCTURED_BLOCK_Q",
           "TILE_BUDGET", "causal_leaves", "default_block_sizes", "dividing_tile",
           "heads_per_chunk"]


# Tiles are sized by a budget of scores per tile (all heads of a chunk × G query heads × bq ×
# bk): XLA's CPU dots are faster on one tall [bq, H] × [H, bk] product than on a batch of
# shorter ones, so the kernel walks the heads in chunks and gives each chunk the tallest tile
# the budget allows; 2^20 f32 scores = 4 MiB per tile (measured: docs/guides/benchmarks.md,
# "The kernels' constants").
TILE_BUDGET = 1 << 20
DEFAULT_BLOCK_K = 256
# Causal: the side of the masked diagonal tiles (see :mod:`.triangle`). The work is T²/2 + T·d/2
# of the full T², and everything but the diagonal tiles runs unmasked with tall tiles.
CAUSAL_LEAF = 128


# Default tiles under a structured mask: the tiles it skips are whole tiles, so shorter ones
# skip more, and cost more per score (the loop's per-tile work). 512×256 was the fastest of
# 128–1024 × 128–256 at T = 16 384 for a causal 512-window and 16 packed documents, fwd+bwd on
# 2 CPU cores (docs/guides/masks.md).
STRUCTURED_BLOCK_Q = 512
STRUCTURED_BLOCK_K = 256


def default_block_sizes(t: int, s: int, group: int = 1, is_causal: bool = False,
                        budget: int | None = None) -> tuple[int, int]:
  """Default (block_q, block_k) for T queries, S keys and ``group`` query heads per kv head.

  block_k = 256 and block_q as tall as the budget (:data:`TILE_BUDGET`) allows (group ·
  block_q · block_k scores); both capped at the (8-aligned) lengths. Causal: the side d of
  the masked diagonal tiles (:func:`causal_leaves`); the squares below the diagonal get
  the non-causal tiles of their own size, cut down to divisors of the square's side.
  """
  if is_causal:
    d = causal_leaves(min(t, s), CAUSAL_LEAF)[1]
    return d, d
  budget = TILE_BUDGET if budget is None else budget
  bk = min(DEFAULT_BLOCK_K, common.round_up(max(s, 1), tl.ALIGN))
  bq = max(tl.ALIGN, (budget // (bk * max(group, 1))) // tl.ALIGN * tl.ALIGN)
  return min(bq, common.round_up(max(t, 1), tl.ALIGN)), bk


def causal_leaves(t: int, leaf: int) -> tuple[int, int]:
  """(P, d): the causal triangle of T rows as P = 2^L diagonal tiles of d ≤ max(leaf, 8) rows
  (d a multiple of 8, P·d ≥ T, P the smallest power of 2 that allows it)."""
  leaf = max(tl.ALIGN, leaf // tl.ALIGN * tl.ALIGN)
  p = 1
  while common.round_up(-(-t // p), tl.ALIGN) > leaf:
    p *= 2
  return p, common.round_up(-(-max(t, 1) // p), tl.ALIGN)


def heads_per_chunk(b: int, kv_heads: int, group: int, bq: int, bk: int,
                    budget: int | None = None) -> int:
  """How many of the X = B·K (batch, kv head) rows one tile holds: the largest count within
  the budget (:data:`TILE_BUDGET`) that divides K or is a multiple of K dividing B·K (so
  that a chunk covers a rectangle of [batch, kv head] and a bias/mask slice stays a plain
  slice). A symbolic batch (``jax.export``) is not enumerated: the chunk then divides K."""
  per_row = group * bq * bk
  fits = max(1, (TILE_BUDGET if budget is None else budget) // per_row)
  options = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
  if not export.is_symbolic_dim(b):
    options += [kv_heads * d for d in range(1, b + 1) if b % d == 0]
  return max(c for c in options if c <= fits) if fits >= 1 else 1


def dividing_tile(side: int, cap: int) -> int:
  """The largest tile ≤ cap that divides `side`, a multiple of 8 where one fits (SIMD)."""
  divisors = [t for t in range(min(cap, side), 0, -1) if side % t == 0]
  aligned = [t for t in divisors if t % tl.ALIGN == 0]
  return (aligned or divisors)[0]
