// DataLoader tests: targets are inputs shifted by one, order is a function of (seed, epoch),
// and a saved position resumes the exact stream.
#include "data/loader.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data/shard.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;

class Loader : public ::testing::Test {
  protected:
    void SetUp() override {
        dir_ = testing::scratch_dir();
        path_ = (dir_ / "train.bin").string();
        // Token i is i % 997, so every window's content identifies its start position.
        std::vector<uint32_t> tokens(1000);
        for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i % 997;
        write_shard(path_, tokens, 1000);
    }
    void TearDown() override { fs::remove_all(dir_); }

    struct Batch {
        std::vector<int32_t> x, y;
        bool operator==(const Batch&) const = default;
    };
    static Batch next(DataLoader& dl) {
        Batch b{std::vector<int32_t>(dl.batch() * dl.seq_len()),
                std::vector<int32_t>(dl.batch() * dl.seq_len())};
        dl.next_batch(b.x.data(), b.y.data());
        return b;
    }

    fs::path dir_;
    std::string path_;
};

TEST_F(Loader, WindowsAndShiftedTargets) {
    DataLoader dl(path_, 4, 16, 0, false);
    EXPECT_EQ(dl.num_windows(), (1000u - 1) / 16);
    const Batch b = next(dl);
    for (int r = 0; r < 4; ++r) {
        for (int t = 0; t < 16; ++t) {
            EXPECT_EQ(b.x[r * 16 + t], r * 16 + t);  // unshuffled: windows in order, stride 16
            EXPECT_EQ(b.y[r * 16 + t], b.x[r * 16 + t] + 1);
        }
    }
}

TEST_F(Loader, ShuffleIsDeterministicAndCoversEveryWindow) {
    DataLoader a(path_, 3, 10, 42, true), b(path_, 3, 10, 42, true), c(path_, 3, 10, 43, true);
    bool differs_from_other_seed = false;
    std::multiset<int32_t> starts;
    const size_t windows = a.num_windows();
    for (size_t i = 0; i < windows / 3; ++i) {
        const Batch ba = next(a), bb = next(b), bc = next(c);
        ASSERT_EQ(ba, bb);
        differs_from_other_seed |= !(ba == bc);
        for (int r = 0; r < 3; ++r) {
            starts.insert(ba.x[r * 10]);
            for (int t = 0; t < 10; ++t) {
                EXPECT_EQ(ba.y[r * 10 + t], (ba.x[r * 10 + t] + 1) % 997);
            }
        }
    }
    EXPECT_TRUE(differs_from_other_seed);
    // One epoch visits each window once.
    EXPECT_EQ(starts.size(), windows / 3 * 3);
    EXPECT_EQ(std::set<int32_t>(starts.begin(), starts.end()).size(), starts.size());
}

TEST_F(Loader, EpochsUseDifferentOrders) {
    const size_t n = 99;
    const auto e0 = DataLoader::epoch_order(7, 0, n, true);
    const auto e1 = DataLoader::epoch_order(7, 1, n, true);
    EXPECT_NE(e0, e1);
    auto sorted = e1;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(sorted[i], i);
    EXPECT_EQ(e0, DataLoader::epoch_order(7, 0, n, true));
    // Crossing an epoch boundary inside a batch advances the epoch.
    DataLoader dl(path_, 5, 100, 7, true);  // 9 windows
    for (int i = 0; i < 2; ++i) next(dl);
    EXPECT_EQ(dl.position().epoch, 1u);
    EXPECT_EQ(dl.position().cursor, 1u);
}

TEST_F(Loader, ResumeFromSavedPositionReproducesBatches) {
    DataLoader a(path_, 4, 12, 9, true);
    for (int i = 0; i < 30; ++i) next(a);  // crosses several epochs (83 windows)
    const DataLoader::Position saved = a.position();
    std::vector<Batch> expected;
    for (int i = 0; i < 50; ++i) expected.push_back(next(a));

    DataLoader b(path_, 4, 12, 9, true);
    b.set_position(saved);
    EXPECT_EQ(b.position(), saved);
    for (int i = 0; i < 50; ++i) ASSERT_EQ(next(b), expected[i]) << "batch " << i;

    b.reset();
    DataLoader fresh(path_, 4, 12, 9, true);
    EXPECT_EQ(next(b), next(fresh));
}

TEST_F(Loader, BadArgumentsThrow) {
    EXPECT_THROW(DataLoader(path_, 1, 1000, 0, false), Error);  // needs 1001 tokens
    EXPECT_NO_THROW(DataLoader(path_, 1, 999, 0, false));
    EXPECT_THROW(DataLoader(path_, 0, 8, 0, false), Error);
    EXPECT_THROW(DataLoader(path_, 1, 0, 0, false), Error);
    EXPECT_THROW(DataLoader((dir_ / "missing.bin").string(), 1, 8, 0, false), Error);
    DataLoader dl(path_, 2, 8, 0, true);
    EXPECT_THROW(dl.set_position({0, dl.num_windows() + 1}), Error);
    EXPECT_NO_THROW(dl.set_position({3, dl.num_windows()}));
}

}  // namespace
}  // namespace memtrain::data
