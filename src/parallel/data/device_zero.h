// ZeRO stages 2 and 3 on GPUs: the CUDA model's DeviceUnitStore (model/cuda_gpt.h) over NCCL.
// Rank r owns [r S, (r + 1) S) of the flat buffer, S = ceil(Ψ / N), the padded equal shards of
// the GPU's ZeRO-1 (cuda_engine.cpp), so the optimizer, its chunk table and the sharded
// checkpoints are the same for stages 1, 2 and 3. A unit (embedding, block, head) cuts into
// uneven pieces along those shards.
//
//  - Gradients (stages 2, 3): backward writes a unit's gradients into a bucket (the embedding and
//    the head have one each, the blocks share a ring of two). When the unit is done, the bucket
//    is reduced piece by piece to the pieces' owners (one grouped NCCL launch) on the
//    communication stream, and each owner adds its piece into its gradient shard, while the
//    backward of the units below runs. Every micro-batch reduces (DeepSpeed's choice: no rank
//    holds whole gradients to accumulate in).
//  - Parameters (stage 3): each rank keeps its shard; a unit is gathered into a slot (embedding,
//    head, a ring of two for blocks) by grouped broadcasts of the owners' pieces before it is
//    used, the next unit is gathered as the current one is acquired (prefetch), and a slot keeps
//    its unit until another needs it, so the last blocks of the forward start the backward
//    without a gather.
// Buckets and slots are allocated once (MemCategory::Communication), so the peak is predicted
// exactly. Everything is queued on streams; the host never waits here.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "core/device.h"
#include "model/cuda_gpt.h"
#include "model/param_layout.h"

namespace memtrain::dist {

template <typename T>
class DeviceZeroUnits final : public DeviceUnitStore<T> {
  public:
    // optim.step_in_backward with one micro-batch per step: no gradient shard; when the backward
    // finishes unit u, its bucket is reduced to the pieces' owners on the compute stream and this
    // rank's reduced piece, `piece` = [lo, lo + n) of the flat buffer, is handed over (to be
    // measured and updated) before the bucket is reused.
    using PieceDone = std::function<void(int u, T* piece, std::size_t lo, std::size_t n)>;
    // `shard` = S; `compute` is the model's stream, `comm_stream` the one collectives run on.
    DeviceZeroUnits(const ParamLayout& layout, int stage, DeviceCommunicator& comm,
                    std::size_t shard, cudaStream_t compute, cudaStream_t comm_stream,
                    PieceDone in_backward = nullptr);
    ~DeviceZeroUnits() override;
    DeviceZeroUnits(const DeviceZeroUnits&) = delete;
    DeviceZeroUnits& operator=(const DeviceZeroUnits&) = delete;

    T* acquire_params(int u) override;
    void release_params(int u) override;
    void prefetch_params(int u) override;
    T* acquire_grads(int u) override;
    void grads_done(int u) override;

    // Stage 2: the whole parameters (N S elements, the padding zero); stage 3: null.
    T* whole_params() { return whole_.data(); }
    // This rank's S parameters (stage 2: inside the whole buffer) and summed gradients (null
    // with the step inside the backward).
    T* param_shard();
    T* grad_shard() { return grad_shard_.size() ? grad_shard_.data() : nullptr; }
    // Queued on the compute stream: the gradient shard becomes zero (the start of a step).
    void zero_grads();
    // The parameter shard changed (the update, loaded weights): gathered units are stale, and
    // later gathers wait for the compute stream's writes.
    void params_changed();
    // The compute stream waits for every reduction queued so far (before reading the shard).
    void join();
    // Bytes of the buckets and slots (MemCategory::Communication), for the memory prediction.
    std::size_t communication_bytes() const;
    // How many units were gathered, and how many of those only when acquired, not prefetched
    // (tests: the prefetch works when the second count stays small).
    int64_t gathers() const { return gathers_; }
    int64_t demand_gathers() const { return demand_gathers_; }

  private:
    struct Slot {
        DeviceBuffer<T> buf;
        int unit = -1;        // the unit it holds (-1: none or stale)
        int holds = 0;        // parameter acquires not yet released
        bool active = false;  // gradients: acquired and not yet done
        int64_t used = 0;     // last use, for least-recently-used choice in the ring
        cudaEvent_t ready = nullptr, free = nullptr;
    };
    void make_slot(Slot& s, std::size_t n);
    // A set of slots: [0] the embedding's, [1] the head's, [2] and [3] the blocks' ring.
    static constexpr int kSlots = 4;
    using Slots = std::array<Slot, kSlots>;
    // The slot of `set` a unit goes to: its own (embedding, head) or the least recently used free
    // block slot; null when every block slot is held.
    Slot* slot_for(Slots& set, int u, bool need_free);
    void gather(int u, Slot& s);
    // The parameter slot holding unit u, or null; the gradient bucket unit u is filling, or null.
    Slot* resident(int u);
    Slot* active_bucket(int u);

    const ParamLayout layout_;
    int stage_, rank_, world_;
    DeviceCommunicator& comm_;
    std::size_t shard_;
    cudaStream_t compute_, comm_stream_;
    DeviceType type_;
    // Per unit: each rank's piece, as offsets into the unit and counts.
    std::vector<UnitPieces> pieces_;
    // Where this rank's piece of unit u starts in its shard (when it has one).
    std::size_t shard_index(int u) const {
        return layout_.units[u].begin + (std::size_t)pieces_[u].offsets[rank_] -
               (std::size_t)rank_ * shard_;
    }
    DeviceBuffer<T> whole_, param_shard_, grad_shard_;
    PieceDone in_backward_;
    Slots grad_, param_;  // gradient buckets; gathered parameters (stage 3)
    cudaEvent_t changed_ = nullptr, joined_ = nullptr;
    int64_t clock_ = 0, gathers_ = 0, demand_gathers_ = 0;
};

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
