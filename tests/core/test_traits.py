"""The traits a weighting declares (``w.traits``), each checked against its dense weights.

A declaration is tested in both directions: a trait declared True must hold on every test row,
and one declared False must fail on at least one row, so a wrong declaration either way fails
here. ``list_weightings`` filters by trait values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import weightings as wlib

# Every registered name, plus parameter variants whose traits or numerics differ.
SPECS = tuple(core.list_weightings()) + (
    "power:p=0.5", "power:p=3", "relu:normalization=length", "relu2:normalization=none",
    "sigmoid:normalization=none", "softmax:alpha=2", "exp:alpha=0.5", "gaussian:h=0.5",
    "gaussian:h=0.5,normalization=none", "triangular:h=2", "boxcar:normalization=length",
    "entmax:alpha=1.3", "entmax:alpha=3", "sparsemax:scale=2", "ssmax:s=0.5",
    "softpick:eps=1e-3")
SHIFTS = (0.5, 3.0, -2.0)


def _rows():
  """[R, K] float32 scores: mixed-sign rows, rows of scores in (−0.9, 0] (inside the compact
  kernels' support, all nonpositive), rows near 0; and a key mask with one fully masked row."""
  rng = np.random.default_rng(0)
  s = np.concatenate([2.0 * rng.normal(size=(48, 12)), rng.uniform(-0.9, 0.0, (24, 12)),
                      0.3 * rng.normal(size=(24, 12)) - 0.3]).astype(np.float32)
  s[0, :3] = 0.0  # exact zeros are nonpositive too
  # On a grid of 2^-10, s + M is exact in float32 for the shifts M below: a weighting whose
  # weights are invariant only up to the rounding of s + M (α-entmax with α > 2 amplifies it
  # through the unbounded slope of p^{1/(α−1)} at the support's edge) is tested exactly.
  s = np.round(s * 1024) / 1024
  mask = rng.random(s.shape) < 0.7
  mask[1] = False
  return s, mask


S, MASK = _rows()


def _weights(spec, where):
  """Weights of S + M for M in (0, *SHIFTS): [1 + len(SHIFTS), R, K] float64."""
  z = jnp.asarray(S)[None] + jnp.asarray((0.0, *SHIFTS), jnp.float32)[:, None, None]
  w = core.weights(z, spec, where=None if where is None else jnp.asarray(where)[None])
  return np.asarray(w, np.float64)


@pytest.mark.parametrize("spec", SPECS)
def test_declared_traits_hold_numerically(spec):
  t = core.get_weighting(spec).traits
  assert set(t) == set(wlib.TRAITS)
  for where in (None, MASK):
    w = _weights(spec, where)
    assert np.all(np.isfinite(w)), spec
    w0 = w[0]
    valid = np.ones(S.shape, bool) if where is None else where
    sums = w0.sum(-1)
    empty = np.all(w0 == 0, axis=-1)
    assert np.all(w0[~valid] == 0), spec
    # sums_to_one: every row sums to one or is all zero (no valid key, or every F(s) = 0).
    off = ~empty & (np.abs(sums - 1) > 1e-5)
    if t["sums_to_one"]:
      assert not off.any(), (spec, sums[off])
    else:
      assert np.any(~empty & (np.abs(sums - 1) > 1e-3)), (spec, "declared not to sum to one")
    # zero_on_nonpositive: exactly zero weight at every valid score ≤ 0.
    nonpos = valid & (S <= 0)
    if t["zero_on_nonpositive"]:
      assert np.all(w0[nonpos] == 0), (spec, np.max(w0[nonpos]))
    else:
      assert np.any(w0[nonpos] != 0), (spec, "declared not zero on s ≤ 0")
    # shift_invariant: the weights of s + M equal those of s, for every row and shift.
    diff = np.max(np.abs(w[1:] - w0))
    if t["shift_invariant"]:
      assert diff < 1e-5, (spec, diff)
    else:
      assert diff > 1e-3, (spec, diff, "declared not shift invariant")


@pytest.mark.parametrize("spec", SPECS)
def test_stream_trait(spec):
  w = core.get_weighting(spec)
  if isinstance(w, wlib.RowNormalizer):
    assert w.traits["stream"] == (None if w.stream is None else w.stream.family)
  else:
    assert w.traits["stream"] == ("online_max" if w.online_max else w.normalization)


def test_trait_table_of_the_builtins():
  """The declarations, in one table (the numerical test above is what keeps it honest)."""
  assert core.list_weightings(zero_on_nonpositive=True) == ["power", "relu", "relu2",
                                                            "softpick"]
  assert core.list_weightings(sums_to_one=False) == ["softmax_plus_one", "softpick",
                                                     "stick_breaking"]
  assert core.list_weightings("pointwise", shift_invariant=True) == ["exp", "gaussian",
                                                                     "softmax"]
  assert core.list_weightings("row", shift_invariant=True) == ["entmax", "entmax15",
                                                               "sparsemax", "ssmax"]


def test_list_weightings_filters_by_traits():
  assert core.list_weightings() == sorted(wlib.BUILTIN)
  assert set(core.list_weightings("pointwise")) | set(core.list_weightings("row")) == set(
      core.list_weightings())
  assert core.list_weightings(stream="entmax") == ["entmax", "entmax15", "sparsemax"]
  # sigmoid (sum-normalized) streams log σ with the running max (weightings.LogF).
  assert core.list_weightings(stream="online_max") == ["exp", "gaussian", "sigmoid",
                                                       "softmax", "softmax_plus_one"]
  assert core.get_weighting("sigmoid:normalization=none").stream_rule == "none"
  assert core.list_weightings("row", stream="online_max") == []
  assert core.list_weightings(stream=None) == []  # every whole-row weighting streams
  both = core.list_weightings(sums_to_one=True, zero_on_nonpositive=True)
  assert both == ["power", "relu", "relu2"]
  for name in core.list_weightings():
    t = core.get_weighting(name).traits
    for trait, value in t.items():
      assert name in core.list_weightings(**{trait: value})


def test_unknown_trait_or_kind_raises():
  with pytest.raises(ValueError, match=r"Unknown weighting trait\(s\) \['sums_to_1'\]; "
                     "valid traits: sums_to_one, zero_on_nonpositive, shift_invariant, stream"):
    core.list_weightings(sums_to_1=True)
  with pytest.raises(ValueError, match="kind must be"):
    core.list_weightings("dense", sums_to_one=True)


def test_custom_weightings_get_conservative_traits():
  f = core.get_weighting(lambda z: jax.nn.relu(z))
  # F(s)/ΣF(s) sums to one whatever F is; the rest is not known for a bare callable.
  assert f.traits == {"sums_to_one": True, "zero_on_nonpositive": False,
                      "shift_invariant": False, "stream": "sum"}
  assert not core.get_weighting(jnp.exp).shift_invariant  # declare exp through exp_alpha
  assert core.get_weighting(jax.nn.relu, zero_on_nonpositive=True).zero_on_nonpositive
  assert not core.get_weighting(jax.nn.relu, normalization="length").sums_to_one
  row = wlib.RowNormalizer(name="mine", fn=lambda z, w, ax: jax.nn.softmax(z, axis=ax))
  assert row.traits == {"sums_to_one": False, "zero_on_nonpositive": False,
                        "shift_invariant": False, "stream": None}
  wlib.register_weighting("trait_test_relu3", lambda: wlib.Pointwise(
      name="trait_test_relu3", fn=lambda z, n: jax.nn.relu(z) ** 3, zero_on_nonpositive=True))
  try:
    assert "trait_test_relu3" in core.list_weightings(zero_on_nonpositive=True)
    with pytest.raises(ValueError, match="every weight would be 0"):
      core.check_compatible("trait_test_relu3", "neg_sq_dist")
  finally:
    wlib.unregister_weighting("trait_test_relu3")


def test_distance_check_reads_the_trait_and_probes_bare_callables():
  for name in core.list_weightings(zero_on_nonpositive=True):
    with pytest.raises(ValueError, match="every weight would be 0"):
      core.check_compatible(name, "neg_sq_dist")
  # A Weighting object is trusted: an undeclared relu passes (its trait reads False).
  core.check_compatible(core.get_weighting(jax.nn.relu), "neg_sq_dist")
  # A bare callable declares nothing and is probed on negative scores.
  with pytest.raises(ValueError, match="every weight would be 0"):
    core.check_compatible(jax.nn.relu, "neg_sq_dist")
  core.check_compatible(jax.nn.sigmoid, "neg_sq_dist")
