// Tagged host memory: every buffer the engine owns carries a category, and the tracker keeps
// current and peak bytes per category, both as used (bytes asked for) and reserved (bytes the
// allocator really holds after alignment), so fragmentation and padding are visible.
//
// Example:
//     Buffer<float> params(n, MemCategory::Parameters);   // counted under "parameters"
//     ...
//     MemorySnapshot s = host_memory().snapshot();
//     s.peak_used[MemCategory::Parameters]  // == 4 * n bytes
//
// The CUDA allocator (core/device.h) reports into a tracker of the same type.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace memtrain {

enum class MemCategory : int {
    Parameters,
    Gradients,
    OptimizerState,
    Activations,
    Workspace,
    Communication,
    Other,
    Count
};
constexpr int kNumMemCategories = static_cast<int>(MemCategory::Count);

std::string_view category_name(MemCategory c);
// Byte counts as the reports print them: "12.3 MiB", "1.25 GiB".
std::string mib(std::size_t bytes);
std::string gib(std::size_t bytes);

// A row of a memory prediction (the run plan's, the report's): a category's predicted bytes and
// the formula behind them.
struct MemoryPrediction {
    MemCategory category;
    std::string formula;
    std::size_t bytes;
};

// The bytes of n elements of elem_size bytes; an error where the product does not fit in
// size_t (a size computed from a config wrapped, and the buffer would come back too small).
std::size_t array_bytes(std::size_t n, std::size_t elem_size);

// The bytes of all rows.
std::size_t predicted_total(const std::vector<MemoryPrediction>& rows);

struct MemoryStats {
    std::array<std::size_t, kNumMemCategories> used{};
    std::array<std::size_t, kNumMemCategories> reserved{};
    std::array<std::size_t, kNumMemCategories> peak_used{};
    std::size_t total_used = 0;
    std::size_t total_reserved = 0;
    std::size_t peak_total_used = 0;  // peak of the sum, not the sum of the peaks
    std::size_t peak_total_reserved = 0;

    std::size_t operator[](MemCategory c) const { return used[static_cast<int>(c)]; }
    std::size_t peak(MemCategory c) const { return peak_used[static_cast<int>(c)]; }
};

class MemoryTracker {
  public:
    void on_alloc(MemCategory c, std::size_t used, std::size_t reserved);
    void on_free(MemCategory c, std::size_t used, std::size_t reserved);
    MemoryStats snapshot() const;
    // Restarts peak tracking from the current usage (e.g. after set-up, to measure a step).
    void reset_peak();

  private:
    mutable std::mutex mu_;
    MemoryStats stats_;
};

// The process-wide tracker for host memory.
MemoryTracker& host_memory();

// 64-byte aligned host allocation registered with the host tracker.
void* tracked_alloc(std::size_t bytes, MemCategory c);
void tracked_free(void* p, std::size_t bytes, MemCategory c);

// An owning, move-only, zero-initialised array of T in one category.
template <typename T>
class Buffer {
  public:
    Buffer() = default;
    Buffer(std::size_t n, MemCategory c) : n_(n), cat_(c) {
        data_ = static_cast<T*>(tracked_alloc(array_bytes(n, sizeof(T)), c));
    }
    ~Buffer() { reset(); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    Buffer(Buffer&& o) noexcept { *this = std::move(o); }
    Buffer& operator=(Buffer&& o) noexcept {
        if (this != &o) {
            reset();
            data_ = std::exchange(o.data_, nullptr);
            n_ = std::exchange(o.n_, 0);
            cat_ = o.cat_;
        }
        return *this;
    }
    void reset() {
        if (data_) tracked_free(data_, n_ * sizeof(T), cat_);
        data_ = nullptr;
        n_ = 0;
    }
    T* data() { return data_; }
    const T* data() const { return data_; }
    std::size_t size() const { return n_; }
    std::size_t bytes() const { return n_ * sizeof(T); }
    T& operator[](std::size_t i) { return data_[i]; }
    const T& operator[](std::size_t i) const { return data_[i]; }
    MemCategory category() const { return cat_; }

  private:
    T* data_ = nullptr;
    std::size_t n_ = 0;
    MemCategory cat_ = MemCategory::Other;
};

// Peak resident set size of this process in bytes (what the OS charged us, all included).
std::size_t process_peak_rss();
std::size_t process_current_rss();

}  // namespace memtrain
