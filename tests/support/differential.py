"""The differential net: every attention implementation against the float64 brute force.

A :class:`Case` is one attention problem (shapes, GQA, dtype, weighting, score, causal, mask,
bias, tiles) drawn from a seed by :func:`draw`, or written by hand to reach a branch of a
kernel. :func:`check` runs it through every implementation that accepts it — dense, blocked,
the automatic choice, the Pallas GPU kernels and the Pallas TPU kernels (both in Pallas'
interpreter) — and compares outputs and the gradients of q, k, v and bias with
:func:`support.reference.reference`. Tiles an implementation rejects must raise a ValueError.

Errors are measured as max |got − ref| / scale per array, over the entries that do not
touch a kink of F (see :func:`support.reference.reference`). The scale is not max |ref| but
the largest sum of |terms| behind an entry (:attr:`support.reference.Reference.bounds`): sums
that cancel (the gradient of a broadcast bias, dq of a weighting invariant to the scale of q)
keep their rounding error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import api, problem
from attnx.core import weightings as wlib
from attnx.core.kernels import pallas as pallas_lib
from attnx.core.kernels.pallas import split as pallas_split
from attnx.core.kernels.pallas import tiles as pallas_tiles
from support import reference as ref_lib

# Every registered weighting and the variants whose code paths differ (normalizations, p < 1
# with its unbounded F', α-entmax by bisection, a denominator offset, α ≠ 1).
WEIGHTINGS = tuple(core.list_weightings()) + (
    "power:p=0.5", "power:p=3", "relu:normalization=length", "relu:normalization=none",
    "sigmoid:normalization=none", "softmax:alpha=2", "gaussian:h=0.5,normalization=none",
    "triangular:h=2", "epanechnikov:h=3", "boxcar:h=2", "entmax:alpha=1.3", "entmax:alpha=3",
    "sparsemax:scale=2", "ssmax:s=0.5")
SCORES = ("scaled_dot", "dot", "cosine", "neg_sq_dist", "bilinear", "metric", "additive")
# max |got − ref| / max |ref|: float32 accumulates in float32; bfloat16 rounds the weights
# (and dS) to bfloat16 before the matmuls, ~2^-8 relative per term.
TOL = {"float32": 2e-3, "bfloat16": 4e-2}
MASKS = ("none", "padding", "random", "rows", "columns")
# On a GPU the "pallas" implementation runs the compiled Triton kernels (not the interpreter):
# long sequences are cheap there, and the TPU kernels, which only the interpreter could run on
# a GPU, are left out.
ON_GPU = jax.default_backend() == "gpu"
PALLAS_MAX_LEN = 4096 if ON_GPU else 160  # Pallas' interpreter is slow: short sequences only
PALLAS_MAX_HEADS = 64 if ON_GPU else 8  # B·N
IMPLEMENTATIONS = ("dense", "blocked", "split_kv", "auto", "pallas", "pallas_tpu", "pallas_split")
# Split-KV (decoding) runs the cases with at most this many query rows; its scores are
# [T, S] per head, as dense's.
SPLIT_KV_MAX_T = 64


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem. ``bias`` is a 4-letter pattern over [B, N, T, S] ('1' or 'x')."""
  seed: int
  b: int = 1
  t: int = 16
  s: int = 16
  n: int = 2
  kh: int = 1
  h: int = 8
  hv: int = 8
  dtype: str = "float32"
  weighting: str = "softmax"
  score: str = "scaled_dot"
  causal: bool = False
  mask: str = "none"
  bias: str | None = None
  block_q: int | None = None
  block_k: int | None = None
  magnitude: float = 1.0
  scale: float | None = None
  pallas: str = "both"  # which Pallas kernels run (if they can): "none", "gpu" or "both"
  mask_bn: str = "xx"  # mask="random": its [B, N] dims, each '1' (broadcast) or 'x' (full)
  per_head: bool = False  # bilinear: W per head [N, H, H] instead of shared [H, H]
  only: tuple[str, ...] | None = None  # restrict to these implementations
  # "banded": q_i and k_j gain a large component along (cos ωi, sin ωi) / (cos ωj, sin ωj), so
  # q_i·k_j peaks at i = j and sparsemax/entmax rows have a band of support: the key tiles far
  # from the diagonal are all zero (the kernels' zero-tile skipping), as local attention.
  structure: str = "none"
  # A structured mask (attnx.core.masks) instead of a dense one: "window", "chunked",
  # "prefix", "segments", "lengths", "mask_mod", "combo" (documents & a causal window) or
  # "sinks" (the first keys | a window, StreamingLLM's pattern: skipped tiles between the
  # attended ones); its sizes come from the seed, its arrays (ids, lengths) from the instance.
  structured: str = "none"
  # A score modification (attnx.core.score_mods): "cap" (logits_soft_cap), "alibi"
  # (core.alibi, learned slopes), "table" (core.relative_table, a learned [N, 2L − 1] table)
  # or "fn" (a score_mod function of both with score_mod_params, and a cap); the reference is
  # support.reference.score_mod64. Parameters' gradients are compared too.
  score_mod: str = "none"
  # Attention sinks (one learned score per head), for the weightings they mean something for.
  sinks: bool = False
  # The relative table's length L ("table", "fn"): 0 for 2·max(T, S) − 1 (every distance its
  # own column); an odd L below that clips the farther distances to its ends.
  table_len: int = 0
  # Also compare the residual (return_residual=True) of the implementations that return one
  # with support.reference.residual64.
  residual: bool = False
  # Split-KV on the Pallas kernels ("pallas_split": core.Pallas(num_splits=splits), key tiles
  # of 16 unless the case has its own): 0 runs no such implementation. Cases that set it run
  # it at any length (interpreted on a CPU: slow; the drawn ones are short).
  splits: int = 0

  def implementations(self) -> list[str]:
    """The implementations this case runs; on a CPU the automatic choice replaces the
    dense or blocked call it is identical to."""
    w = wlib.get_weighting(self.weighting)
    streaming = api.streams(w) and self.score != "additive"
    auto_picks = (problem.choose_implementation(None, w, core.get_score(self.score), self.t,
                                                self.s) if streaming else "dense")
    out = ["dense"] + (["blocked"] if streaming else [])
    if streaming and (self.t <= SPLIT_KV_MAX_T or auto_picks == "split_kv"):
      out.append("split_kv")
    if self.block_q is None and self.block_k is None or auto_picks == "dense":
      out[out.index(auto_picks)] = "auto"
    else:
      out.append("auto")
    small = max(self.t, self.s) <= PALLAS_MAX_LEN and self.b * self.n <= PALLAS_MAX_HEADS
    # Pallas runs every streaming weighting: pointwise F and the whole-row families; a soft
    # cap, ALiBi, a relative table and sinks with either (no other score_mod function).
    if streaming and small and self.pallas != "none" and pallas_runs_modification(self):
      out.append("pallas")
      if self.score in ("dot", "scaled_dot") and self.pallas == "both" and not ON_GPU:
        out.append("pallas_tpu")
    if (self.splits and streaming and pallas_runs_modification(self)
        and pallas_split.reason(w) is None):
      out.append("pallas_split")
    return [i for i in out if self.only is None or i in self.only]

  def label(self) -> str:
    f = dataclasses.asdict(self)
    return " ".join(f"{k}={v}" for k, v in f.items()
                    if v != getattr(Case, k, None) or k in ("seed", "t", "s"))


def pallas_runs_modification(case: Case) -> bool:
  """Whether the Pallas kernels (Triton and Mosaic) run the case's score modification and
  sinks: none at all, or a soft cap, ALiBi or a relative table and/or sinks, with a pointwise
  or a whole-row F (no kernel runs another score_mod function; the draw gives sinks only to
  the weightings they mean something for)."""
  return case.score_mod in ("none", "cap", "alibi", "table")


# --------------------------------------------------------------------------------------------
# Drawing cases.
# --------------------------------------------------------------------------------------------

_EDGE_LENGTHS = (0, 1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 257, 511, 512, 513, 1023,
                 1025)
_TILES_POW2 = (8, 16, 32, 64, 128, 256)
_TILES_8K = (24, 40, 72, 136)
_TILES_ODD = (1, 3, 7, 13, 33)


def _length(rng: np.random.Generator) -> int:
  u = rng.random()
  if u < 0.08:
    return int(rng.choice(_EDGE_LENGTHS))
  if u < 0.66:
    return int(rng.integers(1, 80))
  if u < 0.92:
    return int(rng.integers(80, 600))
  return int(rng.integers(600, 3001))


def _tile(rng: np.random.Generator, length: int) -> int | None:
  u = rng.random()
  if u < 0.45:
    return None
  if u < 0.03 + 0.45:
    return int(rng.choice((0, -4)))  # rejected by every implementation
  big = length > 600
  if u < 0.75:
    pool = tuple(x for x in _TILES_POW2 if not big or x >= 64)
  elif u < 0.9:
    pool = tuple(x for x in _TILES_8K if not big or x >= 64)
  else:
    pool = _TILES_ODD if length <= 200 else _TILES_8K[2:]
  return int(rng.choice(pool))


def _compatible_scores(weighting: str) -> list[str]:
  out = []
  for sc in SCORES:
    try:
      core.check_compatible(weighting, sc)
      out.append(sc)
    except ValueError:
      pass
  return out


def draw(seed: int, kind: str | None = None) -> Case:
  """The random case of this seed (the same on every machine); ``kind`` ("pointwise" or
  "row") draws the weighting from that family only."""
  rng = np.random.default_rng([20261125, seed])
  pool = [w for w in WEIGHTINGS if kind is None or wlib.get_weighting(w).kind == kind]
  weighting = str(rng.choice(pool))
  scores = _compatible_scores(weighting)
  score = "scaled_dot" if "scaled_dot" in scores and rng.random() < 0.5 else str(
      rng.choice(scores))
  t = _length(rng)
  s = t if rng.random() < 0.5 else _length(rng)
  big = t * s > 600 * 600
  kh = int(rng.choice((1, 1, 2, 3)))
  g = int(rng.choice((1, 1, 2, 4)))
  b = int(rng.integers(1, 2 if big else 4))
  if big and kh * g > 2:
    kh, g = 1, 2
  h = int(rng.choice((1, 3, 8, 16, 32, 64) if not big else (8, 16, 32)))
  hv = h if rng.random() < 0.7 else int(rng.choice((1, 5, 16)))
  if score == "additive":
    t, s = min(t, 300), min(s, 300)
  block_q = _tile(rng, t)
  block_k = block_q if rng.random() < 0.5 else _tile(rng, s)
  if (block_q is None) != (block_k is None) and rng.random() < 0.5:
    block_k = block_q
  mag = float(rng.choice((0.3, 1.0, 2.0)))
  if score in ("neg_sq_dist", "metric"):
    mag = 0.3 / math.sqrt(max(h, 1) / 8)
  scale = None if rng.random() < 0.8 else float(rng.choice((0.1, 0.5, 1.7)))
  bias = None
  if rng.random() < 0.35:
    bias = "".join(rng.choice(("1", "x")) for _ in range(4))
  # Pallas' interpreter costs ~1.5 s a call: a share of the cases runs it.
  u = rng.random()
  pallas = "none" if u < 0.7 else "gpu" if u < 0.9 else "both"
  if ON_GPU:  # compiled kernels are cheap: every case runs them
    pallas = "gpu"
  case = Case(seed=seed, b=b, t=t, s=s, n=kh * g, kh=kh, h=h, hv=hv, pallas=pallas,
              mask_bn="".join(rng.choice(("1", "x")) for _ in range(2)),
              per_head=bool(rng.random() < 0.5),
              dtype="bfloat16" if rng.random() < 0.25 else "float32", weighting=weighting,
              score=score, causal=bool(rng.random() < 0.45), mask=str(rng.choice(MASKS)),
              bias=bias, block_q=block_q, block_k=block_k, magnitude=mag, scale=scale)
  # Drawn last, so that the fields above are those of the seed before this option existed.
  if can_band(case) and rng.random() < 0.5:
    case = dataclasses.replace(case, structure="banded")
  if rng.random() < 0.3:  # a structured mask replaces the dense one
    case = dataclasses.replace(case, mask="none", structured=str(rng.choice(STRUCTURED)))
  # Score modifications: every kind where no Pallas kernel runs; where one does, a pointwise
  # F gets the soft cap, ALiBi or a relative table (the modifications the Pallas kernels run)
  # in a smaller share, so that the unmodified Pallas cases keep theirs; a whole-row F too.
  # Sinks likewise (every weighting with a sum: problem.sinks_reason).
  w = wlib.get_weighting(weighting)
  pointwise = isinstance(w, wlib.Pointwise)
  u = rng.random()
  if u < 0.35 and pallas == "none":
    case = dataclasses.replace(case, score_mod=str(rng.choice(ref_lib.SCORE_MODS[1:])))
  elif u < 0.2 and pointwise:
    case = dataclasses.replace(case, score_mod="cap" if u < 0.12 else "alibi")
  elif u < 0.2:  # a whole-row F in Pallas: the soft cap or ALiBi (its kernels run both)
    case = dataclasses.replace(case, score_mod="cap" if u < 0.12 else "alibi")
  if case.score_mod == "alibi" and pallas != "none":
    # A third of those a relative table instead (the Triton kernels run one; "both" runs it
    # on the GPU's only), a clipped one in half of them: from a stream of its own, so that
    # the draws after this one stay those of the seed before tables ran in Pallas.
    side = np.random.default_rng([29, seed])
    if side.random() < 1 / 3:
      width = 2 * max(case.t, case.s, 1) - 1
      clip = side.random() < 0.5 and width > 3
      case = dataclasses.replace(
          case, score_mod="table",
          table_len=int(side.integers(1, width // 2)) * 2 + 1 if clip else 0)
  if rng.random() < 0.3 and problem.sinks_reason(w) is None:
    case = dataclasses.replace(case, sinks=True)
  # From a stream of its own: the draws above stay those of the seed before residuals.
  if np.random.default_rng([31, seed]).random() < 0.3:
    case = dataclasses.replace(case, residual=True)
  # Split-KV on the Pallas kernels for half the cases that run Pallas (and whose F splits),
  # from a stream of its own likewise.
  side = np.random.default_rng([37, seed])
  if pallas != "none" and pallas_split.reason(w) is None and side.random() < 0.5:
    case = dataclasses.replace(case, splits=int(side.choice((2, 3, 4, 8))))
  return case


def soft_cap(case: Case) -> float | None:
  """The case's logits_soft_cap (from its seed), for the "cap" and "fn" modifications: small
  enough that tanh bends the scores of the case's magnitude."""
  if case.score_mod not in ("cap", "fn"):
    return None
  return float(np.random.default_rng([19, case.seed]).choice((0.5, 1.0, 2.0, 5.0)))


def mod_params(case: Case, instance: int = 0) -> dict[str, np.ndarray]:
  """The parameters of the case's score modification (float32): ALiBi slopes [N] (the
  standard ones, perturbed) and a relative-position table [N, 2·max(T, S) − 1]."""
  rng = np.random.default_rng([23, case.seed, instance])
  out = {}
  if case.score_mod in ("alibi", "fn"):
    base = np.asarray(core.alibi_slopes(case.n)) if case.n else np.zeros(0, np.float32)
    out["slopes"] = (base * rng.uniform(0.5, 2.0, case.n)).astype(np.float32)
  if case.score_mod in ("table", "fn"):
    width = case.table_len or 2 * max(case.t, case.s, 1) - 1
    out["table"] = (0.5 * rng.standard_normal((case.n, width))).astype(np.float32)
  if case.sinks:
    # Centred at log S: a sink of score ≈ log S weighs about as much as all S keys together
    # (e^{log S} = S·e⁰), so a wrong sink moves the output and every gradient well past the
    # tolerance; around 0 it would be one key among S, lost in the rounding at S in the
    # hundreds.
    out["sinks"] = (rng.standard_normal(case.n) + np.log(max(case.s, 1))).astype(np.float32)
  return out


def _net_score_mod(score, b, h, q_idx, kv_idx, params):
  """The "fn" modification as a user writes it (support.reference.score_mod64's "fn")."""
  table = params["table"]
  half = table.shape[-1] // 2
  return (score - params["slopes"][h] * (q_idx - kv_idx)
          + table[h, jnp.clip(q_idx - kv_idx, -half, half) + half] + 0.1 * b)


def score_mod_keywords(case: Case, mp: dict[str, Any]) -> dict[str, Any]:
  """attention's keywords for the case's score modification and sinks with parameters
  ``mp``."""
  kw = {"sinks": mp["sinks"]} if case.sinks else {}
  mp = {name: x for name, x in mp.items() if name != "sinks"}
  return kw | _mod_keywords(case, mp)


def _mod_keywords(case: Case, mp: dict[str, Any]) -> dict[str, Any]:
  cap = soft_cap(case)
  if case.score_mod == "cap":
    return dict(logits_soft_cap=cap)
  if case.score_mod == "alibi":
    return dict(score_mod=core.alibi(mp["slopes"], symmetric=not case.causal))
  if case.score_mod == "table":
    return dict(score_mod=core.relative_table(mp["table"]))
  if case.score_mod == "fn":
    return dict(logits_soft_cap=cap, score_mod=_net_score_mod, score_mod_params=mp)
  return {}


STRUCTURED = ("window", "chunked", "prefix", "segments", "lengths", "mask_mod", "combo",
              "sinks")


def _ids(rng: np.random.Generator, b: int, length: int) -> np.ndarray:
  """Sorted document ids [B, length] with leading padding (-1): documents of any length,
  length 1 included, spanning tile boundaries."""
  docs = int(rng.integers(1, 7))
  return np.sort(rng.integers(-1, docs, (b, length)), axis=1).astype(np.int32)


def structured_mask(case: Case, instance: int = 0) -> core.masks.Mask | None:
  """The case's structured mask: sizes from the seed, arrays from the instance."""
  if case.structured == "none":
    return None
  sizes = np.random.default_rng([13, case.seed])
  arrays = np.random.default_rng([17, case.seed, instance])
  t, s, b = case.t, case.s, case.b
  masks = core.masks
  window = masks.sliding_window(int(sizes.integers(0, max(t, s) + 2)),
                                int(sizes.choice((0, 0, int(sizes.integers(0, s + 2))))))
  if case.structured == "window":
    return window
  if case.structured == "chunked":
    return masks.chunked_causal(int(sizes.integers(1, max(t, 1) + 2)))
  if case.structured == "prefix":
    return masks.prefix_lm(arrays.integers(0, s + 1, b).astype(np.int32))
  if case.structured == "lengths":
    return masks.seq_lengths(arrays.integers(0, t + 1, b).astype(np.int32),
                             arrays.integers(0, s + 1, b).astype(np.int32))
  if case.structured == "sinks":
    sinks = arrays.integers(0, min(s, 24) + 1, b).astype(np.int32)
    local = masks.sliding_window(int(sizes.integers(0, max(t, s) // 4 + 1)), 0)
    return masks.seq_lengths(np.full(b, t, np.int32), sinks) | local
  if case.structured == "mask_mod":
    a, c = int(sizes.integers(1, 7)), int(sizes.integers(2, 5))
    return masks.from_fn(lambda bi, h, i, j: (a * i + j + h + bi) % c != 0)
  q_ids = _ids(arrays, b, t)
  kv_ids = q_ids if s == t else _ids(arrays, b, s)
  documents = masks.segment_ids(q_ids, kv_ids)
  return documents & window if case.structured == "combo" else documents


def can_band(case: Case) -> bool:
  """Whether the banded inputs apply: sparsemax/entmax (the weightings that skip zero tiles),
  a dot score, float32 (bf16 would round the large band component's scores by O(1)), h ≥ 2."""
  stream = getattr(wlib.get_weighting(case.weighting), "stream", None)
  return (stream is not None and stream.needs_threshold and case.h >= 2
          and case.score in ("dot", "scaled_dot") and case.dtype == "float32"
          and max(case.t, case.s) > 1)


# --------------------------------------------------------------------------------------------
# Inputs.
# --------------------------------------------------------------------------------------------

def _mask(case: Case, rng: np.random.Generator) -> np.ndarray | None:
  b, n, t, s = case.b, case.n, case.t, case.s
  if case.mask == "none":
    return None
  if case.mask == "padding":  # key padding per batch row; a length of 0 masks whole rows
    lengths = rng.integers(0, s + 1, size=b)
    return (np.arange(s)[None, :] < lengths[:, None]).reshape(b, 1, 1, s)
  if case.mask == "rows":  # some query rows see nothing
    return (rng.random((b, 1, t, 1)) < 0.7)
  if case.mask == "columns":  # per head, some keys hidden
    return (rng.random((1, n, 1, s)) < 0.7)
  lead = tuple(d if c == "x" else 1 for c, d in zip(case.mask_bn, (b, n), strict=True))
  return rng.random(lead + (t, s)) < 0.6


def inputs(case: Case, instance: int = 0) -> dict[str, Any]:
  """Arrays of the case (numpy, in the case's dtype; bias float32): instance i of its inputs
  (data, masks, padding lengths), all of the same shapes."""
  rng = np.random.default_rng([7, case.seed, instance])
  dt = jnp.dtype(case.dtype)
  normal = lambda *shape: (rng.standard_normal(shape) * case.magnitude).astype(dt)
  arrs = dict(q=normal(case.b, case.t, case.n, case.h), k=normal(case.b, case.s, case.kh, case.h),
              v=np.asarray(rng.standard_normal((case.b, case.s, case.kh, case.hv)), dt),
              ct=np.asarray(rng.standard_normal((case.b, case.t, case.n, case.hv)), dt))
  if case.structure == "banded":
    _add_band(case, arrs)
  arrs["mask"] = _mask(case, rng)
  arrs["structured"] = structured_mask(case, instance)
  arrs["bias"] = None
  if case.bias:
    full = (case.b, case.n, case.t, case.s)
    shape = tuple(d if c == "x" else 1 for c, d in zip(case.bias, full, strict=True))
    arrs["bias"] = rng.standard_normal(shape).astype(np.float32)
  h = case.h
  params: dict[str, Any] = {}
  if case.score == "cosine":
    params = {"temperature": 0.5}
  elif case.score == "bilinear":
    shape = (case.n, h, h) if case.per_head else (h, h)
    params = {"W": (rng.standard_normal(shape) / math.sqrt(h)).astype(np.float32)}
  elif case.score == "metric":
    params = {"L": (rng.standard_normal((h, 4)) / math.sqrt(h)).astype(np.float32)}
  elif case.score == "additive":
    params = {"Wq": (rng.standard_normal((h, 6)) / math.sqrt(h)).astype(np.float32),
              "Wk": (rng.standard_normal((h, 6)) / math.sqrt(h)).astype(np.float32),
              "v": rng.standard_normal(6).astype(np.float32)}
  arrs["score_params"] = params
  arrs["mod_params"] = mod_params(case, instance)
  return arrs


def _add_band(case: Case, arrs: dict[str, Any]) -> None:
  """Sets q_i's first two dims to A·(cos ωi, sin ωi) and k_j's to A·(cos ωj, sin ωj): the
  scores become c·cos(ω(i − j)) plus the other dims' noise, c = A²·scale, with ω = π / max(T, S)
  (one peak, at i = j) and c such that without noise sparsemax's support is a band of about a
  twentieth of the length on each side (c·(1 − cos ωd) = 1 at d = L/20)."""
  w = wlib.get_weighting(case.weighting)
  length = max(case.t, case.s)
  omega = math.pi / length
  scale = case.scale if case.scale is not None else (
      1.0 / math.sqrt(case.h) if case.score == "scaled_dot" else 1.0)
  c = 2.0 / (omega * 0.05 * length) ** 2 / (w.stream.alpha - 1.0) / w.stream.scale
  amp = math.sqrt(c / scale)
  for name, n in (("q", case.t), ("k", case.s)):
    phase = omega * np.arange(n)
    band = amp * np.stack([np.cos(phase), np.sin(phase)], axis=-1)  # [n, 2]
    x = arrs[name].astype(np.float32)
    x[..., :2] = band[None, :, None, :]
    arrs[name] = x.astype(arrs[name].dtype)


# --------------------------------------------------------------------------------------------
# Running one implementation.
# --------------------------------------------------------------------------------------------

def rejects(case: Case, impl: str) -> bool:
  """Whether the implementation must refuse the case's tiles with a ValueError."""
  tiles = [x for x in (case.block_q, case.block_k) if x is not None]
  if any(x < 1 for x in tiles):
    return impl not in ("dense", "split_kv")  # no tiles
  if impl in ("pallas", "pallas_split"):
    return any(x < pallas_lib.GPU_MIN_BLOCK or x & (x - 1) for x in tiles)
  if impl == "pallas_tpu":
    return ((case.block_q is not None and case.block_q % pallas_tiles.q_align("tpu", case.dtype))
            or (case.block_k is not None and case.block_k % pallas_lib.TPU_LANES != 0))
  return False


def _call(case: Case, impl: str, scalar_params: tuple, return_residual: bool = False):
  """fn(q, k, v, bias, mask, array_params) -> output of implementation ``impl``.

  The blocked and Pallas implementations get the case's tiles on their objects (a tile below 1
  is a ValueError when the object is made); dense has no tiles. The automatic choice with tiles
  ("auto" in :meth:`Case.implementations`) can only be asked with the deprecated keywords: it
  expects their DeprecationWarning."""
  tiles = dict(block_q=case.block_q, block_k=case.block_k)
  kw = dict(weighting=case.weighting, is_causal=case.causal)
  if return_residual:
    kw["return_residual"] = True
  if impl == "pallas_tpu":
    w = wlib.get_weighting(case.weighting)
    scale = case.scale
    if scale is None:
      scale = 1.0 / math.sqrt(case.h) if case.score == "scaled_dot" else 1.0

    def tpu(q, k, v, bias, mask, params, mp):
      # A soft cap or ALiBi and sinks at most (Case.implementations), as attention passes
      # them.
      mod = problem.score_modification(**(dict(logits_soft_cap=None, score_mod=None,
                                               score_mod_params=None)
                                          | _mod_keywords(case, mp)), q=q)
      structured = None
      if isinstance(mask, core.masks.Mask):  # bound as attention binds it, sigmoid's n too
        structured = mask.bind(q.shape[:1], q.shape[2], q.shape[1], k.shape[1])
        bias = problem.sequence_bias(w, structured, bias, q, k.shape[1])
        mask = None
      return pallas_lib.pallas_attention(
          q, k, v, weighting=w, scale=scale, bias=bias, mask=mask, is_causal=case.causal,
          block_q=case.block_q, block_k=case.block_k, backend="tpu", interpret=True,
          structured_mask=structured, score_mod=mod,
          sinks=mp["sinks"] if case.sinks else None)
    return tpu
  warns = contextlib.nullcontext
  if impl == "auto":
    implementation = None
    if any(x is not None for x in tiles.values()):
      kw.update(tiles)  # deprecated keywords (a bad tile is refused before they warn)
      if all(x is None or x >= 1 for x in tiles.values()):
        warns = functools.partial(pytest.warns, DeprecationWarning, match="is deprecated")
  elif impl == "blocked":
    implementation = core.Blocked(**tiles)
  elif impl == "pallas":
    implementation = core.Pallas(**tiles, interpret=not ON_GPU)
  elif impl == "pallas_split":
    implementation = core.Pallas(block_q=case.block_q,
                                 block_k=16 if case.block_k is None else case.block_k,
                                 interpret=not ON_GPU, num_splits=case.splits)
  else:
    implementation = impl

  def fn(q, k, v, bias, mask, params, mp):
    with warns():  # entered when traced
      return core.attention(
          q, k, v, bias=bias, mask=mask, score=case.score,
          score_params={**params, **dict(scalar_params)} or None, scale=case.scale,
          implementation=implementation, **kw, **score_mod_keywords(case, mp))

  return fn


@functools.lru_cache(maxsize=16)
def _program(config: Case, impl: str, scalar_params: tuple):
  """The jitted output-and-gradients program of one implementation for a case's
  configuration (the seed left out): the inputs of every instance reuse it."""
  fn = _call(config, impl, scalar_params)

  @jax.jit
  def both(q, k, v, bias, mask, ct, params, mp):
    out, vjp = jax.vjp(lambda q, k, v, bias, mp: fn(q, k, v, bias, mask, params, mp),
                       q, k, v, bias, mp)
    return out, vjp(ct)

  return both


# They return residuals.
RESIDUAL_IMPLS = ("dense", "blocked", "split_kv", "auto", "pallas", "pallas_split")


@functools.lru_cache(maxsize=16)
def _residual_program(config: Case, impl: str, scalar_params: tuple):
  fn = _call(config, impl, scalar_params, return_residual=True)
  return jax.jit(fn)


def run_residual(case: Case, impl: str, arrs) -> np.ndarray:
  """The residual [B, T, N] of one implementation (entmax: its threshold), float64."""
  sp = arrs["score_params"]
  scalars = tuple(sorted((k, v) for k, v in sp.items() if np.isscalar(v)))
  params = {k: jnp.asarray(v) for k, v in sp.items() if not np.isscalar(v)}
  config = dataclasses.replace(case, seed=0, only=None, pallas="both")
  if soft_cap(case) is not None:
    config = dataclasses.replace(config, seed=case.seed)
  args = [jnp.asarray(arrs[x]) if arrs[x] is not None else None
          for x in ("q", "k", "v", "bias", "mask")]
  if arrs["structured"] is not None:
    args[4] = arrs["structured"]
  mp = {k: jnp.asarray(v) for k, v in arrs["mod_params"].items()}
  _, res = _residual_program(config, impl, scalars)(*args, params, mp)
  res = res.threshold if isinstance(res, core.EntmaxResidual) else res
  return np.asarray(res, np.float64)


def run_impl(case: Case, impl: str, arrs) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Output and gradients (q, k, v, bias) of one implementation, compiled as one program."""
  sp = arrs["score_params"]
  scalars = tuple(sorted((k, v) for k, v in sp.items() if np.isscalar(v)))
  params = {k: jnp.asarray(v) for k, v in sp.items() if not np.isscalar(v)}
  config = dataclasses.replace(case, seed=0, only=None, pallas="both")
  args = [jnp.asarray(arrs[x]) if arrs[x] is not None else None
          for x in ("q", "k", "v", "bias", "mask", "ct")]
  if arrs["structured"] is not None:
    args[4] = arrs["structured"]  # a pytree argument of the compiled program
  # JAX's GPU default computes float32 matmuls in TF32 (≈ 1e-3 relative scores), which moves
  # entries across kinks of F; the net compares float32 at float32 precision.
  mp = {k: jnp.asarray(v) for k, v in arrs["mod_params"].items()}
  if soft_cap(case) is not None:  # the cap is static: part of the program
    config = dataclasses.replace(config, seed=case.seed)
  with jax.default_matmul_precision("highest") if ON_GPU else contextlib.nullcontext():
    out, (dq, dk, dv, dbias, dmp) = _program(config, impl, scalars)(*args, params, mp)
  grads = dict(q=dq, k=dk, v=dv, bias=dbias, **{f"mod_{k}": g for k, g in dmp.items()})
  return np.asarray(out, np.float64), {n: np.asarray(g, np.float64)
                                       for n, g in grads.items() if g is not None}


# --------------------------------------------------------------------------------------------
# Comparing.
# --------------------------------------------------------------------------------------------

def _error(got: np.ndarray, want: np.ndarray, keep: np.ndarray | None,
           scale: float | None = None) -> float:
  if got.shape != want.shape:
    return math.inf
  if keep is not None:
    got, want = got[np.broadcast_to(keep, got.shape)], want[np.broadcast_to(keep, want.shape)]
  if got.size == 0:
    return 0.0
  if not np.all(np.isfinite(got)):
    return math.inf
  if scale is None:
    scale = float(np.max(np.abs(want)))
  return float(np.max(np.abs(got - want)) / max(scale, 1e-6))


KINK_REL = 2e-5  # float32 scores are off by ~1e-6 relative; a kink closer than this is skipped


@functools.lru_cache(maxsize=4)
def _reference(case: Case, instance: int = 0):
  arrs = inputs(case, instance)
  mask, row_keys = arrs["mask"], None
  if arrs["structured"] is not None:  # the brute force reads it materialized
    call = ((case.b,), case.n, case.t, case.s)
    mask = np.asarray(core.masks.materialize(arrs["structured"].bind(*call), *call))
    row_keys = ref_lib.sequence_keys64(arrs["structured"], case.b, case.t, case.s)
  ref = ref_lib.reference(
      arrs["q"], arrs["k"], arrs["v"], weighting=case.weighting, score=case.score,
      score_params=arrs["score_params"], scale=case.scale, bias=arrs["bias"], mask=mask,
      is_causal=case.causal, cotangent=arrs["ct"], kink_rel=KINK_REL, row_keys=row_keys,
      score_mod=case.score_mod, cap=soft_cap(case), sinks=arrs["mod_params"].get("sinks"),
      mod_params={k: x for k, x in arrs["mod_params"].items() if k != "sinks"})
  grads = dict(ref.grads)
  bounds = dict(ref.bounds)
  for name, g in grads.pop("mod", {}).items():  # one array per parameter
    grads[f"mod_{name}"] = g
  for name, bound in bounds.pop("mod", {}).items():
    bounds[f"mod_{name}"] = bound
  if "sinks" in grads:
    grads["mod_sinks"], bounds["mod_sinks"] = grads.pop("sinks"), bounds.pop("sinks")
  want = {"out": ref.out, **grads}
  if case.bias:  # full [B, N, T, S] gradient -> the bias' shape
    axes = tuple(a for a, c in enumerate(case.bias) if c == "1")
    want["bias"] = ref.grads["bias"].sum(axis=axes, keepdims=True)
    bounds["bias"] = bounds["bias"].sum(axis=axes, keepdims=True)
  scales = {k: float(np.max(b, initial=0.0)) for k, b in bounds.items()}
  # A result that is exactly 0 (dq of a row with one valid key) has a bound of 0 and keeps
  # the rounding noise of its neighbours: a floor relative to the case's largest scale.
  floor = 1e-3 * max(scales.values(), default=0.0)
  scales = {k: max(v, floor) for k, v in scales.items()}
  return arrs, ref, want, scales


def _keeps(case: Case, ref: ref_lib.Reference) -> dict[str, np.ndarray | None]:
  """Which entries of each array are compared: those not touched by a kink of F."""
  slope, jump = ref.kink_slope, ref.kink_jump
  any_kink = slope | jump
  mods = [f"mod_{name}" for name in ("slopes", "table", "sinks")]
  if not any_kink.any():
    return dict.fromkeys(("out", "q", "k", "v", "bias", *mods))
  b, n, t, s = any_kink.shape
  row_ok = ~any_kink.any(-1)  # [B, N, T]
  rows = np.moveaxis(row_ok, 1, 2)[..., None]  # [B, T, N, 1]
  if not isinstance(wlib.get_weighting(case.weighting), wlib.Pointwise):
    # A whole-row weighting couples the row: a kink moves the gradient of every entry in it.
    any_kink = ref.valid & ~row_ok[..., None]
  # A key is touched when any query head of its group sits on a kink with it.
  col = any_kink.any(2).reshape(b, case.kh, n // case.kh, s).any(2)  # [B, K, S]
  keys = np.moveaxis(~col, 1, 2)[..., None]  # [B, S, K, 1]
  jumped = bool(jump.any())  # F itself jumped: a whole row's weights differ
  if jumped:
    keys = np.zeros_like(keys)
  bias_keep = None
  if case.bias:
    axes = tuple(a for a, c in enumerate(case.bias) if c == "1")
    bias_keep = ~any_kink.any(axis=axes, keepdims=True)
    if jumped:
      bias_keep = np.zeros_like(bias_keep)
  # A parameter of the score modification sums over every pair: a kink anywhere moves it.
  return {"out": rows if jumped else None, "q": rows, "k": keys,
          "v": keys if jumped else None, "bias": bias_keep,
          **{name: np.zeros((), bool) for name in mods}}


def check(case: Case, instances: int = 1) -> list[str]:
  """Runs the case on its first ``instances`` random inputs (one compiled program per
  implementation serves them all); returns one line per failure (empty: all agree)."""
  failures = []
  for instance in range(instances):
    failures += [f"inputs {instance}: {f}" if instances > 1 else f
                 for f in _check_instance(case, instance)]
  return failures


def _check_instance(case: Case, instance: int) -> list[str]:
  failures = []
  arrs = ref = keeps = want = scales = None
  for impl in case.implementations():
    if rejects(case, impl):
      try:
        run_impl(case, impl, inputs(case, instance))
      except ValueError:
        continue
      failures.append(f"{impl}: tiles ({case.block_q}, {case.block_k}) were not rejected")
      continue
    if ref is None:
      arrs, ref, want, scales = _reference(case, instance)
      keeps = _keeps(case, ref)
    try:
      out, grads = run_impl(case, impl, arrs)
    except Exception as e:  # noqa: BLE001 - any crash is a failure of the case
      failures.append(f"{impl}: raised {type(e).__name__}: {str(e)[:300]}")
      continue
    tol = TOL[case.dtype]
    errs = {"out": _error(out, want["out"], keeps["out"], scales["out"])}
    for name, g in grads.items():
      errs[name] = _error(g, want[name], keeps[name], scales.get(name))
    if case.residual and impl in RESIDUAL_IMPLS:
      errs["residual"] = _residual_error(case, impl, arrs, ref, keeps["out"])
    bad = {k: e for k, e in errs.items() if not e <= (tol if k == "out" else 2 * tol)}
    if bad:
      failures.append(f"{impl}: " + ", ".join(f"{k} error {e:.3g}" for k, e in bad.items())
                      + f" (tolerance {tol:g}, grads {2 * tol:g})")
  return failures


def _residual_error(case: Case, impl: str, arrs, ref, keep) -> float:
  """:func:`residual_error` of one implementation's residual (a crash: ∞)."""
  try:
    got = run_residual(case, impl, arrs)
  except Exception:  # noqa: BLE001 - a crash is a failure of the case
    return math.inf
  return residual_error(case, got, arrs, ref, keep)


def residual_error(case: Case, got: np.ndarray, arrs, ref, keep) -> float:
  """max |got − want| / max(1, max |want|) of a residual [B, T, N] (entmax: its threshold)
  against support.reference.residual64 over the rows that are not on a kink (``keep``:
  [B, T, N, 1] or None); rows without weight must be −∞ in both (entmax: a NaN threshold in
  the reference, any value in attnx's)."""
  got = np.asarray(got, np.float64)
  row_keys = None
  if arrs["structured"] is not None:
    row_keys = ref_lib.sequence_keys64(arrs["structured"], case.b, case.t, case.s)
  want = ref_lib.residual64(case.weighting, ref.scores, ref.valid,
                            arrs["mod_params"].get("sinks"), row_keys, case.s)
  if got.shape != want.shape:
    return math.inf
  rows = np.ones(want.shape, bool) if keep is None else np.broadcast_to(keep[..., 0], want.shape)
  dead = ~np.isfinite(want)
  if np.any(got[dead & rows] != want[dead & rows]) and not np.all(np.isnan(want[dead])):
    return math.inf
  live = rows & ~dead
  if not live.any():
    return 0.0
  return float(np.max(np.abs(got[live] - want[live])) / max(1.0, np.max(np.abs(want[live]))))


def timed_check(case: Case, instances: int = 1) -> tuple[list[str], float]:
  start = time.perf_counter()
  failures = check(case, instances)
  return failures, time.perf_counter() - start
