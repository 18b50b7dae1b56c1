// Text, JSON, SVG and TOML renderings of estimates and plans.
#include "planner/report.h"

#include "config/run_config.h"
#include "core/error.h"

#include <algorithm>

#include <fmt/format.h>

namespace memtrain::plan {

std::string format_bytes(double bytes) {
    if (bytes >= 1e12) return fmt::format("{:.2f} TB", bytes / 1e12);
    if (bytes >= 1e9) return fmt::format("{:.2f} GB", bytes / 1e9);
    return fmt::format("{:.1f} MB", bytes / 1e6);
}

std::string format_memory_table(const MemoryEstimate& est, const ClusterSpec* cluster) {
    std::string out = fmt::format("{:<24} {:>12}  {}\n", "category", "per GPU", "how");
    for (const auto& l : est.lines)
        out += fmt::format("{:<24} {:>12}  {}\n", l.name, format_bytes(l.bytes), l.detail);
    out += fmt::format("{:<24} {:>12}  stage {} ({} layers){}\n", "total", format_bytes(est.total),
                       est.stage, est.layers_on_stage,
                       est.engine_layout ? ", priced by the engines' layout functions"
                                         : ", priced by the formulas");
    if (!est.stage_activations.empty()) {
        out += fmt::format("{:<24} {:>12} ", "activations per stage", "");
        for (std::size_t i = 0; i < est.stage_activations.size(); i++)
            out += fmt::format(" {}{}", format_bytes(static_cast<double>(est.stage_activations[i])),
                               i + 1 < est.stage_activations.size() ? " |" : "");
        out += "  (the engine's stage layout)\n";
    }
    const int per_node = cluster ? gpus_sharing_a_host(*cluster) : 1;
    if (est.cpu_bytes > 0)
        out +=
            fmt::format("{:<24} {:>12}  offloaded states per GPU{}\n", "host memory",
                        format_bytes(est.cpu_bytes),
                        per_node > 1 ? fmt::format(", {} for the {} GPUs of a node",
                                                   format_bytes(est.cpu_bytes * per_node), per_node)
                                     : "");
    if (cluster) {
        const double capacity = cluster->gpu.memory_bytes;
        double left = capacity - static_cast<double>(est.total);
        out += left >= 0 ? fmt::format("fits in {} with {} to spare\n", format_bytes(capacity),
                                       format_bytes(left))
                         : fmt::format("does NOT fit in {}: over by {}\n", format_bytes(capacity),
                                       format_bytes(-left));
        if (est.cpu_bytes > 0) {
            const double host = cluster->host_memory(),
                         need = static_cast<double>(est.cpu_bytes) * per_node;
            out += host_fits(est, *cluster)
                       ? fmt::format("host: fits in {} per node with {} to spare\n",
                                     format_bytes(host), format_bytes(host - need))
                       : fmt::format("host: does NOT fit in {} per node: over by {}\n",
                                     format_bytes(host), format_bytes(need - host));
        }
    }
    out += "not included: ";
    for (size_t i = 0; i < est.not_included.size(); ++i)
        out += (i ? "; " : "") + est.not_included[i];
    return out + "\n";
}

std::string format_time(const TimeEstimate& t) {
    return fmt::format(
        "step {:.3f} s = compute {:.3f} + TP comm {:.3f} + PP comm {:.3f} + bubble {:.3f} + "
        "exposed DP comm {:.3f} + optimizer {:.3f} + offload {:.3f}\n"
        "{:.0f} tokens/s, MFU {:.1f}% (HFU {:.1f}%), GEMM efficiency {:.0f}%, bubble {:.1f}%\n",
        t.step_s, t.compute_s, t.tp_comm_s, t.pp_comm_s, t.bubble_s, t.dp_comm_s, t.optimizer_s,
        t.offload_s, t.tokens_per_s, t.mfu * 100, t.hfu * 100, t.gemm_efficiency * 100,
        t.bubble_fraction * 100);
}

std::string format_plans(const SearchResult& r, int top, int reasons, const ClusterSpec& c) {
    const double capacity = c.gpu.memory_bytes;
    std::string out;
    int n = std::min<int>(top, static_cast<int>(r.plans.size()));
    // LoRA plans name their method in a first column; full-parameter tables keep their shape.
    const bool lora = !r.plans.empty() && r.plans[0].run.lora_rank > 0;
    if (lora) {
        const RunSpec& l = r.plans[0].run;
        const int64_t adapters = r.methods.empty() ? 0 : r.methods.back().trainable_params;
        out += fmt::format(
            "{} these plans are {}:\n  only low-rank adapters ({:.1f}M parameters, on {}) train, "
            "over frozen weights{}:\n  fine-tuning, not the same job as training every "
            "weight{}\n\n",
            r.lora_instead_of_full ? "full-parameter training does not fit (see rejected), so"
                                   : "LoRA was asked for:",
            describe_method(l), adapters / 1e6,
            l.lora_targets == LoraTargets::all ? "every linear layer" : "the attention projections",
            l.frozen_bits == 16 ? "" : fmt::format(" quantized to {} bits", l.frozen_bits),
            r.lora_instead_of_full && l.frozen_bits == 16
                ? " (--frozen-bits 8 or 4 searches QLoRA instead)"
                : "");
    }
    if (r.moments_instead_of_plain) {
        const RunSpec& p = r.plans[0].run;
        out += fmt::format(
            "training every weight with {} moments does not fit (see rejected), so these plans "
            "store Adam's moments in {} ({} B per parameter instead of {}; optim.state_format = "
            "\"{}\"): the same model and training, with the moments rounded to {} bits between "
            "steps\n\n",
            state_format_name(r.asked_moments), state_format_name(p.state_format),
            2 * moment_bytes_per_param(p.state_format), 2 * moment_bytes_per_param(r.asked_moments),
            state_format_name(p.state_format), p.state_format == StateFormat::Int8 ? 8 : 4);
        if (r.weights_instead_of_master)
            out +=
                "and neither do compressed moments beside the fp32 master, so these plans also "
                "keep the weights in bf16 only (optim.master = \"none\": each update rounded "
                "stochastically into them, 4 B per parameter less)\n\n";
    }
    const bool runnable = !r.plans.empty() && trainer_runs(r.plans[0].run);
    if (n > 0 && !runnable)
        out += fmt::format(
            "no layout memtrain's trainer runs fits in {} per GPU: the plans below offload the "
            "parameters (--offload params), priced for comparison only\n\n",
            format_bytes(capacity));
    if (n > 0) {
        const std::string method_head = lora ? fmt::format("{:<17} ", "method") : "";
        out += fmt::format(
            "{:>3} {}{:>5} {:>4} {:>4} {:>4} {:>8} {:>9} {:>10} {:>10} {:>9} {:>6} {:>9}\n", "#",
            method_head, "dp", "tp", "pp", "zero", "offload", "recompute", "micro", "mem/GPU",
            "step s", "MFU", "tok/s");
        for (int i = 0; i < n; ++i) {
            const Plan& p = r.plans[i];
            const std::string method = lora ? fmt::format("{:<17} ", describe_method(p.run)) : "";
            out += fmt::format(
                "{:>3} {}{:>5} {:>4} {:>4} {:>4} {:>8} {:>9} {:>10} {:>10} {:>9.3f} {:>5.1f}% "
                "{:>9.0f}\n",
                i + 1, method, p.run.dp, p.run.tp, p.run.pp, p.run.zero,
                std::string(to_string(p.run.offload)) + (trainer_runs(p.run) ? "" : "*"),
                to_string(p.run.recompute),
                fmt::format("{}x{}", p.run.micro_batch, p.run.micro_batches),
                format_bytes(p.memory.total), p.time.step_s, p.time.mfu * 100, p.time.tokens_per_s);
        }
        for (int i = 0; i < n; ++i)
            if (!trainer_runs(r.plans[i].run)) {
                out +=
                    "  * parameter offload: priced for comparison; memtrain's trainer does not "
                    "run it yet, so it ranks after every plan it runs and is never emitted\n";
                break;
            }
        out +=
            fmt::format("\n{} plan, per-GPU memory:\n{}\n{}", runnable ? "best" : "closest",
                        format_memory_table(r.plans[0].memory, &c), format_time(r.plans[0].time));
    } else {
        out += fmt::format("no layout fits in {} per GPU ({} layouts tried)\n",
                           format_bytes(capacity), r.evaluated);
    }
    if (!r.rejected.empty()) {
        out += "\nrejected:\n";
        int shown = 0;
        for (const auto& rej : r.rejected) {
            if (shown++ >= reasons) {
                out += fmt::format("  ... {} more (--reasons N or --json shows all)\n",
                                   r.rejected.size() - reasons);
                break;
            }
            out += fmt::format("  {}: {}\n", rej.label(), rej.reason);
        }
    }
    return out;
}

nlohmann::json to_json(const MemoryEstimate& est) {
    nlohmann::json j;
    for (const auto& l : est.lines)
        j["lines"].push_back({{"name", l.name}, {"bytes", l.bytes}, {"detail", l.detail}});
    j["total_bytes"] = est.total;
    j["host_bytes"] = est.cpu_bytes;
    j["stage"] = est.stage;
    j["layers_on_stage"] = est.layers_on_stage;
    j["replica"] = est.replica;
    // Model states and activations from the engines' layout functions, not the formulas.
    j["engine_layout"] = est.engine_layout;
    if (!est.stage_activations.empty()) j["stage_activation_bytes"] = est.stage_activations;
    j["not_included"] = est.not_included;
    return j;
}

nlohmann::json to_json(const SearchResult& r, int top) {
    nlohmann::json j;
    j["evaluated"] = r.evaluated;
    j["fitting"] = r.plans.size();
    j["lora_instead_of_full"] = r.lora_instead_of_full;
    j["moments_instead_of_plain"] = r.moments_instead_of_plain;
    j["weights_instead_of_master"] = r.weights_instead_of_master;
    j["methods"] = nlohmann::json::array();
    for (const auto& m : r.methods)
        j["methods"].push_back({{"method", m.name},
                                {"lora_rank", m.lora_rank},
                                {"frozen_bits", m.frozen_bits},
                                {"trainable_params", m.trainable_params},
                                {"evaluated", m.evaluated},
                                {"fitting", m.fitting}});
    j["plans"] = nlohmann::json::array();
    for (int i = 0; i < std::min<int>(top, static_cast<int>(r.plans.size())); ++i) {
        const Plan& p = r.plans[i];
        j["plans"].push_back({{"method", describe_method(p.run)},
                              {"lora_rank", p.run.lora_rank},
                              {"frozen_bits", p.run.frozen_bits},
                              {"lora_targets", to_string(p.run.lora_targets)},
                              {"trainable_params_per_gpu", p.memory.trainable_on_gpu},
                              {"dp", p.run.dp},
                              {"tp", p.run.tp},
                              {"pp", p.run.pp},
                              {"zero", p.run.zero},
                              {"offload", to_string(p.run.offload)},
                              {"trainer_runs", trainer_runs(p.run)},
                              {"recompute", to_string(p.run.recompute)},
                              {"sequence_parallel", p.run.sequence_parallel},
                              {"micro_batch", p.run.micro_batch},
                              {"micro_batches", p.run.micro_batches},
                              {"memory", to_json(p.memory)},
                              {"step_s", p.time.step_s},
                              {"tokens_per_s", p.time.tokens_per_s},
                              {"mfu", p.time.mfu},
                              {"hfu", p.time.hfu},
                              {"bubble_fraction", p.time.bubble_fraction}});
    }
    j["rejected"] = nlohmann::json::array();
    for (const auto& rej : r.rejected)
        j["rejected"].push_back({{"method", rej.method},
                                 {"family", rej.family},
                                 {"reason", rej.reason},
                                 {"best_bytes", rej.best_bytes}});
    return j;
}

std::string memory_svg(const SearchResult& r, int top, double capacity) {
    const char* colours[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                             "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
    int n = std::min<int>(top, static_cast<int>(r.plans.size()));
    double max_bytes = capacity;
    for (int i = 0; i < n; ++i) max_bytes = std::max<double>(max_bytes, r.plans[i].memory.total);
    const int bar_w = 60, gap = 30, left = 60, top_pad = 30, height = 300, legend_w = 220;
    int width = left + n * (bar_w + gap) + legend_w;
    std::string svg = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
        "font-family=\"sans-serif\" font-size=\"11\">\n",
        width, height + top_pad + 60);
    svg +=
        fmt::format("<text x=\"{}\" y=\"18\">per-GPU memory of the top plans (GB)</text>\n", left);
    auto y_of = [&](double bytes) { return top_pad + height - bytes / max_bytes * height; };
    for (int i = 0; i < n; ++i) {
        const Plan& p = r.plans[i];
        double acc = 0;
        int x = left + i * (bar_w + gap);
        for (size_t c = 0; c < p.memory.lines.size(); ++c) {
            double b = p.memory.lines[c].bytes;
            if (b <= 0) continue;
            svg += fmt::format(
                "<rect x=\"{}\" y=\"{:.1f}\" width=\"{}\" height=\"{:.1f}\" fill=\"{}\"><title>{}: "
                "{}</title></rect>\n",
                x, y_of(acc + b), bar_w, b / max_bytes * height, colours[c % 10],
                p.memory.lines[c].name, format_bytes(b));
            acc += b;
        }
        svg += fmt::format("<text x=\"{}\" y=\"{}\">#{} {:.1f}</text>\n", x, top_pad + height + 15,
                           i + 1, p.memory.total / 1e9);
        svg += fmt::format("<text x=\"{}\" y=\"{}\">tp{} pp{} z{}</text>\n", x,
                           top_pad + height + 30, p.run.tp, p.run.pp, p.run.zero);
    }
    svg += fmt::format(
        "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"black\" "
        "stroke-dasharray=\"4\"/><text x=\"4\" y=\"{:.1f}\">{:.0f} GB</text>\n",
        left - 5, left + n * (bar_w + gap), y_of(capacity), y_of(capacity), y_of(capacity) + 4,
        capacity / 1e9);
    if (n > 0) {
        int lx = left + n * (bar_w + gap) + 10;
        for (size_t c = 0; c < r.plans[0].memory.lines.size(); ++c) {
            int ly = top_pad + static_cast<int>(c) * 18;
            svg += fmt::format(
                "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" "
                "y=\"{}\">{}</text>\n",
                lx, ly, colours[c % 10], lx + 16, ly + 10, r.plans[0].memory.lines[c].name);
        }
    }
    return svg + "</svg>\n";
}

std::string emit_config_toml(const ModelSpec& m, const Plan& p, const RunConfig* source) {
    const RunSpec& r = p.run;
    // What the plan asks for that the trainer has no key for: said in the header, never
    // silently dropped.
    std::string gaps;
    // bf16-only is optim.master = "none", which the GPU engines run with one process, DDP, ZeRO
    // 1-3 and pipelines (compressed moments run everywhere on the GPU, the offloaded optimizer
    // included).
    if (!r.fp32_master && r.tp > 1)
        gaps +=
            "# bf16-only is optim.master = \"none\" below, which the GPU trainer runs with data "
            "parallelism, ZeRO, pipelines and the offloaded optimizer but not with train.tp: it "
            "refuses the config; optim.master = \"fp32\" takes more optimizer memory than "
            "planned.\n";

    if (source && source->model.dropout > 0)
        gaps += fmt::format(
            "# model.dropout = {} runs on the CPU engine without train.tp so far: on a GPU, or "
            "with tp above 1, the trainer refuses it (set model.dropout = 0 there).\n",
            source->model.dropout);
    // The plan is for GPUs: a source that trains on the CPU gets "auto" (a 16-bit plan needs one).
    const bool gpu_device =
        source && source->train.device == "cpu" && r.precision != Precision::fp32;
    if (gpu_device)
        gaps +=
            "# train.device: the source config's \"cpu\" is \"auto\" below, since this plan's "
            "16-bit precision trains on a GPU.\n";
    if (!trainer_runs(r))
        fail(
            "{}: memtrain's trainer does not run parameter offload yet, so there is no config "
            "to write for it",
            describe(r));
    std::string out = fmt::format(
        "# Written by `memtrain plan` for {}.\n"
        "# Layout: {}\n"
        "# precision={} optimizer={} sequence_parallel={} flash_attention={}\n"
        "# Predicted per GPU: {} ({} model states, {} activations); {:.0f} tokens/s, MFU {:.1f}%\n"
        "# Launch dp x tp x pp = {} x {} x {} = {} ranks: mpirun -np {} memtrain train THIS.toml "
        "(data-parallel replicas are the ranks left over by train.tp and train.pp).\n{}{}\n",
        m.name, describe(r), precision_label(r.precision, r.fp32_master), to_string(r.optimizer),
        r.sequence_parallel, r.flash_attention, format_bytes(p.memory.total),
        format_bytes(p.memory.model_states()), format_bytes(p.memory.bytes("activations")),
        p.time.tokens_per_s, p.time.mfu * 100, r.dp, r.tp, r.pp, r.gpus(), r.gpus(), gaps,
        r.lora_rank > 0
            ? fmt::format("# {} (docs/lora.md): set model.init_from to the base model.\n",
                          describe_method(r))
            : "");
    // The whole trainer config: the source's (every model key, its optimizer, data, io, sample
    // and guard sections, paths made absolute by read_run_config) or, for a preset or a
    // config.json, the defaults around the planned model; then the plan's layout over it.
    RunConfig cfg;
    if (source) {
        cfg = *source;
    } else {
        cfg.model = config_from_model(m);
    }
    if (gpu_device) cfg.train.device = "auto";
    cfg.train.seq_len = r.seq_len(m);
    cfg.train.batch_size = (int)r.global_batch();
    cfg.train.batch_tokens = 0;
    cfg.train.micro_batch_size = r.micro_batch;
    cfg.train.remat = to_string(r.recompute);
    cfg.train.precision = precision_name(r.precision);
    cfg.train.zero_stage = r.zero;
    cfg.train.offload_optimizer = r.offload != Offload::none;
    cfg.train.tp = r.tp;
    cfg.train.pp = r.pp;
    cfg.train.sequence_parallel = r.sequence_parallel && r.tp > 1;
    if (r.pp > 1) {
        cfg.train.pp_schedule = to_string(r.schedule);
        cfg.train.pp_virtual = r.schedule == pp::Kind::Interleaved ? r.virtual_stages : 1;
    }
    cfg.optim.name = r.optimizer == Optimizer::sgd         ? "sgd"
                     : r.optimizer == Optimizer::muon      ? "muon"
                     : r.optimizer == Optimizer::adafactor ? "adafactor"
                                                           : "adamw";
    cfg.optim.state_format =
        state_format_name(r.optimizer == Optimizer::adamw8bit ? StateFormat::Int8 : r.state_format);
    cfg.optim.master = r.fp32_master ? "fp32" : "none";
    cfg.lora.rank = r.lora_rank;
    if (r.lora_rank > 0) {
        cfg.lora.targets = r.lora_targets == LoraTargets::all ? "all" : "attn";
        // Frozen weights at 16 bits are the unquantized base (fp32 on the CPU engine); 8 and 4
        // bits are QLoRA's int8 and NF4.
        cfg.lora.base = r.frozen_bits == 8 ? "int8" : r.frozen_bits == 4 ? "nf4" : "fp32";
    }
    std::string body = to_toml(cfg);
    body.erase(0, body.find('\n') + 1);  // to_toml's own title line
    return out + body;
}

}  // namespace memtrain::plan
