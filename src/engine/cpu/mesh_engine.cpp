// The pipeline executor over the CPU model (see mesh_engine.h).
#include "engine/cpu/mesh_engine.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/host_memory.h"
#include "io/text_file.h"
#include "kernels/cpu/ops.h"
#include "parallel/tensor/tp_views.h"

namespace memtrain {

namespace {

// Message tags: a message crosses the boundary below virtual stage s, whose chunk is c = s / p:
// micro-batch i's activation 2 (c m + i), its gradient 2 (c m + i) + 1, and three of their own
// above every chunk's and micro-batch's (MPI guarantees tags up to 32767). Between two ranks
// the boundaries they share differ in c, so the tags name every message of a step.
constexpr int kTagEval = 32000, kTagTiedGrad = 32001, kTagTiedWeights = 32002;
constexpr int kMaxMicroBatches = 16000;  // micro-batches x chunks
int tag_forward(int chunk, int m, int mb) {
    return 2 * (chunk * m + mb);
}
int tag_backward(int chunk, int m, int mb) {
    return 2 * (chunk * m + mb) + 1;
}

// The timeline compares times taken on different ranks, so it reads the wall clock, which the
// processes of one machine share (and NTP keeps close across machines), in seconds since a
// moment rank 0 chose at start-up (small numbers keep the doubles precise).
double wall_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

ModelConfig model_of(const RunConfig& cfg) {
    return cfg.train.tp > 1
               ? dist::tp_shard_config(cfg.model, cfg.train.tp, cfg.train.sequence_parallel)
               : cfg.model;
}

}  // namespace

MeshEngine::MeshEngine(const RunPlan& plan, dist::Communicator& comm)
    : cfg_(plan.cfg),
      world_(comm),
      mesh_(plan.mesh),
      groups_(dist::split_mesh(comm, mesh_)),
      comm_(*groups_.stages),
      data_(groups_.data.get()),
      rank_(comm_.rank()),
      p_(plan.cfg.train.pp),
      v_(plan.cfg.train.pp_virtual),
      kind_(pp::parse_kind(plan.cfg.train.pp_schedule)),
      model_(model_of(plan.cfg)),
      layout_(make_param_layout(model_)) {
    if (comm_.size() != p_) fail("internal: a pipeline of {} stages on {} ranks", p_, comm_.size());
    // The techniques, applied to the model in this order (torchtitan's parallelize): each cuts
    // what the one before left. The recompute plan comes last, from the Trainer (set_remat),
    // once the stage's blocks and arena format are known.
    apply_tensor_parallel();
    apply_pipeline();
    apply_data_parallel();
    epoch_ = wall_seconds();
    comm_.broadcast(&epoch_, sizeof(epoch_), 0);
}

void MeshEngine::apply_tensor_parallel() {
    // This rank's shard of every tensor (Megatron's cut, parallel/tensor/tp.h) and the group
    // holding the other shards of its stage; model_ is already the shard's config.
    if (mesh_.tp == 1) return;
    if (v_ > 1) fail("internal: tensor-parallel stages with {} chunks per rank", v_);
    tpg_ = std::make_unique<dist::TpGroup>(*groups_.tp);
    tpl_ = dist::make_tp_layout(cfg_.model, mesh_.tp, groups_.tp->rank());
}

void MeshEngine::apply_pipeline() {
    // This rank's chunks (virtual stages rank, rank + p, ...; one unless interleaved), each a run
    // of blocks of the whole model's split and a model over them; their units in one StageStore.
    const int B = cfg_.micro_batch(), T = cfg_.train.seq_len, m = cfg_.accum_steps();
    if ((int64_t)m * v_ > kMaxMicroBatches)
        fail("train.pp: {} micro-batches x {} chunks per step is more than the pipeline's {}", m,
             v_, kMaxMicroBatches);
    split_ = pp::split_stages(cfg_.model, num_stages(), B, T);
    std::vector<std::pair<int, int>> ranges;
    for (int c = 0; c < v_; c++) {
        const int s = c * p_ + rank_;
        const int b0 = split_.first_block[s], b1 = b0 + split_.blocks[s];
        const int first_unit = b0 == 0 ? ParamLayout::embedding_unit() : layout_.block_unit(b0);
        const int last_unit =
            b1 == cfg_.model.n_layer ? layout_.head_unit() : layout_.block_unit(b1 - 1);
        ranges.emplace_back(first_unit, last_unit);
    }
    store_ =
        std::make_unique<pp::StageStore>(layout_, ranges, last() && cfg_.model.tied_embeddings);
    // Who owns each unit, for the weights view: the job rank of the stage its blocks belong to
    // (in pipeline 0, shard 0: every pipeline holds the same weights).
    std::vector<int> owner(layout_.units.size(), 0);
    for (int s = 0; s < num_stages(); s++)
        for (int l = split_.first_block[s]; l < split_.first_block[s] + split_.blocks[s]; l++)
            owner[layout_.block_unit(l)] = mesh_.rank(0, rank_of(s));
    owner[layout_.head_unit()] = mesh_.rank(0, p_ - 1);
    if (tpg_)
        weights_ = std::make_unique<TpStageWeights>(tpl_, *store_, *tpg_, std::move(owner), world_);
    else
        weights_ = std::make_unique<dist::OwnerWeights>(layout_, *store_, std::move(owner), world_);
    for (int c = 0; c < v_; c++) {
        const int b0 = split_.first_block[c * p_ + rank_];
        chunks_.push_back(
            std::make_unique<GPT>(model_, store_.get(), b0, b0 + split_.blocks[c * p_ + rank_]));
        chunks_.back()->set_split_backward(kind_ == pp::Kind::ZbH1);
        if (tpg_) chunks_.back()->set_tp(tpg_.get());
    }
    // The weight versions beside the weights, allocated up front: PipeDream's p - s - 1 stash
    // buffers (RunConfig refuses a tied model, so no mirror), 2BW's one shadow of everything the
    // stage computes with (the owned range, then the mirror).
    if (pipedream() || two_bw()) {
        if (v_ > 1) fail("internal: {} with {} chunks per rank", kind_name(kind_), v_);
        const int copies = pipedream() ? pp::pipedream_versions(p_, rank_) - 1 : 1;
        const std::size_t n = store_->count() + (two_bw() ? store_->mirror_size() : 0);
        for (int k = 0; k < copies; k++) stash_.emplace_back(n, MemCategory::Parameters);
        stash_version_.assign((std::size_t)copies, -1);
    }
    make_schedule(m);
}

void MeshEngine::apply_data_parallel() {
    // The pipelines side by side (mesh_.dp) hold the same stage; gradients are all-reduced across
    // them, or under ZeRO-1 reduce-scattered so this replica updates its piece of the stage's
    // range (one chunk per rank, RunConfig checks; at one pipeline there is nothing to shard).
    zero1_ = cfg_.train.zero_stage == 1 && mesh_.dp > 1;
    if (zero1_ && v_ > 1) fail("internal: ZeRO-1 across pipelines with {} chunks per rank", v_);
    shard_ = zero1_ ? dist::shard_ranges((int64_t)store_->count(), mesh_.dp)[data_->rank()]
                    : dist::ShardRange{0, (int64_t)store_->count()};
    if (zero1_) shard_grads_ = Buffer<float>((std::size_t)shard_.count, MemCategory::Gradients);
    std::vector<std::unique_ptr<Optimizer>> opts;
    for (const pp::StageStore::Range& r : store_->ranges()) {
        if (zero1_)
            opts.push_back(make_optimizer(cfg_.optim, layout_, r.begin + (std::size_t)shard_.offset,
                                          (std::size_t)shard_.count));
        else
            opts.push_back(make_optimizer(cfg_.optim, layout_, r.begin, r.count()));
    }
    opt_ = std::make_unique<RangeOptimizers>(std::move(opts));
    if (tpg_) {
        // Under ZeRO-1 the view gathers the replicas' pieces of the shard's range too, so a
        // checkpoint holds the whole model's state as one process's does.
        const pp::StageStore::Range& r = store_->ranges()[0];
        opt_view_ = std::make_unique<TpRangeOptimizer>(
            tpl_, *opt_, *tpg_, r.first_unit, r.last_unit, zero1_ ? data_ : nullptr, shard_);
    }
}

MeshEngine::~MeshEngine() {
    comm_.wait_all();  // sends still travelling read our buffers
}

void MeshEngine::make_schedule(int m) {
    sched_ = pp::make_schedule(kind_, p_, m, v_);
    pp::validate(sched_);
    // The simulator runs each rank's list in order, so its count of what a stage holds between
    // forward and backward is the executor's, whatever the stages cost.
    const int S = num_stages();
    const pp::SimResult sim = pp::simulate(sched_, pp::StageCosts::uniform(S, 1, 2, 1, 1));
    for (int c = 0; c < v_; c++)
        chunks_[c]->set_slots(std::max(1, sim.peak_stage_in_flight[c * p_ + rank_]));
}

int MeshEngine::slots() const {
    int k = 0;
    for (const auto& g : chunks_) k += g->slots();
    return k;
}

std::string MeshEngine::chunk_blocks() const {
    std::string out;
    for (const auto& g : chunks_)
        out +=
            fmt::format("{}{}..{}", out.empty() ? "" : ", ", g->first_block(), g->end_block() - 1);
    return out;
}

std::string MeshEngine::describe() const {
    std::string replicas =
        mesh_.dp > 1
            ? fmt::format(", pipeline {} of {} ({})", replica(), mesh_.dp,
                          zero1_ ? "ZeRO-1 across pipelines" : "gradients all-reduced across them")
            : std::string();
    if (tpg_)
        replicas =
            fmt::format(", tensor-parallel shard {} of {}", tpg_->rank(), tpg_->size()) + replicas;
    if (v_ == 1)
        return fmt::format("cpu (fp32), pipeline stage {} of {} (blocks {}, {} schedule){}", rank_,
                           p_, chunk_blocks(), kind_name(kind_), replicas);
    return fmt::format(
        "cpu (fp32), pipeline rank {} of {}, {} chunks (virtual stages of {}: blocks {}, {} "
        "schedule){}",
        rank_, p_, v_, num_stages(), chunk_blocks(), kind_name(kind_), replicas);
}

void MeshEngine::set_remat(const RematPlan& plan) {
    plan_ = plan;
    if (plan.empty()) {
        for (auto& g : chunks_) g->set_remat({});
        return;
    }
    if (plan.size() != (std::size_t)cfg_.model.n_layer)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg_.model.n_layer);
    for (auto& g : chunks_)
        g->set_remat(RematPlan(plan.begin() + g->first_block(), plan.begin() + g->end_block()));
}

void MeshEngine::begin_step() {
    store_->zero_grads();
    mbs_.clear();
    loss_sum_ = 0;
}

void MeshEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                  float grad_scale, bool last_mb) {
    const std::size_t n = (std::size_t)B * T;
    mbs_.push_back(Micro{std::vector<int32_t>(inputs, inputs + n),
                         std::vector<int32_t>(targets, targets + n)});
    B_ = B;
    T_ = T;
    grad_scale_ = grad_scale;
    // PipeDream updates inside the schedule, with the step's learning rate: finish_step runs it.
    if (last_mb && pipedream())
        pending_ = true;
    else if (last_mb)
        run_schedule();
}

namespace {

// FNV-1a over the bits of n floats: which weights a forward or backward ran on.
uint64_t bits_hash(const float* x, std::size_t n) {
    uint64_t h = 1469598103934665603ull;
    const auto* b = reinterpret_cast<const unsigned char*>(x);
    for (std::size_t k = 0; k < n * sizeof(float); k++) h = (h ^ b[k]) * 1099511628211ull;
    return h;
}

}  // namespace

int64_t MeshEngine::weight_version() const {
    return opt_->steps_taken();
}

std::size_t MeshEngine::version_bytes() const {
    std::size_t b = 0;
    for (const Buffer<float>& x : stash_) b += x.size() * sizeof(float);
    return b;
}

std::size_t MeshEngine::predicted_version_bytes() const {
    if (pipedream())
        return sizeof(float) * (std::size_t)(pp::pipedream_versions(p_, rank_) - 1) *
               store_->count();
    if (two_bw()) return sizeof(float) * (store_->count() + store_->mirror_size());
    return 0;
}

void MeshEngine::swap_shadow() {
    float* sh = stash_[0].data();
    const std::size_t n = store_->count();
    std::swap_ranges(store_->owned_params(), store_->owned_params() + n, sh);
    if (store_->mirror_size())
        std::swap_ranges(store_->mirror_params(), store_->mirror_params() + store_->mirror_size(),
                         sh + n);
}

void MeshEngine::save_shadow() {
    float* sh = stash_[0].data();
    const std::size_t n = store_->count();
    std::copy(store_->owned_params(), store_->owned_params() + n, sh);
    if (store_->mirror_size())
        std::copy(store_->mirror_params(), store_->mirror_params() + store_->mirror_size(), sh + n);
    shadow_version_ = weight_version();
}

void MeshEngine::update(float* g, double lr) {
    if (zero1_) {
        opt_->part(0).step(store_->owned_params() + shard_.offset, g, lr);
        // Every replica's updated shard to every replica of the stage.
        const std::vector<int64_t> counts = dist::shard_counts((int64_t)store_->count(), mesh_.dp);
        data_->all_gather(store_->owned_params() + shard_.offset, store_->owned_params(), counts);
        return;
    }
    for (int c = 0; c < v_; c++) {
        const std::size_t at = store_->ranges()[c].at;
        opt_->part(c).step(store_->owned_params() + at, g + at, lr);
    }
}

void MeshEngine::run_schedule(double lr) {
    const int m = (int)mbs_.size();
    if (m != sched_.m) make_schedule(m);
    const int B = B_, T = T_, S = num_stages();
    // A stage's input and output: the residual stream, or under sequence parallelism this
    // shard's token rows of it.
    const int64_t n = model_.sp_rows((int64_t)B * T) * cfg_.model.n_embd;
    for (auto& g : chunks_) g->prepare(B, T);
    // Weight versions. PipeDream: where each micro-batch in flight finds the weights its
    // forward ran on (-1: the weights themselves, k: stash buffer k), how many in-flight
    // micro-batches use the weights and each stash buffer. 2BW: the whole step on the shadow.
    float* params = store_->owned_params();
    const std::size_t np = store_->count();
    std::vector<int> where((std::size_t)m, -1), stash_users(stash_.size(), 0);
    int weight_users = 0;
    versions_used_.clear();
    if (pipedream() || two_bw()) versions_used_.resize((std::size_t)m);
    if (two_bw()) {
        if (!shadow_valid_) {  // W(-1) = W(0), and after a resume the loaded weights
            save_shadow();
            shadow_valid_ = true;
        }
        swap_shadow();
        peak_live_ = 2;
    }
    // Per chunk: its free slots, the slot of each micro-batch, the sends in flight from each
    // slot's output (until its backward may rewrite it) and from its one gradient buffer (until
    // the next backward writes it).
    std::vector<std::vector<int>> free_slots(v_), slot_of(v_, std::vector<int>(m, -1));
    std::vector<std::vector<uint64_t>> out_send(v_);
    std::vector<uint64_t> grad_send(v_, 0);
    for (int c = 0; c < v_; c++) {
        for (int k = chunks_[c]->slots() - 1; k >= 0; k--) free_slots[c].push_back(k);
        out_send[c].assign(chunks_[c]->slots(), 0);
    }
    // Compute time per chunk and kind of action (F, B, I, W), and each action's start and end in
    // list order, for the stats and the timeline.
    std::vector<std::array<double, 4>> spent(v_, std::array<double, 4>{0, 0, 0, 0});
    std::vector<double> when;
    auto timed = [&](int c, pp::Op op, auto&& work) {
        const double t0 = wall_seconds() - epoch_;
        work();
        const double t1 = wall_seconds() - epoch_;
        when.push_back(t0);
        when.push_back(t1);
        spent[c][(int)op] += t1 - t0;
    };
    comm_.barrier();  // a common start, so the makespan measures the pipeline, not data loading
    const double t_start = wall_seconds() - epoch_;
    for (const pp::Action& a : sched_.ranks[rank_]) {
        const int i = a.mb, s = a.stage, c = s / p_;
        GPT& g = *chunks_[c];
        const Micro& mb = mbs_[i];
        if (a.op == pp::Op::F) {
            if (free_slots[c].empty()) fail("internal: pipeline stage {} ran out of slots", s);
            const int slot = free_slots[c].back();
            free_slots[c].pop_back();
            slot_of[c][i] = slot;
            comm_.wait(out_send[c][slot]);
            if (s > 0) comm_.recv(g.stage_input(slot), n, rank_of(s - 1), tag_forward(c, m, i));
            if (pipedream()) {
                versions_used_[i].forward = weight_version();
                weight_users++;
            } else if (two_bw()) {
                versions_used_[i].forward = shadow_version_;
            }
            if (hash_versions_) versions_used_[i].forward_hash = bits_hash(params, np);
            timed(c, a.op, [&] { g.stage_forward(slot, mb.x.data(), B, T); });
            if (s < S - 1) {
                out_send[c][slot] = comm_.start_send(g.stage_output(slot), n, rank_of(s + 1),
                                                     tag_forward((s + 1) / p_, m, i));
                stats_.bytes_sent += n * (int64_t)sizeof(float);
            }
        } else if (a.op == pp::Op::B || a.op == pp::Op::I) {
            // The whole backward, or (zero bubble) its input-gradient half: both send d(input).
            const int slot = slot_of[c][i];
            comm_.wait(grad_send[c]);
            comm_.wait(out_send[c][slot]);
            if (s < S - 1)
                comm_.recv(g.stage_grad(), n, rank_of(s + 1), tag_backward((s + 1) / p_, m, i));
            float loss = 0;
            if (pipedream()) {
                // Restore the forward's version, backward (micro-batch i's gradient alone, as a
                // step of one micro-batch) and put the newest weights back; the update follows
                // once d(input) is on its way.
                timed(c, a.op, [&] {
                    const int k = where[(std::size_t)i];
                    if (k >= 0) std::swap_ranges(params, params + np, stash_[k].data());
                    versions_used_[i].backward = k >= 0 ? stash_version_[k] : weight_version();
                    if (hash_versions_) versions_used_[i].backward_hash = bits_hash(params, np);
                    loss = g.stage_backward(slot, mb.x.data(), mb.y.data(), B, T,
                                            grad_scale_ * (float)m);
                    if (k >= 0) {
                        std::swap_ranges(params, params + np, stash_[k].data());
                        if (--stash_users[k] == 0) stash_version_[k] = -1;
                    } else {
                        weight_users--;
                    }
                });
            } else {
                if (two_bw()) {
                    versions_used_[i].backward = shadow_version_;
                    if (hash_versions_) versions_used_[i].backward_hash = bits_hash(params, np);
                }
                timed(c, a.op, [&] {
                    loss = a.op == pp::Op::B
                               ? g.stage_backward(slot, mb.x.data(), mb.y.data(), B, T, grad_scale_)
                               : g.stage_backward_input(slot, mb.x.data(), mb.y.data(), B, T,
                                                        grad_scale_);
                });
            }
            if (s == S - 1) loss_sum_ += loss;
            if (s > 0) {
                grad_send[c] =
                    comm_.start_send(g.stage_grad(), n, rank_of(s - 1), tag_backward(c, m, i));
                stats_.bytes_sent += n * (int64_t)sizeof(float);
            }
            if (pipedream()) {
                // PipeDream's update: the newest weights stashed first if a micro-batch in
                // flight still needs them. Its time is part of B's (the span ends after it).
                const double t0 = wall_seconds() - epoch_;
                if (weight_users > 0) {
                    const auto free = std::find(stash_version_.begin(), stash_version_.end(), -1);
                    if (free == stash_version_.end())
                        fail("internal: PipeDream stage {} needs more than {} weight versions", s,
                             pp::pipedream_versions(p_, rank_));
                    const int k2 = (int)(free - stash_version_.begin());
                    std::copy(params, params + np, stash_[k2].data());
                    stash_version_[k2] = weight_version();
                    stash_users[k2] = weight_users;
                    for (int j = 0; j < m; j++)
                        if (where[j] == -1 && versions_used_[j].forward >= 0 &&
                            versions_used_[j].backward < 0 && j != i)
                            where[j] = k2;
                    weight_users = 0;
                }
                int live = 1;
                for (int64_t v : stash_version_) live += v >= 0;
                peak_live_ = std::max(peak_live_, live);
                // Side by side, the stage's replicas sum (or reduce-scatter) this
                // micro-batch's gradient first: every pipeline runs the same list, so they
                // meet at the same backward.
                update(reduce_across_pipelines(), lr);
                store_->zero_grads();
                const double t1 = wall_seconds() - epoch_;
                when.back() = t1;
                spent[c][(int)a.op] += t1 - t0;
            }
            if (a.op == pp::Op::B) free_slots[c].push_back(slot);
        } else {  // W: the weight-gradient half, whenever the schedule finds room for it
            const int slot = slot_of[c][i];
            timed(c, a.op, [&] { g.stage_backward_weight(slot, B, T); });
            free_slots[c].push_back(slot);
        }
    }
    comm_.wait_all();
    if (two_bw()) swap_shadow();  // the newest weights back; the shadow keeps W(t - 1)
    const double end = wall_seconds() - epoch_;
    // Every rank's start, end, busy time and, per chunk, per-micro-batch F, B, I and W times.
    const int kF = 3 + 4 * v_;
    std::vector<double> mine = {t_start, end, 0.0};
    for (int c = 0; c < v_; c++)
        for (int op = 0; op < 4; op++) {
            mine[2] += spent[c][op];
            mine.push_back(spent[c][op] / m);
        }
    std::vector<double> all(kF * (std::size_t)p_);
    comm_.all_gather_bytes(mine.data(), all.data(), kF * (int64_t)sizeof(double));
    double step_start = all[0];
    for (int r = 0; r < p_; r++) step_start = std::min(step_start, all[kF * r]);
    // The step as it ran, for the timeline (every rank's list has the same length: F and B, or
    // F, I and W, of each of its chunks' micro-batches).
    std::vector<double> spans(when.size() * (std::size_t)p_);
    comm_.all_gather_bytes(when.data(), spans.data(), (int64_t)(when.size() * sizeof(double)));
    timeline_ = pp::SimResult{};
    timeline_.spans.resize(p_);
    timeline_.busy.assign(p_, 0.0);
    for (int r = 0; r < p_; r++) {
        timeline_.makespan = std::max(timeline_.makespan, all[kF * r + 1] - step_start);
        timeline_.busy[r] = all[kF * r + 2];
        const std::vector<pp::Action>& list = sched_.ranks[r];
        for (std::size_t j = 0; j < list.size(); j++)
            timeline_.spans[r].push_back({list[j], spans[r * when.size() + 2 * j] - step_start,
                                          spans[r * when.size() + 2 * j + 1] - step_start});
    }
    if (steps_run_++ == 0) return;  // the first step pays for allocation and warm-up
    stats_.steps++;
    stats_.stage_forward_s.resize(S);
    stats_.stage_backward_s.resize(S);
    stats_.stage_input_s.resize(S);
    stats_.stage_weight_s.resize(S);
    double busy_sum = 0;
    for (int r = 0; r < p_; r++) {
        busy_sum += all[kF * r + 2];
        for (int c = 0; c < v_; c++) {
            const double* t = &all[kF * r + 3 + 4 * c];
            const int st = c * p_ + r;
            stats_.stage_forward_s[st] += t[0];
            stats_.stage_backward_s[st] += t[1];
            stats_.stage_input_s[st] += t[2];
            stats_.stage_weight_s[st] += t[3];
        }
    }
    const double makespan = timeline_.makespan;
    stats_.makespan_s += makespan;
    stats_.bubble += makespan > 0 ? 1.0 - busy_sum / p_ / makespan : 0.0;
}

StepResult MeshEngine::finish_step(double lr, double max_norm) {
    StepResult r;
    const int E = ParamLayout::embedding_unit();
    if (pipedream()) {
        // Every micro-batch updated its stages inside the schedule (RunConfig refuses clipping,
        // which would need every stage's gradient of a micro-batch, and a tied embedding).
        if (!pending_) fail("internal: PipeDream finish_step without micro-batches");
        pending_ = false;
        run_schedule(lr);
        double loss = mbs_.empty() ? 0.0 : loss_sum_ / (double)mbs_.size();
        comm_.broadcast(&loss, sizeof(loss), p_ - 1);
        r.loss = mean_over_pipelines(loss);
        return r;
    }
    // The tied embedding: the classifier's gradient (last stage) joins the embedding's (first).
    if (cfg_.model.tied_embeddings && p_ > 1) {
        const int64_t ne = (int64_t)layout_.units[E].size();
        if (last()) comm_.send(store_->mirror_grads(), ne, 0, kTagTiedGrad);
        if (first()) {
            std::vector<float> head(ne);
            comm_.recv(head.data(), ne, p_ - 1, kTagTiedGrad);
            float* g = store_->unit_grads(E);
            for (int64_t j = 0; j < ne; j++) g[j] += head[j];
        }
    }
    reduce_sequence_partial_grads();
    float* g = reduce_across_pipelines();  // the owned gradients, or the ZeRO-1 shard's
    // The global norm: each unit's sum of squares where it lives, added in unit order; under
    // ZeRO-1 each unit's pieces, one per shard, in pipeline order; with tensor parallelism the
    // cut tensors' squares of each shard, the whole tensors' once (shard 0's), in shard order.
    // Entry (u, d, t) is filled by one rank of the job (by every pipeline alike without ZeRO),
    // the rest hold 0.
    const int D = mesh_.dp, d = zero1_ ? replica() : 0, TP = mesh_.tp;
    std::vector<double> sq(layout_.units.size() * (std::size_t)D * TP, 0.0);
    if (tpg_) {
        const int t = tpg_->rank();
        const pp::StageStore::Range& rg = store_->ranges()[0];  // one chunk (RunConfig checks)
        // The floats of the range this rank updates (ZeRO-1: its piece), and where they are in g.
        const std::size_t lo = rg.begin + (std::size_t)shard_.offset,
                          hi = lo + (std::size_t)shard_.count, at = zero1_ ? 0 : rg.at;
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
        for (const pp::StageStore::Range& rg : store_->ranges()) {
            // The floats of this range this rank updates, and where they are in g.
            std::size_t lo = rg.begin, hi = rg.end, at = rg.at;
            if (zero1_) {  // one range: its shard
                lo = rg.begin + (std::size_t)shard_.offset;
                hi = lo + (std::size_t)shard_.count;
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
    r.grad_norm = std::sqrt(total);
    if (max_norm > 0) {
        const double coef = max_norm / (r.grad_norm + 1e-6);
        if (coef < 1.0) cpu::scale_inplace(g, (float)coef, shard_.count);
    }
    // 2BW: the shadow becomes W(t); the update takes the weights to W(t + 1).
    if (two_bw()) save_shadow();
    update(g, lr);
    if (cfg_.model.tied_embeddings && p_ > 1) {
        const int64_t ne = (int64_t)layout_.units[E].size();
        if (first()) comm_.send(store_->acquire(E), ne, p_ - 1, kTagTiedWeights);
        if (last()) comm_.recv(store_->mirror_params(), ne, 0, kTagTiedWeights);
    }
    // The loss lives on the last stage: every rank reports it.
    double loss = mbs_.empty() ? 0.0 : loss_sum_ / (double)mbs_.size();
    comm_.broadcast(&loss, sizeof(loss), p_ - 1);
    r.loss = mean_over_pipelines(loss);
    return r;
}

void MeshEngine::reduce_sequence_partial_grads() {
    // Sequence parallelism: each shard's norm gradients cover its token rows only; summed over
    // the tensor-parallel group (one packed all-reduce), they are the whole stage's.
    if (!tpg_ || !model_.sequence_parallel) return;
    std::vector<float*> at;
    std::vector<std::size_t> len;
    std::size_t n = 0;
    for (const pp::StageStore::Range& rg : store_->ranges())
        for (int u = rg.first_unit; u <= rg.last_unit; u++)
            for (std::size_t i = layout_.units[u].first_tensor; i < layout_.units[u].last_tensor;
                 i++) {
                const ParamSpec& t = layout_.tensors[i];
                if (!dist::sp_partial_grad(t.name)) continue;
                at.push_back(store_->owned_grads() + rg.at + (t.offset - rg.begin));
                len.push_back(t.numel);
                n += t.numel;
            }
    if (n == 0) return;
    std::vector<float> packed(n);
    std::size_t k = 0;
    for (std::size_t j = 0; j < at.size(); k += len[j], j++)
        std::copy(at[j], at[j] + len[j], packed.data() + k);
    tpg_->all_reduce(TpSite::SpNormGrads, packed.data(), (int64_t)n);
    k = 0;
    for (std::size_t j = 0; j < at.size(); k += len[j], j++)
        std::copy(packed.data() + k, packed.data() + k + len[j], at[j]);
}

float* MeshEngine::reduce_across_pipelines() {
    float* g = store_->owned_grads();
    const int64_t n = (int64_t)store_->count();
    if (mesh_.dp == 1) return g;
    if (!zero1_) {
        data_->all_reduce_sum(g, n);
        return g;
    }
    const std::vector<int64_t> counts = dist::shard_counts(n, mesh_.dp);
    data_->reduce_scatter_sum(g, shard_grads_.data(), counts);
    return shard_grads_.data();
}

double MeshEngine::mean_over_pipelines(double loss) {
    if (mesh_.dp == 1) return loss;
    std::vector<double> all((std::size_t)mesh_.dp);
    data_->all_gather_bytes(&loss, all.data(), sizeof(double));
    double sum = 0;
    for (double v : all) sum += v;  // in pipeline order: the same bits on every rank
    return sum / mesh_.dp;
}

void MeshEngine::forward_only(const int32_t* inputs, int B, int T) {
    // A stage's input and output: the residual stream, or under sequence parallelism this
    // shard's token rows of it.
    const int64_t n = model_.sp_rows((int64_t)B * T) * cfg_.model.n_embd;
    const int S = num_stages();
    // Chunk by chunk through the virtual stages (messages between two ranks stay in order).
    for (int c = 0; c < v_; c++) {
        GPT& g = *chunks_[c];
        const int s = c * p_ + rank_;
        g.prepare(B, T);
        if (s > 0) comm_.recv(g.stage_input(0), n, rank_of(s - 1), kTagEval);
        g.stage_forward(0, inputs, B, T);
        if (s < S - 1) comm_.send(g.stage_output(0), n, rank_of(s + 1), kTagEval);
    }
}

double MeshEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    forward_only(inputs, B, T);
    double loss = last() ? chunks_.back()->stage_loss(0, targets, B, T) : 0.0;
    comm_.broadcast(&loss, sizeof(loss), p_ - 1);
    return mean_over_pipelines(loss);
}

void MeshEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    forward_only(inputs, B, T);
    if (last()) chunks_.back()->stage_logits(0, B, T, out);
    comm_.broadcast(out, (int64_t)B * T * cfg_.model.vocab_size * (int64_t)sizeof(float), p_ - 1);
}

std::string MeshEngine::memory_title() const {
    return fmt::format(
        "host, fp32, pipeline stage {} of {}{}{} (rank {})", rank_, p_,
        mesh_.dp > 1 ? fmt::format(" of pipeline {} of {}", replica(), mesh_.dp) : std::string(),
        tpg_ ? fmt::format(", tensor-parallel shard {} of {}", tpg_->rank(), tpg_->size())
             : std::string(),
        world_.rank());
}

std::vector<MemoryPrediction> MeshEngine::predicted_memory(int B, int T) const {
    const std::size_t own = store_->count(), mirror = store_->mirror_size();
    std::string units;
    for (const pp::StageStore::Range& r : store_->ranges())
        units += fmt::format("{}{}..{}", units.empty() ? "" : ", ",
                             layout_.units[r.first_unit].name, layout_.units[r.last_unit].name);
    if (mirror) units += " + a copy of wte";
    const int k = cfg_.optim.name == "adamw" ? 8 : 4;
    // Each chunk: its slots of its own blocks' arena, and a workspace of its own.
    std::size_t acts = 0, work = 0;
    std::string slots;
    for (const auto& g : chunks_) {
        const ArenaPlan a = g->stage_arena(B, T);
        acts += (std::size_t)g->slots() * (a.activation_bytes + g->split_backward_bytes(B, T));
        work += a.workspace_bytes;
        slots += fmt::format("{}{} x activation_layout(blocks {}..{})", slots.empty() ? "" : " + ",
                             g->slots(), g->first_block(), g->end_block() - 1);
    }
    const GPT& g0 = *chunks_.front();
    const std::size_t shard = (std::size_t)shard_.count;
    std::string versions;
    if (pipedream())
        versions = fmt::format(" + {} stashed weight version{} (PipeDream: p - s - 1)",
                               pp::pipedream_versions(p_, rank_) - 1,
                               pp::pipedream_versions(p_, rank_) == 2 ? "" : "s");
    if (two_bw()) versions = " + the shadow W(t - 1) (PipeDream-2BW)";
    return {
        {MemCategory::Parameters, fmt::format("4 x stage params ({}){}", units, versions),
         4 * (own + mirror) + predicted_version_bytes()},
        {MemCategory::Gradients,
         zero1_ ? fmt::format("4 x stage params + 4 x its 1/{} shard (reduce-scattered)", mesh_.dp)
                : std::string("4 x stage params"),
         4 * (own + mirror) + (zero1_ ? 4 * shard : 0)},
        {MemCategory::OptimizerState,
         zero1_ ? fmt::format("{} x 1/{} of the stage params ({}, ZeRO-1 across pipelines)", k,
                              mesh_.dp, k == 8 ? "Adam m, v" : "momentum")
                : fmt::format("{} x stage params, own units ({})", k,
                              k == 8 ? "Adam m, v" : "momentum"),
         (std::size_t)k * shard},
        {MemCategory::Activations,
         fmt::format("micro-batches in flight: {}, remat={}{}", slots, cfg_.train.remat,
                     g0.split_backward() ? " + output gradients kept for W" : ""),
         acts},
        {MemCategory::Workspace,
         v_ == 1 ? std::string("activation_layout(stage blocks), shared")
                 : fmt::format("activation_layout(chunk blocks), one per chunk ({})", v_),
         work},
    };
}

std::string MeshEngine::memory_footer() const {
    std::string out = host_rss_line();
    if (v_ == 1)
        out += fmt::format(
            "pipeline: {} stages, {} schedule, stage {} holds blocks {} and up to {} "
            "micro-batches in flight\n",
            p_, kind_name(kind_), rank_, chunk_blocks(), slots());
    else {
        std::string slots;
        for (const auto& g : chunks_)
            slots += fmt::format("{}{}", slots.empty() ? "" : " + ", g->slots());
        out += fmt::format(
            "pipeline: {} ranks x {} chunks = {} virtual stages, {} schedule, rank {} holds blocks "
            "{} with {} activation slots (each chunk's most micro-batches in flight)\n",
            p_, v_, num_stages(), kind_name(kind_), rank_, chunk_blocks(), slots);
    }
    if (pipedream())
        out += fmt::format(
            "weight versions: stage {} keeps up to p - s = {} (the weights and {} stash "
            "buffer{}, {:.1f} MiB); most alive at once so far: {}; {} updates applied (one per "
            "micro-batch)\n",
            rank_, pp::pipedream_versions(p_, rank_), stash_.size(), stash_.size() == 1 ? "" : "s",
            version_bytes() / 1048576.0, peak_live_, weight_version());
    if (two_bw())
        out += fmt::format(
            "weight versions: the weights and the shadow W(t - 1) ({:.1f} MiB) every step "
            "computes on; {} updates applied\n",
            version_bytes() / 1048576.0, weight_version());
    if (mesh_.dp > 1)
        out += fmt::format(
            "pipelines: {} side by side (job rank = pipeline x {} + stage); stage {}'s {} "
            "gradient floats {} across its {} replicas each step{}\n",
            mesh_.dp, p_, rank_, store_->count(), zero1_ ? "reduce-scattered" : "all-reduced",
            mesh_.dp,
            zero1_ ? fmt::format(", each updating a shard of {} and all-gathering the parameters",
                                 shard_.count)
                   : std::string());
    if (stats_.steps > 0) {
        // The simulator's step for the stages' measured forward and backward times.
        const int S = num_stages();
        pp::StageCosts costs = pp::StageCosts::uniform(S, 0, 0);
        for (int s = 0; s < S; s++) {
            costs.f[s] = stats_.stage_forward_s[s] / stats_.steps;
            costs.b[s] = stats_.stage_backward_s[s] / stats_.steps;
            costs.i[s] = stats_.stage_input_s[s] / stats_.steps;
            costs.w[s] = stats_.stage_weight_s[s] / stats_.steps;
        }
        const pp::SimResult sim = pp::simulate(sched_, costs);
        out += fmt::format(
            "pipeline bubble: measured {:.1f}% (mean over ranks and {} steps), simulated {:.1f}% "
            "from the stages' measured F and B times | step {:.1f} ms measured, {:.1f} ms "
            "simulated | sent {:.1f} MiB per step\n",
            100.0 * stats_.bubble / stats_.steps, stats_.steps, 100.0 * sim.bubble(),
            1e3 * stats_.makespan_s / stats_.steps, 1e3 * sim.makespan,
            stats_.bytes_sent / 1048576.0 / steps_run_);
    }
    return out;
}

std::string MeshEngine::write_run_files(const std::string& out_dir) {
    if (timeline_.spans.empty()) return "";
    const std::string path = (std::filesystem::path(out_dir) / "pipeline_timeline.svg").string();
    const std::string title =
        fmt::format("{} p={} m={}{}: the last step as it ran ({:.1f} ms, bubble {:.1f}%)",
                    kind_name(kind_), p_, sched_.m, v_ > 1 ? fmt::format(" v={}", v_) : "",
                    1e3 * timeline_.makespan, 100.0 * timeline_.bubble());
    io::write_text_file_atomically(path, pp::timeline_svg(sched_, timeline_, title));
    return fmt::format("pipeline timeline (measured, last step): {}\n", path);
}

}  // namespace memtrain
