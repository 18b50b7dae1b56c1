// `memtrain remat CONFIG`: the activation-checkpointing schedule of a run, without training (no
// data files needed). --budget X solves for a budget; --frontier tabulates the named policies and
// budget-optimal schedules (peak bytes vs predicted recompute), --svg draws that frontier.
// --measure prices recompute by a profiling pass on this machine (remat/profile.h) and, with
// --frontier, also times real training steps of every schedule beside the prediction.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "cli/commands.h"
#include "config/run_config.h"
#include "core/error.h"
#include "remat/cost.h"
#include "remat/policy.h"
#include "remat/profile.h"
#include "remat/trace.h"
#include "train/validate.h"

namespace memtrain::cli {

namespace {

using namespace memtrain::remat;

std::string plan_letters(const RematPlan& plan) {
    std::string s;
    for (BlockKeep k : plan) s += (char)std::toupper(keep_letter(k));
    return s;
}

struct Point {
    std::string name;
    Solution s;
    double measured_pct = NAN;       // measured step time over the no-recompute step, in %
    std::size_t measured_bytes = 0;  // the allocator's activation bytes under this schedule
};

std::string frontier_svg(const std::vector<Point>& pts, double step_flops) {
    const double W = 640, H = 400, x0 = 70, y0 = 30, x1 = W - 30, y1 = H - 50;
    double xmax = 0, ymax = 0;
    for (const auto& p : pts) {
        xmax = std::max(xmax, p.s.peak_bytes / 1048576.0);
        ymax = std::max(ymax, 100.0 * p.s.recompute_flops / step_flops);
        if (!std::isnan(p.measured_pct)) ymax = std::max(ymax, p.measured_pct);
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
        "text-anchor=\"middle\">recompute overhead (% of a step; hollow: measured)</text>\n",
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
        if (!std::isnan(p.measured_pct))
            o += fmt::format(
                "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"none\" "
                "stroke=\"seagreen\"/>\n",
                X(p.measured_bytes / 1048576.0), Y(std::max(0.0, p.measured_pct)));
    }
    o += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"steelblue\"/>\n", line);
    o += "</svg>\n";
    return o;
}

// The no-recompute step timed before, between and after the others: how far apart its own
// times lie is the noise every measured column carries.
struct BaselineSpread {
    std::vector<double> seconds;  // each timing of the baseline, in order
    double lo() const { return *std::min_element(seconds.begin(), seconds.end()); }
    double hi() const { return *std::max_element(seconds.begin(), seconds.end()); }
    double pct() const { return 100.0 * (hi() / lo() - 1.0); }
};

// Real steps of every schedule (CPU): the measured side of the frontier, as % over the fastest
// of the baseline's timings (pts[0] is `none`).
BaselineSpread measure_frontier(const ModelConfig& m, int B, int T, std::vector<Point>& pts) {
    BaselineSpread spread;
    const std::size_t half = pts.size() / 2;
    for (std::size_t i = 0; i < pts.size(); i++) {
        if (i == 0 || i == half)
            spread.seconds.push_back(measure_step(m, B, T, pts[0].s.plan).seconds);
        if (i == 0) continue;
        const MeasuredStep ms = measure_step(m, B, T, pts[i].s.plan);
        pts[i].measured_bytes = ms.activation_bytes;
        pts[i].measured_pct = ms.seconds;  // seconds for now; % below
    }
    const MeasuredStep last = measure_step(m, B, T, pts[0].s.plan);
    spread.seconds.push_back(last.seconds);
    pts[0].measured_bytes = last.activation_bytes;
    const double base = spread.lo();
    pts[0].measured_pct = 0;
    for (std::size_t i = 1; i < pts.size(); i++)
        pts[i].measured_pct = 100.0 * (pts[i].measured_pct / base - 1.0);
    return spread;
}

// The baseline's spread, and a warning for every schedule measured faster than no recompute:
// recompute never saves time, so that is noise (within the spread) or a machine whose speed
// changed (beyond it).
void print_spread(const BaselineSpread& spread, const std::vector<Point>& pts) {
    std::string times;
    for (double t : spread.seconds)
        times += fmt::format("{}{:.2f}", times.empty() ? "" : ", ", t * 1e3);
    std::printf(
        "\nmeasured: %% over the fastest of %zu timings of the no-recompute step (%s ms, before, "
        "between and after the others): spread %.2f%%; differences smaller than that are noise\n",
        spread.seconds.size(), times.c_str(), spread.pct());
    std::vector<std::string> faster;
    double worst = 0;
    for (const auto& p : pts)
        if (p.measured_pct < 0) {
            faster.push_back(p.name);
            worst = std::min(worst, p.measured_pct);
        }
    if (faster.empty()) return;
    const bool noise = -worst <= spread.pct();
    std::fflush(stdout);
    std::fprintf(stderr,
                 "memtrain: warning: %zu schedule%s measured faster than no recompute (%s; at "
                 "most %.2f%%), which recompute cannot be: %s\n",
                 faster.size(), faster.size() == 1 ? "" : "s",
                 fmt::format("{}", fmt::join(faster, ", ")).c_str(), worst,
                 noise ? "within the baseline's spread, so noise"
                       : "beyond the baseline's spread, so the machine's speed changed during the "
                         "measurement; measure again on a quiet machine");
}

}  // namespace

void register_remat(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "remat", "activation-checkpointing schedule: per-block plan, peak memory, recompute");
    struct Args {
        std::string config, budget, svg, device, precision, animate;
        std::vector<std::string> sets;
        bool frontier = false;
        bool measure = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("config", a->config, "run config (.toml)")->required();
    cmd->add_option("--set", a->sets, "override a config key: section.key=value");
    cmd->add_option("--budget", a->budget, "peak activation bytes, e.g. 200MiB (else train.remat)");
    cmd->add_flag("--frontier", a->frontier, "table of policies and budget-optimal schedules");
    cmd->add_option("--svg", a->svg, "with --frontier: write the chart to this SVG file");
    cmd->add_option("--animate", a->animate,
                    "write the schedule (train.remat or --budget) as an animated SVG: every "
                    "forward, rebuild, recompute and backward, what each block holds, the live "
                    "bytes");
    cmd->add_option("--device", a->device,
                    "price this device's activation layout: cpu or cuda (default: train.device; "
                    "no GPU is needed to price cuda)");
    cmd->add_option("--precision", a->precision,
                    "fp32, bf16 or fp16 (cuda: the activations' type; cpu: fp32 or bf16 GEMMs "
                    "over fp32 activations) (default: train.precision on its device)");
    cmd->add_flag("--measure", a->measure,
                  "price recompute by a profiling pass on this machine; with --frontier also "
                  "time real steps of every schedule");
    cmd->callback([a] {
        RunConfig cfg = load_run_config(a->config, a->sets);
        resolve_config(cfg);  // "auto": what this machine would run
        const ModelConfig& m = cfg.model;
        const int B = cfg.micro_batch(), T = cfg.train.seq_len;
        // Whose layout to price: the run's device and precision, or those named here.
        const std::string device = a->device.empty() ? cfg.train.device : a->device;
        if (device != "cpu" && device != "cuda") fail("--device {}: expected cpu or cuda", device);
        // The run's precision where it runs on this device; otherwise the device's default.
        std::string precision = !a->precision.empty()        ? a->precision
                                : device == cfg.train.device ? cfg.train.precision
                                : device == "cuda"           ? "bf16"
                                                             : "fp32";
        if (precision != "fp32" && precision != "bf16" && precision != "fp16")
            fail("--precision {}: expected fp32, bf16 or fp16", precision);
        if (device == "cpu" && precision == "fp16")
            fail("--precision fp16 needs --device cuda: the CPU engine computes in fp32 or bf16");
        // The CPU engine's bf16: bf16 saved fields beside an fp32 working block, and its GEMMs'
        // operand scratch in the workspace.
        const ActFormat fmt =
            device == "cuda"
                ? cuda_arena_format(m, precision == "fp32" ? 4 : 2, B, T)
                : ActFormat::cpu(m.lse_attention, precision == "bf16",
                                 cpu_saved_activations(cfg.train, precision), m.mlp_tile);
        const bool measured = a->measure || cfg.train.remat_costs == "measured";
        if (measured && device == "cuda")
            fail("--measure profiles the CPU kernels; price the cuda layout with analytic costs");
        std::optional<BlockFlops> costs;
        double step = (double)step_flops(m, B, T);
        if (measured) {
            costs = measure_block(m, B, T);
            step = estimated_step_ns(m, B, T, *costs);
        }
        const BlockFlops* cost_ptr = costs ? &*costs : nullptr;
        const Chain chain = costs ? make_chain(m, B, T, *costs, fmt) : make_chain(m, B, T, fmt);
        // Recompute units: GFLOP (analytic) or ms (measured).
        const double unit = measured ? 1e6 : 1e9;
        const char* unit_name = measured ? "ms" : "GFLOP";
        std::printf(
            "model %d layers x %d wide, %d heads | micro-batch %d x %d | step %.2f %s (%s, "
            "no recompute)\nactivation layout: %s\n",
            m.n_layer, m.n_embd, m.n_head, B, T, step / unit, unit_name,
            measured ? "estimated from a profiled block" : "analytic",
            device == "cuda"
                ? fmt::format("cuda, {} (fused attention: a log-sum-exp per row, no "
                              "attention probabilities)",
                              precision)
                      .c_str()
                : fmt::format(
                      "cpu, {} ({})",
                      fmt.compressed() ? fmt::format("{} saved fields, an fp32 working block",
                                                     saved_store_name(fmt.saved))
                                       : std::string("fp32"),
                      fmt.fused_attention ? "train.cpu_attention = lse: a log-sum-exp per row"
                                          : "attention probabilities kept")
                      .c_str());
        std::printf("smallest feasible peak activation memory: %s\n",
                    format_bytes(min_feasible_bytes(chain)).c_str());
        // Both models also rebuild block inputs (chen:K, memory-poor), below that (a GPU
        // pipeline stage does not: train.pp > 1 is refused with these policies there).
        const bool rebuilds = m.n_layer > 1;
        if (rebuilds)
            std::printf(
                "  rebuilding block inputs (chen:K, revolve:S, memory-poor; budget:BYTES "
                "below the above): %s\n",
                format_bytes(rebuild_floor(chain)).c_str());
        Chain offload_chain = chain;  // budget:BYTES+offload (cuda): inputs may leave the GPU
        offload_chain.allow_offload = true;
        if (device == "cuda")
            std::printf("  with block inputs in host memory (budget:BYTES+offload): %s\n",
                        format_bytes(min_feasible_bytes(offload_chain)).c_str());
        if (!a->svg.empty() && !a->frontier) fail("--svg needs --frontier");
        if (!a->animate.empty() && a->frontier)
            fail("--animate draws one schedule: drop --frontier (or --animate)");
        if (a->frontier) {
            if (!a->budget.empty()) fail("give either --budget or --frontier, not both");
            std::vector<Point> pts;
            // The named policies, and those that rebuild block inputs: chen:K with
            // K = ceil(sqrt(n_layer)), revolve:S with S = ceil(log2(n_layer)) and memory-poor
            // (the floor).
            const std::string chen =
                fmt::format("chen:{}", (int)std::ceil(std::sqrt((double)m.n_layer)));
            const std::string revolve =
                fmt::format("revolve:{}", (int)std::ceil(std::log2((double)m.n_layer)));
            for (const std::string& p :
                 {std::string("none"), std::string("selective"), std::string("sqrt"),
                  std::string("full"), std::string("offload"), chen, revolve,
                  std::string("memory-poor")}) {
                if (p == "offload" && device != "cuda") continue;
                if (parse_policy(p).rebuilds_inputs() && m.n_layer < 2) continue;
                pts.push_back({p, solve_policy(parse_policy(p), m, B, T, cost_ptr, fmt)});
            }
            std::size_t lo = min_feasible_bytes(chain);
            if (rebuilds) lo = std::min(lo, rebuild_floor(chain));
            const std::size_t hi = pts[0].s.peak_bytes;
            // The budget sweep, after the named policies (none is pts[0]), solved as train.remat
            // = budget:BYTES would be (below the knapsack's floor, the plans that rebuild).
            const int n = 10;
            std::vector<std::size_t> budgets;
            for (int i = 0; i <= n; i++) budgets.push_back(lo + (hi - lo) * i / n);
            if (rebuilds) {
                // Between memory-poor's floor and the knapsack's, where the joint solver chooses
                // which inputs to keep and how to rebuild the rest, five more points.
                const std::size_t top = min_feasible_bytes(chain);
                for (int i = 1; i <= 5 && top > lo; i++) budgets.push_back(lo + (top - lo) * i / 6);
                std::sort(budgets.begin(), budgets.end());
            }
            for (std::size_t b : budgets) {
                const std::string name = fmt::format("budget:{}", b);
                pts.push_back({name, solve_policy(parse_policy(name), m, B, T, cost_ptr, fmt)});
            }
            if (device == "cuda" && m.n_layer > kOffloadSlots) {
                // Recompute and offload together: below `lo` only offloading gets there, above
                // it offloaded inputs leave room for kept blocks.
                const std::size_t olo = min_feasible_bytes(offload_chain);
                for (int i = 0; i <= n / 2; i++) {
                    std::size_t b = olo + (hi - olo) * i / (n / 2);
                    pts.push_back(
                        {fmt::format("budget:{}+offload", b), *solve_budget(offload_chain, b)});
                }
            }
            BaselineSpread spread;
            if (a->measure) spread = measure_frontier(m, B, T, pts);
            std::printf("\n%-28s %12s %14s %10s %10s %12s  %s\n", "schedule", "peak MiB",
                        "peak bytes", "recompute", "measured", "measured MiB",
                        "plan (A all, S selective, I input only, O input in host memory, G "
                        "rebuilt and held, D rebuilt, not held)");
            for (const auto& p : pts) {
                std::string mt = std::isnan(p.measured_pct)
                                     ? std::string("-")
                                     : fmt::format("{:+.2f}%", p.measured_pct);
                std::string mb = std::isnan(p.measured_pct)
                                     ? std::string("-")
                                     : fmt::format("{:.2f}", p.measured_bytes / 1048576.0);
                std::printf("%-28s %12.2f %14zu %9.2f%% %10s %12s  %s\n", p.name.c_str(),
                            p.s.peak_bytes / 1048576.0, p.s.peak_bytes,
                            100.0 * p.s.recompute_flops / step, mt.c_str(), mb.c_str(),
                            plan_letters(p.s.plan).c_str());
            }
            if (a->measure) print_spread(spread, pts);
            if (!a->svg.empty()) {
                std::ofstream out(a->svg, std::ios::binary);
                out << frontier_svg(pts, step);
                if (!out) fail("cannot write {}", a->svg);
                std::printf("wrote %s\n", a->svg.c_str());
            }
            return;
        }
        std::string policy = a->budget.empty() ? cfg.train.remat : "budget:" + a->budget;
        const RematPolicy pol = parse_policy(policy);
        if (pol.may_offload() && device != "cuda")
            fail(
                "{} keeps block inputs in host memory beside a GPU: price it with --device cuda "
                "(this is the {} layout)",
                policy, device);
        Solution s = solve_policy(pol, m, B, T, cost_ptr, fmt);
        std::printf("\nschedule for %s\n%-6s %-10s %14s %13s %s  %s\n", policy.c_str(), "block",
                    "keeps", "kept bytes", "recompute", unit_name, "input in the backward");
        const InputRebuild rb = input_rebuild(s.plan);
        for (std::size_t l = 0; l < s.plan.size(); l++) {
            const Option& o = option(chain, l, s.plan[l]);
            std::string input = "kept";
            if (rb.holder[l] >= 0)
                input =
                    fmt::format("held by block {}'s rebuild (slot {})", rb.holder[l], rb.slot[l]);
            if (rb.from[l] >= 0)
                input = fmt::format("rebuilt from block {}'s ({} forwards)", rb.from[l],
                                    (int)l - rb.from[l]);
            std::printf("%-6zu %-10s %14zu %16.3f  %s\n", l, keep_name(s.plan[l]), o.kept_bytes,
                        o.recompute_flops / unit, input.c_str());
        }
        if (rb.any)
            std::printf("block inputs rebuilt: %lld forwards, %d held at once\n",
                        (long long)rb.forwards, rb.slots);
        std::printf("predicted peak activation memory: %s\n", format_bytes(s.peak_bytes).c_str());
        std::printf("predicted recompute overhead: %.3f %s = %.2f%% of a step\n",
                    s.recompute_flops / unit, unit_name, 100.0 * s.recompute_flops / step);
        if (!a->animate.empty()) {
            const std::vector<TraceEvent> events = trace_step(chain, s.plan);
            std::size_t live = 0;
            for (const TraceEvent& e : events) live = std::max(live, e.live_bytes);
            std::ofstream out(a->animate, std::ios::binary);
            out << trace_svg(events, chain, s.plan,
                             fmt::format("train.remat = {}: {} blocks, micro-batch {} x {}", policy,
                                         m.n_layer, B, T));
            if (!out) fail("cannot write {}", a->animate);
            std::printf("wrote %s: %zu events, at most %s alive of the %s arena\n",
                        a->animate.c_str(), events.size(), format_bytes(live).c_str(),
                        format_bytes(s.peak_bytes).c_str());
        }
    });
}

}  // namespace memtrain::cli
