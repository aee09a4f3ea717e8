"""Hashes of the programs attnx lowers, to show that a refactor changes no computation.

    python tools/program_hashes.py --out before.json            # on the code before
    python tools/program_hashes.py --out after.json --compare before.json   # after
    python tools/program_hashes.py --out now.json --compare baseline   # against the baseline

The lowered programs differ across XLA versions, so hashes compare only when made with the
same JAX: ``--compare`` refuses a file made with another. ``tools/program_hashes_baseline.json``
holds one corpus per JAX version (``--compare baseline`` picks the installed one's;
``--update-baseline`` writes it), each made with JAX_PLATFORMS=cpu:

* jax 0.10.2 (with the ``aot`` extra installed): the code right after the GPU tile table's
  timed dQ/dK/dV tiles, in the middle of the ``attnx.core`` reshaping (2026-11-27): it differed
  from the code before in the 11 Pallas programs lowered for ``cuda`` whose backward reads those
  tiles, and in nothing else. Sum-normalized sigmoid's 40 programs joined it when that
  weighting moved to the log-domain online max (2026-11-28); the other 580 were identical to
  the corpus before.
* jax 0.12.0.1 (Python 3.13, no ``aot`` extra): the code that admitted jax 0.12 (2026-11-29),
  whose 0.10.2 corpus equals the one above.

Each case is traced and lowered to StableHLO (forward, and forward+backward as the gradient
of a fixed random cotangent), on this machine's CPU — and, for the Pallas kernels, lowered for
``cuda`` and ``tpu`` too (nothing runs; no accelerator needed). The text is normalized before
hashing so that what a behaviour-free move may change does not count: function symbols are
renumbered in order of appearance (a renamed private helper is the same program) and source
locations are dropped (programs are lowered with no traceback frames in their locations, since
the Pallas kernels' serialized IR embeds file:line locations that no text substitution can
reach: a line moved in a kernel's file would change its hash). Anything else that differs — an
operation, a shape, a constant, the order of operations, a kernel's serialized IR — is
reported. ``--compare`` exits 1 when any
hash differs or a case is missing, and lists them, and 2 when it has no hashes of this JAX.
Compare runs made with the same JAX; two runs of the same code give the same hashes.

The corpus covers what the kernels branch on: every implementation (dense, blocked, Pallas in
the interpreter, Pallas lowered for each chip), one weighting per streaming family and
normalization, causal and not, GQA, a mask and a bias, T ≠ S, the ring on 8 fake CPU devices,
and an ``attnx.nn.GPT`` training step.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
import time

# The ring's cases need 8 devices; set before JAX initializes.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_traceback_in_locations_limit", 0)

from attnx import core  # noqa: E402
from attnx import nn as attnx_nn  # noqa: E402

# One weighting per streaming rule / whole-row family, and the distance form.
WEIGHTINGS = ("softmax", "softmax_plus_one", "relu", "relu:normalization=length",
              "sigmoid:normalization=none", "sigmoid", "power:p=3", "gaussian", "ssmax",
              "softpick", "stick_breaking", "sparsemax", "entmax15", "entmax:alpha=1.3")
# T ≠ S: one pointwise F, one whole-row family of each direction and a threshold family.
T_NE_S_WEIGHTINGS = ("softmax", "relu", "stick_breaking", "sparsemax")

_SYMBOL = re.compile(r"@([A-Za-z_][\w.$-]*)")
_LOC = re.compile(r"\s*loc\([^()]*(?:\([^()]*\)[^()]*)*\)")


def normalize(text: str) -> str:
  """StableHLO text without source locations, function symbols renumbered by first use."""
  text = _LOC.sub("", text)
  names: dict[str, str] = {"main": "main"}

  def rename(m: re.Match) -> str:
    return "@" + names.setdefault(m.group(1), f"f{len(names)}")

  return _SYMBOL.sub(rename, text)


def digest(fn, args, platforms=None) -> str:
  """The hash of ``fn(*args)`` lowered (for ``platforms``); ``args`` may be a function that
  makes them, so that a case ``--only`` leaves out costs nothing."""
  args = args() if callable(args) else args
  traced = jax.jit(fn).trace(*args)
  lowered = traced.lower(lowering_platforms=platforms) if platforms else traced.lower()
  return hashlib.sha256(normalize(lowered.as_text()).encode()).hexdigest()[:16]


def _qkv(b, t, s, n, kh, h, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
  mask = jax.random.bernoulli(ks[3], 0.8, (b, 1, t, s))
  bias = 0.1 * jax.random.normal(ks[4], (1, n, t, s), jnp.float32)
  return q, k, v, mask, bias


def _fwd_and_grad(call):
  def loss(*args):
    out = call(*args).astype(jnp.float32)
    return jnp.sum(out * jax.random.normal(jax.random.PRNGKey(9), out.shape))

  return call, jax.grad(loss, argnums=(0, 1, 2))


def attention_cases():
  """(name, fn, args, platforms) of core.attention over the kernels' branch points."""
  shapes = {"self": (2, 96, 96, 4, 2, 32), "t!=s": (1, 80, 112, 2, 1, 16)}
  impls = {"dense": dict(implementation="dense"),
           "blocked": dict(implementation=core.Blocked(block_q=32, block_k=32)),
           "blocked_default": dict(implementation="blocked"),
           "pallas_interpret": dict(implementation=core.Pallas(interpret=True))}
  for shape_name, shape in shapes.items():
    qkv = functools.cache(lambda shape=shape: _qkv(*shape))
    for w in WEIGHTINGS if shape_name == "self" else T_NE_S_WEIGHTINGS:
      score = "neg_sq_dist" if w == "gaussian" else "scaled_dot"
      for impl_name, impl in impls.items():
        for causal in (False, True):
          for extras in ("none", "mask_bias"):
            if impl_name == "blocked_default" and extras == "mask_bias":
              continue
            kw = dict(impl, weighting=w, score=score, is_causal=causal)
            masked = extras == "mask_bias"
            call = lambda q_, k_, v_, kw=kw, masked=masked, qkv=qkv: core.attention(
                q_, k_, v_, **kw, **(dict(mask=qkv()[3], bias=qkv()[4]) if masked else {}))
            fwd, grad = _fwd_and_grad(call)
            name = f"attention/{shape_name}/{w}/{impl_name}/causal={causal}/{extras}"
            args = lambda qkv=qkv: qkv()[:3]
            yield name + "/fwd", fwd, args, None
            yield name + "/fwd+bwd", grad, args, None
  # The Pallas kernels as each chip gets them (bf16, H = 64, causal GQA).
  args = functools.cache(lambda: _qkv(1, 128, 128, 4, 2, 64, jnp.bfloat16)[:3])
  for w in WEIGHTINGS:
    score = "neg_sq_dist" if w == "gaussian" else "scaled_dot"
    call = lambda q_, k_, v_, w=w, score=score: core.attention(
        q_, k_, v_, weighting=w, score=score, is_causal=True, implementation="pallas")
    fwd, grad = _fwd_and_grad(call)
    for plat in ("cuda", "tpu"):
      yield f"pallas/{plat}/{w}/fwd", fwd, args, (plat,)
      yield f"pallas/{plat}/{w}/fwd+bwd", grad, args, (plat,)


def ring_cases():
  """ring_attention over 8 fake CPU devices: contiguous and zigzag, causal, GQA."""
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec(None, "sp")
  args = functools.cache(lambda: _qkv(1, 256, 256, 4, 2, 16)[:3])
  for w in ("softmax", "relu", "sigmoid:normalization=none", "sigmoid", "ssmax", "softpick",
            "stick_breaking"):
    for layout in ("contiguous", "zigzag"):
      for impl in ("blocked", "pallas"):
        kw = dict(axis_name="sp", weighting=w, is_causal=True, layout=layout,
                  implementation=core.Pallas(interpret=True) if impl == "pallas" else impl)
        inner = lambda q_, k_, v_, kw=kw: core.ring_attention(q_, k_, v_, **kw)
        call = jax.shard_map(inner, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                             check_vma=False)
        fwd, grad = _fwd_and_grad(call)
        name = f"ring/{w}/{layout}/{impl}"
        yield name + "/fwd", fwd, args, None
        yield name + "/fwd+bwd", grad, args, None


def gpt_cases():
  """One training step's gradient of a small attnx.nn.GPT per implementation."""
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 64), 0, 32)
  for impl in ("dense", "blocked"):
    for attention in ("softmax", {"weighting": "entmax15"}):
      model = attnx_nn.GPT(vocab_size=32, num_layers=2, num_heads=4, hidden_dim=64,
                           mlp_dim=128, max_len=64, attention=attention, implementation=impl)

      def loss(params, tokens, model=model):
        logits = model.apply(params, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

      name = attention if isinstance(attention, str) else attention["weighting"]
      args = lambda model=model: (model.init(jax.random.PRNGKey(0), tokens), tokens)
      yield f"gpt/{impl}/{name}/train_step", jax.value_and_grad(loss), args, None


def corpus(only: str | None = None) -> dict[str, str]:
  hashes, t0 = {}, time.time()
  for gen in (attention_cases, ring_cases, gpt_cases):
    for name, fn, args, plats in gen():
      if only and not re.search(only, name):
        continue
      try:
        hashes[name] = digest(fn, args, plats)
      except Exception as e:  # noqa: BLE001 - a case that fails to lower is recorded as such
        hashes[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
      if len(hashes) % 100 == 0:
        print(f"  {len(hashes)} programs, {time.time() - t0:.0f} s", file=sys.stderr)
  return hashes


def compare(new: dict[str, str], old: dict[str, str]) -> list[str]:
  lines = [f"changed: {k}" for k in sorted(old) if k in new and new[k] != old[k]]
  lines += [f"missing: {k}" for k in sorted(set(old) - set(new))]
  lines += [f"new: {k}" for k in sorted(set(new) - set(old))]
  return lines


BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "program_hashes_baseline.json")


def _load(path: str) -> dict[str, dict]:
  """{jax version: {"hashes": ...}} of a baseline, or of one run's file."""
  with open(path) as f:
    data = json.load(f)
  return {data["jax"]: data} if "jax" in data else data


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="where to write the hashes (JSON)")
  p.add_argument("--compare", help="a JSON of hashes from before the change, made with this "
                 "JAX; 'baseline': the installed JAX's corpus in " + os.path.basename(BASELINE))
  p.add_argument("--only", help="a regular expression: hash only the cases it finds")
  p.add_argument("--update-baseline", action="store_true",
                 help="write this JAX's corpus into the baseline (the other versions' stay)")
  a = p.parse_args(argv)
  hashes = corpus(a.only)
  run = {"jax": jax.__version__, "hashes": hashes}
  with open(a.out, "w") as f:
    json.dump(run, f, indent=1, sort_keys=True)
  errors = sum(v.startswith("error") for v in hashes.values())
  print(f"{len(hashes)} programs hashed with jax {jax.__version__} ({errors} failed to lower) "
        f"-> {a.out}")
  if a.update_baseline:
    if a.only:
      p.error("--update-baseline needs the whole corpus (no --only)")
    base = _load(BASELINE) if os.path.exists(BASELINE) else {}
    base[jax.__version__] = run
    with open(BASELINE, "w") as f:
      json.dump(base, f, indent=1, sort_keys=True)
    print(f"baseline for jax {jax.__version__} written ({sorted(base)} in {BASELINE})")
  if not a.compare:
    return 0
  versions = _load(BASELINE if a.compare == "baseline" else a.compare)
  if jax.__version__ not in versions:
    print(f"no hashes made with jax {jax.__version__} in {a.compare} (it has "
          f"{sorted(versions)}): programs lowered by another XLA differ, so they cannot be "
          "compared; hash the code before with this JAX", file=sys.stderr)
    return 2
  old = versions[jax.__version__]["hashes"]
  if a.only:
    old = {k: v for k, v in old.items() if re.search(a.only, k)}
  diff = compare(hashes, old)
  print("\n".join(diff) if diff else f"identical: all {len(old)} programs")
  return 1 if any(not d.startswith("new:") for d in diff) else 0


if __name__ == "__main__":
  sys.exit(main())
