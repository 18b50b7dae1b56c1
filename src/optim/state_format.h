// How an optimizer stores its moments (optim.state_format): fp32, bf16, or block-quantized 8-
// and 4-bit codes with one fp32 scale per block, and the one place that lays out and prices them.
//
// The rule for what is quantized, on the global tensor (the same at every world size, ZeRO stage
// and pipeline split):
//   - a tensor of fewer than kKeepFp32Below elements (norm gains, biases, small embeddings) keeps
//     fp32 moments in every format;
//   - int8 / int4 blocks are the cells of a grid of block_size(format) elements over the flat
//     parameter buffer, cut where a tensor starts or ends, so a block never holds two tensors;
//   - a ZeRO shard or a ZeRO-1 piece of a pipeline stage starts on a multiple of shard_grain()
//     (256, a multiple of both block sizes), so no block is ever split between ranks: a rank's
//     optimizer quantizes whole blocks with the same scales one process would compute.
//
// Codes: each map is a small float format with subnormals, scaled so its largest code is 1.0,
// and every block is scaled by its largest magnitude, so the block's largest element is stored
// exactly:
//   int8, signed (Adam m, SGD momentum): sign + 4 exponent + 3 mantissa bits;
//   int8, unsigned (Adam v):             5 exponent + 3 mantissa bits;
//   int4, signed:                        sign + 2 exponent + 1 mantissa bit (fp4 E2M1's values);
//   int4, unsigned:                      4 exponent bits (0 and the powers of two 2^-14 .. 1).
// Encoding rounds to the nearest code (ties to even, as fp32 rounding does); an unsigned value
// that is not zero never becomes zero (it takes the smallest code above zero), so Adam's
// denominator never collapses to eps where the gradient was merely small. bf16 rounds to nearest
// even. Within the normal range the relative error is at most 2^-(mantissa bits + 1): 1/16 for
// int8, 1/4 (signed) and 1/3 (unsigned, powers of two) for int4. Decoding a stored block and
// encoding it again gives back the same codes and scale, so a state written out decoded
// (checkpoints) and read back is bitwise the one that was saved.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/dtype.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"

namespace memtrain {

enum class StateFormat { Fp32, Bf16, Int8, Int4 };

// "fp32" | "bf16" | "int8" | "int4"; parse fails (memtrain::Error) naming optim.state_format.
StateFormat parse_state_format(const std::string& s);
const char* state_format_name(StateFormat f);

// Tensors below this many elements keep fp32 moments whatever the format.
inline constexpr std::size_t kKeepFp32Below = 4096;
// Elements per scale: 256 (int8), 128 (int4); 0 for fp32 and bf16, which have no blocks.
std::size_t block_size(StateFormat f);
// What a rank's shard boundaries must be multiples of: 256 for int8 and int4, else 1; the
// second form reads cfg.state_format.
std::size_t shard_grain(StateFormat f);
std::size_t shard_grain(const OptimConfig& cfg);
bool keeps_fp32(StateFormat f, const ParamSpec& t);
// Fails (internal) unless [offset, offset + count) keeps every block of `format` whole: it starts
// and ends on the grid or on a tensor boundary (ZeRO shards and pipeline pieces are cut on
// shard_grain, stages on units), as every optimizer over a range needs.
void check_whole_blocks(StateFormat format, const ParamLayout& layout, std::size_t offset,
                        std::size_t count);
// Bytes per moment per parameter before the fp32 rule for small tensors: 4, 2, 1 + 4/256,
// 0.5 + 4/128 (the planner's per-parameter price).
double moment_bytes_per_param(StateFormat f);

// The value of code c (signed maps: the sign is the top bit) of a map of `bits` (8 or 4); the
// largest code decodes to 1.0.
float decode_code(int bits, bool is_signed, uint8_t c);
// The nearest code to x, with |x| <= 1 (unsigned maps: x >= 0) as the block scaling gives.
uint8_t encode_code(int bits, bool is_signed, float x);
// The constants encode_code rounds with for a map (for kernels that must give its codes): the
// mantissa bits m, the exponent bias, and x in [0, 1] is mapped by x * to_map, normal from
// min_normal, subnormal codes being nearbyint(y * sub_scale).
struct CodeMapConstants {
    int m, bias;
    float to_map, min_normal, sub_scale;
};
CodeMapConstants code_map_constants(int bits, bool is_signed);
// f32_to_bf16 (round to nearest even) and bf16_to_f32 are core/dtype.h's.
// optim.master = "none": bf16 by stochastic rounding. x rounds up (away from zero) to the next
// bf16 with probability equal to its distance from the lower neighbour over their gap, so the
// rounding is unbiased: E[bf16_to_f32(result)] = x. The draw is a hash of (seed, step, index)
// (the element's index in the flat parameter buffer), so a run reproduces from its seed and the
// rounding of an element is the same whichever rank or unit updates it. Not-finite values keep
// their class; a finite value never rounds to infinity.
uint16_t f32_to_bf16_stochastic(float x, uint64_t seed, uint64_t step, uint64_t index);
// The seed of a run's stochastic rounding, from train.seed: the same on every engine, so the CPU
// and the GPU round a run's weights with the same draws.
inline uint64_t bf16_rounding_seed(uint64_t train_seed) {
    return train_seed ^ 0x5EEDB16F00Dull;
}
// The elements [local, local + n) of a shard's flat buffer are the whole model's [global, global
// + n): where a tensor-parallel rank's elements draw their rounding from (dist::tp_index_runs),
// so that they round as one process rounds them.
struct IndexRun {
    std::size_t local = 0, global = 0, n = 0;
};

// One moment (Adam's m or v, SGD's momentum) of the floats [offset, offset + count) of a
// layout's flat buffer, stored in a format. The range is cut into segments, one per tensor piece
// inside it; a segment either is a plain fp32 array (format fp32, or a tensor keeping fp32), which
// direct() returns, or is read and written by blocks through load() and store().
class MomentBuffer {
  public:
    struct Segment {
        std::size_t tensor = 0;  // index into the layout's tensors
        std::size_t begin = 0;   // index into the range of the segment's first element
        std::size_t n = 0;
        bool direct = false;        // plain fp32: direct() points at it
        std::size_t at = 0;         // direct: index into the fp32 store; else into the code store
        std::size_t block0 = 0;     // first block's index into the scales
        std::size_t blocks = 0;     // blocks of the segment (bf16: chunks of 256 for the loops)
        std::size_t first_len = 0;  // elements of its first block (the grid may cut it short)
    };

    MomentBuffer() = default;
    // `only`: per tensor of the layout, whether the moment covers it (empty: every tensor). An
    // optimizer that keeps different state for different tensors (Muon) holds masked moments;
    // what a moment does not cover reads as zero and takes no bytes.
    // `category`: what the memory table counts the bytes under (a checkpoint's scratch decoder
    // is not optimizer state).
    MomentBuffer(StateFormat f, bool is_signed, const ParamLayout& layout, std::size_t offset,
                 std::size_t count, const std::vector<char>& only = {},
                 MemCategory category = MemCategory::OptimizerState);

    StateFormat format() const { return format_; }
    const std::vector<Segment>& segments() const { return segs_; }
    // Block k of a segment: its first element (segment-relative) and its length.
    std::pair<std::size_t, std::size_t> block_span(const Segment& s, std::size_t k) const;
    float* direct(const Segment& s) { return fp32_.data() + s.at; }
    // Decodes / encodes block k of a non-direct segment (at most 256 floats).
    void load(const Segment& s, std::size_t k, float* out) const;
    void store(const Segment& s, std::size_t k, const float* in);
    // The same for every block of a non-direct segment (s.n floats), in parallel.
    void load_segment(const Segment& s, float* out) const;
    void store_segment(const Segment& s, const float* in);

    // The whole range decoded, in order (count floats); and written back from floats.
    void read(float* dst) const;
    void write(const float* src);
    // The single fp32 array holding the whole range, or null when it is stored otherwise.
    const float* whole_fp32() const;
    std::size_t bytes() const;
    // The stored bytes themselves (bytes() of them: the fp32, bf16, code and scale stores in that
    // order), as checkpoints keep them; and the state set from such bytes.
    void save_stored(uint8_t* dst) const;
    void load_stored(const uint8_t* src);

    // Bytes a moment of this format takes over [offset, offset + count), as the constructor
    // allocates them (the memory plan prices optimizer state with it).
    static std::size_t predicted_bytes(StateFormat f, const ParamLayout& layout, std::size_t offset,
                                       std::size_t count, const std::vector<char>& only = {});
    // The segments and store sizes the constructor lays out (nothing allocated): the GPU's
    // optimizer keeps its moments in the same stores, byte for byte.
    struct Plan {
        std::vector<Segment> segs;
        std::size_t fp32 = 0, bf16 = 0, code_bytes = 0, scales = 0;
    };
    static Plan plan(StateFormat f, const ParamLayout& layout, std::size_t offset,
                     std::size_t count, const std::vector<char>& only = {});
    // Block k of a segment of format f (block_span without a buffer), and where its codes start
    // in the code store (int8: one byte a value; int4: two values a byte, each block on its own
    // bytes).
    static std::pair<std::size_t, std::size_t> span(StateFormat f, const Segment& s, std::size_t k);
    static std::size_t code_offset(StateFormat f, const Segment& s, std::size_t k);

  private:
    // The first byte of block k's int4 codes (each block starts on a byte of its own).
    const uint8_t* int4_codes(const Segment& s, std::size_t k) const;
    StateFormat format_ = StateFormat::Fp32;
    bool signed_ = true;
    bool whole_ = false;  // one fp32 array over the whole range (fp32, every tensor)
    std::size_t count_ = 0;
    std::vector<Segment> segs_;
    Buffer<float> fp32_;     // direct segments
    Buffer<uint16_t> bf16_;  // bf16 segments
    Buffer<uint8_t> codes_;  // int8 / int4 segments (int4: two per byte, each block whole bytes)
    Buffer<float> scales_;   // int8 / int4: one per block
};

}  // namespace memtrain
