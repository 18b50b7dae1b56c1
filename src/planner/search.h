// The strategy search: enumerate DP x TP x PP, ZeRO stage, offload, recompute policy and
// micro-batch size for a global batch; keep what fits, rank by predicted tokens/s, and explain
// in one line per strategy family why nothing in it fits. When full-parameter training fits
// nowhere, LoRA and then QLoRA (frozen weights at 8, then 4 bits) are tried, in that order.
#pragma once

#include <string>
#include <vector>

#include "planner/hardware.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "planner/run_layout.h"
#include "planner/time_model.h"

namespace memtrain::plan {

struct SearchSpec {
    int global_batch = 0;  // sequences per optimizer step; 0 = 1024
    int seq = 0;           // 0 = model.block_size
    Precision precision = Precision::bf16;
    bool fp32_master = true;  // false: "bf16-only"
    Optimizer optimizer = Optimizer::adamw;
    // The moments' storage; with state_fallback, full-parameter training that does not fit is
    // tried again with int8 and then int4 moments (those below the given format) before LoRA.
    StateFormat state_format = StateFormat::Fp32;
    bool state_fallback = false;
    bool flash_attention = true;
    bool allow_offload = true;
    int max_micro_batch = 64;
    double fragmentation = 0.05;
    int64_t reserve_bytes = 1'000'000'000;  // CUDA context + workspaces per GPU
    // LoRA. lora_rank > 0: every plan trains adapters of that rank on lora_targets over frozen
    // weights of frozen_bits (0: 16). lora_rank 0 with lora_fallback: full-parameter plans, and
    // only when none fits, LoRA at fallback_rank with frozen 16-bit weights, then QLoRA 8-bit,
    // then 4-bit, stopping at the first that fits (frozen_bits 16, 8 or 4: only that one).
    int lora_rank = 0;
    int frozen_bits = 0;
    LoraTargets lora_targets = LoraTargets::attn;
    Runtime runtime = Runtime::memtrain;  // whose buffers and state layout (--runtime)
    bool lora_fallback = false;  // off for pre-training (scale); `memtrain plan` turns it on
    int fallback_rank = 16;
};

struct Plan {
    RunSpec run;
    MemoryEstimate memory;
    TimeEstimate time;
};

struct Rejection {
    std::string family;      // e.g. "pure DP, ZeRO-0"; "" for a whole method
    std::string reason;      // one line with numbers
    int64_t best_bytes = 0;  // least memory any member needs (0 for structural reasons)
    std::string method;      // describe_method; "" for structural reasons (tp, dp)
    // How the line is named: "pure DP, ZeRO-0" (full-parameter families keep their plain name),
    // "LoRA r=16, pure DP, ZeRO-0", "full-parameter training" (the method as a whole), "tp=3".
    std::string label() const;
};

// One training method the search tried, in the order tried.
struct MethodTried {
    std::string
        name;  // describe_method: "full-parameter training", "LoRA r=16", "QLoRA 4-bit r=16"
    int lora_rank = 0, frozen_bits = 16;
    int64_t trainable_params = 0;    // of the whole model: every weight, or the LoRA adapters
    int evaluated = 0, fitting = 0;  // fitting: plans that fit and the trainer runs
};

struct SearchResult {
    std::vector<Plan> plans;  // fitting plans of one method (the first that fits), fastest first
    // Methods that fit nowhere first (one line each, saying what the next method did), then
    // families with no fitting member by method and memory, then structural reasons.
    std::vector<Rejection> rejected;
    std::vector<MethodTried> methods;
    int evaluated = 0;
    // Full-parameter training was tried and did not fit, so the plans are LoRA fine-tuning: a
    // different job (only the adapters learn), which the output must say.
    bool lora_instead_of_full = false;
    // The plans store the moments in a smaller format than asked (SearchSpec::state_fallback).
    bool moments_instead_of_plain = false;
    // ... and, beyond that, bf16 weights without the fp32 master (optim.master = "none").
    bool weights_instead_of_master = false;
    StateFormat asked_moments = StateFormat::Fp32;  // SearchSpec::state_format
};

// Fails (memtrain::Error) on impossible input: zero GPUs, a GPU count the node size does not
// allow, a global batch below the GPU count. An empty `plans` means nothing fits; `rejected`
// then says why for every family.
SearchResult search_plans(const ModelSpec& model, const ClusterSpec& cluster,
                          const SearchSpec& spec);

// GPUs of one node whose offloaded states share its host memory: min(gpus, gpus_per_node).
int gpus_sharing_a_host(const ClusterSpec& cluster);
// Whether the host memory of a node (ClusterSpec::host_memory) holds the offloaded states of
// its GPUs.
bool host_fits(const MemoryEstimate& est, const ClusterSpec& cluster);

// "dp=32 tp=8 pp=4 ZeRO-1 mb=1x48 recompute=selective" — the one-line name of a layout, with
// " offload=optimizer" and " LoRA r=16 targets=attn" / " QLoRA 4-bit r=16 targets=all" as set.
std::string describe(const RunSpec& run);

}  // namespace memtrain::plan
