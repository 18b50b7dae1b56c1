// Single-process tests of src/dist: the shard layout helpers, LocalCommunicator (the world of
// one every non-MPI run uses), Mesh and the config check. Multi-rank tests are tests/dist_mpi.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "parallel/mesh.h"

namespace memtrain::dist {
namespace {

TEST(ShardRanges, EvenSplit) {
    const auto r = shard_ranges(12, 4);
    ASSERT_EQ(r.size(), 4u);
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(r[i].offset, 3 * i);
        EXPECT_EQ(r[i].count, 3);
    }
}

TEST(ShardRanges, UnevenSplitGivesTheFirstRanksOneMore) {
    const auto r = shard_ranges(10, 4);
    EXPECT_EQ(shard_counts(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
    EXPECT_EQ(r[2].offset, 6);
    EXPECT_EQ(r[3].offset + r[3].count, 10);
}

TEST(ShardRanges, FewerElementsThanRanksLeavesEmptyShards) {
    // Element by element: GCC 12.2 with -march=native (AVX-512) miscompiles the literal
    // std::vector<int64_t>{1, 1, 0, 0} into {1, 1, 1, 1} (one vpbroadcastq).
    const auto c = shard_counts(2, 4);
    ASSERT_EQ(c.size(), 4u);
    EXPECT_EQ(c[0], 1);
    EXPECT_EQ(c[1], 1);
    EXPECT_EQ(c[2], 0);
    EXPECT_EQ(c[3], 0);
    EXPECT_EQ(shard_counts(0, 3), (std::vector<int64_t>{0, 0, 0}));
    const auto r = shard_ranges(2, 4);
    EXPECT_EQ(r[3].offset, 2);  // empty shards sit at the end, offsets stay contiguous
}

TEST(ShardRanges, CoverEveryElementOnceForManySizes) {
    for (int world = 1; world <= 9; ++world) {
        for (int64_t total = 0; total <= 40; ++total) {
            const auto r = shard_ranges(total, world);
            int64_t next = 0, lo = total, hi = 0;
            for (const auto& s : r) {
                EXPECT_EQ(s.offset, next);
                next += s.count;
                lo = std::min(lo, s.count);
                hi = std::max(hi, s.count);
            }
            EXPECT_EQ(next, total);
            EXPECT_LE(hi - lo, 1);
            EXPECT_EQ(shard_offsets(shard_counts(total, world)).back(), r.back().offset);
        }
    }
}

TEST(ShardRanges, RejectsBadArguments) {
    EXPECT_THROW(shard_ranges(10, 0), Error);
    EXPECT_THROW(shard_ranges(-1, 2), Error);
}

TEST(LocalCommunicator, IsAWorldOfOne) {
    LocalCommunicator c;
    EXPECT_EQ(c.rank(), 0);
    EXPECT_EQ(c.size(), 1);
    EXPECT_EQ(c.local_rank(), 0);
    EXPECT_EQ(c.local_size(), 1);
}

TEST(LocalCommunicator, CollectivesAreIdentities) {
    LocalCommunicator c;
    std::vector<float> v = {1.5f, -2.0f, 3.25f};
    const auto before = v;
    c.all_reduce_sum(v.data(), 3);
    EXPECT_EQ(v, before);
    std::vector<double> d = {1.0, -4.0};
    c.all_reduce_max(d.data(), 2);
    EXPECT_EQ(d, (std::vector<double>{1.0, -4.0}));
    std::vector<int64_t> i = {7};
    c.all_reduce_max(i.data(), 1);
    EXPECT_EQ(i[0], 7);

    std::vector<int64_t> counts = {3};
    std::vector<float> out(3, 0.0f);
    c.reduce_scatter_sum(v.data(), out.data(), counts);
    EXPECT_EQ(out, v);
    std::vector<float> gathered(3, 0.0f);
    c.all_gather(v.data(), gathered.data(), counts);
    EXPECT_EQ(gathered, v);
    c.all_gather(gathered.data(), gathered.data(), counts);  // in place
    EXPECT_EQ(gathered, v);

    int64_t rec = 42, all = 0;
    c.all_gather_bytes(&rec, &all, sizeof rec);
    EXPECT_EQ(all, 42);
    c.broadcast(v.data(), 12, 0);
    EXPECT_EQ(v, before);
    c.barrier();
    EXPECT_FALSE(any_rank(c, false));
    EXPECT_TRUE(any_rank(c, true));
}

TEST(LocalCommunicator, StartedCollectivesCompleteAtOnce) {
    LocalCommunicator c;
    std::vector<float> v = {1.5f, -2.0f, 3.25f};
    std::vector<int64_t> counts = {3};
    std::vector<float> piece(3, 0.0f), gathered(3, 0.0f);
    const uint64_t a = c.start_all_reduce_sum(v.data(), 3);
    const uint64_t b = c.start_reduce_scatter_sum(v.data(), piece.data(), counts);
    const uint64_t g = c.start_all_gather(v.data(), gathered.data(), counts);
    // Id 0: already complete, before any wait.
    EXPECT_EQ(a, 0u);
    EXPECT_EQ(b, 0u);
    EXPECT_EQ(g, 0u);
    EXPECT_TRUE(c.test(b));
    EXPECT_EQ(piece, v);
    EXPECT_EQ(gathered, v);
    c.wait(g);
    c.progress();
    c.wait_all();
    std::vector<int64_t> two = {2, 2};
    EXPECT_THROW(c.start_reduce_scatter_sum(v.data(), piece.data(), two), Error);
}

TEST(LocalCommunicator, RejectsWhatAWorldOfOneCannotDo) {
    LocalCommunicator c;
    std::vector<float> v(4);
    std::vector<int64_t> two = {2, 2};
    EXPECT_THROW(c.reduce_scatter_sum(v.data(), v.data(), two), Error);
    EXPECT_THROW(c.all_gather(v.data(), v.data(), two), Error);
    std::vector<int64_t> negative = {-1};
    EXPECT_THROW(c.all_gather(v.data(), v.data(), negative), Error);
    EXPECT_THROW(c.broadcast(v.data(), 4, 1), Error);
    EXPECT_THROW(c.send(v.data(), 4, 1, 0), Error);
    EXPECT_THROW(c.recv(v.data(), 4, 1, 0), Error);
    EXPECT_THROW(c.all_reduce_sum(v.data(), -1), Error);
}

TEST(LocalCommunicatorDeathTest, AbortPrintsTheReasonAndExits) {
    LocalCommunicator c;
    EXPECT_EXIT(c.abort("out of memory"), testing::ExitedWithCode(1),
                "rank 0 of 1: aborting: out of memory");
}

TEST(Mesh, IsAValueOverThePassedCommunicator) {
    LocalCommunicator c;
    Mesh mesh(c);
    EXPECT_EQ(&mesh.world(), &c);
    EXPECT_EQ(&mesh.dp(), &c);
    EXPECT_EQ(mesh.dp_degree(), 1);
    EXPECT_EQ(mesh.dp_rank(), 0);
    EXPECT_TRUE(mesh.is_root());
}

// Pipelines of pp consecutive ranks: rank = d x pp + s; the stage group of pipeline d and the
// data group of stage s are the grid's row and column.
TEST(MeshLayout, PipelinesAreConsecutiveRanks) {
    const MeshLayout m{3, 2};
    EXPECT_EQ(m.size(), 6);
    EXPECT_EQ(m.rank(1, 2), 5);
    EXPECT_EQ(m.stage_of(4), 1);
    EXPECT_EQ(m.replica_of(4), 1);
    EXPECT_EQ(m.stage_group(1), (std::vector<int>{3, 4, 5}));
    EXPECT_EQ(m.data_group(2), (std::vector<int>{2, 5}));
    for (int r = 0; r < m.size(); r++) EXPECT_EQ(m.rank(m.replica_of(r), m.stage_of(r)), r);
}

TEST(MeshLayout, AWorldOfOneSplitsIntoItself) {
    LocalCommunicator c;
    MeshGroups g = split_mesh(c, MeshLayout{1, 1});
    EXPECT_EQ(g.stages->size(), 1);
    EXPECT_EQ(g.data->rank(), 0);
    float x = 2.5f;
    g.data->all_reduce_sum(&x, 1);
    EXPECT_EQ(x, 2.5f);
    EXPECT_THROW(split_mesh(c, MeshLayout{2, 1}), Error);  // two stages on one rank
}

TEST(CheckSameConfig, OneRankAlwaysAgrees) {
    LocalCommunicator c;
    EXPECT_NO_THROW(check_same_config(c, "lr = 3e-4"));
}

TEST(MpiOptions, TimeoutFromTheEnvironment) {
    ::unsetenv("MEMTRAIN_COMM_TIMEOUT_S");
    EXPECT_EQ(mpi_options_from_env().timeout_s, 300.0);
    ::setenv("MEMTRAIN_COMM_TIMEOUT_S", "2.5", 1);
    EXPECT_EQ(mpi_options_from_env().timeout_s, 2.5);
    for (const char* bad : {"0", "-3", "soon", "5s"}) {
        ::setenv("MEMTRAIN_COMM_TIMEOUT_S", bad, 1);
        try {
            mpi_options_from_env();
            ADD_FAILURE() << "accepted " << bad;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("MEMTRAIN_COMM_TIMEOUT_S"), std::string::npos);
        }
    }
    ::unsetenv("MEMTRAIN_COMM_TIMEOUT_S");
}

}  // namespace
}  // namespace memtrain::dist
