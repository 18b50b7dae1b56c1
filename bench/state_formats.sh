#!/usr/bin/env bash
# Compressed optimizer states, the step inside the backward and Muon against fp32 AdamW on the
# CPU engine (issue 30): the same run with optim.state_format = fp32, bf16, int8 and int4, with
# optim.step_in_backward (sib), with optim.master = none (bf16w), combinations of them
# (bf16w-sib-int4), with optim.name = muon (fp32 state) and with optim.name = adafactor, on the
# fortunes corpus. For each it
# prints the
# validation loss at every eval (the curve), the final validation loss and its ratio to fp32's,
# tokens/s, and the model-state bytes per parameter measured by the allocator (parameters +
# gradients + optimizer state, over the model's parameters), with the optimizer state measured
# against predicted.
# Usage: bench/state_formats.sh [BUILD] [STEPS] [MODEL]   (OPTIONS="fp32 int8" to run fewer;
#        fp32 always runs first, as the reference; REUSE=1 keeps the runs already in out/;
#        DEVICE=cuda trains on the GPU in its default bf16 mixed precision, where the state
#        formats built are fp32 and bf16; OUT=DIR writes the runs there instead of out/)
#   MODEL demo (default): configs/demo.toml, 6 x 384, batch 8 x 128
#   MODEL 124m: GPT-2 124M's blocks (12 x 768) over the corpus' 4096-token vocabulary (88M
#               parameters), batch 4 x 128, a learning rate of 6e-4
#   MODEL tiny: 2 x 64, batch 2 x 32 (the GPU command's dry run)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${2:-300}
MODEL=${3:-demo}
BIN=$BUILD/memtrain
DEVICE=${DEVICE:-cpu}
[ -f data/fortunes/train.bin ] || make BUILD="$BUILD" data/fortunes/train.bin >/dev/null
OUT=${OUT:-out}/state_formats_$MODEL
mkdir -p "$OUT"
EVERY=$((STEPS / 6 > 0 ? STEPS / 6 : 1))
case $MODEL in
    demo) SHAPE=() ;;
    124m) SHAPE=(model.n_layer=12 model.n_head=12 model.n_embd=768 train.batch_size=4
                 optim.lr=6e-4) ;;
    tiny) SHAPE=(model.n_layer=2 model.n_head=2 model.n_embd=64 model.block_size=32
                 train.seq_len=32 train.batch_size=2 train.eval_batches=2) ;;
    *) echo "MODEL must be demo, 124m or tiny, got $MODEL" >&2; exit 2 ;;
esac
OPTIONS=${OPTIONS:-fp32 bf16 int8 int4 muon adafactor sib sib-int8 sib-int4 bf16w bf16w-sib-int8 bf16w-sib-int4}
OPTIONS="fp32 $(echo $OPTIONS | tr ' ' '\n' | grep -v '^fp32$' | tr '\n' ' ')"
for f in $OPTIONS; do
    # An option is parts joined by '-': fp32 | bf16 | int8 | int4 (optim.state_format), muon or
    # adafactor (optim.name), sib (optim.step_in_backward, clipping kept by the norm pass), lag
    # (with sib: clipping by the previous step's norm, no norm pass), bf16w
    # (optim.master = none: bf16 weights, stochastic rounding). E.g. bf16w-sib-int8.
    opt=()
    for part in ${f//-/ }; do
        case $part in
            fp32) ;;
            bf16 | int8 | int4) opt+=(optim.state_format=$part) ;;
            muon) opt+=(optim.name=muon) ;;
            # Adafactor's relative step (docs/training.md): lr caps min(lr, 1/sqrt(t)) x the
            # weights' RMS; 3e-2 and no weight decay (PyTorch's default) on the demo.
            adafactor) opt+=(optim.name=adafactor optim.lr=3e-2 optim.weight_decay=0) ;;
            sib) opt+=(optim.step_in_backward=true) ;;
            lag) opt+=(optim.step_in_backward_clip=previous-norm) ;;  # with sib: no norm pass
            bf16w) opt+=(optim.master=none) ;;
            *) echo "unknown option part '$part' in '$f'" >&2; exit 2 ;;
        esac
    done
    # REUSE=1: a run that finished (its log has the last step's line) is kept.
    if [ "${REUSE:-0}" = 1 ] && grep -q "step *$STEPS/$STEPS" "$OUT/$f.log" 2>/dev/null; then
        continue
    fi
    echo "training $MODEL with ${opt[*]} ($STEPS steps) ..." >&2
    "$BIN" train configs/demo.toml --overwrite --set io.out_dir=$OUT/$f train.device=$DEVICE \
        train.max_steps=$STEPS train.eval_every=$EVERY train.eval_batches=16 \
        io.checkpoint_every=0 io.save_final=false sample.max_tokens=0 "${SHAPE[@]}" \
        "${opt[@]}" >"$OUT/$f.log" 2>&1 || { tail -20 "$OUT/$f.log"; exit 1; }
done
python3 - "$OUT" "$MODEL" "$STEPS" "$DEVICE" $OPTIONS <<'PY'
import json, sys
out, model, steps, device, options = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
# Bytes per stored parameter of the fp32 reference run: 4 on the CPU engine, 2 on the GPU (bf16).
param_bytes = 2 if device == "cuda" else 4
rows = {}
for f in options:
    lines = [json.loads(l) for l in open("%s/%s/metrics.jsonl" % (out, f))]
    steps_ = [l for l in lines if "loss" in l]
    vals = [(l["step"], l["val_loss"]) for l in lines if "val_loss" in l]
    mem = {c["name"]: c for c in json.load(open("%s/%s/memory.json" % (out, f)))["categories"]}
    # The model's parameters: fp32's parameter bytes / 4 (fp32 runs first; bf16w stores 2 B).
    params = rows["fp32"]["params"] if rows else mem["parameters"]["peak"] / param_bytes
    state = sum(mem[k]["peak"] for k in ("parameters", "gradients", "optimizer_state"))
    tok = sorted(l["tokens_per_s"] for l in steps_[len(steps_) // 5:])
    rows[f] = dict(vals=vals, tok=tok[len(tok) // 2], bpp=state / params,
                   opt=mem["optimizer_state"]["peak"], pred=mem["optimizer_state"]["predicted"],
                   grad=mem["gradients"]["peak"], gpred=mem["gradients"]["predicted"],
                   params=params)
ref = rows["fp32"]
print("%s model (%.1fM parameters), %s steps on the fortunes corpus, %s" %
      (model, ref["params"] / 1e6, steps,
       "the GPU, bf16 mixed precision" if device == "cuda" else "the CPU engine"))
print()
print("| option | val loss by step | final val | vs fp32 | tokens/s (median) | vs fp32 "
      "| gradients MiB (predicted) | optimizer state MiB (predicted) | model state B/param "
      "| vs fp32 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f, r in rows.items():
    curve = " ".join("%d:%.3f" % v for v in r["vals"])
    final = r["vals"][-1][1]
    print("| %s | %s | %.4f | %+.2f%% | %.0f | %.2fx | %.2f (%.2f) | %.2f (%.2f) | %.2f "
          "| %.2fx less |" % (
        f, curve, final, 100 * (final / ref["vals"][-1][1] - 1), r["tok"], r["tok"] / ref["tok"],
        r["grad"] / 1048576, r["gpred"] / 1048576, r["opt"] / 1048576, r["pred"] / 1048576,
        r["bpp"], ref["bpp"] / r["bpp"]))
PY
