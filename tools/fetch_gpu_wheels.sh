#!/usr/bin/env bash
# Downloads the wheels tools/gpu_check.sh needs on a GPU machine without network (the list:
# tools/gpu_wheels.txt) into DIR (default .whl/, git-ignored), for CPython 3.12 on x86-64.
# Run it on a machine that reaches PyPI:  tools/fetch_gpu_wheels.sh [DIR] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
py="${2:-3.12}"
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^\s*#' tools/gpu_wheels.txt | grep -v '^\s*$' | while read -r req; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp "${platforms[@]}" -d "$dir" "$req" 2>/dev/null \
    || python3 -m pip wheel --quiet --no-deps -w "$dir" "$req"  # sdist only: a pure-Python wheel
done
echo "wheels in $dir:"; ls -1 "$dir"
