// A pipeline's measured steps (see timeline.h).
#include "parallel/pipeline/timeline.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/phase_clock.h"

namespace memtrain::pp {

namespace {

// The timeline compares times taken on different ranks, so it reads the wall clock, which the
// processes of one machine share (and NTP keeps close across machines), in seconds since a
// moment rank 0 chose at start-up (small numbers keep the doubles precise).
double wall_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

}  // namespace

Timeline::Timeline(dist::Communicator& stages) : comm_(&stages) {
    epoch_ = wall_seconds();
    comm_->broadcast(&epoch_, sizeof(epoch_), 0);
}

double Timeline::now() const {
    return wall_seconds() - epoch_;
}

void Timeline::begin_step(int chunks) {
    spent_.assign((std::size_t)chunks, std::vector<double>(4, 0.0));
    when_.clear();
    const ScopedPhase sync(Phase::p2p);  // the pipeline's own synchronisation (core/phase_clock.h)
    comm_->barrier();
    start_ = now();
}

void Timeline::record(int chunk, Op op, double t0, double t1) {
    when_.push_back(t0);
    when_.push_back(t1);
    spent_[chunk][(int)op] += t1 - t0;
}

void Timeline::extend_last(int chunk, Op op, double t0) {
    const double t1 = now();
    when_.back() = t1;
    spent_[chunk][(int)op] += t1 - t0;
}

void Timeline::end_step(const Schedule& s) {
    const int p = s.p, v = s.v, m = s.m;
    const double end = now();
    // Every rank's start, end, busy time and, per chunk, per-micro-batch F, B, I and W times.
    const int kF = 3 + 4 * v;
    std::vector<double> mine = {start_, end, 0.0};
    for (int c = 0; c < v; c++)
        for (int op = 0; op < 4; op++) {
            mine[2] += spent_[c][op];
            mine.push_back(spent_[c][op] / m);
        }
    std::vector<double> all(kF * (std::size_t)p);
    const ScopedPhase sync(Phase::p2p);  // the pipeline's own synchronisation
    comm_->all_gather_bytes(mine.data(), all.data(), kF * (int64_t)sizeof(double));
    double step_start = all[0];
    for (int r = 0; r < p; r++) step_start = std::min(step_start, all[kF * r]);
    // The step as it ran (every rank's list has the same length: F and B, or F, I and W, of each
    // of its chunks' micro-batches).
    std::vector<double> spans(when_.size() * (std::size_t)p);
    comm_->all_gather_bytes(when_.data(), spans.data(), (int64_t)(when_.size() * sizeof(double)));
    measured_ = SimResult{};
    measured_.spans.resize(p);
    measured_.busy.assign(p, 0.0);
    for (int r = 0; r < p; r++) {
        measured_.makespan = std::max(measured_.makespan, all[kF * r + 1] - step_start);
        measured_.busy[r] = all[kF * r + 2];
        const std::vector<Action>& list = s.ranks[r];
        for (std::size_t j = 0; j < list.size(); j++)
            measured_.spans[r].push_back({list[j], spans[r * when_.size() + 2 * j] - step_start,
                                          spans[r * when_.size() + 2 * j + 1] - step_start});
    }
    if (steps_run_++ == 0) return;  // the first step pays for allocation and warm-up
    const int S = s.num_stages();
    stats_.steps++;
    stats_.stage_forward_s.resize(S);
    stats_.stage_backward_s.resize(S);
    stats_.stage_input_s.resize(S);
    stats_.stage_weight_s.resize(S);
    double busy_sum = 0;
    for (int r = 0; r < p; r++) {
        busy_sum += all[kF * r + 2];
        for (int c = 0; c < v; c++) {
            const double* t = &all[kF * r + 3 + 4 * c];
            const int st = c * p + r;
            stats_.stage_forward_s[st] += t[0];
            stats_.stage_backward_s[st] += t[1];
            stats_.stage_input_s[st] += t[2];
            stats_.stage_weight_s[st] += t[3];
        }
    }
    const double makespan = measured_.makespan;
    stats_.makespan_s += makespan;
    stats_.bubble += makespan > 0 ? 1.0 - busy_sum / p / makespan : 0.0;
}

std::string Timeline::summary(const Schedule& s) const {
    if (stats_.steps == 0) return "";
    // The simulator's step for the stages' measured forward and backward times.
    const int S = s.num_stages();
    StageCosts costs = StageCosts::uniform(S, 0, 0);
    for (int st = 0; st < S; st++) {
        costs.f[st] = stats_.stage_forward_s[st] / stats_.steps;
        costs.b[st] = stats_.stage_backward_s[st] / stats_.steps;
        costs.i[st] = stats_.stage_input_s[st] / stats_.steps;
        costs.w[st] = stats_.stage_weight_s[st] / stats_.steps;
    }
    const SimResult sim = simulate(s, costs);
    return fmt::format(
        "pipeline bubble: measured {:.1f}% (mean over ranks and {} steps), simulated {:.1f}% "
        "from the stages' measured F and B times | step {:.1f} ms measured, {:.1f} ms "
        "simulated | sent {:.1f} MiB per step\n",
        100.0 * stats_.bubble / stats_.steps, stats_.steps, 100.0 * sim.bubble(),
        1e3 * stats_.makespan_s / stats_.steps, 1e3 * sim.makespan,
        stats_.bytes_sent / 1048576.0 / steps_run_);
}

std::string Timeline::svg(const Schedule& s) const {
    if (measured_.spans.empty()) return "";
    const std::string title =
        fmt::format("{} p={} m={}{}: the last step as it ran ({:.1f} ms, bubble {:.1f}%)",
                    kind_name(s.kind), s.p, s.m, s.v > 1 ? fmt::format(" v={}", s.v) : "",
                    1e3 * measured_.makespan, 100.0 * measured_.bubble());
    return timeline_svg(s, measured_, title);
}

}  // namespace memtrain::pp
