// ZeroStore: DDP and ZeRO stages 1-3 over a Communicator (see zero_store.h).
#include "parallel/data/zero_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"
#include "parallel/placement.h"

namespace memtrain::dist {

ZeroStore::ZeroStore(const ParamLayout& layout, Communicator& comm, int stage, Options opts)
    : layout_(&layout), comm_(&comm), stage_(stage) {
    if (stage < 0 || stage > 3) fail("dist.zero_stage must be 0, 1, 2 or 3, got {}", stage);
    const int N = comm.size(), r = comm.rank();
    const auto shards = grain_shard_ranges(0, (int64_t)layout.total, N, opts.grain);
    // Which states this stage shards: the placement table the planner prices with.
    const ShardSpec spec = shard_spec(stage);
    const int64_t total = (int64_t)layout.total;
    for (int k = 0; k < N; k++)
        owned_by_rank_.push_back(sharded(spec.optimizer) ? shards[k] : ShardRange{0, total});
    owned_ = owned_by_rank_[r];
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
    if (opts.bf16_params) {
        bf16_ = true;
        params16_ = Buffer<uint16_t>((std::size_t)held(spec.params, total, shards[r].count),
                                     MemCategory::Parameters);
        round_ = Buffer<float>(round_scratch_floats(layout, opts.whole_tensors),
                               MemCategory::Parameters);
        for (std::size_t i = 0; i < opts.whole_tensors.size(); i++)
            if (opts.whole_tensors[i]) {
                const ParamSpec& t = layout.tensors.at(i);
                whole_.push_back({t.offset, t.offset + t.numel});
            }
        std::sort(whole_.begin(), whole_.end());
        rounding_seed_ = opts.rounding_seed;
        global_index_ = opts.global_index;
        std::size_t covered = 0;
        for (const IndexRun& run : global_index_) {
            if (run.local != covered)
                fail("internal: the global index runs leave a gap at {}", covered);
            covered += run.n;
        }
        if (!global_index_.empty() && covered != layout.total)
            fail("internal: the global index runs cover {} of {} floats", covered, layout.total);
    } else {
        params_ = Buffer<float>((std::size_t)held(spec.params, total, shards[r].count),
                                MemCategory::Parameters);
    }
    if (opts.hold_grads)
        grads_ = Buffer<float>((std::size_t)held(spec.grads, total, shards[r].count),
                               MemCategory::Gradients);
    armed_sq_.assign(U, 0.0);
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
    if (bf16_params()) fail("internal: ZeroStore::owned_params over bf16 parameters");
    if (prefetched_.unit >= 0) drop_prefetch();  // the optimizer is about to write the shard
    return stage_ == 3 ? params_.data() : params_.data() + owned_.offset;
}

float* ZeroStore::owned_grads() {
    sync();
    if (grads_.size() == 0) fail("internal: ZeroStore::owned_grads without a gradient buffer");
    return stage_ >= 2 ? grads_.data() : grads_.data() + owned_.offset;
}

float* ZeroStore::full_params() {
    return stage_ == 3 || bf16_params() ? nullptr : params_.data();
}

float* ZeroStore::full_grads() {
    return stage_ >= 2 || grads_.size() == 0 ? nullptr : grads_.data();
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

const float* ZeroStore::send_piece(int u, float* unit_buf) {
    if (!bf16_params()) return my_piece(u);
    const UnitShards& us = unit_shards_[u];
    float* dst = unit_buf + us.mine_begin;
    const uint16_t* src =
        us.mine_count ? bf16_at(layout_->units[u].begin + us.mine_begin) : nullptr;
    const int64_t n = us.mine_count;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    return dst;
}

const float* ZeroStore::my_piece(int u) {
    const UnitShards& us = unit_shards_[u];
    if (us.mine_count == 0) return params_.data();  // sends nothing
    return params_.data() + ((int64_t)layout_->units[u].begin + us.mine_begin - owned_.offset);
}

float* ZeroStore::acquire(int u, bool for_write) {
    const ParamUnit& unit = layout_->units.at(u);
    poll();
    if (stage_ < 3 && !bf16_params()) return params_.data() + unit.begin;
    if (for_write) written_[u] = true;
    if (holds_[u]++ > 0) return gathered_[u].data();
    if (bf16_params() && stage_ < 3) {
        // Decoded into an fp32 copy of the unit (its working weights until release).
        gathered_[u] = Buffer<float>(unit.size(), MemCategory::Parameters);
        const uint16_t* src = params16_.data() + unit.begin;
        float* dst = gathered_[u].data();
        const int64_t n = (int64_t)unit.size();
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
        return dst;
    }
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
    comm_->all_gather(send_piece(u, gathered_[u].data()), gathered_[u].data(),
                      unit_shards_[u].counts);
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
    prefetched_.op = comm_->start_all_gather(send_piece(u, prefetched_.params.data()),
                                             prefetched_.params.data(), unit_shards_[u].counts);
    prefetched_.unit = u;
}

void ZeroStore::release(int u) {
    if (stage_ < 3 && !bf16_params()) return;
    if (holds_[u] <= 0) fail("internal: ZeroStore::release({}) without acquire", u);
    if (--holds_[u] > 0) return;
    const UnitShards& us = unit_shards_[u];
    if (bf16_params()) {
        // Weights written from outside (initialisation, import, a checkpoint) round to nearest:
        // the whole unit, or at stage 3 this rank's piece of it.
        if (written_[u]) {
            const ParamUnit& unit = layout_->units[u];
            const int64_t first = stage_ == 3 ? us.mine_begin : 0;
            const int64_t n = stage_ == 3 ? us.mine_count : (int64_t)unit.size();
            const float* src = gathered_[u].data() + first;
            uint16_t* dst = n ? bf16_at(unit.begin + (std::size_t)first) : nullptr;
#pragma omp parallel for simd schedule(static)
            for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
        }
    } else if (written_[u] && us.mine_count > 0) {
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
    const bool held = grads_.size() > 0;
    if (armed_ != Armed::No) {
        // Stages 0-1 that hold the earlier micro-batches' sum add this one to it in place; the
        // norm pass adds to a copy. The rest fill a bucket of the unit's own.
        if (stage_ < 2 && held && armed_ == Armed::Update) return grads_.data() + unit.begin;
        if (buckets_[u].size() == 0) {
            // Without a gradient buffer, stages 0-1's buckets are the gradients; stages 2-3
            // fill a bucket per unit either way (the reduce-scatter's input).
            buckets_[u] =
                Buffer<float>(unit.size(), held || stage_ >= 2 ? MemCategory::Communication
                                                               : MemCategory::Gradients);
            if (stage_ < 2 && held)
                std::memcpy(buckets_[u].data(), grads_.data() + unit.begin,
                            unit.size() * sizeof(float));
        }
        return buckets_[u].data();
    }
    if (!held) fail("internal: ZeroStore without a gradient buffer, outside an armed backward");
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
    if (armed_ != Armed::No) return reduce_armed(u);
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
    if (grads_.size() > 0) std::memset(grads_.data(), 0, grads_.bytes());
    for (auto& b : buckets_) b.reset();
}

std::pair<std::size_t, std::size_t> ZeroStore::owned_piece(int u) const {
    const ParamUnit& unit = layout_->units[u];
    if (stage_ == 0) return {unit.begin, unit.size()};
    const UnitShards& us = unit_shards_[u];
    return {(std::size_t)((int64_t)unit.begin + us.mine_begin - owned_.offset),
            (std::size_t)us.mine_count};
}

double ZeroStore::norm_of(const std::vector<double>& unit_sq) {
    const std::size_t U = unit_sq.size();
    double sq = 0;
    if (stage_ == 0) {
        // Whole and identical on every rank: each unit's sum in unit order, the same sum a
        // single process and a pipeline's stages (engine/cpu/cpu_engine.h) make.
        for (double x : unit_sq) sq += x;
    } else {
        // Each unit's pieces in rank order, units in order, the same bits on every rank (and the
        // order a pipeline's ZeRO-1 pieces are summed in).
        std::vector<double> all(U * (std::size_t)comm_->size());
        comm_->all_gather_bytes(unit_sq.data(), all.data(), U * sizeof(double));
        for (std::size_t u = 0; u < U; u++)
            for (int r = 0; r < comm_->size(); r++) sq += all[(std::size_t)r * U + u];
    }
    return std::sqrt(sq);
}

double ZeroStore::clip_grad_norm(double max_norm) {
    float* g = owned_grads();  // (completes every reduction)
    std::vector<double> unit_sq(layout_->units.size());
    for (std::size_t u = 0; u < unit_sq.size(); u++) {
        const auto [at, n] = owned_piece((int)u);
        unit_sq[u] = cpu::sum_squares(g + at, (int64_t)n);
    }
    const double norm = norm_of(unit_sq);
    clip_to_norm(g, (std::size_t)owned_.count, norm, max_norm);
    return norm;
}

void ZeroStore::arm_update(UnitUpdate update, int64_t step) {
    sync();  // the earlier micro-batches' reductions are in the shard
    if (prefetched_.unit >= 0) drop_prefetch();
    armed_ = Armed::Update;
    update_ = std::move(update);
    update_step_ = step;
    std::fill(armed_sq_.begin(), armed_sq_.end(), 0.0);
}

void ZeroStore::arm_norm() {
    sync();
    armed_ = Armed::Norm;
    std::fill(armed_sq_.begin(), armed_sq_.end(), 0.0);
}

double ZeroStore::disarm() {
    if (armed_ == Armed::No) fail("internal: ZeroStore::disarm without arm");
    armed_ = Armed::No;
    update_ = nullptr;
    for (auto& b : buckets_) b.reset();
    return norm_of(armed_sq_);
}

void ZeroStore::reduce_armed(int u) {
    const ParamUnit& unit = layout_->units[u];
    const UnitShards& us = unit_shards_[u];
    const bool held = grads_.size() > 0;
    const bool in_place = stage_ < 2 && held && armed_ == Armed::Update;
    float* in = in_place ? grads_.data() + unit.begin : buckets_[u].data();
    if (!in_place && buckets_[u].size() == 0) fail("internal: grads_done({}) without grads", u);
    // The same operations as the two-phase step's reduction, started and waited for at once.
    const auto [at, n] = owned_piece(u);
    float* g = in;
    Buffer<float> piece, sum;
    if (stage_ == 0) {
        comm_->start_all_reduce_sum(in, (int64_t)unit.size());
        comm_->wait_all();
    } else {
        piece = Buffer<float>((std::size_t)us.mine_count, MemCategory::Communication);
        comm_->wait(comm_->start_reduce_scatter_sum(in, piece.data(), us.counts));
        g = piece.data();
        if (stage_ >= 2 && held) {
            // The shard holds the earlier micro-batches' sum: added as finish_oldest_reduce adds
            // (the norm pass into a copy).
            float* dst = grads_.data() + at;
            if (armed_ == Armed::Norm) {
                sum = Buffer<float>(n, MemCategory::Communication);
                std::memcpy(sum.data(), dst, n * sizeof(float));
                dst = sum.data();
            }
            cpu::add_inplace(dst, piece.data(), (int64_t)n);
            g = dst;
        }
    }
    armed_sq_[u] = cpu::sum_squares(g, (int64_t)n);
    if (armed_ == Armed::Update && n > 0) {
        // A prefetch of this unit reads the piece the update writes.
        if (prefetched_.unit == u) drop_prefetch();
        apply_update(update_, g, at, n);
    }
    if (!in_place) buckets_[u].reset();
}

void ZeroStore::apply_update(const UnitUpdate& update, float* g, std::size_t at, std::size_t n) {
    if (!bf16_params()) {
        update(stage_ == 3 ? params_.data() + at : params_.data() + owned_.offset + at, g, at, n);
        return;
    }
    // `at` indexes owned() (the whole buffer at stage 0, this rank's shard at stages 1-3); the
    // bf16 weights are whole on every rank below stage 3 (bf16_at places the shard's at 3), and an
    // element's rounding draw is its global index, the same at every world size and stage. A unit
    // held decoded (backward) is released right after its update and was not written, so its copy
    // is never read again.
    const std::size_t base = (std::size_t)owned_.offset, end = base + at + n;
    for (std::size_t lo = base + at; lo < end;) {
        // A tensor stepped whole is one piece; the rest goes by kRoundChunk, stopping at the
        // next whole tensor.
        const auto next = std::lower_bound(whole_.begin(), whole_.end(), lo,
                                           [](const std::pair<std::size_t, std::size_t>& w,
                                              std::size_t x) { return w.second <= x; });
        std::size_t hi = std::min(end, (lo / kRoundChunk + 1) * kRoundChunk);
        if (next != whole_.end() && next->first <= lo) {
            // The tensor's piece in this rank's range: all of it, or what a shard's edge leaves
            // (the optimizer completes the tensor from its holders, dist::ShardTensorGather).
            const std::size_t first = std::max(next->first, base);
            const std::size_t last = std::min(next->second, base + (std::size_t)owned_.count);
            if (first != lo || last > end)
                fail("internal: a bf16 update of [{}, {}) cuts a tensor stepped whole", base + at,
                     end);
            hi = last;
        } else if (next != whole_.end()) {
            hi = std::min(hi, next->first);
        }
        const int64_t m = (int64_t)(hi - lo);
        uint16_t* w16 = bf16_at(lo);
        float* w = round_.data();
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < m; i++) w[i] = bf16_to_f32(w16[i]);
        update(w, g + (lo - base - at), lo - base, hi - lo);
        round_into(w, lo, hi);
        lo = hi;
    }
}

void ZeroStore::round_into(const float* w, std::size_t lo, std::size_t hi) {
    uint16_t* w16 = bf16_at(lo);
    const uint64_t seed = rounding_seed_, step = (uint64_t)update_step_;
    if (global_index_.empty()) {
        const int64_t m = (int64_t)(hi - lo);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; i++)
            w16[i] = f32_to_bf16_stochastic(w[i], seed, step, (uint64_t)lo + (uint64_t)i);
        return;
    }
    // The runs over [lo, hi): the first is the last one starting at or before lo.
    auto run = std::upper_bound(global_index_.begin(), global_index_.end(), lo,
                                [](std::size_t x, const IndexRun& r) { return x < r.local; });
    for (--run; run != global_index_.end() && run->local < hi; ++run) {
        const std::size_t a = std::max(lo, run->local), b = std::min(hi, run->local + run->n);
        const uint64_t first = run->global + (a - run->local);
        const int64_t m = (int64_t)(b - a);
        uint16_t* out = w16 + (a - lo);
        const float* in = w + (a - lo);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; i++)
            out[i] = f32_to_bf16_stochastic(in[i], seed, step, first + (uint64_t)i);
    }
}

std::size_t ZeroStore::round_scratch_floats(const ParamLayout& layout,
                                            const std::vector<char>& whole_tensors) {
    std::size_t unit = 0, whole = 0;
    for (const ParamUnit& u : layout.units) unit = std::max(unit, u.size());
    for (std::size_t i = 0; i < whole_tensors.size(); i++)
        if (whole_tensors[i]) whole = std::max(whole, layout.tensors.at(i).numel);
    return std::max(std::min(kRoundChunk, unit), whole);
}

void ZeroStore::step_units(const UnitUpdate& update, int64_t step) {
    float* g = owned_grads();
    if (prefetched_.unit >= 0) drop_prefetch();  // it read the shard the update now writes
    update_step_ = step;
    for (std::size_t u = 0; u < layout_->units.size(); u++) {
        const auto [at, n] = owned_piece((int)u);
        if (n > 0) apply_update(update, g + at, at, n);
    }
}

void ZeroStore::finish_step() {
    if (stage_ != 1 && stage_ != 2) return;
    if (!bf16_params()) {
        comm_->all_gather(params_.data() + owned_.offset, params_.data(), shard_counts_);
        return;
    }
    // Each rank's updated piece of the bf16 weights, from its owner: the pieces differ in length,
    // so one broadcast per rank (Ψ bf16 values in all, half the fp32 all-gather's bytes).
    for (int k = 0; k < comm_->size(); k++) {
        const ShardRange& piece = owned_by_rank_[(std::size_t)k];
        if (piece.count > 0)
            comm_->broadcast(params16_.data() + piece.offset,
                             piece.count * (int64_t)sizeof(uint16_t), k);
    }
}

}  // namespace memtrain::dist
