// MpiCommunicator: each operation starts a nonblocking MPI call and polls it against a deadline,
// because a blocking MPI call on a dead or diverged peer waits forever (PEERS pains #19, #20).
// On timeout the rank prints one line naming itself and the stalled operation, then MPI_Abort.
#include "comm/mpi_communicator.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/phase_clock.h"

namespace memtrain::dist {

bool launched_by_mpi() {
    if (const char* force = std::getenv("MEMTRAIN_DIST"); force != nullptr && *force) {
        const std::string v = force;
        if (v == "none") return false;
        if (v == "mpi") return true;
        fail("MEMTRAIN_DIST: expected 'mpi' or 'none', got '{}'", v);
    }
    for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                            "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE"})
        if (const char* v = std::getenv(var); v != nullptr && *v) return true;
    return false;
}

MpiOptions mpi_options_from_env() {
    MpiOptions options;
    if (const char* env = std::getenv("MEMTRAIN_COMM_TIMEOUT_S"); env != nullptr && *env) {
        char* end = nullptr;
        const double v = std::strtod(env, &end);
        if (end == env || *end != '\0' || !(v > 0.0)) {
            fail("MEMTRAIN_COMM_TIMEOUT_S: expected a positive number of seconds, got '{}'", env);
        }
        options.timeout_s = v;
    }
    return options;
}

struct MpiCommunicator::State {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Comm local = MPI_COMM_NULL;
    int rank = 0;
    int size = 1;
    int local_rank = 0;
    int local_size = 1;
    bool owns_mpi = false;
    double timeout_s = 300.0;
    std::string host;
    // The process in the whole job, for every line this rank prints: a sub-group (split) names
    // itself and this rank's place in it beside the job's rank, and its peers by their job rank.
    int world_rank = 0;
    int world_size = 1;
    std::string group;          // empty for the whole job
    std::vector<int> world_of;  // group rank -> job rank (empty for the whole job)
    // Collectives are numbered in call order, which is the same on every rank, so the timeout
    // lines of different ranks can be matched; point-to-point calls have their own count.
    uint64_t collective_seq = 0;
    uint64_t p2p_seq = 0;
    // Started nonblocking collectives, in start order. MPI may read the count and displacement
    // arrays until the operation completes, so each keeps its own (a vector's storage does not
    // move when the vector does).
    struct Started {
        uint64_t id = 0;
        MPI_Request request = MPI_REQUEST_NULL;
        const char* op = "";  // for the timeout line, with n and seq
        int64_t n = 0;
        uint64_t seq = 0;
        bool p2p = false;  // a started send (a pipeline's): its wait is point-to-point time
        std::vector<int> counts, displs;
    };
    std::vector<Started> pending;
    uint64_t next_id = 1;  // 0 means "already complete"
};

namespace {

// "HOST" for the whole job, "HOST, rank R of N in GROUP" for a sub-group: the parenthesis of
// every line naming this rank.
std::string where(const MpiCommunicator::State& s) {
    if (s.group.empty()) return s.host;
    return fmt::format("{}, rank {} of {} in {}", s.host, s.rank, s.size, s.group);
}

int job_rank(const MpiCommunicator::State& s, int peer) {
    return s.world_of.empty() || peer < 0 || peer >= (int)s.world_of.size() ? peer
                                                                            : s.world_of[peer];
}

void check(int rc, int rank, const char* op) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(rc, text, &len);
    fail("MPI error in {} on rank {}: {}", op, rank, std::string(text, static_cast<size_t>(len)));
}

int to_int(int64_t n, const char* op, const char* what) {
    if (n < 0) fail("{}: {} must be >= 0, got {}", op, what, n);
    if (n > INT_MAX) {
        fail("{}: {} is {}, above MPI's limit of {} per call; split the buffer", op, what, n,
             INT_MAX);
    }
    return static_cast<int>(n);
}

}  // namespace

MpiCommunicator::MpiCommunicator(MpiOptions options) : state_(std::make_unique<State>()) {
    if (!(options.timeout_s > 0.0)) fail("MpiCommunicator: timeout_s must be > 0");
    State& s = *state_;
    s.timeout_s = options.timeout_s;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) fail("MpiCommunicator: MPI was already finalised in this process");
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
        if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
            fail("MpiCommunicator: MPI_Init_thread failed");
        }
        s.owns_mpi = true;
    } else {
        MPI_Query_thread(&provided);
    }
    // OpenMP threads exist alongside MPI, so MPI must at least allow them (FUNNELED).
    if (provided < MPI_THREAD_FUNNELED) {
        fail("MpiCommunicator: MPI provides thread level {}, memtrain needs MPI_THREAD_FUNNELED",
             provided);
    }
    check(MPI_Comm_dup(MPI_COMM_WORLD, &s.comm), 0, "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN), 0, "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(s.comm, &s.rank), 0, "MPI_Comm_rank");
    check(MPI_Comm_size(s.comm, &s.size), s.rank, "MPI_Comm_size");
    check(MPI_Comm_split_type(s.comm, MPI_COMM_TYPE_SHARED, s.rank, MPI_INFO_NULL, &s.local),
          s.rank, "MPI_Comm_split_type");
    check(MPI_Comm_rank(s.local, &s.local_rank), s.rank, "MPI_Comm_rank");
    check(MPI_Comm_size(s.local, &s.local_size), s.rank, "MPI_Comm_size");
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    MPI_Get_processor_name(name, &len);
    s.host.assign(name, static_cast<size_t>(len));
    s.world_rank = s.rank;
    s.world_size = s.size;
}

MpiCommunicator::MpiCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, std::string_view name) {
    State& s = *state_;
    if (color < 0) fail("split: color {} must be >= 0", color);
    auto sub = std::make_unique<State>();
    sub->timeout_s = s.timeout_s;
    sub->host = s.host;
    sub->world_rank = s.world_rank;
    sub->world_size = s.world_size;
    sub->local_rank = s.local_rank;  // the node's processes, for picking a device
    sub->local_size = s.local_size;
    sub->group = s.group.empty() ? std::string(name) : fmt::format("{} of {}", name, s.group);
    // MPI_Comm_split blocks; a barrier with the deadline first, so a rank that never arrives is
    // named rather than waited on forever.
    barrier();
    check(MPI_Comm_split(s.comm, color, key, &sub->comm), s.rank, "MPI_Comm_split");
    check(MPI_Comm_set_errhandler(sub->comm, MPI_ERRORS_RETURN), s.rank, "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(sub->comm, &sub->rank), s.rank, "MPI_Comm_rank");
    check(MPI_Comm_size(sub->comm, &sub->size), s.rank, "MPI_Comm_size");
    // Group rank -> job rank, from the groups (a local computation).
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    check(MPI_Comm_group(sub->comm, &mine), s.rank, "MPI_Comm_group");
    check(MPI_Comm_group(MPI_COMM_WORLD, &world), s.rank, "MPI_Comm_group");
    std::vector<int> ranks(static_cast<size_t>(sub->size));
    for (int r = 0; r < sub->size; ++r) ranks[static_cast<size_t>(r)] = r;
    sub->world_of.resize(ranks.size());
    check(MPI_Group_translate_ranks(mine, sub->size, ranks.data(), world, sub->world_of.data()),
          s.rank, "MPI_Group_translate_ranks");
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return std::unique_ptr<Communicator>(new MpiCommunicator(std::move(sub)));
}

MpiCommunicator::~MpiCommunicator() {
    State& s = *state_;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (s.local != MPI_COMM_NULL) MPI_Comm_free(&s.local);
    if (s.comm != MPI_COMM_NULL) MPI_Comm_free(&s.comm);
    if (s.owns_mpi) MPI_Finalize();
}

int MpiCommunicator::rank() const {
    return state_->rank;
}
int MpiCommunicator::size() const {
    return state_->size;
}
int MpiCommunicator::local_rank() const {
    return state_->local_rank;
}
int MpiCommunicator::local_size() const {
    return state_->local_size;
}
double MpiCommunicator::timeout_s() const {
    return state_->timeout_s;
}

namespace {

// Polls `request` until it completes or the deadline passes. MPI progresses nonblocking
// collectives only inside MPI calls, so the loop keeps calling MPI_Test: it yields for the first
// milliseconds (fast collectives) and then sleeps briefly so a waiting rank does not steal the
// core of an oversubscribed peer that has not arrived yet.
// `seq` is the operation's number for the timeout line: 0 takes the next one, a started
// collective passes the number it got when it started.
void wait_request(MpiCommunicator::State& s, MPI_Request& request, const char* op, int64_t n,
                  const char* unit, int peer, MPI_Status* status, uint64_t seq = 0,
                  bool started_p2p = false) {
    using clock = std::chrono::steady_clock;
    const bool collective = peer < 0;
    // (A started send waits here under a collective's number, but as point-to-point time.)
    const ScopedPhase phase(!collective || started_p2p ? Phase::p2p : Phase::comm);
    if (seq == 0) seq = collective ? ++s.collective_seq : ++s.p2p_seq;
    const auto start = clock::now();
    for (;;) {
        int done = 0;
        check(MPI_Test(&request, &done, status != nullptr ? status : MPI_STATUS_IGNORE), s.rank,
              op);
        if (done) return;
        const double elapsed = std::chrono::duration<double>(clock::now() - start).count();
        if (elapsed > s.timeout_s) {
            const std::string what =
                collective ? fmt::format("collective #{}", seq)
                           : fmt::format("point-to-point #{} with rank {}", seq, job_rank(s, peer));
            std::fprintf(stderr,
                         "memtrain: rank %d of %d (%s): timed out after %.1f s in %s (%s, %lld "
                         "%s): a peer rank died, stalled or skipped this call; aborting "
                         "every rank (MEMTRAIN_COMM_TIMEOUT_S=%g)\n",
                         s.world_rank, s.world_size, where(s).c_str(), elapsed, op, what.c_str(),
                         static_cast<long long>(n), unit, s.timeout_s);
            std::fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 3);
            std::_Exit(3);  // MPI_Abort does not return; this is for a broken MPI only
        }
        if (elapsed < 0.002) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }
}

}  // namespace

namespace {

// Registers a started collective; it takes the next collective number now, in start order, which
// is the same on every rank.
uint64_t add_started(MpiCommunicator::State& s, MPI_Request request, const char* op, int64_t n,
                     std::vector<int> counts = {}, std::vector<int> displs = {}) {
    MpiCommunicator::State::Started st;
    st.id = s.next_id++;
    st.request = request;
    st.op = op;
    st.n = n;
    st.seq = ++s.collective_seq;
    st.counts = std::move(counts);
    st.displs = std::move(displs);
    s.pending.push_back(std::move(st));
    return s.pending.back().id;
}

// Waits for one started collective and forgets it. The timeout clock starts here, not at the
// start: a started collective may legitimately wait behind a whole backward pass.
void finish_started(MpiCommunicator::State& s, std::size_t i) {
    auto& st = s.pending[i];
    if (st.request != MPI_REQUEST_NULL)
        wait_request(s, st.request, st.op, st.n, "floats", -1, nullptr, st.seq, st.p2p);
    s.pending.erase(s.pending.begin() + static_cast<std::ptrdiff_t>(i));
}

// Starts MPI_Iallreduce in place and registers it as `op` (the blocking call waits at once).
// Point to point needs another rank of the world as the peer.
void check_peer(const MpiCommunicator::State& s, int peer, const char* op) {
    if (peer < 0 || peer >= s.size || peer == s.rank)
        fail("{}: peer {} is not another rank of a world of size {}", op, peer, s.size);
}

// Posts a nonblocking send of n floats (send waits for it, start_send hands it to wait()).
MPI_Request post_send(MpiCommunicator::State& s, const float* data, int64_t n, int peer, int tag,
                      const char* op) {
    const int count = to_int(n, "send", "n");
    check_peer(s, peer, "send");
    MPI_Request req;
    check(MPI_Isend(data, count, MPI_FLOAT, peer, tag, s.comm, &req), s.rank, op);
    return req;
}

uint64_t start_all_reduce(MpiCommunicator::State& s, float* data, int64_t n, const char* op) {
    const int count = to_int(n, "all_reduce_sum", "n");
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, s.comm, &req), s.rank,
          "all_reduce_sum");
    return add_started(s, req, op, n);
}

}  // namespace

void MpiCommunicator::all_reduce_sum(float* data, int64_t n) {
    wait(start_all_reduce(*state_, data, n, "all_reduce_sum"));
}

uint64_t MpiCommunicator::start_all_reduce_sum(float* data, int64_t n) {
    return start_all_reduce(*state_, data, n, "all_reduce_sum (started)");
}

void MpiCommunicator::progress() {
    State& s = *state_;
    // Completed requests become MPI_REQUEST_NULL; their entries go now, so the list stays short.
    for (auto& st : s.pending) {
        if (st.request == MPI_REQUEST_NULL) continue;
        int done = 0;
        check(MPI_Test(&st.request, &done, MPI_STATUS_IGNORE), s.rank, st.op);
    }
    std::erase_if(s.pending,
                  [](const State::Started& st) { return st.request == MPI_REQUEST_NULL; });
}

bool MpiCommunicator::test(uint64_t id) {
    progress();
    const State& s = *state_;
    for (const auto& st : s.pending)
        if (st.id == id) return false;
    return true;
}

void MpiCommunicator::wait(uint64_t id) {
    State& s = *state_;
    for (std::size_t i = 0; i < s.pending.size(); ++i) {
        if (s.pending[i].id == id) {
            finish_started(s, i);
            return;
        }
    }
}

void MpiCommunicator::wait_all() {
    State& s = *state_;
    while (!s.pending.empty()) finish_started(s, 0);
}

void MpiCommunicator::all_reduce_max(double* data, int64_t n) {
    State& s = *state_;
    const int count = to_int(n, "all_reduce_max", "n");
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count, MPI_DOUBLE, MPI_MAX, s.comm, &req), s.rank,
          "all_reduce_max");
    wait_request(s, req, "all_reduce_max", n, "values", -1, nullptr);
}

void MpiCommunicator::all_reduce_max(int64_t* data, int64_t n) {
    State& s = *state_;
    const int count = to_int(n, "all_reduce_max", "n");
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count, MPI_INT64_T, MPI_MAX, s.comm, &req), s.rank,
          "all_reduce_max");
    wait_request(s, req, "all_reduce_max", n, "values", -1, nullptr);
}

namespace {

// Shard counts and offsets as MPI's int arrays; the whole buffer must fit an int displacement.
void int_layout(std::span<const int64_t> counts, int world, const char* op, std::vector<int>& c,
                std::vector<int>& displs, int64_t& total) {
    check_counts(counts, world, op);
    c.resize(counts.size());
    displs.resize(counts.size());
    total = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
        c[r] = to_int(counts[r], op, "a shard count");
        displs[r] = to_int(total, op, "a shard offset");
        total += counts[r];
    }
    to_int(total, op, "the total element count");
}

}  // namespace

namespace {

// Starts MPI_Ireduce_scatter (the checks of reduce_scatter_sum) and registers it as `op`: the
// blocking call waits for it at once, the started one later.
uint64_t start_reduce_scatter(MpiCommunicator::State& s, const float* in, float* out,
                              std::span<const int64_t> counts, const char* op) {
    std::vector<int> c, displs;
    int64_t total = 0;
    int_layout(counts, s.size, "reduce_scatter_sum", c, displs, total);
    const int64_t mine = counts[static_cast<size_t>(s.rank)];
    if (mine > 0 && out < in + total && in < out + mine) {
        fail("reduce_scatter_sum: the output shard overlaps the input buffer");
    }
    MPI_Request req;
    check(MPI_Ireduce_scatter(in, out, c.data(), MPI_FLOAT, MPI_SUM, s.comm, &req), s.rank,
          "reduce_scatter_sum");
    return add_started(s, req, op, total, std::move(c));
}

// Starts MPI_Iallgatherv (the checks of all_gather) and registers it as `op`, likewise.
uint64_t start_all_gatherv(MpiCommunicator::State& s, const float* in, float* out,
                           std::span<const int64_t> counts, const char* op) {
    std::vector<int> c, displs;
    int64_t total = 0;
    int_layout(counts, s.size, "all_gather", c, displs, total);
    const size_t r = static_cast<size_t>(s.rank);
    // The shard already sitting at its place in `out` is MPI_IN_PLACE (ZeRO's usual case).
    const void* send = (in == out + displs[r]) ? MPI_IN_PLACE : static_cast<const void*>(in);
    MPI_Request req;
    check(MPI_Iallgatherv(send, c[r], MPI_FLOAT, out, c.data(), displs.data(), MPI_FLOAT, s.comm,
                          &req),
          s.rank, "all_gather");
    return add_started(s, req, op, total, std::move(c), std::move(displs));
}

}  // namespace

void MpiCommunicator::reduce_scatter_sum(const float* in, float* out,
                                         std::span<const int64_t> counts) {
    wait(start_reduce_scatter(*state_, in, out, counts, "reduce_scatter_sum"));
}

uint64_t MpiCommunicator::start_reduce_scatter_sum(const float* in, float* out,
                                                   std::span<const int64_t> counts) {
    return start_reduce_scatter(*state_, in, out, counts, "reduce_scatter_sum (started)");
}

void MpiCommunicator::all_gather(const float* in, float* out, std::span<const int64_t> counts) {
    wait(start_all_gatherv(*state_, in, out, counts, "all_gather"));
}

uint64_t MpiCommunicator::start_all_gather(const float* in, float* out,
                                           std::span<const int64_t> counts) {
    return start_all_gatherv(*state_, in, out, counts, "all_gather (started)");
}

void MpiCommunicator::all_gather_bytes(const void* in, void* out, int64_t bytes_per_rank) {
    State& s = *state_;
    const int count = to_int(bytes_per_rank, "all_gather_bytes", "bytes_per_rank");
    to_int(bytes_per_rank * s.size, "all_gather_bytes", "the total byte count");
    MPI_Request req;
    check(MPI_Iallgather(in, count, MPI_BYTE, out, count, MPI_BYTE, s.comm, &req), s.rank,
          "all_gather_bytes");
    wait_request(s, req, "all_gather_bytes", bytes_per_rank * s.size, "bytes", -1, nullptr);
}

void MpiCommunicator::broadcast(void* data, int64_t bytes, int root) {
    State& s = *state_;
    const int count = to_int(bytes, "broadcast", "bytes");
    if (root < 0 || root >= s.size) {
        fail("broadcast: root {} is not a rank of a world of size {}", root, s.size);
    }
    MPI_Request req;
    check(MPI_Ibcast(data, count, MPI_BYTE, root, s.comm, &req), s.rank, "broadcast");
    wait_request(s, req, "broadcast", bytes, "bytes", -1, nullptr);
}

void MpiCommunicator::send(const float* data, int64_t n, int peer, int tag) {
    State& s = *state_;
    MPI_Request req = post_send(s, data, n, peer, tag, "send");
    wait_request(s, req, "send", n, "floats", peer, nullptr);
}

uint64_t MpiCommunicator::start_send(const float* data, int64_t n, int peer, int tag) {
    State& s = *state_;
    MPI_Request req = post_send(s, data, n, peer, tag, "send (started)");
    const uint64_t id = add_started(s, req, "send (started)", n);
    s.pending.back().p2p = true;
    return id;
}

void MpiCommunicator::recv(float* data, int64_t n, int peer, int tag) {
    State& s = *state_;
    const int count = to_int(n, "recv", "n");
    check_peer(s, peer, "recv");
    MPI_Request req;
    MPI_Status status;
    check(MPI_Irecv(data, count, MPI_FLOAT, peer, tag, s.comm, &req), s.rank, "recv");
    wait_request(s, req, "recv", n, "floats", peer, &status);
    int got = 0;
    MPI_Get_count(&status, MPI_FLOAT, &got);
    if (got != count) {
        fail("recv from rank {} (tag {}): expected {} elements, got {}", peer, tag, n, got);
    }
}

void MpiCommunicator::barrier() {
    State& s = *state_;
    MPI_Request req;
    check(MPI_Ibarrier(s.comm, &req), s.rank, "barrier");
    wait_request(s, req, "barrier", 0, "elements", -1, nullptr);
}

void MpiCommunicator::abort(std::string_view reason) {
    const State& s = *state_;
    std::fprintf(stderr, "memtrain: rank %d of %d (%s): aborting every rank: %.*s\n", s.world_rank,
                 s.world_size, where(s).c_str(), static_cast<int>(reason.size()), reason.data());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);  // MPI_Abort does not return; this is for a broken MPI only
}

}  // namespace memtrain::dist
