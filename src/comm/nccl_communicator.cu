// DeviceCommunicator over NCCL (see device_communicator.h). A .cu file without kernels: it is
// compiled with the CUDA sources, so the GPU build links libnccl while cudasim's build links its
// NCCL emulation over MPI (tests/cudasim/nccl.cpp).
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/device_communicator.h"
#include "core/device.h"
#include "core/error.h"

namespace memtrain::dist {

namespace {

ncclDataType_t nccl_type(DeviceType t) {
    switch (t) {
        case DeviceType::F32:
            return ncclFloat32;
        case DeviceType::BF16:
            return ncclBfloat16;
        case DeviceType::F16:
            return ncclFloat16;
        case DeviceType::F64:
            return ncclFloat64;
    }
    return ncclFloat32;
}

double comm_timeout_s() {
    const char* v = std::getenv("MEMTRAIN_COMM_TIMEOUT_S");
    const double t = v ? std::atof(v) : 0.0;
    return t > 0 ? t : 300.0;
}

class NcclCommunicator final : public DeviceCommunicator {
  public:
    explicit NcclCommunicator(const HostLink& host) : rank_(host.rank), size_(host.size) {
        ncclUniqueId id{};
        if (rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
        host.broadcast_from_root(&id, (int64_t)sizeof(id));
        check(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
    }
    ~NcclCommunicator() override {
        if (comm_) ncclCommDestroy(comm_);
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }

    void all_reduce_sum(void* data, int64_t n, DeviceType t, cudaStream_t stream) override {
        if (n > 0)
            check(ncclAllReduce(data, data, (size_t)n, nccl_type(t), ncclSum, comm_, stream),
                  "ncclAllReduce");
    }
    void reduce_scatter_sum(const void* in, void* out, int64_t count, DeviceType t,
                            cudaStream_t stream) override {
        if (count > 0)
            check(ncclReduceScatter(in, out, (size_t)count, nccl_type(t), ncclSum, comm_, stream),
                  "ncclReduceScatter");
    }
    void all_gather(const void* in, void* out, int64_t count, DeviceType t,
                    cudaStream_t stream) override {
        if (count > 0)
            check(ncclAllGather(in, out, (size_t)count, nccl_type(t), comm_, stream),
                  "ncclAllGather");
    }
    void reduce_pieces(void* data, const std::vector<int64_t>& offsets,
                       const std::vector<int64_t>& counts, DeviceType t,
                       cudaStream_t stream) override {
        grouped_pieces(data, offsets, counts, t, [&](void* piece, size_t n, int root) {
            check(ncclReduce(piece, piece, n, nccl_type(t), ncclSum, root, comm_, stream),
                  "ncclReduce");
        });
    }
    void broadcast_pieces(const void* mine, void* out, const std::vector<int64_t>& offsets,
                          const std::vector<int64_t>& counts, DeviceType t,
                          cudaStream_t stream) override {
        grouped_pieces(out, offsets, counts, t, [&](void* piece, size_t n, int root) {
            check(ncclBroadcast(root == rank_ ? mine : piece, piece, n, nccl_type(t), root, comm_,
                                stream),
                  "ncclBroadcast");
        });
    }
    void send(const void* data, int64_t n, DeviceType t, int peer, cudaStream_t stream) override {
        if (n > 0) check(ncclSend(data, (size_t)n, nccl_type(t), peer, comm_, stream), "ncclSend");
    }
    void recv(void* data, int64_t n, DeviceType t, int peer, cudaStream_t stream) override {
        if (n > 0) check(ncclRecv(data, (size_t)n, nccl_type(t), peer, comm_, stream), "ncclRecv");
    }
    void wait(cudaStream_t stream, const char* what) override {
        // Poll instead of blocking in cudaStreamSynchronize: a peer that died leaves NCCL's
        // kernels spinning forever, and only the host can notice and abort.
        const auto start = std::chrono::steady_clock::now();
        const double limit = comm_timeout_s();
        for (int spins = 0;; spins++) {
            cudaError_t e = cudaStreamQuery(stream);
            if (e == cudaSuccess) return;
            if (e != cudaErrorNotReady) MT_CUDA_CHECK(e);
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(comm_, &async);
            const double waited =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (async != ncclSuccess || waited > limit) {
                ncclCommAbort(comm_);
                comm_ = nullptr;
                fail(
                    "rank {} of {}: {} {} after {:.1f} s ({}); a peer rank died or stopped "
                    "taking part (MEMTRAIN_COMM_TIMEOUT_S = {:.0f})",
                    rank(), size(), what, async != ncclSuccess ? "failed" : "timed out", waited,
                    async != ncclSuccess ? ncclGetErrorString(async) : "NCCL still waiting", limit);
            }
            if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

  private:
    // One grouped launch of op(piece, count, owner) over the ranks' nonempty pieces of `base`.
    template <typename Op>
    void grouped_pieces(void* base, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& counts, DeviceType t, Op&& op) {
        const std::size_t e = device_type_bytes(t);
        check(ncclGroupStart(), "ncclGroupStart");
        for (int r = 0; r < size_; r++)
            if (counts[r] > 0)
                op(static_cast<unsigned char*>(base) + (std::size_t)offsets[r] * e,
                   (size_t)counts[r], r);
        check(ncclGroupEnd(), "ncclGroupEnd");
    }
    void check(ncclResult_t r, const char* call) {
        if (r != ncclSuccess && r != ncclInProgress)
            fail("rank {} of {}: {} failed: {}", rank_, size_, call, ncclGetErrorString(r));
    }

    int rank_, size_;
    ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<DeviceCommunicator> make_nccl_communicator(const HostLink& host) {
    return std::make_unique<NcclCommunicator>(host);
}

}  // namespace memtrain::dist
