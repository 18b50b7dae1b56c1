// `memtrain remat CONFIG`: the activation-checkpointing schedule of a run, without training (no
// data files needed). --budget X solves for a budget; --frontier tabulates the named policies and
// budget-optimal schedules (peak bytes vs predicted recompute), --svg draws that frontier.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "remat/cost.h"
#include "remat/policy.h"
#include "train/run_config.h"

namespace memtrain::cli {

namespace {

using namespace memtrain::remat;

std::string plan_letters(const RematPlan& plan) {
    std::string s;
    for (BlockKeep k : plan) s += k == BlockKeep::All ? 'A' : k == BlockKeep::Selective ? 'S' : 'I';
    return s;
}

struct Point {
    std::string name;
    Schedule s;
};

std::string frontier_svg(const std::vector<Point>& pts, double step_flops) {
    const double W = 640, H = 400, x0 = 70, y0 = 30, x1 = W - 30, y1 = H - 50;
    double xmax = 0, ymax = 0;
    for (const auto& p : pts) {
        xmax = std::max(xmax, p.s.peak_bytes / 1048576.0);
        ymax = std::max(ymax, 100.0 * p.s.recompute_flops / step_flops);
    }
    xmax *= 1.05;
    ymax = std::max(1.0, ymax * 1.1);
    auto X = [&](double v) { return x0 + (x1 - x0) * v / xmax; };
    auto Y = [&](double v) { return y1 - (y1 - y0) * v / ymax; };
    std::string o = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
        "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" "
        "fill=\"white\"/>\n<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n"
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        W, H, x0, y1, x1, y1, x0, y0, x0, y1);
    o += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">peak activation memory "
        "(MiB)</text>\n",
        (x0 + x1) / 2, H - 12);
    o += fmt::format(
        "<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" "
        "text-anchor=\"middle\">recompute overhead (% of step FLOPs)</text>\n",
        (y0 + y1) / 2, (y0 + y1) / 2);
    for (int i = 0; i <= 4; i++) {
        double xv = xmax * i / 4, yv = ymax * i / 4;
        o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.1f}</text>\n",
                         X(xv), y1 + 15, xv);
        o += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.1f}</text>\n", x0 - 5,
                         Y(yv) + 4, yv);
    }
    std::string line;
    for (const auto& p : pts) {
        double x = X(p.s.peak_bytes / 1048576.0), y = Y(100.0 * p.s.recompute_flops / step_flops);
        bool opt = p.name.starts_with("budget:");
        if (opt) line += fmt::format("{:.1f},{:.1f} ", x, y);
        o += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"{}\" fill=\"{}\"/>\n", x, y,
                         opt ? 3 : 5, opt ? "steelblue" : "darkorange");
        if (!opt)
            o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", x + 7, y - 6, p.name);
    }
    o += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"steelblue\"/>\n", line);
    o += "</svg>\n";
    return o;
}

}  // namespace

void register_remat(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "remat", "activation-checkpointing schedule: per-block plan, peak memory, recompute");
    struct Args {
        std::string config, budget, svg;
        std::vector<std::string> sets;
        bool frontier = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("config", a->config, "run config (.toml)")->required();
    cmd->add_option("--set", a->sets, "override a config key: section.key=value");
    cmd->add_option("--budget", a->budget, "peak activation bytes, e.g. 200MiB (else train.remat)");
    cmd->add_flag("--frontier", a->frontier, "table of policies and budget-optimal schedules");
    cmd->add_option("--svg", a->svg, "with --frontier: write the chart to this SVG file");
    cmd->callback([a] {
        RunConfig cfg = load_run_config(a->config, a->sets);
        const ModelConfig& m = cfg.model;
        const int B = cfg.micro_batch(), T = cfg.train.seq_len;
        const double step = (double)step_flops(m, B, T);
        const Chain chain = make_chain(m, B, T);
        std::printf(
            "model %d layers x %d wide, %d heads | micro-batch %d x %d | step %.2f GFLOP "
            "(analytic, no recompute)\n",
            m.n_layer, m.n_embd, m.n_head, B, T, step / 1e9);
        std::printf("smallest feasible peak activation memory: %s\n",
                    format_bytes(min_feasible_bytes(chain)).c_str());
        if (!a->svg.empty() && !a->frontier) fail("--svg needs --frontier");
        if (a->frontier) {
            if (!a->budget.empty()) fail("give either --budget or --frontier, not both");
            std::vector<Point> pts;
            for (const char* p : {"none", "selective", "sqrt", "full"})
                pts.push_back({p, make_schedule(parse_policy(p), m, B, T)});
            const std::size_t lo = min_feasible_bytes(chain), hi = pts[0].s.peak_bytes;
            const int n = 10;
            for (int i = 0; i <= n; i++) {
                std::size_t b = lo + (hi - lo) * i / n;
                pts.push_back({fmt::format("budget:{}", b), *solve_budget(chain, b)});
            }
            std::printf("\n%-20s %12s %14s %10s  %s\n", "schedule", "peak MiB", "peak bytes",
                        "recompute", "plan (A all, S selective, I input only)");
            for (const auto& p : pts)
                std::printf("%-20s %12.2f %14zu %9.2f%%  %s\n", p.name.c_str(),
                            p.s.peak_bytes / 1048576.0, p.s.peak_bytes,
                            100.0 * p.s.recompute_flops / step, plan_letters(p.s.plan).c_str());
            if (!a->svg.empty()) {
                std::ofstream out(a->svg, std::ios::binary);
                out << frontier_svg(pts, step);
                if (!out) fail("cannot write {}", a->svg);
                std::printf("wrote %s\n", a->svg.c_str());
            }
            return;
        }
        std::string policy = a->budget.empty() ? cfg.train.remat : "budget:" + a->budget;
        Schedule s = make_schedule(parse_policy(policy), m, B, T);
        std::printf("\nschedule for %s\n%-6s %-10s %14s %16s\n", policy.c_str(), "block", "keeps",
                    "kept bytes", "recompute GFLOP");
        for (std::size_t l = 0; l < s.plan.size(); l++) {
            const Option& o = chain.blocks[l][static_cast<int>(s.plan[l])];
            std::printf("%-6zu %-10s %14zu %16.3f\n", l, keep_name(s.plan[l]), o.kept_bytes,
                        o.recompute_flops / 1e9);
        }
        std::printf("predicted peak activation memory: %s\n", format_bytes(s.peak_bytes).c_str());
        std::printf("predicted recompute overhead: %.3f GFLOP = %.2f%% of a step\n",
                    s.recompute_flops / 1e9, 100.0 * s.recompute_flops / step);
    });
}

}  // namespace memtrain::cli
