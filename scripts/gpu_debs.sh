#!/usr/bin/env bash
# Fetches, here (where apt reaches Debian's mirrors), the Debian 12 packages memtrain builds
# against, into .gpu-debs/ (ignored by git), for a machine that cannot install them: the lent GPU
# machine has the CUDA toolkit, PyTorch and OpenMPI but no network and no Debian -dev packages.
# Carry the folder with the run (the device tool's `carry: [".gpu-debs"]`); bench/gpu.sh then
# unpacks it into a private prefix (never into /) and builds against it. About 14 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libgtest-dev
      libopenblas0-openmp libopenblas-openmp-dev libopenblas-dev libgfortran5 libquadmath0)
rm -rf .gpu-debs
mkdir -p .gpu-debs
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
# apt-get download writes into the current directory as the _apt user where it can.
(cd .gpu-debs && chmod 777 . && apt-get download "${pkgs[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
n=$(ls .gpu-debs/*.deb 2>/dev/null | wc -l)
[ "$n" -eq "${#pkgs[@]}" ] || { echo "gpu_debs: fetched $n of ${#pkgs[@]} packages" >&2; exit 1; }
echo "gpu_debs: $n packages, $(du -sh .gpu-debs | cut -f1) in .gpu-debs/"
