// Post-training weight quantization: the methods (RTN, NF4, per-tensor uniform and k-means,
// Kashin-2D), the packed form each one stores, and dequantization from that stored form alone,
// so bits per weight are counted from real bytes. docs/quantization.md describes every format.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace memtrain::quant {

// A weight matrix as the quantizers see it, row-major: one row per OUTPUT channel, holding that
// output's weights over all inputs (nn.Linear's (out, in)). memtrain and GPT-2 store linear
// weights Conv1D-style as (in, out); callers transpose those first, so "per row" always means
// "per output channel" and groups always run along the input dimension.
struct MatrixView {
    const float* data = nullptr;
    int64_t rows = 0, cols = 0;
    int64_t numel() const { return rows * cols; }
};

// One array of the stored form (packed codes, scales, zero points, codebooks, norms, seeds).
struct StoredPart {
    std::string name;
    DType dtype = DType::U8;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
};

struct Options {
    std::string method = "rtn";  // see method_names()
    int bits = 4;
    int group = 0;              // rtn, rtn-asym: 0 = one scale per row; nf4, nf4-dq: block (0 = 64)
    uint64_t seed = 0;          // kashin: Q1, Q2 are regenerated from it
    int max_iter = 200;         // kashin: greedy steps
    double tol = 1e-6;          // kashin: stop when ||X - U - V̂||_F < tol (||X||_F = 1)
    bool kashin_force = false;  // kashin: quantize a non-converged decomposition anyway
    std::string fallback = "rtn";  // kashin: method for tensors that did not converge
};

struct Result {
    std::string method;  // the method whose stored form `parts` is (the fallback's if it fell back)
    int bits = 0, group = 0;
    int64_t rows = 0, cols = 0;
    std::vector<StoredPart> parts;
    std::vector<float> dequant;  // rows * cols, decoded from `parts`
    // Kashin and Kashin-DCT only (Kashin-DCT: residual is relative, steps run in blocks of 4).
    int iterations = 0;
    bool converged = true;
    double residual = 0;  // ||X - U - V̂||_F at the end of the decomposition
    bool fell_back = false;
    uint64_t stored_bits() const;
    double bpw() const { return (double)stored_bits() / (double)(rows * cols); }
};

// The methods `quantize` knows: rtn, rtn-asym, nf4, nf4-dq, uniform, kmeans, kashin, kashin-dct.
const std::vector<std::string>& method_names();
// Throws memtrain::Error (one line naming the option) unless the method knows `bits` and, where
// given, `group` divides the row length `cols` (the input dimension).
void check_options(const Options& o, int64_t rows, int64_t cols);
Result quantize(const Options& o, MatrixView w);
// Decodes a stored form; `r.dequant` is exactly this.
std::vector<float> dequantize(const Result& r);

// ---- building blocks shared by the method files and the tests ----
// b-bit codes packed LSB-first into one bitstream of ceil(n*b/8) bytes.
std::vector<uint8_t> pack_bits(std::span<const uint32_t> codes, int bits);
std::vector<uint32_t> unpack_bits(std::span<const uint8_t> bytes, int bits, std::size_t n);
// IEEE half precision, round to nearest even; and the smallest half >= x (x >= 0), used for
// scales so that absmax / scale never exceeds the largest code.
uint16_t f32_to_f16(float x);
uint16_t f32_to_f16_up(float x);
float f16_to_f32(uint16_t h);
// The part called `name` of r (throws if absent).
const StoredPart& part(const Result& r, const std::string& name);
StoredPart make_part(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
                     std::size_t bytes);
template <typename T>
std::vector<T> part_values(const StoredPart& p) {
    std::vector<T> v(p.bytes.size() / sizeof(T));
    std::copy_n(p.bytes.data(), v.size() * sizeof(T), reinterpret_cast<uint8_t*>(v.data()));
    return v;
}

// The QLoRA NormalFloat4 levels.
extern const float kNf4Levels[16];

}  // namespace memtrain::quant
