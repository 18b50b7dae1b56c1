// The ZeRO / offload placement table (see placement.h).
#include "parallel/placement.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::dist {

namespace {

Placement to_host(Placement p) {
    return sharded(p) ? Placement::OffloadedShard : Placement::Offloaded;
}

}  // namespace

ShardSpec shard_spec(int zero_stage, bool offload_optimizer, bool offload_params) {
    using P = Placement;
    // One row per stage: parameters, gradients, optimizer state.
    static constexpr ShardSpec kStages[] = {
        {P::Replicated, P::Replicated, P::Replicated},
        {P::Replicated, P::Replicated, P::Sharded},
        {P::Replicated, P::Sharded, P::Sharded},
        {P::Sharded, P::Sharded, P::Sharded},
    };
    if (zero_stage < 0 || zero_stage > 3)
        fail("ZeRO stage {} is out of range: expected 0, 1, 2 or 3", zero_stage);
    if (offload_params && !offload_optimizer)
        fail("internal: parameter offload without optimizer offload");
    ShardSpec s = kStages[zero_stage];
    if (offload_optimizer) s.optimizer = to_host(s.optimizer);
    if (offload_params) s.params = to_host(s.params);
    return s;
}

bool sharded(Placement p) {
    return p == Placement::Sharded || p == Placement::OffloadedShard;
}

bool offloaded(Placement p) {
    return p == Placement::Offloaded || p == Placement::OffloadedShard;
}

int64_t held(Placement p, int64_t whole, int64_t shard) {
    return sharded(p) ? shard : whole;
}

double held_fraction(Placement p, int dp) {
    return sharded(p) ? 1.0 / dp : 1.0;
}

const char* to_string(Placement p) {
    switch (p) {
        case Placement::Replicated:
            return "replicated";
        case Placement::Sharded:
            return "sharded";
        case Placement::Offloaded:
            return "offloaded";
        case Placement::OffloadedShard:
            return "offloaded (shard)";
    }
    return "?";
}

std::string describe(const ShardSpec& s) {
    return fmt::format("parameters {}, gradients {}, optimizer state {}", to_string(s.params),
                       to_string(s.grads), to_string(s.optimizer));
}

}  // namespace memtrain::dist
