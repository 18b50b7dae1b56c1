// `memtrain diagnose`: where a run's step time went and why. The trainer writes timings.json
// at the end of a run (every rank's mean seconds per step in each phase of core/phase_clock.h,
// and what the run plan predicted for recompute and the pipeline bubble); diagnose reads it with
// memory.json, splits the step into compute and its losses (recompute, pipeline bubble,
// communication, waiting on the slowest rank, optimizer, data loading), names the largest loss
// and what would recover it, and with a baseline run names the phase that grew. docs/diagnose.md.
#pragma once

#include <string>
#include <vector>

#include "core/phase_clock.h"

namespace memtrain {

// One rank's mean seconds per timed step.
struct RankTimes {
    int rank = 0;
    int stage = 0, replica = 0, shard = 0;  // its place in the mesh
    double step_s = 0;                      // the whole step, wall clock
    PhaseTimes phases;                      // inside it, per phase
};

// What timings.json holds.
struct RunTimings {
    int steps = 0;  // timed steps: the run's steps but its first (which pays the warm-up)
    std::string engine;
    bool gpu = false;
    int dp = 1, tp = 1, pp = 1, ps_servers = 0;
    int micro_batches = 1;  // per step on each data-parallel replica (gradient accumulation)
    std::string schedule;   // the pipeline schedule ("" without a pipeline)
    int virtual_stages = 1;
    std::string remat;              // train.remat as written
    int64_t tokens_per_step = 0;    // the global batch
    double recompute_fraction = 0;  // the plan: recompute over a micro-batch's step cost
    double bubble_fraction = 0;     // the plan: pipeline fill / (micro-batches + fill)
    std::vector<RankTimes> ranks;
};

void write_timings_json(const std::string& path, const RunTimings& t);
// Fails naming the file when it is missing, not JSON, or lacks a field.
RunTimings read_timings_json(const std::string& path);

// One way the step lost time, in milliseconds per step.
struct TimeLoss {
    std::string key;   // "recompute", "bubble", "comm", "wait", "optimizer", "data", "other"
    std::string what;  // a phrase for people
    double ms = 0;
    double predicted_ms = -1;  // what the plan expected (-1: no prediction)
    std::string remedy;        // what would recover it
};

struct MemoryRow {
    std::string name;
    double peak = 0, predicted = -1, reserved = 0, current = 0;
};

struct Diagnosis {
    std::string run_dir;
    RunTimings t;
    double step_ms = 0, compute_ms = 0;  // the step (slowest rank) and its useful compute
    double predicted_step_ms = 0;        // compute + the plan's recompute and bubble
    int slowest_rank = 0;                // the rank the others wait for
    std::vector<TimeLoss> losses;        // largest first
    std::vector<MemoryRow> memory;       // memory.json's categories (empty: none written)
    double peak_rss = -1;
    std::vector<std::string> notes;  // what the numbers cannot show (GPU host times, ...)
    // With a baseline: its step, and per loss key (and "compute") ms per 1000 tokens per
    // data-parallel replica, here and in the baseline, largest growth first.
    std::string baseline_dir;
    struct Growth {
        std::string key, what;
        double base = 0, here = 0;  // ms per 1000 tokens per replica
    };
    std::vector<Growth> growth;
    double base_step_ms = 0;
};

// Reads RUN_DIR's timings.json (and memory.json where written); `baseline_dir` may be empty.
Diagnosis diagnose_run(const std::string& run_dir, const std::string& baseline_dir);
// One page of text, and the same as JSON.
std::string diagnosis_text(const Diagnosis& d);
std::string diagnosis_json(const Diagnosis& d);

}  // namespace memtrain
