// The CUDA engine's device memory predicted before allocation (see device_memory.h).
#include "engine/device_memory.h"

#include <algorithm>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/error.h"
#include "optim/device_update.h"
#include "remat/policy.h"

namespace memtrain {

namespace {

std::size_t sum(const std::vector<MemoryPrediction>& rows) {
    std::size_t s = 0;
    for (const auto& r : rows) s += r.bytes;
    return s;
}

}  // namespace

bool cuda_data_parallel(const RunConfig& cfg, const dist::Communicator& comm) {
    return dynamic_cast<const dist::LocalCommunicator*>(&comm) == nullptr && !cfg.train.cuda_graphs;
}

std::size_t device_optimizer_bytes_per_param(int elem_bytes, bool adamw) {
    return (elem_bytes == 4 ? 0 : 4) + (adamw ? 8 : 4);
}

std::string device_optimizer_states(int elem_bytes, bool adamw) {
    return fmt::format("{}{}", elem_bytes == 4 ? "" : "fp32 master, ",
                       adamw ? "Adam m, v" : "momentum");
}

int device_elem_bytes(const RunConfig& cfg) {
    return cfg.train.precision == "fp32" ? 4 : 2;
}

ActFormat device_arena_format(const RunConfig& cfg, int B, int T) {
    return cuda_arena_format(cfg.model, device_elem_bytes(cfg), B, T);
}

std::size_t device_token_bytes(int B, int T) {
    const std::size_t N = (std::size_t)B * T;
    return (5 * N + 1) * sizeof(int32_t);  // inputs, targets, plan (at most 3N + 1)
}

std::vector<MemoryPrediction> predict_cuda_memory(const RunConfig& cfg, const RematPlan& plan,
                                                  const DevicePlacement& where, int B, int T) {
    if (cfg.lora.enabled() || cfg.train.pp > 1 || cfg.train.tp > 1 || cfg.ps()) return {};
    const ParamLayout layout = make_param_layout(cfg.model);
    const std::size_t psi = layout.total, world = (std::size_t)where.world;
    const int stage = where.data_parallel ? cfg.train.zero_stage : 0;
    // NCCL shards are equal: the flat buffer is padded to world x ceil(psi / world).
    const std::size_t shard = (psi + world - 1) / world, padded = shard * world;
    const std::vector<dist::ShardRange> shards =
        dist::padded_shard_ranges((int64_t)psi, where.world);
    const std::size_t begin = stage >= 1 ? (std::size_t)shards[where.rank].offset : 0;
    const std::size_t count = stage >= 1 ? (std::size_t)shards[where.rank].count : psi;
    const std::size_t e = (std::size_t)device_elem_bytes(cfg);
    const char* tn = cfg.train.precision.c_str();
    const bool offload = cfg.train.offload_optimizer, adamw = cfg.optim.name == "adamw";
    // DeviceOptimizer's state, and its table of tensor chunks.
    const std::size_t k = offload ? 0 : device_optimizer_bytes_per_param((int)e, adamw);
    const std::size_t table =
        offload ? 0 : cuda::tensor_chunks(layout, begin, count).size() * sizeof(cuda::TensorChunk);
    const std::string states = device_optimizer_states((int)e, adamw);
    const auto lay = activation_layout(cfg.model, B, T, plan, device_arena_format(cfg, B, T));
    const std::size_t stats = sizeof(cuda::StepScalars) + 8 * (2 + (std::size_t)cfg.accum_steps());
    const std::size_t extra = device_token_bytes(B, T) + kDeviceGraphBytes + stats;
    const std::string per_rank = fmt::format(" / {} ranks", world);
    return {
        {MemCategory::Parameters,
         fmt::format("{} x params{} ({})", e, stage >= 3 ? per_rank : "", tn),
         e * (stage >= 3 ? shard : padded)},
        {MemCategory::Gradients,
         fmt::format("{} x params{} ({})", e, stage >= 2 ? per_rank : "", tn),
         e * (stage >= 2 ? shard : padded)},
        // ZeRO-1: this rank's shard of the optimizer state.
        {MemCategory::OptimizerState,
         offload ? std::string("none on the device (train.offload_optimizer: see below)")
                 : fmt::format("{} x params{} ({}) + chunk table {} B", k,
                               stage >= 1 ? per_rank : "", states, table),
         k * count + table},
        {MemCategory::Activations,
         fmt::format("activation_layout(B, T, remat={}, {})", cfg.train.remat, tn),
         arena_bytes(lay, MemCategory::Activations)},
        {MemCategory::Workspace, "activation_layout(B, T) + token ids + step statistics",
         arena_bytes(lay, MemCategory::Workspace) + extra},
    };
}

void check_device_fit(const RunConfig& cfg, const RematPlan& plan, const DevicePlacement& where,
                      std::size_t free_bytes, std::size_t total_bytes) {
    const int B = cfg.micro_batch(), T = cfg.train.seq_len;
    const std::vector<MemoryPrediction> rows = predict_cuda_memory(cfg, plan, where, B, T);
    if (rows.empty()) return;
    const std::size_t need = sum(rows);
    if (need <= free_bytes) return;
    std::string parts;
    const MemoryPrediction* largest = &rows[0];
    for (const auto& r : rows) {
        parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", category_name(r.category),
                             mib(r.bytes));
        if (r.bytes > largest->bytes) largest = &r;
    }
    // What would change it: the activations at one sequence per micro-batch and full remat; the
    // model states in bf16, sharded over more GPUs or with the optimizer on the host.
    const RematPlan full = remat::solve_policy(remat::parse_policy("full"), cfg.model, 1, T,
                                               nullptr, device_arena_format(cfg, 1, T))
                               .plan;
    std::size_t states = 0;
    for (const auto& r : rows)
        if (r.category == MemCategory::Parameters || r.category == MemCategory::Gradients ||
            r.category == MemCategory::OptimizerState)
            states += r.bytes;
    const std::size_t smallest = sum(predict_cuda_memory(cfg, full, where, 1, T));
    std::string fit;
    if (largest->category == MemCategory::Activations ||
        largest->category == MemCategory::Workspace)
        fit = fmt::format(
            "most of it is for activations and their workspace: lower train.micro_batch_size or "
            "train.seq_len, or recompute (train.remat = selective, full or budget:BYTES); "
            "train.micro_batch_size = 1 with train.remat = \"full\" needs {}",
            mib(smallest));
    else
        fit = fmt::format(
            "the model states need {}: {}ZeRO over more GPUs (mpirun with train.zero_stage = 3), "
            "train.offload_optimizer = true, or LoRA (lora.rank) to train adapters only",
            mib(states), cfg.train.precision == "fp32" ? "train.precision = bf16, " : "");
    fail(
        "this run needs {} of device memory per GPU ({}) but the device has {} ({} free): it "
        "would run out of device memory while allocating, so nothing was allocated. To fit: {}",
        mib(need), parts, mib(total_bytes), mib(free_bytes), fit);
}

}  // namespace memtrain
