// ZeRO stages 2 and 3 on GPUs (see device_zero.h): gradient buckets reduced unit by unit to the
// shards' owners, and under stage 3 parameter units gathered into slots just before use, the
// next one prefetched, on the communication stream.
#include "parallel/data/device_zero.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "kernels/cuda/ops.h"

namespace memtrain::dist {

template <typename T>
DeviceZeroUnits<T>::DeviceZeroUnits(const ParamLayout& layout, int stage, DeviceCommunicator& comm,
                                    std::size_t shard, cudaStream_t compute,
                                    cudaStream_t comm_stream, PieceDone in_backward)
    : layout_(layout),
      stage_(stage),
      rank_(comm.rank()),
      world_(comm.size()),
      comm_(comm),
      shard_(shard),
      compute_(compute),
      comm_stream_(comm_stream),
      type_(device_type<T>()),
      in_backward_(std::move(in_backward)) {
    if (stage_ < 2 || stage_ > 3) fail("internal: DeviceZeroUnits is for ZeRO stages 2 and 3");
    const auto shards = equal_shard_ranges((int64_t)layout_.total, world_, (int64_t)shard_);
    for (const ParamUnit& unit : layout_.units)
        pieces_.push_back(unit_pieces(shards, (int64_t)unit.begin, (int64_t)unit.end));
    const std::size_t padded = shard_ * world_;
    if (stage_ == 2) {
        whole_ = DeviceBuffer<T>(padded, MemCategory::Parameters);
        MT_CUDA_CHECK(cudaMemsetAsync(whole_.data(), 0, whole_.bytes(), compute_));
    } else {
        param_shard_ = DeviceBuffer<T>(shard_, MemCategory::Parameters);
        MT_CUDA_CHECK(cudaMemsetAsync(param_shard_.data(), 0, param_shard_.bytes(), compute_));
    }
    if (!in_backward_) {
        grad_shard_ = DeviceBuffer<T>(shard_, MemCategory::Gradients);
        MT_CUDA_CHECK(cudaMemsetAsync(grad_shard_.data(), 0, grad_shard_.bytes(), compute_));
    }
    // Buckets (and stage 3's slots): the embedding's, the head's, and two for the blocks.
    const std::size_t emb = layout_.units.front().size(), head = layout_.units.back().size();
    std::size_t block = 0;
    for (int l = 0; l + 2 < (int)layout_.units.size(); l++)
        block = std::max(block, layout_.units[layout_.block_unit(l)].size());
    const std::size_t sizes[kSlots] = {emb, head, block, block};
    for (int i = 0; i < kSlots; i++) {
        make_slot(grad_[i], sizes[i]);
        if (stage_ == 3) make_slot(param_[i], sizes[i]);
    }
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&changed_, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming));
}

template <typename T>
DeviceZeroUnits<T>::~DeviceZeroUnits() {
    cudaStreamSynchronize(comm_stream_);
    cudaStreamSynchronize(compute_);
    for (Slots* set : {&grad_, &param_}) {
        for (Slot& s : *set) {
            if (s.ready) cudaEventDestroy(s.ready);
            if (s.free) cudaEventDestroy(s.free);
        }
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
typename DeviceZeroUnits<T>::Slot* DeviceZeroUnits<T>::slot_for(Slots& set, int u, bool need_free) {
    if (u == ParamLayout::embedding_unit()) return &set[0];
    if (u == layout_.head_unit()) return &set[1];
    Slot* best = nullptr;
    for (int i = 2; i < kSlots; i++) {
        Slot& s = set[i];
        const bool busy = need_free ? s.holds > 0 : s.active;
        if (!busy && (!best || s.used < best->used)) best = &s;
    }
    return best;
}

template <typename T>
typename DeviceZeroUnits<T>::Slot* DeviceZeroUnits<T>::resident(int u) {
    for (Slot& s : param_)
        if (s.unit == u) return &s;
    return nullptr;
}

template <typename T>
typename DeviceZeroUnits<T>::Slot* DeviceZeroUnits<T>::active_bucket(int u) {
    for (Slot& s : grad_)
        if (s.active && s.unit == u) return &s;
    return nullptr;
}

template <typename T>
void DeviceZeroUnits<T>::gather(int u, Slot& s) {
    if (s.holds > 0) fail("internal: ZeRO-3 gathers unit {} into a slot still in use", u);
    const UnitPieces& p = pieces_[u];
    // The slot's last reader (the compute stream) is done with it, and the shard's last writer.
    MT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, s.free, 0));
    const T* mine = param_shard_.data() + (p.counts[rank_] > 0 ? shard_index(u) : 0);
    comm_.broadcast_pieces(mine, s.buf.data(), p.offsets, p.counts, type_, comm_stream_);
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
        s = slot_for(param_, u, true);
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
    Slot* s = slot_for(param_, u, true);
    if (s && s->holds == 0) gather(u, *s);
}

template <typename T>
T* DeviceZeroUnits<T>::acquire_grads(int u) {
    if (Slot* s = active_bucket(u)) return s->buf.data();
    Slot* s = slot_for(grad_, u, false);
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
    Slot* s = active_bucket(u);
    if (!s) fail("internal: ZeRO-2 gradients of unit {} done without a bucket", u);
    const UnitPieces& pc = pieces_[u];
    if (in_backward_) {
        // The step inside the backward: reduced and used at once, on the compute stream.
        comm_.reduce_pieces(s->buf.data(), pc.offsets, pc.counts, type_, compute_);
        in_backward_(u, s->buf.data() + pc.offsets[rank_],
                     layout_.units[u].begin + (std::size_t)pc.offsets[rank_],
                     (std::size_t)pc.counts[rank_]);
        MT_CUDA_CHECK(cudaEventRecord(s->free, compute_));
        s->active = false;
        return;
    }
    MT_CUDA_CHECK(cudaEventRecord(s->ready, compute_));
    MT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, s->ready, 0));
    comm_.reduce_pieces(s->buf.data(), pc.offsets, pc.counts, type_, comm_stream_);
    if (pc.counts[rank_] > 0)
        cuda::add_inplace<T>(grad_shard_.data() + shard_index(u), s->buf.data() + pc.offsets[rank_],
                             pc.counts[rank_], comm_stream_);
    MT_CUDA_CHECK(cudaEventRecord(s->free, comm_stream_));
    s->active = false;
}

template <typename T>
void DeviceZeroUnits<T>::zero_grads() {
    if (grad_shard_.size())
        MT_CUDA_CHECK(cudaMemsetAsync(grad_shard_.data(), 0, grad_shard_.bytes(), compute_));
}

template <typename T>
void DeviceZeroUnits<T>::params_changed() {
    for (Slot& s : param_) {
        if (s.holds > 0)
            fail("internal: ZeRO-3 parameters changed while unit {} is in use", s.unit);
        s.unit = -1;
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
    for (const Slots* set : {&grad_, &param_})
        for (const Slot& s : *set) b += s.buf.bytes();
    return b;
}

template class DeviceZeroUnits<float>;
template class DeviceZeroUnits<__nv_bfloat16>;
template class DeviceZeroUnits<__half>;

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
