// The CUDA engine's data parallelism (see device_data_parallel.h): the shard ranges, NCCL, and
// the collectives each placement of dist::ShardSpec calls for.
#include "parallel/data/device_data_parallel.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

using dist::device_type;
using dist::sharded;

template <typename T>
DeviceDataParallel<T>::DeviceDataParallel(bool collective, const dist::ShardSpec& spec,
                                          const ParamLayout& layout, dist::Communicator& comm,
                                          cudaStream_t compute, int64_t grain,
                                          typename dist::DeviceZeroUnits<T>::PieceDone in_backward)
    : layout_(layout), comm_(comm), compute_(compute), spec_(spec) {
    // Launched by mpirun (an MPI communicator, even of one rank): NCCL, so `mpirun -np 1` runs
    // this path at world size 1 against the plain single process.
    const bool launched = collective;
    if (!launched && (sharded(spec_.optimizer) || sharded(spec_.grads) || sharded(spec_.params)))
        fail("internal: model states sharded ({}) on one GPU without mpirun",
             dist::describe(spec_));
    world_ = comm.size();
    rank_ = comm.rank();
    const std::size_t psi = layout_.total;
    // The grain only where the optimizer state is sharded between ranks.
    const int64_t g = launched && sharded(spec_.optimizer) ? grain : 1;
    shard_ = (std::size_t)dist::padded_shard_size((int64_t)psi, world_, g);
    shards_ = dist::padded_shard_ranges((int64_t)psi, world_, g);
    first_ = sharded(spec_.optimizer) ? (std::size_t)shards_[rank_].offset : 0;
    count_ = sharded(spec_.optimizer) ? (std::size_t)shards_[rank_].count : psi;
    if (!launched) return;
    dcomm_ = dist::make_nccl_communicator(
        dist::HostLink{rank_, world_, [&comm](void* d, int64_t b) { comm.broadcast(d, b, 0); }});
    comm_stream_ = std::make_unique<UnitGradStream>(compute_, layout_.units.size());
    if (sharded(spec_.grads))
        zero_ = std::make_unique<dist::DeviceZeroUnits<T>>(
            layout_, sharded(spec_.params) ? 3 : 2, *dcomm_, shard_, compute_, comm_stream_->get(),
            std::move(in_backward));
}

template <typename T>
void DeviceDataParallel<T>::attach(CudaGPT<T>& model) {
    model_ = &model;
    if (!dcomm_) return;
    model.set_waiter([this](const char* what) { wait(what); });
    if (all_reduces()) model.set_grads_done_hook([this](int u) { start_unit_all_reduce(u); });
}

template <typename T>
typename DeviceDataParallel<T>::Piece DeviceDataParallel<T>::piece(const ParamUnit& unit) const {
    const std::size_t lo = std::max(unit.begin, first_);
    const std::size_t hi = std::max(lo, std::min(unit.end, first_ + count_));
    return Piece{lo, hi - lo};
}

template <typename T>
void DeviceDataParallel<T>::gather_unit(const ParamUnit& unit, const float* mine, float* whole) {
    const auto counts = dist::unit_pieces(shards_, (int64_t)unit.begin, (int64_t)unit.end).counts;
    comm_.all_gather(mine, whole, counts);
}

template <typename T>
void DeviceDataParallel<T>::begin_step() {
    if (zero_) zero_->zero_grads();
}

template <typename T>
void DeviceDataParallel<T>::before_backward(bool last) {
    if (comm_stream_) comm_stream_->arm(all_reduces() && last);
}

template <typename T>
void DeviceDataParallel<T>::after_backward() {
    if (comm_stream_) comm_stream_->join();
}

template <typename T>
void DeviceDataParallel<T>::start_unit_all_reduce(int u) {
    if (!comm_stream_->follow(u)) return;
    const ParamUnit& unit = layout_.units[u];
    dcomm_->all_reduce_sum(model_->grads() + unit.begin, (int64_t)unit.size(), device_type<T>(),
                           comm_stream_->get());
}

template <typename T>
T* DeviceDataParallel<T>::step_grads() {
    // ZeRO-2/3: the reductions of the last micro-batch's units are done before the shard is read.
    if (zero_) zero_->join();
    return sharded(spec_.grads) ? grad_shard() : model_->grads();
}

template <typename T>
void DeviceDataParallel<T>::reduce_gradients(double* sum_sq, double* unit_sq) {
    // ZeRO-1: every rank gets its shard of the summed gradients (ZeRO-2/3 have it already).
    if (sharded(spec_.optimizer) && !sharded(spec_.grads))
        dcomm_->reduce_scatter_sum(model_->grads(), model_->grads() + first_, (int64_t)shard_,
                                   device_type<T>(), compute_);
    // The norm per unit (this rank's piece of it), the pieces' sums combined over the ranks,
    // then over the units in order: the step inside the backward sums it the same way.
    if (!unit_sq) fail("internal: the whole model's gradient norm without room for unit sums");
    const std::size_t units = layout_.units.size();
    for (std::size_t u = 0; u < units; u++) {
        const auto [lo, n] = piece(layout_.units[u]);
        if (n > 0)
            cuda::sum_squares<T>(unit_sq + u, grad_shard() + (lo - first_), (int64_t)n, compute_);
        else
            MT_CUDA_CHECK(cudaMemsetAsync(unit_sq + u, 0, sizeof(double), compute_));
    }
    combine_unit_sums(unit_sq);
    cuda::sum_doubles_to_device(sum_sq, unit_sq, (int64_t)units, compute_);
}

template <typename T>
void DeviceDataParallel<T>::combine_unit_sums(double* unit_sq) {
    if (sharded(spec_.optimizer))
        dcomm_->all_reduce_sum(unit_sq, (int64_t)layout_.units.size(), dist::DeviceType::F64,
                               compute_);
}

template <typename T>
void DeviceDataParallel<T>::all_reduce_now(T* grads, std::size_t n) {
    if (dcomm_) dcomm_->all_reduce_sum(grads, (int64_t)n, device_type<T>(), compute_);
}

template <typename T>
void DeviceDataParallel<T>::share_updated_params() {
    if (!sharded(spec_.optimizer)) return;  // every rank updated all of them
    if (sharded(spec_.params)) {
        zero_->params_changed();
        zero_->prefetch_params(ParamLayout::embedding_unit());  // the next forward's first unit
    } else {
        dcomm_->all_gather(param_shard(), whole_params(), (int64_t)shard_, device_type<T>(),
                           compute_);
    }
}

template <typename T>
void DeviceDataParallel<T>::wait(const char* what) {
    if (dcomm_)
        dcomm_->wait(compute_, what);
    else
        MT_CUDA_CHECK(cudaStreamSynchronize(compute_));
}

template <typename T>
std::optional<MemoryPrediction> DeviceDataParallel<T>::communication_row() const {
    if (!zero_) return std::nullopt;
    return MemoryPrediction{MemCategory::Communication,
                            sharded(spec_.params)
                                ? "gradient buckets and gathered units: embedding, head, 2 blocks"
                                : "gradient buckets: embedding, head, 2 blocks",
                            zero_->communication_bytes()};
}

template class DeviceDataParallel<float>;
template class DeviceDataParallel<__nv_bfloat16>;
template class DeviceDataParallel<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
