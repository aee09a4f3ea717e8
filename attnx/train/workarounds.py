"""Machine-specific workarounds, each named and explained in one place.

Every function here exists because of a defect or limit of a particular backend or machine
(XLA's CPU runtime on few cores), not because the training logic needs it. Keeping them here
means the loop reads as the algorithm, and a workaround can be dropped in one edit once the
underlying problem is fixed. Each says what it works around, where it was seen and what it
costs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

# The XLA flag that bounds how long a CPU collective waits for all device threads.
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


def sync_every_step(parallel: str, backend: str | None = None) -> bool:
  """Whether `fit` must wait for each data-parallel step before dispatching the next.

  XLA's CPU collectives can deadlock when several data-parallel steps are in flight on fake
  devices that share few cores: the device threads of the next step take the pool while the
  all-reduce of the previous one waits for them (jaxlib 0.10, 2-core machines). One step at a
  time avoids it, at the cost of the overlap of host and device work, which CPU devices hardly
  have anyway. Never needed without data parallelism or on accelerators.
  """
  backend = backend or jax.default_backend()
  return parallel != "none" and backend == "cpu"


def init_seeds(init_one: Callable[[jax.Array], Any], keys: jax.Array) -> Any:
  """`init_one` over the stacked seed `keys`, one seed after another (``lax.map``, not vmap).

  A vmapped orthogonal initializer (GRU/LSTM recurrent kernels) becomes a batched LAPACK QR,
  and on a 2-core CPU two such QRs scheduled at once each wait for workers of the same
  2-thread XLA pool and deadlock (jaxlib 0.10, ``ParallelBatchMap`` inside
  ``lapack_sgeqrf_ffi``). Initialization is cheap, so the sequential loop costs nothing that
  matters, and its values equal vmap's. Call inside ``jax.jit``.
  """
  return jax.lax.map(init_one, keys)


def fake_cpu_devices(n: int, collective_timeout_s: int = 600) -> None:
  """Make JAX expose `n` CPU devices (before its backend starts) that tolerate a busy machine.

  Fake devices share the machine's few cores: on a busy machine a collective can wait longer
  than XLA's default 40 s for all device threads, and XLA then aborts the process; the
  timeout is raised to `collective_timeout_s` (unless XLA_FLAGS already sets it).
  """
  jax.config.update("jax_num_cpu_devices", int(n))
  flags = os.environ.get("XLA_FLAGS", "")
  if _COLLECTIVE_TIMEOUT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_COLLECTIVE_TIMEOUT_FLAG}={collective_timeout_s}".strip()
