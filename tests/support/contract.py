"""Inputs and brute-force rules of the edge-case contract tests (tests/core/test_contract.py).

What a contract test needs besides the implementation under test, written independently of
the kernels: the weightings to run and the family each one exercises (read from the
registry's traits, so a new weighting or family is picked up), the fixed inputs with fully
masked rows and poisoned masked/valid entries, the fuzz's random cases, and the numpy rules
for which rows must be zero or NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any
from unittest import mock

import hypothesis.strategies as st
import jax
import numpy as np

from attnx import core
from attnx.core import weightings as wlib
from support import reference as ref_lib

# Every registered name, plus parameter variants whose code paths differ (normalizations,
# p < 1 with its unbounded F', α-entmax by bisection below and above α = 2, SSMax's s).
WEIGHTINGS = tuple(core.list_weightings()) + (
    "power:p=0.5", "power:p=3", "relu:normalization=length", "sigmoid:normalization=none",
    "softmax:alpha=2", "gaussian:h=0.5,normalization=none", "triangular:h=2",
    "entmax:alpha=1.3", "entmax:alpha=3", "sparsemax:scale=2", "ssmax:s=0.5")
SCORES = ("scaled_dot", "dot", "cosine:temperature=0.5", "neg_sq_dist", "bilinear")


def family(weighting: str) -> str:
  """The code path of the streaming kernels that ``weighting`` exercises, from its traits.

  Pointwise F: its stream rule (``online_max``, or the normalization ``sum``/``length``/
  ``none``), with the distance kernels apart (they run on the −d² score's dot form). Whole-row
  weightings: their streaming family, with α-entmax split into its closed forms (sparsemax,
  α = 1.5) and the bisection below and above α = 2.
  """
  w = wlib.get_weighting(weighting)
  if isinstance(w, wlib.Pointwise):
    return "distance" if w.distance_kernel else w.traits["stream"]
  rule = w.stream
  if rule is None:
    return "dense_only"
  if rule.family != "entmax":
    return rule.family
  if not rule.renormalize:
    return f"entmax:alpha={rule.alpha:g}"
  return "entmax:bisection" + ("<2" if rule.alpha < 2 else ">2")


# Which weighting stands for its family in the default run: these first, then the registry's
# order (a smooth F reads better in a failure than boxcar's jumps).
_PREFERRED = ("softmax", "relu", "triangular", "ssmax", "sparsemax", "entmax15")


def _family_sample() -> dict[str, str]:
  out: dict[str, str] = {}
  for name in _PREFERRED + WEIGHTINGS:
    out.setdefault(family(name), name)
  return out


FAMILY_SAMPLE = _family_sample()  # {family: weighting}, every family once


def default_score(weighting: str) -> str:
  """The first dot-product score the weighting accepts (−d² for the distance kernels)."""
  for score in ("scaled_dot", "neg_sq_dist"):
    try:
      core.check_compatible(weighting, score)
      return score
    except ValueError:
      pass
  raise ValueError(f"no dot-product score fits {weighting!r}")


@contextlib.contextmanager
def tpu_platform() -> Iterator[None]:
  """JAX reports a TPU: ``implementation=core.Pallas(interpret=True)`` builds the Mosaic (TPU)
  kernels instead of the Triton (GPU) ones, and runs them in Pallas' interpreter.

  The Pallas backend is picked from ``jax.default_backend()`` (a CPU with ``interpret``
  falls back to the GPU kernels); no JAX internals read that function, only attnx does.
  """
  with mock.patch.object(jax, "default_backend", lambda: "tpu"):
    yield


def valid(b: int, n: int, t: int, s: int, mask: np.ndarray | None,
          is_causal: bool) -> np.ndarray:
  """Brute-force [B, N, T, S] validity of every (query, key) pair."""
  return ref_lib.valid_mask(b, n, t, s, mask, is_causal)


def expected_nan_rows(valid_pairs: np.ndarray, bad_q: np.ndarray, bad_kv: np.ndarray,
                      bad_bias: np.ndarray) -> np.ndarray:
  """[B, N, T] rows the contract makes NaN: a row with a valid key whose q_i is non-finite,
  or with a valid key j whose k_j, v_j or bias_ij is (bias: NaN or +Inf).

  bad_q: [B, T, N]; bad_kv: [B, S, K]; bad_bias: [B, N, T, S].
  """
  n = valid_pairs.shape[1]
  group = n // bad_kv.shape[2]
  kv = np.repeat(bad_kv, group, axis=2).transpose(0, 2, 1)[:, :, None, :]  # [B, N, 1, S]
  touched = valid_pairs & (kv | bad_bias)
  return valid_pairs.any(-1) & (bad_q.transpose(0, 2, 1) | touched.any(-1))


# --------------------------------------------------------------------------------------------
# Fixed inputs: every contract case in one set of shapes (one compiled program serves them).
# --------------------------------------------------------------------------------------------

FIXED = dict(b=2, t=18, s=20, n=4, kh=2, h=8)  # GQA, T ≠ S, ragged against every tile
MASKED_KEY = 5  # batch 0: a key no query row attends (inside the causal band)
MASKED_ROW = 3  # batch 0: a query row with no valid key


@dataclasses.dataclass
class Fixed:
  """Inputs [B, T, N, H] / [B, S, K, H], a [B, N, T, S] bias and mask (causal on top)."""
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  bias: np.ndarray
  mask: np.ndarray
  ct: np.ndarray
  valid: np.ndarray  # [B, N, T, S], the mask and causality

  def replace(self, **kw: Any) -> Fixed:
    return dataclasses.replace(self, **kw)


def fixed_inputs(score: str, magnitude: float = 1.0) -> Fixed:
  """The fixed case, causal: random mask, a fully masked row and a never-attended key in
  batch 0, and in batch 1 keys 18 and 19 hidden by causality alone (T = 18)."""
  b, t, s, n, kh, h = (FIXED[x] for x in ("b", "t", "s", "n", "kh", "h"))
  rng = np.random.default_rng(20261201)
  # Distances of N(0, 0.3²) vectors in 8 dims reach about half of a kernel's support.
  mag = magnitude * (0.3 if score == "neg_sq_dist" else 1.0)
  q = rng.standard_normal((b, t, n, h)) * mag
  k = rng.standard_normal((b, s, kh, h)) * mag
  v = rng.standard_normal((b, s, kh, h))
  bias = rng.standard_normal((b, n, t, s)) * 0.5
  mask = rng.random((b, n, t, s)) < 0.75
  mask[0, :, MASKED_ROW, :] = False
  mask[0, :, :, MASKED_KEY] = False
  ct = rng.standard_normal((b, t, n, h))
  f32 = lambda x: x.astype(np.float32)
  return Fixed(f32(q), f32(k), f32(v), f32(bias), mask, f32(ct),
               valid(b, n, t, s, mask, is_causal=True))


def poison_masked(x: Fixed) -> tuple[Fixed, Fixed]:
  """Non-finite numbers where no valid pair reads them: (k, v and bias entries; q entries).

  Keys: key 5 of batch 0 (masked for every row), keys 18 and 19 of batch 1 (causally hidden
  from every row). Bias: every masked entry. Query: the fully masked row of batch 0.
  """
  k, v, bias, q = x.k.copy(), x.v.copy(), x.bias.copy(), x.q.copy()
  k[0, MASKED_KEY, :, 1] = np.nan
  v[0, MASKED_KEY, 1, 0] = np.inf
  k[1, 18, 1, 0] = -np.inf
  v[1, 19, 0, 2] = np.nan
  bias[~x.valid] = np.nan
  bias[0, 0, MASKED_ROW, 0] = np.inf
  q[0, MASKED_ROW, :, 0] = np.nan
  q[0, MASKED_ROW, 1, 3] = -np.inf
  return x.replace(k=k, v=v, bias=bias), x.replace(q=q)


def poison_valid(x: Fixed) -> tuple[Fixed, np.ndarray]:
  """Non-finite numbers at entries valid pairs read; the [B, N, T] rows they must reach."""
  q, k, v, bias, mask = x.q.copy(), x.k.copy(), x.v.copy(), x.bias.copy(), x.mask.copy()
  b, t, s, n, kh = (FIXED[x_] for x_ in ("b", "t", "s", "n", "kh"))
  bad_q, bad_kv = np.zeros((b, t, n), bool), np.zeros((b, s, kh), bool)
  bad_bias = np.zeros((b, n, t, s), bool)
  q[1, 7, 2, 0] = np.nan
  bad_q[1, 7, 2] = True
  k[1, 10, 1, 3] = np.inf
  bad_kv[1, 10, 1] = True
  v[0, 2, 0, 1] = -np.inf
  bad_kv[0, 2, 0] = True
  for (bi, ni, ti, si), value in (((1, 0, 15, 4), np.inf), ((0, 3, 12, 11), np.nan)):
    mask[bi, ni, ti, si] = True  # a valid pair (j ≤ i)
    bias[bi, ni, ti, si] = value
    bad_bias[bi, ni, ti, si] = True
  pairs = valid(b, n, t, s, mask, is_causal=True)
  poisoned = x.replace(q=q, k=k, v=v, bias=bias, mask=mask, valid=pairs)
  return poisoned, expected_nan_rows(pairs, bad_q, bad_kv, bad_bias)


def zeroed(x: Fixed) -> Fixed:
  """The inputs with every non-finite entry replaced by 0."""
  fin = lambda a: np.where(np.isfinite(a), a, 0.0).astype(a.dtype)
  return x.replace(q=fin(x.q), k=fin(x.k), v=fin(x.v), bias=fin(x.bias))


def minus_inf_role(weighting: str) -> str:
  """What a bias of −Inf does in ``weighting``'s dense weights (the reference), probed on one
  row: ``"mask"`` (the key gets weight 0 and the others are as if it were masked), ``"nan"``
  (F(−∞) is not finite: the row is NaN, as for taylor_exp) or ``"counts"`` (the weighting
  counts its keys, e.g. SSMax's log n or the length normalization, so a −Inf key is not a
  masked one)."""
  scores = np.asarray([[-np.inf, 0.3, -0.2, 1.1]], np.float32)
  where = np.asarray([[False, True, True, True]])
  with_inf = np.asarray(core.weights(scores, weighting))
  masked = np.asarray(core.weights(np.where(where, scores, 0.0), weighting, where=where))
  if np.isnan(with_inf).any():
    return "nan"
  return "mask" if np.allclose(with_inf, masked, rtol=1e-6, atol=1e-7) else "counts"


# --------------------------------------------------------------------------------------------
# The fuzz: random configurations an implementation supports.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
  weighting: str
  score: str
  dtype: str
  b: int
  t: int
  s: int
  n: int
  kh: int
  h: int
  causal: bool
  mask: str  # none | random | padding
  bias: bool
  magnitude: float  # input scale: scores reach ~1e4 at 100
  block_q: int | None
  block_k: int | None
  seed: int


@st.composite
def cases(draw, test: Any) -> Case:
  """A random case that ``test`` (a contract test class) runs: a weighting, score and dtype
  it supports and tiles its backend accepts, with fully masked rows and extreme scores."""
  scores = {w: [s for s in SCORES if test.unsupported(w, s) is None] for w in WEIGHTINGS}
  weighting = draw(st.sampled_from([w for w in WEIGHTINGS if scores[w]]))
  score = draw(st.sampled_from(scores[weighting]))
  dtype = draw(st.sampled_from([d for d in ("float32", "bfloat16")
                                if test.unsupported(weighting, score, d) is None]))
  block_q, block_k = draw(st.sampled_from(test.fuzz_tiles(dtype)))
  kh = draw(st.sampled_from([1, 2]))
  w = wlib.get_weighting(weighting)
  distance = core.get_score(score).distance or getattr(w, "distance_kernel", False)
  return Case(weighting=weighting, score=score, dtype=dtype,
              b=draw(st.integers(1, 2)), t=draw(st.integers(1, 19)), s=draw(st.integers(1, 19)),
              n=kh * draw(st.sampled_from([1, 2])), kh=kh, h=draw(st.sampled_from([4, 8])),
              causal=draw(st.booleans()), mask=draw(st.sampled_from(["none", "random", "padding"])),
              bias=draw(st.booleans()),
              # Distances of inputs ×100 are ~1e5 and every kernel weight underflows to 0.
              magnitude=1.0 if distance else draw(st.sampled_from([1.0, 10.0, 100.0])),
              block_q=block_q, block_k=block_k, seed=draw(st.integers(0, 2**16)))


def case_arrays(c: Case) -> dict[str, Any]:
  """The case's inputs (numpy float64; cast by the caller) and its [B, N, T, S] validity."""
  rng = np.random.default_rng(c.seed)
  q = rng.normal(size=(c.b, c.t, c.n, c.h)) * c.magnitude
  k = rng.normal(size=(c.b, c.s, c.kh, c.h)) * c.magnitude
  v = rng.normal(size=(c.b, c.s, c.kh, c.h))
  bias = rng.normal(size=(c.b, c.n, c.t, c.s)) if c.bias else None
  if c.mask == "random":
    mask = rng.random((c.b, c.n, c.t, c.s)) < 0.6
    mask[:, :, rng.integers(c.t)] = False  # a fully masked row
  elif c.mask == "padding":
    mask = np.arange(c.s)[None, None, None, :] < rng.integers(0, c.s + 1, (c.b, 1, 1, 1))
  else:
    mask = None
  params = ({"W": (rng.normal(size=(c.h, c.h)) / np.sqrt(c.h)).astype(np.float32)}
            if c.score == "bilinear" else None)
  ct = rng.normal(size=(c.b, c.t, c.n, c.h))
  return dict(q=q, k=k, v=v, bias=bias, mask=mask, params=params, ct=ct,
              valid=valid(c.b, c.n, c.t, c.s, mask, c.causal))


def poison_case(c: Case, arrays: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
  """Non-finite entries at random places of q, k, v and bias (NaN, ±Inf); the rows they
  must reach."""
  rng = np.random.default_rng(c.seed + 7)
  q, k, v = arrays["q"].copy(), arrays["k"].copy(), arrays["v"].copy()
  bias = None if arrays["bias"] is None else arrays["bias"].copy()
  bad_q, bad_kv = np.zeros((c.b, c.t, c.n), bool), np.zeros((c.b, c.s, c.kh), bool)
  bad_bias = np.zeros((c.b, c.n, c.t, c.s), bool)
  for _ in range(rng.integers(1, 3)):
    target = rng.choice(["q", "k", "v", "bias"] if bias is not None else ["q", "k", "v"])
    x = rng.choice((np.nan, np.inf, -np.inf))
    if target == "q":
      i = (rng.integers(c.b), rng.integers(c.t), rng.integers(c.n))
      q[i + (rng.integers(c.h),)] = x
      bad_q[i] = True
    elif target in ("k", "v"):
      j = (rng.integers(c.b), rng.integers(c.s), rng.integers(c.kh))
      (k if target == "k" else v)[j + (rng.integers(c.h),)] = x
      bad_kv[j] = True
    else:
      i = (rng.integers(c.b), rng.integers(c.n), rng.integers(c.t), rng.integers(c.s))
      bias[i] = rng.choice((np.nan, np.inf))  # −Inf bias is a score of −Inf (weight F(−∞))
      bad_bias[i] = True
  out = dict(arrays, q=q, k=k, v=v, bias=bias)
  return out, expected_nan_rows(arrays["valid"], bad_q, bad_kv, bad_bias)

