#!/usr/bin/env bash
# Model-state bytes per parameter of the CUDA engine for a GPT-2 124M-shaped model on one GPU
# (issue 30), for each optimizer-state option beside mixed-precision AdamW with its fp32 master.
# The figures are the engine's own rows (`memtrain train --print-plan`, which allocates nothing),
# the rows the CUDA tests measure equal to the allocations on cudasim and on a GPU
# (CudaTrain.DeviceMemoryIsWhatTheModelPredicts, ...StateFormats..., ...Bf16Weights...); this
# runs on cudasim (memtrain_sim), so it needs no GPU. PyTorch's AMP AdamW holds 16 bytes (fp32
# weights and gradients, two fp32 moments; torch.optim.AdamW(fused=True)); that line is the
# planner's peer price, `memtrain estimate --runtime pytorch`.
# Usage: bench/gpu_model_states.sh [BUILD]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/memtrain_sim
[ -x "$BIN" ] || { echo "gpu_model_states: $BIN not built (cmake --build $BUILD --target memtrain_sim)" >&2; exit 1; }
printf '%-44s %9s %9s %9s %9s\n' "memtrain option (GPT-2 124M, one GPU, bf16)" params grads optim "B/param"
row() {
    local name=$1
    shift
    "$BIN" train configs/gpt2-124m.toml --set train.device=cuda train.precision=bf16 "$@" \
        --print-plan 2>&1 | /usr/bin/python3 -c '
import re, sys
name = sys.argv[1]
rows = {}
for line in sys.stdin:
    m = re.match(r"\s*(parameters|gradients|optimizer state)\s+([0-9.]+) MiB\s+(.*)", line)
    if m:
        rows[m.group(1)] = float(m.group(2)) * 1048576
    m = re.search(r"model: (\d+) parameters \((\d+) with vocab padding\)", line)
psi = rows["parameters"] / 2  # 2 x params (bf16), padding included
k = [rows[c] / psi for c in ("parameters", "gradients", "optimizer state")]
print(f"{name:<44} {k[0]:9.2f} {k[1]:9.2f} {k[2]:9.2f} {sum(k):9.2f}")
' "$name"
}
row "AdamW, fp32 master (the default)"
row "AdamW, bf16 moments" optim.state_format=bf16
row "AdamW, int8 moments" optim.state_format=int8
row "AdamW, int4 moments" optim.state_format=int4
row "AdamW, no master (optim.master = none)" optim.master=none
row "  + bf16 moments" optim.master=none optim.state_format=bf16
row "  + int8 moments" optim.master=none optim.state_format=int8
row "  + int4 moments" optim.master=none optim.state_format=int4
row "SGD momentum, no master, int8" optim.name=sgd optim.master=none optim.state_format=int8
row "Muon, fp32 master" optim.name=muon
row "Muon, no master, int8" optim.name=muon optim.master=none optim.state_format=int8
row "Adafactor, fp32 master" optim.name=adafactor optim.lr=3e-2
row "Adafactor, no master" optim.name=adafactor optim.lr=3e-2 optim.master=none
# optim.step_in_backward (one micro-batch per step): no gradient buffer, two unit buckets.
row "AdamW, no master, int8, step in backward" optim.master=none optim.state_format=int8 \
    optim.step_in_backward=true train.micro_batch_size=8
row "AdamW, no master, int4, step in backward" optim.master=none optim.state_format=int4 \
    optim.step_in_backward=true train.micro_batch_size=8
row "Muon, no master, int8, step in backward" optim.name=muon optim.master=none \
    optim.state_format=int8 optim.step_in_backward=true train.micro_batch_size=8
row "Adafactor, no master, step in backward" optim.name=adafactor optim.lr=3e-2 optim.master=none \
    optim.step_in_backward=true train.micro_batch_size=8
echo "PyTorch AMP AdamW (fp32 weights, fp32 grads, 2 fp32 moments): 16.00 B/param"
