#!/usr/bin/env python3
"""ZeRO-Offload on one GPU: the largest GPT memtrain trains with `train.offload_optimizer=true`.

Tries GPT shapes from the largest down (GPT-2 vocabulary, T = 1024, bf16, block inputs offloaded
to host memory by `train.remat=offload`), a few steps each, until one trains; prints its size,
tokens/s and memtrain's memory breakdown, beside what fits without offload: 16 bytes of model
states per parameter on the GPU (the "16 Psi on the GPU" limit). Each attempt is its own process;
one that runs out of device or host memory is reported and the next smaller shape is tried.

Before each attempt the planner predicts it (`memtrain estimate CONFIG --offload optimizer
--recompute full --host-mem-gb <this machine's>`): the device total and the host bytes are
printed and recorded beside what the run measured, and a shape the planner says the host or the
GPU cannot hold is not launched (`--no-plan-skip` launches it anyway).

    python3 bench/offload_gpu.py --memtrain build-gpu/memtrain [--json out.json] [--quick]
    python3 bench/offload_gpu.py --memtrain build/memtrain --device cpu-smoke   # logic only
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_vs_pytorch import write_shard  # noqa: E402
import gpu_vs_pytorch  # noqa: E402
from gpu_vs_pytorch import (memtrain_config, param_counts, run_process, show_output,  # noqa: E402
                            tail)

# Largest first: (name, n_layer, n_head, n_embd). Host memory holds 18 bytes per parameter
# (fp32 master, Adam m and v, fp32 gradients, the bf16 transfer buffer): 128 GB caps it near 6.5B.
SHAPES = [
    ("6.7b", 32, 32, 4096),
    ("5.3b", 36, 28, 3584),
    ("4.1b", 36, 24, 3072),
    ("2.7b", 32, 32, 2560),
    ("1.5b", 48, 25, 1600),
]
SMOKE_SHAPES = [("smoke-too-big", 2, 4, 4096), ("smoke", 2, 4, 64)]


class Args:
    pass


def machine_memory():
    """(GPU bytes, host bytes) of this machine: nvidia-smi's first GPU (80 GB if none answers)
    and MemTotal."""
    gpu = 80e9
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=30).stdout
        gpu = float(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return gpu, host


def predict(memtrain, config, micro_batch, seq, gpu, host):
    """The planner's estimate of a ZeRO-Offload run of `config` on a machine of `gpu` and `host`
    bytes (machine_memory()), or None."""
    cmd = [memtrain, "estimate", config, "--offload", "optimizer", "--recompute", "full",
           "--micro-batch", str(micro_batch), "--seq", str(seq), "--gpus-per-node", "1",
           "--gpu-mem-gb", "%g" % (gpu / 1e9), "--host-mem-gb", "%g" % (host / 1e9), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print("  planner: %s" % (r.stderr.strip() or "no answer"))
        return None
    j = json.loads(r.stdout)
    return {"device_bytes": j["total_bytes"], "host_bytes": j["host_bytes"], "gpu_bytes": gpu,
            "host_capacity": host,
            "fits": j["total_bytes"] <= gpu and j["host_bytes"] <= host}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memtrain", default="build-gpu/memtrain")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu-smoke"],
                    help="cpu-smoke: tiny shapes on the CPU, to exercise this script only")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="1 + 2 steps per attempt")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--deadline", type=float,
                    help="seconds from now: no attempt runs past it (bench/gpu_device.sh)")
    ap.add_argument("--no-plan-skip", action="store_true",
                    help="launch shapes the planner predicts do not fit")
    a = ap.parse_args()
    if a.deadline:
        gpu_vs_pytorch.DEADLINE = time.time() + a.deadline
    if not os.access(a.memtrain, os.X_OK):
        sys.exit("offload_gpu.py: no memtrain binary at %s (build first)" % a.memtrain)
    smoke = a.device == "cpu-smoke"
    shapes = SMOKE_SHAPES if smoke else SHAPES
    seq = 64 if smoke else a.seq
    warmup, steps = (1, 2) if a.quick or smoke else (2, 5)
    cfg = Args()
    cfg.device, cfg.precision, cfg.threads = ("cpu", "fp32", 2) if smoke else ("cuda", "bf16", 0)

    memory = machine_memory()  # (GPU, host) bytes, for the planner
    results = {"attempts": [], "chosen": None}
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "train.bin")
        write_shard(shard, (warmup + steps) * a.micro_batch * (seq + 1) * 2 + 1, 50257, 1)
        for name, L, H, C in shapes:
            shape = dict(n_layer=L, n_head=H, n_embd=C, vocab=50257, seq=seq,
                         micro_batch=a.micro_batch)
            params, _ = param_counts(shape)
            out_dir = os.path.join(tmp, name)
            os.makedirs(out_dir)
            config = os.path.join(out_dir, "bench.toml")
            with open(config, "w") as f:
                f.write(memtrain_config(shape, cfg, shard, out_dir, warmup + steps))
            sets = [] if smoke else ["train.offload_optimizer=true", "train.remat=offload"]
            if smoke and name == "smoke-too-big":
                sets = ["model.n_embd=1000003"]  # an impossible shape: the failure path
            plan = predict(a.memtrain, config, a.micro_batch, seq, *memory)
            if plan:
                print("  planner: %.1f GB on the GPU of %.0f GB, %.1f GB of host memory of %.0f GB"
                      " -> %s" % (plan["device_bytes"] / 1e9, plan["gpu_bytes"] / 1e9,
                                  plan["host_bytes"] / 1e9, plan["host_capacity"] / 1e9,
                                  "fits" if plan["fits"] else "does not fit"))
            if plan and not plan["fits"] and not smoke and not a.no_plan_skip:
                results["attempts"].append({"name": name, "n_layer": L, "n_head": H,
                                            "n_embd": C, "params": params, "planned": plan,
                                            "skipped": "the planner predicts it does not fit"})
                continue
            cmd = [a.memtrain, "train", config] + sum((["--set", s] for s in sets), [])
            r = run_process("offload %s (%.2fB parameters)" % (name, params / 1e9), cmd,
                            a.timeout)
            attempt = {"name": name, "n_layer": L, "n_head": H, "n_embd": C,
                       "params": params, "rc": r["rc"], "seconds": r["seconds"],
                       "planned": plan, "output_tail": tail(r["output"])}
            results["attempts"].append(attempt)
            if r["rc"] != 0:
                print("  %s did not train (rc %s): %s" % (name, r["rc"],
                                                         (r["output"].strip().splitlines() or
                                                          ["no output"])[-1]))
                continue
            metrics = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))
                       if '"loss"' in l]
            timed = metrics[warmup:]
            tok_s = sum(m["tokens_per_s"] for m in timed) / len(timed)
            attempt.update(tokens_per_s=tok_s,
                           peak_device_bytes=max(m["peak_mem_bytes"] for m in metrics))
            results["chosen"] = attempt
            out = r["output"]
            table = out[out.find("memory breakdown"):] if "memory breakdown" in out else ""
            print("\nlargest model trained: %s, %.2fB parameters (%d x %d, %d heads), "
                  "micro-batch %d x %d" % (name, params / 1e9, L, C, H, a.micro_batch, seq))
            print("tokens/s %.0f (mean of %d steps after %d warm-up); peak tracked device memory "
                  "%.1f GiB" % (tok_s, len(timed), warmup, attempt["peak_device_bytes"] / 2**30))
            print(table.strip())
            if plan:
                print("planner beside it: %.2f GiB predicted on the device (full recompute, block "
                      "inputs on the GPU: an upper bound for remat=offload), %.2f GiB on the host"
                      % (plan["device_bytes"] / 2**30, plan["host_bytes"] / 2**30))
            break
    if results["chosen"] and not smoke:
        gpu = 80e9
        print("\nwithout offload, 16 bytes of model states per parameter on an 80 GB GPU cap the "
              "model below %.1fB parameters (before activations); offload leaves 4 bytes per "
              "parameter there" % (gpu / 16 / 1e9))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if not results["chosen"]:
        for at in results["attempts"]:
            show_output(at["name"], at["output_tail"])
        sys.exit("offload_gpu.py: no shape trained")


if __name__ == "__main__":
    main()
