#!/usr/bin/env bash
# Runs every test twice: the optimised build (the one users run), then an AddressSanitizer +
# UndefinedBehaviorSanitizer build (-O1, line tables) of the same suite. Each suite is the
# GoogleTest binaries under CTest: kernels, model, parity with PyTorch, trainer, data,
# safetensors, planner, the command line end to end, the CUDA backend on cudasim and the
# multi-process tests. Exits non-zero on any failure.
#
# Every CTest entry sets its own OpenMP threads (one per test, PROCESSORS for the multi-process
# ones), so `ctest -j nproc` never runs more threads than there are cores, and its own timeout
# (CTest entry ctest_timeouts checks that none lacks one).
#
# The sanitizer build compiles nothing with nvcc (MEMTRAIN_CUDA_GPU=OFF): code compiled for a GPU
# cannot run where this runs, and the same CUDA sources run there on cudasim. It leaves out three
# entries that would add nothing under the sanitizers: the whole simulator suite in one process
# under seed 3 (the sanitizer build runs it test by test under seed 2), the mutation test of the
# stream waits (tests/cudasim/drop_wait_test.py: stream order, which the sanitizers do not
# change; the suites it reruns run here) and the GPU machine's dry run (shell and Python).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
JOBS=$(nproc)
# Each phase's wall time, so a CI log shows where its minutes went.
phase() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }

phase "tests: optimised build ($BUILD)"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"

if [ "${MEMTRAIN_SKIP_SANITIZE:-0}" != "1" ]; then
    SAN="$BUILD-sanitize"
    phase "build: AddressSanitizer + UndefinedBehaviorSanitizer ($SAN)"
    cmake -S . -B "$SAN" -DCMAKE_BUILD_TYPE=Debug -DMEMTRAIN_SANITIZE=ON -DMEMTRAIN_CUDA_GPU=OFF \
        >/dev/null
    cmake --build "$SAN" -j "$JOBS" >/dev/null
    phase "tests: AddressSanitizer + UndefinedBehaviorSanitizer build ($SAN)"
    # protect_shadow_gap=0: on a machine with a GPU the CUDA driver maps memory where ASan
    # reserves its shadow gap (docs/cuda.md); without a GPU it changes nothing.
    ASAN_OPTIONS=detect_leaks=1:protect_shadow_gap=0 ctest --test-dir "$SAN" --output-on-failure -j "$JOBS"
fi
phase "done"
