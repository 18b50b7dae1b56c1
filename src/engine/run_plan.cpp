// The run plan's names and descriptions (see run_plan.h).
#include "engine/run_plan.h"

#include <fmt/format.h>

#include "core/error.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain {

const char* engine_name(EngineKind k) {
    switch (k) {
        case EngineKind::Cpu:
            return "cpu";
        case EngineKind::Lora:
            return "cpu lora";
        case EngineKind::TensorParallel:
            return "cpu tensor parallel";
        case EngineKind::Mesh:
            return "cpu pipeline";
        case EngineKind::ParameterServer:
            return "cpu parameter server";
        case EngineKind::Cuda:
            return "cuda";
        case EngineKind::CudaLora:
            return "cuda lora";
        case EngineKind::CudaPipeline:
            return "cuda pipeline";
    }
    return "?";
}

void validate_cuda_pipeline(const RunConfig& cfg) {
    const pp::Kind kind = pp::parse_kind(cfg.train.pp_schedule);
    // What the GPU pipeline (engine/cuda/cuda_pipeline_engine.cpp) is built for so far.
    if (kind != pp::Kind::Naive && kind != pp::Kind::GPipe && kind != pp::Kind::OneFOneB)
        fail(
            "train.pp_schedule = \"{}\" runs on the CPU engine only so far; on the GPU choose "
            "naive, gpipe or 1f1b (or set train.device = \"cpu\")",
            cfg.train.pp_schedule);
    if (cfg.dp() > 1 && cfg.train.zero_stage > 0)
        fail(
            "train.zero_stage = {} across {} GPU pipelines: the GPU all-reduces each stage's "
            "gradients across them (ZeRO stage 0); ZeRO-1 across pipelines runs on the CPU engine "
            "(or set train.zero_stage = 0)",
            cfg.train.zero_stage, cfg.dp());
    if (cfg.train.offload_optimizer || cfg.train.cuda_graphs)
        fail("train.{} is not built for pipeline stages on the GPU: set it to false",
             cfg.train.offload_optimizer ? "offload_optimizer" : "cuda_graphs");
    if (cfg.train.remat.find("offload") != std::string::npos)
        fail(
            "train.remat = \"{}\" offloads block inputs, which is not built for pipeline stages "
            "on the GPU: choose none, selective, full or a budget without +offload",
            cfg.train.remat);
}

EngineKind engine_kind(const RunConfig& cfg) {
    const bool gpu = cfg.train.device == "cuda";
    if (!gpu && cfg.train.device != "cpu")
        fail("internal: train.device '{}' was not resolved to cpu or cuda", cfg.train.device);
    if (cfg.ps()) {
        if (gpu)
            fail(
                "train.dp_mode = \"ps\" runs on the CPU engine only so far, not on cuda: set "
                "train.device = \"cpu\"");
        return EngineKind::ParameterServer;
    }
    if (cfg.train.tp > 1 && gpu)
        fail(
            "train.tp = {} runs on the CPU engine only so far, not on cuda: set train.device = "
            "\"cpu\"",
            cfg.train.tp);
    if (cfg.train.pp > 1) {
        if (gpu) {
            validate_cuda_pipeline(cfg);
            return EngineKind::CudaPipeline;
        }
        return EngineKind::Mesh;
    }
    // Tensor parallelism alone, or with data parallelism: the mesh's engine (a pipeline of one
    // stage per tensor-parallel group) where there are several groups.
    if (cfg.train.tp > 1) return cfg.dp() > 1 ? EngineKind::Mesh : EngineKind::TensorParallel;
    if (cfg.lora.enabled()) return gpu ? EngineKind::CudaLora : EngineKind::Lora;
    return gpu ? EngineKind::Cuda : EngineKind::Cpu;
}

bool on_gpu(EngineKind k) {
    return k == EngineKind::Cuda || k == EngineKind::CudaLora || k == EngineKind::CudaPipeline;
}

Precision resolved_precision(const std::string& name) {
    if (const auto p = find_precision(name)) return *p;
    fail("internal: precision \"{}\" was not resolved to fp32, bf16 or fp16", name);
}

int RunPlan::dp_rank() const {
    if (ps_servers > 0) return rank < mesh.dp ? rank : 0;
    return mesh.replica_of(rank);
}

bool RunPlan::loss_is_global() const {
    return world == 1 || mesh.pp > 1 || mesh.tp > 1 || ps_servers > 0;
}

std::string RunPlan::describe() const {
    return fmt::format("{}, tp {} x pp {} x dp {}, {}, {}", engine_name(engine), mesh.tp, mesh.pp,
                       mesh.dp, dist::describe(states), precision_name(precision));
}

std::string RunPlan::summary() const {
    std::size_t total = 0;
    for (const MemoryPrediction& m : memory) total += m.bytes;
    return fmt::format(
        "{} | tp {} x pp {} x dp {} | ZeRO-{} | {} | remat {} | {}", engine_name(engine), mesh.tp,
        mesh.pp, mesh.dp, zero_stage, precision_name(precision), cfg.train.remat,
        memory.empty() ? std::string("memory sized once built")
                       : fmt::format("{:.1f} MiB on the {} per rank", total / 1048576.0,
                                     memory_on == MemoryOn::Host ? "host" : "GPU"));
}

std::string RunPlan::table() const {
    std::string out;
    auto row = [&](const char* key, const std::string& value) {
        out += fmt::format("  {:<18} {}\n", key, value);
    };
    row("engine", engine_name(engine));
    row("rank", fmt::format("{} of {}", rank, world));
    row("mesh", fmt::format("tp {} x pp {} x dp {}{}", mesh.tp, mesh.pp, mesh.dp,
                            ps_servers > 0 ? fmt::format(" + {} parameter servers", ps_servers)
                                           : std::string()));
    if (ps_servers > 0) row("staleness", std::to_string(ps_staleness));
    row("model states", fmt::format("ZeRO stage {}: {}", zero_stage, dist::describe(states)));
    if (gpu()) row("collectives", collective ? "NCCL between the launched ranks" : "none");
    row("precision", precision_name(precision));
    if (!gpu()) row("saved activations", saved_store_name(format.saved));
    if (mesh.pp > 1)
        row("pipeline",
            fmt::format("{}{}", pp::kind_name(schedule),
                        virtual_stages > 1 ? fmt::format(", {} chunks per rank", virtual_stages)
                                           : std::string()));
    if (mesh.tp > 1) row("sequence parallel", sequence_parallel ? "yes" : "no");
    if (lora)
        row("lora", fmt::format("rank {}, base {}", cfg.lora.rank,
                                lora_base ? lora_base->name() : std::string("fp32")));
    std::string keeps;
    for (BlockKeep k : remat.plan) keeps += keep_letter(k);
    row("remat", fmt::format("{}: blocks keep [{}], peak {:.1f} MiB", cfg.train.remat, keeps,
                             remat.peak_bytes / 1048576.0));
    std::size_t total = 0;
    for (const MemoryPrediction& m : memory) {
        row(std::string(category_name(m.category)).c_str(),
            fmt::format("{:.1f} MiB  {}", m.bytes / 1048576.0, m.formula));
        total += m.bytes;
    }
    row(memory_on == MemoryOn::Host ? "host total" : "device total",
        memory.empty() ? std::string("sized once built")
                       : fmt::format("{:.1f} MiB", total / 1048576.0));
    return out;
}

}  // namespace memtrain
