"""What a benchmark's "max abs err" column compares with: a float64 reference written out from
the definitions (:func:`reference`, :func:`max_abs_error`), or another implementation run on
the same inputs (:func:`max_abs_difference`, where no float64 is at hand, e.g. on a GPU).

Both look at the first ``nq`` queries only: the reference costs O(nq·S) instead of O(T·S), and
in the backward dq_i depends on row i alone, so the first rows of dq are exact too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx.core import weightings as wlib
from attnx.train.benchmark.cases import MODES


def reference(q: Any, k: Any, v: Any, weighting: str, nq: int, valid: np.ndarray | None,
              mode: str, score: str = "scaled_dot") -> np.ndarray:
  """float64 output (mode "fwd") or dq (mode "fwd+bwd", of sum(out)) of the first ``nq``
  queries of [B, T, N, H] inputs (grouped keys repeated), scores masked to ``valid`` [nq, S]
  (:func:`attnx.train.benchmark.cases.valid_pairs`; None: every pair)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if score not in ("scaled_dot", "neg_sq_dist"):
    raise ValueError(f"score must be scaled_dot or neg_sq_dist, got {score!r}")
  w = wlib.get_weighting(weighting)
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q[:, :nq], k, v))
    n, kh = q.shape[2], k.shape[2]
    kk, vv = jnp.repeat(k64, n // kh, axis=2), jnp.repeat(v64, n // kh, axis=2)

    def out(qs):
      if score == "neg_sq_dist":  # −‖q − k‖² = 2q·k − ‖q‖² − ‖k‖², exact enough in float64
        qq = jnp.sum(qs * qs, -1).transpose(0, 2, 1)[..., None]
        kn = jnp.sum(kk * kk, -1).transpose(0, 2, 1)[..., None, :]
        scores = 2 * jnp.einsum("btnh,bsnh->bnts", qs, kk) - qq - kn
      else:
        scores = jnp.einsum("btnh,bsnh->bnts", qs, kk) / np.sqrt(q.shape[-1])
      where = None if valid is None else jnp.asarray(valid)
      p = (wlib.pointwise_weights(scores, w, where=where) if isinstance(w, wlib.Pointwise)
           else wlib.apply_weighting(scores, w, where=where))
      return jnp.einsum("bnts,bsnh->btnh", p, vv)

    res = out(q64) if mode == "fwd" else jax.grad(lambda x: jnp.sum(out(x)))(q64)
    return np.asarray(res)


def max_abs_error(result: Any, ref: np.ndarray, mode: str, nq: int) -> float:
  """``max |result − ref|`` over the first ``nq`` queries: ``result`` is a compiled program's
  output (mode "fwd") or its gradients (q's first), ``ref`` :func:`reference`'s."""
  got = result if mode == "fwd" else result[0]
  got = np.asarray(jnp.asarray(got[:, :nq], jnp.float32), np.float64)
  return float(np.max(np.abs(got - ref)))


def max_abs_difference(fn: Callable[..., Any], ref_fn: Callable[..., Any],
                       inputs: tuple[Any, ...], nq: int) -> float:
  """``max |fn − ref_fn|`` of two attention functions' outputs over the first ``nq`` queries of
  ``inputs`` (both jitted, on the same device and dtype)."""
  got, want = (np.asarray(jax.jit(f)(*inputs)[:, :nq], np.float32) for f in (fn, ref_fn))
  return float(np.max(np.abs(got - want)))
