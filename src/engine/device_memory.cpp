// The CUDA engines' device memory predicted before allocation (see device_memory.h).
#include "engine/device_memory.h"

#include <algorithm>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/error.h"
#include "model/lora.h"
#include "optim/device_update.h"
#include "optim/optimizer.h"
#include "parallel/data/tensor_gather.h"
#include "parallel/pipeline/stage_split.h"
#include "quant/quantized_store.h"
#include "remat/policy.h"

namespace memtrain {

namespace {

int elem_bytes(Precision p) {
    return p == Precision::fp32 ? 4 : 2;
}

// The schedule of full recompute at one sequence per micro-batch: the least activation memory a
// run of this model and sequence length can have (what the refusal offers).
RematPlan full_remat(const RunConfig& cfg, int T) {
    return remat::solve_policy(remat::parse_policy("full"), cfg.model, 1, T, nullptr,
                               device_arena_format(cfg, 1, T))
        .plan;
}

// Fails when `rows` exceed `free_bytes`, naming every category, the device's size and what
// would fit: smaller activations (`smallest`: the rows' total at one sequence per micro-batch
// and full recompute) when they are the largest row, else `states_remedy` for the model states.
void refuse_unless_fits(const std::vector<MemoryPrediction>& rows, const std::string& where,
                        std::size_t smallest, const std::string& states_remedy,
                        std::size_t free_bytes, std::size_t total_bytes) {
    const std::size_t need = predicted_total(rows);
    if (rows.empty() || need <= free_bytes) return;
    std::string parts;
    const MemoryPrediction* largest = &rows[0];
    for (const auto& r : rows) {
        parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", category_name(r.category),
                             mib(r.bytes));
        if (r.bytes > largest->bytes) largest = &r;
    }
    std::size_t states = 0;
    for (const auto& r : rows)
        if (r.category == MemCategory::Parameters || r.category == MemCategory::Gradients ||
            r.category == MemCategory::OptimizerState)
            states += r.bytes;
    std::string fit;
    if (largest->category == MemCategory::Activations ||
        largest->category == MemCategory::Workspace)
        fit = fmt::format(
            "most of it is for activations and their workspace: lower train.micro_batch_size or "
            "train.seq_len, or recompute (train.remat = selective, full or budget:BYTES); "
            "train.micro_batch_size = 1 with train.remat = \"full\" needs {}",
            mib(smallest));
    else
        fit = fmt::format("the model states need {}: {}", mib(states), states_remedy);
    fail(
        "this run needs {} of device memory per GPU{} ({}) but the device has {} ({} free): it "
        "would run out of device memory while allocating, so nothing was allocated. To fit: {}",
        mib(need), where, parts, mib(total_bytes), mib(free_bytes), fit);
}

// What shrinks the model states of a run on the plan's GPU engine.
std::string states_remedy(const RunConfig& cfg, EngineKind kind, bool packed_base) {
    const std::string bf16 = cfg.train.precision == "fp32" ? "train.precision = bf16, " : "";
    if (kind == EngineKind::CudaLora)
        return packed_base ? "a GPU with more memory: the frozen base is packed already"
                           : bf16 + "a packed frozen base (QLoRA: lora.base = nf4, int4 or int8)";
    if (kind == EngineKind::CudaPipeline)
        return bf16 +
               "more pipeline stages (train.pp, one GPU each), or LoRA (lora.rank) on one "
               "GPU to train adapters only";
    return bf16 +
           "ZeRO over more GPUs (mpirun with train.zero_stage = 3), "
           "train.offload_optimizer = true, or LoRA (lora.rank) to train adapters only";
}

// DeviceOptimizer's row over floats [begin, begin + n) of `layout` ("k x <what> (states) +
// chunk table"): its state per parameter and its table of tensor chunks. In another
// optim.state_format the moments are priced as the CPU's MomentBuffer lays them out (the same
// stores, cuda::moment_layout), plus the table of where each chunk's moments are and, for int8
// and int4, the two 256-entry decode tables.
MemoryPrediction optimizer_row(const ParamLayout& layout, std::size_t begin, std::size_t n,
                               const std::string& what, int elem_bytes, const OptimConfig& optim,
                               const std::vector<dist::ShardRange>* shards = nullptr,
                               int rank = 0) {
    const bool shard = shards != nullptr;
    const bool adamw = optim.name == "adamw";
    const bool has_master = device_master(elem_bytes, optim);
    // The fp32 master beside the state (its bytes, and its part of the formula).
    const std::size_t master = has_master ? 4 * n : 0;
    const std::string master_part = has_master ? fmt::format("fp32 master 4 x {} + ", what) : "";
    // Each part's tables (optim.step_in_backward: one part per parameter unit; their sum is the
    // whole range's), laid out as DeviceOptimizer lays them.
    const std::vector<cuda::OptimizerPart> parts =
        cuda::optimizer_parts(layout, begin, n, optim.step_in_backward);
    const std::string in_parts =
        parts.size() > 1 ? fmt::format(" (in {} unit parts)", parts.size()) : "";
    if (optim.name == "adafactor") {
        std::size_t state = 0, tables = 0;
        for (const cuda::OptimizerPart& p : parts) {
            const cuda::AdafactorLayout a = cuda::adafactor_layout(layout, p.offset, p.n, shard);
            state += 4 * (std::size_t)a.state;
            tables += a.table_bytes();
        }
        // Under ZeRO: each cut tensor this rank holds, its whole state and tables, and the
        // scratch every rank gathers the largest cut tensor into (gradients and weights in the
        // parameters' type, the fp32 master or state).
        std::size_t largest = 0, held = 0;
        if (shard)
            for (const dist::TensorCut& c :
                 dist::cut_tensors(layout, *shards, whole_step_tensors(optim, layout))) {
                const ParamSpec& t = layout.tensors[c.tensor];
                largest = std::max(largest, t.numel);
                if (!c.holds(rank)) continue;
                const cuda::AdafactorLayout a = cuda::adafactor_layout(layout, t.offset, t.numel);
                state += 4 * (std::size_t)a.state;
                tables += a.table_bytes();
                held++;
            }
        const std::size_t scratch = largest * (2 * (std::size_t)elem_bytes + 4);
        return {MemCategory::OptimizerState,
                fmt::format("{}Adafactor factors {} B + tables and row sums {} B{}{}", master_part,
                            state, tables, in_parts,
                            largest ? fmt::format(" + cut tensors' gather scratch {} B ({} held "
                                                  "whole here)",
                                                  scratch, held)
                                    : ""),
                master + state + tables + scratch};
    }
    const StateFormat f = parse_state_format(optim.state_format);
    if (optim.name == "muon") {
        std::size_t moments = 0, tables = 0, shared = 0, matrices = 0;
        // A ZeRO shard's scratch receives every matrix the shards cut: the layout's largest.
        if (shard) shared = cuda::muon_layout(layout, begin, 0, f, true).shared_bytes(f);
        for (const cuda::OptimizerPart& p : parts) {
            const cuda::MuonLayout m = cuda::muon_layout(layout, p.offset, p.n, f, shard);
            moments += 2 * MomentBuffer::predicted_bytes(f, layout, p.offset, p.n, m.rest) +
                       MomentBuffer::predicted_bytes(f, layout, p.offset, p.n, m.matrix);
            tables += m.chunk_table_bytes();
            shared = std::max(shared, m.shared_bytes(f));  // the scratch of the largest matrix
            matrices += m.matrices.size();
        }
        return {MemCategory::OptimizerState,
                fmt::format("{}Muon momentum on {} block matrices, Adam m, v else, in {} ({} B) + "
                            "chunk tables and Newton-Schulz scratch {} B{}",
                            master_part, matrices, state_format_name(f), moments, tables + shared,
                            in_parts),
                master + moments + tables + shared};
    }
    const std::size_t k = device_optimizer_bytes_per_param(has_master, adamw);
    std::size_t tables = 0;
    for (const cuda::OptimizerPart& p : parts)
        tables +=
            f == StateFormat::Fp32
                ? cuda::tensor_chunks(layout, p.offset, p.n).size() * sizeof(cuda::TensorChunk)
                : cuda::moment_layout(layout, p.offset, p.n, f).table_bytes();
    if (f == StateFormat::Fp32)
        return {MemCategory::OptimizerState,
                fmt::format("{} x {} ({}) + chunk table {} B{}", k, what,
                            device_optimizer_states(has_master, adamw), tables, in_parts),
                k * n + tables};
    std::size_t moments = 0;
    for (const cuda::OptimizerPart& p : parts)
        moments += (adamw ? 2 : 1) * MomentBuffer::predicted_bytes(f, layout, p.offset, p.n);
    tables += cuda::decode_tables(f).size() * sizeof(float);
    return {MemCategory::OptimizerState,
            fmt::format("{}{} {} in {} ({} B) + chunk and decode tables {} B{}", master_part,
                        adamw ? "Adam m, v" : "momentum", what, state_format_name(f), moments,
                        tables, in_parts),
            master + moments + tables};
}

// The adapters' optimizer: one part (their gradients are one small buffer, updated after the
// backward even under optim.step_in_backward).
OptimConfig adapter_optim(OptimConfig optim) {
    optim.step_in_backward = false;
    return optim;
}

}  // namespace

std::size_t device_step_bytes(int accum_steps, std::size_t units) {
    return sizeof(cuda::StepScalars) + 8 * (3 + (std::size_t)accum_steps + units);
}

int pipeline_stage_slots(const pp::Schedule& s, int stage) {
    const pp::SimResult sim = pp::simulate(s, pp::StageCosts::uniform(s.num_stages(), 1, 2, 1, 1));
    return std::max(1, sim.peak_stage_in_flight.at((std::size_t)stage));
}

bool cuda_data_parallel(const RunConfig& cfg, const dist::Communicator& comm) {
    return dynamic_cast<const dist::LocalCommunicator*>(&comm) == nullptr && !cfg.train.cuda_graphs;
}

bool device_master(int elem_bytes, const OptimConfig& optim) {
    return elem_bytes != 4 && optim.master != "none";
}

std::size_t device_optimizer_bytes_per_param(bool master, bool adamw) {
    return (master ? 4 : 0) + (adamw ? 8 : 4);
}

std::string device_optimizer_states(bool master, bool adamw) {
    return fmt::format("{}{}", master ? "fp32 master, " : "", adamw ? "Adam m, v" : "momentum");
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
    // NCCL shards are equal: the flat buffer is padded to world x S, S = ceil(psi / world) on
    // the state format's grain where the optimizer state is sharded (DeviceDataParallel).
    const int64_t grain = stage >= 1 ? (int64_t)shard_grain(cfg.optim) : 1;
    const std::size_t shard =
                          (std::size_t)dist::padded_shard_size((int64_t)psi, where.world, grain),
                      padded = shard * world;
    const std::vector<dist::ShardRange> shards =
        dist::padded_shard_ranges((int64_t)psi, where.world, grain);
    const std::size_t begin = stage >= 1 ? (std::size_t)shards[where.rank].offset : 0;
    const std::size_t count = stage >= 1 ? (std::size_t)shards[where.rank].count : psi;
    const std::size_t e = (std::size_t)device_elem_bytes(cfg);
    const char* tn = cfg.train.precision.c_str();
    const bool offload = cfg.train.offload_optimizer;
    const auto lay = activation_layout(cfg.model, B, T, plan, device_arena_format(cfg, B, T));
    const std::size_t extra = device_token_bytes(B, T) + kDeviceGraphBytes +
                              device_step_bytes(cfg.accum_steps(), layout.units.size());
    const std::string per_rank = fmt::format(" / {} ranks", world);
    return {
        {MemCategory::Parameters,
         fmt::format("{} x params{} ({})", e, stage >= 3 ? per_rank : "", tn),
         e * (stage >= 3 ? shard : padded)},
        // optim.step_in_backward with one micro-batch per step: the open units' buckets only
        // (engine/cuda/in_backward_grads.h).
        cfg.no_grad_buffer() && stage >= 2
            ? MemoryPrediction{MemCategory::Gradients,
                               "none: step in backward (each unit's piece updated from its bucket, "
                               "in the communication row)",
                               0}
        : cfg.no_grad_buffer()
            ? MemoryPrediction{MemCategory::Gradients,
                               fmt::format("{} x ({}), step in backward ({})", e,
                                           cfg.model.tied_embeddings
                                               ? "embedding unit + largest other unit"
                                               : "largest unit",
                                           tn),
                               e * step_in_backward_grad_floats(layout, cfg.model.tied_embeddings)}
            : MemoryPrediction{MemCategory::Gradients,
                               fmt::format("{} x params{} ({})", e, stage >= 2 ? per_rank : "", tn),
                               e * (stage >= 2 ? shard : padded)},
        // ZeRO-1: this rank's shard of the optimizer state.
        offload ? MemoryPrediction{MemCategory::OptimizerState,
                                   "none on the device (train.offload_optimizer: see below)", 0}
                : optimizer_row(layout, begin, count,
                                fmt::format("params{}", stage >= 1 ? per_rank : ""), (int)e,
                                cfg.optim, stage >= 1 && world > 1 ? &shards : nullptr, where.rank),
        {MemCategory::Activations,
         fmt::format("activation_layout(B, T, remat={}, {})", cfg.train.remat, tn),
         arena_bytes(lay, MemCategory::Activations)},
        {MemCategory::Workspace, "activation_layout(B, T) + token ids + step statistics",
         arena_bytes(lay, MemCategory::Workspace) + extra},
    };
}

std::vector<MemoryPrediction> predict_cuda_lora_memory(const RunPlan& plan, const RematPlan& remat,
                                                       int B, int T) {
    const RunConfig& cfg = plan.cfg;
    const ParamLayout layout = make_param_layout(cfg.model);
    const LoraLayout lora = make_lora_layout(cfg.model, cfg.lora);
    const int eb = elem_bytes(plan.precision);
    const std::size_t e = (std::size_t)eb, n = lora.params.total;
    const char* tn = precision_name(plan.precision);
    const auto lay =
        activation_layout(cfg.model, B, T, remat, cuda_arena_format(cfg.model, eb, B, T));
    std::size_t base = e * layout.total, slots = 0;
    std::string base_text = fmt::format("frozen base {} x {} ({})", e, layout.total, tn);
    if (plan.lora_base) {
        const quant::DeviceBaseBytes b =
            quant::device_base_bytes(cfg.model, *plan.lora_base, eb, quant::kDeviceBaseSlots);
        base = b.params;
        slots = b.slots;
        base_text = fmt::format("frozen base packed {} + the rest {}", plan.lora_base->name(), tn);
    }
    // The adapters' GEMM scratch (CudaLora): lora_workspace_bytes counts fp32 elements.
    const std::size_t adapter_gemms =
        lora_workspace_bytes(cfg.lora, lora, B * T) / sizeof(float) * e;
    const std::size_t extra = device_token_bytes(B, T) + kDeviceGraphBytes +
                              device_step_bytes(cfg.accum_steps(), 0) + adapter_gemms + slots;
    return {
        {MemCategory::Parameters, fmt::format("{} + adapters {} x {}", base_text, e, n),
         base + e * n},
        {MemCategory::Gradients, fmt::format("adapters only: {} x {} ({})", e, n, tn), e * n},
        optimizer_row(lora.params, 0, n, "adapters", eb, adapter_optim(cfg.optim)),
        {MemCategory::Activations,
         fmt::format("activation_layout(B, T, remat={}, {})", cfg.train.remat, tn),
         arena_bytes(lay, MemCategory::Activations)},
        {MemCategory::Workspace,
         std::string("activation_layout(B, T) + token ids + step statistics + adapter GEMMs") +
             (plan.lora_base ? " + 2 decode slots" : ""),
         arena_bytes(lay, MemCategory::Workspace) + extra},
    };
}

std::vector<MemoryPrediction> predict_cuda_stage_memory(const RunPlan& plan, const RematPlan& remat,
                                                        int B, int T) {
    const RunConfig& cfg = plan.cfg;
    const int p = plan.mesh.pp, stage = plan.mesh.stage_of(plan.rank);
    const ParamLayout layout = make_param_layout(cfg.model);
    // The stage's blocks and units, as the engine splits the model (for the config's
    // micro-batch, once).
    const pp::StageSplit split =
        pp::split_stages(cfg.model, p, cfg.micro_batch(), cfg.train.seq_len);
    const int b0 = split.first_block[(std::size_t)stage];
    const int b1 = b0 + split.blocks[(std::size_t)stage];
    const int first_unit = b0 == 0 ? ParamLayout::embedding_unit() : layout.block_unit(b0);
    const int last_unit = b1 == cfg.model.n_layer ? layout.head_unit() : layout.block_unit(b1 - 1);
    const std::size_t begin = layout.units[(std::size_t)first_unit].begin;
    const std::size_t count = layout.units[(std::size_t)last_unit].end - begin;
    // A tied embedding across stages: the last stage's mirror of wte (parameters and gradients)
    // and the first stage's buffer for the classifier's wte gradient.
    const bool tied = p > 1 && cfg.model.tied_embeddings;
    const std::size_t emb = layout.units[(std::size_t)ParamLayout::embedding_unit()].size();
    const std::size_t mirror = tied && stage == p - 1 ? emb : 0;
    const int eb = elem_bytes(plan.precision);
    const std::size_t e = (std::size_t)eb, n = count + mirror;
    const std::size_t tied_in = tied && stage == 0 ? e * emb : 0;
    const char* tn = precision_name(plan.precision);
    const int slots =
        pipeline_stage_slots(pp::make_schedule(plan.schedule, p, cfg.accum_steps()), stage);
    const RematPlan stage_remat = remat.empty() ? RematPlan{} : slice_plan(remat, b0, b1);
    const ArenaPlan a = plan_stage_arena(cfg.model, b1 - b0, B, T, stage_remat,
                                         cuda_arena_format(cfg.model, eb, B, T));
    const std::string mirrored = mirror ? " + the tied wte's mirror" : "";
    return {
        {MemCategory::Parameters, fmt::format("{} x stage params{} ({})", e, mirrored, tn), e * n},
        {MemCategory::Gradients, fmt::format("{} x stage params{} ({})", e, mirrored, tn), e * n},
        optimizer_row(layout, begin, count, "stage params", eb, cfg.optim),
        {MemCategory::Activations,
         fmt::format("{} slots x plan_stage_arena({} blocks, B, T, remat={}, {})", slots, b1 - b0,
                     cfg.train.remat, tn),
         (std::size_t)slots * a.activation_bytes},
        {MemCategory::Workspace,
         fmt::format("plan_stage_arena(B, T) + {} slots x token ids + step statistics{}", slots,
                     tied_in ? " + the tied wte's gradient" : ""),
         arena_bytes(a.entries, MemCategory::Workspace) +
             (std::size_t)slots * device_token_bytes(B, T) + kDeviceGraphBytes +
             device_step_bytes(cfg.accum_steps(), 0) + tied_in},
    };
}

std::vector<MemoryPrediction> predict_device_memory(const RunPlan& plan, const RematPlan& remat,
                                                    int B, int T) {
    switch (plan.engine) {
        case EngineKind::Cuda:
            return predict_cuda_memory(
                plan.cfg, remat, DevicePlacement{plan.world, plan.rank, plan.collective}, B, T);
        case EngineKind::CudaLora:
            return predict_cuda_lora_memory(plan, remat, B, T);
        case EngineKind::CudaPipeline:
            return predict_cuda_stage_memory(plan, remat, B, T);
        default:
            return {};
    }
}

void check_device_fit(const RunPlan& plan, std::size_t free_bytes, std::size_t total_bytes) {
    if (plan.memory.empty() || predicted_total(plan.memory) <= free_bytes) return;
    const int T = plan.cfg.train.seq_len;
    const std::size_t smallest =
        predicted_total(predict_device_memory(plan, full_remat(plan.cfg, T), 1, T));
    const std::string where = plan.engine == EngineKind::CudaPipeline
                                  ? fmt::format(" on pipeline stage {} of {}",
                                                plan.mesh.stage_of(plan.rank), plan.mesh.pp)
                                  : std::string();
    refuse_unless_fits(plan.memory, where, smallest,
                       states_remedy(plan.cfg, plan.engine, plan.lora_base.has_value()), free_bytes,
                       total_bytes);
}

void check_device_fit(const RunConfig& cfg, const RematPlan& plan, const DevicePlacement& where,
                      std::size_t free_bytes, std::size_t total_bytes) {
    const int B = cfg.micro_batch(), T = cfg.train.seq_len;
    const std::vector<MemoryPrediction> rows = predict_cuda_memory(cfg, plan, where, B, T);
    if (rows.empty() || predicted_total(rows) <= free_bytes) return;
    const std::size_t smallest =
        predicted_total(predict_cuda_memory(cfg, full_remat(cfg, T), where, 1, T));
    refuse_unless_fits(rows, "", smallest, states_remedy(cfg, EngineKind::Cuda, false), free_bytes,
                       total_bytes);
}

}  // namespace memtrain
