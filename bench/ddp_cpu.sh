#!/usr/bin/env bash
# Data-parallel throughput on the CPU: the demo model at the same global batch, one process
# (all cores) against `mpirun -np 2` (the cores split between the ranks), for ZeRO stages 0-3.
# Each configuration runs STEPS steps; tokens/s is the mean over steps 2..STEPS from the
# metrics file. Prints one line per configuration and its ratio to the single process.
# Usage: bench/ddp_cpu.sh [BUILD] [STEPS]   (needs data/fortunes: make demo or the Makefile rule)
#        EXTRA="optim.name=muon" bench/ddp_cpu.sh ...   (more --set keys for every run)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-12}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SETS=(train.max_steps=$STEPS train.batch_size=16 train.eval_every=0 train.log_every=100
      sample.max_tokens=0 io.save_final=false ${EXTRA:-})
mean_tps() {  # mean tokens/s of steps 2.. in a metrics file
    python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
v = [r["tokens_per_s"] for r in rows[1:]]
print(f"{sum(v) / len(v):.1f}")
PY
}
run() {  # name, launcher..., then memtrain args
    local name=$1; shift
    "$@" >/dev/null
    mean_tps "$OUT/$name/metrics.jsonl"
}
NP=$(nproc)
base=$(run one env OMP_NUM_THREADS=$NP "$BIN" train configs/demo.toml --set "${SETS[@]}" \
       io.out_dir=$OUT/one)
echo "demo 6x384, global batch 16 x 128 tokens, $STEPS steps, $NP cores"
printf "%-28s %10s tok/s  %s\n" "1 process, $NP threads" "$base" "1.00x"
for z in 0 1 2 3; do
    tps=$(run z$z mpirun --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=$((NP / 2 > 0 ? NP / 2 : 1)) \
          "$BIN" train configs/demo.toml --set "${SETS[@]}" train.zero_stage=$z io.out_dir=$OUT/z$z)
    printf "%-28s %10s tok/s  %sx\n" "2 ranks, ZeRO stage $z" "$tps" \
        "$(python3 -c "print(f'{$tps / $base:.2f}')")"
done
