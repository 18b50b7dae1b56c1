// Pieces the multi-process tests share: the tiny run's shards in a directory every rank sees,
// and the checkpoint round trip between a distributed layout and one process.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "mpi/dist_env.h"
#include "test_util.h"
#include "train/plan.h"
#include "train/trainer.h"

namespace memtrain::dist {

// test::tiny_run_config over test::test_tmp_root()/NAME, made fresh by rank 0 (with the
// shards) while the other ranks wait.
inline RunConfig shared_tiny_run_config(const std::string& name, int steps) {
    namespace fs = std::filesystem;
    const std::string dir = (test::test_tmp_root() / name).string();
    if (comm().rank() == 0) {
        fs::remove_all(dir);
        fs::create_directories(dir);
        test::tiny_run(dir, steps);  // writes the shards
    }
    comm().barrier();
    return test::tiny_run_config(dir, steps);
}

// The optimizer state over the whole model, per state name, read through the engine's view (a
// collective under tensor parallelism and ZeRO: every rank of the job calls it).
inline std::vector<std::vector<float>> optimizer_state(Trainer& t) {
    OptimizerState& o = t.engine().optimizer();
    std::vector<std::vector<float>> out;
    for (const std::string& name : o.state_names()) {
        out.emplace_back(o.count());
        o.read_state(name, out.back().data());
    }
    return out;
}

// Building a Trainer for `bad` over comm() fails on every rank with an Error containing `what`.
// The trainer's engine's predicted bytes of one category, all its rows together.
inline std::size_t predicted_bytes(Trainer& t, MemCategory category) {
    std::size_t n = 0;
    const RunConfig& c = t.config();
    for (const MemoryPrediction& m : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
        if (m.category == category) n += m.bytes;
    return n;
}

inline void expect_refused(const RunConfig& bad, const std::string& what) {
    TrainOptions quiet;
    quiet.quiet = true;
    try {
        Trainer t(bad, quiet, &comm());
        ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
}

// The rows plan_run predicts for t's config on comm(), before anything is allocated, are the
// rows its built engine reports (category, bytes and formula); returns them.
inline std::vector<MemoryPrediction> expect_planned_rows_are_the_engines(Trainer& t,
                                                                         const std::string& what) {
    const RunConfig& tc = t.config();
    const RunPlan plan = plan_run(tc, comm());
    const auto built = t.engine().predicted_memory(tc.micro_batch(), tc.train.seq_len);
    EXPECT_EQ(plan.memory.size(), built.size()) << what;
    for (std::size_t i = 0; i < std::min(built.size(), plan.memory.size()); i++) {
        EXPECT_EQ(plan.memory[i].category, built[i].category) << what;
        EXPECT_EQ(plan.memory[i].bytes, built[i].bytes) << what << " " << built[i].formula;
        EXPECT_EQ(plan.memory[i].formula, built[i].formula) << what;
    }
    return plan.memory;
}

// Building a Trainer for `run` over comm() on a host of 1 KiB (MEMTRAIN_HOST_MEMORY) fails on
// every rank with an Error containing `what`, before anything is allocated.
inline void expect_refused_before_allocating(const RunConfig& run, const std::string& what) {
    setenv("MEMTRAIN_HOST_MEMORY", "1KiB", 1);
    const MemoryStats before = host_memory().snapshot();
    expect_refused(run, what);
    const MemoryStats after = host_memory().snapshot();
    unsetenv("MEMTRAIN_HOST_MEMORY");
    EXPECT_EQ(after.total_used, before.total_used) << what << ": something was allocated";
    comm().barrier();
}

// `one` (every rank on its own, in its own out_dir) and `dist` (the job over comm()) train the
// same `steps` steps. A checkpoint `dist` writes after `cut` steps resumes in one process, and
// one rank 0's single process writes after `cut` steps resumes under `dist`; both continue
// bitwise as the uninterrupted single process does (losses of the remaining steps, and the final
// parameters). Output directories are dist.io.out_dir with suffixes.
inline void check_checkpoint_round_trip(const RunConfig& one, const RunConfig& dist, int steps,
                                        int cut, const std::string& what) {
    const int r = comm().rank();
    const std::string base = dist.io.out_dir;
    TrainOptions quiet;
    quiet.quiet = true;
    TrainSummary ref;
    std::vector<float> ref_params;
    {
        Trainer t(one, quiet);
        ref = t.run();
        ref_params = t.params();
    }
    auto expect_continues = [&](const TrainSummary& s, const std::vector<float>& params,
                                const std::string& how) {
        ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut)) << how;
        for (int i = 0; i < steps - cut; i++)
            EXPECT_EQ(s.losses[i], ref.losses[cut + i]) << how << " step " << cut + i + 1;
        ASSERT_EQ(params.size(), ref_params.size());
        std::size_t diff = 0;
        for (std::size_t j = 0; j < params.size(); j++) diff += params[j] != ref_params[j];
        EXPECT_EQ(diff, 0u) << how;
    };

    // The distributed job for `cut` steps (a checkpoint at the stop), then one process from it.
    {
        TrainOptions o = quiet;
        o.stop_after = cut;
        Trainer(dist, o, &comm()).run();
    }
    {
        RunConfig rest = one;
        rest.io.out_dir = base + "_rest" + std::to_string(r);
        TrainOptions o = quiet;
        o.resume = dist.io.out_dir;
        Trainer t(rest, o);
        const TrainSummary s = t.run();
        expect_continues(s, t.params(), what + " checkpoint resumed in one process");
    }
    // One process for `cut` steps (rank 0 writes it), then the distributed job from it.
    RunConfig first = one;
    first.io.out_dir = base + "_first";
    if (r == 0) {
        TrainOptions o = quiet;
        o.stop_after = cut;
        Trainer(first, o).run();
    }
    comm().barrier();
    {
        RunConfig rest = dist;
        rest.io.out_dir = base + "_resumed";
        TrainOptions o = quiet;
        o.resume = first.io.out_dir;
        Trainer t(rest, o, &comm());
        const TrainSummary s = t.run();
        expect_continues(s, t.params(), "one-process checkpoint resumed by the " + what);
    }
}

}  // namespace memtrain::dist
