#!/usr/bin/env bash
# The joint remat solver against the structured schedules that rebuild block inputs (issue 27),
# measured on the CPU engine: a deep, narrow GPT (48 blocks of 256, 4 heads, micro-batch 2 x 128,
# fp32, log-sum-exp attention) over the fortunes corpus, 3 steps each, the last timed. For
# `full`, `chen:7`, `revolve:6`, `memory-poor` and budget:BYTES at memory-poor's floor plus 1, 2,
# 4 and 8 residual streams, it prints the measured and predicted activation bytes, the step time,
# its ratio to `full`'s, and the plan's analytic recompute.
# Usage: bench/remat_joint.sh [BUILD]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=out/remat_joint
mkdir -p "$OUT"
SHAPE="model.n_layer=48 model.n_head=4 model.n_embd=256 model.block_size=128 train.seq_len=128
train.batch_size=2 train.device=cpu train.precision=fp32 train.cpu_attention=lse"
RUN="train.eval_every=0 sample.max_tokens=0 io.save_final=false io.checkpoint_every=0
train.max_steps=3"
# Memory-poor's floor and one residual stream (B x T x C fp32), from the plan.
floor=$("$BIN" remat configs/demo.toml --set $SHAPE train.remat=memory-poor |
    sed -n 's/^predicted peak activation memory: .*(\([0-9]*\) B)$/\1/p')
stream=$((2 * 128 * 256 * 4))
POLICIES="full chen:7 revolve:6 memory-poor"
for k in 1 2 4 8; do POLICIES="$POLICIES budget:$((floor + k * stream))"; done
printf '%-20s %9s %9s %9s %9s %10s  %s\n' policy "act MiB" predicted "step ms" "vs full" \
    recompute "plan"
full_ms=""
for p in $POLICIES; do
    dir="$OUT/${p//:/_}"
    "$BIN" train configs/demo.toml --overwrite --set io.out_dir="$dir" $SHAPE $RUN \
        train.remat="$p" >"$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
    read -r act pred ms < <(/usr/bin/python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
mem = json.load(open(f"{d}/memory.json"))
act = next(c for c in mem["categories"] if c["name"] == "activations")
step = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"ms_per_step"' in l][-1]
print(f'{act["peak"] / 2**20:.2f} {act["predicted"] / 2**20:.2f} {step["ms_per_step"]:.0f}')
PY
    )
    [ -n "$full_ms" ] || full_ms=$ms
    plan=$("$BIN" remat configs/demo.toml --set $SHAPE train.remat="$p" |
        sed -n 's/^predicted recompute overhead: .* = \(.*\) of a step$/\1/p')
    letters=$(awk '$1 ~ /^[0-9]+$/ { printf "%s", toupper(substr($2 == "segment" ? "g" : $2, 1, 1)) }' \
        < <("$BIN" remat configs/demo.toml --set $SHAPE train.remat="$p"))
    printf '%-20s %9s %9s %9s %8.2fx %10s  %s\n' "$p" "$act" "$pred" "$ms" \
        "$(echo "$ms / $full_ms" | bc -l)" "$plan" "$letters"
done
