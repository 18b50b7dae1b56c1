#!/usr/bin/env bash
# Second GPU run: every CUDA test in its own process (a sticky CUDA error in one no longer fails
# the rest), compute-sanitizer on the first failures, then GPT-2 1.5B against PyTorch eager.
set -u
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee -a "$OUT/run2.log") 2>&1
ROOT=$PWD
mkdir -p /work && ln -sfn "$ROOT" /work/main
mkdir -p build-dev && tar xJf .gpu-run/bundle.tar.xz -C build-dev
CUDALIBS=$(for n in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do find /usr/local /opt /usr/lib -name "$n*" 2>/dev/null | head -1; done | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$ROOT/build-dev/lib:$CUDALIBS"
export MEMTRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=8
B=build-dev/memtrain_tests
$B --gtest_list_tests --gtest_filter='Cuda*:Device.*' | awk '/^[^ ]/{s=$1} /^  /{print s $1}' > $OUT/tests.txt
el "== $(wc -l < $OUT/tests.txt) CUDA tests, one process each"
: > $OUT/isolated.txt
while read -r t; do
  [ $(( $(date +%s) - T0 )) -gt 200 ] && { echo "$t NOT-RUN" >> $OUT/isolated.txt; continue; }
  timeout 40 $B --gtest_filter="$t" > $OUT/one.log 2>&1; rc=$?
  if grep -q "^\[  PASSED  \] 1 test" $OUT/one.log; then r=PASS; elif grep -q "SKIPPED" $OUT/one.log; then r=SKIP; else r="FAIL(rc=$rc)"; { echo "=== $t"; grep -v "^\[" $OUT/one.log | head -12; } >> $OUT/failures.log; fi
  echo "$t $r" >> $OUT/isolated.txt
done < $OUT/tests.txt
grep -c PASS $OUT/isolated.txt; grep -v " PASS" $OUT/isolated.txt
el "== compute-sanitizer memcheck on CudaMatmul.LinearBf16"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 90 $CS --tool memcheck --show-backtrace device --print-limit 5 $B --gtest_filter='CudaMatmul.LinearBf16' > $OUT/sanitizer.log 2>&1
grep -E "Invalid|Misaligned|at 0x|in .*kernel|by thread|Address|ERROR SUMMARY" $OUT/sanitizer.log | head -40
el "== GPT-2 1.5B: memtrain vs PyTorch eager"
PYTHONUNBUFFERED=1 timeout $(( 500 - ($(date +%s) - T0) )) python3 bench/gpu_vs_pytorch.py --memtrain build-dev/memtrain --preset 1.5b --quick --peers eager \
    --json $OUT/gpu-1.5b.json > $OUT/bench1.5b.log 2>&1; echo "rc=$?" >> $OUT/bench1.5b.log
tail -25 $OUT/bench1.5b.log
el "done"
