// The training loop: build the model, optimizer and data loaders from a RunConfig, then for
// each step accumulate gradients over micro-batches, clip, update, log, evaluate and
// checkpoint; at the end print the memory breakdown (measured beside predicted) and a sample.
#pragma once

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/loader.h"
#include "io/checkpoint.h"
#include "model/gpt.h"
#include "optim/optimizer.h"
#include "train/run_config.h"

namespace memtrain {

struct TrainOptions {
    std::string resume;   // checkpoint dir (or out_dir with `latest`) to continue from
    bool quiet = false;   // no console output (tests)
    int stop_after = -1;  // stop (and checkpoint) after this many steps of this process; -1 = off
};

struct TrainSummary {
    std::vector<float> losses;                      // training loss per step run here
    std::vector<std::pair<int, float>> val_losses;  // (step, loss)
    int64_t steps_done = 0;
    double tokens_per_s = 0;  // mean over the steps after the first
    std::string last_checkpoint;
};

class Trainer {
  public:
    Trainer(RunConfig cfg, TrainOptions opts = {});
    TrainSummary run();
    GPT& model() { return *model_; }
    const RunConfig& config() const { return cfg_; }

  private:
    float evaluate();
    void print(const std::string& s);
    void print_memory_report();
    void print_sample();

    RunConfig cfg_;
    TrainOptions opts_;
    std::unique_ptr<GPT> model_;
    std::unique_ptr<Optimizer> opt_;
    std::unique_ptr<data::DataLoader> train_loader_, val_loader_;
    TrainState state_;
    double peak_lr_ = 0;
    std::FILE* metrics_ = nullptr;
};

}  // namespace memtrain
