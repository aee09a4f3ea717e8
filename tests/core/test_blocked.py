"""attnx.core.kernels.xla.pointwise: the flash-style kernel against the dense pointwise_weights
reference.

Compilation dominates the runtime of these tests, so each group of cases is compiled once as a
single jitted program (shared through functools.cache) and the parametrized tests index it.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from support import differential as diff

from attnx.core import weightings as wlib
from attnx.core.kernels.xla import pointwise as blocked_lib
from attnx.core.kernels.xla import sizes, sweep, tiling
from attnx.core.kernels.xla.pointwise import blocked_attention
from attnx.core.kernels.xla.sizes import causal_leaves, default_block_sizes, heads_per_chunk

POINTWISE = [n for n in wlib.list_weightings() if isinstance(wlib.get_weighting(n), wlib.Pointwise)]
VARIANTS = ["relu:normalization=length", "sigmoid:normalization=none",
            "gaussian:normalization=none", "softmax:alpha=0.5", "power:p=3"]
ALL = POINTWISE + VARIANTS
BLOCK = 16
SCALE = 0.35


def _ci_sample(values, keep):
  """``values`` as pytest params, those not in ``keep`` marked exhaustive (``-m exhaustive``):
  CI runs the sample, which keeps it within its 20 minutes."""
  return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)),
                                           marks=pytest.mark.exhaustive) for v in values]


def _dense(q, k, v, w, scale, bias=None, mask=None, is_causal=False):
  """The reference: pointwise_weights on the full [B, N, T, S] scores, then weights @ v."""
  n, kh = q.shape[2], k.shape[2]
  kk, vv = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kk, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    s = s + bias
  t, sl = q.shape[1], k.shape[1]
  valid = jnp.ones((1, 1, t, sl), bool)
  if mask is not None:
    valid = valid & mask
  if is_causal:
    valid = valid & jnp.tril(jnp.ones((t, sl), bool))
  p = wlib.pointwise_weights(s, w, where=valid)
  out = jnp.einsum("bnts,bsnh->btnh", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
  return out.astype(q.dtype)


def _blocked(q, k, v, w, scale, bias=None, mask=None, is_causal=False, block=BLOCK):
  return blocked_attention(q, k, v, weighting=w, scale=scale, bias=bias, mask=mask,
                           is_causal=is_causal, block_q=block, block_k=block)


def _inputs(b=2, t=37, s=53, n=4, kh=2, h=8, dtype=jnp.float32, seed=0, bias_shape=None):
  # numpy, not jax.random: eager jax ops would compile once per new shape.
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  q, k, v = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, h)
  bias = normal(*(bias_shape or (1, n, t, s)))
  # Row 3 of batch 0 is fully masked; the rest keeps ~70 % of the keys.
  mask = rng.random((b, 1, t, s)) < 0.7
  mask[0, :, 3, :] = False
  ct = normal(b, t, n, h)
  return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(bias), jnp.asarray(mask),
          jnp.asarray(ct))


def _out_and_grads(attn, q, k, v, bias, ct, **kw):
  """Output and d<out, ct>/d(q, k, v, bias) (a random linear functional of the output)."""
  def f(q, k, v, bias):
    o = attn(q, k, v, bias=bias, **kw)
    return jnp.sum(o.astype(jnp.float32) * ct), o
  (_, o), g = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
  return o, g


def _assert_close(actual, desired, rtol=1e-5, atol=1e-5):
  for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
    a, d = np.asarray(a, np.float32), np.asarray(d, np.float32)
    assert np.all(np.isfinite(a)), "non-finite values"
    tol = atol * max(1.0, float(np.max(np.abs(d))))
    np.testing.assert_allclose(a, d, rtol=rtol, atol=tol)


def _tol(name):
  # triangular's F' = −1/(2h√−s) amplifies rounding of scores near 0.
  return 1e-3 if name.startswith("triangular") else 2e-5


# --------------------------------------------------------------------------------------------
# Every pointwise weighting: odd lengths (T=37, S=53, block 16), GQA, mask with a fully masked
# row, per-head bias; outputs and gradients for q, k, v and bias.
# --------------------------------------------------------------------------------------------

@functools.cache
def _all_weightings():
  q, k, v, bias, mask, ct = _inputs()

  @jax.jit
  def run(q, k, v, bias, mask, ct):
    res = {}
    for name in ALL:
      w = wlib.get_weighting(name)
      kw = dict(w=w, scale=SCALE, mask=mask)
      res[name] = (_out_and_grads(_blocked, q, k, v, bias, ct, **kw),
                   _out_and_grads(_dense, q, k, v, bias, ct, **kw))
    return res

  return jax.device_get(run(q, k, v, bias, mask, ct))


def test_registry_has_the_expected_pointwise_weightings():
  expected = {"softmax", "exp", "softmax_plus_one", "relu", "relu2", "softplus", "elu_plus_one",
              "taylor_exp", "power", "sigmoid", "gaussian", "boxcar", "triangular",
              "epanechnikov"}
  assert expected <= set(POINTWISE)


@pytest.mark.split_by_jax
@pytest.mark.parametrize("name", ALL)
def test_matches_dense_every_weighting(name):
  (ob, gb), (od, gd) = _all_weightings()[name]
  _assert_close(ob, od, atol=1e-5)
  _assert_close(gb, gd, atol=_tol(name))
  # The fully masked row (batch 0, query 3) is exactly zero, and its query gets no gradient.
  np.testing.assert_array_equal(ob[0, 3], 0.0)
  np.testing.assert_array_equal(gb[0][0, 3], 0.0)


# --------------------------------------------------------------------------------------------
# Causal (with T == S, T > S and T < S), broadcast bias shapes, MHA and GQA.
# --------------------------------------------------------------------------------------------

CAUSAL_SHAPES = {  # name: (t, s, n, kh, bias_shape, weightings)
    "square_gqa": (45, 45, 4, 2, (2, 1, 1, 45),
                   ("softmax", "relu:normalization=length", "sigmoid:normalization=none")),
    "more_queries_mha": (40, 24, 2, 2, (1, 1, 40, 1), ("softmax_plus_one",)),
    "more_keys_mqa": (24, 40, 3, 1, (2, 3, 24, 40), ("softmax", "gaussian:h=2")),
}
CAUSAL_CASES = [(shape, name) for shape, c in CAUSAL_SHAPES.items() for name in c[-1]]


@functools.cache
def _causal():
  res = {}
  for shape_name, (t, s, n, kh, bias_shape, names) in CAUSAL_SHAPES.items():
    q, k, v, bias, mask, ct = _inputs(t=t, s=s, n=n, kh=kh, bias_shape=bias_shape, seed=1)
    use_mask = shape_name == "more_keys_mqa"

    @jax.jit
    def run(q, k, v, bias, mask, ct, use_mask=use_mask, names=names):
      out = {}
      for name in names:
        kw = dict(w=wlib.get_weighting(name), scale=SCALE, is_causal=True,
                  mask=mask if use_mask else None)
        out[name] = (_out_and_grads(_blocked, q, k, v, bias, ct, **kw),
                     _out_and_grads(_dense, q, k, v, bias, ct, **kw))
      return out

    res[shape_name] = jax.device_get(run(q, k, v, bias, mask, ct))
  return res


@pytest.mark.parametrize("shape_name,name", CAUSAL_CASES)
def test_causal_and_bias_broadcast(shape_name, name):
  (ob, gb), (od, gd) = _causal()[shape_name][name]
  _assert_close(ob, od)
  _assert_close(gb, gd, atol=2e-5)
  assert gb[3].shape == CAUSAL_SHAPES[shape_name][4]


# Every pointwise weighting on the causal path: T = S = 45 with 16-row tiles is P = 4 diagonal
# tiles of 16 (the last one mostly padding) and squares of 32 and 16 below them; GQA, a mask
# with a fully masked row and a [B, 1, T, S] bias (cut into the squares' and tiles' blocks).
@functools.cache
def _causal_all():
  q, k, v, _, mask, ct = _inputs(t=45, s=45, seed=8)
  bias = jnp.asarray(np.random.default_rng(9).standard_normal((2, 1, 45, 45), np.float32))

  @jax.jit
  def run(q, k, v, bias, mask, ct):
    res = {}
    for name in ALL:
      kw = dict(w=wlib.get_weighting(name), scale=SCALE, mask=mask, is_causal=True)
      res[name] = (_out_and_grads(_blocked, q, k, v, bias, ct, **kw),
                   _out_and_grads(_dense, q, k, v, bias, ct, **kw))
    return res

  return jax.device_get(run(q, k, v, bias, mask, ct))


@pytest.mark.split_by_jax
@pytest.mark.parametrize("name", ALL)
def test_causal_matches_dense_every_weighting(name):
  (ob, gb), (od, gd) = _causal_all()[name]
  _assert_close(ob, od, atol=1e-5)
  _assert_close(gb, gd, atol=_tol(name))
  np.testing.assert_array_equal(ob[0, 3], 0.0)  # the fully masked row
  np.testing.assert_array_equal(gb[0][0, 3], 0.0)


# Default tiles (no block sizes): T = 300 is 4 diagonal tiles of 80 and squares of 160 and 80
# with the non-causal default tiles; T ≠ S both ways; a full [T, S] bias and a key mask.
DEFAULT_TILE_CASES = [(300, 300, "softmax"), (300, 300, "relu:normalization=length"),
                      (300, 300, "softmax_plus_one"), (260, 200, "sigmoid:normalization=none"),
                      (200, 260, "gaussian:h=2")]


@functools.cache
def _causal_default_tiles(t, s, name):
  q, k, v, _, _, ct = _inputs(b=1, t=t, s=s, n=2, kh=1, seed=10)
  rng = np.random.default_rng(11)
  bias = jnp.asarray(rng.standard_normal((1, 2, t, s), np.float32))
  mask = jnp.asarray(rng.random((1, 1, 1, s)) < 0.9)
  kw = dict(w=wlib.get_weighting(name), scale=SCALE, mask=mask, is_causal=True)
  blocked = lambda *a, **k: blocked_attention(*a[:3], weighting=k["w"], scale=k["scale"],
                                              bias=k["bias"], mask=k["mask"], is_causal=True)
  run = jax.jit(lambda *a: (_out_and_grads(blocked, *a, **kw), _out_and_grads(_dense, *a, **kw)))
  return jax.device_get(run(q, k, v, bias, ct))


@pytest.mark.parametrize("t,s,name", DEFAULT_TILE_CASES)
def test_causal_default_tiles_match_dense(t, s, name):
  got, want = _causal_default_tiles(t, s, name)
  _assert_close(got, want, atol=2e-5)


def test_causal_leaves():
  assert causal_leaves(4096, 128) == (32, 128)
  assert causal_leaves(1024, 128) == (8, 128)
  assert causal_leaves(300, 128) == (4, 80)
  assert causal_leaves(45, 16) == (4, 16)
  assert causal_leaves(17, 128) == (1, 24)
  for t in range(1, 600, 7):
    for leaf in (8, 16, 100, 128):
      p, d = causal_leaves(t, leaf)
      assert p & (p - 1) == 0 and d % 8 == 0 and p * d >= t and d <= max(leaf // 8 * 8, 8)
      assert p == 1 or causal_leaves(t, leaf)[1] * (p // 2) < t  # no smaller P would do


def _dot_flops(jaxpr) -> int:
  """FLOPs of every dot_general in a jaxpr, loops counted by their trip counts."""
  from jax.extend import core as jcore  # noqa: PLC0415
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
      continue
    assert eqn.primitive.name != "while", "a loop of unknown length"
    mult = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
          total += mult * _dot_flops(getattr(sub, "jaxpr", sub))
  return total


@pytest.mark.parametrize("t", [1024, 4096])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_causal_costs_half_of_full(t, mode):
  # Every matmul of the program counted (traced, not run): the causal kernel computes the
  # T²/2 scores on and below the diagonal plus half of the P diagonal d×d tiles, nothing more.
  x = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)
  w = wlib.get_weighting("softmax")

  def flops(causal):
    f = lambda q, k, v: jnp.sum(blocked_attention(q, k, v, weighting=w, scale=0.1,
                                                  is_causal=causal))
    if mode == "fwd+bwd":
      f = jax.grad(f, argnums=(0, 1, 2))
    return _dot_flops(jax.make_jaxpr(f)(x, x, x).jaxpr)

  full, causal = flops(False), flops(True)
  d = default_block_sizes(t, t, is_causal=True)[0]
  assert causal / full == pytest.approx(0.5 + d / (2 * t), rel=1e-6)
  assert causal / full <= 0.6


# Chunks of heads: a small tile budget forces several chunks (of 1 or 2 of the X = B·K = 4
# rows), with bias and mask broadcast over batch or heads; outputs and all gradients.
CHUNK_CASES = [(chunk, bias_shape, mask_shape)
               for chunk in (1, 2)
               for bias_shape, mask_shape in (((2, 4, 21, 19), (2, 1, 21, 19)),
                                              ((1, 4, 21, 19), (1, 4, 1, 19)),
                                              ((2, 1, 1, 19), (2, 4, 21, 19)))]


@pytest.mark.parametrize("chunk,bias_shape,mask_shape",
                         _ci_sample(CHUNK_CASES, {c for c in CHUNK_CASES if c[0] == 1}))
def test_chunks_of_heads_match_dense(chunk, bias_shape, mask_shape, monkeypatch):
  q, k, v, _, _, ct = _inputs(t=21, s=19, n=4, kh=2, seed=3)
  rng = np.random.default_rng(4)
  bias = jnp.asarray(rng.standard_normal(bias_shape, np.float32))
  mask = jnp.asarray(rng.random(mask_shape) < 0.8)
  # G = 2 query heads per kv head: a tile of one X row holds 2 · 16 · 16 scores.
  monkeypatch.setattr(sizes, "TILE_BUDGET", chunk * 2 * BLOCK * BLOCK)
  assert heads_per_chunk(2, 2, 2, BLOCK, BLOCK) == chunk
  w = wlib.get_weighting("softmax_plus_one")
  kw = dict(w=w, scale=SCALE, mask=mask, is_causal=True)
  got = jax.jit(lambda *a: _out_and_grads(_blocked, *a, **kw))(q, k, v, bias, ct)
  want = jax.jit(lambda *a: _out_and_grads(_dense, *a, **kw))(q, k, v, bias, ct)
  _assert_close(got, want, atol=2e-5)


def test_causal_skips_tiles_above_the_diagonal():
  # NaN values in the last key tile: query tiles that skip it stay finite; a kernel that
  # computed and masked that tile would give 0 · NaN = NaN everywhere.
  q, k, v, *_ = _inputs(b=1, t=64, s=64, n=2, kh=2)
  v = v.at[:, 48:].set(jnp.nan)
  for name in ("softmax", "relu"):
    out = _blocked(q, k, v, wlib.get_weighting(name), SCALE, is_causal=True)
    assert np.all(np.isfinite(out[:, :48])), name
    assert np.all(np.isnan(out[:, 48:])), name


# --------------------------------------------------------------------------------------------
# bfloat16, extreme scores, empty rows.
# --------------------------------------------------------------------------------------------

BF16_NAMES = ["softmax", "sigmoid:normalization=none"]


@functools.cache
def _bf16():
  q, k, v, bias, mask, ct = _inputs(dtype=jnp.bfloat16, seed=2)

  @jax.jit
  def run(q, k, v, bias, mask, ct):
    res = {}
    for name in BF16_NAMES:
      kw = dict(w=wlib.get_weighting(name), scale=SCALE, mask=mask)
      f32 = [x.astype(jnp.float32) for x in (q, k, v)]
      res[name] = (_out_and_grads(_blocked, q, k, v, bias, ct, **kw),
                   _out_and_grads(_dense, *f32, bias, ct, **kw))
      kw["is_causal"] = True
      res[name + " causal"] = (_out_and_grads(_blocked, q, k, v, bias, ct, **kw),
                               _out_and_grads(_dense, *f32, bias, ct, **kw))
    return res

  return jax.device_get(run(q, k, v, bias, mask, ct))


@pytest.mark.parametrize("name", BF16_NAMES + [n + " causal" for n in BF16_NAMES])
def test_bf16_runs_and_is_close(name):
  (ob, gb), (od, gd) = _bf16()[name]
  assert ob.dtype == jnp.bfloat16 and gb[0].dtype == jnp.bfloat16
  _assert_close(ob, od, rtol=3e-2, atol=3e-2)
  _assert_close(gb, gd, rtol=5e-2, atol=5e-2)


EXTREME_NAMES = ["softmax_plus_one", "relu2", "sigmoid:normalization=none"]


@functools.cache
def _extreme(dtype_name):
  dtype = jnp.dtype(dtype_name)
  q, k, v, bias, mask, ct = _inputs(t=20, s=24, seed=3)
  q = (q * 60.0).astype(dtype)  # |s| ~ 1e4
  k, v = k.astype(dtype), v.astype(dtype)

  @jax.jit
  def run(q, k, v, bias, mask, ct):
    res = {}
    for name in EXTREME_NAMES:
      kw = dict(w=wlib.get_weighting(name), scale=1.0, mask=mask)
      res[name] = (_out_and_grads(_blocked, q, k, v, bias, ct, **kw),
                   _dense(q, k, v, bias=bias, **kw))
    return res

  return q, jax.device_get(run(q, k, v, bias, mask, ct))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_extreme_scores_stay_finite(dtype_name):
  q, res = _extreme(dtype_name)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) > 100
  for name, ((ob, gb), od) in res.items():
    for x in (ob, *gb):
      assert np.all(np.isfinite(np.asarray(x, np.float32))), name
    if name.startswith("softmax"):
      # Online max: no overflow, and the same answer as the dense max-shifted reference.
      _assert_close(ob, od, rtol=3e-2, atol=3e-2)


# Fully masked rows are checked for every weighting in test_matches_dense_every_weighting.
ZERO_F_NAMES = ["relu", "relu:normalization=length"]


@functools.cache
def _all_zero_f():
  q, k, v, bias, _, ct = _inputs(t=20, s=24, seed=4)
  neg_bias = jnp.full_like(bias, -20.0)  # every score < 0, so every F(s) = relu(s) = 0

  @jax.jit
  def run(q, k, v, bias, ct):
    return {name: _out_and_grads(_blocked, q * 0.1, k, v, bias, ct, w=wlib.get_weighting(name),
                                 scale=SCALE) for name in ZERO_F_NAMES}

  return jax.device_get(run(q, k, v, neg_bias, ct))


@pytest.mark.parametrize("name", ZERO_F_NAMES)
def test_all_zero_f_gives_zero_output_and_finite_grads(name):
  out, grads = _all_zero_f()[name]
  np.testing.assert_array_equal(out, 0.0)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)  # also finite: no 0/0 in the backward pass


# --------------------------------------------------------------------------------------------
# Transformations and API.
# --------------------------------------------------------------------------------------------

class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_softmax_matches_jax_nn(self):
    q, k, v, _, mask, _ = _inputs(t=21, s=19, seed=5)
    fn = self.variant(lambda q, k, v, m: _blocked(q, k, v, wlib.get_weighting("softmax"),
                                                  q.shape[-1] ** -0.5, mask=m, block=8))
    m = mask.at[0, :, 3].set(True)  # jax.nn averages over empty rows; keep none empty
    ref = jax.nn.dot_product_attention(q, k, v, mask=m)
    chex.assert_trees_all_close(fn(q, k, v, m), ref, atol=1e-5, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_causal_softmax_and_grads_match_jax_nn(self):
    q, k, v, *_ = _inputs(t=16, s=16, seed=12)  # 2 leaves of 8 (op by op without jit)
    w = wlib.get_weighting("softmax")
    loss = lambda attn: lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)))
    ours = lambda q, k, v: _blocked(q, k, v, w, q.shape[-1] ** -0.5, is_causal=True, block=8)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    got = self.variant(jax.value_and_grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


def test_vmap_and_grad_compose():
  q, k, v, bias, mask, ct = _inputs(t=19, s=23, seed=6)
  stack = lambda x: jnp.stack([x, -0.5 * x])
  qs, ks, vs = stack(q), stack(k), stack(v)
  w = wlib.get_weighting("relu2")

  def loss(attn, q, k, v):
    o = jax.vmap(lambda a, b, c: attn(a, b, c, w, SCALE, mask=mask, is_causal=True))(q, k, v)
    return jnp.sum(o * ct)

  grads = lambda attn: jax.grad(functools.partial(loss, attn), argnums=(0, 1, 2))(qs, ks, vs)
  got, want = jax.jit(lambda: (grads(_blocked), grads(_dense)))()
  _assert_close(got, want)


def test_scale_gradient():
  q, k, v, bias, mask, ct = _inputs(t=17, s=29, seed=7)
  names = ("softmax:alpha=2",)

  @jax.jit
  def run(c):
    res = []
    for name in names:
      w = wlib.get_weighting(name)
      f = lambda attn, c, w=w: jnp.sum(attn(q, k, v, w, c, bias=bias, mask=mask) * ct)
      res.append((jax.grad(functools.partial(f, _blocked))(c),
                  jax.grad(functools.partial(f, _dense))(c)))
    return res

  for name, (got, want) in zip(names, run(jnp.float32(0.4)), strict=True):
    assert abs(float(want)) > 1e-3, name
    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=name)


class ApiTest(parameterized.TestCase):

  @parameterized.parameters((5, 7, 1, False, 8, 8), (512, 512, 1, False, 512, 256),
                            (4096, 100, 1, False, 4096, 104), (9000, 9000, 1, False, 4096, 256),
                            (4096, 4096, 4, False, 1024, 256), (4096, 4096, 1, True, 128, 128),
                            (300, 300, 2, True, 80, 80), (20, 30, 1, True, 24, 24))
  def test_default_block_sizes(self, t, s, group, causal, bq, bk):
    self.assertEqual(default_block_sizes(t, s, group, causal), (bq, bk))

  def test_heads_per_chunk_fills_the_budget_with_whole_rectangles(self):
    budget = sizes.TILE_BUDGET
    self.assertEqual(heads_per_chunk(1, 4, 1, 4096, 256), 1)  # one 4096×256 tile = budget
    self.assertEqual(heads_per_chunk(8, 8, 1, 256, 256), 16)  # 2 batch rows of 8 kv heads
    self.assertEqual(heads_per_chunk(2, 8, 1, 1024, 256), 4)  # divides K
    self.assertEqual(heads_per_chunk(3, 6, 1, 8, 8), 18)  # everything fits
    for b, kh in ((3, 6), (4, 5), (2, 8)):
      for bq in (8, 64, 1024):
        c = heads_per_chunk(b, kh, 2, bq, 256)
        self.assertTrue(kh % c == 0 or (c % kh == 0 and b % (c // kh) == 0), (b, kh, c))
        self.assertTrue(c == 1 or c * 2 * bq * 256 <= budget)

  def test_default_blocks_match_small_blocks(self):
    q, k, v, *_ = _inputs(t=37, s=53)
    w = wlib.get_weighting("softmax")
    a = blocked_attention(q, k, v, weighting=w, scale=SCALE)
    _assert_close(a, _blocked(q, k, v, w, SCALE, block=8))

  def test_rejects_bad_inputs(self):
    q, k, v, *_ = _inputs(n=3, kh=2)
    with self.assertRaisesRegex(ValueError, "incompatible"):
      blocked_attention(q, k, v, weighting=wlib.get_weighting("softmax"), scale=1.0)
    with self.assertRaisesRegex(TypeError, "Pointwise"):
      blocked_attention(q, k, v, weighting=wlib.get_weighting("sparsemax"), scale=1.0)


# --------------------------------------------------------------------------------------------
# Causal attention was wrong at most lengths above 512 and for tiles that do not divide the
# triangle's squares (see docs/changes.md, "Known issues fixed"): the
# squares ran the plain kernel unpadded, and a last tile running past a square's end was
# clamped by dynamic_slice onto earlier keys. Every case of the first three tests below failed
# before the fix (37 of 37); each is compared with the float64 brute force
# (tests/support/reference.py), outputs and gradients.
# --------------------------------------------------------------------------------------------

def _check_against_float64(**case):
  failures = diff.check(diff.Case(**case))
  assert not failures, "\n".join(failures)


# 513, 700, 1025 and 1500 also run in CI as the differential net's branch cases 1–4.
@pytest.mark.parametrize("t", _ci_sample([513, 700, 1025, 1500, 2049, 3000], {3000}))
def test_causal_default_dispatch_at_lengths_above_512(t):
  # implementation=None, as a user calls it (the blocked kernel at these lengths on a CPU).
  _check_against_float64(seed=t, t=t, s=t, n=2, h=32, hv=32, causal=True, only=("auto",))


ISSUE_TILES = [(64, 24), (70, 32), (100, 24), (100, 40), (130, 32), (130, 64), (200, 24),
               (200, 40), (200, 64), (257, 32), (257, 64), (257, 128)]


@pytest.mark.parametrize("t,tile", _ci_sample(ISSUE_TILES, {(70, 32), (100, 24), (257, 128)}))
def test_causal_tiles_that_do_not_divide_the_squares(t, tile):
  _check_against_float64(seed=t + tile, t=t, s=t, causal=True, block_q=tile, block_k=tile,
                         only=("blocked",))


# Every pointwise weighting also runs causal with GQA, a mask and a bias against dense in CI
# (test_causal_matches_dense_every_weighting); against float64 a sample of the three
# normalizations and a distance kernel.
@pytest.mark.parametrize("name", _ci_sample(ALL, {"softmax", "sigmoid:normalization=none",
                                                  "relu:normalization=length", "gaussian"}))
def test_causal_every_pointwise_weighting_gqa_mask_bias(name):
  # T = 70 with 32-row tiles (unnormalized relu was off by 14), GQA, a random mask with
  # fully masked rows and a per-batch [B, 1, T, S] bias.
  score = "neg_sq_dist" if wlib.get_weighting(name).distance_kernel else "scaled_dot"
  _check_against_float64(seed=70, b=2, t=70, s=70, n=4, kh=2, causal=True, block_q=32,
                         block_k=32, weighting=name, score=score, mask="random", bias="x1xx",
                         magnitude=0.3 if score == "neg_sq_dist" else 1.0, only=("blocked",))


@pytest.mark.parametrize("t,s", [(70, 45), (45, 70), (600, 530), (530, 600)])
def test_causal_t_not_s_with_mask_and_bias(t, s):
  _check_against_float64(seed=t * s, t=t, s=s, n=2, causal=True, mask="padding", bias="1xxx",
                         block_q=32 if t < 100 else None, block_k=32 if t < 100 else None,
                         only=("blocked",))


def test_squares_get_tiles_that_divide_them():
  for side in (8, 72, 96, 136, 144, 288, 576, 1088):
    for cap in (1, 7, 8, 24, 32, 256, 4096):
      tile = sizes.dividing_tile(side, cap)
      assert side % tile == 0 and tile <= max(cap, 1)
      if cap >= 8:
        assert tile % 8 == 0


def test_tiles_that_do_not_cover_the_padded_length_fail_at_trace_time():
  q, k, v, *_ = _inputs(b=1, t=40, s=40, n=1, kh=1)
  cfg = tiling.TileConfig(w=wlib.get_weighting("softmax"), t=40, s=40, bq=16, bk=16,
                          is_causal=False, has_mask=False, has_bias=False)
  q4 = jnp.zeros((1, 1, 40, 8))  # 40 rows are not whole 16-row tiles (48 would be)
  k3 = jnp.zeros((1, 40, 8))
  with pytest.raises(AssertionError, match="not whole tiles"):
    sweep.forward(q4, k3, k3, None, None, jnp.float32(1.0), cfg)


@pytest.mark.parametrize("name", ["softmax_plus_one", "relu:normalization=length",
                                  "sigmoid:normalization=none"])
def test_raw_block_states_of_key_blocks_merge_to_the_whole(name):
  # The entry points of ring attention (attnx.core.parallel.ring): the raw states of two key blocks
  # merge to the whole row, F seeing the whole problem's key count, and the blocks' gradients
  # from the final statistic add up to the whole gradient.
  from attnx.core import streaming

  w = wlib.get_weighting(name)
  rng = np.random.default_rng(3)
  x, g, t, s, h = 2, 2, 24, 40, 8
  q = jnp.asarray(rng.standard_normal((x, g, t, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((x, s, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((x, s, h)), jnp.float32)
  do = jnp.asarray(rng.standard_normal((x, g, t, h)), jnp.float32)
  scale = jnp.float32(SCALE)
  # [B, T, N, H] views for blocked_attention: X = B·K with K = 1, N = G.
  q4 = q.transpose(0, 2, 1, 3)
  k4, v4 = k[:, :, None], v[:, :, None]
  want, vjp = jax.vjp(lambda q, k, v: blocked_attention(q, k, v, weighting=w, scale=SCALE),
                      q4, k4, v4)
  dq_w, dk_w, dv_w = vjp(do.transpose(0, 2, 1, 3))
  cut = 16
  states, cfgs = [], []
  for lo, hi in ((0, cut), (cut, s)):
    cfg = blocked_lib.block_config(w, t, hi - lo, (x, 1, g), is_causal=False, has_mask=False,
                                   has_bias=False, num_keys=s)
    cfgs.append(cfg)
    states.append(blocked_lib.raw_block_state(q, k[:, lo:hi], v[:, lo:hi], None, None, scale,
                                              cfg))
  out, stat = streaming.pointwise_finalize(w, *streaming.pointwise_merge(w, *states))
  np.testing.assert_allclose(out.transpose(0, 2, 1, 3), want, atol=1e-5)
  blocks = ((0, cut), (cut, s))
  grads = [blocked_lib.block_grads(q, k[:, lo:hi], v[:, lo:hi], None, None, scale, out, stat,
                                   do, cfg) for (lo, hi), cfg in zip(blocks, cfgs, strict=True)]
  np.testing.assert_allclose((grads[0][0] + grads[1][0]).transpose(0, 2, 1, 3), dq_w,
                             atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate([grads[0][1], grads[1][1]], 1)[:, :, None], dk_w,
                             atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate([grads[0][2], grads[1][2]], 1)[:, :, None], dv_w,
                             atol=1e-5)
