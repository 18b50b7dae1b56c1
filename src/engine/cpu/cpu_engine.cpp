// The CPU engine (see cpu_engine.h).
#include "engine/cpu/cpu_engine.h"

#include <fmt/format.h>

#include "core/error.h"
#include "engine/host_memory.h"
#include "parallel/placement.h"

namespace memtrain {

CpuEngine::CpuEngine(const RunPlan& plan, dist::Communicator& comm)
    : cfg_(plan.cfg), comm_(comm), layout_(make_param_layout(plan.cfg.model)) {
    store_ = std::make_unique<dist::ZeroStore>(layout_, comm_, cfg_.train.zero_stage);
    model_ = std::make_unique<GPT>(cfg_.model, store_.get());
    const dist::ShardRange owned = store_->owned();
    opt_ = make_optimizer(cfg_.optim, layout_, owned.offset, owned.count);
}

void CpuEngine::begin_step() {
    model_->zero_grads();
    loss_sum_ = 0;
    micro_batches_ = 0;
}

void CpuEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                 float grad_scale, bool last) {
    store_->set_reduce(last);  // stages 0-1 reduce once per step
    loss_sum_ += model_->forward_backward(inputs, targets, B, T, grad_scale);
    micro_batches_++;
}

StepResult finish_zero_step(dist::ZeroStore& store, Optimizer& opt, double loss_sum,
                            int micro_batches, double lr, double max_norm) {
    StepResult r;
    r.loss = micro_batches ? loss_sum / micro_batches : 0.0;
    r.grad_norm = store.clip_grad_norm(max_norm);
    opt.step(store.owned_params(), store.owned_grads(), lr);
    store.finish_step();
    return r;
}

StepResult CpuEngine::finish_step(double lr, double max_norm) {
    return finish_zero_step(*store_, *opt_, loss_sum_, micro_batches_, lr, max_norm);
}

double CpuEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    return model_->forward_loss(inputs, targets, B, T);
}

void CpuEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    model_->forward_logits(inputs, B, T, out);
}

std::string CpuEngine::memory_title() const {
    const int N = comm_.size();
    return fmt::format("host, fp32{}", N > 1 ? fmt::format(", rank 0 of {}, ZeRO stage {}", N,
                                                           cfg_.train.zero_stage)
                                             : std::string());
}

std::vector<MemoryPrediction> CpuEngine::predicted_memory(int B, int T) const {
    return predict_cpu_memory(cfg_, model_->remat_plan(), comm_.rank(), B, T);
}

std::string CpuEngine::memory_footer() const {
    std::string out = host_rss_line();
    // What the overlap did, beside the communication buffers it cost (parallel/data/zero_store.h).
    const dist::ReduceStats& r = store_->reduce_stats();
    const dist::PrefetchStats& p = store_->prefetch_stats();
    if (r.started > 0)
        out += fmt::format(
            "overlap: {} reduce-scatters, {} arrived under compute, the rest waited for (at most "
            "{} in flight)\n",
            r.started, r.arrived, r.max_in_flight);
    if (comm_.size() > 1 && store_->stage() == 0) {
        // What the gradient all-reduce moves, for comparison with the parameter server's counted
        // bytes (engine/cpu/ps_engine.h): the ring's formula (MPI may pick another algorithm).
        const double psi4 = 4.0 * (double)layout_.total, N = comm_.size();
        out += fmt::format(
            "all-reduce per step: Ψ = {} floats; a ring moves 2 Ψ (N-1)/N x 4 B = {:.2f} MiB per "
            "rank, {:.2f} MiB over all links\n",
            layout_.total, 2 * (N - 1) / N * psi4 / 1048576.0, 2 * (N - 1) * psi4 / 1048576.0);
    }
    if (p.hits + p.misses > 0)
        out += fmt::format("overlap: ZeRO-3 gathers {} prefetched, {} on the spot, {} dropped\n",
                           p.hits, p.misses, p.dropped);
    return out;
}

}  // namespace memtrain
