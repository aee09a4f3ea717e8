"""Ahead-of-time compilation for absent chips (attnx.aot).

Without JAX's CUDA plugin or libtpu the compiling tests skip with the module's own reason; the
availability checks (missing packages, drifted versions) run everywhere with the package
versions mocked. With them installed, a few tiny Pallas kernels compile for an H100 and a TPU
v5e (≈ 1 s each): one that fits (its kernel record), one whose tiles cannot fit (shared memory
on the GPU, VMEM on the TPU).
"""

from __future__ import annotations

import os
from importlib import metadata

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from attnx import aot


def _needs(target: str) -> None:
  reason = aot.available(target)
  if reason:
    pytest.skip(reason)


def _fake_versions(monkeypatch: pytest.MonkeyPatch, **versions: str | None) -> None:
  """importlib.metadata.version answering ``versions`` (None: not installed) for the named
  distributions (underscores for dashes), the real answer for the others."""
  real = metadata.version
  fake = {k.replace("_", "-"): v for k, v in versions.items()}

  def version(dist: str) -> str:
    if dist in fake:
      if fake[dist] is None:
        raise metadata.PackageNotFoundError(dist)
      return fake[dist]
    return real(dist)

  monkeypatch.setattr(metadata, "version", version)


# ---- facts and availability (no compiling) ---------------------------------------------------


def test_targets_name_their_chips_facts():
  h100, a100 = aot.TARGETS["h100"], aot.TARGETS["a100"]
  assert (h100.platform, h100.arch, h100.cores, h100.smem_per_block) == ("cuda", "sm_90a", 132,
                                                                         232448)
  assert (a100.arch, a100.cores, a100.smem_per_block) == ("sm_80", 108, 166912)
  for t in aot.TARGETS.values():
    if t.platform == "cuda":  # the vendored target descriptions ship with the package
      assert os.path.isfile(os.path.join(os.path.dirname(aot.__file__), "gpu_specs", t.spec))
    else:
      assert t.vmem_bytes and t.scoped_vmem_default and t.topology
  assert {"h100", "a100", "v5e", "v6e"} <= set(aot.TARGETS)


def test_unknown_target_is_a_value_error():
  with pytest.raises(ValueError, match="unknown target 'h200'"):
    aot.available("h200")


def test_missing_cuda_plugin_says_what_to_install(monkeypatch):
  _fake_versions(monkeypatch, jaxlib="0.10.2", jax_cuda12_plugin=None, jax_cuda12_pjrt=None,
                 jax_cuda13_plugin=None, jax_cuda13_pjrt=None)
  with pytest.raises(aot.AotUnavailable, match=r"pip install 'jax-cuda12-plugin==0\.10\.2' "
                                               r"'jax-cuda12-pjrt==0\.10\.2'"):
    aot.require("h100")
  assert "jax-cuda12-plugin==0.10.2" in aot.available("a100")


def test_drifted_cuda_plugin_names_the_versions(monkeypatch):
  _fake_versions(monkeypatch, jaxlib="0.10.2", jax_cuda12_plugin="0.9.0",
                 jax_cuda12_pjrt="0.10.2", jax_cuda13_plugin=None, jax_cuda13_pjrt=None)
  with pytest.raises(aot.AotUnavailable) as e:
    aot.require("h100")
  msg = str(e.value)
  assert "does not match jaxlib 0.10.2" in msg and "jax-cuda12-plugin 0.9.0" in msg
  assert "pip install 'jax-cuda12-plugin==0.10.2'" in msg


def test_missing_or_drifted_libtpu_says_what_to_install(monkeypatch):
  pin = aot._tpu_pin()  # what jax[tpu] pins for the installed jax, e.g. ==0.0.42.*
  _fake_versions(monkeypatch, libtpu=None)
  with pytest.raises(aot.AotUnavailable, match="pip install"):
    aot.require("v5e")
  if pin:
    assert f"libtpu{pin}" in aot.available("v6e")
    _fake_versions(monkeypatch, libtpu="0.0.1")
    assert "libtpu 0.0.1 does not match jax" in aot.available("v5e")


def test_version_specifiers():
  assert aot._matches("0.0.42.1", "==0.0.42.*") and aot._matches("0.0.42", "==0.0.42.*")
  assert not aot._matches("0.0.43.1", "==0.0.42.*") and not aot._matches("0.0.420", "==0.0.42.*")
  assert aot._matches("1.2", "==1.2") and not aot._matches("1.2.1", "==1.2")


def test_limit_checks_name_each_limit_exceeded():
  k = aot.KernelReport("attnx_pallas_dkv", "pallas", registers=255, spill_store_bytes=24,
                       spill_load_bytes=24, smem_bytes=300_000)
  ok = aot.CompileReport("h100", True, "ok", None, 1.0, 0.1, kernels=(k,))
  failed = lambda report, **kw: [s for s, met in report.limit_checks(**kw) if not met]
  assert failed(ok) == ["attnx_pallas_dkv spills 24 B", "attnx_pallas_dkv smem 300000 > 232448"]
  assert failed(ok, spills_allowed={"attnx_pallas_dkv"}) == [
      "attnx_pallas_dkv smem 300000 > 232448"]  # an allowed spill; the size still counts
  clean = aot.CompileReport("h100", True, "ok", None, 1.0, 0.1, kernels=(
      aot.KernelReport("attnx_pallas_fwd", "pallas", registers=200, spill_store_bytes=0,
                       smem_bytes=1024),))
  assert failed(clean) == [] and len(clean.limit_checks()) == 5
  bad = aot.CompileReport("h100", False, "smem_overflow", "RESOURCE_EXHAUSTED: Shared memory\nx",
                          1.0, 0.1)
  assert bad.limit_checks() == [("smem_overflow: RESOURCE_EXHAUSTED: Shared memory", False)]
  unmeasured = aot.CompileReport("h100", True, "ok", None, 1.0, 0.1, kernels=(
      aot.KernelReport("attnx_pallas_fwd", "pallas", smem_bytes=1024),))
  assert failed(unmeasured) == ["registers not measured (no ptxas)"]
  assert failed(aot.CompileReport("v5e", True, "ok", None, 1.0, 0.1)) == ["no Pallas kernel found"]
  big = aot.CompileReport("v5e", True, "ok", None, 1.0, 0.1, kernels=(
      aot.KernelReport("attnx_pallas_fwd", "pallas", vmem_bytes=200 << 20),))
  assert failed(big) == [f"attnx_pallas_fwd VMEM {200 << 20} > {128 << 20}"]


def test_errors_are_categorized():
  assert aot._category("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested "
                       "524288, available: 232448") == "smem_overflow"
  assert aot._category("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of "
                       "memory in memory space vmem") == "vmem_oom"
  assert aot._category("RESOURCE_EXHAUSTED: Allocation (size=2147483648) would exceed memory "
                       "(size=134217728) :: #allocation2 [space=vmem, scoped]") == "vmem_oom"
  assert aot._category("INTERNAL: something else") == "compile_error"


# ---- GPU (H100) -------------------------------------------------------------------------------


def _matmul(x_ref, y_ref, o_ref):
  o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def _triton_matmul(x, y, block_m: int):
  from jax.experimental.pallas import triton as plgpu

  m, n = x.shape[0], y.shape[1]
  return pl.pallas_call(
      _matmul, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(m // block_m,),
      in_specs=[pl.BlockSpec((block_m, x.shape[1]), lambda i: (i, 0)),
                pl.BlockSpec(y.shape, lambda i: (0, 0))],
      out_specs=pl.BlockSpec((block_m, n), lambda i: (i, 0)), name="aot_tiny",
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(x, y)


def test_tiny_triton_kernel_compiles_for_h100(tmp_path):
  _needs("h100")
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  y = jnp.zeros((64, 64), jnp.float32)  # a concrete array is used for its shape only
  r = aot.compile_for(lambda x, y: _triton_matmul(x, y, 32), x, y, target="h100",
                      keep_dump=str(tmp_path))
  assert r.ok and r.category == "ok" and r.error is None, r
  k = r.kernel("aot_tiny")
  assert k.kind == "pallas" and r.pallas_kernels == (k,)
  assert (k.grid, k.num_warps, k.num_stages) == ((4, 1, 1), 4, 1)
  assert k.smem_bytes is not None and 0 < k.smem_bytes <= aot.TARGETS["h100"].smem_per_block
  if aot.find_ptxas() is None:
    assert any("ptxas" in n for n in r.notes)
  else:
    assert 0 < k.registers <= 255 and k.spill_store_bytes == 0
  assert "aot_tiny" in str(r) and r.memory and r.compile_seconds > 0
  assert os.path.dirname(r.dump_dir) == str(tmp_path) and os.listdir(r.dump_dir)


def test_too_large_tile_overflows_shared_memory():
  _needs("h100")
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)  # both operands in smem: 2 x 256 KiB
  r = aot.compile_for(lambda x, y: _triton_matmul(x, y, 256), x, x, target="h100")
  assert not r.ok and r.category == "smem_overflow", r
  assert "available: 232448" in r.error


def test_tracing_errors_are_reported():
  _needs("h100")

  def bad(x):
    raise ValueError("tile too large")

  r = aot.compile_for(bad, jax.ShapeDtypeStruct((8,), jnp.float32), target="h100")
  assert (r.ok, r.category) == (False, "trace_error") and "tile too large" in r.error


# ---- TPU (v5e) --------------------------------------------------------------------------------


def _accumulate_in_scratch(x_ref, o_ref, s_ref):
  """Accumulates over the grid at both ends of a scratch buffer (the compiler keeps all of it:
  a scratch only written and read back in one step is optimized away)."""
  last = s_ref.shape[0] - 8

  @pl.when(pl.program_id(0) == 0)
  def _():
    s_ref[0:8, :] = jnp.zeros((8, 128), jnp.float32)
    s_ref[pl.ds(last, 8), :] = jnp.zeros((8, 128), jnp.float32)

  s_ref[0:8, :] += x_ref[...]
  s_ref[pl.ds(last, 8), :] += x_ref[...]
  o_ref[...] = s_ref[0:8, :] + s_ref[pl.ds(last, 8), :]


def _mosaic(x, scratch_rows: int):
  from jax.experimental.pallas import tpu as pltpu

  return pl.pallas_call(
      _accumulate_in_scratch, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)), name="aot_mosaic",
      scratch_shapes=[pltpu.VMEM((scratch_rows, 128), jnp.float32)])(x)


def test_tiny_mosaic_kernel_compiles_for_v5e():
  _needs("v5e")
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  r = aot.compile_for(lambda x: _mosaic(x, 1024), x, target="v5e")  # 512 KiB of scratch
  assert r.ok, r
  k = r.kernel("aot_mosaic")
  assert k.kind == "pallas" and k.grid == (4,)
  assert 512 * 1024 <= k.vmem_bytes < k.vmem_limit_bytes == aot.TARGETS["v5e"].scoped_vmem_default


def test_too_large_scratch_runs_out_of_vmem():
  _needs("v5e")
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  r = aot.compile_for(lambda x: _mosaic(x, 64 * 1024), x, target="v5e")  # 32 MiB > 16 MiB
  assert not r.ok and r.category == "vmem_oom", r
