#!/usr/bin/env bash
# Remat that rebuilds block inputs under model parallelism (issue 27), measured on the CPU engine
# at 2 ranks: the demo model deepened to 12 blocks (6 x 384, micro-batch 8 x 128, bf16 GEMMs where
# the CPU has them) as a 2-stage 1F1B pipeline (6 blocks per stage) and as tensor parallelism
# (tp 2, with sequence parallelism), 3 steps each, the last timed. For each policy it prints rank
# 0's measured and predicted activation bytes, the step time and its ratio to `full`'s, and the
# whole run's final loss (bitwise the same under every policy of a layout).
# Usage: bench/remat_parallel.sh [BUILD]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=out/remat_parallel
mkdir -p "$OUT"
MPIRUN="mpirun --oversubscribe --allow-run-as-root -n 2"
RUN="model.n_layer=12 train.eval_every=0 sample.max_tokens=0 io.save_final=false
io.checkpoint_every=0 train.max_steps=3"
export OMP_NUM_THREADS=1
printf '%-28s %-12s %9s %9s %9s %9s  %s\n' layout policy "act MiB" predicted "step ms" \
    "vs full" "loss"
for layout in "train.pp=2" "train.tp=2 train.sequence_parallel=true"; do
    full_ms=""
    for p in full none selective chen:3 revolve:1 memory-poor; do
        dir="$OUT/${layout//[ =.]/_}_${p//:/_}"
        $MPIRUN "$BIN" train configs/demo.toml --overwrite --set io.out_dir="$dir" $RUN \
            $layout train.remat="$p" >"$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
        read -r act pred ms loss < <(/usr/bin/python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
mem = json.load(open(f"{d}/memory.json"))
act = next(c for c in mem["categories"] if c["name"] == "activations")
step = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"ms_per_step"' in l][-1]
print(f'{act["peak"] / 2**20:.2f} {act["predicted"] / 2**20:.2f} {step["ms_per_step"]:.0f} '
      f'{step["loss"]:.6f}')
PY
        )
        [ -n "$full_ms" ] || full_ms=$ms
        printf '%-28s %-12s %9s %9s %9s %8.2fx  %s\n' "${layout%% *}" "$p" "$act" "$pred" "$ms" \
            "$(echo "$ms / $full_ms" | bc -l)" "$loss"
    done
done
