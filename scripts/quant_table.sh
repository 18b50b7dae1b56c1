#!/usr/bin/env bash
# Produces the results table of docs/quantization.md: trains the demo GPT on Debian's fortunes
# (cached under out/quant_demo/), quantizes it with every method and measures held-out perplexity.
# Usage: bash scripts/quant_table.sh   (env: BUILD=build STEPS=400 SEEDS="0 1 2" KASHIN_BITS="4 5 6"
# LOW_SEEDS="0" PART=all|main|low|render: main = the 4-8 bit rows, low = the 3- and 2-bit rows,
# render = only rebuild the table from the rows measured so far)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${STEPS:-400}
SEEDS=${SEEDS:-"0 1 2"}
KASHIN_BITS=${KASHIN_BITS:-"4 5 6"}
LOW_SEEDS=${LOW_SEEDS:-"0"}
PART=${PART:-all}
M=$BUILD/memtrain
W=${W:-out/quant_demo}
EVAL_ARGS=${EVAL_ARGS:-}  # e.g. "--max-batches 2" for a quick check of the script
DATA=data/fortunes
FORTUNES=/usr/share/games/fortunes
mkdir -p "$W/q"

[ -x "$M" ] || { echo "quant_table: build memtrain first ($M missing)" >&2; exit 1; }
if [ ! -f $DATA/val.bin ]; then  # the same corpus as `make demo`
    mkdir -p $DATA
    files=$(find $FORTUNES -maxdepth 1 -type f ! -name '*.dat' | sort)
    $M tokenizer train --vocab-size 4096 --doc-separator % --out $DATA/tokenizer.json $files
    $M tokenize --tokenizer $DATA/tokenizer.json --out $DATA --doc-separator % \
        --val-fraction 0.05 $files
fi
CKPT=$W/run/ckpt_$(printf %06d "$STEPS")
if [ ! -d "$CKPT" ]; then
    echo "quant_table: training the demo model for $STEPS steps into $W/run"
    $M train configs/demo.toml --set train.max_steps="$STEPS" --set io.out_dir=$W/run \
        --set io.checkpoint_every=100 --set train.eval_every=100 --set sample.max_tokens=0 \
        >$W/train.log 2>&1
fi

# One line of JSON per measured row; rows already measured for this checkpoint are skipped, so an
# interrupted run resumes.
RESULTS=$W/results-$STEPS.jsonl
touch "$RESULTS"
row() {  # row LABEL SEED [quantize arguments...]
    local label=$1 seed=$2 key
    shift 2
    key="$label|$seed"
    if grep -qF "\"key\": \"$key\"" "$RESULTS"; then return; fi
    local model=$CKPT qjson=null qsecs=0
    if [ $# -gt 0 ]; then
        model=$W/q/$(echo "$key" | tr -c 'a-zA-Z0-9\n' '_')
        local t0=$(date +%s.%N)
        $M quantize "$CKPT" "$@" --out "$model" >"$model.log" 2>&1 ||
            { cat "$model.log" >&2; exit 1; }
        qsecs=$(echo "$(date +%s.%N) - $t0" | bc)
        qjson=$model/quantization.json
    fi
    local ev
    ev=$($M eval "$model" --data $DATA/val.bin --seq-len 128 --json $EVAL_ARGS)
    python3 - "$key" "$label" "$seed" "$qjson" "$qsecs" "$ev" >>"$RESULTS" <<'EOF'
import json, sys
key, label, seed, qjson, qsecs, ev = sys.argv[1:]
r = {"key": key, "label": label, "seed": seed, "eval": json.loads(ev), "quant_seconds": float(qsecs)}
if qjson != "null":
    q = json.load(open(qjson))
    r["totals"] = q["totals"]
    r["iterations"] = [t.get("iterations") for t in q["tensors"]]
    r["rel_error"] = sum(t["rel_error"] for t in q["tensors"]) / len(q["tensors"])
print(json.dumps(r))
EOF
    echo "quant_table: $key done"
}

if [ "$PART" = all ] || [ "$PART" = main ]; then
    row "fp32" -
    row "RTN int8 per row" - --method rtn --bits 8
    row "RTN int4 per row" - --method rtn --bits 4
    row "RTN int4 per row, asym" - --method rtn-asym --bits 4
    row "RTN int4 group 64" - --method rtn --bits 4 --group 64
    row "NF4 block 64" - --method nf4
    row "NF4 + double quant" - --method nf4-dq
    row "per-tensor uniform 4" - --method uniform --bits 4
    row "per-tensor k-means 16" - --method kmeans --bits 4
    # Seed-major, so an interrupted run already has every bit width once.
    for s in $SEEDS; do
        for b in $KASHIN_BITS; do row "Kashin-2D k$b" "$s" --method kashin --bits "$b" --seed "$s"; done
        row "Kashin-DCT 2+2 per channel" "$s" --method kashin-dct --bits 4 --seed "$s"
    done
fi
if [ "$PART" = all ] || [ "$PART" = low ]; then
    # Below 4 bits the methods separate more clearly than at 4 bits on this small model.
    row "RTN int3 per row" - --method rtn --bits 3
    row "RTN int3 group 64" - --method rtn --bits 3 --group 64
    row "per-tensor uniform 3" - --method uniform --bits 3
    row "per-tensor k-means 8" - --method kmeans --bits 3
    row "RTN int2 group 64" - --method rtn --bits 2 --group 64
    row "per-tensor k-means 4" - --method kmeans --bits 2
    for s in $LOW_SEEDS; do
        row "Kashin-2D k3" "$s" --method kashin --bits 3 --seed "$s"
        row "Kashin-2D k2" "$s" --method kashin --bits 2 --seed "$s"
    done
fi

python3 - "$RESULTS" "$STEPS" "$SEEDS" >$W/table.md <<'EOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps, seeds = sys.argv[2], sys.argv[3].split()
order, by = [], {}
for r in rows:
    if r["label"] not in by: order.append(r["label"]); by[r["label"]] = []
    by[r["label"]].append(r)
fp32 = by["fp32"][0]["eval"]["perplexity"]
print(f"Demo GPT (6 x 384, 4096-token BPE) after {steps} steps on Debian fortunes; held-out "
      f"perplexity on data/fortunes/val.bin ({by['fp32'][0]['eval']['tokens']} tokens, windows of 128).")
print()
def low(label):
    t = by[label][0].get("totals")
    return t is not None and t["bpw_quantized"] < 3.9
for title, labels in (("4 bits and more", [l for l in order if not low(l)]),
                      ("below 4 bits", [l for l in order if low(l)])):
  if not labels: continue
  print()
  print(f"**{title}**")
  print()
  print("| method | bpw (quantized tensors) | bpw (whole model) | rel. weight error | perplexity | vs fp32 | Kashin iterations | fallbacks | quantize s |")
  print("|---|---|---|---|---|---|---|---|---|")
  for label in labels:
      rs = by[label]
      ppl = [r["eval"]["perplexity"] for r in rs]
      mean = sum(ppl) / len(ppl)
      if len(ppl) > 1:
          sd = math.sqrt(sum((p - mean) ** 2 for p in ppl) / (len(ppl) - 1))
          ppl_s = f"{mean:.2f} ± {sd:.2f} ({len(ppl)} seeds)"
      else:
          ppl_s = f"{mean:.2f}"
      t = rs[0].get("totals")
      bq = f"{t['bpw_quantized']:.4f}" if t else "32"
      bm = f"{t['bpw_model']:.4f}" if t else "32"
      err = f"{sum(r['rel_error'] for r in rs) / len(rs):.4f}" if t else "0"
      its = [i for r in rs for i in (r.get("iterations") or []) if i is not None]
      it_s = f"{min(its)}-{max(its)}" if its else "-"
      fb = f"{sum(r['totals']['fallbacks'] for r in rs)}/{sum(r['totals']['quantized_tensors'] for r in rs)}" if t and "fallbacks" in t else "-"
      qs = f"{sum(r['quant_seconds'] for r in rs) / len(rs):.0f}" if t else "-"
      print(f"| {label} | {bq} | {bm} | {err} | {ppl_s} | {100 * (mean / fp32 - 1):+.2f}% | {it_s} | {fb} | {qs} |")
EOF
cat $W/table.md
# The table goes between the markers in docs/quantization.md.
python3 - $W/table.md docs/quantization.md <<'EOF'
import sys
table, doc = open(sys.argv[1]).read(), open(sys.argv[2]).read()
a, b = "<!-- quant_table begin -->", "<!-- quant_table end -->"
i, j = doc.index(a) + len(a), doc.index(b)
open(sys.argv[2], "w").write(doc[:i] + "\n" + table + doc[j:])
EOF
echo "quant_table: wrote the table into docs/quantization.md"
