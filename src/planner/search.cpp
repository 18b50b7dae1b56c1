// Exhaustive search over layouts: the space is a few thousand points and each estimate is a
// handful of arithmetic operations, so enumerating beats any heuristic and is exact.
#include "planner/search.h"

#include <algorithm>
#include <map>
#include <optional>

#include <fmt/ranges.h>

#include "core/error.h"
#include "planner/rank_layout.h"

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
        gbs(static_cast<double>(p.memory.cpu_bytes) * per_node), gbs(c.host_memory()));
}

// Keeps in `slot` the plan with the least `key`.
template <typename Key>
void keep_least(std::optional<Plan>& slot, const Plan& p, Key key) {
    if (!slot || key(p) < key(*slot)) slot = p;
}

// What one training method (full-parameter, or LoRA at a rank and frozen bits) allows.
struct MethodSearch {
    std::vector<Plan> plans;
    std::vector<Rejection> families;    // families in which nothing fits
    std::vector<Rejection> structural;  // tp or dp impossible for the model or the batch
    int evaluated = 0;
    // Over all families: the least GPU memory without offload, with offload (not fitting the
    // GPU), and the least host memory of offloaded layouts that do fit the GPU.
    std::optional<Plan> least_plain, least_offload, least_host;
};

MethodSearch search_method(const ModelSpec& m, const ClusterSpec& c, const SearchSpec& spec, int B,
                           int seq, const RunSpec& method) {
    MethodSearch out;
    std::map<std::string, Plan> closest;       // per family: the member needing the least memory
    std::map<std::string, Plan> host_closest;  // ... of those that fit the GPU but not the host
    std::map<std::string, bool> family_fits;
    const std::string name = describe_method(method);
    const auto total = [](const Plan& p) { return p.memory.total; };
    const auto host = [](const Plan& p) { return p.memory.cpu_bytes; };

    for (int tp = 1; tp <= std::min(c.gpus, c.gpus_per_node); tp *= 2) {
        if (c.gpus % tp != 0) continue;
        if (m.n_head % tp != 0 || (m.kv_heads() % tp != 0 && tp % m.kv_heads() != 0)) {
            out.structural.push_back({fmt::format("tp={}", tp),
                                      fmt::format("{} attention heads ({} key/value) are not "
                                                  "divisible by tp={}",
                                                  m.n_head, m.kv_heads(), tp),
                                      0, ""});
            continue;
        }
        for (int pp = 1; pp <= std::min(m.n_layer, c.gpus / tp); ++pp) {
            if ((c.gpus / tp) % pp != 0) continue;
            const int dp = c.gpus / (tp * pp);
            if (B % dp != 0) {
                out.structural.push_back(
                    {fmt::format("dp={} tp={} pp={}", dp, tp, pp),
                     fmt::format("global batch {} is not divisible by dp={}", B, dp), 0, ""});
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
                            RunSpec r = method;
                            r.dp = dp, r.tp = tp, r.pp = pp, r.zero = zero, r.offload = off;
                            r.recompute = rc, r.micro_batch = mbs;
                            r.micro_batches = B / (mbs * dp);
                            r.seq = seq;
                            // Sequence parallelism with tp wherever the trainer runs it.
                            r.sequence_parallel = sequence_parallel_runs(m, r);
                            if (!runtime_layout_refusal(r).empty()) continue;  // not this runtime's
                            Plan p;
                            p.run = r;
                            p.memory = estimate_memory(m, r);
                            ++out.evaluated;
                            std::string fam = family_of(r);
                            const bool fits = p.memory.total <= c.gpu.memory_bytes,
                                       fits_host = host_fits(p.memory, c);
                            family_fits[fam] = family_fits[fam] || (fits && fits_host);
                            if (!fits) {
                                keep_least(
                                    off == Offload::none ? out.least_plain : out.least_offload, p,
                                    total);
                                auto it = closest.find(fam);
                                if (it == closest.end() || p.memory.total < it->second.memory.total)
                                    closest[fam] = p;
                                continue;
                            }
                            if (!fits_host) {  // fits the GPU, not the host: the least host
                                keep_least(out.least_host, p, host);
                                auto it = host_closest.find(fam);
                                if (it == host_closest.end() ||
                                    p.memory.cpu_bytes < it->second.memory.cpu_bytes)
                                    host_closest[fam] = p;
                                continue;
                            }
                            p.time = estimate_time(m, r, c);
                            out.plans.push_back(std::move(p));
                        }
                    }
                }
            }
        }
    }
    std::sort(out.plans.begin(), out.plans.end(), [](const Plan& a, const Plan& b) {
        if (trainer_runs(a.run) != trainer_runs(b.run)) return trainer_runs(a.run);
        if (a.time.tokens_per_s != b.time.tokens_per_s)
            return a.time.tokens_per_s > b.time.tokens_per_s;
        return a.memory.total < b.memory.total;
    });
    for (const auto& [fam, fits] : family_fits) {
        if (fits) continue;
        if (auto h = host_closest.find(fam); h != host_closest.end()) {
            const Plan& p = h->second;
            out.families.push_back({fam, host_over_reason(p, c), p.memory.total, name});
            continue;
        }
        const Plan& p = closest.at(fam);
        out.families.push_back({fam, over_reason(p, c.gpu.memory_bytes), p.memory.total, name});
    }
    std::sort(out.families.begin(), out.families.end(),
              [](const Rejection& a, const Rejection& b) { return a.best_bytes > b.best_bytes; });
    return out;
}

// One line for a method in which nothing fits: the least GPU memory without offload and, where
// offload was searched, the least GPU or host memory with it.
std::string why_nothing_fits(const MethodSearch& s, const ClusterSpec& c) {
    std::vector<std::string> parts;
    const std::string cap = gbs(c.gpu.memory_bytes);
    if (s.least_plain)
        parts.push_back(fmt::format("without offload at least {}/GPU > {} ({})",
                                    gbs(s.least_plain->memory.total), cap,
                                    describe(s.least_plain->run)));
    if (s.least_host) {
        const Plan& p = *s.least_host;
        parts.push_back(fmt::format(
            "with offload {} fits the GPU ({}) but needs {} of host memory per node > {}",
            describe(p.run), gbs(p.memory.total),
            gbs(static_cast<double>(p.memory.cpu_bytes) * gpus_sharing_a_host(c)),
            gbs(c.host_memory())));
    } else if (s.least_offload) {
        parts.push_back(fmt::format("with offload at least {}/GPU > {} ({})",
                                    gbs(s.least_offload->memory.total), cap,
                                    describe(s.least_offload->run)));
    }
    return fmt::format("nothing fits: {}", fmt::join(parts, "; "));
}

}  // namespace

std::string Rejection::label() const {
    if (family.empty()) return method;
    if (method.empty() || method == "full-parameter training") return family;
    return method + ", " + family;
}

int gpus_sharing_a_host(const ClusterSpec& c) {
    return std::max(1, std::min(c.gpus, c.gpus_per_node));
}

bool host_fits(const MemoryEstimate& est, const ClusterSpec& c) {
    return static_cast<double>(est.cpu_bytes) * gpus_sharing_a_host(c) <= c.host_memory();
}

std::string describe(const RunSpec& r) {
    std::string s = fmt::format("dp={} tp={} pp={} ZeRO-{} mb={}x{} recompute={}", r.dp, r.tp, r.pp,
                                r.zero, r.micro_batch, r.micro_batches, to_string(r.recompute));
    if (r.offload != Offload::none) s += fmt::format(" offload={}", to_string(r.offload));
    if (r.lora_rank > 0)
        s += fmt::format(" {} targets={}", describe_method(r), to_string(r.lora_targets));
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
    if (!(c.host_memory() > 0))
        fail("host memory per node must be positive, got {}", c.host_memory());
    if (spec.lora_rank < 0) fail("LoRA rank must be >= 1, got {}", spec.lora_rank);
    if (spec.lora_fallback && spec.fallback_rank < 1)
        fail("LoRA fallback rank must be >= 1, got {}", spec.fallback_rank);
    if (spec.frozen_bits != 0 && spec.frozen_bits != 16 && spec.frozen_bits != 8 &&
        spec.frozen_bits != 4)
        fail("frozen weight bits must be 16, 8 or 4, got {}", spec.frozen_bits);
    if (spec.frozen_bits != 0 && spec.lora_rank == 0 && !spec.lora_fallback)
        fail("frozen weights at {} bits need LoRA: give a LoRA rank or allow the LoRA fallback",
             spec.frozen_bits);
    const int B = spec.global_batch > 0 ? spec.global_batch : 1024;
    const int seq = spec.seq > 0 ? spec.seq : m.block_size;
    if (!m.rope && seq > m.block_size)
        fail("sequence length {} exceeds the {} learned positions of {}", seq, m.block_size,
             m.name);

    // The methods in the order tried: the given LoRA, or full-parameter training and then, when
    // allowed, LoRA with frozen weights at 16, 8 and 4 bits (or only the bits given).
    RunSpec base;
    base.flash_attention = spec.flash_attention;
    base.precision = spec.precision, base.optimizer = spec.optimizer;
    base.state_format = spec.state_format;
    base.fp32_master = spec.fp32_master;
    base.fragmentation = spec.fragmentation;
    base.reserve_bytes = spec.reserve_bytes;
    base.lora_targets = spec.lora_targets;
    base.runtime = spec.runtime;
    // Compressed moments and LoRA are memtrain's: a peer's runtime is priced as it trains.
    const bool memtrain_runtime = spec.runtime == Runtime::memtrain;
    std::vector<RunSpec> ladder;
    if (spec.lora_rank > 0) {
        RunSpec r = base;
        r.lora_rank = spec.lora_rank;
        r.frozen_bits = spec.frozen_bits > 0 ? spec.frozen_bits : 16;
        ladder.push_back(r);
    } else {
        ladder.push_back(base);
        // Compressed moments keep training every weight: tried before adapters.
        if (memtrain_runtime && spec.state_fallback && spec.optimizer == Optimizer::adamw) {
            for (StateFormat f : {StateFormat::Int8, StateFormat::Int4})
                if (moment_bytes_per_param(f) < moment_bytes_per_param(spec.state_format)) {
                    RunSpec r = base;
                    r.state_format = f;
                    ladder.push_back(r);
                }
            // Then bf16 weights without the fp32 master (optim.master = "none", which the GPU
            // engines run with DDP, ZeRO and pipelines): 4 B per parameter less, int8 and int4.
            if (base.precision == Precision::bf16 && base.fp32_master)
                for (StateFormat f : {StateFormat::Int8, StateFormat::Int4}) {
                    RunSpec r = base;
                    r.fp32_master = false;
                    r.state_format = f;
                    ladder.push_back(r);
                }
        }
        if (memtrain_runtime && spec.lora_fallback) {
            std::vector<int> bits = {16, 8, 4};
            if (spec.frozen_bits > 0) bits = {spec.frozen_bits};
            for (int b : bits) {
                RunSpec r = base;
                r.lora_rank = spec.fallback_rank;
                r.frozen_bits = b;
                ladder.push_back(r);
            }
        }
    }

    SearchResult result;
    std::vector<MethodSearch> tried;
    for (const RunSpec& method : ladder) {
        tried.push_back(search_method(m, c, spec, B, seq, method));
        const MethodSearch& s = tried.back();
        const int64_t trainable =
            method.lora_rank > 0
                ? m.n_layer * lora_params_per_layer(m, method.lora_rank, method.lora_targets)
                : m.total_params();
        const auto runs = std::count_if(s.plans.begin(), s.plans.end(),
                                        [](const Plan& p) { return trainer_runs(p.run); });
        result.methods.push_back({describe_method(method), method.lora_rank, method.frozen_bits,
                                  trainable, s.evaluated, static_cast<int>(runs)});
        result.evaluated += s.evaluated;
        // A method stops the ladder when a plan the trainer runs fits; parameter offload alone
        // (priced for comparison) does not, so compressed moments or LoRA are tried next.
        if (!s.plans.empty() && trainer_runs(s.plans.front().run)) break;
    }
    // The plans shown: the method that stopped the ladder, or else the first with any plan.
    std::size_t shown = tried.size() - 1;
    if (tried.back().plans.empty() || !trainer_runs(tried.back().plans.front().run))
        for (std::size_t i = 0; i < tried.size(); ++i)
            if (!tried[i].plans.empty()) {
                shown = i;
                break;
            }
    result.plans = tried[shown].plans;
    result.lora_instead_of_full =
        !result.plans.empty() && ladder.front().lora_rank == 0 && result.plans[0].run.lora_rank > 0;
    result.asked_moments = spec.state_format;
    result.moments_instead_of_plain = !result.plans.empty() && result.plans[0].run.lora_rank == 0 &&
                                      result.plans[0].run.state_format != spec.state_format;
    result.weights_instead_of_master =
        result.moments_instead_of_plain && spec.fp32_master && !result.plans[0].run.fp32_master;
    for (size_t i = 0; i < tried.size(); ++i) {
        if (i == shown && !tried[i].plans.empty()) continue;
        std::string reason =
            tried[i].plans.empty()
                ? why_nothing_fits(tried[i], c)
                : "only parameter offload fits, which memtrain's trainer does not run yet";
        if (i + 1 < tried.size())
            reason +=
                fmt::format("; {} {}", result.methods[i + 1].name,
                            result.methods[i + 1].fitting > 0 ? "fits" : "does not fit either");
        int64_t least = 0;
        for (const auto& p : {tried[i].least_plain, tried[i].least_offload, tried[i].least_host})
            if (p && (least == 0 || p->memory.total < least)) least = p->memory.total;
        result.rejected.push_back({"", reason, least, result.methods[i].name});
    }
    for (auto& s : tried)
        for (auto& f : s.families) result.rejected.push_back(std::move(f));
    for (auto& s : tried.front().structural) result.rejected.push_back(std::move(s));
    return result;
}

}  // namespace memtrain::plan
