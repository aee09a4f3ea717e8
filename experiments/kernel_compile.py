"""Every Pallas kernel attnx ships, compiled to real device binaries for chips that are not here.

For each target chip (H100, A100, TPU v5e, v6e), weighting F (every pointwise F, the distance
kernels on ``neg_sq_dist``, and every whole-row weighting with a streaming family), dtype, head
size and input variant, the forward+backward program of ``core.attention(...,
implementation="pallas")`` (the public path, chosen per lowering platform) is compiled for the
chip by :func:`attnx.aot.compile_for`: XLA + Triton + ptxas for a GPU, XLA + Mosaic for a
TPU. Per kernel (forward, dQ, dK/dV) the report gives what the chip's compiler decided:
registers, spill bytes, shared memory or scoped VMEM against the chip's limit, grid, warps, and
the compile time.

Variants: ``causal_gqa`` (T = S = 2048, N = 8 query heads on K = 2 kv heads, causal),
``mask_bias`` (the same shape, not causal, a key-padding mask and a per-head float32 bias),
``ragged`` (T = 1000 queries on S = 3000 keys, no power of two, not causal), ``documents``
(the causal GQA shape on packed documents with a 512-key sliding window: a structured mask of
segment ids, a traced argument, that the kernels read per tile and whose empty tiles they
skip), ``modded`` (the causal GQA shape with Gemma 2's soft cap c = 30, ALiBi with learned
slopes and learned attention sinks (where F has a sum for a sink to enter: not stick-breaking,
not the "length"/"none" normalizations), the slopes and sinks differentiated; not in the default
matrix), ``relative`` (the causal GQA shape with the cap and a learned relative-position table
covering every distance, [N, 2·T − 1] (``core.relative_table``), differentiated; not in the
default matrix).

A program passes when its :func:`claim` holds (attnx.train.verdict, kind *claim*):
it compiles, no kernel spills registers (GPU; except tiles chosen by time on a GPU,
``tiles.GpuTier.timed``), none exceeds the chip's shared memory / VMEM. Presets: ``sample``
(CI: every F at H = 128, bf16, causal GQA on h100 and v5e), ``default`` (the full matrix),
``tiny`` (2 F on h100, for a quick look).

Needs the compile-only toolchain (``pip install -e ".[aot]"``: JAX's CUDA plugin at jaxlib's
version, ptxas, libtpu); without it the report says what to install and the run exits 0 with
nothing measured.

Command:
  python launch.py --config=experiments/kernel_compile.py:sample --workdir=runs/kernel_compile
  python launch.py --config=experiments/kernel_compile.py --workdir=runs/kernel_compile_full
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # `python experiments/kernel_compile.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402

from attnx import aot, core, train  # noqa: E402
from attnx.core import problem  # noqa: E402
from attnx.core import weightings as wlib  # noqa: E402
from attnx.core.kernels.common import round_up  # noqa: E402
from attnx.core.kernels.pallas import tiles as pallas_tiles  # noqa: E402
from attnx.train import config as train_config  # noqa: E402
from attnx.train import verdict  # noqa: E402
from attnx.train.benchmark.cases import case_weighting  # noqa: E402  (distance kernels: −d²)

VARIANTS = ("causal_gqa", "mask_bias", "ragged", "documents", "modded", "relative")
# The default matrix: the variants every kernel runs.
DEFAULT_VARIANTS = ("causal_gqa", "mask_bias", "ragged", "documents")
ROW_WEIGHTINGS = ("ssmax", "softpick", "stick_breaking", "sparsemax", "entmax15",
                  "entmax:alpha=1.3")
COLUMNS = ["target", "weighting", "dtype", "H", "variant", "kernel", "grid", "warps", "regs",
           "spill st/ld B", "smem KiB", "VMEM KiB (limit)", "compile s", "status"]


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment = "kernel_compile"
  c.targets = "h100,a100,v5e,v6e"
  c.weightings = ""  # empty = every pointwise weighting and every streaming whole-row one
  c.dtypes = "bfloat16,float32"
  c.head_dims = "64,128,256"
  c.variants = ",".join(DEFAULT_VARIANTS)
  c.batch = 1
  c.length = 2048  # T = S of causal_gqa and mask_bias
  c.num_heads = 8
  c.num_kv_heads = 2
  return c


def _sample(c: ml_collections.ConfigDict) -> None:
  c.update(dict(targets="h100,v5e", dtypes="bfloat16", head_dims="128", variants="causal_gqa"))


def _tiny(c: ml_collections.ConfigDict) -> None:
  _sample(c)
  c.update(dict(targets="h100", weightings="softmax,sparsemax"))


PRESET_FNS = {"default": lambda c: None, "sample": _sample, "tiny": _tiny}
PRESETS = tuple(PRESET_FNS)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS` (None = "default")."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "kernel_compile")


def weightings(config) -> list[str]:
  """The F of a run: ``config.weightings`` or every pointwise F plus the whole-row ones."""
  return train.split_list(config.weightings) or [*wlib.list_weightings("pointwise"),
                                                 *ROW_WEIGHTINGS]


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for an unknown target, variant, dtype or weighting."""
  for key, valid in (("targets", tuple(aot.TARGETS)), ("variants", VARIANTS),
                     ("dtypes", ("bfloat16", "float16", "float32"))):
    train.check_choices(config, key, train.split_list(config[key]) or ["(none)"], valid)
  for name in weightings(config):
    if not core.api.streams(wlib.get_weighting(name)):
      raise ValueError(f"config.weightings: {name!r} has no Pallas kernel (no streaming form)")
  for h in train.split_list(config.head_dims):
    if not h.isdigit() or int(h) < 1:
      raise ValueError(f"config.head_dims: bad head size {h!r}")


def program(weighting: str, dtype: str, head_dim: int, variant: str, config):
  """(fn, args): the fwd+bwd program of one case (grad of Σ out² w.r.t. q, k, v and the
  variant's learned arguments) and its abstract arguments."""
  b, n, kh, length = (int(config.batch), int(config.num_heads), int(config.num_kv_heads),
                      int(config.length))
  t, s = (1000, 3000) if variant == "ragged" else (length, length)
  name, score = case_weighting(weighting, head_dim)
  sds, f32, dt = jax.ShapeDtypeStruct, jnp.float32, jnp.dtype(dtype)
  sinks = problem.sinks_reason(wlib.get_weighting(name)) is None  # F whose sum a sink enters
  learned = {"mask_bias": [sds((1, n, t, s), f32)],  # a per-head bias
             "modded": [sds((n,), f32)] * (1 + sinks),  # ALiBi slopes (and sinks)
             "relative": [sds((n, 2 * max(t, s) - 1), f32)]}  # a table of every distance
  args = [sds((b, t, n, head_dim), dt), *[sds((b, s, kh, head_dim), dt)] * 2,
          *learned.get(variant, [])]
  differentiated = tuple(range(len(args)))
  if variant == "documents":
    args.append(sds((b, t), jnp.int32))  # segment ids, not differentiated
  padding = jnp.arange(s)[None, None, None, :] < s - 17  # mask_bias's key padding (a constant)
  keywords = {  # attention keywords from the variant's extra arguments
      "mask_bias": lambda r: dict(bias=r[0], mask=padding),
      "documents": lambda r: dict(mask=core.masks.segment_ids(r[0])
                                  & core.masks.sliding_window(512, 0)),
      "modded": lambda r: dict(logits_soft_cap=30.0, score_mod=core.alibi(r[0]),
                               sinks=r[1] if len(r) > 1 else None),
      "relative": lambda r: dict(logits_soft_cap=30.0, score_mod=core.relative_table(r[0]))}
  attend = functools.partial(
      core.attention, weighting=name, score=score,
      is_causal=variant in ("causal_gqa", "documents", "modded", "relative"),
      scale=1.0 if score == "neg_sq_dist" else 1.0 / math.sqrt(head_dim),
      implementation="pallas")

  def loss(q, k, v, *rest):
    out = attend(q, k, v, **keywords.get(variant, lambda r: {})(rest))
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  return jax.grad(loss, argnums=differentiated), args


def timed_kernels(weighting: str, dtype: str, head_dim: int) -> frozenset[str]:
  """The GPU kernels of a case whose tiles were chosen by time on a GPU (their spills are a
  measured trade: :func:`attnx.core.kernels.pallas.tiles.timed_kernels`)."""
  name, score = case_weighting(weighting, head_dim)
  w = wlib.get_weighting(name)
  family = None if isinstance(w, wlib.Pointwise) else w.stream.family
  if score == "neg_sq_dist":  # the dot form: H + 2 columns in float32
    dtype, head_dim = "float32", head_dim + 2
  return pallas_tiles.timed_kernels(round_up(head_dim, pallas_tiles.GPU_MIN_BLOCK), family,
                                    dtype)


def kernel_role(kernel_name: str) -> str:
  """"fwd", "dq" or "dkv" (dK and dV run as two passes count as "dkv") of a Pallas kernel."""
  role = kernel_name.removeprefix("attnx_pallas_").removeprefix("rows_")
  return "dkv" if role in ("dk", "dv") else role


def claim(report: aot.CompileReport, timed: frozenset[str] = frozenset()) -> verdict.Claim:
  """What a compiled program must meet (kind *claim*, attnx.train.verdict): every limit of its
  chip (``CompileReport.limit_checks``: it compiles, no spills, shared memory / VMEM within the
  chip's, registers measured), a spill in a kernel of ``timed`` (GPU tiles chosen by time:
  :func:`timed_kernels`) being a measured trade, not a failure (the rows still show it)."""
  allowed = {k.name for k in report.pallas_kernels if kernel_role(k.name) in timed}
  return verdict.claim(verdict.check(what, met) for what, met in
                       report.limit_checks(spills_allowed=allowed))


def status_cell(report: aot.CompileReport, timed: frozenset[str] = frozenset()) -> str:
  """A program's status: "pass" when its :func:`claim` holds, else "FAIL " and the refuted
  parts; "n/a: ..." for a documented limit of ``implementation="pallas"`` ("cannot run
  this"), a program that is not compiled."""
  first = (report.error or "").splitlines()[0] if report.error else ""
  if report.category == "trace_error" and "cannot run this" in first:
    return "n/a: " + first.split("cannot run this: ", 1)[1][:160]
  c = claim(report, timed)
  return "pass" if c.held else "FAIL " + "; ".join(c.refuted())


def compile_case(case: dict[str, Any], config) -> tuple[aot.CompileReport, list[dict]]:
  """Compiles one case; its report and one row per Pallas kernel."""
  fn, args = program(case["weighting"], case["dtype"], case["H"], case["variant"], config)
  report = aot.compile_for(fn, *args, target=case["target"])
  target = aot.TARGETS[case["target"]]
  timed = (timed_kernels(case["weighting"], case["dtype"], case["H"])
           if target.platform == "cuda" else frozenset())
  status = status_cell(report, timed)
  base = {key: case[key] for key in ("target", "weighting", "dtype", "H", "variant")}
  rows = []
  for k in report.pallas_kernels or [None]:
    row = dict(base, status=status, **{"compile s": report.compile_seconds})
    if k is not None:
      row.update({
          "kernel": k.name.removeprefix("attnx_pallas_"), "grid": k.grid,
          "warps": k.num_warps, "regs": k.registers,
          "spill st/ld B": (None if k.spill_store_bytes is None
                            else f"{k.spill_store_bytes}/{k.spill_load_bytes}"),
          "smem KiB": None if k.smem_bytes is None else k.smem_bytes / 1024,
          "VMEM KiB (limit)": (None if k.vmem_bytes is None else
                               f"{k.vmem_bytes / 1024:.0f} ({(k.vmem_limit_bytes or 0) // 1024})"),
      })
    rows.append(row)
  return report, rows


def cases(config) -> list[dict[str, Any]]:
  return [dict(target=tg, weighting=w, dtype=dt, H=int(h), variant=var)
          for tg in train.split_list(config.targets)
          for var in train.split_list(config.variants)
          for dt in train.split_list(config.dtypes)
          for h in train.split_list(config.head_dims)
          for w in weightings(config)]


def _fmt(v: Any) -> str:
  """A compile table cell: 1–2 decimals, a grid as 8×2×1, nothing for an unmeasured value."""
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
  if isinstance(v, tuple):
    return "×".join(map(str, v))
  return str(v)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per target: programs compiled and passed, the most registers, largest spill, smem/VMEM."""
  out = []
  for target in dict.fromkeys(r["target"] for r in rows):
    mine = [r for r in rows if r["target"] == target]
    programs = {(r["weighting"], r["dtype"], r["H"], r["variant"]): r["status"] for r in mine}
    regs = [r["regs"] for r in mine if r.get("regs") is not None]
    out.append({
        "target": target, "programs": len(programs),
        "passed": sum(s == "pass" for s in programs.values()),
        "n/a": sum(s.startswith("n/a") for s in programs.values()),
        "max regs": max(regs) if regs else None,
        "max smem KiB": max((r["smem KiB"] for r in mine if r.get("smem KiB")), default=None),
        "compile s (mean)": sum(r["compile s"] for r in mine) / max(len(mine), 1),
    })
  return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Compiles every case for its target; writes compile.md, compile.json and the report."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  title = "Pallas kernels compiled for real chips"
  claim = ("Every Pallas kernel attnx ships compiles for H100, A100, TPU v5e and v6e at its "
           "default tiles with 0 spill bytes (except GPU tiles chosen by time on a GPU, whose "
           "spills were measured to cost less than smaller tiles) and shared memory / VMEM "
           "within the chip's limit.")
  rep = train.Report(title, workdir, config=config, claim=claim)
  targets = train.split_list(config.targets)
  missing = {t: why for t in targets if (why := aot.available(t))}
  if missing:
    rep.text("Nothing compiled: " + "; ".join(f"{t}: {w}" for t, w in missing.items())
             + ". Install the toolchain: `pip install -e \".[aot]\"`.")
    rep.verdict(None, "inconclusive: the compile-only toolchain is not installed.")
    print(f"kernel_compile: not run: {missing}", flush=True)
    return {"report": rep.write(), "rows": [], "skipped": missing}

  todo = cases(config)
  rows, t0 = [], time.time()
  for i, case in enumerate(todo):
    report, case_rows = compile_case(case, config)
    rows += case_rows
    print(f"[{i + 1}/{len(todo)}] {case['target']} {case['weighting']} {case['dtype']} "
          f"H={case['H']} {case['variant']}: {case_rows[0]['status']} "
          f"({report.compile_seconds:.1f} s)", flush=True)
  elapsed = time.time() - t0
  table = train.markdown_table(rows, COLUMNS, fmt=_fmt)
  with open(os.path.join(workdir, "compile.md"), "w") as f:
    # A title: the table can be copied into docs/kernel_compile/ as a page of the site as is.
    f.write(f"# Compile report: {', '.join(train.split_list(config.targets))}\n\n{table}")
  versions = aot.toolchain_versions()
  rep.save_json("compile.json", {"rows": rows, "columns": COLUMNS, "elapsed_s": elapsed,
                                 "versions": versions, "config": config})
  per_target = summary(rows)
  failed = sorted({(r["target"], r["weighting"], r["dtype"], r["H"], r["variant"], r["status"])
                   for r in rows if r["status"].startswith("FAIL")})
  rep.text(f"{len(todo)} programs (fwd+bwd) compiled in {elapsed:.0f} s with "
           + ", ".join(f"{d} {v}" for d, v in versions.items() if v) + ".")
  rep.section("Summary")
  rep.table(per_target)
  programs = {(r["target"], r["weighting"], r["dtype"], r["H"], r["variant"]): r["status"]
              for r in rows if not r["status"].startswith("n/a")}  # n/a: a documented limit
  every = verdict.claim(verdict.check(" ".join(map(str, p)), s == "pass")
                        for p, s in programs.items())
  rep.text(every.rule())
  rep.verdict(every.held, "every program passes (compiles, 0 spill bytes outside the timed "
              "GPU tiles, within the chip's memory limits)." if not failed else
              f"{len(failed)} of {len(todo)} programs fail: "
              + "; ".join(" ".join(map(str, f)) for f in failed[:12])
              + (" ..." if len(failed) > 12 else ""))
  rep.section("Kernels")
  rep.text(table)
  return {"report": rep.write(), "rows": rows, "failed": failed, "summary": per_target}


if __name__ == "__main__":
  from experiments import _common  # noqa: PLC0415

  _common.run_standalone("kernel_compile", get_config, run, PRESETS)
