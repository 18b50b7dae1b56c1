// The CPU engines' memory predicted before allocation (see host_memory.h).
#include "engine/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/error.h"
#include "engine/run_plan.h"
#include "model/gpt.h"
#include "model/lora.h"
#include "parallel/data/zero_store.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_split.h"
#include "parallel/pipeline/weight_versions.h"
#include "parallel/placement.h"
#include "parallel/ps/param_server.h"
#include "parallel/tensor/tp.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "quant/quantized_store.h"
#include "remat/policy.h"

namespace memtrain {

std::string host_rss_line() {
    return fmt::format(
        "{:<16} {:>12}  (everything the OS charged: code, libraries, loaders, allocator slack)\n",
        "process peak RSS", fmt::format("{:.1f} MiB", process_peak_rss() / 1048576.0));
}

std::vector<MemoryPrediction> zero_state_rows(const RunConfig& cfg, const ParamLayout& layout,
                                              int world, int rank, const std::string& what,
                                              bool tied_grads) {
    // Model states per rank under ZeRO (parallel/placement.h, as ZeroStore allocates them): a shard
    // (this rank's count of the balanced layout, Ψ/N rounded to the state format's grain) where
    // the stage shards that state, Ψ otherwise.
    const dist::ShardSpec spec = dist::shard_spec(cfg.train.zero_stage);
    const std::size_t psi = layout.total;
    const dist::ShardRange mine =
        dist::grain_shard_ranges(0, (int64_t)psi, world, (int64_t)shard_grain(cfg.optim)).at(rank);
    const std::size_t shard = (std::size_t)mine.count;
    auto n = [&](dist::Placement p) {
        return (std::size_t)dist::held(p, (int64_t)psi, (int64_t)shard);
    };
    auto per = [&](dist::Placement p) {
        return world > 1 && dist::sharded(p) ? fmt::format(" / {} ranks", world) : std::string();
    };
    const bool sharded_state = dist::sharded(spec.optimizer);
    MemoryPrediction grads{MemCategory::Gradients,
                           fmt::format("4 x {}{} (fp32)", what, per(spec.grads)),
                           4 * n(spec.grads)};
    if (cfg.no_grad_buffer()) {
        // No gradient buffer: each unit's, while backward fills it (dist::ZeroStore); under
        // ZeRO 2-3 those buckets are the communication ones the two-phase step also fills.
        const bool tied = tied_grads && cfg.model.tied_embeddings;
        if (cfg.train.zero_stage >= 2)
            grads = {MemCategory::Gradients, "none: no shard, step in backward", 0};
        else
            grads = {MemCategory::Gradients,
                     tied ? std::string("4 x (embedding unit + largest other unit), step in "
                                        "backward")
                          : std::string("4 x largest unit, step in backward"),
                     4 * step_in_backward_grad_floats(layout, tied)};
    }
    MemoryPrediction params{MemCategory::Parameters,
                            fmt::format("4 x {}{} (fp32)", what, per(spec.params)),
                            4 * n(spec.params)};
    if (cfg.optim.master == "none") {
        // bf16 weights, each unit decoded while in use, and the update's scratch
        // (dist::ZeroStore::Options::bf16_params); at stage 3 this rank's shard of them, the
        // units decoded into their gathers (communication buffers, as fp32's).
        const std::size_t scratch =
            dist::ZeroStore::round_scratch_floats(layout, whole_step_tensors(cfg.optim, layout));
        const bool sharded = dist::sharded(spec.params);
        params = {MemCategory::Parameters,
                  sharded ? fmt::format("2 x {}{} (bf16) + 4 x {} update scratch", what,
                                        per(spec.params), scratch)
                          : fmt::format("2 x {} (bf16) + 4 x decoded units + 4 x {} update scratch",
                                        what, scratch),
                  sharded ? 2 * n(spec.params) + 4 * scratch
                          : 2 * psi + 4 * (decoded_unit_floats(
                                               layout, tied_grads && cfg.model.tied_embeddings) +
                                           scratch)};
    }
    return {
        params,
        grads,
        {MemCategory::OptimizerState,
         fmt::format("{}{} ({})", what, per(spec.optimizer), describe_optimizer_state(cfg.optim)),
         optimizer_state_bytes(cfg.optim, layout, sharded_state ? (std::size_t)mine.offset : 0,
                               n(spec.optimizer))},
    };
}

namespace {

// A number from a /proc or /sys file's first token after `key` (key empty: the first token).
std::size_t read_number(const std::string& path, const std::string& key, std::size_t scale) {
    std::ifstream f(path);
    std::string k;
    while (f >> k) {
        if (key.empty() || k == key) {
            std::string v;
            if (key.empty())
                v = k;
            else
                f >> v;
            if (v == "max") return std::numeric_limits<std::size_t>::max();
            try {
                return (std::size_t)std::stoull(v) * scale;
            } catch (const std::exception&) {
                return std::numeric_limits<std::size_t>::max();
            }
        }
    }
    return std::numeric_limits<std::size_t>::max();
}

}  // namespace

// A tensor-parallel rank (tensor parallelism alone, engine/cpu/cpu_engine.h): the model states of
// its shard (the whole tensors plus 1/T of the cut ones), the arenas of the shard's config, and the
// buffers that gather the shards for checkpoints (a unit, or the optimizer state, from every rank).
static std::vector<MemoryPrediction> predict_tp_memory(const RunConfig& cfg, const RematPlan& plan,
                                                       int rank, int B, int T) {
    const int tp = cfg.train.tp;
    const dist::TpLayout tl = dist::make_tp_layout(cfg.model, tp, rank);
    const ModelConfig shard = dist::tp_shard_config(cfg.model, tp, cfg.train.sequence_parallel);
    const std::size_t whole = tl.replicated_floats();
    auto rows = zero_state_rows(
        cfg, tl.local, 1, 0,
        fmt::format("(whole {} + cut {} / {}) params", whole, tl.full.total - whole, tp));
    const auto arena = activation_layout(shard, B, T, plan, cpu_arena_format(shard));
    rows.push_back({MemCategory::Activations,
                    fmt::format("activation_layout(shard{}, B, T, remat={})",
                                cfg.train.sequence_parallel ? " with sequence parallelism" : "",
                                cfg.train.remat),
                    arena_bytes(arena, MemCategory::Activations)});
    rows.push_back({MemCategory::Workspace, "activation_layout(shard, B, T)",
                    arena_bytes(arena, MemCategory::Workspace)});
    // Checkpoints (TpRangeOptimizer::read_state, TpWholeWeights) over the whole model's units.
    rows.push_back(
        {MemCategory::Communication,
         fmt::format("checkpoint gathers: max((1 + {}) x Ψ_shard, a unit + its {} pieces)", tp, tp),
         tp_gather_bytes(tl.full, tl.local, {{0, (int)tl.local.units.size() - 1}}, tp)});
    return rows;
}

std::vector<MemoryPrediction> predict_cpu_memory(const RunConfig& cfg, const RematPlan& plan,
                                                 int rank, int B, int T) {
    if (cfg.train.device != "cpu") return {};
    switch (engine_kind(cfg)) {
        case EngineKind::TensorParallel:
            return predict_tp_memory(cfg, plan, rank, B, T);
        case EngineKind::Cpu:
        case EngineKind::Lora:
            break;
        default:  // a pipeline stage or a parameter server (predict_host_memory)
            return {};
    }
    const ParamLayout layout = make_param_layout(cfg.model);
    const auto arena = activation_layout(cfg.model, B, T, plan, cpu_arena_format(cfg.model));
    std::vector<MemoryPrediction> rows;
    std::string ws_formula = "activation_layout(B, T)";
    std::size_t ws_extra = 0;
    if (!cfg.lora.enabled()) {
        rows = zero_state_rows(cfg, layout, cfg.world, rank, "params");
    } else {
        // The adapters' states as any ZeroStore's; the frozen base beside their parameters.
        const LoraLayout ll = make_lora_layout(cfg.model, cfg.lora);
        rows = zero_state_rows(cfg, ll.params, cfg.world, rank, "adapters", false);
        std::size_t base = sizeof(float) * layout.total;
        std::string base_formula = fmt::format("4 x {} (fp32)", layout.total);
        if (cfg.lora.base != "fp32") {
            const quant::BaseQuant q = quant::lora_base_quant(cfg.lora);
            const quant::BaseBytes bb = quant::QuantizedParamStore::predicted_bytes(cfg.model, q);
            base = bb.params();
            base_formula = q.name() + " packed + fp32 rest";
            ws_extra += bb.slots;
            ws_formula += " + 2 decoded blocks (fp32)";
        }
        rows[0].bytes += base;
        rows[0].formula = fmt::format("base {} (frozen) + {}", base_formula, rows[0].formula);
        ws_extra += lora_workspace_bytes(cfg.lora, ll, B * T);
        ws_formula += " + LoRA h, dh (+ dropout x, dx)";
    }
    rows.push_back({MemCategory::Activations,
                    fmt::format("activation_layout(B, T, remat={})", cfg.train.remat),
                    arena_bytes(arena, MemCategory::Activations)});
    rows.push_back({MemCategory::Workspace, ws_formula,
                    arena_bytes(arena, MemCategory::Workspace) + ws_extra});
    return rows;
}

std::size_t tp_gather_bytes(const ParamLayout& full, const ParamLayout& shard,
                            const std::vector<std::pair<int, int>>& unit_ranges, int tp) {
    std::size_t floats = 0;
    for (const auto& [first, last] : unit_ranges) {
        const std::size_t n = shard.units[last].end - shard.units[first].begin;
        floats = std::max(floats, (std::size_t)(1 + tp) * n);
        for (int u = first; u <= last; u++)
            floats = std::max(floats, full.units[u].size() + tp * shard.units[u].size());
    }
    return sizeof(float) * floats;
}

std::vector<MemoryPrediction> stage_memory_rows(const RunPlan& plan, const StageFootprint& f) {
    const std::string what = describe_optimizer_state(plan.cfg.optim);
    const std::size_t stage = f.params + f.mirror;
    std::vector<MemoryPrediction> rows = {
        {MemCategory::Parameters, fmt::format("4 x stage params ({}){}", f.units, f.versions),
         4 * stage + f.version_bytes},
        {MemCategory::Gradients,
         f.piece
             ? fmt::format("4 x stage params + 4 x its 1/{} shard (reduce-scattered)", f.replicas)
             : std::string("4 x stage params"),
         4 * stage + 4 * f.reduce_buffer},
        {MemCategory::OptimizerState,
         f.piece ? fmt::format("1/{} of the stage params ({}, ZeRO-1 across pipelines)", f.replicas,
                               what)
                 : fmt::format("stage params, own units ({})", what),
         f.state_bytes},
        {MemCategory::Activations,
         fmt::format("micro-batches in flight: {}, remat={}{}", f.slots, plan.remat_policy,
                     f.split_backward ? " + output gradients kept for W" : ""),
         f.activations},
        {MemCategory::Workspace,
         f.chunks == 1
             ? std::string("activation_layout(stage blocks), shared")
             : fmt::format("activation_layout(chunk blocks), one per chunk ({})", f.chunks),
         f.workspace},
    };
    if (f.gathers > 0)
        rows.push_back({MemCategory::Communication,
                        fmt::format("checkpoint gathers: max((1 + {}) x a chunk's shard, a unit + "
                                    "its {} pieces)",
                                    f.tp, f.tp),
                        f.gathers});
    return rows;
}

StageFootprint stage_footprint(const RunPlan& plan, const RematPlan& remat, int B, int T) {
    // As CpuEngine builds the stage: the whole model's blocks split over p x v virtual stages,
    // this rank's chunks c * p + s, their units in the layout of the (tensor-parallel shard's)
    // config, a slot per micro-batch the schedule keeps in flight on the chunk.
    const ModelConfig& whole = plan.cfg.model;
    const int tp = plan.mesh.tp, p = plan.mesh.pp, v = plan.virtual_stages;
    const int s = plan.mesh.stage_of(plan.rank);
    const ModelConfig cfg =
        tp > 1 ? dist::tp_shard_config(whole, tp, plan.sequence_parallel) : whole;
    // (A shard's tensors know their whole tensors' sizes, which the moments' rule reads.)
    const ParamLayout layout =
        tp > 1 ? dist::make_tp_layout(whole, tp, plan.mesh.shard_of(plan.rank)).local
               : make_param_layout(cfg);
    const pp::StageSplit split = pp::split_stages(whole, p * v, plan.micro_batch, plan.seq_len);
    const pp::SimResult sim = pp::simulate(pp::make_schedule(plan.schedule, p, plan.accum_steps, v),
                                           pp::StageCosts::uniform(p * v, 1, 2, 1, 1));
    StageFootprint f;
    f.chunks = v;
    f.split_backward = plan.schedule == pp::Kind::ZbH1;
    bool embedding = false;
    std::vector<std::pair<std::size_t, std::size_t>> ranges;  // each chunk's [begin, end)
    std::vector<std::pair<int, int>> unit_ranges;             // and its [first, last] unit
    for (int c = 0; c < v; c++) {
        const int vs = c * p + s, b0 = split.first_block[vs], b1 = b0 + split.blocks[vs];
        const int first = b0 == 0 ? ParamLayout::embedding_unit() : layout.block_unit(b0);
        const int last = b1 == whole.n_layer ? layout.head_unit() : layout.block_unit(b1 - 1);
        embedding = embedding || b0 == 0;
        f.params += layout.units[last].end - layout.units[first].begin;
        ranges.emplace_back(layout.units[first].begin, layout.units[last].end);
        unit_ranges.emplace_back(first, last);
        f.units += fmt::format("{}{}..{}", f.units.empty() ? "" : ", ", layout.units[first].name,
                               layout.units[last].name);
        const RematPlan keep = remat.empty() ? RematPlan{} : slice_plan(remat, b0, b1);
        const ArenaPlan a = plan_stage_arena(cfg, b1 - b0, B, T, keep, cpu_arena_format(cfg));
        const int slots = std::max(1, sim.peak_stage_in_flight[vs]);
        const std::size_t wgrad = f.split_backward ? split_backward_bytes(cfg, b1 - b0, B, T) : 0;
        f.activations += (std::size_t)slots * (a.activation_bytes + wgrad);
        f.workspace += a.workspace_bytes;
        f.slots += fmt::format("{}{} x activation_layout(blocks {}..{})",
                               f.slots.empty() ? "" : " + ", slots, b0, b1 - 1);
    }
    if (s == p - 1 && whole.tied_embeddings && !embedding) {
        f.mirror = layout.units[ParamLayout::embedding_unit()].size();
        f.units += " + a copy of wte";
    }
    f.version_bytes =
        sizeof(float) * pp::weight_version_floats(plan.schedule, p, s, f.params, f.mirror);
    f.versions = pp::weight_version_formula(plan.schedule, p, s);
    f.replicas = plan.mesh.dp;
    f.piece = f.replicas > 1 && dist::sharded(plan.states.optimizer);
    // ZeRO-1 across pipelines: this replica's piece of the (one) chunk, as ReplicaSync cuts it.
    const int64_t grain = (int64_t)shard_grain(plan.cfg.optim);
    f.updated = 0;
    for (const auto& [b, e] : ranges) {
        dist::ShardRange own{0, (int64_t)(e - b)};
        if (f.piece)
            own = dist::grain_shard_ranges((int64_t)b, (int64_t)e, f.replicas, grain)
                      .at(plan.mesh.replica_of(plan.rank));
        f.updated += (std::size_t)own.count;
        f.state_bytes += optimizer_state_bytes(plan.cfg.optim, layout, b + (std::size_t)own.offset,
                                               (std::size_t)own.count);
    }
    f.reduce_buffer = f.piece ? f.updated : 0;
    f.tp = tp;
    if (tp > 1) f.gathers = tp_gather_bytes(make_param_layout(whole), layout, unit_ranges, tp);
    return f;
}

std::vector<MemoryPrediction> ps_memory_rows(const RunPlan& plan, const RematPlan& remat,
                                             bool server, std::size_t server_floats, int B, int T) {
    const int k = plan.cfg.optim.name == "adamw" ? 8 : 4;
    if (server) {
        const std::size_t own = server_floats;
        const std::size_t copies = plan.ps_staleness > 0 ? (std::size_t)plan.ps_staleness + 1 : 0;
        return {
            {MemCategory::Parameters, "4 x server params (its units)", 4 * own},
            {MemCategory::Gradients, "4 x server params (sum of the pushes)", 4 * own},
            {MemCategory::OptimizerState,
             fmt::format("{} x server params ({})", k, k == 8 ? "Adam m, v" : "momentum"),
             (std::size_t)k * own},
            {MemCategory::Communication,
             fmt::format("4 x server params x (1 push buffer + {} published versions)", copies),
             4 * own * (1 + copies)},
        };
    }
    const std::size_t psi = make_param_layout(plan.cfg.model).total;
    const auto lay =
        activation_layout(plan.cfg.model, B, T, remat, cpu_arena_format(plan.cfg.model));
    return {
        {MemCategory::Parameters, "4 x params (a whole replica)", 4 * psi},
        {MemCategory::Gradients, "4 x params", 4 * psi},
        {MemCategory::OptimizerState, "none: the servers hold it", 0},
        {MemCategory::Activations,
         fmt::format("activation_layout(B, T, remat={})", plan.remat_policy),
         arena_bytes(lay, MemCategory::Activations)},
        {MemCategory::Workspace, "activation_layout(B, T)",
         arena_bytes(lay, MemCategory::Workspace)},
    };
}

std::vector<MemoryPrediction> predict_host_memory(const RunPlan& plan, const RematPlan& remat,
                                                  int B, int T) {
    switch (plan.engine) {
        case EngineKind::Cpu:
        case EngineKind::Lora:
        case EngineKind::TensorParallel:
            return predict_cpu_memory(plan.cfg, remat, plan.rank, B, T);
        case EngineKind::Mesh:
            return stage_memory_rows(plan, stage_footprint(plan, remat, B, T));
        case EngineKind::ParameterServer: {
            // The last ps_servers ranks are servers, each a contiguous run of units.
            const int workers = plan.mesh.dp;
            if (plan.rank < workers) return ps_memory_rows(plan, remat, false, 0, B, T);
            const dist::ServerSplit split =
                dist::split_servers(make_param_layout(plan.cfg.model), plan.ps_servers);
            return ps_memory_rows(plan, remat, true, split.count(plan.rank - workers), B, T);
        }
        default:  // the GPU (engine/device_memory.h)
            return {};
    }
}

plan::RunSpec planner_run_spec(const RunConfig& cfg, const ActFormat& format) {
    plan::RunSpec rs;
    rs.precision = plan::parse_precision(cfg.train.precision, &rs.fp32_master);
    // The CPU engine stores everything in fp32 at either precision; bf16 rounds GEMM operands
    // only, in a workspace region of the arena (ActFormat::bf16_gemm).
    if (!format.cuda) rs.precision = Precision::fp32;
    rs.cpu_bf16 = format.bf16_gemm;
    rs.cpu_saved = format.saved;
    rs.optimizer = cfg.optim.name == "sgd"         ? plan::Optimizer::sgd
                   : cfg.optim.name == "muon"      ? plan::Optimizer::muon
                   : cfg.optim.name == "adafactor" ? plan::Optimizer::adafactor
                                                   : plan::Optimizer::adamw;
    rs.state_format = parse_state_format(cfg.optim.state_format);
    rs.step_in_backward = cfg.optim.step_in_backward;
    rs.device_optimizer = format.cuda && !cfg.train.offload_optimizer;
    if (cfg.optim.master == "none") rs.fp32_master = false;
    rs.micro_batch = cfg.micro_batch();
    rs.seq = cfg.train.seq_len;
    rs.micro_batches = cfg.accum_steps();
    rs.dp = cfg.dp();
    rs.tp = cfg.train.tp;
    rs.pp = cfg.train.pp;
    rs.sequence_parallel = cfg.train.sequence_parallel;
    // The schedules the planner knows; the others (naive, PipeDream) are priced as 1F1B.
    const std::string& sched = cfg.train.pp_schedule;
    if (sched == "gpipe" || sched == "1f1b" || sched == "zb-h1")
        rs.schedule = plan::parse_schedule(sched);
    if (sched == "interleaved" && cfg.train.pp_virtual > 1) {
        rs.schedule = pp::Kind::Interleaved;
        rs.virtual_stages = cfg.train.pp_virtual;
    }
    rs.zero = cfg.train.zero_stage;
    rs.offload = cfg.train.offload_optimizer ? plan::Offload::optimizer : plan::Offload::none;
    rs.flash_attention = format.cuda;
    rs.lse_attention = format.fused_attention && !format.cuda;
    rs.fragmentation = 0;
    rs.reserve_bytes = 0;
    const std::string& rp = cfg.train.remat;
    if (rp == "selective" || rp == "full") rs.recompute = plan::parse_recompute(rp);
    if (cfg.lora.enabled()) {
        rs.lora_rank = cfg.lora.rank;
        rs.frozen_bits = cfg.lora.base == "int8" ? 8 : cfg.lora.base == "fp32" ? 16 : 4;
        rs.lora_targets =
            cfg.lora.targets == "all" ? plan::LoraTargets::all : plan::LoraTargets::attn;
    }
    return rs;
}

plan::RankCoord planner_rank(const RunConfig& cfg, int rank) {
    // The mesh's order (parallel/mesh.h): rank = (replica x pp + stage) x tp + shard.
    const dist::MeshLayout mesh{std::max(1, cfg.train.pp), 1, std::max(1, cfg.train.tp)};
    return plan::RankCoord{mesh.stage_of(rank), mesh.replica_of(rank)};
}

std::size_t host_available_bytes() {
    if (const char* e = std::getenv("MEMTRAIN_HOST_MEMORY")) {
        try {
            return remat::parse_bytes(e);
        } catch (const Error&) {
            fail("MEMTRAIN_HOST_MEMORY = '{}': expected bytes, e.g. 8GiB", e);
        }
    }
    std::size_t avail = read_number("/proc/meminfo", "MemAvailable:", 1024);
    // A cgroup v2 limit (containers, Slurm) caps what this process may take.
    const std::size_t limit = read_number("/sys/fs/cgroup/memory.max", "", 1);
    const std::size_t used = read_number("/sys/fs/cgroup/memory.current", "", 1);
    if (limit != std::numeric_limits<std::size_t>::max() && used <= limit)
        avail = std::min(avail, limit - used);
    return avail;
}

std::vector<MemoryPrediction> predict_pipeline_memory(const RunConfig& cfg, int rank) {
    // The mesh's engine: pipelines, and tensor-parallel groups side by side (pp = 1).
    if (cfg.train.device != "cpu" || engine_kind(cfg) != EngineKind::Mesh || cfg.lora.enabled())
        return {};
    // What the planner prices as the executor allocates: the synchronous schedules' slots (not
    // naive's one, nor PipeDream's weight versions) and the whole-model remat policies.
    const std::string &sched = cfg.train.pp_schedule, &remat = cfg.train.remat;
    if (sched != "gpipe" && sched != "1f1b" && sched != "zb-h1" && sched != "interleaved")
        return {};
    if (remat != "none" && remat != "selective" && remat != "full") return {};
    const plan::MemoryEstimate est = plan::estimate_rank_memory(
        plan::model_from_config(cfg.model), planner_run_spec(cfg, cpu_arena_format(cfg.model)),
        planner_rank(cfg, rank));
    if (!est.engine_layout) return {};
    std::vector<MemoryPrediction> rows;
    const struct {
        MemCategory category;
        const char* line;
    } lines[] = {{MemCategory::Parameters, "parameters"},
                 {MemCategory::Gradients, "gradients"},
                 {MemCategory::OptimizerState, "optimizer states"},
                 {MemCategory::Activations, "activations"}};
    for (const auto& l : lines)
        rows.push_back({l.category, fmt::format("estimate_rank_memory: {}", l.line),
                        (std::size_t)est.bytes(l.line)});
    // The engine keeps ZB-H1's deferred output gradients among its activations.
    rows.back().bytes += (std::size_t)est.bytes("zero-bubble W gradients");
    return rows;
}

void check_host_fit(const RunPlan& plan, int ranks_on_node) {
    const std::vector<MemoryPrediction>& rows = plan.memory;
    if (rows.empty()) return;
    const std::size_t per_rank = predicted_total(rows),
                      need = per_rank * (std::size_t)ranks_on_node;
    const std::size_t avail = host_available_bytes();
    if (need <= avail) return;
    std::string parts;
    for (const auto& r : rows)
        parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", category_name(r.category),
                             gib(r.bytes));
    const std::string node = ranks_on_node > 1 ? fmt::format(", {} for the {} ranks on this node,",
                                                             gib(need), ranks_on_node)
                                               : std::string(",");
    const char* env = std::getenv("MEMTRAIN_HOST_MEMORY") ? " (MEMTRAIN_HOST_MEMORY)" : "";
    if (plan.engine == EngineKind::Mesh)
        fail(
            "this run needs {} of host memory per rank on pipeline stage {} ({}){} but {} is "
            "available{}: it would fail while allocating. More stages (train.pp), a smaller "
            "train.micro_batch_size or train.remat = \"full\" need less per rank",
            gib(per_rank), plan.mesh.stage_of(plan.rank), parts, node, gib(avail), env);
    // What would change it: the activations at one sequence per micro-batch and full remat, and
    // the model states sharded over more ranks or left to adapters.
    const int T = plan.seq_len;
    const RematPlan full = remat::solve_policy(remat::parse_policy("full"), plan.cfg.model, 1, T,
                                               nullptr, cpu_arena_format(plan.cfg.model))
                               .plan;
    const std::size_t smallest = predicted_total(predict_host_memory(plan, full, 1, T));
    std::string would = fmt::format(
        "train.micro_batch_size = 1 with train.remat = \"full\" needs {} per rank", gib(smallest));
    if (smallest > avail / (std::size_t)ranks_on_node)
        would +=
            plan.lora ? "; a smaller model or more memory is needed"
            : plan.engine != EngineKind::ParameterServer
                ? "; model states need ZeRO over more nodes, or LoRA (lora.rank) to train adapters "
                  "only"
            : plan.rank < plan.mesh.dp
                ? "; a parameter-server worker holds the whole model: a smaller model or more "
                  "memory is needed"
                : "; more parameter servers (train.ps_servers) hold fewer units each";
    fail(
        "this run needs {} of host memory per rank ({}){} but {} is available{}: it would fail "
        "while allocating. {}",
        gib(per_rank), parts, node, gib(avail), env, would);
}

}  // namespace memtrain
