// Where each model state of a data-parallel rank lives: ZeRO stages 0-3 and ZeRO-Offload as rows
// of one table (data), so "stage >= k shards X" is written once. ZeroStore allocates its
// parameters and gradients by it (parallel/data/zero_store.cpp), and the CPU engines' predicted
// memory (engine/host_memory.cpp: zero_state_rows) and the planner (planner/memory_model.cpp)
// count a rank's model-state elements with held(); the CUDA engine's data-parallel part picks its
// collectives by it (parallel/data/device_data_parallel.h).
//
//            parameters   gradients   optimizer state
//   ZeRO-0   Replicated   Replicated  Replicated
//   ZeRO-1   Replicated   Replicated  Sharded
//   ZeRO-2   Replicated   Sharded     Sharded
//   ZeRO-3   Sharded      Sharded     Sharded
// Offload moves the optimizer state (and optionally the parameters) to host memory: Offloaded, or
// OffloadedShard where the stage also shards that state.
#pragma once

#include <cstdint>
#include <string>

namespace memtrain::dist {

enum class Placement : uint8_t {
    Replicated,      // every data-parallel rank holds all of it, on the device
    Sharded,         // each rank holds its piece (dist::shard_ranges), on the device
    Offloaded,       // all of it, in host memory
    OffloadedShard,  // the rank's piece, in host memory
};

struct ShardSpec {
    Placement params = Placement::Replicated;
    Placement grads = Placement::Replicated;
    Placement optimizer = Placement::Replicated;
};

// The table above; fails for a stage outside 0..3. offload_params needs offload_optimizer.
ShardSpec shard_spec(int zero_stage, bool offload_optimizer = false, bool offload_params = false);

bool sharded(Placement p);    // Sharded or OffloadedShard
bool offloaded(Placement p);  // in host memory
// Elements a rank holds of a state of `whole` elements whose ZeRO piece on this rank is `shard`.
int64_t held(Placement p, int64_t whole, int64_t shard);
// The same for formulas that split evenly: whole / dp where the state is sharded.
double held_fraction(Placement p, int dp);
const char* to_string(Placement p);
// "parameters replicated, gradients sharded, optimizer state sharded"
std::string describe(const ShardSpec& s);

}  // namespace memtrain::dist
