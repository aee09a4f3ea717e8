"""Split-KV decoding on the Pallas kernels (attnx/core/kernels/pallas/split.py): the keys as
chunks on a batch axis of the kernels, merged with each family's rule.

Its values, residuals and gradients against the float64 brute force are the differential
net's (tests/core/test_differential.py: the branch cases 160–167 at lengths in the thousands,
and "pallas_split" in half of the drawn cases that run Pallas); here: that those cases really
split, the settings and their errors, the automatic split for decoding shapes, paged caches,
and lowering for real chips.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import differential as diff

from attnx import core
from attnx.core.kernels.pallas import split, wrapper
from attnx.core.weightings import get_weighting

# One end of the JAX range runs each test (tests/conftest.py).
pytestmark = pytest.mark.split_by_jax


def _branch_cases():
  path = pathlib.Path(__file__).with_name("test_differential.py")
  spec = importlib.util.spec_from_file_location("_differential_cases", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return [c for c in mod.BRANCH_CASES if c.splits]


def _spy(monkeypatch) -> list[int]:
  """Records the chunk count of every split forward traced from now on."""
  seen = []
  for name in ("forward", "row_forward"):
    real = getattr(split, name)

    def spy(cfg, *args, _real=real, **kw):
      seen.append(cfg.kv_splits)
      return _real(cfg, *args, **kw)

    monkeypatch.setattr(split, name, spy)
  return seen


@pytest.mark.parametrize("case", _branch_cases(), ids=lambda c: f"branch{c.seed}")
def test_the_split_branch_cases_split_their_keys(case, monkeypatch):
  # The net's split cases reach the split forward with more than one chunk (a case whose
  # chunk count came out 1 would test the unsplit kernel twice).
  seen = _spy(monkeypatch)
  arrs = diff.inputs(case)
  sp = arrs["score_params"]
  fn = diff._call(case, "pallas_split", tuple(sorted(sp.items())))
  mask = arrs["structured"] if arrs["structured"] is not None else arrs["mask"]
  mp = {k: jnp.asarray(v) for k, v in arrs["mod_params"].items()}
  jax.eval_shape(lambda q, k, v, b, mp: fn(q, k, v, b, mask, {}, mp),
                 arrs["q"], arrs["k"], arrs["v"], arrs["bias"], mp)
  assert seen and all(c > 1 for c in seen), seen


def _qkv(b=2, t=1, s=256, n=4, kh=2, h=16, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (b, t, n, h)), jax.random.normal(ks[1], (b, s, kh, h)),
          jax.random.normal(ks[2], (b, s, kh, h)))


def test_split_count_is_a_divisor_of_the_key_tiles():
  assert split.split_count(32, 8) == 8
  assert split.split_count(35, 3) == 5  # divisors 1, 5, 7, 35
  assert split.split_count(19, 64) == 19  # at most one chunk per tile
  assert split.split_count(7, 1) == 1


def test_settings_and_their_errors():
  for bad in (0, -2, 1.5, True, "4"):
    with pytest.raises(ValueError, match="num_splits"):
      core.Pallas(num_splits=bad)
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"num_splits must be a positive int"):
    wrapper.pallas_attention(q, k, v, weighting=get_weighting("softmax"), scale=0.25,
                             backend="gpu", interpret=True, num_splits=0)
  # Sparsemax/entmax: no split on request (their threshold needs the whole row) ...
  with pytest.raises(ValueError, match=r"threshold"):
    wrapper.pallas_attention(q, k, v, weighting=get_weighting("entmax15"), scale=0.25,
                             backend="gpu", interpret=True, num_splits=4)
  with pytest.raises(ValueError, match=r"num_splits=4.*threshold"):
    core.attention(q, k, v, weighting="sparsemax",
                   implementation=core.Pallas(interpret=True, num_splits=4))
  # ... and no split by default: the unsplit kernels run them.
  prob, _ = core.problem.plan(q, jnp.zeros((2, 4096, 2, 16)), jnp.zeros((2, 4096, 2, 16)),
                              weighting="entmax15")
  assert core.Pallas().splits(prob) == 1


def test_decoding_shapes_split_by_default():
  plan = lambda t, s, w="softmax": core.problem.plan(
      jnp.zeros((2, t, 4, 16)), jnp.zeros((2, s, 2, 16)), jnp.zeros((2, s, 2, 16)),
      weighting=w)[0]
  assert core.Pallas().splits(plan(1, 32768)) == 32
  assert core.Pallas().splits(plan(8, 4096, "stick_breaking")) == 4
  assert core.Pallas().splits(plan(1, 200_000)) == 64
  assert core.Pallas().splits(plan(9, 32768)) == 1  # not a decoding shape
  assert core.Pallas().splits(plan(1, 1000)) == 1  # a short cache
  assert core.Pallas(num_splits=1).splits(plan(1, 32768)) == 1
  assert core.Pallas(num_splits=6).splits(plan(64, 64)) == 6


def test_explicit_pallas_decodes_split(monkeypatch):
  # implementation="pallas" on a decoding shape runs the split forward by itself, and gives
  # the unsplit kernels' output.
  seen = _spy(monkeypatch)
  q, k, v = _qkv(t=2, s=4096)
  got = core.attention(q, k, v, implementation=core.Pallas(interpret=True, block_k=128))
  assert seen == [4]  # chunks of about 1024 keys
  want = core.attention(q, k, v, implementation=core.Pallas(interpret=True, block_k=128,
                                                            num_splits=1))
  np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("w", ["softmax", "stick_breaking"])
def test_paged_attention_on_the_split_pallas_kernels(w, monkeypatch):
  seen = _spy(monkeypatch)
  page, pages = 16, 8
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
  pool_k = jnp.asarray(rng.standard_normal((2 * pages, page, 2, 16)), jnp.float32)
  pool_v = jnp.asarray(rng.standard_normal((2 * pages, page, 2, 16)), jnp.float32)
  table = jnp.asarray(rng.permutation(2 * pages).reshape(2, pages), jnp.int32)
  lengths = jnp.asarray([37, 128], jnp.int32)
  impl = core.Pallas(interpret=True, block_k=16, num_splits=4)
  got, got_res = core.paged_attention(q, pool_k, pool_v, table, lengths, weighting=w,
                                      implementation=impl, return_residual=True)
  assert seen == [4]
  want, want_res = core.paged_attention(q, pool_k, pool_v, table, lengths, weighting=w,
                                        implementation="dense", return_residual=True)
  np.testing.assert_allclose(got, want, atol=2e-6)
  np.testing.assert_allclose(got_res, want_res, atol=2e-6)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_split_decoding_lowers_for_real_chips(platform):
  # Lowered (not run) for a GPU and a TPU: forward and gradient, GQA, sinks, a window.
  q, k, v = _qkv(t=1, s=2048)
  impl = core.Pallas(num_splits=8)
  sinks = jnp.zeros((4,))

  def loss(q, k, v):
    return jnp.sum(core.attention(q, k, v, implementation=impl, sinks=sinks,
                                  local_window_size=(512, 0), is_causal=False))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
      lowering_platforms=(platform,)).as_text()
  assert ("triton" in text.lower()) if platform == "cuda" else ("tpu_custom_call" in text)


def test_chunks_are_a_free_reshape_of_the_cache():
  # K and V reach the chunk kernels as [B·C, S/C, K, H] without a transpose or a copy per
  # query head: the lowered split forward holds no transpose or broadcast of them.
  q, k, v = _qkv(t=1, s=2048, n=8, kh=2, h=64)
  fn = lambda q, k, v: core.attention(q, k, v, implementation=core.Pallas(num_splits=8))
  text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  kv_shape = "tensor<2x2048x2x64xf32>"
  for line in text.splitlines():
    if kv_shape in line.split("->")[0] and ("transpose" in line or "broadcast" in line):
      raise AssertionError(f"K or V copied: {line.strip()}")
  assert "tensor<16x256x2x64xf32>" in text  # the chunks as a batch axis


def test_split_matches_the_unsplit_kernels_for_every_family_that_splits():
  # Chunk states merge to the unsplit kernels' output and residual (float32 rounding), ragged
  # key lengths included, for every family that splits.
  q, k, v = _qkv(t=3, s=200)
  for name in ("softmax", "sigmoid", "softmax_plus_one", "ssmax", "softpick", "stick_breaking",
               "relu:normalization=length", "sigmoid:normalization=none"):
    w = get_weighting(name)
    kw = dict(weighting=w, scale=0.25, backend="gpu", interpret=True, block_q=16, block_k=16,
              return_residual=True, kv_lengths=jnp.asarray([150, 200]))
    a = wrapper.pallas_attention(q, k, v, **kw)
    b = wrapper.pallas_attention(q, k, v, num_splits=4, **kw)
    np.testing.assert_allclose(b[0], a[0], atol=3e-6, err_msg=name)
    for x, y in zip(jax.tree.leaves(b[1]), jax.tree.leaves(a[1]), strict=True):
      np.testing.assert_allclose(x, y, atol=5e-6, err_msg=name)
