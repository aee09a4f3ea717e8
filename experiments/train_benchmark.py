"""Training-machinery benchmark: N seeds via vmap vs N sequential runs; 1 vs 8 (fake) devices.

Model and data: the compare_weightings default model (ViT, 2x2 patches, softmax) on digits.
Part 1 trains `num_seeds` seeds in one vmapped program, then one run per seed (each compiling
its own program), and reports wall time with and without compilation (claim: vmap ≤ 0.5x the
sequential time). Part 2 re-launches itself on `devices` fake CPU devices and reports steps/s
for parallel=none (1 device), shard_map and pmap: the overhead of the SPMD machinery (fake
devices share the cores), and whether all give the same losses.
Part 3 (``part=causal_lm``; not in ``all``) times a training step (forward, backward, AdamW) of
a GPT-style causal LM with ``attnx.nn.MultiHeadAttention(is_causal=True)`` and with flax's stock
attention under a causal mask: attnx / flax per T against the issue's targets. Part 4
(``part=nnx_gpt``; not in ``all``) times attnx.train's step of the language-model experiment's
GPT (4 layers, width 128, context 64, RoPE) as ``attnx.nn.GPT`` and as ``attnx.nnx.GPT``
through Flax's bridge, from the same parameters (target: NNX / linen ≤ 1.05). The models and
steps of parts 3 and 4, timed round-robin, are attnx.train.benchmark.training's.

  python launch.py --config=experiments/train_benchmark.py          (≈2–8 min on 2 shared CPU cores)
  python launch.py --config=experiments/train_benchmark.py:tiny     (≈1 min, smoke test)
  python launch.py --config=experiments/train_benchmark.py:causal_lm  (≈ 3 min; causal_lm_tiny)
  python launch.py --config=experiments/train_benchmark.py:nnx_gpt    (≈ 1 min; nnx_gpt_tiny)

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
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from attnx import nn as attnx_nn
from attnx import train
from attnx.train import benchmark, verdict
from attnx.train import config as train_config
from attnx.train.benchmark.targets import Target

PARTS = ("all", "seeds", "devices", "causal_lm", "nnx_gpt")
MODES = ("none", "shard_map", "pmap")
NNX_TARGET = 1.05  # the NNX issue's bound on the NNX / linen step-time ratio
# The causal-attention issue's targets for the attnx / flax step-time ratio.
LM_TARGETS = {1024: 0.67, 4096: 0.4}
TARGETS = (Target("attnx / flax ≤ {bound} at T = {T}", "attnx / flax", "<=",
                  lambda f: LM_TARGETS[f["T"]], dict(T=lambda t: t in LM_TARGETS)),)
# Not forwarded to the device part: it sets its own, and one host joins no cluster twice.
_NOT_FORWARDED = ("experiment", "preset", "part", "num_cpu_devices", "devices", "distributed",
                  "coordinator_address", "num_processes", "process_id")


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment = "train_benchmark"
  c.part = "all"  # all | seeds | devices
  c.num_seeds = 8
  c.num_steps = 200
  c.batch_size = 64
  c.devices = 8  # fake CPU devices for part 2
  c.model = ml_collections.ConfigDict(dict(
      hidden_dim=32, num_layers=2, num_heads=4, mlp_dim=64, dropout_rate=0.0, patch_size=2))
  c.optimizer = train.optimizer_config(name="adamw", learning_rate=3e-3, warmup_steps=20)
  # Part causal_lm: the GPT-style model, its sequence lengths and the timing.
  c.lm = ml_collections.ConfigDict(dict(
      seq_lens="256,1024,4096", width=256, num_heads=4, num_layers=2, batch_size=2,
      vocab_size=256, learning_rate=1e-3, repeats=5))
  # Part nnx_gpt: the language-model experiment's GPT, linen vs NNX, and the timing.
  c.nnx = ml_collections.ConfigDict(dict(
      num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512, context=64, vocab_size=65,
      batch_size=12, num_seeds=3, attention="softmax", repeats=30))
  return c


def _causal_lm_tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:causal_lm_tiny (seconds): part 3
  on a width-32 model at T = 32, 64, one timed step (a smoke test; the timings mean nothing)."""
  c.part = "causal_lm"
  c.lm.update(seq_lens="32,64", width=32, repeats=1)


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


# Each preset is the default changed by one small function (see the module docstring):
# causal_lm (≈ 3 min) and nnx_gpt (≈ 1 min) run parts 3 and 4 at their default sizes.
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny, "causal_lm": lambda c: c.update(part="causal_lm"),
    "causal_lm_tiny": _causal_lm_tiny, "nnx_gpt": lambda c: c.update(part="nnx_gpt"),
    "nnx_gpt_tiny": _nnx_gpt_tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Benchmark config (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "train_benchmark")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a bad part, sequence lengths, LM width or batch size."""
  train.check_choice(config, "part", PARTS)
  lm = config.lm
  try:
    lens = [int(t) for t in train.split_list(lm.seq_lens)]
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
  from attnx import data  # noqa: PLC0415  (the size without preparing the data)

  train.check_batch_size(config, "batch_size", data.get_info("digits").splits["train"],
                         "'digits'")


def _fitter(config) -> Callable[..., tuple[Any, float]]:
  """fit(**overrides) -> (result, wall s): the ViT of parts 1 and 2 trained on digits
  (attnx.train.benchmark.training.timed_fit)."""
  from attnx import data  # noqa: PLC0415

  arrays = data.load_arrays("digits", split="train")
  m = config.model
  model = attnx_nn.VisionTransformer(
      num_classes=10, patch_size=m.patch_size, hidden_dim=m.hidden_dim,
      num_layers=m.num_layers, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
      dropout_rate=m.dropout_rate, attention=attnx_nn.attention_spec("softmax"))
  return functools.partial(benchmark.training.timed_fit, model,
                           {"inputs": arrays["inputs"], "targets": arrays["targets"]}, config)


def _seeds_part(config) -> dict[str, Any]:
  fit, n = _fitter(config), config.num_seeds
  vm, vm_wall = fit(num_seeds=n, seed=config.seed)
  seq = [fit(num_seeds=1, seed=config.seed + i) for i in range(n)]
  seq_wall = sum(wall for _, wall in seq)
  seq_train = sum(r.seconds_per_step * config.num_steps for r, _ in seq)
  vm_train = vm.seconds_per_step * config.num_steps
  return {"num_seeds": n, "num_steps": config.num_steps,
          "vmap_wall_s": vm_wall, "vmap_train_s": vm_train, "vmap_compile_s": vm.compile_seconds,
          "sequential_wall_s": seq_wall, "sequential_train_s": seq_train,
          "sequential_compile_s": sum(r.compile_seconds for r, _ in seq),
          "ratio_wall": vm_wall / seq_wall, "ratio_train": vm_train / seq_train}


def _devices_part(config) -> dict[str, Any]:
  fit = _fitter(config)
  out: dict[str, Any] = {"devices": len(jax.devices())}
  for mode in MODES:
    r, _ = fit(num_seeds=1, seed=config.seed, parallel=mode)
    out[mode] = {"steps_per_s": 1.0 / r.seconds_per_step, "compile_s": r.compile_seconds,
                 "final_train_loss": float(r.final_metrics["train_loss"][0])}
  return out


def nnx_gpt_steps(config) -> dict[str, tuple[Any, tuple]]:
  """{"linen" | "nnx": (compiled attnx.train step, (state, batch, step))} of part 4, both from
  the linen model's initial parameters."""
  from attnx import nnx as anx  # noqa: PLC0415

  n = config.nnx
  kw = dict(vocab_size=n.vocab_size, num_layers=n.num_layers, num_heads=n.num_heads,
            hidden_dim=n.hidden_dim, mlp_dim=n.mlp_dim, max_len=n.context,
            attention=n.attention, positions="rotary")
  tokens = np.random.default_rng(config.seed).integers(
      0, n.vocab_size, (n.num_seeds, n.batch_size, n.context + 1))
  return benchmark.training.train_steps(
      {"linen": attnx_nn.GPT(**kw), "nnx": anx.to_linen(anx.GPT, **kw)}, tokens)


def _run_causal_lm(config, workdir: str) -> dict[str, Any]:
  rows, lm = [], config.lm
  for t in (int(x) for x in train.split_list(lm.seq_lens)):
    steps = {a: benchmark.training.lm_step(
        benchmark.training.causal_lm(a, width=lm.width, num_heads=lm.num_heads,
                                     num_layers=lm.num_layers, vocab_size=lm.vocab_size),
        batch_size=lm.batch_size, seq_len=t, vocab_size=lm.vocab_size,
        learning_rate=lm.learning_rate, seed=config.seed) for a in benchmark.training.ATTENTIONS}
    ms, losses = benchmark.training.time_steps(steps, lm.repeats, lambda out: float(out[2]))
    rows.append({"T": t, "flax step ms": ms["flax"], "attnx step ms": ms["attnx"],
                 "attnx / flax": ms["attnx"] / ms["flax"], "flax first loss": losses["flax"],
                 "attnx first loss": losses["attnx"]})
  result = {"rows": rows}
  benchmark.save(workdir, result)
  rep = train.Report("Causal LM training step: attnx vs flax attention", workdir, config,
                     claim="A causal training step with attnx.nn.MultiHeadAttention is "
                           "faster than with flax's stock attention, and more so at long T.")
  rep.table(rows, caption=(
      f"One training step (forward, backward, AdamW) of a {lm.num_layers}-layer pre-LN causal "
      f"LM, width {lm.width}, {lm.num_heads} heads, batch {lm.batch_size}, float32; median "
      f"of {lm.repeats} steps, the two models timed round-robin. The first losses agree "
      "(same initialization, same math)."))
  benchmark.targets.add_to_report(rep, benchmark.targets.check(TARGETS, rows), count=False)
  path = rep.write()
  print(json.dumps(result, indent=1))
  return {"report": path, **result}


def _run_nnx_gpt(config, workdir: str) -> dict[str, Any]:
  ms, losses = benchmark.training.time_steps(nnx_gpt_steps(config), config.nnx.repeats,
                                             lambda out: float(np.mean(out[1]["loss"])))
  row = {"linen step ms": ms["linen"], "nnx step ms": ms["nnx"],
         "nnx / linen": ms["nnx"] / ms["linen"], "linen first loss": losses["linen"],
         "nnx first loss": losses["nnx"]}
  benchmark.save(workdir, row)
  n = config.nnx
  rep = train.Report("GPT training step: attnx.nnx vs attnx.nn", workdir, config,
                     claim=f"attnx.train's step on the NNX GPT costs at most {NNX_TARGET}x "
                           "the linen GPT's.")
  rep.table([row], caption=(
      f"attnx.train's step (forward, backward, AdamW; {n.num_seeds} seeds vmapped) of a "
      f"{n.num_layers}-layer GPT, width {n.hidden_dim}, context {n.context}, batch "
      f"{n.batch_size}, {n.attention}, RoPE, float32; median of {n.repeats} steps, the two "
      "models timed round-robin from the same parameters (so the first losses agree)."))
  rep.text(verdict.rule("exact"))
  rep.verdict(verdict.within_tolerance(row["nnx / linen"], NNX_TARGET),
              f"NNX / linen = {row['nnx / linen']:.3f} (target ≤ {NNX_TARGET}).")
  path = rep.write()
  print(json.dumps(row, indent=1))
  return {"report": path, **row}


def devices_command(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """launch.py command of the device part: this run's config (every overridden value) on
  `config.devices` fake CPU devices."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return [sys.executable, os.path.join(root, "launch.py"),
          f"--config={os.path.abspath(__file__)}:{config.preset}", "--config.part=devices",
          f"--config.num_cpu_devices={config.devices}", f"--config.devices={config.devices}",
          *train_config.config_overrides(config, get_config(config.preset),
                                         exclude=_NOT_FORWARDED),
          f"--workdir={workdir}"]


def loss_spread(devices: dict[str, Any]) -> tuple[float, int]:
  """(max - min of the final train losses over all processes and modes, number of runs)."""
  losses = [d[mode]["final_train_loss"] for d in devices.values() for mode in MODES]
  return max(losses) - min(losses), len(losses)


def _run_all(config, workdir: str) -> dict[str, Any]:
  """Parts 1 and 2: seeds here, then devices here (1) and in a process with fake devices."""
  result = {"seeds": _seeds_part(config)}
  one = _devices_part(config)  # this process: 1 device
  sub_dir = os.path.join(workdir, "devices")
  subprocess.run(devices_command(config, sub_dir), check=True,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(sub_dir, "benchmark.json")) as f:
    many = json.load(f)["devices"]
  result["devices"] = {"1_device": one, f"{many['devices']}_devices": many}
  result["final_train_loss_spread"] = loss_spread(result["devices"])[0]
  benchmark.save(workdir, result)
  s = result["seeds"]
  rep = train.Report("attnx.train benchmark: seeds via vmap, data parallelism", workdir, config,
                     claim=f"Training {s['num_seeds']} seeds in one vmapped program takes at most "
                           f"half the time of {s['num_seeds']} sequential runs.")
  rep.section("Seeds: vmap vs sequential")
  rep.table([{"mode": label, "wall s": s[f"{key}_wall_s"], "train s": s[f"{key}_train_s"],
              "compile s": s[f"{key}_compile_s"]}
             for label, key in ((f"vmap ({s['num_seeds']} seeds, 1 program)", "vmap"),
                                (f"{s['num_seeds']} sequential runs", "sequential"))] + [
      {"mode": "ratio vmap / sequential", "wall s": s["ratio_wall"], "train s": s["ratio_train"],
       "compile s": s["vmap_compile_s"] / s["sequential_compile_s"]}],
      caption=f"{s['num_steps']} steps, batch {config.batch_size}; wall includes init, "
              "compilation and data")
  rep.text(verdict.rule("exact"))
  rep.verdict(verdict.within_tolerance(s["ratio_wall"], 0.5),
              f"vmap/sequential wall-time ratio {s['ratio_wall']:.2f} (training only "
              f"{s['ratio_train']:.2f}).")
  rep.section("Data parallelism (fake CPU devices share the same cores)")
  rep.table([{"process": label, "parallel": mode, "steps/s": d[mode]["steps_per_s"],
              "compile s": d[mode]["compile_s"], "final train loss": d[mode]["final_train_loss"]}
             for label, d in result["devices"].items() for mode in MODES])
  spread, n = loss_spread(result["devices"])
  rep.verdict(verdict.within_tolerance(spread, 1e-4),
              f"The final train losses of the {n} runs (processes x parallel modes) differ by at "
              f"most {spread:.1e}" + (": data parallelism computes the same update."
                                      if verdict.within_tolerance(spread, 1e-4)
                                      else ", more than 1e-4."))
  path = rep.write()
  print(json.dumps(result, indent=1))
  return {"report": path}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Run the requested parts; part "all" re-launches itself with fake devices for part 2."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  if config.part in ("seeds", "devices"):
    part = _seeds_part if config.part == "seeds" else _devices_part
    return {"report": benchmark.save(workdir, {config.part: part(config)})}
  return {"all": _run_all, "causal_lm": _run_causal_lm, "nnx_gpt": _run_nnx_gpt}[config.part](
      config, workdir)
