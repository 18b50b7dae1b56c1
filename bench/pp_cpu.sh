#!/usr/bin/env bash
# Pipeline bubble on the CPU: the demo model split over `mpirun -np 2` (one thread per rank),
# GPipe, 1F1B and ZB-H1 with m = 1, 2, 4, 8 micro-batches of MB sequences per step, and
# interleaved with 2 chunks per rank (4 virtual stages) for m = 2, 4, 8 (m must be even). For each run the
# executor measures the bubble (1 - mean busy / makespan, every step after the first, each step
# started at a barrier) and the simulator predicts it from the stages' measured forward and
# backward times on the same schedule lists; the script prints both and their ratio, beside the
# closed form (p - 1) / (m + p - 1) for equal stages ((p - 1) / (v m + p - 1) interleaved).
# Usage: bench/pp_cpu.sh [BUILD] [STEPS] [MB]   (needs data/fortunes: the Makefile rule makes it)
# SCHEDULES picks the schedules; EXTRA adds --set keys to every run (PipeDream needs
# EXTRA="model.tied_embeddings=false optim.grad_clip=0").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-8}
MB=${3:-2}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "demo 6x384 over 2 stages, micro-batch $MB x 128 tokens, $STEPS steps (bubble over steps 2..$STEPS)"
printf "%-9s %3s %10s %10s %8s %12s %12s\n" schedule m measured simulated ratio "closed form" "step ms"
SCHEDULES=${SCHEDULES:-gpipe 1f1b zb-h1 interleaved}
EXTRA=${EXTRA:-}
for sched in $SCHEDULES; do
    v=1
    [ "$sched" = interleaved ] && v=2
    for m in 1 2 4 8; do
        [ "$sched" = interleaved ] && [ "$m" = 1 ] && continue
        log=$OUT/$sched$m.log
        mpirun --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=1 \
            "$BIN" train configs/demo.toml --set train.pp=2 train.pp_schedule=$sched \
            train.pp_virtual=$v \
            train.micro_batch_size=$MB train.batch_size=$((MB * m)) train.max_steps=$STEPS \
            train.eval_every=0 train.log_every=100 sample.max_tokens=0 io.save_final=false \
            io.checkpoint_every=0 io.out_dir=$OUT/$sched$m $EXTRA >"$log" 2>&1 || { cat "$log"; exit 1; }
        python3 - "$log" "$sched" "$m" "$v" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
g = re.search(r"pipeline bubble: measured ([\d.]+)% .* simulated ([\d.]+)% .* step ([\d.]+) ms measured", text)
if not g:
    sys.exit("no 'pipeline bubble' line in the run's output:\n" + text[-2000:])
meas, sim, ms = float(g.group(1)), float(g.group(2)), float(g.group(3))
m, v = int(sys.argv[3]), int(sys.argv[4])
closed = 100.0 * 1 / (v * m + 1)
name = sys.argv[2] if v == 1 else f"{sys.argv[2][:5]} v={v}"
print(f"{name:<9} {m:>3} {meas:>9.1f}% {sim:>9.1f}% {meas / sim if sim else float('nan'):>8.2f} {closed:>11.1f}% {ms:>12.1f}")
PY
    done
done
