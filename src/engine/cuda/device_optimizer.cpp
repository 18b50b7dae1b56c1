// The CUDA engines' device optimizer (see device_optimizer.h).
#include "engine/cuda/device_optimizer.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/device_memory.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

template <typename T>
void DeviceOptimizer<T>::MomentSet::allocate(const cuda::MomentLayout& lay, int moments) {
    const MomentBuffer::Plan& p = lay.plan;
    for (int k = 0; k < moments; k++) {
        // Zero-initialised: every moment starts at zero (zero codes with zero scales too).
        if (p.fp32) f32[k] = DeviceBuffer<float>(p.fp32, MemCategory::OptimizerState);
        if (p.bf16) b16[k] = DeviceBuffer<__nv_bfloat16>(p.bf16, MemCategory::OptimizerState);
        if (p.code_bytes)
            codes[k] = DeviceBuffer<uint8_t>(p.code_bytes, MemCategory::OptimizerState);
        if (p.scales) scales[k] = DeviceBuffer<float>(p.scales, MemCategory::OptimizerState);
    }
    auto upload = [](auto& buf, const auto& host) {
        using B = std::decay_t<decltype(buf)>;
        if (host.empty()) return;
        buf = B(host.size(), MemCategory::OptimizerState);
        copy_to_device(buf.data(), host.data(), buf.bytes());
    };
    upload(chunks, lay.chunks);
    upload(at, lay.at);
    upload(grid, lay.grid);
    blocks = lay.blocks;
}

template <typename T>
DeviceOptimizer<T>::DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                    std::size_t offset, std::size_t n, cudaStream_t stream,
                                    Wait wait, uint64_t train_seed, bool by_unit,
                                    dist::DeviceShardGather* shards)
    : kind_(cfg.name == "adafactor" ? Kind::Adafactor
            : cfg.name == "sgd"     ? Kind::Sgd
            : cfg.name == "muon"    ? Kind::Muon
                                    : Kind::AdamW),
      format_(parse_state_format(cfg.state_format)),
      layout_(layout),
      offset_(offset),
      n_(n),
      stream_(stream),
      wait_(std::move(wait)),
      shards_(shards) {
    if (cfg.name != "adamw" && cfg.name != "sgd" && cfg.name != "adafactor" && cfg.name != "muon")
        fail("internal: optim.name = \"{}\" has no step on the GPU", cfg.name);
    if (cfg.master == "none") {
        if (!std::is_same_v<T, __nv_bfloat16>)
            fail("internal: optim.master = \"none\" on the GPU stores bf16 parameters only");
        round_ = {1, bf16_rounding_seed(train_seed), (int64_t)offset};
    } else if constexpr (!std::is_same_v<T, float>) {
        master_ = DeviceBuffer<float>(n, MemCategory::OptimizerState);
    }
    std::size_t max_numel = 0, max_gram = 0;
    for (const cuda::OptimizerPart& piece : cuda::optimizer_parts(layout, offset, n, by_unit)) {
        Part& p = parts_.emplace_back();
        p.offset = piece.offset;
        p.n = piece.n;
        allocate(p);
        max_numel = std::max(max_numel, p.muon.max_numel);
        max_gram = std::max(max_gram, p.muon.max_gram);
    }
    if (kind_ == Kind::Adafactor && shards_ && shards_->largest() > 0) {
        // The cut tensors this rank holds, each whole in a part of its own, and the scratch
        // every rank receives a cut tensor into.
        for (const dist::DeviceShardGather::Cut& c : shards_->cuts()) {
            if (!c.mine) continue;
            const ParamSpec& t = layout.tensors[c.tensor];
            Part& p = cut_parts_.emplace_back();
            p.offset = t.offset;
            p.n = t.numel;
            allocate(p);
        }
        cut_staged_.resize(cut_parts_.size());
        const std::size_t m = shards_->largest();
        cut_g_ = DeviceBuffer<T>(m, MemCategory::OptimizerState);
        cut_w_ = DeviceBuffer<T>(m, MemCategory::OptimizerState);
        cut_f_ = DeviceBuffer<float>(m, MemCategory::OptimizerState);
    }
    if (kind_ == Kind::Muon && shards_) {
        // Every rank receives each matrix the shards cut, with or without a part of its own.
        const cuda::MuonLayout all = cuda::muon_layout(layout, offset, 0, format_, true);
        max_numel = std::max(max_numel, all.max_numel);
        max_gram = std::max(max_gram, all.max_gram);
    }
    if (kind_ == Kind::Muon) {
        if (max_numel) {
            for (DeviceBuffer<float>* b : {&ns_x_, &ns_y_})
                *b = DeviceBuffer<float>(max_numel, MemCategory::OptimizerState);
            for (DeviceBuffer<float>* b : {&ns_a_, &ns_b_})
                *b = DeviceBuffer<float>(max_gram, MemCategory::OptimizerState);
        }
        ns_sumsq_ = DeviceBuffer<double>(1, MemCategory::OptimizerState);
    }
    if (kind_ != Kind::Adafactor &&
        (format_ == StateFormat::Int8 || format_ == StateFormat::Int4)) {
        const std::vector<float> t = cuda::decode_tables(format_);
        tables_ = DeviceBuffer<float>(t.size(), MemCategory::OptimizerState);
        copy_to_device(tables_.data(), t.data(), tables_.bytes());
    }
    wait_("the optimizer's state");
}

template <typename T>
void DeviceOptimizer<T>::allocate(Part& p) {
    if (kind_ == Kind::Adafactor) {
        p.af = cuda::adafactor_layout(layout_, p.offset, p.n, shards_ != nullptr);
        const std::size_t nt = p.af.tensors.size();
        if (p.af.state)
            p.af_state = DeviceBuffer<float>((std::size_t)p.af.state, MemCategory::OptimizerState);
        if (nt) {
            p.af_tensors = DeviceBuffer<cuda::AdafactorTensor>(nt, MemCategory::OptimizerState);
            copy_to_device(p.af_tensors.data(), p.af.tensors.data(), p.af_tensors.bytes());
            p.af_scalars = DeviceBuffer<cuda::AdafactorScalars>(nt, MemCategory::OptimizerState);
            p.af_sums = DeviceBuffer<double>((std::size_t)(p.af.rows + p.af.parts),
                                             MemCategory::OptimizerState);
        }
        return;
    }
    if (kind_ == Kind::Muon) {
        p.muon = cuda::muon_layout(layout_, p.offset, p.n, format_, shards_ != nullptr);
        p.moments.only = p.muon.rest;
        p.momentum.only = p.muon.matrix;
        p.moments.allocate(p.muon.adam, 2);
        p.momentum.allocate(p.muon.momentum, 1);
        return;
    }
    p.moments.allocate(cuda::moment_layout(layout_, p.offset, p.n, format_),
                       kind_ == Kind::AdamW ? 2 : 1);
}

template <typename T>
cuda::MomentStores DeviceOptimizer<T>::moment_stores(MomentSet& set, std::size_t first,
                                                     int64_t blocks) {
    auto ptr = [](auto& b) { return b.size() ? b.data() : nullptr; };
    cuda::MomentStores st;
    st.m32 = ptr(set.f32[0]);
    st.v32 = ptr(set.f32[1]);
    st.m16 = ptr(set.b16[0]);
    st.v16 = ptr(set.b16[1]);
    st.at = set.at.size() ? set.at.data() + first : nullptr;
    if (format_ == StateFormat::Int8 || format_ == StateFormat::Int4) {
        // (A part of only fp32-kept tensors has a grid but no codes.)
        st.bits = format_ == StateFormat::Int8 ? 8 : 4;
        st.mq = ptr(set.codes[0]);
        st.vq = ptr(set.codes[1]);
        st.ms = ptr(set.scales[0]);
        st.vs = ptr(set.scales[1]);
        st.table_m = tables_.data();
        st.table_v = tables_.data() + 256;
        st.qm = cuda::quant_map(format_, true);
        st.qv = cuda::quant_map(format_, false);
    }
    st.grid = set.grid.size() ? set.grid.data() + first : nullptr;
    st.blocks = blocks >= 0 ? blocks : set.blocks;
    return st;
}

template <typename T>
cuda::AdafactorStores DeviceOptimizer<T>::adafactor_stores(Part& p) {
    cuda::AdafactorStores st;
    st.state = p.af_state.size() ? p.af_state.data() : nullptr;
    st.tensors = p.af_tensors.size() ? p.af_tensors.data() : nullptr;
    st.scalars = p.af_scalars.size() ? p.af_scalars.data() : nullptr;
    st.rows = p.af_sums.size() ? p.af_sums.data() : nullptr;
    st.parts = p.af.parts ? p.af_sums.data() + p.af.rows : nullptr;
    st.ntensors = (int)p.af.tensors.size();
    st.nrows = p.af.rows;
    st.items = p.af.items;
    st.tiles = p.af.tiles;
    st.max_cols = p.af.max_cols;
    return st;
}

template <typename T>
void DeviceOptimizer<T>::step(T* params, const T* grads, const cuda::StepScalars* scalars,
                              cudaStream_t stream) {
    for (std::size_t k = 0; k < parts_.size(); k++) {
        // Under shards, the first part joins the gathers of the cut matrices before the range,
        // the last those after it.
        const std::size_t lo = k == 0 ? 0 : parts_[k].offset;
        const std::size_t hi =
            k + 1 == parts_.size() ? layout_.total : parts_[k].offset + parts_[k].n;
        step_part(&parts_[k], lo, hi, params, grads + (parts_[k].offset - offset_), scalars,
                  stream);
    }
    adafactor_cuts(0, layout_.total, params, grads, offset_, scalars, stream);
}

template <typename T>
void DeviceOptimizer<T>::step_unit(int u, std::size_t begin, std::size_t n, T* params,
                                   const T* grads, const cuda::StepScalars* scalars,
                                   cudaStream_t stream) {
    const ParamUnit& unit = layout_.units.at((std::size_t)u);
    Part* part = nullptr;
    for (Part& p : parts_)
        if (n > 0 && p.offset == begin && p.n == n) part = &p;
    if (n > 0 && !part)
        fail("internal: the device optimizer has no part [{}, {})", begin, begin + n);
    step_part(part, unit.begin, unit.end, params, grads, scalars, stream);
    adafactor_cuts(unit.begin, unit.end, params, grads, begin, scalars, stream);
}

template <typename T>
typename DeviceOptimizer<T>::Part* DeviceOptimizer<T>::cut_part(std::size_t tensor) {
    for (Part& p : cut_parts_)
        if (p.offset == layout_.tensors[tensor].offset) return &p;
    fail("internal: no whole part for the cut tensor {}", layout_.tensors[tensor].name);
}

template <typename T>
void DeviceOptimizer<T>::adafactor_cuts(std::size_t lo, std::size_t hi, T* params, const T* grads,
                                        std::size_t grads_at, const cuda::StepScalars* scalars,
                                        cudaStream_t stream) {
    if (kind_ != Kind::Adafactor || !shards_) return;
    const std::size_t r = (std::size_t)shards_->rank();
    const dist::DeviceType type = dist::device_type<T>();
    float* master = master_.size() ? cut_f_.data() : nullptr;
    for (const dist::DeviceShardGather::Cut* c : shards_->cuts_in(lo, hi)) {
        // The tensor's gradients and weights (the master where there is one) from its holders;
        // this rank's piece starts at `at` of the flat buffer.
        const ParamSpec& t = layout_.tensors[c->tensor];
        const std::size_t at = t.offset + (std::size_t)c->offsets[r];
        shards_->gather(*c, c->mine ? (const void*)(grads + (at - grads_at)) : cut_g_.data(),
                        cut_g_.data(), type, stream);
        if (master)
            shards_->gather(*c, c->mine ? master_.data() + (at - offset_) : master, master,
                            dist::DeviceType::F32, stream);
        else
            shards_->gather(*c, c->mine ? (const void*)(params + (at - offset_)) : cut_w_.data(),
                            cut_w_.data(), type, stream);
        if (!c->mine) continue;
        // The whole tensor's step (its draws by global index), then this rank's piece back.
        cuda::ParamRounding round = round_;
        round.base = (int64_t)t.offset;
        cuda::adafactor_step<T>(cut_w_.data(), master, adafactor_stores(*cut_part(c->tensor)),
                                cut_g_.data(), scalars, stream, round);
        const std::size_t n = (std::size_t)c->counts[r], off = (std::size_t)c->offsets[r];
        MT_CUDA_CHECK(cudaMemcpyAsync(params + (at - offset_), cut_w_.data() + off, n * sizeof(T),
                                      cudaMemcpyDeviceToDevice, stream));
        if (master)
            MT_CUDA_CHECK(cudaMemcpyAsync(master_.data() + (at - offset_), master + off,
                                          n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
}

template <typename T>
void DeviceOptimizer<T>::step_part(Part* part, std::size_t lo, std::size_t hi, T* params,
                                   const T* grads, const cuda::StepScalars* scalars,
                                   cudaStream_t stream) {
    if (!part) {  // only the gathers this rank takes part in
        if (kind_ == Kind::Muon)
            muon_step(nullptr, lo, hi, params, nullptr, grads, scalars, stream, round_);
        return;
    }
    Part& p = *part;
    // The part's own view: its parameters, master weights and rounding draws (by flat index).
    const std::size_t rel = p.offset - offset_;
    params += rel;
    float* master = master_.size() ? master_.data() + rel : nullptr;
    cuda::ParamRounding round = round_;
    round.base = (int64_t)p.offset;
    if (kind_ == Kind::Adafactor)
        return cuda::adafactor_step<T>(params, master, adafactor_stores(p), grads, scalars, stream,
                                       round);
    const int nchunks = (int)p.moments.chunks.size();
    const cuda::TensorChunk* chunks = nchunks ? p.moments.chunks.data() : nullptr;
    if (kind_ == Kind::Sgd)
        return cuda::sgd_step<T>(params, master, moment_stores(p.moments), grads, chunks, nchunks,
                                 scalars, stream, round);
    // AdamW, or Muon's AdamW over the tensors that are not block matrices.
    cuda::adamw_step<T>(params, master, moment_stores(p.moments), grads, chunks, nchunks, scalars,
                        stream, round);
    if (kind_ == Kind::Muon) muon_step(&p, lo, hi, params, master, grads, scalars, stream, round);
}

template <typename T>
void DeviceOptimizer<T>::muon_step(Part* p, std::size_t lo, std::size_t hi, T* params,
                                   float* master, const T* grads, const cuda::StepScalars* scalars,
                                   cudaStream_t stream, const cuda::ParamRounding& round) {
    // The cut matrices this rank holds none of: gathered (received into the scratch and
    // dropped) in their place among the part's matrices, so every rank gathers in layout order.
    std::vector<const dist::DeviceShardGather::Cut*> others;
    if (shards_)
        for (const dist::DeviceShardGather::Cut* c : shards_->cuts_in(lo, hi))
            if (!c->mine) others.push_back(c);
    std::size_t next = 0;
    auto gather_others_before = [&](std::size_t tensor) {
        for (; next < others.size() && others[next]->tensor < tensor; next++)
            shards_->gather(*others[next], ns_x_.data(), stream);
    };
    // Each matrix in turn through the same scratch: the momentum and its Nesterov direction (a
    // cut matrix's piece at its place, then the matrix gathered), the orthogonalization, the
    // update of the floats the range holds.
    if (p)
        for (const cuda::MuonMatrix& m : p->muon.matrices) {
            gather_others_before((std::size_t)m.tensor);
            cuda::muon_momentum<T>(
                ns_x_.data(), m.begin, moment_stores(p->momentum, (std::size_t)m.first, m.blocks),
                grads, p->momentum.chunks.data() + m.first, m.n, scalars, stream);
            if (m.cut()) {
                if (!shards_) fail("internal: a cut Muon matrix without the shards' gather");
                shards_->gather(shards_->cut_of((std::size_t)m.tensor), ns_x_.data(), stream);
            }
            const float* o =
                cuda::newton_schulz5(ns_x_.data(), ns_y_.data(), ns_a_.data(), ns_b_.data(),
                                     ns_sumsq_.data(), m.rows, m.cols, scalars, stream);
            cuda::muon_apply<T>(params, master, o + m.piece, m.begin + m.piece, m.count, m.rows,
                                m.cols, m.decay, scalars, stream, round);
        }
    gather_others_before(layout_.tensors.size());
}

template <typename T>
std::string DeviceOptimizer<T>::describe() const {
    if (kind_ == Kind::Adafactor)
        return fmt::format("{}Adafactor factored second moment",
                           master_.size() ? "fp32 master, " : "");
    std::string d = kind_ == Kind::Muon
                        ? fmt::format("{}Muon momentum on block matrices, Adam m, v else",
                                      master_.size() ? "fp32 master, " : "")
                        : device_optimizer_states(master_.size() > 0, kind_ == Kind::AdamW);
    if (format_ != StateFormat::Fp32) d += fmt::format(" in {}", state_format_name(format_));
    return d;
}

template <typename T>
typename DeviceOptimizer<T>::Stores DeviceOptimizer<T>::stores(const std::string& name) {
    const bool adam = kind_ == Kind::AdamW || kind_ == Kind::Muon;
    if (adam && name == "exp_avg") return {&Part::moments, 0, true};
    if (adam && name == "exp_avg_sq") return {&Part::moments, 1, false};
    if (kind_ == Kind::Sgd && name == "momentum_buffer") return {&Part::moments, 0, true};
    if (kind_ == Kind::Muon && name == "momentum_buffer") return {&Part::momentum, 0, true};
    fail("internal: the CUDA optimizer has no state tensor '{}'", name);
}

template <typename T>
std::vector<std::string> DeviceOptimizer<T>::state_names() {
    if (kind_ == Kind::Adafactor) return {"variance"};
    if (kind_ == Kind::AdamW) return {"exp_avg", "exp_avg_sq"};
    if (kind_ == Kind::Muon) return {"exp_avg", "exp_avg_sq", "momentum_buffer"};
    return {"momentum_buffer"};
}

template <typename T>
MomentBuffer DeviceOptimizer<T>::to_host(Part& p, const Stores& st) {
    const MomentSet& m = p.*st.set;
    MomentBuffer b(format_, st.is_signed, layout_, p.offset, p.n, m.only, MemCategory::Other);
    std::vector<uint8_t> bytes(b.bytes());
    uint8_t* at = bytes.data();
    const int k = st.k;
    for (auto [src, size] : {std::pair{(const void*)m.f32[k].data(), m.f32[k].bytes()},
                             std::pair{(const void*)m.b16[k].data(), m.b16[k].bytes()},
                             std::pair{(const void*)m.codes[k].data(), m.codes[k].bytes()},
                             std::pair{(const void*)m.scales[k].data(), m.scales[k].bytes()}}) {
        if (at + size > bytes.data() + bytes.size())
            fail("internal: the device optimizer's stores exceed the host layout's {} B",
                 bytes.size());
        if (size) MT_CUDA_CHECK(cudaMemcpyAsync(at, src, size, cudaMemcpyDeviceToHost, stream_));
        at += size;
    }
    if (at != bytes.data() + bytes.size())
        fail("internal: the device optimizer's stores ({} B) are not the host layout's ({} B)",
             at - bytes.data(), bytes.size());
    wait_("queued device work");
    b.load_stored(bytes.data());
    return b;
}

template <typename T>
void DeviceOptimizer<T>::to_device(Part& p, const MomentBuffer& b, const Stores& st) {
    std::vector<uint8_t> bytes(b.bytes());
    b.save_stored(bytes.data());
    const uint8_t* at = bytes.data();
    MomentSet& m = p.*st.set;
    const int k = st.k;
    for (auto [dst, size] : {std::pair{(void*)m.f32[k].data(), m.f32[k].bytes()},
                             std::pair{(void*)m.b16[k].data(), m.b16[k].bytes()},
                             std::pair{(void*)m.codes[k].data(), m.codes[k].bytes()},
                             std::pair{(void*)m.scales[k].data(), m.scales[k].bytes()}}) {
        if (size) MT_CUDA_CHECK(cudaMemcpyAsync(dst, at, size, cudaMemcpyHostToDevice, stream_));
        at += size;
    }
    wait_("queued device work");
}

template <typename T>
void DeviceOptimizer<T>::adafactor_floats(Part& p, float* d) {
    // As the CPU's Adafactor lays it for checkpoints: each tensor's floats hold its state (rows
    // then columns, or the whole moment) from its start, then zeros.
    std::vector<float> packed((std::size_t)p.af.state);
    if (!packed.empty())
        MT_CUDA_CHECK(cudaMemcpyAsync(packed.data(), p.af_state.data(), p.af_state.bytes(),
                                      cudaMemcpyDeviceToHost, stream_));
    wait_("queued device work");
    std::fill(d, d + p.n, 0.0f);
    for (const cuda::AdafactorTensor& t : p.af.tensors)
        std::copy_n(packed.data() + t.state, t.state_floats(), d + t.begin);
}

template <typename T>
void DeviceOptimizer<T>::read_state(const std::string& name, float* dst) {
    if (kind_ == Kind::Adafactor && name != "variance")
        fail("internal: Adafactor has no state tensor '{}'", name);
    const Stores st = kind_ == Kind::Adafactor ? Stores{} : stores(name);
    for (Part& p : parts_) {
        float* d = dst + (p.offset - offset_);
        if (kind_ == Kind::Adafactor) {
            adafactor_floats(p, d);
            continue;
        }
        const MomentSet& m = p.*st.set;
        if (format_ == StateFormat::Fp32 && m.only.empty()) {  // indexed like the parameters
            const DeviceBuffer<float>& f = m.f32[st.k];
            MT_CUDA_CHECK(cudaMemcpyAsync(d, f.data(), f.bytes(), cudaMemcpyDeviceToHost, stream_));
            wait_("queued device work");
            continue;
        }
        to_host(p, st).read(d);  // decoded by the CPU's codec
    }
    // The cut tensors' state (Adafactor under shards): its floats from the tensor's start, the
    // part of them inside this range (every holder has them whole).
    for (Part& p : cut_parts_) {
        std::vector<float> all(p.n);
        adafactor_floats(p, all.data());
        const std::size_t lo = std::max(p.offset, offset_),
                          hi = std::min(p.offset + p.n, offset_ + n_);
        if (lo < hi)
            std::copy(all.data() + (lo - p.offset), all.data() + (hi - p.offset),
                      dst + (lo - offset_));
    }
}

template <typename T>
void DeviceOptimizer<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                     const float* src) {
    if (begin > n_ || n > n_ - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             n_);
    if (kind_ == Kind::Adafactor && name != "variance")
        fail("internal: Adafactor has no state tensor '{}'", name);
    const Stores st = kind_ == Kind::Adafactor ? Stores{} : stores(name);
    // The cut tensors' state (Adafactor under shards): the written floats staged for
    // finish_writes, which completes them from the other holders.
    for (std::size_t k = 0; k < cut_parts_.size(); k++) {
        Part& p = cut_parts_[k];
        const std::size_t lo = std::max(p.offset, offset_ + begin);
        const std::size_t hi = std::min(p.offset + p.n, offset_ + begin + n);
        if (lo >= hi) continue;
        std::vector<float>& staged = cut_staged_[k];
        if (staged.empty()) {
            staged.resize(p.n);
            adafactor_floats(p, staged.data());
        }
        std::copy(src + (lo - offset_ - begin), src + (hi - offset_ - begin),
                  staged.data() + (lo - p.offset));
    }
    for (Part& p : parts_) {
        // The write's floats inside this part, [lo, hi) of the range.
        const std::size_t rel = p.offset - offset_;
        const std::size_t lo = std::max(begin, rel), hi = std::min(begin + n, rel + p.n);
        if (lo >= hi) continue;
        if (kind_ == Kind::Adafactor) {
            // The part's floats, the write over them, packed again.
            std::vector<float> all(p.n);
            adafactor_floats(p, all.data());
            std::copy(src + (lo - begin), src + (hi - begin), all.data() + (lo - rel));
            std::vector<float> packed((std::size_t)p.af.state);
            for (const cuda::AdafactorTensor& t : p.af.tensors)
                std::copy_n(all.data() + t.begin, t.state_floats(), packed.data() + t.state);
            if (!packed.empty())
                MT_CUDA_CHECK(cudaMemcpyAsync(p.af_state.data(), packed.data(), p.af_state.bytes(),
                                              cudaMemcpyHostToDevice, stream_));
            wait_("queued device work");
            continue;
        }
        MomentSet& m = p.*st.set;
        if (format_ == StateFormat::Fp32 && m.only.empty()) {
            MT_CUDA_CHECK(cudaMemcpyAsync(m.f32[st.k].data() + (lo - rel), src + (lo - begin),
                                          (hi - lo) * sizeof(float), cudaMemcpyHostToDevice,
                                          stream_));
            wait_("queued device work");
            continue;
        }
        // The part as floats, the write over it, encoded again by the CPU's codec (a block the
        // write does not touch decodes and encodes to the same bytes).
        MomentBuffer b = to_host(p, st);
        std::vector<float> all(p.n);
        b.read(all.data());
        std::copy(src + (lo - begin), src + (hi - begin), all.data() + (lo - rel));
        b.write(all.data());
        to_device(p, b, st);
    }
}

template <typename T>
void DeviceOptimizer<T>::finish_writes() {
    if (kind_ != Kind::Adafactor || !shards_ || shards_->largest() == 0) return;
    // Each cut tensor's floats on every rank from its holders' pieces (every rank takes part, in
    // the cuts' order), packed into each holder's whole state.
    const std::size_t r = (std::size_t)shards_->rank();
    std::size_t k = 0;
    for (const dist::DeviceShardGather::Cut& c : shards_->cuts()) {
        float* f = cut_f_.data();
        const std::size_t off = (std::size_t)c.offsets[r], n = (std::size_t)c.counts[r];
        Part* p = c.mine ? &cut_parts_.at(k) : nullptr;
        std::vector<float> none;
        std::vector<float>& staged = c.mine ? cut_staged_.at(k++) : none;
        if (p && staged.empty()) {  // nothing written: its own state as it is
            staged.resize(p->n);
            adafactor_floats(*p, staged.data());
        }
        if (p)
            MT_CUDA_CHECK(cudaMemcpyAsync(f + off, staged.data() + off, n * sizeof(float),
                                          cudaMemcpyHostToDevice, stream_));
        shards_->gather(c, f, stream_);
        if (!p) continue;
        MT_CUDA_CHECK(cudaMemcpyAsync(staged.data(), f, p->n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_));
        wait_("a cut tensor's state");
        std::vector<float> packed((std::size_t)p->af.state);
        for (const cuda::AdafactorTensor& t : p->af.tensors)
            std::copy_n(staged.data() + t.begin, t.state_floats(), packed.data() + t.state);
        if (!packed.empty())
            MT_CUDA_CHECK(cudaMemcpyAsync(p->af_state.data(), packed.data(), p->af_state.bytes(),
                                          cudaMemcpyHostToDevice, stream_));
        wait_("queued device work");
        staged.clear();
    }
}

template <typename T>
void download_decoded(float* dst, const T* src, std::size_t n, cudaStream_t stream,
                      const std::function<void(const char*)>& wait) {
    std::vector<T> stored(n);
    if (n)
        MT_CUDA_CHECK(
            cudaMemcpyAsync(stored.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    wait("a weight transfer");
    for (std::size_t i = 0; i < n; i++) dst[i] = cuda::to_fp32(stored[i]);
}

template <typename T>
void upload_rounded(T* dst, const float* src, std::size_t n, cudaStream_t stream,
                    const std::function<void(const char*)>& wait) {
    std::vector<T> rounded(n);
    for (std::size_t i = 0; i < n; i++) rounded[i] = cuda::to_storage<T>(src[i]);
    if (n)
        MT_CUDA_CHECK(
            cudaMemcpyAsync(dst, rounded.data(), n * sizeof(T), cudaMemcpyHostToDevice, stream));
    wait("a weight transfer");
}

#define MT_INSTANTIATE(T)                                                          \
    template void download_decoded<T>(float*, const T*, std::size_t, cudaStream_t, \
                                      const std::function<void(const char*)>&);    \
    template void upload_rounded<T>(T*, const float*, std::size_t, cudaStream_t,   \
                                    const std::function<void(const char*)>&);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

std::string device_in_use_line() {
    std::size_t free_b = 0, total_b = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return fmt::format(
        "{:<16} {:>8.1f} MiB  of {:.1f} MiB (the driver's count: the CUDA context, library code "
        "and handles, and page granularity beyond the tracked tensors)\n",
        "device in use", (total_b - free_b) / 1048576.0, total_b / 1048576.0);
}

void use_rank_device(const dist::Communicator& comm) {
    if (!cuda_available()) fail("train.device = \"cuda\", but no CUDA device answers");
    select_device(comm.local_rank());
}

template class DeviceOptimizer<float>;
template class DeviceOptimizer<__nv_bfloat16>;
template class DeviceOptimizer<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
