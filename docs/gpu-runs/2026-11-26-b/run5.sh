#!/usr/bin/env bash
# Fifth GPU run (session 2): ZeRO-Offload, the largest GPT on one GPU.
set -u
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee -a "$OUT/run5.log") 2>&1
ROOT=$PWD
mkdir -p /work && ln -sfn "$ROOT" /work/main
mkdir -p build-next && tar xJf .gpu-run/bundle.tar.xz -C build-next
CUDALIBS=$(for n in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do find /usr/local /opt /usr/lib -name "$n*" 2>/dev/null | head -1; done | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$ROOT/build-next/lib:$ROOT/build-next/lib-mpi:$CUDALIBS"
export MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=16
el "== offload: largest GPT with the optimizer on the host"
PYTHONUNBUFFERED=1 timeout 420 python3 bench/offload_gpu.py --memtrain build-next/memtrain --quick --timeout 200 \
    --json $OUT/gpu-offload.json > $OUT/offload.log 2>&1; echo "rc=$?" >> $OUT/offload.log
cat $OUT/offload.log | grep -v "^\s*$" | tail -60
el "done"
