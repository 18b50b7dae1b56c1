// Collectives on device (GPU) buffers, for the CUDA engine's data parallelism: the NCCL backend
// (nccl_communicator.cu), built from the host Communicator (MPI), which carries NCCL's unique id
// from rank 0 to the others. Calls queue work on a CUDA stream and return, as NCCL's do; the
// stream orders it. Every rank must make the same calls in the same order with the same counts.
// Sharded buffers use NCCL's equal-size layout: rank r's block is [r * count, (r + 1) * count),
// so a buffer of total elements is padded to size() * ceil(total / size()).
//
// Fail fast: wait() (not the CUDA stream) is how the engine waits for its collectives; it polls
// and, past MEMTRAIN_COMM_TIMEOUT_S (default 300 s), aborts the NCCL communicator and fails
// naming the rank and the collective, instead of hanging on a peer that has died.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

namespace memtrain::dist {

enum class DeviceType { F32, BF16, F16, F64 };
inline std::size_t device_type_bytes(DeviceType t) {
    return t == DeviceType::F64 ? 8 : t == DeviceType::F32 ? 4 : 2;
}
// The DeviceType of a storage type: float, __nv_bfloat16 or __half.
template <typename T>
DeviceType device_type() {
    if constexpr (std::is_same_v<T, float>)
        return DeviceType::F32;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return DeviceType::BF16;
    else
        return DeviceType::F16;
}

class DeviceCommunicator {
  public:
    virtual ~DeviceCommunicator() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;

    // In place: data[i] = sum over ranks of data[i] (n elements).
    virtual void all_reduce_sum(void* data, int64_t n, DeviceType t, cudaStream_t stream) = 0;
    // `in` holds size() * count elements on every rank; `out` (count elements) receives this
    // rank's block of the element-wise sum. `out` may be `in + rank() * count`.
    virtual void reduce_scatter_sum(const void* in, void* out, int64_t count, DeviceType t,
                                    cudaStream_t stream) = 0;
    // `in` holds this rank's count elements; `out` (size() * count) receives every rank's block
    // at its offset. `in` may be `out + rank() * count`.
    virtual void all_gather(const void* in, void* out, int64_t count, DeviceType t,
                            cudaStream_t stream) = 0;
    // Unit by unit (ZeRO-2/3 on GPUs): a unit of the flat buffer cuts into uneven pieces, rank
    // r's piece being [offsets[r], offsets[r] + counts[r]) elements of the unit (a count may be
    // 0). reduce_pieces sums each piece over the ranks into its owner, in place: on rank r,
    // piece r of `data` becomes the sum (the other pieces are left as they were or undefined).
    // broadcast_pieces gives every rank the whole unit in `out`, each piece from its owner, this
    // rank's taken from `mine`. Each is one grouped launch of per-piece reduces or broadcasts.
    virtual void reduce_pieces(void* data, const std::vector<int64_t>& offsets,
                               const std::vector<int64_t>& counts, DeviceType t,
                               cudaStream_t stream) = 0;
    virtual void broadcast_pieces(const void* mine, void* out, const std::vector<int64_t>& offsets,
                                  const std::vector<int64_t>& counts, DeviceType t,
                                  cudaStream_t stream) = 0;
    // Point to point (pipeline stages): n elements to rank `peer`, which makes the matching
    // recv. Each is queued on `stream`; a send waits there for its receive (NCCL's ncclSend is
    // blocking for the GPU), so a sender queues it on a stream of its own where it should not
    // hold up its compute. Between two ranks, the sends and receives on one communicator pair
    // up in the order they were queued.
    virtual void send(const void* data, int64_t n, DeviceType t, int peer, cudaStream_t stream) = 0;
    virtual void recv(void* data, int64_t n, DeviceType t, int peer, cudaStream_t stream) = 0;
    // Waits until everything queued on `stream` has finished, with the fail-fast timeout.
    virtual void wait(cudaStream_t stream, const char* what) = 0;
};

// What NCCL's set-up needs of the host communicator (dist::Communicator), in the C++17 this
// header keeps for nvcc: the rank, the world size and a broadcast from rank 0.
struct HostLink {
    int rank = 0, size = 1;
    std::function<void(void* data, int64_t bytes)> broadcast_from_root;
};

// NCCL across the ranks of `host` (one GPU per rank; the caller has selected it). Every rank
// calls it (the unique id travels over `host`).
std::unique_ptr<DeviceCommunicator> make_nccl_communicator(const HostLink& host);

}  // namespace memtrain::dist
