// cudasim: runs memtrain's CUDA kernels on the CPU, so that every machine (CI has no GPU) can
// execute and test the CUDA backend, in the spirit of Numba's CUDA simulator and Triton's
// interpreter. Not a performance tool: it checks indexing, synchronisation and the host-side
// orchestration, not speed, and it is no proof that the code runs on a real GPU.
//
// How it works:
//   - The .cu files are compiled a second time, as C++, by the host compiler, with prelude.h
//     included first: __global__/__device__ vanish, __shared__ becomes block-shared storage,
//     threadIdx & co. read the simulated thread's state, and the warp intrinsics (__shfl_*_sync,
//     __syncwarp, the tensor-core mma wrappers of kernels/cuda) become warp-wide exchanges.
//   - A kernel launch runs every block; the threads of a block are fibers on one OS thread,
//     switched only at barriers (__syncthreads, warp collectives), so a block's threads meet at
//     every barrier as on the GPU. A barrier some threads never reach is reported as a deadlock.
//     Blocks run on several OS threads at once (OpenMP), as blocks run on several SMs.
//   - The CUDA runtime and cuBLASLt calls memtrain makes are reimplemented over host memory
//     (runtime.cpp, cublaslt.cpp): "device" memory is host memory (so AddressSanitizer checks
//     every kernel's accesses in the sanitizer build), and stream capture records the work into
//     a graph that replays it (CUDA graphs).
//   - Streams keep CUDA's meaning (queue.h): work is queued per stream and runs only when a
//     synchronisation needs it (cudaStreamSynchronize, cudaEventSynchronize, a synchronous copy,
//     cudaDeviceSynchronize, cudaFree), in an order drawn from MEMTRAIN_SIM_SEED among the
//     orders CUDA allows (a stream's own order, event waits, the legacy stream's implicit
//     synchronisation, a communicator's issue order). A missing cudaStreamWaitEvent lets a
//     consumer run before its producer, as it may on a GPU.
//
// Settings (environment): MEMTRAIN_SIM_DEVICE_MIB, the device memory the simulator reports and
// enforces (default 81559, an H100's); MEMTRAIN_SIM_THREADS, OS threads for blocks (default
// OpenMP's); MEMTRAIN_SIM_SEED, the interleaving of streams (default 1; 0 runs work in the order
// the host issued it, as the first simulator did); MEMTRAIN_SIM_DROP_WAIT (site:OFFSET drops
// every cudaStreamWaitEvent made from that return address, call:N the N-th call) and
// MEMTRAIN_SIM_WAIT_SITES (a folder: each process writes the call sites of its waits there at
// exit): the mutation test's hook (tests/cudasim/drop_wait_test.py).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace cudasim {

// The simulated thread's coordinates, as the kernel sees them.
struct ThreadState {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned linear;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
    unsigned lane;    // linear % 32
    unsigned warp;    // linear / 32
};

// The current simulated thread (valid only inside a kernel).
const ThreadState& self();

// __syncthreads(): returns once every live thread of the block has arrived.
void syncthreads();
// A warp-wide exchange: each live lane of the calling thread's warp contributes `bytes` (at most
// kMaxExchangeBytes) and gets the base of a table of 32 entries kMaxExchangeBytes apart, lane i's
// contribution at entry i. The table stays valid until the warp's next-but-one exchange, so read
// it before the next barrier-free stretch ends. Also serves __syncwarp (bytes = 0).
constexpr std::size_t kMaxExchangeBytes = 64;
const unsigned char* warp_exchange(const void* mine, std::size_t bytes);
// The block's dynamic shared memory (the launch's `smem` bytes, 16-byte aligned).
void* dynamic_smem();

// Runs (or, while `stream` is being captured, records) a kernel: `body` is called once per
// thread of every block. Returns the error a real launch would report for a bad configuration.
cudaError_t launch(const char* name, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                   std::function<void()> body);

// Work that a stream would queue (a copy, a memset, a cuBLASLt call): queued on the stream, or
// recorded while the stream is being captured. Returns what enqueueing returns.
cudaError_t enqueue(cudaStream_t stream, std::function<void()> work);
// Work that waits for other processes (an NCCL operation): `start` runs when the scheduler
// reaches it, then `done` is polled until it returns true, and the stream's later work waits
// until then (other streams go on meanwhile). Operations with the same `order` (a communicator)
// start in the order they were enqueued, whatever their stream, as NCCL's do.
cudaError_t enqueue_async(cudaStream_t stream, const void* order, std::function<void()> start,
                          std::function<bool()> done);
// Runs every queued item of every stream (what cudaDeviceSynchronize waits for).
void drain();
// The interleaving seed in use (MEMTRAIN_SIM_SEED), and a test's way to change it.
uint64_t seed();
void set_seed(uint64_t seed);

// Sets the error the next cudaGetLastError() returns (sticky errors are not simulated).
void set_last_error(cudaError_t e);

}  // namespace cudasim
