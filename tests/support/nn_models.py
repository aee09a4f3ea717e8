"""Small helpers shared by the attnx.nn tests."""

from __future__ import annotations

import jax


def perturb_head(variables, key):
  """ViT's head is zero-initialized (logits are exactly 0 at init): give it random weights."""
  head = variables["params"]["head"]
  new = {"kernel": jax.random.normal(key, head["kernel"].shape), "bias": head["bias"]}
  return {**variables, "params": {**variables["params"], "head": new}}
