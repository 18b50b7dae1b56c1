// Shard layout helpers, the world-of-one backend, and the collective checks built on any
// Communicator (config agreement, error agreement).
#include "comm/communicator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace memtrain::dist {

std::vector<ShardRange> shard_ranges(int64_t total, int world) {
    if (world < 1) fail("shard_ranges: world size must be >= 1, got {}", world);
    if (total < 0) fail("shard_ranges: total must be >= 0, got {}", total);
    std::vector<ShardRange> ranges(static_cast<size_t>(world));
    const int64_t base = total / world;
    const int64_t extra = total % world;
    int64_t offset = 0;
    for (int r = 0; r < world; ++r) {
        const int64_t count = base + (r < extra ? 1 : 0);
        ranges[static_cast<size_t>(r)] = {offset, count};
        offset += count;
    }
    return ranges;
}

std::vector<ShardRange> grain_shard_ranges(int64_t begin, int64_t end, int world, int64_t grain) {
    if (grain < 1) fail("grain_shard_ranges: grain must be >= 1, got {}", grain);
    if (begin < 0 || end < begin) fail("grain_shard_ranges: [{}, {}) is not a range", begin, end);
    if (grain == 1) return shard_ranges(end - begin, world);
    const int64_t first = begin / grain, cells = (end + grain - 1) / grain - first;
    std::vector<ShardRange> ranges = shard_ranges(cells, world);
    for (ShardRange& r : ranges) {
        const int64_t lo = std::clamp((first + r.offset) * grain, begin, end);
        const int64_t hi = std::clamp((first + r.offset + r.count) * grain, begin, end);
        r = {lo - begin, hi - lo};
    }
    return ranges;
}

std::vector<int64_t> counts_of(std::span<const ShardRange> ranges) {
    std::vector<int64_t> counts;
    for (const ShardRange& r : ranges) counts.push_back(r.count);
    return counts;
}

std::vector<int64_t> shard_counts(int64_t total, int world) {
    return counts_of(shard_ranges(total, world));
}

int64_t padded_shard_size(int64_t total, int world, int64_t grain) {
    if (world < 1) fail("padded_shard_ranges: world size must be >= 1, got {}", world);
    if (grain < 1) fail("padded_shard_ranges: grain must be >= 1, got {}", grain);
    const int64_t S = (total + world - 1) / world;
    return (S + grain - 1) / grain * grain;
}

std::vector<ShardRange> padded_shard_ranges(int64_t total, int world, int64_t grain) {
    return equal_shard_ranges(total, world, padded_shard_size(total, world, grain));
}

std::vector<ShardRange> equal_shard_ranges(int64_t total, int world, int64_t S) {
    if (world < 1) fail("equal_shard_ranges: world size must be >= 1, got {}", world);
    std::vector<ShardRange> ranges(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
        const int64_t b = std::min(total, r * S);
        ranges[static_cast<size_t>(r)] = {b, std::min(S, total - b)};
    }
    return ranges;
}

UnitPieces unit_pieces(std::span<const ShardRange> shards, int64_t begin, int64_t end) {
    UnitPieces p;
    for (const ShardRange& s : shards) {
        const int64_t lo = std::max(s.offset, begin), hi = std::min(s.offset + s.count, end);
        p.offsets.push_back(hi > lo ? lo - begin : 0);
        p.counts.push_back(hi > lo ? hi - lo : 0);
    }
    return p;
}

std::vector<int64_t> shard_offsets(std::span<const int64_t> counts) {
    std::vector<int64_t> offsets(counts.size());
    int64_t offset = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
        offsets[r] = offset;
        offset += counts[r];
    }
    return offsets;
}

void check_counts(std::span<const int64_t> counts, int world, const char* op) {
    if (static_cast<int64_t>(counts.size()) != world) {
        fail("{}: expected one shard count per rank ({}), got {}", op, world, counts.size());
    }
    for (size_t r = 0; r < counts.size(); ++r) {
        if (counts[r] < 0) fail("{}: shard count of rank {} is negative ({})", op, r, counts[r]);
    }
}

namespace {

void check_n(int64_t n, const char* op) {
    if (n < 0) fail("{}: element count must be >= 0, got {}", op, n);
}

}  // namespace

void LocalCommunicator::all_reduce_sum(float*, int64_t n) {
    check_n(n, "all_reduce_sum");
}
void LocalCommunicator::all_reduce_max(double*, int64_t n) {
    check_n(n, "all_reduce_max");
}
void LocalCommunicator::all_reduce_max(int64_t*, int64_t n) {
    check_n(n, "all_reduce_max");
}

void LocalCommunicator::reduce_scatter_sum(const float* in, float* out,
                                           std::span<const int64_t> counts) {
    check_counts(counts, 1, "reduce_scatter_sum");
    if (counts[0] > 0 && in != out) std::memcpy(out, in, static_cast<size_t>(counts[0]) * 4);
}

void LocalCommunicator::all_gather(const float* in, float* out, std::span<const int64_t> counts) {
    check_counts(counts, 1, "all_gather");
    if (counts[0] > 0 && in != out) std::memcpy(out, in, static_cast<size_t>(counts[0]) * 4);
}

void LocalCommunicator::all_gather_bytes(const void* in, void* out, int64_t bytes_per_rank) {
    check_n(bytes_per_rank, "all_gather_bytes");
    if (bytes_per_rank > 0 && in != out) std::memcpy(out, in, static_cast<size_t>(bytes_per_rank));
}

void LocalCommunicator::broadcast(void*, int64_t bytes, int root) {
    check_n(bytes, "broadcast");
    if (root != 0) fail("broadcast: root {} is not a rank of a world of size 1", root);
}

void LocalCommunicator::send(const float*, int64_t, int peer, int) {
    fail("send to rank {}: a single-process run has no peers", peer);
}

void LocalCommunicator::recv(float*, int64_t, int peer, int) {
    fail("recv from rank {}: a single-process run has no peers", peer);
}

std::unique_ptr<Communicator> LocalCommunicator::split(int, int, std::string_view) {
    return std::make_unique<LocalCommunicator>();  // a world of one splits into itself
}

void LocalCommunicator::abort(std::string_view reason) {
    std::fprintf(stderr, "memtrain: rank 0 of 1: aborting: %.*s\n", static_cast<int>(reason.size()),
                 reason.data());
    std::fflush(stderr);
    std::_Exit(1);
}

namespace {

// FNV-1a: stable across processes, builds and runs (std::hash is not guaranteed to be).
uint64_t fnv1a(std::string_view s) {
    uint64_t h = 14695981039346656037ull;
    for (unsigned char c : s) {
        h ^= c;
        h *= 1099511628211ull;
    }
    return h;
}

}  // namespace

void check_same_config(Communicator& comm, std::string_view fingerprint) {
    const uint64_t mine = fnv1a(fingerprint);
    std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
    comm.all_gather_bytes(&mine, all.data(), sizeof(uint64_t));
    // Group ranks by hash so the message says which ranks agree with rank 0 and which do not.
    std::map<uint64_t, std::vector<int>> groups;
    for (int r = 0; r < comm.size(); ++r) groups[all[static_cast<size_t>(r)]].push_back(r);
    if (groups.size() == 1) return;
    std::string differing;
    for (const auto& [hash, ranks] : groups) {
        if (hash == all[0]) continue;
        differing += fmt::format("{}ranks {} (hash {:016x})", differing.empty() ? "" : "; ",
                                 fmt::join(ranks, ","), hash);
    }
    fail(
        "config differs across ranks: rank 0 has hash {:016x}, differing: {}; every rank must "
        "resolve the same config (same file, same --set overrides)",
        all[0], differing);
}

bool any_rank(Communicator& comm, bool local_failed) {
    int64_t flag = local_failed ? 1 : 0;
    comm.all_reduce_max(&flag, 1);
    return flag != 0;
}

}  // namespace memtrain::dist
