// ZeroStore: DDP and ZeRO stages 1-3 over a Communicator (see zero_store.h).
#include "parallel/data/zero_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "optim/optimizer.h"
#include "parallel/placement.h"

namespace memtrain::dist {

ZeroStore::ZeroStore(const ParamLayout& layout, Communicator& comm, int stage, int64_t grain)
    : layout_(&layout), comm_(&comm), stage_(stage) {
    if (stage < 0 || stage > 3) fail("dist.zero_stage must be 0, 1, 2 or 3, got {}", stage);
    const int N = comm.size(), r = comm.rank();
    const auto shards = grain_shard_ranges(0, (int64_t)layout.total, N, grain);
    // Which states this stage shards: the placement table the planner prices with.
    const ShardSpec spec = shard_spec(stage);
    const int64_t total = (int64_t)layout.total;
    owned_ = sharded(spec.optimizer) ? shards[r] : ShardRange{0, total};
    shard_counts_ = counts_of(shards);
    for (const auto& unit : layout.units) {
        UnitPieces p = unit_pieces(shards, (int64_t)unit.begin, (int64_t)unit.end);
        UnitShards us;
        us.mine_begin = p.offsets[r];
        us.mine_count = p.counts[r];
        us.counts = std::move(p.counts);
        unit_shards_.push_back(std::move(us));
    }
    const std::size_t U = layout.units.size();
    gathered_.resize(U);
    holds_.assign(U, 0);
    written_.assign(U, false);
    buckets_.resize(U);
    params_ = Buffer<float>((std::size_t)held(spec.params, total, shards[r].count),
                            MemCategory::Parameters);
    grads_ = Buffer<float>((std::size_t)held(spec.grads, total, shards[r].count),
                           MemCategory::Gradients);
}

ZeroStore::~ZeroStore() {
    // MPI writes into the pieces and the prefetch buffer until their operations complete. On the
    // normal path nothing is in flight here; after an error, this waits (within the
    // communicator's timeout) rather than free memory MPI may still write.
    try {
        if (prefetched_.unit >= 0) drop_prefetch();
        for (auto& r : reducing_) comm_->wait(r.op);
        if (in_flight_) comm_->wait_all();
    } catch (...) {  // a destructor must not throw; the error that unwound us is the story
    }
}

float* ZeroStore::owned_params() {
    if (prefetched_.unit >= 0) drop_prefetch();  // the optimizer is about to write the shard
    return stage_ == 3 ? params_.data() : params_.data() + owned_.offset;
}

float* ZeroStore::owned_grads() {
    sync();
    return stage_ >= 2 ? grads_.data() : grads_.data() + owned_.offset;
}

float* ZeroStore::full_params() {
    return stage_ == 3 ? nullptr : params_.data();
}

float* ZeroStore::full_grads() {
    return stage_ >= 2 ? nullptr : grads_.data();
}

void ZeroStore::poll() {
    if (!in_flight_ && reducing_.empty() && prefetched_.unit < 0) return;
    comm_->progress();
    while (!reducing_.empty() && comm_->test(reducing_.front().op)) {
        reduce_stats_.arrived++;
        finish_oldest_reduce();
    }
}

void ZeroStore::finish_oldest_reduce() {
    Reducing& r = reducing_.front();
    comm_->wait(r.op);
    const ParamUnit& unit = layout_->units[r.unit];
    const UnitShards& us = unit_shards_[r.unit];
    if (us.mine_count > 0) {
        if (stage_ == 1) {
            std::memcpy(grads_.data() + unit.begin + us.mine_begin, r.piece.data(),
                        us.mine_count * sizeof(float));
        } else {
            // In start order, so each float of the shard adds its micro-batches in the order a
            // synchronous reduction would: the same bits whatever the timing.
            float* dst = grads_.data() + ((int64_t)unit.begin + us.mine_begin - owned_.offset);
            cpu::add_inplace(dst, r.piece.data(), us.mine_count);
        }
    }
    if (stage_ >= 2) buckets_[r.unit].reset();
    reducing_.pop_front();
}

void ZeroStore::finish_reduces_of(int u) {
    for (std::size_t i = reducing_.size(); i-- > 0;) {
        if (reducing_[i].unit != u) continue;
        for (std::size_t k = 0; k <= i; k++) finish_oldest_reduce();
        return;
    }
}

void ZeroStore::sync() {
    while (!reducing_.empty()) finish_oldest_reduce();
    if (!in_flight_) return;
    comm_->wait_all();
    in_flight_ = false;
}

void ZeroStore::drop_prefetch() {
    comm_->wait(prefetched_.op);
    prefetched_.params.reset();
    prefetched_.unit = -1;
    prefetch_stats_.dropped++;
}

const float* ZeroStore::my_piece(int u) {
    const UnitShards& us = unit_shards_[u];
    if (us.mine_count == 0) return params_.data();  // sends nothing
    return params_.data() + ((int64_t)layout_->units[u].begin + us.mine_begin - owned_.offset);
}

float* ZeroStore::acquire(int u, bool for_write) {
    const ParamUnit& unit = layout_->units.at(u);
    poll();
    if (stage_ < 3) return params_.data() + unit.begin;
    if (for_write) written_[u] = true;
    if (holds_[u]++ > 0) return gathered_[u].data();
    if (prefetched_.unit == u) {
        comm_->wait(prefetched_.op);
        gathered_[u] = std::move(prefetched_.params);
        prefetched_.unit = -1;
        prefetch_stats_.hits++;
        return gathered_[u].data();
    }
    // Gather the unit from every rank's shard now.
    prefetch_stats_.misses++;
    gathered_[u] = Buffer<float>(unit.size(), MemCategory::Communication);
    comm_->all_gather(my_piece(u), gathered_[u].data(), unit_shards_[u].counts);
    return gathered_[u].data();
}

void ZeroStore::prefetch(int u) {
    const ParamUnit& unit = layout_->units.at(u);
    if (stage_ < 3 || holds_[u] > 0 || prefetched_.unit == u) return;
    // At most one prefetch: one announced earlier and not acquired was a wrong guess.
    if (prefetched_.unit >= 0) drop_prefetch();
    // Reads this rank's piece of params_ while in flight: only release of a written unit (another
    // unit: this one is not held) and the optimizer (owned_params drops it first) write there.
    prefetched_.params = Buffer<float>(unit.size(), MemCategory::Communication);
    prefetched_.op =
        comm_->start_all_gather(my_piece(u), prefetched_.params.data(), unit_shards_[u].counts);
    prefetched_.unit = u;
}

void ZeroStore::release(int u) {
    if (stage_ < 3) return;
    if (holds_[u] <= 0) fail("internal: ZeroStore::release({}) without acquire", u);
    if (--holds_[u] > 0) return;
    const UnitShards& us = unit_shards_[u];
    if (written_[u] && us.mine_count > 0) {
        const ParamUnit& unit = layout_->units[u];
        std::memcpy(params_.data() + ((int64_t)unit.begin + us.mine_begin - owned_.offset),
                    gathered_[u].data() + us.mine_begin, us.mine_count * sizeof(float));
    }
    written_[u] = false;
    gathered_[u].reset();
}

float* ZeroStore::unit_grads(int u) {
    const ParamUnit& unit = layout_->units.at(u);
    poll();
    if (stage_ < 2) return grads_.data() + unit.begin;
    // The previous micro-batch's bucket of this unit may still be on its way into the shard.
    finish_reduces_of(u);
    if (buckets_[u].size() == 0)
        buckets_[u] = Buffer<float>(unit.size(), MemCategory::Communication);
    return buckets_[u].data();
}

void ZeroStore::grads_done(int u) {
    const ParamUnit& unit = layout_->units.at(u);
    const UnitShards& us = unit_shards_[u];
    poll();
    if (stage_ == 0) {
        // DDP: the unit's sum travels while backward computes the next units.
        if (reduce_) {
            comm_->start_all_reduce_sum(grads_.data() + unit.begin, (int64_t)unit.size());
            in_flight_ = true;
        }
        return;
    }
    if (stage_ == 1 && !reduce_) return;
    const float* in = stage_ == 1 ? grads_.data() + unit.begin : buckets_[u].data();
    if (stage_ >= 2 && buckets_[u].size() == 0) fail("internal: grads_done({}) without grads", u);
    while (reducing_.size() >= kMaxReducing) finish_oldest_reduce();
    // Backward writes no more of this unit's gradients (stage 1: of its part of grads_) until
    // the next micro-batch, whose unit_grads(u) completes this reduction first.
    Reducing r;
    r.unit = u;
    r.piece = Buffer<float>((std::size_t)us.mine_count, MemCategory::Communication);
    r.op = comm_->start_reduce_scatter_sum(in, r.piece.data(), us.counts);
    reducing_.push_back(std::move(r));
    reduce_stats_.started++;
    reduce_stats_.max_in_flight = std::max(reduce_stats_.max_in_flight, reducing_.size());
}

void ZeroStore::zero_grads() {
    sync();
    std::memset(grads_.data(), 0, grads_.bytes());
    for (auto& b : buckets_) b.reset();
}

double ZeroStore::clip_grad_norm(double max_norm) {
    sync();
    double sq;
    if (stage_ == 0) {
        // Whole and identical on every rank: each unit's sum in unit order, the same sum a
        // single process and a pipeline's stages (engine/cpu/cpu_engine.h) make.
        sq = 0;
        for (const ParamUnit& u : layout_->units)
            sq += cpu::sum_squares(grads_.data() + u.begin, (int64_t)u.size());
    } else {
        // Each rank's partial sum, added in rank order on every rank (the same bits everywhere).
        const double mine = cpu::sum_squares(owned_grads(), owned_.count);
        std::vector<double> all((std::size_t)comm_->size());
        comm_->all_gather_bytes(&mine, all.data(), sizeof(double));
        sq = 0;
        for (double x : all) sq += x;
    }
    const double norm = std::sqrt(sq);
    clip_to_norm(owned_grads(), (std::size_t)owned_.count, norm, max_norm);
    return norm;
}

void ZeroStore::finish_step() {
    if (stage_ == 1 || stage_ == 2) {
        comm_->all_gather(params_.data() + owned_.offset, params_.data(), shard_counts_);
    }
}

}  // namespace memtrain::dist
