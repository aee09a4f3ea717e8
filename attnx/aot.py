"""Ahead-of-time compilation for chips that are not here: real device binaries and their costs.

Compiles a JAX function (in particular attnx's Pallas kernels) for an H100/A100 GPU or a TPU
v5e/v6e/v5p/v4 on any host, a CPU-only one included, and reports per kernel what the chip's
compiler decided: for a GPU the Triton kernels' registers, spills, shared memory, launch grid and
warps (XLA + Triton compile the program to PTX, ``ptxas`` to SASS exactly as XLA itself runs it);
for a TPU each Mosaic kernel's scoped VMEM and its limit. A program that does not fit fails
here as it would on the chip (too much shared memory, VMEM out of memory), in seconds.

    from attnx import aot
    report = aot.compile_for(jax.grad(loss), q, k, v, target="h100")  # q, k, v: arrays or
    print(report)                                                      # ShapeDtypeStructs

How (all private or semi-private JAX APIs, wrapped here and nowhere else):

* GPU: the CUDA PJRT plugin (``jax-cuda12-plugin``/``jax-cuda12-pjrt``, the version of jaxlib;
  no CUDA libraries needed) makes a compile-only topology from XLA's own description of the chip
  (``gpu_specs/*.txtpb``, ``GpuTargetConfigProto`` text, vendored from openxla/xla). Its
  check of the CUDA libraries is skipped: ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` while JAX
  discovers its plugins (once per process; this module starts the discovery when it makes its
  first device, so a real GPU's check is skipped too when that comes first), and the plugin is
  registered late where the discovery already ran and the check failed. Per-kernel figures
  come from XLA's dump of each compile (``xla_dump_to`` as a per-compile option, a fresh
  directory each time): the thunk sequence (grid, threads, dynamic shared memory), the
  optimized HLO (Triton's ``num_warps``/``num_stages``) and the PTX (``xla_dump_emitter_re``),
  run through ``ptxas -v`` (registers, spills, stack, static shared memory).
* TPU: ``libtpu`` (the version JAX pins for its ``tpu`` extra) makes a compile-only topology
  (``jax.experimental.topologies``). Per-kernel scoped VMEM is the ``used_scoped_memory_configs``
  that the TPU compiler writes into each Mosaic custom call (dumped HLO after codegen); the
  grids come from the traced program's ``pallas_call`` equations.

The persistent compilation cache is bypassed for these compiles (its key ignores the dump
directory, and a compile-only client cannot load an entry anyway). XLA flags that the process
set for speed (``--xla_backend_optimization_level``, ``--xla_llvm_disable_expensive_passes``)
are reset to XLA's defaults per compile, so the figures are those of a production build.

Install (versions must equal jaxlib's; ``pip install`` lines are in :class:`AotUnavailable`'s
messages): ``jax-cuda12-plugin==V jax-cuda12-pjrt==V`` (V = jaxlib's version; without the
``with-cuda`` extra: no CUDA libraries), for registers a ``ptxas`` (``nvidia-cuda-nvcc-cu12``, a
CUDA toolkit, or Triton's), and for TPUs ``libtpu`` as pinned by ``jax[tpu]==V``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from importlib import metadata
from typing import Any, Literal

import jax

from attnx import _compat

__all__ = ["TARGETS", "AotUnavailable", "CompileReport", "KernelReport", "Target", "available",
           "compile_for", "device", "find_ptxas", "require", "toolchain_versions"]

_SPECS = os.path.join(os.path.dirname(__file__), "gpu_specs")
_SKIP_CUDA_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


@dataclasses.dataclass(frozen=True)
class Target:
  """A chip to compile for, and the facts about it that bound a kernel.

  Attributes:
    name: the key in :data:`TARGETS`.
    platform: ``"cuda"`` or ``"tpu"`` (JAX's lowering platform).
    description: the chip in words.
    device_kind: what JAX calls the compile-only device.
    gpu_kind: GPU: the name JAX's Triton lowering knows the chip by (its compute capability).
    cores: streaming multiprocessors (GPU) or TensorCores per chip (TPU).
    arch: the GPU's ``ptxas`` architecture (``sm_90a``, ``sm_80``); None on a TPU.
    smem_per_block: GPU: the most shared memory one block may use (opt-in limit), bytes.
    smem_per_core: GPU: shared memory per SM, bytes.
    registers_per_core: GPU: 32-bit registers per SM.
    max_registers_per_thread: GPU: the most registers one thread may use.
    vmem_bytes: TPU: the VMEM of a TensorCore as the compiler enforces it.
    scoped_vmem_default: TPU: a kernel's scoped-VMEM limit unless it sets ``vmem_limit_bytes``.
    spec: GPU: the target description file in ``gpu_specs/``.
    topology: TPU: the topology name given to libtpu (the first device is compiled for).
  """

  name: str
  platform: Literal["cuda", "tpu"]
  description: str
  device_kind: str
  cores: int
  arch: str | None = None
  smem_per_block: int | None = None
  smem_per_core: int | None = None
  registers_per_core: int | None = None
  max_registers_per_thread: int | None = None
  vmem_bytes: int | None = None
  scoped_vmem_default: int | None = None
  spec: str | None = None
  topology: str | None = None
  gpu_kind: str | None = None


_MIB = 1 << 20
#: The chips :func:`compile_for` knows. GPU figures are from XLA's target descriptions; the TPU
#: VMEM sizes and default scoped limits as libtpu 0.0.42 enforces them (its error messages).
TARGETS: Mapping[str, Target] = {t.name: t for t in (
    Target("h100", "cuda", "NVIDIA H100 SXM 80GB (Hopper)", "NVIDIA H100 80GB HBM3", cores=132,
           arch="sm_90a", smem_per_block=232448, smem_per_core=233472,
           registers_per_core=65536, max_registers_per_thread=255, spec="h100_sxm.txtpb",
           gpu_kind="NVIDIA H100"),
    Target("a100", "cuda", "NVIDIA A100 SXM4 80GB (Ampere)", "NVIDIA A100-SXM4-80GB", cores=108,
           arch="sm_80", smem_per_block=166912, smem_per_core=167936,
           registers_per_core=65536, max_registers_per_thread=255, spec="a100_sxm_80.txtpb",
           gpu_kind="NVIDIA A100"),
    Target("v5e", "tpu", "TPU v5e (v5 lite)", "TPU v5 lite", cores=1, vmem_bytes=128 * _MIB,
           scoped_vmem_default=16 * _MIB, topology="v5e:2x2"),
    Target("v6e", "tpu", "TPU v6e (Trillium)", "TPU v6 lite", cores=1, vmem_bytes=128 * _MIB,
           scoped_vmem_default=32 * _MIB, topology="v6e:2x2"),
    Target("v5p", "tpu", "TPU v5p", "TPU v5", cores=2, vmem_bytes=64 * _MIB,
           scoped_vmem_default=16 * _MIB, topology="v5p:2x2x1"),
    Target("v4", "tpu", "TPU v4", "TPU v4", cores=2, vmem_bytes=16 * _MIB,
           scoped_vmem_default=16 * _MIB, topology="v4:2x2x1"),
)}


class AotUnavailable(RuntimeError):
  """This host cannot compile for the target: a package is missing or its version drifted.
  The message says what to ``pip install``."""


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """One compiled kernel (a GPU kernel launch, or a TPU Mosaic custom call).

  Attributes:
    name: the kernel's name (a ``pallas_call``'s ``name``, or XLA's fusion name).
    kind: ``"pallas"`` (a Triton or Mosaic kernel from a ``pallas_call``) or ``"xla"`` (a fusion
      XLA generated around them; GPU only).
    grid: GPU: the launch grid (x, y, z); TPU: the ``pallas_call`` grid. None when unknown.
    num_warps: GPU: threads per block / 32.
    num_stages: GPU Triton kernels: software-pipelining stages.
    registers: GPU: registers per thread (``ptxas``); None without a ``ptxas``.
    spill_store_bytes, spill_load_bytes: GPU: register spills to local memory (``ptxas``).
    stack_bytes: GPU: stack frame per thread (``ptxas``).
    smem_bytes: GPU: shared memory per block, dynamic (the launch's) plus static (``ptxas``).
    vmem_bytes: TPU: scoped VMEM the kernel uses (its pipeline buffers, scratch and the
      compiler's internal scratch).
    vmem_limit_bytes: TPU: the kernel's scoped VMEM limit (its ``vmem_limit_bytes``, else the
      chip's default).
  """

  name: str
  kind: Literal["pallas", "xla"]
  grid: tuple[int, ...] | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  registers: int | None = None
  spill_store_bytes: int | None = None
  spill_load_bytes: int | None = None
  stack_bytes: int | None = None
  smem_bytes: int | None = None
  vmem_bytes: int | None = None
  vmem_limit_bytes: int | None = None


Category = Literal["ok", "trace_error", "smem_overflow", "vmem_oom", "compile_error"]


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What compiling one program for one target gave.

  Attributes:
    target: the :data:`TARGETS` name.
    ok: it compiled.
    category: ``"ok"``; ``"trace_error"`` (tracing or lowering raised, before XLA: e.g. a tile
      size the kernel rejects); ``"smem_overflow"`` (a GPU kernel needs more shared memory than
      a block may have); ``"vmem_oom"`` (a TPU kernel's VMEM exceeds its scoped limit or the
      chip's VMEM); ``"compile_error"`` (any other compiler error).
    error: the error's text (None when ok).
    compile_seconds: the XLA compile (Triton and ptxas included), not tracing or lowering.
    lower_seconds: tracing and lowering to StableHLO.
    kernels: every kernel found, the ``pallas_call`` kernels first (also after a failed
      compile: those compiled before the failure, when the dump has them).
    memory: ``compiled.memory_analysis()`` (argument/output/temp/code bytes), when ok.
    notes: what could not be measured and why (e.g. no ``ptxas``).
    dump_dir: the XLA dump, when kept (``keep_dump``).
  """

  target: str
  ok: bool
  category: Category
  error: str | None
  compile_seconds: float
  lower_seconds: float
  kernels: tuple[KernelReport, ...] = ()
  memory: Mapping[str, int] | None = None
  notes: tuple[str, ...] = ()
  dump_dir: str | None = None

  @property
  def pallas_kernels(self) -> tuple[KernelReport, ...]:
    """The kernels of the program's ``pallas_call`` s."""
    return tuple(k for k in self.kernels if k.kind == "pallas")

  def limit_checks(self, spills_allowed: Collection[str] = ()) -> list[tuple[str, bool]]:
    """Whether the program fits its chip (:data:`TARGETS`), as ``(statement, met)`` pairs
    whose statement names the value and the limit (what a report says of a failure): it
    compiled (``"<category>: <first error line>"``); per Pallas kernel no register spills
    (except kernels named in ``spills_allowed``, e.g. tiles measured faster with their
    spills), shared memory within a block's and VMEM within the chip's; on a GPU the
    registers were measured (a ``ptxas``); there is a Pallas kernel at all."""
    t = TARGETS[self.target]
    if not self.ok:
      return [(f"{self.category}: {(self.error or '').splitlines()[0][:160]}", False)]
    out = []
    for k in self.pallas_kernels:
      out.append((f"{k.name} spills {k.spill_store_bytes} B",
                  not k.spill_store_bytes or k.name in spills_allowed))
      out.append((f"{k.name} smem {k.smem_bytes} > {t.smem_per_block}",
                  not (k.smem_bytes and t.smem_per_block and k.smem_bytes > t.smem_per_block)))
      # A kernel over its scoped-VMEM limit fails to compile (vmem_oom). The compiler's figure
      # can exceed the limit the kernel asked for (its internal scratch on top; seen
      # compiling): what must hold is the chip's VMEM.
      out.append((f"{k.name} VMEM {k.vmem_bytes} > {t.vmem_bytes}",
                  not (k.vmem_bytes and t.vmem_bytes and k.vmem_bytes > t.vmem_bytes)))
    return out + [("registers not measured (no ptxas)", t.platform != "cuda"
                   or all(k.registers is not None for k in self.pallas_kernels)),
                  ("no Pallas kernel found", bool(self.pallas_kernels))]

  def kernel(self, name: str) -> KernelReport:
    """The kernel called ``name`` (KeyError when none)."""
    for k in self.kernels:
      if k.name == name:
        return k
    raise KeyError(f"no kernel {name!r}; kernels: {[k.name for k in self.kernels]}")

  def __str__(self) -> str:
    head = (f"[{self.target}] {'ok' if self.ok else self.category} "
            f"(compile {self.compile_seconds:.2f} s, lower {self.lower_seconds:.2f} s)")
    lines = [head]
    if self.error:
      lines.append("  " + self.error.splitlines()[0][:300])
    for k in self.pallas_kernels:
      lines.append("  " + _kernel_line(k))
    lines += [f"  note: {n}" for n in self.notes]
    return "\n".join(lines)


def _kernel_line(k: KernelReport) -> str:
  parts = [k.name]
  for label, v in (("grid", k.grid), ("warps", k.num_warps), ("stages", k.num_stages),
                   ("regs", k.registers), ("spill st/ld", None if k.spill_store_bytes is None
                                           else f"{k.spill_store_bytes}/{k.spill_load_bytes}"),
                   ("smem", k.smem_bytes), ("vmem", k.vmem_bytes),
                   ("vmem limit", k.vmem_limit_bytes)):
    if v is not None:
      parts.append(f"{label} {list(v) if isinstance(v, tuple) else v}")
  return ", ".join(parts)


# ----------------------------------------------------------------------------------------------
# Availability: packages and their versions.


def _version(dist: str) -> str | None:
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def toolchain_versions() -> dict[str, str | None]:
  """The installed versions of what these compiles depend on (None: not installed)."""
  return {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                                   "libtpu", "nvidia-cuda-nvcc-cu12")}


def _gpu_problem() -> str | None:
  """Why the CUDA plugin cannot be used (None when it can)."""
  jaxlib = _version("jaxlib")
  pairs = [(f"jax-cuda{c}-plugin", f"jax-cuda{c}-pjrt") for c in (12, 13)]
  installed = [(p, r) for p, r in pairs if _version(p) is not None or _version(r) is not None]
  want = f"pip install 'jax-cuda12-plugin=={jaxlib}' 'jax-cuda12-pjrt=={jaxlib}'"
  if not installed:
    return (f"GPU ahead-of-time compilation needs JAX's CUDA plugin matching jaxlib {jaxlib}: "
            f"{want} (no CUDA libraries or GPU needed)")
  for plugin, pjrt in installed:
    got = {plugin: _version(plugin), pjrt: _version(pjrt)}
    bad = {d: v for d, v in got.items() if v != jaxlib}
    if not bad:
      return None
  drift = ", ".join(f"{d} {'missing' if v is None else v}" for d, v in bad.items())
  return (f"JAX's CUDA plugin does not match jaxlib {jaxlib} ({drift}); "
          f"{want.replace('cuda12', plugin.split('-')[1])}")


def _tpu_pin() -> str | None:
  """The libtpu requirement of ``jax[tpu]`` for the installed jax, e.g. ``==0.0.42.*``."""
  for req in metadata.requires("jax") or ():
    m = re.match(r"\s*libtpu\s*([=<>!~][^;]*);.*extra\s*==\s*['\"]tpu['\"]", req)
    if m:
      return m.group(1).strip()
  return None


def _matches(version: str, spec: str) -> bool:
  """Whether ``version`` meets ``spec`` (``==X``, ``==X.*`` or a comma-separated list; other
  operators are not checked)."""
  for part in spec.split(","):
    part = part.strip()
    if part.startswith("=="):
      want = part[2:].strip()
      if want.endswith(".*"):
        if not (version == want[:-2] or version.startswith(want[:-1])):
          return False
      elif version != want:
        return False
  return True


def _tpu_problem() -> str | None:
  """Why libtpu cannot be used (None when it can)."""
  jax_v = _version("jax")
  pin = _tpu_pin()
  want = f"pip install 'libtpu{pin}'" if pin else f"pip install 'jax[tpu]=={jax_v}'"
  got = _version("libtpu")
  if got is None:
    return f"TPU ahead-of-time compilation needs libtpu for jax {jax_v}: {want}"
  if pin and not _matches(got, pin):
    return f"libtpu {got} does not match jax {jax_v} (it pins libtpu{pin}): {want}"
  return None


def _target(name: str) -> Target:
  try:
    return TARGETS[name]
  except KeyError:
    raise ValueError(f"unknown target {name!r}; known: {sorted(TARGETS)}") from None


def available(target: str) -> str | None:
  """Why this host cannot compile for ``target`` (a :data:`TARGETS` name), or None when it can.

  Checks the packages and their versions, and that a compile-only device can be made (the
  first call per target loads the plugin: ~1 s)."""
  try:
    device(target)
  except AotUnavailable as e:
    return str(e)
  return None


def require(target: str) -> Target:
  """The :class:`Target`, or :class:`AotUnavailable` saying what to install."""
  t = _target(target)
  problem = _gpu_problem() if t.platform == "cuda" else _tpu_problem()
  if problem:
    raise AotUnavailable(problem)
  return t


# ----------------------------------------------------------------------------------------------
# Compile-only devices.

_lock = threading.Lock()


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
  old = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if old is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = old


def _cuda_topology_factory_ready() -> None:
  """Registers the CUDA plugin's topology factory, also where JAX's plugin discovery already ran
  and the plugin's CUDA-library check failed (no GPU here)."""
  from jax._src import xla_bridge as xb

  with _env(_SKIP_CUDA_CHECK, os.environ.get(_SKIP_CUDA_CHECK) or "1"):
    xb._discover_and_register_pjrt_plugins()
    if "cuda" in xb._topology_factories:
      return
    err = None
    for mod in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
      if importlib.util.find_spec(mod) is None:
        continue
      try:
        importlib.import_module(mod).initialize()
      except Exception as e:  # noqa: BLE001 - reported below
        err = e
      if "cuda" in xb._topology_factories:
        return
  raise AotUnavailable(
      "JAX's CUDA plugin is installed but did not register" + (f": {err}" if err else "")
      + f" (JAX discovers plugins once per process; {_SKIP_CUDA_CHECK}=1 lets it register "
      "without CUDA libraries)")


@functools.cache
def _device_cached(name: str) -> Any:
  t = require(name)
  from jax.experimental import topologies

  with _lock:
    if t.platform != "cuda" and _gpu_problem() is None:
      # JAX has not discovered its plugins yet where it will when tracing for the TPU: with
      # the CUDA check skipped, so that the CUDA plugin registers quietly (no GPU here).
      from jax._src import xla_bridge as xb

      with _env(_SKIP_CUDA_CHECK, os.environ.get(_SKIP_CUDA_CHECK) or "1"):
        xb._discover_and_register_pjrt_plugins()
    if t.platform == "cuda":
      _cuda_topology_factory_ready()
      with open(os.path.join(_SPECS, t.spec)) as f:
        spec = f.read()
      try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=spec)
      except Exception as e:
        raise AotUnavailable(
            f"cannot make a compile-only {t.description} with jaxlib {_version('jaxlib')} from "
            f"gpu_specs/{t.spec}: {e} (a field this jaxlib's XLA does not know? XLA's log "
            "names it)") from e
    else:
      try:
        # libtpu takes a lock file per host unless told that several processes may load it
        # (pytest -n 2, two targets at once): compile-only clients share no device.
        with _env("ALLOW_MULTIPLE_LIBTPU_LOAD", os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD")
                  or "1"):
          topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu")
      except Exception as e:
        raise AotUnavailable(f"cannot make a compile-only {t.description} ({t.topology}) with "
                             f"libtpu {_version('libtpu')}: {e}") from e
  return topo.devices[0]


def device(target: str) -> Any:
  """A compile-only JAX device of ``target`` (cached; :class:`AotUnavailable` when missing)."""
  require(target)
  return _device_cached(target)


# ----------------------------------------------------------------------------------------------
# ptxas.


def find_ptxas() -> str | None:
  """A ``ptxas``: the ``nvidia-cuda-nvcc-cu12`` wheel's, Triton's, the one on PATH, or CUDA's
  default install; None when there is none."""
  for pkg, rel in (("nvidia.cuda_nvcc", "bin/ptxas"), ("nvidia.cu13", "bin/ptxas"),
                   ("triton", "backends/nvidia/bin/ptxas")):
    try:
      spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
      spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
      path = os.path.join(root, rel)
      if os.access(path, os.X_OK):
        return path
  found = shutil.which("ptxas")
  if found:
    return found
  default = "/usr/local/cuda/bin/ptxas"
  return default if os.access(default, os.X_OK) else None


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def _ptxas_info(ptxas: str, ptx_files: Sequence[str], notes: list[str]) -> dict[str, dict]:
  """Per entry function: registers, spills, stack and static shared memory, as ``ptxas -v``
  reports them for the PTX files (the arguments XLA itself gives ptxas)."""
  out: dict[str, dict] = {}
  for path in ptx_files:
    with open(path, errors="replace") as f:
      text = f.read()
    arch = re.search(r"^\.target\s+(sm_\w+)", text, re.M)
    if ".entry" not in text or arch is None:
      continue
    cmd = [ptxas, path, "-o", os.devnull, f"-arch={arch.group(1)}", "--warn-on-spills", "-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode:
      notes.append(f"ptxas failed on {os.path.basename(path)}: "
                   f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
      continue
    name = None
    for line in (r.stdout + r.stderr).splitlines():
      if m := _PTXAS_FUNC.search(line):
        name = m.group(1)
        out[name] = {}
      elif name and (m := _PTXAS_PROPS.search(line)):
        out[name].update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                         spill_load_bytes=int(m.group(3)))
      elif name and (m := _PTXAS_USED.search(line)):
        out[name].update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
  return out


# ----------------------------------------------------------------------------------------------
# Dump parsing.

_THUNK = re.compile(r"\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")
_TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'


def _ints(s: str) -> tuple[int, ...]:
  return tuple(int(x) for x in s.replace(" ", "").split(",") if x)


def _read(paths: Sequence[str]) -> str:
  text = []
  for p in paths:
    with open(p, errors="replace") as f:
      text.append(f.read())
  return "\n".join(text)


def _triton_configs(hlo: str) -> dict[str, dict]:
  """Triton custom calls in optimized GPU HLO: name -> num_warps, num_stages."""
  out = {}
  for line in hlo.splitlines():
    if _TRITON_CALL not in line:
      continue
    line = re.sub(r'\bir = "(?:[^"\\]|\\.)*"', "", line)  # the kernel's MLIR bytecode
    cfg = {k: int(v) for k, v in re.findall(r"\b(num_warps|num_stages) = (\d+)", line)}
    if m := re.search(r'\bname = "([^"]*)"', line):
      out[m.group(1)] = cfg
  return out


def _gpu_kernels(dump: str, pallas: Mapping[str, dict], ptxas: str | None,
                 notes: list[str]) -> list[KernelReport]:
  hlo = _read(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
  triton = _triton_configs(hlo)
  info = {}
  ptx = sorted(glob.glob(os.path.join(dump, "*.ptx")))
  if ptxas is None:
    notes.append("no ptxas found (pip install nvidia-cuda-nvcc-cu12, or a CUDA toolkit): "
                 "no registers or spills")
  elif ptx:
    info = _ptxas_info(ptxas, ptx, notes)
  launches: dict[str, tuple] = {}
  for line in _read(glob.glob(os.path.join(dump, "*thunk_sequence.txt"))).splitlines():
    if m := _THUNK.search(line):
      launches.setdefault(m.group(1), (_ints(m.group(2)), _ints(m.group(3)), int(m.group(4))))
  names = list(launches) + [n for n in info if n not in launches]
  kernels = []
  for name in names:
    grid, threads, dyn_smem = launches.get(name, (None, None, None))
    ptx_info = info.get(name, {})
    static = ptx_info.get("static_smem")
    smem = None if dyn_smem is None and static is None else (dyn_smem or 0) + (static or 0)
    base = re.sub(r"__\d+$", "", name)  # XLA numbers repeated kernel names: toy, toy__1
    cfg = triton.get(name, triton.get(base, {}))
    is_pallas = bool({name, base} & (set(triton) | set(pallas)))
    warps = (threads[0] * threads[1] * threads[2]) // 32 if threads else cfg.get("num_warps")
    kernels.append(KernelReport(
        name=name, kind="pallas" if is_pallas else "xla", grid=grid, num_warps=warps,
        num_stages=cfg.get("num_stages", pallas.get(base, {}).get("num_stages")),
        registers=ptx_info.get("registers"), spill_store_bytes=ptx_info.get("spill_store_bytes"),
        spill_load_bytes=ptx_info.get("spill_load_bytes"), stack_bytes=ptx_info.get("stack_bytes"),
        smem_bytes=smem))
  return kernels


def _backend_config(line: str) -> dict:
  i = line.find("backend_config=")
  if i < 0:
    return {}
  try:
    cfg, _ = json.JSONDecoder().raw_decode(line[i + len("backend_config="):])
  except ValueError:
    return {}
  return cfg if isinstance(cfg, dict) else {}


def _vmem(configs: Any) -> int | None:
  sizes = [int(c.get("size", 0)) for c in configs or ()
           if str(c.get("memory_space", "1")) == "1"]
  return sum(sizes) if sizes else None


def _pallas_name(instr: str, op_name: str, pallas: Mapping[str, dict]) -> str:
  """The ``pallas_call`` name behind a Mosaic custom call, whose HLO name carries the
  transformations around it (``transpose_jvp_attnx_pallas_dq__.1``): the longest known name
  found in its op_name (``jit(f)/transpose(jvp(attnx_pallas_dq))/pallas_call``) or instruction
  name, else the instruction name without its ``.N`` suffix."""
  for text in (op_name, instr):
    hits = [n for n in pallas if re.search(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])", text)]
    if hits:
      return max(hits, key=len)
  return re.sub(r"\.\d+$", "", instr)


def _tpu_kernels(dump: str, pallas: Mapping[str, dict], t: Target,
                 notes: list[str]) -> list[KernelReport]:
  files = (glob.glob(os.path.join(dump, "*after_codegen.txt"))
           or glob.glob(os.path.join(dump, "*after_optimizations.txt")))
  kernels, seen, names = [], set(), {}
  for line in _read(files).splitlines():
    if 'custom_call_target="tpu_custom_call"' not in line:
      continue
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
    instr = m.group(1) if m else "?"
    if instr in seen:
      continue
    seen.add(instr)
    op = re.search(r'op_name="([^"]*)"', line)
    base = _pallas_name(instr, op.group(1) if op else "", pallas)
    cfg = _backend_config(line)
    own = pallas.get(base, {})
    limit = _vmem(cfg.get("scoped_memory_configs")) or own.get("vmem_limit_bytes")
    n = names[base] = names.get(base, -1) + 1  # repeated names numbered as on a GPU
    kernels.append(KernelReport(
        name=f"{base}__{n}" if n else base, kind="pallas", grid=own.get("grid"), vmem_bytes=_vmem(
            cfg.get("used_scoped_memory_configs")),
        vmem_limit_bytes=limit or t.scoped_vmem_default))
  if not files:
    notes.append("no TPU HLO dump found: no per-kernel VMEM")
  return kernels


def _kernel_platform(compiler_params: Any) -> str | None:
  """The platform a ``pallas_call``'s compiler parameters are for (None: not known)."""
  module = type(compiler_params).__module__
  if ".triton" in module or ".mosaic_gpu" in module:
    return "cuda"
  if ".mosaic" in module:
    return "tpu"
  return None


def _pallas_calls(jaxpr: Any, platform: str) -> dict[str, dict]:
  """The ``pallas_call`` equations of a (closed) jaxpr and its sub-jaxprs for ``platform``
  (kernels staged for another platform, as in a per-platform choice, are left out): name ->
  grid and compiler parameters (a name used with different grids gets no grid)."""
  found: dict[str, dict] = {}

  def visit(j: Any) -> None:
    j = getattr(j, "jaxpr", j)
    for eqn in getattr(j, "eqns", ()):
      params = eqn.params
      if eqn.primitive.name == "pallas_call":
        name = params.get("name")
        name = getattr(name, "name", name) or "pallas_call"
        gm = params.get("grid_mapping")
        grid = tuple(int(g) for g in getattr(gm, "grid", ()) if isinstance(g, int)) or None
        cp = params.get("compiler_params")
        if _kernel_platform(cp) not in (None, platform):
          continue
        rec = {"grid": grid}
        for key in ("num_warps", "num_stages", "vmem_limit_bytes"):
          if getattr(cp, key, None) is not None:
            rec[key] = getattr(cp, key)
        if str(name) in found and found[str(name)].get("grid") != grid:
          rec["grid"] = None
        found[str(name)] = rec
        continue
      for v in params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
            visit(sub)

  visit(jaxpr)
  return found


# ----------------------------------------------------------------------------------------------
# Compiling.

# XLA's defaults for flags a test setup may lower for speed (they change the code generated).
_PRODUCTION_OPTIONS = {"xla_backend_optimization_level": 3,
                       "xla_llvm_disable_expensive_passes": False}
_SMEM = re.compile(r"Shared memory size limit exceeded")
_VMEM = re.compile(r"CompileTimeScopedVmemOom|memory space vmem|space=vmem|scoped vmem",
                   re.I)


def _category(error: str) -> Category:
  if _SMEM.search(error):
    return "smem_overflow"
  if _VMEM.search(error):
    return "vmem_oom"
  return "compile_error"


@contextlib.contextmanager
def _no_persistent_cache() -> Iterator[None]:
  """Bypasses JAX's persistent compilation cache: its key ignores ``xla_dump_to`` (a hit would
  leave no dump) and a compile-only client cannot load an entry (it warns, then compiles)."""
  from jax._src import compilation_cache as cc

  if not all(hasattr(cc, a) for a in ("_cache_initialized_mutex", "_cache_checked",
                                      "_cache_used")):
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*persistent compilation cache.*")
      yield
    return
  with cc._cache_initialized_mutex:
    saved = cc._cache_checked, cc._cache_used
    cc._cache_checked, cc._cache_used = True, False
  try:
    yield
  finally:
    with cc._cache_initialized_mutex:
      cc._cache_checked, cc._cache_used = saved


def _place(args: Any, dev: Any) -> Any:
  """Array-like leaves (arrays, ShapeDtypeStructs) -> ShapeDtypeStructs on the device."""
  sharding = jax.sharding.SingleDeviceSharding(dev)

  def leaf(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                                  weak_type=bool(getattr(x, "weak_type", False)))
    return x

  return jax.tree.map(leaf, args)


def compile_for(fn: Callable[..., Any], *args: Any, target: str = "h100",
                compiler_options: Mapping[str, Any] | None = None,
                ptxas: str | None = None, keep_dump: str | None = None,
                **kwargs: Any) -> CompileReport:
  """Compiles ``fn(*args, **kwargs)`` for ``target`` and reports what the compiler made of it.

  Args:
    fn: a function or a ``jax.jit``-wrapped one (not called; traced with abstract arguments).
      Bind non-array arguments with ``functools.partial``.
    *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` s (any pytree of them); only shapes
      and dtypes are used, placed on a compile-only device of the target.
    target: a :data:`TARGETS` name.
    compiler_options: extra XLA options for this compile (``{"xla_...": value}``), over the
      ones set here (dump directory, ptxas location, production optimization levels).
    ptxas: the ``ptxas`` to read GPU registers with (default :func:`find_ptxas`); XLA is
      pointed at the same CUDA directory, so the binary analysed is the one XLA built.
    keep_dump: a directory to keep XLA's dump in, in a new subdirectory per compile
      (:attr:`CompileReport.dump_dir`); default: a temporary directory, removed.

  Returns:
    A :class:`CompileReport`; compiler failures (shared memory, VMEM, other) are reported in
    it, not raised.

  Raises:
    AotUnavailable: the target's packages are missing or their versions drifted.
    ValueError: an unknown target.
  """
  t = require(target)
  dev = device(target)
  notes: list[str] = []
  options = dict(_PRODUCTION_OPTIONS)
  if t.platform == "cuda":
    # The PTX in the dump: XLA wrote it unasked up to jaxlib 0.10; from 0.11 only what this
    # matches ("ptx": the PTX alone; ".*" adds Triton's pass-by-pass IR, tens of MB and ≈ 25 s
    # per whole-row program). The flag exists in both.
    options["xla_dump_emitter_re"] = "ptx"
    ptxas = ptxas or find_ptxas()
    if ptxas:  # XLA uses <dir>/bin/ptxas and <dir>/nvvm/libdevice: a CUDA layout only
      root = os.path.dirname(os.path.dirname(os.path.realpath(ptxas)))
      if (os.access(os.path.join(root, "bin", "ptxas"), os.X_OK)
          and os.path.isdir(os.path.join(root, "nvvm", "libdevice"))):
        options["xla_gpu_cuda_data_dir"] = root
      else:
        notes.append(f"XLA assembled with its own ptxas; registers are from {ptxas}")
  if keep_dump:
    os.makedirs(keep_dump, exist_ok=True)
  dump = tempfile.mkdtemp(prefix=f"attnx-aot-{target}-", dir=keep_dump)
  options["xla_dump_to"] = dump
  options.update(compiler_options or {})

  t0 = time.perf_counter()
  try:
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    # Triton kernels are traced for this GPU (jax >= 0.11 reads it from the abstract mesh).
    chip = (_compat.triton_lowering_target(t.gpu_kind) if t.platform == "cuda"
            else contextlib.nullcontext())
    with chip:
      traced = jitted.trace(*_place(args, dev), **_place(kwargs, dev))
    pallas = _pallas_calls(traced.jaxpr, t.platform)
    lowered = traced.lower(lowering_platforms=(t.platform,))
  except Exception as e:  # noqa: BLE001 - a report, not a crash
    _cleanup(dump, keep_dump)
    return CompileReport(target, False, "trace_error", f"{type(e).__name__}: {e}", 0.0,
                         time.perf_counter() - t0, notes=tuple(notes))
  lower_s = time.perf_counter() - t0

  error, memory = None, None
  t1 = time.perf_counter()
  try:
    with _no_persistent_cache():
      compiled = lowered.compile(compiler_options=options)
  except Exception as e:  # noqa: BLE001 - XLA's errors are the result
    error = f"{type(e).__name__}: {e}"
  compile_s = time.perf_counter() - t1
  if error is None:
    with contextlib.suppress(Exception):
      stats = compiled.memory_analysis()
      memory = {f: int(getattr(stats, f)) for f in dir(stats)
                if f.endswith("_in_bytes") and isinstance(getattr(stats, f), int)}

  try:
    if t.platform == "cuda":
      kernels = _gpu_kernels(dump, pallas, ptxas, notes)
    else:
      kernels = _tpu_kernels(dump, pallas, t, notes)
  finally:
    _cleanup(dump, keep_dump)
  kernels.sort(key=lambda k: k.kind != "pallas")
  have = {re.sub(r"__\d+$", "", k.name) for k in kernels}
  if missing := [n for n in pallas if n not in have]:
    notes.append(f"pallas_call kernels without a compiled record: {missing}"
                 + (" (the failure may be in one of them)" if error else ""))
  return CompileReport(
      target=target, ok=error is None, category="ok" if error is None else _category(error),
      error=error, compile_seconds=compile_s, lower_seconds=lower_s, kernels=tuple(kernels),
      memory=memory, notes=tuple(notes), dump_dir=dump if keep_dump else None)


def _cleanup(dump: str, keep: str | None) -> None:
  if not keep:
    shutil.rmtree(dump, ignore_errors=True)
