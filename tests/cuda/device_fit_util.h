// Helpers of the tests that a GPU run is priced and checked before its engine allocates
// (engine/device_memory.h): the run's plan as the Trainer makes it, a model too large for this
// device (the GPU's, or cudasim's simulated size), and the check that a refused run allocated
// nothing on the device. Shared by tests/cuda and tests/mpi/cuda_*_test.cpp.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "comm/communicator.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/run_plan.h"
#include "train/plan.h"
#include "train/trainer.h"
#include "train/validate.h"

namespace memtrain::test {

// The plan the Trainer makes for `c` on `comm` (validated, resolved, priced and checked against
// this rank's device).
inline RunPlan plan_of(RunConfig c, dist::Communicator& comm) {
    c.world = comm.size();
    validate_config(c);
    resolve_config(c);
    return plan_run(c, comm);
}

// `c` with blocks 8192 wide and enough of them that each of `stages` pipeline stages holds more
// parameters than the device has bytes: whatever the engine, its parameters alone cannot fit.
inline RunConfig too_large_for_device(RunConfig c, int stages = 1) {
    const std::size_t total = device_memory_info().second;
    const std::size_t block_params = 12ull * 8192 * 8192;
    c.model.n_embd = 8192;
    c.model.n_head = 64;
    c.model.n_layer = stages * (int)(total / block_params + 2);
    return c;
}

// Builds a Trainer for `c`, which the plan must refuse before the engine allocates anything on
// the device, naming the device memory and its categories; returns the message.
inline std::string refused_before_allocating(const RunConfig& c, const TrainOptions& opts,
                                             dist::Communicator* comm = nullptr) {
    const MemoryStats before = device_memory().snapshot();
    std::string message;
    try {
        Trainer t(c, opts, comm);
        ADD_FAILURE() << "a run too large for the device was accepted";
    } catch (const Error& e) {
        message = e.what();
    }
    EXPECT_EQ(device_memory().snapshot().total_used, before.total_used)
        << "device memory was allocated before the run was refused";
    for (const char* word : {"of device memory per GPU", "parameters", "activations",
                             "out of device memory", "nothing was allocated", "To fit:"})
        EXPECT_NE(message.find(word), std::string::npos) << word << " in: " << message;
    return message;
}

}  // namespace memtrain::test
