#!/usr/bin/env python3
"""CPU benchmark: memtrain against PyTorch (CPU, fp32) on the same GPT-2 shape, in one run.

Both train the same model (same shape, AdamW, clipping, tied embeddings) for the same number of
steps on random tokens with the same thread count; each runs in its own process, whose peak RSS
is read from the kernel (wait4), so the memory figures count everything each process held.
Prints tokens/s, ms/step and peak memory for both, and the ratios memtrain / PyTorch.

    /usr/bin/python3 bench/cpu_vs_pytorch.py [--memtrain build/memtrain] [--preset small]
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

PRESETS = {
    # name: (n_layer, n_head, n_embd, vocab, seq, batch)
    "small": (6, 6, 384, 4096, 128, 8),     # the demo model
    "gpt2vocab": (4, 4, 256, 50257, 256, 4),  # GPT-2's vocabulary: classifier-heavy
}


def write_shard(path, n_tokens, vocab, seed):
    import random
    rng = random.Random(seed)
    bpt = 2 if vocab <= 65536 else 4
    header = b"MTTOKENS" + struct.pack("<IIQI", 1, bpt, n_tokens, vocab)
    header += b"\0" * (64 - len(header))
    fmt = "<%d%s" % (n_tokens, "H" if bpt == 2 else "I")
    with open(path, "wb") as f:
        f.write(header)
        f.write(struct.pack(fmt, *[rng.randrange(vocab) for _ in range(n_tokens)]))


def run_measured(cmd, env):
    """Runs cmd, returns (stdout, peak RSS bytes of that process tree's largest child)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit("benchmark command failed: %s\n%s" % (" ".join(cmd), out[-3000:]))
    return out, ru.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memtrain", default="build/memtrain")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    L, H, C, V, T, B = PRESETS[a.preset]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))

    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "train.bin")
        write_shard(shard, max(200_000, (a.steps + a.warmup_steps + 2) * B * (T + 1)), V, 1)
        total = a.steps + a.warmup_steps
        sets = [
            "model.n_layer=%d" % L, "model.n_head=%d" % H, "model.n_embd=%d" % C,
            "model.vocab_size=%d" % V, "model.block_size=%d" % T, "train.seq_len=%d" % T,
            "train.batch_size=%d" % B, "train.max_steps=%d" % total, "train.eval_every=0",
            "train.threads=%d" % a.threads, "data.train=" + shard, "io.out_dir=" + tmp + "/out",
            "io.save_final=false", "sample.max_tokens=0", "optim.warmup_steps=2",
        ]
        cmd = [a.memtrain, "train"]
        for s in sets:
            cmd += ["--set", s]
        _, mt_rss = run_measured(cmd, env)
        steps = [json.loads(l) for l in open(os.path.join(tmp, "out", "metrics.jsonl")) if '"loss"' in l]
        timed = steps[a.warmup_steps:]
        mt_ms = sum(s["ms_per_step"] for s in timed) / len(timed)
        mt_tps = B * T / (mt_ms / 1000)

        here = os.path.dirname(os.path.abspath(__file__))
        tcmd = ["/usr/bin/python3", os.path.join(here, "torch_gpt2.py"), "--n-layer", str(L),
                "--n-head", str(H), "--n-embd", str(C), "--vocab", str(V), "--seq", str(T),
                "--batch", str(B), "--steps", str(a.steps), "--warmup-steps", str(a.warmup_steps),
                "--threads", str(a.threads), "--json"]
        out, pt_rss = run_measured(tcmd, env)
        pt = json.loads(out.strip().splitlines()[-1])
        pt_ms, pt_tps = pt["ms_per_step"], pt["tokens_per_s"]

    res = {
        "preset": a.preset, "shape": dict(n_layer=L, n_head=H, n_embd=C, vocab=V, seq=T, batch=B),
        "threads": a.threads, "steps": a.steps,
        "memtrain": {"tokens_per_s": mt_tps, "ms_per_step": mt_ms, "peak_rss_bytes": mt_rss},
        "pytorch": {"tokens_per_s": pt_tps, "ms_per_step": pt_ms, "peak_rss_bytes": pt_rss},
        "speed_ratio": mt_tps / pt_tps, "memory_ratio": mt_rss / pt_rss,
    }
    mib = 1 << 20
    print("CPU benchmark, preset %s: %d layers x %d wide, %d heads, vocab %d, batch %d x %d tokens, "
          "%d threads, %d timed steps" % (a.preset, L, C, H, V, B, T, a.threads, a.steps))
    print("%-10s %12s %10s %14s" % ("", "tokens/s", "ms/step", "peak RSS MiB"))
    print("%-10s %12.0f %10.1f %14.1f" % ("memtrain", mt_tps, mt_ms, mt_rss / mib))
    print("%-10s %12.0f %10.1f %14.1f" % ("PyTorch", pt_tps, pt_ms, pt_rss / mib))
    print("ratio memtrain/PyTorch: speed %.2fx, peak memory %.2fx" % (res["speed_ratio"], res["memory_ratio"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
