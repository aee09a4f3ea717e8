"""Run in a subprocess with 8 fake CPU devices (tests/train/test_parallel.py); prints JSON results.

Plain SGD (no momentum, no clipping) makes the update proportional to the gradient, so a
gradient that is D times too large (a sum over devices instead of the mean) shows up in the
parameters; adam would hide it, being invariant to the gradient's scale. The "masked" case has
per-token targets with IGNORE_INDEX padding, so devices hold different numbers of valid tokens
(the global mean is not the mean of per-device means), and clips gradients at a norm that some
steps exceed and others do not, so clipping acts on the global gradient.
"""

from __future__ import annotations

import json
import os
import sys

import jax

from attnx.train import workarounds

workarounds.fake_cpu_devices(8)  # before JAX starts its backend
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import numpy as np  # noqa: E402
import optax  # noqa: E402

from attnx import train  # noqa: E402
from support.train_stand_ins import TinyMLP, make_arrays  # noqa: E402


def masked_arrays(n: int = 64, length: int = 5, dim: int = 6) -> dict[str, np.ndarray]:
  """Per-token targets where example i has i % (length + 1) valid tokens (0 to length)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n, length, dim)).astype(np.float32)
  y = (x[..., 0] > 0).astype(np.int32) + (x[..., 1] > 0.5)
  valid = np.arange(length)[None, :] < (np.arange(n) % (length + 1))[:, None]
  return {"inputs": x, "targets": np.where(valid, y, train.IGNORE_INDEX).astype(np.int32)}


def token_arrays(n: int = 64, length: int = 8, vocab: int = 16) -> dict[str, np.ndarray]:
  """Next-token pairs of random tokens (the NNX GPT's case)."""
  ids = np.random.default_rng(2).integers(0, vocab, (n, length + 1)).astype(np.int32)
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def nnx_gpt():
  """An attnx.nnx GPT behind Flax's bridge (attnx.nnx.to_linen): NNX models train data-parallel
  as linen ones do."""
  from attnx import nnx as anx

  return anx.to_linen(anx.GPT, vocab_size=16, num_layers=1, num_heads=2, hidden_dim=16,
                      mlp_dim=32, max_len=8, attention="sigmoid:normalization=none",
                      positions="rotary")


SGD = train.optimizer_config(name="sgd", momentum=0.0, learning_rate=0.5, schedule="constant")
CASES = {  # name: (arrays, optimizer, model factory)
    "sgd": (make_arrays(n=128), SGD, TinyMLP),
    "masked_clipped": (masked_arrays(), train.optimizer_config(
        name="sgd", momentum=0.0, learning_rate=0.5, schedule="constant", grad_clip_norm=0.4),
        TinyMLP),
    "nnx_gpt": (token_arrays(), SGD, nnx_gpt),
}


class TokenMLP(TinyMLP):
  """TinyMLP on every position alone: exact under any split of the sequence; it declares the
  sequence axis as a ring-attention model does."""

  sequence_axis: str | None = "seq"
  sequence_layout: str = "contiguous"


def sequence_case() -> dict:
  """(data, seq) meshes 2 x 4 and 1 x 8, contiguous and zigzag, against one device."""
  arrays = masked_arrays(n=64, length=8)
  opt = train.optimizer_config(name="sgd", momentum=0.0, learning_rate=0.5, schedule="constant")
  params, res = {}, {}
  for name, sp, layout in (("none", 1, "contiguous"), ("seq4", 4, "contiguous"),
                           ("seq4_zigzag", 4, "zigzag"), ("seq8", 8, "contiguous")):
    config = train.FitConfig(optimizer=opt, num_steps=6, num_seeds=2, log_every=2,
                             parallel="none" if sp == 1 else "shard_map", sequence_parallel=sp,
                             sequence_layout=layout, progress=False, tensorboard=False)
    r = train.fit(TokenMLP(sequence_layout=layout), train_data=train.loader(arrays, 32),
                  config=config)
    params[name] = r.params
    res[name] = {"loss": [h["loss"] for h in r.history]}
  for name in ("seq4", "seq4_zigzag", "seq8"):
    res[f"max_param_diff_{name}"] = max_diff(params["none"], params[name])
  init = train.init_state(TokenMLP(), optax.identity(), [0, 1],
                          next(train.array_stream(arrays, 32, 0)))
  res["param_change"] = max_diff(params["none"], init["params"])
  return res


def max_diff(a, b) -> float:
  return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def main() -> None:
  assert len(jax.devices()) == 8, jax.devices()
  out = {}
  for case, (arrays, opt, make_model) in CASES.items():
    params, res = {}, {}
    for mode in ("none", "shard_map", "pmap"):
      config = train.FitConfig(optimizer=opt, num_steps=6, num_seeds=2, log_every=2,
                               parallel=mode, progress=False, tensorboard=False)
      r = train.fit(make_model(), train_data=train.loader(arrays, 32),
                    eval_data=train.loader(arrays, 64), config=config)
      params[mode] = r.params
      res[mode] = {"loss": [h["loss"] for h in r.history],
                   "accuracy": [h["accuracy"] for h in r.history],
                   "eval_accuracy": r.final_metrics["accuracy"].tolist()}
    init = train.init_state(make_model(), optax.identity(), [0, 1], next(train.array_stream(
        arrays, 32, 0)))
    res["max_param_diff_shard_map"] = max_diff(params["none"], params["shard_map"])
    res["max_param_diff_pmap"] = max_diff(params["none"], params["pmap"])
    res["max_param_diff_shard_map_pmap"] = max_diff(params["shard_map"], params["pmap"])
    # Training moved the parameters far more than the tolerance (the check is not vacuous).
    res["param_change"] = max_diff(params["none"], init["params"])
    out[case] = res
  out["sequence"] = sequence_case()
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
