#!/usr/bin/env bash
# Tensor parallelism on the CPU: the demo model (6 x 384, vocabulary 4096) at batch 8 x 128
# tokens, one process with 2 OpenMP threads against `mpirun -np 2` with train.tp = 2 and one
# thread per rank (the same training: tests/dist_mpi/tp_test.cpp checks it matches one process).
# Prints the mean tokens/s and step time of steps 2..STEPS, and the TP group's counted
# collectives of the last step beside the formula: per block 2 all-reduces forward + 2 backward
# of B x T x C floats, plus the embedding's and the classifier's (B x T x C each) and the loss's
# (B x T doubles and 2 B x T floats).
# Usage: bench/tp_cpu.sh [BUILD] [STEPS]   (needs data/fortunes: the Makefile rule makes it)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-8}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
COMMON="train.max_steps=$STEPS train.eval_every=0 train.log_every=1 sample.max_tokens=0
        io.save_final=false io.checkpoint_every=0"
OMP_NUM_THREADS=2 "$BIN" train configs/demo.toml --set $COMMON io.out_dir=$OUT/one \
    >"$OUT/one.log" 2>&1 || { cat "$OUT/one.log"; exit 1; }
mpirun --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=1 \
    "$BIN" train configs/demo.toml --set $COMMON train.tp=2 io.out_dir=$OUT/tp \
    >"$OUT/tp.log" 2>&1 || { cat "$OUT/tp.log"; exit 1; }
python3 - "$OUT/one.log" "$OUT/tp.log" <<'PY'
import re, sys
def steps(path):
    text = open(path).read()
    rows = re.findall(r"step +(\d+)/\d+ \| loss ([\d.]+) .*?\| +(\d+) tok/s \| +([\d.]+) ms", text)
    later = [r for r in rows if int(r[0]) > 1]
    return text, rows, sum(float(r[2]) for r in later) / len(later), sum(float(r[3]) for r in later) / len(later)
_, one, one_tps, one_ms = steps(sys.argv[1])
text, tp, tp_tps, tp_ms = steps(sys.argv[2])
print(f"{'run':<34} {'tokens/s':>9} {'step ms':>9} {'vs 1 process':>13} {'last loss':>10}")
print(f"{'1 process, 2 threads':<34} {one_tps:>9.0f} {one_ms:>9.1f} {1.0:>12.2f}x {one[-1][1]:>10}")
print(f"{'mpirun -np 2, train.tp = 2':<34} {tp_tps:>9.0f} {tp_ms:>9.1f} {tp_tps / one_tps:>12.2f}x {tp[-1][1]:>10}")
g = re.search(r"tensor parallel, last step's collectives: (.*); ([\d.]+) MiB in all, ([\d.]+) ms inside", text)
L, B, T, C = 6, 8, 128, 384
N = B * T
formula = (4 * L * N * C + 2 * N * C + 2 * N) * 4 + N * 8
print(f"counted: {g.group(1)}")
print(f"all-reduced per step: counted {float(g.group(2)):.3f} MiB, formula "
      f"(4 L + 2) B T C x 4 B + B T (2 x 4 + 8) B = {formula / 2**20:.3f} MiB; "
      f"{float(g.group(3)):.1f} ms of the step inside the collectives")
PY
