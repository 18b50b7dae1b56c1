// cudasim's streams (see sim.h): work is queued per stream and runs only when a synchronisation
// needs it, in an order drawn from MEMTRAIN_SIM_SEED among the orders CUDA allows. Private to
// the simulator's runtime (runtime.cpp, nccl.cpp use it through sim.h and these types).
//
// What CUDA allows, and so what the scheduler keeps:
//   - a stream's work runs in the order it was queued, one item at a time;
//   - an item queued after cudaStreamWaitEvent(s, e) runs after e's last record (at the time of
//     the wait) has completed;
//   - the legacy default stream and the blocking streams (created without cudaStreamNonBlocking)
//     wait for each other's earlier work; non-blocking streams wait for nothing implicitly;
//   - NCCL operations of one communicator start in the order they were issued, whatever their
//     stream (NCCL serialises a communicator's kernels).
// Everything else is free: two streams' work interleaves in whatever order the seed draws, and
// work nobody waits for stays queued until a synchronisation needs it. So a missing event wait
// leaves the consumer free to run before its producer, and one of the seeds runs it so.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

namespace cudasim {

struct Item {
    enum class State : uint8_t { Pending, Started, Done };
    uint64_t id = 0;  // enqueue order over all streams
    CUstream_st* stream = nullptr;
    std::function<void()> run;   // the work, or the start of asynchronous work
    std::function<bool()> done;  // asynchronous work only: polled after `run` until true
    std::vector<std::shared_ptr<Item>> after_done;  // must have completed first
    std::shared_ptr<Item> after_started;            // must have started first (a communicator)
    State state = State::Pending;
    std::chrono::steady_clock::time_point when{};  // when it completed (event timing)
};
using ItemPtr = std::shared_ptr<Item>;

}  // namespace cudasim

struct CUstream_st {
    bool legacy = false;                 // the legacy default stream (stream 0)
    bool blocking = false;               // synchronises with the legacy stream
    std::deque<cudasim::ItemPtr> queue;  // not yet completed, oldest first
    cudasim::ItemPtr tail;               // the last item queued (may have completed)
    uint64_t priority = 0;               // the scheduler's current preference (higher first)
    // Stream capture (CUDA graphs): work is recorded instead of queued.
    bool capturing = false;
    bool invalidated = false;
    std::vector<std::function<void()>> recorded;
};

struct CUevent_st {
    cudasim::ItemPtr record;  // the last cudaEventRecord's item; null: never recorded
};

namespace cudasim {

// Every scheduler entry point takes this lock (recursive: the runtime's calls nest).
void lock();
void unlock();
struct Lock {
    Lock() { lock(); }
    ~Lock() { unlock(); }
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
};

CUstream_st* stream_of(cudaStream_t s);
CUstream_st* new_stream(bool blocking);
// Completes the stream's work, then forgets it.
void destroy_stream(CUstream_st* s);

// Queues `item` (its run/done/after_* filled in) on `s`, adding the implicit dependencies.
// `order`: the communicator whose operations start in issue order (null: none).
ItemPtr push(CUstream_st* s, ItemPtr item, const void* order = nullptr);

// Runs queued work until `target` has completed (and whatever it depends on, in a seeded
// order). `block` false: runs what can run without waiting for another process and returns
// whether the target completed (cudaStreamQuery, cudaEventQuery).
bool complete(const ItemPtr& target, bool block = true);
// Runs every queued item of every stream (cudaDeviceSynchronize, cudaFree).
void complete_all();
// Completes every stream the legacy stream synchronises with (cudaStreamSynchronize(0)).
void complete_legacy();

// The wait hook of the mutation test (docs/cuda.md): true when this cudaStreamWaitEvent call,
// made from return address `site`, is to be dropped (MEMTRAIN_SIM_DROP_WAIT), after counting it
// for MEMTRAIN_SIM_WAIT_SITES.
bool drop_wait(const void* site);

}  // namespace cudasim
