#!/usr/bin/env bash
# Third GPU run, on main with the cuBLASLt epilogue fix: the CUDA tests (one process, then the
# matmul tests alone), CudaDp/CudaPp over NCCL at np 1, GPT-2 124M against eager and compile.
set -u
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee -a "$OUT/run3.log") 2>&1
ROOT=$PWD
mkdir -p /work && ln -sfn "$ROOT" /work/main
mkdir -p build-next && tar xJf .gpu-run/bundle.tar.xz -C build-next
CUDALIBS=$(for n in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do find /usr/local /opt /usr/lib -name "$n*" 2>/dev/null | head -1; done | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$ROOT/build-next/lib:$CUDALIBS"
export MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=8
B=build-next/memtrain_tests
el "== CUDA tests, one process"
timeout 150 $B --gtest_filter='Cuda*:Device.*:DeviceFit.*' > $OUT/cuda_tests.log 2>&1; echo "rc=$?" >> $OUT/cuda_tests.log
grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|tests ran|rc=" $OUT/cuda_tests.log | head -30
el "== CudaDp/CudaPp at np 1"
timeout 90 mpirun --allow-run-as-root -np 1 -x LD_LIBRARY_PATH -x MEMTRAIN_REQUIRE_GPU build-next/memtrain_dist_tests --gtest_filter='CudaDp.*:CudaPp.*' > $OUT/cuda_dist.log 2>&1; echo "rc=$?" >> $OUT/cuda_dist.log
grep -E "^\[  PASSED|^\[  FAILED|tests ran|rc=" $OUT/cuda_dist.log | head
el "== GPT-2 124M: memtrain vs PyTorch eager and torch.compile"
PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu_vs_pytorch.py --memtrain build-next/memtrain --preset 124m --quick \
    --json $OUT/gpu-124m.json > $OUT/bench124m.log 2>&1; echo "rc=$?" >> $OUT/bench124m.log
tail -22 $OUT/bench124m.log
el "done"
