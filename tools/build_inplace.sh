#!/usr/bin/env bash
# Developer build without installing: compiles uccl_moe._C into build/inplace and copies it next to the
# Python sources, so `python -m pytest` in this tree imports this tree (several worktrees side by side).
# Users run `pip install -e .` instead (README).
#   tools/build_inplace.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${UCCL_MOE_BUILD_DIR:-build/inplace}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" "$@" >/dev/null
cmake --build "$BUILD" -j"${UCCL_MOE_JOBS:-2}"
# New inode (copy, then rename): processes that have the old module mapped keep running.
for so in "$BUILD"/native/src/bindings/_C*.so; do
  cp -f "$so" "uccl_moe/.$(basename "$so").tmp" && mv -f "uccl_moe/.$(basename "$so").tmp" "uccl_moe/$(basename "$so")"
done
echo "built $(ls uccl_moe/_C*.so)"
