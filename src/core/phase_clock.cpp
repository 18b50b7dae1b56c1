// The per-thread phase clock (core/phase_clock.h).
#include "core/phase_clock.h"

namespace memtrain {

const char* phase_key(Phase p) {
    switch (p) {
        case Phase::data:
            return "data";
        case Phase::compute:
            return "compute";
        case Phase::recompute:
            return "recompute";
        case Phase::comm:
            return "comm";
        case Phase::p2p:
            return "p2p";
        case Phase::optimizer:
            return "optimizer";
    }
    return "?";
}

double PhaseTimes::total() const {
    double t = 0;
    for (double v : s) t += v;
    return t;
}

PhaseTimes& PhaseTimes::operator+=(const PhaseTimes& o) {
    for (std::size_t i = 0; i < kPhases; i++) s[i] += o.s[i];
    return *this;
}

PhaseTimes PhaseTimes::operator-(const PhaseTimes& o) const {
    PhaseTimes d;
    for (std::size_t i = 0; i < kPhases; i++) d.s[i] = s[i] - o.s[i];
    return d;
}

void PhaseClock::enter(Phase p) {
    if (p == Phase::comm && !open_.empty() && open_.back() == Phase::p2p) p = Phase::p2p;
    const Clock::time_point now = Clock::now();
    if (!open_.empty()) sum_[open_.back()] += std::chrono::duration<double>(now - mark_).count();
    open_.push_back(p);
    mark_ = now;
}

void PhaseClock::leave() {
    if (open_.empty()) return;
    const Clock::time_point now = Clock::now();
    sum_[open_.back()] += std::chrono::duration<double>(now - mark_).count();
    open_.pop_back();
    mark_ = now;
}

PhaseTimes PhaseClock::totals() const {
    PhaseTimes t = sum_;
    if (!open_.empty())
        t[open_.back()] += std::chrono::duration<double>(Clock::now() - mark_).count();
    return t;
}

PhaseClock& phase_clock() {
    thread_local PhaseClock clock;
    return clock;
}

}  // namespace memtrain
