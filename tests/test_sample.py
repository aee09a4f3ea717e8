"""sample.py end to end: a tiny GPT trained with attnx.train.fit (two seeds, checkpoints) into a
tmp workdir laid out as sample.py's docstring says, then sampled from on the command line."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from attnx import train
from attnx.nn import GPT, generate, save_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sample", os.path.join(ROOT, "sample.py"))
sample = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sample)

VOCAB = "\nabcdefg :"
L = 8


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("lm_workdir"))
  rng = np.random.default_rng(0)
  seq = (rng.integers(0, len(VOCAB), size=(64, 1)) + np.arange(L + 1)) % len(VOCAB)
  arrays = {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32)}
  model = GPT(vocab_size=len(VOCAB), num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
              max_len=L, positions="rotary", dropout_rate=0.1)
  config = train.FitConfig(num_steps=6, optimizer=train.optimizer_config(learning_rate=1e-2),
                           num_seeds=2, checkpoint_every=3, progress=False, tensorboard=False)
  res = train.fit(model, train_data=train.loader(arrays, 16), config=config, workdir=wd,
                  name="lm-softmax")
  save_model_spec(os.path.join(wd, "lm", "softmax", "model.json"), model, vocab=VOCAB,
                  checkpoint="lm-softmax", dataset="toy")
  return wd, model, res


def run(capsys, *argv):
  code = sample.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def test_greedy_sample_uses_the_chosen_seeds_final_params(workdir, capsys):
  wd, model, res = workdir
  for seed_index in (0, 1):
    code, out, err = run(capsys, f"--workdir={wd}", "--prompt=ab:", "--num_tokens=12",
                         "--temperature=0", f"--seed_index={seed_index}")
    assert code == 0, err
    assert "step 6" in err and "run softmax" in err
    params = jax.tree.map(lambda x, i=seed_index: x[i], res.params)
    ids = np.asarray([[VOCAB.index(c) for c in "ab:"]])
    want = generate(model.clone(dropout_rate=0.0), params, ids, 12,
                    rng=jax.random.PRNGKey(0), temperature=0.0)
    assert out == "".join(VOCAB[i] for i in np.asarray(want)[0]) + "\n"


def test_seeded_samples_and_options(workdir, capsys):
  wd, _, _ = workdir
  args = (f"--workdir={wd}", "--run=softmax", "--prompt=a", "--num_tokens=20",
          "--temperature=1.5", "--top_k=5", "--num_samples=2")
  _, a, _ = run(capsys, *args, "--seed=1")
  _, b, _ = run(capsys, *args, "--seed=1")
  _, c, _ = run(capsys, *args, "--seed=2", "--use_cache=false")
  assert a == b and a != c
  samples = a.rstrip("\n").split("\n" + "-" * 40 + "\n")
  assert len(samples) == 2 and all(s.startswith("a") and len(s) == 21 for s in samples)
  # An earlier checkpoint is another model.
  code, _, err = run(capsys, f"--workdir={wd}", "--step=3", "--num_tokens=2")
  assert code == 0 and "step 3" in err
  code, out, _ = run(capsys, f"--workdir={wd}", "--list")
  assert code == 0 and out == "softmax\n"


def test_clear_errors(workdir, capsys, tmp_path):
  wd, _, _ = workdir
  code, _, err = run(capsys, f"--workdir={wd}", "--prompt=XYZ")
  assert code == 2 and "outside the model's vocabulary: 'XYZ'" in err
  code, _, err = run(capsys, f"--workdir={wd}", "--seed_index=2")
  assert code == 2 and "trained with 2 seed(s)" in err
  code, _, err = run(capsys, f"--workdir={wd}", "--run=relu")
  assert code == 2 and "no model 'relu'" in err and "available: softmax" in err
  code, _, err = run(capsys, f"--workdir={wd}", "--step=4")
  assert code == 2 and "steps: [3, 6]" in err
  code, _, err = run(capsys, f"--workdir={tmp_path}")
  assert code == 2 and "no trained language model" in err and "model.json" in err
  # A model.json whose checkpoint is missing names the directory.
  spec = json.load(open(os.path.join(wd, "lm", "softmax", "model.json")))
  spec["checkpoint"] = "lm-missing"
  os.makedirs(tmp_path / "lm" / "x")
  json.dump(spec, open(tmp_path / "lm" / "x" / "model.json", "w"))
  code, _, err = run(capsys, f"--workdir={tmp_path}")
  assert code == 2 and os.path.join("checkpoints", "lm-missing") in err


@pytest.mark.slow
def test_command_line(workdir):
  wd, _, _ = workdir
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--workdir={wd}",
                         "--prompt=ab", "--num_tokens=5", "--temperature=0"],
                        capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("ab") and len(proc.stdout) == len("ab") + 5 + 1


def test_prompts_of_different_lengths_and_the_paged_cache(workdir, capsys):
  """A batch of prompts of different lengths decodes as each prompt alone (greedy), and the
  paged KV cache, the contiguous one and recomputation give the same text (sampled)."""
  wd, model, res = workdir
  prompts = ("--prompt=ab", "--prompt=c:dae", "--prompt=g")
  base = (f"--workdir={wd}", *prompts, "--num_tokens=3")
  code, greedy, err = run(capsys, *base, "--temperature=0", "--page_size=3")
  assert code == 0, err
  texts = greedy[:-1].split("\n" + "-" * 40 + "\n")  # print() ends with one newline
  params = jax.tree.map(lambda x: x[0], res.params)
  for text, prompt in zip(texts, ("ab", "c:dae", "g"), strict=True):
    ids = np.asarray([[VOCAB.index(c) for c in prompt]])
    want = generate(model.clone(dropout_rate=0.0), params, ids, 3, rng=jax.random.PRNGKey(0),
                    temperature=0.0)
    assert text == "".join(VOCAB[i] for i in np.asarray(want)[0])
  sampled = (*base, "--temperature=1.5", "--seed=3", "--num_samples=2")
  outs = [run(capsys, *sampled, *extra)[1] for extra in
          (("--page_size=2",), ("--use_cache=true",), ("--use_cache=false",))]
  assert outs[0] == outs[1] == outs[2] and len(outs[0].split("-" * 40)) == 6
  code, _, err = run(capsys, *base, "--page_size=2", "--use_cache=false")
  assert code == 2 and "--page_size must be >= 1 and needs the KV cache" in err
