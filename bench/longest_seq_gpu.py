#!/usr/bin/env python3
"""The longest sequence a Llama-3-8B-shaped model trains at on one GPU (issue 27).

For each activation policy (no recompute, `full`: block inputs kept on the GPU, `offload`: block
inputs in pinned host memory), finds the longest T (a multiple of --step) at micro-batch 1 whose
whole step the run plan says fits this GPU (`memtrain train CONFIG --print-plan`: the plan prices
every buffer the engine will allocate and refuses, before allocating, what does not fit the free
device memory), then confirms the longest of them with one measured step: the device tracker's
peak against the plan's prediction (memory.json), the step time and tokens/s. Model states stay
on the GPU (bf16 weights and gradients, fp32 master and AdamW moments: 16 bytes per parameter,
128 GB for 8.0B parameters), so what is left of the card bounds the activations.

    python3 bench/longest_seq_gpu.py --memtrain build-gpu/memtrain [--json out.json]
    python3 bench/longest_seq_gpu.py --memtrain build/memtrain --device cpu-smoke  # logic only

The Llama-3-8B shape: 32 layers of width 4096, 32 query heads over 8 key/value heads, SwiGLU of
14336, RMSNorm, RoPE (theta 500000), untied embeddings over a 128256-token vocabulary, no biases.
The tokens are random (a shard of uint32 ids): memory and time do not depend on the text.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_vs_pytorch import write_shard  # noqa: E402
import gpu_vs_pytorch  # noqa: E402
from gpu_vs_pytorch import note_progress, run_process, tail  # noqa: E402

LLAMA3_8B = dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                 vocab=128256, rope_theta=500000.0)
# The smoke shape: the script's logic on the CPU in seconds, under a small host budget.
SMOKE = dict(n_layer=8, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=176, vocab=300,
             rope_theta=10000.0)
SMOKE_HOST = "48MiB"


def config_text(shape, device, precision, shard, out_dir):
    s, q = shape, json.dumps  # a TOML basic string is a JSON string
    return "\n".join([
        "# written by bench/longest_seq_gpu.py",
        "[model]",
        "n_layer = %d" % s["n_layer"], "n_head = %d" % s["n_head"],
        "n_kv_head = %d" % s["n_kv_head"], "n_embd = %d" % s["n_embd"],
        "ffn_hidden = %d" % s["ffn_hidden"], "vocab_size = %d" % s["vocab"], "vocab_pad = 128",
        'norm = "rmsnorm"', 'activation = "swiglu"', 'positions = "rope"',
        "rope_theta = %g" % s["rope_theta"], "tied_embeddings = false", "bias = false",
        "[train]",
        "device = %s" % q(device), "precision = %s" % q(precision),
        "batch_size = 1", "micro_batch_size = 1", "max_steps = 1", "eval_every = 0",
        "log_every = 1",
        # (the CPU engine's attention keeps the log-sum-exp, as the GPU's does, not T^2 floats)
        'cpu_attention = "lse"' if device == "cpu" else "",
        "[optim]",
        'name = "adamw"', "lr = 3e-4", "weight_decay = 0.1", "grad_clip = 1.0",
        'schedule = "constant"', "warmup_steps = 0",
        "[data]",
        "train = %s" % q(shard), 'val = ""', 'tokenizer = ""',
        "[io]",
        "out_dir = %s" % q(out_dir), "checkpoint_every = 0", "save_final = false",
        "[sample]",
        "max_tokens = 0",
        ""])


def sets(T, remat):
    return ["--set", "model.block_size=%d" % T, "--set", "train.seq_len=%d" % T,
            "--set", "train.remat=%s" % remat]


def planned(memtrain, config, T, remat, env):
    """(fits, planned MiB or None, the refusal's last line)."""
    if gpu_vs_pytorch.DEADLINE is not None and time.time() > gpu_vs_pytorch.DEADLINE - 15:
        raise TimeoutError("the time budget (--deadline) is spent")
    r = subprocess.run([memtrain, "train", config, "--print-plan"] + sets(T, remat),
                       capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    m = re.search(r"^\s*(?:host|device) total\s+([0-9.]+) MiB", out, re.M)
    return r.returncode == 0, float(m.group(1)) if m else None, (out.strip().splitlines() or
                                                                 [""])[-1]


def longest(memtrain, config, remat, step, max_seq, env):
    """The longest multiple of `step` up to `max_seq` that the plan says fits, with its planned
    MiB, and the number of plans asked; (0, None, n) when even `step` does not fit."""
    asked = 1
    ok, mib, why = planned(memtrain, config, step, remat, env)
    if not ok:
        print("  %s: even T = %d does not fit: %s" % (remat, step, why))
        return 0, None, asked
    lo, lo_mib, hi = step, mib, max_seq + step
    while hi - lo > step:
        mid = (lo + hi) // (2 * step) * step
        ok, mib, _ = planned(memtrain, config, mid, remat, env)
        asked += 1
        if ok:
            lo, lo_mib = mid, mib
        else:
            hi = mid
    return lo, lo_mib, asked


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memtrain", default="build-gpu/memtrain")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu-smoke"],
                    help="cpu-smoke: a tiny Llama on the CPU under a small host budget, to "
                         "exercise this script only")
    ap.add_argument("--policies", default=None,
                    help="comma-separated train.remat values (default: none,full,offload; "
                         "cpu-smoke: none,full,memory-poor)")
    ap.add_argument("--step", type=int, default=None, help="T granularity (default 1024)")
    ap.add_argument("--max-seq", type=int, default=None,
                    help="the longest T tried (default 131072: 2^31 / 14336 bounds one "
                         "micro-batch's MLP field for 32-bit element counts)")
    ap.add_argument("--confirm", type=int, default=2,
                    help="confirm this many policies with a measured step, longest T first")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--progress", help="append each confirming process's result here (JSON lines)")
    ap.add_argument("--deadline", type=float,
                    help="seconds from now: no process runs past it (bench/gpu_device.sh)")
    a = ap.parse_args()
    if a.deadline:
        gpu_vs_pytorch.DEADLINE = time.time() + a.deadline
    if a.progress:
        gpu_vs_pytorch.PROGRESS = a.progress
    if not os.access(a.memtrain, os.X_OK):
        sys.exit("longest_seq_gpu.py: no memtrain binary at %s (build first)" % a.memtrain)
    smoke = a.device == "cpu-smoke"
    shape = SMOKE if smoke else LLAMA3_8B
    policies = (a.policies or ("none,full,memory-poor" if smoke else "none,full,offload")).split(",")
    step = a.step or (64 if smoke else 1024)
    max_seq = a.max_seq or (4096 if smoke else 131072)
    env = dict(os.environ)
    if smoke:
        env.update(MEMTRAIN_HOST_MEMORY=SMOKE_HOST, OMP_NUM_THREADS="2",
                   OPENBLAS_NUM_THREADS="2")
    device, precision = ("cpu", "fp32") if smoke else ("cuda", "bf16")

    results = {"shape": shape, "device": device, "precision": precision, "step": step,
               "max_seq": max_seq, "host_budget": SMOKE_HOST if smoke else None, "policies": []}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "train.bin")
        write_shard(shard, max_seq + 2, shape["vocab"], 1)
        config = os.path.join(tmp, "plan.toml")
        with open(config, "w") as f:
            f.write(config_text(shape, device, precision, shard, os.path.join(tmp, "plan")))
        print("Llama-3-8B shape" if not smoke else "smoke shape", json.dumps(shape))
        for remat in policies:
            t0 = time.time()
            try:
                T, mib, asked = longest(a.memtrain, config, remat, step, max_seq, env)
            except TimeoutError as e:
                print("  remat=%s: not searched: %s" % (remat, e))
                failed = True
                continue
            row = {"remat": remat, "longest_T": T, "planned_MiB": mib, "plans_asked": asked,
                   "plan_seconds": time.time() - t0}
            results["policies"].append(row)
            print("  remat=%-12s longest T %6d (plan: %s MiB%s; %d plans in %.1f s)" % (
                remat, T, "%.1f" % mib if mib else "-",
                " on the GPU" if not smoke else " of host memory", asked, row["plan_seconds"]))
        order = sorted((r for r in results["policies"] if r["longest_T"]),
                       key=lambda r: -r["longest_T"])
        for row in order[:a.confirm]:
            out_dir = os.path.join(tmp, "run-" + row["remat"])
            os.makedirs(out_dir)
            run_config = os.path.join(out_dir, "bench.toml")
            with open(run_config, "w") as f:
                f.write(config_text(shape, device, precision, shard, out_dir))
            cmd = [a.memtrain, "train", run_config] + sets(row["longest_T"], row["remat"])
            label = "remat=%s at T = %d" % (row["remat"], row["longest_T"])
            r = run_process(label, cmd, 600, env=env)
            row["confirm"] = {"rc": r["rc"], "seconds": r["seconds"]}
            if r["rc"] != 0:  # (run_process printed its output)
                failed = True
                row["confirm"]["output_tail"] = tail(r["output"])
                note_progress({"label": label, "kind": "memtrain", "ok": False,
                               "error": r.get("error"), "seconds": r["seconds"]})
                continue
            mem = json.load(open(os.path.join(out_dir, "memory.json")))
            step_line = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))
                         if '"ms_per_step"' in l][-1]
            measured = mem["process_peak_rss"] if smoke else mem["total"]["peak"]
            row["confirm"].update(measured_peak_MiB=measured / 2**20,
                                  predicted_MiB=mem["total"]["predicted"] / 2**20,
                                  activations_MiB=next(c["peak"] for c in mem["categories"]
                                                       if c["name"] == "activations") / 2**20,
                                  step_ms=step_line["ms_per_step"],
                                  tokens_per_s=step_line.get("tokens_per_s"))
            c = row["confirm"]
            note_progress({"label": label, "kind": "memtrain", "ok": True, "seconds": r["seconds"],
                           "tokens_per_s": c["tokens_per_s"], "ms_per_step": c["step_ms"],
                           "peak_bytes": measured, "remat": row["remat"]})
            print("  confirmed remat=%s at T = %d: peak %.1f MiB (%s), predicted %.1f MiB, "
                  "activations %.1f MiB, one step %.1f s" % (
                      row["remat"], row["longest_T"], c["measured_peak_MiB"],
                      "process RSS" if smoke else "device tracker", c["predicted_MiB"],
                      c["activations_MiB"], c["step_ms"] / 1e3))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if failed or not any(r["longest_T"] for r in results["policies"]):
        sys.exit("longest_seq_gpu.py: a confirming run failed or nothing fits")


if __name__ == "__main__":
    main()
