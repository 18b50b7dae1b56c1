// MpiCommunicator: the Communicator over MPI (OpenMPI), for CPU multi-process runs.
// Every operation is nonblocking MPI plus a polling wait with a deadline: a rank that died or
// skipped a collective makes the others abort within the timeout instead of hanging.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace memtrain::dist {

struct MpiOptions {
    // Seconds any one operation may wait for its peers before this rank prints which operation
    // stalled and calls MPI_Abort, which ends every rank of the job.
    double timeout_s = 300.0;
};

// True when this process was started by an MPI launcher (mpirun/mpiexec of OpenMPI, MPICH or
// Intel MPI, or Slurm's srun with PMI/PMIx), read from the environment those launchers set.
// MEMTRAIN_DIST=none forces false (a single-process run inside an MPI job), MEMTRAIN_DIST=mpi
// forces true.
bool launched_by_mpi();

// Defaults, with timeout_s from MEMTRAIN_COMM_TIMEOUT_S when set (a positive number of seconds;
// anything else is an error naming the variable).
MpiOptions mpi_options_from_env();

class MpiCommunicator final : public Communicator {
  public:
    // Initialises MPI (MPI_Init_thread, at least MPI_THREAD_FUNNELED: only the thread that made
    // the communicator may call it) unless the program already did, and works on a duplicate
    // of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so MPI errors become memtrain::Error naming the
    // operation. If this constructor initialised MPI, the destructor finalises it; create one
    // per process and keep it for the whole run (MPI cannot be initialised twice).
    explicit MpiCommunicator(MpiOptions options = mpi_options_from_env());
    ~MpiCommunicator() override;
    MpiCommunicator(const MpiCommunicator&) = delete;
    MpiCommunicator& operator=(const MpiCommunicator&) = delete;

    int rank() const override;
    int size() const override;
    int local_rank() const override;
    int local_size() const override;
    double timeout_s() const;

    void all_reduce_sum(float* data, int64_t n) override;
    void all_reduce_max(double* data, int64_t n) override;
    void all_reduce_max(int64_t* data, int64_t n) override;
    void reduce_scatter_sum(const float* in, float* out, std::span<const int64_t> counts) override;
    void all_gather(const float* in, float* out, std::span<const int64_t> counts) override;
    void all_gather_bytes(const void* in, void* out, int64_t bytes_per_rank) override;
    uint64_t start_all_reduce_sum(float* data, int64_t n) override;
    uint64_t start_reduce_scatter_sum(const float* in, float* out,
                                      std::span<const int64_t> counts) override;
    uint64_t start_all_gather(const float* in, float* out,
                              std::span<const int64_t> counts) override;
    void progress() override;
    bool test(uint64_t id) override;
    void wait(uint64_t id) override;
    void wait_all() override;
    void broadcast(void* data, int64_t bytes, int root) override;
    void send(const float* data, int64_t n, int peer, int tag) override;
    void recv(float* data, int64_t n, int peer, int tag) override;
    uint64_t start_send(const float* data, int64_t n, int peer, int tag) override;
    void barrier() override;
    // MPI_Comm_split, after a barrier with the deadline. The sub-group keeps the timeout; its
    // timeout and abort lines name the job's rank and size (as the whole job's do) with the
    // group and the rank in it, its point-to-point peers by their job rank, and MPI_Abort ends
    // the whole job.
    std::unique_ptr<Communicator> split(int color, int key, std::string_view name) override;
    [[noreturn]] void abort(std::string_view reason) override;

    // Defined in the .cpp only: keeps <mpi.h> out of this header.
    struct State;

  private:
    explicit MpiCommunicator(std::unique_ptr<State> state);  // a sub-group (split)
    std::unique_ptr<State> state_;
};

}  // namespace memtrain::dist
