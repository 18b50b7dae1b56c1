#include "core/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

namespace memtrain {

std::string short_duration(double seconds) {
    const int64_t s = (int64_t)std::llround(std::max(0.0, seconds));
    if (s < 60) return fmt::format("{}s", s);
    if (s < 3600) return fmt::format("{}m{:02d}s", s / 60, s % 60);
    return fmt::format("{}h{:02d}m", s / 3600, s % 3600 / 60);
}

Progress::Progress(std::string what, std::string unit, int64_t total, double every_s)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      total_(total),
      every_s_(every_s),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

void Progress::tick(int64_t done) {
    if (total_ <= 1 || done >= total_) return;  // the result line says the rest
    const auto now = std::chrono::steady_clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (done != 1 && since < every_s_) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double eta = elapsed / (double)done * (double)(total_ - done);
    std::fprintf(stderr, "%s: %s %lld/%lld (%.0f%%), elapsed %s, eta %s\n", what_.c_str(),
                 unit_.c_str(), (long long)done, (long long)total_, 100.0 * done / total_,
                 short_duration(elapsed).c_str(), short_duration(eta).c_str());
}

}  // namespace memtrain
