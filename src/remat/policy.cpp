// Parsing policies and turning them into per-block plans (see policy.h).
#include "remat/policy.h"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "core/error.h"
#include "remat/cost.h"

namespace memtrain::remat {

std::size_t parse_bytes(const std::string& text) {
    static const std::pair<const char*, double> kSuffixes[] = {
        {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0},
        {"KB", 1e3},     {"MB", 1e6},        {"GB", 1e9},
        {"B", 1.0},      {"", 1.0}};
    const char* s = text.c_str();
    char* end = nullptr;
    double v = std::strtod(s, &end);
    if (end == s || !std::isfinite(v) || v <= 0)
        fail("'{}' is not a positive byte count (e.g. 200MiB, 1.5GB, 4096)", text);
    std::string suffix(end);
    for (const auto& [name, mult] : kSuffixes)
        if (suffix == name) return (std::size_t)std::floor(v * mult);
    fail("'{}': unknown size suffix '{}'; use B, KB, MB, GB, KiB, MiB or GiB", text, suffix);
}

RematPolicy parse_policy(const std::string& text) {
    RematPolicy p;
    p.text = text;
    auto bad = [&](const std::string& why) -> RematPolicy {
        fail("remat policy '{}' {}; expected {}", text, why, kPolicyForms);
    };
    if (text == "none")
        p.kind = RematPolicy::Kind::None;
    else if (text == "full")
        p.kind = RematPolicy::Kind::Full;
    else if (text == "sqrt")
        p.kind = RematPolicy::Kind::Sqrt;
    else if (text == "selective")
        p.kind = RematPolicy::Kind::Selective;
    else if (text == "offload")
        p.kind = RematPolicy::Kind::Offload;
    else if (text == "memory-poor")
        p.kind = RematPolicy::Kind::MemoryPoor;
    else if (text.starts_with("chen:") || text.starts_with("every:") ||
             text.starts_with("revolve:")) {
        const bool chen = text.starts_with("chen:"), revolve = text.starts_with("revolve:");
        const std::string k = text.substr(text.find(':') + 1);
        char* end = nullptr;
        const long v = std::strtol(k.c_str(), &end, 10);
        if (k.empty() || *end != '\0' || v < (revolve ? 0 : 1) || v > 1000000)
            return bad(revolve ? "has a bad S (a count of hold slots, 0 or more)"
                       : chen  ? "has a bad K (a positive integer: a segment of K blocks)"
                               : "has a bad K (a positive integer)");
        p.kind = chen      ? RematPolicy::Kind::Chen
                 : revolve ? RematPolicy::Kind::Revolve
                           : RematPolicy::Kind::Every;
        p.every = (int)v;
    } else if (text.starts_with("budget:")) {
        std::string bytes = text.substr(7);
        constexpr std::string_view kOffload = "+offload";
        if (bytes.ends_with(kOffload)) {
            p.budget_offload = true;
            bytes.resize(bytes.size() - kOffload.size());
        }
        try {
            p.budget = parse_bytes(bytes);
        } catch (const Error& e) {
            return bad(std::string("has a bad budget: ") + e.what());
        }
        p.kind = RematPolicy::Kind::Budget;
    } else {
        return bad("is not a known form");
    }
    return p;
}

std::string format_bytes(std::size_t bytes) {
    return fmt::format("{:.2f} MiB ({} B)", bytes / 1048576.0, bytes);
}

Solution solve_policy(const RematPolicy& policy, const ModelConfig& cfg, int B, int T,
                      const BlockFlops* costs, const ActFormat& fmt) {
    Chain chain = costs ? make_chain(cfg, B, T, *costs, fmt) : make_chain(cfg, B, T, fmt);
    chain.allow_offload = policy.budget_offload;
    const int L = cfg.n_layer;
    using K = RematPolicy::Kind;
    RematPlan plan(L, BlockKeep::All);
    int every = policy.every;
    switch (policy.kind) {
        case K::None:
            break;
        case K::Full:
            plan.assign(L, BlockKeep::Input);
            break;
        case K::Selective:
            plan.assign(L, BlockKeep::Selective);
            break;
        case K::Sqrt:
            every = (int)std::ceil(std::sqrt((double)L));
            [[fallthrough]];
        case K::Every:
            for (int l = 0; l < L; l++)
                plan[l] = l % every == 0 ? BlockKeep::All : BlockKeep::Input;
            break;
        case K::Offload:  // every block recomputes, and the inputs leave the device
            plan.assign(L, BlockKeep::Offload);
            break;
        case K::MemoryPoor:  // only the first block's input is kept
            plan = memory_poor_plan(L);
            break;
        case K::Chen:  // the inputs of blocks 0, K, 2K, ... kept; segments rebuilt once
            plan = chen_plan(L, every);
            break;
        case K::Revolve:  // the first input kept, the rest on the binomial schedule
            plan = binomial_plan(chain, every);
            break;
        case K::Budget: {
            // The plans that rebuild block inputs join the knapsack's (the joint solver); with
            // +offload the GPU keeps or offloads every block's input instead.
            const bool rebuild = !policy.budget_offload && L > 1;
            const auto s =
                rebuild ? solve_joint(chain, policy.budget) : solve_budget(chain, policy.budget);
            if (!s) {
                std::size_t need = min_feasible_bytes(chain);
                if (rebuild) need = std::min(need, rebuild_floor(chain));
                fail(
                    "remat budget {} is below the smallest feasible peak activation memory {} "
                    "for this model at micro-batch {} x {}; use budget:{}{} or more{}",
                    format_bytes(policy.budget), format_bytes(need), B, T, need,
                    policy.budget_offload ? "+offload" : "",
                    policy.budget_offload || L <= kOffloadSlots
                        ? ""
                        : " (on a GPU, budget:BYTES+offload can go lower by keeping block "
                          "inputs in host memory)");
            }
            return *s;
        }
    }
    return evaluate(chain, plan);
}

}  // namespace memtrain::remat
