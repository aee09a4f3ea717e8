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

Measured on a shared 2-core machine (jax 0.10.2, 2 min 15 s in all): 8 seeds via vmap 18.9 s
wall vs 60.2 s for 8 sequential runs (ratio 0.31; compilation 2.7 s vs 25.9 s; pure training
time ratio 0.95, as the FLOPs are the same on CPU). Steps/s with 1 seed, batch 64: 95 (1 device),
44 (shard_map over 8 fake devices), 46 (pmap over 8); the final losses agree to 3e-6.
"""

from __future__ import annotations

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

PARTS = ("all", "seeds", "devices")
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
  return c


def _tiny(c: ml_collections.ConfigDict) -> None:
  """python launch.py --config=experiments/train_benchmark.py:tiny (≈ 1 min, smoke test):
  2 seeds, 20 steps, 2 fake devices, a 1-layer model."""
  c.update(dict(num_seeds=2, num_steps=20, devices=2))
  c.model.update(hidden_dim=16, num_layers=1, num_heads=2, mlp_dim=32)


# Each preset is the default changed by one small function (see the module docstring).
PRESET_FNS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "default": lambda c: None, "tiny": _tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Benchmark config (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "train_benchmark")


def validate_config(config: ml_collections.ConfigDict) -> None:
  if config.part not in PARTS:
    raise ValueError(f"config.part={config.part!r} is invalid; valid choices: {', '.join(PARTS)}")
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


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Run the requested parts; part "all" re-launches itself with fake devices for part 2."""
  from attnx import train

  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
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
