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
import tempfile

_FAST = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
         " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST).strip()

# One persistent compilation cache per test session, shared by the xdist workers and the
# subprocesses the tests start (all inherit the environment): many tests compile the same
# programs (the same tiny models, the same kernels), which then compile once (≈ 11 % of the
# tests/nn time on 2 cores). Fresh per session, so no result depends on an earlier run.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = None
if _CACHE_ENV not in os.environ:
  _OWN_CACHE = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="attnx-test-jax-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session):
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the controller cleans up
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
