// A frozen base model held quantized in memory (QLoRA): the four linear weights of every block
// packed as int8, int4 or NF4, everything else fp32, and each block decoded to fp32 when the
// model acquires it, into one of a few unit-sized slots (as ZeRO-3 gathers a unit just in time).
// The model reads it like any other UnitStore; it has no gradients and cannot be written.
//
// Example:
//     const quant::BaseQuant q = quant::parse_base_quant("nf4");
//     quant::QuantizedParamStore base(full_model.weights(), q);  // quantized unit by unit
//     GPT model(cfg, &base);
//     model.forward_loss(x, y, B, T);                           // decodes each block once
//     fmt::print("{}\n", base.summary());
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/allocator.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/param_layout.h"
#include "model/unit_store.h"
#include "model/weights.h"
#include "quant/quant.h"

namespace memtrain::quant {

// How the block matrices are stored (m outputs x n inputs each):
//   int8: RTN 8 bits, one fp16 scale per output row        m n + 2 m bytes
//   int4: RTN 4 bits, one fp16 scale per `group` inputs    ceil(m n / 2) + 2 m n / group
//   nf4:  NF4 (nf4-dq), blocks of `group` inputs, the block absmaxes as uint8 codes with one
//         fp32 scale per 256 blocks                        ceil(m n / 2) + m n / group
//                                                            + 4 ceil(m n / group / 256)
enum class BaseFormat { Int8, Int4, Nf4 };

struct BaseQuant {
    BaseFormat format = BaseFormat::Nf4;
    int group = 64;  // int4: inputs per scale; nf4: inputs per absmax block; int8: 0 (per row)
    std::string name() const;  // "int8", "int4 (group 64)", "nf4 (block 64)"
    Options options() const;   // what quant::quantize is asked for
    // Throws memtrain::Error unless `group` divides the input width of every block matrix.
    void check(const ModelConfig& cfg) const;
};

// "int8", "int4" or "nf4"; group 0 takes the default (64 for int4 and nf4). Anything else is a
// one-line memtrain::Error naming the value and what is accepted.
BaseQuant parse_base_quant(std::string_view format, int group = 0);
// What a QLoRA run's lora.base and lora.base_group ask for (int8 keeps one scale per row).
BaseQuant lora_base_quant(const LoraConfig& lora);
// Replaces the weights of a whole model by what a quantized base of format q decodes to (the
// frozen base a QLoRA run trained against).
void round_trip_base(const ModelWeights& weights, const BaseQuant& q);

// Bytes of a quantized base. `packed` and `fp32` are MemCategory::Parameters, `slots`
// MemCategory::Workspace.
struct BaseBytes {
    std::size_t packed = 0;  // codes, scales and absmax codes of the block matrices
    std::size_t fp32 = 0;    // every other tensor (embeddings, norms, biases, lm_head), fp32
    std::size_t slots = 0;   // the decode slots: slots x one block unit, fp32
    std::size_t params() const { return packed + fp32; }
};

// What acquire has done since construction.
struct DecodeStats {
    uint64_t acquires = 0;  // of block units (fp32-only units are never decoded)
    uint64_t decodes = 0;   // acquires that were not already in a slot
    double decode_seconds = 0;
    double quantize_seconds = 0;  // construction and load_unit
};

// Element counts of one packed matrix's arrays (rows = outputs, cols = inputs) under q.
struct PackedSizes {
    std::size_t codes = 0;         // bytes
    std::size_t scales = 0;        // fp16 values (int8, int4)
    std::size_t absmax_q = 0;      // bytes (nf4)
    std::size_t absmax_scale = 0;  // fp32 values (nf4)
    std::size_t bytes() const { return codes + 2 * scales + absmax_q + 4 * absmax_scale; }
};
PackedSizes packed_sizes(const BaseQuant& q, int64_t rows, int64_t cols);

// Whether tensor `t` is one of the matrices a quantized base packs: attn.c_attn, attn.c_proj,
// mlp.c_fc or mlp.c_proj weight of a block.
bool is_packed_matrix(const ParamSpec& t);

// The bytes of QLoRA's base on the GPU (quant/device_base.h) for cfg under q, from the formats
// alone (the plan prices it before the GPU engine exists): the packed matrices, each array
// 4-byte aligned, and every other tensor in elem_bytes; and `slots` decode slots of the largest
// block unit.
inline constexpr int kDeviceBaseSlots = 2;  // QuantizedDeviceBase's decode slots
struct DeviceBaseBytes {
    std::size_t params = 0, slots = 0;
};
DeviceBaseBytes device_base_bytes(const ModelConfig& cfg, const BaseQuant& q, int elem_bytes,
                                  int slots);
// One packed matrix's device bytes: each array starts 4-byte aligned.
std::size_t device_matrix_bytes(const PackedSizes& s);

class QuantizedParamStore final : public UnitStore {
  public:
    static constexpr int kDefaultSlots = 2;

    // An empty base (all weights zero), to be filled with load_unit (or QuantizedStoreWriter).
    QuantizedParamStore(const ModelConfig& cfg, const BaseQuant& q, int slots = kDefaultSlots);
    // The weights of `source`, read and quantized one unit at a time (each unit is acquired once
    // and released), so besides this store only one unit of fp32 and one matrix's quantizer
    // scratch exist at once.
    QuantizedParamStore(const ModelWeights& source, const BaseQuant& q, int slots = kDefaultSlots);

    // Exactly the bytes the store allocates for `cfg` under `q`, computed from the formats.
    static BaseBytes predicted_bytes(const ModelConfig& cfg, const BaseQuant& q,
                                     int slots = kDefaultSlots);
    // The bytes it did allocate (the sizes of its buffers).
    BaseBytes bytes() const;
    const DecodeStats& stats() const { return stats_; }
    // One line: format, bytes against fp32, decodes and their time.
    std::string summary() const;

    const ModelConfig& config() const { return cfg_; }
    const ParamLayout& layout() const { return layout_; }
    const BaseQuant& quant() const { return q_; }

    // Replaces unit u from `values` (layout.units[u].size() floats, layout order, matrices (in,
    // out)): the matrices are quantized, the rest copied. The unit must not be acquired.
    void load_unit(int u, const float* values);
    // The stored form of packed matrix `tensor` (e.g. "h.0.mlp.c_fc.weight") as quant::quantize
    // returns it for the (out, in) matrix, without `dequant`: quant::dequantize decodes it.
    Result stored(std::string_view tensor) const;

    // Unit u as stored, for a copy elsewhere (the CUDA engine's quantized base,
    // model/cuda_quant_base.h): its fp32 runs (a unit without matrices is one run) and its
    // packed matrices, each with its floats' offset from the unit's first.
    struct PlainView {
        std::size_t offset = 0, count = 0;
        const float* values = nullptr;
    };
    struct PackedView {
        std::size_t offset = 0;
        int64_t rows = 0, cols = 0;
        std::span<const uint8_t> codes;
        std::span<const uint16_t> scales;     // int8, int4
        std::span<const uint8_t> absmax_q;    // nf4
        std::span<const float> absmax_scale;  // nf4
    };
    struct UnitView {
        std::vector<PlainView> plain;
        std::vector<PackedView> packed;
    };
    UnitView unit_view(int u) const;
    // NF4's double quantization: absmax codes per fp32 scale.
    static int nf4_dq_block();

    // UnitStore. acquire(u) of a block decodes it into a slot unless a slot holds it already;
    // for_write is an error (frozen). There are no gradients: unit_grads is an error,
    // full_grads and full_params are null, zero_grads and grads_done do nothing.
    float* full_params() override { return nullptr; }
    float* full_grads() override { return nullptr; }
    float* acquire(int u, bool for_write = false) override;
    void release(int u) override;
    float* unit_grads(int u) override;
    void grads_done(int) override {}
    void zero_grads() override {}

  private:
    // One block matrix as the quantizer sees it (rows = outputs, cols = inputs); its fp32 home
    // is the (in, out) tensor at `offset` in the unit.
    struct PackedMatrix {
        std::size_t tensor = 0;  // index in layout_.tensors
        std::size_t offset = 0;  // floats from the unit's first
        int64_t rows = 0, cols = 0;
        Buffer<uint8_t> codes;       // LSB-first bitstream, 8 or 4 bits per weight
        Buffer<uint16_t> scales;     // int8, int4: fp16, rows x (cols / group)
        Buffer<uint8_t> absmax_q;    // nf4: one code per block
        Buffer<float> absmax_scale;  // nf4: one per 256 blocks
        std::size_t bytes() const;
    };
    // A run of fp32 tensors: `count` floats at `offset` in the unit, at `at` in Unit::fp32.
    struct Plain {
        std::size_t offset = 0, count = 0, at = 0;
    };
    struct Unit {
        Buffer<float> fp32;  // the whole unit when it has no matrices, else its plain runs
        std::vector<Plain> plain;
        std::vector<PackedMatrix> packed;
        int held = 0;   // acquires not yet released
        int slot = -1;  // the slot holding it decoded, or -1
    };
    struct Slot {
        Buffer<float> data;  // one block unit, fp32 (Workspace)
        int unit = -1;
        uint64_t last_use = 0;
    };
    void decode(const Unit& unit, float* out) const;
    void decode_matrix(const PackedMatrix& m, float* out) const;
    int free_slot() const;
    Unit& unit_at(int u, const char* what);

    ModelConfig cfg_;
    ParamLayout layout_;
    BaseQuant q_;
    std::vector<Unit> units_;
    std::vector<Slot> slots_;
    uint64_t clock_ = 0;
    DecodeStats stats_;
};

// A write-only UnitStore over a QuantizedParamStore, for loaders that write unit by unit
// through ModelWeights (init_gpt2_weights, load_hf_weights): acquire(u, true) gives one zeroed
// unit-sized fp32 scratch (Workspace), release(u) quantizes it into the store. One unit at a
// time; reading, gradients and nested acquires are errors.
class QuantizedStoreWriter final : public WeightWindow {
  public:
    explicit QuantizedStoreWriter(QuantizedParamStore& target);
    ModelWeights weights() { return {*this, target_->layout(), target_->config()}; }

    float* acquire(int u, bool for_write = false) override;
    void release(int u) override;

  private:
    QuantizedParamStore* target_;
    Buffer<float> scratch_;
    int open_ = -1;
};

}  // namespace memtrain::quant
