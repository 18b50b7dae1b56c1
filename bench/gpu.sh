#!/usr/bin/env bash
# The GPU machine's one command: builds the Release tree with the CUDA backend, runs the CUDA
# tests (every kernel against the CPU reference; a missing GPU fails them here instead of skipping
# them) and the data-parallel engine over NCCL at world size one, then the GPU benchmarks
# (bench/gpu_vs_pytorch.py: memtrain against PyTorch eager and torch.compile on GPT-2 124M and
# 1.5B, then activation checkpointing on 1.5B). See docs/cuda.md and docs/benchmarks.md.
#
#   bash bench/gpu.sh [--quick] [--skip-tests | --bench-only] [--only 124m,1.5b,remat] [BUILD_DIR]
#
#   BUILD_DIR     default build-gpu
#   --quick       fewer steps (and no torch.compile peer on 1.5B): about half the time
#   --skip-tests  build only the memtrain target and skip the CUDA tests
#   --bench-only  skip the build and the CUDA tests (BUILD_DIR/memtrain must exist)
#   --only LIST   run only these benchmarks (default 124m,1.5b,remat; also offload: the largest
#                 GPT ZeRO-Offload trains on one GPU, bench/offload_gpu.py)
#   env: OUT (results folder, default bench-out), PYTHON (interpreter with PyTorch, default
#        python3), MEMTRAIN_SKIP_DEPS=1 (skip scripts/deps.sh), MEMTRAIN_BENCH_TIMEOUT (seconds per
#        benchmark process, default 900), MEMTRAIN_DEPS_DIR (where .gpu-debs is unpacked)
#
# On the lent GPU machine (no network, no Debian -dev packages): run scripts/gpu_debs.sh here
# first and carry .gpu-debs with the run; this script then builds against those packages.
#
# Everything printed also goes to $OUT/gpu.log, and each benchmark's measurements (with each
# process's command and the end of its output) to $OUT/gpu-<name>.json: four files in all.
# A failed CUDA test or benchmark does not stop the others; the exit status is non-zero if any
# failed. Expected time on one H100: build + tests a few minutes, 124m ~3 min (torch.compile's
# warm-up is most of it), 1.5b ~6 min, remat ~6 min (its ZeRO-Offload row included).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-gpu
QUICK=()
BENCH_ONLY=0
SKIP_TESTS=0
ONLY=124m,1.5b,remat
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=(--quick) ;;
        --bench-only) BENCH_ONLY=1 ;;
        --skip-tests) SKIP_TESTS=1 ;;
        --only) [ $# -ge 2 ] || { echo "gpu.sh: --only needs a list" >&2; exit 2; }
                ONLY=$2; shift ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        -*) echo "gpu.sh: unknown option $1 (see bash bench/gpu.sh --help)" >&2; exit 2 ;;
        *) BUILD=$1 ;;
    esac
    shift
done
for b in ${ONLY//,/ }; do
    case "$b" in 124m|1.5b|remat|offload) ;; *) echo "gpu.sh: unknown benchmark '$b' in --only" >&2; exit 2 ;; esac
done
JOBS=$(nproc)
OUTDIR=${OUT:-bench-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/gpu.log") 2>&1
export PYTHONUNBUFFERED=1
status=0

nvidia-smi -L || { echo "gpu.sh: nvidia-smi sees no GPU" >&2; exit 1; }
if [ "$BENCH_ONLY" = 0 ]; then
    command -v nvcc >/dev/null || { echo "gpu.sh: nvcc not found: install the CUDA toolkit" >&2; exit 1; }
    CMAKE_EXTRA=()
    if ls .gpu-debs/*.deb >/dev/null 2>&1; then
        # The lent GPU machine cannot install packages: unpack the Debian packages that
        # scripts/gpu_debs.sh fetched (carried with the run) into a private prefix, never into /,
        # and build against it; the binaries find its libraries through their RPATH. The image's
        # compiler may be newer than Debian 12's, so its new warnings do not stop the build.
        DEPS=${MEMTRAIN_DEPS_DIR:-/tmp/memtrain-deps}
        echo "== dependencies: unpacking .gpu-debs into $DEPS"
        rm -rf "$DEPS"
        mkdir -p "$DEPS"
        for f in .gpu-debs/*.deb; do
            member=$(ar t "$f" | grep '^data\.tar')
            case "$member" in
                *.xz) ar p "$f" "$member" | tar -xJ -C "$DEPS" ;;
                *.zst) ar p "$f" "$member" | tar --zstd -x -C "$DEPS" ;;
                *.gz) ar p "$f" "$member" | tar -xz -C "$DEPS" ;;
                *) echo "gpu.sh: $f holds no data.tar I can unpack ($member)" >&2; exit 1 ;;
            esac
        done
        LIBDIR="$DEPS/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
        CMAKE_EXTRA=(-DMEMTRAIN_DEPS_PREFIX="$DEPS" -DMEMTRAIN_WERROR=OFF
                     "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags -Wl,-rpath,$LIBDIR")
    elif [ "${MEMTRAIN_SKIP_DEPS:-0}" != "1" ]; then
        bash scripts/deps.sh
    fi

    echo "== build ($BUILD, Release, CUDA)"
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMEMTRAIN_CUDA=ON "${CMAKE_EXTRA[@]}" >/dev/null
    if [ "$SKIP_TESTS" = 1 ]; then
        cmake --build "$BUILD" -j "$JOBS" --target memtrain
    else
        cmake --build "$BUILD" -j "$JOBS"
    fi
    if ! grep -q -- "-DMEMTRAIN_HAVE_CUDA=1" "$BUILD/compile_commands.json"; then
        echo "gpu.sh: CMake did not enable the CUDA backend (is nvcc on PATH?)" >&2
        exit 1
    fi

    if [ "$SKIP_TESTS" = 1 ]; then
        echo "== CUDA tests skipped (--skip-tests)"
    else
        echo "== CUDA tests (kernels against the CPU reference)"
        if ! MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$JOBS} \
            ctest --test-dir "$BUILD" -R '^(Cuda|Device)' --output-on-failure; then
            echo "gpu.sh: CUDA tests FAILED; running the benchmarks anyway"
            status=1
        fi
                # The GPU engine's NCCL path at world size one (one GPU: NCCL takes one rank per GPU):
        # DDP, ZeRO 1-3 and ZeRO-Offload against the plain single process, and the pipeline
        # code path at one stage against the single GPU and the CPU.
        echo "== CUDA data parallelism and pipeline stages over NCCL (mpirun -np 1)"
        if ! OMP_NUM_THREADS=${OMP_NUM_THREADS:-$JOBS} MEMTRAIN_COMM_TIMEOUT_S=120 \
            mpirun --allow-run-as-root -np 1 "$BUILD/memtrain_dist_tests" \
            --gtest_filter='CudaDp.*:CudaPp.*'; then
            echo "gpu.sh: CUDA data-parallel tests FAILED; running the benchmarks anyway"
            status=1
        fi
    fi
fi
[ -x "$BUILD/memtrain" ] || { echo "gpu.sh: no $BUILD/memtrain (build first, without --bench-only)" >&2; exit 1; }

echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true

for b in ${ONLY//,/ }; do
    echo
    echo "== GPU benchmark: $b"
    if [ "$b" = offload ]; then
        # ZeRO-Offload: the largest GPT one GPU trains with the optimizer on the host.
        script=(bench/offload_gpu.py)
    elif [ "$b" = remat ]; then
        script=(bench/gpu_vs_pytorch.py --remat-compare)
    else
        script=(bench/gpu_vs_pytorch.py --preset "$b")
    fi
    if ! "$PYTHON" "${script[@]}" --memtrain "$BUILD/memtrain" "${QUICK[@]}" \
        --timeout "${MEMTRAIN_BENCH_TIMEOUT:-900}" --json "$OUTDIR/gpu-$b.json"; then
        echo "gpu.sh: benchmark $b FAILED (see above and $OUTDIR/gpu-$b.json)"
        status=1
    fi
done
echo
echo "== done: log and results in $OUTDIR (gpu.log, gpu-*.json); exit status $status"
exit $status
