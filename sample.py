"""Sample text from a GPT language model trained into an attnx workdir.

  python sample.py --workdir=runs/lm [--run=NAME] [--prompt="ROMEO:"] [--num_tokens=500]
      [--temperature=0.8] [--top_k=40] [--seed=0] [--num_samples=1] [--seed_index=0]
      [--step=LATEST] [--use_cache=auto|true|false] [--page_size=N]
      [--context=TRAINING_CONTEXT]

Prints the prompt followed by the sampled continuation (``--num_samples`` of them, separated
by a line of dashes). ``--prompt`` may be given several times: the prompts, of any lengths,
are decoded together as one batch. ``--page_size=N`` keeps the KV cache in pages of N
positions (``attnx.core.paged_attention``'s layout); the text is the same. The same
``--seed`` gives the same text; ``--temperature=0`` is greedy. ``--run`` may be omitted when
the workdir holds a single model; ``--list`` lists them.

What a training run must leave in the workdir — ``<workdir>/lm/<run>/model.json`` naming the
checkpoint ``attnx.train.fit`` wrote under ``<workdir>/checkpoints/`` — is the contract of
``attnx.train.sampling``, which writes it after training (``save_models``; e.g.
``experiments/language_model.py``), reads it back (``load_run``: one seed's parameters,
``--seed_index``, default 0) and draws the text (``sample_text``: ``attnx.nn.generate``, with a
KV cache where the attention has one). Each character is predicted from the latest
``--context`` characters, by default the model's training context (nanoGPT crops to its block
size the same way); rotary models accept a longer one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from attnx.train.sampling import SampleError, list_runs, load_run, sample_text


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="the experiment's workdir")
  p.add_argument("--run", default=None, help="model under <workdir>/lm (default: the only one)")
  p.add_argument("--list", action="store_true", help="list the models of the workdir and exit")
  p.add_argument("--prompt", action="append", default=None,
                 help="text to continue (default: a newline); repeat for a batch of prompts")
  p.add_argument("--num_tokens", type=int, default=500, help="characters to sample")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--num_samples", type=int, default=1, help="independent samples")
  p.add_argument("--seed_index", type=int, default=0, help="which trained seed's params")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--use_cache", choices=("auto", "true", "false"), default="auto",
                 help="KV cache (auto: where the attention has one)")
  p.add_argument("--page_size", type=int, default=None,
                 help="a paged KV cache with pages of this many positions")
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
    if args.page_size is not None and (args.page_size < 1 or args.use_cache == "false"):
      raise SampleError("--page_size must be >= 1 and needs the KV cache (--use_cache=auto or "
                        "true).")
    loaded = load_run(args.workdir, args.run, seed_index=args.seed_index, step=args.step)
    use_cache = {"auto": None, "true": True, "false": False}[args.use_cache]
    texts = sample_text(loaded["model"], loaded["params"], loaded["spec"]["vocab"],
                        args.prompt or ["\n"], args.num_tokens, seed=args.seed,
                        temperature=args.temperature, top_k=args.top_k,
                        num_samples=args.num_samples, use_cache=use_cache,
                        context=args.context, extra_variables=loaded["extra"],
                        page_size=args.page_size)
  except (SampleError, ValueError, FileNotFoundError) as e:
    print(f"FATAL: {e}", file=sys.stderr)
    return 2
  print(f"# run {loaded['run']}, step {loaded['step']}, seed index {args.seed_index}",
        file=sys.stderr)
  print(("\n" + "-" * 40 + "\n").join(texts))
  return 0


if __name__ == "__main__":
  sys.exit(main())
