"""Ring (context-parallel) attention, attnx.core.parallel.ring.

The multi-device checks run in a subprocess with 8 fake CPU devices
(tests/support/ring_check.py): the cases of its table this run selected (half on each end of
the JAX range, tests/support/legs.py) against the float64 brute force of the differential net.
The checks of arguments, of the layout helpers and of the load balance run here, on one device
(a ring of one).

Random draws (tests/support/ring_draws.py), as the differential net does for the other
implementations: the CI sample (every family × layout × causal once, the rest random; one
global length above 1000 that is no power of two; score modifications and sinks in several
families; dealt between the ends of the JAX range as the table) runs in one more subprocess;
the large run (``-m differential``) runs ``ATTNX_RING_DIFF_CASES`` (default 320) draws from seed
``ATTNX_RING_DIFF_FIRST`` (default 0) on, in subprocesses of :data:`_LARGE_CHUNK` draws, and
``ATTNX_RING_PALLAS_CASES`` (default 80) CI-sized ones with every step on the Pallas kernels;
``ATTNX_DIFF_KIND=row`` (or ``pointwise``) draws the weighting from one family only.
"""

from __future__ import annotations

import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import differential, legs, lowering, ring_cases, ring_draws
from support.scripts import script_result

from attnx import core
from attnx.core.parallel import layout, ring, steps

# max |got − ref| / scale (the differential net's scale: the largest Σ|terms| behind an entry,
# at least max |ref|), float32 ring against the float64 reference.
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


VMA = ring_cases.VMA  # ring_check.py runs ring_cases.VMA_CASES with check_vma=True too


PALLAS = ring_cases.PALLAS  # ring_check.py runs ring_cases.PALLAS_CASES on the Pallas kernels

TABLE_TEST = "test_ring_equals_float64_reference_on_8_devices"
# Cases the other tests of the table read, on either end of the JAX range.
READ_BY_NAME = ("sigmoid_none_causal", "softmax_alibi_sinks_zigzag_gqa", "learned_params",
                "learned_params" + VMA)


@functools.lru_cache(maxsize=4)
def _table_batch(names: tuple[str, ...]) -> dict:
  return script_result("ring_check.py", *names)


def _table_result(request: pytest.FixtureRequest, name: str) -> dict:
  """One case of the 8-device table. The cases this run selected (the table test is split by
  JAX end: this end's half, or what -k / -m chose) run together, in one subprocess for the
  XLA steps and one for the Pallas kernels (each process pays JAX's start and 8 devices once)."""
  chosen = {it.callspec.params["name"] for it in request.session.items
            if getattr(it, "originalname", None) == TABLE_TEST} | set(READ_BY_NAME) | {name}
  pallas = name.endswith(PALLAS)
  return _table_batch(tuple(sorted(n for n in chosen if n.endswith(PALLAS) == pallas)))[name]


@pytest.mark.split_by_jax
@pytest.mark.parametrize("name", list(ring_cases.CASES) + [n + VMA for n in ring_cases.VMA_CASES]
                         + [n + PALLAS for n in ring_cases.PALLAS_CASES]
                         + [pytest.param(n + PALLAS, marks=pytest.mark.exhaustive)
                            for n in ring_cases.PALLAS_EXHAUSTIVE])
def test_ring_equals_float64_reference_on_8_devices(name, request):
  # The XLA blocked kernel at every step, or (name + PALLAS) the Pallas kernels, in Pallas'
  # interpreter on these CPU devices.
  res = _table_result(request, name)
  errs = res["errors"]
  assert res["nonzero_out"] > 0.1, res  # the output is not trivially zero
  # Not vacuous: a good share of every array is compared (entries near a kink of F are not;
  # softpick couples a row, so a key is left out when any row that attends it has a score
  # near 0: with GQA and causal rows, most of dk).
  floor = {"k": 0.02} if name.startswith("softpick_causal_gqa") else {}
  for key, kept in res["kept"].items():
    assert kept >= floor.get(key, 0.3), (key, res["kept"])
  case = ring_cases.CASES[name.removesuffix(VMA).removesuffix(PALLAS)][0]
  expected = {"out", "q", "k", "v"} | ({"bias"} if case.bias else set())
  # A score modification's parameters and the sinks (replicated): their gradients too.
  expected |= {f"mod_{p}" for p in differential.mod_params(case)}
  expected |= {"residual"}  # the ring's return_residual, against support.reference.residual64
  assert set(errs) == expected, errs
  assert errs["out"] <= OUT_TOL, (name, errs)
  for key in expected - {"out"}:
    assert errs[key] <= GRAD_TOL, (name, key, errs)


def test_sigmoid_uses_the_global_length(request):
  # sigmoid:normalization=none has b = −log S: the answer with the shard's S/P is far off.
  res = _table_result(request, "sigmoid_none_causal")
  assert res["errors"]["out"] <= OUT_TOL
  assert res["shard_length_error"] > 1e-2, res


@pytest.mark.parametrize("name", ["learned_params", "learned_params" + VMA])
def test_learned_ssmax_s_scale_and_score_parameter_gradients(name, request):
  # Replicated parameters: with check_vma=False shard_map's transpose sums their gradients
  # over the devices, with check_vma=True the ring's backward does.
  res = _table_result(request, name)
  assert res["s"] <= GRAD_TOL, res
  assert res["scale"] <= GRAD_TOL, res  # against the float64 reference's central difference
  assert res["bilinear_W"] <= GRAD_TOL, res  # against the float32 dense implementation


def test_score_mods_at_global_positions(request):
  # The ALiBi case is not vacuous: with the positions local to each step's block (the
  # kernels' own) its output is far from the reference.
  res = _table_result(request, "softmax_alibi_sinks_zigzag_gqa")
  assert res["errors"]["out"] <= OUT_TOL
  assert res["local_positions_error"] > 1e-2, res


def test_case_table_covers_every_score_mod_and_sinks():
  cases = [ring_cases.CASES[n] for n in ring_cases.MOD_CASES]
  assert {c.score_mod for c, _ in cases} >= {"cap", "alibi", "table", "fn"}
  families = {steps.family_of(core.get_weighting(c.weighting)) for c, _ in cases}
  assert families == {"pointwise", "ssmax", "softpick", "stick_breaking"}, families
  assert {c.weighting.partition(":")[0] for c, _ in cases if c.sinks} >= {
      "softmax", "sigmoid", "ssmax", "softpick"}
  assert {"sigmoid:normalization=none"} <= {c.weighting for c, _ in cases}
  assert {(c.causal, lay) for c, lay in cases} >= {
      (False, "contiguous"), (True, "contiguous"), (True, "zigzag")}
  # GQA in passes over the heads (the global head of a pass), and check_vma=True (the
  # parameters' gradients summed over the devices by the ring).
  assert any(n in ring_cases.PASSES and ring_cases.CASES[n][0].kh < ring_cases.CASES[n][0].n
             for n in ring_cases.MOD_CASES)
  assert any(n in ring_cases.VMA_CASES for n in ring_cases.MOD_CASES)


def test_case_table_covers_every_streamable_weighting():
  names = {ring_cases.CASES[c][0].weighting.partition(":")[0] for c in ring_cases.CASES}
  for name in core.list_weightings():
    w = core.get_weighting(name)
    if w.kind == "pointwise" or w.stream_rule in ("ssmax", "softpick", "stick_breaking"):
      assert name in names, name
  layouts = {(c.causal, layout) for c, layout in ring_cases.CASES.values()}
  assert layouts == {(False, "contiguous"), (False, "zigzag"), (True, "contiguous"),
                     (True, "zigzag")}


# --------------------------------------------------------------------------------------------
# Random draws: the differential net's random sample for the ring.
# --------------------------------------------------------------------------------------------

DRAW_TEST = "test_random_draw_equals_float64_reference"


@functools.lru_cache(maxsize=2)
def _ci_batch(indices: tuple[int, ...]) -> dict:
  return script_result("ring_check.py", "--ci", "--only", ",".join(map(str, indices)))


def _ci_draws(request: pytest.FixtureRequest, index: int | None = None) -> dict:
  """The CI sample's results, by seed, of the draws this run selected (the draw test is split
  by JAX end: this end's part, or what -k / -m chose; ``index``'s draw too), run together in
  one subprocess (it pays JAX's start and 8 devices once)."""
  chosen = {it.callspec.params["index"] for it in request.session.items
            if getattr(it, "originalname", None) == DRAW_TEST}
  if index is not None:
    chosen.add(index)
  if not chosen:  # the coverage test alone: this end's part of the draws
    chosen = {i for i in range(ring_draws.CI_DRAWS) if f"{DRAW_TEST}[{i}]" in this_end_draws()}
  return _ci_batch(tuple(sorted(chosen)))


def this_end_draws() -> set[str]:
  """The draw test's case names (``name[index]``) that this end of the JAX range runs."""
  return {i.split("::")[-1] for i in legs.this_end(
      f"tests/core/test_ring.py::{DRAW_TEST}[{i}]" for i in range(ring_draws.CI_DRAWS))}


def _failures(results: dict) -> list[str]:
  return [f"{r['label']}\n  {r['failure']}\n{r.get('traceback', '')}"
          for r in results.values() if r["failure"] is not None]


@pytest.mark.split_by_jax
@pytest.mark.parametrize("index", range(ring_draws.CI_DRAWS))
def test_random_draw_equals_float64_reference(index, request):
  res = _ci_draws(request, index)[str(ring_draws.CI_FIRST + index)]
  assert res["failure"] is None, _failures({index: res})
  assert set(res["errors"]) >= {"out", "q", "k", "v"}, res


def test_random_ci_sample_reaches_every_branch(request):
  # What the CI sample must reach: the draws are seeded, this holds them to it.
  draws = ring_draws.ci_sample()
  cov = ring_draws.coverage(draws)
  assert cov["family_layout_causal"] == {
      (f, layout, causal) for f in steps.FAMILIES for layout in ring.LAYOUTS
      for causal in (False, True)}
  assert cov["devices"] >= {2, 8}
  assert cov["mask"] == {"none", "travel", "rows", "const"}
  assert cov["bias"] == {"none", "travel", "rows", "const"}
  for key in ("gqa", "capped", "t_ne_s", "learned_s", "odd_head_dim", "passes"):
    assert cov[key] == {False, True}, key
  assert cov["batch"] == {1, 2}
  assert True in cov["long_not_pow2"]  # a global length ≥ 1000 that is no power of two
  assert any(d.local[0] % 2 for d in draws)  # an odd shard length
  # Score modifications and sinks (support.differential's kinds), in several families, one
  # with SSMax's learned s (the reference one head at a time).
  assert {"cap", "alibi"} <= cov["score_mod"] and cov["score_mod"] & {"table", "fn"}
  assert len({f for f, mod in cov["family_score_mod"] if mod != "none"}) >= 3
  assert cov["sinks"] == {False, True} and len(cov["family_sinks"]) >= 2
  assert True in cov["learned_s_mod"]
  # The draws compare something: outputs that are not all zero, most entries kept (of the
  # draws this run ran: on each end of the JAX range in CI its part of them).
  res = _ci_draws(request)
  assert sum(r["nonzero_out"] > 0.1 for r in res.values()) >= len(res) - 2
  kept = [{key: x for key, x in r["kept"].items() if not key.startswith("mod_")}
          for r in res.values()]
  assert np.mean([min(k.values()) for k in kept]) > 0.5
  # The parameters' gradients are compared (a kink of F anywhere leaves them out) in some.
  for name in ("mod_slopes", "mod_table", "mod_sinks"):
    assert any(r["kept"].get(name, 0.0) == 1.0 for r in res.values()), name


def test_large_run_draws_reach_every_weighting_and_length():
  draws = ring_draws.large_sample(0, 320)
  cov = ring_draws.coverage(draws)
  assert cov["weighting"] >= set(ring_draws.streamable_weightings())
  for name in core.list_weightings():  # every weighting the ring runs is in the pool
    w = core.get_weighting(name)
    if w.kind == "pointwise" or w.stream_rule in ("ssmax", "softpick", "stick_breaking"):
      assert name in cov["weighting"], name
  assert cov["devices"] == set(ring_draws.DEVICE_COUNTS)
  assert {(d.family, d.layout, d.case.causal, d.devices) for d in draws} == {
      (f, layout, causal, p) for f in steps.FAMILIES for layout in ring.LAYOUTS
      for causal in (False, True) for p in ring_draws.DEVICE_COUNTS}
  lengths = [d.case.t for d in draws]
  assert max(lengths) >= 3000 and sum(t >= 1000 and t & (t - 1) for t in lengths) >= 30
  # Every score modification in every family; sinks in each family that takes them.
  assert cov["family_score_mod"] == {(f, mod) for f in steps.FAMILIES
                                     for mod in ("none", "cap", "alibi", "table", "fn")}
  assert cov["family_sinks"] == set(steps.FAMILIES) - {"stick_breaking"}
  assert cov["learned_s_mod"] == {False, True}
  # The draws on the Pallas steps: caps, ALiBi, tables and sinks, no user's score_mod
  # function (refused there).
  pallas = ring_draws.coverage(ring_draws.large_sample(0, 80, pallas=True))
  assert pallas["score_mod"] == {"none", "cap", "alibi", "table"}, pallas["score_mod"]
  assert pallas["sinks"] == {False, True}


_LARGE_FIRST = int(os.environ.get("ATTNX_RING_DIFF_FIRST", "0"))
_LARGE_COUNT = int(os.environ.get("ATTNX_RING_DIFF_CASES", "320"))
_LARGE_CHUNK = 10  # draws per subprocess (each starts JAX with 8 devices: ~3 s)
_KIND = os.environ.get("ATTNX_DIFF_KIND") or None


@pytest.mark.differential
@pytest.mark.parametrize("chunk", range(-(-_LARGE_COUNT // _LARGE_CHUNK)))
def test_random_draws_large_run(chunk):
  first = _LARGE_FIRST + chunk * _LARGE_CHUNK
  count = min(_LARGE_CHUNK, _LARGE_FIRST + _LARGE_COUNT - first)
  kind = ("--kind", _KIND) if _KIND else ()
  res = script_result("ring_check.py", "--random", str(count), "--seed", str(first), *kind,
                    timeout=3600)
  assert len(res) == count
  failures = _failures(res)
  assert not failures, "\n".join(failures)


_PALLAS_COUNT = int(os.environ.get("ATTNX_RING_PALLAS_CASES", "80"))


@pytest.mark.differential
@pytest.mark.parametrize("chunk", range(-(-_PALLAS_COUNT // _LARGE_CHUNK)))
def test_random_draws_on_pallas_steps_large_run(chunk):
  # The same net with every ring step on the Pallas kernels (Pallas' interpreter: CI-sized
  # draws), seeds from ATTNX_RING_DIFF_FIRST on.
  first = _LARGE_FIRST + chunk * _LARGE_CHUNK
  count = min(_LARGE_CHUNK, _LARGE_FIRST + _PALLAS_COUNT - first)
  res = script_result("ring_check.py", "--random", str(count), "--seed", str(first),
                      "--pallas", timeout=3600)
  assert len(res) == count
  failures = _failures(res)
  assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------------------
# Load balance.
# --------------------------------------------------------------------------------------------

def test_ring_work_zigzag_balances_causal_work():
  for p in (2, 3, 4, 8, 16):
    contiguous = ring.ring_work(p, "contiguous", True)
    zigzag = ring.ring_work(p, "zigzag", True)
    full = ring.ring_work(p, "contiguous", False)
    # The causal triangle is half the full square: T²/2 = (2P)²/2 chunk tiles in all.
    assert contiguous.sum() == zigzag.sum() == full.sum() / 2 == (2 * p) ** 2 / 2
    assert zigzag.max() <= 1.1 * zigzag.mean()
    np.testing.assert_allclose(contiguous, 4 * np.arange(p) + 2)
    assert contiguous.max() >= (2 - 1 / p) * contiguous.mean() - 1e-9
    np.testing.assert_allclose(full, 4 * p)


def test_ring_work_counts_the_kernels_steps():
  # The table the kernel runs: contiguous causal skips the shards of later devices, zigzag
  # runs half a shard on every step.
  p = 4
  kinds = [[int(layout.step_kind(i, (i - r) % p, "contiguous", True, np)) for r in range(p)]
           for i in range(p)]
  assert kinds[0] == [layout.DIAG, layout.SKIP, layout.SKIP, layout.SKIP]
  assert kinds[3] == [layout.DIAG, layout.FULL, layout.FULL, layout.FULL]
  zz = [int(layout.step_kind(1, (1 - r) % p, "zigzag", True, np)) for r in range(p)]
  assert zz == [layout.ZZ_DIAG, layout.ZZ_LOW, layout.ZZ_HIGH, layout.ZZ_HIGH]


# --------------------------------------------------------------------------------------------
# The zigzag layout.
# --------------------------------------------------------------------------------------------

def test_ring_work_counts_the_steps_a_structured_mask_skips():
  # 8 devices of 24 positions: a 21-key causal window meets the device's own shard and the one
  # before it; 4 documents of 48 positions (2 shards each) meet 1 or 2 shards (contiguous), but
  # every zigzag device holds a chunk of the first and of the last document.
  window = core.masks.sliding_window(20, 0)
  assert list(core.ring_work(8, "contiguous", mask=window, length=192)) == [2] + [6] * 7
  ids = np.repeat(np.arange(4), 48)[None]
  docs = core.masks.segment_ids(ids)
  assert list(core.ring_work(8, "contiguous", mask=docs, length=192)) == [2, 6] * 4
  assert list(core.ring_work(8, "zigzag", mask=docs, length=192)) == [8] * 8
  assert list(core.ring_work(8, "contiguous", False, mask=docs, length=192)) == [8] * 8
  with pytest.raises(ValueError, match="sequence length"):
    core.ring_work(8, mask=window)


def test_zigzag_permute_roundtrip_and_order():
  x = jnp.arange(24).reshape(2, 12, 1)
  z = ring.zigzag_permute(x, 3)
  # 6 chunks of 2: device 0 holds chunks 0 and 5, device 1 chunks 1 and 4, device 2 2 and 3.
  np.testing.assert_array_equal(z[0, :, 0], [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7])
  np.testing.assert_array_equal(ring.zigzag_unpermute(z, 3), x)
  m = jnp.arange(24).reshape(1, 1, 2, 12)
  np.testing.assert_array_equal(ring.zigzag_unpermute(ring.zigzag_permute(m, 2, -1), 2, -1), m)
  with pytest.raises(ValueError, match="2·P = 6 chunks"):
    ring.zigzag_permute(jnp.zeros((1, 10)), 3)


def test_zigzag_positions_match_the_permutation():
  p, t = 4, 6
  perm = np.asarray(ring.zigzag_permute(jnp.arange(p * t)[None], p))[0]
  got = np.concatenate([layout.positions(i, t, p, "zigzag", np) for i in range(p)])
  np.testing.assert_array_equal(got, perm)


# --------------------------------------------------------------------------------------------
# One device: a ring of one, and the argument checks.
# --------------------------------------------------------------------------------------------

def _one_device(fn, *args):
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  # One device: every array is its own shard (the axis "sp" is bound, of size 1).
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(P() for _ in args), out_specs=P(),
                       check_vma=False)(*args)


def _qkv(t=16, n=2, kh=1, h=8):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((1, t, n, h)), jnp.float32),
          jnp.asarray(rng.standard_normal((1, t, kh, h)), jnp.float32),
          jnp.asarray(rng.standard_normal((1, t, kh, h)), jnp.float32))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("weighting,layout", [("softmax", "zigzag"), ("ssmax", "contiguous"),
                                              ("stick_breaking", "zigzag")])
def test_ring_of_one_equals_attention(weighting, layout):
  q, k, v = _qkv(n=4, kh=2)
  got = _one_device(lambda q, k, v: ring.ring_attention(
      q, k, v, axis_name="sp", weighting=weighting, is_causal=True, layout=layout), q, k, v)
  want = core.attention(q, k, v, weighting=weighting, is_causal=True, implementation="dense")
  np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.exhaustive  # CI: the case table's PASSES on 8 devices, against float64
def test_kv_heads_in_passes_equal_one_pass():
  # Three passes of one kv head (two query heads each) against one pass of all three, with a
  # per-head bias: values and gradients. (Every family, broadcast biases and 8 devices: the
  # case table's PASSES and the random draws, against the float64 reference.)
  q, k, v = _qkv(t=16, n=6, kh=3)
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, 6, 16, 16)), jnp.float32)
  mask = jnp.arange(16)[None, None, None, :] < 13

  def run(block):
    def loss(q, k, v, b):
      out = ring.ring_attention(q, k, v, b, mask, axis_name="sp", weighting="stick_breaking",
                                is_causal=True, layout="zigzag", kv_head_block=block)
      return jnp.sum(out * jnp.cos(out)), out
    return _one_device(lambda *a: jax.grad(loss, (0, 1, 2, 3), has_aux=True)(*a), q, k, v,
                       bias)

  (g1, out1), (g3, out3) = run(1), run(3)
  np.testing.assert_allclose(out1, out3, atol=1e-6)
  for a, c in zip(g1, g3, strict=True):
    np.testing.assert_allclose(a, c, atol=1e-5)


def test_default_passes_keep_a_pass_within_the_budget():
  # kv heads per pass: all of them for short shards, one for a 64k/8 shard of 8 heads.
  assert ring._kv_heads_per_pass(None, 1, 8, 1, 256, 64) == 8
  assert ring._kv_heads_per_pass(None, 1, 8, 1, 8192, 64) == 1
  assert ring._kv_heads_per_pass(None, 1, 6, 2, 1024, 64) == 3  # the most that divide K
  assert ring._kv_heads_per_pass(2, 1, 8, 1, 8192, 64) == 2


@pytest.mark.parametrize("platform,weighting", [("cuda", "softmax"), ("tpu", "sigmoid"),
                                               ("cuda", "stick_breaking"), ("tpu", "ssmax")])
def test_pallas_ring_lowers_for_gpu_and_tpu(platform, weighting):
  # The ring's fwd+bwd on the Pallas kernels, lowered for a chip from this CPU host: one
  # custom call per kernel (forward, dQ, dK/dV), Triton or Mosaic, nothing else.
  x = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  backend = {"cuda": "gpu", "tpu": "tpu"}[platform]

  def loss(q, k, v):
    out = ring.ring_attention(q, k, v, axis_name="sp", weighting=weighting, is_causal=True,
                              layout="zigzag", implementation="pallas", pallas_backend=backend)
    return jnp.sum(out.astype(jnp.float32))

  mesh = lowering.chip_mesh(platform, (1,), ("sp",))
  grads = jax.shard_map(jax.grad(loss, (0, 1, 2)), mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                        out_specs=(P(None, "sp"),) * 3, check_vma=False)
  text = jax.jit(grads).trace(x, kv, kv).lower(lowering_platforms=(platform,)).as_text()
  family = None if weighting in ("softmax", "sigmoid") else weighting
  target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
  calls = re.findall(r"custom_call @([\w.$]+)", text)
  assert set(calls) == {target}, calls
  assert set(re.findall(r"attnx_pallas_(?:rows_)?(fwd|dq|dkv|dk|dv)\b", text)) == (
      lowering.expected_kernels(platform, "bfloat16", 64, 64, family))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_ring_alibi_lowers(backend):
  # ALiBi on the Pallas steps (zigzag: each step's pieces split into their chunks): lowered
  # for the chip, its kernels' custom calls only (each block's relative table is built outside
  # the kernels).
  x = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  platform, target = {"gpu": ("cuda", "__gpu$xla.gpu.triton"),
                      "tpu": ("tpu", "tpu_custom_call")}[backend]
  mesh = lowering.chip_mesh(platform, (1,), ("sp",))

  def loss(q, k, v, slopes):
    out = ring.ring_attention(q, k, v, axis_name="sp", is_causal=True, layout="zigzag",
                              implementation="pallas", pallas_backend=backend,
                              score_mod=core.alibi(slopes))
    return jnp.sum(out.astype(jnp.float32))

  grads = jax.shard_map(jax.grad(loss, (0, 3)), mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                        out_specs=(P(None, "sp"), P()), check_vma=False)
  traced = lambda: jax.jit(grads).trace(x, kv, kv, jax.ShapeDtypeStruct((4,), jnp.float32))
  text = traced().lower(lowering_platforms=(platform,)).as_text()
  assert set(re.findall(r"custom_call @([\w.$]+)", text)) == {target}


def test_pallas_ring_refusals():
  q, k, v = _qkv(n=4, kh=2)
  with pytest.raises(ValueError, match="needs a GPU or TPU.*interpret=True"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp",
                                                    implementation="pallas"), q, k, v)
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  with pytest.raises(ValueError, match="check_vma=True.*use check_vma=False"):
    jax.shard_map(lambda q, k, v: ring.ring_attention(
        q, k, v, axis_name="sp", implementation=core.Pallas(interpret=True)), mesh=mesh,
        in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"), check_vma=True)(q, k, v)
  # The automatic choice on this CPU host: the blocked kernel (no Pallas custom call).
  text = jax.jit(lambda q, k, v: _one_device(lambda q, k, v: ring.ring_attention(
      q, k, v, axis_name="sp"), q, k, v)).lower(q, k, v).as_text()
  assert "custom_call" not in text


def test_ring_of_one_bf16_gqa_bias_padding_mask():
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(t=32, n=4, kh=2))
  bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 32, 32)), jnp.float32)
  mask = jnp.arange(32)[None, None, None, :] < 27
  got = _one_device(lambda q, k, v, b, m: ring.ring_attention(
      q, k, v, b, m, axis_name="sp", weighting="softpick", layout="zigzag", is_causal=True),
      q, k, v, bias, mask)
  want = core.attention(q, k, v, bias, mask, weighting="softpick", is_causal=True,
                        implementation="blocked")
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)


def test_ring_of_one_batch_dims_empty_and_masked_nan():
  rng = np.random.default_rng(2)
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v = x(2, 3, 16, 2, 8), x(2, 3, 16, 1, 8), x(2, 3, 16, 1, 4)
  mask = jnp.arange(16)[None, None, None, None, :] < jnp.asarray([9, 16, 0])[None, :, None,
                                                                            None, None]
  k = k.at[:, :, 12].set(jnp.nan)  # a key no row of batch (·, 0) attends
  got = _one_device(lambda q, k, v, m: ring.ring_attention(
      q, k, v, None, m, axis_name="sp", weighting="relu:normalization=length",
      is_causal=True), q, k, v, mask)
  want = core.attention(q, k, v, mask=mask, weighting="relu:normalization=length",
                        is_causal=True, implementation="dense")
  assert got.shape == (2, 3, 16, 2, 4)
  np.testing.assert_allclose(got[:, 0], want[:, 0], atol=2e-6)  # finite: NaN key masked
  np.testing.assert_array_equal(got[:, 2], 0.0)  # no valid key: zeros
  empty = _one_device(lambda q: ring.ring_attention(q, q, q, axis_name="sp"), q[:, :, :0])
  assert empty.shape == (2, 3, 0, 2, 8)


def test_outside_shard_map_or_unknown_axis_raises():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="inside jax.shard_map.*'sp'"):
    ring.ring_attention(q, k, v, axis_name="sp")
  with pytest.raises(ValueError, match="axis named 'seq'"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="seq"), q, k, v)


def test_check_vma_true_on_one_device():
  q, k, v = _qkv(n=4, kh=2)
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  got = jax.shard_map(lambda q, k, v: ring.ring_attention(
      q, k, v, axis_name="sp", weighting="stick_breaking", is_causal=True, layout="zigzag"),
      mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"), check_vma=True)(q, k, v)
  want = core.attention(q, k, v, weighting="stick_breaking", is_causal=True,
                        implementation="dense")
  np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("weighting", ["sparsemax", "entmax15", "entmax:alpha=1.3"])
def test_entmax_family_refused_with_the_alternative(weighting):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"(?s)cannot run ring-parallel.*all_gather.*"
                                       r"attnx\.core\.attention.*streamable weighting"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp",
                                                    weighting=weighting), q, k, v)


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="striped"), "Unknown layout 'striped'"),
    (dict(implementation="dense"), re.escape("implementation must be None, 'blocked' or "
                                             "'pallas' (or core.Blocked(...), core.Pallas(...)), "
                                             "got 'dense'.")),
    (dict(implementation=core.Dense()), r"implementation must be None, .*got 'dense'\."),
    (dict(implementation="foo"), r"Unknown implementation 'foo'; valid: dense, blocked, "
                                 r"split_kv, pallas, an implementation object .* or None "
                                 r"\(automatic\)\."),
    (dict(score="additive"), "not a dot product"),
    (dict(block_q=0), "block_q must be a positive int"),  # deprecated: refused before it warns
    (dict(kv_head_block=3), "kv_head_block must be a positive int dividing the 2 kv heads"),
    (dict(weighting="nope"), "Unknown weighting 'nope'"),
    # Score modifications and sinks: attention()'s checks.
    (dict(sinks=np.zeros(3, np.float32)), re.escape("sinks must be a float array [N] = [4]")),
    (dict(sinks=np.zeros((1, 4), np.float32)), re.escape("sinks must be a float array [N]")),
    (dict(sinks=np.zeros(4, np.int32)), "sinks must be a float array"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap must be a positive finite number"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be a positive finite number"),
    (dict(score_mod_params={"a": np.ones(2, np.float32)}),
     "score_mod_params were given without a score_mod"),
    (dict(score_mod=lambda s, b, h, i, j, p: s[..., :1], score_mod_params={}),
     "score_mod must return scores of the shape"),
    (dict(weighting="stick_breaking", sinks=np.zeros(4, np.float32)),
     "stick-breaking leaves the stick"),
    (dict(weighting="relu:normalization=length", sinks=np.zeros(4, np.float32)),
     "divides by no sum of weights"),
    # The ring's Pallas steps take a cap, ALiBi, tables and sinks, not a user's score_mod
    # function: a ValueError naming it.
    (dict(implementation="pallas", interpret=True, score_mod=lambda s, b, h, i, j, p: s,
          score_mod_params={}),
     "Pallas steps run logits_soft_cap, ALiBi .*not a user's score_mod function"),
    (dict(implementation=core.Pallas(interpret=True), logits_soft_cap=1.0,
          score_mod=lambda s, b, h, i, j, p: s),
     "Pallas steps run .*not a user's score_mod function; use the XLA steps"),
])
def test_bad_arguments_raise(kwargs, match):
  q, k, v = _qkv(n=4, kh=2)
  if kwargs.get("score") == "additive":
    kwargs["score_params"] = {"Wq": jnp.ones((8, 4)), "Wk": jnp.ones((8, 4)), "v": jnp.ones(4)}
  with pytest.raises(ValueError, match=match):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", **kwargs),
                q, k, v)


def test_pallas_steps_declined_for_score_mods_and_sinks():
  # The automatic choice takes the XLA steps for a call with a cap, a score_mod or sinks,
  # also where it would take Pallas otherwise (a GPU's kernels).
  from attnx.core.implementations import RingProblem
  w = core.get_weighting("softmax")
  for mods in (("logits_soft_cap",), ("score_mod",), ("sinks",)):
    why = core.Pallas().ring_declines(RingProblem(w, jnp.float32, 64, 64, backend="gpu",
                                                  modifications=mods))
    assert why is not None and mods[0] in why
  assert core.Blocked().ring_reason(RingProblem(w, jnp.float32, 64, 64,
                                                modifications=("sinks",))) is None


# The 8-device cases (ring_cases) run every family with them in CI; one device: -m exhaustive.
@pytest.mark.exhaustive
def test_ring_of_one_with_score_mods_and_sinks():
  # One device (every step the diagonal): the cap, ALiBi and the sinks as attention applies
  # them, and their gradients (the 8-device cases above cover every family and layout).
  weighting, layout = "softmax", "zigzag"
  q, k, v = _qkv(n=4, kh=2)
  slopes = core.alibi_slopes(4)
  sinks = jnp.asarray([0.5, 1.0, 2.0, 3.0])

  def loss(fn, q, k, v, slopes, sinks):
    return jnp.sum(fn(q, k, v, slopes, sinks) ** 2)

  ring_fn = lambda q, k, v, slopes, sinks: _one_device(
      lambda q, k, v, slopes, sinks: ring.ring_attention(
          q, k, v, axis_name="sp", weighting=weighting, is_causal=True, layout=layout,
          logits_soft_cap=2.0, score_mod=core.alibi(slopes), sinks=sinks),
      q, k, v, slopes, sinks)
  dense_fn = lambda q, k, v, slopes, sinks: core.attention(
      q, k, v, weighting=weighting, is_causal=True, implementation="dense",
      logits_soft_cap=2.0, score_mod=core.alibi(slopes), sinks=sinks)
  got = jax.grad(functools.partial(loss, ring_fn), (0, 1, 2, 3, 4))(q, k, v, slopes, sinks)
  want = jax.grad(functools.partial(loss, dense_fn), (0, 1, 2, 3, 4))(q, k, v, slopes, sinks)
  np.testing.assert_allclose(ring_fn(q, k, v, slopes, sinks), dense_fn(q, k, v, slopes, sinks),
                             atol=2e-6)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)


def test_shapes_that_do_not_split_raise():
  q, k, v = _qkv(t=16)
  with pytest.raises(ValueError, match="T = S"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k[:, :8], v[:, :8], axis_name="sp",
                                                    is_causal=True), q, k, v)
  q, k, v = _qkv(t=15)
  with pytest.raises(ValueError, match="must be even"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                                    layout="zigzag"), q, k, v)
  q, k, v = _qkv(t=15)
  with pytest.raises(ValueError, match="stick_breaking in the zigzag layout.*15 must be even"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", layout="zigzag",
                                                    weighting="stick_breaking"), q, k, v)
  q, k, v = _qkv(t=257)  # prime: the unpadded blocks would run tiles of one row
  with pytest.raises(ValueError, match="tiles of 1: use local lengths.*multiples of 8"):
    _one_device(lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp"), q, k, v)
  # Bias/mask shardings (local shapes) that are none of the documented ones.
  with pytest.raises(ValueError, match="travels around the ring"):
    steps.kind_of(jnp.zeros((1, 1, 4, 3)), 4, 3, 2, "bias")
  with pytest.raises(ValueError, match="S axis must be 1, the local key length 3"):
    steps.kind_of(jnp.zeros((1, 1, 1, 5)), 4, 3, 2, "mask")
  with pytest.raises(ValueError, match="T axis must be 1 or the local query length 4"):
    steps.kind_of(jnp.zeros((1, 1, 2, 1)), 4, 3, 2, "mask")
  assert [steps.kind_of(jnp.zeros(s), 4, 3, 2, "b") for s in
          ((1, 1, 4, 1), (1, 1, 1, 3), (1, 1, 4, 6))] == ["const", "travel", "rows"]
  # One key per device: a key padding mask's local S axis is 1, as a broadcast one's; both
  # are right travelling with the keys (the large run's seed 132 read it as broadcast: every
  # key got the local key's mask). A T axis means the S axis is broadcast.
  assert [steps.kind_of(jnp.zeros(s), 4, 1, 2, "b") for s in
          ((1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 4, 2))] == ["travel", "const", "rows"]
  # One query and one key per device: [.., 1, 1] may be sharded with either (seeds 352, 509
  # vs 431, 481 of the large run need different rings): refused, unless the ring has one device.
  with pytest.raises(ValueError, match=r"one query and one key per device.*whole S axis \(2\)"):
    steps.kind_of(jnp.zeros((1, 4, 1, 1)), 1, 1, 2, "mask")
  assert steps.kind_of(jnp.zeros((1, 4, 1, 2)), 1, 1, 2, "b") == "rows"
  assert steps.kind_of(jnp.zeros((1, 4, 1, 1)), 1, 1, 1, "b") == "const"


def test_ring_attention_is_exported():
  assert core.ring_attention is ring.ring_attention
  assert not math.isnan(float(ring.ring_work(2).sum()))


# --------------------------------------------------------------------------------------------
# Memory: the point of the custom VJP.
# --------------------------------------------------------------------------------------------

@pytest.mark.split_by_jax
@pytest.mark.slow
@pytest.mark.parametrize("weighting,causal", [
    ("softmax", True), ("ssmax", True), ("stick_breaking", True), ("softmax", False)])
def test_ring_scratch_per_device_at_64k(weighting, causal):
  # XLA's temp bytes of fwd+bwd at T = 65 536 (B = 1, N = 8, H = 64) over 8 devices, per
  # device, against the single-device blocked kernel's: compiled, not run. The target
  # is 1/6. Measured 0.014, 0.067, 0.137 (zigzag: the four later runs' states are saved) and
  # 0.094. In one pass of all 8 heads (kv_head_block=8) the ring holds about 12 buffers of a
  # shard's size against the single-device kernel's 6.3 of the whole sequence: 0.24 without
  # causal masking, over the target.
  res = script_result("ring_memory.py", "65536", weighting, str(int(causal)))
  assert res["ratio"] <= 1 / 6, res


@pytest.mark.slow
def test_ring_scratch_with_packed_documents_holds_no_rows_by_keys_block():
  # 16 packed documents and a 1024-key window (segment ids of the whole sequence) at
  # T = 65 536 over 8 devices: each step evaluates its [t, s] block, so a device never holds
  # its rows against every key ([8192, 65536] booleans, 0.5 GiB, which alone the ring held
  # before: 0.69 GB per device then, 0.15 GB now; 0.08 GB without a mask).
  res = script_result("ring_memory.py", "65536", "softmax", "1", "contiguous", "1")
  assert res["ring_temp_bytes_per_device"] < (65536 // 8) * 65536, res
  assert res["ratio"] <= 1 / 5, res
