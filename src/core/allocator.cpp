// Host side of the tagged allocator: aligned allocations and the per-category tracker.
#include "core/allocator.h"

#include <fmt/format.h>

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/error.h"

namespace memtrain {

std::string mib(std::size_t bytes) {
    return fmt::format("{:.1f} MiB", (double)bytes / (1024.0 * 1024));
}

std::string gib(std::size_t bytes) {
    return fmt::format("{:.2f} GiB", (double)bytes / (1024.0 * 1024 * 1024));
}

std::size_t array_bytes(std::size_t n, std::size_t elem_size) {
    std::size_t bytes = 0;
    if (__builtin_mul_overflow(n, elem_size, &bytes))
        fail("an allocation of {} elements of {} bytes does not fit in 64 bits", n, elem_size);
    return bytes;
}

std::size_t predicted_total(const std::vector<MemoryPrediction>& rows) {
    std::size_t s = 0;
    for (const auto& r : rows) s += r.bytes;
    return s;
}

std::string_view category_name(MemCategory c) {
    switch (c) {
        case MemCategory::Parameters:
            return "parameters";
        case MemCategory::Gradients:
            return "gradients";
        case MemCategory::OptimizerState:
            return "optimizer state";
        case MemCategory::Activations:
            return "activations";
        case MemCategory::Workspace:
            return "workspace";
        case MemCategory::Communication:
            return "communication";
        case MemCategory::Other:
            return "other";
        case MemCategory::Count:
            break;
    }
    return "?";
}

void MemoryTracker::on_alloc(MemCategory c, std::size_t used, std::size_t reserved) {
    std::lock_guard lock(mu_);
    int i = static_cast<int>(c);
    stats_.used[i] += used;
    stats_.reserved[i] += reserved;
    stats_.total_used += used;
    stats_.total_reserved += reserved;
    if (stats_.used[i] > stats_.peak_used[i]) stats_.peak_used[i] = stats_.used[i];
    if (stats_.total_used > stats_.peak_total_used) stats_.peak_total_used = stats_.total_used;
    if (stats_.total_reserved > stats_.peak_total_reserved)
        stats_.peak_total_reserved = stats_.total_reserved;
}

void MemoryTracker::on_free(MemCategory c, std::size_t used, std::size_t reserved) {
    std::lock_guard lock(mu_);
    int i = static_cast<int>(c);
    stats_.used[i] -= used;
    stats_.reserved[i] -= reserved;
    stats_.total_used -= used;
    stats_.total_reserved -= reserved;
}

MemoryStats MemoryTracker::snapshot() const {
    std::lock_guard lock(mu_);
    return stats_;
}

void MemoryTracker::reset_peak() {
    std::lock_guard lock(mu_);
    stats_.peak_used = stats_.used;
    stats_.peak_total_used = stats_.total_used;
    stats_.peak_total_reserved = stats_.total_reserved;
}

MemoryTracker& host_memory() {
    static MemoryTracker tracker;
    return tracker;
}

static constexpr std::size_t kAlign = 64;

static std::size_t reserved_bytes(std::size_t bytes) {
    return (bytes + kAlign - 1) / kAlign * kAlign;
}

void* tracked_alloc(std::size_t bytes, MemCategory c) {
    std::size_t reserved = reserved_bytes(bytes == 0 ? 1 : bytes);
    void* p = std::aligned_alloc(kAlign, reserved);
    if (!p) {
        fail("out of host memory: could not allocate {} bytes for {} ({} MiB already in use)",
             bytes, category_name(c), host_memory().snapshot().total_used >> 20);
    }
    std::memset(p, 0, reserved);
    host_memory().on_alloc(c, bytes, reserved);
    return p;
}

void tracked_free(void* p, std::size_t bytes, MemCategory c) {
    std::free(p);
    host_memory().on_free(c, bytes, reserved_bytes(bytes == 0 ? 1 : bytes));
}

std::size_t process_peak_rss() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<std::size_t>(ru.ru_maxrss) * 1024;
}

std::size_t process_current_rss() {
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long pages_total = 0, pages_resident = 0;
    int n = std::fscanf(f, "%lu %lu", &pages_total, &pages_resident);
    std::fclose(f);
    return n == 2 ? pages_resident * 4096ul : 0;
}

}  // namespace memtrain
