// The step inside the backward's gradient buckets on the GPU (see in_backward_grads.h).
#include "engine/cuda/in_backward_grads.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.h"

namespace memtrain {

template <typename T>
InBackwardGrads<T>::InBackwardGrads(const ParamLayout& layout, bool tied_embeddings,
                                    cudaStream_t stream, UnitDone done)
    : layout_(layout), tied_(tied_embeddings), stream_(stream), done_(std::move(done)) {
    // The sizes step_in_backward_grad_floats prices.
    const int E = ParamLayout::embedding_unit();
    if (tied_) embedding_.buf = DeviceBuffer<T>(layout_.units[E].size(), MemCategory::Gradients);
    other_.buf = DeviceBuffer<T>(largest_other_unit_floats(layout_, tied_), MemCategory::Gradients);
}

template <typename T>
T* InBackwardGrads<T>::acquire_grads(int u) {
    Bucket& b = bucket_for(u);
    if (b.unit == u) return b.buf.data();
    if (b.unit >= 0)
        fail("internal: unit {}'s gradient opened while unit {} holds its bucket", u, b.unit);
    const ParamUnit& unit = layout_.units.at(u);
    MT_CUDA_CHECK(cudaMemsetAsync(b.buf.data(), 0, unit.size() * sizeof(T), stream_));
    b.unit = u;
    return b.buf.data();
}

template <typename T>
void InBackwardGrads<T>::grads_done(int u) {
    Bucket& b = bucket_for(u);
    if (b.unit != u) fail("internal: grads_done({}) of a unit whose gradient is not open", u);
    done_(u, b.buf.data());
    b.unit = -1;
}

template class InBackwardGrads<float>;
template class InBackwardGrads<__nv_bfloat16>;
template class InBackwardGrads<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
