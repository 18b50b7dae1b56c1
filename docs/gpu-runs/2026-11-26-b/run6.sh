#!/usr/bin/env bash
# Sixth GPU run (session 2): GPT-2 1.5B against eager and torch.compile.
set -u
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee -a "$OUT/run6.log") 2>&1
ROOT=$PWD
mkdir -p /work && ln -sfn "$ROOT" /work/main
mkdir -p build-next && tar xJf .gpu-run/bundle.tar.xz -C build-next
CUDALIBS=$(for n in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do find /usr/local /opt /usr/lib -name "$n*" 2>/dev/null | head -1; done | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$ROOT/build-next/lib:$ROOT/build-next/lib-mpi:$CUDALIBS"
export MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=16
el "== GPT-2 1.5B: memtrain vs PyTorch eager and torch.compile"
PYTHONUNBUFFERED=1 timeout 330 python3 bench/gpu_vs_pytorch.py --memtrain build-next/memtrain --preset 1.5b --quick --peers eager,compile \
    --json $OUT/gpu-1.5b.json > $OUT/bench1.5b.log 2>&1; echo "rc=$?" >> $OUT/bench1.5b.log
grep -E "result:|done in|rc=" $OUT/bench1.5b.log; tail -16 $OUT/bench1.5b.log
el "done"
