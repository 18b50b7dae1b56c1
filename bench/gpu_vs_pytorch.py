#!/usr/bin/env python3
"""GPU benchmark: memtrain against PyTorch (eager and torch.compile) on the same GPT-2, in one run.

For a preset it writes a random-token shard in memtrain's format, then runs, each in its own
process and for the same steps: the bf16 GEMM peak of the GPU (a torch 8192^3 bf16 matmul),
`memtrain train` on the shard (bf16 by default), and the PyTorch peer bench/torch_gpt2_gpu.py in
eager mode and under torch.compile (bf16 autocast, SDPA, fused AdamW). It prints one table of
tokens/s, model TFLOP/s, MFU against the measured GEMM peak and peak memory, the ratios
memtrain / PyTorch, and the issue's goals marked met or not met with their margin.

    python3 bench/gpu_vs_pytorch.py --memtrain build-gpu/memtrain --preset 124m [--quick]
    python3 bench/gpu_vs_pytorch.py --memtrain build-gpu/memtrain --preset 1.5b
    python3 bench/gpu_vs_pytorch.py --memtrain build-gpu/memtrain --remat-compare
    # smoke test without a GPU (memtrain fp32 on the CPU, torch on the CPU):
    /usr/bin/python3 bench/gpu_vs_pytorch.py --memtrain build/memtrain --preset tiny \\
        --device cpu --peers eager

--remat-compare (the activation-checkpointing issue): GPT-2 1.5B at micro-batch 8, PyTorch eager
with torch.utils.checkpoint per block against memtrain with train.remat=budget:<bytes>, the
budget chosen so that memtrain's peak is no higher than PyTorch's checkpointed peak (PyTorch's
measured peak minus memtrain's non-activation bytes, read from the memory breakdown of memtrain's
remat=none run; or --remat-budget), beside memtrain remat=none and PyTorch without checkpointing;
and a second way to the same memory: the optimizer on the host (train.offload_optimizer), the
freed GPU memory spent on (almost) no recompute, and --offload-accum micro-batches per step so
that the host update is amortised.

Conventions (the same for both sides):
  - time: the mean over the timed steps after the warm-up steps (memtrain: the ms_per_step of
    each timed step in metrics.jsonl; PyTorch: CUDA events around the timed steps);
  - model FLOPs per token = 6 N + 12 n_layer n_embd T (PaLM, appendix B), N = every parameter
    except the position embeddings, the tied token embedding counted once with its padded rows
    (both sides run the classifier over the padded vocabulary); recompute is not counted, so
    MFU = model FLOP/s / measured bf16 GEMM peak;
  - peak memory on the GPU: memtrain = the largest peak_mem_bytes in metrics.jsonl (every tensor
    memtrain allocated, tracked); PyTorch = torch.cuda.max_memory_allocated() over the whole run
    (warm-up and compilation included; the caching allocator's reserve and the CUDA context
    are excluded on both sides); with --device cpu both are the process peak RSS.

Every result (and each process's command and the end of its output) also goes to --json FILE.
The exit status is non-zero when a run failed; the other runs are still measured and reported.
"""
import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_vs_pytorch import write_shard  # noqa: E402  (memtrain's token shard format)

MIB = 1 << 20
# --deadline: no process starts after this time (time.time()), and none runs past it, so that a
# benchmark inside a fixed window (bench/gpu_device.sh) ends in time with what it measured.
DEADLINE = None
# --progress: each finished run is appended here as one JSON line, as it finishes.
PROGRESS = None
VOCAB_PAD = 128  # memtrain's model.vocab_pad in the GPT-2 configs: 50257 -> 50304 rows

# name: shape, micro-batch, (warm-up, timed) steps in full and --quick runs, peers run by default
PRESETS = {
    "124m": dict(n_layer=12, n_head=12, n_embd=768, vocab=50257, seq=1024, micro_batch=16,
                 steps=(10, 100), quick=(5, 20), peers=("eager", "compile"),
                 quick_peers=("eager", "compile")),
    "1.5b": dict(n_layer=48, n_head=25, n_embd=1600, vocab=50257, seq=1024, micro_batch=8,
                 steps=(5, 30), quick=(3, 10), peers=("eager", "compile"),
                 quick_peers=("eager",)),
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, vocab=512, seq=64, micro_batch=4,
                 steps=(2, 5), quick=(2, 3), peers=("eager", "compile"),
                 quick_peers=("eager",)),
}
# The goals: memtrain's tokens/s at least X times the peer's, with no more peak memory.
GOALS = {
    "124m": [("compile", 1.15)],
    "1.5b": [("eager", 1.15)],
    "tiny": [("eager", 1.15), ("compile", 1.15)],  # smoke test only: exercises the reporting
}
REMAT_SPEEDUP_GOAL = 1.2     # memtrain (budget) tokens/s vs PyTorch eager + checkpoint per block
REMAT_OWN_SPEED_GOAL = 0.9   # memtrain (budget) tokens/s vs memtrain remat=none


# --------------------------------------------------------------------------------------------
# Model arithmetic


def param_counts(s):
    """(all parameters, parameters without position embeddings), padded vocabulary, tied."""
    C, L = s["n_embd"], s["n_layer"]
    rows = padded_vocab(s["vocab"])
    blocks = L * (12 * C * C + 13 * C)  # qkv, proj, fc, fc_proj with biases, two LayerNorms
    without_wpe = rows * C + blocks + 2 * C  # + ln_f
    return without_wpe + s["seq"] * C, without_wpe


def padded_vocab(v):
    return (v + VOCAB_PAD - 1) // VOCAB_PAD * VOCAB_PAD


def flops_per_token(s):
    _, n = param_counts(s)
    return 6 * n + 12 * s["n_layer"] * s["n_embd"] * s["seq"]


# --------------------------------------------------------------------------------------------
# Processes


def run_process(label, cmd, timeout, env=None, cwd=None):
    """Runs cmd in its own process group with its output in a file; returns a dict with rc,
    output, seconds, peak RSS (wait4) and timed_out. A process past `timeout` seconds is killed
    with its group."""
    if DEADLINE is not None:
        left = DEADLINE - time.time() - 5
        if left < 10:
            print("[%s] skipped: the time budget (--deadline) is spent" % label, flush=True)
            return {"label": label, "cmd": cmd, "rc": None, "seconds": 0.0, "timed_out": False,
                    "peak_rss_bytes": 0, "output": "",
                    "error": "skipped: the time budget (--deadline) is spent"}
        timeout = min(timeout, left)
    print("[%s] %s" % (label, " ".join(shlex.quote(c) for c in cmd)), flush=True)
    t0 = time.time()
    with tempfile.TemporaryFile(mode="w+", errors="replace") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        timed_out = False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() - t0 > timeout:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    secs = time.time() - t0
    res = {"label": label, "cmd": cmd, "rc": proc.returncode, "seconds": secs,
           "timed_out": timed_out, "peak_rss_bytes": ru.ru_maxrss * 1024, "output": output}
    if timed_out:
        res["error"] = "timed out after %g s (--timeout)" % timeout
    elif proc.returncode != 0:
        res["error"] = "exit status %d: %s" % (proc.returncode, last_error_line(output))
    print("[%s] %s in %.1f s" % (label, "FAILED (%s)" % res["error"] if "error" in res else "done",
                                  secs), flush=True)
    if "error" in res:
        show_output(label, output)
    return res


def note_progress(run):
    """Appends a finished run's headline numbers to --progress (results as they come)."""
    if PROGRESS and run:
        keys = ("label", "kind", "ok", "error", "seconds", "tokens_per_s", "ms_per_step",
                "peak_bytes", "tracked_peak_bytes", "remat", "budget_bytes")
        rec = {k: run[k] for k in keys if k in run}
        if "result" in run and isinstance(run["result"], dict) and "tflops" in run["result"]:
            rec["tflops"] = run["result"]["tflops"]
        rec["time"] = time.time()
        with open(PROGRESS, "a") as f:
            f.write(json.dumps(rec) + "\n")


def last_error_line(output):
    lines = [l.strip() for l in output.splitlines() if l.strip()]
    for l in reversed(lines):
        if "error" in l.lower() or "Error" in l:
            return l[:300]
    return lines[-1][:300] if lines else "(no output)"


def show_output(label, output, max_lines=400):
    lines = output.splitlines()
    print("---- output of %s%s ----" % (label, " (last %d lines)" % max_lines
                                        if len(lines) > max_lines else ""))
    print("\n".join(lines[-max_lines:]))
    print("---- end of %s ----" % label, flush=True)


def tail(output, n=80):
    return "\n".join(output.splitlines()[-n:])


def last_json(output):
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


# --------------------------------------------------------------------------------------------
# PyTorch side


class Peer:
    """Runs bench/torch_gpt2_gpu.py with one interpreter and device."""

    def __init__(self, a):
        self.a = a
        self.script = os.path.join(HERE, "torch_gpt2_gpu.py")

    def base(self):
        cmd = [self.a.python, self.script, "--device", self.a.device, "--json"]
        if self.a.device == "cpu":
            cmd += ["--threads", str(self.a.threads)]
        return cmd

    def probe(self):
        r = run_process("probe torch", [self.a.python, self.script, "--probe"], 300)
        info = last_json(r["output"]) if "error" not in r else None
        if info is None:
            sys.exit("gpu_vs_pytorch.py: the PyTorch peer cannot run with %s: %s\n"
                     "(install PyTorch for that interpreter or pass --python)"
                     % (self.a.python, r.get("error") or tail(r["output"], 20)))
        return info

    def gemm_peak(self):
        cmd = self.base() + ["--gemm-peak"]
        if self.a.device == "cpu":  # a smaller fp32 product: the smoke test's stand-in
            cmd += ["--gemm-size", "1024", "--gemm-iters", "10", "--gemm-repeats", "3"]
        r = run_process("GEMM peak", cmd, self.a.timeout)
        res = last_json(r["output"]) if "error" not in r else None
        run = finish_run(r, res, "gemm")
        note_progress(run)
        return run

    def train(self, label, shape, mode, checkpoint, warmup, steps):
        cmd = self.base() + [
            "--mode", mode, "--checkpoint", checkpoint, "--precision", self.a.precision,
            "--n-layer", str(shape["n_layer"]), "--n-head", str(shape["n_head"]),
            "--n-embd", str(shape["n_embd"]), "--vocab", str(shape["vocab"]),
            "--vocab-pad", str(VOCAB_PAD), "--seq", str(shape["seq"]),
            "--micro-batch", str(shape["micro_batch"]), "--steps", str(steps),
            "--warmup-steps", str(warmup)]
        r = run_process(label, cmd, self.a.timeout)
        res = last_json(r["output"]) if "error" not in r else None
        run = finish_run(r, res, "pytorch")
        if run.get("ok"):
            run["peak_bytes"] = (res["max_memory_allocated"] if self.a.device == "cuda"
                                 else r["peak_rss_bytes"])
            run["device_in_use_bytes"] = res.get("device_in_use_bytes_at_end")
        print_result(label, run)
        note_progress(run)
        return run


def print_result(label, run):
    """One line per finished run, so a run cut off by a time limit keeps what it measured."""
    if run.get("ok") and "tokens_per_s" in run:
        print("[%s] result: %.0f tokens/s, %.1f ms/step, peak %.0f MiB"
              % (label, run["tokens_per_s"], run.get("ms_per_step", math.nan),
                 run.get("peak_bytes", math.nan) / MIB), flush=True)


def process_record(r, kind):
    """The common record of one process: its command, time and the end of its output."""
    run = {"kind": kind, "label": r["label"], "cmd": " ".join(shlex.quote(c) for c in r["cmd"]),
           "seconds": r["seconds"], "process_peak_rss_bytes": r["peak_rss_bytes"],
           "output_tail": tail(r["output"]), "ok": "error" not in r}
    if "error" in r:
        run["error"] = r["error"]
    return run


def finish_run(r, res, kind):
    """A peer process's record with its JSON result line."""
    run = process_record(r, kind)
    if run["ok"] and res is None:
        run.update(ok=False, error="no JSON result line in the output")
        show_output(r["label"], r["output"])
    elif run["ok"]:
        run["result"] = res
        if kind == "pytorch":
            run["tokens_per_s"] = res["tokens_per_s"]
            run["ms_per_step"] = res["ms_per_step"]
    return run


# --------------------------------------------------------------------------------------------
# memtrain side

BREAKDOWN_ROW = re.compile(
    r"^(parameters|gradients|optimizer state|activations|workspace|communication|other|"
    r"total tracked)\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([\d.]+) MiB")
DEVICE_IN_USE = re.compile(r"device in use\s+([\d.]+) MiB\s+of\s+([\d.]+) MiB")
MODEL_LINE = re.compile(r"model: (\d+) parameters \((\d+) with vocab padding\)")
REMAT_LINE = re.compile(r"^remat (\S+): blocks keep \[(\w*)\].*\| activations ([\d.]+) MiB "
                        r"\| recompute ([\d.]+)%")
BUDGET_TOO_SMALL = re.compile(r"use budget:(\d+) or more")


def memtrain_config(shape, a, shard, out_dir, total_steps, accum=1):
    """A val-less config for the benchmark: training steps only (no validation, checkpoints or
    sample), a constant learning rate, one micro-batch per step (as the PyTorch peer) unless
    `accum` micro-batches are accumulated per step."""
    s = shape
    q = json.dumps  # a TOML basic string is a JSON string
    return "\n".join([
        "# written by bench/gpu_vs_pytorch.py",
        "[model]",
        "n_layer = %d" % s["n_layer"], "n_head = %d" % s["n_head"], "n_embd = %d" % s["n_embd"],
        "block_size = %d" % s["seq"], "vocab_size = %d" % s["vocab"], "vocab_pad = %d" % VOCAB_PAD,
        "[train]",
        "device = %s" % q(a.device), "precision = %s" % q(a.precision),
        "seq_len = %d" % s["seq"], "batch_size = %d" % (s["micro_batch"] * accum),
        "micro_batch_size = %d" % s["micro_batch"], "max_steps = %d" % total_steps,
        "eval_every = 0", "log_every = 1", "threads = %d" % (a.threads if a.device == "cpu" else 0),
        "[optim]",
        'name = "adamw"', "lr = 6e-4", "weight_decay = 0.1", "beta1 = 0.9", "beta2 = 0.95",
        "grad_clip = 1.0", 'schedule = "constant"', "warmup_steps = 0",
        "[data]",
        "train = %s" % q(shard), 'val = ""', 'tokenizer = ""',
        "[io]",
        "out_dir = %s" % q(out_dir), "checkpoint_every = 0", "save_final = false",
        "[sample]",
        "max_tokens = 0",
        ""])


class Memtrain:
    def __init__(self, a, shape, shard, tmp):
        self.a, self.shape, self.shard, self.tmp = a, shape, shard, tmp
        self.env = dict(os.environ)
        if a.device == "cpu":
            self.env.update(OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads))

    def check_keys(self):
        r = run_process("memtrain keys", [self.a.memtrain, "train", "--help-keys"], 120)
        missing = [k for k in ("train.device", "train.precision", "train.remat", "io.save_final",
                               "sample.max_tokens", "train.eval_every", "data.val")
                   if k not in r["output"]]
        if "error" in r or missing:
            sys.exit("gpu_vs_pytorch.py: %s cannot run this benchmark: %s" %
                     (self.a.memtrain, r.get("error") or "no config key " + ", ".join(missing)))

    def train(self, label, warmup, steps, remat="none", accum=1, extra=()):
        """One memtrain run; `accum` micro-batches per step, `extra` more --set key=value."""
        run = self._train(label, warmup, steps, remat, accum, extra)
        note_progress(run)
        return run

    def _train(self, label, warmup, steps, remat, accum, extra):
        name = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
        out_dir = os.path.join(self.tmp, name)
        os.makedirs(out_dir, exist_ok=True)
        config = os.path.join(out_dir, "bench.toml")
        with open(config, "w") as f:
            f.write(memtrain_config(self.shape, self.a, self.shard, out_dir, warmup + steps,
                                    accum))
        cmd = [self.a.memtrain, "train", config, "--set", "train.remat=" + remat,
               "--set", "io.save_final=false", "--set", "sample.max_tokens=0",
               "--set", "train.eval_every=0"]
        for kv in extra:
            cmd += ["--set", kv]
        r = run_process(label, cmd, self.a.timeout, env=self.env)
        run = process_record(r, "memtrain")
        with open(config) as f:
            run["config"] = f.read()
        run["remat"] = remat
        if not run["ok"]:
            m = BUDGET_TOO_SMALL.search(r["output"])
            if m:
                run["smallest_feasible_budget"] = int(m.group(1))
            return run
        try:
            run.update(ok=True, **parse_memtrain(os.path.join(out_dir, "metrics.jsonl"),
                                                  r["output"], warmup, steps, self.shape, accum))
            run["accum"] = accum
        except (OSError, ValueError, KeyError) as e:
            run.update(ok=False, error="could not read memtrain's results: %s" % e)
            show_output(label, r["output"])
            return run
        run["peak_bytes"] = (run["tracked_peak_bytes"] if self.a.device == "cuda"
                             else r["peak_rss_bytes"])
        print_result(label, run)
        return run


def parse_memtrain(metrics_path, output, warmup, steps, shape, accum=1):
    with open(metrics_path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    step_rows = [r for r in rows if "loss" in r]
    if len(step_rows) != warmup + steps:
        raise ValueError("%s has %d step rows, expected %d" % (metrics_path, len(step_rows),
                                                               warmup + steps))
    timed = step_rows[warmup:]
    total_ms = sum(r["ms_per_step"] for r in timed)
    tokens = shape["micro_batch"] * accum * shape["seq"] * len(timed)
    res = {
        "tokens_per_s": tokens / (total_ms / 1000.0),
        "ms_per_step": total_ms / len(timed),
        "ms_per_step_all": [r["ms_per_step"] for r in step_rows],
        "tracked_peak_bytes": max(r["peak_mem_bytes"] for r in step_rows),
        "tracked_end_bytes": step_rows[-1]["mem_bytes"],
        "first_loss": step_rows[0]["loss"],
        "final_loss": step_rows[-1]["loss"],
    }
    if any("skipped" in r for r in step_rows):
        res["skipped_steps"] = sum(1 for r in step_rows if r.get("skipped"))
    breakdown = {}
    for line in output.splitlines():
        m = BREAKDOWN_ROW.match(line.strip())
        if m:
            breakdown[m.group(1)] = {"current_bytes": int(float(m.group(2)) * MIB),
                                     "peak_bytes": int(float(m.group(3)) * MIB),
                                     "reserved_bytes": int(float(m.group(4)) * MIB)}
        m = DEVICE_IN_USE.search(line)
        if m:
            res["device_in_use_bytes"] = int(float(m.group(1)) * MIB)
            res["device_total_bytes"] = int(float(m.group(2)) * MIB)
        m = MODEL_LINE.search(line)
        if m:
            res["params"] = int(m.group(2))
        m = REMAT_LINE.match(line.strip())
        if m:
            res["remat_plan"] = m.group(2)
            res["remat_predicted_activation_bytes"] = int(float(m.group(3)) * MIB)
            res["remat_predicted_recompute_pct"] = float(m.group(4))
    res["breakdown"] = breakdown  # MiB rounded to 0.1 in memtrain's table
    if "activations" in breakdown:
        # Everything but activations at its own peak (parameters, gradients, optimizer state,
        # workspace, ...); at least the tracked peak less the activations, should a category
        # count in the total without a row of its own.
        res["non_activation_peak_bytes"] = max(
            sum(v["peak_bytes"] for k, v in breakdown.items()
                if k not in ("activations", "total tracked")),
            res["tracked_peak_bytes"] - breakdown["activations"]["peak_bytes"])
    return res


def run_lengths(plan):
    """'aaaii' -> 'a3 i2'."""
    out, i = [], 0
    while i < len(plan):
        j = i
        while j < len(plan) and plan[j] == plan[i]:
            j += 1
        out.append("%s%d" % (plan[i], j - i))
        i = j
    return " ".join(out)


# --------------------------------------------------------------------------------------------
# Report


def fmt_mib(b):
    return "-" if b is None else "%.0f" % (b / MIB)


def add_flops(run, fpt, peak):
    if run.get("ok"):
        run["model_tflops"] = fpt * run["tokens_per_s"] / 1e12
        run["mfu"] = run["model_tflops"] / peak if peak else None


def print_table(title, rows, mem_label, peak):
    print()
    print(title)
    head = "%-34s %12s %10s %13s %7s %12s %12s" % ("run", "tokens/s", "ms/step", "model TFLOP/s",
                                                  "MFU", mem_label, "in use MiB")
    print(head)
    print("-" * len(head))
    for name, run in rows:
        if not run or not run.get("ok"):
            why = run.get("error", "not run") if run else "not run"
            print("%-34s %s" % (name, "FAILED: " + why if run else "not run"))
            continue
        mfu = "%6.1f%%" % (100 * run["mfu"]) if run.get("mfu") is not None else "%7s" % "-"
        tf = run["model_tflops"]
        print("%-34s %12.0f %10.1f %13s %7s %12s %12s" % (
            name, run["tokens_per_s"], run["ms_per_step"], "%.1f" % tf if tf >= 1 else "%.3g" % tf,
            mfu, fmt_mib(run.get("peak_bytes")), fmt_mib(run.get("device_in_use_bytes"))))
    if peak:
        print("MFU: model FLOPs (6N + 12 L C T per token, recompute not counted) against the "
              "measured GEMM peak of %.3g TFLOP/s" % peak)
    if mem_label == "peak MiB":
        print("peak MiB: memtrain's tracked peak, PyTorch's max_memory_allocated (whole run); "
              "in use MiB: the driver's count at the end of the run (CUDA context and caches "
              "included)")


def ratio(a, b, key):
    if a and b and a.get("ok") and b.get("ok") and a.get(key) and b.get(key):
        return a[key] / b[key]
    return None


def speed_goal(desc, mine, peer, target):
    r = ratio(mine, peer, "tokens_per_s")
    g = {"goal": desc, "target": target, "ratio": r}
    if r is None:
        g.update(status="not measured", margin=None)
    else:
        g.update(status="met" if r >= target else "NOT MET", margin=r - target)
    return g


def memory_goal(desc, mine, peer):
    g = {"goal": desc, "ratio": ratio(mine, peer, "peak_bytes")}
    if g["ratio"] is None:
        g.update(status="not measured", margin_bytes=None)
    else:
        slack = peer["peak_bytes"] - mine["peak_bytes"]
        g.update(status="met" if slack >= 0 else "NOT MET", margin_bytes=slack)
    return g


def print_goals(goals):
    print("goals:")
    for g in goals:
        if g["status"] == "not measured":
            print("  %-62s not measured (a run failed or was not run)" % g["goal"])
        elif "target" in g:
            print("  %-62s %5.2fx  %-7s (margin %+.2fx, %+.1f%%)" % (
                g["goal"], g["ratio"], g["status"], g["margin"], 100 * g["margin"] / g["target"]))
        else:
            print("  %-62s %5.2fx  %-7s (margin %+.0f MiB)" % (
                g["goal"], g["ratio"], g["status"], g["margin_bytes"] / MIB))


# --------------------------------------------------------------------------------------------
# Benchmarks


def preset_benchmark(a, shape, warmup, steps, peer, mt, res):
    fpt = res["flops_per_token"]
    gemm = peer.gemm_peak()
    res["gemm_peak"] = gemm
    peak = gemm["result"]["tflops"] if gemm.get("ok") else None
    runs = {"memtrain": mt.train("memtrain (%s)" % a.precision, warmup, steps)}
    for p in a.peers:
        runs["pytorch_" + p] = peer.train("PyTorch %s" % p, shape, p, "none", warmup, steps)
    for r in runs.values():
        add_flops(r, fpt, peak)
    res["runs"] = runs

    mem_label = "peak MiB" if a.device == "cuda" else "peak RSS MiB"
    print_table("GPU benchmark, preset %s: %d layers x %d wide, %d heads, vocab %d (%d rows), "
                "micro-batch %d x %d, %s, %d timed steps after %d warm-up, on %s"
                % (a.preset, shape["n_layer"], shape["n_embd"], shape["n_head"], shape["vocab"],
                   padded_vocab(shape["vocab"]), shape["micro_batch"], shape["seq"],
                   a.precision, steps, warmup, res["device_name"]),
                [("memtrain (%s)" % a.precision, runs["memtrain"])] +
                [("PyTorch %s (%s)" % (p, "bf16 autocast" if a.precision == "bf16"
                                        else a.precision), runs["pytorch_" + p])
                 for p in a.peers], mem_label, peak)
    ratios = {}
    for p in a.peers:
        sp = ratio(runs["memtrain"], runs["pytorch_" + p], "tokens_per_s")
        me = ratio(runs["memtrain"], runs["pytorch_" + p], "peak_bytes")
        ratios["memtrain/" + p] = {"speed": sp, "memory": me}
        print("ratio memtrain/PyTorch %-8s speed %s, peak memory %s" % (
            p + ":", "%.2fx" % sp if sp else "-", "%.2fx" % me if me else "-"))
    res["ratios"] = ratios
    goals = []
    for p, target in GOALS[a.preset]:
        peer_run = runs.get("pytorch_" + p)
        goals.append(speed_goal("tokens/s >= %.2fx PyTorch %s" % (target, p),
                                runs["memtrain"], peer_run, target))
        goals.append(memory_goal("peak memory <= PyTorch %s" % p, runs["memtrain"], peer_run))
    res["goals"] = goals
    print_goals(goals)


def offload_accum_run(a, warmup, steps, mt, runs):
    """--remat-compare's second way to PyTorch's checkpointed memory: the optimizer on the host
    (train.offload_optimizer), the activation budget what is left under PyTorch's peak (a short
    probe gives the non-activation bytes), a.offload_accum micro-batches per step. Returns the
    run, or None when it is not asked for or has no budget."""
    if a.offload_accum <= 0 or a.device != "cuda":
        return None
    pt = runs["pytorch_checkpoint"]
    extra = ("train.offload_optimizer=true",)
    probe = mt.train("memtrain ZeRO-Offload remat=full (budget probe)", 1, 1, "full", 1, extra)
    runs["memtrain_offload_probe"] = probe
    if not (pt.get("ok") and probe.get("ok") and "non_activation_peak_bytes" in probe):
        return None
    budget = pt["peak_bytes"] - probe["non_activation_peak_bytes"] - a.remat_margin_mib * MIB
    if budget <= 0:
        return None
    # Fewer, longer steps: each holds offload_accum micro-batches.
    w, n = max(1, warmup // 3), max(2, steps // 10)
    run = mt.train("memtrain ZeRO-Offload remat=budget", w, n, "budget:%d" % budget,
                   a.offload_accum, extra)
    if not run.get("ok") and run.get("smallest_feasible_budget"):
        budget = run["smallest_feasible_budget"]
        run = mt.train("memtrain ZeRO-Offload remat=budget (smallest feasible)", w, n,
                       "budget:%d" % budget, a.offload_accum, extra)
    run["budget_bytes"] = budget
    runs["memtrain_offload_budget"] = run
    return run


def remat_benchmark(a, shape, warmup, steps, peer, mt, res):
    fpt = res["flops_per_token"]
    gemm = peer.gemm_peak()
    res["gemm_peak"] = gemm
    peak = gemm["result"]["tflops"] if gemm.get("ok") else None
    runs = {}
    runs["pytorch_checkpoint"] = peer.train("PyTorch eager, checkpoint per block", shape, "eager",
                                            "block", warmup, steps)
    runs["pytorch_eager"] = peer.train("PyTorch eager", shape, "eager", "none", warmup, steps)
    runs["memtrain_none"] = mt.train("memtrain remat=none", warmup, steps, "none")

    # The budget: PyTorch's checkpointed peak minus memtrain's non-activation bytes (parameters,
    # gradients, optimizer state, workspace: the sum of their peaks), so that memtrain's whole
    # peak is at most PyTorch's.
    budget, how = a.remat_budget, "--remat-budget"
    if budget is None:
        src = runs["memtrain_none"]
        if not (src.get("ok") and "non_activation_peak_bytes" in src):
            # e.g. remat=none ran out of memory: a short remat=full run gives the breakdown
            src = mt.train("memtrain remat=full (budget probe)", 1, 1, "full")
            runs["memtrain_probe"] = src
        pt = runs["pytorch_checkpoint"]
        if pt.get("ok") and src.get("ok") and "non_activation_peak_bytes" in src:
            nonact = src["non_activation_peak_bytes"]
            budget = pt["peak_bytes"] - nonact - a.remat_margin_mib * MIB
            how = ("PyTorch checkpointed peak %.1f MiB - memtrain's non-activation peaks %.1f MiB "
                   "(%s) - margin %d MiB" % (pt["peak_bytes"] / MIB, nonact / MIB, src["label"],
                                             a.remat_margin_mib))
    res["remat_budget"] = {"bytes": budget, "from": how}
    if budget is None or budget <= 0:
        why = ("no budget: PyTorch's checkpointed run or memtrain's memory breakdown is missing"
               if budget is None else
               "budget %d bytes <= 0: memtrain's non-activation memory alone exceeds PyTorch's "
               "checkpointed peak" % budget)
        print("gpu_vs_pytorch.py: " + why, flush=True)
        runs["memtrain_budget"] = {"ok": False, "error": why, "label": "memtrain remat=budget"}
    else:
        print("remat budget: %d bytes (%.1f MiB) from %s" % (budget, budget / MIB, how))
        run = mt.train("memtrain remat=budget", warmup, steps, "budget:%d" % budget)
        run["budget_bytes"] = budget
        if not run.get("ok") and run.get("smallest_feasible_budget"):
            least = run["smallest_feasible_budget"]
            print("remat budget %d is below memtrain's smallest feasible plan; measuring "
                  "budget:%d (its smallest) instead" % (budget, least), flush=True)
            res["remat_budget"]["raised_to"] = least
            run = mt.train("memtrain remat=budget (smallest feasible)", warmup, steps,
                           "budget:%d" % least)
            run["budget_bytes"] = least
        runs["memtrain_budget"] = run
        if a.device == "cuda" and run.get("budget_bytes"):
            # The same budget with block inputs in host memory allowed (recompute and offload
            # chosen together): offloaded inputs leave room for blocks that keep more.
            b = run["budget_bytes"]
            runs["memtrain_budget_offload"] = mt.train("memtrain remat=budget+offload", warmup,
                                                       steps, "budget:%d+offload" % b)
            runs["memtrain_budget_offload"]["budget_bytes"] = b
    offload = offload_accum_run(a, warmup, steps, mt, runs)
    for r in runs.values():
        add_flops(r, fpt, peak)
    res["runs"] = runs

    mb = runs["memtrain_budget"]
    mem_label = "peak MiB" if a.device == "cuda" else "peak RSS MiB"
    print_table("Activation checkpointing, preset %s: %d layers x %d wide, micro-batch %d x %d, "
                "%s, %d timed steps after %d warm-up, on %s"
                % (a.preset, shape["n_layer"], shape["n_embd"], shape["micro_batch"],
                   shape["seq"], a.precision, steps, warmup, res["device_name"]),
                [("memtrain remat=none", runs["memtrain_none"]),
                 ("memtrain remat=budget" + (":%.0fMiB" % (mb["budget_bytes"] / MIB)
                                             if mb.get("budget_bytes") else ""), mb),
                 ("PyTorch eager", runs["pytorch_eager"]),
                 ("PyTorch eager + checkpoint/block", runs["pytorch_checkpoint"])] +
                ([("memtrain remat=budget+offload", runs["memtrain_budget_offload"])]
                 if "memtrain_budget_offload" in runs else []) +
                ([("memtrain ZeRO-Offload, %d micro-batches/step" % a.offload_accum, offload)]
                 if offload else []),
                mem_label, peak)
    for label, r in (("budget", mb), ("budget+offload", runs.get("memtrain_budget_offload", {}))):
        if r.get("remat_plan"):
            print("memtrain's %s plan (blocks: a all, s selective, i input only, o input in host "
                  "memory): %s; predicted recompute %.1f%% of a step"
                  % (label, run_lengths(r["remat_plan"]),
                     r.get("remat_predicted_recompute_pct", math.nan)))
    goals = [
        speed_goal("tokens/s >= %.2fx PyTorch eager + checkpoint" % REMAT_SPEEDUP_GOAL,
                   mb, runs["pytorch_checkpoint"], REMAT_SPEEDUP_GOAL),
        memory_goal("peak memory <= PyTorch eager + checkpoint", mb, runs["pytorch_checkpoint"]),
        speed_goal("tokens/s >= %.2fx memtrain remat=none" % REMAT_OWN_SPEED_GOAL,
                   mb, runs["memtrain_none"], REMAT_OWN_SPEED_GOAL),
    ]
    if offload:
        # The same goals met another way: the optimizer's 12 bytes/parameter on the host leave
        # the GPU room for (almost) no recompute, and accumulating micro-batches amortises the
        # host update. PyTorch's optimizer step (on the GPU, once per micro-batch there) is a few
        # percent of its step, so the comparison slightly favours this row.
        print("ZeRO-Offload row: train.offload_optimizer with %d micro-batches of %d x %d per "
              "step (global batch %d sequences), remat %s" % (
                  a.offload_accum, shape["micro_batch"], shape["seq"],
                  a.offload_accum * shape["micro_batch"], offload.get("remat")))
        goals += [
            speed_goal("ZeRO-Offload: tokens/s >= %.2fx PyTorch eager + checkpoint"
                       % REMAT_SPEEDUP_GOAL, offload, runs["pytorch_checkpoint"],
                       REMAT_SPEEDUP_GOAL),
            memory_goal("ZeRO-Offload: peak memory <= PyTorch eager + checkpoint", offload,
                        runs["pytorch_checkpoint"]),
            speed_goal("ZeRO-Offload: tokens/s >= %.2fx memtrain remat=none"
                       % REMAT_OWN_SPEED_GOAL, offload, runs["memtrain_none"],
                       REMAT_OWN_SPEED_GOAL),
        ]
    res["goals"] = goals
    res["ratios"] = {
        "memtrain_budget/pytorch_checkpoint": {
            "speed": ratio(mb, runs["pytorch_checkpoint"], "tokens_per_s"),
            "memory": ratio(mb, runs["pytorch_checkpoint"], "peak_bytes")},
        "memtrain_budget/memtrain_none": {
            "speed": ratio(mb, runs["memtrain_none"], "tokens_per_s"),
            "memory": ratio(mb, runs["memtrain_none"], "peak_bytes")},
        "memtrain_budget_offload/pytorch_checkpoint": {
            "speed": ratio(runs.get("memtrain_budget_offload", {}), runs["pytorch_checkpoint"],
                           "tokens_per_s"),
            "memory": ratio(runs.get("memtrain_budget_offload", {}), runs["pytorch_checkpoint"],
                            "peak_bytes")},
        "memtrain_none/pytorch_eager": {
            "speed": ratio(runs["memtrain_none"], runs["pytorch_eager"], "tokens_per_s"),
            "memory": ratio(runs["memtrain_none"], runs["pytorch_eager"], "peak_bytes")},
    }
    print_goals(goals)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memtrain", default="build-gpu/memtrain", help="the memtrain binary")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="model (default 124m; 1.5b with --remat-compare)")
    ap.add_argument("--remat-compare", action="store_true",
                    help="activation checkpointing: memtrain remat=budget vs PyTorch checkpoint")
    ap.add_argument("--remat-budget", type=int, help="bytes; default: derived (see above)")
    ap.add_argument("--offload-accum", type=int,
                    help="--remat-compare: also run memtrain with the optimizer on the host and "
                         "this many micro-batches per step (default 64, 32 with --quick; 0: no)")
    ap.add_argument("--remat-margin-mib", type=int, default=16,
                    help="subtracted from the derived budget (rounding of memtrain's table)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: smoke test (memtrain fp32 on the CPU, torch on the CPU)")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"],
                    help="memtrain's train.precision and the peer's autocast (default bf16; "
                         "fp32 with --device cpu)")
    ap.add_argument("--peers", help="comma-separated PyTorch modes for a preset: eager,compile "
                                    "(default: the preset's; --quick drops compile on 1.5b)")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--steps", type=int, help="timed steps (default: the preset's)")
    ap.add_argument("--warmup-steps", type=int, help="warm-up steps (default: the preset's)")
    ap.add_argument("--micro-batch", type=int, help="override the preset's micro-batch")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with PyTorch for the peer (default: this one)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="--device cpu threads")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds per process before it is killed (default 900)")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--deadline", type=float,
                    help="seconds from now: no process runs past it (a fixed window)")
    ap.add_argument("--progress", help="append each finished run to this JSONL file")
    a = ap.parse_args()
    global DEADLINE, PROGRESS
    if a.deadline:
        DEADLINE = time.time() + a.deadline
    PROGRESS = a.progress

    a.preset = a.preset or ("1.5b" if a.remat_compare else "124m")
    if a.offload_accum is None:
        a.offload_accum = 32 if a.quick else 64
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    if a.device == "cpu" and a.precision != "fp32":
        ap.error("--device cpu trains in fp32 (memtrain's CPU engine is fp32 only)")
    p = PRESETS[a.preset]
    shape = {k: p[k] for k in ("n_layer", "n_head", "n_embd", "vocab", "seq", "micro_batch")}
    if a.micro_batch:
        shape["micro_batch"] = a.micro_batch
    warmup, steps = p["quick"] if a.quick else p["steps"]
    warmup = a.warmup_steps if a.warmup_steps is not None else warmup
    steps = a.steps if a.steps is not None else steps
    if steps < 1 or warmup < 1:
        ap.error("--steps and --warmup-steps must be at least 1 (the first step is never timed)")
    a.peers = (a.peers.split(",") if a.peers else
               list(p["quick_peers"] if a.quick else p["peers"]))
    if any(x not in ("eager", "compile") for x in a.peers) or not a.peers:
        ap.error("--peers takes eager and/or compile")
    if a.remat_compare and a.peers != list(p["quick_peers" if a.quick else "peers"]):
        print("note: --peers is ignored by --remat-compare (PyTorch eager with and without "
              "checkpointing)")

    # Preflight: a missing peer or GPU is an error, not a skipped row.
    if not (os.path.isfile(a.memtrain) and os.access(a.memtrain, os.X_OK)):
        sys.exit("gpu_vs_pytorch.py: no memtrain binary at %s (build it, or pass --memtrain)"
                 % a.memtrain)
    peer = Peer(a)
    info = peer.probe()
    print("peer: torch %s (Python %s), CUDA %s, %s" % (
        info["torch_version"], info["python"], info["cuda_version"],
        info["device_name"] or "no GPU"))
    if a.device == "cuda":
        if not info["cuda_available"]:
            sys.exit("gpu_vs_pytorch.py: torch %s with %s sees no CUDA device; the GPU "
                     "benchmark needs one (--device cpu is the smoke test)"
                     % (info["torch_version"], a.python))
        if a.precision == "bf16" and not info["bf16_supported"]:
            sys.exit("gpu_vs_pytorch.py: %s does not support bf16" % info["device_name"])
        if not info["sdpa"]:
            sys.exit("gpu_vs_pytorch.py: torch %s has no F.scaled_dot_product_attention"
                     % info["torch_version"])
    if "compile" in a.peers and not a.remat_compare and not info["compile"]:
        sys.exit("gpu_vs_pytorch.py: torch %s has no torch.compile (needed for the compile "
                 "peer); use --peers eager" % info["torch_version"])

    with tempfile.TemporaryDirectory(prefix="memtrain-gpu-bench-") as tmp:
        mt = Memtrain(a, shape, os.path.join(tmp, "train.bin"), tmp)
        mt.check_keys()
        n_tokens = max(200_000, (warmup + steps + 2) * shape["micro_batch"] * (shape["seq"] + 1))
        # (the offload row's longer steps wrap around the shard: the data loader starts a new
        # epoch, which costs nothing measurable)
        write_shard(mt.shard, n_tokens, shape["vocab"], 1)
        n_all, n_flops = param_counts(shape)
        res = {
            "benchmark": "remat-compare" if a.remat_compare else "preset",
            "preset": a.preset, "device": a.device, "precision": a.precision,
            "device_name": info["device_name"] or "cpu", "torch_version": info["torch_version"],
            "shape": dict(shape, vocab_rows=padded_vocab(shape["vocab"])),
            "warmup_steps": warmup, "steps": steps, "quick": a.quick,
            "params": n_all, "params_for_flops": n_flops,
            "flops_per_token": flops_per_token(shape),
            "flops_convention": "6 N + 12 n_layer n_embd T (PaLM), N = parameters without "
                                "position embeddings, tied embedding once, padded vocabulary; "
                                "recompute not counted",
            "memory_convention": (
                "memtrain: max peak_mem_bytes in metrics.jsonl (tracked device tensors); "
                "PyTorch: torch.cuda.max_memory_allocated() over the whole run incl. warm-up"
                if a.device == "cuda" else "process peak RSS (wait4) for both"),
            "timing_convention": "mean over the timed steps after the warm-up steps",
        }
        if a.remat_compare:
            remat_benchmark(a, shape, warmup, steps, peer, mt, res)
        else:
            preset_benchmark(a, shape, warmup, steps, peer, mt, res)

    for name, run in res["runs"].items():  # both sides must have built the same model
        got = run.get("result", run).get("params") if run.get("ok") else None
        if got is not None and got != n_all:
            print("WARNING: %s has %d parameters, the benchmark's shape %d" % (name, got, n_all))
            run["params_mismatch"] = True
    failed = [n for n, r in list(res["runs"].items()) + [("gemm_peak", res["gemm_peak"])]
              if not r.get("ok")]
    res["failed"] = failed
    res["ok"] = not failed
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
        print("results: %s" % a.json)
    if failed:
        print("gpu_vs_pytorch.py: %d run(s) failed: %s" % (len(failed), ", ".join(failed)))
        sys.exit(1)


if __name__ == "__main__":
    main()
