"""The streaming rules of a pointwise F (:class:`attnx.core.weightings.Pointwise` ``w``).

A pointwise F streams with one of two rules: the online max with rescaling for softmax-like F
(:func:`online_max_update`), or acc += F·V with a sum, count or nothing beside it
(:func:`pointwise_update`); :func:`pointwise_merge` joins raw states of disjoint key ranges,
:func:`pointwise_finalize` normalizes once (the denominator offset a virtual key of score 0),
and the backward recomputes each tile's weights and dS from the saved row statistic
(:func:`pointwise_grad_rows`, :func:`pointwise_tile_grad`). The blocked kernel
(:mod:`attnx.core.kernels.xla.pointwise`: its key tiles, its causal triangle's merge of the raw
states of its pieces, its backward) and both Pallas backends (:mod:`attnx.core.kernels.pallas`,
forward and dQ/dK/dV kernels, through their :class:`~attnx.core.streaming.ops.Ops`) run them.

A raw state is (acc, st), or (acc, m, l) for the online max without a ones column:

* acc = Σ F·V over the keys seen, [..., rows, Hv] or a tuple of head-dim chunks of it (v is
  then the tuple of the matching chunks of V); with ``ops.ones_column`` and "sum", V ends in
  a column of ones, so acc's last column is Σ F;
* st: the running max m (online max), the valid-key count ("length"), Σ F ("sum" without
  the ones column), unused otherwise;
* l: Σ e^{z − m} (online max without the ones column).

Row statistics (m, st, l) are laid out as ``ops`` says: [..., rows], or [rows, lanes].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attnx.core.streaming.ops import LOG2E, XLA, Array, Ops


def _rows_times(acc: Any, r: Array, ops: Ops) -> Any:
  """acc (an array, or a tuple of head-dim chunks) with every row multiplied by r's value."""
  return jax.tree.map(lambda a: a * ops.spread(r, a.shape[-1]), acc)


def _split_ones(acc: Array) -> tuple[Array, Array]:
  """(Σ F·V, Σ F) of an accumulator whose last column came from V's column of ones."""
  hv = acc.shape[-1] - 1
  return acc[..., :hv], acc[..., hv]


def _check_l(l: Array | None, ops: Ops, fn: str) -> None:
  """The online max's l is in acc's ones column or passed apart, never both or neither."""
  if (l is None) != ops.ones_column:
    raise ValueError(f"{fn}: pass l (Σ e^(z − m)) exactly when ops.ones_column is False "
                     f"(ones_column={ops.ones_column}, l given: {l is not None})")


def online_max_start(w: Any, with_offset: bool = True) -> tuple[float, float]:
  """(m, l) of a row that has seen no key, the start of :func:`online_max_update`.

  The denominator offset c (softmax_plus_one, Evan Miller 2023) is a virtual key of score 0.
  A state may start from it (m = 0, l = c; finalize with ``add_offset=False``) or start
  empty (m = −∞, l = 0; ``with_offset=False``) and get it in :func:`pointwise_finalize`: raw
  states that are merged must, or the key would count once per piece.
  """
  c = float(w.denominator_offset) if with_offset else 0.0
  return (0.0 if c > 0 else -float("inf")), c


def _unit(ops: Ops) -> float:
  """The online max's exponent unit: 1, or log₂e when its exponentials are 2ˣ."""
  return LOG2E if ops.exp2 else 1.0


def online_max_bound(log_f: Any, z: Array, *, ops: Ops = XLA) -> Array:
  """The running max's candidate for scores whose largest is ``z`` (any shape, elementwise):
  z itself (the exponent α·s), or for a log-domain F (``w.log_f``, z the score)
  unit·bound(z) ≥ unit·log F(z)."""
  if log_f is None:
    return z
  g = log_f.bound(z)
  return g * _unit(ops) if ops.exp2 else g


def online_max_shifted(log_f: Any, z: Array, m: Array, *, ops: Ops = XLA) -> Array:
  """e^{exponent − m} of scores ``z`` (any shape) with ``m`` broadcast against them, finite:
  e^{z − m}, or for a log-domain F e^{unit·log F(z) − m} (one exponential per score)."""
  if log_f is None:
    return ops.exp(z - m)
  return log_f.shifted(z, m, ops.exp(m), ops.exp, _unit(ops))[0]


def online_max_update(acc: Any, m: Array, z: Array, valid: Array | None, v: Any,
                      l: Array | None = None, *, ops: Ops = XLA,
                      log_f: Any = None) -> tuple[Any, ...]:
  """One key tile of the online softmax (Milakov & Gimelshein 2018): rescale by e^{m_old − m}.

  ``z``: the tile's [..., rows, keys] exponents α·s (in base-2 units with ``ops.exp2``), or
  with ``log_f`` (a :class:`~attnx.core.weightings.LogF`, sum-normalized sigmoid's) its scores
  s, whose exponent is log F(s) (m then a bound of it, :func:`online_max_bound`); keys
  where ``valid`` is False weigh nothing, and a row without a valid key so far keeps m = −∞
  and is not shifted. Returns (acc, m) with ``ops.ones_column`` (l = Σ e^{z − m} rides in
  acc's last column), else (acc, m, l).
  """
  _check_l(l, ops, "online_max_update")
  if valid is not None:
    z = jnp.where(valid, z, -jnp.inf)
  m_new = jnp.maximum(m, online_max_bound(log_f, ops.row_max(z), ops=ops))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked so far: no shift
  n = z.shape[-1]
  if log_f is None:
    p = ops.exp(z - ops.spread(m_use, n))
  else:
    p = log_f.shifted(z, ops.spread(m_use, n), ops.spread(ops.exp(m_use), n), ops.exp,
                      _unit(ops))[0]
  corr = ops.exp(m - m_use)
  acc = jax.tree.map(lambda a, vc: a * ops.spread(corr, a.shape[-1]) + ops.pv(p, vc), acc, v)
  if ops.ones_column:
    return acc, m_new
  return acc, m_new, l * corr + ops.row_sum(p)


def pointwise_update(w: Any, acc: Any, l: Array, s: Array, valid: Array | None, v: Any,
                     num_keys: int, *, ops: Ops = XLA, full: bool = False) -> tuple[Any, Array]:
  """One key tile of a pointwise F without a running max: acc += F·V, and the statistic l
  (``st``) += the tile's valid-key count (``"length"``; with ``valid`` None nothing is counted,
  see :func:`pointwise_finalize`'s ``num_keys``, unless ``full``: a tile of a masked kernel
  whose every key is valid, counted whole) or Σ F (``"sum"`` without a ones column)."""
  if valid is None:
    f = w.fn(s, num_keys)
  else:
    # F never sees masked scores, so they cannot produce NaN/inf (or their gradients).
    f = jnp.where(valid, w.fn(jnp.where(valid, s, 0.0), num_keys), 0.0)
  acc = jax.tree.map(lambda a, vc: a + ops.pv(f, vc), acc, v)  # a ones column accumulates Σ F
  if w.divides_by_sum and not ops.ones_column:
    l = l + ops.row_sum(f)
  elif w.divides_by_length and (valid is not None or full):
    every = jnp.ones(f.shape, bool) if valid is None else jnp.broadcast_to(valid, f.shape)
    l = l + ops.row_sum(every, dtype=l.dtype)
  return acc, l


def pointwise_empty(w: Any, rows: tuple[int, ...], hv: int, dtype: Any) -> tuple[Array, Array]:
  """The raw state (acc, st) of rows that have seen no key (the XLA spelling: acc [rows, Hv],
  or [rows, Hv + 1] with Σ F in the last column; st −∞ for the online max, else 0)."""
  cols = hv + 1 if w.divides_by_sum else hv
  return (jnp.zeros(rows + (cols,), dtype),
          jnp.full(rows, -jnp.inf if w.online_max else 0.0, dtype))


def pointwise_merge(w: Any, a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
  """Merges two raw states (acc, st) of the same rows over disjoint key ranges (the XLA
  spelling: natural units, Σ F in a ones column)."""
  (acc_a, st_a), (acc_b, st_b) = a, b
  if not w.online_max:
    return acc_a + acc_b, st_a + st_b
  m = jnp.maximum(st_a, st_b)
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  return (acc_a * jnp.exp(st_a - m_use)[..., None] + acc_b * jnp.exp(st_b - m_use)[..., None],
          m)


def pointwise_finalize(w: Any, acc: Any, st: Array, l: Array | None = None, *,
                       add_offset: bool = True, num_keys: int | None = None,
                       split_lse: bool = False, ops: Ops = XLA) -> tuple[Any, Array]:
  """A raw state -> (O, row statistic): lse = m + log l for the online max (a log2-sum-exp
  with ``ops.exp2``), the normalizer l otherwise (1 for ``"none"``).

  ``split_lse`` (online max): the statistic is [..., rows, 2], lse as the pair (hi, lo) with
  hi = fl(m + log l) and lo its rounding error (exact, by TwoSum), which
  :func:`pointwise_tile_grad` subtracts in turn: e^{(z − hi) − lo}. The rounding of a single
  lse is up to half an ulp of lse (2⁻²⁰ at lse ≈ 20, scores of large mean) of relative error
  in every recomputed weight of the row, on top of the scores' own; with the pair the
  weights are as accurate as exp(z − m)/l (docs/guides/implementations.md, "Precision and
  accuracy").

  ``add_offset``: add the denominator offset here, as a virtual key of score 0 (False when
  the state started from it: :func:`online_max_start`). ``num_keys``: ``"length"`` on tiles
  that were never masked (nothing was counted): every row has this many keys. A row whose
  normalizer is 0 (no valid key, or every F 0) gets O = 0 and lse = +∞, which makes every
  weight the backward recomputes 0; a NaN normalizer (NaN score) propagates.
  """
  norm = w.normalization
  offset = float(w.denominator_offset)
  if w.online_max:
    _check_l(l, ops, "pointwise_finalize")
    m = st
    if ops.ones_column:
      acc, l = _split_ones(acc)
    if add_offset and offset > 0:  # the virtual key of score 0
      m_new = jnp.maximum(m, 0.0)
      corr = ops.exp(m - m_new)
      acc, l, m = _rows_times(acc, corr, ops), l * corr + offset * ops.exp(-m_new), m_new
    m = jnp.where(m == -jnp.inf, 0.0, m)
    empty = l == 0
    o = jax.tree.map(lambda a: jnp.where(ops.spread(empty, a.shape[-1]), 0.0,
                                         a / ops.spread(jnp.where(empty, 1.0, l), a.shape[-1])),
                     acc)
    log_l = ops.log(jnp.where(empty, 1.0, l))
    lse = m + log_l
    stat = jnp.where(empty, jnp.inf, lse)
    if not split_lse:
      return o, stat
    # TwoSum (Knuth): lse + lo = m + log_l exactly, whichever of the two is larger.
    back = lse - m
    lo = (m - (lse - back)) + (log_l - back)
    return o, jnp.stack([stat, jnp.where(jnp.isfinite(stat), lo, 0.0)], axis=-1)
  if norm == "none":
    return acc, jnp.ones(st.shape, st.dtype)
  if norm == "sum":
    if ops.ones_column:
      acc, l = _split_ones(acc)
    else:
      l = st
    if add_offset:
      l = l + offset
  elif num_keys is not None:
    l = jnp.full(st.shape, float(num_keys), st.dtype)
  else:
    l = st
  empty = l == 0
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  return _rows_times(acc, inv, ops), l


def pointwise_grad_rows(w: Any, stat: Array,
                        delta: Array) -> tuple[Array | None, Array | None, Array | None]:
  """The per-row values (r0, r1, δ) :func:`pointwise_tile_grad` reads, from the forward's row
  statistic and δ_i = dO_i·O_i = Σ_j w_ij dP_ij (also right with a denominator offset).

  Online max: (lse, −, δ), lse the pair (hi, lo) where ``stat`` is [..., 2] (``split_lse``
  of :func:`pointwise_finalize`: one more dim than ``delta``); ``"sum"``: (μ, 1/(l·μ), δ);
  ``"length"``: (−, 1/n, −);
  ``"none"``: nothing (− is None: the rule reads nothing there). μ = 2^100 where
  |l| < 2^−100, else 1: 1/l overflows for a denormal l (F ≈ 0 on a whole row, e.g.
  power:p=3 on scores near 0) and F·∞ would be NaN, so such rows use F·2^100 / (l·2^100)
  (F ≤ l there). A row with l = 0 gets 1/l = 0: zero weights and gradients. A NaN row (NaN
  lse) gets δ = 0: its P is NaN at every valid key already, and a masked key's
  dz = 0·(dP − δ) must stay 0, so that the row reaches only the keys it attends.
  """
  if w.online_max:
    if stat.ndim == delta.ndim + 1:
      stat = (stat[..., 0], stat[..., 1])
    return stat, None, jnp.where(jnp.isnan(delta), 0.0, delta)
  if w.unnormalized:
    return None, None, None
  empty = stat == 0
  tiny = jnp.abs(stat) < 2.0 ** -100
  mult = jnp.where(tiny, 2.0 ** 100, 1.0)
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, stat * mult))
  if w.divides_by_sum:
    return mult, inv, delta
  return None, inv, None


def pointwise_tile_grad(w: Any, z: Array, valid: Array | None, dp: Array,
                        rows: tuple[Array | None, Array | None, Array | None], num_keys: int,
                        *, row: Any = None, ops: Ops = XLA) -> tuple[Array, Array]:
  """The backward of one tile from the saved statistic (FlashAttention-2's recomputation):
  (P, dz), the weights (for dV = Pᵀ·dO) and the cotangent of z in natural units.

  Online max (z = α·s, base 2 with ``ops.exp2``): P = e^{z − lse} (e^{(z − hi) − lo} for a
  split lse), dz = P ∘ (dP − δ); for a log-domain F (``w.log_f``, z the score s itself)
  P = e^{log F(s) − lse} and dz = P ∘ (dP − δ) ∘ d log F/ds, the cotangent of s;
  ``"sum"``: dz = F'(s) ∘ (dP − δ)/l; ``"length"``: F'(s) ∘ dP/n; ``"none"``: F'(s) ∘ dP.
  ``dp`` = dO·Vᵀ on the tile; ``rows`` the (r0, r1, δ) of :func:`pointwise_grad_rows`, each
  taken onto the tile by ``row`` (default: they are already broadcast against it) only where
  the rule reads it. Masked keys get P = 0 and dz = 0, also in a NaN row (NaN statistic).
  """
  row = (lambda r: r) if row is None else row
  r0, r1, delta = rows
  if w.online_max and w.log_f is not None:
    hi, lo = r0 if isinstance(r0, tuple) else (r0, None)
    # Exponentials of the tile's rows only (row() may slice them from every row's statistic).
    hi = row(hi)
    r, slope = w.log_f.shifted(z, hi, ops.exp(hi), ops.exp, _unit(ops))
    p = r if lo is None else r * ops.exp(-row(lo))
    dz = p * (dp - row(delta)) * slope
    if valid is not None:  # after the products: a masked key's score may be anything
      p, dz = jnp.where(valid, p, 0.0), jnp.where(valid, dz, 0.0)
    return p, dz
  if w.online_max:
    if isinstance(r0, tuple):  # lse = hi + lo (split_lse)
      p = ops.exp((z - row(r0[0])) - row(r0[1]))
    else:
      p = ops.exp(z - row(r0))
    if valid is not None:  # after the exp: e^(−∞ − lse) is NaN where lse is
      p = jnp.where(valid, p, 0.0)
    return p, p * (dp - row(delta))
  sv = z if valid is None else jnp.where(valid, z, 0.0)
  f, fp = jax.jvp(lambda s: w.fn(s, num_keys), (sv,), (jnp.ones_like(sv),))
  if w.unnormalized:
    p, dz = f, fp * dp
  else:
    il = row(r1)
    if w.divides_by_sum:
      big = row(r0)
      f, fp = f * big, fp * big
      dz = fp * ((dp - row(delta)) * il)
    else:
      dz = fp * (dp * il)
    p = f * il
  if valid is not None:  # after the products: 1/l is NaN in a NaN row
    p, dz = jnp.where(valid, p, 0.0), jnp.where(valid, dz, 0.0)
  return p, dz



__all__ = ["online_max_bound", "online_max_shifted", "online_max_start", "online_max_update",
           "pointwise_empty", "pointwise_finalize", "pointwise_grad_rows", "pointwise_merge",
           "pointwise_tile_grad", "pointwise_update"]
