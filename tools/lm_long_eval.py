"""Time and memory of reading the language model at 4096 characters (64× its context).

The default preset's GPT (4 layers, 4 heads, width 128, rotary positions; built by the
experiment's ``build_model``, :func:`attnx.nn.lm.gpt_builder`), untrained, seeds
vmapped as the experiment evaluates them, on 16 windows of 4096 random tokens (the 64× read of
``experiments/language_model.py``: 65 536 characters) through ``attnx.train.evaluators``'
``window_nll`` with the model's automatic kernel choice. Prints one JSON line: the seconds of
the pass (compile included) and the process's peak resident memory. Usage:

  python tools/lm_long_eval.py WEIGHTING [SEEDS]     # e.g. entmax15 3
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attnx import nn  # noqa: E402
from attnx.train import evaluators  # noqa: E402
from experiments import language_model  # noqa: E402


def main() -> None:
  weighting = sys.argv[1]
  seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
  spec = nn.attention_spec(weighting)
  if spec["type"] == "linear":
    raise SystemExit(f"{weighting}: linear attention keeps learned positions in the "
                     "experiment and is not read beyond its context")
  model = language_model.build_model(language_model.get_config(), vocab_size=96)(spec)
  init = lambda key: model.init(key, jnp.zeros((1, model.max_len), jnp.int32))["params"]
  params = jax.vmap(init)(jax.random.split(jax.random.PRNGKey(0), seeds))
  tokens = np.random.default_rng(0).integers(0, 96, 16 * 4096 + 1).astype(np.int32)
  windows = {"inputs": tokens[:-1].reshape(16, 4096), "targets": tokens[1:].reshape(16, 4096)}
  start = time.perf_counter()
  evaluators.window_nll(evaluators.token_nll_fn(model), params, {}, windows)
  print(json.dumps({"weighting": weighting, "seeds": seeds,
                    "seconds": round(time.perf_counter() - start, 1),
                    "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                          / 2**20, 2)}))


if __name__ == "__main__":
  main()
