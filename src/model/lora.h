// LoRA (Hu et al., 2021): low-rank adapters beside the linear layers of the blocks, the base
// weights frozen. An adapter on a linear of `in` inputs adds to `out` of its output columns
//     y[:, col0 : col0 + out] += (alpha / rank) * drop(x) A^T B^T
// with A (rank, in) drawn N(0, 1/rank) and B (out, rank) zero, so training starts exactly at the
// base model. A and B keep the shapes and names the PEFT library uses
// ("<module>.lora_A.weight", "<module>.lora_B.weight"), so the checkpoint's adapter files are
// PEFT's. memtrain fuses q, k, v into attn.c_attn and gate, up into mlp.c_fc; for a Llama model
// each of q_proj, k_proj, v_proj, gate_proj, up_proj gets an adapter of its own on its columns of
// the fused GEMM, exactly as PEFT puts one on each separate nn.Linear.
//
// The adapters are parameters of their own layout (one unit per block), held by any UnitStore:
// a ZeroStore shards their gradients and optimizer state like the full model's. Nothing is
// saved for backward beyond what the block keeps anyway: the adapter's hidden h = drop(x) A^T
// (N x rank) is recomputed from the block's saved input, and the dropout mask is a hash of
// (seed, micro-batch, site, element), so it is never stored either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "model/unit_store.h"

namespace memtrain {

struct LoraConfig {
    int rank = 0;                  // 0: off (full-parameter training)
    double alpha = 16;             // the adapters' output is scaled by alpha / rank
    double dropout = 0;            // on the adapter's input, in training only
    std::string targets = "attn";  // attn | all | comma-separated module-name suffixes
    std::string base = "fp32";     // frozen base storage: fp32 | int8 | int4 | nf4 (QLoRA)
    int base_group = 64;           // int4: inputs per fp16 scale
    bool enabled() const { return rank > 0; }
    float scale() const { return (float)(alpha / rank); }
    // One-line errors for bad values (rank < 0, dropout outside [0, 1), ...).
    void validate() const;
};

// The four GEMMs of a block: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj.
enum class BlockLinear : int { Qkv = 0, Proj = 1, Fc = 2, FcProj = 3 };

struct LoraSite {
    int block = 0;
    BlockLinear linear = BlockLinear::Qkv;
    std::string module;  // Hugging Face module: "h.0.attn.c_attn", "model.layers.0.mlp.up_proj"
    int64_t in = 0, out = 0;   // A is (rank, in), B is (out, rank)
    int64_t col0 = 0;          // first output column of the linear the adapter adds to
    int64_t linear_out = 0;    // output columns of the whole linear (the row stride of y)
    std::size_t a = 0, b = 0;  // A's and B's offsets from the block's adapter unit
};

struct LoraLayout {
    int rank = 0;
    ParamLayout params;              // unit l = block l's adapters; tensors named by module
    std::vector<LoraSite> sites;     // block by block, in linear order
    std::vector<std::string> names;  // distinct module suffixes adapted ("attn.c_attn", "q_proj")
    int64_t max_in = 0;              // the widest adapter input
    // The adapters of block `block` on `linear`: a contiguous run of `sites`.
    std::span<const LoraSite> sites_of(int block, BlockLinear linear) const {
        const std::size_t k = 4 * (std::size_t)block + (std::size_t)linear;
        return std::span<const LoraSite>(sites).subspan(first[k], first[k + 1] - first[k]);
    }
    // sites_of(b, k) is sites[first[4b + k], first[4b + k + 1]).
    std::vector<std::size_t> first;
};

// The adapters `lora.targets` asks for. Targets: "attn" = the attention projections (GPT-2
// c_attn and attn.c_proj; Llama q/k/v/o_proj), "all" = every linear of the blocks, or
// comma-separated suffixes matched at a dot boundary ("c_proj" matches attn.c_proj and
// mlp.c_proj, "mlp.c_proj" only the second). A suffix matching nothing is an error naming the
// modules there are.
LoraLayout make_lora_layout(const ModelConfig& cfg, const LoraConfig& lora);
// The modules of block 0 an adapter may sit on, without the block prefix ("attn.c_attn", ...).
std::vector<std::string> lora_module_suffixes(const ModelConfig& cfg);

// Workspace LoraAdapters takes for N rows: h and dh (N x rank), and with dropout the dropped
// input and its gradient (N x the widest adapter input).
std::size_t lora_workspace_bytes(const LoraConfig& cfg, const LoraLayout& layout, int N);

// A ~ N(0, 1/rank) (PEFT's "gaussian" init), B = 0, unit by unit through the store.
void init_lora_weights(WeightWindow& store, const LoraLayout& layout, uint64_t seed);

// The adapters' arithmetic inside the blocks (GPT calls it; see model/gpt.h set_lora).
class LoraAdapters {
  public:
    LoraAdapters(const LoraConfig& cfg, const LoraLayout& layout, UnitStore& store,
                 uint64_t dropout_seed);
    const LoraConfig& config() const { return cfg_; }
    const LoraLayout& layout() const { return *layout_; }
    UnitStore& store() { return *store_; }
    // Dropout applies in training only; each micro-batch draws a new mask (forward, recompute
    // and backward of one micro-batch use the same). The engines number micro-batches from the
    // optimizer's step count (step x accumulation + index), so a resumed run draws the masks the
    // uninterrupted run drew.
    void set_training(bool on) { training_ = on; }
    void set_micro_batch(uint64_t i) { micro_batch_ = i; }
    // Workspace for N rows (MemCategory::Workspace); bytes it needs for N.
    void prepare(int N);
    std::size_t workspace_bytes(int N) const { return lora_workspace_bytes(cfg_, *layout_, N); }

    // y (N rows of site.linear_out) += scale * drop(x) A^T B^T on the site's columns; `unit` is
    // the block's adapter unit.
    void forward(const LoraSite& s, const float* unit, const float* x, float* y, int N,
                 int64_t row0 = 0);
    // With dy the linear's output gradient (rows of site.linear_out): dA and dB accumulate into
    // `grads` (the unit's gradients), dx (N, in) += the adapter's share of the input gradient.
    void backward(const LoraSite& s, const float* unit, float* grads, const float* x,
                  const float* dy, float* dx, int N, int64_t row0 = 0);

  private:
    // drop(x) into xd_ (or x itself without dropout).
    const float* dropped(const LoraSite& s, const float* x, int N, int64_t row0);
    float keep_scale(const LoraSite& s, std::size_t i) const;  // 0 or 1 / (1 - p)

    LoraConfig cfg_;
    const LoraLayout* layout_;
    UnitStore* store_;
    uint64_t seed_;
    uint64_t micro_batch_ = 0;
    bool training_ = false;
    int rows_ = 0;
    Buffer<float> xd_, h_, dh_, tmp_;
};

// Merges the adapters into a copy of the base: W[:, col0 + o] += scale * (B A)^T for every site
// (memtrain's (in, out) weights). `base` is the full flat buffer of the model's layout.
void merge_lora(float* base, const ParamLayout& base_layout, const float* adapters,
                const LoraLayout& layout, float scale);

}  // namespace memtrain
