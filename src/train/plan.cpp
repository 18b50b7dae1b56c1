// The plan step (see plan.h).
#include "train/plan.h"

#include "train/validate.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "engine/device_memory.h"
#include "engine/host_memory.h"
#include "model/gpt.h"
#include "parallel/pipeline/stage_split.h"
#include "parallel/tensor/tp.h"
#include "remat/policy.h"
#include "remat/profile.h"

namespace memtrain {

namespace {

// The model whose arenas a rank allocates: under tensor parallelism its shard's
// (sequence-parallel when the run is), so that a schedule, its budget and its recompute are
// priced in the rank's own bytes and FLOPs.
ModelConfig rank_model(const ModelConfig& whole, const RunPlan& p) {
    return p.mesh.tp > 1 ? dist::tp_shard_config(whole, p.mesh.tp, p.sequence_parallel) : whole;
}

// The run's remat schedule for the whole model. A pipeline's policies that rebuild block inputs
// (memory-poor, chen:K, revolve:S) apply to each chunk of blocks on its own, as the chunk's
// engine runs it: the chunk's first input arrives from the stage before and stays, and every
// rebuild re-runs blocks of the chunk only. Its peak is the largest chunk's, its recompute the
// chunks' sum.
remat::Solution solve_remat(const RunConfig& cfg, const RunPlan& p,
                            const remat::BlockFlops* measured) {
    const remat::RematPolicy policy = remat::parse_policy(cfg.train.remat);
    const int B = p.micro_batch, T = p.seq_len;
    const ModelConfig model = rank_model(cfg.model, p);
    const int chunks = p.mesh.pp * std::max(1, p.virtual_stages);
    if (!policy.rebuilds_inputs() || chunks <= 1 || chunks > cfg.model.n_layer) {
        remat::Solution s = remat::solve_policy(policy, model, B, T, measured, p.format);
        // A budget below every plan that keeps the block inputs solves to one that rebuilds
        // them over the whole model, which a pipeline's chunks do not run.
        if (std::any_of(s.plan.begin(), s.plan.end(), rebuilds_input) && p.mesh.pp > 1)
            fail(
                "train.remat = {} solves to a plan that rebuilds block inputs ({} MiB of "
                "activations) across the whole model, which train.pp = {} does not run: raise "
                "the budget to at least {} MiB, the least without rebuilding, or use "
                "memory-poor, chen:K or revolve:S, which rebuild within each stage",
                cfg.train.remat, s.peak_bytes / 1048576.0, p.mesh.pp,
                (double)remat::min_feasible_bytes(remat::make_chain(model, B, T, p.format)) /
                    1048576.0);
        return s;
    }
    const pp::StageSplit split = pp::split_stages(cfg.model, chunks, B, T);
    remat::Solution whole;
    for (int c = 0; c < chunks; c++) {
        ModelConfig part = model;
        part.n_layer = split.blocks[c];
        const remat::Solution s = remat::solve_policy(policy, part, B, T, measured, p.format);
        append_plan(whole.plan, s.plan);
        whole.peak_bytes = std::max(whole.peak_bytes, s.peak_bytes);
        whole.recompute_flops += s.recompute_flops;
    }
    return whole;
}

}  // namespace

RunPlan plan_layout(const RunConfig& config, const dist::Communicator& comm,
                    const remat::BlockFlops* measured) {
    RunConfig resolved = config;
    resolve_config(resolved);
    const bool collective = resolved.train.device == "cuda" && cuda_data_parallel(resolved, comm);
    return plan_layout(config, comm.rank(), comm.size(), collective, measured);
}

RunPlan plan_layout(const RunConfig& config, int rank, int world, bool collective,
                    const remat::BlockFlops* measured) {
    RunPlan p;
    p.cfg = config;
    resolve_config(p.cfg);  // (a no-op for the Trainer's config, resolved already)
    const RunConfig& cfg = p.cfg;
    p.engine = engine_kind(cfg);
    p.rank = rank;
    p.world = world;
    const int tp = std::max(1, cfg.train.tp), pp = std::max(1, cfg.train.pp);
    p.mesh = dist::MeshLayout{pp, cfg.dp(), tp};
    if (cfg.ps()) {
        p.ps_servers = cfg.train.ps_servers;
        p.ps_staleness = cfg.train.ps_staleness;
    }
    const bool gpu = p.gpu();
    p.collective = gpu && collective;
    p.cuda_graphs = gpu && cfg.train.cuda_graphs;
    // One GPU without mpirun holds everything (ZeRO needs NCCL between launched ranks).
    p.zero_stage = gpu && !p.collective ? 0 : cfg.train.zero_stage;
    p.states = dist::shard_spec(p.zero_stage, cfg.train.offload_optimizer);
    p.precision = resolved_precision(cfg.train.precision);
    p.schedule = pp::parse_kind(cfg.train.pp_schedule);  // (a pipeline engine at one stage too)
    if (pp > 1) p.virtual_stages = cfg.train.pp_virtual;
    p.sequence_parallel = tp > 1 && cfg.train.sequence_parallel;
    p.lora = cfg.lora.enabled();
    if (p.lora && cfg.lora.base != "fp32") p.lora_base = quant::lora_base_quant(cfg.lora);
    const int B = cfg.micro_batch(), T = cfg.train.seq_len;
    p.micro_batch = B;
    p.seq_len = T;
    p.accum_steps = cfg.accum_steps();
    p.remat_policy = cfg.train.remat;
    const ModelConfig mine = rank_model(cfg.model, p);
    p.step_cost = measured ? remat::estimated_step_ns(mine, B, T, *measured)
                           : (double)remat::step_flops(mine, B, T);
    p.costs_measured = measured != nullptr;
    p.format = gpu ? device_arena_format(cfg, B, T) : cpu_arena_format(cfg.model);
    p.remat = solve_remat(cfg, p, measured);
    return p;
}

RunPlan plan_host_rank(const RunConfig& cfg, int rank) {
    if (cfg.train.device != "cpu") fail("internal: plan_host_rank prices the CPU engines only");
    RunPlan p = plan_layout(cfg, rank, cfg.world, false, nullptr);
    p.memory = predict_host_memory(p, p.remat.plan, p.cfg.micro_batch(), p.cfg.train.seq_len);
    p.memory_on = MemoryOn::Host;
    return p;
}

HostNeed host_need(const RunConfig& cfg) {
    HostNeed n;
    for (int r = 0; r < cfg.world; r++) {
        const std::size_t total = predicted_total(plan_host_rank(cfg, r).memory);
        n.most = std::max(n.most, total);
        n.sum += total;
    }
    return n;
}

std::string resolve_micro_batch(RunConfig& cfg, dist::Communicator& comm) {
    if (cfg.train.micro_batch_size != TrainConfig::kAutoMicroBatch) return "";
    // The CPU engines fit the node's host memory (every rank on it, rank 0's reading so that
    // every rank chooses the same); the GPU engine each rank's own device (its free bytes), and
    // a micro-batch is taken only when it fits every rank's.
    const bool gpu = cfg.train.device == "cuda";
    uint64_t avail = 0;
    if (gpu) {
        if (!cuda_available())
            fail("train.micro_batch_size = \"auto\" on train.device = \"cuda\": no device answers");
        select_device(comm.local_rank());  // this rank's GPU, as the engine takes it
        avail = device_memory_info().first;
    } else {
        avail = host_available_bytes();
        comm.broadcast(&avail, sizeof(avail), 0);
    }
    const int dp = cfg.dp(), share = cfg.train.batch_size / dp, ranks = comm.local_size();
    auto need = [&](int mb) -> std::optional<std::size_t> {
        RunConfig c = cfg;
        c.train.micro_batch_size = mb;
        try {
            validate_config(c);
        } catch (const Error&) {
            return std::nullopt;  // a layout constraint (sequence parallelism's token split)
        }
        if (!gpu) return host_need(c).most * (std::size_t)ranks;
        const RunPlan p = plan_layout(c, comm);  // this rank's GPU engine (whole model or stage)
        return predicted_total(predict_device_memory(p, p.remat.plan, mb, c.train.seq_len));
    };
    auto fits = [&](std::size_t n) {  // on every rank (one gather per candidate on the GPU)
        if (!gpu) return n <= avail;
        const uint8_t mine = n <= avail;
        std::vector<uint8_t> all(comm.size());
        comm.all_gather_bytes(&mine, all.data(), 1);
        return std::all_of(all.begin(), all.end(), [](uint8_t v) { return v == 1; });
    };
    const char* where = gpu ? "device memory free on this rank's GPU" : "host memory available";
    std::optional<std::size_t> larger;  // the next larger candidate's need
    int last = 0, larger_mb = 0;
    for (int mb = share; mb >= 1; mb--) {
        if (share % mb != 0) continue;
        const std::optional<std::size_t> n = need(mb);
        if (!n) continue;
        last = mb;
        if (fits(*n)) {
            cfg.train.micro_batch_size = mb;
            const std::string node = gpu ? std::string("each GPU needs")
                                     : ranks > 1
                                         ? fmt::format("the {} ranks on this node need", ranks)
                                         : std::string("the run needs");
            return fmt::format(
                "train.micro_batch_size = \"auto\": {} sequence{} per micro-batch, {} "
                "micro-batch{} per step on each of {} rank{} ({} {:.1f} MiB of {:.1f} MiB "
                "{}{})",
                mb, mb == 1 ? "" : "s", share / mb, share / mb == 1 ? "" : "es", dp,
                dp == 1 ? "" : "s", node, *n / 1048576.0, avail / 1048576.0,
                gpu ? "free" : "available",
                larger ? fmt::format("; {} would need {:.1f} MiB", larger_mb, *larger / 1048576.0)
                       : std::string("; the global batch allows no larger"));
        }
        larger = n;
        larger_mb = mb;
    }
    fail(
        "train.micro_batch_size = \"auto\": no micro-batch fits the {:.1f} MiB of {}{}: even {} "
        "sequence{} per micro-batch needs {:.1f} MiB. train.remat = \"full\", ZeRO "
        "(train.zero_stage), {} or more ranks need less (memtrain plan CONFIG {}tries them in "
        "turn)",
        avail / 1048576.0, where,
        !gpu && std::getenv("MEMTRAIN_HOST_MEMORY") ? " (MEMTRAIN_HOST_MEMORY)" : "", last,
        last == 1 ? "" : "s", larger ? *larger / 1048576.0 : 0.0,
        gpu ? "train.offload_optimizer" : "compressed moments (optim.state_format)",
        gpu ? "" : "--device cpu ");
}

RunPlan plan_run(const RunConfig& cfg, dist::Communicator& comm) {
    std::optional<remat::BlockFlops> measured;
    if (cfg.train.remat_costs == "measured" && cfg.train.remat != "none") {
        // A short profiling pass on this machine (one block's kernels, no extra model); every
        // rank uses rank 0's numbers, so all ranks choose the same schedule.
        const remat::BlockFlops t =
            remat::measure_block(cfg.model, cfg.micro_batch(), cfg.train.seq_len);
        int64_t ns[7] = {t.ln, t.qkv, t.attention, t.proj, t.fc, t.gelu, t.fc_proj};
        comm.broadcast(ns, sizeof(ns), 0);
        measured = remat::BlockFlops{ns[0], ns[1], ns[2], ns[3], ns[4], ns[5], ns[6]};
    }
    RunPlan p = plan_layout(cfg, comm, measured ? &*measured : nullptr);
    const int B = p.cfg.micro_batch(), T = p.cfg.train.seq_len;
    if (p.gpu()) {
        // What the plan's GPU engine (whole model, LoRA or a pipeline stage) will allocate.
        p.memory = predict_device_memory(p, p.remat.plan, B, T);
        p.memory_on = MemoryOn::Device;
        // (Without a device the engine's construction says so.)
        if (!p.memory.empty() && cuda_available()) {
            select_device(comm.local_rank());  // this rank's GPU, as the engine takes it
            const auto [free_b, total_b] = device_memory_info();
            check_device_fit(p, free_b, total_b);
        }
    } else {
        p.memory = predict_host_memory(p, p.remat.plan, B, T);
        p.memory_on = MemoryOn::Host;
        check_host_fit(p, comm.local_size());
    }
    return p;
}

}  // namespace memtrain
