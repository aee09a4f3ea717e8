"""Training NNX models with attnx.train: Flax's bridge (attnx.nnx.to_linen), the same loss curve
as the linen model from the same initial parameters, and the language-model experiment with
``model_api="nnx"`` end to end."""

from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from support import legs

from attnx import nn as attnx_nn
from attnx import nnx as anx
from attnx import train
from attnx.train import step as step_lib
from attnx.train.losses import get_loss
from attnx.train.optim import make_optimizer
from experiments import language_model as exp

KW = dict(vocab_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, max_len=8)
TOKENS = np.random.default_rng(0).integers(0, 16, size=(48, 9)).astype(np.int32)
ARRAYS = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:]}


def _tiny_preset_models(attention):
  """The language-model experiment's tiny-preset GPT in either API (its build_model)."""
  models = []
  for api in ("linen", "nnx"):
    c = exp.get_config("tiny")
    c.model_api = api
    models.append(exp.build_model(c, 16)(exp.nn.attention_spec(attention)))
  return models


@pytest.mark.split_by_jax
@pytest.mark.parametrize("extra", [dict(attention="sigmoid:normalization=none",
                                        positions="rotary"),
                                   dict(attention="ssmax_learned", sinks=True,
                                        dropout_rate=0.0),
                                   "tiny_preset"])
def test_the_nnx_gpt_and_the_linen_gpt_train_alike_from_the_same_parameters(extra):
  """attnx.train's vmapped step on the NNX model (through the bridge) and on the linen model,
  from the linen model's initial parameters, over the same batches: the same loss curve and
  the same final parameters (float32 tolerance)."""
  if extra == "tiny_preset":
    linen, bridged = _tiny_preset_models("relu:normalization=length")
    assert anx.is_nnx(bridged) and not anx.is_nnx(linen)
  else:
    linen, bridged = attnx_nn.GPT(**KW, **extra), anx.to_linen(anx.GPT, **KW, **extra)
  config = train.optimizer_config(learning_rate=3e-3)
  tx, loss_fn = make_optimizer(config, 30), get_loss("softmax_xent")
  state = step_lib.init_state(linen, tx, [0, 1], {k: v[:4] for k, v in ARRAYS.items()})
  chex.assert_trees_all_equal_structs(  # the bridge's parameters have the linen names
      state["params"],
      step_lib.init_state(bridged, tx, [0, 1], {k: v[:4] for k, v in ARRAYS.items()})["params"])
  curves = {}
  for name, model in (("linen", linen), ("nnx", bridged)):
    step = step_lib.make_step(step_lib.make_apply_fn(model), loss_fn, tx, donate=False)
    s, losses = state, []
    for i in range(30):
      rows = (np.arange(8) + 8 * i) % len(TOKENS)
      batch = {k: np.stack([v[rows], v[rows[::-1]]]) for k, v in ARRAYS.items()}  # 2 seeds
      s, metrics = step(s, batch, np.int32(i))
      losses.append(np.asarray(metrics["loss"]))
    curves[name] = (np.stack(losses), s["params"])
  np.testing.assert_allclose(curves["nnx"][0], curves["linen"][0], rtol=2e-5, atol=2e-6)
  assert curves["nnx"][0][-1].mean() < curves["nnx"][0][0].mean()  # it learned something
  chex.assert_trees_all_close(curves["nnx"][1], curves["linen"][1], atol=1e-4, rtol=1e-4)


def test_fit_trains_an_nnx_model_with_seeds_checkpoints_and_resume(tmp_path):
  model = anx.to_linen(anx.GPT, **KW, attention="relu", positions="alibi")
  config = train.FitConfig(num_steps=6, num_seeds=2, log_every=3, checkpoint_every=3,
                           progress=False, tensorboard=False,
                           optimizer=train.optimizer_config(learning_rate=1e-2))
  run = lambda: train.fit(model, train_data=train.loader(ARRAYS, 8), config=config,
                          eval_data=train.loader(ARRAYS, 48), workdir=str(tmp_path), name="nnx")
  whole = run()
  assert whole.seeds == [0, 1] and np.isfinite(np.asarray(whole.final_metrics["loss"])).all()
  shutil.rmtree(os.path.join(tmp_path, "checkpoints", "nnx", "6"))  # died after step 3
  resumed = run()
  assert resumed.start_step == 3
  chex.assert_trees_all_equal(resumed.params, whole.params)  # bit-identical
  # The trained parameters drive the linen twin and the native NNX model alike.
  twin = anx.linen_twin(model)
  tokens = TOKENS[:2, :-1]
  seed0 = jax.tree.map(lambda a: np.asarray(a)[0], whole.params)
  native = anx.GPT(**KW, attention="relu", positions="alibi", rngs=nnx.Rngs(0))
  state = nnx.state(native, nnx.Param)
  nnx.replace_by_pure_dict(state, seed0)
  nnx.update(native, state)
  chex.assert_trees_all_close(native(tokens), twin.apply({"params": seed0}, tokens), atol=1e-5)


def test_to_linen_and_linen_twin_refuse_what_they_cannot_do():
  config = train.FitConfig(num_steps=1, progress=False, tensorboard=False,
                           optimizer=train.optimizer_config())
  with pytest.raises(TypeError, match=r"to_linen\(GPT"):
    train.fit(anx.GPT(**KW, rngs=nnx.Rngs(0)), train_data=train.loader(ARRAYS, 8),
              config=config)
  with pytest.raises(TypeError, match="class"):
    anx.to_linen(anx.GPT(**KW, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="rngs"):
    anx.to_linen(anx.GPT, **KW, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no linen twin"):
    anx.linen_twin(anx.to_linen(anx.EncoderBlock, hidden_dim=16, num_heads=2, mlp_dim=32))
  linen = attnx_nn.GPT(**KW)
  assert anx.linen_twin(linen) is linen and not anx.is_nnx(linen)


@legs.experiment_run
def test_the_language_model_tiny_preset_runs_with_model_api_nnx(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  c = exp.get_config("tiny")
  c.update(dict(progress=False, num_steps=10, eval_every=10, checkpoint_every=10,
                model_api="nnx"))
  wd = str(tmp_path / "wd")
  out = exp.run(c, wd)
  fin = out["finish"]
  result = out["tasks"][fin["task"]]
  assert set(fin["val_loss"]) == {"softmax", "relu:normalization=length"}
  for res in result.fits.values():
    assert np.isfinite(res.final_metrics["loss_by_context"]).all()
    assert np.isfinite(res.final_metrics["sink_rate"]).all()  # the attention statistics
  assert anx.is_nnx(result.task.build_model(exp.nn.attention_spec("softmax")))
  # The model file describes the GPT both APIs build; sample.py's linen model reads it.
  spec_path = os.path.join(wd, "lm", "softmax", "model.json")
  with open(spec_path, encoding="utf-8") as f:
    assert json.load(f)["model"]["attention"] == {"type": "dot", "weighting": "softmax"}
  assert isinstance(anx.gpt_from_spec(attnx_nn.load_model_spec(spec_path), rngs=nnx.Rngs(0)),
                    anx.GPT)
  with pytest.raises(ValueError, match="model_api"):
    c.model_api = "haiku"
    exp.validate_config(c)
