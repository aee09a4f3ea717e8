"""The edge-case contract every attention implementation obeys, and the shared steps that give it.

What :func:`attnx.core.attention` returns on the inputs where "just compute it" is not an
answer — identically for ``implementation="dense"`` and ``"blocked"`` (and any future one):

* **Empty sequences.** T = 0 gives an empty ``[..., 0, N, Hv]`` output; S = 0 (no keys) gives
  zeros, since every query row then has no valid key. Gradients are zero.
* **Rows with no valid key** (fully masked, causal rows beyond the keys, or every F(s) = 0, e.g.
  ReLU on all-negative scores) give a zero output row with finite (zero) gradients, where
  ``jax.nn.dot_product_attention`` averages all values.
* **Masked keys are never touched**: whatever a masked (or causally hidden) key, value or bias
  entry holds, NaN and ±Inf included, the rows that do not attend it are unchanged, and so is
  every gradient but the non-finite entry's own, which is zero. Likewise a non-finite q_i of a
  row without a valid key changes no output and no other gradient.
* **NaN/Inf inputs** propagate to exactly the rows they touch, as in ``jax.nn``: row i of the
  output is all NaN iff it has at least one valid key and q_i holds a non-finite number, or
  some key j valid for row i has a non-finite k_j, v_j or bias_ij (NaN or +Inf). A bias of
  −Inf is a score of −Inf: weight F(−∞), which is 0 for every built-in F except
  ``taylor_exp`` (whose F(−∞) = +∞ makes the row NaN). A NaN row's weights are NaN at its
  valid keys and 0 at the masked ones (as ``jax.nn.softmax(..., where=mask)``). Its gradients
  are NaN where it reaches, as autodiff gives, and nowhere else: it reaches its own dq_i and
  the dk_j, dv_j and bias gradients of the keys j it attends; every other gradient is what it
  is without the row. A non-finite q_i (every score of the row NaN) makes all of these NaN
  for softmax and every whole-row weighting, in every implementation. Which of them are NaN
  may differ between implementations where F' is a select (relu, boxcar, ...: dense gives 0
  at a NaN score, the streaming kernels NaN) or where one bad key leaves some weights finite
  (stick-breaking's later keys).
* **Unbounded F'**: ``power:p`` with p < 1 has F'(0⁺) = ∞; attnx uses F(s) = F'(s) = 0 for
  s < 2⁻¹²⁶ (the smallest normal float32), so gradients are finite for finite inputs.
* **Finite inputs give finite outputs and gradients** for every built-in weighting and score
  with scores up to |s| ≈ 1e4 (exp is computed with a running maximum; sum-normalized
  weightings divide once in the backward so a denormal Σ F does not overflow).
* **Precision**: every implementation computes (scores, F, statistics, accumulators) in
  max(float32, the input dtype) (:func:`compute_dtype`): bf16/f16 inputs in float32, cast
  back; float64 inputs (``jax_enable_x64``) in float64, in dense (pointwise F and the
  whole-row weightings of :mod:`attnx.core.weightings.rownorm` and
  :mod:`attnx.core.weightings.simplex`, whose bisections then run to float64 resolution), the
  blocked kernels (pointwise and whole-row) and the ring's blocked steps. The Pallas kernels
  have no float64 form: ``implementation="pallas"`` raises a ValueError naming the dtype and
  ``implementation="blocked"`` (also with ``interpret=True``), and the automatic choice never
  takes them for float64.

This module holds what every kernel shares: the input step, which makes non-finite numbers
travel as NaN along a path masks can stop (the scores), never through a product with a zero
weight; and the backward's rule for the same reason: the products dq = dS·K and dk = dSᵀ·Q
take :func:`finite` copies of q and k, since dS is 0 at a masked pair and 0·NaN would make a
masked NaN key poison dq of every row of its group (and a NaN query row without valid keys dk
of every key). The scores are still recomputed from the real q and k, so a pair that is valid
has a NaN dS and the rows and keys a NaN reaches keep their NaN gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def compute_dtype(*dtypes) -> jnp.dtype:
  """The dtype the kernels compute and accumulate in for inputs of ``dtypes``: float32 for
  16-bit floats and float32, float64 for float64 (with ``jax_enable_x64``)."""
  return jnp.promote_types(jnp.float32, jnp.result_type(*dtypes))


def nonfinite_inputs(q: Array, k: Array, v: Array | None,
                     bias: Array | None) -> tuple[Array, Array, Array | None, Array | None]:
  """Rewrites q, k, v, bias ([..., T|S, heads, H] layout) so that NaN follows the contract.

  * a non-finite entry of q_i or k_j becomes NaN: one NaN in a vector makes every score it
    enters NaN (NaN · 0 is NaN), so s_ij is NaN exactly for the pairs (i, j) that it touches,
    and masks replace masked s_ij before F sees them;
  * a key whose v_j holds a non-finite entry gets k_j = NaN, for the same reason;
  * v_j's non-finite entries become 0: a masked key enters the weighted sum with weight 0,
    and 0 · NaN would otherwise poison rows that never attend it;
  * a bias of +Inf becomes NaN (−Inf stays a score of −Inf).

  Everything but one reduction over v's last axis is elementwise, so XLA fuses it into the
  kernels' own layout passes. Finite inputs pass through unchanged (identity gradient there).
  """
  q = jnp.where(jnp.isfinite(q), q, jnp.nan)
  k_ok = jnp.isfinite(k)
  if v is not None:
    k_ok = k_ok & jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)
    v = jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))
  k = jnp.where(k_ok, k, jnp.nan)
  if bias is not None and jnp.issubdtype(bias.dtype, jnp.floating):
    bias = jnp.where(bias == jnp.inf, jnp.nan, bias)
  return q, k, v, bias


def finite(x: Array) -> Array:
  """x with NaN entries replaced by 0: the copy of q or k that the backward's products
  dS·K and dSᵀ·Q take (see the module docstring). After :func:`nonfinite_inputs` NaN is the
  only non-finite value; finite inputs pass through unchanged, bit for bit."""
  return jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
