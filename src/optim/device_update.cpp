// Host half of the GPU optimizer: the per-tensor pieces of a parameter range and the per-step
// scalars (optim/device_update.h). Plain C++, built everywhere.
#include "optim/device_update.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/error.h"
#include "optim/optimizer.h"

namespace memtrain::cuda {

namespace {

// Whether tensor t lies in [offset, offset + count): wholly (true) or not at all (false). Part of
// it, or a tensor-parallel slice, fails naming the optimizer's rule (`rule`: "\"muon\"
// orthogonalizes whole matrices").
bool whole_in_range(const ParamSpec& t, std::size_t offset, std::size_t count, const char* rule) {
    const std::size_t lo = std::max(t.offset, offset);
    const std::size_t hi = std::min(t.offset + t.numel, offset + count);
    if (lo >= hi) return false;
    if (lo != t.offset || hi != t.offset + t.numel || t.sliced())
        fail("optim.name = {} on the GPU, and the range [{}, {}) holds part of {}", rule, offset,
             offset + count, t.name);
    return true;
}

}  // namespace

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
                           StateFormat format, int max_n, const std::vector<char>& only) {
    MomentLayout out;
    check_whole_blocks(format, layout, offset, count);
    out.plan = MomentBuffer::plan(format, layout, offset, count, only);
    if (format == StateFormat::Fp32 && only.empty()) {
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

MuonLayout muon_layout(const ParamLayout& layout, std::size_t offset, std::size_t count,
                       StateFormat format, bool shard) {
    MuonLayout m;
    m.matrix = muon_matrices(layout);
    const std::vector<char>& matrix = m.matrix;
    m.rest.resize(matrix.size());
    for (std::size_t i = 0; i < matrix.size(); i++) m.rest[i] = !matrix[i];
    m.adam = moment_layout(layout, offset, count, format, 1 << 16, m.rest);
    m.momentum = moment_layout(layout, offset, count, format, 1 << 16, matrix);
    MomentLayout& mo = m.momentum;
    const bool grid = !mo.grid.empty();
    std::size_t c = 0;  // the next chunk of the momentum
    for (std::size_t i = 0; i < layout.tensors.size(); i++) {
        const ParamSpec& t = layout.tensors[i];
        if (!matrix[i]) continue;
        const std::size_t lo = std::max(t.offset, offset);
        const std::size_t hi = std::min(t.offset + t.numel, offset + count);
        if (shard) {
            if (lo >= hi) continue;
            if (t.sliced())
                fail(
                    "optim.name = \"muon\" on the GPU: a ZeRO shard of {}, a tensor-parallel "
                    "slice",
                    t.name);
        } else if (!whole_in_range(t, offset, count, "\"muon\" orthogonalizes whole matrices")) {
            continue;
        }
        MuonMatrix x{};
        x.begin = (int64_t)t.offset - (int64_t)offset;
        x.tensor = (int32_t)i;
        x.piece = (int64_t)(lo - t.offset);
        x.count = (int64_t)(hi - lo);
        x.rows = (int32_t)t.shape[0];
        x.cols = (int32_t)t.shape[1];
        x.decay = t.decay ? 1 : 0;
        x.first = (int32_t)c;
        // The matrix's chunks: those that start inside it (the layout's order is the buffer's).
        while (c < mo.chunks.size() && mo.chunks[c].begin < x.begin + (int64_t)t.numel) c++;
        x.n = (int32_t)(c - (std::size_t)x.first);
        if (x.n == 0) fail("internal: no momentum chunks for {}", t.name);
        if (grid) {
            const int64_t b0 = mo.grid[(std::size_t)x.first].first_block;
            const int64_t b1 = c < mo.grid.size() ? mo.grid[c].first_block : mo.blocks;
            x.blocks = b1 - b0;
            for (std::size_t k = (std::size_t)x.first; k < c; k++)
                mo.grid[k].first_block -= (int32_t)b0;
        } else {
            x.blocks = x.n;
        }
        m.matrices.push_back(x);
    }
    if (c != mo.chunks.size()) fail("internal: momentum chunks outside the block matrices");
    // The scratch: the range's matrices, or under a shard every matrix of the layout.
    for (std::size_t i = 0; i < layout.tensors.size(); i++) {
        const ParamSpec& t = layout.tensors[i];
        const bool in_range = std::any_of(m.matrices.begin(), m.matrices.end(),
                                          [&](const MuonMatrix& x) { return x.tensor == (int)i; });
        if (!matrix[i] || !(shard || in_range)) continue;
        const std::size_t r = (std::size_t)std::min(t.shape[0], t.shape[1]);
        m.max_numel = std::max(m.max_numel, t.numel);
        m.max_gram = std::max(m.max_gram, r * r);
    }
    return m;
}

std::size_t MuonLayout::shared_bytes(StateFormat format) const {
    return decode_tables(format).size() * sizeof(float) +
           sizeof(float) * 2 * (max_numel + max_gram) + sizeof(double);
}

std::vector<OptimizerPart> optimizer_parts(const ParamLayout& layout, std::size_t offset,
                                           std::size_t count, bool by_unit) {
    if (!by_unit) return {{offset, count}};
    std::vector<OptimizerPart> out;
    for (const ParamUnit& u : layout.units) {
        const std::size_t lo = std::max(u.begin, offset);
        const std::size_t hi = std::min(u.end, offset + count);
        if (lo < hi) out.push_back({lo, hi - lo});
    }
    return out;
}

AdafactorLayout adafactor_layout(const ParamLayout& layout, std::size_t offset, std::size_t count,
                                 bool shard) {
    if (offset > layout.total || count > layout.total - offset)
        fail("internal: Adafactor range [{}, {}) outside the {} parameters", offset, offset + count,
             layout.total);
    AdafactorLayout a;
    for (const ParamSpec& t : layout.tensors) {
        // (A shard leaves a tensor its edge cuts to the gathered step of the whole tensor.)
        const bool whole = t.offset >= offset && t.offset + t.numel <= offset + count;
        if (shard ? !whole || t.numel == 0
                  : !whole_in_range(t, offset, count, "\"adafactor\" steps whole tensors"))
            continue;
        AdafactorTensor e{};
        const bool factored = adafactor_factors(t);
        e.begin = (int64_t)(t.offset - offset);
        e.state = a.state;
        e.rows = factored ? t.shape[0] : 1;
        e.cols = factored ? t.shape[1] : (int64_t)t.numel;
        e.row0 = a.rows;
        e.item0 = a.items;
        e.tile0 = a.tiles;
        e.part0 = a.parts;
        e.factored = factored;
        e.decay = t.decay;
        a.state += (int64_t)adafactor_floats(t);
        a.rows += e.rows;
        a.max_cols = std::max(a.max_cols, e.cols);
        if (factored) {
            const int64_t tiles = (e.cols + kAdafactorTile - 1) / kAdafactorTile;
            const int64_t chunks = (e.rows + kAdafactorChunkRows - 1) / kAdafactorChunkRows;
            a.tiles += tiles;
            a.items += tiles * chunks;
            a.parts += chunks * e.cols;
        }
        a.tensors.push_back(e);
    }
    return a;
}

std::size_t AdafactorLayout::table_bytes() const {
    return tensors.size() * (sizeof(AdafactorTensor) + sizeof(AdafactorScalars)) +
           sizeof(double) * (std::size_t)(rows + parts);
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
    // Adafactor::step_part's.
    s.af_rho = std::min(lr, 1.0 / std::sqrt((double)step));
    s.af_clip = cfg.adafactor_clip;
    s.af_w = (float)std::pow((double)step, cfg.adafactor_beta2_decay);
    // Muon::step_part's.
    s.muon_lr = cfg.muon_lr * (lr / cfg.lr);
    s.muon_decay = (float)(1.0 - s.muon_lr * cfg.weight_decay);
    s.muon_momentum = (float)cfg.muon_momentum;
    return s;
}

}  // namespace memtrain::cuda
