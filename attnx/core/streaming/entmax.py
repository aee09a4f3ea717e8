"""α-entmax, sparsemax (α = 2) and 1.5-entmax (Martins & Astudillo 2016; Peters, Niculae &
Martins 2019): p = [x − τ]₊^{1/(α−1)} with x = (α−1)·scale·z shifted by the row max. The
threshold τ_i of every row (``ctx``) depends on the whole row: :func:`entmax_threshold` finds it
by passes of Newton's method safeguarded by bisection over the key tiles (Gonçalves et al. 2025,
"AdaSplash"), before one output pass that also accumulates Σu·v/Σu, u = p^{2−α}, the statistic
of the backward. Key tiles whose weights are all zero can be left out of the later passes and
of the backward (:func:`entmax_zero_tiles`, :func:`entmax_zero_tile`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attnx.core.streaming.family import Family, GradCarry
from attnx.core.streaming.ops import F32, XLA, Array, Ops, masked, safe_div

if TYPE_CHECKING:
  from attnx.core.streaming.rowstream import RowStream

# Newton/bisection passes for the threshold: bisection alone reaches float32 resolution of
# τ ∈ [−1, 0] in 25, and Newton's method needs ~4–8 where it applies.
MAX_THRESHOLD_PASSES = 40
# Float64 scores (jax_enable_x64): bisection needs 29 more halvings for its 52-bit resolution.
MAX_THRESHOLD_PASSES_F64 = MAX_THRESHOLD_PASSES + 30


def max_threshold_passes(dtype: Any = F32) -> int:
  """The most passes :func:`entmax_threshold` makes for scores of ``dtype``."""
  return MAX_THRESHOLD_PASSES_F64 if jnp.dtype(dtype).itemsize > 4 else MAX_THRESHOLD_PASSES


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


def entmax_powers(r: Array, alpha: float) -> tuple[Array, Array]:
  """(p, u) = (r^q, r^{q−1}), q = 1/(α−1), of the shifted scores r = [x − τ]₊ ≥ 0: the weights
  at a threshold and Newton's slope terms; safe to differentiate at r = 0."""
  return _powers(r, alpha)


def entmax_x(z: Array, valid: Array, rs: RowStream, m: Array | None = None) -> Array:
  """x = (α−1)·scale·z on valid keys (−∞ elsewhere), minus the row max m if given."""
  x = ((rs.alpha - 1.0) * rs.scale) * masked(z, valid)
  if m is not None:
    x = x - m[..., None]
  return masked(x, valid, -jnp.inf)


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


def threshold_sums_fold(rs: RowStream, m: Array, tau: Array, dtype: Any = F32):
  """``fn(carry, z, valid) -> carry``: adds a tile's sums at threshold ``tau`` (shifted by the
  row max ``m``) to the carry (Σp, Σ r^{q−1}, the support's size): what each pass of
  :func:`entmax_threshold` folds over the key tiles (its Newton step reads them). A carry of
  four also keeps the smallest r > 0 (+∞ for an empty support; its initial value +∞): with it
  sparsemax and 1.5-entmax see when the support is final (:func:`entmax_threshold`)."""
  alpha = rs.alpha

  def fn(c, z, valid):
    r = jnp.maximum(entmax_x(z, valid, rs, m) - tau[..., None], 0.0)
    p, u = _powers(r, alpha)
    s1 = r if alpha == 1.5 else u  # Newton's f' / (−q): Σ r^{q−1}
    out = (c[0] + jnp.sum(p, axis=-1), c[1] + jnp.sum(s1, axis=-1),
           c[2] + jnp.sum((r > 0).astype(dtype), axis=-1))
    if len(c) == 3:
      return out
    return out + (jnp.minimum(c[3], jnp.min(jnp.where(r > 0, r, jnp.inf), axis=-1)),)

  return fn


def _support_root(sums, alpha: float) -> Array:
  """δ with Σ_S [r − δ]^q = 1 on the support S of the pass's sums (r > 0 there; sparsemax and
  1.5-entmax only): the closed form of Peters et al. 2019 given which keys have p > 0."""
  f_plus1, d, cnt = sums[:3]
  cnt = jnp.where(cnt > 0, cnt, 1.0)
  if alpha == 2.0:
    return (f_plus1 - 1.0) / cnt  # Σ_S (r − δ) = 1 (p = r)
  # Σ_S (r − δ)² = 1, the smaller root, written without cancellation
  disc = jnp.maximum(d * d - cnt * (f_plus1 - 1.0), 0.0)
  return (f_plus1 - 1.0) / jnp.where(d + jnp.sqrt(disc) > 0, d + jnp.sqrt(disc), 1.0)


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

  # Sparsemax and 1.5-entmax stop as soon as the support is final: the exact root δ on the
  # pass's support S keeps every key of S in it (its smallest r exceeds δ) and, Newton's τ
  # rising from below, no key outside S (r = 0 there) joins it, so τ + δ is the threshold.
  # A pass that does not give the smallest r (a solve summing chunks: ThresholdSums) stops
  # by the step size alone.
  closed_form = alpha in (1.5, 2.0) and ops.support_stop  # (ops: Triton's row forward, no)

  def sums_fn(tau):
    fn = threshold_sums_fold(rs, m, tau, dtype)
    zero = jnp.zeros(rows, dtype)
    init = (zero, zero, zero) + ((jnp.full(rows, jnp.inf, dtype),) if closed_form else ())
    if sums_pass is not None:
      return sums_pass(fn, init, m, tau)
    return tile_pass(fn, init)

  tol = float(jnp.finfo(dtype).eps)  # 2⁻²³ in float32
  max_passes = max_threshold_passes(dtype)

  # For α > 2 a key just inside the support (r → 0⁺) makes f' = −q·Σ r^{q−1} (q − 1 < 0) huge, so
  # Newton's steps shrink to nothing long before τ: there a step that is not at most half the
  # previous one bisects instead (the safeguard of Numerical Recipes' rtsafe). For α ≤ 2 f' is
  # bounded and Newton alone converges.
  stall_guard = alpha > 2.0

  def step(tau, lo, hi, sums, dx):
    f_plus1, d = sums[:2]
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
    if closed_form:  # (every pass then gives the smallest r: sums of four)
      delta = _support_root(sums, alpha)
      exact = (sums[3] > delta) & (delta >= 0) & ~done
      new, done = jnp.where(exact, tau + delta, new), done | exact
    else:
      exact = None
    return new, lo, hi, done, jnp.abs(new - tau), exact

  # `done` travels through the loop as 0./1. float32: Mosaic cannot carry a boolean vector
  # through a loop ("failed to legalize operation 'scf.yield'" compiling for a TPU).
  def cond(c):
    if ops.all_rows:
      return (c[0] < max_passes) & ~jnp.all(c[4] > 0)
    return (c[0] < max_passes) & (jnp.min(c[4]) == 0.0)

  def body(c):
    if not closed_form:
      it, tau, lo, hi, _, _, dx = c
      sums = sums_fn(tau)
      new, lo, hi, done, step_size, _ = step(tau, lo, hi, sums, dx[0] if dx else None)
      return (it + 1, jnp.where(done, tau, new), lo, hi, done.astype(dtype), sums,
              (step_size,) if stall_guard else ())
    it, tau, lo, hi, _, sums0, dx, exact0 = c
    exact0 = exact0 > 0  # carried as 0./1. like `done`
    sums = sums_fn(tau)
    new, lo, hi, done, step_size, exact = step(tau, lo, hi, sums, dx[0] if dx else None)
    tau = jnp.where(exact0, tau, jnp.where(done & ~exact, tau, new))
    # A row that found its support keeps τ and the sums of that pass (others may run on).
    sums = jax.tree.map(lambda a, b: jnp.where(exact0, a, b), sums0, sums)
    return (it + 1, tau, lo, hi, (done | exact0).astype(dtype), sums,
            (step_size,) if stall_guard else (), (exact0 | exact).astype(dtype))

  zero = jnp.zeros(rows, dtype)
  sums0 = (zero, zero, zero) + ((jnp.full(rows, jnp.inf, dtype),) if closed_form else ())
  init = (jnp.int32(1), tau0, lo, hi, zero, sums0, (hi - lo,) if stall_guard else ())
  if closed_form:
    init += (zero,)  # 1. where the support was final (carried as 0./1.)
  if ops.threshold_loop == "while":
    out = lax.while_loop(cond, body, init)
  else:
    out = lax.fori_loop(1, max_passes, lambda _, c: lax.cond(cond(c), body, lambda c: c, c),
                        init)
  it, tau, done, sums = out[0], out[1], out[4], out[5]
  if alpha in (1.5, 2.0):
    # One exact step on the support for the rows that stopped by the step size: the closed
    # form given which keys have p > 0, from the sums of their last pass (no extra pass).
    delta = _support_root(sums, alpha)
    keep = empty | (done == 0)
    if closed_form:  # (those that stopped on their support hold their exact τ already)
      keep = keep | (out[7] > 0)
    tau = jnp.where(keep, tau, tau + delta)
  return Threshold(m, tau, it)


def init(rs: RowStream, rows: tuple[int, ...], hv: int, dtype: Any = F32) -> EntmaxState:
  zero = jnp.zeros(rows, dtype)
  return EntmaxState(jnp.zeros(rows + (hv,), dtype), jnp.zeros(rows + (hv,), dtype), zero, zero)


def update(rs: RowStream, st: EntmaxState, z: Array, valid: Array, v: Array, th: Threshold,
           ops: Ops = XLA) -> EntmaxState:
  r = jnp.maximum(entmax_x(z, valid, rs, th.m) - th.tau[..., None], 0.0)
  p, u = _powers(r, rs.alpha)
  if not ops.concat_pv:
    return EntmaxState(st.acc + ops.pv(p, v), st.acc_u + ops.pv(u, v),
                       st.p_sum + jnp.sum(p, axis=-1), st.u_sum + jnp.sum(u, axis=-1))
  rows = p.shape[-2]
  both = ops.pv(jnp.concatenate([p, u], axis=-2), v)  # one matmul for Σp·v and Σu·v
  return EntmaxState(st.acc + both[..., :rows, :], st.acc_u + both[..., rows:, :],
                     st.p_sum + jnp.sum(p, axis=-1), st.u_sum + jnp.sum(u, axis=-1))


def merge(rs: RowStream, a: EntmaxState, b: EntmaxState) -> EntmaxState:
  return EntmaxState(*(x + y for x, y in zip(a, b, strict=True)))


def finalize(rs: RowStream, st: EntmaxState,
             th: Threshold) -> tuple[Array, tuple[Array, ...], Array]:
  o = safe_div(st.acc, st.p_sum) if rs.renormalize else st.acc
  support_mean = safe_div(st.acc_u, st.u_sum)
  norm = st.p_sum if rs.renormalize else jnp.ones_like(st.p_sum)
  return o, (th.m, th.tau, norm), support_mean


def tile_grad(rs: RowStream, z: Array, valid: Array, dp: Array, stats: tuple[Array, ...],
              delta: Array, carry: GradCarry, ctx: Any, ops: Ops = XLA,
              weights_dtype: Any = None) -> tuple[Array, Array, GradCarry]:
  row = lambda a: a[..., None]
  m, tau, norm = stats
  # Masked keys' x is −∞, which a NaN row's m or τ turns into NaN: r = 0 there.
  r = masked(jnp.maximum(entmax_x(z, valid, rs, m) - row(tau), 0.0), valid)
  p, u = _powers(r, rs.alpha)
  if rs.alpha == 2.0:  # u is 1 at NaN r; NaN makes a NaN row's dz NaN, as for the other α
    u = jnp.where(jnp.isnan(r), r, u)
  if rs.renormalize:  # p̂ = p/Σp and u = p̂^{2−α}
    inv = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
    p = p * row(inv)
    u = u * row(jnp.exp((2.0 - rs.alpha) * jnp.log(jnp.where(norm > 0, inv, 1.0))))
  dz = rs.scale * u * (dp - row(delta))
  return p, jnp.where(valid, dz, 0.0), carry


FAMILY = Family("entmax", init, update, merge, finalize, tile_grad, num_stats=3,
                needs_threshold=True, saves_support_mean=True)

__all__ = ["FAMILY", "MAX_THRESHOLD_PASSES", "MAX_THRESHOLD_PASSES_F64", "EntmaxState",
           "Threshold", "entmax_powers", "entmax_threshold", "entmax_tile_max", "entmax_x",
           "entmax_zero_tile",
           "entmax_zero_tiles", "finalize", "init", "max_threshold_passes", "merge",
           "threshold_sums_fold", "tile_grad", "update"]
