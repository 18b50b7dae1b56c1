#!/usr/bin/env bash
# Runs the CPU benchmarks (memtrain vs PyTorch in the same run) for every preset.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
for preset in small gpt2vocab; do
    /usr/bin/python3 bench/cpu_vs_pytorch.py --memtrain "$BUILD/memtrain" --preset "$preset"
    echo
done
