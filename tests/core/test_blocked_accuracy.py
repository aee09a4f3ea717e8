"""Accuracy of the blocked kernel's backward against a float64 reference (issue 41, part 3).

tokamax's case: q, k, v uniform in [1, 2), T = 256 queries, S = 8 keys, H = 64, float32. The
scores are ≈ 20 everywhere. The blocked dV was 3.4× as far from the float64 reference as
dense's (max 2.7e-5 against 7.9e-6; over tokamax's tolerance 2e-5 + 2e-6·|ref|), for two reasons
(docs/guides/implementations.md, "Precision and accuracy"):

* the backward recomputed the scores in a transposed tile, [keys × queries], whose XLA:CPU dot
  sums q·k in another order: 8.6e-6 from the exact scores where the forward's [queries × keys]
  tile (and dense) are 3.4e-6 away. The backward now computes the tile as the forward does,
  with the forward's own score function;
* P = exp(s − lse) with one float32 lse ≈ 20, rounded by up to 2⁻²⁰ relative: every weight of
  the row inherits it. The forward now saves lse as the pair (hi, lo) (TwoSum), and the
  backward takes exp((s − hi) − lo).

After: blocked's dV is within 1.3× of dense's max error and 1.1× its RMS error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import streaming
from attnx.core.weightings import get_weighting

B, T, N, H, S = 2, 256, 2, 64, 8


def _case(seed):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.uniform(1.0, 2.0, (B, n, N, H)).astype(np.float32) for n in (T, S, S))
  g = rng.standard_normal((B, T, N, H)).astype(np.float32)
  return q, k, v, g


def _reference(q, k, v, g):
  """(out, dq, dk, dv) of softmax attention with the loss Σ out·g, float64 numpy."""
  q, k, v, g = (x.astype(np.float64) for x in (q, k, v, g))
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p, v)
  dv = np.einsum("bnts,btnh->bsnh", p, g)
  dp = np.einsum("btnh,bsnh->bnts", g, v)
  ds = p * (dp - np.einsum("btnh,btnh->bnt", g, out)[..., None]) / np.sqrt(H)
  return out, np.einsum("bnts,bsnh->btnh", ds, k), np.einsum("bnts,btnh->bsnh", ds, q), dv


def _errors(implementation, q, k, v, g, ref, **kw):
  """|got − ref| of (out, dq, dk, dv), float64 arrays."""
  out, vjp = jax.vjp(lambda q, k, v: core.attention(q, k, v, implementation=implementation,
                                                    **kw), q, k, v)
  got = (out, *vjp(jnp.asarray(g)))
  return [np.abs(np.asarray(a, np.float64) - b) for a, b in zip(got, ref, strict=True)]


def _rms(x):
  return float(np.sqrt(np.mean(x ** 2)))


@pytest.mark.parametrize("blocked", [core.Blocked(), core.Blocked(block_q=64)],
                         ids=["default", "bq64"])
def test_blocked_dv_as_accurate_as_dense_on_tokamax_case(blocked):
  rms_blocked, rms_dense = [], []
  for seed in range(4):
    q, k, v, g = _case(seed)
    ref = _reference(q, k, v, g)
    err = _errors(blocked, q, k, v, g, ref)
    dense = _errors("dense", q, k, v, g, ref)
    dv_ref, dv_err = ref[3], err[3]
    # tokamax's tolerance for dV (before the fix: exceeded 1.18–1.42× on three of the draws).
    excess = dv_err / (2e-5 + 2e-6 * np.abs(dv_ref))
    assert excess.max() <= 1.0, f"seed {seed}: dV error {excess.max():.2f}× tokamax's tolerance"
    if seed == 0:  # max error: was 2.68e-5 against dense's 7.86e-6 (3.4×); now 1.17× / 1.00×
      ratio = dv_err.max() / dense[3].max()
      assert ratio <= 1.3, f"dV max error {dv_err.max():.3g}, dense {dense[3].max():.3g}"
    rms_blocked.append(_rms(dv_err))
    rms_dense.append(_rms(dense[3]))
  # RMS over the four draws: was 2.6–2.7× dense's; now ≤ 1.05×.
  ratio = sum(rms_blocked) / sum(rms_dense)
  assert ratio <= 1.1, f"dV RMS error {ratio:.3f}× dense's"


def _dq_through_rounded_out(q, k, v, g, out):
  """dQ in float64 from the exact P and dP but D = Σ_h dO·O of a computed (rounded) output.

  The flash backward's D reads the forward's float32 output; autodiff through dense softmax
  does not. This dQ's distance from the exact one is what O's rounding alone costs: jax 0.12's
  XLA:CPU rounds the output ≈ 20 % further than jax 0.10.2's (dense and blocked alike), and
  blocked's dQ follows."""
  q, k, v, g, out = (np.asarray(x, np.float64) for x in (q, k, v, g, out))
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dp = np.einsum("btnh,bsnh->bnts", g, v)
  ds = p * (dp - np.einsum("btnh,btnh->bnt", g, out)[..., None]) / np.sqrt(H)
  return np.einsum("bnts,bsnh->btnh", ds, k)


def test_blocked_dq_dk_out_near_dense_on_tokamax_case():
  # Not the subject, but the same causes: the fix brought dQ from 2.6× dense's max
  # error to 1.2× and dK from 1.3× to 1.0× (seed 0, jax 0.10.2); the output was already as
  # dense's. dQ's floor is the larger of dense's error and what the rounded output passes
  # through D (seeds 0 and 1: 0.9-1.1× dense's on jax 0.10.2's XLA:CPU, 1.35-1.45× on 0.12's).
  q, k, v, g = _case(0)
  ref = _reference(q, k, v, g)
  err = _errors("blocked", q, k, v, g, ref)
  dense = _errors("dense", q, k, v, g, ref)
  out = np.asarray(core.attention(q, k, v, implementation="blocked"))
  floors = {"out": dense[0].max(), "dk": dense[2].max(),
            "dq": max(dense[1].max(), np.abs(_dq_through_rounded_out(q, k, v, g, out)
                                             - ref[1]).max())}
  for name, e in zip(("out", "dq", "dk"), err[:3], strict=False):
    assert e.max() <= 1.5 * floors[name], f"{name}: {e.max():.3g} against {floors[name]:.3g}"


def test_split_lse_carries_the_rounding_of_lse():
  # pointwise_finalize(split_lse=True): (hi, lo) with hi + lo = m + fl(log l) exactly, where
  # hi alone is off by up to half an ulp of lse (2⁻²⁰ relative at lse ≈ 20).
  rng = np.random.default_rng(0)
  m = jnp.asarray(rng.uniform(16.0, 32.0, 4096), jnp.float32)
  l = jnp.asarray(rng.uniform(1.0, 1000.0, 4096), jnp.float32)
  acc = jnp.stack([jnp.zeros_like(l), l], axis=-1)  # Hv = 1 column of zeros, then Σ e^(z − m)
  w = get_weighting("softmax")
  _, stat = streaming.pointwise_finalize(w, acc, m, split_lse=True)
  _, lse = streaming.pointwise_finalize(w, acc, m)
  assert stat.shape == (4096, 2)
  np.testing.assert_array_equal(np.asarray(stat[:, 0]), np.asarray(lse))
  log_l = np.asarray(jnp.log(l), np.float64)  # float32 log, as the kernel's
  exact = np.asarray(m, np.float64) + log_l
  hi, lo = (np.asarray(stat[:, i], np.float64) for i in (0, 1))
  assert np.max(np.abs(hi - exact)) > 2e-7  # one float32 loses bits here ...
  np.testing.assert_array_equal(hi + lo, exact)  # ... that lo holds, exactly (TwoSum)
  # The backward reads both: P = e^((z − hi) − lo).
  rows = streaming.pointwise_grad_rows(w, stat, jnp.zeros_like(m))
  assert isinstance(rows[0], tuple) and len(rows[0]) == 2


def test_empty_and_nan_rows_keep_their_statistic_with_split_lse():
  # A row without keys: lse = +∞ and lo = 0 (every recomputed weight 0); a NaN row: NaN, lo 0.
  w = get_weighting("softmax")
  m = jnp.asarray([0.0, jnp.nan, 3.0], jnp.float32)
  l = jnp.asarray([0.0, jnp.nan, 2.0], jnp.float32)
  acc = jnp.stack([jnp.zeros_like(l), l], axis=-1)
  _, stat = streaming.pointwise_finalize(w, acc, m, split_lse=True)
  assert stat[0, 0] == jnp.inf and stat[0, 1] == 0
  assert jnp.isnan(stat[1, 0]) and stat[1, 1] == 0
  assert np.isfinite(np.asarray(stat[2])).all()
