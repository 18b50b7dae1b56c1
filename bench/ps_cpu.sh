#!/usr/bin/env bash
# Parameter server against ring all-reduce on the CPU: the demo model at the same global batch,
# `mpirun -np 2` all-reduce (2 workers) against `mpirun -np 3` parameter server (1 server + 2
# workers), synchronous and with staleness 1. One OpenMP thread per rank. Each configuration runs
# STEPS steps; the step time is the mean of steps 2..STEPS from the metrics file, the bytes per
# step come from the run's memory footer: counted for the parameter server, the ring formula
# 2 Ψ (N-1)/N per rank for all-reduce (MPI may pick another algorithm; the bytes are the ring's).
# Usage: bench/ps_cpu.sh [BUILD] [STEPS]   (needs data/fortunes: make demo or the Makefile rule)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-12}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SETS=(train.max_steps=$STEPS train.batch_size=16 train.eval_every=0 train.log_every=100
      sample.max_tokens=0 io.save_final=false train.device=cpu)
MPI=(mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1)
mean_ms() {  # mean ms per step of steps 2.. in a metrics file
    python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"ms_per_step"' in l]
v = [r["ms_per_step"] for r in rows[1:]]
print(f"{sum(v) / len(v):.1f}")
PY
}
# name, np, extra --set ...: prints "ms all_links_MiB busiest_rank_MiB" (busiest: sent + received)
run() {
    local name=$1 np=$2; shift 2
    "${MPI[@]}" -np "$np" "$BIN" train configs/demo.toml --set "${SETS[@]}" "$@" \
        io.out_dir="$OUT/$name" >"$OUT/$name.log"
    local ms; ms=$(mean_ms "$OUT/$name/metrics.jsonl")
    python3 - "$OUT/$name.log" "$ms" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"ps traffic per step: worker 0 sent ([\d.]+) MiB received ([\d.]+) MiB \| "
              r"server 0 sent ([\d.]+) MiB received ([\d.]+) MiB \| all links ([\d.]+) MiB", text)
if m:
    w_s, w_r, s_s, s_r, links = map(float, m.groups())
    print(sys.argv[2], f"{links:.1f}", f"{s_s + s_r:.1f}")
else:
    m = re.search(r"= ([\d.]+) MiB per rank, ([\d.]+) MiB over all links", text)
    per, links = map(float, m.groups())
    # A ring rank sends and receives the same amount.
    print(sys.argv[2], f"{links:.1f}", f"{2 * per:.1f}")
PY
}
read -r ar_ms ar_links ar_busy < <(run allreduce 2)
echo "demo 6x384, global batch 16 x 128 tokens, $STEPS steps, $(nproc) cores, 1 thread per rank"
printf "%-42s %9s %8s %16s %18s\n" "configuration" "ms/step" "vs AR" "MiB/step (links)" "MiB/step (busiest)"
printf "%-42s %9s %8s %16s %18s\n" "all-reduce, -np 2 (2 workers)" "$ar_ms" "1.00x" "$ar_links" "$ar_busy"
for k in 0 1; do
    read -r ms links busy < <(run ps$k 3 train.dp_mode=ps train.ps_staleness=$k)
    printf "%-42s %9s %8s %16s %18s\n" "parameter server, -np 3 (1+2), staleness $k" "$ms" \
        "$(python3 -c "print(f'{$ms / $ar_ms:.2f}x')")" "$links" "$busy"
done
