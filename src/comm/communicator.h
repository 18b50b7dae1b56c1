// dist::Communicator: the collectives every parallel technique is built from, with one shard
// layout for all of them, plus the helpers that run on top (shard_ranges, check_same_config).
// Backends: LocalCommunicator (world of one, here) and MpiCommunicator (mpi_communicator.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace memtrain::dist {

// Shard layout shared by reduce_scatter_sum, all_gather and (later) ZeRO: a buffer of `total`
// elements is cut into world contiguous pieces in rank order; rank r owns
// [offset_r, offset_r + count_r). Counts may differ between ranks and may be zero.
struct ShardRange {
    int64_t offset = 0;
    int64_t count = 0;
};

// The balanced layout: the first total % world ranks get one element more, so counts differ
// by at most one and a rank gets an empty shard only when total < world.
std::vector<ShardRange> shard_ranges(int64_t total, int world);
// shard_ranges of [begin, end) cut only on multiples of `grain` counted from 0 (not from begin),
// offsets counted from begin: balanced in cells of the grain, so counts differ by at most one
// cell. Block-quantized optimizer state (optim/state_format.h) keeps each block on one rank this
// way. grain 1 gives shard_ranges(end - begin, world).
std::vector<ShardRange> grain_shard_ranges(int64_t begin, int64_t end, int world, int64_t grain);
std::vector<int64_t> counts_of(std::span<const ShardRange> ranges);
// Just the counts of shard_ranges, the form the collectives take.
std::vector<int64_t> shard_counts(int64_t total, int world);
// Prefix sums of `counts`: the offset of each rank's shard.
std::vector<int64_t> shard_offsets(std::span<const int64_t> counts);
// The layout NCCL's collectives want (the GPU engine's ZeRO): every shard S long over a buffer
// padded to world x S, S = ceil(total / world) rounded up to a multiple of `grain` (so that
// block-quantized optimizer state keeps each block on one rank: optim/state_format.h's
// shard_grain); here clipped to [0, total), so the last shards may be shorter or empty.
int64_t padded_shard_size(int64_t total, int world, int64_t grain = 1);
std::vector<ShardRange> padded_shard_ranges(int64_t total, int world, int64_t grain = 1);
// Shards of S elements each over [0, total), clipped (padded_shard_ranges for a given S).
std::vector<ShardRange> equal_shard_ranges(int64_t total, int world, int64_t S);

// A piece of the flat buffer, [begin, end) (a ZeRO unit), cut along the shards: rank r's part
// of it is [offsets[r], offsets[r] + counts[r]) counted from `begin` (count 0, offset 0 where the
// shard misses the piece).
struct UnitPieces {
    std::vector<int64_t> offsets, counts;
};
UnitPieces unit_pieces(std::span<const ShardRange> shards, int64_t begin, int64_t end);

// A group of ranks and the operations they do together. Every collective must be called by
// every rank of the group, in the same order, with the same sizes (counts, n, root); a rank
// that does not arrive makes the others fail (MpiCommunicator: after its timeout) rather than
// hang. All calls but the start_ ones are blocking: on return the output is complete and input
// buffers are free. Buffers are host memory; n and counts are in elements.
class Communicator {
  public:
    virtual ~Communicator() = default;

    virtual int rank() const = 0;
    virtual int size() const = 0;
    // Rank among the processes of this node, and how many there are (for picking a device).
    virtual int local_rank() const = 0;
    virtual int local_size() const = 0;

    // In place: data[i] = sum over ranks of data[i]. Every rank receives the same bits, and the
    // same inputs on the same world size give the same bits on every run (the reduction order is
    // fixed by the backend's algorithm, not by timing).
    virtual void all_reduce_sum(float* data, int64_t n) = 0;
    // In place: data[i] = max over ranks (used to agree on errors, overflow flags, step counts).
    virtual void all_reduce_max(double* data, int64_t n) = 0;
    virtual void all_reduce_max(int64_t* data, int64_t n) = 0;

    // `in` is the full buffer (sum of counts elements) on every rank; `out` receives this rank's
    // shard of the element-wise sum: out[i] = sum over ranks of in[offset_rank + i], with
    // counts[rank] elements. `out` must not overlap `in`.
    virtual void reduce_scatter_sum(const float* in, float* out,
                                    std::span<const int64_t> counts) = 0;
    // `in` holds this rank's counts[rank] elements; `out` (sum of counts elements) receives every
    // rank's shard at its offset. `in` may be `out + offset_rank` (the shard already in place).
    virtual void all_gather(const float* in, float* out, std::span<const int64_t> counts) = 0;
    // Fixed-size records: `out` receives size() * bytes_per_rank bytes, rank r's at r * bytes.
    virtual void all_gather_bytes(const void* in, void* out, int64_t bytes_per_rank) = 0;

    // Nonblocking collectives: each starts the operation and returns at once with its id, so
    // the caller can compute while it travels (DDP overlaps a unit's gradient all-reduce with the
    // backward of the next units, ZeRO its reduce-scatters, ZeRO-3 prefetches the next unit's
    // parameters). The output (an all-reduce's data) must not be read or written, nor the input
    // written, until wait(id) or wait_all() returns. Started operations count as collectives in
    // call order like any other: every rank starts the same ones in the same order, and may
    // complete them in any order. Backends without nonblocking support (LocalCommunicator) run them
    // at once and return id 0, which is always complete (these defaults).
    virtual uint64_t start_all_reduce_sum(float* data, int64_t n) {
        all_reduce_sum(data, n);
        return 0;
    }
    virtual uint64_t start_reduce_scatter_sum(const float* in, float* out,
                                              std::span<const int64_t> counts) {
        reduce_scatter_sum(in, out, counts);
        return 0;
    }
    virtual uint64_t start_all_gather(const float* in, float* out,
                                      std::span<const int64_t> counts) {
        all_gather(in, out, counts);
        return 0;
    }
    // Lets started operations advance (MPI progresses nonblocking collectives only inside MPI
    // calls); cheap, call it between pieces of work.
    virtual void progress() {}
    // Never waits: lets every started operation advance and says whether `id` has completed.
    virtual bool test(uint64_t /*id*/) { return true; }
    // Completes `id` (with the backend's timeout); returns at once if it already has.
    virtual void wait(uint64_t /*id*/) {}
    // Completes every started operation (with the backend's timeout).
    virtual void wait_all() {}

    // Copies `bytes` bytes at `data` from rank `root` to every rank.
    virtual void broadcast(void* data, int64_t bytes, int root) = 0;

    // Point to point, blocking like MPI_Send/MPI_Recv: pair them so that a send never waits on a
    // peer that is itself sending to us (e.g. even ranks send first, odd ranks receive first).
    // recv fails if the message does not have exactly n elements.
    virtual void send(const float* data, int64_t n, int peer, int tag) = 0;
    virtual void recv(float* data, int64_t n, int peer, int tag) = 0;
    // A send that returns at once with an id for wait() (MPI_Isend): `data` must stay unchanged
    // until then. Lets a pipeline stage pass activations on while its neighbour sends gradients
    // back without the two blocking on each other. Default: the blocking send, id 0.
    virtual uint64_t start_send(const float* data, int64_t n, int peer, int tag) {
        send(data, n, peer, tag);
        return 0;
    }

    virtual void barrier() = 0;

    // Splits this group into sub-groups, as MPI_Comm_split: the ranks that pass the same
    // `color` form one group, ranked by `key` (ties by rank here). A collective of this group;
    // the result lives no longer than this communicator. `name` says which group it is (e.g.
    // "pipeline 1") in the lines a timeout or abort prints, which name the process by its rank
    // in the whole job, so a rank that dies or hangs is named the same way in every group.
    virtual std::unique_ptr<Communicator> split(int color, int key, std::string_view name) = 0;

    // For an error this rank cannot recover from while its peers may be waiting on it: prints
    // one line naming this rank and `reason` on stderr and ends every rank of the job now,
    // rather than leaving the others to reach their timeout (PEERS pain #20).
    [[noreturn]] virtual void abort(std::string_view reason) = 0;
};

// World of one process: collectives are identities (or copies), so single-process runs and
// tests go through the same code paths as distributed ones.
class LocalCommunicator final : public Communicator {
  public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    int local_rank() const override { return 0; }
    int local_size() const override { return 1; }
    void all_reduce_sum(float* data, int64_t n) override;
    void all_reduce_max(double* data, int64_t n) override;
    void all_reduce_max(int64_t* data, int64_t n) override;
    void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) override;
    void all_gather(const float* in, float* out, std::span<const int64_t> counts) override;
    void all_gather_bytes(const void* in, void* out, int64_t bytes_per_rank) override;
    void broadcast(void* data, int64_t bytes, int root) override;
    void send(const float* data, int64_t n, int peer, int tag) override;
    void recv(float* data, int64_t n, int peer, int tag) override;
    void barrier() override {}
    std::unique_ptr<Communicator> split(int color, int key, std::string_view name) override;
    [[noreturn]] void abort(std::string_view reason) override;
};

// The parallel layout of a run, built once at start-up and passed down by reference to whatever
// communicates; never stored in a global (STYLE lesson 9). Only data parallelism exists yet, so
// the data-parallel group is the whole world; tensor/pipeline groups will be added here.
class Mesh {
  public:
    explicit Mesh(Communicator& world) : world_(&world) {}
    Communicator& world() const { return *world_; }
    Communicator& dp() const { return *world_; }
    int dp_degree() const { return world_->size(); }
    int dp_rank() const { return world_->rank(); }
    // The rank that prints, logs and writes checkpoints.
    bool is_root() const { return world_->rank() == 0; }

  private:
    Communicator* world_;  // not owned; outlives the Mesh
};

// Checks every rank resolved the same configuration: all-gathers a 64-bit hash of each rank's
// `fingerprint` (e.g. the printed config table) and, if any differs from rank 0's, throws
// memtrain::Error on every rank naming the ranks that differ. A collective.
void check_same_config(Communicator& comm, std::string_view fingerprint);

// True on every rank if `local_failed` is true on any rank: lets ranks take the same branch
// (skip a step, stop) after a local error instead of desynchronising. A collective.
bool any_rank(Communicator& comm, bool local_failed);

// Checks counts has one non-negative entry per rank; names `op` in the error. For backends.
void check_counts(std::span<const int64_t> counts, int world, const char* op);

}  // namespace memtrain::dist
