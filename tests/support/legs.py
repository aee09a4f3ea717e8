"""Which part of a split test's cases this end of the supported JAX range runs.

CI runs the whole suite on the oldest and on the newest supported JAX (``.ci/run``), both within
its 50 minutes; the newest compiles each program ≈ 1.3–2.8× slower on XLA:CPU (its MLIR fusion
emitters cannot be turned off). A test marked ``split_by_jax`` runs part of its cases on each
end (``tests/conftest.py`` marks the others ``exhaustive``): a default run takes this end's
part, ``-m exhaustive`` the rest, and CI runs every case once across its two legs. The newest
end takes one case in three, the oldest the other two (:data:`NEWEST_SHARE`): the same cases
cost the newest end more time. The parts are drawn by a hash of each case's id, ranked and
dealt in turn, so that they follow no one parameter axis (the differential net's large run,
``-m differential``, runs every case on the newest end). Split: matrices of attnx's own
arithmetic (kernels against a float64 reference, one weighting or draw per case), not tests
of a JAX or Flax API's behaviour; and, as one group (:data:`experiment_run`), the tiny
end-to-end runs of the experiments that build on the library's tested pieces (each
experiment runs on one end, as do the language-model preset's sequence-parallel run and its
run with NNX models; the language-model preset and the default experiment, which launch.py's
tests start, on both).
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


# Of every NEWEST_SHARE[1] cases of a split test, the newest end runs NEWEST_SHARE[0].
NEWEST_SHARE = (1, 3)


def this_end(ids: Iterable[str]) -> set[str]:
  """The ids (of one test's cases) that this end runs: one in three on the newest end, the
  others on the oldest (a test of one case: the oldest)."""
  ranked = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())
  take, every = NEWEST_SHARE
  newest = jax_end() == 1
  # Dealt from the second rank on, so that a test of two cases still runs one on each end.
  return {i for rank, i in enumerate(ranked) if ((rank + every - 1) % every < take) == newest}


# The tiny end-to-end run of one experiment: these tests are dealt between the ends.
experiment_run = pytest.mark.split_by_jax(group="experiment end-to-end runs")
