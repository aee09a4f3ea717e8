"""Run in a subprocess with 8 fake CPU devices (tests/nn/test_sequence_axis.py): attnx.nn.GPT
with ``sequence_axis`` inside ``jax.shard_map`` (the tokens of every sequence cut over 8
devices) against the same GPT on the whole sequence; prints JSON.

For each case: the logits and the gradient of the mean next-token loss with respect to every
parameter, sharded vs unsharded: max |Δ| / max |unsharded| (over all parameters for the
gradient).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from attnx import core, nn
from attnx.train import workarounds

DEVICES, LENGTH, BATCH, VOCAB = 8, 48, 2, 11
CASES = {
    "softmax_learned_contiguous": ("softmax", "learned", "contiguous"),
    "softmax_rotary_zigzag": ("softmax", "rotary", "zigzag"),
    "sigmoid_rotary_zigzag": ("sigmoid:normalization=none", "rotary", "zigzag"),
    "relu_length_learned_zigzag": ("relu:normalization=length", "learned", "zigzag"),
    "ssmax_rotary_contiguous": ("ssmax", "rotary", "contiguous"),
    "stick_breaking_rotary_contiguous": ("stick_breaking", "rotary", "contiguous"),
    "stick_breaking_learned_zigzag": ("stick_breaking", "learned", "zigzag"),
}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run_case(weighting: str, positions: str, layout: str) -> dict:
  def model(axis):
    return nn.GPT(vocab_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                  max_len=LENGTH, attention=weighting, positions=positions,
                  sequence_axis=axis, sequence_layout=layout)

  tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, LENGTH + 1), 0, VOCAB)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  whole = model(None)
  params = whole.init(jax.random.PRNGKey(0), inputs)["params"]

  def loss_whole(p):
    logits = whole.apply({"params": p}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), logits

  (_, logits), grads = jax.value_and_grad(loss_whole, has_aux=True)(params)

  sharded = model("seq")
  mesh = Mesh(np.asarray(jax.devices()), ("seq",))
  order = (lambda x: core.zigzag_permute(x, DEVICES, axis=1)) if layout == "zigzag" else (
      lambda x: x)
  back = (lambda x: core.zigzag_unpermute(x, DEVICES, axis=1)) if layout == "zigzag" else (
      lambda x: x)

  def local(p, x, y):
    def loss(p):
      lg = sharded.apply({"params": p}, x)
      total = optax.softmax_cross_entropy_with_integer_labels(lg, y).sum()
      return total / (BATCH * LENGTH), lg

    (_, lg), g = jax.value_and_grad(loss, has_aux=True)(p)
    return lg, jax.lax.psum(g, "seq")

  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "seq"), P(None, "seq")),
                            out_specs=(P(None, "seq"), P()), check_vma=False))
  lg_s, g_s = f(params, order(inputs), order(targets))
  lg_s = back(lg_s)
  # Relative to the largest gradient entry of the model: some entries are zero in exact
  # arithmetic (the key bias under softmax) and hold rounding only.
  scale = float(max(jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)))
  diff = max(float(jnp.max(jnp.abs(a - b)))
             for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(grads), strict=True))
  return {"logits": _rel(lg_s, logits), "grads": diff / scale, "grad_scale": scale}


def main() -> None:
  assert len(jax.devices()) == DEVICES, jax.devices()
  names = sys.argv[1:] or list(CASES)
  print("RESULT " + json.dumps({n: run_case(*CASES[n]) for n in names}))


if __name__ == "__main__":
  workarounds.fake_cpu_devices(DEVICES)  # before JAX starts its backend (test modules import
  main()  # CASES from here without it)
