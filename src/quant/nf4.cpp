// NormalFloat4 (QLoRA): 16 levels at normal quantiles, scaled by the absmax of each block of
// inputs; with double quantization the absmaxes themselves become 8-bit codes.
#include <cmath>

#include "core/error.h"
#include "quant/methods.h"

namespace memtrain::quant::detail {

namespace {

uint32_t nearest_nf4(float v) {
    uint32_t k = 0;
    while (k < 15 && v > 0.5f * (kNf4Levels[k] + kNf4Levels[k + 1])) k++;
    return k;
}

}  // namespace

Result nf4_quantize(MatrixView w, int block, bool double_quant) {
    Result r;
    r.method = double_quant ? "nf4-dq" : "nf4";
    r.bits = 4;
    r.group = block;
    r.rows = w.rows;
    r.cols = w.cols;
    const int64_t nb = w.numel() / block;
    std::vector<float> absmax((std::size_t)nb);
    for (int64_t b = 0; b < nb; b++) {
        float a = 0;
        for (int64_t j = 0; j < block; j++) a = std::max(a, std::fabs(w.data[b * block + j]));
        absmax[(std::size_t)b] = a;
    }
    if (double_quant) {
        // Unsigned linear 8-bit codes of each absmax, rounded UP so that the decoded absmax is
        // never below the true one and no weight falls outside [-1, 1] after normalizing.
        const int64_t n2 = (nb + kNf4DqBlock - 1) / kNf4DqBlock;
        std::vector<uint8_t> codes((std::size_t)nb);
        std::vector<float> scale2((std::size_t)n2);
        for (int64_t b2 = 0; b2 < n2; b2++) {
            const int64_t lo = b2 * kNf4DqBlock, hi = std::min(nb, lo + kNf4DqBlock);
            float m = 0;
            for (int64_t b = lo; b < hi; b++) m = std::max(m, absmax[(std::size_t)b]);
            const float s = m / 255.0f;
            scale2[(std::size_t)b2] = s;
            for (int64_t b = lo; b < hi; b++) {
                float q = s > 0 ? std::ceil(absmax[(std::size_t)b] / s) : 0.0f;
                q = std::min(q, 255.0f);
                if (q < 255.0f && q * s < absmax[(std::size_t)b]) q += 1;  // float rounding
                codes[(std::size_t)b] = (uint8_t)q;
                absmax[(std::size_t)b] = q * s;
            }
        }
        r.parts.push_back(make_part("absmax_q", DType::U8, {nb}, codes.data(), codes.size()));
        r.parts.push_back(
            make_part("absmax_scale", DType::F32, {n2}, scale2.data(), scale2.size() * 4));
    } else {
        r.parts.push_back(make_part("absmax", DType::F32, {nb}, absmax.data(), absmax.size() * 4));
    }
    std::vector<uint32_t> codes((std::size_t)w.numel());
    for (int64_t b = 0; b < nb; b++) {
        const float a = absmax[(std::size_t)b];
        for (int64_t j = 0; j < block; j++) {
            const int64_t e = b * block + j;
            const float v = a > 0 ? std::clamp(w.data[e] / a, -1.0f, 1.0f) : 0.0f;
            codes[(std::size_t)e] = nearest_nf4(v);
        }
    }
    const auto packed = pack_bits(codes, 4);
    r.parts.insert(r.parts.begin(), make_part("qweight", DType::U8, {(int64_t)packed.size()},
                                              packed.data(), packed.size()));
    r.dequant = nf4_dequantize(r);
    return r;
}

std::vector<float> nf4_dequantize(const Result& r) {
    const int64_t n = r.rows * r.cols, block = r.group, nb = n / block;
    std::vector<float> absmax;
    if (r.method == "nf4-dq") {
        const auto& q = part(r, "absmax_q").bytes;
        const auto s2 = part_values<float>(part(r, "absmax_scale"));
        absmax.resize((std::size_t)nb);
        for (int64_t b = 0; b < nb; b++)
            absmax[(std::size_t)b] = (float)q[(std::size_t)b] * s2[(std::size_t)(b / kNf4DqBlock)];
    } else {
        absmax = part_values<float>(part(r, "absmax"));
    }
    const auto codes = unpack_bits(part(r, "qweight").bytes, 4, (std::size_t)n);
    std::vector<float> out((std::size_t)n);
    for (int64_t e = 0; e < n; e++)
        out[(std::size_t)e] = kNf4Levels[codes[(std::size_t)e]] * absmax[(std::size_t)(e / block)];
    return out;
}

}  // namespace memtrain::quant::detail
