#!/usr/bin/env bash
# The GPU run's bundle, built here (docs/benchmarks.md, "GPU"): the lent GPU machine has no
# network, no Debian -dev packages, 15 minutes in all and takes at most 64 MiB beside the source
# tree, so nothing is compiled there. This builds, in the Release tree, the four programs the GPU
# run needs, compiled by nvcc for sm_90:
#   bin/memtrain                    the command line (CPU code; loads the backend for a GPU run)
#   bin/libmemtrain_cuda.so         the CUDA backend: kernels, cuBLASLt calls, NCCL
#   bin/memtrain_cuda_tests         tests/cuda on the GPU (every kernel against the CPU reference)
#   bin/memtrain_cuda_dist_tests    tests/mpi/cuda_*: the GPU engines' DDP, ZeRO and pipelines
# stripped, and beside them in lib/ the Debian runtime libraries they need that the GPU machine
# lacks (OpenBLAS with its Fortran runtime, oneDNN, fmt, toml++, GoogleTest, libgomp; OpenMPI's as a
# fallback in lib/mpi/, used only where the machine has no libmpi.so.40). The CUDA runtime,
# cuBLASLt and NCCL are the machine's own (CUDA 13). All of it goes into OUT_DIR/bundle.tar.xz
# (OpenBLAS alone is 35 MiB unpacked, a third of that packed), beside OUT_DIR/manifest. Prints
# the packed and unpacked sizes and fails when the packed one is above the limit.
#
#   bash scripts/gpu_bundle.sh [BUILD_DIR] [OUT_DIR]        default: build .gpu-bundle
#   bash scripts/gpu_bundle.sh --stand-in BUILD_DIR OUT_DIR  the CI dry run's bundle: the CPU
#        and cudasim programs under the GPU ones' names (no nvcc needed)
#
# Then carry OUT_DIR (ignored by git) with the device run: bench/gpu_device.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
STAND_IN=0
if [ "${1:-}" = "--stand-in" ]; then
    STAND_IN=1
    shift
fi
[ "$STAND_IN" = 1 ] && XZ_LEVEL=${XZ_LEVEL:--0}  # the dry run's bundle: packed fast
BUILD=${1:-build}
OUT=${2:-.gpu-bundle}
LIMIT_MIB=${MEMTRAIN_BUNDLE_LIMIT_MIB:-56}  # 64 MiB a device call carries, less the source tree

if [ "$STAND_IN" = 0 ]; then
    command -v nvcc >/dev/null || { echo "gpu_bundle: nvcc not found: the bundle needs the CUDA toolkit" >&2; exit 1; }
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMEMTRAIN_CUDA=ON -DMEMTRAIN_CUDA_GPU=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
    grep -q "MT_CUDA_GPU:INTERNAL=1\|^MEMTRAIN_CUDA_GPU:BOOL=ON" "$BUILD/CMakeCache.txt"
    nice cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target memtrain memtrain_cuda \
        memtrain_cuda_tests memtrain_cuda_dist_tests
    progs=(memtrain libmemtrain_cuda.so memtrain_cuda_tests memtrain_cuda_dist_tests)
    src=("$BUILD/memtrain" "$BUILD/libmemtrain_cuda.so" "$BUILD/memtrain_cuda_tests"
         "$BUILD/memtrain_cuda_dist_tests")
else
    progs=(memtrain memtrain_cuda_tests memtrain_cuda_dist_tests)
    src=("$BUILD/memtrain" "$BUILD/memtrain_sim_tests" "$BUILD/memtrain_sim_dist_tests")
fi

rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGE=$(mktemp -d /tmp/memtrain-bundle-stage.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib/mpi"
for i in "${!progs[@]}"; do
    [ -f "${src[$i]}" ] || { echo "gpu_bundle: ${src[$i]} is not built" >&2; exit 1; }
    strip --strip-unneeded -o "$STAGE/bin/${progs[$i]}" "${src[$i]}"
done

# The shared libraries they load, by where they come from: the C library, the compiler's C++
# runtime and the CUDA libraries are the machine's; OpenMPI's go to lib/mpi (a fallback);
# everything else Debian installed goes to lib/.
declare -A seen
while read -r name path; do
    [ -n "$path" ] && [ -f "$path" ] || continue
    [ -z "${seen[$name]:-}" ] || continue
    seen[$name]=1
    case "$name" in
        linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libutil.so*) continue ;;
        libstdc++.so*|libgcc_s.so*) continue ;;
        libcuda.so*|libcudart.so*|libcublas*|libnccl.so*|libnvidia*|libnvrtc*|libnvJitLink*) continue ;;
        libmpi*|libopen-*|libhwloc*|libevent*|libpmix*|libfabric*|libucp*|libucs*|libuct*|libucm*|libpsm*|librdmacm*|libibverbs*|libnl-*|libmunge*|libltdl*|libz.so*|libudev*|libcap*|libefa*|libnuma*)
            cp -L "$path" "$STAGE/lib/mpi/$name" ;;
        *) cp -L "$path" "$STAGE/lib/$name" ;;
    esac
done < <(for p in "${src[@]}"; do ldd "$p"; done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u)
strip --strip-unneeded "$STAGE"/lib/*.so* "$STAGE"/lib/mpi/*.so* 2>/dev/null || true

# What the run needs to know about the bundle: its programs, how it was made, and the GLIBC and
# GLIBCXX versions the machine's C and C++ runtimes must provide.
{
    echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$( [ -z "$(git status --porcelain 2>/dev/null)" ] || echo ' (with local changes)')"
    echo "stand-in $STAND_IN"
    echo "programs ${progs[*]}"
    echo "glibc $(for f in "$STAGE"/bin/*; do objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
    echo "glibcxx $(for f in "$STAGE"/bin/*; do objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
    echo "unpacked $(du -sb "$STAGE" | cut -f1) bytes"
    (cd "$STAGE" && find . -type f -printf '%s\t%p\n' | sort -n)
} > "$OUT/manifest"
cp "$OUT/manifest" "$STAGE/manifest"
# xz: the GPU machine unpacks it with tar (or Python's tarfile); the dry run packs fast.
tar -C "$STAGE" -cf - . | xz -T2 "${XZ_LEVEL:--6}" > "$OUT/bundle.tar.xz"

bytes=$(du -sb "$OUT" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu_bundle: $OUT: $mib MiB to carry ($bytes bytes), $(( $(du -sb "$STAGE" | cut -f1) / 1048576 )) MiB unpacked:"
(cd "$STAGE" && find . -type f -printf '%s %p\n' | sort -n | awk '{printf "  %6.1f MiB  %s\n", $1 / 1048576, $2}')
if [ "$mib" -gt "$LIMIT_MIB" ]; then
    echo "gpu_bundle: $mib MiB is over the $LIMIT_MIB MiB a device run can carry beside the source tree" >&2
    exit 1
fi
