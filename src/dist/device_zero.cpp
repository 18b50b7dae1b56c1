// ZeRO stages 2 and 3 on GPUs (see device_zero.h): gradient buckets reduced unit by unit to the
// shards' owners, and under stage 3 parameter units gathered into slots just before use, the
// next one prefetched, on the communication stream.
#include "dist/device_zero.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/ops.h"

namespace memtrain::dist {

namespace {

template <typename T>
DeviceType type_of() {
    if constexpr (std::is_same_v<T, float>)
        return DeviceType::F32;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return DeviceType::BF16;
    else
        return DeviceType::F16;
}

}  // namespace

template <typename T>
DeviceZeroUnits<T>::DeviceZeroUnits(const ParamLayout& layout, int stage, DeviceCommunicator& comm,
                                    std::size_t shard, cudaStream_t compute,
                                    cudaStream_t comm_stream)
    : layout_(layout),
      stage_(stage),
      rank_(comm.rank()),
      world_(comm.size()),
      comm_(comm),
      shard_(shard),
      compute_(compute),
      comm_stream_(comm_stream),
      type_(type_of<T>()) {
    if (stage_ < 2 || stage_ > 3) fail("internal: DeviceZeroUnits is for ZeRO stages 2 and 3");
    for (const ParamUnit& unit : layout_.units) {
        std::vector<int64_t> off(world_, 0), cnt(world_, 0);
        for (int r = 0; r < world_; r++) {
            const std::size_t b = (std::size_t)r * shard_, e = b + shard_;
            const std::size_t lo = std::max(b, unit.begin), hi = std::min(e, unit.end);
            if (hi > lo) {
                off[r] = (int64_t)(lo - unit.begin);
                cnt[r] = (int64_t)(hi - lo);
            }
        }
        offsets_.push_back(off);
        counts_.push_back(cnt);
    }
    const std::size_t padded = shard_ * world_;
    if (stage_ == 2) {
        whole_ = DeviceBuffer<T>(padded, MemCategory::Parameters);
        MT_CUDA_CHECK(cudaMemsetAsync(whole_.data(), 0, whole_.bytes(), compute_));
    } else {
        param_shard_ = DeviceBuffer<T>(shard_, MemCategory::Parameters);
        MT_CUDA_CHECK(cudaMemsetAsync(param_shard_.data(), 0, param_shard_.bytes(), compute_));
    }
    grad_shard_ = DeviceBuffer<T>(shard_, MemCategory::Gradients);
    MT_CUDA_CHECK(cudaMemsetAsync(grad_shard_.data(), 0, grad_shard_.bytes(), compute_));
    // Buckets (and stage 3's slots): the embedding's, the head's, and two for the blocks.
    const std::size_t emb = layout_.units.front().size(), head = layout_.units.back().size();
    std::size_t block = 0;
    for (int l = 0; l + 2 < (int)layout_.units.size(); l++)
        block = std::max(block, layout_.units[layout_.block_unit(l)].size());
    make_slot(grad_emb_, emb);
    make_slot(grad_head_, head);
    for (auto& s : grad_ring_) make_slot(s, block), grad_blocks_.push_back(&s);
    if (stage_ == 3) {
        make_slot(param_emb_, emb);
        make_slot(param_head_, head);
        for (auto& s : param_ring_) make_slot(s, block), param_blocks_.push_back(&s);
    }
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&changed_, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming));
}

template <typename T>
DeviceZeroUnits<T>::~DeviceZeroUnits() {
    cudaStreamSynchronize(comm_stream_);
    cudaStreamSynchronize(compute_);
    for (Slot* s : {&grad_emb_, &grad_head_, &grad_ring_[0], &grad_ring_[1], &param_emb_,
                    &param_head_, &param_ring_[0], &param_ring_[1]}) {
        if (s->ready) cudaEventDestroy(s->ready);
        if (s->free) cudaEventDestroy(s->free);
    }
    if (changed_) cudaEventDestroy(changed_);
    if (joined_) cudaEventDestroy(joined_);
}

template <typename T>
void DeviceZeroUnits<T>::make_slot(Slot& s, std::size_t n) {
    s.buf = DeviceBuffer<T>(std::max<std::size_t>(n, 1), MemCategory::Communication);
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&s.free, cudaEventDisableTiming));
    // Recorded once, so the first wait on them passes at once.
    MT_CUDA_CHECK(cudaEventRecord(s.ready, compute_));
    MT_CUDA_CHECK(cudaEventRecord(s.free, compute_));
}

template <typename T>
T* DeviceZeroUnits<T>::param_shard() {
    return stage_ == 2 ? whole_.data() + (std::size_t)rank_ * shard_ : param_shard_.data();
}

template <typename T>
typename DeviceZeroUnits<T>::Slot* DeviceZeroUnits<T>::slot_for(std::vector<Slot*>& ring, Slot& emb,
                                                                Slot& head, int u, bool need_free) {
    if (u == ParamLayout::embedding_unit()) return &emb;
    if (u == layout_.head_unit()) return &head;
    Slot* best = nullptr;
    for (Slot* s : ring) {
        const bool busy = need_free ? s->holds > 0 : s->active;
        if (!busy && (!best || s->used < best->used)) best = s;
    }
    return best;
}

template <typename T>
typename DeviceZeroUnits<T>::Slot* DeviceZeroUnits<T>::resident(int u) {
    for (Slot* s : {&param_emb_, &param_head_, &param_ring_[0], &param_ring_[1]})
        if (s->unit == u) return s;
    return nullptr;
}

template <typename T>
void DeviceZeroUnits<T>::gather(int u, Slot& s) {
    if (s.holds > 0) fail("internal: ZeRO-3 gathers unit {} into a slot still in use", u);
    const ParamUnit& unit = layout_.units[u];
    const std::vector<int64_t>& off = offsets_[u];
    // The slot's last reader (the compute stream) is done with it, and the shard's last writer.
    MT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, s.free, 0));
    const T* mine =
        param_shard_.data() +
        (counts_[u][rank_] > 0 ? unit.begin + off[rank_] - (std::size_t)rank_ * shard_ : 0);
    comm_.broadcast_pieces(mine, s.buf.data(), off, counts_[u], type_, comm_stream_);
    MT_CUDA_CHECK(cudaEventRecord(s.ready, comm_stream_));
    s.unit = u;
    s.used = ++clock_;
    gathers_++;
}

template <typename T>
T* DeviceZeroUnits<T>::acquire_params(int u) {
    if (stage_ == 2) return whole_.data() + layout_.units[u].begin;
    Slot* s = resident(u);
    if (!s) {
        s = slot_for(param_blocks_, param_emb_, param_head_, u, true);
        if (!s) fail("internal: ZeRO-3 has no free slot for unit {}", u);
        gather(u, *s);
        demand_gathers_++;
    }
    s->holds++;
    s->used = ++clock_;
    MT_CUDA_CHECK(cudaStreamWaitEvent(compute_, s->ready, 0));
    return s->buf.data();
}

template <typename T>
void DeviceZeroUnits<T>::release_params(int u) {
    if (stage_ == 2) return;
    Slot* s = resident(u);
    if (!s || s->holds <= 0) fail("internal: ZeRO-3 releases unit {} that is not acquired", u);
    // The next gather into this slot waits for the work queued so far to stop reading it.
    if (--s->holds == 0) MT_CUDA_CHECK(cudaEventRecord(s->free, compute_));
}

template <typename T>
void DeviceZeroUnits<T>::prefetch_params(int u) {
    if (stage_ == 2 || u < 0 || resident(u)) return;
    Slot* s = slot_for(param_blocks_, param_emb_, param_head_, u, true);
    if (s && s->holds == 0) gather(u, *s);
}

template <typename T>
T* DeviceZeroUnits<T>::acquire_grads(int u) {
    for (Slot* s : {&grad_emb_, &grad_head_, &grad_ring_[0], &grad_ring_[1]})
        if (s->active && s->unit == u) return s->buf.data();
    Slot* s = slot_for(grad_blocks_, grad_emb_, grad_head_, u, false);
    if (!s || s->active) fail("internal: ZeRO-2 has no free gradient bucket for unit {}", u);
    // The bucket's last reduction has finished; this micro-batch's gradients start from zero.
    MT_CUDA_CHECK(cudaStreamWaitEvent(compute_, s->free, 0));
    MT_CUDA_CHECK(cudaMemsetAsync(s->buf.data(), 0, layout_.units[u].size() * sizeof(T), compute_));
    s->unit = u;
    s->active = true;
    s->used = ++clock_;
    return s->buf.data();
}

template <typename T>
void DeviceZeroUnits<T>::grads_done(int u) {
    Slot* s = nullptr;
    for (Slot* c : {&grad_emb_, &grad_head_, &grad_ring_[0], &grad_ring_[1]})
        if (c->active && c->unit == u) s = c;
    if (!s) fail("internal: ZeRO-2 gradients of unit {} done without a bucket", u);
    MT_CUDA_CHECK(cudaEventRecord(s->ready, compute_));
    MT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, s->ready, 0));
    comm_.reduce_pieces(s->buf.data(), offsets_[u], counts_[u], type_, comm_stream_);
    const int64_t n = counts_[u][rank_];
    if (n > 0) {
        const std::size_t at =
            layout_.units[u].begin + (std::size_t)offsets_[u][rank_] - (std::size_t)rank_ * shard_;
        cuda::add_inplace<T>(grad_shard_.data() + at, s->buf.data() + offsets_[u][rank_], n,
                             comm_stream_);
    }
    MT_CUDA_CHECK(cudaEventRecord(s->free, comm_stream_));
    s->active = false;
}

template <typename T>
void DeviceZeroUnits<T>::zero_grads() {
    MT_CUDA_CHECK(cudaMemsetAsync(grad_shard_.data(), 0, grad_shard_.bytes(), compute_));
}

template <typename T>
void DeviceZeroUnits<T>::params_changed() {
    for (Slot* s : {&param_emb_, &param_head_, &param_ring_[0], &param_ring_[1]}) {
        if (s->holds > 0)
            fail("internal: ZeRO-3 parameters changed while unit {} is in use", s->unit);
        s->unit = -1;
    }
    MT_CUDA_CHECK(cudaEventRecord(changed_, compute_));
    MT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, changed_, 0));
}

template <typename T>
void DeviceZeroUnits<T>::join() {
    MT_CUDA_CHECK(cudaEventRecord(joined_, comm_stream_));
    MT_CUDA_CHECK(cudaStreamWaitEvent(compute_, joined_, 0));
}

template <typename T>
std::size_t DeviceZeroUnits<T>::communication_bytes() const {
    std::size_t b = 0;
    for (const Slot* s : {&grad_emb_, &grad_head_, &grad_ring_[0], &grad_ring_[1], &param_emb_,
                          &param_head_, &param_ring_[0], &param_ring_[1]})
        b += s->buf.bytes();
    return b;
}

template class DeviceZeroUnits<float>;
template class DeviceZeroUnits<__nv_bfloat16>;
template class DeviceZeroUnits<__half>;

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
