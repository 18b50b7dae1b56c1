// Host half of the GPU optimizer: the per-tensor pieces of a parameter range and the per-step
// scalars (optim/device_update.h). Plain C++, built everywhere.
#include "optim/device_update.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/error.h"

namespace memtrain::cuda {

std::vector<TensorChunk> tensor_chunks(const ParamLayout& layout, std::size_t offset,
                                       std::size_t count, int max_n) {
    if (max_n < 1) fail("cuda::tensor_chunks: max_n is {}, expected >= 1", max_n);
    if (offset > layout.total || count > layout.total - offset)
        fail("cuda::tensor_chunks: range [{}, {} + {}) is outside the {} parameters", offset,
             offset, count, layout.total);
    std::vector<TensorChunk> chunks;
    const std::size_t end = offset + count;
    for (const ParamSpec& t : layout.tensors) {
        // The same intersection as the CPU optimizer's segments (MomentBuffer), cut into max_n
        // pieces.
        const std::size_t lo = std::max(t.offset, offset);
        const std::size_t hi = std::min(t.offset + t.numel, end);
        for (std::size_t at = lo; at < hi; at += (std::size_t)max_n) {
            const std::size_t n = std::min(hi - at, (std::size_t)max_n);
            chunks.push_back({(int64_t)(at - offset), (int32_t)n, t.decay ? 1 : 0});
        }
    }
    return chunks;
}

MomentLayout moment_layout(const ParamLayout& layout, std::size_t offset, std::size_t count,
                           StateFormat format, int max_n) {
    MomentLayout out;
    check_whole_blocks(format, layout, offset, count);
    out.plan = MomentBuffer::plan(format, layout, offset, count);
    if (format == StateFormat::Fp32) {
        out.chunks = tensor_chunks(layout, offset, count, max_n);
        out.blocks = (int64_t)out.chunks.size();
        return out;
    }
    if (max_n < 1) fail("cuda::moment_layout: max_n is {}, expected >= 1", max_n);
    for (const MomentBuffer::Segment& s : out.plan.segs) {
        const int32_t decay = layout.tensors[s.tensor].decay ? 1 : 0;
        const bool blocks = !s.direct && format != StateFormat::Bf16;
        const bool quantized = format == StateFormat::Int8 || format == StateFormat::Int4;
        if (!blocks) {
            // In pieces of at most max_n: the fp32 store, or the bf16 one.
            for (std::size_t at = 0; at < s.n; at += (std::size_t)max_n) {
                const std::size_t n = std::min(s.n - at, (std::size_t)max_n);
                out.chunks.push_back({(int64_t)(s.begin + at), (int32_t)n, decay});
                out.at.push_back({(int64_t)(s.at + at), s.direct ? 1 : 0, 0});
                if (quantized) out.grid.push_back({(int32_t)out.blocks, 0});
                out.blocks++;
            }
            continue;
        }
        // The whole segment, a CUDA block per quantization block (span and code_offset of
        // block k are computed on the device from the first block's).
        if (s.n > (std::size_t)INT32_MAX || out.blocks + (int64_t)s.blocks > INT32_MAX)
            fail("cuda::moment_layout: {} elements of {} exceed the kernels' 32-bit grid", s.n,
                 layout.tensors[s.tensor].name);
        out.chunks.push_back({(int64_t)s.begin, (int32_t)s.n, decay});
        out.at.push_back({(int64_t)MomentBuffer::code_offset(format, s, 0), 0, (int32_t)s.block0});
        out.grid.push_back({(int32_t)out.blocks, (int32_t)s.first_len});
        out.blocks += (int64_t)s.blocks;
    }
    return out;
}

std::vector<float> decode_tables(StateFormat format) {
    if (format != StateFormat::Int8 && format != StateFormat::Int4) return {};
    const int bits = format == StateFormat::Int8 ? 8 : 4;
    std::vector<float> t(512);
    for (int c = 0; c < 256; c++) {
        t[(std::size_t)c] = decode_code(bits, true, (uint8_t)c);
        t[256 + (std::size_t)c] = decode_code(bits, false, (uint8_t)c);
    }
    return t;
}

QuantMap quant_map(StateFormat format, bool is_signed) {
    if (format != StateFormat::Int8 && format != StateFormat::Int4)
        fail("internal: a code map of {}", state_format_name(format));
    const int bits = format == StateFormat::Int8 ? 8 : 4;
    const CodeMapConstants c = code_map_constants(bits, is_signed);
    return {bits, is_signed ? 1 : 0, c.m, c.bias, c.to_map, c.min_normal, c.sub_scale};
}

StepScalars make_step_scalars(const OptimConfig& cfg, double lr, int64_t step, float loss_scale) {
    if (step < 1) fail("cuda::make_step_scalars: step is {}, expected the 1-based count", step);
    StepScalars s{};
    // AdamW::step's constants: bias corrections in double, then float.
    s.lr = (float)lr;
    s.beta1 = (float)cfg.beta1;
    s.beta2 = (float)cfg.beta2;
    s.eps = (float)cfg.eps;
    s.decay_factor = (float)(1.0 - lr * cfg.weight_decay);
    s.step_size = (float)(lr / (1.0 - std::pow(cfg.beta1, (double)step)));
    s.bc2_sqrt = (float)std::sqrt(1.0 - std::pow(cfg.beta2, (double)step));
    // Sgd::step's.
    s.momentum = (float)cfg.momentum;
    s.weight_decay = (float)cfg.weight_decay;
    s.first_step = step == 1 ? 1 : 0;
    s.nesterov = cfg.nesterov ? 1 : 0;
    s.loss_scale = loss_scale;
    s.max_norm = (float)cfg.grad_clip;
    s.step = step;
    return s;
}

}  // namespace memtrain::cuda
