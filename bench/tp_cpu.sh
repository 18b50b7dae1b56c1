#!/usr/bin/env bash
# Tensor parallelism on the CPU: the demo model (6 x 384, vocabulary 4096) at batch 8 x 128
# tokens, one process with 2 OpenMP threads against `mpirun -np 2` with train.tp = 2 and one
# thread per rank, without and with train.sequence_parallel (the same training:
# tests/mpi/tp_test.cpp checks both match one process). Prints the mean tokens/s and step
# time of steps 2..STEPS, the activation and workspace bytes per rank (the memory report's
# measured current bytes, equal to its prediction), and the TP group's counted collectives of
# the last step beside the formula: TP per block 2 all-reduces forward + 2 backward of
# B x T x C floats, plus the embedding's and the classifier's (B x T x C each) and the loss's
# (B x T doubles and 2 B x T floats); SP per block 2 all-gathers + 2 reduce-scatters forward,
# 4 all-gathers (2 of them re-gathers) + 2 reduce-scatters backward, plus the embedding's, ln_f's
# and the classifier's, the loss's, and one all-reduce of the norm gradients per step.
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
mpirun --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=1 \
    "$BIN" train configs/demo.toml --set $COMMON train.tp=2 train.sequence_parallel=true \
    io.out_dir=$OUT/sp >"$OUT/sp.log" 2>&1 || { cat "$OUT/sp.log"; exit 1; }
python3 - "$OUT/one.log" "$OUT/tp.log" "$OUT/sp.log" <<'PY'
import re, sys
def steps(path):
    text = open(path).read()
    rows = re.findall(r"step +(\d+)/\d+ \| loss ([\d.]+) .*?\| +(\d+) tok/s \| +([\d.]+) ms", text)
    later = [r for r in rows if int(r[0]) > 1]
    act = re.search(r"^activations +([\d.]+) MiB", text, re.M)
    work = re.search(r"^workspace +([\d.]+) MiB", text, re.M)
    return (text, rows, sum(float(r[2]) for r in later) / len(later),
            sum(float(r[3]) for r in later) / len(later), float(act.group(1)), float(work.group(1)))
_, one, one_tps, one_ms, one_act, one_work = steps(sys.argv[1])
print(f"{'run':<46} {'tokens/s':>9} {'step ms':>9} {'vs 1 process':>13} {'last loss':>10} "
      f"{'act MiB/rank':>13} {'work MiB/rank':>14}")
print(f"{'1 process, 2 threads':<46} {one_tps:>9.0f} {one_ms:>9.1f} {1.0:>12.2f}x {one[-1][1]:>10} "
      f"{one_act:>13.1f} {one_work:>14.1f}")
L, B, T, C = 6, 8, 128, 384
N = B * T
runs = []
for name, path in (("mpirun -np 2, train.tp = 2", sys.argv[2]),
                   ("mpirun -np 2, train.tp = 2 + sequence_parallel", sys.argv[3])):
    text, rows, tps, ms, act, work = steps(path)
    print(f"{name:<46} {tps:>9.0f} {ms:>9.1f} {tps / one_tps:>12.2f}x {rows[-1][1]:>10} "
          f"{act:>13.1f} {work:>14.1f}")
    g = re.search(r"tensor parallel, last step's collectives: (.*); ([\d.]+) MiB in all \(([\d.]+) "
                  r"MiB sent per rank by a ring\), ([\d.]+) ms inside", text)
    runs.append((name, g))
# Payload formulas (MiB): TP all-reduces (4 L + 2) N C floats + the loss's statistics; SP
# reduce-scatters and all-gathers (4 L + 2) N C each, the re-gathers 2 L N C, the loss's
# statistics, and the norm gradients (2 L + 1) x 2 C floats. A ring over 2 ranks sends half of
# each reduce-scatter's / all-gather's buffer and the whole of each all-reduce's.
loss = 2 * N * 4 + N * 8
formula = {runs[0][0]: ((4 * L + 2) * N * C * 4 + loss, (4 * L + 2) * N * C * 4 + loss),
           runs[1][0]: ((10 * L + 4) * N * C * 4 + loss + (2 * L + 1) * 2 * C * 4,
                        (10 * L + 4) * N * C * 4 / 2 + loss + (2 * L + 1) * 2 * C * 4)}
for name, g in runs:
    payload, ring = formula[name]
    print(f"{name}: counted {g.group(1)}")
    print(f"  payload per step: counted {float(g.group(2)):.3f} MiB, formula {payload / 2**20:.3f} MiB; "
          f"sent per rank (ring): counted {float(g.group(3)):.3f} MiB, formula {ring / 2**20:.3f} MiB; "
          f"{float(g.group(4)):.1f} ms of the step inside the collectives")
PY
