// Host half of the GPU optimizer: the per-tensor pieces of a parameter range and the per-step
// scalars (optim/device_update.h). Plain C++, built everywhere.
#include "optim/device_update.h"

#include <algorithm>
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

std::vector<StateChunk> state_chunks(const ParamLayout& layout, std::size_t offset,
                                     std::size_t count, const std::vector<TensorChunk>& chunks,
                                     StateFormat format, std::size_t* n32, std::size_t* n16) {
    *n32 = count;
    *n16 = 0;
    if (format == StateFormat::Fp32) return {};
    if (format != StateFormat::Bf16)
        fail("optim.state_format = \"{}\" is not built on the GPU (fp32 and bf16 are)",
             state_format_name(format));
    *n32 = 0;
    std::vector<StateChunk> out;
    std::size_t t = 0;
    for (const TensorChunk& c : chunks) {
        const std::size_t at = offset + (std::size_t)c.begin;
        while (t < layout.tensors.size() &&
               layout.tensors[t].offset + layout.tensors[t].numel <= at)
            t++;
        if (t == layout.tensors.size() || layout.tensors[t].offset > at)
            fail("internal: a chunk at {} lies in no tensor", at);
        const bool fp32 = keeps_fp32(format, layout.tensors[t]);
        std::size_t& n = fp32 ? *n32 : *n16;
        out.push_back({(int64_t)n, fp32 ? 1 : 0, 0});
        n += (std::size_t)c.n;
    }
    return out;
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
    return s;
}

}  // namespace memtrain::cuda
