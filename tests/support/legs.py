"""Which half of a split test's cases this end of the supported JAX range runs.

CI runs the whole suite on the oldest and on the newest supported JAX (``.ci/run``), both within
its 50 minutes; the newest compiles each program ≈ 2.4× slower on XLA:CPU (its MLIR fusion
emitters cannot be turned off). A test marked ``split_by_jax`` runs half its cases on each end
(``tests/conftest.py`` marks the other half ``exhaustive``): a default run takes this end's half,
``-m exhaustive`` the rest, and CI runs every case once across its two legs. The halves are
drawn by a hash of each case's id, ranked and alternated, so that they are even and follow no
one parameter axis. Split: matrices of attnx's own arithmetic (kernels against a float64
reference, one weighting or draw per case), not tests of a JAX or Flax API's behaviour; and, as
one group (:data:`experiment_run`), the tiny end-to-end runs of the experiments that build on
the library's tested pieces (each experiment runs on one end; the language-model preset, its
sequence-parallel run and the default experiment, which launch.py's tests start, on both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from importlib import metadata

import pytest


def jax_end() -> int:
  """0 on the oldest end's releases (jax 0.10), 1 on newer ones (read without importing jax,
  whose flags the conftest sets first)."""
  release = tuple(int(p) for p in metadata.version("jax").split(".")[:2])
  return int(release >= (0, 11))


def persistent_cache_safe() -> bool:
  """Whether the suite may write JAX's persistent compilation cache: on the oldest end only.
  jaxlib 0.12.0.1 crashes a process now and then inside XLA:CPU: twice in each differential
  large run of 1000 cases (2026-11-29; cases 517 and 599 with the cache on, one of them in the
  executable's serialize() for the cache write; 602 and 690 with it off, an abort and a
  segmentation fault while compiling), each case passing when run again alone. With the cache
  off one crash site fewer, and no leg's results depend on it."""
  return jax_end() == 0


def this_end(ids: Iterable[str]) -> set[str]:
  """The ids (of one test's cases) that this end runs: half of them, the other end the rest."""
  ranked = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())
  end = jax_end()
  return {i for rank, i in enumerate(ranked) if rank % 2 == end}


# The tiny end-to-end run of one experiment: half of these tests run on each end.
experiment_run = pytest.mark.split_by_jax(group="experiment end-to-end runs")
