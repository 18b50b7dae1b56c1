// The pipeline executor (see executor.h).
#include "parallel/pipeline/executor.h"

#include <algorithm>

#include "core/error.h"
#include "core/phase_clock.h"

namespace memtrain::pp {

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

}  // namespace

Executor::Executor(dist::Communicator& stages, Kind kind, std::vector<GPT*> chunks,
                   WeightVersions& versions, Timeline& timeline)
    : comm_(&stages),
      kind_(kind),
      rank_(stages.rank()),
      p_(stages.size()),
      chunks_(std::move(chunks)),
      versions_(&versions),
      timeline_(&timeline) {}

Executor::~Executor() {
    comm_->wait_all();
}

void Executor::check_micro_batches(int m, int chunks) {
    if ((int64_t)m * chunks > kMaxMicroBatches)
        fail("train.pp: {} micro-batches x {} chunks per step is more than the pipeline's {}", m,
             chunks, kMaxMicroBatches);
}

void Executor::make_schedule(int m) {
    const int v = chunks();
    check_micro_batches(m, v);
    sched_ = pp::make_schedule(kind_, p_, m, v);
    validate(sched_);
    const SimResult sim = simulate(sched_, StageCosts::uniform(num_stages(), 1, 2, 1, 1));
    for (int c = 0; c < v; c++)
        chunks_[c]->set_slots(std::max(1, sim.peak_stage_in_flight[c * p_ + rank_]));
}

void Executor::begin_step() {
    mbs_.clear();
    loss_sum_ = 0;
}

void Executor::push(const int32_t* inputs, const int32_t* targets, int B, int T, float grad_scale,
                    uint64_t dropout_rows) {
    const std::size_t n = (std::size_t)B * T;
    mbs_.push_back(Micro{std::vector<int32_t>(inputs, inputs + n),
                         std::vector<int32_t>(targets, targets + n), dropout_rows});
    B_ = B;
    T_ = T;
    grad_scale_ = grad_scale;
}

int64_t Executor::boundary_floats(int B, int T) const {
    const ModelConfig& c = chunks_.front()->config();
    return c.sp_rows((int64_t)B * T) * c.n_embd;
}

bool Executor::tied() const {
    return chunks_.front()->config().tied_embeddings && p_ > 1;
}

void Executor::run(const std::function<void()>& update) {
    const int m = (int)mbs_.size(), v = chunks();
    if (m != sched_.m) make_schedule(m);
    const int B = B_, T = T_, S = num_stages();
    const int64_t n = boundary_floats(B, T);
    const bool per_micro_batch = versions_->update_per_micro_batch();
    // PipeDream: each micro-batch's gradient is a step of its own, the mean over its tokens.
    const float scale = per_micro_batch ? grad_scale_ * (float)m : grad_scale_;
    for (GPT* g : chunks_) g->prepare(B, T);
    versions_->begin_step(m);
    // Per chunk: its free slots, the slot of each micro-batch, the sends in flight from each
    // slot's output (until its backward may rewrite it) and from its one gradient buffer (until
    // the next backward writes it).
    std::vector<std::vector<int>> free_slots(v), slot_of(v, std::vector<int>(m, -1));
    std::vector<std::vector<uint64_t>> out_send(v);
    std::vector<uint64_t> grad_send(v, 0);
    for (int c = 0; c < v; c++) {
        for (int k = chunks_[c]->slots() - 1; k >= 0; k--) free_slots[c].push_back(k);
        out_send[c].assign(chunks_[c]->slots(), 0);
    }
    timeline_->begin_step(v);
    for (const Action& a : sched_.ranks[rank_]) {
        const int i = a.mb, s = a.stage, c = s / p_;
        GPT& g = *chunks_[c];
        const Micro& mb = mbs_[i];
        if (a.op == Op::F) {
            if (free_slots[c].empty()) fail("internal: pipeline stage {} ran out of slots", s);
            const int slot = free_slots[c].back();
            free_slots[c].pop_back();
            slot_of[c][i] = slot;
            comm_->wait(out_send[c][slot]);
            if (s > 0) comm_->recv(g.stage_input(slot), n, rank_of(s - 1), tag_forward(c, m, i));
            versions_->forward(i);
            g.train_next_forward(mb.dropout_rows);  // its slot keeps the micro-batch's masks
            timeline_->time(c, a.op, [&] { g.stage_forward(slot, mb.x.data(), B, T); });
            if (s < S - 1) {
                out_send[c][slot] = comm_->start_send(g.stage_output(slot), n, rank_of(s + 1),
                                                      tag_forward((s + 1) / p_, m, i));
                timeline_->add_sent(n * (int64_t)sizeof(float));
            }
        } else if (a.op == Op::B || a.op == Op::I) {
            // The whole backward, or (zero bubble) its input-gradient half: both send d(input).
            const int slot = slot_of[c][i];
            comm_->wait(grad_send[c]);
            comm_->wait(out_send[c][slot]);
            if (s < S - 1)
                comm_->recv(g.stage_grad(), n, rank_of(s + 1), tag_backward((s + 1) / p_, m, i));
            float loss = 0;
            timeline_->time(c, a.op, [&] {
                loss = versions_->backward(i, [&] {
                    return a.op == Op::B
                               ? g.stage_backward(slot, mb.x.data(), mb.y.data(), B, T, scale)
                               : g.stage_backward_input(slot, mb.x.data(), mb.y.data(), B, T,
                                                        scale);
                });
            });
            if (s == S - 1) loss_sum_ += loss;
            if (s > 0) {
                grad_send[c] =
                    comm_->start_send(g.stage_grad(), n, rank_of(s - 1), tag_backward(c, m, i));
                timeline_->add_sent(n * (int64_t)sizeof(float));
            }
            if (per_micro_batch) {
                const double t0 = timeline_->now();
                versions_->before_micro_batch_update(i);
                update();
                timeline_->extend_last(c, a.op, t0);
            }
            if (a.op == Op::B) free_slots[c].push_back(slot);
        } else {  // W: the weight-gradient half, whenever the schedule finds room for it
            const int slot = slot_of[c][i];
            timeline_->time(c, a.op, [&] { g.stage_backward_weight(slot, B, T); });
            free_slots[c].push_back(slot);
        }
    }
    {
        const ScopedPhase sync(Phase::p2p);  // the sends still in flight: the pipeline's drain
        comm_->wait_all();
    }
    versions_->end_step();
    timeline_->end_step(sched_);
}

double Executor::step_loss() {
    // The loss lives on the last stage: every rank reports it.
    double loss = mbs_.empty() ? 0.0 : loss_sum_ / (double)mbs_.size();
    const ScopedPhase sync(Phase::p2p);  // the first stages wait here for the last one's loss
    comm_->broadcast(&loss, sizeof(loss), p_ - 1);
    return loss;
}

void Executor::join_tied_grads(StageStore& store) {
    if (!tied()) return;
    const int E = ParamLayout::embedding_unit();
    const int64_t ne = (int64_t)chunks_.front()->layout().units[E].size();
    if (last()) comm_->send(store.mirror_grads(), ne, 0, kTagTiedGrad);
    if (first()) {
        std::vector<float> head(ne);
        comm_->recv(head.data(), ne, p_ - 1, kTagTiedGrad);
        float* g = store.unit_grads(E);
        for (int64_t j = 0; j < ne; j++) g[j] += head[j];
    }
}

void Executor::share_tied_weights(StageStore& store) {
    if (!tied()) return;
    const int E = ParamLayout::embedding_unit();
    const int64_t ne = (int64_t)chunks_.front()->layout().units[E].size();
    if (first()) comm_->send(store.acquire(E), ne, p_ - 1, kTagTiedWeights);
    if (last()) comm_->recv(store.mirror_params(), ne, 0, kTagTiedWeights);
}

void Executor::forward_only(const int32_t* inputs, int B, int T) {
    const int64_t n = boundary_floats(B, T);
    const int S = num_stages();
    // Chunk by chunk through the virtual stages (messages between two ranks stay in order).
    for (int c = 0; c < chunks(); c++) {
        GPT& g = *chunks_[c];
        const int s = c * p_ + rank_;
        g.prepare(B, T);
        if (s > 0) comm_->recv(g.stage_input(0), n, rank_of(s - 1), kTagEval);
        g.stage_forward(0, inputs, B, T);
        if (s < S - 1) comm_->send(g.stage_output(0), n, rank_of(s + 1), kTagEval);
    }
}

double Executor::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    forward_only(inputs, B, T);
    double loss = last() ? chunks_.back()->stage_loss(0, targets, B, T) : 0.0;
    comm_->broadcast(&loss, sizeof(loss), p_ - 1);
    return loss;
}

void Executor::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    forward_only(inputs, B, T);
    if (last()) chunks_.back()->stage_logits(0, B, T, out);
    comm_->broadcast(out,
                     (int64_t)B * T * chunks_.front()->config().vocab_size * (int64_t)sizeof(float),
                     p_ - 1);
}

}  // namespace memtrain::pp
