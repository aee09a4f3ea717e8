"""Run in a subprocess with 8 fake CPU devices (see test_parallel.py); prints JSON results."""

from __future__ import annotations

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from train_stand_ins import TinyMLP, make_arrays  # noqa: E402

from attnx import train  # noqa: E402


def main() -> None:
  assert len(jax.devices()) == 8, jax.devices()
  arrays = make_arrays(n=128)
  out = {}
  params = {}
  for mode in ("none", "shard_map", "pmap"):
    r = train.fit(TinyMLP(), train_data=train.stream_fn(arrays, 32),
                  eval_data=lambda: train.batches(arrays, 64),
                  optimizer=train.optimizer_config(learning_rate=1e-2),
                  num_steps=6, num_seeds=2, log_every=3, parallel=mode, progress=False,
                  tensorboard=False)
    params[mode] = r.params
    out[mode] = {"loss": [h["loss"] for h in r.history],
                 "accuracy": r.final_metrics["accuracy"].tolist()}
  for mode in ("shard_map", "pmap"):
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                         params["none"], params[mode]))
    out[f"max_param_diff_{mode}"] = max(diffs)
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                       params["shard_map"], params["pmap"]))
  out["max_param_diff_shard_map_pmap"] = max(diffs)
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
