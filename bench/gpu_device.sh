#!/usr/bin/env bash
# The GPU machine's commands (docs/benchmarks.md, "GPU"): run the bundle scripts/gpu_bundle.sh
# built here, inside the lent machine's window (15 minutes of machine time in all, start-up
# included; at most 10 minutes a command). Nothing is compiled there. Each command ends within
# its budget (default 530 s) and writes its results as it goes: what a stage measured is on disk
# before the next stage starts.
#
#   bash bench/gpu_device.sh first    the CUDA tests on the GPU (tests/cuda with
#                                     MEMTRAIN_REQUIRE_GPU=1, then the engines' DDP, ZeRO and
#                                     pipeline code over NCCL at one rank), GPT-2 124M against
#                                     PyTorch eager and torch.compile (tokens/s, peak memory),
#                                     GPT-2 1.5B quick (against eager), then activation
#                                     checkpointing on 1.5B (remat=budget vs PyTorch's
#                                     checkpointing, ZeRO-Offload at 8 micro-batches a step)
#   bash bench/gpu_device.sh second   when time is left: the longest sequence of a Llama-3-8B
#                                     shape on the GPU (issue 27), the optimizer state formats
#                                     (fp32, bf16, int8, int4) on a 124M shape (issue 30; needs data/fortunes,
#                                     carried beside the bundle), the largest GPT under
#                                     ZeRO-Offload, then 1.5B in full (with torch.compile)
#   options: --bundle DIR (default .gpu-bundle), --out DIR (default $OUT, else bench-out),
#            --budget SECONDS (default 530), --dry-run BUILD_DIR (the CI smoke test: a stand-in
#            bundle of BUILD_DIR's CPU and cudasim programs, tiny CPU benchmarks, no GPU)
#   env: PYTHON (the interpreter with PyTorch, default python3)
#
# Results in the output folder (at most 8 files, as the device tool brings back): gpu.log
# (everything printed), summary.txt (one line per stage), progress.jsonl (each benchmark process
# as it finishes), cuda-tests.xml and dist-tests.xml (GoogleTest reports), and one JSON per
# benchmark (gpu-124m.json, gpu-1.5b.json, gpu-remat.json; second: gpu-longest.json,
# gpu-state-formats.md, gpu-offload.json, gpu-1.5b-full.json). The exit status is non-zero if a stage failed; later stages still run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
START=$(date +%s)
WHICH=${1:-}
shift || true
BUNDLE=.gpu-bundle
RESULTS=${OUT:-bench-out}
BUDGET=530
DRY_BUILD=""
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=$2; shift ;;
        --out) RESULTS=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        --dry-run) DRY_BUILD=$2; shift ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        *) echo "gpu_device: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$WHICH" in
    first|second) ;;
    *) echo "gpu_device: say which command: first or second (see --help)" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
exec > >(tee -a "$RESULTS/gpu.log") 2>&1
export PYTHONUNBUFFERED=1
status=0

elapsed() { echo $(( $(date +%s) - START )); }
UNPACKED=""
STANDIN=""
trap 'rm -rf "$UNPACKED" "$STANDIN"' EXIT
left() { echo $(( BUDGET - $(elapsed) )); }
summary() { echo "$*" | tee -a "$RESULTS/summary.txt"; }

# ---- the bundle ---------------------------------------------------------------------------------
if [ -n "$DRY_BUILD" ]; then
    # The CI smoke test: the same steps on the CPU, with the CPU and cudasim programs standing in
    # for the GPU ones and tiny benchmarks standing in for the real ones.
    STANDIN=$(mktemp -d /tmp/memtrain-standin.XXXXXX)
    BUNDLE=$STANDIN
    bash scripts/gpu_bundle.sh --stand-in "$DRY_BUILD" "$BUNDLE" || exit 1
fi
[ -f "$BUNDLE/bundle.tar.xz" ] || { echo "gpu_device: no bundle at $BUNDLE (make it here with bash scripts/gpu_bundle.sh and carry it)" >&2; exit 1; }
echo "== gpu_device $WHICH: budget ${BUDGET} s, bundle $BUNDLE"
head -6 "$BUNDLE/manifest"
# Unpacked outside the tree (the tree is what the device tool copies there).
UNPACKED=$(mktemp -d /tmp/memtrain-bundle.XXXXXX)
if command -v xz >/dev/null; then
    tar -C "$UNPACKED" -xJf "$BUNDLE/bundle.tar.xz"
else
    "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$BUNDLE/bundle.tar.xz" "$UNPACKED"
fi || { echo "gpu_device: cannot unpack $BUNDLE/bundle.tar.xz" >&2; exit 1; }
BUNDLE=$UNPACKED
BIN=$BUNDLE/bin
echo "unpacked into $BUNDLE in $(elapsed) s"
echo "machine: $(uname -srm), $(ldd --version 2>/dev/null | head -1), $(nproc) cores"

# ---- libraries: the bundle's, then the machine's CUDA, NCCL and MPI, wherever they are ----------
export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing() { for f in "$BIN"/*; do ldd "$f" 2>/dev/null; done | awk '/not found/ {print $1}' | sort -u; }
candidates() {
    echo /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu \
        /usr/lib/x86_64-linux-gnu/openmpi/lib /opt/hpcx/ompi/lib /usr/local/lib /opt/openmpi/lib
    local mpirun_bin
    mpirun_bin=$(command -v mpirun 2>/dev/null) && echo "$(dirname "$(dirname "$(readlink -f "$mpirun_bin")")")/lib"
    # pip's CUDA libraries (nvidia-nccl-cu13, nvidia-cublas, ...), as PyTorch finds them
    "$PYTHON" - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia
    for base in nvidia.__path__:
        for d in sorted(glob.glob(os.path.join(base, "*", "lib"))):
            print(d)
except ImportError:
    pass
EOF
}
for lib in $(missing); do
    for d in $(candidates); do
        if [ -e "$d/$lib" ]; then
            echo "libraries: $lib from $d"
            export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
            break
        fi
    done
done
if missing | grep -q '^libmpi\.so'; then
    echo "libraries: no libmpi.so.40 on this machine: the bundle's OpenMPI (one process only)"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$BUNDLE/lib/mpi"
fi
if [ -n "$(missing)" ]; then
    echo "gpu_device: libraries not found: $(missing | tr '\n' ' ')" >&2
    for f in "$BIN"/*; do echo "-- ldd $f"; ldd "$f"; done
    summary "libraries: MISSING $(missing | tr '\n' ' ')"
    exit 1
fi
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

if [ -z "$DRY_BUILD" ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv ||
        { echo "gpu_device: nvidia-smi sees no GPU" >&2; exit 1; }
    export MEMTRAIN_REQUIRE_GPU=1  # a CUDA test that finds no GPU fails instead of skipping
    DEVICE_ARGS=(--device cuda)
else
    DEVICE_ARGS=(--device cpu --preset tiny --peers eager --threads 2)
fi
export MEMTRAIN_TEST_TMP=${MEMTRAIN_TEST_TMP:-/tmp/memtrain-test-tmp}
mkdir -p "$MEMTRAIN_TEST_TMP"
MPIRUN=$(command -v mpirun || true)

# Runs a stage with at most `want` seconds, fewer if the budget has less (less `reserve` for the
# stages after it); skips it when fewer than `need` are left.
stage() {
    local name=$1 need=$2 want=$3 reserve=$4
    shift 4
    local have=$(( $(left) - reserve ))
    [ "$have" -lt "$want" ] && want=$have
    echo
    echo "== $name ($(elapsed) s in; up to $want s)"
    if [ "$want" -lt "$need" ]; then
        summary "$name: SKIPPED (${want} s left of the budget, needs $need)"
        [ -n "$DRY_BUILD" ] && status=1  # the dry run must reach every stage
        return 0
    fi
    local t0=$(date +%s)
    STAGE_SECONDS=$want "$@"
    local rc=$?
    local took=$(( $(date +%s) - t0 ))
    if [ "$rc" = 0 ]; then
        summary "$name: ok in ${took} s"
    else
        [ "$rc" = 124 ] && summary "$name: TIMED OUT after ${took} s" || summary "$name: FAILED (exit $rc) in ${took} s"
        status=1
    fi
}

cuda_tests() {
    local filter=()
    # On cudasim the whole suite takes minutes: the dry run runs a few kernels' tests.
    [ -n "$DRY_BUILD" ] && filter=(--gtest_filter='CudaSemantics.*:CudaReduce.*')
    OMP_NUM_THREADS=$(nproc) timeout -k 5 "$STAGE_SECONDS" "$BIN/memtrain_cuda_tests" \
        "${filter[@]}" --gtest_output="xml:$RESULTS/cuda-tests.xml"
}

dist_tests() {
    [ -n "$MPIRUN" ] || { echo "no mpirun on this machine: the NCCL tests need one"; return 1; }
    local filter='CudaDp.*:CudaPp.*'
    [ -n "$DRY_BUILD" ] && filter='CudaPp.RefusesWhatItDoesNotRun'
    OMP_NUM_THREADS=$(nproc) MEMTRAIN_COMM_TIMEOUT_S=60 timeout -k 5 "$STAGE_SECONDS" \
        "$MPIRUN" --allow-run-as-root --oversubscribe -np 1 "$BIN/memtrain_cuda_dist_tests" \
        --gtest_filter="$filter" --gtest_output="xml:$RESULTS/dist-tests.xml"
}

# gpu_vs_pytorch.py or offload_gpu.py inside the stage's seconds: --deadline stops its processes
# in time and it still writes its JSON; `timeout` is the backstop.
bench() {
    local json=$1
    shift
    timeout -k 5 $(( STAGE_SECONDS + 20 )) "$PYTHON" "$@" --memtrain "$BIN/memtrain" \
        --deadline $(( STAGE_SECONDS - 5 )) --json "$RESULTS/$json"
}
compare() {
    local json=$1
    shift
    if [ -n "$DRY_BUILD" ]; then
        bench "$json" bench/gpu_vs_pytorch.py "${DEVICE_ARGS[@]}" "$@" --progress "$RESULTS/progress.jsonl" --quick
    else
        bench "$json" bench/gpu_vs_pytorch.py "${DEVICE_ARGS[@]}" "$@" --progress "$RESULTS/progress.jsonl"
    fi
}
offload() {
    if [ -n "$DRY_BUILD" ]; then
        bench gpu-offload.json bench/offload_gpu.py --device cpu-smoke
    else
        bench gpu-offload.json bench/offload_gpu.py --quick
    fi
}
longest() {
    if [ -n "$DRY_BUILD" ]; then
        bench gpu-longest.json bench/longest_seq_gpu.py --device cpu-smoke --progress "$RESULTS/progress.jsonl"
    else
        bench gpu-longest.json bench/longest_seq_gpu.py --progress "$RESULTS/progress.jsonl"
    fi
}

# bench/state_formats.sh on the fortunes corpus (carried: data/fortunes is not in the tree), its
# table into gpu-state-formats.md. The dry run trains a tiny shape on the CPU, where the corpus
# has been made (`make demo`); without it there it says so and passes.
state_formats() {
    local runs
    runs=$(mktemp -d /tmp/memtrain-state-formats.XXXXXX)
    if [ ! -f data/fortunes/train.bin ]; then
        echo "no data/fortunes/train.bin: carry data/fortunes beside the bundle"
        [ -n "$DRY_BUILD" ] && return 0 || return 1
    fi
    if [ -n "$DRY_BUILD" ]; then
        OPTIONS="fp32 bf16 int8 int4" DEVICE=cpu OUT=$runs timeout -k 5 "$STAGE_SECONDS" \
            bash bench/state_formats.sh "$BIN" 12 tiny
    else
        # Adafactor without a master (4.05 B/param) and Muon last: they run on the GPU since
        # 4daf94a, and the stage's cap ends what does not fit.
        OPTIONS="fp32 bf16 int8 int4 adafactor-bf16w muon" DEVICE=cuda OUT=$runs \
            timeout -k 5 "$STAGE_SECONDS" bash bench/state_formats.sh "$BIN" 300 124m
    fi > "$RESULTS/gpu-state-formats.md"
    local rc=$?
    cat "$RESULTS/gpu-state-formats.md"
    rm -rf "$runs"
    return $rc
}

# ---- the stages ---------------------------------------------------------------------------------
# `need` is what a stage must have to say anything; `want` the most it may take; `reserve` what
# the stages after it need. Sized from the H200 run of 2026-11-27 (docs/benchmarks.md): the CUDA
# tests took 6 s, the NCCL tests 20, 124M 75, 1.5B quick 63, the checkpointing comparison about
# 200 without its ZeRO-Offload row; the 6.7B offload attempt 142 s (2026-11-26), torch.compile's
# compilation of 1.5B 93 s.
if [ -n "$DRY_BUILD" ]; then
    # The same stages, sized for the dry run's tiny stand-ins (within --budget 300).
    if [ "$WHICH" = first ]; then
        stage "CUDA tests on the GPU" 10 90 150 cuda_tests
        stage "DDP, ZeRO and pipelines over NCCL (mpirun -np 1)" 10 40 120 dist_tests
        stage "GPT-2 124M vs PyTorch eager and torch.compile" 20 60 80 compare gpu-124m.json
        stage "GPT-2 1.5B quick vs PyTorch eager" 20 60 40 compare gpu-1.5b.json
        stage "activation checkpointing on 1.5B" 20 100 0 compare gpu-remat.json --remat-compare
    else
        stage "the longest sequence of a Llama-3-8B shape" 20 60 120 longest
        stage "optimizer state formats on 124M" 10 40 90 state_formats
        stage "ZeRO-Offload: the largest GPT" 20 60 30 offload
        stage "GPT-2 1.5B in full (eager and torch.compile)" 20 80 0 compare gpu-1.5b-full.json
    fi
elif [ "$WHICH" = first ]; then
    stage "CUDA tests on the GPU" 30 90 420 cuda_tests
    stage "DDP, ZeRO and pipelines over NCCL (mpirun -np 1)" 20 60 390 dist_tests
    stage "GPT-2 124M vs PyTorch eager and torch.compile" 90 120 300 \
        compare gpu-124m.json --preset 124m --quick
    stage "GPT-2 1.5B quick vs PyTorch eager" 60 90 230 compare gpu-1.5b.json --preset 1.5b --quick
    stage "activation checkpointing on 1.5B" 150 300 0 \
        compare gpu-remat.json --remat-compare --quick --offload-accum 8
else
    stage "the longest sequence of a Llama-3-8B shape" 120 300 160 longest
    stage "optimizer state formats on 124M" 40 120 150 state_formats
    stage "ZeRO-Offload: the largest GPT" 150 200 0 offload
    stage "GPT-2 1.5B in full (eager and torch.compile)" 150 240 0 \
        compare gpu-1.5b-full.json --preset 1.5b
fi

echo
echo "== gpu_device $WHICH done in $(elapsed) s of ${BUDGET}; results in $RESULTS:"
cat "$RESULTS/summary.txt"
ls -la "$RESULTS"
exit $status
