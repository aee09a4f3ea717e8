"""Random configurations of ring attention for the differential net (no side effects).

The fixed table of :mod:`support.ring_cases` reaches each documented path once, at one length
on 8 devices. The net's rule is that kernels are checked on random shapes too: here a seed
draws a whole ring problem — the weighting (every streamable family, with the variants the
differential net draws), the score, the layout, causal or not, P ∈ {2, 4, 8} devices, local
lengths (global lengths P·local up to several thousand, most of them no power of two; T ≠ S
when not causal), GQA, batch, head sizes, a mask and a bias in every sharding the ring
accepts, tile caps, SSMax with a learned per-head s, kv heads in several passes, and (from a
stream of their own, :func:`_with_mods`) the differential net's score modifications and
attention sinks — as a :class:`RingDraw`.
tests/support/ring_check.py (``--random``) runs draws on 8 fake CPU devices against the
float64 brute force; tests/core/test_ring.py holds the CI sample and the large run.

Kept free of JAX device set-up, so that the test can list draws (and check what the CI sample
covers) in its own process.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attnx.core import problem
from attnx.core import weightings as wlib
from attnx.core.parallel import ring, steps
from support import differential as diff
from support import reference as ref_lib

FAMILIES = steps.FAMILIES  # pointwise, ssmax, softpick, stick_breaking
LAYOUTS = ring.LAYOUTS
DEVICE_COUNTS = (2, 4, 8)


def streamable_weightings() -> tuple[str, ...]:
  """The weightings of the differential net (registry and variants) that can run in a ring."""
  out = []
  for name in diff.WEIGHTINGS:
    w = wlib.get_weighting(name)
    if w.kind == "pointwise" or w.stream_rule in FAMILIES:
      out.append(name)
  return tuple(out)


def family_of(weighting: str) -> str:
  w = wlib.get_weighting(weighting)
  return "pointwise" if w.kind == "pointwise" else w.stream_rule


def _by_family() -> dict[str, tuple[str, ...]]:
  names = streamable_weightings()
  return {f: tuple(n for n in names if family_of(n) == f) for f in FAMILIES}


@dataclasses.dataclass(frozen=True)
class RingDraw:
  """One random ring problem: a differential-net :class:`~support.differential.Case` of the
  global arrays (its ``block_q``/``block_k`` are the ring's tile caps), the layout, the number
  of devices P the sequence is sharded over, and SSMax's learned per-head s (or None)."""
  seed: int
  case: diff.Case
  layout: str
  devices: int
  learned_s: tuple[float, ...] | None = None
  kv_head_block: int | None = None  # kv heads per pass (None: the ring's default)
  pallas: bool = False  # every step on the Pallas kernels (in Pallas' interpreter)

  @property
  def passes(self) -> bool:
    """Whether the ring runs the kv heads in more than one pass."""
    return self.kv_head_block is not None and self.kv_head_block < self.case.kh

  @property
  def family(self) -> str:
    return family_of(self.case.weighting)

  @property
  def local(self) -> tuple[int, int]:
    return self.case.t // self.devices, self.case.s // self.devices

  def mask_kind(self) -> str:
    """How the ring sees the mask: "none", "travel" (S sharded with the keys), "rows" (the
    whole S axis, T sharded) or "const" (S axis 1)."""
    return _kind(None if self.case.mask == "none" else _MASK_PATTERN[self.case.mask])

  def bias_kind(self) -> str:
    return _kind(self.case.bias)

  def capped(self) -> bool:
    """Whether a tile cap is below a local length (the kernel's tiles are the caps' divisors
    rather than its defaults)."""
    t, s = self.local
    return ((self.case.block_q is not None and self.case.block_q < t)
            or (self.case.block_k is not None and self.case.block_k < s))

  def label(self) -> str:
    extra = f" learned_s={list(self.learned_s)}" if self.learned_s else ""
    extra += f" kv_head_block={self.kv_head_block}" if self.kv_head_block else ""
    extra += " pallas" if self.pallas else ""
    return (f"ring seed={self.seed} layout={self.layout} devices={self.devices} "
            f"local={self.local}{extra} | {self.case.label()}")


# [B, N, T, S] patterns of the differential net's mask kinds ("random": T and S both there).
_MASK_PATTERN = {"padding": "x11x", "rows": "x1x1", "columns": "1x1x", "random": "xxxx"}


def _kind(pattern: str | None) -> str:
  if pattern is None:
    return "none"
  if pattern[3] == "1":
    return "const"
  return "rows" if pattern[2] == "x" else "travel"


# Local lengths: the edges of the kernel's tiling (1, 8 ± 1, 64 ± 1, ...), then short, medium
# and long shards. Lengths ≥ 64 that only split into tiles below 8 are refused by the ring
# (see steps.check_tiles) and redrawn.
_EDGE_LOCAL = (1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 63, 64, 66, 96, 120, 128, 136, 200, 256)
_SIZES = {
    # (P(short), P(medium), medium high, long high, max B·N·T·S of the reference)
    "ci": (0.7, 0.3, 100, 100, 1 << 20),
    "large": (0.3, 0.4, 240, 600, 1 << 23),
}
_CAPS_POW2 = (8, 16, 32, 64, 128, 256)
_CAPS_8K = (24, 40, 72, 136)
_CAPS_ODD = (3, 7, 13)


def _local(rng: np.random.Generator, size: str) -> int:
  short, medium, mid_hi, long_hi, _ = _SIZES[size]
  u = rng.random()
  if u < 0.1:
    return int(rng.choice(_EDGE_LOCAL))
  if u < 0.1 + short:
    return int(rng.integers(1, 64))
  if u < 0.1 + short + medium or long_hi <= mid_hi:
    return int(rng.integers(64, mid_hi + 1))
  return int(rng.integers(mid_hi, long_hi + 1))


def _cap(rng: np.random.Generator) -> int | None:
  u = rng.random()
  if u < 0.45:
    return None
  if u < 0.75:
    return int(rng.choice(_CAPS_POW2))
  if u < 0.92:
    return int(rng.choice(_CAPS_8K))
  return int(rng.choice(_CAPS_ODD))


def _accepted(d: RingDraw) -> bool:
  """Whether ring_attention runs the draw rather than refusing it (local lengths ≥ 64 whose
  tiles would be a few rows; a bias or mask at one position per device)."""
  c = d.case
  t, s = d.local
  if d.devices > 1 and t == s == 1 and (c.mask != "none" or c.bias is not None):
    return False  # the ring refuses a [.., 1, 1] shard: query- or key-sharded is ambiguous
  rc = steps.RingConfig(axis="sp", p=d.devices, layout=d.layout, is_causal=c.causal,
                        w=wlib.get_weighting(c.weighting), family=d.family, t=t, s=s,
                        head_dims=(c.b, c.kh, c.n // c.kh), bias_kind=d.bias_kind(),
                        mask_kind=d.mask_kind(), block_q=c.block_q, block_k=c.block_k)
  try:
    steps.check_tiles(rc)
  except ValueError:
    return False
  return True


def draw(seed: int, size: str = "large", family: str | None = None, layout: str | None = None,
         causal: bool | None = None, devices: int | None = None,
         long: bool = False, learned: bool | None = None, kind: str | None = None,
         weighting: str | None = None, score_mod: str | None = None,
         sinks: bool | None = None) -> RingDraw:
  """The random ring problem of this seed (the same on every machine). ``size``: "ci"
  (short shards, a small reference) or "large" (shards up to 600 positions, global lengths up
  to 4800). ``family``, ``layout``, ``causal``, ``devices`` fix those choices (the CI sample
  stratifies over them); ``learned`` whether SSMax's s is a learned per-head array (drawn
  when None); ``weighting`` fixes F (and its family); ``long`` forces P = 8 and a global
  length ≥ 1000 that is no power of two; ``kind`` ("pointwise" or "row") restricts the
  weighting's family like the differential net's ATTNX_DIFF_KIND. ``score_mod`` ("none",
  "cap", "alibi", "table", "fn") and ``sinks`` fix the score modification and the sinks
  (drawn when None, :func:`_with_mods`; sinks only where the weighting defines them)."""
  rng = np.random.default_rng([20261126, seed])
  families = {f: names for f, names in _by_family().items()
              if kind is None or (f == "pointwise") == (kind == "pointwise")}
  if weighting is not None:
    family = family_of(weighting)
  if family is None:
    # Pointwise F (most of the registry) about half the time, each whole-row family (a kernel
    # of its own) a sixth.
    fams = list(families)
    probs = np.array([3.0 if f == "pointwise" else 1.0 for f in fams])
    family = str(rng.choice(fams, p=probs / probs.sum()))
  weighting = weighting or str(rng.choice(families[family]))
  scores = [sc for sc in diff._compatible_scores(weighting) if sc != "additive"]
  score = "scaled_dot" if "scaled_dot" in scores and rng.random() < 0.5 else str(
      rng.choice(scores))
  layout = layout or str(rng.choice(LAYOUTS))
  causal = bool(rng.random() < 0.5) if causal is None else causal
  devices = 8 if long else devices or int(rng.choice(DEVICE_COUNTS))
  b = int(rng.integers(1, 3))
  kh = int(rng.choice((1, 1, 2, 3)))
  g = int(rng.choice((1, 1, 2, 4)))
  h = int(rng.choice((1, 3, 8, 12, 16, 24, 32, 40, 64)))
  hv = h if rng.random() < 0.7 else int(rng.choice((1, 5, 16, 24)))
  mag = float(rng.choice((0.3, 1.0, 2.0)))
  if score in ("neg_sq_dist", "metric"):
    mag = 0.3 / math.sqrt(max(h, 1) / 8)
  scale = None if rng.random() < 0.8 else float(rng.choice((0.1, 0.5, 1.7)))
  mask = str(rng.choice(diff.MASKS))
  bias = None
  if rng.random() < 0.45:
    bias = "".join(rng.choice(("1", "x")) for _ in range(4))
  learned_s = None
  if family == "ssmax" and (rng.random() < 0.4 if learned is None else learned):
    learned_s = tuple(float(np.float32(x)) for x in rng.uniform(0.3, 1.6, kh * g))
    weighting = "ssmax"  # the learned s replaces the name's
  mask_bn = "".join(rng.choice(("1", "x")) for _ in range(2))
  per_head = bool(rng.random() < 0.5)
  even = layout == "zigzag"  # the test cuts each axis into 2P chunks
  budget = max(_SIZES[size][4], 1 << 22 if long else 0)
  for _ in range(1000):  # lengths the ring accepts and the reference affords
    if long:
      lt = 2 * int(rng.integers(63, 100)) + 1  # odd: P·local = 8·odd, no power of two
      lt += lt % 2 if even else 0
      ls = lt
    else:
      lt = _local(rng, size)
      ls = lt if causal or rng.random() < 0.5 else _local(rng, size)
    if even:
      lt, ls = lt + lt % 2, ls + ls % 2
    t, s = devices * lt, devices * ls
    if long and (t < 1000 or t & (t - 1) == 0):
      continue
    bb, nn = b, kh * g
    while bb * nn * t * s > budget and (bb > 1 or nn > 1):
      bb, kh, g = (bb - 1, kh, g) if bb > 1 else (bb, kh, max(g // 2, 1)) if g > 1 else (
          bb, max(kh - 1, 1), g)
      nn = kh * g
    if bb * nn * t * s > budget:
      continue
    if learned_s is not None:
      learned_s = learned_s[:nn]
    block_q = _cap(rng)  # redrawn with the lengths: a cap below 8 only fits a short shard
    block_k = block_q if rng.random() < 0.5 else _cap(rng)
    case = diff.Case(seed=seed, b=bb, t=t, s=s, n=nn, kh=kh, h=h, hv=hv, weighting=weighting,
                     score=score, causal=causal, mask=mask, bias=bias, block_q=block_q,
                     block_k=block_k, magnitude=mag, scale=scale, mask_bn=mask_bn,
                     per_head=per_head, pallas="none")
    # Passes over the kv heads, from a stream of their own (the draws before them unchanged).
    passes = np.random.default_rng([20261126, seed, 1])
    block = 1 if kh > 1 and passes.random() < 0.5 else None
    d = RingDraw(seed=seed, case=case, layout=layout, devices=devices, learned_s=learned_s,
                 kv_head_block=block)
    if _accepted(d):
      return _with_mods(d, score_mod, sinks)
  raise AssertionError(f"seed {seed}: no accepted lengths")  # pragma: no cover


def _with_mods(d: RingDraw, score_mod: str | None = None, sinks: bool | None = None) -> RingDraw:
  """The draw with its score modification and sinks, from a stream of their own (every other
  choice of the seed unchanged), by the single-device net's rules for a case no Pallas kernel
  runs (:func:`support.differential.draw`): about 35% of the draws a modification (a soft
  cap, ALiBi with learned slopes, a learned relative-position table, or a score_mod function
  of both with a cap), about 30% sinks where the weighting has a sum for them (not
  stick-breaking, not normalization "length" or "none"). Their parameters are replicated
  (diff.mod_params of the global lengths); the Pallas-step draws (:func:`large_sample`)
  keep the cap and the sinks only, as the ring's Pallas steps refuse a score_mod function."""
  rng = np.random.default_rng([20261126, d.seed, 2])
  if score_mod is None:
    score_mod = (str(rng.choice(ref_lib.SCORE_MODS[1:])) if rng.random() < 0.35 else "none")
  else:
    rng.random()  # the same stream position for the sinks' draw
  takes_sinks = problem.sinks_reason(wlib.get_weighting(d.case.weighting)) is None
  u = rng.random()
  if sinks is None:
    sinks = u < 0.3 and takes_sinks
  if sinks and not takes_sinks:
    raise ValueError(f"seed {d.seed}: {d.case.weighting} takes no sinks")
  return dataclasses.replace(d, case=dataclasses.replace(d.case, score_mod=score_mod,
                                                         sinks=bool(sinks)))


def _on_pallas_steps(d: RingDraw) -> RingDraw:
  """The draw as the ring's Pallas steps run it: its soft cap, ALiBi, table and sinks kept, a
  user's score_mod function (the fn) left out (the Pallas steps refuse it)."""
  mod = "none" if d.case.score_mod == "fn" else d.case.score_mod
  return dataclasses.replace(d, case=dataclasses.replace(d.case, score_mod=mod), pallas=True)


# The CI sample: every family × layout × causal once (16 draws), the rest of each draw random;
# the first draw long (P = 8, a global length ≥ 1000 that is no power of two), the second
# SSMax with a learned s, ALiBi and sinks (the reference one head at a time), the fifth
# unnormalized sigmoid (its F sees the global key count: b = −log S) with a relative table,
# the sixth SSMax with sinks. The others' score modifications and sinks are drawn: a cap,
# ALiBi, a table, the fn and sinks in several families (tests/core/test_ring.py holds the
# sample to it). CI deals the draws between the ends of the JAX range (tests/support/legs.py):
# the second and fifth fall to the newest, the sixth to the oldest, so that each end compares
# the gradients of ALiBi's slopes, a table and the sinks (F without a kink there).
CI_FIRST = 1_000_000
CI_DRAWS = len(FAMILIES) * len(LAYOUTS) * 2


def ci_sample() -> list[RingDraw]:
  out = []
  for i in range(CI_DRAWS):
    family = FAMILIES[i % len(FAMILIES)]
    layout = LAYOUTS[(i // len(FAMILIES)) % len(LAYOUTS)]
    causal = bool(i // (len(FAMILIES) * len(LAYOUTS)))
    out.append(draw(CI_FIRST + i, "ci", family=family, layout=layout, causal=causal,
                    long=i == 0, learned=True if i == 1 else None,
                    weighting="sigmoid:normalization=none" if i == 4 else None,
                    score_mod={1: "alibi", 4: "table"}.get(i),
                    sinks=True if i in (1, 5) else None))
  return out


def coverage(draws: list[RingDraw]) -> dict[str, set]:
  """The branches of the ring the draws reach, by name (what tests/core/test_ring.py asserts
  of the CI sample)."""
  is_pow2 = lambda n: n & (n - 1) == 0
  return {
      "family": {d.family for d in draws},
      "layout_causal": {(d.layout, d.case.causal) for d in draws},
      "family_layout_causal": {(d.family, d.layout, d.case.causal) for d in draws},
      "devices": {d.devices for d in draws},
      "mask": {d.mask_kind() for d in draws},
      "bias": {d.bias_kind() for d in draws},
      "gqa": {d.case.n > d.case.kh for d in draws},
      "batch": {d.case.b for d in draws},
      "capped": {d.capped() for d in draws},
      "t_ne_s": {d.case.t != d.case.s for d in draws},
      "learned_s": {d.learned_s is not None for d in draws if d.family == "ssmax"},
      "long_not_pow2": {d.case.t >= 1000 and not is_pow2(d.case.t) for d in draws},
      "odd_head_dim": {d.case.h % 2 == 1 or not is_pow2(d.case.h) for d in draws},
      "weighting": {d.case.weighting for d in draws},
      "passes": {d.passes for d in draws},
      "score_mod": {d.case.score_mod for d in draws},
      "family_score_mod": {(d.family, d.case.score_mod) for d in draws},
      "sinks": {d.case.sinks for d in draws if problem.sinks_reason(
          wlib.get_weighting(d.case.weighting)) is None},
      "family_sinks": {d.family for d in draws if d.case.sinks},
      "learned_s_mod": {d.case.score_mod != "none" or d.case.sinks
                        for d in draws if d.learned_s is not None},
  }


def large_sample(first: int, count: int, kind: str | None = None,
                 pallas: bool = False) -> list[RingDraw]:
  """Draws ``first`` … ``first + count − 1``: "large" ones on the blocked kernel, or with
  ``pallas`` "ci"-sized ones (Pallas' interpreter is slow) on the Pallas kernels."""
  if pallas:
    return [_on_pallas_steps(draw(seed, "ci", kind=kind)) for seed in range(first, first + count)]
  return [draw(seed, "large", kind=kind) for seed in range(first, first + count)]
