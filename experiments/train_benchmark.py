"""Training-machinery benchmark: N seeds via vmap vs N sequential runs; 1 vs 8 (fake) devices.

Model and data: the compare_weightings default model (ViT, 2x2 patches, softmax) on digits.

  python launch.py --config=experiments/train_benchmark.py          (≈2–8 min on 2 shared CPU cores)
  python launch.py --config=experiments/train_benchmark.py:tiny     (≈1 min, smoke test)

Part 1 trains `num_seeds` seeds in one vmapped program, then the same seeds one run at a time
(each compiling its own program, as separate runs would), and reports wall time with and without
compilation; the claim is vmap ≤ 0.5x the sequential time. Part 2 re-launches itself with
`devices` fake CPU devices and reports steps/s for parallel=none (1 device), shard_map and
pmap (batch sharded over all devices). Fake devices share the same CPU cores, so part 2
measures the overhead of the SPMD machinery, not a speed-up.

Part 3 (``part=causal_lm``, preset ``causal_lm``; not in ``all``) times one whole training step
(forward, backward, AdamW update) of a GPT-style causal language model — token and learned
position embeddings, pre-LN blocks (causal self-attention, GELU MLP of 4× the width), final
LayerNorm, next-token cross-entropy on random tokens — once with
``attnx.nn.MultiHeadAttention(weighting="softmax", is_causal=True)`` (the default
implementation: dense below ``attnx.core.BLOCKED_MIN_SCORES``, the blocked kernel
above) and once with flax's stock ``nn.MultiHeadDotProductAttention`` under
``nn.make_causal_mask``; everything else is the same. Both steps of one T are timed round-robin
(median of ``lm.repeats``); the report gives the time ratio attnx / flax per T.

  python launch.py --config=experiments/train_benchmark.py:causal_lm       (≈ 3 min on 2 cores)
  python launch.py --config=experiments/train_benchmark.py:causal_lm_tiny  (seconds, smoke test)

Part 4 (``part=nnx_gpt``, preset ``nnx_gpt``; not in ``all``) times attnx.train's training step
(the vmapped seeds' forward, backward and AdamW update, ``attnx.train.step.make_step``) of the
language-model experiment's GPT (4 layers, width 128, context 64, batch 12, 3 seeds, RoPE)
built twice from the same parameters: ``attnx.nn.GPT`` (linen) and ``attnx.nnx.GPT`` through
Flax's bridge (``attnx.nnx.to_linen``). Round-robin, median of ``nnx.repeats``; the report gives
the ratio NNX / linen against the NNX issue's target (≤ 1.05) and the two first losses.

  python launch.py --config=experiments/train_benchmark.py:nnx_gpt       (≈ 1 min on 2 cores)
  python launch.py --config=experiments/train_benchmark.py:nnx_gpt_tiny  (seconds, smoke test)

Measured on a shared 2-core machine (jax 0.10.2, 2 min 15 s in all): 8 seeds via vmap 18.9 s
wall vs 60.2 s for 8 sequential runs (ratio 0.31; compilation 2.7 s vs 25.9 s; pure training
time ratio 0.95, as the FLOPs are the same on CPU). Steps/s with 1 seed, batch 64: 95 (1 device),
44 (shard_map over 8 fake devices), 46 (pmap over 8); the final losses agree to 3e-6.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from attnx.train import config as train_config
from attnx.train.config import base_config, check_batch_size, config_overrides
from attnx.train.optim import optimizer_config

PARTS = ("all", "seeds", "devices", "causal_lm", "nnx_gpt")
MODES = ("none", "shard_map", "pmap")
# Not forwarded to the device part: it sets its own, and one host joins no cluster twice.
_NOT_FORWARDED = ("experiment", "preset", "part", "num_cpu_devices", "devices", "distributed",
                  "coordinator_address", "num_processes", "process_id")


def _default() -> ml_collections.ConfigDict:
  c = base_config()
  c.experiment = "train_benchmark"
  c.part = "all"  # all | seeds | devices
  c.num_seeds = 8
  c.num_steps = 200
  c.batch_size = 64
  c.devices = 8  # fake CPU devices for part 2
  c.model = ml_collections.ConfigDict(dict(
      hidden_dim=32, num_layers=2, num_heads=4, mlp_dim=64, dropout_rate=0.0, patch_size=2))
  c.optimizer = optimizer_config(name="adamw", learning_rate=3e-3, warmup_steps=20)
  # Part causal_lm: the GPT-style model, its sequence lengths and the timing.
  c.lm = ml_collections.ConfigDict(dict(
      seq_lens="256,1024,4096", width=256, num_heads=4, num_layers=2, batch_size=2,
      vocab_size=256, learning_rate=1e-3, repeats=5))
  # Part nnx_gpt: the language-model experiment's GPT, linen vs NNX, and the timing.
  c.nnx = ml_collections.ConfigDict(dict(
      num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512, context=64, vocab_size=65,
      batch_size=12, num_seeds=3, attention="softmax", repeats=30))
  return c


def _causal_lm(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:causal_lm (≈ 3 min): part 3,
  the causal LM training step, attnx vs flax's stock attention at T = 256, 1024, 4096."""
  c.part = "causal_lm"


def _causal_lm_tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:causal_lm_tiny (seconds): part 3
  on a width-32 model at T = 32, 64, one timed step (a smoke test; the timings mean nothing)."""
  c.part = "causal_lm"
  c.lm.update(seq_lens="32,64", width=32, repeats=1)


def _nnx_gpt(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:nnx_gpt (≈ 1 min): part 4, the
  NNX GPT's training step against the linen GPT's."""
  c.part = "nnx_gpt"


def _nnx_gpt_tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:nnx_gpt_tiny (seconds): part 4
  on a 1-layer width-16 GPT, 3 timed steps (a smoke test; the timings mean nothing)."""
  c.part = "nnx_gpt"
  c.nnx.update(num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, context=16, repeats=3)


def _tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:tiny (≈ 1 min, smoke test):
  2 seeds, 20 steps, 2 fake devices, a 1-layer model."""
  c.update(dict(num_seeds=2, num_steps=20, devices=2))
  c.model.update(hidden_dim=16, num_layers=1, num_heads=2, mlp_dim=32)


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny, "causal_lm": _causal_lm,
    "causal_lm_tiny": _causal_lm_tiny, "nnx_gpt": _nnx_gpt, "nnx_gpt_tiny": _nnx_gpt_tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Benchmark config (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "train_benchmark")


def validate_config(config: ml_collections.ConfigDict) -> None:
  if config.part not in PARTS:
    raise ValueError(f"config.part={config.part!r} is invalid; valid choices: {', '.join(PARTS)}")
  lm = config.lm
  try:
    lens = [int(t) for t in train_config.split_list(lm.seq_lens)]
  except ValueError:
    lens = []
  if not lens or min(lens) < 2:
    raise ValueError(f"config.lm.seq_lens={lm.seq_lens!r} must list sequence lengths ≥ 2")
  if lm.width % lm.num_heads:
    raise ValueError(f"config.lm.width={lm.width} must be divisible by "
                     f"config.lm.num_heads={lm.num_heads}")
  if config.batch_size % max(config.devices, 1):
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by "
                     f"config.devices={config.devices}")
  from attnx import data  # the size without preparing the data

  check_batch_size(config, "batch_size", data.get_info("digits").splits["train"], "'digits'")


def _setup(config):
  from attnx import data
  from attnx import nn as attnx_nn

  arrays = data.load_arrays("digits", split="train")
  arrays = {"inputs": arrays["inputs"], "targets": arrays["targets"]}
  m = config.model
  model = attnx_nn.VisionTransformer(
      num_classes=10, patch_size=m.patch_size, hidden_dim=m.hidden_dim,
      num_layers=m.num_layers, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
      dropout_rate=m.dropout_rate, attention=attnx_nn.attention_spec("softmax"))
  return model, arrays


def _fit(config, model, arrays, **kw) -> tuple[Any, float]:
  from attnx import train

  fit_config = train.FitConfig.from_config(
      config, **{"parallel": "none", "checkpoint_every": 0, "log_every": 0, "progress": False,
                 "tensorboard": False, **kw})
  t0 = time.perf_counter()
  r = train.fit(model, train_data=train.loader(arrays, config.batch_size, config.data_pipeline),
                config=fit_config)
  return r, time.perf_counter() - t0


def _seeds_part(config) -> dict[str, Any]:
  model, arrays = _setup(config)
  n = config.num_seeds
  vm, vm_wall = _fit(config, model, arrays, num_seeds=n, seed=config.seed)
  seq_wall, seq_train, seq_compile = 0.0, 0.0, 0.0
  for i in range(n):
    r, wall = _fit(config, model, arrays, num_seeds=1, seed=config.seed + i)
    seq_wall += wall
    seq_train += r.seconds_per_step * config.num_steps
    seq_compile += r.compile_seconds
  vm_train = vm.seconds_per_step * config.num_steps
  return {"num_seeds": n, "num_steps": config.num_steps,
          "vmap_wall_s": vm_wall, "vmap_train_s": vm_train, "vmap_compile_s": vm.compile_seconds,
          "sequential_wall_s": seq_wall, "sequential_train_s": seq_train,
          "sequential_compile_s": seq_compile,
          "ratio_wall": vm_wall / seq_wall, "ratio_train": vm_train / seq_train}


def _devices_part(config) -> dict[str, Any]:
  import jax

  model, arrays = _setup(config)
  out: dict[str, Any] = {"devices": len(jax.devices())}
  for mode in MODES:
    r, _ = _fit(config, model, arrays, num_seeds=1, seed=config.seed, parallel=mode)
    out[mode] = {"steps_per_s": 1.0 / r.seconds_per_step, "compile_s": r.compile_seconds,
                 "final_train_loss": float(r.final_metrics["train_loss"][0])}
  return out


# --------------------------------------------------------------------------------------------
# Part 3: a causal LM training step, attnx attention vs flax's stock attention.
# --------------------------------------------------------------------------------------------

LM_ATTENTION = ("flax", "attnx")


def lm_model(config, attention: str):
  """The GPT-style model of part 3 with `attention` in :data:`LM_ATTENTION`."""
  import flax.linen as nn
  import jax.numpy as jnp

  from attnx import nn as attnx_nn

  lm = config.lm

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      if attention == "attnx":
        h = attnx_nn.MultiHeadAttention(num_heads=lm.num_heads, weighting="softmax",
                                        is_causal=True, name="attention")(h)
      else:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(num_heads=lm.num_heads, name="attention")(
            h, mask=mask)
      x = x + h
      h = nn.Dense(4 * lm.width)(nn.LayerNorm()(x))
      return x + nn.Dense(lm.width)(nn.gelu(h))

  class CausalLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(lm.vocab_size, lm.width)(tokens)
      pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                       (tokens.shape[-1], lm.width))
      x = x + pos
      for _ in range(lm.num_layers):
        x = Block()(x)
      return nn.Dense(lm.vocab_size)(nn.LayerNorm()(x))

  return CausalLM()


def lm_step(config, attention: str, seq_len: int):
  """(compiled train step, (params, opt_state, tokens)) of part 3: forward, backward, AdamW."""
  import jax
  import optax

  lm = config.lm
  model = lm_model(config, attention)
  tokens = jax.random.randint(jax.random.PRNGKey(config.seed), (lm.batch_size, seq_len + 1), 0,
                              lm.vocab_size)
  params = model.init(jax.random.PRNGKey(config.seed + 1), tokens[:, :-1])
  tx = optax.adamw(lm.learning_rate)

  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply(p, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  args = (params, tx.init(params), tokens)
  return jax.jit(step).lower(*args).compile(), args


def _round_robin_ms(steps: dict[str, tuple[Any, tuple]], repeats: int) -> dict[str, float]:
  """{name: median ms} of compiled steps ``fn(*args)`` timed round-robin (load hits all
  alike; attnx.train.benchmark.time_round_robin)."""
  from attnx.train import benchmark

  calls = [functools.partial(fn, *args) for fn, args in steps.values()]
  secs = benchmark.time_round_robin(calls, int(repeats))
  return {name: 1e3 * t for name, t in zip(steps, secs, strict=True)}


def _causal_lm_part(config) -> dict[str, Any]:
  import jax

  rows = []
  for t in (int(x) for x in train_config.split_list(config.lm.seq_lens)):
    steps = {a: lm_step(config, a, t) for a in LM_ATTENTION}
    losses = {a: float(jax.block_until_ready(fn(*args))[2])
              for a, (fn, args) in steps.items()}  # one untimed step each
    ms = _round_robin_ms(steps, config.lm.repeats)
    rows.append({"T": t, "flax step ms": ms["flax"], "attnx step ms": ms["attnx"],
                 "attnx / flax": ms["attnx"] / ms["flax"], "flax first loss": losses["flax"],
                 "attnx first loss": losses["attnx"]})
  return {"rows": rows}


NNX_TARGET = 1.05  # the NNX issue's bound on the NNX / linen step-time ratio


def nnx_gpt_steps(config) -> dict[str, tuple[Any, tuple]]:
  """{"linen" | "nnx": (compiled attnx.train step, (state, batch, step))} of part 4, both from
  the linen model's initial parameters."""
  import jax
  import numpy as np

  from attnx import nn, train
  from attnx import nnx as anx
  from attnx.train import step as step_lib
  from attnx.train.losses import get_loss
  from attnx.train.optim import make_optimizer

  n = config.nnx
  kw = dict(vocab_size=n.vocab_size, num_layers=n.num_layers, num_heads=n.num_heads,
            hidden_dim=n.hidden_dim, mlp_dim=n.mlp_dim, max_len=n.context,
            attention=n.attention, positions="rotary")
  models = {"linen": nn.GPT(**kw), "nnx": anx.to_linen(anx.GPT, **kw)}
  rng = np.random.default_rng(config.seed)
  tokens = rng.integers(0, n.vocab_size, (n.num_seeds, n.batch_size, n.context + 1))
  batch = {"inputs": tokens[..., :-1].astype(np.int32),
           "targets": tokens[..., 1:].astype(np.int32)}
  tx = make_optimizer(train.optimizer_config(), 1000)
  state = step_lib.init_state(models["linen"], tx, list(range(n.num_seeds)),
                              {k: v[0, :2] for k, v in batch.items()})
  args = (state, batch, np.int32(0))
  return {name: (jax.jit(step_lib.make_step(step_lib.make_apply_fn(m), get_loss(
      "softmax_xent"), tx, donate=False)).lower(*args).compile(), args)
          for name, m in models.items()}


def _nnx_gpt_part(config) -> dict[str, Any]:
  import jax
  import numpy as np

  steps = nnx_gpt_steps(config)
  losses = {a: float(np.mean(jax.block_until_ready(fn(*args))[1]["loss"]))
            for a, (fn, args) in steps.items()}  # one untimed step each
  ms = _round_robin_ms(steps, config.nnx.repeats)
  return {"linen step ms": ms["linen"], "nnx step ms": ms["nnx"],
          "nnx / linen": ms["nnx"] / ms["linen"], "linen first loss": losses["linen"],
          "nnx first loss": losses["nnx"]}


# The causal-attention issue's targets for the attnx / flax step-time ratio.
LM_TARGETS = {1024: 0.67, 4096: 0.4}


def lm_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  return [{"target": f"attnx / flax ≤ {LM_TARGETS[r['T']]} at T = {r['T']}",
           "measured": f"{r['attnx / flax']:.2f}",
           "met": "yes" if r["attnx / flax"] <= LM_TARGETS[r["T"]] else "**no**"}
          for r in rows if r["T"] in LM_TARGETS]


def devices_command(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """launch.py command of the device part: this run's config (every overridden value) on
  `config.devices` fake CPU devices."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return [sys.executable, os.path.join(root, "launch.py"),
          f"--config={os.path.abspath(__file__)}:{config.preset}", "--config.part=devices",
          f"--config.num_cpu_devices={config.devices}", f"--config.devices={config.devices}",
          *config_overrides(config, get_config(config.preset), exclude=_NOT_FORWARDED),
          f"--workdir={workdir}"]


def loss_spread(devices: dict[str, Any]) -> tuple[float, int]:
  """(max - min of the final train losses over all processes and modes, number of runs)."""
  losses = [d[mode]["final_train_loss"] for d in devices.values() for mode in MODES]
  return max(losses) - min(losses), len(losses)


def _save_json(workdir: str, result: dict[str, Any]) -> dict[str, Any]:
  """Writes ``result`` to ``<workdir>/benchmark.json`` and returns it."""
  with open(os.path.join(workdir, "benchmark.json"), "w") as f:
    json.dump(result, f, indent=1)
  return result


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Run the requested parts; part "all" re-launches itself with fake devices for part 2."""
  from attnx import train

  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  if config.part == "nnx_gpt":
    row = _save_json(workdir, _nnx_gpt_part(config))
    n = config.nnx
    rep = train.Report("GPT training step: attnx.nnx vs attnx.nn", workdir, config,
                       claim=f"attnx.train's step on the NNX GPT costs at most {NNX_TARGET}x "
                             "the linen GPT's.")
    rep.table([row], caption=(
        f"attnx.train's step (forward, backward, AdamW; {n.num_seeds} seeds vmapped) of a "
        f"{n.num_layers}-layer GPT, width {n.hidden_dim}, context {n.context}, batch "
        f"{n.batch_size}, {n.attention}, RoPE, float32; median of {n.repeats} steps, the two "
        "models timed round-robin from the same parameters (so the first losses agree)."))
    met = row["nnx / linen"] <= NNX_TARGET
    rep.verdict(met, f"NNX / linen = {row['nnx / linen']:.3f} (target ≤ {NNX_TARGET}).")
    path = rep.write()
    print(json.dumps(row, indent=1))
    return {"report": path, **row}
  if config.part == "causal_lm":
    result = _save_json(workdir, _causal_lm_part(config))
    lm = config.lm
    rep = train.Report("Causal LM training step: attnx vs flax attention", workdir, config,
                       claim="A causal training step with attnx.nn.MultiHeadAttention is "
                             "faster than with flax's stock attention, and more so at long T.")
    rep.table(result["rows"], caption=(
        f"One training step (forward, backward, AdamW) of a {lm.num_layers}-layer pre-LN causal "
        f"LM, width {lm.width}, {lm.num_heads} heads, batch {lm.batch_size}, float32; median "
        f"of {lm.repeats} steps, the two models timed round-robin. The first losses agree "
        "(same initialization, same math)."))
    goals = lm_targets(result["rows"])
    if goals:
      rep.section("Targets")
      rep.table(goals, columns=["target", "measured", "met"])
      missed = [g["target"] for g in goals if g["met"] != "yes"]
      rep.verdict(not missed, "every target met." if not missed else "missed: "
                  + "; ".join(missed) + ".")
    path = rep.write()
    print(json.dumps(result, indent=1))
    return {"report": path, **result}
  if config.part == "seeds":
    result = {"seeds": _seeds_part(config)}
  elif config.part == "devices":
    result = {"devices": _devices_part(config)}
  else:
    result = {"seeds": _seeds_part(config)}
    one = _devices_part(config)  # this process: 1 device
    sub_dir = os.path.join(workdir, "devices")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(devices_command(config, sub_dir), check=True, cwd=root)
    with open(os.path.join(sub_dir, "benchmark.json")) as f:
      many = json.load(f)["devices"]
    result["devices"] = {"1_device": one, f"{many['devices']}_devices": many}
    result["final_train_loss_spread"] = loss_spread(result["devices"])[0]
  with open(os.path.join(workdir, "benchmark.json"), "w") as f:
    json.dump(result, f, indent=1)
  if config.part != "all":
    return {"report": os.path.join(workdir, "benchmark.json")}

  s = result["seeds"]
  rep = train.Report("attnx.train benchmark: seeds via vmap, data parallelism", workdir, config,
                     claim=f"Training {s['num_seeds']} seeds in one vmapped program takes at most "
                           f"half the time of {s['num_seeds']} sequential runs.")
  rep.section("Seeds: vmap vs sequential")
  rep.table([
      {"mode": f"vmap ({s['num_seeds']} seeds, 1 program)", "wall s": s["vmap_wall_s"],
       "train s": s["vmap_train_s"], "compile s": s["vmap_compile_s"]},
      {"mode": f"{s['num_seeds']} sequential runs", "wall s": s["sequential_wall_s"],
       "train s": s["sequential_train_s"], "compile s": s["sequential_compile_s"]},
      {"mode": "ratio vmap / sequential", "wall s": s["ratio_wall"], "train s": s["ratio_train"],
       "compile s": s["vmap_compile_s"] / s["sequential_compile_s"]},
  ], caption=f"{s['num_steps']} steps, batch {config.batch_size}; wall includes init, "
             "compilation and data")
  rep.verdict(s["ratio_wall"] <= 0.5,
              f"vmap/sequential wall-time ratio {s['ratio_wall']:.2f} (training only "
              f"{s['ratio_train']:.2f}).")
  rep.section("Data parallelism (fake CPU devices share the same cores)")
  rows = []
  for label, d in result["devices"].items():
    for mode in MODES:
      rows.append({"process": label, "parallel": mode, "steps/s": d[mode]["steps_per_s"],
                   "compile s": d[mode]["compile_s"],
                   "final train loss": d[mode]["final_train_loss"]})
  rep.table(rows)
  spread, n = loss_spread(result["devices"])
  rep.verdict(spread <= 1e-4,
              f"The final train losses of the {n} runs (processes x parallel modes) differ by at "
              f"most {spread:.1e}" + (": data parallelism computes the same update."
                                      if spread <= 1e-4 else ", more than 1e-4."))
  path = rep.write()
  print(json.dumps(result, indent=1))
  return {"report": path}
