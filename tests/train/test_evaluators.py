"""Evaluators by name (attnx/train/evaluators.py) against direct computations."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx.train import evaluators


class _Constant(nn.Module):
  """Predicts the same value everywhere: its ICL error has a closed form."""

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    c = self.param("c", nn.initializers.constant(0.5), (1,))
    return jnp.broadcast_to(c, x.shape[:-1] + (1,))


def test_icl_error_matches_numpy():
  rng = np.random.default_rng(0)
  arrays = {"inputs": rng.normal(size=(7, 8, 4)).astype(np.float32),
            "targets": rng.normal(size=(7, 4)).astype(np.float32)}
  model = _Constant()
  params = jax.tree.map(lambda x: jnp.stack([x, x + 1.0]),
                        model.init(jax.random.PRNGKey(0), arrays["inputs"])["params"])
  out = evaluators.make_eval_fn(("icl_error",), model, arrays)(params)
  dim = 3
  for s, c in enumerate((0.5, 1.5)):
    curve = ((c - arrays["targets"]) ** 2).mean(0) / dim
    np.testing.assert_allclose(out["icl_curve"][s], curve, rtol=1e-5)
    np.testing.assert_allclose(out["mse_last"][s], curve[-1], rtol=1e-5)
    np.testing.assert_allclose(out["mse"][s], curve.mean(), rtol=1e-5)


def test_accuracy_and_loss_are_dataset_means():
  class Logits(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
      return nn.Dense(3)(x)

  rng = np.random.default_rng(1)
  arrays = {"inputs": rng.normal(size=(1203, 5)).astype(np.float32),
            "targets": rng.integers(0, 3, 1203).astype(np.int32)}
  model = Logits()
  p = model.init(jax.random.PRNGKey(0), arrays["inputs"])["params"]
  out = evaluators.make_eval_fn(("accuracy", "loss"), model, arrays)(
      jax.tree.map(lambda x: x[None], p))
  logits = np.asarray(model.apply({"params": p}, arrays["inputs"]))
  acc = (logits.argmax(-1) == arrays["targets"]).mean()
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  loss = -logp[np.arange(1203), arrays["targets"]].mean()
  np.testing.assert_allclose(out["accuracy"], [acc], rtol=1e-6)
  np.testing.assert_allclose(out["loss"], [loss], rtol=1e-5)


def test_registry():
  assert {"accuracy", "loss", "mse", "icl_error"} <= set(evaluators.list_evaluators())
  with pytest.raises(ValueError, match="unknown evaluator"):
    evaluators.check_evaluators(("nope",))
  with pytest.raises(ValueError, match="already registered"):
    evaluators.register_evaluator("accuracy", lambda *a: None)
