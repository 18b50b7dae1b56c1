// The end of a CPU engine's step, for each way the trained states are held: a ZeroStore, one
// tensor-parallel shard, pipeline stages (see cpu_engine.h).
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "core/phase_clock.h"
#include "engine/cpu/cpu_engine.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

StepResult CpuEngine::finish_step(double lr, double max_norm) {
    if (pipelined()) return finish_stage_step(lr, max_norm);
    if (zero_) return finish_zero_step(lr, max_norm);
    return finish_shard_step(lr, max_norm);
}

StepResult CpuEngine::finish_zero_step(double lr, double max_norm) {
    // The mean loss of the micro-batches, the global norm clipped, the optimizer over the rank's
    // range, the stage's all-gather.
    StepResult r;
    r.loss = micro_batches_ ? loss_sum_ / micro_batches_ : 0.0;
    if (in_backward()) {
        // The last backward has updated every unit (last_backward_with_update).
        if (lr != update_lr_ || max_norm != update_max_norm_)
            fail("internal: finish_step({}, {}) after prepare_update({}, {})", lr, max_norm,
                 update_lr_, update_max_norm_);
        r.grad_norm = update_norm_;
        opt_->part(0).advance();
        update_prepared_ = false;
    } else {
        r.grad_norm = zero_->clip_grad_norm(max_norm);
        Optimizer& opt = opt_->part(0);
        if (zero_->bf16_params()) {
            // optim.master = "none": each unit decoded, updated and rounded, a chunk at a time.
            zero_->step_units([&opt, lr](float* p, float* g, std::size_t at,
                                         std::size_t n) { opt.step_part(p, g, lr, at, n); },
                              opt.steps_taken() + 1);
            opt.advance();
        } else {
            opt.step(zero_->owned_params(), zero_->owned_grads(), lr);
        }
    }
    zero_->finish_step();
    return r;
}

namespace {

// Every rank's histograms (one per tensor, the same tensors on every rank) added up in rank
// order (a collective); the names are the caller's.
std::vector<Engine::TensorHistogram> merged_over_ranks(dist::Communicator& world,
                                                       const std::vector<Log2Histogram>& mine) {
    std::vector<Log2Histogram> all(mine.size() * (std::size_t)world.size());
    world.all_gather_bytes(mine.data(), all.data(), mine.size() * sizeof(Log2Histogram));
    std::vector<Engine::TensorHistogram> out(mine.size());
    for (std::size_t i = 0; i < mine.size(); i++)
        for (int r = 0; r < world.size(); r++)
            out[i].hist.merge(all[(std::size_t)r * mine.size() + i]);
    return out;
}

}  // namespace

std::vector<Engine::TensorHistogram> CpuEngine::gradient_histograms() {
    if (!has_gradient_histograms()) fail("internal: gradient histograms asked of {}", describe());
    // This rank's piece of every tensor, then every rank's counts added in rank order.
    const dist::ShardRange own = zero_->owned();
    const float* g = zero_->owned_grads();
    const std::size_t lo = (std::size_t)own.offset, hi = lo + (std::size_t)own.count;
    std::vector<Log2Histogram> mine(layout_.tensors.size());
    for (std::size_t i = 0; i < layout_.tensors.size(); i++) {
        const ParamSpec& t = layout_.tensors[i];
        const std::size_t a = std::max(lo, t.offset), b = std::min(hi, t.offset + t.numel);
        if (a < b) mine[i].add(g + (a - lo), b - a);
    }
    std::vector<TensorHistogram> out = merged_over_ranks(world_, mine);
    for (std::size_t i = 0; i < out.size(); i++) out[i].name = layout_.tensors[i].name;
    return out;
}

void CpuEngine::record_activation_histograms() {
    if (!has_gradient_histograms()) fail("internal: activation histograms asked of {}", describe());
    model().set_activation_histograms(&act_hist_);
}

std::vector<Engine::TensorHistogram> CpuEngine::activation_histograms() {
    if (!has_gradient_histograms()) fail("internal: activation histograms asked of {}", describe());
    model().set_activation_histograms(nullptr);
    // Per block its output, then its input gradient; every rank's counts added in rank order.
    std::vector<Log2Histogram> mine;
    for (const Log2Histogram& h : act_hist_.outputs) mine.push_back(h);
    for (const Log2Histogram& h : act_hist_.input_grads) mine.push_back(h);
    std::vector<TensorHistogram> out = merged_over_ranks(world_, mine);
    const std::size_t L = act_hist_.outputs.size();
    for (std::size_t i = 0; i < out.size(); i++)
        out[i].name = i < L ? fmt::format("h.{}.output", i) : fmt::format("h.{}.input.grad", i - L);
    return out;
}

void CpuEngine::sum_sequence_partial_grads() {
    // Sequence parallelism: each shard's norm gradients cover its token rows only; summed over
    // the tensor-parallel group (one packed all-reduce), once per step, they are the whole
    // tensors' and the same bits on every rank.
    if (!tp_ || !model_.sequence_parallel) return;
    std::vector<dist::UnitGrads> ranges;
    if (stages_) {
        for (const pp::StageStore::Range& rg : stages_->ranges())
            ranges.push_back({rg.first_unit, rg.last_unit, stages_->owned_grads() + rg.at});
    } else {
        ranges.push_back(
            {ParamLayout::embedding_unit(), layout_.head_unit(), shard_store().full_grads()});
    }
    dist::sum_sequence_partial_grads(*tp_, layout_, ranges);
}

StepResult CpuEngine::finish_shard_step(double lr, double max_norm) {
    StepResult r;
    r.loss = micro_batches_ ? loss_sum_ / micro_batches_ : 0.0;
    sum_sequence_partial_grads();
    float* g = shard_store().full_grads();
    r.grad_norm = dist::tp_grad_norm(tpl_, g, *tp_);
    clip_to_norm(g, layout_.total, r.grad_norm, max_norm);
    Optimizer& opt = opt_->part(0);
    if (shard16_) {
        // optim.master = "none": decoded, updated and rounded a chunk at a time (a tensor stepped
        // whole, gathered over the group, as one piece).
        shard16_->step_units([&opt, lr](float* p, float* grads, std::size_t at,
                                        std::size_t n) { opt.step_part(p, grads, lr, at, n); },
                             opt.steps_taken() + 1);
        opt.advance();
    } else {
        opt.step(full_->full_params(), g, lr);
    }
    step_counts_ = tp_->counts();
    steps_++;
    return r;
}

void CpuEngine::update_stage(float* g, double lr) {
    float* params = stages_->owned_params();
    if (replicas_->sharded()) {
        opt_->part(0).step(params + replicas_->owned().offset, g, lr);
        replicas_->gather(params);  // every replica's updated piece to every replica
        return;
    }
    for (int c = 0; c < opt_->parts(); c++) {
        const std::size_t at = stages_->ranges()[c].at;
        opt_->part(c).step(params + at, g + at, lr);
    }
}

double CpuEngine::stage_grad_norm(const float* g) {
    // Each unit's sum of squares where it lives, added in unit order; under ZeRO-1 each unit's
    // pieces, one per replica, in replica order; with tensor parallelism the cut tensors' squares
    // of each shard, the whole tensors' once (shard 0's), in shard order. Entry (u, d, t) is
    // filled by one rank of the job (by every replica alike without ZeRO), the rest hold 0.
    const dist::ShardRange own = replicas_->owned();
    const bool piece = replicas_->sharded();
    const int D = plan_.mesh.dp, d = piece ? replica() : 0, TP = plan_.mesh.tp;
    std::vector<double> sq(layout_.units.size() * (std::size_t)D * TP, 0.0);
    if (tp_) {
        const int t = tp_->rank();
        const pp::StageStore::Range& rg = stages_->ranges()[0];  // one chunk (the config's checks)
        // The floats of the range this rank updates (ZeRO-1: its piece), and where they are in g.
        const std::size_t lo = rg.begin + (std::size_t)own.offset, hi = lo + (std::size_t)own.count,
                          at = piece ? 0 : rg.at;
        for (int u = rg.first_unit; u <= rg.last_unit; u++) {
            const ParamUnit& unit = layout_.units[u];
            double x = 0;
            for (std::size_t i = unit.first_tensor; i < unit.last_tensor; i++) {
                const ParamSpec& ts = layout_.tensors[i];
                const std::size_t a = std::max(lo, ts.offset),
                                  b = std::min(hi, ts.offset + ts.numel);
                if (a < b && (tpl_.shards[i].split() || t == 0))
                    x += cpu::sum_squares(g + at + (a - lo), (int64_t)(b - a));
            }
            sq[((std::size_t)u * D + d) * TP + t] = x;
        }
    } else {
        for (const pp::StageStore::Range& rg : stages_->ranges()) {
            // The floats of this range this rank updates, and where they are in g.
            std::size_t lo = rg.begin, hi = rg.end, at = rg.at;
            if (piece) {  // one range: its piece
                lo = rg.begin + (std::size_t)own.offset;
                hi = lo + (std::size_t)own.count;
                at = 0;
            }
            for (int u = rg.first_unit; u <= rg.last_unit; u++) {
                const std::size_t a = std::max(lo, layout_.units[u].begin),
                                  b = std::min(hi, layout_.units[u].end);
                if (a < b)
                    sq[(std::size_t)u * D + d] =
                        cpu::sum_squares(g + at + (a - lo), (int64_t)(b - a));
            }
        }
    }
    world_.all_reduce_max(sq.data(), (int64_t)sq.size());
    double total = 0;
    for (double s : sq) total += s;
    return std::sqrt(total);
}

StepResult CpuEngine::finish_stage_step(double lr, double max_norm) {
    StepResult r;
    if (versions_->update_per_micro_batch()) {
        // PipeDream: every micro-batch updates its stages inside the schedule (the config
        // refuses clipping, which would need every stage's gradient of a micro-batch, and a tied
        // embedding). Side by side, the stage's replicas sum (or reduce-scatter) each
        // micro-batch's gradient first: every pipeline runs the same list, so they meet at the
        // same backward.
        if (exec_->queued() == 0) fail("internal: PipeDream finish_step without micro-batches");
        const ScopedPhase compute(Phase::compute);  // the schedule runs here, updates inside
        exec_->run([&] {
            const ScopedPhase update(Phase::optimizer);
            update_stage(replicas_->reduce(stages_->owned_grads()), lr);
            stages_->zero_grads();
        });
        r.loss = replicas_->mean(exec_->step_loss());
        return r;
    }
    exec_->join_tied_grads(*stages_);
    sum_sequence_partial_grads();
    float* g = replicas_->reduce(stages_->owned_grads());  // the range's, or the ZeRO-1 piece's
    r.grad_norm = stage_grad_norm(g);
    clip_to_norm(g, (std::size_t)replicas_->owned().count, r.grad_norm, max_norm);
    versions_->before_update();
    update_stage(g, lr);
    exec_->share_tied_weights(*stages_);
    r.loss = replicas_->mean(exec_->step_loss());
    return r;
}

}  // namespace memtrain
