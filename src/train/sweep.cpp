// The isoFLOP grid and the loss points of run directories (see sweep.h).
#include "train/sweep.h"

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/run_report.h"
#include "io/text_file.h"
#include "planner/model_shape.h"

namespace fs = std::filesystem;

namespace memtrain {

double non_embedding_params(const ModelConfig& model) {
    const plan::ModelSpec m = plan::model_from_config(model);
    return (double)(m.total_params() - m.embedding_params());
}

plan::LossPoint run_loss_point(const std::string& run_dir) {
    const std::string ckpt = resolve_checkpoint_dir(run_dir);
    const RunConfig cfg = checkpoint_config(ckpt);
    const TrainState st = checkpoint_state(ckpt);
    const fs::path metrics = fs::path(run_dir) / cfg.io.metrics;
    std::error_code ec;
    if (!fs::is_regular_file(metrics, ec))
        fail("{}: no {} (the run's validation losses are read from it)", run_dir, metrics.string());
    const io::RunMetrics m = io::parse_metrics(io::read_text_file(metrics), metrics.string());
    double loss = NAN;
    for (const auto& [step, v] : m.val_loss)
        if (step == st.step) loss = v;
    if (!std::isfinite(loss))
        fail(
            "{}: no validation loss at step {} (its newest checkpoint, {}): a run to fit needs "
            "data.val, which the trainer evaluates at the last step",
            run_dir, st.step, ckpt);
    plan::LossPoint p;
    p.params = non_embedding_params(cfg.model);
    p.tokens = (double)st.step * (double)cfg.tokens_per_step();
    p.loss = loss;
    p.origin = run_dir;
    return p;
}

std::vector<std::pair<int, int>> parse_sweep_sizes(const std::string& text) {
    std::vector<std::pair<int, int>> out;
    std::size_t at = 0;
    while (at <= text.size()) {
        const std::size_t comma = std::min(text.find(',', at), text.size());
        const std::string item = text.substr(at, comma - at);
        int l = 0, w = 0;
        char x = 0, extra = 0;
        if (std::sscanf(item.c_str(), "%d%c%d%c", &l, &x, &w, &extra) != 3 || x != 'x' || l <= 0 ||
            w <= 0 || w % 64 != 0)
            fail(
                "--sizes: \"{}\" is not LAYERSxWIDTH with a width that is a multiple of 64 (heads "
                "of 64 dimensions), e.g. 2x128,4x256",
                item);
        out.push_back({l, w});
        at = comma + 1;
    }
    return out;
}

std::vector<SweepRun> plan_sweep(const RunConfig& base, const std::vector<double>& flops,
                                 const std::vector<std::pair<int, int>>& sizes,
                                 const std::string& dir, int min_steps,
                                 std::vector<std::string>* skipped) {
    std::vector<SweepRun> out;
    for (double c : flops) {
        if (!(c > 0 && std::isfinite(c)))
            fail("--flops: {} is not a positive compute budget in FLOPs", c);
        const int exp = (int)std::floor(std::log10(c));
        const std::string c_name = fmt::format("{:g}e{}", c / std::pow(10.0, exp), exp);
        for (const auto& [l, w] : sizes) {
            SweepRun r;
            r.flops = c;
            r.n_layer = l;
            r.n_embd = w;
            r.n_head = w / 64;
            r.config = base;
            r.config.model.n_layer = l;
            r.config.model.n_embd = w;
            r.config.model.n_head = r.n_head;
            r.params = non_embedding_params(r.config.model);
            const double tokens_per_step = (double)base.tokens_per_step();
            r.steps = (int64_t)std::llround(c / (6.0 * r.params * tokens_per_step));
            r.tokens = (double)r.steps * tokens_per_step;
            r.out_dir = (fs::path(dir) / fmt::format("C{}_L{}_W{}", c_name, l, w)).string();
            if (r.steps < min_steps) {
                if (skipped)
                    skipped->push_back(
                        fmt::format("{} x {} at C = {:.3g}: {} steps (fewer than {})", l, w, c,
                                    r.steps, min_steps));
                continue;
            }
            r.config.train.max_steps = (int)r.steps;
            r.config.optim.warmup_steps =
                std::min<int>(base.optim.warmup_steps, (int)std::max<int64_t>(1, r.steps / 10));
            r.config.io.out_dir = r.out_dir;
            r.config.io.save_final = true;
            r.config.sample.max_tokens = 0;
            out.push_back(std::move(r));
        }
    }
    return out;
}

}  // namespace memtrain
