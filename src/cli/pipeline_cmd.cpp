// `memtrain pipeline CONFIG --pp P --micro-batches M [--schedule S] [--virtual V] [--svg FILE]`:
// a pipeline schedule for the config's model, simulated from its per-stage costs: the action
// lists, the step time, the bubble and the activations each stage holds.
#include <cstdio>
#include <fstream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/run_config.h"
#include "core/error.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_split.h"
#include "train/validate.h"

namespace memtrain::cli {

void register_pipeline(CLI::App& app) {
    auto* cmd = app.add_subcommand("pipeline", "simulate a pipeline-parallel schedule");
    struct Args {
        std::string config, schedule = "1f1b", svg;
        std::vector<std::string> sets;
        int pp = 2, m = 0, v = 1;
        double tflops = 1.0;
        bool lists = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("config", a->config, "TOML config (the model and micro-batch)")->required();
    cmd->add_option("--set", a->sets, "override a key: section.key=value")->take_all();
    cmd->add_option("--pp", a->pp, "pipeline stages (ranks)");
    cmd->add_option("--micro-batches", a->m, "micro-batches per step (default: accumulation)");
    cmd->add_option("--schedule", a->schedule,
                    "naive | gpipe | 1f1b | interleaved | zb-h1 | pipedream | pipedream-2bw");
    cmd->add_option("--virtual", a->v, "chunks per rank (interleaved)");
    cmd->add_option("--tflops", a->tflops, "sustained TFLOP/s per rank, to turn FLOPs into time");
    cmd->add_option("--svg", a->svg, "write the timeline, one row per rank");
    cmd->add_flag("--lists", a->lists, "print every rank's action list");
    cmd->callback([a]() {
        RunConfig cfg = load_run_config(a->config, a->sets);
        resolve_config(cfg);  // "auto": the device and precision (its activation layout) here
        if (!(a->tflops > 0)) fail("--tflops must be positive, got {}", a->tflops);
        const pp::Kind kind = pp::parse_kind(a->schedule);
        const int B = cfg.micro_batch(), T = cfg.train.seq_len;
        const int m = a->m > 0 ? a->m : cfg.train.batch_size / B;
        if (a->m < 0) fail("--micro-batches must be positive, got {}", a->m);
        const pp::Schedule s = pp::make_schedule(kind, a->pp, m, a->v);
        const pp::StageSplit split = pp::split_stages(cfg.model, s.num_stages(), B, T);
        const pp::SimResult r = pp::simulate(s, pp::stage_costs(split, a->tflops * 1e12));
        double ideal = 0;  // one rank doing all the work of the step
        for (double f : split.forward_flops) ideal += 3 * f * m / (a->tflops * 1e12);
        std::printf("%s", fmt::format("pipeline {} | pp {} x {} chunk(s) | {} micro-batches of "
                                      "{} x {} tokens | model {} layers\n",
                                      pp::kind_name(kind), s.p, s.v, m, B, T, cfg.model.n_layer)
                              .c_str());
        std::printf("%s",
                    fmt::format("{:>5} {:>14} {:>13} {:>10} {:>10} {:>14}\n", "rank", "blocks",
                                "fwd GFLOP/mb", "busy ms", "in flight", "activations")
                        .c_str());
        for (int rk = 0; rk < s.p; rk++) {
            std::string blocks;
            double gflop = 0;
            double bytes = 0;
            for (int c = 0; c < s.v; c++) {
                const int st = c * s.p + rk;
                const int first = split.first_block[st];
                blocks += fmt::format("{}{}-{}", c ? "," : "", first, first + split.blocks[st] - 1);
                gflop += split.forward_flops[st] / 1e9;
                // What the executor allocates: each chunk's most micro-batches in flight, in
                // arenas of its own blocks.
                bytes += (double)split.act_bytes[st] * r.peak_stage_in_flight[st];
            }
            std::printf("%s", fmt::format("{:>5} {:>14} {:>13.2f} {:>10.2f} {:>10} {:>10.1f} MiB\n",
                                          rk, blocks, gflop, r.busy[rk] * 1e3, r.peak_in_flight[rk],
                                          bytes / (1 << 20))
                                  .c_str());
        }
        std::printf(
            "%s", fmt::format("step {:.2f} ms simulated (one rank alone: {:.2f} ms, {:.2f}x "
                              "faster) | bubble {:.1f}% of the step (uniform stages: (p-1)/(m+p-1) "
                              "= {:.1f}% for GPipe and 1F1B)\n",
                              r.makespan * 1e3, ideal * 1e3, ideal / r.makespan, 100 * r.bubble(),
                              100.0 * (s.p - 1) / (m + s.p - 1))
                      .c_str());
        if (kind == pp::Kind::PipeDream || kind == pp::Kind::PipeDream2BW) {
            std::string versions;
            for (int rk = 0; rk < s.p; rk++)
                versions += fmt::format(
                    " {}", kind == pp::Kind::PipeDream ? pp::pipedream_versions(s.p, rk) : 2);
            std::printf("weight versions kept per stage:%s\n", versions.c_str());
        }
        if (a->lists) std::printf("%s", pp::format_lists(s).c_str());
        if (!a->svg.empty()) {
            std::ofstream f(a->svg);
            f << pp::timeline_svg(
                s, r, fmt::format("{} p={} m={} v={}", pp::kind_name(kind), s.p, m, s.v));
            if (!f) fail("could not write {}", a->svg);
            std::printf("timeline: %s\n", a->svg.c_str());
        }
    });
}

}  // namespace memtrain::cli
