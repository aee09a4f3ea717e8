"""Sample text from a GPT language model trained into an attnx workdir.

  python sample.py --workdir=runs/lm [--run=NAME] [--prompt="ROMEO:"] [--num_tokens=500]
      [--temperature=0.8] [--top_k=40] [--seed=0] [--num_samples=1] [--seed_index=0]
      [--step=LATEST] [--use_cache=auto|true|false] [--context=TRAINING_CONTEXT]

Prints the prompt followed by the sampled continuation (``--num_samples`` of them, separated
by a line of dashes). The same ``--seed`` gives the same text; ``--temperature=0`` is greedy.
``--run`` may be omitted when the workdir holds a single model; ``--list`` lists them.

What a training run must leave in the workdir (the contract with the experiment that trains,
e.g. ``experiments/language_model.py``), for each trained model ``<run>``:

* ``<workdir>/lm/<run>/model.json``, written by
  ``attnx.nn.gpt.save_model_spec(path, model, vocab=vocab, checkpoint=<fit name>, ...)``:
  ``{"format": "attnx.gpt/1", "model": {GPT constructor kwargs}, "vocab": [id -> character],
  "encoding": "utf-8 characters", "checkpoint": <fit name>, ...}``. ``vocab`` is the
  dataset's, ``attnx.data.get_info("shakespeare", ...).extras["vocab"]``. ``"checkpoint"`` is
  the ``name=`` given to ``attnx.train.fit``; when absent it is ``<run>``. Other keys
  (dataset, weighting, ...) are kept and ignored.
* ``<workdir>/checkpoints/<fit name>/``: the checkpoints ``attnx.train.fit(model,
  workdir=<workdir>, name=<fit name>, config=FitConfig(checkpoint_every>0, ...))`` writes (the
  final step is always saved). The params there are stacked over the run's seeds (leading
  axis); ``--seed_index`` (default 0) picks one. Non-trained collections (FAVOR+ ω, the
  state's ``"extra"``) are restored with them.

The model is rebuilt with ``attnx.nn.gpt.gpt_from_spec`` (dropout is off when sampling), and
text is drawn with ``attnx.nn.generate`` (KV cache where the attention has one, else the
prefix is recomputed each step; see attnx/nn/gpt.py). Each character is predicted from the
latest ``--context`` characters, by default the model's training context (nanoGPT crops to
its block size the same way); rotary models accept a longer one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from attnx.nn.gpt import GPT, generate, gpt_from_spec, load_model_spec

MODEL_FILE = "model.json"


class SampleError(ValueError):
  """A workdir, run, checkpoint or prompt that sample.py cannot use (one-line message)."""


def model_path(workdir: str, run: str) -> str:
  return os.path.join(workdir, "lm", run, MODEL_FILE)


def list_runs(workdir: str) -> list[str]:
  """Runs with a model.json under ``<workdir>/lm``."""
  root = os.path.join(workdir, "lm")
  if not os.path.isdir(root):
    return []
  return sorted(r for r in os.listdir(root) if os.path.isfile(model_path(workdir, r)))


def _pick_run(workdir: str, run: str | None) -> str:
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
  """``{"run", "spec", "model", "params", "extra", "step", "num_seeds"}`` of a trained model."""
  run = _pick_run(workdir, run)
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
  table = {c: i for i, c in enumerate(vocab)}
  unknown = sorted({c for c in prompt if c not in table})
  if unknown:
    raise SampleError(f"the prompt has characters outside the model's vocabulary: "
                      f"{''.join(unknown)!r}.")
  if not prompt:
    raise SampleError("the prompt is empty; give at least one character (e.g. --prompt='\\n').")
  return np.asarray([table[c] for c in prompt], np.int32)


def sample_text(model: GPT, params: Any, vocab: Sequence[str], prompt: str, num_tokens: int, *,
                seed: int = 0, temperature: float = 1.0, top_k: int | None = None,
                num_samples: int = 1, use_cache: bool | None = None,
                context: int | None = None, extra_variables: Any = None) -> list[str]:
  """``num_samples`` texts: the prompt and ``num_tokens`` sampled characters each."""
  ids = encode_prompt(prompt, vocab)
  batch = np.tile(ids[None], (num_samples, 1))
  out = generate(model, params, batch, num_tokens, rng=jax.random.PRNGKey(seed),
                 temperature=temperature, top_k=top_k, use_cache=use_cache, context=context,
                 extra_variables=extra_variables)
  return ["".join(vocab[int(i)] for i in row) for row in np.asarray(out)]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="the experiment's workdir")
  p.add_argument("--run", default=None, help="model under <workdir>/lm (default: the only one)")
  p.add_argument("--list", action="store_true", help="list the models of the workdir and exit")
  p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
  p.add_argument("--num_tokens", type=int, default=500, help="characters to sample")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--num_samples", type=int, default=1, help="independent samples")
  p.add_argument("--seed_index", type=int, default=0, help="which trained seed's params")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--use_cache", choices=("auto", "true", "false"), default="auto",
                 help="KV cache (auto: where the attention has one)")
  p.add_argument("--context", type=int, default=None,
                 help="characters the model sees per step (default: its training context)")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(argv)
  try:
    if args.list:
      for run in list_runs(args.workdir):
        print(run)
      return 0
    if args.num_tokens < 0 or args.num_samples < 1:
      raise SampleError("--num_tokens must be >= 0 and --num_samples >= 1.")
    loaded = load_run(args.workdir, args.run, seed_index=args.seed_index, step=args.step)
    use_cache = {"auto": None, "true": True, "false": False}[args.use_cache]
    texts = sample_text(loaded["model"], loaded["params"], loaded["spec"]["vocab"],
                        args.prompt, args.num_tokens, seed=args.seed,
                        temperature=args.temperature, top_k=args.top_k,
                        num_samples=args.num_samples, use_cache=use_cache,
                        context=args.context, extra_variables=loaded["extra"])
  except (SampleError, ValueError, FileNotFoundError) as e:
    print(f"FATAL: {e}", file=sys.stderr)
    return 2
  print(f"# run {loaded['run']}, step {loaded['step']}, seed index {args.seed_index}",
        file=sys.stderr)
  print(("\n" + "-" * 40 + "\n").join(texts))
  return 0


if __name__ == "__main__":
  sys.exit(main())
