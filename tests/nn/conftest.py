"""tests/nn: tiny models on a shared CPU, so make XLA compile fast.

When this directory runs on its own, JAX's backend is not initialized yet and a cheaper XLA
CPU optimization level cuts compile time (these tests are compile-bound, not compute-bound).
"""

import os

_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST).strip()
