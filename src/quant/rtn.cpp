// Round-to-nearest integer grids: per output channel or per group of inputs (fp16 scales,
// optional integer zero points), and the per-tensor uniform grid of the paper's GLUE baseline.
#include <cmath>

#include "core/error.h"
#include "quant/methods.h"

namespace memtrain::quant::detail {

namespace {

int64_t row_groups(const Result& r) {
    return r.group == 0 ? 1 : r.cols / r.group;
}

}  // namespace

Result rtn_quantize(MatrixView w, int bits, int group, bool asym) {
    Result r;
    r.method = asym ? "rtn-asym" : "rtn";
    r.bits = bits;
    r.group = group;
    r.rows = w.rows;
    r.cols = w.cols;
    const int64_t gsize = group == 0 ? w.cols : group, ng = row_groups(r);
    const int qmax_sym = (1 << (bits - 1)) - 1, levels = (1 << bits) - 1;
    std::vector<uint32_t> codes((std::size_t)w.numel());
    std::vector<uint16_t> scales((std::size_t)(w.rows * ng));
    std::vector<uint8_t> zeros(asym ? scales.size() : 0);
    for (int64_t i = 0; i < w.rows; i++)
        for (int64_t g = 0; g < ng; g++) {
            const float* x = w.data + i * w.cols + g * gsize;
            uint32_t* c = codes.data() + i * w.cols + g * gsize;
            const std::size_t k = (std::size_t)(i * ng + g);
            if (!asym) {
                float amax = 0;
                for (int64_t j = 0; j < gsize; j++) amax = std::max(amax, std::fabs(x[j]));
                // Rounded up to a half, so |x| / scale <= qmax and nothing is clipped.
                scales[k] = f32_to_f16_up(amax / (float)qmax_sym);
                const float s = f16_to_f32(scales[k]);
                for (int64_t j = 0; j < gsize; j++) {
                    const float q = s > 0 ? std::nearbyint(x[j] / s) : 0.0f;
                    c[j] = (uint32_t)((int)std::clamp(q, (float)-qmax_sym, (float)qmax_sym) +
                                      qmax_sym);
                }
            } else {
                float lo = x[0], hi = x[0];
                for (int64_t j = 0; j < gsize; j++)
                    lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
                scales[k] = f32_to_f16_up((hi - lo) / (float)levels);
                const float s = f16_to_f32(scales[k]);
                const float z =
                    s > 0 ? std::clamp(std::nearbyint(-lo / s), 0.0f, (float)levels) : 0.0f;
                zeros[k] = (uint8_t)z;
                for (int64_t j = 0; j < gsize; j++) {
                    const float q = s > 0 ? std::nearbyint(x[j] / s) + z : z;
                    c[j] = (uint32_t)std::clamp(q, 0.0f, (float)levels);
                }
            }
        }
    const auto packed = pack_bits(codes, bits);
    r.parts.push_back(
        make_part("qweight", DType::U8, {(int64_t)packed.size()}, packed.data(), packed.size()));
    r.parts.push_back(
        make_part("scales", DType::F16, {w.rows, ng}, scales.data(), scales.size() * 2));
    if (asym)
        r.parts.push_back(make_part("zeros", DType::U8, {w.rows, ng}, zeros.data(), zeros.size()));
    r.dequant = rtn_dequantize(r);
    return r;
}

std::vector<float> rtn_dequantize(const Result& r) {
    const bool asym = r.method == "rtn-asym";
    const int64_t gsize = r.group == 0 ? r.cols : r.group, ng = row_groups(r);
    const auto codes =
        unpack_bits(part(r, "qweight").bytes, r.bits, (std::size_t)(r.rows * r.cols));
    const auto scales = part_values<uint16_t>(part(r, "scales"));
    const auto zeros = asym ? part(r, "zeros").bytes : std::vector<uint8_t>{};
    const int qmax_sym = (1 << (r.bits - 1)) - 1;
    std::vector<float> out(codes.size());
    for (int64_t i = 0; i < r.rows; i++)
        for (int64_t j = 0; j < r.cols; j++) {
            const std::size_t k = (std::size_t)(i * ng + j / gsize),
                              e = (std::size_t)(i * r.cols + j);
            const float s = f16_to_f32(scales[k]);
            const int z = asym ? zeros[k] : qmax_sym;
            out[e] = (float)((int)codes[e] - z) * s;
        }
    return out;
}

Result uniform_quantize(MatrixView w, int bits) {
    Result r;
    r.method = "uniform";
    r.bits = bits;
    r.rows = w.rows;
    r.cols = w.cols;
    float lo = w.data[0], hi = w.data[0];
    for (int64_t e = 0; e < w.numel(); e++)
        lo = std::min(lo, w.data[e]), hi = std::max(hi, w.data[e]);
    const int levels = (1 << bits) - 1;
    const float step = (hi - lo) / (float)levels;
    std::vector<uint32_t> codes((std::size_t)w.numel());
    for (int64_t e = 0; e < w.numel(); e++) {
        const float q = step > 0 ? std::nearbyint((w.data[e] - lo) / step) : 0.0f;
        codes[(std::size_t)e] = (uint32_t)std::clamp(q, 0.0f, (float)levels);
    }
    const auto packed = pack_bits(codes, bits);
    const float grid[2] = {lo, step};
    r.parts.push_back(
        make_part("qweight", DType::U8, {(int64_t)packed.size()}, packed.data(), packed.size()));
    r.parts.push_back(make_part("grid", DType::F32, {2}, grid, sizeof grid));
    r.dequant = uniform_dequantize(r);
    return r;
}

std::vector<float> uniform_dequantize(const Result& r) {
    const auto codes =
        unpack_bits(part(r, "qweight").bytes, r.bits, (std::size_t)(r.rows * r.cols));
    const auto grid = part_values<float>(part(r, "grid"));
    std::vector<float> out(codes.size());
    for (std::size_t e = 0; e < codes.size(); e++) out[e] = grid[0] + (float)codes[e] * grid[1];
    return out;
}

}  // namespace memtrain::quant::detail
