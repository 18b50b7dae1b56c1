// The training loop: build the model, optimizer and data loaders from a RunConfig, then for
// each step accumulate gradients over micro-batches, clip, update, log, evaluate and
// checkpoint; at the end print the memory breakdown (measured beside predicted) and a sample.
#pragma once

#include <csignal>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "core/phase_clock.h"
#include "data/loader.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "io/checkpoint.h"
#include "io/metrics_log.h"
#include "io/out_dir.h"
#include "train/guard.h"

namespace memtrain {

struct TrainOptions {
    std::string resume;   // checkpoint dir (or out_dir with `latest`) to continue from
    bool quiet = false;   // no console output (tests)
    int stop_after = -1;  // stop (and checkpoint) after this many steps of this process; -1 = off
    // Called before each step with the (1-based) number of the step about to run: a hook for
    // tests (fault injection, inspecting the engine between steps).
    std::function<void(int64_t step, Engine& engine)> before_step;
    // Hooks for tests of the divergence guard: each global micro-batch as read for a step (to
    // corrupt it), and each step's learning rate (to change it). A rolled-back step runs again
    // through them.
    std::function<void(int64_t step, int32_t* inputs, int32_t* targets, std::size_t n)> on_batch;
    std::function<double(int64_t step, double lr)> on_lr;
    // Set (to the signal's number) by a signal handler to stop the run: the step in progress
    // finishes, a checkpoint is written and run() returns. Under data parallelism the ranks agree
    // on it every step (the max over ranks), so all stop after the same step.
    const volatile std::sig_atomic_t* stop_signal = nullptr;
    // Builds the engine instead of make_engine (tests: the GPU pipeline at one stage).
    std::function<std::unique_ptr<Engine>(const RunPlan&, dist::Communicator&)> engine;
    // The out_dir rules of `memtrain train` (docs/training.md): a run (new, or resumed into
    // another directory) does not go into an out_dir that holds another run, unless
    // `overwrite`, which first removes that run's files. Off for library callers and tests.
    bool refuse_existing_run = false;
    bool overwrite = false;
    // A resume on other data, another tokenizer, seq_len, batch size or seed is refused unless
    // this is set; either way the run prints what changed.
    bool accept_changes = false;
    // With `resume`: start data.train from its beginning (epoch 0), keeping the weights,
    // optimizer state, step and schedule: the way to go on with new data. The data may then hold
    // other tokens (a new shard of the same tokenizer) without accept_changes.
    bool reset_data = false;
};

struct TrainSummary {
    std::vector<float> losses;                      // training loss per step run here
    std::vector<std::pair<int, float>> val_losses;  // (step, loss)
    int64_t steps_done = 0;
    int64_t steps_skipped = 0;  // fp16: updates skipped for a gradient overflow
    double tokens_per_s = 0;    // mean over the steps after the first
    std::string last_checkpoint;
    int stopped_by_signal = 0;  // the signal that stopped the run before train.max_steps; 0 = none
    // The divergence guard's actions, in order: at `step` it went back to the state after
    // `to_step`, skipping the step's batch, and (`lower_lr`) lowered the learning rate.
    struct GuardAction {
        int64_t step = 0, to_step = 0;
        bool lower_lr = false;
        std::string reason;
    };
    std::vector<GuardAction> guard_actions;
};

// Creates io.out_dir and writes a file in it, so a path that cannot hold checkpoints (under a
// regular file, read-only, /proc) fails before training, naming the key, the path and the
// system's reason. `rank` keeps the probe files of ranks sharing the directory apart.
void check_out_dir(const std::string& out_dir, int rank = 0);

// The model, its gradients and optimizer live in an Engine (engine.h): the CPU one, or the CUDA
// one for train.device = "cuda". Data parallelism (CPU): every rank of `comm` builds the same
// Trainer; each takes its rows of every global micro-batch (rank r the r-th slice of
// micro_batch rows), and the engine's ZeroStore reduces the gradients and shards the model
// states per train.zero_stage. Without a communicator the run is a world of one, through the
// same code. Rank 0 prints, logs and writes the shared checkpoint files; reported losses are
// means over all ranks, identical on every rank.
class Trainer {
  public:
    Trainer(RunConfig cfg, TrainOptions opts = {}, dist::Communicator* comm = nullptr);
    ~Trainer();
    TrainSummary run();
    Engine& engine() { return *engine_; }
    // Every parameter as fp32 (the master weights), in layout order; a collective under ZeRO-3.
    std::vector<float> params() { return gather_params(engine_->weights()); }
    // The CPU engine's model and store (tests of the CPU engine); an Error on another device.
    GPT& model();
    dist::ZeroStore& store();
    const RunConfig& config() const { return cfg_; }
    // The run as planned before anything was allocated (its memory rows among it).
    const RunPlan& plan() const { return plan_; }

  private:
    float evaluate();
    // The mean of one value per rank, summed in rank order (the same bits on every rank).
    double mean_over_ranks(double x);
    // timings.json in io.out_dir (train/diagnose.h): every rank's timed steps, their seconds and
    // their phases, gathered to rank 0 (a collective).
    void write_timings(int64_t steps, double seconds, const PhaseTimes& phases);
    // This rank's rows of the next global micro-batch from `loader`, into x_, y_.
    void next_rows(data::DataLoader& loader);
    bool root() const { return comm_->rank() == 0; }
    // Which data-parallel replica's rows this rank reads (RunPlan::dp_rank).
    int dp_rank() const { return plan_.dp_rank(); }
    void print(const std::string& s);
    // The start-up line's layout: " | tensor parallel over 2 ranks ... | pipeline of 2 stages ...".
    std::string layout_line() const;
    void print_memory_report();
    // A checkpoint of the run into `out_dir` (the engine's carried state, fp16's loss scale and
    // previous-norm clipping's norm, taken into state_ first), and the run set from one.
    std::string save_state(const std::string& out_dir);
    void load_state(const std::string& dir);
    // The divergence guard (train/guard.h): the snapshot of the state after this step, and the
    // answer to an anomaly at step `bad` whose batch started at `batch_at`.
    void guard_snapshot();
    void guard_rollback(int64_t bad, const std::string& reason, data::DataLoader::Position batch_at,
                        TrainSummary& sum);
    std::string guard_dir() const;
    // train.diagnostics = amp: the gradients' histograms of step `step` (before its update),
    // printed and logged; and at the end of the run, what they suggest.
    void amp_diagnose(int64_t step);
    void amp_summary();
    // The same step's activations and activation gradients (Engine::activation_histograms),
    // printed and logged; `s` is the loss scale fp16 would start at, as 2^s.
    void amp_activations(int64_t step, int s);
    int fp16_scale_log2() const;  // optim.loss_scale, the scale fp16 would start at, as 2^k
    void print_sample();

    RunConfig cfg_;  // train.device and train.precision resolved ("auto" -> what runs here)
    std::string written_device_, written_precision_;  // as the config gave them
    // cfg_ with train.device and train.precision as the config gave them: what checkpoints save.
    RunConfig config_as_written() const;
    TrainOptions opts_;
    CpuEngine& cpu_engine();

    std::unique_ptr<dist::Communicator> own_comm_;
    dist::Communicator* comm_;
    // What changed between the checkpoint a run resumes from and this run ("" when nothing):
    // refused unless opts_.accept_changes. Every rank computes the same.
    std::string resume_changes(const std::string& dir, const RunConfig& saved, const TrainState& st,
                               std::optional<uint64_t> tokenizer_fp) const;
    // Appends one line to the metrics log; a failure is a warning once, then logging stops.
    void log_metrics(const std::string& line);

    io::OutDirLock lock_;  // rank 0: the out_dir is this run's while the Trainer lives
    RunPlan plan_;         // the run as decided before anything was allocated (engine/run_plan.h)
    std::unique_ptr<Engine> engine_;
    std::unique_ptr<data::DataLoader> train_loader_, val_loader_;
    std::vector<int32_t> xg_, yg_;  // a global micro-batch (every rank's rows)
    TrainState state_;
    double peak_lr_ = 0;
    std::unique_ptr<io::MetricsLog> metrics_;
    int64_t metrics_failed_at_ = 0;           // the step whose line could not be written; 0: none
    std::unique_ptr<DivergenceGuard> guard_;  // null: guard.enabled = false, or not available
    std::vector<std::pair<int64_t, std::string>> snapshots_;   // (step, dir), oldest first
    std::vector<data::DataLoader::Position> skipped_batches_;  // the guard's, for every replay
    Log2Histogram amp_last_;  // every gradient value of the last diagnosed step
    int64_t amp_last_step_ = 0;
};

}  // namespace memtrain
