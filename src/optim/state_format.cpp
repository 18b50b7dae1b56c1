// Moment storage formats (see state_format.h): the code maps, bf16 rounding, and the segment and
// block layout of a MomentBuffer.
#include "optim/state_format.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace memtrain {

StateFormat parse_state_format(const std::string& s) {
    if (s == "fp32") return StateFormat::Fp32;
    if (s == "bf16") return StateFormat::Bf16;
    if (s == "int8") return StateFormat::Int8;
    if (s == "int4") return StateFormat::Int4;
    fail("optim.state_format = \"{}\": expected \"fp32\", \"bf16\", \"int8\" or \"int4\"", s);
}

const char* state_format_name(StateFormat f) {
    switch (f) {
        case StateFormat::Fp32:
            return "fp32";
        case StateFormat::Bf16:
            return "bf16";
        case StateFormat::Int8:
            return "int8";
        case StateFormat::Int4:
            return "int4";
    }
    return "?";
}

std::size_t block_size(StateFormat f) {
    return f == StateFormat::Int8 ? 256 : f == StateFormat::Int4 ? 128 : 0;
}

std::size_t shard_grain(StateFormat f) {
    return block_size(f) ? 256 : 1;
}

double moment_bytes_per_param(StateFormat f) {
    switch (f) {
        case StateFormat::Fp32:
            return 4;
        case StateFormat::Bf16:
            return 2;
        case StateFormat::Int8:
            return 1 + 4.0 / 256;
        case StateFormat::Int4:
            return 0.5 + 4.0 / 128;
    }
    return 4;
}

std::size_t shard_grain(const OptimConfig& cfg) {
    return shard_grain(parse_state_format(cfg.state_format));
}

void check_whole_blocks(StateFormat format, const ParamLayout& layout, std::size_t offset,
                        std::size_t count) {
    const std::size_t B = block_size(format);
    if (!B) return;
    auto on_cut = [&](std::size_t at) {
        if (at % B == 0 || at == layout.total) return true;
        for (const ParamSpec& t : layout.tensors)
            if (t.offset == at || t.offset + t.numel == at) return true;
        return false;
    };
    if (!on_cut(offset) || !on_cut(offset + count))
        fail(
            "internal: optimizer range [{}, {}) splits an optim.state_format = {} block of {} "
            "(shards must be cut on multiples of {})",
            offset, offset + count, state_format_name(format), B, shard_grain(format));
}

bool keeps_fp32(StateFormat f, const ParamSpec& t) {
    // On the global tensor: a tensor-parallel shard's piece follows its whole tensor.
    return f == StateFormat::Fp32 || t.global_numel() < kKeepFp32Below;
}

namespace {

// Every map is a small float format of e exponent and m mantissa bits with subnormals, its
// exponent bias 2^e - 1 so that the largest value is 2 - 2^-m, scaled by 1 / (2 - 2^-m):
//   int8 signed (4, 3), int8 unsigned (5, 3), int4 signed (2, 1) (fp4 E2M1's values 0, 0.5,
//   1, 1.5, 2, 3, 4, 6 over 6), int4 unsigned (4, 0) (0 and the powers of two 2^-14 .. 1).
struct MiniFloat {
    int e, m;
};
MiniFloat mini_float(int bits, bool is_signed) {
    if (bits == 8) return is_signed ? MiniFloat{4, 3} : MiniFloat{5, 3};
    return is_signed ? MiniFloat{2, 1} : MiniFloat{4, 0};
}
float largest(MiniFloat f) {
    return 2.0f - std::ldexp(1.0f, -f.m);
}

// Rounds magnitudes to the nearest code of a map: the fp32 mantissa rounded to m bits, ties to
// even, or a multiple of the subnormal step below the smallest normal.
struct Encoder {
    MiniFloat f;
    int bias;
    float to_map;      // largest(f): a magnitude in [0, 1] times this is in the format's range
    float min_normal;  // 2^(1 - bias)
    float sub_scale;   // 2^(bias - 1 + m): subnormal values in steps of one
    explicit Encoder(MiniFloat mf)
        : f(mf),
          bias((1 << mf.e) - 1),
          to_map(largest(mf)),
          min_normal(std::ldexp(1.0f, 1 - bias)),
          sub_scale(std::ldexp(1.0f, bias - 1 + mf.m)) {}
    // The magnitude bits of the code nearest a in [0, 1].
    uint32_t operator()(float a) const {
        const float y = a * to_map;
        if (y < min_normal) return (uint32_t)std::nearbyint(y * sub_scale);  // 2^m: first normal
        uint32_t u;
        std::memcpy(&u, &y, 4);
        const int shift = 23 - f.m;
        u += (1u << (shift - 1)) - 1 + ((u >> shift) & 1u);
        const int exp = (int)(u >> 23) - 127 + bias;
        return ((uint32_t)exp << f.m) | ((u >> shift) & ((1u << f.m) - 1));
    }
};

const Encoder& encoder(int bits, bool is_signed) {
    static const Encoder e8s(mini_float(8, true)), e8u(mini_float(8, false)),
        e4s(mini_float(4, true)), e4u(mini_float(4, false));
    if (bits == 8) return is_signed ? e8s : e8u;
    return is_signed ? e4s : e4u;
}

// The code of x / scale (|x| <= scale; scale 0: every x is 0).
inline uint8_t encode_scaled(const Encoder& enc, int bits, bool is_signed, float x, float scale) {
    const float a = scale > 0 ? std::fabs(x) / scale : 0.0f;  // a division keeps a <= 1 exactly
    const uint32_t c = enc(a);
    if (!is_signed) return (uint8_t)(c == 0 && a > 0 ? 1 : c);
    if (c == 0) return 0;
    return (uint8_t)(std::signbit(x) ? c | (1u << (bits - 1)) : c);
}

// Decoded values of every code (signed maps: the top bit is the sign), the largest 1.0.
struct DecodeTable {
    std::array<float, 256> v{};
    DecodeTable(int bits, bool is_signed) {
        const MiniFloat f = mini_float(bits, is_signed);
        const int bias = (1 << f.e) - 1, mags = 1 << (f.e + f.m);
        for (int c = 0; c < mags; c++) {
            const int e = c >> f.m, frac = c & ((1 << f.m) - 1);
            const double x = e == 0 ? std::ldexp((double)frac / (1 << f.m), 1 - bias)
                                    : std::ldexp(1 + (double)frac / (1 << f.m), e - bias);
            v[c] = (float)(x / largest(f));
            if (is_signed) v[c | mags] = -v[c];
        }
    }
};

const float* decode_table(int bits, bool is_signed) {
    static const DecodeTable t8s(8, true), t8u(8, false), t4s(4, true), t4u(4, false);
    if (bits == 8) return is_signed ? t8s.v.data() : t8u.v.data();
    return is_signed ? t4s.v.data() : t4u.v.data();
}

}  // namespace

float decode_code(int bits, bool is_signed, uint8_t c) {
    return decode_table(bits, is_signed)[c];
}

CodeMapConstants code_map_constants(int bits, bool is_signed) {
    const Encoder& e = encoder(bits, is_signed);
    return {e.f.m, e.bias, e.to_map, e.min_normal, e.sub_scale};
}

uint8_t encode_code(int bits, bool is_signed, float x) {
    return encode_scaled(encoder(bits, is_signed), bits, is_signed, x, 1.0f);
}

uint16_t f32_to_bf16_stochastic(float x, uint64_t seed, uint64_t step, uint64_t index) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f32_to_bf16(x);  // Inf, NaN
    // A counter-based draw: splitmix64's finaliser over the three coordinates.
    uint64_t z = seed ^ (step * 0xD1B54A32D192ED03ull) ^ (index * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // Adding a uniform 16-bit number to the magnitude's low bits carries into the kept bits with
    // probability (low bits) / 2^16.
    const uint32_t r = (uint32_t)(z >> 48);
    const uint32_t up = (u + r) >> 16;
    if ((up & 0x7f80u) == 0x7f80u) return (uint16_t)(u >> 16);  // would overflow: truncate
    return (uint16_t)up;
}

namespace {

// Loop chunk of bf16 segments (they have no scales; blocks only split the work).
constexpr std::size_t kBf16Chunk = 256;

using SegmentPlan = MomentBuffer::Plan;

std::size_t grid(StateFormat f) {
    return f == StateFormat::Bf16 ? kBf16Chunk : block_size(f);
}

// Bytes of int4 codes of a segment whose first block has first_len elements (each block starts
// on a byte of its own).
std::size_t int4_bytes(std::size_t n, std::size_t first_len, std::size_t B) {
    if (n == 0) return 0;
    const std::size_t rest = n - first_len;
    return (first_len + 1) / 2 + (rest / B) * (B / 2) + ((rest % B) + 1) / 2;
}

SegmentPlan plan_segments(StateFormat f, const ParamLayout& layout, std::size_t offset,
                          std::size_t count, const std::vector<char>& only) {
    if (!only.empty() && only.size() != layout.tensors.size())
        fail("internal: a moment's tensor mask has {} entries for {} tensors", only.size(),
             layout.tensors.size());
    if (offset > layout.total || count > layout.total - offset)
        fail("internal: moment range [{}, {} + {}) is outside the {} parameters", offset, offset,
             count, layout.total);
    SegmentPlan p;
    // fp32 over every tensor: one array over the range, gaps included.
    const bool whole = f == StateFormat::Fp32 && only.empty();
    if (whole) p.fp32 = count;
    const std::size_t B = grid(f);
    for (std::size_t ti = 0; ti < layout.tensors.size(); ti++) {
        const ParamSpec& t = layout.tensors[ti];
        if (!only.empty() && !only[ti]) continue;
        const std::size_t lo = std::max(t.offset, offset);
        const std::size_t hi = std::min(t.offset + t.numel, offset + count);
        if (lo >= hi) continue;
        MomentBuffer::Segment s;
        s.tensor = ti;
        s.begin = lo - offset;
        s.n = hi - lo;
        s.direct = keeps_fp32(f, t);
        if (s.direct) {
            s.at = whole ? s.begin : p.fp32;
            if (!whole) p.fp32 += s.n;
        } else {
            s.first_len = std::min(s.n, B - lo % B);
            s.blocks = 1 + (s.n - s.first_len + B - 1) / B;
            if (f == StateFormat::Bf16) {
                s.at = p.bf16;
                p.bf16 += s.n;
            } else {
                s.at = p.code_bytes;
                s.block0 = p.scales;
                p.code_bytes += f == StateFormat::Int8 ? s.n : int4_bytes(s.n, s.first_len, B);
                p.scales += s.blocks;
            }
        }
        p.segs.push_back(s);
    }
    return p;
}

}  // namespace

MomentBuffer::MomentBuffer(StateFormat f, bool is_signed, const ParamLayout& layout,
                           std::size_t offset, std::size_t count, const std::vector<char>& only,
                           MemCategory category)
    : format_(f),
      signed_(is_signed),
      whole_(f == StateFormat::Fp32 && only.empty()),
      count_(count) {
    SegmentPlan p = plan_segments(f, layout, offset, count, only);
    segs_ = std::move(p.segs);
    if (p.fp32) fp32_ = Buffer<float>(p.fp32, category);
    if (p.bf16) bf16_ = Buffer<uint16_t>(p.bf16, category);
    if (p.code_bytes) codes_ = Buffer<uint8_t>(p.code_bytes, category);
    if (p.scales) scales_ = Buffer<float>(p.scales, category);
    // Zero codes decode to zero in every map with a zero scale, as a fresh fp32 state is zero.
}

MomentBuffer::Plan MomentBuffer::plan(StateFormat f, const ParamLayout& layout, std::size_t offset,
                                      std::size_t count, const std::vector<char>& only) {
    return plan_segments(f, layout, offset, count, only);
}

std::pair<std::size_t, std::size_t> MomentBuffer::span(StateFormat f, const Segment& s,
                                                       std::size_t k) {
    if (k == 0) return {0, s.first_len};
    const std::size_t B = grid(f);
    const std::size_t start = s.first_len + (k - 1) * B;
    return {start, std::min(B, s.n - start)};
}

std::size_t MomentBuffer::code_offset(StateFormat f, const Segment& s, std::size_t k) {
    if (f == StateFormat::Int8) return s.at + span(f, s, k).first;
    const std::size_t full = block_size(StateFormat::Int4) / 2;  // bytes of a whole block
    return s.at + (k == 0 ? 0 : (s.first_len + 1) / 2 + (k - 1) * full);
}

std::size_t MomentBuffer::predicted_bytes(StateFormat f, const ParamLayout& layout,
                                          std::size_t offset, std::size_t count,
                                          const std::vector<char>& only) {
    const SegmentPlan p = plan_segments(f, layout, offset, count, only);
    return 4 * p.fp32 + 2 * p.bf16 + p.code_bytes + 4 * p.scales;
}

std::size_t MomentBuffer::bytes() const {
    return fp32_.bytes() + bf16_.bytes() + codes_.bytes() + scales_.bytes();
}

void MomentBuffer::save_stored(uint8_t* dst) const {
    for (auto [data, n] : {std::pair{(const void*)fp32_.data(), fp32_.bytes()},
                           std::pair{(const void*)bf16_.data(), bf16_.bytes()},
                           std::pair{(const void*)codes_.data(), codes_.bytes()},
                           std::pair{(const void*)scales_.data(), scales_.bytes()}}) {
        if (n) std::memcpy(dst, data, n);
        dst += n;
    }
}

void MomentBuffer::load_stored(const uint8_t* src) {
    for (auto [data, n] : {std::pair{(void*)fp32_.data(), fp32_.bytes()},
                           std::pair{(void*)bf16_.data(), bf16_.bytes()},
                           std::pair{(void*)codes_.data(), codes_.bytes()},
                           std::pair{(void*)scales_.data(), scales_.bytes()}}) {
        if (n) std::memcpy(data, src, n);
        src += n;
    }
}

const float* MomentBuffer::whole_fp32() const {
    return whole_ ? fp32_.data() : nullptr;
}

std::pair<std::size_t, std::size_t> MomentBuffer::block_span(const Segment& s,
                                                             std::size_t k) const {
    return span(format_, s, k);
}

void MomentBuffer::load(const Segment& s, std::size_t k, float* out) const {
    const auto [start, len] = block_span(s, k);
    if (format_ == StateFormat::Bf16) {
        const uint16_t* h = bf16_.data() + s.at + start;
        for (std::size_t i = 0; i < len; i++) out[i] = bf16_to_f32(h[i]);
        return;
    }
    const float scale = scales_[s.block0 + k];
    const float* table = decode_table(format_ == StateFormat::Int8 ? 8 : 4, signed_);
    if (format_ == StateFormat::Int8) {
        const uint8_t* c = codes_.data() + s.at + start;
        for (std::size_t i = 0; i < len; i++) out[i] = table[c[i]] * scale;
        return;
    }
    const uint8_t* c = int4_codes(s, k);
    for (std::size_t i = 0; i < len; i++) {
        out[i] = table[(c[i / 2] >> (4 * (i % 2))) & 0xf] * scale;
    }
}

void MomentBuffer::store(const Segment& s, std::size_t k, const float* in) {
    const auto [start, len] = block_span(s, k);
    if (format_ == StateFormat::Bf16) {
        uint16_t* h = bf16_.data() + s.at + start;
        for (std::size_t i = 0; i < len; i++) h[i] = f32_to_bf16(in[i]);
        return;
    }
    // The block's largest magnitude; a value that is not finite makes the scale NaN, so the
    // whole block decodes to NaN and the run's non-finite checks see it (never silently zero).
    float scale = 0;
    bool finite = true;
    for (std::size_t i = 0; i < len; i++) {
        finite = finite && std::isfinite(in[i]);
        scale = std::max(scale, std::fabs(in[i]));
    }
    if (!finite) scale = std::numeric_limits<float>::quiet_NaN();
    scales_[s.block0 + k] = scale;
    const int bits = format_ == StateFormat::Int8 ? 8 : 4;
    const Encoder& enc = encoder(bits, signed_);
    auto code = [&](float x) { return encode_scaled(enc, bits, signed_, x, scale); };
    if (format_ == StateFormat::Int8) {
        uint8_t* c = codes_.data() + s.at + start;
        for (std::size_t i = 0; i < len; i++) c[i] = code(in[i]);
        return;
    }
    uint8_t* c = const_cast<uint8_t*>(int4_codes(s, k));
    for (std::size_t i = 0; i < len; i += 2) {
        const uint8_t lo = code(in[i]);
        const uint8_t hi = i + 1 < len ? code(in[i + 1]) : 0;
        c[i / 2] = (uint8_t)(lo | (hi << 4));
    }
}

const uint8_t* MomentBuffer::int4_codes(const Segment& s, std::size_t k) const {
    return codes_.data() + code_offset(StateFormat::Int4, s, k);
}

void MomentBuffer::load_segment(const Segment& s, float* out) const {
#pragma omp parallel for schedule(static)
    for (std::size_t k = 0; k < s.blocks; k++) load(s, k, out + block_span(s, k).first);
}

void MomentBuffer::store_segment(const Segment& s, const float* in) {
#pragma omp parallel for schedule(static)
    for (std::size_t k = 0; k < s.blocks; k++) store(s, k, in + block_span(s, k).first);
}

void MomentBuffer::read(float* dst) const {
    if (const float* p = whole_fp32()) {
        std::copy(p, p + fp32_.size(), dst);
        return;
    }
    std::fill(dst, dst + count_, 0.0f);  // what no segment covers reads as zero
    for (const Segment& s : segs_) {
        if (s.direct) {
            std::copy(fp32_.data() + s.at, fp32_.data() + s.at + s.n, dst + s.begin);
            continue;
        }
        load_segment(s, dst + s.begin);
    }
}

void MomentBuffer::write(const float* src) {
    if (whole_) {
        std::copy(src, src + fp32_.size(), fp32_.data());
        return;
    }
    for (const Segment& s : segs_) {
        if (s.direct) {
            std::copy(src + s.begin, src + s.begin + s.n, fp32_.data() + s.at);
            continue;
        }
        store_segment(s, src + s.begin);
    }
}

}  // namespace memtrain
