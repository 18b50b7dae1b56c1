// Exhaustive search over layouts: the space is a few thousand points and each estimate is a
// handful of arithmetic operations, so enumerating beats any heuristic and is exact.
#include "plan/search.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::plan {

namespace {

std::string family_of(const RunSpec& r) {
    std::string shape = r.tp == 1 && r.pp == 1 ? "pure DP"
                        : r.pp == 1            ? "DP+TP"
                        : r.tp == 1            ? "DP+PP"
                                               : "DP+TP+PP";
    std::string off = r.offload == Offload::none        ? ""
                      : r.offload == Offload::optimizer ? " + optimizer offload"
                                                        : " + param offload";
    return fmt::format("{}, ZeRO-{}{}", shape, r.zero, off);
}

std::string gbs(double bytes) {
    if (bytes >= 1e12) return fmt::format("{:.2f} TB", bytes / 1e12);
    return fmt::format("{:.1f} GB", bytes / 1e9);
}

std::string over_reason(const Plan& p, double capacity) {
    const auto& mem = p.memory;
    return fmt::format(
        "best layout {} needs {}/GPU > {}: states {} (params {}, grads {}, optimizer {}), "
        "activations {}, other {}",
        describe(p.run), gbs(mem.total), gbs(capacity), gbs(mem.model_states()),
        gbs(mem.bytes("parameters")), gbs(mem.bytes("gradients")),
        gbs(mem.bytes("optimizer states")), gbs(mem.bytes("activations")),
        gbs(mem.total - mem.model_states() - mem.bytes("activations")));
}

std::string host_over_reason(const Plan& p, const ClusterSpec& c) {
    const int per_node = gpus_sharing_a_host(c);
    return fmt::format(
        "best layout {} fits the GPU ({}) but its offloaded states need {}/GPU x {} GPUs = {} of "
        "host memory per node > {}",
        describe(p.run), gbs(p.memory.total), gbs(p.memory.cpu_bytes), per_node,
        gbs(static_cast<double>(p.memory.cpu_bytes) * per_node), gbs(c.host_memory_bytes));
}

}  // namespace

int gpus_sharing_a_host(const ClusterSpec& c) {
    return std::max(1, std::min(c.gpus, c.gpus_per_node));
}

bool host_fits(const MemoryEstimate& est, const ClusterSpec& c) {
    return c.host_memory_bytes <= 0 ||
           static_cast<double>(est.cpu_bytes) * gpus_sharing_a_host(c) <= c.host_memory_bytes;
}

std::string describe(const RunSpec& r) {
    std::string s = fmt::format("dp={} tp={} pp={} ZeRO-{} mb={}x{} recompute={}", r.dp, r.tp, r.pp,
                                r.zero, r.micro_batch, r.micro_batches, to_string(r.recompute));
    if (r.offload != Offload::none) s += fmt::format(" offload={}", to_string(r.offload));
    return s;
}

SearchResult search_plans(const ModelSpec& m, const ClusterSpec& c, const SearchSpec& spec) {
    m.validate();
    if (c.gpus <= 0) fail("--gpus must be at least 1, got {}", c.gpus);
    if (c.gpus_per_node <= 0) fail("GPUs per node must be at least 1, got {}", c.gpus_per_node);
    if (c.gpus > c.gpus_per_node && c.gpus % c.gpus_per_node != 0)
        fail("{} GPUs do not fill whole nodes of {}; use a multiple of {}", c.gpus, c.gpus_per_node,
             c.gpus_per_node);
    if (c.gpu.memory_bytes <= 0 || c.gpu.peak_flops <= 0)
        fail("GPU memory and peak FLOP/s must be positive");
    const int B = spec.global_batch > 0 ? spec.global_batch : 1024;
    const int seq = spec.seq > 0 ? spec.seq : m.block_size;
    if (!m.rope && seq > m.block_size)
        fail("sequence length {} exceeds the {} learned positions of {}", seq, m.block_size,
             m.name);

    SearchResult result;
    std::map<std::string, Plan> closest;       // per family: the member needing the least memory
    std::map<std::string, Plan> host_closest;  // ... of those that fit the GPU but not the host
    std::map<std::string, bool> family_fits;
    std::vector<Rejection> structural;

    for (int tp = 1; tp <= std::min(c.gpus, c.gpus_per_node); tp *= 2) {
        if (c.gpus % tp != 0) continue;
        if (m.n_head % tp != 0 || (m.kv_heads() % tp != 0 && tp % m.kv_heads() != 0)) {
            structural.push_back({fmt::format("tp={}", tp),
                                  fmt::format("{} attention heads ({} key/value) are not "
                                              "divisible by tp={}",
                                              m.n_head, m.kv_heads(), tp),
                                  0});
            continue;
        }
        for (int pp = 1; pp <= std::min(m.n_layer, c.gpus / tp); ++pp) {
            if ((c.gpus / tp) % pp != 0) continue;
            const int dp = c.gpus / (tp * pp);
            if (B % dp != 0) {
                structural.push_back(
                    {fmt::format("dp={} tp={} pp={}", dp, tp, pp),
                     fmt::format("global batch {} is not divisible by dp={}", B, dp), 0});
                continue;
            }
            for (int zero = 0; zero <= 3; ++zero) {
                if (pp > 1 && zero >= 2) continue;  // ZeRO-2/3 do not combine with PP
                for (Offload off :
                     {Offload::none, Offload::optimizer, Offload::optimizer_and_params}) {
                    if (off != Offload::none && !spec.allow_offload) continue;
                    if (off == Offload::optimizer_and_params && zero != 3) continue;
                    // Offloading the optimizer needs a shard per rank, except on one GPU.
                    if (off == Offload::optimizer && zero == 0 && dp > 1) continue;
                    // One GPU: sharding over one rank changes nothing (ZeRO-0 covers it), but
                    // ZeRO-3 is how parameters are offloaded.
                    if (dp == 1 && zero > 0 && off != Offload::optimizer_and_params) continue;
                    for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
                        if (rc == Recompute::selective && spec.flash_attention)
                            continue;  // same as none
                        for (int mbs = 1; mbs <= spec.max_micro_batch && mbs * dp <= B; mbs *= 2) {
                            if (B % (mbs * dp) != 0) continue;
                            RunSpec r;
                            r.dp = dp, r.tp = tp, r.pp = pp, r.zero = zero, r.offload = off;
                            r.recompute = rc, r.micro_batch = mbs;
                            r.micro_batches = B / (mbs * dp);
                            r.seq = seq;
                            r.sequence_parallel = tp > 1;
                            r.flash_attention = spec.flash_attention;
                            r.precision = spec.precision, r.optimizer = spec.optimizer;
                            r.fragmentation = spec.fragmentation;
                            r.reserve_bytes = spec.reserve_bytes;
                            Plan p;
                            p.run = r;
                            p.memory = estimate_memory(m, r);
                            ++result.evaluated;
                            std::string fam = family_of(r);
                            const bool fits = p.memory.total <= c.gpu.memory_bytes,
                                       fits_host = host_fits(p.memory, c);
                            family_fits[fam] = family_fits[fam] || (fits && fits_host);
                            if (!fits) {
                                auto it = closest.find(fam);
                                if (it == closest.end() || p.memory.total < it->second.memory.total)
                                    closest[fam] = p;
                                continue;
                            }
                            if (!fits_host) {  // fits the GPU, not the host: the least host
                                auto it = host_closest.find(fam);
                                if (it == host_closest.end() ||
                                    p.memory.cpu_bytes < it->second.memory.cpu_bytes)
                                    host_closest[fam] = p;
                                continue;
                            }
                            p.time = estimate_time(m, r, c);
                            result.plans.push_back(std::move(p));
                        }
                    }
                }
            }
        }
    }
    std::sort(result.plans.begin(), result.plans.end(), [](const Plan& a, const Plan& b) {
        if (a.time.tokens_per_s != b.time.tokens_per_s)
            return a.time.tokens_per_s > b.time.tokens_per_s;
        return a.memory.total < b.memory.total;
    });
    for (const auto& [fam, fits] : family_fits) {
        if (fits) continue;
        if (auto h = host_closest.find(fam); h != host_closest.end()) {
            const Plan& p = h->second;
            result.rejected.push_back({fam, host_over_reason(p, c), p.memory.total});
            continue;
        }
        const Plan& p = closest.at(fam);
        result.rejected.push_back({fam, over_reason(p, c.gpu.memory_bytes), p.memory.total});
    }
    std::sort(result.rejected.begin(), result.rejected.end(),
              [](const Rejection& a, const Rejection& b) { return a.best_bytes > b.best_bytes; });
    for (auto& s : structural) result.rejected.push_back(std::move(s));
    return result;
}

}  // namespace memtrain::plan
