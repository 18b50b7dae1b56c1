#!/usr/bin/env bash
# LoRA and QLoRA fine-tuning against full fine-tuning on the CPU: the demo model (6 x 384,
# trained on Debian's fortunes, cached under out/lora_bench/base) is fine-tuned on a second
# corpus, the Jargon File from Debian's dict-jargon package (hacker slang, a domain shift from the
# fortunes), for STEPS steps by: full fine-tuning, LoRA r=8 on the attention projections, LoRA
# r=16 on every linear, and QLoRA (NF4 base) r=16 on every linear. For each it prints the held-out
# jargon loss before and after, tokens/s, and the memory by category, measured and predicted
# (both from the run's memory.json).
# Usage: bench/lora_cpu.sh [BUILD] [STEPS]   (installs dict-jargon with apt-get when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-150}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
if [ ! -f /usr/share/dictd/jargon.dict.dz ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dict-jargon >/dev/null
fi
OUT=out/lora_bench
mkdir -p "$OUT" data/jargon
if [ ! -f data/jargon/val.bin ]; then
    # One document per lexicon entry: an entry starts at an unindented line after a blank line.
    zcat /usr/share/dictd/jargon.dict.dz | python3 -c '
import re, sys
text = sys.stdin.read()
entries = [e.strip() for e in re.split(r"\n\s*\n(?=\S)", text) if e.strip()]
sys.stdout.write("\n%\n".join(entries) + "\n")' >data/jargon/jargon.txt
    "$BIN" tokenize --tokenizer data/fortunes/tokenizer.json --out data/jargon --doc-separator % \
        --val-fraction 0.05 data/jargon/jargon.txt >/dev/null
fi
if [ ! -f "$OUT/base/latest" ]; then
    echo "training the base model (configs/demo.toml, 300 steps on the fortunes) ..."
    "$BIN" train configs/demo.toml --set io.out_dir=$OUT/base train.device=cpu \
        sample.max_tokens=0 >"$OUT/base.log" 2>&1 || { tail -20 "$OUT/base.log"; exit 1; }
fi
BASE=$OUT/base/$(cat $OUT/base/latest)
before=$("$BIN" eval "$BASE" --data data/jargon/val.bin --json)
run() {  # name, --set arguments
    local name=$1
    shift
    "$BIN" train configs/demo.toml --set model.init_from=$BASE data.train=data/jargon/train.bin \
        data.val=data/jargon/val.bin train.device=cpu train.max_steps=$STEPS train.eval_every=0 \
        optim.warmup_steps=10 sample.max_tokens=0 io.checkpoint_every=0 io.out_dir=$OUT/$name "$@" \
        --overwrite >"$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
}
run full optim.lr=3e-4
run lora-r8-attn optim.lr=2e-3 lora.rank=8 lora.alpha=16 lora.targets=attn
run lora-r16-all optim.lr=2e-3 lora.rank=16 lora.alpha=32 lora.targets=all
run qlora-nf4-r16-all optim.lr=2e-3 lora.rank=16 lora.alpha=32 lora.targets=all lora.base=nf4
python3 - "$OUT" "$before" "$STEPS" <<'PY'
import json, sys
out, before, steps = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
print("demo 6x384 from the fortunes, fine-tuned %s steps on the Jargon File (batch 8 x 128)" % steps)
print("held-out jargon loss before fine-tuning: %.4f (perplexity %.1f)" % (before["loss"], 2.718281828 ** before["loss"]))
mib = lambda b: "%.1f" % (b / 1048576)
rows = []
for name in ["full", "lora-r8-attn", "lora-r16-all", "qlora-nf4-r16-all"]:
    mem = {c["name"]: c for c in json.load(open("%s/%s/memory.json" % (out, name)))["categories"]}
    lines = [json.loads(l) for l in open("%s/%s/metrics.jsonl" % (out, name))]
    val = [l["val_loss"] for l in lines if "val_loss" in l][-1]
    tps = [l["tokens_per_s"] for l in lines if "tokens_per_s" in l][1:]
    cats = ["parameters", "gradients", "optimizer_state", "activations", "workspace"]
    meas = sum(mem[c]["peak"] for c in cats)
    pred = sum(mem[c]["predicted"] or 0 for c in cats)
    states = sum(mem[c]["peak"] for c in cats[:3])
    rows.append((name, val, sum(tps) / len(tps), mem, states, meas, pred))
full_states = rows[0][4]
print("| run | jargon val loss | tok/s | parameters | gradients | optimizer | activations | workspace | model states | total measured | total predicted |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for name, val, tps, mem, states, meas, pred in rows:
    print("| %s | %.4f | %.0f | %s | %s | %s | %s | %s | %s MiB (%.1f%% of full) | %s MiB | %s MiB |" % (
        name, val, tps, *[mib(mem[c]["peak"]) for c in ["parameters", "gradients", "optimizer_state", "activations", "workspace"]],
        mib(states), 100.0 * states / full_states, mib(meas), mib(pred)))
PY
