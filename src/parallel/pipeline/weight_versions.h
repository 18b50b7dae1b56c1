// Which version of a pipeline stage's weights each micro-batch computes on: the executor
// (parallel/pipeline/executor.h) calls these hooks around every forward, backward and update,
// and one implementation per kind of schedule answers.
//
//   none       the synchronous schedules: every micro-batch of a step runs on the weights as
//              they are; the step's one update comes after the list.
//   PipeDream  weight stashing (Narayanan et al. SOSP'19): each backward is followed by an update
//              of the stage by that micro-batch's gradient alone, so the weights move during the
//              step. F(i) runs on the newest weights and notes their version (the optimizer's
//              step count); an update that would overwrite a version an in-flight micro-batch
//              used first copies it into a stash buffer, and B(i) swaps its version into the
//              parameters for the backward and back after it. Stage s keeps at most p - s
//              versions (the weights and p - s - 1 buffers, allocated up front as Parameters).
//              The lists are per trainer step, so the pipeline drains at the step's end: no
//              stash is alive between steps, and a checkpoint resumes exactly.
//   2BW        PipeDream-2BW (Narayanan et al. ICML'21): every forward and backward of step t
//              runs on a shadow copy W(t - 1) of the weights (the tied embedding's mirror
//              included), and the step's update goes to the newest ones:
//              W(t + 1) = W(t) - lr grad f(W(t - 1)), W(-1) = W(0). The shadow is not in
//              checkpoints: new weights (weights_loaded) restart it from themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain::pp {

// The weights a stage computes with: its owned range, and a tied embedding's mirror.
struct StageWeights {
    float* params = nullptr;
    std::size_t count = 0;
    float* mirror = nullptr;
    std::size_t mirror_count = 0;
};

// The version (updates applied to the stage before) the parameters held while a micro-batch's
// forward and backward ran, and with hashing on, a hash of their bits at that moment: equal
// hashes show the backward ran on the very weights its forward did.
struct VersionUse {
    int64_t forward = -1, backward = -1;
    uint64_t forward_hash = 0, backward_hash = 0;
};

// Floats of the copies beside stage s's weights for `kind` on p stages: PipeDream p - s - 1
// stashes of the owned range, 2BW one shadow of the range and the mirror, none otherwise.
std::size_t weight_version_floats(Kind kind, int p, int stage, std::size_t count,
                                  std::size_t mirror_count);
// What they add to the formula of the stage's Parameters row ("" for none).
std::string weight_version_formula(Kind kind, int p, int stage);

class WeightVersions {
  public:
    // `version`: the updates applied to the stage so far (its optimizer's step count).
    WeightVersions(StageWeights w, std::function<int64_t()> version);
    virtual ~WeightVersions() = default;
    WeightVersions(const WeightVersions&) = delete;
    WeightVersions& operator=(const WeightVersions&) = delete;

    // The step's list of m micro-batches starts.
    virtual void begin_step(int m);
    // F(i) is about to run.
    virtual void forward(int /*i*/) {}
    // Runs B(i) (or its input half I(i)) through `run` on the weights F(i) ran on.
    virtual float backward(int /*i*/, const std::function<float()>& run) { return run(); }
    // Whether each backward is followed by an update of the stage by its micro-batch (PipeDream).
    virtual bool update_per_micro_batch() const { return false; }
    // Before that update, after B(i): keeps the weights a micro-batch in flight still needs.
    virtual void before_micro_batch_update(int /*i*/) {}
    // The step's list has run.
    virtual void end_step() {}
    // Before the step's one update.
    virtual void before_update() {}
    // The weights were initialised, imported or resumed.
    virtual void weights_loaded() {}

    // Per micro-batch of the last step, in micro-batch order (empty when synchronous).
    const std::vector<VersionUse>& used() const { return used_; }
    // Tests: hash the weights at every forward and backward (reads them twice per micro-batch).
    void hash_weights(bool on) { hash_ = on; }
    // Updates applied to the stage so far.
    int64_t version() const { return version_(); }
    // The most versions alive at once so far (the weights and the copies some micro-batch still
    // needs); 1 when synchronous.
    int peak_live() const { return peak_live_; }
    // Bytes of the copies beside the weights: allocated, and weight_version_floats' (equal).
    std::size_t bytes() const;
    virtual std::size_t predicted_bytes() const { return 0; }
    // The memory footer's line ("" for none).
    virtual std::string summary() const { return ""; }

  protected:
    uint64_t weights_hash() const;

    StageWeights w_;
    std::function<int64_t()> version_;
    std::vector<Buffer<float>> copies_;  // allocated up front, as Parameters
    std::vector<VersionUse> used_;
    bool hash_ = false;
    int peak_live_ = 1;
};

// The versions `kind` keeps for stage `stage` of p (one chunk per rank: `chunks` must be 1
// for PipeDream and 2BW).
std::unique_ptr<WeightVersions> make_weight_versions(Kind kind, int p, int stage, int chunks,
                                                     StageWeights w,
                                                     std::function<int64_t()> version);

}  // namespace memtrain::pp
