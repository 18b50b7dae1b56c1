// What a pipeline's steps took, as they ran: each action's start and end on the wall clock the
// ranks of a pipeline share, gathered into the simulator's form (pp::SimResult) after every step,
// the measured bubble and makespan summed over the steps, and the last step drawn as an SVG.
// The executor (parallel/pipeline/executor.h) times its actions through it; the engine's memory
// footer and run files print it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain::pp {

// What the executor measured over the steps so far (all but the first, which pays start-up).
// Every step's schedule starts at a barrier; the step's makespan runs from the earliest rank's
// start to the latest rank's end on the wall clock the ranks share, and the bubble is the
// simulator's definition, 1 - mean over ranks of busy / makespan.
struct PipelineStats {
    int steps = 0;
    double makespan_s = 0;   // summed over steps
    double bubble = 0;       // summed over steps
    int64_t bytes_sent = 0;  // activations and gradients sent by this rank
    // Per virtual stage: one micro-batch's forward and backward time, summed over steps (for
    // the simulator's prediction from measured stage times).
    std::vector<double> stage_forward_s, stage_backward_s, stage_input_s, stage_weight_s;
};

class Timeline {
  public:
    // Rank 0 of `stages` (the pipeline) picks the clock's zero; a collective of the pipeline.
    explicit Timeline(dist::Communicator& stages);

    // A step's list starts: a barrier (so the makespan measures the pipeline, not data
    // loading), then the start time. `chunks`: this rank's virtual stages.
    void begin_step(int chunks);
    // Runs `work` as action `op` of chunk `chunk`, recording its span in list order.
    template <class Work>
    void time(int chunk, Op op, Work&& work) {
        const double t0 = now();
        work();
        record(chunk, op, t0, now());
    }
    // Seconds since the clock's zero.
    double now() const;
    // Work that belongs to the last recorded action (PipeDream's update after B) ran from t0 to
    // now: the span ends later and the action's time grows.
    void extend_last(int chunk, Op op, double t0);
    void add_sent(int64_t bytes) { stats_.bytes_sent += bytes; }
    // The step's list has run on every rank of `s`: gathers every rank's spans and busy time (a
    // collective of the pipeline) into measured(), and from the second step on into stats().
    void end_step(const Schedule& s);

    const PipelineStats& stats() const { return stats_; }
    // The last step as it ran: every rank's actions with their measured start and end (seconds
    // from the step's common start), in the simulator's form.
    const SimResult& measured() const { return measured_; }
    // Steps run so far, the first included.
    int steps_run() const { return steps_run_; }

    // The footer line: the measured bubble beside the simulator's for the stages' measured
    // times, and the step time ("" before a measured step).
    std::string summary(const Schedule& s) const;
    // The last step as an SVG with its title ("" before a step ran).
    std::string svg(const Schedule& s) const;

  private:
    void record(int chunk, Op op, double t0, double t1);

    dist::Communicator* comm_;
    double epoch_ = 0;  // wall-clock seconds of rank 0 at start-up: the timeline's zero
    // This step: compute time per chunk and kind of action (F, B, I, W), each action's start and
    // end in list order, and the list's start.
    std::vector<std::vector<double>> spent_;
    std::vector<double> when_;
    double start_ = 0;
    int steps_run_ = 0;
    PipelineStats stats_;
    SimResult measured_;
};

}  // namespace memtrain::pp
