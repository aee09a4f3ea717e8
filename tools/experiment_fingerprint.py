"""What the experiments' tiny presets compute, to show that a refactor changes none of it.

  python tools/experiment_fingerprint.py run --out=DIR [--only=a,b]  # writes DIR/fingerprint.json
  python tools/experiment_fingerprint.py read --out=DIR --root=CHECKOUT  # again, from DIR's runs
  python tools/experiment_fingerprint.py compare BEFORE.json AFTER.json  # 1 on a difference

``run`` launches every experiment's ``tiny`` preset (``launch.py
--config=experiments/NAME.py:tiny``, one process each, as a user would) into ``DIR/NAME`` and reads
back what a user reads: the final metrics (``final_metrics.json``), every other JSON the run wrote,
the metric log (``metrics.jsonl``) and the report's tables and verdicts (``results.json``). Timings
are not part of a fingerprint: cells and keys that measure time or speed (and, for the benchmarks,
every number derived from a timing: ratios, rates, targets, their verdict) are replaced by
``"<timed>"``, so a benchmark's fingerprint is its cases, columns and measured errors.

``compare`` prints every path that differs (``experiment / file / key ...``) and exits 1 if any;
experiments missing from AFTER (a run with ``--only``) are named and not compared.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Experiments whose numbers are timings (their errors and cases are still compared).
BENCHMARKS = ("kernel_benchmark", "pallas_benchmark", "train_benchmark", "kernel_compile")
_TIMED = re.compile(r"(^|[^a-z])(ms|s|sec|seconds|time|times|wall|gflop|tflop|rate|speed|"
                    r"compile|created|command|elapsed|throughput|steps?/s|tokens?/s|per_s|"
                    r"per_second|ratio|×|x |fraction|target|met|missed|speedup|mfu|"
                    r"utili[sz]ation)([^a-z]|$)",
                    re.IGNORECASE)
_WORKDIR = re.compile(r"/[^\s\"']*fingerprint[^\s\"']*")
# A duration inside a cell ("dense, 7.37 s", "12 ms"): a timing whatever its column.
_DURATION = re.compile(r"(?<![\w.])\d+(\.\d+)?(e[-+]?\d+)? ?(s|ms|min)(?!\w)")


def _timed(key: str, benchmark: bool) -> bool:
  if key in ("created", "command"):
    return True
  if benchmark and (" / " in key or re.search(r"gflops|tflops|matmul", key, re.IGNORECASE)):
    return True  # a ratio of two timings, a rate, a fraction of the matmul rate
  return bool(_TIMED.search(key)) if benchmark else bool(
      re.search(r"(^|[^a-z])(ms|seconds|compile s|compile_s|created|command|wall|elapsed|"
                r"time|steps?/s|tokens?/s|per_s|per_second)([^a-z]|$)", key, re.IGNORECASE))


def _scrub(x: Any, benchmark: bool, key: str = "", root: str = _ROOT) -> Any:
  if key and _timed(key, benchmark):
    return "<timed>"
  if isinstance(x, dict):
    return {k: _scrub(v, benchmark, str(k), root) for k, v in sorted(x.items())}
  if isinstance(x, list):
    return [_scrub(v, benchmark, root=root) for v in x]
  if isinstance(x, str):
    return _DURATION.sub("<timed>", _WORKDIR.sub("<workdir>", x.replace(root, "<repo>")))
  return x


def _results(path: str, benchmark: bool, root: str) -> dict:
  with open(path) as f:
    r = json.load(f)
  tables = []
  for t in r.get("tables", []):
    cols = t.get("columns", [])
    rows = [{c: ("<timed>" if _timed(c, benchmark) else _scrub(v, benchmark, root=root))
             for c, v in row.items()} for row in t.get("rows", [])]
    tables.append({"caption": _scrub(t.get("caption", ""), benchmark, root=root),
                   "columns": cols, "rows": rows})
  verdicts = [("<timed>" if benchmark else _scrub(v, benchmark, root=root))
              for v in r.get("verdicts", [])]
  return {"title": r.get("title"), "claim": r.get("claim"), "tables": tables,
          "verdicts": verdicts, "data_files": sorted(r.get("data_files", []))}


def fingerprint(workdir: str, name: str, root: str = _ROOT) -> dict:
  """The comparable content of one experiment's run directory (``root``: the checkout that
  ran it, written ``<repo>`` so that two checkouts compare)."""
  bench = name in BENCHMARKS
  out: dict[str, Any] = {}
  for path in sorted(glob.glob(os.path.join(workdir, "**", "*.json*"), recursive=True)):
    rel = os.path.relpath(path, workdir)
    if "checkpoint" in rel or rel.startswith("tb" + os.sep) or "_METADATA" in rel:
      continue
    if rel == "results.json":
      out[rel] = _results(path, bench, root)
    elif rel.endswith(".jsonl"):
      with open(path) as f:
        out[rel] = [_scrub(json.loads(line), bench, root=root) for line in f if line.strip()]
    elif rel.endswith(".json"):
      with open(path) as f:
        out[rel] = _scrub(json.load(f), bench, root=root)
  return out


def _experiments() -> list[str]:
  names = []
  for path in sorted(glob.glob(os.path.join(_ROOT, "experiments", "*.py"))):
    name = os.path.basename(path)[:-3]
    if not name.startswith("_"):
      names.append(name)
  return names


def run(out: str, only: list[str] | None) -> int:
  os.makedirs(out, exist_ok=True)
  names = only or _experiments()
  prints: dict[str, Any] = {}
  failed = []
  for i, name in enumerate(names, 1):
    workdir = os.path.join(os.path.abspath(out), name)
    cmd = [sys.executable, os.path.join(_ROOT, "launch.py"),
           f"--config={os.path.join(_ROOT, 'experiments', name)}.py:tiny",
           f"--workdir={workdir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True)
    print(f"[{i}/{len(names)}] {name}: exit {proc.returncode} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    if proc.returncode:
      failed.append(name)
      print(proc.stderr[-3000:], file=sys.stderr)
    prints[name] = {"exit": proc.returncode, **fingerprint(workdir, name)}
  with open(os.path.join(out, "fingerprint.json"), "w") as f:
    json.dump(prints, f, indent=1, sort_keys=True, default=str)
  print(f"wrote {os.path.join(out, 'fingerprint.json')}")
  return 1 if failed else 0


def read(out: str, root: str) -> int:
  """Writes ``out/fingerprint.json`` anew from the run directories under ``out`` (e.g. after a
  change of what a fingerprint holds; ``root``: the checkout that ran them)."""
  prints = {}
  for name in _experiments():
    workdir = os.path.join(out, name)
    if os.path.isdir(workdir):
      prints[name] = {"exit": 0 if os.path.exists(os.path.join(workdir, "results.json")) else 1,
                      **fingerprint(workdir, name, root)}
  with open(os.path.join(out, "fingerprint.json"), "w") as f:
    json.dump(prints, f, indent=1, sort_keys=True, default=str)
  print(f"wrote {os.path.join(out, 'fingerprint.json')} ({len(prints)} experiments)")
  return 0


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      if k not in a or k not in b:
        out.append(f"{path}/{k}: only in {'after' if k in b else 'before'}")
      else:
        _diff(a[k], b[k], f"{path}/{k}", out)
  elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
      _diff(x, y, f"{path}[{i}]", out)
  elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
    out.append(f"{path}: {str(a)[:200]!r} != {str(b)[:200]!r}")


def compare(before: str, after: str) -> int:
  with open(before) as f:
    a = json.load(f)
  with open(after) as f:
    b = json.load(f)
  missing = sorted(set(a) - set(b))
  if missing:  # a partial run (--only) compares the experiments it ran
    print(f"not in {after} (not compared): {', '.join(missing)}")
    a = {k: v for k, v in a.items() if k in b}
  out: list[str] = []
  _diff(a, b, "", out)
  for line in out:
    print(line)
  print(f"{len(out)} difference(s) over {len(set(a) | set(b))} experiments")
  return 1 if out else 0


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--out", required=True)
  r.add_argument("--only", default="", help="comma-separated experiment names")
  rd = sub.add_parser("read", help="fingerprint the run directories under --out again")
  rd.add_argument("--out", required=True)
  rd.add_argument("--root", default=_ROOT, help="the checkout that ran them")
  c = sub.add_parser("compare")
  c.add_argument("before")
  c.add_argument("after")
  args = p.parse_args(argv)
  if args.cmd == "run":
    return run(args.out, [n for n in args.only.split(",") if n] or None)
  if args.cmd == "read":
    return read(args.out, args.root)
  return compare(args.before, args.after)


if __name__ == "__main__":
  sys.exit(main())
