"""Streaming states of the whole-row weightings: one definition per family, shared by kernels.

A streaming kernel never holds a whole row of scores. It visits a row's keys tile by tile and
keeps, per query row, a small state; this module says what that state is for each family of
whole-row weighting (see ``docs/references.md``), as pure functions on one tile:

* ``init(rows, hv)``: the state of a row that has seen no key;
* ``update(state, z, valid, v, ctx)``: the state after one more key tile (z the [rows, keys]
  float32 scores, ``valid`` the boolean tile, v the [keys, Hv] values); ``reverse`` families
  (stick-breaking) must be fed the keys from the last one backwards;
* ``merge(a, b)``: the state of two disjoint key ranges of the same rows (split-K, ring
  attention); for ``reverse`` families ``a`` holds the later keys;
* ``finalize(state, ctx)``: (output rows, the row statistics the backward needs);
* ``tile_grad(...)``: the backward of one tile from the saved statistics: the weights (for dV),
  dz (the cotangent of the scores) and the family's per-row carries.

``ctx`` holds per-row constants that depend on the whole row but not on the values: the scale
c_i = s·log n_i of SSMax, the threshold τ_i of sparsemax/entmax (found by
:func:`entmax_threshold`, a few passes over the key tiles before the output pass).

The families:

* **ssmax** — softmax of c_i·z (Nakanishi 2025): the online softmax with a per-row scale.
* **softpick** — relu(eᶻ − 1)/(Σ|eᶻ − 1| + ε) (Zuhri et al. 2025) with a running max m ≥ 0
  (the e^{−m} of the "−1" rescales like e^{z−m}; m ≥ 0 keeps e^{−m} ≤ 1, exact). With 16-bit
  values its P·V takes each weight as two 16-bit parts: the backward multiplies δ = dO·O by
  e^z/Σ|e^z − 1|, up to ~1/|z|, so O must hold the weights to better than 16 bits.
* **stick_breaking** — β = σ(z), keys visited from the last one backwards carrying
  L = Σ log(1 − β) of the keys already visited (Tan et al. 2024); every log-weight is ≤ 0, so
  no running max is needed.
* **entmax** — α-entmax, sparsemax (α = 2) and 1.5-entmax: [x − τ]₊^{1/(α−1)} with
  x = (α−1)·scale·z shifted by the row max, τ found by passes of Newton's method safeguarded
  by bisection (Gonçalves et al. 2025, "AdaSplash"), then one output pass that also
  accumulates Σu·v/Σu, u = p^{2−α}, the statistic of the backward.

Masked keys (``valid`` False, or a score of −∞) contribute nothing: no weight, no
denominator, no stick. NaN scores at valid keys make the row NaN, as in the dense weightings.

A pointwise F streams with one of two rules: the online max with rescaling for softmax-like
F (:func:`online_max_update`), or acc += F·V with a sum, count or nothing beside it
(:func:`pointwise_update`); :func:`pointwise_merge` joins raw states of disjoint key ranges,
:func:`pointwise_finalize` normalizes once (the denominator offset a virtual key of score 0),
and the backward recomputes each tile's weights and dS from the saved row statistic
(:func:`pointwise_grad_rows`, :func:`pointwise_tile_grad`). The blocked kernel
(:mod:`attnx.core.kernels.xla.pointwise`: its tiles, its causal triangle's merge of the raw states
of its pieces, its backward) and both Pallas backends (:mod:`attnx.core.kernels.pallas`, forward and
dQ/dK/dV kernels) run them. :class:`Ops` spells what differs between kernel languages: the
primitives Triton and Mosaic lack, base-2 exponents, where Σ F accumulates and the layout of
the row statistics, so that every backend runs the same tile math.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core.contract import compute_dtype
from attnx.core.softplus import log_sigmoid_pair

Array = jax.Array
F32 = jnp.float32
FAMILIES = ("ssmax", "softpick", "stick_breaking", "entmax")
# Newton/bisection passes for the threshold: bisection alone reaches float32 resolution of
# τ ∈ [−1, 0] in 25, and Newton's method needs ~4–8 where it applies.
MAX_THRESHOLD_PASSES = 40
# Float64 scores (jax_enable_x64): bisection needs 29 more halvings for its 52-bit resolution.
MAX_THRESHOLD_PASSES_F64 = MAX_THRESHOLD_PASSES + 30


def max_threshold_passes(dtype: Any = F32) -> int:
  """The most passes :func:`entmax_threshold` makes for scores of ``dtype``."""
  return MAX_THRESHOLD_PASSES_F64 if jnp.dtype(dtype).itemsize > 4 else MAX_THRESHOLD_PASSES


@dataclasses.dataclass(frozen=True)
class Ops:
  """How the tile math is spelled in a kernel language: the primitives it lacks, its layouts.

  The defaults are the XLA forms the blocked kernels use (:data:`XLA`); the Pallas kernels
  (:mod:`attnx.core.kernels.pallas`: ``triton.OPS``, ``mosaic.OPS`` for a pointwise F,
  ``triton_rows.OPS``, ``mosaic_rows.OPS`` for the whole-row families) pick alternatives that
  compute the same functions with other rounding, in other units (exp2) or layouts. With the
  default, every function that takes ``ops`` computes exactly (bit for bit) what it computed
  before the argument existed.

  Attributes:
    cumsum_matmul: stick-breaking's reverse exclusive cumsum along a tile's keys as matmuls
      with the strictly triangular 0/1 matrix (float32 split into three bfloat16 parts, each
      product exact, float32 accumulation): Triton lowers no reverse cumsum, Mosaic no cumsum.
    concat_pv: entmax's Σp·v and Σu·v as one matmul of the stacked rows [p; u] (True) or as
      two: Triton concatenates only [..., 1] arrays.
    all_rows: the threshold loop stops when every row is done, tested with ``jnp.all`` (True)
      or as a float32 minimum (no boolean reductions: Triton).
    sign: softpick's sign(z) by ``jnp.sign`` (True) or by comparisons (Mosaic's sign rule asks
      the TPU for its generation, so it does not lower on a host without one).
    threshold_loop: entmax's threshold passes in a ``lax.while_loop`` that stops once every
      row is done (``"while"``), or in a ``lax.fori_loop`` of :data:`MAX_THRESHOLD_PASSES`
      whose passes after that are skipped by ``lax.cond`` (``"fori"``).
    exp2: the pointwise online max's scores arrive in base-2 units (z·log₂e, the factor
      folded into the score's scale), so its exponentials are exp2 and its statistic a
      log2-sum-exp (True: the Pallas kernels, as FlashAttention-2), or natural units (False).
    ones_column: a pointwise F with ``"sum"`` gets its row sum Σ F from the F·V matmul, V
      carrying a column of ones the caller appended (True: one pass over the tile fewer), or
      from a separate sum over the tile's keys (False: Triton arrays have power-of-2 dims and
      Mosaic's lanes come by 128, so Hv + 1 columns do not fit).
    lanes: the pointwise rules' row statistics are [..., rows] (0), or [rows, lanes]
      replicated over the lanes (Mosaic: 1-D vectors and [rows, 1] columns lay out badly on
      the TPU's (8, 128) vregs); :meth:`row_max`, :meth:`row_sum` and :meth:`spread` follow.
  """

  cumsum_matmul: bool = False
  concat_pv: bool = True
  all_rows: bool = True
  sign: bool = True
  threshold_loop: str = "while"
  exp2: bool = False
  ones_column: bool = True
  lanes: int = 0

  def exp(self, x: Array) -> Array:
    """The online max's exponential: eˣ, or 2ˣ when the scores are in base-2 units."""
    return jnp.exp2(x) if self.exp2 else jnp.exp(x)

  def log(self, x: Array) -> Array:
    """The inverse of :meth:`exp` (for the log-sum-exp statistic)."""
    return jnp.log2(x) if self.exp2 else jnp.log(x)

  def row_max(self, x: Array) -> Array:
    """The max over a tile's keys (last axis), in the layout of the row statistics."""
    return jnp.max(x, axis=-1, keepdims=self.lanes > 0)

  def row_sum(self, x: Array, dtype: Any = None) -> Array:
    """The sum over a tile's keys (last axis), in the layout of the row statistics."""
    return jnp.sum(x, axis=-1, dtype=dtype, keepdims=self.lanes > 0)

  def spread(self, r: Array, n: int) -> Array:
    """A row statistic broadcast against n columns (a tile's keys or an accumulator's)."""
    if not self.lanes:
      return r[..., None]
    if r.dtype == jnp.bool_:  # Mosaic tiles no i1 vectors: through float32
      return _lanes(r.astype(F32), n, self.lanes) > 0
    return _lanes(r, n, self.lanes)


XLA = Ops()


def _lanes(x: Array, n: int, lanes: int) -> Array:
  """A lane-replicated [rows, lanes] value as [rows, n] (tiled, or sliced below ``lanes``)."""
  if n % lanes == 0:
    return jnp.tile(x, (1, n // lanes)) if n != lanes else x
  if n < lanes:
    return x[:, :n]
  return jnp.tile(x, (1, -(-n // lanes)))[:, :n]


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
  def reverse(self) -> bool:
    """Whether key tiles must be visited from the last key backwards."""
    return self.family == "stick_breaking"

  @property
  def needs_row_scale(self) -> bool:
    """Whether the kernels need the per-row scale c_i = s·log n_i (SSMax)."""
    return self.family == "ssmax"

  @property
  def needs_threshold(self) -> bool:
    return self.family == "entmax"

  @property
  def num_stats(self) -> int:
    """How many [rows] statistics :meth:`finalize` returns for the backward."""
    return {"ssmax": 1, "softpick": 1, "stick_breaking": 1, "entmax": 3}[self.family]

  @property
  def saves_support_mean(self) -> bool:
    """Whether the backward needs Σu·v/Σu ([rows, Hv]) besides the output (entmax)."""
    return self.family == "entmax"

  @property
  def suffix_carries(self) -> bool:
    """Whether the backward of a key tile (or of a ring block) needs the grad carries of the
    keys after it (stick-breaking: the stick L they leave and their Σ A·dP), so that a kernel
    whose dQ and dK/dV passes are apart saves them per key tile."""
    return self.family == "stick_breaking"

  @property
  def output_is_state(self) -> bool:
    """Whether :func:`finalize` returns the raw state as it is (stick-breaking: (Σ A·v, L)),
    so that a block's output and statistic are its raw state."""
    return self.family == "stick_breaking"

  @property
  def max_start(self) -> float | None:
    """The running max m of a :class:`MaxState` that has seen no key: −∞ (SSMax), or 0 where
    m never drops below 0 (softpick: keeps e^{−m} ≤ 1); None for the other families."""
    return {"ssmax": -float("inf"), "softpick": 0.0}.get(self.family)

  @property
  def block_stream(self) -> RowStream:
    """The stream of one key block whose state is merged with others (ring attention): this
    one without the terms that belong to the whole row (softpick's ε), which :func:`finalize`
    adds once after the merge."""
    if self.family == "softpick" and self.eps:
      return dataclasses.replace(self, eps=0.0)
    return self


def pv(p: Array, v: Array) -> Array:
  """Σ_j p_ij v_j accumulated in max(float32, v's dtype); p [..., rows, keys], v [..., keys,
  Hv]."""
  return jnp.einsum("...qs,...sd->...qd", p.astype(v.dtype), v,
                    preferred_element_type=compute_dtype(v.dtype))


def _masked(z: Array, valid: Array, fill: float = 0.0) -> Array:
  return jnp.where(valid, z, fill)


# --------------------------------------------------------------------------------------------
# Pointwise F (:class:`attnx.core.weightings.Pointwise` ``w``): the two streaming rules, used
# by the blocked kernel (attnx.core.kernels.xla.pointwise: its key tiles and its causal triangle's
# merge) and by the Pallas kernels (attnx.core.kernels.pallas: Triton and Mosaic, through their
# Ops). A raw state is (acc, st), or (acc, m, l) for the online max without a ones column:
# * acc = Σ F·V over the keys seen, [..., rows, Hv] or a tuple of head-dim chunks of it (v is
#   then the tuple of the matching chunks of V); with ``ops.ones_column`` and "sum", V ends in
#   a column of ones, so acc's last column is Σ F;
# * st: the running max m (online max), the valid-key count ("length"), Σ F ("sum" without
#   the ones column), unused otherwise;
# * l: Σ e^{z − m} (online max without the ones column).
# Row statistics (m, st, l) are laid out as ``ops`` says: [..., rows], or [rows, lanes].
# --------------------------------------------------------------------------------------------

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


def online_max_update(acc: Any, m: Array, z: Array, valid: Array | None, v: Any,
                      l: Array | None = None, *, ops: Ops = XLA) -> tuple[Any, ...]:
  """One key tile of the online softmax (Milakov & Gimelshein 2018): rescale by e^{m_old − m}.

  ``z``: the tile's [..., rows, keys] exponents α·s (in base-2 units with ``ops.exp2``); keys
  where ``valid`` is False weigh nothing, and a row without a valid key so far keeps m = −∞
  and is not shifted. Returns (acc, m) with ``ops.ones_column`` (l = Σ e^{z − m} rides in
  acc's last column), else (acc, m, l).
  """
  _check_l(l, ops, "online_max_update")
  if valid is not None:
    z = jnp.where(valid, z, -jnp.inf)
  m_new = jnp.maximum(m, ops.row_max(z))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked so far: no shift
  p = ops.exp(z - ops.spread(m_use, z.shape[-1]))
  corr = ops.exp(m - m_use)
  acc = jax.tree.map(lambda a, vc: a * ops.spread(corr, a.shape[-1]) + pv(p, vc), acc, v)
  if ops.ones_column:
    return acc, m_new
  return acc, m_new, l * corr + ops.row_sum(p)


def pointwise_update(w: Any, acc: Any, l: Array, s: Array, valid: Array | None, v: Any,
                     num_keys: int, *, ops: Ops = XLA) -> tuple[Any, Array]:
  """One key tile of a pointwise F without a running max: acc += F·V, and the statistic l
  (``st``) += the tile's valid-key count (``"length"``; with ``valid`` None nothing is counted,
  see :func:`pointwise_finalize`'s ``num_keys``) or Σ F (``"sum"`` without a ones column)."""
  if valid is None:
    f = w.fn(s, num_keys)
  else:
    # F never sees masked scores, so they cannot produce NaN/inf (or their gradients).
    f = jnp.where(valid, w.fn(jnp.where(valid, s, 0.0), num_keys), 0.0)
  acc = jax.tree.map(lambda a, vc: a + pv(f, vc), acc, v)  # a ones column accumulates Σ F
  if w.normalization == "sum" and not ops.ones_column:
    l = l + ops.row_sum(f)
  elif w.normalization == "length" and valid is not None:
    l = l + ops.row_sum(jnp.broadcast_to(valid, f.shape), dtype=l.dtype)
  return acc, l


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
  if w.normalization == "none":
    return None, None, None
  empty = stat == 0
  tiny = jnp.abs(stat) < 2.0 ** -100
  mult = jnp.where(tiny, 2.0 ** 100, 1.0)
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, stat * mult))
  if w.normalization == "sum":
    return mult, inv, delta
  return None, inv, None


def pointwise_tile_grad(w: Any, z: Array, valid: Array | None, dp: Array,
                        rows: tuple[Array | None, Array | None, Array | None], num_keys: int,
                        *, row: Any = None, ops: Ops = XLA) -> tuple[Array, Array]:
  """The backward of one tile from the saved statistic (FlashAttention-2's recomputation):
  (P, dz), the weights (for dV = Pᵀ·dO) and the cotangent of z in natural units.

  Online max (z = α·s, base 2 with ``ops.exp2``): P = e^{z − lse} (e^{(z − hi) − lo} for a
  split lse), dz = P ∘ (dP − δ);
  ``"sum"``: dz = F'(s) ∘ (dP − δ)/l; ``"length"``: F'(s) ∘ dP/n; ``"none"``: F'(s) ∘ dP.
  ``dp`` = dO·Vᵀ on the tile; ``rows`` the (r0, r1, δ) of :func:`pointwise_grad_rows`, each
  taken onto the tile by ``row`` (default: they are already broadcast against it) only where
  the rule reads it. Masked keys get P = 0 and dz = 0, also in a NaN row (NaN statistic).
  """
  row = (lambda r: r) if row is None else row
  r0, r1, delta = rows
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
  if w.normalization == "none":
    p, dz = f, fp * dp
  else:
    il = row(r1)
    if w.normalization == "sum":
      big = row(r0)
      f, fp = f * big, fp * big
      dz = fp * ((dp - row(delta)) * il)
    else:
      dz = fp * (dp * il)
    p = f * il
  if valid is not None:  # after the products: 1/l is NaN in a NaN row
    p, dz = jnp.where(valid, p, 0.0), jnp.where(valid, dz, 0.0)
  return p, dz


# --------------------------------------------------------------------------------------------
# SSMax and softpick: a running maximum.
# --------------------------------------------------------------------------------------------

class MaxState(NamedTuple):
  acc: Array  # [rows, Hv] Σ weight·v, in units of e^{m}
  l: Array  # [rows] the denominator's running sum, in the same units
  m: Array  # [rows] the running maximum


def _max_init(rows: tuple[int, ...], hv: int, m0: float, dtype: Any = F32) -> MaxState:
  return MaxState(jnp.zeros(rows + (hv,), dtype), jnp.zeros(rows, dtype),
                  jnp.full(rows, m0, dtype))


def _max_merge(a: MaxState, b: MaxState) -> MaxState:
  m = jnp.maximum(a.m, b.m)
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  ca, cb = jnp.exp(a.m - m_use), jnp.exp(b.m - m_use)
  return MaxState(a.acc * ca[..., None] + b.acc * cb[..., None], a.l * ca + b.l * cb, m)


def _safe_div(acc: Array, l: Array) -> Array:
  empty = l == 0
  return jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None])


def _ssmax_update(st: MaxState, z: Array, valid: Array, v: Array, c: Array) -> MaxState:
  y = _masked(c[..., None] * _masked(z, valid), valid, -jnp.inf)
  m_new = jnp.maximum(st.m, jnp.max(y, axis=-1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing valid yet: no shift
  p = jnp.exp(y - m_use[..., None])
  corr = jnp.exp(st.m - m_use)
  return MaxState(st.acc * corr[..., None] + pv(p, v), st.l * corr + jnp.sum(p, axis=-1), m_new)


def _ssmax_finalize(st: MaxState) -> tuple[Array, tuple[Array, ...]]:
  m = jnp.where(st.m == -jnp.inf, 0.0, st.m)
  empty = st.l == 0  # no valid key; a NaN l propagates
  lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, st.l)))
  return _safe_div(st.acc, st.l), (lse,)


# Below this |z| softpick's eᶻ − 1 is a Taylor polynomial: e^{z−m} − e^{−m} would lose up to
# log2(e^z/|e^z − 1|) bits to cancellation (3 bits at |z| = 1/8, all of them as z → 0).
_TAYLOR_Z = 0.125


def _scaled_expm1(z: Array, e_shifted: Array, e_neg_shift: Array) -> Array:
  """e^{−c}(eᶻ − 1) from e_shifted = e^{z−c} and e_neg_shift = e^{−c}, with one exponential per
  entry (the caller's e^{z−c}): e^{z−c} − e^{−c} where |z| ≥ 1/8 (≤ 3 bits of cancellation:
  relative error ≲ 1e-6), the degree-6 Taylor polynomial of eᶻ − 1 times e^{−c} below
  (truncation ≤ 1e-9 relative). Nothing overflows where e^{z−c} and e^{−c} are finite, where
  eᶻ − 1 alone overflows past z ≈ 88 (a second exponential for those rows)."""
  taylor = z * (1.0 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z * (1 / 720))))))
  return jnp.where(jnp.abs(z) < _TAYLOR_Z, taylor * e_neg_shift, e_shifted - e_neg_shift)


def _softpick_d(z: Array, valid: Array, m: Array) -> Array:
  """e^{−m}(eᶻ − 1) on valid keys (0 elsewhere), m ≥ max(0, z)."""
  zv = _masked(z, valid)
  mm = m[..., None]
  return jnp.where(valid, _scaled_expm1(zv, jnp.exp(zv - mm), jnp.exp(-mm)), 0.0)


def _pv_split(p: Array, v: Array) -> Array:
  """Σ_j p_ij v_j with p kept to ~2⁻¹⁶ when v is 16-bit: p = hi + lo, both in v's dtype.

  Softpick's backward takes δ_i = dO_i·O_i for Σ_j p_ij dP_ij and multiplies it by
  e^{z − lse} = e^z/(Σ|e^z − 1| + ε), up to ~1/|z| when every score is near 0: O made of p
  rounded to 16 bits (up to 2⁻⁸ relative in bfloat16) would put an error up to |dP|/(256·|z|)
  in dS, while dense autodiff forms Σ p·dP from the float32 weights. hi is p rounded to v's
  dtype, p − hi is exact in float32 and ≤ 2⁻⁸·p (bfloat16; float16: max(2⁻¹¹·p, 2⁻²⁵), its
  subnormals), so lo's own rounding leaves ≤ 2⁻¹⁶·p (float16: max(2⁻²²·p, 2⁻²⁵)): each product
  with a 16-bit v is exact, accumulated in float32. A 32- or 64-bit v: one matmul, as
  :func:`pv` (p is not rounded).
  """
  if jnp.dtype(v.dtype).itemsize >= 4:
    return pv(p, v)
  hi = p.astype(v.dtype)
  lo = (p - hi.astype(F32)).astype(v.dtype)
  return pv(hi, v) + pv(lo, v)


def _softpick_update(st: MaxState, z: Array, valid: Array, v: Array) -> MaxState:
  m_new = jnp.maximum(st.m, jnp.max(_masked(z, valid, -jnp.inf), axis=-1))  # m starts at 0
  d = _softpick_d(z, valid, m_new)
  corr = jnp.exp(st.m - m_new)
  return MaxState(st.acc * corr[..., None] + _pv_split(jax.nn.relu(d), v),
                  st.l * corr + jnp.sum(jnp.abs(d), axis=-1), m_new)


def _softpick_finalize(st: MaxState, eps: float) -> tuple[Array, tuple[Array, ...]]:
  denom = st.l + eps * jnp.exp(-st.m)
  empty = denom == 0
  lse = jnp.where(empty, jnp.inf, st.m + jnp.log(jnp.where(empty, 1.0, denom)))
  return _safe_div(st.acc, denom), (lse,)


# --------------------------------------------------------------------------------------------
# Stick-breaking: the log of the remaining stick.
# --------------------------------------------------------------------------------------------

class StickState(NamedTuple):
  acc: Array  # [rows, Hv] Σ A·v over the keys visited
  log_rest: Array  # [rows] L = Σ log(1 − β) over the keys visited (≤ 0)


def _reverse_exclusive_cumsum(x: Array, ops: Ops = XLA) -> Array:
  """y_j = Σ_{l > j} x_l along the last axis (shifting the inclusive sum: no cancellation)."""
  if ops.cumsum_matmul:  # x @ M, M_lj = 1 for l > j: a sum of the later terms, no cancellation
    n = x.shape[-1]
    later = (lax.broadcasted_iota(jnp.int32, (n, n), 0)
             > lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.bfloat16)
    # x = x₁ + x₂ + x₃ in bfloat16 (8 + 8 + 8 bits of float32's 24): three bf16 matmuls with
    # the exact 0/1 matrix and float32 accumulation run on tensor cores / the MXU, where a
    # float32 matmul at HIGHEST precision does not (Triton runs it without tensor cores).
    x = x.astype(F32)
    parts = []
    for _ in range(3):
      hi = x.astype(jnp.bfloat16)
      parts.append(hi)
      x = x - hi.astype(F32)
    dot = lambda p: jnp.dot(p, later, preferred_element_type=F32)
    return dot(parts[0]) + (dot(parts[1]) + dot(parts[2]))
  incl = lax.cumsum(x, axis=x.ndim - 1, reverse=True)
  return jnp.concatenate([incl[..., 1:], jnp.zeros_like(incl[..., :1])], axis=-1)


def _stick_weights(z: Array, valid: Array, log_rest: Array,
                   ops: Ops = XLA) -> tuple[Array, Array, Array]:
  """(A, b, β) of one tile: b = log(1 − β) (0 at masked keys), A the weights given the stick
  L left by the later tiles, β = σ(z)."""
  log_beta, b, beta = log_sigmoid_pair(_masked(z, valid))
  b = jnp.where(valid, b, 0.0)
  log_a = log_beta + _reverse_exclusive_cumsum(b, ops) + log_rest[..., None]
  return jnp.where(valid, jnp.exp(log_a), 0.0), b, beta


def _stick_update(st: StickState, z: Array, valid: Array, v: Array,
                  ops: Ops = XLA) -> StickState:
  a, b, _ = _stick_weights(z, valid, st.log_rest, ops)
  return StickState(st.acc + pv(a, v), st.log_rest + jnp.sum(b, axis=-1))


def _stick_merge(later: StickState, earlier: StickState) -> StickState:
  """Keys of ``later`` come after those of ``earlier``: they break the stick first."""
  rest = jnp.exp(later.log_rest)
  return StickState(later.acc + rest[..., None] * earlier.acc,
                    later.log_rest + earlier.log_rest)


# --------------------------------------------------------------------------------------------
# Sparsemax and α-entmax: a threshold found by passes, then an output pass.
# --------------------------------------------------------------------------------------------

class Threshold(NamedTuple):
  """Per-row constants of the entmax output pass: x' = (α−1)·scale·z − m, p = [x' − τ]₊^q."""
  m: Array  # the row max of (α−1)·scale·z over valid keys (0 for an empty row)
  tau: Array  # τ ∈ [−1, 0] in the shifted units
  passes: Array  # int32 scalar: passes over the key tiles that found τ (max pass included)


class EntmaxState(NamedTuple):
  acc: Array  # [rows, Hv] Σ p·v
  acc_u: Array  # [rows, Hv] Σ u·v, u = p^{2−α}
  p_sum: Array  # [rows] Σ p
  u_sum: Array  # [rows] Σ u


def _exponent(alpha: float) -> float:
  return 1.0 / (alpha - 1.0)


def _powers(r: Array, alpha: float) -> tuple[Array, Array]:
  """(p, u) = (r^q, r^{q−1}) for r ≥ 0, q = 1/(α−1) (u = p^{2−α} = dp/dy), 0 where r = 0
  (NaN where r is NaN: a NaN score makes its row NaN; but u = 1 there for α = 2)."""
  pos = ~(r <= 0)
  if alpha == 2.0:
    return r, pos.astype(r.dtype)
  if alpha == 1.5:
    return r * r, r
  q = _exponent(alpha)
  log_r = jnp.log(jnp.where(pos, r, 1.0))
  return (jnp.where(pos, jnp.exp(q * log_r), 0.0), jnp.where(pos, jnp.exp((q - 1.0) * log_r), 0.0))


def entmax_x(z: Array, valid: Array, rs: RowStream, m: Array | None = None) -> Array:
  """x = (α−1)·scale·z on valid keys (−∞ elsewhere), minus the row max m if given."""
  x = ((rs.alpha - 1.0) * rs.scale) * _masked(z, valid)
  if m is not None:
    x = x - m[..., None]
  return _masked(x, valid, -jnp.inf)


def entmax_tile_max(z: Array, valid: Array, rs: RowStream) -> Array:
  """[rows]: the max of x = (α−1)·scale·z over a tile's valid keys (−∞ where none; NaN
  propagates). A tile whose max m_t has (m_t − m) − τ ≤ 0 in every row (m the row max, τ the
  threshold) holds only zero weights: rounding is monotone, so every key's x − m − τ ≤ 0."""
  return jnp.max(entmax_x(z, valid, rs), axis=-1)


def entmax_zero_tiles(tile_max: Array, m: Array, tau: Array) -> Array:
  """Whether a key tile is all zero at threshold τ for every row of a block.

  ``tile_max`` holds :func:`entmax_tile_max` of each tile, [..., rows] with any leading tile
  axes; ``m`` and ``tau`` the [rows] row max and threshold; returns the leading axes (bool).
  The test is the tile math's own ``(x − m) − τ ≤ 0`` on the tile's largest x, so a zero tile
  adds exact zeros to every sum and gradient; a NaN row never passes it (its tiles are kept).
  """
  rows = tuple(range(tile_max.ndim - m.ndim, tile_max.ndim))
  return jnp.all((tile_max - m) - tau <= 0.0, axis=rows)


def entmax_zero_tile(z: Array, valid: Array, m: Array, tau: Array, rs: RowStream,
                     ops: Ops = XLA) -> Array:
  """Whether every weight of one score tile z [rows, keys] is zero at its rows' thresholds:
  :func:`entmax_zero_tiles` on the tile's own max (a scalar bool, for kernels that test a tile
  after computing its scores, having no table of tile maxima). NaN rows never pass."""
  gap = (entmax_tile_max(z, valid, rs) - m) - tau
  if ops.all_rows:
    return jnp.all(gap <= 0.0)
  return jnp.max(jnp.where(gap <= 0.0, 0.0, 1.0)) == 0.0  # no boolean reductions (Triton)


def entmax_threshold(tile_pass, rows: tuple[int, ...], rs: RowStream,
                     ops: Ops = XLA, *, row_max: tuple[Array, Array] | None = None,
                     sums_pass=None, dtype: Any = F32) -> Threshold:
  """τ of every row, from passes over its key tiles.

  ``tile_pass(fn, init)`` folds ``fn(carry, z, valid) -> carry`` over the row block's key
  tiles (any order) and returns the carry; each call is one pass over the keys.

  Two hooks let a kernel skip key tiles that are all zero (AdaSplash, Gonçalves et al. 2025):
  ``row_max`` is pass 1's result (m, n), the max of x = (α−1)·scale·z over each row's valid
  keys (−∞ if none) and their count, when the kernel made that pass itself (to record each
  tile's max with :func:`entmax_tile_max`); it still counts as a pass. ``sums_pass(fn, init,
  m, tau)`` folds like ``tile_pass`` for the passes at threshold ``tau`` (shifted by the row
  max ``m``) and may leave out the tiles where :func:`entmax_zero_tiles` holds: they add exact
  zeros to these sums.

  Pass 1 finds the row max m (and the count n of valid keys), which brackets τ in
  [−1, −n^{1−α}] after the shift. Each further pass evaluates f(τ) = Σ r^q − 1 (r = [x' − τ]₊)
  and its derivative; the step is Newton's (for α = 2 it is Michelot's fixed point, exact once
  the support is right), replaced by bisection whenever it would leave the bracket. For α ≤ 2
  f is convex and Newton's method started at the left end approaches τ from below, never
  overshooting; for α > 2 it is concave and we start at the right end. Rows stop when the
  step is below the resolution of ``dtype`` (the scores' dtype: float32, or float64 with
  :func:`max_threshold_passes` passes at most); sparsemax and 1.5-entmax then take one exact
  step on their support (the closed form of Peters et al. 2019).
  """
  alpha = rs.alpha
  q = _exponent(alpha)

  def max_fn(c, z, valid):
    m, n = c
    x = entmax_x(z, valid, rs)
    return jnp.maximum(m, jnp.max(x, axis=-1)), n + jnp.sum(valid, axis=-1, dtype=dtype)

  if row_max is None:
    m, n = tile_pass(max_fn, (jnp.full(rows, -jnp.inf, dtype), jnp.zeros(rows, dtype)))
  else:
    m, n = row_max
  empty = n == 0
  m = jnp.where(empty, 0.0, m)  # NaN stays NaN: the row's output is NaN
  lo = jnp.full(rows, -1.0, dtype)
  hi = -jnp.exp((1.0 - alpha) * jnp.log(jnp.maximum(n, 1.0)))  # −n^{1−α}: Σp ≤ 1 there
  tau0 = lo if alpha <= 2.0 else hi

  def sums_fn(tau):
    def fn(c, z, valid):
      r = jnp.maximum(entmax_x(z, valid, rs, m) - tau[..., None], 0.0)
      p, u = _powers(r, alpha)
      s1 = r if alpha == 1.5 else u  # Newton's f' / (−q): Σ r^{q−1}
      return (c[0] + jnp.sum(p, axis=-1), c[1] + jnp.sum(s1, axis=-1),
              c[2] + jnp.sum((r > 0).astype(dtype), axis=-1))
    zero = jnp.zeros(rows, dtype)
    if sums_pass is not None:
      return sums_pass(fn, (zero, zero, zero), m, tau)
    return tile_pass(fn, (zero, zero, zero))

  tol = float(jnp.finfo(dtype).eps)  # 2⁻²³ in float32
  max_passes = max_threshold_passes(dtype)

  # For α > 2 a key just inside the support (r → 0⁺) makes f' = −q·Σ r^{q−1} (q − 1 < 0) huge, so
  # Newton's steps shrink to nothing long before τ: there a step that is not at most half the
  # previous one bisects instead (the safeguard of Numerical Recipes' rtsafe). For α ≤ 2 f' is
  # bounded and Newton alone converges.
  stall_guard = alpha > 2.0

  def step(tau, lo, hi, sums, dx):
    f_plus1, d, cnt = sums
    f = f_plus1 - 1.0
    lo = jnp.where(f >= 0, tau, lo)
    hi = jnp.where(f <= 0, tau, hi)
    newton = tau + f / (q * jnp.where(d > 0, d, 1.0))
    ok = (d > 0) & (newton >= lo) & (newton <= hi)
    if stall_guard:  # (a step within tol ends the row: never bisect away from there)
      dn = jnp.abs(newton - tau)
      ok = ok & ((2.0 * dn <= dx) | (dn <= tol))
    new = jnp.where(ok, newton, 0.5 * (lo + hi))
    done = (jnp.abs(new - tau) <= tol) | (f == 0) | empty | jnp.isnan(f)
    return new, lo, hi, done, jnp.abs(new - tau)

  # `done` travels through the loop as 0./1. float32: Mosaic cannot carry a boolean vector
  # through a loop ("failed to legalize operation 'scf.yield'" compiling for a TPU).
  def cond(c):
    if ops.all_rows:
      return (c[0] < max_passes) & ~jnp.all(c[4] > 0)
    return (c[0] < max_passes) & (jnp.min(c[4]) == 0.0)

  def body(c):
    it, tau, lo, hi, _, _, dx = c
    sums = sums_fn(tau)
    new, lo, hi, done, step_size = step(tau, lo, hi, sums, dx[0] if dx else None)
    return (it + 1, jnp.where(done, tau, new), lo, hi, done.astype(dtype), sums,
            (step_size,) if stall_guard else ())

  zero = jnp.zeros(rows, dtype)
  init = (jnp.int32(1), tau0, lo, hi, zero, (zero, zero, zero),
          (hi - lo,) if stall_guard else ())
  if ops.threshold_loop == "while":
    it, tau, _, _, done, sums, _ = lax.while_loop(cond, body, init)
  else:
    it, tau, _, _, done, sums, _ = lax.fori_loop(
        1, max_passes, lambda _, c: lax.cond(cond(c), body, lambda c: c, c), init)
  if alpha in (1.5, 2.0):
    # One exact step on the support: the closed form given which keys have p > 0, from the
    # sums of the last pass, taken at the final τ of every row that converged (no extra pass).
    f_plus1, d, cnt = sums
    cnt = jnp.where(cnt > 0, cnt, 1.0)
    if alpha == 2.0:
      delta = (f_plus1 - 1.0) / cnt  # Σ_S (r − δ) = 1 (p = r)
    else:  # Σ_S (r − δ)² = 1, the smaller root, written without cancellation
      s1 = d
      disc = jnp.maximum(s1 * s1 - cnt * (f_plus1 - 1.0), 0.0)
      delta = (f_plus1 - 1.0) / jnp.where(s1 + jnp.sqrt(disc) > 0, s1 + jnp.sqrt(disc), 1.0)
    tau = jnp.where(empty | (done == 0), tau, tau + delta)
  return Threshold(m, tau, it)


def _entmax_update(st: EntmaxState, z: Array, valid: Array, v: Array, th: Threshold,
                   rs: RowStream, ops: Ops = XLA) -> EntmaxState:
  r = jnp.maximum(entmax_x(z, valid, rs, th.m) - th.tau[..., None], 0.0)
  p, u = _powers(r, rs.alpha)
  if not ops.concat_pv:
    return EntmaxState(st.acc + pv(p, v), st.acc_u + pv(u, v), st.p_sum + jnp.sum(p, axis=-1),
                       st.u_sum + jnp.sum(u, axis=-1))
  rows = p.shape[-2]
  both = pv(jnp.concatenate([p, u], axis=-2), v)  # one matmul for Σp·v and Σu·v
  return EntmaxState(st.acc + both[..., :rows, :], st.acc_u + both[..., rows:, :],
                     st.p_sum + jnp.sum(p, axis=-1), st.u_sum + jnp.sum(u, axis=-1))


def _entmax_finalize(st: EntmaxState, th: Threshold,
                     rs: RowStream) -> tuple[Array, tuple[Array, ...], Array]:
  o = _safe_div(st.acc, st.p_sum) if rs.renormalize else st.acc
  support_mean = _safe_div(st.acc_u, st.u_sum)
  norm = st.p_sum if rs.renormalize else jnp.ones_like(st.p_sum)
  return o, (th.m, th.tau, norm), support_mean


# --------------------------------------------------------------------------------------------
# The family interface the kernels call.
# --------------------------------------------------------------------------------------------

def init(rs: RowStream, rows: tuple[int, ...], hv: int, dtype: Any = F32) -> Any:
  """The state of rows that have seen no key, in ``dtype`` (the kernel's compute dtype)."""
  if rs.family == "ssmax":
    return _max_init(rows, hv, -jnp.inf, dtype)
  if rs.family == "softpick":
    return _max_init(rows, hv, 0.0, dtype)  # m ≥ 0 keeps e^{−m} ≤ 1
  if rs.family == "stick_breaking":
    return StickState(jnp.zeros(rows + (hv,), dtype), jnp.zeros(rows, dtype))
  zero = jnp.zeros(rows, dtype)
  return EntmaxState(jnp.zeros(rows + (hv,), dtype), jnp.zeros(rows + (hv,), dtype), zero, zero)


def update(rs: RowStream, state: Any, z: Array, valid: Array, v: Array, ctx: Any,
           ops: Ops = XLA) -> Any:
  """The state after one more key tile (see the module docstring)."""
  if rs.family == "ssmax":
    return _ssmax_update(state, z, valid, v, ctx)
  if rs.family == "softpick":
    return _softpick_update(state, z, valid, v)
  if rs.family == "stick_breaking":
    return _stick_update(state, z, valid, v, ops)
  return _entmax_update(state, z, valid, v, ctx, rs, ops)


def merge(rs: RowStream, a: Any, b: Any) -> Any:
  """The state of the union of two disjoint key ranges (``a`` the later keys if reverse)."""
  if rs.family in ("ssmax", "softpick"):
    return _max_merge(a, b)
  if rs.family == "stick_breaking":
    return _stick_merge(a, b)
  return EntmaxState(*(x + y for x, y in zip(a, b, strict=True)))


def finalize(rs: RowStream, state: Any, ctx: Any) -> tuple[Array, tuple[Array, ...], Array | None]:
  """(output rows [rows, Hv], row statistics, Σu·v/Σu or None) of a finished state."""
  if rs.family == "ssmax":
    return (*_ssmax_finalize(state), None)
  if rs.family == "softpick":
    return (*_softpick_finalize(state, rs.eps), None)
  if rs.family == "stick_breaking":
    return state.acc, (state.log_rest,), None
  return _entmax_finalize(state, ctx, rs)


class GradCarry(NamedTuple):
  """Per-row sums the backward carries across key tiles (zeros where a family has none)."""
  a: Array  # stick-breaking: L of the keys visited; SSMax: dc = Σ z·dy
  b: Array  # stick-breaking: Σ A·dP over the keys visited


def tile_grad(rs: RowStream, z: Array, valid: Array, dp: Array, stats: tuple[Array, ...],
              delta: Array, carry: GradCarry, ctx: Any, ops: Ops = XLA,
              weights_dtype: Any = None) -> tuple[Array, Array, GradCarry]:
  """The backward of one tile: (weights p, dz = ∂loss/∂z, carry).

  ``dp`` = dO·vᵀ on the tile; ``stats`` the row statistics of :func:`finalize`; ``delta`` the
  per-row δ_i: dO_i·O_i, or dO_i·(Σu·v/Σu)_i for entmax; ``ctx`` as in :func:`update`;
  ``weights_dtype`` the dtype the forward rounded the weights to before its P·V matmul (v's).
  """
  row = lambda a: a[..., None]
  if rs.family == "ssmax":
    (lse,) = stats
    zv = _masked(z, valid)
    y = _masked(row(ctx) * zv, valid, -jnp.inf)
    p = _masked(jnp.exp(y - row(lse)), valid)  # e^(−∞ − lse) is NaN where lse is
    dy = jnp.where(valid, p * (dp - row(delta)), 0.0)
    return p, row(ctx) * dy, GradCarry(carry.a + jnp.sum(zv * dy, axis=-1), carry.b)
  if rs.family == "softpick":
    (lse,) = stats
    zv = _masked(z, valid)
    e = jnp.where(valid, jnp.exp(zv - row(lse)), 0.0)
    # lse ≥ log ε (m ≥ 0 and the denominator ≥ ε·e^{−m}): e^{−lse} ≤ 1/ε, no overflow.
    p = jnp.where(valid, jax.nn.relu(_scaled_expm1(zv, e, jnp.exp(-row(lse)))), 0.0)
    sign = (jnp.sign(zv) if ops.sign
            else jnp.where(zv > 0, 1.0, jnp.where(zv < 0, -1.0, zv)))  # zv: ±0 and NaN
    dz = e * (jnp.where(zv > 0, dp, 0.0) - sign * row(delta))
    return p, jnp.where(valid, dz, 0.0), carry
  if rs.family == "stick_breaking":
    a, b, beta = _stick_weights(z, valid, carry.a, ops)
    # δ = dO·O sums the weights as the forward's P·V saw them (rounded to v's dtype): round
    # them the same way here, or δ − Σ_{j > k} a_j cancels to the rounding error of 16-bit
    # weights (Tan et al.'s and flash-linear-attention's kernels take c_i = ⟨dO, O⟩ likewise).
    a_seen = (a if weights_dtype is None or jnp.dtype(weights_dtype).itemsize >= 4
              else a.astype(weights_dtype).astype(a.dtype))
    ad = a_seen * dp
    # dz_k = a_k − σ(z_k)·Σ_{j ≤ k} a_j, and Σ_{j ≤ k} a_j = δ − Σ_{j > k} a_j (δ = dO·O).
    later = _reverse_exclusive_cumsum(ad, ops) + row(carry.b)
    dz = ad - beta * (row(delta) - later)
    return a, jnp.where(valid, dz, 0.0), GradCarry(carry.a + jnp.sum(b, axis=-1),
                                                   carry.b + jnp.sum(ad, axis=-1))
  m, tau, norm = stats
  # Masked keys' x is −∞, which a NaN row's m or τ turns into NaN: r = 0 there.
  r = _masked(jnp.maximum(entmax_x(z, valid, rs, m) - row(tau), 0.0), valid)
  p, u = _powers(r, rs.alpha)
  if rs.alpha == 2.0:  # u is 1 at NaN r; NaN makes a NaN row's dz NaN, as for the other α
    u = jnp.where(jnp.isnan(r), r, u)
  if rs.renormalize:  # p̂ = p/Σp and u = p̂^{2−α}
    inv = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
    p = p * row(inv)
    u = u * row(jnp.exp((2.0 - rs.alpha) * jnp.log(jnp.where(norm > 0, inv, 1.0))))
  dz = rs.scale * u * (dp - row(delta))
  return p, jnp.where(valid, dz, 0.0), carry


def row_scale(rs: RowStream, n_valid: Array, s: Array | float | None = None,
              dtype: Any = F32) -> Array:
  """SSMax's c_i = s·log max(n_i, 1) from the count of valid keys per row, in ``dtype``."""
  s = rs.s if s is None else s
  return jnp.asarray(s, dtype) * jnp.log(jnp.maximum(n_valid.astype(dtype), 1.0))


__all__ = ["FAMILIES", "MAX_THRESHOLD_PASSES", "MAX_THRESHOLD_PASSES_F64", "XLA", "EntmaxState",
           "GradCarry", "MaxState", "Ops", "RowStream", "StickState", "Threshold",
           "entmax_threshold", "entmax_tile_max", "entmax_x", "entmax_zero_tile",
           "entmax_zero_tiles", "finalize", "init", "max_threshold_passes", "merge",
           "online_max_start", "online_max_update", "pointwise_finalize", "pointwise_grad_rows",
           "pointwise_merge", "pointwise_tile_grad", "pointwise_update", "pv", "row_scale",
           "tile_grad", "update"]
