"""attnx.train.sampling: the model files of a language-model run and the text drawn from them
(the run names, choosing a run, prompts outside the vocabulary, seeded samples equal to
attnx.nn.generate's, the model files save_models writes). Reading checkpoints back through
sample.py's command line: tests/test_sample.py."""

from __future__ import annotations

import json
import os
import types

import jax
import numpy as np
import pytest

from attnx import nn
from attnx.train import experiment, sampling

VOCAB = "\nabc :"
MODEL = nn.GPT(vocab_size=len(VOCAB), num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
               max_len=8, positions="rotary")


def _params(seeds: int = 0):
  params = MODEL.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
  return jax.tree.map(lambda a: np.stack([a] * seeds), params) if seeds else params


def test_run_names_and_choosing_a_run(tmp_path):
  assert sampling.run_names(["softmax", "relu:normalization=length", "a b/c"]) == {
      "softmax": "softmax", "relu:normalization=length": "relu_normalization_length",
      "a b/c": "a_b_c"}
  wd = str(tmp_path)
  assert sampling.list_runs(wd) == []
  with pytest.raises(sampling.SampleError, match="no trained language model"):
    sampling.pick_run(wd, None)
  for run in ("softmax", "relu"):
    nn.save_model_spec(sampling.model_path(wd, run), MODEL, vocab=VOCAB)
  os.makedirs(tmp_path / "lm" / "empty")  # no model.json: not a run
  assert sampling.list_runs(wd) == ["relu", "softmax"]
  assert sampling.pick_run(wd, "relu") == "relu"
  with pytest.raises(sampling.SampleError, match="several models; pick one with --run"):
    sampling.pick_run(wd, None)
  with pytest.raises(sampling.SampleError, match="no model 'x'.*available: relu, softmax"):
    sampling.pick_run(wd, "x")


def test_prompts_and_seeded_samples():
  np.testing.assert_array_equal(sampling.encode_prompt("ab :", VOCAB), [1, 2, 4, 5])
  with pytest.raises(sampling.SampleError, match="outside the model's vocabulary: 'XZ'"):
    sampling.encode_prompt("aZX", VOCAB)
  with pytest.raises(sampling.SampleError, match="the prompt is empty"):
    sampling.encode_prompt("", VOCAB)
  params = _params()
  texts = sampling.sample_text(MODEL, params, VOCAB, "ab", 6, seed=3, temperature=0.9,
                               num_samples=2)
  want = nn.generate(MODEL, params, np.asarray([[1, 2], [1, 2]]), 6,
                     rng=jax.random.PRNGKey(3), temperature=0.9)
  assert texts == ["".join(VOCAB[i] for i in row) for row in np.asarray(want)]
  assert all(t.startswith("ab") and len(t) == 8 for t in texts)


def test_model_files_and_samples_of_a_finished_comparison(tmp_path):
  task = types.SimpleNamespace(name="toy_char", build_model=lambda spec: MODEL)
  fit = types.SimpleNamespace(params=_params(seeds=2), extra_variables=None)
  result = types.SimpleNamespace(task=task, fits={"softmax": fit, "relu:x=1": fit})
  specs = {"softmax": "softmax", "relu:x=1": "relu"}
  runs = sampling.save_models(str(tmp_path), result, specs, VOCAB, dataset="toy",
                              data={"seq_len": 8}, num_steps=5)
  assert runs == {"softmax": "softmax", "relu:x=1": "relu_x_1"}
  with open(sampling.model_path(str(tmp_path), "relu_x_1"), encoding="utf-8") as f:
    spec = json.load(f)
  assert spec["checkpoint"] == experiment.run_name("toy_char", "relu:x=1")
  assert (spec["dataset"], spec["data"], spec["weighting"], spec["num_steps"]) == (
      "toy", {"seq_len": 8}, "relu:x=1", 5)
  assert nn.gpt_from_spec(spec) == MODEL
  # One sample per variant from seed index 0; characters outside the vocabulary are dropped.
  texts = sampling.sample_variants(result, specs, VOCAB, "aZb", num_tokens=4, seed=1,
                                   temperature=0.5, top_k=50)
  want = nn.generate(MODEL, _params(), np.asarray([[1, 2]]), 4, rng=jax.random.PRNGKey(1),
                     temperature=0.5, top_k=len(VOCAB))
  assert texts["softmax"] == texts["relu:x=1"] == "".join(VOCAB[i] for i in np.asarray(want)[0])
