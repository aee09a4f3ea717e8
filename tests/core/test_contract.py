"""The edge-case contract of attnx.core.attention (attnx/core/contract.py), per implementation.

:class:`ContractTests` holds every contract test; each subclass names one implementation —
``TestDense``, ``TestBlocked``, ``TestPallasGPUInterpret`` and ``TestPallasTPUInterpret``
(the Triton and Mosaic kernels in Pallas' interpreter) — and declares what it supports by
asking the library (``core.check_compatible``, ``kernels.pallas.supported``), so that a test
that does not apply is skipped with the library's reason. A later implementation (ring) is
one more subclass.

The tests:

* one fixed causal case per weighting (GQA, T ≠ S, ragged tiles, a random mask with a fully
  masked row and a never-attended key, a bias), compiled once per implementation and run on
  several inputs: finite inputs give finite outputs and gradients that agree with dense (dense
  itself with the float64 brute force of ``support.reference``); rows without a valid key
  are zero with zero gradients; NaN/±Inf in masked entries (or in q of a row without a valid
  key) change no output and no gradient but their own, which is zero; NaN/±Inf in valid
  entries reach exactly the rows the contract names (a numpy rule), and those rows'
  gradients reach nothing beyond their dq and the keys they attend; a −Inf bias is a score
  of −Inf. The default run takes one weighting per family of the streaming kernels
  (``support.contract.FAMILY_SAMPLE``: online max, sum/length/none normalizations, distance
  kernels, SSMax, softpick, stick-breaking, sparsemax, 1.5-entmax, α-entmax by bisection);
  every other weighting is marked ``exhaustive``;
* a hypothesis fuzz over weighting × score × dtype × shapes × masks × bias × tiles (fewer
  examples for the slow interpreter), with NaN poisoning;
* empty sequences, bf16/f16 (float64 where x64 is on), p < 1, tile rules, bad inputs (the
  same ValueError as dense), what needs the weights.

Module-level tests hold a NaN query row to independent references (``jax.nn`` for softmax,
the float64 brute force for the whole-row weightings, each without the row): NaN exactly in
its dq and in dk, dv of the keys it attends, the rest as without it.

CI cost: the interpreter compiles a program in seconds, so each implementation compiles one
program per weighting for all the fixed-case tests (:func:`_program` caches them), the fuzz
runs few examples for Pallas, and the shapes are tiny (T, S ≤ 20, B·N ≤ 8).
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import contract as cl
from support import reference as ref_lib

from attnx import core
from attnx.core import streaming
from attnx.core import weightings as wlib
from attnx.core.kernels import pallas as pallas_lib

FUZZ = hypothesis.settings(deadline=None, derandomize=True,
                           suppress_health_check=list(hypothesis.HealthCheck), print_blob=True)
WEIGHTING_PARAMS = [pytest.param(w, marks=() if w in cl.FAMILY_SAMPLE.values()
                                 else pytest.mark.exhaustive) for w in cl.WEIGHTINGS]
# max |got − dense| ≤ TOL · max(1, max |dense|), float32: the kernels differ from dense in
# summation order (and a threshold found by iteration) only.
TOL_DENSE = {"out": 5e-5, "grad": 5e-4}


def _f32(x) -> np.ndarray | None:
  return None if x is None else np.asarray(jnp.asarray(x, jnp.float32))


def _assert_close(got, want, tol: float, what: str) -> None:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  bound = tol * max(1.0, float(np.max(np.abs(want), initial=0.0)))
  err = float(np.max(np.abs(got - want), initial=0.0))
  assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@functools.cache
def _program(test_cls: type, weighting: str, score: str, is_causal: bool,
             block_q: int | None, block_k: int | None):
  """The jitted output-and-VJP program of ``test_cls``'s implementation for one static
  configuration: every input of the same shapes reuses its compilation (the interpreter's
  programs take seconds to compile)."""
  hook = test_cls()
  kw = dict(weighting=weighting, score=score, is_causal=is_causal, block_q=block_q,
            block_k=block_k)

  @jax.jit
  def run(q, k, v, bias, mask, params, ct):
    f = lambda q, k, v, bias: hook.call(q, k, v, bias, mask, score_params=params, **kw)
    out, vjp = jax.vjp(f, q, k, v, bias)
    return out, vjp(ct.astype(out.dtype))

  return run


@pytest.fixture(scope="module", autouse=True)
def _free_programs():
  yield
  _program.cache_clear()


def _run(prog, x: dict[str, Any] | cl.Fixed, dtype: str = "float32"):
  """(output, [dq, dk, dv, dbias]) as float32 numpy (dbias None without a bias)."""
  get = (lambda n: getattr(x, n)) if isinstance(x, cl.Fixed) else x.get
  dt = jnp.dtype(dtype)
  params = get("params") if not isinstance(x, cl.Fixed) else None
  bias, mask = get("bias"), get("mask")
  out, grads = prog(jnp.asarray(get("q"), dt), jnp.asarray(get("k"), dt),
                    jnp.asarray(get("v"), dt),
                    None if bias is None else jnp.asarray(bias, jnp.float32),
                    None if mask is None else jnp.asarray(mask),
                    None if params is None else {k: jnp.asarray(v) for k, v in params.items()},
                    jnp.asarray(get("ct"), dt))
  return _f32(out), [_f32(g) for g in grads]


def _rows(out: np.ndarray) -> np.ndarray:
  """[B, T, N, Hv] -> [B, N, T, Hv], to index with [B, N, T] row masks."""
  return out.transpose(0, 2, 1, 3)


class ContractTests:
  """Every contract test, for the implementation a subclass names (not collected itself).

  A subclass sets ``implementation`` (its name), the tiles of the fixed case, the fuzz's
  example count, and overrides :meth:`configured` (the implementation object with its
  settings), :meth:`call` / :meth:`unsupported` / :meth:`tile_ok` where its implementation
  differs.
  """

  implementation: ClassVar[str]
  pallas_backend: ClassVar[str | None] = None  # "gpu" | "tpu": the Pallas kernels it runs
  fixed_tiles: ClassVar[tuple[int | None, int | None]] = (None, None)
  fuzz_examples: ClassVar[int] = 10

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    # Each implementation gets its own hypothesis test, with its own example count.
    settings = hypothesis.settings(FUZZ, max_examples=cls.fuzz_examples)
    cls.test_fuzz = settings(hypothesis.given(data=st.data())(ContractTests._fuzz))

  # ------------------------------------------------------------------------------------------
  # What the implementation is and supports.
  # ------------------------------------------------------------------------------------------

  def configured(self, block_q: int | None = None,
                 block_k: int | None = None) -> core.Implementation:
    """The implementation object with tile caps ``block_q``, ``block_k`` (a ValueError for a
    tile below 1, when the object is made)."""
    return type(core.get_implementation(self.implementation))(block_q=block_q, block_k=block_k)

  def call(self, q, k, v, bias=None, mask=None, block_q=None, block_k=None, **kw) -> Any:
    """``core.attention`` with this implementation and these tiles (the one hook a subclass
    may replace)."""
    return core.attention(q, k, v, bias, mask,
                          implementation=self.configured(block_q, block_k), **kw)

  def unsupported(self, weighting: str, score: str = "scaled_dot",
                  dtype: str = "float32") -> str | None:
    """Why the implementation does not run this combination (None if it does), in the
    library's words."""
    if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
      return "float64 arrays need jax_enable_x64 (off in this run)"
    try:
      core.check_compatible(weighting, score, self.implementation)
    except ValueError as e:
      return str(e)
    return None

  def tile_ok(self, name: str, block: int, dtype: str) -> bool:
    """The documented tile rule: blocked takes any positive tile (dense has no tiles)."""
    del name, dtype
    return block >= 1

  def fuzz_tiles(self, dtype: str) -> list[tuple[int | None, int | None]]:
    """Tile pairs the fuzz draws: small ones this implementation accepts, and the default."""
    sizes = (8, 16, 128)
    pairs = [(bq, bk) for bq in sizes for bk in sizes
             if self.tile_ok("block_q", bq, dtype) and self.tile_ok("block_k", bk, dtype)
             and (bq, bk) != (128, 128)]
    return pairs + [(None, None)]

  def require(self, weighting: str, score: str = "scaled_dot", dtype: str = "float32") -> None:
    reason = self.unsupported(weighting, score, dtype)
    if reason is not None:
      pytest.skip(f"{self.implementation}: {reason}")

  def program(self, weighting: str, score: str, is_causal: bool = True,
              block_q: int | None = None, block_k: int | None = None):
    return _program(type(self), weighting, score, is_causal, block_q, block_k)

  def fixed_program(self, weighting: str, score: str, dtype: str = "float32"):
    return self.program(weighting, score, True, *self.tiles_for(dtype))

  def tiles_for(self, dtype: str) -> tuple[int | None, int | None]:
    """The fixed case's tiles, the query tile doubled where the dtype needs it (TPU, 16-bit)."""
    bq, bk = self.fixed_tiles
    while bq is not None and not self.tile_ok("block_q", bq, dtype):
      bq *= 2
    return bq, bk

  @staticmethod
  def dense_program(weighting: str, score: str, is_causal: bool = True):
    return _program(TestDense, weighting, score, is_causal, None, None)

  @property
  def is_reference(self) -> bool:
    return self.implementation == "dense"

  # ------------------------------------------------------------------------------------------
  # The fixed case, one weighting at a time.
  # ------------------------------------------------------------------------------------------

  @pytest.mark.split_by_jax
  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_finite_inputs_give_finite_outputs_and_gradients(self, weighting):
    score = cl.default_score(weighting)
    self.require(weighting, score)
    prog = self.fixed_program(weighting, score)
    # Scores ~1 and ~1e3 (running maxima, one division in the backward keep them finite).
    for magnitude in (1.0, 30.0):
      out, grads = _run(prog, cl.fixed_inputs(score, magnitude))
      for name, a in zip(("out", "dq", "dk", "dv", "dbias"), [out, *grads], strict=True):
        assert np.all(np.isfinite(a)), (name, magnitude)

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_results_agree_with_dense(self, weighting):
    if self.is_reference:
      pytest.skip("dense is the reference here (tests/core/test_differential.py checks it "
                  "against the float64 brute force)")
    score = cl.default_score(weighting)
    self.require(weighting, score)
    x = cl.fixed_inputs(score)
    out, grads = _run(self.fixed_program(weighting, score), x)
    want, want_grads = _run(self.dense_program(weighting, score), x)
    for name, got, ref in zip(("out", "dq", "dk", "dv", "dbias"), [out, *grads],
                              [want, *want_grads], strict=True):
      _assert_close(got, ref, TOL_DENSE["out" if name == "out" else "grad"], name)

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_rows_without_a_valid_key_are_zero_with_zero_gradients(self, weighting):
    score = cl.default_score(weighting)
    self.require(weighting, score)
    x = cl.fixed_inputs(score)
    out, (dq, dk, dv, dbias) = _run(self.fixed_program(weighting, score), x)
    empty = ~x.valid.any(-1)  # [B, N, T]
    assert empty[0, :, cl.MASKED_ROW].all()
    assert np.all(_rows(out)[empty] == 0)
    assert np.all(_rows(dq)[empty] == 0)
    b, n, _, s = x.valid.shape
    kh = x.k.shape[2]
    unused = ~x.valid.reshape(b, kh, n // kh, -1, s).any((2, 3)).transpose(0, 2, 1)  # [B,S,K]
    assert unused[0, cl.MASKED_KEY].all() and unused[1, 18:].all()
    assert np.all(dk[unused] == 0) and np.all(dv[unused] == 0)
    assert np.all(dbias[~x.valid] == 0)

  def _masked_runs(self, weighting: str):
    """(clean, poisoned k/v/bias, poisoned q) results of the fixed case, and its inputs."""
    score = cl.default_score(weighting)
    self.require(weighting, score)
    x = cl.fixed_inputs(score)
    prog = self.fixed_program(weighting, score)
    keys, query = cl.poison_masked(x)
    return _run(prog, x), _run(prog, keys), _run(prog, query), (keys, query)

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_nonfinite_masked_entries_change_nothing(self, weighting):
    (out, (dq, dk, dv, dbias)), (o1, g1), (o2, g2), (keys, query) = self._masked_runs(weighting)
    # Outputs, and the gradients of the finite entries (dq after masked k, v and dk after the
    # NaN query row: the next test; the non-finite entries' own: the one after).
    finite_k, finite_q = np.isfinite(keys.k), np.isfinite(query.q)
    np.testing.assert_array_equal(o1, out, err_msg="masked k, v, bias: output")
    np.testing.assert_array_equal(g1[1][finite_k], dk[finite_k], err_msg="masked k, v: dk")
    np.testing.assert_array_equal(g1[2], dv, err_msg="masked k, v, bias: dv")
    np.testing.assert_array_equal(g1[3], dbias, err_msg="masked k, v, bias: dbias")
    np.testing.assert_array_equal(o2, out, err_msg="NaN q of a fully masked row: output")
    np.testing.assert_array_equal(g2[0][finite_q], dq[finite_q], err_msg="masked q: dq")
    np.testing.assert_array_equal(g2[2], dv, err_msg="NaN q of a fully masked row: dv")
    np.testing.assert_array_equal(g2[3], dbias, err_msg="NaN q of a fully masked row: dbias")

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_nonfinite_masked_entries_leave_the_other_gradients_unchanged(self, weighting):
    # dS = 0 at masked pairs; the backward's dS·K and dSᵀ·Q take NaN-free copies of q and k.
    (_, (dq, dk, _, _)), (_, g1), (_, g2), _ = self._masked_runs(weighting)
    np.testing.assert_array_equal(g1[0], dq, err_msg="masked k, v: dq")
    np.testing.assert_array_equal(g2[1], dk, err_msg="masked q: dk")

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_a_nonfinite_masked_entry_has_a_zero_gradient(self, weighting):
    _, (_, g1), (_, g2), (keys, query) = self._masked_runs(weighting)
    bad_k, bad_v, bad_q = ~np.isfinite(keys.k), ~np.isfinite(keys.v), ~np.isfinite(query.q)
    assert np.all(g1[1][bad_k] == 0), "dk at the masked non-finite k entries"
    assert np.all(g1[2][bad_v] == 0), "dv at the masked non-finite v entries"
    assert np.all(g2[0][bad_q] == 0), "dq at the non-finite q entries of a fully masked row"

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_nonfinite_inputs_reach_exactly_the_rows_that_attend_them(self, weighting):
    score = cl.default_score(weighting)
    self.require(weighting, score)
    prog = self.fixed_program(weighting, score)
    poisoned, expected = cl.poison_valid(cl.fixed_inputs(score))
    out = _rows(_run(prog, poisoned)[0])
    nan_rows = np.isnan(out).all(-1)
    np.testing.assert_array_equal(nan_rows, expected, err_msg="the NaN rows")
    assert not np.isnan(out[~expected]).any(), "NaN rows are all NaN, the others have none"
    clean = _rows(_run(prog, cl.zeroed(poisoned))[0])  # bad entries replaced by zeros
    np.testing.assert_array_equal(out[~expected], clean[~expected], err_msg="untouched rows")

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_nan_rows_reach_only_their_own_gradients(self, weighting):
    # A NaN row's gradients are NaN at most in its dq and at the keys (and bias entries) it
    # attends; everything else is what it is without the row: the inputs' non-finite entries
    # zeroed and the NaN rows' cotangent 0, so that they add nothing anywhere.
    score = cl.default_score(weighting)
    self.require(weighting, score)
    prog = self.fixed_program(weighting, score)
    poisoned, nan_rows = cl.poison_valid(cl.fixed_inputs(score))  # nan_rows [B, N, T]
    _, grads = _run(prog, poisoned)
    rows_t = nan_rows.transpose(0, 2, 1)  # [B, T, N]
    without = cl.zeroed(poisoned).replace(
        ct=np.where(rows_t[..., None], 0.0, poisoned.ct).astype(np.float32))
    _, want = _run(prog, without)
    pairs = poisoned.valid & nan_rows[..., None]  # [B, N, T, S]
    b, n, t, s = pairs.shape
    kh = poisoned.k.shape[2]
    keys = pairs.reshape(b, kh, n // kh, t, s).any((2, 3)).transpose(0, 2, 1)  # [B, S, K]
    for name, g, w, reach in zip(("dq", "dk", "dv", "dbias"), grads, want,
                                 (rows_t[..., None], keys[..., None], keys[..., None], pairs),
                                 strict=True):
      out = ~np.broadcast_to(reach, g.shape)  # (the poisoned entries are all within reach)
      assert not np.isnan(g[out]).any(), f"{name}: NaN beyond the NaN rows' reach"
      np.testing.assert_array_equal(g[out], w[out], err_msg=f"{name} beyond the NaN rows' reach")

  @pytest.mark.parametrize("weighting", WEIGHTING_PARAMS)
  def test_minus_inf_bias_is_a_score_of_minus_inf(self, weighting):
    score = cl.default_score(weighting)
    self.require(weighting, score)
    x = cl.fixed_inputs(score)
    prog = self.fixed_program(weighting, score)
    # The mask becomes a bias of −Inf: every causal pair is then "valid".
    as_bias = x.replace(bias=np.where(x.mask, x.bias, -np.inf).astype(np.float32),
                        mask=np.ones_like(x.mask))
    got, grads = _run(prog, as_bias)
    role = cl.minus_inf_role(weighting)
    if role == "mask":  # weight F(−∞) = 0: as if masked, gradients finite
      _assert_close(got, _run(prog, x)[0], 1e-5, "−Inf bias vs mask")
      for name, g in zip(("dq", "dk", "dv", "dbias"), grads, strict=True):
        assert np.all(np.isfinite(g)), name
    elif role == "nan":  # F(−∞) is not finite: a row with a causal −Inf entry is NaN
      causal = np.tril(np.ones(x.mask.shape[-2:], bool))
      expected = (causal & ~x.mask).any(-1)  # [B, N, T]
      np.testing.assert_array_equal(np.isnan(_rows(got)).all(-1), expected)
      _assert_close(_rows(got)[~expected], _rows(_run(prog, x)[0])[~expected], 1e-5,
                    "rows without a −Inf entry")
    elif self.is_reference:
      pytest.skip(f"{weighting} counts its keys: a −Inf key is not a masked one, and dense is "
                  "the reference the other implementations are compared with here")
    if not self.is_reference:
      want = _run(self.dense_program(weighting, score), as_bias)[0]
      np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN vs dense")
      fin = ~np.isnan(want)
      _assert_close(got[fin], want[fin], TOL_DENSE["out"], "−Inf bias vs dense")

  # ------------------------------------------------------------------------------------------
  # The fuzz (registered per subclass by __init_subclass__, with its example count).
  # ------------------------------------------------------------------------------------------

  def _fuzz(self, data) -> None:
    """Random supported configurations: finite inputs give finite outputs and gradients,
    rows without a valid key are zero, results agree with dense, and NaN/±Inf at random
    places reach exactly the rows the contract names."""
    c = data.draw(cl.cases(self), label="case")
    arrays = cl.case_arrays(c)
    prog = self.program(c.weighting, c.score, c.causal, c.block_q, c.block_k)
    out, grads = _run(prog, arrays, c.dtype)
    assert np.all(np.isfinite(out)), c
    for name, g in zip("qkvb", grads, strict=True):
      assert g is None or np.all(np.isfinite(g)), (name, c)
    empty = ~arrays["valid"].any(-1)  # [B, N, T]
    assert np.all(_rows(out)[empty] == 0), c
    # boxcar is discontinuous: a score that rounds differently flips a weight 0 ↔ 1.
    if not self.is_reference and c.magnitude == 1.0 and not c.weighting.startswith("boxcar"):
      want, want_grads = _run(self.dense_program(c.weighting, c.score, c.causal), arrays,
                              c.dtype)
      tol = dict(rtol=2e-2, atol=2e-2) if c.dtype == "bfloat16" else dict(rtol=2e-4, atol=2e-4)
      np.testing.assert_allclose(out, want, **tol, err_msg=str(c))
      if c.dtype == "float32":
        for g, w in zip(grads, want_grads, strict=True):
          if w is not None:
            np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3, err_msg=str(c))
    poisoned, expected = cl.poison_case(c, arrays)
    got = _rows(_run(prog, poisoned, c.dtype)[0])
    nan_rows = np.isnan(got).all(-1)
    assert np.array_equal(nan_rows, expected), (c, np.argwhere(nan_rows != expected))
    assert not np.isnan(got[~expected]).any(), c  # NaN rows are all NaN, the others have none
    clean = dict(poisoned, **{n: None if poisoned[n] is None else
                              np.where(np.isfinite(poisoned[n]), poisoned[n], 0.0)
                              for n in ("q", "k", "v", "bias")})
    ref = _rows(_run(prog, clean, c.dtype)[0])
    np.testing.assert_array_equal(got[~expected], ref[~expected], err_msg=str(c))

  # ------------------------------------------------------------------------------------------
  # Shapes, dtypes, tiles and arguments.
  # ------------------------------------------------------------------------------------------

  # The dispatcher answers empty inputs before any kernel: one pointwise, one whole-row F.
  @pytest.mark.parametrize("weighting", [cl.FAMILY_SAMPLE["sum"],
                                         cl.FAMILY_SAMPLE["stick_breaking"]])
  @pytest.mark.parametrize("t,s", [(0, 5), (5, 0), (0, 0)])
  def test_empty_sequences(self, t, s, weighting):
    score = cl.default_score(weighting)
    self.require(weighting, score)
    q, k, v = jnp.ones((2, t, 4, 8)), jnp.ones((2, s, 2, 8)), jnp.ones((2, s, 2, 3))
    f = lambda q, k, v: self.call(q, k, v, weighting=weighting, score=score, is_causal=True)
    out = f(q, k, v)
    assert out.shape == (2, t, 4, 3) and out.dtype == q.dtype
    assert jnp.all(out == 0)
    grads = jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2))(q, k, v)
    for g, a in zip(grads, (q, k, v), strict=True):
      assert g.shape == a.shape and jnp.all(g == 0)

  @pytest.mark.parametrize("dtype,weighting", [
      *[("bfloat16", w) if w == "stick_breaking" else
        pytest.param("bfloat16", w, marks=pytest.mark.exhaustive)
        for w in cl.FAMILY_SAMPLE.values()],
      *[("float16", w) if w == "softmax" else
        pytest.param("float16", w, marks=pytest.mark.exhaustive)
        for w in cl.FAMILY_SAMPLE.values()],
      ("float64", "softmax")])
  def test_low_precision_is_computed_in_float32(self, dtype, weighting):
    score = cl.default_score(weighting)
    if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
      pytest.skip("float64 arrays need jax_enable_x64 (off in this run)")
    x = cl.fixed_inputs(score)
    low = x.replace(**{n: getattr(x, n).astype(jnp.dtype(dtype)) for n in ("q", "k", "v", "ct")})
    reason = self.unsupported(weighting, score, self._stream_dtype(score, dtype))
    if reason is not None:  # the library says no: so must core.attention
      with pytest.raises(ValueError):
        self.call(jnp.asarray(low.q), jnp.asarray(low.k), jnp.asarray(low.v),
                  weighting=weighting, score=score)
      return
    prog = self.fixed_program(weighting, score, dtype)
    dt = jnp.dtype(dtype)
    raw_out, raw_grads = prog(*(jnp.asarray(a, dt) for a in (low.q, low.k, low.v)),
                              jnp.asarray(x.bias), jnp.asarray(x.mask), None,
                              jnp.asarray(low.ct, dt))
    assert raw_out.dtype == dt and all(g.dtype == dt for g in raw_grads[:3])
    # The reference: dense in float32 on the same (rounded) inputs.
    as32 = low.replace(**{n: getattr(low, n).astype(np.float32) for n in ("q", "k", "v", "ct")})
    want, want_grads = _run(self.dense_program(weighting, score), as32)
    out, grads = _f32(raw_out), [_f32(g) for g in raw_grads]
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    eps = float(jnp.finfo(dt).eps)
    _assert_close(out, want, 8 * eps, "out")
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads, strict=True):
      _assert_close(g, w, 32 * eps, name)

  @staticmethod
  def _stream_dtype(score: str, dtype: str) -> str:
    """The dtype the streaming kernels see: the score's dot form may upcast (distances)."""
    q = jax.ShapeDtypeStruct((1, 2, 1, 8), jnp.dtype(dtype))
    qd, kd = jax.eval_shape(lambda q, k: core.get_score(score).to_dot(q, k), q, q)
    return jnp.result_type(qd.dtype, kd.dtype, jnp.dtype(dtype)).name

  @pytest.mark.parametrize("p", [pytest.param(0.1, marks=pytest.mark.exhaustive), 0.5,
                                 pytest.param(0.9, marks=pytest.mark.exhaustive)])
  def test_power_below_one_has_finite_gradients(self, p):
    # The reported case: power:p=0.5 blocked gave NaN/Inf dq and dk on N(0, 1) inputs.
    weighting = f"power:p={p}"
    self.require(weighting)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 16, 1, 8)), jnp.float32) for _ in range(3))
    q = q.at[0, 0].set(0.0)  # a score of exactly 0 in every column of row 0
    bq, bk = self.tiles_for("float32")
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(self.call(q, k, v, weighting=weighting, block_q=bq,
                                          block_k=bk) ** 2), (0, 1, 2)))
    for g in value_and_grad(q, k, v)[1]:
      assert jnp.all(jnp.isfinite(g))
    # Away from 0 the gradient is the exact one: a central difference along a random direction.
    q1 = q.at[0, 0].set(1.0)
    d = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    eps = 1e-3
    fd = (value_and_grad(q1 + eps * d, k, v)[0] - value_and_grad(q1 - eps * d, k, v)[0]) / (
        2 * eps)
    np.testing.assert_allclose(jnp.vdot(value_and_grad(q1, k, v)[1][0], d), fd, rtol=2e-2)

  @pytest.mark.parametrize("t", [0, 6])
  def test_tiles_follow_the_documented_rule(self, t):
    # For the Pallas classes the two backends' rules differ (GPU: powers of 2 ≥ 16; TPU: query
    # tiles a multiple of 8, key tiles of 128), which also shows the right kernels are built.
    # A tile below 1 is refused when the object is made, whatever the backend.
    if self.is_reference:
      with pytest.raises(TypeError, match="block_q"):  # dense has no tiles
        core.Dense(block_q=8)
      return
    q, k, v = jnp.ones((1, t, 2, 8)), jnp.ones((1, 6, 1, 8)), jnp.ones((1, 6, 1, 8))
    for bq, bk in ((0, 8), (8, -1), (8, 8), (16, 16), (8, 128), (16, 128), (24, 32), (3, 7)):
      ok = self.tile_ok("block_q", bq, "float32") and self.tile_ok("block_k", bk, "float32")
      if ok and t:
        continue  # accepted tiles run in the fixed-case tests; no compile here
      if ok:
        assert jnp.all(self.call(q, k, v, block_q=bq, block_k=bk) == 0)
      else:
        with pytest.raises(ValueError, match="block_[qk]"):
          self.call(q, k, v, block_q=bq, block_k=bk)

  def test_bad_inputs_raise_the_same_value_error_as_dense(self):
    q, k, v = jnp.ones((1, 4, 2, 8)), jnp.ones((1, 5, 1, 8)), jnp.ones((1, 5, 1, 8))
    bad = {
        "rank": dict(q=jnp.ones((4, 8))),
        "lengths": dict(v=jnp.ones((1, 6, 1, 8))),
        "heads": dict(q=jnp.ones((1, 4, 3, 8)), k=jnp.ones((1, 5, 2, 8)),
                      v=jnp.ones((1, 5, 2, 8))),
        "int query": dict(q=jnp.ones((1, 4, 2, 8), jnp.int32)),
        "mask dtype": dict(mask=jnp.ones((1, 2, 4, 5))),
        "bias shape": dict(bias=jnp.ones((3, 3))),
        "weighting": dict(weighting="no_such_weighting"),
        "parameter": dict(weighting="power:p=abc"),
        "kernel on a dot": dict(weighting="gaussian"),
        "relu on a distance": dict(weighting="relu", score="neg_sq_dist"),
        "weighting_params": dict(weighting="softmax", weighting_params={"s": 1.0}),
        "dropout rate": dict(dropout_rate=1.5),
        "dropout rng": dict(dropout_rate=0.1),
    }
    for label, kw in bad.items():
      kw = dict(kw)
      args = (kw.pop("q", q), kw.pop("k", k), kw.pop("v", v))
      with pytest.raises(ValueError) as want:
        core.attention(*args, implementation="dense", **kw)
      with pytest.raises(ValueError) as got:
        self.call(*args, **kw)
      assert str(got.value) == str(want.value), label

  def test_what_needs_the_weights(self):
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32) for _ in range(3))
    kw = dict(weighting="softmax", is_causal=True)
    if not self.is_reference:
      for extra in (dict(return_weights=True),
                    dict(dropout_rate=0.5, dropout_rng=jax.random.key(0))):
        with pytest.raises(ValueError, match="weights"):
          self.call(q, k, v, **kw, **extra)
      return
    out, w = self.call(q, k, v, **kw, return_weights=True)
    np.testing.assert_allclose(w, jax.nn.softmax(
        jnp.where(jnp.tril(jnp.ones((6, 6), bool)),
                  jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(8), -jnp.inf)),
        rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", w, v), rtol=1e-5, atol=1e-6)
    dropped = self.call(q, k, v, **kw, dropout_rate=0.5, dropout_rng=jax.random.key(0))
    assert dropped.shape == out.shape and np.all(np.isfinite(dropped))


class TestDense(ContractTests):
  """``implementation="dense"``: the reference the others are compared with."""

  implementation = "dense"
  fuzz_examples = 4

  def configured(self, block_q=None, block_k=None):
    assert block_q is None and block_k is None, "dense has no tiles"
    return core.Dense()

  def fuzz_tiles(self, dtype):
    return [(None, None)]  # dense has no tiles: one compiled program per configuration


class TestBlocked(ContractTests):
  """``implementation="blocked"``: the XLA streaming kernels, 3×3 tiles in the fixed case."""

  implementation = "blocked"
  fixed_tiles = (8, 8)
  fuzz_examples = 5


class _Pallas(ContractTests):
  """``implementation="pallas"`` in Pallas' interpreter (not collected itself)."""

  implementation = "pallas"
  fuzz_examples = 2  # the interpreter compiles for seconds per configuration

  def configured(self, block_q=None, block_k=None):
    return core.Pallas(block_q=block_q, block_k=block_k, interpret=True)

  def unsupported(self, weighting, score="scaled_dot", dtype="float32"):
    reason = super().unsupported(weighting, score, dtype)
    if reason is None:
      reason = pallas_lib.supported(wlib.get_weighting(weighting), backend=self.pallas_backend,
                                    dtype=dtype, interpret=True)
    return reason


class TestPallasGPUInterpret(_Pallas):
  """The Triton (GPU) kernels: what ``core.Pallas(interpret=True)`` builds on a CPU. 2×2
  tiles."""

  pallas_backend = "gpu"
  fixed_tiles = (16, 16)

  def tile_ok(self, name, block, dtype):
    return block >= pallas_lib.GPU_MIN_BLOCK and not block & (block - 1)


class TestPallasTPUInterpret(_Pallas):
  """The Mosaic (TPU) kernels, selected by making JAX report a TPU. 3×1 tiles."""

  pallas_backend = "tpu"
  fixed_tiles = (8, 128)

  def call(self, q, k, v, bias=None, mask=None, **kw):
    with cl.tpu_platform():
      return super().call(q, k, v, bias, mask, **kw)

  def tile_ok(self, name, block, dtype):
    if name == "block_k":
      return block >= 1 and block % 128 == 0
    return block >= 1 and block % (8 if jnp.dtype(dtype).itemsize == 4 else 16) == 0


# --------------------------------------------------------------------------------------------
# A NaN query row against independent references: what its gradients reach, exactly.
# --------------------------------------------------------------------------------------------

NAN_ROW = (1, 6, 3)  # (batch, query, head) whose q holds a NaN (at entry 2)
ROW_WEIGHTINGS = [w for w in cl.FAMILY_SAMPLE.values()
                  if isinstance(wlib.get_weighting(w), wlib.RowNormalizer)]


def _nan_row_case():
  """(q with the NaN, k, v, ct, mask, valid) and the reference inputs (q, ct) without the
  row: its q finite and its cotangent 0, so that it adds nothing to any gradient. Causal GQA;
  every row has a valid key (jax.nn averages the values of a row without one)."""
  rng = np.random.default_rng(11)
  b, t, s, n, kh, h = 2, 12, 12, 4, 2, 8
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k, v, ct = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, h), normal(b, t, n, h)
  mask = rng.random((b, n, t, s)) < 0.7
  mask[..., 0] = True
  valid = mask & np.tril(np.ones((t, s), bool))
  nan_q = q.copy()
  nan_q[NAN_ROW + (2,)] = np.nan
  q0, ct0 = q.copy(), ct.copy()
  q0[NAN_ROW], ct0[NAN_ROW] = 0.0, 0.0
  return (nan_q, k, v, ct, mask, valid), (q0, ct0)


def _nan_row_reach(shapes, valid) -> list[np.ndarray]:
  """Where out, dq, dk, dv must be NaN: the row's output and dq (but the NaN entry's own
  gradient, 0), and dk, dv of the keys it attends (of its kv head), every entry."""
  bi, ti, ni = NAN_ROW
  kv = ni // (shapes[0][2] // shapes[1][2])
  out, dq = np.zeros(shapes[0], bool), np.zeros(shapes[0], bool)
  out[bi, ti, ni] = dq[bi, ti, ni] = True
  dq[NAN_ROW + (2,)] = False
  dk = np.zeros(shapes[1], bool)
  dk[bi, valid[bi, ni, ti], kv] = True
  return [out, dq, dk, dk.copy()]


def _out_and_vjp(f, q, k, v, ct):
  out, vjp = jax.vjp(f, *(jnp.asarray(a) for a in (q, k, v)))
  return [np.asarray(x) for x in (out, *vjp(jnp.asarray(ct)))]


@pytest.mark.parametrize("implementation", ["dense", "blocked", "pallas"])
def test_a_nan_query_row_reaches_its_dq_and_its_keys_like_jax_nn(implementation):
  # Softmax. jax.nn itself makes every key of the row's kv head NaN (its dk and dv take
  # 0·NaN at masked pairs), so the reference is jax.nn without the row, which must agree with
  # everything the row does not reach.
  (q, k, v, ct, mask, valid), (q0, ct0) = _nan_row_case()
  got = _out_and_vjp(lambda q, k, v: core.attention(
      q, k, v, mask=mask, is_causal=True,
      implementation=core.Pallas(interpret=True) if implementation == "pallas"
      else implementation), q, k, v, ct)
  want = _out_and_vjp(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=jnp.asarray(mask), is_causal=True), q0, k, v, ct0)
  for name, g, w, nan in zip(("out", "dq", "dk", "dv"), got, want,
                             _nan_row_reach((q.shape, k.shape), valid), strict=True):
    np.testing.assert_array_equal(np.isnan(g), nan, err_msg=f"{name}: NaN where it reaches")
    _assert_close(g[~nan], w[~nan], TOL_DENSE["grad"], f"{name} vs jax.nn")


@pytest.mark.parametrize("implementation", ["dense", "blocked"])
@pytest.mark.parametrize("weighting", ROW_WEIGHTINGS)
def test_a_nan_query_row_reaches_its_dq_and_its_keys_in_every_whole_row_weighting(
    implementation, weighting):
  # The whole-row weightings (sparsemax's and entmax's derivative once hid the NaN: 0 on a
  # NaN row, or finite values in the streaming kernels), against the float64 brute force
  # without the row. The Pallas kernels are held to dense's NaN in test_pallas_rows.
  (q, k, v, ct, mask, valid), (q0, ct0) = _nan_row_case()
  got = _out_and_vjp(lambda q, k, v: core.attention(
      q, k, v, mask=mask, is_causal=True, weighting=weighting,
      implementation=core.Blocked(block_q=8, block_k=8) if implementation == "blocked"
      else implementation), q, k, v, ct)
  ref = ref_lib.reference(q0, k, v, weighting=weighting, mask=mask, is_causal=True,
                          cotangent=ct0)
  want = [ref.out, ref.grads["q"], ref.grads["k"], ref.grads["v"]]
  for name, g, w, nan in zip(("out", "dq", "dk", "dv"), got, want,
                             _nan_row_reach((q.shape, k.shape), valid), strict=True):
    np.testing.assert_array_equal(np.isnan(g), nan, err_msg=f"{name}: NaN where it reaches")
    _assert_close(g[~nan], w[~nan], TOL_DENSE["grad"], f"{name} vs the float64 reference")


# --------------------------------------------------------------------------------------------
# The weights themselves (dense only, whatever the implementation).
# --------------------------------------------------------------------------------------------

def test_nan_propagates_through_weights_like_jax_nn_softmax():
  scores = jnp.asarray([[0.0, 1.0, jnp.nan], [0.0, 1.0, 2.0], [jnp.nan, 0.0, 0.0]])
  where = jnp.asarray([[True, True, True], [True, True, True], [False, True, True]])
  for name in core.list_weightings():
    w = np.asarray(core.weights(scores, name, where=where))
    assert np.isnan(w[0]).all(), name  # NaN at a valid entry: the whole row
    assert not np.isnan(w[1:]).any(), name  # a masked NaN is never seen
  ref = np.asarray(jax.nn.softmax(scores[:2]))
  np.testing.assert_array_equal(np.isnan(ref), np.isnan(np.asarray(
      core.weights(scores[:2], "softmax"))))


@pytest.mark.parametrize("t,s", [(0, 5), (5, 0), (0, 0)])
def test_weights_of_empty_sequences(t, s):
  w = core.attention_weights(jnp.ones((2, t, 4, 8)), jnp.ones((2, s, 2, 8)),
                             weighting="sparsemax")
  assert w.shape == (2, 4, t, s)
  assert core.weights(jnp.ones((3, 0)), "softmax").shape == (3, 0)


def test_the_default_run_reaches_every_streaming_family():
  sample = [wlib.get_weighting(w) for w in cl.FAMILY_SAMPLE.values()]
  # Every whole-row streaming family of the library, and α-entmax's three solvers.
  rows = {w.stream.family for w in sample if isinstance(w, wlib.RowNormalizer)}
  assert rows == set(streaming.FAMILIES), set(streaming.FAMILIES) ^ rows
  entmax = {(w.stream.alpha, w.stream.renormalize) for w in sample
            if isinstance(w, wlib.RowNormalizer) and w.stream.family == "entmax"}
  assert {(2.0, False), (1.5, False)} < entmax and any(r for _, r in entmax), entmax
  # Every stream rule of a pointwise F (online max; sum, length and no normalization), and a
  # distance kernel.
  rules = {w.stream_rule for w in sample if isinstance(w, wlib.Pointwise)}
  assert rules >= {"online_max", "sum", "length", "none"}, rules
  assert any(isinstance(w, wlib.Pointwise) and w.distance_kernel for w in sample)
  # And every registered weighting's family.
  families = {cl.family(w) for w in core.list_weightings()}
  assert families <= set(cl.FAMILY_SAMPLE), families - set(cl.FAMILY_SAMPLE)
