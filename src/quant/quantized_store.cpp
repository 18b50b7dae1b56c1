// The quantized frozen base (see quantized_store.h): packing each block matrix with
// quant::quantize, and decoding it back straight into memtrain's (in, out) layout with the same
// arithmetic as quant::dequantize, so a decoded unit is bitwise what dequantize gives.
#include "quant/quantized_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "quant/methods.h"

namespace memtrain::quant {

PackedSizes packed_sizes(const BaseQuant& q, int64_t rows, int64_t cols) {
    const auto n = (std::size_t)(rows * cols);
    PackedSizes s;
    switch (q.format) {
        case BaseFormat::Int8:
            s.codes = n;
            s.scales = (std::size_t)rows;
            break;
        case BaseFormat::Int4:
            s.codes = (n * 4 + 7) / 8;
            s.scales = n / (std::size_t)q.group;
            break;
        case BaseFormat::Nf4:
            s.codes = (n * 4 + 7) / 8;
            s.absmax_q = n / (std::size_t)q.group;
            s.absmax_scale = (s.absmax_q + detail::kNf4DqBlock - 1) / detail::kNf4DqBlock;
            break;
    }
    return s;
}

namespace {

// (rows, cols) of the quantizer's view of a memtrain (in, out) weight.
int64_t out_dim(const ParamSpec& t) {
    return t.shape[1];
}
int64_t in_dim(const ParamSpec& t) {
    return t.shape[0];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Decodes an (out, in) = (rows, cols) matrix into its (in, out) home `out`, 64 x 64 at a time:
// seg(i, j0, j1, k, dst) writes quantizer elements (i, j0 .. j1 - 1), which share scale or block
// k (row-major over the matrix), to dst[0 .. j1 - j0] of a tile in L1, row by row with
// contiguous reads and writes; the tile is then written out transposed.
template <typename Seg>
void decode_tiles(int64_t rows, int64_t cols, int64_t group, float* out, Seg seg) {
    constexpr int64_t kTile = 64;
    const int64_t ti = (rows + kTile - 1) / kTile, tj = (cols + kTile - 1) / kTile;
    const int64_t ng = cols / group;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ti * tj; t++) {
        alignas(64) float tile[kTile * kTile];
        const int64_t i0 = t / tj * kTile, j0 = t % tj * kTile;
        const int64_t i1 = std::min(rows, i0 + kTile), j1 = std::min(cols, j0 + kTile);
        for (int64_t i = i0; i < i1; i++)
            for (int64_t j = j0; j < j1;) {
                const int64_t g = j / group, end = std::min(j1, (g + 1) * group);
                seg(i, j, end, i * ng + g, tile + (i - i0) * kTile + (j - j0));
                j = end;
            }
        for (int64_t j = j0; j < j1; j++)
            for (int64_t i = i0; i < i1; i++) out[j * rows + i] = tile[(i - i0) * kTile + (j - j0)];
    }
}

// Elements e .. e + n - 1 of a 4-bit LSB-first bitstream (element e in the low nibble of byte
// e / 2 when e is even), each mapped through `lut`.
void decode_nibbles(const uint8_t* codes, int64_t e, int64_t n, const float* lut, float* dst) {
    int64_t t = 0;
    if (e & 1) dst[t++] = lut[codes[e >> 1] >> 4];
    const uint8_t* p = codes + ((e + t) >> 1);
    for (; t + 1 < n; t += 2, p++) {
        dst[t] = lut[*p & 15];
        dst[t + 1] = lut[*p >> 4];
    }
    if (t < n) dst[t] = lut[*p & 15];
}

}  // namespace

// ---- formats ----------------------------------------------------------------------------------

std::string BaseQuant::name() const {
    switch (format) {
        case BaseFormat::Int8:
            return "int8";
        case BaseFormat::Int4:
            return fmt::format("int4 (group {})", group);
        case BaseFormat::Nf4:
            return fmt::format("nf4 (block {})", group);
    }
    return "?";
}

Options BaseQuant::options() const {
    Options o;
    o.method = format == BaseFormat::Nf4 ? "nf4-dq" : "rtn";
    o.bits = format == BaseFormat::Int8 ? 8 : 4;
    o.group = format == BaseFormat::Int8 ? 0 : group;
    return o;
}

void BaseQuant::check(const ModelConfig& cfg) const {
    if (format == BaseFormat::Int8) {
        if (group != 0)
            fail("quantized base int8 keeps one scale per output row; got group {}", group);
        return;
    }
    if (group <= 0) fail("quantized base {}: the group must be positive; got {}", name(), group);
    const int widths[2] = {cfg.n_embd, cfg.mlp_hidden()};
    const char* what[2] = {"attn.c_attn, attn.c_proj and mlp.c_fc (n_embd)",
                           "mlp.c_proj (the MLP hidden size)"};
    for (int k = 0; k < 2; k++)
        if (widths[k] % group != 0)
            fail("quantized base {}: group {} does not divide the input width {} of {}", name(),
                 group, widths[k], what[k]);
}

BaseQuant parse_base_quant(std::string_view format, int group) {
    BaseQuant q;
    if (format == "int8") {
        if (group != 0)
            fail(
                "base format int8 keeps one scale per output row; a group ({}) applies to int4 "
                "and nf4 only",
                group);
        q.format = BaseFormat::Int8;
        q.group = 0;
        return q;
    }
    if (format == "int4")
        q.format = BaseFormat::Int4;
    else if (format == "nf4")
        q.format = BaseFormat::Nf4;
    else
        fail("unknown base quantization format '{}'; expected int8, int4 or nf4", format);
    if (group < 0) fail("base format {}: the group must be positive; got {}", format, group);
    q.group = group == 0 ? 64 : group;
    return q;
}

bool is_packed_matrix(const ParamSpec& t) {
    if (!t.name.starts_with("h.") || t.shape.size() != 2) return false;
    for (const char* s :
         {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
        if (t.name.ends_with(s)) return true;
    return false;
}

// ---- the store --------------------------------------------------------------------------------

std::size_t QuantizedParamStore::PackedMatrix::bytes() const {
    return codes.bytes() + scales.bytes() + absmax_q.bytes() + absmax_scale.bytes();
}

QuantizedParamStore::QuantizedParamStore(const ModelConfig& cfg, const BaseQuant& q, int slots)
    : cfg_(cfg), q_(q) {
    cfg_.validate();
    q_.check(cfg_);
    if (slots < 1) fail("internal: a quantized base needs at least one decode slot; got {}", slots);
    layout_ = make_param_layout(cfg_);
    constexpr MemCategory P = MemCategory::Parameters;
    units_.resize(layout_.units.size());
    std::size_t block_floats = 0;
    for (std::size_t u = 0; u < units_.size(); u++) {
        const ParamUnit& pu = layout_.units[u];
        Unit& un = units_[u];
        std::size_t plain = 0;
        for (std::size_t i = pu.first_tensor; i < pu.last_tensor; i++) {
            const ParamSpec& t = layout_.tensors[i];
            const std::size_t offset = t.offset - pu.begin;
            if (is_packed_matrix(t)) {
                PackedMatrix m;
                m.tensor = i;
                m.offset = offset;
                m.rows = out_dim(t);
                m.cols = in_dim(t);
                const PackedSizes s = packed_sizes(q_, m.rows, m.cols);
                m.codes = Buffer<uint8_t>(s.codes, P);
                if (s.scales) m.scales = Buffer<uint16_t>(s.scales, P);
                if (s.absmax_q) m.absmax_q = Buffer<uint8_t>(s.absmax_q, P);
                if (s.absmax_scale) m.absmax_scale = Buffer<float>(s.absmax_scale, P);
                un.packed.push_back(std::move(m));
                continue;
            }
            // Consecutive fp32 tensors form one run.
            if (!un.plain.empty() && un.plain.back().offset + un.plain.back().count == offset)
                un.plain.back().count += t.numel;
            else
                un.plain.push_back({offset, t.numel, plain});
            plain += t.numel;
        }
        un.fp32 = Buffer<float>(plain, P);
        if (!un.packed.empty()) block_floats = std::max(block_floats, pu.size());
    }
    slots_.resize((std::size_t)slots);
    for (Slot& s : slots_) s.data = Buffer<float>(block_floats, MemCategory::Workspace);
}

QuantizedParamStore::QuantizedParamStore(const ModelWeights& source, const BaseQuant& q, int slots)
    : QuantizedParamStore(source.cfg, q, slots) {
    for (int u = 0; u < (int)layout_.units.size(); u++) {
        const float* values = source.store.acquire(u);
        try {
            load_unit(u, values);
        } catch (...) {
            source.store.release(u);
            throw;
        }
        source.store.release(u);
    }
}

BaseBytes QuantizedParamStore::predicted_bytes(const ModelConfig& cfg, const BaseQuant& q,
                                               int slots) {
    q.check(cfg);
    const ParamLayout layout = make_param_layout(cfg);
    BaseBytes b;
    std::size_t block_floats = 0;
    for (const ParamUnit& u : layout.units) {
        bool packed = false;
        for (std::size_t i = u.first_tensor; i < u.last_tensor; i++) {
            const ParamSpec& t = layout.tensors[i];
            if (is_packed_matrix(t)) {
                b.packed += packed_sizes(q, out_dim(t), in_dim(t)).bytes();
                packed = true;
            } else {
                b.fp32 += 4 * t.numel;
            }
        }
        if (packed) block_floats = std::max(block_floats, u.size());
    }
    b.slots = 4 * block_floats * (std::size_t)slots;
    return b;
}

std::size_t device_matrix_bytes(const PackedSizes& s) {
    auto round4 = [](std::size_t n) { return (n + 3) / 4 * 4; };
    return round4(s.codes) + round4(2 * s.scales) + round4(s.absmax_q) + 4 * s.absmax_scale;
}

DeviceBaseBytes device_base_bytes(const ModelConfig& cfg, const BaseQuant& q, int elem_bytes,
                                  int slots) {
    q.check(cfg);
    const ParamLayout layout = make_param_layout(cfg);
    DeviceBaseBytes b;
    std::size_t plain = 0, block = 0;
    for (const ParamUnit& u : layout.units) {
        bool packed = false;
        for (std::size_t i = u.first_tensor; i < u.last_tensor; i++) {
            const ParamSpec& t = layout.tensors[i];
            if (is_packed_matrix(t)) {
                b.params += device_matrix_bytes(packed_sizes(q, t.shape[1], t.shape[0]));
                packed = true;
            } else {
                plain += t.numel;
            }
        }
        if (packed) block = std::max(block, u.size());
    }
    b.params += plain * (std::size_t)elem_bytes;
    b.slots = (std::size_t)slots * block * (std::size_t)elem_bytes;
    return b;
}

BaseBytes QuantizedParamStore::bytes() const {
    BaseBytes b;
    for (const Unit& un : units_) {
        b.fp32 += un.fp32.bytes();
        for (const PackedMatrix& m : un.packed) b.packed += m.bytes();
    }
    for (const Slot& s : slots_) b.slots += s.data.bytes();
    return b;
}

std::string QuantizedParamStore::summary() const {
    const BaseBytes b = bytes();
    std::size_t packed_weights = 0;
    for (const Unit& un : units_)
        for (const PackedMatrix& m : un.packed) packed_weights += (std::size_t)(m.rows * m.cols);
    const double mib = 1.0 / (1 << 20);
    return fmt::format(
        "quantized base {}: {:.1f} MiB ({:.1f} MiB packed at {:.3f} bits per weight + {:.1f} MiB "
        "fp32) vs {:.1f} MiB fp32; {} decode slots {:.1f} MiB; {} decodes for {} block acquires "
        "({:.1f} ms)",
        q_.name(), b.params() * mib, b.packed * mib,
        packed_weights ? 8.0 * (double)b.packed / (double)packed_weights : 0.0, b.fp32 * mib,
        4.0 * (double)layout_.total * mib, slots_.size(), b.slots * mib, stats_.decodes,
        stats_.acquires, 1e3 * stats_.decode_seconds);
}

QuantizedParamStore::UnitView QuantizedParamStore::unit_view(int u) const {
    if (u < 0 || u >= (int)units_.size())
        fail("internal: QuantizedParamStore::unit_view({}) of {} units", u, units_.size());
    const Unit& un = units_[(std::size_t)u];
    UnitView v;
    if (un.packed.empty()) {
        v.plain.push_back({0, un.fp32.size(), un.fp32.data()});
        return v;
    }
    for (const Plain& p : un.plain) v.plain.push_back({p.offset, p.count, un.fp32.data() + p.at});
    for (const PackedMatrix& m : un.packed)
        v.packed.push_back({m.offset, m.rows, m.cols,
                            std::span<const uint8_t>(m.codes.data(), m.codes.size()),
                            std::span<const uint16_t>(m.scales.data(), m.scales.size()),
                            std::span<const uint8_t>(m.absmax_q.data(), m.absmax_q.size()),
                            std::span<const float>(m.absmax_scale.data(), m.absmax_scale.size())});
    return v;
}

int QuantizedParamStore::nf4_dq_block() {
    return (int)detail::kNf4DqBlock;
}

QuantizedParamStore::Unit& QuantizedParamStore::unit_at(int u, const char* what) {
    if (u < 0 || u >= (int)units_.size())
        fail("internal: {} of unit {} of a quantized base with {} units", what, u, units_.size());
    return units_[(std::size_t)u];
}

void QuantizedParamStore::load_unit(int u, const float* values) {
    Unit& un = unit_at(u, "load_unit");
    if (un.held > 0)
        fail("internal: unit {} ({}) of the quantized base is loaded while acquired", u,
             layout_.units[(std::size_t)u].name);
    const auto t0 = std::chrono::steady_clock::now();
    if (un.slot >= 0) {  // the decoded copy is stale
        slots_[(std::size_t)un.slot].unit = -1;
        un.slot = -1;
    }
    for (const Plain& p : un.plain)
        std::memcpy(un.fp32.data() + p.at, values + p.offset, p.count * sizeof(float));
    const Options opt = q_.options();
    std::vector<float> w;
    for (PackedMatrix& m : un.packed) {
        // (in, out) -> (out, in), one matrix at a time.
        w.resize((std::size_t)(m.rows * m.cols));
        const float* src = values + m.offset;
        for (int64_t j = 0; j < m.cols; j++)
            for (int64_t i = 0; i < m.rows; i++)
                w[(std::size_t)(i * m.cols + j)] = src[j * m.rows + i];
        const Result r = quantize(opt, {w.data(), m.rows, m.cols});
        auto put = [&](const char* name, void* dst, std::size_t bytes) {
            const StoredPart& p = part(r, name);
            if (p.bytes.size() != bytes)
                fail("internal: {} of {} holds {} bytes, the quantized base expected {}", name,
                     layout_.tensors[m.tensor].name, p.bytes.size(), bytes);
            std::memcpy(dst, p.bytes.data(), bytes);
        };
        put("qweight", m.codes.data(), m.codes.bytes());
        if (q_.format == BaseFormat::Nf4) {
            put("absmax_q", m.absmax_q.data(), m.absmax_q.bytes());
            put("absmax_scale", m.absmax_scale.data(), m.absmax_scale.bytes());
        } else {
            put("scales", m.scales.data(), m.scales.bytes());
        }
    }
    stats_.quantize_seconds += seconds_since(t0);
}

Result QuantizedParamStore::stored(std::string_view tensor) const {
    for (const Unit& un : units_)
        for (const PackedMatrix& m : un.packed) {
            if (layout_.tensors[m.tensor].name != tensor) continue;
            const Options o = q_.options();
            Result r;
            r.method = o.method;
            r.bits = o.bits;
            r.group = o.group;
            r.rows = m.rows;
            r.cols = m.cols;
            r.parts.push_back(make_part("qweight", DType::U8, {(int64_t)m.codes.size()},
                                        m.codes.data(), m.codes.bytes()));
            if (q_.format == BaseFormat::Nf4) {
                r.parts.push_back(make_part("absmax_q", DType::U8, {(int64_t)m.absmax_q.size()},
                                            m.absmax_q.data(), m.absmax_q.bytes()));
                r.parts.push_back(make_part("absmax_scale", DType::F32,
                                            {(int64_t)m.absmax_scale.size()}, m.absmax_scale.data(),
                                            m.absmax_scale.bytes()));
            } else {
                const int64_t ng = o.group == 0 ? 1 : m.cols / o.group;
                r.parts.push_back(make_part("scales", DType::F16, {m.rows, ng}, m.scales.data(),
                                            m.scales.bytes()));
            }
            return r;
        }
    fail("internal: '{}' is not a packed matrix of the quantized base", tensor);
}

void QuantizedParamStore::decode_matrix(const PackedMatrix& m, float* out) const {
    // Each value is computed as quant::dequantize computes it, operation for operation (the
    // 16-entry tables hold exactly those products), so the floats are the same bits.
    const int64_t rows = m.rows, cols = m.cols;
    const uint8_t* codes = m.codes.data();
    switch (q_.format) {
        case BaseFormat::Int8: {
            const uint16_t* scales = m.scales.data();
            decode_tiles(rows, cols, cols, out,
                         [&](int64_t i, int64_t j0, int64_t j1, int64_t k, float* dst) {
                             const float s = f16_to_f32(scales[k]);
                             const uint8_t* c = codes + i * cols + j0;
                             for (int64_t t = 0; t < j1 - j0; t++)
                                 dst[t] = (float)((int)c[t] - 127) * s;
                         });
            break;
        }
        case BaseFormat::Int4: {
            const uint16_t* scales = m.scales.data();
            decode_tiles(rows, cols, q_.group, out,
                         [&](int64_t i, int64_t j0, int64_t j1, int64_t k, float* dst) {
                             const float s = f16_to_f32(scales[k]);
                             float lut[16];
                             for (int c = 0; c < 16; c++) lut[c] = (float)(c - 7) * s;
                             decode_nibbles(codes, i * cols + j0, j1 - j0, lut, dst);
                         });
            break;
        }
        case BaseFormat::Nf4: {
            const uint8_t* aq = m.absmax_q.data();
            const float* as = m.absmax_scale.data();
            decode_tiles(rows, cols, q_.group, out,
                         [&](int64_t i, int64_t j0, int64_t j1, int64_t k, float* dst) {
                             const float absmax = (float)aq[k] * as[k / detail::kNf4DqBlock];
                             float lut[16];
                             for (int c = 0; c < 16; c++) lut[c] = kNf4Levels[c] * absmax;
                             decode_nibbles(codes, i * cols + j0, j1 - j0, lut, dst);
                         });
            break;
        }
    }
}

void QuantizedParamStore::decode(const Unit& un, float* out) const {
    for (const Plain& p : un.plain)
        std::memcpy(out + p.offset, un.fp32.data() + p.at, p.count * sizeof(float));
    for (const PackedMatrix& m : un.packed) decode_matrix(m, out + m.offset);
}

int QuantizedParamStore::free_slot() const {
    int best = -1;
    for (int s = 0; s < (int)slots_.size(); s++) {
        const Slot& sl = slots_[(std::size_t)s];
        if (sl.unit >= 0 && units_[(std::size_t)sl.unit].held > 0) continue;
        if (best < 0 || sl.last_use < slots_[(std::size_t)best].last_use) best = s;
    }
    if (best < 0)
        fail(
            "internal: all {} decode slots of the quantized base hold acquired blocks; release "
            "one first or construct the store with more slots",
            slots_.size());
    return best;
}

float* QuantizedParamStore::acquire(int u, bool for_write) {
    Unit& un = unit_at(u, "acquire");
    if (for_write)
        fail(
            "internal: the quantized base model is frozen: unit {} ({}) cannot be acquired for "
            "writing",
            u, layout_.units[(std::size_t)u].name);
    if (un.packed.empty()) {  // embedding, head: fp32 as stored
        un.held++;
        return un.fp32.data();
    }
    stats_.acquires++;
    if (un.slot < 0) {
        const int s = free_slot();
        Slot& sl = slots_[(std::size_t)s];
        if (sl.unit >= 0) units_[(std::size_t)sl.unit].slot = -1;
        sl.unit = -1;
        const auto t0 = std::chrono::steady_clock::now();
        decode(un, sl.data.data());
        stats_.decode_seconds += seconds_since(t0);
        stats_.decodes++;
        sl.unit = u;
        un.slot = s;
    }
    Slot& sl = slots_[(std::size_t)un.slot];
    sl.last_use = ++clock_;
    un.held++;
    return sl.data.data();
}

void QuantizedParamStore::release(int u) {
    Unit& un = unit_at(u, "release");
    if (un.held == 0)
        fail("internal: release of unit {} ({}) of the quantized base without an acquire", u,
             layout_.units[(std::size_t)u].name);
    un.held--;
}

float* QuantizedParamStore::unit_grads(int u) {
    fail(
        "internal: the quantized base model is frozen and has no gradients (unit_grads of unit "
        "{})",
        u);
}

// ---- the writer -------------------------------------------------------------------------------

QuantizedStoreWriter::QuantizedStoreWriter(QuantizedParamStore& target)
    : target_(&target), scratch_(target.layout().largest_unit(), MemCategory::Workspace) {}

float* QuantizedStoreWriter::acquire(int u, bool for_write) {
    const ParamLayout& layout = target_->layout();
    if (u < 0 || u >= (int)layout.units.size())
        fail("internal: acquire of unit {} of a model with {} units", u, layout.units.size());
    if (!for_write) fail("internal: the quantized base writer is write-only (read of unit {})", u);
    if (open_ >= 0)
        fail(
            "internal: the quantized base writer holds unit {}; unit {} must wait for its "
            "release",
            open_, u);
    open_ = u;
    std::memset(scratch_.data(), 0, layout.units[(std::size_t)u].size() * sizeof(float));
    return scratch_.data();
}

void QuantizedStoreWriter::release(int u) {
    if (u != open_)
        fail("internal: release of unit {} by the quantized base writer, which holds {}", u, open_);
    open_ = -1;
    target_->load_unit(u, scratch_.data());
}

BaseQuant lora_base_quant(const LoraConfig& lora) {
    return parse_base_quant(lora.base, lora.base == "int8" ? 0 : lora.base_group);
}

void round_trip_base(const ModelWeights& weights, const BaseQuant& q) {
    QuantizedParamStore packed(weights, q, 1);
    for (int u = 0; u < (int)weights.layout.units.size(); u++) {
        const float* src = packed.acquire(u);
        float* dst = weights.store.acquire(u, true);
        std::copy(src, src + weights.layout.units[u].size(), dst);
        weights.store.release(u);
        packed.release(u);
    }
}

}  // namespace memtrain::quant
