#!/usr/bin/env bash
# First GPU run: the CUDA tests on the real GPU, the data-parallel/pipeline engines over NCCL at
# np 1, then GPT-2 124M against PyTorch eager and torch.compile. Results go to $OUT as they come.
set -u
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee -a "$OUT/run1.log") 2>&1
el "start on $(hostname)"; nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
ROOT=$PWD
mkdir -p /work && ln -sfn "$ROOT" /work/main          # the binaries' MT_SOURCE_DIR
mkdir -p build-dev && tar xJf .gpu-run/bundle.tar.xz -C build-dev
CUDALIBS=$(for n in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do find /usr/local /opt /usr/lib -name "$n*" 2>/dev/null | head -1; done | xargs -r -n1 dirname | sort -u | tr '\n' ':')
el "cuda libs: $CUDALIBS"
LIBS="$ROOT/build-dev/lib:$CUDALIBS"
ldconfig -p | grep -q "libmpi.so.40 " || LIBS="$LIBS:$ROOT/build-dev/lib-mpi"
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd build-dev/memtrain_tests | grep -E "not found|cudart|cublas|nccl|mpi"
build-dev/memtrain --version
el "== CUDA tests on the GPU"
MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=8 timeout 200 build-dev/memtrain_tests --gtest_filter='Cuda*:Device.*' \
    --gtest_output=json:$OUT/cuda_tests.json > $OUT/cuda_tests.log 2>&1; echo "rc=$?" >> $OUT/cuda_tests.log
grep -E "^\[  (PASSED|FAILED) |^\[  SKIPPED|FAILED  \]|tests ran|rc=" $OUT/cuda_tests.log | head -60
el "== CudaDp/CudaPp over NCCL at np 1"
if command -v mpirun >/dev/null; then
  MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=4 timeout 90 mpirun --allow-run-as-root -np 1 -x LD_LIBRARY_PATH -x MEMTRAIN_REQUIRE_GPU \
    build-dev/memtrain_dist_tests --gtest_filter='CudaDp.*:CudaPp.*' > $OUT/cuda_dist.log 2>&1; echo "rc=$?" >> $OUT/cuda_dist.log
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]|tests ran|rc=" $OUT/cuda_dist.log | head -30
else echo "no mpirun"; fi
el "== GPT-2 124M: memtrain vs PyTorch eager and torch.compile"
PYTHONUNBUFFERED=1 timeout 250 python3 bench/gpu_vs_pytorch.py --memtrain build-dev/memtrain --preset 124m --quick \
    --json $OUT/gpu-124m.json > $OUT/bench124m.log 2>&1; echo "rc=$?" >> $OUT/bench124m.log
tail -40 $OUT/bench124m.log
el "done"
