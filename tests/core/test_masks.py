"""Structured masks (attnx.core.masks) and jax.nn's mask keywords: each mask against a numpy
formula, the tile metadata against the materialized mask, attention against
jax.nn.dot_product_attention, the blocked kernel's per-tile evaluation against a float64 dense
brute force, and the errors of bad input."""

import collections
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import core
from attnx.core import masks
from attnx.core.kernels import pallas as pallas_lib

B, N, K, H = 2, 4, 2, 8


def _ids(rng, b, length, docs=4):
  """Sorted document ids with padding (-1) first, as a packer lays them out."""
  return np.sort(rng.integers(-1, docs, (b, length)), axis=1).astype(np.int32)


def _formulas(t, s, rng):
  """(mask, its [B|1, N|1, T, S] boolean formula) for every kind of mask."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  qi, ki = _ids(rng, B, t), _ids(rng, B, s)
  seg = np.stack([(qi[b][:, None] == ki[b][None]) & (qi[b][:, None] >= 0) for b in range(B)])
  lq, lk = np.array([t, t // 2], np.int32), np.array([0, max(s - 3, 0)], np.int32)
  cases = {
      "causal": (masks.causal(), j <= i),
      "window": (masks.sliding_window(5, 2), (j >= i - 5) & (j <= i + 2)),
      "window0": (masks.sliding_window(0, 0), j == i),
      "chunked": (masks.chunked_causal(8), (j <= i) & (j // 8 == i // 8)),
      "prefix": (masks.prefix_lm(np.array([3, 10])),
                 np.stack([(j < p) | (j <= i) for p in (3, 10)])[:, None]),
      "segments": (masks.segment_ids(qi, ki), seg[:, None]),
      "lengths": (masks.seq_lengths(lq, lk),
                  np.stack([(i < a) & (j < c) for a, c in zip(lq, lk, strict=True)])[:, None]),
      "mask_mod": (masks.from_fn(lambda b, h, q, k: (q + 2 * k + h) % 5 != 0),
                   np.stack([(i + 2 * j + h) % 5 != 0 for h in range(N)])[None]),
  }
  cases["and"] = (cases["window"][0] & cases["segments"][0],
                  cases["window"][1] & cases["segments"][1])
  cases["or"] = (cases["prefix"][0] | cases["chunked"][0], cases["prefix"][1] | cases["chunked"][1])
  return cases


@pytest.mark.parametrize("t, s", [(37, 45), (64, 64)])
def test_each_mask_is_its_formula(t, s):
  for name, (mask, formula) in _formulas(t, s, np.random.default_rng(t)).items():
    got = masks.materialize(mask.bind((B,), N, t, s), (B,), N, t, s)
    np.testing.assert_array_equal(np.broadcast_to(got, (B, N, t, s)),
                                  np.broadcast_to(formula, (B, N, t, s)), err_msg=name)


@pytest.mark.parametrize("bq, bk", [(8, 16), (5, 7), (16, 8), (1, 1)])
@pytest.mark.split_by_jax
def test_tile_metadata_never_skips_a_valid_pair(bq, bk):
  """some = False only for tiles without a valid pair; every = True only where all are."""
  t, s = 37, 45
  nq, nk = -(-t // bq), -(-s // bk)
  for name, (mask, _) in _formulas(t, s, np.random.default_rng(3)).items():
    bound = mask.bind((B,), N, t, s)
    dense = np.broadcast_to(masks.materialize(bound, (B,), N, t, s), (B, N, t, s))
    some, every = (np.broadcast_to(x, (B, N, nq, nk)) for x in bound.block_table(bq, bk, nq, nk))
    for i, j in itertools.product(range(nq), range(nk)):
      tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      assert not np.any(~some[..., i, j] & tile.any((-2, -1))), (name, i, j)
      assert not np.any(every[..., i, j] & ~tile.all((-2, -1))), (name, i, j)
    # The analytic bounds are tight on tiles inside T and S: causal, window, lengths.
    if name in ("causal", "window", "lengths"):
      for i, j in itertools.product(range(t // bq), range(s // bk)):
        tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        np.testing.assert_array_equal(some[..., i, j], tile.any((-2, -1)), err_msg=name)


def test_block_table_equals_tile_range():
  """SegmentIds and the combinators compute their tables from block statistics; they agree
  with the per-tile answer."""
  rng = np.random.default_rng(5)
  t = 50
  ids = _ids(rng, B, t)
  for mask in (masks.segment_ids(ids), masks.segment_ids(ids) & masks.sliding_window(4, 0),
               masks.segment_ids(ids) | masks.prefix_lm(np.array([2, 7]))):
    bound = mask.bind((B,), N, t, t)
    table = bound.block_table(8, 16, 7, 4)
    per_tile = masks.Mask.block_table(bound, 8, 16, 7, 4)
    for a, b in zip(table, per_tile, strict=True):
      np.testing.assert_array_equal(np.broadcast_to(a, (B, N, 7, 4)),
                                    np.broadcast_to(b, (B, N, 7, 4)))


def test_masks_are_pytrees():
  ids = jnp.array([[0, 0, 1, 1, -1]])
  mask = masks.segment_ids(ids) & masks.sliding_window(2, 0)
  leaves, tree = jax.tree.flatten(mask)
  assert len(leaves) == 2  # q and kv ids; the window sizes are static
  rebuilt = jax.tree.unflatten(tree, [x + 1 for x in leaves])
  assert rebuilt.b == mask.b and int(rebuilt.a.q_ids[0, 0]) == 1
  fn = jax.jit(lambda m: masks.materialize(m.bind((1,), 1, 5, 5), (1,), 1, 5, 5))
  np.testing.assert_array_equal(fn(mask)[0, 0], np.array(
      [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0] * 5], bool))


# ---------------------------------------------------------------------------------------------
# jax.nn's keywords: the same results as jax.nn.dot_product_attention.
# ---------------------------------------------------------------------------------------------

JAX_NN_CASES = [
    dict(query_seq_lengths=[40, 17, 3], key_value_seq_lengths=[40, 25, 30]),
    dict(key_value_seq_lengths=[1, 40, 12]),
    dict(local_window_size=(5, 2)),
    dict(local_window_size=4, is_causal=True),
    dict(local_window_size=(0, 0)),
    dict(local_window_size=(100, 100)),
    dict(query_seq_lengths=[40, 17, 3], key_value_seq_lengths=[40, 25, 30],
         local_window_size=(3, 0), is_causal=True),
]


@pytest.mark.parametrize("kw", JAX_NN_CASES)
@pytest.mark.parametrize("implementation", ["dense", "blocked", "pallas"])
@pytest.mark.split_by_jax
def test_jax_nn_keywords_equal_jax_nn(kw, implementation):
  b, t, n, h = 3, 40, 4, 16
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (b, t, n, h)) for key in (kq, kk, kv))
  kw = {name: jnp.asarray(x, jnp.int32) if "lengths" in name else x for name, x in kw.items()}
  impl = core.Pallas(interpret=True, block_q=16, block_k=16) if implementation == "pallas" else (
      core.Blocked(block_q=16, block_k=8) if implementation == "blocked" else "dense")
  # Rows with a valid key (jax.nn gives the others the mean of the values, attnx zeros).
  structured = masks.from_jax_nn(**{n_: x for n_, x in kw.items() if n_ != "is_causal"})
  valid = masks.materialize(structured.bind((b,), n, t, t), (b,), n, t, t)
  if kw.get("is_causal"):
    valid = valid & jnp.tril(jnp.ones((t, t), bool))
  row_ok = jnp.broadcast_to(valid.any(-1), (b, 1, t)).transpose(0, 2, 1)[..., None]
  ct = jax.random.normal(jax.random.key(1), (b, t, n, h)) * row_ok

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) * ct)

  ours = lambda q, k, v: core.attention(q, k, v, implementation=impl, **kw)
  theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)
  chex.assert_trees_all_close(ours(q, k, v) * row_ok, theirs(q, k, v) * row_ok, atol=2e-6,
                              rtol=2e-6)
  chex.assert_trees_all_close(jax.grad(loss, argnums=(1, 2, 3))(ours, q, k, v),
                              jax.grad(loss, argnums=(1, 2, 3))(theirs, q, k, v),
                              atol=2e-5, rtol=2e-5)


def test_empty_key_axis_with_per_batch_masks():
  """No key (S = 0) with per-batch arrays of a zero-length axis: zeros, as without a mask (the
  differential net's seed 163 found the reshape that failed here)."""
  q = jnp.ones((3, 5, 2, 4))
  k = v = jnp.ones((3, 0, 2, 4))
  ids = (jnp.zeros((3, 5), jnp.int32), jnp.zeros((3, 0), jnp.int32))
  for impl in ("dense", "blocked"):
    out = core.attention(q, k, v, segment_ids=ids, local_window_size=(2, 0),
                         implementation=impl)
    assert out.shape == (3, 5, 2, 4) and float(jnp.abs(out).max()) == 0.0


def test_query_padding_rows_are_zero():
  q = k = v = jnp.ones((2, 6, 1, 4))
  out = core.attention(q, k, v, query_seq_lengths=jnp.array([6, 2]),
                       key_value_seq_lengths=jnp.array([6, 6]))
  assert float(jnp.abs(out[1, 2:]).max()) == 0.0 and float(out[0].min()) == 1.0


def test_segment_ids_keyword_is_the_mask_object():
  rng = np.random.default_rng(0)
  kq, kk, kv = jax.random.split(jax.random.key(2), 3)
  q, k, v = (jax.random.normal(key, (B, 30, N, H)) for key in (kq, kk, kv))
  ids = _ids(rng, B, 30)
  for w in ("softmax", "sigmoid:normalization=none", "stick_breaking"):
    a = core.attention(q, k, v, weighting=w, segment_ids=ids, is_causal=True)
    b = core.attention(q, k, v, weighting=w, mask=masks.segment_ids(ids) & masks.causal())
    c = core.attention(q, k, v, weighting=w, segment_ids=(ids, ids), is_causal=True)
    chex.assert_trees_all_close(a, b, c, atol=1e-6)


_IMPLEMENTATIONS = ("dense", core.Blocked(block_q=8, block_k=8),
                    core.Pallas(block_q=16, block_k=16, interpret=True))


@pytest.mark.parametrize("weighting", ["softmax", "sigmoid:normalization=none",
                                       "relu:normalization=length", "ssmax", "stick_breaking"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.split_by_jax
def test_packed_documents_attend_alone(weighting, causal):
  """Three packed documents give each document what it gets attended on its own (the dense
  implementation), values and gradients, in every implementation: also for the weightings
  that count keys (sigmoid's b = −log n with n the document's keys, the "length"
  normalization's and SSMax's n the keys a query attends)."""
  lens = (7, 12, 5)
  ids = np.repeat(np.arange(3), lens)[None].astype(np.int32)
  kq, kk, kv, kc = jax.random.split(jax.random.key(3), 4)
  q, k, v, ct = (jax.random.normal(key, (1, sum(lens), N, H)) for key in (kq, kk, kv, kc))
  kw = dict(weighting=weighting, is_causal=causal)

  def loss(impl, q, k, v, rows=slice(None), **extra):
    out = core.attention(q, k, v, implementation=impl, **kw, **extra)
    return jnp.sum(out * ct[:, rows]), out

  parts, start = [], 0
  for n_ in lens:
    parts.append(slice(start, start + n_))
    start += n_
  alone = [jax.grad(lambda *a, p=p: loss("dense", *a, rows=p), argnums=(0, 1, 2),
                    has_aux=True)(*(x[:, p] for x in (q, k, v))) for p in parts]
  for impl in _IMPLEMENTATIONS:
    grads, packed = jax.grad(lambda *a, impl=impl: loss(impl, *a, segment_ids=ids),
                             argnums=(0, 1, 2),
                             has_aux=True)(q, k, v)
    for p, (grads_alone, out_alone) in zip(parts, alone, strict=True):
      chex.assert_trees_all_close(packed[:, p], out_alone, atol=2e-6)
      chex.assert_trees_all_close([g[:, p] for g in grads], list(grads_alone), atol=2e-5)


def test_sigmoid_n_all_keeps_the_static_key_count():
  """``n="all"``: sigmoid's b = −log S with S the packed row's keys, as before."""
  lens = (7, 12, 5)
  ids = np.repeat(np.arange(3), lens)[None].astype(np.int32)
  q, k, v = (jax.random.normal(key, (1, sum(lens), N, H)) for key in
             jax.random.split(jax.random.key(4), 3))
  mask = ids[0][:, None] == ids[0][None, :]
  for impl in _IMPLEMENTATIONS:
    got = core.attention(q, k, v, segment_ids=ids, implementation=impl,
                         weighting="sigmoid:normalization=none,n=all")
    want = core.attention(q, k, v, mask=mask, weighting="sigmoid:normalization=none")
    chex.assert_trees_all_close(got, want, atol=2e-6)
  with pytest.raises(ValueError, match="n must be one of"):
    core.get_weighting("sigmoid:normalization=none,n=rows")


def test_sequence_keys_count_each_querys_sequence():
  rng = np.random.default_rng(5)
  t, s = 30, 26
  q_ids = np.sort(rng.integers(-1, 4, (B, t)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(-1, 4, (B, s)), axis=1).astype(np.int32)
  lq, lk = np.array([t, 11], np.int32), np.array([4, s], np.int32)
  docs = np.where(q_ids >= 0, (q_ids[:, :, None] == kv_ids[:, None, :]).sum(-1), 0)
  lens = np.where(np.arange(t)[None] < lq[:, None], lk[:, None], 0)

  def count(mask):
    return mask.bind((B,), N, t, s).sequence_keys(t, s)

  np.testing.assert_array_equal(count(masks.segment_ids(q_ids, kv_ids)), docs)
  np.testing.assert_array_equal(count(masks.seq_lengths(lq, lk)), lens)
  np.testing.assert_array_equal(count(masks.seq_lengths(None, lk)),
                                np.broadcast_to(lk[:, None], (B, t)))
  both = masks.segment_ids(q_ids, kv_ids) & masks.causal() & masks.seq_lengths(lq, lk)
  np.testing.assert_array_equal(count(both), np.minimum(docs, lens))
  np.testing.assert_array_equal(count(masks.segment_ids(q_ids, kv_ids)
                                      | masks.seq_lengths(lq, lk)), np.maximum(docs, lens))
  np.testing.assert_array_equal(count(masks.seq_lengths(lq)),
                                np.where(np.arange(t)[None] < lq[:, None], s, 0))
  for position in (masks.causal(), masks.sliding_window(3, 0), masks.chunked_causal(4),
                   masks.prefix_lm(3), masks.from_fn(lambda b, h, i, j: i >= j)):
    assert count(position) is None
  assert count(masks.sliding_window(3, 0) & masks.segment_ids(q_ids, kv_ids)).shape == (B, t)


# ---------------------------------------------------------------------------------------------
# The blocked kernel evaluates the mask per tile: against a float64 dense brute force.
# ---------------------------------------------------------------------------------------------

_POINTWISE = ["softmax", "relu", "sigmoid:normalization=none", "power:p=2,normalization=length",
              "softmax_plus_one", "gaussian"]
# The whole-row families: SSMax (its n_i), softpick, stick-breaking (the stick, walked
# backwards), sparsemax and entmax (the threshold count, zero-tile skipping).
_WHOLE_ROW = ["ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15"]


def _draws(count, seed, weightings=tuple(_POINTWISE)):
  rng = np.random.default_rng(seed)
  for _ in range(count):
    t = int(rng.choice([1, 9, 40, 70, 130]))
    s = t if rng.random() < 0.6 else int(rng.choice([1, 33, 96]))
    kinds = list(_formulas(t, s, rng).items())
    name, (mask, _) = kinds[rng.integers(len(kinds))]
    yield dict(t=t, s=s, mask_name=name, mask=mask, weighting=str(rng.choice(weightings)),
               causal=bool(rng.random() < 0.4), bq=int(rng.choice([8, 16, 24])),
               bk=int(rng.choice([8, 16, 40])), bias=bool(rng.random() < 0.3),
               dense_mask=bool(rng.random() < 0.2), seed=int(rng.integers(1 << 30)))


def _sampled(cases, in_ci):
  """``in_ci`` of the draws run in CI — first each weighting's and each mask kind's first
  draw, then the earliest others — and the rest with ``-m exhaustive`` (the differential net's
  random draws reach structured masks in every kernel too)."""
  chosen, seen = set(), set()
  for i, c in enumerate(cases):
    if len(chosen) < in_ci and not {c["weighting"], c["mask_name"]} <= seen:
      chosen.add(i)
      seen |= {c["weighting"], c["mask_name"]}
  chosen |= set([i for i in range(len(cases)) if i not in chosen][:in_ci - len(chosen)])
  return [c if i in chosen else pytest.param(c, marks=pytest.mark.exhaustive)
          for i, c in enumerate(cases)]


@pytest.mark.parametrize("case", _sampled(list(_draws(24, 0)), 12)
                         + _sampled(list(_draws(15, 1, _WHOLE_ROW)), 8),
                         ids=lambda c: (
    f"{c['mask_name']}-{c['weighting']}-t{c['t']}s{c['s']}-c{int(c['causal'])}-"
    f"{c['bq']}x{c['bk']}-b{int(c['bias'])}m{int(c['dense_mask'])}"))
@pytest.mark.split_by_jax
def test_blocked_kernel_against_float64(case):
  t, s = case["t"], case["s"]
  keys = jax.random.split(jax.random.key(case["seed"]), 6)
  q = jax.random.normal(keys[0], (B, t, N, H))
  k = jax.random.normal(keys[1], (B, s, K, H))
  v = jax.random.normal(keys[2], (B, s, K, H))
  bias = jax.random.normal(keys[3], (B, 1, t, s)) if case["bias"] else None
  dense_mask = jax.random.bernoulli(keys[4], 0.8, (1, N, t, s)) if case["dense_mask"] else None
  score = "neg_sq_dist" if case["weighting"] == "gaussian" else "scaled_dot"
  ct = jax.random.normal(keys[5], (B, t, N, H))

  def run(impl, q, k, v, bias):
    mask = case["mask"]
    if dense_mask is not None:  # a dense mask on top of the structured one
      mask = mask & masks.from_fn(lambda b, h, i, j: dense_mask[0, h, i, j])
    return core.attention(q, k, v, bias, mask, weighting=case["weighting"], score=score,
                          is_causal=case["causal"], implementation=impl)

  blocked = core.Blocked(block_q=case["bq"], block_k=case["bk"])
  args = (q, k, v, bias)
  got = run(blocked, *args)
  grads = jax.grad(lambda *a: jnp.sum(run(blocked, *a) * ct), argnums=(0, 1, 2))(*args)
  with jax.enable_x64(True):
    a64 = tuple(None if x is None else jnp.asarray(np.asarray(x, np.float64)) for x in args)
    ct64 = jnp.asarray(np.asarray(ct, np.float64))
    ref = run("dense", *a64)
    ref_grads = jax.grad(lambda *a: jnp.sum(run("dense", *a) * ct64), argnums=(0, 1, 2))(*a64)
  ref, ref_grads = np.asarray(ref), [np.asarray(r) for r in ref_grads]
  scale = max(1.0, float(np.abs(ref).max()))
  np.testing.assert_allclose(got, ref, atol=2e-5 * scale, rtol=1e-4)
  for g, r in zip(grads, ref_grads, strict=True):
    gs = max(1.0, float(np.abs(r).max()))
    np.testing.assert_allclose(g, r, atol=5e-5 * gs, rtol=1e-3)


@pytest.mark.parametrize("weighting", ["softmax", "ssmax", "stick_breaking", "entmax15"])
def test_blocked_kernel_never_forms_t_by_s(weighting):
  """Neither blocked kernel forms a [T, S] array under a structured mask, values or
  gradients."""
  t = 1024
  q = k = v = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)

  def program(mask):
    fn = lambda q, k, v: core.attention(q, k, v, mask=mask, is_causal=True, weighting=weighting,
                                        implementation=core.Blocked(block_q=64, block_k=64))
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))).lower(
        q, k, v)

  text = program(masks.sliding_window(64, 0)).as_text()
  assert f"{t}x{t}" not in text and "1024,1024" not in text
  compiled = program(masks.segment_ids(jnp.zeros((1, t), jnp.int32))).compile()
  memory = compiled.memory_analysis()
  if memory is not None:
    assert memory.temp_size_in_bytes < t * t  # a bool T×S array alone would be this


def test_explain_counts_the_skipped_tiles():
  t = 1024
  q = k = v = jnp.ones((1, t, 2, 8))
  blocked = core.Blocked(block_q=128, block_k=128)
  ex = core.explain(q, k, v, mask=masks.sliding_window(127, 0), is_causal=True,
                    implementation=blocked)
  # 8×8 tiles of 128: the 8 diagonal tiles and the 7 just below lie partly inside the
  # 128-key causal window (masked); no tile lies wholly inside it; the other 49 are skipped.
  m = ex.mask_tiles
  assert m["tiles"] == (128, 128) and m["skipped"] + m["unmasked"] + m["masked"] == 64
  assert m["skipped"] == 64 - 8 - 7 and m["masked"] == 15 and m["unmasked"] == 0
  assert "skips 49 of 64 tiles of 128x128" in str(ex)
  # The whole-row kernel (entmax) reads the same tiles; SSMax without a bias runs as softmax
  # in the pointwise kernel, with a bias in the whole-row kernel.
  for weighting, bias in (("entmax15", None), ("ssmax", None), ("ssmax", jnp.zeros((t, t)))):
    m = core.explain(q, k, v, bias, mask=masks.sliding_window(127, 0), is_causal=True,
                     weighting=weighting, implementation=blocked).mask_tiles
    assert (m["tiles"], m["skipped"], m["masked"]) == ((128, 128), 49, 15)
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None]
  m = core.explain(q, k, v, segment_ids=ids, implementation=blocked).mask_tiles
  assert (m["skipped"], m["unmasked"], m["masked"]) == (48, 16, 0)  # 4 documents of 2×2 tiles
  assert core.explain(q, k, v, implementation=blocked).mask_tiles is None
  assert core.explain(q, k, v, segment_ids=ids, implementation="dense").mask_tiles is None


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("weighting", ["softmax", "stick_breaking"])
def test_pallas_kernels_never_form_t_by_s(backend, weighting):
  """The Pallas kernels of both lowerings read a structured mask per tile: the program of
  values and gradients holds no [T, S] array (segment ids travel as [B, T], spans as
  [B, tiles])."""
  t, s = 1024, 896
  q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  k = v = jax.ShapeDtypeStruct((1, s, 1, 16), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
  kv_ids = jax.ShapeDtypeStruct((1, s), jnp.int32)

  def loss(q, k, v, ids, kv_ids):
    mask = masks.segment_ids(ids, kv_ids) & masks.sliding_window(200, 0)
    out = pallas_lib.pallas_attention(
        q, k, v, weighting=core.get_weighting(weighting), scale=0.25,
        structured_mask=mask.bind((1,), 2, t, s), backend=backend, interpret=True,
        block_q=64 if backend == "gpu" else 128, block_k=128)
    return jnp.sum(out)

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, ids, kv_ids))
  assert f"{t},{s}]" not in text and f"{t}, {s}]" not in text
  assert "pallas_call" in text


def test_from_fn_tile_metadata_is_evaluated_in_batches_of_tiles():
  """from_fn's block_table equals the tile-by-tile definition, and a blocked program with a
  mask_mod holds no [T, S] array (its tiles' metadata is evaluated a batch of tiles at a
  time, not every tile at once)."""
  fn = masks.from_fn(lambda b, h, i, j: ((i + 2 * j + h + b) % 5 != 0) & (j <= i + 3 * b))
  bound = fn.bind((2,), 3, 40, 56)
  got = bound.block_table(8, 16, 5, 4)
  want = masks.Mask.block_table(bound, 8, 16, 5, 4)  # every tile at once, by definition
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  assert got[0].shape == (2, 3, 5, 4)
  t = 4096
  x = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  band = masks.from_fn(lambda b, h, i, j: (j <= i) & (j > i - 100))
  loss = lambda q, k, v: jnp.sum(core.attention(
      q, k, v, mask=band, implementation=core.Blocked(block_q=128, block_k=128)))
  memory = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().memory_analysis()
  if memory is not None:  # both heads' [T, S] booleans at once would be 2·T² bytes
    assert memory.temp_size_in_bytes < t * t, memory.temp_size_in_bytes


def test_pallas_explain_counts_the_tiles_its_loops_visit():
  t = 1024
  q = k = v = jnp.ones((1, t, 2, 8))
  pallas = core.Pallas(block_q=128, block_k=128, interpret=True)
  # The kernels loop over each query tile's span of key tiles: for a 128-key causal window
  # the diagonal tile and the one before it (the first query tile: its diagonal only).
  m = core.explain(q, k, v, mask=masks.sliding_window(127, 0), is_causal=True,
                   implementation=pallas).mask_tiles
  assert m == {"tiles": (128, 128), "skipped": 64 - 15, "unmasked": 0, "masked": 15}
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None]
  # 4 documents of 2×2 tiles: the kernels, pointwise and whole-row, evaluate the mask only on
  # a span's boundary tiles, here none (documents fill tiles)
  for weighting in ("softmax", "entmax15"):
    m = core.explain(q, k, v, segment_ids=ids, weighting=weighting,
                     implementation=pallas).mask_tiles
    assert (m["skipped"], m["unmasked"], m["masked"]) == (48, 16, 0)
    m = core.explain(q, k, v, segment_ids=ids, is_causal=True, weighting=weighting,
                     implementation=pallas).mask_tiles
    assert (m["skipped"], m["unmasked"], m["masked"]) == (52, 4, 8)  # the diagonal tiles


def test_pallas_reads_a_mask_mod_that_captures_arrays_materialized():
  # A Pallas kernel cannot capture constants: such a mask_mod is evaluated densely instead,
  # with the same result as the dense implementation, and explain() counts no tiles.
  rng = np.random.default_rng(3)
  t = 40
  table = jnp.asarray(rng.random((t, t)) < 0.6)
  mask = masks.from_fn(lambda b, h, i, j: table[i, j])
  q, k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32) for _ in range(3))
  pallas = core.Pallas(block_q=16, block_k=16, interpret=True)
  got = core.attention(q, k, v, mask=mask, implementation=pallas)
  ref = core.attention(q, k, v, mask=mask, implementation="dense")
  np.testing.assert_allclose(got, ref, atol=1e-5)
  assert core.explain(q, k, v, mask=mask, implementation=pallas).mask_tiles is None


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------

def test_bad_input_is_a_clear_error():
  q = k = v = jnp.ones((2, 8, 2, 4))
  with pytest.raises(ValueError, match="left must be an int >= 0"):
    masks.sliding_window(-1, 0)
  with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
    masks.chunked_causal(0)
  with pytest.raises(ValueError, match="integer array"):
    core.attention(q, k, v, segment_ids=jnp.ones((2, 8)))
  with pytest.raises(ValueError, match=r"segment ids must be \[batch..., T\]"):
    core.attention(q, k, v, segment_ids=jnp.ones((2, 7), jnp.int32))
  with pytest.raises(ValueError, match="does not fit the call"):
    core.attention(q, k, v, segment_ids=jnp.ones((3, 8), jnp.int32))
  with pytest.raises(ValueError, match=r"must be in \[0, 8\]"):
    core.attention(q, k, v, query_seq_lengths=jnp.array([9, 2]))
  with pytest.raises(ValueError, match=r"must be in \[0, 8\]"):
    core.attention(q, k, v, key_value_seq_lengths=jnp.array([-1, 2]))
  with pytest.raises(ValueError, match="local_window_size must be an int or a"):
    core.attention(q, k, v, local_window_size=(1, 2, 3))
  with pytest.raises(ValueError, match="must return booleans"):
    core.attention(q, k, v, mask=masks.from_fn(lambda b, h, i, j: i - j))
  with pytest.raises(TypeError, match="combines with & only with another"):
    masks.causal() & jnp.ones((8, 8), bool)
  with pytest.raises(ValueError, match="needs q_lengths, kv_lengths or both"):
    masks.seq_lengths()


# Both layouts with -m exhaustive: in CI test_ring's 8-device cases run structured masks
# (documents, a mask_mod in passes over the heads) in both layouts against float64.
@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_of_one_takes_a_structured_mask(layout):
  """ring_attention reads a mask object at the global positions (the 8-device check is
  tests/support/ring_cases.py's structured cases); here a ring of one equals attention."""
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  ids = jnp.repeat(jnp.arange(3, dtype=jnp.int32), jnp.array([5, 7, 4]),
                   total_repeat_length=16)[None]
  mask = masks.segment_ids(ids) & masks.sliding_window(4, 0)
  q, k, v = (jax.random.normal(key, (1, 16, 2, 8)) for key in
             jax.random.split(jax.random.key(6), 3))
  for weighting in ("softmax", "sigmoid:normalization=none", "stick_breaking"):
    ring = jax.shard_map(
        lambda q, k, v, w=weighting: core.ring_attention(q, k, v, mask=mask, axis_name="sp",
                                                         weighting=w, is_causal=True,
                                                         layout=layout),
        mesh=mesh, in_specs=jax.sharding.PartitionSpec(None, "sp"),
        out_specs=jax.sharding.PartitionSpec(None, "sp"), check_vma=False)
    want = core.attention(q, k, v, mask=mask, weighting=weighting, is_causal=True)
    chex.assert_trees_all_close(ring(q, k, v), want, atol=2e-6)


def _attended_tiles(dense: np.ndarray, bq: int, bk: int, tp: int, sp: int) -> np.ndarray:
  """[B, nq, nk]: whether tile (i, j) holds an attended pair (padded positions attend none)."""
  b, t, s = dense.shape
  pad = np.zeros((b, tp, sp), bool)
  pad[:, :t, :s] = dense
  return pad.reshape(b, tp // bq, bq, sp // bk, bk).any(axis=(2, 4))


_VISIT_MASKS = {
    "window": lambda rng, b, t, s: masks.sliding_window(int(rng.integers(1, 200)),
                                                        int(rng.integers(0, 40))),
    "causal window": lambda rng, b, t, s: masks.causal() & masks.sliding_window(
        int(rng.integers(1, 300)), 0),
    "documents": lambda rng, b, t, s: masks.segment_ids(np.sort(
        rng.integers(0, 6, (b, t)), axis=1).astype(np.int32)),
    "chunks": lambda rng, b, t, s: masks.chunked_causal(int(rng.integers(16, 200))),
    "lengths": lambda rng, b, t, s: masks.seq_lengths(
        rng.integers(1, t + 1, b).astype(np.int32), rng.integers(1, s + 1, b).astype(np.int32)),
    "prefix": lambda rng, b, t, s: masks.prefix_lm(rng.integers(0, t, b).astype(np.int32)),
}


@pytest.mark.split_by_jax
@pytest.mark.parametrize("kind", sorted(_VISIT_MASKS))
def test_pallas_kernels_visit_exactly_the_tiles_with_an_attended_pair(kind):
  """The loops of the Pallas kernels run over the spans of tiles the mask's metadata gives
  (kernels/pallas/masking.py): forward and dQ the key tiles of each query tile, dK/dV the
  query tiles of each key tile. For windows, documents, chunks, lengths and prefixes the
  tiles they visit are exactly those holding an attended pair (counted on the dense mask):
  none is launched only to be masked out."""
  from attnx.core.kernels.pallas import masking  # noqa: PLC0415

  rng = np.random.default_rng(sorted(_VISIT_MASKS).index(kind))
  for _ in range(2):
    b, t = int(rng.integers(1, 3)), int(rng.integers(100, 700))
    s = t if kind in ("documents", "prefix") else int(rng.integers(100, 700))
    mask = _VISIT_MASKS[kind](rng, b, t, s).bind((b,), 2, t, s)
    dense = np.broadcast_to(np.asarray(masks.materialize(mask, (b,), 2, t, s))[:, 0],
                            (b, t, s))  # [B, T, S]
    tiles = {"fwd": (64, 32), "dkv": (16, 128)}  # (dQ's loop is the forward's)
    tp, sp = -(-t // 128) * 128, -(-s // 128) * 128
    _, ops = masking.prepare(mask, tiles, tp, sp, t, s)
    for name, (bq, bk) in tiles.items():
      want = _attended_tiles(dense, bq, bk, tp, sp)  # [B, nq, nk]
      lo, hi = (np.broadcast_to(np.asarray(x), (b, x.shape[1])) for x in ops[name][:2])
      idx = np.arange(want.shape[2] if name != "dkv" else want.shape[1])
      visit = (idx[None, None] >= lo[..., None]) & (idx[None, None] < hi[..., None])
      if name == "dkv":  # per key tile, the query tiles: [B, nk, nq] -> [B, nq, nk]
        visit = visit.transpose(0, 2, 1)
      np.testing.assert_array_equal(visit, want, err_msg=f"{kind} {name} b={b} t={t} s={s}")


def _every_tiles(dense: np.ndarray, bq: int, bk: int, tp: int, sp: int) -> np.ndarray:
  """[B, nq, nk]: whether every pair of tile (i, j) attends (a tile holding padding: no)."""
  b, t, s = dense.shape
  pad = np.zeros((b, tp, sp), bool)
  pad[:, :t, :s] = dense
  return pad.reshape(b, tp // bq, bq, sp // bk, bk).all(axis=(2, 4))


def _kernel_runs(cfg, sm_spans, b: int, kind: str, bq: int, bk: int, n: int, q_len, kv_len):
  """[B, n, other] (visited, unmasked) of each tile's loop as the kernels compute them
  (common.kv_span/kv_full, or q_span/q_full for dK/dV), from a structured mask's spans."""
  from attnx.core.kernels.pallas import common, masking  # noqa: PLC0415

  span_fn, full_fn = ((common.q_span, common.q_full) if kind == "dkv"
                      else (common.kv_span, common.kv_full))
  other = (cfg.tp // bq) if kind == "dkv" else (cfg.sp // bk)
  visit = np.zeros((b, n, other), bool)
  plain = np.zeros((b, n, other), bool)
  idx = np.arange(other)
  for bb in range(b):
    for t in range(n):
      sm = None
      if sm_spans is not None:
        lo, hi, flo, fhi = (np.broadcast_to(np.asarray(x), (b, n))[bb, t] for x in sm_spans)
        sm = masking.KernelMask(None, bb, lo, hi, flo, fhi, [], [], None, None)
      span = span_fn(cfg, t, bq, bk, q_len[bb], kv_len[bb], sm)
      f_lo, f_hi = full_fn(cfg, t, bq, bk, q_len[bb], kv_len[bb], span, False, sm)
      visit[bb, t] = (idx >= int(span[0])) & (idx < int(span[1]))
      plain[bb, t] = (idx >= int(f_lo)) & (idx < int(f_hi))
  return visit, plain


@pytest.mark.split_by_jax
@pytest.mark.parametrize("kind", sorted(_VISIT_MASKS) + ["causal + lengths"])
def test_pallas_kernels_mask_elementwise_only_the_boundary_tiles(kind):
  """Of the tiles a Pallas kernel visits, it evaluates the mask per element only on those
  where some pair does not attend (the boundary tiles: the diagonal of a causal mask, a
  window's edges, documents' borders, the tile of a length, tiles holding padding); the
  others, whose every pair attends, run without it (kernels/pallas/common.py: kv_full,
  q_full). Counted on the dense mask for the forward/dQ loops and the dK/dV loop, at ragged
  T and S, for the masks' spans and the kernels' own causality and lengths."""
  import types  # noqa: PLC0415

  from attnx.core.kernels.pallas import masking  # noqa: PLC0415

  rng = np.random.default_rng(100 + (sorted(_VISIT_MASKS) + ["causal + lengths"]).index(kind))
  for _ in range(2):
    b, t = int(rng.integers(1, 3)), int(rng.integers(100, 700))
    s = t if kind in ("documents", "prefix", "causal + lengths") else int(rng.integers(100, 700))
    tp, sp = -(-t // 128) * 128, -(-s // 128) * 128
    causal = kind == "causal + lengths"
    if causal:  # the kernels' own causality and lengths, no mask object
      q_len, kv_len = rng.integers(1, t + 1, b), rng.integers(1, s + 1, b)
      dense = np.tril(np.ones((t, s), bool))[None] & (
          (np.arange(t)[None, :, None] < q_len[:, None, None])
          & (np.arange(s)[None, None, :] < kv_len[:, None, None]))
      mask = None
    else:
      q_len, kv_len = np.full(b, t), np.full(b, s)
      mask = _VISIT_MASKS[kind](rng, b, t, s).bind((b,), 2, t, s)
      dense = np.broadcast_to(np.asarray(masks.materialize(mask, (b,), 2, t, s))[:, 0],
                              (b, t, s))
    cfg = types.SimpleNamespace(needs_valid=lambda has_mask: True, is_causal=causal,
                                q_bound=causal or tp != t, kv_bound=causal or sp != s,
                                tp=tp, sp=sp)
    tiles = {"fwd": (64, 32), "dkv": (16, 128)}
    ops = masking.prepare(mask, tiles, tp, sp, t, s)[1] if mask is not None else {}
    for name, (bq, bk) in tiles.items():
      some = _attended_tiles(dense, bq, bk, tp, sp)  # [B, nq, nk]
      every = _every_tiles(dense, bq, bk, tp, sp)
      n = tp // bq if name != "dkv" else sp // bk
      visit, plain = _kernel_runs(cfg, ops.get(name), b, name, bq, bk, n, q_len, kv_len)
      if name == "dkv":
        visit, plain = visit.transpose(0, 2, 1), plain.transpose(0, 2, 1)
      msg = f"{kind} {name} b={b} t={t} s={s}"
      np.testing.assert_array_equal(visit, some, err_msg=msg)
      np.testing.assert_array_equal(plain, every, err_msg=msg)


def _loop_mask_work(fn, *args) -> dict[str, list[int]]:
  """{kernel name: [the iota ops in the body of each of its while loops]} of the Pallas
  kernels in fn's program: a loop body that evaluates an elementwise causal mask builds the
  rows' and columns' positions (two iotas) that an unmasked body does not."""
  from jax.extend import core as jcore  # noqa: PLC0415

  def ops(jaxpr, acc):
    for e in jaxpr.eqns:
      acc.append(e.primitive.name)
      if e.primitive.name != "while":
        for sub in jcore.jaxprs_in_params(e.params):
          ops(sub, acc)
    return acc

  def loops(jaxpr, acc):
    for e in jaxpr.eqns:
      if e.primitive.name == "while":
        acc.append(ops(e.params["body_jaxpr"].jaxpr, []).count("iota"))
      for sub in jcore.jaxprs_in_params(e.params):
        loops(sub, acc)
    return acc

  out = {}

  def kernels(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        name = e.params.get("name_and_src_info", e.params.get("name"))  # (renamed in jax 0.11)
        out[str(name).split()[0]] = loops(e.params["jaxpr"], [])
      for sub in jcore.jaxprs_in_params(e.params):
        kernels(sub)

  kernels(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


@pytest.mark.parametrize("backend,weighting", [
    ("gpu", "softmax"), *itertools.product(
        ["gpu", "tpu"], ["softpick", "stick_breaking", "entmax15", "ssmax"])])
def test_pallas_kernel_loops_run_the_full_tiles_without_the_mask(backend, weighting):
  """Every loop over tiles of the Pallas kernels (forward, dQ, dK/dV; pointwise and whole-row,
  the threshold passes too) runs, under a causal mask, as three loops: the boundary tiles
  before and after with the elementwise mask, the full run between without it, whose body
  does the work of the unmasked kernel's loop and no more (kernels/pallas/common.py:
  span_loop). Read from the kernels' programs: fails when a kernel keeps one masked loop.
  (The pointwise TPU kernels have no loop: their grid is the loop, common.span_when.) The
  Triton whole-row kernels split the forward's output pass only: the threshold passes and
  the backward kernels keep one masked loop (split, they spilled registers compiled for an
  H100: docs/known_limits.md)."""
  t = 256
  x = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)

  def work(causal):
    def loss(q, k, v):
      return jnp.sum(pallas_lib.pallas_attention(
          q, k, v, weighting=core.get_weighting(weighting), scale=0.25, is_causal=causal,
          backend=backend, interpret=True, block_q=64 if backend == "gpu" else 128,
          block_k=128))
    return _loop_mask_work(jax.grad(loss, argnums=(0, 1, 2)), x, x, x)

  plain, causal = work(False), work(True)
  assert plain.keys() == causal.keys() and len(plain) >= 2, (plain, causal)
  triton_rows = backend == "gpu" and weighting != "softmax"
  for name, loops in plain.items():
    masked = causal[name]
    if triton_rows and not name.endswith("_fwd"):  # one masked loop each
      assert len(masked) == len(loops) and sum(masked) > sum(loops), (name, loops, masked)
      continue
    # each plain loop (Triton whole-row: the output pass, the last) has a counterpart that
    # evaluates no mask, and two boundary loops that do
    split = loops[-1:] if triton_rows else loops
    assert not collections.Counter(split) - collections.Counter(masked), (name, loops, masked)
    assert len(masked) > len(loops) and max(masked) > max(loops), (name, loops, masked)
