// Option checks, dispatch to the method families, bit packing, half-precision conversion and the
// stored-bits count that every bits-per-weight figure comes from.
#include "quant/quant.h"

#include <bit>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "quant/methods.h"

namespace memtrain::quant {

const float kNf4Levels[16] = {-1.0f,
                              -0.6961928009986877f,
                              -0.5250730514526367f,
                              -0.39491748809814453f,
                              -0.28444138169288635f,
                              -0.18477343022823334f,
                              -0.09105003625154495f,
                              0.0f,
                              0.07958029955625534f,
                              0.16093020141124725f,
                              0.24611230194568634f,
                              0.33791524171829224f,
                              0.44070982933044434f,
                              0.5626170039176941f,
                              0.7229568362236023f,
                              1.0f};

uint64_t Result::stored_bits() const {
    uint64_t bytes = 0;
    for (const auto& p : parts) bytes += p.bytes.size();
    return 8 * bytes;
}

const std::vector<std::string>& method_names() {
    static const std::vector<std::string> names = {"rtn",     "rtn-asym", "nf4",    "nf4-dq",
                                                   "uniform", "kmeans",   "kashin", "kashin-dct"};
    return names;
}

void check_options(const Options& o, int64_t rows, int64_t cols) {
    const auto& m = o.method;
    if (std::find(method_names().begin(), method_names().end(), m) == method_names().end())
        fail(
            "unknown quantization method '{}'; expected one of rtn, rtn-asym, nf4, nf4-dq, "
            "uniform, kmeans, kashin, kashin-dct",
            m);
    if (m == "nf4" || m == "nf4-dq" || m == "kashin-dct") {
        if (o.bits != 4) fail("--method {} stores 4 bits per weight; got --bits {}", m, o.bits);
    } else if (m == "uniform" || m == "kmeans") {
        if (o.bits < 1 || o.bits > 8) fail("--method {} takes --bits 1..8; got {}", m, o.bits);
    } else if (o.bits < 2 || o.bits > 8) {
        fail("--method {} takes --bits 2..8; got {}", m, o.bits);
    }
    const bool grouped = m == "rtn" || m == "rtn-asym" || m == "nf4" || m == "nf4-dq";
    if (o.group != 0 && !grouped)
        fail("--group applies to rtn, rtn-asym, nf4 and nf4-dq, not to --method {}", m);
    if (o.group < 0) fail("--group must be positive; got {}", o.group);
    const int64_t g = (m == "nf4" || m == "nf4-dq") && o.group == 0 ? 64 : o.group;
    if (g > 0 && cols % g != 0)
        fail("--group {} does not divide the row length {} of a {}x{} weight", g, cols, rows, cols);
    if (m == "kashin-dct" && o.max_iter < 4)
        fail("--max-iter must be >= 4 for kashin-dct (blocks of 4 steps); got {}", o.max_iter);
    if (m == "kashin") {
        if (o.max_iter < 1) fail("--max-iter must be >= 1; got {}", o.max_iter);
        if (o.fallback == "kashin") fail("the Kashin fallback method cannot be kashin itself");
        Options f = o;
        f.method = o.fallback;
        f.group = 0;
        check_options(f, rows, cols);
    }
}

Result quantize(const Options& o, MatrixView w) {
    check_options(o, w.rows, w.cols);
    const auto& m = o.method;
    Result r;
    if (m == "rtn" || m == "rtn-asym")
        r = detail::rtn_quantize(w, o.bits, o.group, m == "rtn-asym");
    else if (m == "nf4" || m == "nf4-dq")
        r = detail::nf4_quantize(w, o.group == 0 ? 64 : o.group, m == "nf4-dq");
    else if (m == "uniform")
        r = detail::uniform_quantize(w, o.bits);
    else if (m == "kmeans")
        r = detail::kmeans_quantize(w, o.bits);
    else if (m == "kashin-dct")
        r = detail::kashin_dct_quantize(o, w);
    else
        r = detail::kashin_quantize(o, w);
    return r;
}

std::vector<float> dequantize(const Result& r) {
    const auto& m = r.method;
    if (m == "rtn" || m == "rtn-asym") return detail::rtn_dequantize(r);
    if (m == "nf4" || m == "nf4-dq") return detail::nf4_dequantize(r);
    if (m == "uniform") return detail::uniform_dequantize(r);
    if (m == "kmeans") return detail::kmeans_dequantize(r);
    if (m == "kashin") return detail::kashin_dequantize(r);
    if (m == "kashin-dct") return detail::kashin_dct_dequantize(r);
    fail("cannot dequantize unknown method '{}'", m);
}

std::vector<uint8_t> pack_bits(std::span<const uint32_t> codes, int bits) {
    std::vector<uint8_t> out((codes.size() * (std::size_t)bits + 7) / 8, 0);
    std::size_t pos = 0;
    for (uint32_t c : codes) {
        for (int b = 0; b < bits; b++, pos++)
            if ((c >> b) & 1u) out[pos >> 3] |= (uint8_t)(1u << (pos & 7));
    }
    return out;
}

std::vector<uint32_t> unpack_bits(std::span<const uint8_t> bytes, int bits, std::size_t n) {
    if (bytes.size() * 8 < n * (std::size_t)bits)
        fail("packed codes hold {} bytes, fewer than {} codes of {} bits need", bytes.size(), n,
             bits);
    std::vector<uint32_t> out(n, 0);
    std::size_t pos = 0;
    for (std::size_t i = 0; i < n; i++)
        for (int b = 0; b < bits; b++, pos++)
            out[i] |= (uint32_t)((bytes[pos >> 3] >> (pos & 7)) & 1u) << b;
    return out;
}

float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float v = std::ldexp((float)man, -24);
        return sign ? -v : v;
    }
    if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
    return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f32_to_f16(float x) {
    const uint32_t u = std::bit_cast<uint32_t>(x);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const float a = std::fabs(x);
    if (std::isnan(x)) return (uint16_t)(sign | 0x7e00u);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00u);
    if (a < 6.103515625e-05f) {  // subnormal half: a multiple of 2^-24, rounded to nearest even
        const float q = std::nearbyint(a * 16777216.0f);
        return (uint16_t)(sign | (uint16_t)q);
    }
    const uint32_t au = u & 0x7fffffffu;
    uint32_t h = ((au >> 23) - 112) << 10 | ((au >> 13) & 0x3ffu);
    const uint32_t rest = au & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

uint16_t f32_to_f16_up(float x) {
    uint16_t h = f32_to_f16(x);
    if (f16_to_f32(h) < x) h++;  // positive halves are ordered like their bit patterns
    return h;
}

const StoredPart& part(const Result& r, const std::string& name) {
    for (const auto& p : r.parts)
        if (p.name == name) return p;
    fail("the stored form of method {} has no part '{}'", r.method, name);
}

StoredPart make_part(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
                     std::size_t bytes) {
    StoredPart p{std::move(name), dtype, std::move(shape), std::vector<uint8_t>(bytes)};
    if (bytes) std::memcpy(p.bytes.data(), data, bytes);
    return p;
}

}  // namespace memtrain::quant
