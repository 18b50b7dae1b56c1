// Helpers of the tests of the optimizer's memory options (optim.state_format,
// optim.step_in_backward, optim.master): the shared tiny run widened to 64 so its matrices and
// embedding are large enough to store compressed, what a run measured against its plan, and the
// check that a layout an option does not run with is refused by name.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/allocator.h"
#include "core/error.h"
#include "test_util.h"
#include "train/trainer.h"

namespace memtrain::test {

inline RunConfig wide_tiny_run(const std::string& name, int steps) {
    RunConfig c = tiny_run(temp_dir(name), steps);
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.io.save_final = false;
    return c;
}

struct MeasuredRun {
    TrainSummary summary;
    std::vector<float> params;  // every weight after the run, in layout order
    // Per category: the allocator's peak during the run, and the plan's row.
    std::array<std::size_t, kNumMemCategories> peak{}, predicted{};
};

// Trains c in one process from a reset peak.
inline MeasuredRun measured_run(const RunConfig& c) {
    host_memory().reset_peak();
    Trainer t(c, quiet());
    MeasuredRun r;
    r.summary = t.run();
    r.params = t.params();
    const MemoryStats m = host_memory().snapshot();
    for (int k = 0; k < kNumMemCategories; k++) r.peak[k] = m.peak_used[k];
    for (const MemoryPrediction& p : t.plan().memory)
        r.predicted[static_cast<int>(p.category)] = p.bytes;
    return r;
}

// check(c) refuses c in one line naming both `option` (the key refused) and `key` (what it does
// not run with).
inline void expect_refused_naming(void (*check)(const RunConfig&), const RunConfig& c,
                                  const std::string& option, const std::string& key) {
    try {
        check(c);
        ADD_FAILURE() << option << " with " << key << " was accepted";
    } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(option), std::string::npos) << msg;
        EXPECT_NE(msg.find(key), std::string::npos) << msg;
    }
}

}  // namespace memtrain::test
