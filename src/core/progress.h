// Progress of long loops a user waits on (eval over a shard): one line on stderr after the first
// item, so the pace and an ETA show at once, then one every `every_s` seconds. stdout stays the
// command's result (a script reading --json is not disturbed).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace memtrain {

// "45s", "3m05s", "2h03m": elapsed times and ETAs on progress and step lines.
std::string short_duration(double seconds);

class Progress {
  public:
    // `what` starts each line ("eval"), `unit` names the items ("batch").
    Progress(std::string what, std::string unit, int64_t total, double every_s = 10.0);
    // `done` items of `total` are finished: prints when due.
    void tick(int64_t done);

  private:
    std::string what_, unit_;
    int64_t total_;
    double every_s_;
    std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace memtrain
