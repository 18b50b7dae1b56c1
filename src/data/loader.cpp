// DataLoader implementation. The shuffle uses its own splitmix64 stream rather than std::
// distributions, whose output differs between standard libraries, so data order is part of the
// reproducible state just like the seed.
#include "data/loader.h"

#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace memtrain::data {

DataLoader::DataLoader(const std::string& shard_path, int batch, int seq_len, uint64_t seed,
                       bool shuffle)
    : shard_(shard_path), batch_(batch), seq_len_(seq_len), seed_(seed), shuffle_(shuffle) {
    if (batch <= 0) fail("data loader: batch size must be positive, got {}", batch);
    if (seq_len <= 0) fail("data loader: sequence length must be positive, got {}", seq_len);
    if (shard_.vocab_size() > static_cast<uint32_t>(INT32_MAX)) {
        fail("token shard '{}': vocab size {} does not fit the int32 token ids the model uses",
             shard_path, shard_.vocab_size());
    }
    const size_t window = static_cast<size_t>(seq_len) + 1;
    if (shard_.size() < window) {
        fail(
            "token shard '{}' has {} tokens; sequence length {} needs at least {} (one window "
            "of seq_len + 1)",
            shard_path, shard_.size(), seq_len, window);
    }
    num_windows_ = (shard_.size() - 1) / static_cast<size_t>(seq_len);
    window_.resize(window);
}

std::vector<uint64_t> DataLoader::epoch_order(uint64_t seed, uint64_t epoch, size_t num_windows,
                                              bool shuffle) {
    std::vector<uint64_t> order(num_windows);
    std::iota(order.begin(), order.end(), uint64_t{0});
    if (!shuffle) return order;
    // Mix seed and epoch through splitmix64 so neighbouring seeds or epochs are unrelated.
    uint64_t s = seed;
    uint64_t state = splitmix64(s) ^ (epoch * 0xD1B54A32D192ED03ull);
    for (size_t i = num_windows; i > 1; --i) {
        // Multiply-shift maps 64 random bits onto [0, i); bias is below 2^-40 for any real size.
        const uint64_t r = splitmix64(state);
        const auto j = static_cast<size_t>((static_cast<unsigned __int128>(r) * i) >> 64);
        std::swap(order[i - 1], order[j]);
    }
    return order;
}

void DataLoader::ensure_order() {
    if (order_epoch_ == pos_.epoch) return;
    order_ = epoch_order(seed_, pos_.epoch, num_windows_, shuffle_);
    order_epoch_ = pos_.epoch;
}

void DataLoader::set_position(Position position) {
    if (position.cursor > num_windows_) {
        fail(
            "data loader position (epoch {}, cursor {}) is invalid for shard '{}', which has {} "
            "windows of {} tokens; was the checkpoint made with another dataset or seq_len?",
            position.epoch, position.cursor, shard_.path(), num_windows_, seq_len_);
    }
    pos_ = position;
}

void DataLoader::next_batch(int32_t* inputs, int32_t* targets) {
    const size_t t = static_cast<size_t>(seq_len_);
    for (int b = 0; b < batch_; ++b) {
        if (pos_.cursor >= num_windows_) {
            ++pos_.epoch;
            pos_.cursor = 0;
        }
        ensure_order();
        const uint64_t w = order_[pos_.cursor++];
        shard_.read(w * t, t + 1, window_.data());
        int32_t* in = inputs + static_cast<size_t>(b) * t;
        int32_t* tg = targets + static_cast<size_t>(b) * t;
        for (size_t k = 0; k < t; ++k) {
            in[k] = static_cast<int32_t>(window_[k]);
            tg[k] = static_cast<int32_t>(window_[k + 1]);
        }
    }
}

}  // namespace memtrain::data
