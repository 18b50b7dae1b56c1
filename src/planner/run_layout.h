// RunSpec: how one training run is laid out on the GPUs (parallel degrees, ZeRO stage,
// precision, optimizer, recomputation, micro-batching). Plain data plus parsers for the
// command-line spellings and a validator that explains what is impossible.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "model/activation_layout.h"
#include "optim/state_format.h"
#include "parallel/pipeline/schedule.h"
#include "planner/model_shape.h"

namespace memtrain::plan {

// sgd = SGD with momentum; muon = Muon's momentum on the blocks' 2-D matrices, AdamW elsewhere;
// adafactor = a factored second moment (rows + cols floats per matrix, whole for the rest).
enum class Optimizer { adamw, sgd, adamw8bit, muon, adafactor };
// For every layout priced by the engines' layout functions (planner/rank_layout.h,
// planner/stage_activations.h) each name is the trainer's train.remat of that name (selective:
// ln_1, ln_2 and the MLP activation recomputed), sequence parallelism and tp with pp included;
// LoRA on a whole model prices its activations with the engine's arena too. The per-layer
// formulas (layer_activation_bytes, left for what the trainer cannot express: dropout masks, and
// LoRA sharded over tp or pp) read selective as Korthikanti's, the attention core recomputed.
enum class Recompute { none, selective, full };
enum class Offload { none, optimizer, optimizer_and_params };
// Linear layers that get LoRA adapters: the attention projections (the trainer's default), or
// those and the MLP's. GPT-2: attn.c_attn (fused QKV, one adapter) and attn.c_proj, then mlp.c_fc
// and mlp.c_proj; Llama: q_proj, k_proj, v_proj, o_proj, then gate_proj, up_proj, down_proj, each
// its own adapter.
enum class LoraTargets { attn, all };
// Whose runtime the memory is priced for (`--runtime`): memtrain's engines (planned buffers), or
// a peer's buffers and state layout at their defaults (docs/planner.md, "Runtime profiles").
enum class Runtime { memtrain, pytorch, deepspeed, megatron };

struct RunSpec {
    int dp = 1, tp = 1, pp = 1;
    int zero = 0;           // ZeRO stage 0..3 over the dp group
    int micro_batch = 1;    // sequences per micro-batch per data-parallel rank
    int seq = 0;            // tokens per sequence; 0 = model.block_size
    int micro_batches = 1;  // micro-batches per optimizer step (gradient accumulation)
    Recompute recompute = Recompute::none;
    // The trainer's per-block plan (train.remat = budget:, every:K, sqrt), one entry per block of
    // the whole model; empty: `recompute` for every block. Priced where the engines' layout is.
    RematPlan block_plan;
    bool sequence_parallel = false;  // Megatron SP: shards the norm/dropout activations over tp
    bool flash_attention = true;     // no s^2 attention scores are kept (the GPU's fused kernel)
    // The CPU engine without flash_attention, under train.cpu_attention = "lse": it keeps each
    // row's log-sum-exp instead of the s^2 probabilities (ModelConfig::lse_attention).
    bool lse_attention = false;
    // The CPU engine under train.precision = "bf16": fp32 storage, GEMM operands rounded to bf16
    // in a workspace region (ModelConfig::cpu_bf16); `precision` stays fp32.
    bool cpu_bf16 = false;
    // How the CPU engine stores its saved fields (ModelConfig::saved_activations).
    SavedStore cpu_saved = SavedStore::fp32;
    // bf16/fp16: 16-bit parameters and gradients, with an fp32 master copy unless !fp32_master
    // ("bf16-only"); fp32: everything in fp32 (core/dtype.h's Precision).
    Precision precision = Precision::bf16;
    bool fp32_master = true;
    Optimizer optimizer = Optimizer::adamw;
    // How the moments are stored (optim.state_format); adamw8bit is adamw with int8 moments.
    StateFormat state_format = StateFormat::Fp32;
    // optim.step_in_backward: with one micro-batch per step, no gradient buffer (each unit's
    // gradient lives until its update; under ZeRO 2-3 not even the shard).
    bool step_in_backward = false;
    // The optimizer runs on the GPU (memtrain's DeviceOptimizer): Muon's Newton-Schulz scratch
    // is then allocated for the run, beside the state (the CPU's is a step's temporary).
    bool device_optimizer = false;
    Offload offload = Offload::none;
    pp::Kind schedule = pp::Kind::OneFOneB;  // the ones parse_schedule accepts
    int virtual_stages = 1;  // model chunks per pipeline stage (interleaved schedule)
    int lora_rank = 0;       // > 0: base weights frozen, LoRA adapters on `lora_targets`
    int frozen_bits = 16;    // storage of frozen base weights under LoRA: 16, 8 or 4 (QLoRA)
    LoraTargets lora_targets = LoraTargets::attn;
    Runtime runtime = Runtime::memtrain;
    int64_t bucket_bytes = 25 * 1024 * 1024;  // gradient all-reduce bucket (PyTorch DDP default)
    double fragmentation = 0.05;              // allocator slack as a fraction of the rest
    int64_t reserve_bytes = 0;                // CUDA context, cuBLAS/NCCL workspaces

    int gpus() const { return dp * tp * pp; }
    int seq_len(const ModelSpec& m) const { return seq > 0 ? seq : m.block_size; }
    int64_t global_batch() const { return static_cast<int64_t>(dp) * micro_batch * micro_batches; }
};

// bf16 | fp16 | fp32 | bf16-only (bf16 without fp32 master weights: *fp32_master = false).
Precision parse_precision(const std::string& s, bool* fp32_master);
Optimizer parse_optimizer(const std::string& s);  // adamw | sgd | adamw8bit
Recompute parse_recompute(const std::string& s);  // none | selective | full
// The executor's schedules the planner prices: 1f1b | gpipe | interleaved | zb-h1.
pp::Kind parse_schedule(const std::string& s);
Offload parse_offload(const std::string& s);           // none | optimizer | params
LoraTargets parse_lora_targets(const std::string& s);  // attn | all
Runtime parse_runtime(const std::string& s);           // memtrain | pytorch | deepspeed | megatron
// "bf16", "fp16", "fp32" or "bf16-only".
const char* precision_label(Precision p, bool fp32_master);
const char* to_string(Optimizer o);
const char* to_string(Recompute r);
std::string to_string(pp::Kind s);
const char* to_string(Offload o);
const char* to_string(LoraTargets t);
const char* to_string(Runtime r);

// How the weights are trained, for labels: "full-parameter training", "LoRA r=16", "QLoRA 8-bit
// r=16", "QLoRA 4-bit r=16" (frozen weights at 16 bits are not quantized: plain LoRA).
std::string describe_method(const RunSpec& run);

// Whether memtrain's trainer runs this layout: not parameter offload (--offload params), which
// the planner prices for comparison only. `plan` and `scale` rank such plans after every one the
// trainer runs, mark them in the table, and never emit one.
bool trainer_runs(const RunSpec& run);
// Why a peer's runtime (--runtime) does not run this layout (offload, ZeRO stage, tp, pp) as
// priced, or "" when it does (and for memtrain's own): validate_run refuses with it, the search
// skips such layouts.
std::string runtime_layout_refusal(const RunSpec& run);

// Throws memtrain::Error with the reason and a fix when the layout cannot run at all
// (tp does not divide the heads, more stages than layers, ZeRO stage out of range, ...).
void validate_run(const ModelSpec& model, const RunSpec& run);

// Bytes per parameter of parameters, gradients and optimizer states (before sharding).
struct StateBytes {
    double param, grad, optim;
    double master = 0;  // of optim: the fp32 master copy of mixed precision
};
// Each moment at moment_bytes_per_param(format) (optim/optimizer.h: the trainer's blocks and
// scales, without the fp32 rule for small tensors); adamw8bit is int8. fp32 moments without an
// fp32 master ("bf16-only") are bf16.
StateBytes state_bytes(Precision precision, bool fp32_master, Optimizer optimizer,
                       StateFormat format = StateFormat::Fp32);
StateBytes state_bytes(const RunSpec& r);
// The same for `model`: Muon keeps one moment on the blocks' 2-D matrices (the fraction
// muon_matrix_fraction of the parameters) and AdamW's two on the rest; Adafactor
// adafactor_bytes_per_param (without a model, state_bytes prices Adafactor's factors as 0).
StateBytes state_bytes(const ModelSpec& model, const RunSpec& r);
double adafactor_bytes_per_param(const ModelSpec& model);
double muon_matrix_fraction(const ModelSpec& model);
// Muon's Newton-Schulz scratch, whichever engine: two copies of the largest block matrix and
// two of its Gram matrix (min(rows, cols)^2), in fp32, and a norm (the GPU's DeviceOptimizer
// holds them for the run, the CPU's newton_schulz5 for each matrix's step).
double muon_scratch_bytes(const ModelSpec& model);
// GPU Adafactor under ZeRO over `dp` GPUs: the scratch every rank gathers the largest tensor the
// shards cut into (gradients and weights of elem_bytes, the fp32 master or state), as
// DeviceOptimizer allocates it; 0 below two ranks.
double adafactor_cut_scratch_bytes(const ModelSpec& model, int dp, int elem_bytes);
// Bytes of one saved activation element: 4 for fp32 training, else 2.
int activation_bytes(Precision precision);
// Bytes of one frozen weight-matrix element under LoRA: 16 bits keeps the run's parameter dtype
// (state_bytes(...).param), 8 bits is int8 with a per-row scale (LLM.int8; the scale's 32/fan_in
// bits are left out), 4 bits is QLoRA's NF4 with double-quantized block scales, 4 + 8/64 +
// 32/(64 x 256) = 4.127 bits (Dettmers et al. 2023; `memtrain quantize --method nf4-dq`).
double frozen_bytes_per_weight(int frozen_bits, Precision precision, bool fp32_master);

}  // namespace memtrain::plan
