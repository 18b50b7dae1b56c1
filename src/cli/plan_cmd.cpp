// `memtrain estimate`, `memtrain plan`, `memtrain scale`: parse flags, call planner/, print.
// estimate: per-GPU memory table (and step time) of one layout; plan: ranked layouts with
// reasons for the rejected ones; scale: compute-optimal size and the time it takes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/ranges.h>

#include "cli/commands.h"
#include "config/run_config.h"
#include "core/error.h"
#include "engine/host_memory.h"
#include "planner/rank_layout.h"
#include "planner/report.h"
#include "planner/scaling.h"
#include "planner/search.h"
#include "planner/stage_activations.h"
#include "remat/policy.h"
#include "train/plan.h"
#include "train/validate.h"

namespace memtrain::cli {

namespace {

using namespace memtrain::plan;

struct GpuArgs {
    std::string gpu = "h100-80gb";
    int gpus_per_node = 8;
    double mem_gb = 0, tflops = 0, fp32_tflops = 0, hbm_gbs = 0, intra_gbs = 0, inter_gbs = 0,
           pcie_gbs = 0, efficiency = 0, host_mem_gb = 0;
};

// Range checks for flags the user gave (defaults are not checked): one line naming the flag
// and its value, a memtrain::Error like every other refusal of these commands (exit 1).
class FlagCheck {
  public:
    explicit FlagCheck(const CLI::App* cmd) : cmd_(cmd) {}
    bool given(const char* flag) const { return cmd_->count(flag) > 0; }
    template <typename T>
    void positive(const char* flag, T v) const {
        if (given(flag) && !(v > 0)) fail("{} must be positive, got {}", flag, v);
    }
    template <typename T>
    void at_least(const char* flag, T v, T lo) const {
        if (given(flag) && !(v >= lo)) fail("{} must be at least {}, got {}", flag, lo, v);
    }
    void fraction(const char* flag, double v) const {  // (0, 1]
        if (given(flag) && !(v > 0 && v <= 1))
            fail("{} must be a fraction in (0, 1], got {}", flag, v);
    }

  private:
    const CLI::App* cmd_;
};

void add_gpu_flags(CLI::App* cmd, GpuArgs& a) {
    cmd->add_option("--gpu", a.gpu,
                    fmt::format("GPU preset: {} custom", fmt::join(gpu_preset_names(), " ")));
    cmd->add_option("--gpus-per-node", a.gpus_per_node, "GPUs per node (NVLink domain)");
    cmd->add_option("--gpu-mem-gb", a.mem_gb, "override GPU memory (GB)");
    cmd->add_option("--gpu-tflops", a.tflops, "override dense bf16 peak (TFLOP/s)");
    cmd->add_option("--gpu-fp32-tflops", a.fp32_tflops, "override plain fp32 peak (TFLOP/s)");
    cmd->add_option("--hbm-bw-gbs", a.hbm_gbs, "override GPU memory bandwidth (GB/s)");
    cmd->add_option("--intra-bw-gbs", a.intra_gbs, "override NVLink GB/s per GPU");
    cmd->add_option("--inter-bw-gbs", a.inter_gbs, "override network GB/s per GPU");
    cmd->add_option("--pcie-bw-gbs", a.pcie_gbs, "override host<->GPU GB/s (offload)");
    cmd->add_option("--efficiency", a.efficiency, "achievable fraction of peak for big GEMMs");
    cmd->add_option("--host-mem-gb", a.host_mem_gb,
                    "host memory per node for offloaded states (GB; default: the GPU preset's "
                    "typical node, 2048 for h100-80gb)");
}

constexpr const char* kRuntimeHelp =
    "whose memory to price: memtrain (default: its planned buffers), pytorch (torch.amp + DDP), "
    "deepspeed (ZeRO 1-3 at its default buckets), megatron (fp32 main grads, distributed "
    "optimizer)";

// What of the GPU's numbers a command uses, so that `--gpu custom` asks only for those.
struct GpuNeeds {
    bool fp32 = false;     // precision fp32 runs at the plain fp32 peak
    bool offload = false;  // offloaded states cross PCIe
};

void check_gpu_flags(const GpuArgs& a, const CLI::App* cmd) {
    const FlagCheck check(cmd);
    check.positive("--gpu-mem-gb", a.mem_gb);
    check.positive("--gpu-tflops", a.tflops);
    check.positive("--gpu-fp32-tflops", a.fp32_tflops);
    check.positive("--hbm-bw-gbs", a.hbm_gbs);
    check.positive("--intra-bw-gbs", a.intra_gbs);
    check.positive("--inter-bw-gbs", a.inter_gbs);
    check.positive("--pcie-bw-gbs", a.pcie_gbs);
    check.fraction("--efficiency", a.efficiency);
    check.positive("--host-mem-gb", a.host_mem_gb);
    check.at_least("--gpus-per-node", a.gpus_per_node, 1);
}

ClusterSpec make_cluster(const GpuArgs& a, const CLI::App* cmd, int gpus, GpuNeeds needs = {}) {
    check_gpu_flags(a, cmd);
    const FlagCheck check(cmd);
    if (gpus < 1) fail("the cluster needs at least 1 GPU, got {}", gpus);
    if (a.gpu == "custom") {
        // A custom GPU has no datasheet behind it: every number the estimate uses must be given.
        std::vector<std::string> missing;
        auto need = [&](const char* flag, bool used) {
            if (used && !check.given(flag)) missing.push_back(flag);
        };
        need("--gpu-mem-gb", true);
        need("--gpu-tflops", true);
        need("--hbm-bw-gbs", true);
        need("--gpu-fp32-tflops", needs.fp32);
        need("--intra-bw-gbs", gpus > 1);
        need("--inter-bw-gbs", gpus > a.gpus_per_node);
        need("--pcie-bw-gbs", needs.offload);
        need("--host-mem-gb", needs.offload);
        if (!missing.empty())
            fail("--gpu custom needs the GPU's numbers: give {} (or start from a preset: {})",
                 fmt::format("{}", fmt::join(missing, ", ")),
                 fmt::format("{}", fmt::join(gpu_preset_names(), ", ")));
    }
    ClusterSpec c;
    c.gpu = gpu_preset(a.gpu);
    if (check.given("--gpu-mem-gb")) c.gpu.memory_bytes = a.mem_gb * 1e9;
    if (check.given("--gpu-tflops")) c.gpu.peak_flops = a.tflops * 1e12;
    if (check.given("--gpu-fp32-tflops")) c.gpu.peak_flops_fp32 = a.fp32_tflops * 1e12;
    if (check.given("--hbm-bw-gbs")) c.gpu.hbm_bandwidth = a.hbm_gbs * 1e9;
    if (check.given("--intra-bw-gbs")) c.gpu.intra_node_bw = a.intra_gbs * 1e9;
    if (check.given("--inter-bw-gbs")) c.gpu.inter_node_bw = a.inter_gbs * 1e9;
    if (check.given("--pcie-bw-gbs")) c.gpu.pcie_bw = a.pcie_gbs * 1e9;
    if (check.given("--efficiency")) c.gpu.efficiency = a.efficiency;
    if (check.given("--host-mem-gb")) c.host_memory_bytes = a.host_mem_gb * 1e9;
    c.gpus_per_node = a.gpus_per_node;
    c.gpus = gpus;
    return c;
}

// bf16 on a GPU without bf16 tensor cores (Volta): refused when --precision asked for it, fp16
// when bf16 was only the default. Returns the line that says so, or "".
std::string fit_precision_to_gpu(const GpuSpec& g, const CLI::App* cmd, Precision* p,
                                 bool* fp32_master) {
    if (g.bf16 || *p != Precision::bf16) return "";
    if (FlagCheck(cmd).given("--precision"))
        fail("--precision {}: {} has no bf16 tensor cores; use --precision fp16 (or fp32)",
             precision_label(*p, *fp32_master), g.name);
    *p = Precision::fp16;
    *fp32_master = true;
    return fmt::format(
        "precision: fp16 with loss scaling ({} has no bf16 tensor cores; --precision to change)",
        g.name);
}

// "host memory: 2048 GB per node (default for h100-80gb, as in a DGX H100: 2048 GB for 8 GPUs;
// --host-mem-gb to change)": the number every offloaded layout is checked against, and whence.
std::string host_memory_line(const ClusterSpec& c, const CLI::App* cmd) {
    const double gb = c.host_memory() / 1e9;
    if (FlagCheck(cmd).given("--host-mem-gb"))
        return fmt::format("host memory: {:g} GB per node (--host-mem-gb)", gb);
    // --gpu custom needs --host-mem-gb whenever offload is possible, so only --no-offload is left.
    if (c.gpu.host_memory_source.empty())
        return "host memory: not used (--no-offload; --host-mem-gb to give it)";
    const std::string per_gpu = c.gpus_per_node == 8
                                    ? ""
                                    : fmt::format(": {:g} GB per GPU x {} GPUs per node",
                                                  c.gpu.host_memory_per_gpu / 1e9, c.gpus_per_node);
    return fmt::format(
        "host memory: {:g} GB per node (default for {}{}, {}; --host-mem-gb to change)", gb,
        c.gpu.name, per_gpu, c.gpu.host_memory_source);
}

// --frozen-bits and --lora-targets, as given: one line naming the flag when they are wrong.
void check_lora_flags(const CLI::App* cmd, int frozen_bits, const std::string& targets) {
    const FlagCheck check(cmd);
    if (check.given("--frozen-bits") && frozen_bits != 16 && frozen_bits != 8 && frozen_bits != 4)
        fail("--frozen-bits must be 16, 8 or 4, got {}", frozen_bits);
    if (check.given("--lora-targets") && targets != "attn" && targets != "all")
        fail("--lora-targets must be attn (q, k, v, o) or all (and the MLP), got \"{}\"", targets);
}

void write_file(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary);
    if (!out) fail("cannot write {}", path);
    out << text;
    if (!out) fail("error writing {}", path);
}

// --state-format's value, refused naming the flag.
StateFormat state_format_flag(const std::string& v) {
    if (v != "fp32" && v != "bf16" && v != "int8" && v != "int4")
        fail("--state-format {}: expected fp32, bf16, int8 or int4", v);
    return parse_state_format(v);
}

struct EstimateArgs {
    std::string model, precision = "bf16", optimizer = "adamw", recompute = "none";
    std::string offload = "none", schedule = "1f1b", lora_targets = "attn";
    std::string state_format = "fp32", device = "gpu", runtime = "memtrain";
    RunSpec run;
    GpuArgs gpu;
    int global_batch = 0;
    double reserve_gb = 1.0;
    bool no_flash = false, sp = false, json = false;
};

// The CPU engine's config of `model`: the TOML's whole config, or a preset's (or config.json's)
// model at its context with a global batch of one sequence per each of `dp` ranks (the
// micro-batch derived); the TOML's precision as training resolves it on this CPU (bf16 GEMMs
// or fp32; a GPU's fp16 is fp32 here).
RunConfig cpu_source_config(const std::string& model, const ModelSpec& m, int dp) {
    RunConfig cfg;
    if (model.ends_with(".toml")) {
        cfg = read_run_config(model, {});
    } else {
        cfg.model = config_from_model(m);
        cfg.train.seq_len = m.block_size;
        cfg.train.micro_batch_size = 0;
        cfg.train.batch_size = dp;
    }
    cfg.train.device = "cpu";
    if (cfg.train.precision == "auto") resolve_config(cfg);  // what training would run here
    if (cfg.train.precision != "bf16") cfg.train.precision = "fp32";
    set_cpu_bf16(cfg);
    return cfg;
}

// `estimate --device cpu`: the trainer's config for the layout the flags describe, on the CPU
// engine (fp32, or bf16 GEMMs with --precision bf16; any of the trainer's remat policies), from
// the source TOML or the preset.
RunConfig cpu_estimate_config(const EstimateArgs& a, const CLI::App* cmd, const ModelSpec& m) {
    const FlagCheck check(cmd);
    for (const char* flag :
         {"--offload", "--gpu", "--gpu-mem-gb", "--gpu-tflops", "--hbm-bw-gbs", "--gpu-fp32-tflops",
          "--intra-bw-gbs", "--inter-bw-gbs", "--pcie-bw-gbs", "--efficiency", "--reserve-gb",
          "--fragmentation", "--no-flash", "--gpus-per-node"})
        if (check.given(flag))
            fail("{} describes a GPU; --device cpu prices the CPU engine (drop the flag)", flag);
    if (check.given("--precision") && a.precision != "fp32" && a.precision != "bf16")
        fail("--precision {}: the CPU engine computes in fp32 or bf16 (--device cpu)", a.precision);
    const bool toml = a.model.ends_with(".toml");
    RunConfig cfg = cpu_source_config(a.model, m, a.run.dp);
    if (!toml) cfg.train.micro_batch_size = 1;  // as the GPU estimate: one sequence per micro-batch
    cfg.train.tp = a.run.tp;
    cfg.train.pp = a.run.pp;
    cfg.train.zero_stage = a.run.zero;
    cfg.world = a.run.gpus();
    if (check.given("--seq")) cfg.train.seq_len = a.run.seq;
    if (check.given("--micro-batch")) cfg.train.micro_batch_size = a.run.micro_batch;
    if (check.given("--global-batch")) {
        cfg.train.batch_size = a.global_batch;
        cfg.train.batch_tokens = 0;
    } else if (check.given("--micro-batch") || !toml) {
        // One micro-batch per step on every data-parallel rank (a pipeline: one per stage).
        const int64_t per = (int64_t)a.run.dp * std::max(1, cfg.train.micro_batch_size);
        cfg.train.batch_size = (int)(per * (a.run.pp > 1 ? a.run.pp : 1));
        cfg.train.batch_tokens = 0;
    }
    if (check.given("--recompute")) cfg.train.remat = a.recompute;
    if (check.given("--sequence-parallel")) cfg.train.sequence_parallel = a.sp;
    if (check.given("--schedule")) cfg.train.pp_schedule = a.schedule;
    if (check.given("--virtual-stages")) cfg.train.pp_virtual = a.run.virtual_stages;
    if (check.given("--optimizer")) {
        if (a.optimizer == "adamw8bit") {
            cfg.optim.name = "adamw";
            cfg.optim.state_format = "int8";
        } else {
            cfg.optim.name = a.optimizer;
        }
    }
    if (check.given("--state-format")) cfg.optim.state_format = a.state_format;
    if (check.given("--step-in-backward")) cfg.optim.step_in_backward = a.run.step_in_backward;
    if (check.given("--precision")) {
        cfg.train.precision = a.precision;
        set_cpu_bf16(cfg);
    }
    if (a.run.lora_rank > 0) {
        cfg.lora.rank = a.run.lora_rank;
        cfg.lora.targets = a.lora_targets;
        cfg.lora.base = a.run.frozen_bits == 8 ? "int8" : a.run.frozen_bits == 4 ? "nf4" : "fp32";
    }
    validate_config(cfg);
    return cfg;
}

// Every rank's rows (the engines' own predictions, as `train --print-plan` prints them), the most
// loaded rank's table, and whether all ranks fit this host (or --host-mem-gb).
void print_cpu_estimate(const EstimateArgs& a, const CLI::App* cmd, const ModelSpec& m) {
    const RunConfig cfg = cpu_estimate_config(a, cmd, m);
    std::vector<RunPlan> ranks;
    std::size_t sum = 0, most = 0;
    int worst = 0;
    for (int r = 0; r < cfg.world; r++) {
        ranks.push_back(plan_host_rank(cfg, r));
        const std::size_t total = predicted_total(ranks.back().memory);
        sum += total;
        if (total > most) most = total, worst = r;
    }
    const bool given = FlagCheck(cmd).given("--host-mem-gb");
    const double host = given ? a.gpu.host_mem_gb * 1e9 : (double)host_available_bytes();
    const bool fits = (double)sum <= host;
    const RunPlan& p = ranks[worst];
    if (a.json) {
        nlohmann::json j;
        j["model"] = m.name;
        j["params"] = m.total_params();
        j["device"] = "cpu";
        j["plan"] = p.describe();
        for (const RunPlan& rp : ranks) {
            nlohmann::json rows = nlohmann::json::array();
            for (const MemoryPrediction& row : rp.memory)
                rows.push_back({{"category", std::string(category_name(row.category))},
                                {"bytes", row.bytes},
                                {"formula", row.formula}});
            j["ranks"].push_back(
                {{"rank", rp.rank}, {"total_bytes", predicted_total(rp.memory)}, {"rows", rows}});
        }
        j["host_bytes_needed"] = sum;
        j["host_memory_bytes"] = host;
        j["fits"] = fits;
        std::printf("%s\n", j.dump(2).c_str());
        return;
    }
    std::printf("%s: %.3fB parameters (%d layers, d=%d, %d heads), seq %d, the CPU engine\n",
                m.name.c_str(), m.total_params() / 1e9, m.n_layer, m.n_embd, m.n_head,
                cfg.train.seq_len);
    std::printf("plan: %s\n", p.describe().c_str());
    if (cfg.world > 1) {
        std::string all;
        for (const RunPlan& rp : ranks)
            all += fmt::format("{}rank {} {:.1f} MiB", all.empty() ? "" : " | ", rp.rank,
                               predicted_total(rp.memory) / 1048576.0);
        std::printf("every rank: %s\nthe most loaded, rank %d:\n", all.c_str(), worst);
    }
    std::fputs(p.table().c_str(), stdout);
    std::printf(
        "host: %d rank%s %.1f MiB; %s %.1f MiB (%s): %s\n", cfg.world,
        cfg.world == 1 ? " needs" : "s need", sum / 1048576.0, given ? "given" : "this machine has",
        host / 1048576.0,
        given ? "--host-mem-gb"
              : "MemAvailable or the cgroup limit; MEMTRAIN_HOST_MEMORY or --host-mem-gb to change",
        fits ? "fits" : "does NOT fit");
}

// --recompute with one of the trainer's per-block policies: the remat solver's plan on the
// layout the engines would allocate (the planner prices it block by block, RunSpec::block_plan).
void solve_block_plan(const std::string& policy, const ModelSpec& m, RunSpec& r) {
    const remat::RematPolicy pol = remat::parse_policy(policy);  // names what is wrong
    if (pol.may_offload())
        fail(
            "--recompute {}: block inputs in host memory are priced by `memtrain remat CONFIG "
            "--device cuda`",
            policy);
    if (!uses_engine_arena(m, r) && !uses_stage_layout(m, r))
        fail(
            "--recompute {} is solved on the engines' activation layout, and this layout is "
            "priced by the formulas (a model or layout no engine runs): use none, selective or "
            "full",
            policy);
    const ModelConfig cfg = rank_config(m, r);
    r.block_plan =
        remat::solve_policy(pol, cfg, r.micro_batch, r.seq_len(m), nullptr, arena_format(cfg, r))
            .plan;
}

// `plan --device cpu`: the CPU engine's run of the model on `ranks` processes of this host, made
// to fit the host by levers tried in a fixed order, each kept once taken: ZeRO stages, remat
// policies and compressed saved activations, a smaller micro-batch (accumulation keeps the
// global batch), compressed moments, bf16 weights. Every step is printed with its bytes, so the
// choice says why.
struct CpuPlanArgs {
    std::string model, emit;
    int ranks = 1, global_batch = 0, seq = 0;
    double host_gb = 0;  // 0: this host's available memory
    bool json = false;
};
int run_cpu_plan(const CpuPlanArgs& a) {
    const ModelSpec m = load_model(a.model);
    RunConfig cfg = cpu_source_config(a.model, m, a.ranks);
    cfg.train.tp = cfg.train.pp = 1;
    cfg.world = a.ranks;
    if (a.seq > 0) cfg.train.seq_len = a.seq;
    if (a.global_batch > 0) {
        cfg.train.batch_size = a.global_batch;
        cfg.train.batch_tokens = 0;
    }
    cfg.train.micro_batch_size = cfg.micro_batch();  // explicit: a lever halves it
    validate_config(cfg);
    const double host = a.host_gb > 0 ? a.host_gb * 1e9 : (double)host_available_bytes();
    struct Step {
        std::string lever;
        std::string skipped;  // why the lever does not apply ("" when it was tried)
        HostNeed need;
        bool fits = false;
    };
    std::vector<Step> steps;
    std::optional<RunConfig> chosen;
    auto attempt = [&](const std::string& lever, const std::function<void(RunConfig&)>& apply) {
        if (chosen) return;
        RunConfig next = cfg;
        apply(next);
        Step s{lever, "", {}, false};
        try {
            validate_config(next);
            s.need = host_need(next);
        } catch (const Error& e) {
            s.skipped = e.what();
            steps.push_back(s);
            return;
        }
        s.fits = (double)s.need.sum <= host;
        steps.push_back(s);
        cfg = next;  // kept: the levers add up
        if (s.fits) chosen = cfg;
    };
    attempt("as configured", [](RunConfig&) {});
    const std::string source_format = cfg.train.cpu_activations;
    if (a.ranks > 1) {
        attempt("ZeRO-1",
                [](RunConfig& c) { c.train.zero_stage = std::max(c.train.zero_stage, 1); });
        attempt("ZeRO-2",
                [](RunConfig& c) { c.train.zero_stage = std::max(c.train.zero_stage, 2); });
    }
    attempt("train.remat = selective", [](RunConfig& c) { c.train.remat = "selective"; });
    // Compression before recompute: every saved field stored block-scaled in int8 (bf16 first
    // where they are fp32) costs a rounding pass and no flops (docs/checkpointing.md: on the
    // demo 1.2x the bf16 step for 0.67x its bytes, the loss unchanged to 4 digits), where `full`
    // re-runs every block's forward.
    if (cpu_saved_activations(cfg.train, cfg.train.precision) == SavedStore::fp32)
        attempt("train.cpu_activations = bf16 (saved fields)",
                [](RunConfig& c) { c.train.cpu_activations = "bf16"; });
    attempt("train.cpu_activations = int8 (saved fields)",
            [](RunConfig& c) { c.train.cpu_activations = "int8"; });
    for (const char* policy : {"sqrt", "full"})
        attempt(fmt::format("train.remat = {}", policy),
                [&](RunConfig& c) { c.train.remat = policy; });
    attempt("train.cpu_attention = lse (no attention probabilities)",
            [](RunConfig& c) { c.train.cpu_attention = "lse"; });
    // The norms and the MLP over row tiles: a recomputed block then holds a tile of their fields
    // (docs/checkpointing.md), free or cheaper under full. The tile: the largest power of two up
    // to 256 rows and a quarter of the micro-batch's, raised to the rows a tile of int8 fields
    // must be a multiple of (a power of two too) while it stays below the micro-batch's rows.
    {
        const int64_t rows = (int64_t)cfg.train.micro_batch_size * cfg.train.seq_len;
        int64_t tile = 1;
        while (tile * 2 <= 256 && tile * 2 <= rows / 4) tile *= 2;
        tile = std::max(tile, mlp_tile_multiple(cfg));
        if (rows >= 4 && tile < rows)
            attempt(fmt::format("train.mlp_tile = {} (norms and MLP in row tiles)", tile),
                    [tile](RunConfig& c) { c.train.mlp_tile = (int)tile; });
    }
    while (!chosen && cfg.train.micro_batch_size > 1) {
        const int half = cfg.train.micro_batch_size / 2;
        if (cfg.train.batch_size % (half * cfg.dp()) != 0) break;
        attempt(fmt::format("micro-batch {} (accumulation keeps the global batch)", half),
                [&](RunConfig& c) { c.train.micro_batch_size = half; });
        if (!steps.back().skipped.empty()) break;
    }
    attempt("optim.state_format = int8", [](RunConfig& c) { c.optim.state_format = "int8"; });
    if (a.ranks > 1) attempt("ZeRO-3", [](RunConfig& c) { c.train.zero_stage = 3; });
    attempt("optim.state_format = int4", [](RunConfig& c) { c.optim.state_format = "int4"; });
    attempt("optim.master = none (bf16 weights)", [](RunConfig& c) { c.optim.master = "none"; });
    // The step in the backward frees the gradient buffer only with one micro-batch per step (with
    // accumulation the earlier micro-batches' sum stays).
    if (!chosen && cfg.accum_steps() > 1)
        steps.push_back({"optim.step_in_backward (no gradient buffer)",
                         "no gain with gradient accumulation (the micro-batches' sum stays)",
                         {},
                         false});
    else
        attempt("optim.step_in_backward (no gradient buffer)",
                [](RunConfig& c) { c.optim.step_in_backward = true; });
    // Last, for their recompute: dropping the block inputs too. The joint remat solver
    // (docs/checkpointing.md) gives the least recompute under a budget, so the lever is the
    // largest budget the host leaves: a rank's activations are its plan's peak and nothing else
    // depends on the plan, so raising every rank's budget by d from the rebuild floor (memory-
    // poor's bytes) adds at most d x ranks. Where even the floor does not fit, memory-poor shows
    // what it needs.
    if (!chosen && cfg.model.n_layer > 3) {  // from 4 blocks the floor keeps fewer streams
        RunConfig floor = cfg;
        floor.train.remat = "memory-poor";
        std::optional<HostNeed> at_floor;
        try {
            validate_config(floor);
            at_floor = host_need(floor);
        } catch (const Error&) {  // the lever's own attempt says why
        }
        const double headroom = at_floor ? host - (double)at_floor->sum : -1;
        if (headroom >= 0) {
            const std::size_t peak = plan_host_rank(floor, 0).remat.peak_bytes;
            const std::size_t budget = peak + (std::size_t)(headroom / a.ranks);
            attempt(fmt::format("train.remat = budget:{} (least recompute that fits)", budget),
                    [&](RunConfig& c) { c.train.remat = fmt::format("budget:{}", budget); });
        } else {
            attempt("train.remat = memory-poor",
                    [](RunConfig& c) { c.train.remat = "memory-poor"; });
        }
    }

    // The compression was taken before recompute; where the chosen run fits with the source's
    // format as well and recomputes no more (a later lever, `full` above all, keeps only block
    // inputs, which no format compresses), the lossless format comes back: the same fit and
    // recompute, without the rounding pass. (Under a budget the compression may be what spares
    // recompute: it stays.)
    if (chosen && chosen->train.cpu_activations != source_format) {
        RunConfig back = *chosen;
        back.train.cpu_activations = source_format;
        try {
            validate_config(back);
            const HostNeed need = host_need(back);
            if ((double)need.sum <= host && plan_host_rank(back, 0).remat.recompute_flops <=
                                                plan_host_rank(*chosen, 0).remat.recompute_flops) {
                steps.push_back(
                    {fmt::format("train.cpu_activations = {} again (fits without)", source_format),
                     "", need, true});
                chosen = back;
            }
        } catch (const Error&) {  // keeps the compressed run
        }
    }

    if (a.json) {
        nlohmann::json j;
        j["model"] = m.name;
        j["ranks"] = a.ranks;
        j["host_memory_bytes"] = host;
        for (const Step& s : steps)
            j["steps"].push_back({{"lever", s.lever},
                                  {"skipped", s.skipped},
                                  {"bytes_per_rank", s.need.most},
                                  {"bytes_all_ranks", s.need.sum},
                                  {"fits", s.fits}});
        j["fits"] = chosen.has_value();
        if (chosen) j["config"] = to_toml(*chosen);
        std::printf("%s\n", j.dump(2).c_str());
    } else {
        std::printf(
            "%s: %.3fB parameters on the CPU engine, %d rank%s on this host, global batch %d x %d "
            "tokens; host memory %.2f GB (%s)\n\n",
            m.name.c_str(), m.total_params() / 1e9, a.ranks, a.ranks == 1 ? "" : "s",
            cfg.train.batch_size, cfg.train.seq_len, host / 1e9,
            a.host_gb > 0
                ? "--host-mem-gb"
                : "MemAvailable or the cgroup limit; MEMTRAIN_HOST_MEMORY or --host-mem-gb");
        std::printf("%-4s %-52s %14s %14s  %s\n", "step", "lever (each kept once taken)",
                    "per rank", "all ranks", "fits");
        for (std::size_t i = 0; i < steps.size(); i++) {
            const Step& s = steps[i];
            if (!s.skipped.empty()) {
                std::printf("%-4zu %-52s skipped: %s\n", i, s.lever.c_str(), s.skipped.c_str());
                continue;
            }
            std::printf("%-4zu %-52s %11.1f MiB %11.1f MiB  %s\n", i, s.lever.c_str(),
                        s.need.most / 1048576.0, s.need.sum / 1048576.0, s.fits ? "yes" : "no");
        }
        if (chosen) {
            const RunPlan p = plan_host_rank(*chosen, 0);
            const bool undone = steps.size() > 1 && steps[steps.size() - 2].fits;
            std::printf(
                "\nchosen: step %zu, %s; rank 0 of it:\n%s", steps.size() - 1,
                undone ? "the first that fits with its compression undone" : "the first that fits",
                p.table().c_str());
        } else {
            std::size_t least = 0;
            for (const Step& st : steps)
                if (st.skipped.empty()) least = st.need.sum;
            std::printf("\nnothing fits: the last step tried needs %.1f MiB of %.1f MiB\n",
                        least / 1048576.0, host / 1048576.0);
        }
    }
    if (!a.emit.empty()) {
        std::fflush(stdout);  // the table (or JSON) before the error
        if (!chosen) fail("no CPU plan fits, so there is no config to write to {}", a.emit);
        write_file(a.emit, fmt::format("# Written by `memtrain plan --device cpu` for {}: {} "
                                       "rank(s) of the CPU engine on a host of {:.2f} GB.\n",
                                       m.name, a.ranks, host / 1e9) +
                               to_toml(*chosen));
        if (!a.json) std::printf("\nwrote %s\n", a.emit.c_str());
    }
    return chosen ? 0 : 1;
}

void register_estimate(CLI::App& app) {
    auto* cmd = app.add_subcommand("estimate", "per-GPU memory (and step time) of one layout");
    using Args = EstimateArgs;
    auto a = std::make_shared<Args>();
    cmd->add_option("model", a->model, "preset, HF config.json or memtrain .toml")->required();
    cmd->add_option("--zero", a->run.zero, "ZeRO stage 0-3");
    cmd->add_option("--dp", a->run.dp, "data-parallel degree");
    cmd->add_option("--tp", a->run.tp, "tensor-parallel degree");
    cmd->add_option("--pp", a->run.pp, "pipeline-parallel degree");
    cmd->add_option("--micro-batch", a->run.micro_batch, "sequences per micro-batch");
    cmd->add_option("--global-batch", a->global_batch, "sequences per step (sets micro-batches)");
    cmd->add_option("--seq", a->run.seq, "sequence length (default: model context)");
    cmd->add_option("--recompute", a->recompute,
                    "none | selective | full, or the trainer's per-block policies every:K | sqrt | "
                    "budget:BYTES (solved on the engines' layout)");
    cmd->add_option("--precision", a->precision, "bf16 | fp16 | fp32 | bf16-only");
    cmd->add_option("--optimizer", a->optimizer, "adamw | sgd | adamw8bit | muon | adafactor");
    cmd->add_option("--state-format", a->state_format,
                    "optimizer moments: fp32 | bf16 | int8 | int4 (optim.state_format)");
    cmd->add_option("--offload", a->offload, "none | optimizer | params");
    cmd->add_flag("--step-in-backward", a->run.step_in_backward,
                  "update each unit in the backward: no gradient buffer with one micro-batch "
                  "(optim.step_in_backward)");
    cmd->add_option("--schedule", a->schedule, "1f1b | gpipe | interleaved | zb-h1");
    cmd->add_option("--virtual-stages", a->run.virtual_stages, "interleaved model chunks");
    cmd->add_option("--lora-rank", a->run.lora_rank, "LoRA adapters of this rank");
    cmd->add_option("--frozen-bits", a->run.frozen_bits, "frozen weights: 16 | 8 | 4 (QLoRA)");
    cmd->add_option("--lora-targets", a->lora_targets,
                    "attn (q, k, v, o; default) | all (and the MLP)");
    cmd->add_option("--fragmentation", a->run.fragmentation, "allocator slack fraction");
    cmd->add_option("--reserve-gb", a->reserve_gb, "CUDA context + workspaces (GB)");
    cmd->add_flag("--no-flash", a->no_flash, "attention without flash (keeps s^2 scores)");
    cmd->add_flag("--sequence-parallel", a->sp, "Megatron sequence parallelism");
    cmd->add_flag("--json", a->json, "print JSON");
    cmd->add_option("--runtime", a->runtime, kRuntimeHelp);
    cmd->add_option("--device", a->device,
                    "gpu (default) or cpu: the CPU engine's own memory rows for every rank (fp32, "
                    "--recompute takes the trainer's policies) and whether they fit this host");
    add_gpu_flags(cmd, a->gpu);
    cmd->callback([a, cmd]() {
        const FlagCheck check(cmd);
        if (a->device != "gpu" && a->device != "cpu")
            fail("--device {}: expected gpu or cpu", a->device);
        check.at_least("--dp", a->run.dp, 1);
        check.at_least("--tp", a->run.tp, 1);
        check.at_least("--pp", a->run.pp, 1);
        check.at_least("--zero", a->run.zero, 0);
        if (a->run.zero > 3) fail("--zero must be 0, 1, 2 or 3, got {}", a->run.zero);
        check.positive("--micro-batch", a->run.micro_batch);
        check.positive("--global-batch", a->global_batch);
        check.positive("--seq", a->run.seq);
        check.at_least("--virtual-stages", a->run.virtual_stages, 1);
        check.at_least("--lora-rank", a->run.lora_rank, 0);
        check_lora_flags(cmd, a->run.frozen_bits, a->lora_targets);
        if (a->run.lora_rank == 0) {
            if (a->run.frozen_bits != 16)
                fail(
                    "--frozen-bits {} needs --lora-rank R: QLoRA trains adapters over the "
                    "quantized weights",
                    a->run.frozen_bits);
            if (check.given("--lora-targets")) fail("--lora-targets needs --lora-rank R");
        }
        check.at_least("--reserve-gb", a->reserve_gb, 0.0);
        if (check.given("--fragmentation") &&
            !(a->run.fragmentation >= 0 && a->run.fragmentation < 1))
            fail("--fragmentation must be a fraction in [0, 1), got {}", a->run.fragmentation);
        ModelSpec m = load_model(a->model);
        if (a->device == "cpu") {
            check.positive("--host-mem-gb", a->gpu.host_mem_gb);
            print_cpu_estimate(*a, cmd, m);
            return;
        }
        RunSpec r = a->run;
        r.precision = parse_precision(a->precision, &r.fp32_master);
        r.optimizer = parse_optimizer(a->optimizer);
        r.state_format = state_format_flag(a->state_format);
        if (!r.fp32_master && !check.given("--state-format")) r.state_format = StateFormat::Bf16;
        // The trainer's per-block policies (every:K, sqrt, budget:BYTES) are solved below, on
        // the layout the run is priced with.
        const bool uniform =
            a->recompute == "none" || a->recompute == "selective" || a->recompute == "full";
        if (uniform) r.recompute = parse_recompute(a->recompute);
        r.offload = parse_offload(a->offload);
        r.schedule = parse_schedule(a->schedule);
        r.lora_targets = parse_lora_targets(a->lora_targets);
        r.flash_attention = !a->no_flash;
        r.sequence_parallel = a->sp;
        r.runtime = parse_runtime(a->runtime);
        r.reserve_bytes = static_cast<int64_t>(a->reserve_gb * 1e9);
        const ClusterSpec c = make_cluster(
            a->gpu, cmd, r.gpus(), {r.precision == Precision::fp32, r.offload != Offload::none});
        const std::string precision_note =
            fit_precision_to_gpu(c.gpu, cmd, &r.precision, &r.fp32_master);
        if (!uniform) solve_block_plan(a->recompute, m, r);
        if (a->global_batch > 0) {
            int64_t per = static_cast<int64_t>(r.dp) * r.micro_batch;
            if (a->global_batch % per != 0)
                fail("--global-batch {} is not a multiple of dp x micro-batch = {}",
                     a->global_batch, per);
            r.micro_batches = static_cast<int>(a->global_batch / per);
        } else if (r.pp > 1) {
            r.micro_batches = 4 * r.pp;  // enough to keep the bubble near 20%
        }
        MemoryEstimate est = estimate_memory(m, r);
        TimeEstimate t = estimate_time(m, r, c);
        if (a->json) {
            nlohmann::json j = to_json(est);
            j["model"] = m.name;
            j["params"] = m.total_params();
            j["step_s"] = t.step_s;
            j["tokens_per_s"] = t.tokens_per_s;
            j["mfu"] = t.mfu;
            j["method"] = describe_method(r);
            j["precision"] = precision_label(r.precision, r.fp32_master);
            j["runtime"] = to_string(r.runtime);
            j["host_memory_bytes"] = c.host_memory();
            std::printf("%s\n", j.dump(2).c_str());
            return;
        }
        std::printf("%s: %.3fB parameters (%d layers, d=%d, %d heads), seq %d\n", m.name.c_str(),
                    m.total_params() / 1e9, m.n_layer, m.n_embd, m.n_head, r.seq_len(m));
        std::printf("layout: %s, %s %s, GPU %s%s\n", describe(r).c_str(),
                    precision_label(r.precision, r.fp32_master), to_string(r.optimizer),
                    c.gpu.name.c_str(),
                    r.runtime == Runtime::memtrain
                        ? ""
                        : fmt::format(", priced as {} runs it", to_string(r.runtime)).c_str());
        if (!precision_note.empty()) std::printf("%s\n", precision_note.c_str());
        if (r.offload != Offload::none) std::printf("%s\n", host_memory_line(c, cmd).c_str());
        std::printf("\n");
        std::printf("%s\n%s", format_memory_table(est, &c).c_str(), format_time(t).c_str());
    });
}

void register_plan_cmd(CLI::App& app) {
    auto* cmd = app.add_subcommand("plan", "rank parallel layouts for a model on a cluster");
    struct Args {
        std::string model, precision = "bf16", optimizer = "adamw", emit, svg;
        std::string lora_targets = "attn", state_format = "fp32", runtime = "memtrain";
        std::string device = "gpu";
        GpuArgs gpu;
        int gpus = 0, nodes = 0, top = 5, reasons = 12, ranks = 1;
        SearchSpec spec;
        double reserve_gb = 1.0;
        bool json = false, no_flash = false, no_offload = false, no_lora = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("model", a->model, "preset, HF config.json or memtrain .toml")->required();
    cmd->add_option("--gpus", a->gpus, "total GPUs");
    cmd->add_option("--nodes", a->nodes, "nodes (GPUs = nodes x --gpus-per-node)");
    cmd->add_option("--global-batch", a->spec.global_batch, "sequences per step (default 1024)");
    cmd->add_option("--seq", a->spec.seq, "sequence length (default: model context)");
    cmd->add_option("--precision", a->precision, "bf16 | fp16 | fp32 | bf16-only");
    cmd->add_option("--optimizer", a->optimizer, "adamw | sgd | adamw8bit | muon | adafactor");
    cmd->add_option("--state-format", a->state_format,
                    "optimizer moments: fp32 | bf16 | int8 | int4 (default: fp32, then int8 and "
                    "int4 when nothing fits)");
    cmd->add_option("--top", a->top, "plans to show");
    cmd->add_option("--reasons", a->reasons, "rejected families to show");
    cmd->add_option("--reserve-gb", a->reserve_gb, "CUDA context + workspaces (GB)");
    cmd->add_option("--fragmentation", a->spec.fragmentation, "allocator slack fraction");
    cmd->add_option("--emit-config", a->emit, "write a memtrain TOML for the best plan");
    cmd->add_option("--svg", a->svg, "write a memory breakdown chart of the top plans");
    cmd->add_flag("--json", a->json, "print JSON");
    cmd->add_flag("--no-flash", a->no_flash, "attention without flash");
    cmd->add_flag("--no-offload", a->no_offload, "do not consider CPU offload");
    cmd->add_option("--lora-rank", a->spec.lora_rank,
                    "every plan trains LoRA adapters of this rank (default: full-parameter "
                    "plans, then LoRA r=16 / QLoRA when those do not fit)");
    cmd->add_option("--frozen-bits", a->spec.frozen_bits,
                    "LoRA's frozen weights: 16 | 8 | 4 (QLoRA); default 16, or 16 then 8 then 4 "
                    "when LoRA is the fallback");
    cmd->add_option("--lora-targets", a->lora_targets,
                    "attn (q, k, v, o; default) | all (and the MLP)");
    cmd->add_option("--runtime", a->runtime, kRuntimeHelp);
    cmd->add_flag("--no-lora", a->no_lora, "full-parameter plans only, no LoRA fallback");
    cmd->add_option("--device", a->device,
                    "gpu (default) or cpu: fit the CPU engine's run into this host, trying ZeRO, "
                    "remat, a smaller micro-batch, compressed moments and bf16 weights in turn");
    cmd->add_option("--ranks", a->ranks, "with --device cpu: processes on this host (mpirun -np)");
    add_gpu_flags(cmd, a->gpu);
    cmd->callback([a, cmd]() {
        const FlagCheck check(cmd);
        if (a->device != "gpu" && a->device != "cpu")
            fail("--device {}: expected gpu or cpu", a->device);
        if (a->device == "cpu") {
            for (const char* flag : {"--gpus",        "--nodes",        "--precision",
                                     "--optimizer",   "--state-format", "--top",
                                     "--reasons",     "--reserve-gb",   "--fragmentation",
                                     "--svg",         "--no-flash",     "--no-offload",
                                     "--lora-rank",   "--frozen-bits",  "--lora-targets",
                                     "--runtime",     "--no-lora",      "--gpu",
                                     "--gpu-mem-gb",  "--gpu-tflops",   "--gpu-fp32-tflops",
                                     "--hbm-bw-gbs",  "--intra-bw-gbs", "--inter-bw-gbs",
                                     "--pcie-bw-gbs", "--efficiency",   "--gpus-per-node"})
                if (check.given(flag))
                    fail(
                        "{} is not a --device cpu flag (it takes --ranks, --global-batch, --seq, "
                        "--host-mem-gb, --emit-config, --json)",
                        flag);
            check.positive("--ranks", a->ranks);
            check.positive("--global-batch", a->spec.global_batch);
            check.positive("--seq", a->spec.seq);
            check.positive("--host-mem-gb", a->gpu.host_mem_gb);
            CpuPlanArgs c;
            c.model = a->model, c.emit = a->emit, c.ranks = a->ranks;
            c.global_batch = a->spec.global_batch, c.seq = a->spec.seq;
            c.host_gb = a->gpu.host_mem_gb, c.json = a->json;
            if (const int code = run_cpu_plan(c)) throw ExitCode{code};
            return;
        }
        if (check.given("--ranks")) fail("--ranks needs --device cpu (GPUs: --gpus)");
        check.at_least("--lora-rank", a->spec.lora_rank, 1);
        check_lora_flags(cmd, a->spec.frozen_bits, a->lora_targets);
        if (a->no_lora) {
            const std::pair<const char*, std::string> lora_flags[] = {
                {"--lora-rank", std::to_string(a->spec.lora_rank)},
                {"--frozen-bits", std::to_string(a->spec.frozen_bits)},
                {"--lora-targets", a->lora_targets}};
            for (const auto& [flag, value] : lora_flags)
                if (check.given(flag))
                    fail("{} {} asks for LoRA, which --no-lora turns off: drop one of them", flag,
                         value);
        }
        check.positive("--gpus", a->gpus);
        check.positive("--nodes", a->nodes);
        check.positive("--global-batch", a->spec.global_batch);
        check.positive("--seq", a->spec.seq);
        check.at_least("--top", a->top, 0);
        check.at_least("--reasons", a->reasons, 0);
        check.at_least("--reserve-gb", a->reserve_gb, 0.0);
        if (check.given("--fragmentation") &&
            !(a->spec.fragmentation >= 0 && a->spec.fragmentation < 1))
            fail("--fragmentation must be a fraction in [0, 1), got {}", a->spec.fragmentation);
        check.at_least("--gpus-per-node", a->gpu.gpus_per_node, 1);
        ModelSpec m = load_model(a->model);
        int gpus = a->gpus;
        if (a->nodes > 0) {
            if (gpus > 0 && gpus != a->nodes * a->gpu.gpus_per_node)
                fail("--gpus {} disagrees with --nodes {} x {} GPUs per node", gpus, a->nodes,
                     a->gpu.gpus_per_node);
            gpus = a->nodes * a->gpu.gpus_per_node;
        }
        if (gpus <= 0) fail("give the cluster size with --gpus N (at least 1) or --nodes N");
        SearchSpec s = a->spec;
        s.precision = parse_precision(a->precision, &s.fp32_master);
        const ClusterSpec c =
            make_cluster(a->gpu, cmd, gpus, {s.precision == Precision::fp32, !a->no_offload});
        const std::string precision_note =
            fit_precision_to_gpu(c.gpu, cmd, &s.precision, &s.fp32_master);
        s.optimizer = parse_optimizer(a->optimizer);
        s.state_format = state_format_flag(a->state_format);
        if (!s.fp32_master && !check.given("--state-format")) s.state_format = StateFormat::Bf16;
        s.state_fallback = !check.given("--state-format");
        s.flash_attention = !a->no_flash;
        s.allow_offload = !a->no_offload;
        s.reserve_bytes = static_cast<int64_t>(a->reserve_gb * 1e9);
        s.lora_targets = parse_lora_targets(a->lora_targets);
        s.lora_fallback = !a->no_lora;
        s.runtime = parse_runtime(a->runtime);
        if (s.runtime != Runtime::memtrain && !a->emit.empty())
            fail(
                "--emit-config writes memtrain's config; --runtime {} prices another runtime "
                "(drop one of them)",
                a->runtime);
        SearchResult r = search_plans(m, c, s);
        // Parameter offload ranks after every plan the trainer runs: first only when nothing
        // the trainer runs fits.
        const bool runnable = !r.plans.empty() && trainer_runs(r.plans[0].run);
        if (!a->svg.empty()) write_file(a->svg, memory_svg(r, a->top, c.gpu.memory_bytes));
        if (!a->emit.empty()) {
            if (!runnable)
                fail("no plan the trainer runs fits, so there is no config to write to {}",
                     a->emit);
            // A memtrain TOML is the source of every key the plan does not decide.
            std::optional<RunConfig> source;
            if (a->model.ends_with(".toml")) source = read_run_config(a->model, {});
            write_file(a->emit, emit_config_toml(m, r.plans[0], source ? &*source : nullptr));
        }
        // Nothing fits: the table still says why (and how close each layout came), and the exit
        // code says it to a script.
        const int code = runnable ? 0 : 1;
        if (a->json) {
            nlohmann::json j = to_json(r, a->top);
            j["host_memory_bytes"] = c.host_memory();
            j["host_memory_default"] = !check.given("--host-mem-gb");
            j["precision"] = precision_label(s.precision, s.fp32_master);
            std::printf("%s\n", j.dump(2).c_str());
            if (code) throw ExitCode{code};
            return;
        }
        std::printf("%s: %.3fB parameters on %d x %s (%.0f GB), global batch %d x %d tokens\n",
                    m.name.c_str(), m.total_params() / 1e9, gpus, c.gpu.name.c_str(),
                    c.gpu.memory_bytes / 1e9, s.global_batch > 0 ? s.global_batch : 1024,
                    s.seq > 0 ? s.seq : m.block_size);
        if (!precision_note.empty()) std::printf("%s\n", precision_note.c_str());
        std::printf("%s\n\n", host_memory_line(c, cmd).c_str());
        std::printf("%s", format_plans(r, a->top, a->reasons, c).c_str());
        if (!a->emit.empty()) std::printf("\nwrote %s\n", a->emit.c_str());
        if (!a->svg.empty()) std::printf("wrote %s\n", a->svg.c_str());
        if (code) {
            std::fflush(stdout);
            std::fprintf(stderr,
                         "memtrain: no layout of %s that the trainer runs fits %d x %s (exit 1)\n",
                         m.name.c_str(), gpus, c.gpu.name.c_str());
            throw ExitCode{code};
        }
    });
}

void register_scale(CLI::App& app) {
    auto* cmd = app.add_subcommand("scale", "compute-optimal model size (Chinchilla, Kaplan)");
    struct Args {
        double flops = 0, days = 0, assumed_mfu = 0.4;
        int gpus = 0, seq = 2048, global_batch = 0;
        GpuArgs gpu;
        std::vector<std::string> fit;
        bool json = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("--flops", a->flops, "compute budget C in FLOPs (e.g. 1e23)");
    cmd->add_option("--fit", a->fit,
                    "fit L(N, D) to these finished run directories (memtrain sweep makes them) "
                    "and give the optimum at --flops (default: their largest budget)");
    cmd->add_flag("--json", a->json, "with --fit: print the fit as JSON");
    cmd->add_option("--gpus", a->gpus, "cluster size (with --days: derives C; times the run)");
    cmd->add_option("--days", a->days, "wall-clock budget in days");
    cmd->add_option("--mfu", a->assumed_mfu, "MFU assumed to turn GPU-days into FLOPs");
    cmd->add_option("--seq", a->seq, "sequence length for the timed plan");
    cmd->add_option("--global-batch", a->global_batch, "sequences per step for the timed plan");
    add_gpu_flags(cmd, a->gpu);
    cmd->callback([a, cmd]() {
        const FlagCheck check(cmd);
        check.positive("--flops", a->flops);
        check.positive("--gpus", a->gpus);
        check.positive("--days", a->days);
        check.fraction("--mfu", a->assumed_mfu);
        check.positive("--seq", a->seq);
        check.positive("--global-batch", a->global_batch);
        if (!a->fit.empty()) {
            if (a->gpus > 0 || a->days > 0)
                fail(
                    "--fit fits your runs' law: give it --flops C (or nothing), not --gpus/--days");
            scale_fit(a->fit, a->flops, a->json);
            return;
        }
        if (a->json) fail("--json goes with --fit RUN_DIR...");
        if (a->flops > 0 && a->days > 0)
            fail(
                "--flops {:g} and --days {:g} both set the compute budget: give --flops C, or "
                "--gpus N --days D (and --gpu) to derive it (--gpus alone with --flops times the "
                "run)",
                a->flops, a->days);
        double C = a->flops;
        ClusterSpec c;
        check_gpu_flags(a->gpu, cmd);
        if (a->gpus > 0) c = make_cluster(a->gpu, cmd, a->gpus, {false, true});
        if (C <= 0) {
            if (a->gpus <= 0 || a->days <= 0)
                fail("give --flops C, or --gpus N --days D (and --gpu) to derive it");
            C = a->gpus * c.gpu.peak_flops * a->assumed_mfu * a->days * 86400.0;
            std::printf("budget: %d x %s x %.1f days at %.0f%% MFU = %.3g FLOPs\n", a->gpus,
                        c.gpu.name.c_str(), a->days, a->assumed_mfu * 100, C);
        }
        Allocation opt = chinchilla_optimal(C), rule = chinchilla_20x(C), kap = kaplan_optimal(C);
        std::printf("compute C = %.3g FLOPs (C = 6 N D)\n\n", C);
        std::printf("%-34s %12s %14s %10s\n", "allocation", "params N", "tokens D", "loss");
        std::printf("%-34s %11.1fB %13.0fB %10.3f\n", "Chinchilla fit (closed form)",
                    opt.params / 1e9, opt.tokens / 1e9, opt.loss);
        std::printf("%-34s %11.1fB %13.0fB %10.3f\n", "Chinchilla rule D = 20 N", rule.params / 1e9,
                    rule.tokens / 1e9, rule.loss);
        std::printf("%-34s %11.1fB %13.0fB %10.3f\n", "Kaplan 2020 (N ~ C^0.73)", kap.params / 1e9,
                    kap.tokens / 1e9, kap.loss);
        std::printf("loss: Chinchilla fit L = 1.69 + 406.4/N^0.34 + 410.7/D^0.28\n");
        if (a->gpus <= 0) return;
        ModelSpec m = shape_for_params(rule.params, a->seq);
        SearchSpec s;
        s.seq = a->seq;
        s.global_batch =
            a->global_batch > 0 ? a->global_batch : std::max(a->gpus, 4 * 1024 * 1024 / a->seq);
        SearchResult r = search_plans(m, c, s);
        std::printf("\nshape for the D = 20 N model: %d layers, d=%d, %d heads (%.3gB params)\n",
                    m.n_layer, m.n_embd, m.n_head, m.total_params() / 1e9);
        if (r.plans.empty()) {
            std::printf("no layout fits on %d x %s; the planner says:\n%s", a->gpus,
                        c.gpu.name.c_str(), format_plans(r, 0, 5, c).c_str());
            return;
        }
        const Plan& best = r.plans[0];
        double days = rule.tokens / best.time.tokens_per_s / 86400.0;
        std::printf("best plan: %s, %.0f tokens/s, MFU %.1f%%\n", describe(best.run).c_str(),
                    best.time.tokens_per_s, best.time.mfu * 100);
        std::printf("training %.3gB tokens takes %.1f days on %d x %s\n", rule.tokens / 1e9, days,
                    a->gpus, c.gpu.name.c_str());
    });
}

}  // namespace

void register_plan(CLI::App& app) {
    register_estimate(app);
    register_plan_cmd(app);
    register_scale(app);
}

}  // namespace memtrain::cli
