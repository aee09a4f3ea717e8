"""Test-suite setup: make XLA compile fast before JAX initializes its backend.

The tests use tiny arrays and are bound by XLA compile time, not run time; a cheaper CPU
optimization level cuts compilation by about a third. XLA:CPU's loop emitters for fusions
instead of its default MLIR fusion emitters (``xla_cpu_use_fusion_emitters=false``) and one
LLVM module per program (``xla_cpu_parallel_codegen_split_count=1``: splitting it for parallel
codegen only pays on idle cores, and CI runs 2 workers on 2 cores) compile ≈ 3× faster again:
the CPU time of the compile-bound tests drops by 40-55 % (tests/nn 207 → 122 CPU-s,
test_contract.py 121 → 57, the ring's 8-device table 68 → 33). Results change by float32
rounding at most (of ring attention's outputs and gradients on five cases, 18 of 23 arrays
were bit-identical, the rest within 4e-6), the ratios of XLA's memory analysis that
test_ring.py checks by under 3 %, and the 2-CPU deadlock test of tests/train/test_step.py
still hangs without its workaround. Set here, in the root conftest, so they
apply to every test module and to the subprocesses they start (which inherit XLA_FLAGS).
Benchmarks (experiments/kernel_benchmark.py, run outside pytest) keep the full optimization.

Layout: tests mirror the modules, one file per module: attnx/<package>/<module>.py is tested in
tests/<package>/test_<module>.py, experiments/<name>.py in tests/experiments/test_<name>.py and
launch.py in tests/test_launch.py. Test directories are not packages (pytest's "prepend" import
mode), so basenames must be unique across the tree: where two packages have a module of the same
name, the later one's file takes its package as a prefix (tests/nn/test_nn_linear.py,
tests/experiments/test_experiments_nadaraya_watson.py). A few files test one property across
many modules and say so in their docstring (test_weighting_matrix.py, test_nn_errors.py,
test_vmap_over_seeds.py, test_interchangeable_attention.py, test_builder_matrix.py). Helpers
that are not tests live in tests/support/, imported as ``support.<module>`` (this directory is
on sys.path because this conftest is in it).
"""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from support import legs as _legs  # this directory is on sys.path (rootdir conftest)

_FAST = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
         "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_accepts(flags: list[str]) -> bool:
  """Whether this jaxlib's XLA starts with ``flags``: an XLA that does not know a flag exits
  the process with status 1 and no message (jaxlib 0.11.2 on a GPU machine, 2026-11-26: every
  test process died silently), so each new JAX is asked once, in a subprocess."""
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
  return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


def _fast_flags(level: int) -> str:
  base = os.environ.get("XLA_FLAGS", "").split()
  fast = [f"--xla_backend_optimization_level={level}", *_FAST[1:]]
  if _xla_accepts(base + fast):
    return " ".join(base + fast)
  return " ".join(base + [f for f in fast if _xla_accepts(base + [f])])


def _optimization_level(markexpr: str) -> int:
  """0 for the suite; 1 for the differential net's large run (``-m differential``).

  jaxlib 0.12.0.1's XLA:CPU computes one blocked 1.3-entmax case wrong at level 0 only
  (configuration 4053 of the net: one row's output sums to 2 instead of 1): its optimized HLO and
  buffer assignment are the same at every level, so the difference is XLA's LLVM code at level
  0, not the program attnx builds; the default level (what users run), 1 and 2 are right, and
  so is level 0 on jax 0.10.2 (docs/development.md). The large run draws every kernel's
  branches at random, so it runs at level 1 (≈ 20 % slower than 0); the suite's hand-written
  cases pass at level 0 on both ends.
  """
  return int("differential" in markexpr and "not differential" not in markexpr)


def pytest_configure(config):
  # The controller decides once, before xdist starts its workers (which, like the tests'
  # subprocesses, inherit XLA_FLAGS) and before JAX initializes a backend.
  if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = _fast_flags(_optimization_level(config.getoption("markexpr")))

# One persistent compilation cache per test session, shared by the xdist workers and the
# subprocesses the tests start (all inherit the environment): many tests compile the same
# programs (the same tiny models, the same kernels), which then compile once (≈ 11 % of the
# tests/nn time on 2 cores). Fresh per session, so no result depends on an earlier run.
# Not on jaxlib 0.12.0.1, whose cache writes can crash (legs.persistent_cache_safe).
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = None
if _CACHE_ENV not in os.environ and _legs.persistent_cache_safe():
  _OWN_CACHE = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="attnx-test-jax-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session):
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the controller cleans up
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# --- Cases split between the two ends of the supported JAX range (tests/support/legs.py) ---


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
  groups: dict[str, list] = {}
  for item in items:
    mark = item.get_closest_marker("split_by_jax")
    if mark and not item.get_closest_marker("exhaustive"):
      # The cases of one test, or the tests of one named group (single tests across files).
      group = mark.kwargs.get("group") or item.nodeid.split("[", 1)[0]
      groups.setdefault(group, []).append(item)
  for cases in groups.values():
    mine = _legs.this_end(it.nodeid for it in cases)
    for item in cases:
      if item.nodeid not in mine:
        item.add_marker(pytest.mark.exhaustive)
