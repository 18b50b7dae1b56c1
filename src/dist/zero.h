// Data parallelism with ZeRO sharding (Rajbhandari et al.), as a ParamStore the model runs on.
// Every rank runs the same model on its own rows of the global batch; this store decides what
// each rank keeps of the model states and when gradients and parameters travel:
//
//   stage  parameters    gradients              optimizer state   communication per step
//   0      whole         whole, all-reduced     whole             all-reduce per unit (DDP)
//   1      whole         whole, reduce-scatter  this rank's shard reduce-scatter + all-gather
//   2      whole         this rank's shard      this rank's shard reduce-scatter per unit and
//                                                                 micro-batch + all-gather
//   3      shard         this rank's shard      this rank's shard all-gather per unit use +
//                                                                 reduce-scatter as stage 2
//
// A rank's shard is its balanced piece of the flat parameter buffer (dist::shard_ranges), the
// same for parameters, gradients and optimizer state, so the optimizer of rank r updates the
// floats [offset_r, offset_r + count_r) and nothing else.
//
// Gradients are reduced unit by unit (embedding, blocks, head) as soon as backward has finished a
// unit: a unit is DDP's bucket. At stage 0 the all-reduce is nonblocking and travels while
// backward computes the next units (each acquire lets it progress); the gradients are waited for
// when first read (clip_grad_norm, owned_grads). Stages 0 and 1 keep whole
// gradients and so reduce once per optimizer step, after the last micro-batch
// (set_reduce(false) for the others); stages 2 and 3 keep only a shard, so they reduce each
// micro-batch's unit into it and free the unit's buffer at once. Stage 3 gathers a unit's
// parameters into a buffer of its own at acquire and frees it at release.
//
// Memory (floats, Ψ parameters, N ranks, fp32 on the CPU): parameters Ψ (stage 3: Ψ/N),
// gradients Ψ (stages 2, 3: Ψ/N), optimizer state kΨ (stages 1-3: kΨ/N; AdamW k = 2). Unit
// buffers (gathered parameters, gradient buckets, reduce-scatter output) are tagged
// MemCategory::Communication and live only while a unit is in use.
#pragma once

#include <cstdint>
#include <vector>

#include "core/allocator.h"
#include "dist/communicator.h"
#include "model/param_store.h"

namespace memtrain::dist {

class ZeroStore final : public ParamStore {
  public:
    ZeroStore(const ParamLayout& layout, Communicator& comm, int stage);

    int stage() const { return stage_; }
    // The floats of the flat buffer this rank updates: everything at stage 0, its shard else.
    ShardRange owned() const { return owned_; }
    // Parameters and (reduced) gradients of owned(), valid after the last micro-batch's backward.
    float* owned_params();
    float* owned_grads();

    // Stages 0 and 1: whether this micro-batch's backward reduces its gradients (true for the
    // last micro-batch of a step). Stages 2 and 3 always reduce. Default true.
    void set_reduce(bool reduce) { reduce_ = reduce; }

    // The global L2 norm of the reduced gradients; when max_norm > 0 and the norm is larger,
    // scales them to max_norm (torch.nn.utils.clip_grad_norm_'s coefficient). A collective.
    double clip_grad_norm(double max_norm);
    // After the optimizer has updated owned_params(): stages 1 and 2 all-gather the parameters so
    // every rank holds them whole again. A collective.
    void finish_step();

    // ParamStore
    float* full_params() override;
    float* full_grads() override;
    float* acquire(int u, bool for_write = false) override;
    void release(int u) override;
    float* unit_grads(int u) override;
    void grads_done(int u) override;
    void zero_grads() override;

  private:
    // One unit's piece of the shard layout: how many of its floats each rank owns, and where
    // this rank's piece starts inside the unit.
    struct UnitShards {
        std::vector<int64_t> counts;  // per rank
        int64_t mine_begin = 0;       // index into the unit of this rank's first float
        int64_t mine_count = 0;
    };

    // Waits for the started all-reduces (stage 0) before anyone reads the gradients.
    void sync();

    const ParamLayout* layout_;
    Communicator* comm_;
    bool in_flight_ = false;
    int stage_;
    ShardRange owned_;
    std::vector<UnitShards> unit_shards_;
    bool reduce_ = true;

    Buffer<float> params_;  // whole (stages 0-2) or this rank's shard (stage 3)
    Buffer<float> grads_;   // whole (stages 0-1) or this rank's shard (stages 2-3)
    // Stage 3: gathered parameters per unit, with how many acquires hold them and whether one
    // may write. Stages 2-3: a gradient bucket per unit while backward fills it.
    std::vector<Buffer<float>> gathered_;
    std::vector<int> holds_;
    std::vector<bool> written_;
    std::vector<Buffer<float>> buckets_;
};

}  // namespace memtrain::dist
