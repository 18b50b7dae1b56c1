// Histograms of log2|x| (see log2_histogram.h).
#include "core/log2_histogram.h"

#include <algorithm>
#include <cstring>

namespace memtrain {

void Log2Histogram::add(const float* x, std::size_t n) {
    total += (int64_t)n;
    for (std::size_t i = 0; i < n; i++) {
        uint32_t b;
        std::memcpy(&b, &x[i], 4);
        const uint32_t exp_bits = (b >> 23) & 0xffu, mant = b & 0x7fffffu;
        if (exp_bits == 0xffu) {
            nonfinite++;
        } else if (exp_bits == 0) {
            if (mant == 0) {
                zeros++;
            } else {  // subnormal: mant x 2^-149, its exponent that of mant's top bit
                int top = 31 - __builtin_clz(mant);
                bins[(std::size_t)top]++;  // exponent top - 149, at index top
            }
        } else {
            bins[(std::size_t)((int)exp_bits - 127 - kMinExp)]++;
        }
    }
}

void Log2Histogram::merge(const Log2Histogram& o) {
    for (int i = 0; i < kBins; i++) bins[(std::size_t)i] += o.bins[(std::size_t)i];
    zeros += o.zeros;
    nonfinite += o.nonfinite;
    total += o.total;
}

int64_t Log2Histogram::below(int e) const {
    int64_t s = 0;
    for (int k = kMinExp; k < std::min(e, kMaxExp + 1); k++) s += at(k);
    return s;
}

int64_t Log2Histogram::at_or_above(int e) const {
    int64_t s = 0;
    for (int k = std::max(e, kMinExp); k <= kMaxExp; k++) s += at(k);
    return s;
}

int Log2Histogram::min_exp() const {
    for (int k = kMinExp; k <= kMaxExp; k++)
        if (at(k)) return k;
    return kMaxExp + 1;
}

int Log2Histogram::max_exp() const {
    for (int k = kMaxExp; k >= kMinExp; k--)
        if (at(k)) return k;
    return kMinExp - 1;
}

PrecisionLoss precision_loss(const Log2Histogram& h, int scale_log2) {
    PrecisionLoss p;
    if (h.total == 0) return p;
    const double n = (double)h.total;
    p.zero = (double)h.zeros / n;
    // x 2^s below 2^-24 <=> exponent of x below -24 - s (the same with -133 for bf16).
    p.fp16_underflow = (double)h.below(-24 - scale_log2) / n;
    p.fp16_overflow = (double)h.at_or_above(16 - scale_log2) / n;
    p.bf16_underflow = (double)h.below(-133 - scale_log2) / n;
    return p;
}

int largest_safe_scale_log2(const Log2Histogram& h) {
    const int top = h.max_exp();
    if (top < Log2Histogram::kMinExp) return 24;
    return std::min(24, 15 - top);
}

}  // namespace memtrain
