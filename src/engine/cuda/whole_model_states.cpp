// The whole model's states for the CUDA engine (see whole_model_states.h).
#include "engine/cuda/whole_model_states.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/device_memory.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

using cuda::to_storage;

template <typename T>
float* WeightsStore<T>::acquire(int u, bool for_write) {
    if (held_ >= 0 && held_ != u)
        fail("internal: the CUDA engine's weight store holds one unit at a time");
    const ParamUnit& unit = s_.layout().units.at(u);
    const auto master = s_.master_weights();
    const std::size_t first = s_.dp_.first();
    const bool sharded = s_.dp_.master_sharded();
    written_ = written_ || for_write;
    if (holds_++ > 0) return lent_ ? master.data + (unit.begin - first) : host_.data();
    held_ = u;
    // The whole unit's master weights in host memory already (ZeRO-Offload, one range): lent.
    lent_ = master.on_host && !sharded;
    if (lent_) return master.data + (unit.begin - first);
    // This rank's piece of the unit (all of it unless the master weights are sharded), then
    // every rank's piece gathered over the host communicator.
    const auto [lo, n] = s_.dp_.piece(unit);
    host_.resize(unit.size());
    if (sharded) piece_.resize(n);
    float* mine = sharded ? piece_.data() : host_.data();
    if (!master.data) {  // optim.master = "none": the bf16 parameters, decoded
        download_decoded(mine, s_.dp_.param_shard() + (lo - first), n, s_.stream_,
                         [this](const char* what) { s_.wait(what); });
    } else if (master.on_host)
        std::copy_n(master.data + (lo - first), n, mine);
    else if (n > 0)
        MT_CUDA_CHECK(cudaMemcpyAsync(mine, master.data + (lo - first), n * sizeof(float),
                                      cudaMemcpyDeviceToHost, s_.stream_));
    s_.wait("a weight transfer");
    if (sharded) s_.dp_.gather_unit(unit, piece_.data(), host_.data());
    return host_.data();
}

template <typename T>
void WeightsStore<T>::release(int u) {
    if (held_ != u || holds_ <= 0) fail("internal: WeightsStore::release({}) without acquire", u);
    if (--holds_ > 0) return;
    if (written_) {
        const ParamUnit& unit = s_.layout().units[u];
        write_back(unit,
                   lent_ ? s_.master_weights().data + (unit.begin - s_.dp_.first()) : host_.data());
    }
    held_ = -1;
    written_ = false;
    lent_ = false;
}

template <typename T>
void WeightsStore<T>::write_back(const ParamUnit& unit, const float* src) {
    const auto master = s_.master_weights();
    DeviceDataParallel<T>& dp = s_.dp_;
    const std::size_t first = dp.first();
    const auto [lo, n] = dp.piece(unit);
    // This rank's piece of the master weights (a lent unit was written in place; none under
    // optim.master = "none").
    if (!lent_ && master.data) {
        if (master.on_host)
            std::copy_n(src + (lo - unit.begin), n, master.data + (lo - first));
        else if (n > 0)
            MT_CUDA_CHECK(cudaMemcpyAsync(master.data + (lo - first), src + (lo - unit.begin),
                                          n * sizeof(float), cudaMemcpyHostToDevice, s_.stream_));
    }
    // The compute copy: cast on the device where the device holds the whole unit's master
    // weights (nothing to do in fp32, where they are the parameters); else rounded on the host
    // and copied up, the whole unit where every rank holds the parameters whole, or this rank's
    // piece (ZeRO-3).
    if (master.data && !master.on_host && !dp.master_sharded()) {
        if constexpr (!std::is_same_v<T, float>)
            cuda::cast<T, float>(dp.whole_params() + unit.begin, master.data + (unit.begin - first),
                                 (int64_t)unit.size(), s_.stream_);
    } else {
        std::vector<T> stage(unit.size());
        for (std::size_t i = 0; i < unit.size(); i++) stage[i] = to_storage<T>(src[i]);
        if (T* whole = dp.whole_params()) {
            MT_CUDA_CHECK(cudaMemcpyAsync(whole + unit.begin, stage.data(), unit.size() * sizeof(T),
                                          cudaMemcpyHostToDevice, s_.stream_));
        } else if (n > 0) {
            MT_CUDA_CHECK(cudaMemcpyAsync(dp.param_shard() + (lo - first),
                                          stage.data() + (lo - unit.begin), n * sizeof(T),
                                          cudaMemcpyHostToDevice, s_.stream_));
        }
    }
    dp.params_changed();
    s_.wait("a weight transfer");  // the host buffers are reused
}

template <typename T>
WholeModelStates<T>::WholeModelStates(const RunPlan& plan, dist::Communicator& comm,
                                      cudaStream_t stream)
    : plan_(plan),
      stream_(stream),
      dp_(plan.collective, plan.states, make_param_layout(plan.cfg.model), comm, stream,
          (int64_t)shard_grain(plan.cfg.optim), in_backward_pieces(plan)),
      store_(*this) {
    steps_in_backward_ = plan_.cfg.no_grad_buffer();
    if (steps_in_backward_ && !dp_.unit_store()) {
        const ParamLayout lay = make_param_layout(plan_.cfg.model);
        in_backward_ = std::make_unique<InBackwardGrads<T>>(
            lay, plan_.cfg.model.tied_embeddings, stream_, [this](int u, T* grads) {
                const ParamUnit& unit = layout().units[u];
                unit_done(u, grads, unit.begin, unit.size());
            });
    }
    model_ = std::make_unique<CudaGPT<T>>(plan_.cfg.model, stream_, dp_.padded_total(),
                                          dp_.unit_store(), nullptr, in_backward_.get());
    dp_.attach(*model_);
    model_->set_cuda_graphs(plan_.cuda_graphs);
    if (dist::offloaded(dp_.spec().optimizer)) {
        // Offload streams each unit's gradients to the host as the last backward finishes it
        // (not under CUDA graphs, whose capture would take the side stream in; with several
        // ranks the reduced shard comes down after the backward).
        const bool stream_grads = !plan_.cuda_graphs && !dp_.collective();
        offload_ =
            std::make_unique<DeviceOffload<T>>(plan_.cfg.optim, layout(), dp_.first(), dp_.count(),
                                               stream_, stream_grads, plan_.cfg.train.seed);
        offload_->attach(*model_);
    } else {
        const std::vector<char> whole = whole_step_tensors(plan_.cfg.optim, layout());
        if (std::find(whole.begin(), whole.end(), 1) != whole.end() && dp_.master_sharded() &&
            dp_.device_comm() && dp_.world() > 1)
            shard_gather_ = std::make_unique<dist::DeviceShardGather>(layout(), dp_.shards(), whole,
                                                                      *dp_.device_comm());
        opt_ = std::make_unique<DeviceOptimizer<T>>(
            plan_.cfg.optim, layout(), dp_.first(), dp_.count(), stream_,
            [this](const char* what) { wait(what); }, plan_.cfg.train.seed,
            plan_.cfg.optim.step_in_backward, shard_gather_.get());
    }
}

template <typename T>
typename dist::DeviceZeroUnits<T>::PieceDone WholeModelStates<T>::in_backward_pieces(
    const RunPlan& plan) {
    if (!plan.cfg.no_grad_buffer() || !dist::sharded(plan.states.grads)) return nullptr;
    return [this](int u, T* piece, std::size_t lo, std::size_t n) { unit_done(u, piece, lo, n); };
}

template <typename T>
void WholeModelStates<T>::unit_done(int u, T* grads, std::size_t lo, std::size_t n) {
    if (!armed_ || !unit_sq_)
        fail("internal: a unit's gradient outside the step inside the backward's armed passes");
    // As the two-phase step sees it: DDP's all-reduce of the unit (ZeRO-2/3 reduced the piece
    // already), the piece's sum of squares (combined over the ranks at disarm).
    if (!dp_.master_sharded()) dp_.all_reduce_now(grads, n);
    if (n == 0)
        MT_CUDA_CHECK(cudaMemsetAsync(unit_sq_ + u, 0, sizeof(double), stream_));
    else
        cuda::sum_squares<T>(unit_sq_ + u, grads, (int64_t)n, stream_);
    // (Every rank, for every unit: Muon under ZeRO gathers the unit's cut matrices.)
    if (update_) opt_->step_unit(u, lo, n, dp_.param_shard(), grads, update_, stream_);
}

template <typename T>
void WholeModelStates<T>::reduce(double* sum_sq, double* unit_sq) {
    if (!steps_in_backward_) return dp_.reduce_gradients(sum_sq, unit_sq);
    // The units' sums of the update pass (combined over the ranks), added as the two-phase step
    // adds them.
    if (!unit_sq) fail("internal: the step inside the backward without unit sums");
    cuda::sum_doubles_to_device(sum_sq, unit_sq, (int64_t)layout().units.size(), stream_);
}

template <typename T>
WholeModelStates<T>::~WholeModelStates() {
    // Nothing queued may outlive what it reads: the streams drain before the parts go (the
    // offload part, the model, then data parallelism's store and streams, in reverse order of
    // the members).
    cudaStreamSynchronize(stream_);
    dp_.synchronize();
}

template <typename T>
std::string WholeModelStates<T>::overflow() {
    const ParamLayout& lay = layout();
    if (steps_in_backward_) {
        // No gradient is left after the step inside the backward: the units' sums of squares
        // name where it was not finite (every rank summed the same reduced gradients).
        std::vector<double> sq(lay.units.size());
        if (unit_sq_)
            MT_CUDA_CHECK(cudaMemcpyAsync(sq.data(), unit_sq_, sq.size() * sizeof(double),
                                          cudaMemcpyDeviceToHost, stream_));
        wait("the overflow check");
        std::string names;
        int bad = 0;
        for (std::size_t u = lay.units.size(); u-- > 0;)  // backward order: the head first
            if (!std::isfinite(sq[u]) && bad++ < 3)
                names += (names.empty() ? "" : ", ") + lay.units[u].name;
        return fmt::format("non-finite gradients in {} of {} units, first in backward order: {}",
                           bad, lay.units.size(), bad ? names : "none found");
    }
    // Only after a skipped step: a sum of squares per tensor of this rank's gradient range, the
    // non-finite ones marked, the marks combined over the ranks.
    const std::size_t first = dp_.first(), last = dp_.first() + dp_.count();
    const std::size_t n = lay.tensors.size();
    DeviceBuffer<double> sums(n, MemCategory::Workspace);
    MT_CUDA_CHECK(cudaMemsetAsync(sums.data(), 0, sums.bytes(), stream_));
    for (std::size_t i = 0; i < n; i++) {
        const ParamSpec& t = lay.tensors[i];
        const std::size_t lo = std::max(t.offset, first), hi = std::min(t.offset + t.numel, last);
        if (lo < hi)
            cuda::sum_squares<T>(sums.data() + i, dp_.grad_shard() + (lo - first),
                                 (int64_t)(hi - lo), stream_);
    }
    std::vector<double> host(n);
    MT_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), sums.data(), sums.bytes(), cudaMemcpyDeviceToHost, stream_));
    wait("the overflow check");
    std::vector<int64_t> bad(n);
    for (std::size_t i = 0; i < n; i++) bad[i] = std::isfinite(host[i]) ? 0 : 1;
    dp_.combine_flags(bad);
    // Backward order: the head, the blocks from the last, the embedding; within a unit, the
    // later tensors first (a block's backward starts at its MLP output projection).
    auto rank_of = [&](std::size_t i) {
        const std::size_t off = lay.tensors[i].offset;
        int u = 0;
        while (off >= lay.units[u].end) u++;
        return std::pair<int, int64_t>{u == 0 ? INT32_MAX : -u, -(int64_t)i};
    };
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < n; i++)
        if (bad[i]) order.push_back(i);
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return rank_of(a) < rank_of(b); });
    std::string names;
    for (std::size_t k = 0; k < order.size() && k < 3; k++)
        names += (k ? ", " : "") + lay.tensors[order[k]].name;
    if (order.size() > 3) names += ", ...";
    return fmt::format("non-finite gradients in {} of {} tensors, first in backward order: {}",
                       order.size(), n, order.empty() ? "none found" : names);
}

template <typename T>
std::vector<MemoryPrediction> WholeModelStates<T>::predicted_memory(const RematPlan& remat, int B,
                                                                    int T_) const {
    // The plan's rows (engine/device_memory.h), checked against the device before these states
    // allocated, and the ZeRO-2/3 buckets sized here.
    std::vector<MemoryPrediction> out = predict_cuda_memory(
        plan_.cfg, remat, DevicePlacement{dp_.world(), dp_.rank(), dp_.collective()}, B, T_);
    if (auto row = dp_.communication_row()) out.push_back(*row);
    return out;
}

template <typename T>
std::string WholeModelStates<T>::memory_footer() const {
    std::string out = device_in_use_line();
    if (offload_) out += offload_->memory_line();
    if (model_->offloaded_bytes() > 0)
        out += fmt::format(
            "{:<16} {:>12}  (train.remat = offload: block inputs in pinned host "
            "memory, copied out in the forward and prefetched in the backward)\n",
            "offloaded", mib(model_->offloaded_bytes()));
    out += fmt::format("{:<16} {:>12}  (host: code, libraries, loaders, pinned staging)\n",
                       "process peak RSS", mib(process_peak_rss()));
    return out;
}

template class WeightsStore<float>;
template class WeightsStore<__nv_bfloat16>;
template class WeightsStore<__half>;
template class WholeModelStates<float>;
template class WholeModelStates<__nv_bfloat16>;
template class WholeModelStates<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
