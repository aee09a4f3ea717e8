#!/usr/bin/env bash
# The GPU check: what compiling cannot tell, measured on a real GPU, in one command.
#
#   tools/gpu_check.sh [OUT]        (OUT: where results go; default runs/gpu_check)
#
# Runs, in order, from the repository root:
#   1. the Pallas tests on the GPU, compiled kernels, no interpreter
#      (tests/core/test_pallas_device.py: every streaming weighting vs a float64 brute force;
#      tests/core/test_platforms.py: lowering per platform);
#   2. the Pallas benchmark's quick preset at one shape (TFLOP/s per F vs cuDNN softmax and JAX's Pallas
#      flash; the kernel issue's target: every pointwise F >= 60 % of cuDNN softmax at T >= 4k);
#   3. a short language_model run with implementation="pallas" (4 weightings, 200 steps);
#   4. the CPU test suite under the machine's own JAX (JAX_PLATFORMS=cpu), to learn whether a
#      newer JAX than pyproject.toml admits passes it, in CPU_SUITE_WORKERS shards (default 10);
#      CPU_SUITE=0 skips it.
# The benchmark (BENCHMARK=0 skips it) runs first, alone, so that its timings come from a quiet
# machine; steps 1, 3 and 4 then run side by side.
# Each step is bounded by `timeout` (STEP_TIMEOUT seconds, default 240) so that one hung step
# cannot eat a lent machine's time.
# and writes OUT/gpu_check.md (date, chip, driver, JAX version, each step's outcome and time,
# the benchmark's target table) plus each step's log and report, for the docs (docs/guides/pallas.md) to quote.
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

# The CPU suite in N shards of whole test files, one plain pytest process and log each, so that
# a run cut short by the lent time still says what each shard passed and failed so far.
cpu_suite() {
  local n=$1 i rc=0
  local files
  mapfile -t files < <(find tests -name 'test_*.py' | sort)
  for ((i = 0; i < n; i++)); do
    local shard=()
    for ((j = i; j < ${#files[@]}; j += n)); do shard+=("${files[j]}"); done
    JAX_PLATFORMS=cpu timeout "${STEP_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider \
      -p no:benchmark "${shard[@]}" \
      > "$out/cpu_suite.$i.log" 2>&1 &
  done
  for ((i = 0; i < n; i++)); do wait -n || rc=1; done
  for ((i = 0; i < n; i++)); do
    grep -h -E "^(FAILED|ERROR) " "$out/cpu_suite.$i.log"
    echo "shard $i: $(tail -1 "$out/cpu_suite.$i.log")"
  done
  # One closing line for all shards: the sums of pytest's counts.
  local word total line=""
  for word in passed failed skipped deselected errors error; do
    total=$(tail -q -n1 "$out"/cpu_suite.*.log | grep -o -E "[0-9]+ $word\b" |
      awk '{s += $1} END {print s + 0}')
    [ "$total" -gt 0 ] && line="$line${line:+, }$total $word"
  done
  echo "all shards: $line"
  return $rc
}

# The benchmark first, alone on the machine (BENCHMARK=0 skips it). One shape and the F of the
# table in docs/guides/pallas.md ("Measured on an NVIDIA H100"), so the figures compare with
# the tiles timed before; the whole-row weightings as the preset has.
if [ "${BENCHMARK:-1}" != 0 ]; then
  step pallas_benchmark "$py" launch.py --config=experiments/pallas_benchmark.py:quick \
    --config.shapes=4x4096x16x128 --config.weightings=softmax,relu,sigmoid,power \
    --workdir="$out/pallas_benchmark"
fi
# Then the rest side by side: the device tests and the training run share the GPU (each
# allocating as it goes instead of taking 75 % of its memory up front), the CPU suite the cores.
pids=()
if [ "${CPU_SUITE:-1}" != 0 ]; then
  step cpu_suite cpu_suite "${CPU_SUITE_WORKERS:-10}" &
  pids+=($!)
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step pallas_tests "$py" -m pytest -q -p no:cacheprovider tests/core/test_pallas_device.py \
  tests/core/test_platforms.py &
pids+=($!)
step language_model "$py" launch.py --config=experiments/language_model.py \
  --config.weightings=softmax,relu,sparsemax,stick_breaking --config.num_seeds=1 \
  --config.num_steps=200 --config.eval_every=100 --config.implementation=pallas \
  --workdir="$out/language_model" || status=1
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

if [ -f "$out/pallas_benchmark/report.md" ]; then
  { echo; echo "## Pallas benchmark (quick)"; echo;
    sed -n '/^## Targets/,/^## Results/p' "$out/pallas_benchmark/report.md" | sed '$d'; } \
    >> "$summary"
fi
echo "summary: $summary"
exit $status
