// Multi-process tests of dist::MpiCommunicator, run under mpirun on 2 and 4 ranks: every
// collective against a serial reference computed on each rank, uneven and empty shards, config
// agreement, and the fail-fast scenarios (--scenario=rank1_skips|rank1_skips_started|rank1_exits|
// rank1_aborts|rank1_hangs_in_group).
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "core/rng.h"
#include "mpi/dist_env.h"
#include "parallel/mesh.h"

namespace memtrain::dist {
namespace {
MpiCommunicator* g_comm = nullptr;
}  // namespace

Communicator& comm() {
    return *g_comm;
}

namespace {

// Dyadic values with small magnitude: any summation order gives the exact same float, so the
// collectives can be compared bitwise with a serial reference whatever algorithm MPI picks.
float value(int rank, int64_t i) {
    return static_cast<float>((rank * 7 + i * 13) % 97 - 48) * 0.125f;
}

std::vector<float> rank_buffer(int rank, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(rank, i);
    return v;
}

// Layouts every shard test runs over: balanced, total < world (empty shards on 4 ranks), and
// hand-made uneven counts with rank 1 empty.
std::vector<std::vector<int64_t>> layouts(int world) {
    std::vector<int64_t> uneven;
    for (int r = 0; r < world; ++r) uneven.push_back(r == 1 ? 0 : 3 + 2 * r);
    return {shard_counts(1001, world), shard_counts(3, world), uneven};
}

int64_t sum(const std::vector<int64_t>& v) {
    int64_t s = 0;
    for (int64_t x : v) s += x;
    return s;
}

TEST(MpiComm, RanksAndLocalRanks) {
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    EXPECT_EQ(comm().size(), world_size);
    EXPECT_GE(comm().rank(), 0);
    EXPECT_LT(comm().rank(), comm().size());
    // CTest launches every rank on this machine.
    EXPECT_EQ(comm().local_size(), comm().size());
    EXPECT_EQ(comm().local_rank(), comm().rank());
    Mesh mesh(comm());
    EXPECT_EQ(mesh.dp_degree(), comm().size());
    EXPECT_EQ(mesh.is_root(), comm().rank() == 0);
}

TEST(MpiComm, StartedAllReducesCompleteInOrderBitwise) {
    // Three sums in flight at once, with compute (progress calls) between, then one wait.
    std::vector<std::vector<float>> bufs;
    for (int64_t n : {5000, 17, 70001}) bufs.push_back(rank_buffer(comm().rank(), n));
    for (auto& b : bufs) {
        comm().start_all_reduce_sum(b.data(), (int64_t)b.size());
        comm().progress();
    }
    comm().wait_all();
    for (auto& b : bufs) {
        std::vector<float> ref(b.size(), 0.0f);
        for (int r = 0; r < comm().size(); ++r)
            for (size_t i = 0; i < b.size(); ++i) ref[i] += value(r, (int64_t)i);
        EXPECT_EQ(std::memcmp(b.data(), ref.data(), b.size() * sizeof(float)), 0);
    }
}

TEST(MpiComm, AllReduceSumMatchesSerialBitwise) {
    const int64_t n = 4099;
    std::vector<float> data = rank_buffer(comm().rank(), n);
    comm().all_reduce_sum(data.data(), n);
    std::vector<float> ref(static_cast<size_t>(n), 0.0f);
    for (int r = 0; r < comm().size(); ++r) {
        for (int64_t i = 0; i < n; ++i) ref[static_cast<size_t>(i)] += value(r, i);
    }
    EXPECT_EQ(std::memcmp(data.data(), ref.data(), data.size() * sizeof(float)), 0);
}

TEST(MpiComm, AllReduceOfGradientsIsDeterministicAndAgreedByAllRanks) {
    // Gradient-like values (normal, mixed magnitudes): rounding depends on the summation order,
    // so this checks the order is fixed (repeat calls) and every rank ends with the same bits.
    const int64_t n = 100003;
    auto grads = [&](int rank) {
        Rng rng(1234 + static_cast<uint64_t>(rank));
        std::vector<float> g(static_cast<size_t>(n));
        for (auto& x : g) x = static_cast<float>(rng.normal() * 1e-3 * (1 + rank));
        return g;
    };
    std::vector<float> first = grads(comm().rank());
    comm().all_reduce_sum(first.data(), n);
    for (int repeat = 0; repeat < 3; ++repeat) {
        std::vector<float> again = grads(comm().rank());
        comm().all_reduce_sum(again.data(), n);
        ASSERT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)), 0)
            << "repeat " << repeat;
    }
    // Printed so separate runs can be compared too (same world size, same MPI: same hash).
    if (comm().rank() == 0) {
        uint64_t h = 14695981039346656037ull;
        for (float x : first) {
            uint32_t bits;
            std::memcpy(&bits, &x, 4);
            h = (h ^ bits) * 1099511628211ull;
        }
        std::printf("all_reduce_sum of %lld gradients on %d ranks: result hash %016llx\n",
                    static_cast<long long>(n), comm().size(), static_cast<unsigned long long>(h));
    }
    std::vector<float> root = first;
    comm().broadcast(root.data(), n * static_cast<int64_t>(sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(first.data(), root.data(), first.size() * sizeof(float)), 0);
    // And it is the sum, up to float rounding of a different order.
    std::vector<double> ref(static_cast<size_t>(n), 0.0);
    for (int r = 0; r < comm().size(); ++r) {
        std::vector<float> g = grads(r);
        for (size_t i = 0; i < g.size(); ++i) ref[i] += g[i];
    }
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(first[i], ref[i], 1e-8) << i;
}

TEST(MpiComm, AllReduceMax) {
    const int r = comm().rank();
    std::vector<double> d = {static_cast<double>(r), -static_cast<double>(r), r == 1 ? 7.5 : 0.0};
    comm().all_reduce_max(d.data(), 3);
    EXPECT_EQ(d, (std::vector<double>{comm().size() - 1.0, 0.0, 7.5}));
    std::vector<int64_t> i = {r, int64_t{1} << 40, -r};
    comm().all_reduce_max(i.data(), 3);
    EXPECT_EQ(i, (std::vector<int64_t>{comm().size() - 1, int64_t{1} << 40, 0}));
    EXPECT_FALSE(any_rank(comm(), false));
    EXPECT_TRUE(any_rank(comm(), r == comm().size() - 1));
}

TEST(MpiComm, ReduceScatterUnevenShards) {
    for (const auto& counts : layouts(comm().size())) {
        const int64_t total = sum(counts);
        const auto offsets = shard_offsets(counts);
        const size_t me = static_cast<size_t>(comm().rank());
        std::vector<float> in = rank_buffer(comm().rank(), total);
        std::vector<float> out(static_cast<size_t>(counts[me]) + 1, -1.0f);  // +1: a canary
        comm().reduce_scatter_sum(in.data(), out.data(), counts);
        for (int64_t i = 0; i < counts[me]; ++i) {
            float ref = 0.0f;
            for (int r = 0; r < comm().size(); ++r) ref += value(r, offsets[me] + i);
            ASSERT_EQ(out[static_cast<size_t>(i)], ref) << "total " << total << " i " << i;
        }
        EXPECT_EQ(out.back(), -1.0f) << "wrote past the shard";
    }
}

TEST(MpiComm, AllGatherUnevenShardsSeparateAndInPlace) {
    for (const auto& counts : layouts(comm().size())) {
        const int64_t total = sum(counts);
        const auto offsets = shard_offsets(counts);
        const size_t me = static_cast<size_t>(comm().rank());
        // Rank r's shard holds value(r, offset_r + i), so the gathered buffer is known.
        std::vector<float> ref(static_cast<size_t>(total));
        for (int r = 0; r < comm().size(); ++r) {
            for (int64_t i = 0; i < counts[static_cast<size_t>(r)]; ++i) {
                const int64_t j = offsets[static_cast<size_t>(r)] + i;
                ref[static_cast<size_t>(j)] = value(r, j);
            }
        }
        std::vector<float> shard(ref.begin() + offsets[me], ref.begin() + offsets[me] + counts[me]);
        std::vector<float> out(static_cast<size_t>(total), -1.0f);
        comm().all_gather(shard.data(), out.data(), counts);
        EXPECT_EQ(out, ref) << "total " << total;

        std::vector<float> in_place(static_cast<size_t>(total), -1.0f);
        std::copy(shard.begin(), shard.end(), in_place.begin() + offsets[me]);
        comm().all_gather(in_place.data() + offsets[me], in_place.data(), counts);
        EXPECT_EQ(in_place, ref) << "in place, total " << total;
    }
}

TEST(MpiComm, StartedReduceScattersAndGathersCompleteInAnyOrder) {
    // What ZeRO does: several reduce-scatters and all-gathers in flight at once, with work
    // between them, completed in another order than started (the gathers first).
    const size_t me = static_cast<size_t>(comm().rank());
    struct Rs {
        std::vector<int64_t> counts;
        std::vector<float> in, out;
        uint64_t id;
    };
    struct Ag {
        std::vector<int64_t> counts;
        std::vector<float> shard, out, ref;
        uint64_t id;
    };
    std::vector<Rs> rs;
    std::vector<Ag> ag;
    for (const auto& counts : layouts(comm().size())) {
        rs.push_back({counts, rank_buffer(comm().rank(), sum(counts)),
                      std::vector<float>(static_cast<size_t>(counts[me]) + 1, -1.0f), 0});
        const auto offsets = shard_offsets(counts);
        Ag a{counts, {}, std::vector<float>(static_cast<size_t>(sum(counts)), -1.0f), {}, 0};
        a.ref.resize(a.out.size());
        for (int r = 0; r < comm().size(); ++r)
            for (int64_t i = 0; i < counts[static_cast<size_t>(r)]; ++i) {
                const int64_t j = offsets[static_cast<size_t>(r)] + i;
                a.ref[static_cast<size_t>(j)] = value(r, j);
            }
        a.shard.assign(a.ref.begin() + offsets[me], a.ref.begin() + offsets[me] + counts[me]);
        ag.push_back(std::move(a));
    }
    for (size_t k = 0; k < rs.size(); ++k) {
        rs[k].id = comm().start_reduce_scatter_sum(rs[k].in.data(), rs[k].out.data(), rs[k].counts);
        ag[k].id = comm().start_all_gather(ag[k].shard.data(), ag[k].out.data(), ag[k].counts);
        EXPECT_NE(rs[k].id, ag[k].id);
        comm().progress();
    }
    for (auto& a : ag) {
        comm().wait(a.id);
        EXPECT_TRUE(comm().test(a.id));
        EXPECT_EQ(a.out, a.ref);
    }
    for (auto& r : rs) {
        comm().wait(r.id);
        const auto offsets = shard_offsets(r.counts);
        for (int64_t i = 0; i < r.counts[me]; ++i) {
            float ref = 0.0f;
            for (int q = 0; q < comm().size(); ++q) ref += value(q, offsets[me] + i);
            ASSERT_EQ(r.out[static_cast<size_t>(i)], ref) << "i " << i;
        }
        EXPECT_EQ(r.out.back(), -1.0f) << "wrote past the shard";
    }
    comm().wait_all();  // nothing left: returns at once
    // test() completes an operation without waiting for it, once it has arrived.
    std::vector<float> v = rank_buffer(comm().rank(), 4096);
    const uint64_t id = comm().start_all_reduce_sum(v.data(), 4096);
    while (!comm().test(id)) std::this_thread::yield();
    std::vector<float> ref(4096, 0.0f);
    for (int r = 0; r < comm().size(); ++r)
        for (int64_t i = 0; i < 4096; ++i) ref[static_cast<size_t>(i)] += value(r, i);
    EXPECT_EQ(v, ref);
}

TEST(MpiComm, AllGatherBytes) {
    struct Record {
        int32_t rank;
        float loss;
    };
    Record mine{comm().rank(), 0.5f * static_cast<float>(comm().rank())};
    std::vector<Record> all(static_cast<size_t>(comm().size()));
    comm().all_gather_bytes(&mine, all.data(), sizeof(Record));
    for (int r = 0; r < comm().size(); ++r) {
        EXPECT_EQ(all[static_cast<size_t>(r)].rank, r);
        EXPECT_EQ(all[static_cast<size_t>(r)].loss, 0.5f * static_cast<float>(r));
    }
}

TEST(MpiComm, BroadcastFromEveryRoot) {
    for (int root = 0; root < comm().size(); ++root) {
        std::vector<float> v = rank_buffer(comm().rank(), 257);
        comm().broadcast(v.data(), 257 * sizeof(float), root);
        EXPECT_EQ(v, rank_buffer(root, 257)) << "root " << root;
    }
    EXPECT_THROW(comm().broadcast(nullptr, 0, comm().size()), Error);
}

TEST(MpiComm, SendRecvRing) {
    const int r = comm().rank(), n = comm().size();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<float> out = rank_buffer(r, 5000), in(5000, 0.0f);
    // Even ranks send first and odd ranks receive first, so no two blocking sends face each
    // other (the world sizes tested are even).
    if (r % 2 == 0) {
        comm().send(out.data(), 5000, next, 7);
        comm().recv(in.data(), 5000, prev, 7);
    } else {
        comm().recv(in.data(), 5000, prev, 7);
        comm().send(out.data(), 5000, next, 7);
    }
    EXPECT_EQ(in, rank_buffer(prev, 5000));
}

TEST(MpiComm, RecvOfTheWrongLengthFails) {
    std::vector<float> buf(4, 1.0f);
    if (comm().rank() == 0) {
        comm().send(buf.data(), 2, 1, 9);
    } else if (comm().rank() == 1) {
        try {
            comm().recv(buf.data(), 4, 0, 9);
            ADD_FAILURE() << "expected a length error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("expected 4 elements, got 2"), std::string::npos)
                << e.what();
        }
    }
    comm().barrier();
}

TEST(MpiComm, CheckSameConfigPassesWhenEqual) {
    EXPECT_NO_THROW(check_same_config(comm(), "n_layer=12\nlr=3e-4\n"));
}

TEST(MpiComm, CheckSameConfigNamesTheDifferingRank) {
    const int odd = comm().size() - 1;
    const std::string cfg =
        comm().rank() == odd ? "n_layer=12\nlr=1e-3\n" : "n_layer=12\nlr=3e-4\n";
    // Every rank must fail, not only the odd one, or the others would run on into a hang.
    try {
        check_same_config(comm(), cfg);
        ADD_FAILURE() << "expected a config mismatch on rank " << comm().rank();
    } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("config differs across ranks"), std::string::npos) << msg;
        EXPECT_NE(msg.find("ranks " + std::to_string(odd) + " "), std::string::npos) << msg;
    }
}

TEST(MpiComm, BadCountsFailOnEveryRankBeforeCommunicating) {
    std::vector<float> buf(8);
    std::vector<int64_t> too_few = {8};
    EXPECT_THROW(comm().all_gather(buf.data(), buf.data(), too_few), Error);
    std::vector<int64_t> negative(static_cast<size_t>(comm().size()), 1);
    negative.back() = -1;
    EXPECT_THROW(comm().reduce_scatter_sum(buf.data(), buf.data() + 4, negative), Error);
    EXPECT_THROW(comm().start_reduce_scatter_sum(buf.data(), buf.data() + 4, negative), Error);
    EXPECT_THROW(comm().start_all_gather(buf.data(), buf.data(), too_few), Error);
}

// Rank 1 misses the second collective and stays alive (a stuck or diverged rank: a dead one is
// caught by mpirun itself). The other ranks must print the timeout line and abort the job.
int run_rank1_skips(Communicator& c) {
    std::vector<float> v(1024, 1.0f);
    c.all_reduce_sum(v.data(), 1024);  // collective #1: everyone
    if (c.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::seconds(30));
        return 0;
    }
    c.all_reduce_sum(v.data(), 1024);  // collective #2: rank 1 never arrives
    std::fprintf(stderr, "rank %d: collective #2 completed without rank 1\n", c.rank());
    return 1;
}

// As rank1_skips, with the collective rank 1 misses started nonblocking (as ZeRO's reduce-scatters
// and prefetches are): the deadline applies when the others wait for it.
int run_rank1_skips_started(Communicator& c) {
    std::vector<float> v(1024, 1.0f);
    std::vector<float> piece(1024, 0.0f);
    const std::vector<int64_t> counts = shard_counts(1024, c.size());
    c.all_reduce_sum(v.data(), 1024);  // collective #1: everyone
    if (c.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::seconds(30));
        return 0;
    }
    const uint64_t id = c.start_reduce_scatter_sum(v.data(), piece.data(), counts);  // #2
    c.progress();
    c.wait(id);
    std::fprintf(stderr, "rank %d: collective #2 completed without rank 1\n", c.rank());
    return 1;
}

// Rank 1 hangs inside a sub-group: the mesh of pp 2 x dp 2 (np 4), rank 1 (stage 1 of pipeline 0)
// skips its data group's second collective. Rank 3, its partner there, must print the timeout
// line naming itself by its job rank with the group, and end the job; ranks 0 and 2 wait longer
// than the timeout outside any collective, so the line comes from rank 3.
int run_rank1_hangs_in_group(Communicator& c) {
    MeshGroups g = split_mesh(c, MeshLayout{2, c.size() / 2});
    std::vector<float> v(1024, 1.0f);
    g.data->all_reduce_sum(v.data(), 1024);  // the data group's collective #1: everyone
    if (c.rank() != 3) {
        std::this_thread::sleep_for(std::chrono::seconds(30));
        return 0;
    }
    g.data->all_reduce_sum(v.data(), 1024);  // #2: rank 1 never arrives
    std::fprintf(stderr, "rank %d: collective #2 completed without rank 1\n", c.rank());
    return 1;
}

// Rank 1 exits without finalising (a crash) while the others wait in a collective: mpirun
// notices the exit and ends the job, well before the communicator's timeout.
int run_rank1_exits(Communicator& c) {
    std::vector<float> v(1024, 1.0f);
    c.all_reduce_sum(v.data(), 1024);
    if (c.rank() == 1) std::_Exit(0);
    c.all_reduce_sum(v.data(), 1024);
    std::fprintf(stderr, "rank %d: collective #2 completed without rank 1\n", c.rank());
    return 1;
}

// Rank 1 hits an unrecoverable error (say, out of memory) and aborts the job on purpose, so the
// others stop at once instead of waiting for their timeout.
int run_rank1_aborts(Communicator& c) {
    std::vector<float> v(1024, 1.0f);
    c.all_reduce_sum(v.data(), 1024);
    if (c.rank() == 1) c.abort("out of memory: activations grew past the budget");
    c.all_reduce_sum(v.data(), 1024);
    std::fprintf(stderr, "rank %d: collective #2 completed without rank 1\n", c.rank());
    return 1;
}

// On ranks other than 0, print only failures, prefixed by the rank, so the log stays readable.
class RankFailurePrinter : public testing::EmptyTestEventListener {
  public:
    explicit RankFailurePrinter(int rank) : rank_(rank) {}
    void OnTestPartResult(const testing::TestPartResult& r) override {
        if (r.failed()) {
            std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                         r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
        }
    }

  private:
    int rank_;
};

}  // namespace
}  // namespace memtrain::dist

int main(int argc, char** argv) {
    using namespace memtrain::dist;
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int status = 0;
    {
        MpiCommunicator comm(mpi_options_from_env());
        g_comm = &comm;
        const std::string scenario = argc > 1 ? argv[1] : "";
        if (scenario == "--scenario=rank1_skips") {
            status = run_rank1_skips(comm);
        } else if (scenario == "--scenario=rank1_skips_started") {
            status = run_rank1_skips_started(comm);
        } else if (scenario == "--scenario=rank1_exits") {
            status = run_rank1_exits(comm);
        } else if (scenario == "--scenario=rank1_aborts") {
            status = run_rank1_aborts(comm);
        } else if (scenario == "--scenario=rank1_dies_in_training") {
            status = run_rank1_dies_in_training(comm);
        } else if (scenario == "--scenario=rank1_hangs_in_group") {
            status = run_rank1_hangs_in_group(comm);
        } else {
            testing::InitGoogleTest(&argc, argv);
            if (comm.rank() != 0) {
                auto& listeners = testing::UnitTest::GetInstance()->listeners();
                delete listeners.Release(listeners.default_result_printer());
                listeners.Append(new RankFailurePrinter(comm.rank()));
            }
            status = RUN_ALL_TESTS();
        }
        g_comm = nullptr;
    }
    MPI_Finalize();
    return status;
}
