#!/usr/bin/env bash
# How low the CPU engine's activation memory goes, and what each step costs (issue 27), on a
# GPT-2 124M-shaped model (12 x 768, 12 heads, over the fortunes corpus' 4096-token vocabulary)
# at B = 1, bf16 GEMMs where the CPU has them. Prints:
#   1. at T = 4096, a measured step (the second) under each policy: no remat (fp32 saved fields, attention
#      probabilities kept), full, no remat with int8 fields and log-sum-exp attention, and the
#      lowest plan (memory-poor with log-sum-exp attention), and that plan with the norms and the MLP
#      over tiles of 256 rows (train.mlp_tile; fp32 saved fields): activation bytes measured and
#      predicted, the ratio to no remat, the step time and its overhead;
#   2. the longest T (a multiple of 256) whose whole step fits a 4 GiB host under each, found
#      from the run plan (`memtrain train --print-plan`'s host total) and, where a step there
#      takes minutes at most, confirmed by one measured step (its process peak RSS);
#   3. for the 48-layer GPT-2 1.5B shape at B = 1, T = 1024, the planned activation bytes at
#      12, 24, 36 and 48 layers under none, full and memory-poor.
# Usage: bench/activation_floor.sh [BUILD] [CONFIRM_MAX_T]   e.g. bench/activation_floor.sh build
# ORDER="none lowest tiled" PARTS=1 bench/activation_floor.sh build: those policies, part 1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
CONFIRM_MAX_T=${2:-8192}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=out/activation_floor
mkdir -p "$OUT"
SHAPE="model.n_layer=12 model.n_head=12 model.n_embd=768 train.batch_size=1 train.device=cpu"
RUN="train.eval_every=0 sample.max_tokens=0 io.save_final=false io.checkpoint_every=0"
declare -A POLICY=(
    [none]="train.remat=none train.cpu_activations=fp32 train.cpu_attention=probs"
    [full]="train.remat=full train.cpu_activations=fp32 train.cpu_attention=probs"
    [int8_lse]="train.remat=none train.cpu_activations=int8 train.cpu_attention=lse"
    [lowest]="train.remat=memory-poor train.cpu_attention=lse"
    [tiled]="train.remat=memory-poor train.cpu_attention=lse train.cpu_activations=fp32
             train.mlp_tile=256"
)
ORDER=${ORDER:-"none full int8_lse lowest tiled"}
PARTS=${PARTS:-123}

# Two steps, the second measured (the first pays the first touch of every page): "act_MiB
# predicted_MiB step_s peak_rss_MiB".
measure() {  # name T
    local dir="$OUT/$1_$2"
    "$BIN" train configs/demo.toml --overwrite --set io.out_dir="$dir" $SHAPE $RUN \
        model.block_size="$2" train.seq_len="$2" train.max_steps=2 ${POLICY[$1]} \
        >"$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
    /usr/bin/python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
mem = json.load(open(f"{d}/memory.json"))
act = next(c for c in mem["categories"] if c["name"] == "activations")
step = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"ms_per_step"' in l][-1]
print(act["peak"] / 2**20, act["predicted"] / 2**20, step["ms_per_step"] / 1e3,
      mem["process_peak_rss"] / 2**20)
PY
}

# The run plan's host total (MiB) at T.
planned() {  # name T
    "$BIN" train configs/demo.toml --set $SHAPE $RUN model.block_size="$2" train.seq_len="$2" \
        ${POLICY[$1]} --print-plan 2>&1 | awk '$1 == "host" && $2 == "total" { print $3 }' || true
}

echo "1. GPT-2 124M shape, B = 1, T = 4096: the second step of each"
printf '%-9s %12s %12s %9s %9s %9s\n' policy "act MiB" predicted "of none" "step s" overhead
declare -A ACT STEP
for p in $ORDER; do
    read -r act pred step rss <<<"$(measure "$p" 4096)"
    ACT[$p]=$act
    STEP[$p]=$step
    printf '%-9s %12.1f %12.1f %9s %9.1f %9s\n' "$p" "$act" "$pred" \
        "1/$(/usr/bin/python3 -c "print(round(${ACT[none]} / $act, 1))")" "$step" \
        "$(/usr/bin/python3 -c "print(f'{100 * ($step / ${STEP[none]} - 1):+.0f}%')")"
done

[[ $PARTS == *2* ]] || exit 0
echo
echo "2. the longest T whose step fits 4 GiB of host memory (plan), confirmed where T <= $CONFIRM_MAX_T"
printf '%-9s %8s %14s %16s\n' policy "T max" "plan MiB" "measured RSS MiB"
for p in $ORDER; do
    lo=256 hi=65536
    while [ $((hi - lo)) -gt 256 ]; do
        mid=$(((lo + hi) / 512 * 256))
        total=$(planned "$p" "$mid")
        if [ -n "$total" ] && /usr/bin/python3 -c "import sys; sys.exit(0 if $total <= 4096 else 1)"; then
            lo=$mid
        else
            hi=$mid
        fi
    done
    rss="(not run: a step at this T takes too long here)"
    if [ "$lo" -le "$CONFIRM_MAX_T" ]; then
        read -r _ _ _ rss <<<"$(measure "$p" "$lo")"
        rss=$(printf '%.1f' "$rss")
    fi
    printf '%-9s %8d %14s %16s\n' "$p" "$lo" "$(planned "$p" "$lo")" "$rss"
done

[[ $PARTS == *3* ]] || exit 0
echo
echo "3. GPT-2 1.5B width (1600, 25 heads), B = 1, T = 1024: planned activation MiB by depth"
printf '%-8s %10s %10s %12s\n' layers none full memory-poor
for L in 12 24 36 48; do
    row=""
    for r in none full memory-poor; do
        # (The plan only: 1.5B's model states alone need more than this host has.)
        a=$(MEMTRAIN_HOST_MEMORY=1024GiB "$BIN" train configs/demo.toml --set model.n_layer="$L" model.n_head=25 \
            model.n_embd=1600 model.block_size=1024 train.seq_len=1024 train.batch_size=1 \
            train.device=cpu train.remat="$r" train.cpu_attention=lse $RUN --print-plan 2>&1 |
            awk '$1 == "activations" { print $2 }' || true)
        row="$row $a"
    done
    printf '%-8s %10s %10s %12s\n' "$L" $row
done
