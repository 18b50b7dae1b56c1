// Where a step's wall-clock time went, as the thread that ran it saw it: loading data, the
// forward and backward, recomputing dropped activations, collectives (data-, tensor-parallel and
// ZeRO traffic, and waiting in them for slower ranks), pipeline sends and receives (the bubble),
// and the optimizer. Phases nest and count exclusively: a collective inside the backward is
// communication, not compute; a collective inside a p2p scope (a pipeline's own
// synchronisation: its step barrier, its timeline's gathers, the loss sent back from the last
// stage) stays p2p, the pipeline's idle time. `memtrain diagnose` (train/diagnose.h) reads the
// sums.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <vector>

namespace memtrain {

enum class Phase : int { data, compute, recompute, comm, p2p, optimizer };
inline constexpr std::size_t kPhases = 6;
// "data", "compute", "recompute", "comm", "p2p", "optimizer": the keys of timings.json and of a
// metrics line's "phases_ms".
const char* phase_key(Phase p);

struct PhaseTimes {
    std::array<double, kPhases> s{};  // seconds per phase
    double& operator[](Phase p) { return s[(std::size_t)p]; }
    double operator[](Phase p) const { return s[(std::size_t)p]; }
    double total() const;
    PhaseTimes& operator+=(const PhaseTimes& o);
    PhaseTimes operator-(const PhaseTimes& o) const;
};

// One thread's clock. Time outside every phase is not counted; entering a phase inside another
// pauses the outer one until the inner one ends.
class PhaseClock {
  public:
    void enter(Phase p);
    void leave();
    // The sums so far, the phases still open counted up to now.
    PhaseTimes totals() const;

  private:
    using Clock = std::chrono::steady_clock;
    PhaseTimes sum_;
    std::vector<Phase> open_;
    Clock::time_point mark_;
};

// The calling thread's clock.
PhaseClock& phase_clock();

// Counts its scope as phase `p` on the calling thread's clock.
class ScopedPhase {
  public:
    explicit ScopedPhase(Phase p) { phase_clock().enter(p); }
    ~ScopedPhase() { phase_clock().leave(); }
    ScopedPhase(const ScopedPhase&) = delete;
    ScopedPhase& operator=(const ScopedPhase&) = delete;
};

}  // namespace memtrain
