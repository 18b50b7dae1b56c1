// The end-of-run memory report (see report.h).
#include "train/report.h"

#include <fmt/format.h>

#include "engine/host_memory.h"
#include "io/run_report.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"

namespace memtrain {

// The planner (`memtrain estimate`) for this run's rank 0, the rank that reports: the engines'
// layout functions for every layout they run, the formulas for the rest (planner/memory_model.h).
plan::MemoryEstimate planner_estimate(const RunConfig& cfg, const Engine& engine) {
    plan::RunSpec r = planner_run_spec(cfg, engine.arena_format());
    r.block_plan = engine.remat_plan();  // budget:, every:K and sqrt solve a plan per block
    return plan::estimate_rank_memory(plan::model_from_config(cfg.model), r, planner_rank(cfg, 0));
}

std::vector<MemoryPrediction> report_rows(const RunPlan& plan, const Engine& engine,
                                          bool plan_rows) {
    std::vector<MemoryPrediction> built =
        engine.predicted_memory(plan.cfg.micro_batch(), plan.cfg.train.seq_len);
    if (!plan_rows || plan.memory.empty()) return built;
    std::vector<MemoryPrediction> rows = plan.memory;
    rows.insert(rows.end(), built.begin() + (std::ptrdiff_t)plan.memory.size(), built.end());
    return rows;
}

std::string memory_report(const RunPlan& plan, Engine& engine, dist::Communicator& comm,
                          bool plan_rows) {
    const RunConfig& cfg = plan.cfg;
    const std::vector<MemoryPrediction> predicted = report_rows(plan, engine, plan_rows);
    auto s = engine.memory().snapshot();
    // Every rank's peak of model states (parameters + gradients + optimizer state) and of
    // activations, measured and predicted, gathered so rank 0 can show that sharding or the
    // pipeline really spread them. A collective.
    constexpr int kRec = 4;
    std::vector<double> ranks(kRec * (std::size_t)comm.size());
    {
        double mine[kRec] = {
            (double)(s.peak(MemCategory::Parameters) + s.peak(MemCategory::Gradients) +
                     s.peak(MemCategory::OptimizerState)),
            0.0, (double)s.peak(MemCategory::Activations), 0.0};
        for (const auto& r : predicted) {
            if (r.category == MemCategory::Activations) mine[3] += (double)r.bytes;
            if (r.category == MemCategory::Parameters || r.category == MemCategory::Gradients ||
                r.category == MemCategory::OptimizerState)
                mine[1] += (double)r.bytes;
        }
        comm.all_gather_bytes(mine, ranks.data(), sizeof(mine));
    }
    if (comm.rank() != 0) return "";
    const int N = cfg.world;
    std::string out = fmt::format("\nmemory breakdown ({})\n", engine.memory_title());
    out += fmt::format("{:<16} {:>12} {:>12} {:>12} {:>12}  {}\n", "category", "current", "peak",
                       "reserved", "predicted", "formula");
    std::size_t pred_total = 0;
    bool comm_predicted = false;
    for (const auto& r : predicted) {
        int i = static_cast<int>(r.category);
        comm_predicted = comm_predicted || r.category == MemCategory::Communication;
        pred_total += r.bytes;
        out += fmt::format("{:<16} {:>12} {:>12} {:>12} {:>12}  {}\n", category_name(r.category),
                           mib(s.used[i]), mib(s.peak_used[i]), mib(s.reserved[i]), mib(r.bytes),
                           r.formula);
    }
    {
        // Unit buffers of the data-parallel engine: gathered parameters (stage 3), gradient
        // buckets (stages 2-3) and reduce-scatter pieces; alive only while a unit is in use.
        const int i = static_cast<int>(MemCategory::Communication);
        if (s.peak_used[i] > 0 && !comm_predicted)
            out += fmt::format("{:<16} {:>12} {:>12} {:>12} {:>12}  {}\n", "communication",
                               mib(s.used[i]), mib(s.peak_used[i]), mib(s.reserved[i]), "-",
                               "unit buffers (largest unit: " +
                                   mib(4 * engine.weights().layout.largest_unit()) + ")");
    }
    out += fmt::format("{:<16} {:>12} {:>12} {:>12} {:>12}\n", "total tracked", mib(s.total_used),
                       mib(s.peak_total_used), mib(s.total_reserved), mib(pred_total));
    out += engine.memory_footer();
    const auto est = planner_estimate(cfg, engine);
    out += fmt::format(
        "planner estimate (per rank): parameters {} | gradients {} | optimizer {} | "
        "activations {} (+ recompute working set {}) | logits and loss {}\n",
        mib(est.bytes("parameters")), mib(est.bytes("gradients")),
        mib(est.bytes("optimizer states")), mib(est.bytes("activations")),
        mib(est.bytes("recompute working set")), mib(est.bytes("logits and loss")));
    if (cfg.train.pp > 1) {
        out += "per pipeline stage (peak, measured / predicted):\n";
        for (int r = 0; r < N; r++)
            out += fmt::format(
                "  stage {}{}: model states {} / {} | activations {} / {}\n", r % cfg.train.pp,
                cfg.dp() > 1 ? fmt::format(" of pipeline {} (rank {})", r / cfg.train.pp, r)
                             : std::string(),
                mib((std::size_t)ranks[kRec * r]), mib((std::size_t)ranks[kRec * r + 1]),
                mib((std::size_t)ranks[kRec * r + 2]), mib((std::size_t)ranks[kRec * r + 3]));
    } else if (N > 1) {
        out += "model states per rank (peak):";
        for (int r = 0; r < N; r++)
            out += fmt::format(" rank {} {}{}", r, mib((std::size_t)ranks[kRec * r]),
                               r + 1 < N ? " |" : "\n");
    }
    return out;
}

void write_memory_json(const RunPlan& plan, Engine& engine, const std::string& path,
                       bool plan_rows) {
    io::write_memory_json(path, engine.memory_title(), engine.memory().snapshot(),
                          report_rows(plan, engine, plan_rows), planner_estimate(plan.cfg, engine),
                          process_peak_rss());
}

}  // namespace memtrain
