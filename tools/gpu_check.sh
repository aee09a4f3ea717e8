#!/usr/bin/env bash
# The GPU check: what compiling cannot tell, measured on a real GPU, in one command.
#
#   tools/gpu_check.sh [OUT]        (OUT: where results go; default runs/gpu_check)
#
# Runs, from the repository root, in two phases:
#   1. the GPU alone: tools/gpu_autotune.py (the kernels' tiles timed on this chip for the
#      benchmark's shape, every F, causal and not, into OUT/pallas_tiles.json, which every later
#      step reads; AUTOTUNE=0 skips it), then the Pallas benchmark's quick preset at one shape (TFLOP/s per F vs cuDNN
#      softmax and JAX's Pallas flash; target: every pointwise F >= 60 % of cuDNN softmax at
#      T >= 4k; and softmax / stick-breaking under a causal window and packed documents, per
#      attended pair vs plain causal; and those masked rows again at T = 16 384, the Masks
#      guide's 1.3x rule; the decoding benchmark's gpu preset: split-KV on the Pallas kernels
#      and its share of HBM bandwidth, target >= 60 % for softmax at a 32k cache in bf16;
#      BENCHMARK=0 skips them), then tools/gpu_tile_sweep.py (the forward, dQ and dK/dV
#      tiles timed candidate by candidate, the autotuner's grid with a full report; SWEEP=1 runs
#      it, SWEEP_BUDGET seconds, default 150);
#   2. then: the Pallas tests with compiled kernels, no interpreter
#      (tests/core/test_pallas_device.py: every streaming weighting vs a float64 brute force;
#      tests/core/test_platforms.py), in DEVICE_TEST_WORKERS pytest-xdist workers (default 6),
#      and after them a short training run with implementation="pallas" (compare_weightings:quick, digits).
# Beside both, on the other cores (pinned, niced): the CPU test suite (JAX_PLATFORMS=cpu) under
# the machine's own JAX and, if .whl-newest/ holds it, under the newest JAX release (the top of
# the supported range, which CI tests on the CPU too) (CPU_SUITE=0 skips them;
# CPU_SUITE_WORKERS each, default 5; CPU_SUITE_TIMEOUT seconds, default 420).
# Every other step is bounded by `timeout` (STEP_TIMEOUT seconds, default 240) so that one hung
# step cannot eat a lent machine's time. Writes OUT/gpu_check.md (date, chip, driver, JAX
# version, each step's outcome and time, the benchmark's target table, the tile sweep) plus each
# step's log and report, for the docs (docs/guides/pallas.md) to quote.
#
# The GPU machine has JAX with CUDA, flax, optax, chex and orbax but not attnx's other
# dependencies, and no network: run tools/fetch_gpu_wheels.sh beforehand on a machine that
# has one; this script installs .whl/*.whl (if present) into a private directory with
# --no-index --no-deps and puts it and the checkout on PYTHONPATH. Nothing is installed into
# the machine's Python.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
  site="${TMPDIR:-/tmp}/attnx-gpu-check-site"
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$site" \
    .whl/*.whl || { echo "gpu_check: installing .whl/*.whl failed" >&2; exit 2; }
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# The newest JAX release, for the CPU suite only (the machine's CUDA plugin is its own JAX's):
# .whl-newest/ holds jax and a jaxlib whose libjax_common.so is stripped, as .tar.xz archives
# (the wheels are over what a lent machine's call carries).
newest_site=""
if compgen -G ".whl-newest/*.tar.xz" > /dev/null; then
  newest_site="${TMPDIR:-/tmp}/attnx-gpu-check-newest"
  for a in .whl-newest/*.tar.xz; do
    "$py" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
      "$a" "$newest_site" || { echo "gpu_check: unpacking $a failed" >&2; exit 2; }
  done
fi

if ! "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "gpu_check: JAX sees no GPU here ($("$py" -c 'import jax; print(jax.devices())' 2>&1 |
    tail -1)); nothing measured." >&2
  exit 3
fi
missing=$("$py" - <<'EOF'
import importlib.util
names = ["ml_collections", "tensorflow_datasets", "grain", "array_record", "tensorboardX",
         "flax", "optax", "chex", "orbax.checkpoint", "matplotlib", "sklearn", "pytest"]
print(" ".join(n for n in names if importlib.util.find_spec(n.split(".")[0]) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages: $missing (run tools/fetch_gpu_wheels.sh on a" \
       "machine with network, copy .whl/ here)" >&2
  exit 2
fi

summary="$out/gpu_check.md"
{
  echo "# attnx GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- chip: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    2>/dev/null | head -1)"
  echo "- $("$py" -c 'import jax, jaxlib; print(f"jax {jax.__version__}, jaxlib '\
'{jaxlib.__version__}, devices {jax.devices()}")')"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
} > "$summary"

status=0
step() {  # step NAME COMMAND...: runs it, logs to OUT/NAME.log, records the outcome
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  if [ "$(type -t "$1")" = function ]; then  # a function bounds its own commands
    "$@" > "$out/$name.log" 2>&1
  else
    timeout "${STEP_TIMEOUT:-240}" "$@" > "$out/$name.log" 2>&1
  fi
  local rc=$?
  local result="passed"
  [ $rc -ne 0 ] && { result="FAILED (exit $rc)"; status=1; }
  echo "| $name | $result: $(tail -1 "$out/$name.log" | cut -c1-160) | $((SECONDS - t0)) |" \
    >> "$summary"
  echo "   $result ($((SECONDS - t0)) s); log: $out/$name.log"
  return $rc
}

# The CPU suite under one JAX: pytest-xdist workers, verbose, so that a run stopped by its timeout
# still names every test it passed or failed (`cpu_suite LABEL PYTHONPATH WORKERS`). The aot tests
# need the aot extra's toolchain at jaxlib 0.10.2 (pyproject.toml) and are left out.
cpu_suite() {
  local label=$1 path=$2 n=$3 log="$out/pytest_$1.log" rc
  JAX_PLATFORMS=cpu PYTHONPATH="$path" timeout "${CPU_SUITE_TIMEOUT:-420}" $pin_cpu \
    "$py" -c "import jax, sys; print('jax', jax.__version__, file=sys.stderr)" > "$log" 2>&1
  JAX_PLATFORMS=cpu PYTHONPATH="$path" timeout "${CPU_SUITE_TIMEOUT:-420}" $pin_cpu \
    "$py" -m pytest -v -p no:cacheprovider -p no:benchmark -n "$n" \
    --ignore=tests/core/test_aot.py --ignore=tests/experiments/test_kernel_compile.py tests \
    >> "$log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' |
    sort -u
  echo "$label: $(grep -c '\] PASSED ' "$log") passed, $(grep -c '\] FAILED ' "$log") failed," \
    "$(grep -c '\] SKIPPED ' "$log") skipped, $(grep -c '\] ERROR ' "$log") errors" \
    "$([ $rc -eq 124 ] && echo "(stopped by its ${CPU_SUITE_TIMEOUT:-420} s timeout)")"
  return $rc
}

# Phase 1, the GPU alone: the tuner, the benchmarks, then the tile sweep if asked (AUTOTUNE=0 /
# BENCHMARK=0 skip, SWEEP=1 runs).
# One shape and the F of the table in docs/guides/pallas.md ("Measured on an NVIDIA H100"), so
# the figures compare with the tiles timed before. The CPU suites run meanwhile on the other
# cores (pinned there, niced): they use no GPU, and a kernel's time is the GPU's.
pin_cpu=""
pin_gpu=""
cores=$(nproc)
if command -v taskset > /dev/null && [ "$cores" -ge 8 ]; then
  pin_gpu="taskset -c 0-5"
  pin_cpu="nice -n 10 taskset -c 6-$((cores - 1))"
fi
pids=()
if [ "${CPU_SUITE:-1}" != 0 ]; then
  workers=${CPU_SUITE_WORKERS:-5}
  step cpu_suite cpu_suite machine "$PYTHONPATH" "$workers" &
  pids+=($!)
  if [ -n "$newest_site" ]; then
    step cpu_suite_newest cpu_suite newest "$newest_site:$PYTHONPATH" "$workers" &
    pids+=($!)
  fi
fi
# The tiles tuned on this chip first (AUTOTUNE=0 skips it; AUTOTUNE_BUDGET seconds per F and
# causality, default 12): the benchmarks below read the cache it writes.
export ATTNX_TILE_CACHE="${ATTNX_TILE_CACHE:-$PWD/$out/pallas_tiles.json}"
if [ "${AUTOTUNE:-1}" != 0 ]; then
  STEP_TIMEOUT=${AUTOTUNE_TIMEOUT:-300} step autotune $pin_gpu "$py" tools/gpu_autotune.py \
    --shape=4x4096x16x128 --budget="${AUTOTUNE_BUDGET:-12}" --out="$out/autotune"
fi
if [ "${BENCHMARK:-1}" != 0 ]; then
  step pallas_benchmark $pin_gpu "$py" launch.py --config=experiments/pallas_benchmark.py:quick \
    --config.shapes=4x4096x16x128 --config.weightings=softmax,relu,sigmoid,power \
    --workdir="$out/pallas_benchmark"
fi
if [ "${BENCHMARK:-1}" != 0 ]; then  # the Masks guide's 1.3x rule at its own T = 16 384
  step mask_benchmark $pin_gpu "$py" launch.py --config=experiments/pallas_benchmark.py:quick \
    --config.shapes=1x16384x16x128 --config.weightings=softmax --config.row_weightings= \
    --config.baselines=cudnn --config.modes=fwd+bwd --workdir="$out/mask_benchmark"
fi
if [ "${BENCHMARK:-1}" != 0 ]; then  # decoding: split-KV on the Pallas kernels, its HBM share
  step decode_benchmark $pin_gpu "$py" experiments/decode_benchmark.py --preset=gpu \
    --workdir="$out/decode_benchmark"
fi
if [ "${SWEEP:-0}" != 0 ]; then
  step tile_sweep $pin_gpu "$py" tools/gpu_tile_sweep.py --out="$out/tile_sweep" \
    --weightings="${SWEEP_WEIGHTINGS:-softmax,sigmoid,relu,power,ssmax,sparsemax}" \
    --budget="${SWEEP_BUDGET:-150}"
fi
# Phase 2 (each process allocating as it goes instead of taking 75 % of its memory up front):
# the device tests in parallel workers (each compiles its kernels: 11-90 s a test), alone on the
# GPU's cores, since beside the training run they finished none in 200 s (2026-11-27); then a
# short training run with the Pallas kernels (digits, offline).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step pallas_tests $pin_gpu "$py" -m pytest -q -p no:cacheprovider -n "${DEVICE_TEST_WORKERS:-6}" \
  tests/core/test_pallas_device.py tests/core/test_platforms.py || status=1
step training $pin_gpu "$py" launch.py --config=experiments/compare_weightings.py:quick \
  --config.weightings=softmax,relu,sparsemax,stick_breaking --config.implementation=pallas \
  --workdir="$out/training" || status=1
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

if [ -f "$out/pallas_benchmark/report.md" ]; then
  { echo; echo "## Pallas benchmark (quick)"; echo;
    sed -n '/^## Targets/,/^## Results/p' "$out/pallas_benchmark/report.md" | sed '$d'; } \
    >> "$summary"
fi
if [ -f "$out/mask_benchmark/report.md" ]; then
  { echo; echo "## Masked rows at T = 16 384 (fwd+bwd)"; echo;
    grep -E '^\| shape \| impl' "$out/mask_benchmark/report.md" | head -1
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    grep -E '^\| 1x16384.*\| (causal|window|documents) \|' "$out/mask_benchmark/report.md"; } \
    >> "$summary"
fi
if [ -f "$out/decode_benchmark/report.md" ]; then
  { echo; echo "## Decoding (bf16, B = 4, N = 8 over K = 2, H = 64)"; echo;
    sed -n '/^## Targets/,/^## Results/p' "$out/decode_benchmark/report.md" | sed '$d'; } \
    >> "$summary"
fi
if [ -f "$out/autotune/autotune.md" ]; then
  { echo; sed 's/^# /## /' "$out/autotune/autotune.md"; } >> "$summary"
fi
if [ -f "$out/tile_sweep/tile_sweep.md" ]; then
  { echo; sed 's/^# /## /' "$out/tile_sweep/tile_sweep.md"; } >> "$summary"
fi
echo "summary: $summary"
exit $status
