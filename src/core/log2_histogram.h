// The magnitudes of a tensor's values, by power of two: how many values have floor(log2|x|) = e
// for every exponent of fp32 (subnormals included), zeros and non-finite values apart. What a
// value would become in fp16 or bf16 after a scale by a power of two follows from the counts
// exactly (train.diagnostics = amp, docs/training.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace memtrain {

struct Log2Histogram {
    static constexpr int kMinExp = -149, kMaxExp = 127;  // fp32's smallest subnormal, largest
    static constexpr int kBins = kMaxExp - kMinExp + 1;
    std::array<int64_t, kBins> bins{};  // bins[e - kMinExp]: finite non-zero values of exponent e
    int64_t zeros = 0, nonfinite = 0, total = 0;

    void add(const float* x, std::size_t n);
    void merge(const Log2Histogram& o);
    // Finite non-zero values with floor(log2|x|) < e, and >= e.
    int64_t below(int e) const;
    int64_t at_or_above(int e) const;
    int64_t at(int e) const {
        return e < kMinExp || e > kMaxExp ? 0 : bins[(std::size_t)(e - kMinExp)];
    }
    // The exponents of the smallest and the largest finite non-zero value (with none: kMaxExp + 1
    // and kMinExp - 1).
    int min_exp() const;
    int max_exp() const;
};

// What scaling a histogram's values by 2^scale_log2 and storing them in fp16 or bf16 does to
// them, as fractions of all values: zero already, flushed to zero (below the format's smallest
// subnormal: fp16 2^-24, bf16 2^-133), and overflowing (fp16 at or above 2^16: the values in
// [65520, 65536) round to inf too and [65504, 65520) to 65504, which a bin cannot tell apart;
// bf16 never, below fp32's range).
struct PrecisionLoss {
    double zero = 0, fp16_underflow = 0, fp16_overflow = 0, bf16_underflow = 0;
};
PrecisionLoss precision_loss(const Log2Histogram& h, int scale_log2);
// The largest power-of-two loss scale (as its log2, at most 24) at which no value reaches 2^16
// in fp16.
int largest_safe_scale_log2(const Log2Histogram& h);

}  // namespace memtrain
