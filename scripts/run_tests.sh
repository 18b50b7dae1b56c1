#!/usr/bin/env bash
# Runs every test: the GoogleTest suite through CTest (parity with PyTorch included), then the
# end-to-end command-line checks. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
ctest --test-dir "$BUILD" --output-on-failure -j 2
