#!/usr/bin/env bash
# Runs every test twice: the optimised build (the one users run), then an ASan + UBSan debug
# build of the same suite. Each suite is the GoogleTest binary under CTest: kernels, model,
# parity with PyTorch, trainer, data, safetensors, planner and the command line end to end.
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
JOBS=$(nproc)

echo "== tests: optimised build ($BUILD)"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"

if [ "${MEMTRAIN_SKIP_SANITIZE:-0}" != "1" ]; then
    SAN="$BUILD-sanitize"
    echo "== tests: AddressSanitizer + UndefinedBehaviorSanitizer build ($SAN)"
    cmake -S . -B "$SAN" -DCMAKE_BUILD_TYPE=Debug -DMEMTRAIN_SANITIZE=ON >/dev/null
    cmake --build "$SAN" -j "$JOBS" >/dev/null
    # protect_shadow_gap=0: on a machine with a GPU the CUDA driver maps memory where ASan
    # reserves its shadow gap (docs/cuda.md); without a GPU it changes nothing.
    ASAN_OPTIONS=detect_leaks=1:protect_shadow_gap=0 ctest --test-dir "$SAN" --output-on-failure -j "$JOBS"
fi
