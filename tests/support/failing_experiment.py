"""A launch.py experiment that fails on purpose, for the launcher's error-path tests.

Every process first joins one collective (so that gloo has connected every pair), prints
``ready <process index>``, then process ``rank`` fails as ``behaviour`` says: ``raise`` (an
exception no check anticipated) or ``kill`` (SIGKILL of itself). The others either keep
calling collectives with the lost peer (``talk=True``) or sleep outside JAX (``talk=False``),
for up to two minutes.
"""

from __future__ import annotations

import os
import signal
import time


def get_config(preset: str | None = None):
  from attnx.train.config import base_config  # noqa: PLC0415

  c = base_config()
  c.experiment, c.preset = "failing_experiment", preset or "default"
  c.behaviour = "raise"
  c.rank = 1
  c.talk = True
  return c


def run(config, workdir: str) -> dict:
  del workdir
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415

  many = jax.process_count() > 1
  if many:
    multihost_utils.process_allgather(np.zeros(1))
  print(f"ready {jax.process_index()}", flush=True)
  if jax.process_index() == config.rank:
    time.sleep(0.5)
    if config.behaviour == "raise":
      raise RuntimeError("the experiment broke")
    os.kill(os.getpid(), signal.SIGKILL)
  start = time.time()
  while time.time() - start < 120:
    if many and config.talk:
      multihost_utils.process_allgather(np.zeros(1))
    time.sleep(0.05)
  return {}
