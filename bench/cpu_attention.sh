#!/usr/bin/env bash
# train.cpu_attention = "lse" against "probs" on the CPU engine, in the same run: the demo model
# (6 x 384, fortunes corpus) at sequence lengths 256, 512 and 1024 (two sequences a step, 8 steps,
# each mode run twice, alternating, and the faster run kept). Prints per length the measured
# activation bytes of each mode, the step time, and the ratios (lse / probs).
# Usage: bench/cpu_attention.sh [BUILD] [LENGTHS]   e.g. bench/cpu_attention.sh build "512 1024"
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
LENGTHS=${2:-256 512 1024}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=out/cpu_attention
mkdir -p "$OUT"
run() {  # mode T -> "activation_MiB step_ms"
    "$BIN" train configs/demo.toml --overwrite --set io.out_dir="$OUT/$1_$2" train.device=cpu \
        model.block_size="$2" train.seq_len="$2" train.batch_size=2 train.max_steps=8 \
        train.eval_every=0 train.log_every=1 io.checkpoint_every=0 io.save_final=false \
        sample.max_tokens=0 train.cpu_attention="$1" >"$OUT/$1_$2.log" 2>&1 ||
        { tail -20 "$OUT/$1_$2.log"; exit 1; }
    local act ms
    act=$(awk '$1 == "activations" { print $2; exit }' "$OUT/$1_$2.log")
    ms=$(grep -E '^step +8/8' "$OUT/$1_$2.log" | sed -E 's/.*\| +([0-9.]+) ms.*/\1/')
    echo "$act $ms"
}
printf '%6s  %14s %14s %8s  %12s %12s %8s\n' T "probs act MiB" "lse act MiB" ratio \
    "probs ms" "lse ms" ratio
for T in $LENGTHS; do
    best_p=; best_l=
    for rep in 1 2; do
        read -r ap mp < <(run probs "$T")
        read -r al ml < <(run lse "$T")
        if [ -z "$best_p" ] || awk "BEGIN { exit !($mp < $best_p) }"; then best_p=$mp; fi
        if [ -z "$best_l" ] || awk "BEGIN { exit !($ml < $best_l) }"; then best_l=$ml; fi
    done
    awk -v T="$T" -v ap="$ap" -v al="$al" -v mp="$best_p" -v ml="$best_l" 'BEGIN {
        printf "%6d  %14.1f %14.1f %8.2f  %12.1f %12.1f %8.2f\n", T, ap, al, al / ap, mp, ml, ml / mp }'
done
