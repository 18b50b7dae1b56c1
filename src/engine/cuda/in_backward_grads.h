// The gradients of the CUDA engine's step inside the backward (optim.step_in_backward with one
// micro-batch per step, docs/training.md): no whole gradient buffer, but a bucket per open unit.
// A unit's gradient lives from its first write in the backward (acquire_grads: the bucket,
// zeroed) to grads_done, which hands it to the engine's update (reduce over the ranks, measure,
// update the unit) and frees the bucket for the next unit. At most two are open at once: with
// tied embeddings the head's backward opens the embedding's, which the embedding's backward
// closes last, so there is a bucket for the embedding unit and one for the largest other unit;
// untied, one bucket of the largest unit. Their bytes are step_in_backward_grad_floats x the
// storage size (MemCategory::Gradients), allocated once, as the memory row predicts.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <functional>
#include <utility>

#include "core/device.h"
#include "model/cuda_gpt.h"
#include "model/param_layout.h"

namespace memtrain {

template <typename T>
class InBackwardGrads final : public DeviceGradStore<T> {
  public:
    // Called at grads_done(u) with the unit's complete gradient of this micro-batch (queued on
    // the stream): the bucket is reused by the next unit's work queued after it.
    using UnitDone = std::function<void(int unit, T* grads)>;
    InBackwardGrads(const ParamLayout& layout, bool tied_embeddings, cudaStream_t stream,
                    UnitDone done);

    T* acquire_grads(int u) override;
    void grads_done(int u) override;

  private:
    struct Bucket {
        DeviceBuffer<T> buf;
        int unit = -1;  // the open unit, or -1
    };
    Bucket& bucket_for(int u) {
        return tied_ && u == ParamLayout::embedding_unit() ? embedding_ : other_;
    }

    ParamLayout layout_;
    bool tied_;
    cudaStream_t stream_;
    UnitDone done_;
    Bucket embedding_, other_;  // tied: the embedding unit's, and every other unit's
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
