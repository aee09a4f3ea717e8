"""fit gives the results the loop gave before its periodic work became separate actions.

fit_reference.json holds the history, metrics.jsonl records, final metrics and parameters of
one small run (logging, evaluation and checkpoints on different periods, plus a resume from a
mid-run checkpoint), written by the loop as it was before the refactoring. On the platform
that wrote it they must match bit for bit (same XLA flags: tests/conftest.py); elsewhere a
different CPU may round differently, so there they are compared to float32 round-off.
"""

from __future__ import annotations

import json
import os
import platform
import shutil

import jax
import jaxlib
import numpy as np
import pytest
from train_stand_ins import TinyMLP, make_arrays

from attnx import train

REFERENCE = os.path.join(os.path.dirname(__file__), "fit_reference.json")


def _platform() -> dict[str, str]:
  cpu = platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
  except OSError:
    pass
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "backend": jax.default_backend(), "cpu": cpu}


def _run(workdir: str) -> dict:
  arrays = make_arrays()
  # Logs at 3, 6, 9; evaluations at 4, 8 (records of their own); checkpoints at 5 (no record);
  # everything at 10.
  config = train.FitConfig(
      optimizer=train.optimizer_config(learning_rate=1e-2, warmup_steps=3), num_steps=10,
      num_seeds=2, seed=3, log_every=3, eval_every=4, checkpoint_every=5, progress=False,
      tensorboard=False)
  r = train.fit(TinyMLP(dropout_rate=0.2), train_data=train.loader(arrays, 16),
                eval_data=train.loader(arrays, 64), config=config, workdir=workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    jsonl = [json.loads(line) for line in f]
  return {"history": r.history, "jsonl": jsonl,
          "final_metrics": {k: np.asarray(v).tolist() for k, v in r.final_metrics.items()},
          "params": jax.tree.map(lambda x: np.asarray(x).tolist(), r.params),
          "start_step": r.start_step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
  wd = str(tmp_path_factory.mktemp("reference") / "wd")
  full = _run(wd)
  shutil.rmtree(os.path.join(wd, "checkpoints", "run", "10"))  # killed after step 5's save
  return {"full": full, "resumed": _run(wd)}


def _assert_same(got, want, exact: bool, where: str = "") -> None:
  if isinstance(want, dict):
    assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"  # order too
    for k in want:
      _assert_same(got[k], want[k], exact, f"{where}.{k}")
  elif isinstance(want, list) and want and isinstance(want[0], dict | list):
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
      _assert_same(g, w, exact, f"{where}[{i}]")
  elif exact or not isinstance(want, float | list):
    assert got == want, f"{where}: {got} != {want}"
  else:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=where)


@pytest.mark.parametrize("which", ["full", "resumed"])
def test_fit_matches_the_reference_run(runs, which):
  with open(REFERENCE) as f:
    reference = json.load(f)
  exact = reference["platform"] == _platform()
  got, want = runs[which], reference[which]
  assert got["start_step"] == want["start_step"] == (0 if which == "full" else 5)
  assert [h["step"] for h in got["history"]] == [3, 4, 6, 8, 9, 10]
  for key in ("history", "jsonl", "final_metrics", "params"):
    _assert_same(got[key], want[key], exact, f"{which}.{key}")
