#!/usr/bin/env bash
# train.cpu_activations = fp32, bf16 and int8 on the CPU engine, one after the other on the same
# machine: the demo (6 x 384, fortunes corpus, bf16 GEMMs where the CPU has them) for STEPS
# steps with validation every 50. Prints per storage the measured activation bytes (and the
# prediction), the validation losses, the final one against fp32's, and the median step time of
# steps 6 and on.
# Usage: bench/cpu_activations.sh [BUILD] [STEPS]   e.g. bench/cpu_activations.sh build 200
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-200}
BIN=$BUILD/memtrain
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=out/cpu_activations
mkdir -p "$OUT"
for a in fp32 bf16 int8; do
    "$BIN" train configs/demo.toml --overwrite --set io.out_dir="$OUT/$a" train.device=cpu \
        train.max_steps="$STEPS" train.eval_every=50 train.log_every=50 io.checkpoint_every=0 \
        io.save_final=false sample.max_tokens=0 train.cpu_activations="$a" >"$OUT/$a.log" 2>&1 ||
        { tail -20 "$OUT/$a.log"; exit 1; }
done
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for a in ("fp32", "bf16", "int8"):
    val, ms = [], []
    for line in open(f"{out}/{a}/metrics.jsonl"):
        j = json.loads(line)
        if "val_loss" in j:
            val.append(j["val_loss"])
        elif "ms_per_step" in j and j["step"] > 5:
            ms.append(j["ms_per_step"])
    mem = json.load(open(f"{out}/{a}/memory.json"))
    act = next(c for c in mem["categories"] if c["name"] == "activations")
    ms.sort()
    rows[a] = (act["peak"] / 2**20, act["predicted"] / 2**20, val, ms[len(ms) // 2])
print(f"{'stored':6} {'act MiB':>8} {'predicted':>9}  {'val loss at each eval':<40} {'vs fp32':>8} {'ms/step':>8}")
base = rows["fp32"][2][-1]
for a, (act, pred, val, ms) in rows.items():
    print(f"{a:6} {act:8.1f} {pred:9.1f}  {' '.join(f'{v:.4f}' for v in val):<40} "
          f"{100 * (val[-1] - base) / base:+7.2f}% {ms:8.1f}")
PY
