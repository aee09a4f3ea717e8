"""A float64 brute-force attention, the reference of the differential net.

It forms the whole [B, N, T, S] score matrix in float64 from its own formulas for every score
(Vaswani et al. for scaled_dot; Luong et al. for bilinear; Ruan & Zhang for metric; Bahdanau
et al. for additive), applies F — the registry's pointwise definition F(z, S) evaluated in
float64, or an implementation written here for the whole-row weightings — and normalizes by
the rule of the weighting. Gradients are jax.vjp of that program in float64: they share no
code with the kernels' custom VJPs.

With ``kink_rel`` it also finds the score entries where a float32 kernel may sit on the other
side of a kink of F than the float64 reference (relu at 0, the edge of a distance kernel's
support, ...): there F' (or F itself) jumps, so kernels legitimately disagree with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx import core
from attnx.core import weightings as wlib

f64 = jnp.float64


@dataclasses.dataclass
class Reference:
  """Float64 outputs and gradients, and the scores and validity they came from."""
  out: np.ndarray  # [B, T, N, Hv]
  grads: dict[str, np.ndarray]  # q, k, v and (if a bias was given) bias
  scores: np.ndarray  # [B, N, T, S], scale and bias applied
  valid: np.ndarray  # [B, N, T, S] bool
  bounds: dict[str, np.ndarray]  # per result, Σ |terms| of the sums behind it (same shapes;
  # bias: [B, N, T, S])
  kink_slope: np.ndarray | None = None  # [B, N, T, S]: F' jumps near the score (see _kinks)
  kink_jump: np.ndarray | None = None  # [B, N, T, S]: F itself jumps near the score


# --------------------------------------------------------------------------------------------
# Scores, written from their definitions.
# --------------------------------------------------------------------------------------------

def _proj(x, w):
  return jnp.einsum("btnh,hr->btnr", x, w) if w.ndim == 2 else jnp.einsum("btnh,nhr->btnr", x, w)


def _sq_dist(q, k):
  d = q[:, :, None, :, :] - k[:, None, :, :, :]  # [B, T, S, N, H]
  return jnp.einsum("btsnh->bnts", d * d)


def scores64(q, k, score: str, params: dict[str, Any]):
  """[B, N, T, S] float64 scores (no scale) of [B, T, N, H] q and k (k already per head)."""
  if score in ("dot", "scaled_dot"):
    return jnp.einsum("btnh,bsnh->bnts", q, k)
  if score == "cosine":
    unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
    return jnp.einsum("btnh,bsnh->bnts", unit(q), unit(k)) / params.get("temperature", 1.0)
  if score == "bilinear":
    return jnp.einsum("btnr,bsnr->bnts", _proj(q, params["W"]), k)
  if score == "neg_sq_dist":
    return -_sq_dist(q, k)
  if score == "metric":
    return -_sq_dist(_proj(q, params["L"]), _proj(k, params["L"]))
  if score == "additive":
    qa, ka = _proj(q, params["Wq"]), _proj(k, params["Wk"])
    h = jnp.tanh(qa[:, :, None] + ka[:, None])  # [B, T, S, N, A]
    return jnp.einsum("btsna,a->bnts", h, params["v"])
  raise ValueError(f"no reference for score {score!r}")


# --------------------------------------------------------------------------------------------
# Whole-row weightings, written from their papers' formulas.
# --------------------------------------------------------------------------------------------

def _entmax_tau(z, valid, alpha):
  """τ of α-entmax on rows of z' = (α−1)z by bisection (float64, 200 halvings)."""
  zm = jnp.where(valid, z, -jnp.inf)
  n = jnp.maximum(jnp.sum(valid, -1, keepdims=True), 1)
  top = jnp.max(jnp.where(valid, z, -1e300), -1, keepdims=True, initial=-1e300)

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    mass = jnp.sum(jnp.maximum(zm - mid, 0.0) ** (1.0 / (alpha - 1.0)), -1, keepdims=True)
    return jnp.where(mass >= 1.0, mid, lo), jnp.where(mass >= 1.0, hi, mid)

  lo, hi = jax.lax.fori_loop(0, 200, halve, (top - 1.0, top - (1.0 / n) ** (alpha - 1.0)))
  return (lo + hi) / 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _entmax(z, valid, alpha):
  zs = (alpha - 1.0) * z
  tau = _entmax_tau(zs, valid, alpha)
  p = jnp.where(valid, jnp.maximum(zs - tau, 0.0), 0.0) ** (1.0 / (alpha - 1.0))
  s = jnp.sum(p, -1, keepdims=True)
  return p / jnp.where(s > 0, s, 1.0)


def _entmax_fwd(z, valid, alpha):
  p = _entmax(z, valid, alpha)
  return p, (p, valid)


def _entmax_bwd(alpha, res, g):
  # Peters et al. 2019: with u = p^(2−α) on the support, J = diag(u) − u uᵀ / Σu.
  p, valid = res
  u = jnp.where(p > 0, p ** (2.0 - alpha), 0.0)
  su = jnp.sum(u, -1, keepdims=True)
  dz = u * g - u * jnp.sum(u * g, -1, keepdims=True) / jnp.where(su > 0, su, 1.0)
  return dz, None


_entmax.defvjp(_entmax_fwd, _entmax_bwd)


def _softmax_rows(a, valid):
  m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, a, -jnp.inf), -1, keepdims=True,
                                    initial=-jnp.inf))
  e = jnp.where(valid, jnp.exp(jnp.where(valid, a - jnp.where(jnp.isfinite(m), m, 0.0), 0.0)),
                0.0)
  s = jnp.sum(e, -1, keepdims=True)
  return e / jnp.where(s > 0, s, 1.0)


def row_weights64(z, valid, name: str, params: dict[str, Any]):
  """Weights of a whole-row weighting on float64 scores z (masked entries: weight 0)."""
  z = jnp.where(valid, z, 0.0)
  if name in ("sparsemax", "entmax15", "entmax"):
    alpha = {"sparsemax": 2.0, "entmax15": 1.5}.get(name, float(params.get("alpha", 1.5)))
    return _entmax(float(params.get("scale", 1.0)) * z, valid, alpha)
  if name == "ssmax":  # Nakanishi 2025: softmax((s · log n) · z), n valid keys
    n = jnp.maximum(jnp.sum(valid, -1, keepdims=True), 1)
    return _softmax_rows(float(params.get("s", 1.0)) * jnp.log(n) * z, valid)
  if name == "softpick":  # Zuhri et al. 2025: relu(e^z − 1) / (Σ|e^z − 1| + ε)
    d = jnp.where(valid, jnp.expm1(z), 0.0)
    return jax.nn.relu(d) / (jnp.sum(jnp.abs(d), -1, keepdims=True)
                             + float(params.get("eps", 1e-6)))
  if name == "stick_breaking":  # Tan et al. 2024: σ(z_j) Π_{k>j}(1 − σ(z_k)), valid k only
    rest = jnp.where(valid, jax.nn.log_sigmoid(-z), 0.0)
    after = jnp.flip(jnp.cumsum(jnp.flip(rest, -1), -1), -1) - rest
    return jnp.where(valid, jnp.exp(jax.nn.log_sigmoid(z) + after), 0.0)
  raise ValueError(f"no reference for weighting {name!r}")


def pointwise_weights64(z, valid, w: wlib.Pointwise, num_keys: int, row_keys=None,
                        key_counts: tuple[int, ...] = ()):
  """F(z)/N of a pointwise weighting in float64, masked entries 0, empty rows 0. ``row_keys``
  ([B, T], with its distinct values ``key_counts``): the keys of each query's sequence, F's n
  where F counts them (``w.sequence_shift``), else S."""
  zv = jnp.where(valid, z, 0.0)
  if w.exp_alpha is not None and w.online_max:  # exp(αz) overflows float64: a shifted ratio
    # The row's max (and 0, the offset's virtual key, where there is one): a shift of 0 for
    # rows whose scores are all far below 0 (ALiBi at long distances) would square their
    # e^{αz} to 0 in the gradient (0/0).
    first = 0.0 if w.denominator_offset else -jnp.inf
    m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, w.exp_alpha * zv, -jnp.inf), -1,
                                      keepdims=True, initial=first))
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row without a valid key
    f = jnp.where(valid, jnp.exp(w.exp_alpha * zv - m), 0.0)
    den = jnp.sum(f, -1, keepdims=True) + w.denominator_offset * jnp.exp(-m)
    return f / jnp.where(den > 0, den, 1.0)
  if row_keys is not None and w.sequence_shift is not None:  # F(z, n) with each row's own n
    n_rows = row_keys[:, None, :, None]
    f = sum(jnp.where(n_rows == n, w.fn(zv, n), 0.0) for n in key_counts)
    f = jnp.where(valid, f, 0.0)
  else:
    f = jnp.where(valid, w.fn(zv, num_keys), 0.0)
  if w.normalization == "none":
    return f
  if w.normalization == "length":
    den = jnp.sum(valid, -1, keepdims=True).astype(f64)
    return f / jnp.where(den != 0, den, 1.0)
  # "sum": f/Σf with f and the offset scaled by the row's largest f first (exact in value),
  # so that the gradient's f/den² does not underflow to 0/0 where every f of a row is tiny
  # (sigmoid far below its bias: ALiBi at long distances).
  top = jax.lax.stop_gradient(jnp.max(f, -1, keepdims=True))
  top = jnp.where(top > 0, top, 1.0)
  f = f / top
  den = jnp.sum(f, -1, keepdims=True) + w.denominator_offset / top
  return f / jnp.where(den != 0, den, 1.0)


# --------------------------------------------------------------------------------------------
# The whole attention.
# --------------------------------------------------------------------------------------------

def sequence_keys64(mask: Any, b: int, t: int, s: int) -> np.ndarray | None:
  """The keys of each query's sequence, [B, T], of an (unbound) structured mask with batch
  dims (B,), counted pair by pair in numpy: a document's keys with the query's id (0 for
  padding), a padded row's key length (0 past its query length); ``&`` the smaller, ``|``
  the larger of two; None for a mask that does not split rows."""
  masks = core.masks
  if isinstance(mask, masks.SegmentIds):
    qi = np.broadcast_to(np.asarray(mask.q_ids), (b, t))
    ki = np.broadcast_to(np.asarray(mask.kv_ids), (b, s))
    return np.where(qi >= 0, (qi[:, :, None] == ki[:, None, :]).sum(-1), 0)
  if isinstance(mask, masks.SeqLengths):
    if mask.q_lengths is None and mask.kv_lengths is None:
      return None
    kv = np.full(b, s) if mask.kv_lengths is None else np.broadcast_to(mask.kv_lengths, (b,))
    lq = np.full(b, t) if mask.q_lengths is None else np.broadcast_to(mask.q_lengths, (b,))
    return np.where(np.arange(t)[None, :] < lq[:, None], kv[:, None], 0)
  if isinstance(mask, (masks.And, masks.Or)):
    na, nb = sequence_keys64(mask.a, b, t, s), sequence_keys64(mask.b, b, t, s)
    if na is None or nb is None:
      return nb if na is None else na
    return (np.minimum if isinstance(mask, masks.And) else np.maximum)(na, nb)
  return None


def valid_mask(b, n, t, s, mask, is_causal) -> np.ndarray:
  valid = np.ones((b, n, t, s), bool)
  if mask is not None:
    valid &= np.broadcast_to(np.asarray(mask, bool).reshape((1,) * (4 - np.ndim(mask))
                                                            + np.shape(mask)), valid.shape)
  if is_causal:
    valid &= np.tril(np.ones((t, s), bool))
  return valid


SCORE_MODS = ("none", "cap", "alibi", "table", "fn")


def score_mod64(kind: str, z, bias, mod_params, cap: float | None, causal: bool,
                absolute: bool = False):
  """The score modifications of the net written from their definitions, on float64 raw
  scores z = scale·s(q, k) [B, N, T, S]: the soft cap c·tanh(z/c) (Gemma 2), then the bias,
  then ``kind``'s: ALiBi's −m_h·(i − j) (Press et al.; −m_h·|i − j| when not causal), a
  relative-position table's table[h, clip(i − j) + L//2], or "fn" (the net's own score_mod
  function: both, plus 0.1·b). ``absolute``: the bound of the parameters' gradients (the
  same linear map with |coefficients|)."""
  if cap is not None:
    z = cap * jnp.tanh(z / cap)
  z = z + bias
  b, n, t, s_len = z.shape
  i = jnp.arange(t)[:, None]
  j = jnp.arange(s_len)[None, :]
  dist = (jnp.abs(i - j) if (absolute or not causal) and kind == "alibi" else i - j).astype(f64)
  if absolute:
    dist = jnp.abs(dist)
  sign = 1.0 if absolute else -1.0
  if kind in ("alibi", "fn"):
    z = z + sign * mod_params["slopes"][None, :, None, None] * dist
  if kind in ("table", "fn"):
    half = mod_params["table"].shape[-1] // 2
    z = z + mod_params["table"][:, jnp.clip(i - j, -half, half) + half][None]
  if kind == "fn":
    z = z + 0.1 * jnp.arange(b, dtype=f64)[:, None, None, None]
  return z


def reference(q, k, v, *, weighting: str, score: str = "scaled_dot",
              score_params: dict[str, Any] | None = None, scale: float | None = None,
              bias=None, mask=None, is_causal: bool = False, cotangent=None,
              kink_rel: float | None = None, row_keys=None, score_mod: str = "none",
              mod_params: dict[str, Any] | None = None, cap: float | None = None,
              sinks=None) -> Reference:
  """The float64 brute force of ``attnx.core.attention`` with these arguments.

  Inputs are numpy arrays in their test dtype; they are cast to float64 exactly. ``cotangent``
  (the output's) gives the gradients of q, k, v and bias; the bias gradient comes at the full
  [B, N, T, S] shape (sum it over the bias' broadcast dims). With ``kink_rel`` the result
  also marks the entries whose score lies within kink_rel · (1 + max |score|) of a kink of F
  (:func:`_kinks`). ``row_keys`` ([B, T] ints, :func:`sequence_keys64`): the keys of each
  query's sequence under a mask that splits rows into sequences, the n of an F that counts
  them. ``score_mod``, ``mod_params``, ``cap``: the score modification of
  :func:`score_mod64` (its parameters' gradients come as ``grads["mod"]``, a dict).
  ``sinks`` [N]: attention sinks, a column of score sinks[h] and zero value appended to every
  row before F and dropped after it (F's n stays S); their gradient is ``grads["sinks"]``.
  One jitted float64 program per call.
  """
  b, t, n, h = q.shape
  s_len = k.shape[1]
  if scale is None:
    scale = 1.0 / math.sqrt(h) if score == "scaled_dot" else 1.0
  valid = valid_mask(b, n, t, s_len, mask, is_causal)
  full = (b, n, t, s_len)
  with jax.enable_x64(True):
    as64 = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
    params = {key: val if np.isscalar(val) else as64(val)
              for key, val in (score_params or {}).items()}
    bias64 = None if bias is None else jnp.broadcast_to(as64(bias), full)
    ct = as64(cotangent if cotangent is not None else np.zeros((b, t, n, v.shape[-1])))
    counts = () if row_keys is None else tuple(int(c) for c in np.unique(row_keys))
    mp = {key: as64(val) for key, val in (mod_params or {}).items()}
    out, grads, bounds, z, slope, jump = _program(
        as64(q), as64(k), as64(v), bias64, params, jnp.asarray(valid), ct,
        None if row_keys is None else jnp.asarray(row_keys), mp, as64(sinks),
        weighting=weighting,
        score=score, scale=float(scale), kink_rel=None if kink_rel is None else float(kink_rel),
        key_counts=counts, score_mod=score_mod, cap=cap, causal=bool(is_causal))
    grads = dict(zip(("q", "k", "v", "bias", "mod", "sinks"),
                     jax.tree.map(np.asarray, grads), strict=True))
    if bias is None:
      del grads["bias"]
    if not mp:
      del grads["mod"]
    if sinks is None:
      del grads["sinks"]
    if cotangent is None:
      grads = {}
    ref = Reference(np.asarray(out), grads, np.asarray(z), valid,
                    {key: jax.tree.map(np.asarray, val) for key, val in bounds.items()})
    ref.kink_slope, ref.kink_jump = np.asarray(slope), np.asarray(jump)
  return ref


@functools.partial(jax.jit, static_argnames=("weighting", "score", "scale", "kink_rel",
                                             "key_counts", "score_mod", "cap", "causal"))
def _program(q, k, v, bias, params, valid, ct, row_keys, mod_params, sinks, *, weighting, score,
             scale, kink_rel, key_counts, score_mod, cap, causal):
  w = wlib.get_weighting(weighting)
  name, wparams = wlib.parse_weighting_name(weighting)
  b, t, n, _ = q.shape
  kh, s_len = k.shape[2], k.shape[1]
  g = n // kh
  bias = jnp.zeros((b, n, t, s_len), f64) if bias is None else bias

  def scores_of(q, k, bias):
    return scores64(q, jnp.repeat(k, g, axis=2), score, params) * scale + bias

  def modified_scores(q, k, bias, mp):
    if score_mod == "none" and cap is None:
      return scores_of(q, k, bias)
    raw = scores64(q, jnp.repeat(k, g, axis=2), score, params) * scale
    return score_mod64(score_mod, raw, bias, mp, cap, causal)

  def plain_weights(z, valid):
    if isinstance(w, wlib.Pointwise):
      return pointwise_weights64(z, valid, w, s_len, row_keys, key_counts)
    return row_weights64(z, valid, name, wparams)

  def weights_of(z, sink_rows):  # sink_rows [B, N, T]: each row's sink score, or None
    if sink_rows is None:
      return plain_weights(z, valid)
    z_all = jnp.concatenate([z, sink_rows[..., None]], axis=-1)
    valid_all = jnp.concatenate([jnp.broadcast_to(valid, z.shape),
                                 jnp.ones(z.shape[:-1] + (1,), bool)], axis=-1)
    return plain_weights(z_all, valid_all)[..., :s_len]

  def per_kv_head(x):  # [B, S, N, H] summed over each kv head's G query heads
    return x.reshape(x.shape[:2] + (kh, g) + x.shape[3:]).sum(3)

  z, scores_vjp = jax.vjp(modified_scores, q, k, bias, mod_params)
  sink_rows = None if sinks is None else jnp.broadcast_to(sinks[None, :, None], (b, n, t))
  p, weights_vjp = jax.vjp(weights_of, z, sink_rows)
  vv = jnp.repeat(v, g, axis=2)
  out = jnp.einsum("bnts,bsnh->btnh", p, vv)
  dp = jnp.einsum("btnh,bsnh->bnts", ct, vv)
  dz, dsink_rows = weights_vjp(dp)
  dq, dk, dbias, dmod = scores_vjp(dz)
  dv = per_kv_head(jnp.einsum("bnts,btnh->bsnh", p, ct))
  # Bounds of the sums behind each result (sums of |terms|): the scale of its rounding error.
  ap, adz = jnp.abs(p), jnp.abs(dz)
  if isinstance(w, wlib.Pointwise) and w.normalization == "sum":
    # dz = F'(z)/l · (dP − D): its terms are F'/l·dP and F'/l·D, which cancel where a row
    # has one key that counts (then dz = 0, but not its rounding).
    big_d = jnp.sum(p * dp, -1, keepdims=True)
    if w.exp_alpha is not None and w.online_max:
      coef = w.exp_alpha * p
    else:
      zv = jnp.where(valid, z, 0.0)
      fz, dfz = jax.jvp(lambda y: w.fn(y, s_len), (zv,), (jnp.ones_like(zv),))
      den = jnp.sum(jnp.where(valid, fz, 0.0), -1, keepdims=True) + w.denominator_offset
      coef = jnp.where(valid, dfz, 0.0) / jnp.where(den != 0, den, 1.0)
    adz = jnp.maximum(adz, jnp.abs(coef) * (jnp.abs(dp) + jnp.abs(big_d)))
  _, abs_vjp = jax.vjp(scores_of, jnp.abs(q), jnp.abs(k), bias)
  bq, bk, _ = abs_vjp(adz)
  bq, bk = _transform_bounds(jnp.abs(bq), jnp.abs(bk), q, k, adz, score, params, scale, g)
  bounds = {"out": jnp.einsum("bnts,bsnh->btnh", ap, jnp.abs(vv)), "q": bq, "k": bk,
            "v": per_kv_head(jnp.einsum("bnts,btnh->bsnh", ap, jnp.abs(ct))), "bias": adz}
  if mod_params:  # the parameters' sums of |terms|: the same linear map, |coefficients|
    zero = jnp.zeros_like(z)
    _, mod_abs_vjp = jax.vjp(
        lambda mp: score_mod64(score_mod, zero, zero, mp, None, causal, absolute=True),
        mod_params)
    bounds["mod"] = mod_abs_vjp(adz)[0]
  slope = jump = jnp.zeros(valid.shape, bool)
  if kink_rel is not None:
    zmax = jnp.max(jnp.abs(jnp.where(valid, z, 0.0)), initial=0.0)
    slope, jump = _kinks(z, valid, w, s_len, kink_rel * (1.0 + zmax), name, wparams)
  dsinks = None
  if sinks is not None:  # one term per row: their sum of |terms|
    dsinks = dsink_rows.sum(axis=(0, 2))
    bounds["sinks"] = jnp.abs(dsink_rows).sum(axis=(0, 2))
  return out, (dq, dk, dv, dbias, dmod, dsinks), bounds, z, slope, jump


def _transform_bounds(bq, bk, q, k, adz, score: str, params, scale: float, g: int):
  """Bounds of dq, dk for scores that transform q and k before a dot product.

  Their derivatives are differences that cancel (d(q/‖q‖)/dq is 0 for H = 1, ∂‖q − k‖²/∂q =
  2(q − k)), so the vjp at |q|, |k| understates the terms: bound them one by one instead.
  """
  kh = k.shape[2]
  per_kv = lambda x: x.reshape(x.shape[:2] + (kh, g) + x.shape[3:]).sum(3)
  row = adz.sum(-1).transpose(0, 2, 1)[..., None]  # Σ_j |dz_ij|, [B, T, N, 1]
  col = adz.sum(2).transpose(0, 2, 1)[..., None]  # Σ_i |dz_ij|, [B, S, N, 1]
  if score == "cosine":  # |∂(q̂·k̂)/∂q_h| ≤ 2 / ‖q‖
    c = 2.0 * scale / params.get("temperature", 1.0)
    qn = jnp.maximum(jnp.linalg.norm(q, axis=-1, keepdims=True), 1e-6)
    kn = jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    return jnp.maximum(bq, c * row / qn), jnp.maximum(bk, c * per_kv(col) / kn)
  if score in ("neg_sq_dist", "metric"):  # |∂‖(q − k)L‖²/∂(qL)| ≤ 2(|qL| + |kL|)
    qt, kt = q, jnp.repeat(k, g, axis=2)
    if score == "metric":
      qt, kt = _proj(qt, params["L"]), _proj(kt, params["L"])
    qa, ka = jnp.abs(qt), jnp.abs(kt)
    aq = row * qa + jnp.einsum("bnts,bsnr->btnr", adz, ka)
    ak = col * ka + jnp.einsum("bnts,btnr->bsnr", adz, qa)
    if score == "metric":
      lab = jnp.abs(params["L"])
      back = (lambda a: jnp.einsum("btnr,hr->btnh", a, lab)) if lab.ndim == 2 else (
          lambda a: jnp.einsum("btnr,nhr->btnh", a, lab))
      aq, ak = back(aq), back(ak)
    return jnp.maximum(bq, 2.0 * scale * aq), jnp.maximum(bk, 2.0 * scale * per_kv(ak))
  return bq, bk


def _kinks(z, valid, w, num_keys: int, delta: float, name: str, wparams: dict[str, Any]):
  """Entries where F' (first) or F (second) jumps within ±delta of the score z.

  A pointwise F is probed on both sides in float64. Of the whole-row weightings, α-entmax with
  α ≥ 2 has one at the edge of its support (sparsemax's Jacobian jumps there, and for α > 2 it
  is unbounded), softpick one at z = 0; the others are smooth.
  """
  none = jnp.zeros(valid.shape, bool)
  if not isinstance(w, wlib.Pointwise):
    if name == "softpick":
      return valid & (jnp.abs(z) < delta), none
    alpha = {"sparsemax": 2.0, "entmax15": 1.5}.get(name, float(wparams.get("alpha", 1.5)))
    if name not in ("sparsemax", "entmax") or alpha < 2.0:
      return none, none
    c = (alpha - 1.0) * float(wparams.get("scale", 1.0))
    zs = c * jnp.where(valid, z, 0.0)
    tau = _entmax_tau(zs, valid, alpha)
    # For α > 2, dp/dz = p^(2−α) grows without bound towards the edge, so float32 rounding of
    # zs − τ is amplified in a band much wider than delta: delta^(1/3).
    band = c * (delta if alpha == 2.0 else jnp.cbrt(delta))
    return valid & (jnp.abs(zs - tau) < band), none
  if w.exp_alpha is not None:
    return none, none
  z = jnp.where(valid, z, 0.0)
  fd = lambda x: jax.jvp(lambda y: w.fn(y, num_keys), (x,), (jnp.ones_like(x),))
  (f_lo, d_lo), (f_0, d_0), (f_hi, d_hi) = fd(z - delta), fd(z), fd(z + delta)

  def spread(a, b, c):  # how far three samples lie apart, relative to the smallest
    lo, hi = jnp.minimum(jnp.minimum(a, b), c), jnp.maximum(jnp.maximum(a, b), c)
    small = jnp.minimum(jnp.minimum(jnp.abs(a), jnp.abs(b)), jnp.abs(c))
    return hi - lo, 1.0 + small

  ds, dref = spread(d_lo, d_0, d_hi)
  fs, fref = spread(f_lo, f_0, f_hi)
  slope = ds > 1e-3 * dref
  jump = fs > 1e-3 * fref + 4 * delta * jnp.maximum(jnp.abs(d_lo), jnp.abs(d_hi))
  return slope & valid, jump & valid


# --------------------------------------------------------------------------------------------
# Residuals (attnx.core.residuals), from the definitions.
# --------------------------------------------------------------------------------------------

def residual64(weighting: str, z: np.ndarray, valid: np.ndarray, sinks=None, row_keys=None,
               num_keys: int | None = None) -> np.ndarray:
  """The residual of float64 scores z [B, N, T, S] (``valid`` broadcastable; ``sinks`` [N] or
  None; ``row_keys`` [B, T]: F's n per row where F counts its sequence's keys), [B, T, N]:
  log Σ F (with the sink, the offset, softpick's ε), log n, 0, stick-breaking's
  Σ log(1 − σ(z)), or entmax's τ in score units (bisection, 200 halvings). Computed in numpy
  (and F in float64), from the definitions, not from attnx's streaming code."""
  w = wlib.get_weighting(weighting)
  valid = np.broadcast_to(np.asarray(valid), z.shape)
  z = np.where(valid, np.asarray(z, np.float64), 0.0)
  s_len = z.shape[-1] if num_keys is None else num_keys
  srow = None if sinks is None else np.broadcast_to(
      np.asarray(sinks, np.float64)[None, :, None], z.shape[:-1])
  out = _residual64(w, z, valid, srow, row_keys, s_len)
  return np.moveaxis(out, 1, 2)


def _residual64(w, z, valid, srow, row_keys, s_len):
  with jax.enable_x64(True), np.errstate(divide="ignore", over="ignore"):
    if isinstance(w, wlib.Pointwise):
      if w.normalization == "none":
        return np.zeros(z.shape[:-1])
      if w.normalization == "length":
        return np.log(valid.sum(-1).astype(np.float64))

      def f_of(x, n_for_rows):
        return np.asarray(w.fn(jnp.asarray(x, f64), n_for_rows), np.float64)

      if w.exp_alpha is not None and w.online_max:  # log-sum-exp, shifted by the row's max
        e = np.where(valid, w.exp_alpha * z, -np.inf)
        parts = [e]
        if srow is not None:
          parts.append(w.exp_alpha * srow[..., None])
        if w.denominator_offset:
          parts.append(np.full(z.shape[:-1] + (1,), np.log(w.denominator_offset)))
        e = np.concatenate(parts, -1)
        m = np.max(e, -1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        return np.log(np.sum(np.exp(e - m), -1)) + m[..., 0]
      if row_keys is not None and w.sequence_shift is not None:
        n_rows = np.asarray(row_keys)[:, None, :, None]
        f = sum(np.where(n_rows == n, f_of(z, int(n)), 0.0) for n in np.unique(row_keys))
      else:
        f = f_of(z, s_len)
      total = np.where(valid, f, 0.0).sum(-1) + float(w.denominator_offset)
      if srow is not None:
        total = total + f_of(srow, s_len)
      return np.log(total)
    rs = w.stream
    if rs.family == "stick_breaking":
      return np.sum(np.where(valid, -np.logaddexp(0.0, z), 0.0), -1)
    if rs.family == "ssmax":
      cnt = valid.sum(-1) + (0 if srow is None else 1)
      c = rs.s * np.log(np.maximum(cnt, 1))
      e = np.where(valid, c[..., None] * z, -np.inf)
      if srow is not None:
        e = np.concatenate([e, (c * srow)[..., None]], -1)
      m = np.max(e, -1, keepdims=True)
      m = np.where(np.isfinite(m), m, 0.0)
      return np.log(np.sum(np.exp(e - m), -1)) + m[..., 0]
    if rs.family == "softpick":
      d = np.where(valid, np.abs(np.expm1(z)), 0.0).sum(-1) + rs.eps
      if srow is not None:
        d = d + np.abs(np.expm1(srow))
      return np.log(d)
    a, sc = rs.alpha, rs.scale
    zz = np.where(valid, z, -np.inf)
    if srow is not None:
      zz = np.concatenate([zz, srow[..., None]], -1)
    top = np.max(zz, -1)
    empty = ~np.isfinite(top)
    top = np.where(empty, 0.0, top)
    lo, hi = top - 1.0 / ((a - 1) * sc), top
    for _ in range(200):
      mid = (lo + hi) / 2
      mass = np.sum(np.maximum((a - 1) * sc * (zz - mid[..., None]), 0.0) ** (1 / (a - 1)), -1)
      lo, hi = np.where(mass >= 1, mid, lo), np.where(mass >= 1, hi, mid)
    return np.where(empty, np.nan, (lo + hi) / 2)
