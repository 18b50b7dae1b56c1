// The CUDA engine's data parallelism (engine/cuda/cuda_engine.cpp): where this rank's model states
// live (dist::ShardSpec, the same table as the run plan's) and the collectives that keep them in
// step. Under mpirun (the plan's `collective`): NCCL between the ranks' GPUs on a communication
// stream, by the placements
//   - optimizer state replicated (DDP): the gradients all-reduced unit by unit during the last
//     micro-batch's backward;
//   - optimizer state sharded, gradients replicated (ZeRO-1): the gradients reduce-scattered
//     after the backward, the updated shards all-gathered after the update;
//   - gradients sharded (ZeRO-2), parameters too (ZeRO-3): dist::DeviceZeroUnits reduces them in
//     buckets during every backward (and gathers the parameter units as the model uses them).
// One process without mpirun is the trivial case: everything replicated, no collectives.
// Part of splitting the CUDA engine along its plan (issue 15).
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "core/cuda_streams.h"
#include "model/cuda_gpt.h"
#include "model/param_layout.h"
#include "parallel/data/device_zero.h"
#include "parallel/placement.h"

namespace memtrain {

template <typename T>
class DeviceDataParallel {
  public:
    // This rank of `comm`, with the engine's compute stream, holding the model states as `spec`
    // (the run plan's table) says. `collective` (the plan's decision: launched by mpirun, even at
    // world size 1): NCCL between the ranks; otherwise one process, everything replicated.
    // `grain`: shards are padded to a multiple of it (dist::padded_shard_ranges; the optimizer
    // state format's shard_grain).
    // `in_backward` (optim.step_in_backward with one micro-batch per step, ZeRO-2/3): the store
    // keeps no gradient shard and hands each unit's reduced piece to it
    // (dist::DeviceZeroUnits::PieceDone).
    DeviceDataParallel(bool collective, const dist::ShardSpec& spec, const ParamLayout& layout,
                       dist::Communicator& comm, cudaStream_t compute, int64_t grain = 1,
                       typename dist::DeviceZeroUnits<T>::PieceDone in_backward = nullptr);
    DeviceDataParallel(const DeviceDataParallel&) = delete;
    DeviceDataParallel& operator=(const DeviceDataParallel&) = delete;

    const dist::ShardSpec& spec() const { return spec_; }
    // Each rank holds its shard of the optimizer state and of the fp32 master weights.
    bool master_sharded() const { return dist::sharded(spec_.optimizer); }
    bool collective() const { return dcomm_ != nullptr; }  // NCCL between the ranks
    dist::DeviceCommunicator* device_comm() { return dcomm_.get(); }
    // Every rank's range [rank S, (rank + 1) S) of the flat buffer, clipped to Ψ.
    const std::vector<dist::ShardRange>& shards() const { return shards_; }
    int rank() const { return rank_; }
    int world() const { return world_; }
    // The model's flat buffers hold world x S elements (NCCL shards are equal: S is
    // ceil(total / world) rounded up to the grain), and its units go through the ZeRO-2/3 store
    // (null below stage 2).
    std::size_t padded_total() const { return shard_ * world_; }
    DeviceUnitStore<T>* unit_store() { return zero_.get(); }
    // Connects the model built over unit_store(): its waits fail fast on a dead peer, and DDP
    // takes its gradients unit by unit as the last backward finishes them.
    void attach(CudaGPT<T>& model);

    // This rank's range [first(), first() + count()) of the optimizer's state and of the fp32
    // master weights: its shard where the optimizer state is sharded, else everything.
    std::size_t first() const { return first_; }
    std::size_t count() const { return count_; }
    // This rank's piece of `unit` inside that range: [lo, lo + n).
    struct Piece {
        std::size_t lo = 0, n = 0;
    };
    Piece piece(const ParamUnit& unit) const;
    // Every rank's piece of `unit`, gathered over the host communicator into `whole` (a
    // collective); `mine` is this rank's piece.
    void gather_unit(const ParamUnit& unit, const float* mine, float* whole);

    // This rank's parameters and gradients of its range (under ZeRO-1 the gradients after
    // reduce_gradients), and the whole parameters (null where they are sharded: ZeRO-3).
    T* param_shard() { return zero_ ? zero_->param_shard() : model_->params() + first_; }
    T* grad_shard() { return zero_ ? zero_->grad_shard() : model_->grads() + first_; }
    T* whole_params() { return zero_ ? zero_->whole_params() : model_->params(); }

    // The step, in order.
    void begin_step();                // the sharded gradients to zero
    void before_backward(bool last);  // DDP reduces during the last micro-batch's backward
    void after_backward();            // ... and the compute stream waits for it
    // After the step's backwards: the gradients as the step reads them (the model's, or this
    // rank's sharded ones once their reductions are joined).
    T* step_grads();
    // This rank's shard of the summed gradients (ZeRO-1's reduce-scatter), and in `sum_sq` the
    // sum of squares of all of them, taken per unit into `unit_sq` (room for a double per unit:
    // this rank's piece of each unit, the pieces' sums combined over the ranks), then over the
    // units in order, as the step inside the backward takes it.
    void reduce_gradients(double* sum_sq, double* unit_sq);
    // optim.step_in_backward: one unit's gradient of this micro-batch, `grads` (n values), summed
    // over the ranks in place on the compute stream (nothing on one GPU), as DDP's all-reduce of
    // that unit would sum it.
    void all_reduce_now(T* grads, std::size_t n);
    // The units' sums of squares of this rank's pieces, summed over the ranks where the pieces
    // are shards (on the compute stream; nothing where every rank measured whole units).
    void combine_unit_sums(double* unit_sq);
    // After the update: every rank's updated shard to every rank (ZeRO-1/2), or the gathered
    // units marked stale and the next forward's first unit prefetched (ZeRO-3).
    void share_updated_params();
    // The parameters were written outside a step (weight I/O): ZeRO-3 gathers again.
    void params_changed() {
        if (zero_) zero_->params_changed();
    }
    // Waits for the compute stream; with NCCL through the device communicator, which fails fast
    // (naming `what`) where a dead peer would leave a collective waiting forever.
    void wait(const char* what);
    // Waits for the collectives queued beside the compute stream, before the engine frees what
    // they read (in its destructor: unchecked).
    void synchronize() {
        if (comm_stream_) cudaStreamSynchronize(comm_stream_->get());
    }
    // Non-finite flags (1) of this rank's tensors, combined over the ranks.
    void combine_flags(std::vector<int64_t>& flags) {
        comm_.all_reduce_max(flags.data(), (int64_t)flags.size());
    }

    // The memory report's rows of the ZeRO-2/3 buckets (none below stage 2).
    std::optional<MemoryPrediction> communication_row() const;
    std::pair<int64_t, int64_t> zero_gathers() const {
        return zero_ ? std::pair<int64_t, int64_t>{zero_->gathers(), zero_->demand_gathers()}
                     : std::pair<int64_t, int64_t>{0, 0};
    }

  private:
    // DDP: all-reduces unit u's gradients on the communication stream (the grads-done hook).
    void start_unit_all_reduce(int u);
    // DDP: no shard of the optimizer state, so every rank needs all of the summed gradients.
    bool all_reduces() const { return dcomm_ && !dist::sharded(spec_.optimizer); }

    const ParamLayout layout_;
    dist::Communicator& comm_;  // the host's (MPI): weight I/O and the overflow flags
    cudaStream_t compute_;
    dist::ShardSpec spec_;
    int world_ = 1, rank_ = 0;
    std::size_t shard_ = 0, first_ = 0, count_ = 0;
    std::vector<dist::ShardRange> shards_;  // every rank's [rank S, (rank + 1) S), clipped to Ψ
    std::unique_ptr<dist::DeviceCommunicator> dcomm_;
    std::unique_ptr<UnitGradStream> comm_stream_;  // the collectives beside the compute stream
    // ZeRO-2/3: the model's gradients (and stage 3's parameters) sharded, units in buckets and
    // gathered slots (parallel/data/device_zero.h).
    std::unique_ptr<dist::DeviceZeroUnits<T>> zero_;
    CudaGPT<T>* model_ = nullptr;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
