// Kernels that pin down the CUDA semantics memtrain's kernels rely on (block barriers, warp
// shuffles, dynamic shared memory, multi-dimensional indices, stream capture), built for the GPU
// and for cudasim alike: on a GPU they check the hardware, on cudasim they check the simulator,
// and the same test expects the same answers from both.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::semantics {

// out[i] = i + 1 within each block of `threads`, read back from shared memory through a barrier
// (out[i] = value written by the next thread of the block, cyclically).
void rotate_through_shared(int* out, int blocks, int threads, cudaStream_t stream = 0);
// Per warp lane l: xor[l] = l ^ 5, down[l] = l + 3 (or l past the end), up[l] = l - 2 (or l),
// width16[l] = (l & ~15) + 7, ballot = bits of the odd lanes; out holds 5 ints per thread.
void warp_shuffles(int* out, int threads, cudaStream_t stream = 0);
// A block of (4, 3, 2) threads in a grid of (2, 3, 1): out[linear global id] encodes the indices.
void indices_3d(int* out, cudaStream_t stream = 0);
// Dynamic shared memory of n floats per block: out[i] = sum of the block's inputs (each thread
// writes one value, thread 0 sums after a barrier).
void dynamic_shared_sum(float* out, const float* in, int blocks, int threads,
                        cudaStream_t stream = 0);
// Threads with index >= live return at once; the rest meet at a barrier and write 1.
void early_exit_then_barrier(int* out, int threads, int live, cudaStream_t stream = 0);
// x[i] += 1 for i < n.
void increment(float* x, int n, cudaStream_t stream = 0);
// A warp whose lane 0 waits at __syncthreads while the others wait at __syncwarp: no barrier can
// complete (cudasim reports a deadlock and aborts; on a GPU this would hang, so never run there).
void divergent_barrier(int* out, cudaStream_t stream = 0);

}  // namespace memtrain::semantics
