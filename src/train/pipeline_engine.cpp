// The pipeline executor over the CPU model (see pipeline_engine.h).
#include "train/pipeline_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "io/text_file.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

namespace {

// Message tags: micro-batch i's activation 2i, its gradient 2i + 1, and three of their own
// above every micro-batch's (MPI guarantees tags up to 32767).
constexpr int kTagEval = 32000, kTagTiedGrad = 32001, kTagTiedWeights = 32002;
constexpr int kMaxMicroBatches = 16000;
int tag_forward(int mb) {
    return 2 * mb;
}
int tag_backward(int mb) {
    return 2 * mb + 1;
}

// The timeline compares times taken on different ranks, so it reads the wall clock, which the
// processes of one machine share (and NTP keeps close across machines), in seconds since a
// moment rank 0 chose at start-up (small numbers keep the doubles precise).
double wall_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// The most micro-batches a rank's list holds between their F and their B.
int peak_in_flight(const std::vector<pp::Action>& list) {
    int now = 0, peak = 0;
    for (const pp::Action& a : list) {
        // A micro-batch's activations stay until its B, or with a split backward its W.
        now += a.op == pp::Op::F ? 1 : (a.op == pp::Op::B || a.op == pp::Op::W ? -1 : 0);
        peak = std::max(peak, now);
    }
    return peak;
}

// dp pipelines of train.pp ranks on the job's ranks (validated by RunConfig).
dist::MeshLayout mesh_of(const RunConfig& cfg, const dist::Communicator& world) {
    const int pp = cfg.train.pp;
    if (pp < 1 || world.size() % pp != 0)
        fail("internal: pipelines of {} stages on {} ranks", pp, world.size());
    return dist::MeshLayout{pp, world.size() / pp};
}

}  // namespace

PipelineEngine::PipelineEngine(const RunConfig& cfg, dist::Communicator& comm)
    : cfg_(cfg),
      world_(comm),
      mesh_(mesh_of(cfg, comm)),
      groups_(dist::split_mesh(comm, mesh_)),
      comm_(*groups_.stages),
      data_(groups_.data.get()),
      rank_(comm_.rank()),
      p_(cfg.train.pp),
      kind_(pp::parse_kind(cfg.train.pp_schedule)),
      layout_(make_param_layout(cfg.model)) {
    if (comm_.size() != p_) fail("internal: a pipeline of {} stages on {} ranks", p_, comm_.size());
    const int B = cfg_.micro_batch(), T = cfg_.train.seq_len, m = cfg_.accum_steps();
    if (m > kMaxMicroBatches)
        fail("train.pp: {} micro-batches per step is more than the pipeline's {}", m,
             kMaxMicroBatches);
    split_ = pp::split_stages(cfg_.model, p_, B, T);
    const int b0 = split_.first_block[rank_], b1 = b0 + split_.blocks[rank_];
    const int first_unit = b0 == 0 ? ParamLayout::embedding_unit() : layout_.block_unit(b0);
    const int last_unit =
        b1 == cfg_.model.n_layer ? layout_.head_unit() : layout_.block_unit(b1 - 1);
    store_ = std::make_unique<pp::StageStore>(layout_, first_unit, last_unit,
                                              last() && cfg_.model.tied_embeddings);
    // Who owns each unit, for the weights view: the stage whose blocks it belongs to.
    std::vector<int> owner(layout_.units.size(), 0);
    for (int s = 0; s < p_; s++)
        for (int l = split_.first_block[s]; l < split_.first_block[s] + split_.blocks[s]; l++)
            owner[layout_.block_unit(l)] = s;
    owner[layout_.head_unit()] = p_ - 1;
    // Every pipeline holds the same weights: pipeline 0's stage s (job rank s) speaks for them.
    weights_ = std::make_unique<dist::OwnerWeights>(layout_, *store_, std::move(owner), world_);
    model_ = std::make_unique<GPT>(cfg_.model, store_.get(), b0, b1);
    model_->set_split_backward(kind_ == pp::Kind::ZbH1);
    // ZeRO-1 across the pipelines: this replica updates its shard of the stage's range (at one
    // pipeline there is nothing to shard).
    zero1_ = cfg_.train.zero_stage == 1 && mesh_.dp > 1;
    shard_ = zero1_ ? dist::shard_ranges((int64_t)store_->count(), mesh_.dp)[data_->rank()]
                    : dist::ShardRange{0, (int64_t)store_->count()};
    if (zero1_) shard_grads_ = Buffer<float>((std::size_t)shard_.count, MemCategory::Gradients);
    opt_ = make_optimizer(cfg_.optim, layout_, store_->begin() + (std::size_t)shard_.offset,
                          (std::size_t)shard_.count);
    epoch_ = wall_seconds();
    comm_.broadcast(&epoch_, sizeof(epoch_), 0);
    sched_ = pp::make_schedule(kind_, p_, m);
    pp::validate(sched_);
    model_->set_slots(std::max(1, peak_in_flight(sched_.ranks[rank_])));
}

PipelineEngine::~PipelineEngine() {
    comm_.wait_all();  // sends still travelling read our buffers
}

std::string PipelineEngine::describe() const {
    return fmt::format("cpu (fp32), pipeline stage {} of {} (blocks {}..{}, {} schedule){}", rank_,
                       p_, model_->first_block(), model_->end_block() - 1, kind_name(kind_),
                       mesh_.dp > 1 ? fmt::format(", pipeline {} of {} ({})", replica(), mesh_.dp,
                                                  zero1_ ? "ZeRO-1 across pipelines"
                                                         : "gradients all-reduced across them")
                                    : std::string());
}

void PipelineEngine::set_remat(const RematPlan& plan) {
    plan_ = plan;
    if (plan.empty()) {
        model_->set_remat({});
        return;
    }
    if (plan.size() != (std::size_t)cfg_.model.n_layer)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg_.model.n_layer);
    model_->set_remat(
        RematPlan(plan.begin() + model_->first_block(), plan.begin() + model_->end_block()));
}

void PipelineEngine::begin_step() {
    model_->zero_grads();
    mbs_.clear();
    loss_sum_ = 0;
}

void PipelineEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                      float grad_scale, bool last_mb) {
    const std::size_t n = (std::size_t)B * T;
    mbs_.push_back(Micro{std::vector<int32_t>(inputs, inputs + n),
                         std::vector<int32_t>(targets, targets + n)});
    B_ = B;
    T_ = T;
    grad_scale_ = grad_scale;
    if (last_mb) run_schedule();
}

void PipelineEngine::run_schedule() {
    const int m = (int)mbs_.size();
    if (m != sched_.m) {
        sched_ = pp::make_schedule(kind_, p_, m);
        pp::validate(sched_);
        model_->set_slots(std::max(1, peak_in_flight(sched_.ranks[rank_])));
    }
    const int B = B_, T = T_;
    const int64_t n = (int64_t)B * T * cfg_.model.n_embd;
    model_->prepare(B, T);
    std::vector<int> free_slots, slot_of(m, -1);
    for (int s = model_->slots() - 1; s >= 0; s--) free_slots.push_back(s);
    // Sends in flight: each slot's output (until its backward may rewrite it) and the one
    // gradient buffer (until the next backward writes it).
    std::vector<uint64_t> out_send(model_->slots(), 0);
    uint64_t grad_send = 0;
    // Compute time per kind of action (F, B, I, W), and each action's start and end in list
    // order, for the stats and the timeline.
    double spent[4] = {0, 0, 0, 0};
    std::vector<double> when;
    auto timed = [&](pp::Op op, auto&& work) {
        const double t0 = wall_seconds() - epoch_;
        work();
        const double t1 = wall_seconds() - epoch_;
        when.push_back(t0);
        when.push_back(t1);
        spent[(int)op] += t1 - t0;
    };
    comm_.barrier();  // a common start, so the makespan measures the pipeline, not data loading
    const double t_start = wall_seconds() - epoch_;
    for (const pp::Action& a : sched_.ranks[rank_]) {
        const int i = a.mb;
        const Micro& mb = mbs_[i];
        if (a.op == pp::Op::F) {
            if (free_slots.empty()) fail("internal: pipeline stage {} ran out of slots", rank_);
            const int slot = free_slots.back();
            free_slots.pop_back();
            slot_of[i] = slot;
            comm_.wait(out_send[slot]);
            if (!first()) comm_.recv(model_->stage_input(slot), n, rank_ - 1, tag_forward(i));
            timed(a.op, [&] { model_->stage_forward(slot, mb.x.data(), B, T); });
            if (!last()) {
                out_send[slot] =
                    comm_.start_send(model_->stage_output(slot), n, rank_ + 1, tag_forward(i));
                stats_.bytes_sent += n * (int64_t)sizeof(float);
            }
        } else if (a.op == pp::Op::B || a.op == pp::Op::I) {
            // The whole backward, or (zero bubble) its input-gradient half: both send d(input).
            const int slot = slot_of[i];
            comm_.wait(grad_send);
            comm_.wait(out_send[slot]);
            if (!last()) comm_.recv(model_->stage_grad(), n, rank_ + 1, tag_backward(i));
            float loss = 0;
            timed(a.op, [&] {
                loss = a.op == pp::Op::B ? model_->stage_backward(slot, mb.x.data(), mb.y.data(), B,
                                                                  T, grad_scale_)
                                         : model_->stage_backward_input(
                                               slot, mb.x.data(), mb.y.data(), B, T, grad_scale_);
            });
            if (last()) loss_sum_ += loss;
            if (!first()) {
                grad_send = comm_.start_send(model_->stage_grad(), n, rank_ - 1, tag_backward(i));
                stats_.bytes_sent += n * (int64_t)sizeof(float);
            }
            if (a.op == pp::Op::B) free_slots.push_back(slot);
        } else {  // W: the weight-gradient half, whenever the schedule finds room for it
            const int slot = slot_of[i];
            timed(a.op, [&] { model_->stage_backward_weight(slot, B, T); });
            free_slots.push_back(slot);
        }
    }
    comm_.wait_all();
    const double end = wall_seconds() - epoch_;
    // Every rank's start, end, busy time and per-micro-batch forward and backward times.
    constexpr int kF = 7;
    const double busy = spent[0] + spent[1] + spent[2] + spent[3];
    const double mine[kF] = {t_start,      end,          busy,        spent[0] / m,
                             spent[1] / m, spent[2] / m, spent[3] / m};
    std::vector<double> all(kF * (std::size_t)p_);
    comm_.all_gather_bytes(mine, all.data(), sizeof(mine));
    double step_start = all[0];
    for (int s = 0; s < p_; s++) step_start = std::min(step_start, all[kF * s]);
    // The step as it ran, for the timeline (every rank's list has the same length: m F and m B).
    std::vector<double> spans(when.size() * (std::size_t)p_);
    comm_.all_gather_bytes(when.data(), spans.data(), (int64_t)(when.size() * sizeof(double)));
    timeline_ = pp::SimResult{};
    timeline_.spans.resize(p_);
    timeline_.busy.assign(p_, 0.0);
    for (int s = 0; s < p_; s++) {
        timeline_.makespan = std::max(timeline_.makespan, all[kF * s + 1] - step_start);
        timeline_.busy[s] = all[kF * s + 2];
        const std::vector<pp::Action>& list = sched_.ranks[s];
        for (std::size_t j = 0; j < list.size(); j++)
            timeline_.spans[s].push_back({list[j], spans[s * when.size() + 2 * j] - step_start,
                                          spans[s * when.size() + 2 * j + 1] - step_start});
    }
    if (steps_run_++ == 0) return;  // the first step pays for allocation and warm-up
    stats_.steps++;
    stats_.stage_forward_s.resize(p_);
    stats_.stage_backward_s.resize(p_);
    stats_.stage_input_s.resize(p_);
    stats_.stage_weight_s.resize(p_);
    double busy_sum = 0;
    for (int s = 0; s < p_; s++) {
        busy_sum += all[kF * s + 2];
        stats_.stage_forward_s[s] += all[kF * s + 3];
        stats_.stage_backward_s[s] += all[kF * s + 4];
        stats_.stage_input_s[s] += all[kF * s + 5];
        stats_.stage_weight_s[s] += all[kF * s + 6];
    }
    const double makespan = timeline_.makespan;
    stats_.makespan_s += makespan;
    stats_.bubble += makespan > 0 ? 1.0 - busy_sum / p_ / makespan : 0.0;
}

StepResult PipelineEngine::finish_step(double lr, double max_norm) {
    StepResult r;
    const int E = ParamLayout::embedding_unit();
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
    float* g = reduce_across_pipelines();  // the gradient of [shard_.offset, + shard_.count)
    // The global norm: each unit's sum of squares where it lives, added in unit order; under
    // ZeRO-1 each unit's pieces, one per shard, in pipeline order. Entry (u, d) is filled by one
    // rank of the job (by every pipeline alike without ZeRO), the rest hold 0.
    const int D = mesh_.dp, d = zero1_ ? replica() : 0;
    std::vector<double> sq(layout_.units.size() * (std::size_t)D, 0.0);
    const std::size_t lo = store_->begin() + (std::size_t)shard_.offset,
                      hi = lo + (std::size_t)shard_.count;
    for (int u = store_->first_unit(); u <= store_->last_unit(); u++) {
        const std::size_t a = std::max(lo, layout_.units[u].begin),
                          b = std::min(hi, layout_.units[u].end);
        if (a < b) sq[(std::size_t)u * D + d] = cpu::sum_squares(g + (a - lo), (int64_t)(b - a));
    }
    world_.all_reduce_max(sq.data(), (int64_t)sq.size());
    double total = 0;
    for (double s : sq) total += s;
    r.grad_norm = std::sqrt(total);
    if (max_norm > 0) {
        const double coef = max_norm / (r.grad_norm + 1e-6);
        if (coef < 1.0) cpu::scale_inplace(g, (float)coef, shard_.count);
    }
    opt_->step(store_->owned_params() + shard_.offset, g, lr);
    if (zero1_) {  // every replica's updated shard to every replica of the stage
        const std::vector<int64_t> counts = dist::shard_counts((int64_t)store_->count(), D);
        data_->all_gather(store_->owned_params() + shard_.offset, store_->owned_params(), counts);
    }
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

float* PipelineEngine::reduce_across_pipelines() {
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

double PipelineEngine::mean_over_pipelines(double loss) {
    if (mesh_.dp == 1) return loss;
    std::vector<double> all((std::size_t)mesh_.dp);
    data_->all_gather_bytes(&loss, all.data(), sizeof(double));
    double sum = 0;
    for (double v : all) sum += v;  // in pipeline order: the same bits on every rank
    return sum / mesh_.dp;
}

void PipelineEngine::forward_only(const int32_t* inputs, int B, int T) {
    const int64_t n = (int64_t)B * T * cfg_.model.n_embd;
    model_->prepare(B, T);
    if (!first()) comm_.recv(model_->stage_input(0), n, rank_ - 1, kTagEval);
    model_->stage_forward(0, inputs, B, T);
    if (!last()) comm_.send(model_->stage_output(0), n, rank_ + 1, kTagEval);
}

double PipelineEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    forward_only(inputs, B, T);
    double loss = last() ? model_->stage_loss(0, targets, B, T) : 0.0;
    comm_.broadcast(&loss, sizeof(loss), p_ - 1);
    return mean_over_pipelines(loss);
}

void PipelineEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    forward_only(inputs, B, T);
    if (last()) model_->stage_logits(0, B, T, out);
    comm_.broadcast(out, (int64_t)B * T * cfg_.model.vocab_size * (int64_t)sizeof(float), p_ - 1);
}

std::string PipelineEngine::memory_title() const {
    return fmt::format(
        "host, fp32, pipeline stage {} of {}{} (rank {})", rank_, p_,
        mesh_.dp > 1 ? fmt::format(" of pipeline {} of {}", replica(), mesh_.dp) : std::string(),
        world_.rank());
}

std::vector<MemoryPrediction> PipelineEngine::predicted_memory(int B, int T) const {
    const std::size_t own = store_->count(), mirror = store_->mirror_size();
    const std::string units =
        fmt::format("units {}..{}{}", layout_.units[store_->first_unit()].name,
                    layout_.units[store_->last_unit()].name, mirror ? " + a copy of wte" : "");
    const int k = cfg_.optim.name == "adamw" ? 8 : 4;
    const ArenaPlan a = model_->stage_arena(B, T);
    const int K = model_->slots();
    const std::size_t shard = (std::size_t)shard_.count;
    return {
        {MemCategory::Parameters, fmt::format("4 x stage params ({})", units), 4 * (own + mirror)},
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
         fmt::format("{} micro-batches in flight x activation_layout(blocks {}..{}, remat={}){}", K,
                     model_->first_block(), model_->end_block() - 1, cfg_.train.remat,
                     model_->split_backward() ? " + output gradients kept for W" : ""),
         (std::size_t)K * (a.activation_bytes + model_->split_backward_bytes(B, T))},
        {MemCategory::Workspace, "activation_layout(stage blocks), shared", a.workspace_bytes},
    };
}

std::string PipelineEngine::memory_footer() const {
    std::string out = host_rss_line();
    out += fmt::format(
        "pipeline: {} stages, {} schedule, stage {} holds blocks {}..{} and up to {} "
        "micro-batches in flight\n",
        p_, kind_name(kind_), rank_, model_->first_block(), model_->end_block() - 1,
        model_->slots());
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
        pp::StageCosts costs = pp::StageCosts::uniform(p_, 0, 0);
        for (int s = 0; s < p_; s++) {
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

std::string PipelineEngine::write_run_files(const std::string& out_dir) {
    if (timeline_.spans.empty()) return "";
    const std::string path = (std::filesystem::path(out_dir) / "pipeline_timeline.svg").string();
    const std::string title = fmt::format(
        "{} p={} m={}: the last step as it ran ({:.1f} ms, bubble {:.1f}%)", kind_name(kind_), p_,
        sched_.m, 1e3 * timeline_.makespan, 100.0 * timeline_.bubble());
    io::write_text_file_atomically(path, pp::timeline_svg(sched_, timeline_, title));
    return fmt::format("pipeline timeline (measured, last step): {}\n", path);
}

}  // namespace memtrain
