// `memtrain sweep CONFIG --flops C1,C2,... --sizes LxW,...`: trains an isoFLOP grid of small
// models one after another, resuming where a sweep stopped, then fits the scaling law to it.
// `memtrain scale --fit RUN_DIR...`: the fit alone, over any finished runs (docs/scaling.md).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "train/sweep.h"
#include "train/trainer.h"
#include "train/validate.h"

namespace fs = std::filesystem;

namespace memtrain::cli {

namespace {

// "1.23M", "45.6k": parameter and token counts.
std::string count(double x) {
    if (x >= 1e9) return fmt::format("{:.3g}B", x / 1e9);
    if (x >= 1e6) return fmt::format("{:.3g}M", x / 1e6);
    if (x >= 1e3) return fmt::format("{:.3g}k", x / 1e3);
    return fmt::format("{:.3g}", x);
}

std::vector<double> parse_flops(const std::string& text) {
    std::vector<double> out;
    std::size_t at = 0;
    while (at <= text.size()) {
        const std::size_t comma = std::min(text.find(',', at), text.size());
        const std::string item = text.substr(at, comma - at);
        char* end = nullptr;
        const double c = std::strtod(item.c_str(), &end);
        if (item.empty() || *end != '\0' || !(c > 0) || !std::isfinite(c))
            fail("--flops: \"{}\" is not a positive number of FLOPs (e.g. 1e13,3e13)", item);
        out.push_back(c);
        at = comma + 1;
    }
    return out;
}

void print_fit(const std::vector<plan::LossPoint>& pts, double flops, bool json) {
    plan::FitOptions opts;
    const plan::ScalingLawFit f = plan::fit_scaling_law(pts, opts);
    if (flops <= 0)
        for (const auto& p : pts) flops = std::max(flops, 6 * p.params * p.tokens);
    const plan::ChinchillaFit& law = f.law;
    const bool has_optimum = law.alpha > 0 && law.beta > 0;
    plan::Allocation opt;
    plan::Interval n_ci, d_ci;
    if (has_optimum) {
        opt = plan::chinchilla_optimal(flops, law);
        std::vector<double> ns, ds;
        for (const auto& r : f.resamples) {
            if (!(r.alpha > 0 && r.beta > 0)) continue;
            const plan::Allocation a = plan::chinchilla_optimal(flops, r);
            ns.push_back(a.params);
            ds.push_back(a.tokens);
        }
        if (!ns.empty()) {
            n_ci = plan::percentile_interval(ns);
            d_ci = plan::percentile_interval(ds);
        }
    }
    if (json) {
        nlohmann::json j;
        j["law"] = {
            {"E", law.E}, {"A", law.A}, {"B", law.B}, {"alpha", law.alpha}, {"beta", law.beta}};
        auto ci = [](const plan::Interval& i) { return nlohmann::json::array({i.lo, i.hi}); };
        j["interval_95"] = {{"E", ci(f.E)},
                            {"A", ci(f.A)},
                            {"B", ci(f.B)},
                            {"alpha", ci(f.alpha)},
                            {"beta", ci(f.beta)}};
        j["huber_objective"] = f.objective;
        j["bootstrap"] = (int)f.resamples.size();
        for (const auto& p : pts)
            j["runs"].push_back({{"dir", p.origin},
                                 {"params", p.params},
                                 {"tokens", p.tokens},
                                 {"loss", p.loss},
                                 {"fitted", plan::chinchilla_loss(p.params, p.tokens, law)}});
        j["flops"] = flops;
        if (has_optimum)
            j["optimum"] = {{"params", opt.params},
                            {"tokens", opt.tokens},
                            {"loss", opt.loss},
                            {"params_95", ci(n_ci)},
                            {"tokens_95", ci(d_ci)}};
        std::printf("%s\n", j.dump(2).c_str());
        return;
    }
    std::printf(
        "scaling law fitted to %zu runs (Hoffmann et al.'s third approach: Huber loss, delta "
        "1e-3, on log L; 4500 starts; %zu bootstrap resamples for the 95%% intervals)\n",
        pts.size(), f.resamples.size());
    std::printf("L(N, D) = E + A / N^alpha + B / D^beta  (N non-embedding parameters, D tokens)\n");
    auto row = [](const char* name, double v, const plan::Interval& i) {
        std::printf("  %-6s %10.4g   [%.4g, %.4g]\n", name, v, i.lo, i.hi);
    };
    row("E", law.E, f.E);
    row("A", law.A, f.A);
    row("B", law.B, f.B);
    row("alpha", law.alpha, f.alpha);
    row("beta", law.beta, f.beta);
    std::printf("\n%-40s %9s %9s %8s %8s %10s\n", "run", "N", "D", "loss", "fitted", "C");
    for (const auto& p : pts) {
        std::string name = fs::path(p.origin).filename().string();
        if (name.empty()) name = p.origin;
        std::printf("%-40s %9s %9s %8.4f %8.4f %10.3g\n", name.c_str(), count(p.params).c_str(),
                    count(p.tokens).c_str(), p.loss, plan::chinchilla_loss(p.params, p.tokens, law),
                    6 * p.params * p.tokens);
    }
    if (!has_optimum) {
        std::printf(
            "\nno compute-optimal size: the fit has alpha = %.3g, beta = %.3g (both must be > "
            "0; add sizes or budgets)\n",
            law.alpha, law.beta);
        return;
    }
    std::printf(
        "\ncompute-optimal at C = %.3g FLOPs: N = %s [%s, %s], D = %s tokens [%s, %s], predicted "
        "loss %.4f\n",
        flops, count(opt.params).c_str(), count(n_ci.lo).c_str(), count(n_ci.hi).c_str(),
        count(opt.tokens).c_str(), count(d_ci.lo).c_str(), count(d_ci.hi).c_str(), opt.loss);
    std::printf("(N grows as C^%.3f, D as C^%.3f; Chinchilla's own fit: 0.46 and 0.54)\n",
                law.beta / (law.alpha + law.beta), law.alpha / (law.alpha + law.beta));
}

}  // namespace

void scale_fit(const std::vector<std::string>& run_dirs, double flops, bool json) {
    std::vector<plan::LossPoint> pts;
    for (const std::string& d : run_dirs) pts.push_back(run_loss_point(d));
    print_fit(pts, flops, json);
}

void register_sweep(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "sweep", "train an isoFLOP grid of small models, then fit L(N, D) = E + A/N^a + B/D^b");
    struct Args {
        std::string config, flops, sizes, out;
        std::vector<std::string> sets;
        int min_steps = 20;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("config", a->config, "TOML config of the runs (data, batch, optimizer)")
        ->required();
    cmd->add_option("--flops", a->flops, "compute budgets C = 6 N D, comma-separated (1e13,3e13)")
        ->required();
    cmd->add_option("--sizes", a->sizes,
                    "model shapes LAYERSxWIDTH, comma-separated (2x128,4x256); heads of 64")
        ->required();
    cmd->add_option("--out", a->out, "directory of the runs (default: io.out_dir/sweep)");
    cmd->add_option("--set", a->sets, "override a key of every run: section.key=value")->take_all();
    cmd->add_option("--min-steps", a->min_steps, "leave out runs shorter than this many steps")
        ->check(CLI::PositiveNumber);
    cmd->callback([a]() {
        RunConfig base = load_run_config(a->config, a->sets);
        if (base.data.val.empty())
            fail(
                "memtrain sweep fits the runs' validation losses: set data.val (a token shard "
                "the runs do not train on)");
        const std::string dir =
            a->out.empty() ? (fs::path(base.io.out_dir) / "sweep").string() : a->out;
        std::vector<std::string> skipped;
        const std::vector<SweepRun> runs = plan_sweep(
            base, parse_flops(a->flops), parse_sweep_sizes(a->sizes), dir, a->min_steps, &skipped);
        for (const SweepRun& r : runs) {  // every run's config is checked before any trains
            RunConfig c = r.config;
            validate_config(c);
        }
        std::printf(
            "sweep: %zu runs in %s (C = 6 N D, N non-embedding parameters, %lld tokens "
            "per step)\n",
            runs.size(), dir.c_str(), (long long)base.tokens_per_step());
        for (const std::string& s : skipped) std::printf("  left out: %s\n", s.c_str());
        install_stop_handlers(true);
        std::vector<plan::LossPoint> pts;
        nlohmann::json record;
        record["runs"] = nlohmann::json::array();
        for (std::size_t i = 0; i < runs.size(); i++) {
            const SweepRun& r = runs[i];
            TrainOptions o;
            o.quiet = true;
            o.stop_signal = &g_stop_signal;
            std::error_code ec;
            int64_t at = 0;
            if (fs::exists(fs::path(r.out_dir) / "latest", ec)) {
                at = checkpoint_state(resolve_checkpoint_dir(r.out_dir)).step;
                o.resume = r.out_dir;
            }
            const std::string what =
                fmt::format("run {}/{} {}: C = {:.3g}, {} x {} (N = {}), {} steps = {} tokens",
                            i + 1, runs.size(), fs::path(r.out_dir).filename().string(), r.flops,
                            r.n_layer, r.n_embd, count(r.params), r.steps, count(r.tokens));
            if (at < r.steps) {
                std::printf("%s%s ...\n", what.c_str(),
                            at > 0 ? fmt::format(" (resuming at step {})", at).c_str() : "");
                std::fflush(stdout);
                const auto t0 = std::chrono::steady_clock::now();
                Trainer t(r.config, o);
                const TrainSummary sum = t.run();
                if (sum.stopped_by_signal) {
                    std::fprintf(stderr,
                                 "memtrain: sweep stopped by %s in run %zu of %zu (checkpoint: "
                                 "%s); run the same command to continue where it stopped\n",
                                 signal_name(sum.stopped_by_signal), i + 1, runs.size(),
                                 sum.last_checkpoint.c_str());
                    throw ExitCode{128 + sum.stopped_by_signal};
                }
                std::printf(
                    "  done in %.0f s%s\n",
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                    sum.guard_actions.empty()
                        ? ""
                        : fmt::format(" ({} guard actions)", sum.guard_actions.size()).c_str());
            }
            const plan::LossPoint p = run_loss_point(r.out_dir);
            if (at >= r.steps) std::printf("%s: done before\n", what.c_str());
            std::printf("  val loss %.4f\n", p.loss);
            pts.push_back(p);
            record["runs"].push_back({{"dir", r.out_dir},
                                      {"flops", r.flops},
                                      {"n_layer", r.n_layer},
                                      {"n_embd", r.n_embd},
                                      {"params", r.params},
                                      {"steps", r.steps},
                                      {"tokens", r.tokens},
                                      {"val_loss", p.loss}});
        }
        {
            const std::string path = (fs::path(dir) / "sweep.json").string();
            std::ofstream out(path);
            out << record.dump(2) << "\n";
            if (!out) fail("cannot write {}", path);
            std::printf("sweep: runs recorded in %s\n\n", path.c_str());
        }
        if (pts.size() < 5) {
            std::printf("sweep: %zu runs, too few to fit (at least 5)\n", pts.size());
            return;
        }
        print_fit(pts, 0, false);
    });
}

}  // namespace memtrain::cli
