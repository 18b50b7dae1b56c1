#!/usr/bin/env python3
"""bf16 on the CPU: memtrain (train.precision = bf16, and fp32) against PyTorch fp32 and PyTorch's
CPU autocast to bf16, in one run, with the same thread count, on the same GPT-2 shapes.

Each run is its own process, whose peak RSS the kernel reports (wait4). For every shape it prints
tokens/s, peak RSS, the ratios memtrain bf16 / PyTorch bf16 autocast, and memtrain bf16's model
FLOP/s as a fraction of the bf16 GEMM peak measured on this machine (a 2048^3 bf16 torch.mm, which
PyTorch runs through oneDNN as memtrain does). Model FLOPs per token: 6 N (N without the position
table) + 12 L C T (attention), as Megatron and nanoGPT count them.

    /usr/bin/python3 bench/cpu_bf16.py [--memtrain build/memtrain] [--shapes demo,wide,124m]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_vs_pytorch import run_measured, write_shard  # noqa: E402

SHAPES = {
    # name: (n_layer, n_head, n_embd, vocab, seq, batch, timed steps)
    "demo": (6, 6, 384, 4096, 128, 8, 12),       # the demo model
    "wide": (6, 6, 384, 50304, 256, 4, 8),        # GPT-2's padded vocabulary at T = 256
    "124m": (12, 12, 768, 50304, 1024, 1, 4),     # GPT-2 124M at T = 1024
}
WARMUP = 2


def gemm_peak(threads, env):
    code = ("import time, torch; torch.set_num_threads(%d); n = 2048\n"
            "a = torch.randn(n, n).bfloat16(); b = torch.randn(n, n).bfloat16()\n"
            "for _ in range(3): a @ b\n"
            "t = time.perf_counter(); r = 10\n"
            "for _ in range(r): a @ b\n"
            "print(2 * n ** 3 * r / (time.perf_counter() - t))\n" % threads)
    out, _ = run_measured(["/usr/bin/python3", "-c", code], env)
    return float(out.strip().splitlines()[-1])


def memtrain_run(binary, shape, precision, threads, env, tmp):
    L, H, C, V, T, B, steps = shape
    shard = os.path.join(tmp, "train_%d.bin" % V)
    if not os.path.exists(shard):
        write_shard(shard, max(100_000, (steps + WARMUP + 2) * B * (T + 1)), V, 1)
    out_dir = os.path.join(tmp, "out_" + precision)
    sets = ["model.n_layer=%d" % L, "model.n_head=%d" % H, "model.n_embd=%d" % C,
            "model.vocab_size=%d" % V, "model.block_size=%d" % T, "train.seq_len=%d" % T,
            "train.batch_size=%d" % B, "train.max_steps=%d" % (steps + WARMUP),
            "train.eval_every=0", "train.threads=%d" % threads, "train.device=cpu",
            "train.precision=" + precision, "data.train=" + shard, "io.out_dir=" + out_dir,
            "io.save_final=false", "io.checkpoint_every=0", "sample.max_tokens=0",
            "optim.warmup_steps=2"]
    cmd = [binary, "train", "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    log, rss = run_measured(cmd, env)
    rows = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl")) if '"loss"' in l]
    timed = rows[WARMUP:]
    ms = sum(r["ms_per_step"] for r in timed) / len(timed)
    path = next((l for l in log.splitlines() if l.startswith("device:")), "")
    return {"tokens_per_s": B * T / (ms / 1000), "ms_per_step": ms, "peak_rss_bytes": rss,
            "device_line": path.split("|")[0].strip()}


def torch_run(shape, autocast, threads, env):
    L, H, C, V, T, B, steps = shape
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = ["/usr/bin/python3", os.path.join(here, "torch_gpt2.py"), "--n-layer", str(L),
           "--n-head", str(H), "--n-embd", str(C), "--vocab", str(V), "--seq", str(T),
           "--batch", str(B), "--steps", str(steps), "--warmup-steps", str(WARMUP),
           "--threads", str(threads), "--json"] + (["--autocast"] if autocast else [])
    out, rss = run_measured(cmd, env)
    r = json.loads(out.strip().splitlines()[-1])
    return {"tokens_per_s": r["tokens_per_s"], "ms_per_step": r["ms_per_step"],
            "peak_rss_bytes": rss}


def model_flops_per_token(shape):
    L, H, C, V, T, B, _ = shape
    n = V * C + L * (12 * C * C + 13 * C) + 2 * C  # wte (tied classifier), blocks, ln_f
    return 6 * n + 12 * L * C * T


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memtrain", default="build/memtrain")
    ap.add_argument("--shapes", default="demo,wide,124m")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))
    peak = gemm_peak(a.threads, env)
    mib = 1 << 20
    print("bf16 GEMM peak on this machine (2048^3 bf16 torch.mm through oneDNN, %d threads): "
          "%.0f GFLOP/s" % (a.threads, peak / 1e9))
    results = []
    for name in a.shapes.split(","):
        if name not in SHAPES:
            sys.exit("unknown shape %r (expected %s)" % (name, ", ".join(SHAPES)))
        shape = SHAPES[name]
        L, H, C, V, T, B, steps = shape
        with tempfile.TemporaryDirectory() as tmp:
            runs = {
                "memtrain bf16": memtrain_run(a.memtrain, shape, "bf16", a.threads, env, tmp),
                "memtrain fp32": memtrain_run(a.memtrain, shape, "fp32", a.threads, env, tmp),
                "PyTorch bf16 autocast": torch_run(shape, True, a.threads, env),
                "PyTorch fp32": torch_run(shape, False, a.threads, env),
            }
        mt, pt = runs["memtrain bf16"], runs["PyTorch bf16 autocast"]
        frac = mt["tokens_per_s"] * model_flops_per_token(shape) / peak
        print("\n%s: %d layers x %d wide, vocab %d, batch %d x %d tokens, %d threads, %d timed "
              "steps (%s)" % (name, L, C, V, B, T, a.threads, steps, mt["device_line"]))
        print("%-24s %10s %10s %14s" % ("", "tokens/s", "ms/step", "peak RSS MiB"))
        for k, r in runs.items():
            print("%-24s %10.0f %10.1f %14.1f" % (k, r["tokens_per_s"], r["ms_per_step"],
                                                  r["peak_rss_bytes"] / mib))
        print("memtrain bf16 / PyTorch bf16 autocast: speed %.2fx, peak memory %.2fx; "
              "/ PyTorch fp32: speed %.2fx; memtrain bf16 / fp32: speed %.2fx" %
              (mt["tokens_per_s"] / pt["tokens_per_s"], mt["peak_rss_bytes"] / pt["peak_rss_bytes"],
               mt["tokens_per_s"] / runs["PyTorch fp32"]["tokens_per_s"],
               mt["tokens_per_s"] / runs["memtrain fp32"]["tokens_per_s"]))
        print("memtrain bf16 model FLOP/s: %.0f GFLOP/s = %.0f%% of the bf16 GEMM peak" %
              (mt["tokens_per_s"] * model_flops_per_token(shape) / 1e9, 100 * frac))
        results.append({"shape": name, "runs": runs, "gemm_peak_flops": peak,
                        "peak_fraction": frac})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
