"""Test-suite setup: make XLA compile fast before JAX initializes its backend.

The tests use tiny arrays and are bound by XLA compile time, not run time; a cheaper CPU
optimization level cuts compilation by about a third. Set here, in the root conftest, so it
applies to every test module and to the subprocesses they start (which inherit XLA_FLAGS).
Benchmarks (experiments/kernel_benchmark.py, run outside pytest) keep the full optimization.
"""

import os

_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST).strip()
