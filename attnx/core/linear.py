"""Linear attention: w_ij ∝ φ(q_i)·φ(k_j), computed in O(T + S) instead of O(T·S).

With a feature map φ: R^H → R^M_{≥0}, the attention of Alam et al. with F(s(q, k)) = φ(q)·φ(k)
factorizes (Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers
with Linear Attention"):

    out_i = φ(q_i) · Σ_j φ(k_j) v_jᵀ / (φ(q_i) · Σ_j φ(k_j) + ε r_i),
    r_i = max_m |φ(q_i)_m| · Σ_j Σ_m |φ(k_j)_m|,

where j runs over the keys query i sees (valid under ``key_mask``; j ≤ i when causal). The
regularizer is relative: |φ(q_i)·Σ_j φ(k_j)| ≤ r_i (Hölder), so ε is a fraction of the largest
denominator these feature magnitudes allow, and the output is unchanged when φ(q_i) or all the
φ(k_j) are rescaled — which is what lets FAVOR+'s stabilizers cancel exactly. A query with no
valid key (or whose regularized denominator underflows) gets output 0, with zero gradients.

Feature maps:

* ``"elu_plus_one"`` (Katharopoulos et al. 2020): φ(x) = elu(x) + 1, evaluated as
  where(x ≥ 0, x + 1, exp(min(x, 0))) because elu(x) + 1 rounds to 0 in bf16 near x ≈ −8.
* ``"favor_plus"`` (Choromanski et al. 2020, "Rethinking Attention with Performers"): positive
  orthogonal random features with E[φ(q)·φ(k)] = exp(q·k/√H), so the output approximates
  softmax attention ``jax.nn.dot_product_attention`` (default scale 1/√H); the approximation
  error shrinks like 1/√M. The exponentials are stabilized per query token and, for keys, per
  example and head over the valid keys (see :func:`favor_plus_features`): an example's output
  depends only on that example's own queries, valid keys and values, never on the rest of the
  batch or on masked keys.
* any callable ``φ(x) -> [..., M]`` applied to queries and keys.

Layout follows ``jax.nn.dot_product_attention``: q [B, T, N, H], k [B, S, K, H],
v [B, S, K, Hv] with grouped-query attention when N is a multiple of K; the output is
[B, T, N, Hv] in q's dtype, accumulated in float32.

Causal attention (T = S, query i sees keys j ≤ i) uses a chunked scan: inside a chunk of C
positions the (C × C) masked products are formed explicitly, across chunks a running state
Σ φ(k) vᵀ [M, Hv] is carried. Memory is O(C² + M·Hv) per head instead of the O(S·M·Hv) of a
full prefix sum, and the work is still linear in S.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
FeatureMap = str | Callable[[Array], Array]

FEATURE_MAPS = ("elu_plus_one", "favor_plus")
DEFAULT_NUM_FEATURES = 256
DEFAULT_CHUNK_SIZE = 64


# --------------------------------------------------------------------------------------------
# Feature maps.
# --------------------------------------------------------------------------------------------

def elu_plus_one_features(x: Array) -> Array:
  """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020), exact in low precision.

  ``jax.nn.elu(x) + 1`` computes (eˣ − 1) + 1, which rounds to 0 in bfloat16 for x ≲ −8; the
  branch exp(min(x, 0)) keeps φ strictly positive (and the min keeps the unused branch finite).
  """
  x = jnp.asarray(x)
  return jnp.where(x >= 0, x + 1, jnp.exp(jnp.minimum(x, 0)))


def _orthonormalize_columns(a: Array) -> Array:
  """Q of a = QR with diag(R) > 0, for a batch of square matrices [..., H, H].

  Classical Gram-Schmidt applied twice per column ("twice is enough": orthogonal to float
  rounding, Giraud et al. 2005). With diag(R) > 0 the factor is unique, and for a Gaussian
  ``a`` it is Haar-distributed (Mezzadri 2007), which FAVOR+ needs for unbiased features.
  Written with plain XLA ops instead of ``jnp.linalg.qr``: a batched LAPACK QR on the CPU waits
  for workers of XLA's own thread pool, so two of them running at once on a 2-core machine
  deadlock (jaxlib 0.10) — and independent FAVOR+ layers draw their features at once.
  """
  h = a.shape[-1]

  def column(j, q):
    v = jnp.take(a, j, axis=-1)  # [..., H]
    for _ in range(2):
      v = v - jnp.einsum("...ij,...j->...i", q, jnp.einsum("...ij,...i->...j", q, v))
    v = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    onehot = (jnp.arange(h) == j).astype(a.dtype)
    return q + v[..., :, None] * onehot  # column j of q was 0 until now

  return jax.lax.fori_loop(0, h, column, jnp.zeros_like(a))


@functools.partial(jax.jit, static_argnames=("num_features", "head_dim", "orthogonal"))
def favor_features(key: Array, num_features: int, head_dim: int,
                   orthogonal: bool = True) -> Array:
  """Random projection ω [M, H] for FAVOR+ (Choromanski et al. 2020, Sec. 2.4).

  Rows are drawn in blocks of H mutually orthogonal directions (the Q of a Gaussian matrix), each
  row rescaled by an independent χ_H norm (the norm of a fresh Gaussian vector), so every row
  is marginally N(0, I_H) — the estimator stays unbiased — while orthogonality within a block
  lowers its variance.

  Args:
    key: a PRNG key.
    num_features: M, the number of random features.
    head_dim: H.
    orthogonal: False gives i.i.d. Gaussian rows (the plain positive random features).

  Returns:
    float32 array [num_features, head_dim].
  """
  if num_features < 1 or head_dim < 1:
    raise ValueError(f"num_features and head_dim must be ≥ 1, got {num_features}, {head_dim}")
  k_dir, k_norm = jax.random.split(key)
  if not orthogonal:
    return jax.random.normal(k_dir, (num_features, head_dim), jnp.float32)
  num_blocks = -(-num_features // head_dim)
  gauss = jax.random.normal(k_dir, (num_blocks, head_dim, head_dim), jnp.float32)
  q = _orthonormalize_columns(gauss)
  directions = jnp.swapaxes(q, -1, -2).reshape(num_blocks * head_dim, head_dim)[:num_features]
  norms = jnp.linalg.norm(
      jax.random.normal(k_norm, (num_features, head_dim), jnp.float32), axis=-1, keepdims=True)
  return directions * norms


def favor_plus_features(x: Array, omega: Array, is_query: bool,
                        mask: Array | None = None) -> Array:
  """Positive random features φ(x) = M^{−1/2} exp(ωx′ − ‖x′‖²/2 − c), x′ = H^{−1/4} x.

  E_ω[φ(q)·φ(k)] = exp(q·k/√H) e^{−c_q − c_k} (Choromanski et al. 2020, "Rethinking Attention
  with Performers", Lemma 1). The stabilizer c keeps every exponent ≤ 0 (every feature
  ≤ M^{−1/2}, no overflow); its extent is that of the authors' reference implementation:

  * queries, x [..., H]: c is the largest exponent of each token (over its M features);
  * keys, x [..., S, K, H]: c is the largest exponent over the S positions and M features of
    each leading index (example) and head K, taken over the valid keys only (``mask``).

  (The reference takes the maximum of ωx′ alone and adds its ε to every feature; here c is the
  maximum of the whole exponent, and ε is applied by :func:`linear_attention`.) Both constants
  are the same for all keys of one query's attention and :func:`linear_attention`'s ε is
  relative, so c cancels exactly in its output: an example's output does not depend on the
  rest of the batch, other heads or masked keys. Causal attention shares one c across
  positions, so later keys reach earlier outputs only through float32 rounding (unless a later
  key's exponent exceeds every earlier one's by ≳ 80 and the earlier features underflow).
  Since c cancels, its true gradient is zero: it is held fixed (``stop_gradient``) instead of
  differentiated through the max.

  Args:
    x: [..., H] queries or [..., S, K, H] keys (any float dtype; computed in float32).
    omega: [M, H] projection from :func:`favor_features`.
    is_query: per-token stabilizer (True) or per example and head over keys (False).
    mask: keys only, boolean broadcastable to ``x.shape[:-1]`` ([..., S, K]; True = valid).
      Masked keys are left out of the stabilizer and get all-zero features (and gradient), so
      their values are never read. An example and head with no valid key gets zeros.

  Returns:
    float32 features [..., M].
  """
  x = jnp.asarray(x).astype(jnp.float32)
  m, h = omega.shape
  if x.shape[-1] != h:
    raise ValueError(f"favor features: x has head_dim {x.shape[-1]}, omega expects {h}")
  if not is_query and x.ndim < 3:
    raise ValueError(f"favor features: keys must be [..., S, K, H], got shape {x.shape}")
  if mask is not None:
    if is_query:
      raise ValueError("favor features: mask applies to keys only (is_query=False)")
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape[:-1])[..., None]
    x = jnp.where(mask, x, 0.0)  # masked inputs never reach exp: finite values and gradients
  x = x * h ** -0.25
  exponent = (jnp.einsum("...h,mh->...m", x, omega.astype(jnp.float32))
              - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True))
  e = jax.lax.stop_gradient(exponent)
  if is_query:
    c = jnp.max(e, axis=-1, keepdims=True)
  else:
    if mask is not None:
      e = jnp.where(mask, e, -jnp.inf)
    c = jnp.max(e, axis=(-3, -1), keepdims=True)  # [..., 1, K, 1]
    c = jnp.where(c == -jnp.inf, 0.0, c)  # no valid key: any finite c (features are zeroed)
  features = jnp.exp(exponent - c) / math.sqrt(m)
  if mask is not None:
    features = jnp.where(mask, features, 0.0)
  return features


# --------------------------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------------------------

def _check_shapes(q: Array, k: Array, v: Array) -> None:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError("linear_attention expects q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]; "
                     f"got shapes {q.shape}, {k.shape}, {v.shape}")
  b, _, n, h = q.shape
  if k.shape[0] != b or v.shape[0] != b:
    raise ValueError(f"batch sizes differ: {q.shape}, {k.shape}, {v.shape}")
  if k.shape[-1] != h:
    raise ValueError(f"q and k head dims differ: {h} vs {k.shape[-1]}")
  if k.shape[1:3] != v.shape[1:3]:
    raise ValueError(f"k and v must agree on [S, K]: {k.shape} vs {v.shape}")
  if n % k.shape[2]:
    raise ValueError(f"number of query heads {n} must be a multiple of key heads {k.shape[2]}")


def _resolve_feature_map(feature_map: FeatureMap, head_dim: int, num_features: int | None,
                         key: Array | None, features: Array | None):
  """(φ_q(x), φ_k(x, mask)) callables; φ_k's mask [B, S, K] is None or marks valid keys."""
  if callable(feature_map):
    return feature_map, lambda x, mask: feature_map(x)
  if feature_map == "elu_plus_one":
    return elu_plus_one_features, lambda x, mask: elu_plus_one_features(x)
  if feature_map == "favor_plus":
    if features is None:
      if key is None:
        raise ValueError("feature_map='favor_plus' needs random features: pass key=PRNGKey "
                         "(draw fresh ones each step) or features=favor_features(...).")
      features = favor_features(key, num_features or DEFAULT_NUM_FEATURES, head_dim)
    elif features.shape[-1] != head_dim:
      raise ValueError(f"features must be [M, {head_dim}], got {features.shape}")
    return (lambda x: favor_plus_features(x, features, is_query=True),
            lambda x, mask: favor_plus_features(x, features, is_query=False, mask=mask))
  raise ValueError(f"Unknown feature_map {feature_map!r}; valid: {', '.join(FEATURE_MAPS)} or a "
                   "callable φ(x) -> [..., M].")


def _noncausal(fq: Array, fk: Array, v: Array, precision) -> tuple[Array, Array]:
  # fq [B, T, K, G, M], fk [B, S, K, M], v [B, S, K, D].
  kv = jnp.einsum("bskm,bskd->bkmd", fk, v, precision=precision)
  ksum = jnp.sum(fk, axis=1)
  num = jnp.einsum("btkgm,bkmd->btkgd", fq, kv, precision=precision)
  den = jnp.einsum("btkgm,bkm->btkg", fq, ksum, precision=precision)
  return num, den


def _causal(fq: Array, fk: Array, v: Array, chunk: int, precision) -> tuple[Array, Array]:
  b, t, kh, g, m = fq.shape
  d = v.shape[-1]
  c = max(1, min(chunk, t))
  pad = -t % c
  if pad:  # zero key features contribute nothing; padded queries are dropped below
    fq = jnp.pad(fq, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    fk = jnp.pad(fk, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
  nc = (t + pad) // c
  # Chunk-major for the scan: [nc, B, C, ...].
  fq_c = jnp.moveaxis(fq.reshape(b, nc, c, kh, g, m), 1, 0)
  fk_c = jnp.moveaxis(fk.reshape(b, nc, c, kh, m), 1, 0)
  v_c = jnp.moveaxis(v.reshape(b, nc, c, kh, d), 1, 0)
  tril = jnp.tril(jnp.ones((c, c), fq.dtype))

  def step(state, xs):
    kv, ksum = state  # [B, K, M, D], [B, K, M]: Σ over all previous chunks
    q_, k_, v_ = xs
    a = jnp.einsum("btkgm,bskm->bkgts", q_, k_, precision=precision) * tril
    num = (jnp.einsum("bkgts,bskd->btkgd", a, v_, precision=precision)
           + jnp.einsum("btkgm,bkmd->btkgd", q_, kv, precision=precision))
    den = (jnp.moveaxis(jnp.sum(a, axis=-1), -1, 1)
           + jnp.einsum("btkgm,bkm->btkg", q_, ksum, precision=precision))
    kv = kv + jnp.einsum("bskm,bskd->bkmd", k_, v_, precision=precision)
    ksum = ksum + jnp.sum(k_, axis=1)
    return (kv, ksum), (num, den)

  init = (jnp.zeros((b, kh, m, d), fq.dtype), jnp.zeros((b, kh, m), fq.dtype))
  _, (num, den) = jax.lax.scan(step, init, (fq_c, fk_c, v_c))
  num = jnp.moveaxis(num, 0, 1).reshape(b, nc * c, kh, g, d)[:, :t]
  den = jnp.moveaxis(den, 0, 1).reshape(b, nc * c, kh, g)[:, :t]
  return num, den


@jax.custom_jvp
def _safe_divide(num: Array, den: Array) -> Array:
  """num [..., D] / den [...] where den is a normal positive float, else 0.

  Its derivative divides by den once, (dnum − out·dden) / den, instead of autodiff's
  num·dden/den², which overflows float32 for den ≲ 1e-19 (reachable with tiny features).
  """
  ok = den >= jnp.finfo(den.dtype).tiny
  return jnp.where(ok[..., None], num / jnp.where(ok, den, 1.0)[..., None], 0.0)


@_safe_divide.defjvp
def _safe_divide_jvp(primals, tangents):
  num, den = primals
  dnum, dden = tangents
  out = _safe_divide(num, den)
  ok = den >= jnp.finfo(den.dtype).tiny
  inv = jnp.where(ok, 1.0 / jnp.where(ok, den, 1.0), 0.0)[..., None]
  return out, (dnum - out * dden[..., None]) * inv


@functools.partial(jax.jit, static_argnames=("feature_map", "is_causal", "num_features", "eps",
                                             "chunk_size", "precision"))
def linear_attention(q: Array, k: Array, v: Array, *,
                     feature_map: FeatureMap = "elu_plus_one", is_causal: bool = False,
                     num_features: int | None = None, key: Array | None = None,
                     features: Array | None = None, key_mask: Array | None = None,
                     eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     precision: jax.lax.PrecisionLike = None) -> Array:
  """Linear attention out_i = φ(q_i)·Σ_j φ(k_j) v_jᵀ / (φ(q_i)·Σ_j φ(k_j) + ε r_i).

  Katharopoulos et al. 2020 (elu + 1 features) and Choromanski et al. 2020 (FAVOR+).

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H]; N must be a multiple of K (grouped-query attention).
    v: values [B, S, K, Hv].
    feature_map: ``"elu_plus_one"``, ``"favor_plus"`` or a callable φ(x) -> [..., M] applied
      to queries and keys (it must be non-negative for the weights to be).
    is_causal: query i attends to keys j ≤ i (needs T = S); chunked scan, see the module doc.
    num_features: M for FAVOR+ when drawing features from ``key`` (default 256).
    key: PRNG key for FAVOR+'s random features (redraw them regularly during training).
    features: an explicit FAVOR+ projection [M, H] (e.g. from :func:`favor_features`);
      takes precedence over ``key``.
    key_mask: optional boolean [B, S] (or [S]); False keys are dropped: their features are
      zeroed, their keys and values are never read (nor differentiated), and FAVOR+'s key
      stabilizer ignores them. General [T, S] masks do not factorize and are not supported.
    eps: relative regularizer ε of the denominator: ε r_i is added, with
      ``r_i = max_m |φ(q_i)_m| · Σ_j Σ_m |φ(k_j)_m|`` over the keys query i sees (valid, and
      j ≤ i when causal), an upper bound of ``|φ(q_i)·Σ_j φ(k_j)|``. It is invariant to
      rescaling the features, so the output does not depend on FAVOR+'s stabilizers, on other
      examples or on masked keys. Queries with no valid key get 0.
    chunk_size: positions per chunk of the causal scan.
    precision: passed to the einsums (e.g. ``jax.lax.Precision.HIGHEST`` on TPU/GPU).

  Returns:
    [B, T, N, Hv] in q's dtype (float32 accumulation).
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  _check_shapes(q, k, v)
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if is_causal and t != s:
    raise ValueError(f"is_causal=True needs as many queries as keys, got T={t}, S={s}")
  phi_q, phi_k = _resolve_feature_map(feature_map, h, num_features, key, features)
  f32 = jnp.float32
  vf = v.astype(f32)
  mask = None
  if key_mask is not None:
    mask = jnp.broadcast_to(jnp.asarray(key_mask, bool)[..., None], (b, s, kh))  # [B, S, K]
    # Masked keys and values are replaced before any arithmetic: huge or non-finite padding
    # cannot reach the output or the gradients (0 · inf would be NaN).
    k = jnp.where(mask[..., None], k, jnp.zeros((), k.dtype))
    vf = jnp.where(mask[..., None], vf, 0.0)
  fq = phi_q(q).astype(f32)
  fk = phi_k(k, mask).astype(f32)
  if fq.shape[:-1] != q.shape[:-1] or fk.shape[:-1] != k.shape[:-1] or (
      fq.shape[-1] != fk.shape[-1]):
    raise ValueError(f"feature map must map [..., H] to [..., M]; got {fq.shape}, {fk.shape}")
  if mask is not None:
    fk = jnp.where(mask[..., None], fk, 0.0)
  fq = fq.reshape(b, t, kh, n // kh, fq.shape[-1])
  if is_causal:
    num, den = _causal(fq, fk, vf, chunk_size, precision)
  else:
    num, den = _noncausal(fq, fk, vf, precision)
  # Relative regularizer ε r_i (see the module doc): key mass each query sees, [B, S|1, K].
  key_mass = jnp.sum(jnp.abs(fk), axis=-1)
  key_mass = (jnp.cumsum(key_mass, axis=1) if is_causal
              else jnp.sum(key_mass, axis=1, keepdims=True))
  r = jnp.max(jnp.abs(fq), axis=-1) * key_mass[..., None]  # [B, T, K, G]
  out = _safe_divide(num, den + eps * r)
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)
