// A finished (or running) training run as data, and `memtrain report`'s page of it: the
// metrics.jsonl parser, memory.json (measured peaks beside predictions, written at the end of a
// run), and one self-contained HTML file with inline SVG charts (no scripts, no network).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "planner/memory_model.h"

namespace memtrain::io {

// One optimizer step's line of metrics.jsonl. Fields a run did not record stay empty, so logs
// of older versions still load.
struct StepRecord {
    int64_t step = 0;
    std::optional<double> loss, lr, grad_norm, tokens_per_s, ms_per_step, mem_bytes, peak_mem_bytes,
        loss_scale;
    bool skipped = false;
    std::vector<std::pair<std::string, double>> mem;     // current bytes by category name
    std::vector<std::pair<std::string, double>> phases;  // rank 0's ms per phase (phases_ms)
};

struct RunMetrics {
    std::vector<StepRecord> steps;                     // ascending step
    std::vector<std::pair<int64_t, double>> val_loss;  // (step, loss), ascending step
    std::vector<int64_t> resumes;                      // the steps runs resumed from
    // The divergence guard's actions ({"step": S, "event": "guard", ...} lines): at step S it went
    // back to the state after to_step ("skip": the batch skipped; "rollback": the learning rate
    // lowered too). The lines logged for the steps it undid are dropped, as for a resume.
    struct GuardMark {
        int64_t step = 0, to_step = 0;
        std::string action, reason;
    };
    std::vector<GuardMark> guard;
    // train.diagnostics = amp ({"step": S, "event": "amp", ...} lines): the gradients' log2|g|
    // histogram of each diagnosed step, from exponent log2_lo up, and the loss scale it was
    // judged at.
    struct AmpRecord {
        int64_t step = 0;
        int log2_lo = 0, loss_scale_log2 = 0;
        std::vector<double> counts;
        int64_t values = 0, zeros = 0;
    };
    std::vector<AmpRecord> amp;
    // The same steps' activation gradients ({"event": "amp_activations"} lines, their
    // "activation_grads"): the lecture's Figure 5.
    std::vector<AmpRecord> amp_activation_grads;
    // What the parser passed over: a torn last line ("" when none).
    std::string note;
};

// Parses metrics.jsonl text. Blank lines are skipped. A resumed run appends to the file after
// a line {"step": S, "event": "resume"}: the lines for steps after S logged before it (by the
// run that died) are dropped, so no step is plotted twice; where a step still appears twice the
// later line wins. A last line that is not complete JSON (a run killed while writing it, a full
// disk) is skipped and `note` says so. Throws memtrain::Error naming `origin` and the line
// number for any other line that is not a JSON object with an integer "step" or whose fields
// have the wrong type.
RunMetrics parse_metrics(const std::string& text, const std::string& origin);

// The `, "mem": {"parameters": N, ...}` fragment of a metrics line: current bytes per category
// (category names with '_' for ' ').
std::string metrics_memory_field(const MemoryStats& stats);

// memory.json: one entry per category with measured current, peak and reserved bytes and the
// engine's predicted bytes (the numbers of the end-of-run memory table), plus the analytic
// planner's lines. Written to a temporary name and renamed into place.
void write_memory_json(const std::string& path, const std::string& title, const MemoryStats& stats,
                       const std::vector<MemoryPrediction>& predicted,
                       const plan::MemoryEstimate& planner, std::size_t process_peak_rss);

struct MemoryCategoryRecord {
    std::string name;
    double current = 0, peak = 0, reserved = 0;
    std::optional<double> predicted;  // none: the engine makes no prediction for it
    std::string formula;
};

struct MemoryRecord {
    std::string title;
    std::vector<MemoryCategoryRecord> categories;
    double peak_total = 0;
    std::vector<std::pair<std::string, double>> planner;  // (line name, bytes)
    double process_peak_rss = 0;
};

MemoryRecord parse_memory_json(const std::string& text, const std::string& origin);

struct ReportInput {
    std::string run_dir;
    RunMetrics metrics;
    std::optional<MemoryRecord> memory;  // none: the run wrote no memory.json
    std::string config_toml;             // the latest checkpoint's memtrain.toml, or empty
    std::string config_origin;           // its path
};

// Reads RUN_DIR/metrics.jsonl (required; or the io.metrics the latest checkpoint's config
// names), RUN_DIR/memory.json and the latest checkpoint's memtrain.toml (both optional).
ReportInput read_run(const std::string& run_dir);
std::string render_report_html(const ReportInput& input);
// The page of a sweep (`memtrain sweep` writes DIR/sweep.json; `memtrain report DIR` renders
// it): the isoFLOP curves, validation loss against log10 N, one per budget, with the fitted
// law's curves dashed beside them and its optimum at each budget marked; the law and the runs.
std::string render_sweep_html(const std::string& dir, const std::string& sweep_json);
// read_run + render, written to `out_path` (default RUN_DIR/report.html) through a temporary
// file, so a failure never leaves a partial page. Returns the path written; `note` receives
// what the metrics parser passed over (RunMetrics::note).
std::string write_run_report(const std::string& run_dir, const std::string& out_path = "",
                             std::string* note = nullptr);

}  // namespace memtrain::io
