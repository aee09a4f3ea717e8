"""Score modifications: what happens to a score between the dot product and the weighting F.

    s_ij = c · tanh((scale · q_i·k_j) / c)     logits_soft_cap = c (Gemma 2), optional
    s_ij = s_ij + bias_ij                      the dense bias, optional
    s_ij = fn(s_ij, b, h, i, j, params)        score_mod = fn (FlexAttention's hook), optional
    w_ij = F(s_ij) / …                         the weighting, with the mask

The order is attnx's everywhere (every implementation, every F): the cap bounds the raw
logit, as Gemma 2 does, and the biases — the dense one, then ``score_mod``'s (ALiBi, a
relative-position table) — come after it. A :class:`ScoreMod` carries the cap (static), the
function (static) and its parameters (a pytree of arrays: ``jit``, ``vmap`` and ``grad`` trace
them, so slopes and tables can be learned); the dense implementation applies it to the whole
[T, S] grid, a streaming kernel to one tile at a time, never forming a T×S array.

``fn(score, b, h, q_idx, kv_idx, params)`` is called on broadcasting arrays, as a FlexAttention
``score_mod`` compiled for a whole tile: ``score`` is the tile of scores (float32, float64 for
float64 inputs), ``b`` the flat batch index, ``h`` the query head, ``q_idx`` and ``kv_idx``
the global query and key positions (int32; each broadcasts against the score); it returns
the modified scores, with the score's shape and dtype. Write it with ``jnp`` operations
(``params["slopes"][h]`` gathers, ``q_idx - kv_idx`` broadcasts).

Constructors: :func:`soft_cap` (the cap alone), :func:`alibi` (ALiBi's linear biases, causal or
symmetric, slopes as parameters) and :func:`alibi_slopes` (the standard geometric slopes).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["ScoreMod", "alibi", "alibi_slopes", "check", "kind", "make", "relative_table",
           "soft_cap"]


@dataclasses.dataclass(frozen=True)
class ScoreMod:
  """A soft cap and/or a ``score_mod`` function with its parameters (a pytree: ``params``
  are its leaves, ``cap`` and ``fn`` static).

  Attributes:
    cap: ``logits_soft_cap`` c > 0 (s ← c·tanh(s/c) before the bias), or None.
    fn: ``fn(score, b, h, q_idx, kv_idx, params) -> score`` after the bias, or None.
    params: the pytree of arrays ``fn`` reads (its gradients flow back through attention).
    linear_bias: ``"causal"`` or ``"symmetric"`` when ``fn`` is ALiBi's linear bias
      s − m_h·(i − j) or s − m_h·abs(i − j) with ``params`` the slopes m ``[N]``
      (:func:`alibi` sets it), None otherwise: a declaration that kernels which do not call
      ``fn`` (the Pallas kernels) read instead of it, so they never compare functions.
    relative: True when ``fn`` is a relative-position table's bias
      s + table[h, clip(i − j, −(L − 1)/2, (L − 1)/2) + (L − 1)/2] with ``params`` the table
      ``[N, L]`` (:func:`relative_table` sets it): a declaration like ``linear_bias``, read by
      the Pallas kernels instead of ``fn``.
  """

  cap: float | None = None
  fn: Callable[..., Array] | None = None
  params: Any = None
  linear_bias: str | None = None
  relative: bool = False

  def __post_init__(self):
    if self.linear_bias not in (None, "causal", "symmetric"):
      raise ValueError(f"ScoreMod.linear_bias must be None, 'causal' or 'symmetric', got "
                       f"{self.linear_bias!r}.")
    if self.linear_bias is not None and self.fn is None:
      raise ValueError("ScoreMod.linear_bias declares fn to be ALiBi's bias: give fn too.")
    if not isinstance(self.relative, bool):
      raise ValueError(f"ScoreMod.relative must be True or False, got {self.relative!r}.")
    if self.relative and self.fn is None:
      raise ValueError("ScoreMod.relative declares fn to be a relative-position table's bias: "
                       "give fn too.")
    if self.relative and self.linear_bias is not None:
      raise ValueError("ScoreMod.relative and ScoreMod.linear_bias declare two different "
                       "functions (a relative table, ALiBi); a ScoreMod has one fn.")

  def capped(self, z: Array) -> Array:
    """The soft cap on raw scores ``z`` (``z`` itself without one)."""
    if self.cap is None:
      return z
    c = jnp.asarray(self.cap, z.dtype)
    return c * jnp.tanh(z / c)

  def apply(self, z: Array, bias: Array | None, b: Any, h: Any, q_idx: Any,
            kv_idx: Any) -> Array:
    """The modified scores of raw scores ``z`` (scale·q·k) with ``bias`` (or None) at flat
    batch ``b``, head ``h``, positions ``q_idx``, ``kv_idx`` (broadcasting against ``z``)."""
    s = self.capped(z)
    if bias is not None:
      s = s + bias.astype(s.dtype)
    if self.fn is not None:
      s = self.fn(s, b, h, q_idx, kv_idx, self.params)
    return s

  def grid(self, z: Array, bias: Array | None, batch: tuple[int, ...]) -> Array:
    """:meth:`apply` on whole ``[batch..., N, T, S]`` scores (the dense implementation)."""
    n, t, s = z.shape[-3:]
    nb = math.prod(batch)
    b = jnp.arange(nb, dtype=jnp.int32).reshape(batch + (1, 1, 1))
    h = jnp.arange(n, dtype=jnp.int32).reshape((1,) * len(batch) + (n, 1, 1))
    q_idx = jnp.arange(t, dtype=jnp.int32).reshape((1,) * len(batch) + (1, t, 1))
    kv_idx = jnp.arange(s, dtype=jnp.int32).reshape((1,) * len(batch) + (1, 1, s))
    return self.apply(z, bias, b, h, q_idx, kv_idx)


jax.tree_util.register_dataclass(ScoreMod, data_fields=["params"],
                                 meta_fields=["cap", "fn", "linear_bias", "relative"])


def _check_cap(cap: Any) -> float:
  bad = (isinstance(cap, bool) or not isinstance(cap, numbers.Real)
         or not math.isfinite(float(cap)) or float(cap) <= 0)
  if bad:
    raise ValueError(f"logits_soft_cap must be a positive finite number c (scores become "
                     f"c·tanh(s/c)), got {cap!r}.")
  return float(cap)


def soft_cap(cap: float) -> ScoreMod:
  """The soft cap alone: s ← c·tanh(s/c) (Gemma 2's ``attn_logit_softcapping``); the same as
  ``logits_soft_cap=cap``."""
  return ScoreMod(cap=_check_cap(cap))


def alibi_slopes(num_heads: int) -> Array:
  """ALiBi's head slopes m_h (Press et al. 2022, "Train Short, Test Long: Attention with
  Linear Biases Enables Input Length Extrapolation"): the geometric sequence
  2^(−8(h+1)/N) for N a power of two; otherwise those of the nearest smaller power of two n
  followed by every other slope of 2n (the paper's code). float32 ``[N]``."""
  if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1:
    raise ValueError(f"num_heads must be a positive int, got {num_heads!r}.")

  def power_of_two(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

  n = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(n)
  if n < num_heads:
    slopes += power_of_two(2 * n)[0::2][:num_heads - n]
  return jnp.asarray(np.asarray(slopes, np.float32))


def _alibi_causal(score, b, h, q_idx, kv_idx, params):
  del b
  return score - params[h].astype(score.dtype) * (q_idx - kv_idx).astype(score.dtype)


def _alibi_symmetric(score, b, h, q_idx, kv_idx, params):
  del b
  return score - params[h].astype(score.dtype) * jnp.abs(q_idx - kv_idx).astype(score.dtype)


def alibi(slopes: Array, *, symmetric: bool = False) -> ScoreMod:
  """ALiBi as a score modification: s_ij − m_h·(i − j) (``symmetric=True``: − m_h·abs(i − j),
  for attention that is not causal), with ``slopes`` m ``[N]`` as its parameters — pass
  :func:`alibi_slopes` for the paper's, or a learned array (its gradient flows back).

  Pass the result as ``score_mod=`` (it carries its parameters; ``score_mod_params`` stays
  unset). With the causal form, keys after the query get a positive bias: combine it with
  ``is_causal=True`` (or a causal mask), as ALiBi models do."""
  slopes = jnp.asarray(slopes)
  if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise ValueError(f"alibi: slopes must be a float array [N] (one per query head), got "
                     f"shape {slopes.shape} and dtype {slopes.dtype}.")
  return ScoreMod(fn=_alibi_symmetric if symmetric else _alibi_causal, params=slopes,
                  linear_bias="symmetric" if symmetric else "causal")


def _relative(score, b, h, q_idx, kv_idx, params):
  del b
  half = params.shape[-1] // 2
  d = jnp.clip(q_idx - kv_idx, -half, half) + half
  return score + params[h, d].astype(score.dtype)


def relative_table(table: Array) -> ScoreMod:
  """A learned relative-position bias: s_ij + table[h, i − j + (L − 1)/2] with ``table``
  ``[N, L]`` (L odd: distances −(L − 1)/2 … (L − 1)/2; farther ones read the ends; L = 2T − 1
  covers every pair), FlexAttention's relative-bias example. Its gradient flows to
  ``table``. The result declares itself (:attr:`ScoreMod.relative`), so the Pallas kernels
  run it without calling ``fn``."""
  table = jnp.asarray(table)
  if table.ndim != 2 or table.shape[1] % 2 == 0 or not jnp.issubdtype(table.dtype,
                                                                       jnp.floating):
    raise ValueError(f"relative_table: table must be a float array [N, L] with L odd "
                     f"(distances −(L−1)/2 … (L−1)/2), got shape {table.shape} and dtype "
                     f"{table.dtype}.")
  return ScoreMod(fn=_relative, params=table, relative=True)


def kind(mod: ScoreMod | None) -> str | None:
  """What a modification's function is, for implementations that run some kinds only: None
  (no modification, or a soft cap alone), ``"alibi"`` (a :attr:`ScoreMod.linear_bias`, ALiBi's
  slopes as ``params``), ``"relative"`` (a :attr:`ScoreMod.relative` table, the table as
  ``params``) or ``"fn"`` (any other function: a user's)."""
  if mod is None or mod.fn is None:
    return None
  if mod.linear_bias is not None:
    return "alibi"
  return "relative" if mod.relative else "fn"


def make(logits_soft_cap: Any = None, score_mod: Any = None,
         score_mod_params: Any = None) -> ScoreMod | None:
  """The call's :class:`ScoreMod` from :func:`attnx.core.attention`'s keywords, checked, or
  None when there is none: ``score_mod`` is a callable (with ``score_mod_params``) or a
  :class:`ScoreMod` (carrying its own parameters), ``logits_soft_cap`` a positive number."""
  cap = None if logits_soft_cap is None else _check_cap(logits_soft_cap)
  if score_mod is None:
    if score_mod_params is not None:
      raise ValueError("score_mod_params were given without a score_mod; pass "
                       "score_mod=fn(score, b, h, q_idx, kv_idx, params).")
    return None if cap is None else ScoreMod(cap=cap)
  if isinstance(score_mod, ScoreMod):
    if score_mod_params is not None:
      raise ValueError("score_mod is a ScoreMod (for example core.alibi(slopes)), which "
                       "carries its own parameters: leave score_mod_params unset.")
    if cap is not None and score_mod.cap is not None and cap != score_mod.cap:
      raise ValueError(f"two soft caps: logits_soft_cap={cap} and the score_mod's "
                       f"{score_mod.cap}.")
    return dataclasses.replace(score_mod, cap=cap if cap is not None else score_mod.cap)
  if not callable(score_mod):
    raise ValueError(f"score_mod must be a function fn(score, b, h, q_idx, kv_idx, params) "
                     f"or a core.score_mods.ScoreMod, got {type(score_mod).__name__}.")
  return ScoreMod(cap=cap, fn=score_mod, params=score_mod_params)


def check(mod: ScoreMod, dtype: Any, ndim_batch: int = 1) -> None:
  """ValueError unless ``mod.fn`` returns scores of the shape and dtype it was given (traced
  abstractly on a small grid laid out as the kernels lay out a tile)."""
  if mod.fn is None:
    return
  lead = (1,) * ndim_batch
  score = jax.ShapeDtypeStruct(lead + (2, 3, 5), jnp.dtype(dtype))
  idx = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = (idx(lead + (1, 1, 1)), idx(lead + (2, 1, 1)), idx(lead + (1, 3, 1)),
          idx(lead + (1, 1, 5)))
  try:
    out = jax.eval_shape(mod.fn, score, *args, mod.params)
  except Exception as e:  # the user's function failed on the tile: say so, with its error
    raise ValueError(f"score_mod failed on a tile of scores {score.shape} with broadcasting "
                     f"index arrays b, h, q_idx, kv_idx: {type(e).__name__}: {e}") from e
  if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != score.shape or (
      out.dtype != score.dtype):
    got = (f"{out.shape} {out.dtype}" if isinstance(out, jax.ShapeDtypeStruct)
           else type(out).__name__)
    raise ValueError(f"score_mod must return scores of the shape and dtype it is given (a "
                     f"tile {score.shape} {score.dtype}), got {got}.")
