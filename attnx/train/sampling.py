"""Text from trained character GPTs: the model files a run leaves, read back and sampled.

The contract between an experiment that trains character-level GPTs (e.g.
``experiments/language_model.py``) and ``sample.py``, both sides of it here. For every trained
model ``<run>`` the workdir holds:

* ``<workdir>/lm/<run>/model.json`` (:func:`save_models`, through
  :func:`attnx.nn.save_model_spec`): ``{"format": "attnx.gpt/1", "model": {GPT constructor
  kwargs}, "vocab": [id -> character], "encoding": "utf-8 characters", "checkpoint": <fit
  name>, ...}``. ``vocab`` is the dataset's, ``attnx.data.get_info("shakespeare",
  ...).extras["vocab"]``; ``"checkpoint"`` is the ``name=`` given to :func:`attnx.train.fit`
  (when absent, ``<run>``). Other keys (dataset, weighting, ...) are kept and ignored.
* ``<workdir>/checkpoints/<fit name>/``: what :func:`attnx.train.fit` writes with
  ``checkpoint_every > 0`` (the final step is always saved). Its params are stacked over the
  run's seeds (leading axis); ``seed_index`` picks one. Non-trained collections (FAVOR+ ω, the
  state's ``"extra"``) are restored with them.

:func:`load_run` rebuilds the model with :func:`attnx.nn.gpt_from_spec` (dropout off) and
restores one seed's parameters; :func:`sample_text` draws text with :func:`attnx.nn.generate`
(a KV cache where the attention has one, else the prefix recomputed each step), each character
predicted from the latest ``context`` characters, by default the training context (nanoGPT
crops to its block size the same way). :func:`sample_variants` and :func:`report_samples` draw
the report's samples straight from a finished comparison (seed index 0).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from attnx.train.experiment import run_name

if TYPE_CHECKING:
  from attnx import nn

__all__ = ["MODEL_FILE", "SampleError", "encode_prompt", "linen_model", "list_runs",
           "load_run", "model_path", "pick_run", "report_samples", "restore_state",
           "run_names", "sample_text", "sample_variants", "save_models"]

MODEL_FILE = "model.json"


class SampleError(ValueError):
  """A workdir, run, checkpoint or prompt that cannot be sampled from (one-line message)."""


def model_path(workdir: str, run: str) -> str:
  """The model file of ``run``: ``<workdir>/lm/<run>/model.json``."""
  return os.path.join(workdir, "lm", run, MODEL_FILE)


def list_runs(workdir: str) -> list[str]:
  """Runs with a model.json under ``<workdir>/lm``."""
  root = os.path.join(workdir, "lm")
  if not os.path.isdir(root):
    return []
  return sorted(r for r in os.listdir(root) if os.path.isfile(model_path(workdir, r)))


def pick_run(workdir: str, run: str | None) -> str:
  """``run``, or the workdir's only one when None; a :class:`SampleError` lists the choices."""
  runs = list_runs(workdir)
  if run is None:
    if len(runs) == 1:
      return runs[0]
    if not runs:
      raise SampleError(f"no trained language model in {workdir!r}: expected "
                        f"{os.path.join(workdir, 'lm', '<run>', MODEL_FILE)} (see sample.py's "
                        "docstring for what a training run must save).")
    raise SampleError(f"{workdir!r} holds several models; pick one with --run: "
                      f"{', '.join(runs)}.")
  if run not in runs:
    raise SampleError(f"no model {run!r} in {workdir!r} (no {model_path(workdir, run)}); "
                      f"available: {', '.join(runs) or 'none'}.")
  return run


def restore_state(workdir: str, name: str, step: int | None = None) -> tuple[dict, int]:
  """The train state (numpy, stacked over seeds) of checkpoint ``step`` (default: latest)."""
  from attnx.train.checkpoint import (  # noqa: PLC0415 (heavy import)
      CheckpointDamagedError,
      load_checkpoint,
  )

  try:
    saved = load_checkpoint(workdir, name, step)
  except (FileNotFoundError, ValueError, CheckpointDamagedError) as e:
    raise SampleError(str(e)) from e
  return saved.state, saved.step


def load_run(workdir: str, run: str | None = None, *, seed_index: int = 0,
             step: int | None = None) -> dict[str, Any]:
  """``{"run", "spec", "model", "params", "extra", "step", "num_seeds"}`` of a trained model:
  its model file and one seed's parameters at ``step`` (default: the latest checkpoint)."""
  from attnx.nn.gpt import gpt_from_spec, load_model_spec  # noqa: PLC0415 (attnx.train: light)

  run = pick_run(workdir, run)
  spec = load_model_spec(model_path(workdir, run))
  model = gpt_from_spec(spec, dropout_rate=0.0, attention_dropout_rate=0.0)
  state, step = restore_state(workdir, spec.get("checkpoint") or run, step)
  num_seeds = len(jax.tree.leaves(state["params"])[0])
  if not 0 <= seed_index < num_seeds:
    raise SampleError(f"--seed_index={seed_index}: run {run!r} was trained with {num_seeds} "
                      f"seed(s) (valid: 0..{num_seeds - 1}).")
  pick = lambda tree: jax.tree.map(lambda x: np.asarray(x)[seed_index], tree)
  params = pick(state["params"])
  expected = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                            np.zeros((1, 1), np.int32))["params"]
  got = jax.tree.map(np.shape, params)
  want = jax.tree.map(lambda s: tuple(s.shape), expected)
  if got != want:
    raise SampleError(f"the checkpoint of run {run!r} does not fit the model in "
                      f"{model_path(workdir, run)} (parameter shapes differ).")
  extra = pick(state["extra"]) if state.get("extra") else None
  return {"run": run, "spec": spec, "model": model, "params": params, "extra": extra,
          "step": step, "num_seeds": num_seeds}


def encode_prompt(prompt: str, vocab: Sequence[str]) -> np.ndarray:
  """The prompt as token ids; a :class:`SampleError` names characters outside ``vocab``."""
  table = {c: i for i, c in enumerate(vocab)}
  unknown = sorted({c for c in prompt if c not in table})
  if unknown:
    raise SampleError(f"the prompt has characters outside the model's vocabulary: "
                      f"{''.join(unknown)!r}.")
  if not prompt:
    raise SampleError("the prompt is empty; give at least one character (e.g. --prompt='\\n').")
  return np.asarray([table[c] for c in prompt], np.int32)


def sample_text(model: nn.GPT, params: Any, vocab: Sequence[str], prompt: str | Sequence[str],
                num_tokens: int, *,
                seed: int = 0, temperature: float = 1.0, top_k: int | None = None,
                num_samples: int = 1, use_cache: bool | None = None,
                context: int | None = None, extra_variables: Any = None,
                page_size: int | None = None) -> list[str]:
  """``num_samples`` texts per prompt: the prompt and ``num_tokens`` sampled characters each.

  ``prompt`` may be a list of prompts of different lengths: they are decoded together, one
  batch (each its own length, :func:`attnx.nn.generate`'s ``prompt_lengths``), and the texts
  come prompt by prompt. ``page_size``: a paged KV cache (pages of that many positions)
  instead of a contiguous one; the texts are the same."""
  from attnx.nn.gpt import generate  # noqa: PLC0415

  prompts = [prompt] if isinstance(prompt, str) else list(prompt)
  if not prompts:
    raise SampleError("give at least one prompt.")
  encoded = [encode_prompt(p, vocab) for p in prompts]
  longest = max(len(ids) for ids in encoded)
  rows = [np.pad(ids, (0, longest - len(ids))) for ids in encoded for _ in range(num_samples)]
  lengths = np.asarray([len(ids) for ids in encoded for _ in range(num_samples)], np.int32)
  out = generate(model, params, np.stack(rows), num_tokens, rng=jax.random.PRNGKey(seed),
                 temperature=temperature, top_k=top_k, use_cache=use_cache, context=context,
                 extra_variables=extra_variables,
                 prompt_lengths=None if len(set(lengths.tolist())) == 1 else lengths,
                 cache_page_size=page_size)
  return ["".join(vocab[int(i)] for i in row[:length + num_tokens])
          for row, length in zip(np.asarray(out), lengths, strict=True)]


# --- the training side: model files and the report's samples ------------------------------------


def linen_model(result: Any, spec: Any) -> nn.GPT:
  """The linen GPT of a trained variant (``result`` an :class:`attnx.train.experiment.TaskResult`):
  the model itself, or an NNX model's linen twin (the same parameter tree)."""
  from attnx.nnx import bridge  # noqa: PLC0415 (attnx.nnx sits beside attnx.train)

  return bridge.linen_twin(result.task.build_model(spec))


def run_names(variants: Sequence[str]) -> dict[str, str]:
  """{variant: run}: each name with characters other than ``A-Za-z0-9_.-`` as "_"."""
  return {name: re.sub(r"[^A-Za-z0-9_.-]+", "_", name) for name in variants}


def save_models(workdir: str, result: Any, specs: Mapping[str, Any], vocab: str, *,
                dataset: str, data: Mapping[str, Any], num_steps: int) -> dict[str, str]:
  """Writes ``<workdir>/lm/<run>/model.json`` for every trained variant of ``result`` (a
  TaskResult; ``specs``: {variant: what its build_model took}), naming its checkpoint, the
  dataset and its config, the variant (as ``"weighting"``) and the steps; returns
  :func:`run_names`."""
  from attnx.nn.gpt import save_model_spec  # noqa: PLC0415

  runs = run_names(list(result.fits))
  for name in result.fits:
    save_model_spec(model_path(workdir, runs[name]), linen_model(result, specs[name]),
                    vocab=vocab, checkpoint=run_name(result.task.name, name), dataset=dataset,
                    data=dict(data), weighting=name, num_steps=int(num_steps))
  return runs


def sample_variants(result: Any, specs: Mapping[str, Any], vocab: str, text: str, *,
                    num_tokens: int, seed: int = 0, temperature: float = 1.0,
                    top_k: int | None = None) -> dict[str, str]:
  """{variant: sample}: one per trained variant of ``result`` from its seed-0 parameters,
  continuing ``text`` (its characters outside the vocabulary dropped; none left: token 0)."""
  from attnx.nn.gpt import generate  # noqa: PLC0415

  table = {ch: i for i, ch in enumerate(vocab)}
  ids = np.asarray([[table[ch] for ch in text if ch in table] or [0]], np.int32)
  seed0 = lambda tree: jax.tree.map(lambda a: np.asarray(a)[0], tree) if tree else None
  return {name: "".join(vocab[int(i)] for i in np.asarray(generate(
      linen_model(result, specs[name]), seed0(res.params), ids, int(num_tokens),
      rng=jax.random.PRNGKey(int(seed)), temperature=float(temperature),
      top_k=min(int(top_k), len(vocab)) if top_k else None,
      extra_variables=seed0(res.extra_variables)))[0]) for name, res in result.fits.items()}


def report_samples(rep: Any, result: Any, specs: Mapping[str, Any], vocab: str, prompt: str,
                   sample: Mapping[str, Any], *, context: int, runs: Mapping[str, str],
                   label: str = "weighting") -> dict[str, str]:
  """The report's "Samples" section: :func:`sample_variants` with ``sample``'s
  ``num_tokens``, ``temperature``, ``top_k`` and ``seed``, how they were drawn and how to draw
  more with sample.py (``runs``: :func:`save_models`); returns {variant: sample}."""
  rep.section("Samples")
  n, t, k, seed = (sample[key] for key in ("num_tokens", "temperature", "top_k", "seed"))
  texts = sample_variants(result, specs, vocab, prompt, num_tokens=n, seed=seed,
                          temperature=t, top_k=k)
  rep.text(f"One sample per {label}: seed index 0, prompt {prompt!r}, {n} "
           f"characters, temperature {t:g}, top-k {k}, sampling seed "
           f"{seed} (attnx.nn.generate; each character from the latest {context}, the training "
           "context, as nanoGPT crops to its block size). More with `python sample.py "
           f"--workdir={rep.workdir} --run=RUN --prompt={shlex.quote(prompt)}` (runs: "
           f"{', '.join(runs.values())}).")
  for name, text in texts.items():
    rep.text(f"**{name}**\n\n```text\n{text}\n```")
  return texts
