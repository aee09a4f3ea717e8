"""attnx._compat: what differs between the JAX releases attnx supports.

Each difference is tested on the JAX installed (CI runs the oldest and the newest supported),
the branch for the other end by patching the version where the logic allows it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh
from jax.sharding import PartitionSpec as P
from support import lowering

from attnx import _compat, core
from attnx.core.parallel import ring

A100 = AbstractDevice("NVIDIA A100", None, "gpu")


def _gpu_info():
  from jax._src.pallas.triton import gpu_info  # noqa: PLC0415 - jax >= 0.11 only
  return gpu_info.get_gpu_info()


@pytest.mark.skipif(not _compat.TRITON_TARGET_FROM_MESH, reason="jax < 0.11 reads no mesh")
def test_the_default_gpu_is_an_h100_and_a_named_one_wins():
  # This host has no GPU: Triton's lowering finds none by itself.
  with pytest.raises(ValueError):
    _gpu_info()
  with _compat.triton_lowering_target():
    assert _gpu_info().compute_capability == 90
  with _compat.triton_lowering_target("NVIDIA A100"):
    assert _gpu_info().compute_capability == 80
  with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=A100)):
    assert _compat.named_gpu() == "NVIDIA A100"
    with _compat.triton_lowering_target():  # the caller's GPU is kept
      assert _gpu_info().compute_capability == 80


def test_jax_0_10_needs_no_target(monkeypatch):
  monkeypatch.setattr(_compat, "TRITON_TARGET_FROM_MESH", False)
  before = jax.sharding.get_abstract_mesh()
  with _compat.triton_lowering_target():
    assert jax.sharding.get_abstract_mesh() is before


def test_pallas_attention_lowers_for_a_named_gpu_from_this_host():
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  f = jax.jit(lambda q: core.attention(q, q, q, weighting="relu", is_causal=True,
                                       implementation="pallas"))
  for mesh in (None, AbstractMesh((), (), abstract_device=A100)):
    if mesh is None:
      text = f.trace(q).lower(lowering_platforms=("cuda",)).as_text()
    else:
      with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w.$]+)", text) == ["__gpu$xla.gpu.triton"]


def _ring_grads(mesh):
  def loss(q, k, v):
    out = ring.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                              implementation="pallas", pallas_backend="gpu")
    return jnp.sum(out.astype(jnp.float32))
  x = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  return jax.jit(jax.shard_map(jax.grad(loss, (0, 1, 2)), mesh=mesh,
                               in_specs=(P(None, "sp"),) * 3, out_specs=(P(None, "sp"),) * 3,
                               check_vma=False)).trace(x, x, x)


def test_triton_kernels_in_a_mesh_of_cpus_say_how_to_lower_for_a_gpu():
  cpus = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  if _compat.TRITON_TARGET_FROM_MESH:
    with pytest.raises(ValueError, match=r"mesh of cpu devices .*AbstractDevice\('NVIDIA H100'"):
      _ring_grads(cpus)
  else:  # jax 0.10 lowers them for compute capability 9.0
    assert "__gpu$xla.gpu.triton" in _ring_grads(cpus).lower(
        lowering_platforms=("cuda",)).as_text()
  text = _ring_grads(lowering.chip_mesh("cuda", (1,), ("sp",))).lower(
      lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w.$]+)", text)) == {"__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("jax_version,flax,ok", [
    ((0, 12, 0, 1), "0.12.8", False), ((0, 12, 0, 1), "0.12.9", False),
    ((0, 12, 0, 1), "0.12.10", True), ((0, 13), "0.12.12", True), ((0, 12), "0.13.0rc1", True),
    ((0, 10, 2), "0.12.1", True), ((0, 11, 2), "0.12.8", True)])
def test_check_flax_names_the_flax_this_jax_needs(monkeypatch, jax_version, flax, ok):
  monkeypatch.setattr(_compat, "JAX_VERSION", jax_version)
  monkeypatch.setattr(_compat.metadata, "version", lambda name: flax)
  if ok:
    _compat.check_flax()
  else:
    with pytest.raises(ImportError, match=r"flax 0\.12\.\d+ does not work .*'flax>=0\.12\.10'"):
      _compat.check_flax()


def test_the_installed_flax_works_with_the_installed_jax():
  _compat.check_flax()
  import flax.nnx  # noqa: F401, PLC0415
