"""What differs between the JAX releases attnx supports, in one place.

attnx supports jax 0.10.2 through the newest release tested (``docs/development.md``,
"Supported JAX"). Where two releases need different code, the difference is here, each branch
naming the releases it is for; no other module tests a JAX version.

* **The GPU a Triton kernel is lowered for** (:func:`triton_lowering_target`). Pallas' Triton
  lowering needs the GPU's compute capability. jax 0.10 asked ``jax.local_devices("gpu")`` and,
  with none there (lowering for ``cuda`` on a CPU host, ``jax.export`` for two platforms),
  lowered for compute capability 9.0 (an H100). jax 0.11 and later ask the abstract mesh's
  ``AbstractDevice`` (``jax.sharding.use_abstract_mesh``) or the default device, and raise
  ``RuntimeError: No supported GPU devices found`` on a host without a GPU; each equation
  lowers under the abstract mesh it was traced in. attnx traces its GPU kernels for an H100
  there, as jax 0.10 lowered them, unless the caller named a GPU.
* **Which flax imports** (:func:`check_flax`). flax's floor on jax admits releases that do not
  import with the newest jax; attnx's Flax packages say which flax to install instead of
  flax's error about a JAX internal.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from importlib import metadata

import jax

#: The installed JAX as a tuple of ints, e.g. (0, 12, 0, 1).
JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)

#: jax >= 0.11: Pallas' Triton lowering reads its target GPU from the abstract mesh.
TRITON_TARGET_FROM_MESH = JAX_VERSION >= (0, 11)

#: The GPU a Triton kernel is lowered for where the host has none and the caller named none:
#: compute capability 9.0, jax 0.10's own fallback, so both ends of the range lower the same.
DEFAULT_GPU_KIND = "NVIDIA H100"

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _host_has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:  # no GPU backend in this process
    return False


def named_gpu() -> str | None:
  """The device kind of the GPU the caller set with ``jax.sharding.use_abstract_mesh`` (an
  ``AbstractMesh`` whose ``abstract_device`` is a GPU), or None."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and device.platform in _GPU_PLATFORMS:
    return device.device_kind
  return None


def triton_lowering_target(device_kind: str | None = None) -> contextlib.AbstractContextManager:
  """A context in which Pallas Triton kernels are traced so that they lower on any host.

  jax >= 0.11 lowers each equation under the abstract mesh it was traced in, and Triton's
  lowering reads the GPU from that mesh's ``AbstractDevice``: a kernel must be traced knowing
  its GPU. With no GPU in this process and none named by the caller, this enters an abstract
  mesh (the current one's axes) whose ``AbstractDevice`` is ``device_kind`` (default
  :data:`DEFAULT_GPU_KIND`). With a GPU present and ``device_kind`` None, with a GPU named by
  the caller, and on jax 0.10 (whose lowering falls back to compute capability 9.0 by itself)
  it does nothing.

  Args:
    device_kind: the GPU to lower for, as JAX names it (``"NVIDIA A100"``, ``"NVIDIA H100"``);
      it must be one that JAX's Triton lowering knows (``GpuVersion`` in
      ``jax/_src/pallas/triton/gpu_info.py``).
  """
  if (not TRITON_TARGET_FROM_MESH or named_gpu() is not None
      or (device_kind is None and _host_has_gpu())):
    return contextlib.nullcontext()
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:  # the operands' types name this mesh's devices: it cannot change here
    raise ValueError(
        f"Pallas Triton kernels traced inside a mesh of {_kind(mesh)} devices ({mesh}) cannot "
        f"be lowered for a GPU: jax {jax.__version__} lowers each kernel for the GPU of the "
        "mesh it was traced in. Trace under a mesh of GPUs, or of abstract ones: "
        "jax.sharding.AbstractMesh(axis_sizes, axis_names, abstract_device=jax.sharding."
        "AbstractDevice('NVIDIA H100', None, 'gpu')) in jax.shard_map, then lower with "
        "lowering_platforms=('cuda',).")
  return _abstract_gpu(device_kind or DEFAULT_GPU_KIND)


def _kind(mesh: jax.sharding.AbstractMesh) -> str:
  device = getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else "host"


@contextlib.contextmanager
def _abstract_gpu(device_kind: str) -> Iterator[None]:
  mesh = jax.sharding.get_abstract_mesh()
  gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=gpu)):
    yield


#: The first flax release that imports with a jax release, where flax's own floor on jax
#: admits older flax that do not (measured: flax 0.12.8 and 0.12.9 fail to import with jax
#: 0.12.0.1 on ``jax.experimental.hijax``; 0.12.10 imports).
FLAX_FOR_JAX: tuple[tuple[tuple[int, ...], str], ...] = (((0, 12), "0.12.10"),)


def _release(version: str) -> tuple[int, ...]:
  parts = []
  for p in version.split("."):
    digits = "".join(itertools.takewhile(str.isdigit, p))
    if not digits:
      break
    parts.append(int(digits))
  return tuple(parts)


def check_flax() -> None:
  """Raises ImportError, saying what to install, where the installed flax cannot import with
  the installed jax (pip keeps an installed flax that meets attnx's floor, and flax's import
  error names a JAX internal). Reads versions only; imports nothing."""
  try:
    flax = metadata.version("flax")
  except metadata.PackageNotFoundError:
    return  # flax's own ImportError says it
  for since, first in FLAX_FOR_JAX:
    if JAX_VERSION >= since and _release(flax) < _release(first):
      raise ImportError(
          f"flax {flax} does not work with jax {jax.__version__}: with jax >= "
          f"{'.'.join(map(str, since))} attnx's Flax modules need flax >= {first} "
          f"(pip install 'flax>={first}'), or keep jax < {'.'.join(map(str, since))}.")
