// DataLoader: cuts a token shard into windows of seq_len + 1 tokens (stride seq_len) and serves
// them as (inputs, targets) batches, epoch after epoch. The order depends only on (seed, epoch)
// and the position is two integers, so a checkpoint resumes the exact same stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/shard.h"

namespace memtrain::data {

class DataLoader {
  public:
    // Where the next window comes from: `cursor` indexes the epoch's visiting order.
    struct Position {
        uint64_t epoch = 0;
        uint64_t cursor = 0;
        bool operator==(const Position&) const = default;
    };

    DataLoader(const std::string& shard_path, int batch, int seq_len, uint64_t seed, bool shuffle);

    // Fills batch * seq_len inputs and the same number of targets (inputs shifted by one token).
    void next_batch(int32_t* inputs, int32_t* targets);

    Position position() const { return pos_; }
    // Restores a position saved from a loader over the same shard; the cursor must be at most
    // num_windows().
    void set_position(Position position);
    void reset() { set_position({0, 0}); }

    size_t num_windows() const { return num_windows_; }
    int batch() const { return batch_; }
    int seq_len() const { return seq_len_; }
    const TokenShard& shard() const { return shard_; }

    // The window visited at `index` of `epoch`'s order: a splitmix64-driven Fisher-Yates shuffle
    // of 0..num_windows-1, identical on every platform.
    static std::vector<uint64_t> epoch_order(uint64_t seed, uint64_t epoch, size_t num_windows,
                                             bool shuffle);

  private:
    void ensure_order();

    TokenShard shard_;
    int batch_, seq_len_;
    uint64_t seed_;
    bool shuffle_;
    size_t num_windows_ = 0;
    Position pos_;
    std::vector<uint64_t> order_;  // for order_epoch_
    uint64_t order_epoch_ = UINT64_MAX;
    std::vector<uint32_t> window_;
};

}  // namespace memtrain::data
