// Helpers shared by the .cu files of kernels/cuda: launch checks, grid sizes, warp reductions and
// the fixed-order column sum used for bias and norm-parameter gradients. Internal to kernels/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/device.h"
#include "core/error.h"

namespace memtrain::cuda {

// Call after every launch: reports a bad configuration (and earlier asynchronous faults) at the
// launch site rather than at some later synchronisation.
#define MT_CUDA_CHECK_LAUNCH() MT_CUDA_CHECK(cudaGetLastError())

// Reports a failed launch: the kernel, its configuration and the runtime's reason.
[[noreturn]] void launch_fail(const char* kernel, int error, dim3 grid, dim3 block,
                              std::size_t smem);

// Launches `kernel` on `stream` with `args` converted to its parameter types, then checks the
// launch. Every kernel of kernels/cuda starts here, so that the same source runs under cudasim
// (tests/cudasim), which executes kernels on the CPU for the machines without a GPU:
//     MT_LAUNCH(gelu_forward_kernel<T>, blocks, threads, 0, stream, out, inp, n);
#define MT_LAUNCH(kernel, grid, block, smem, stream, ...) \
    ::memtrain::cuda::launch_kernel(#kernel, kernel, grid, block, smem, stream, __VA_ARGS__)

template <typename... Params, typename... Args>
void launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                   std::size_t smem, cudaStream_t stream, Args... args) {
    static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
#if MEMTRAIN_CUDA_SIM
    cudasim::launch(name, grid, block, smem, stream, [=] { kernel(static_cast<Params>(args)...); });
#else
    // clang-format off
    kernel<<<grid, block, smem, stream>>>(static_cast<Params>(args)...);
    // clang-format on
#endif
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) launch_fail(name, (int)err, grid, block, smem);
}

// Dynamic shared memory of the running block as an array of T (16-byte aligned).
#if MEMTRAIN_CUDA_SIM
#define MT_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::cudasim::dynamic_smem())
#else
#define MT_DYNAMIC_SHARED(T, name)                               \
    extern __shared__ __align__(16) unsigned char name##_raw_[]; \
    T* name = reinterpret_cast<T*>(name##_raw_)
#endif

// A grid-stride loop over [0, n) with 64-bit indices.
#define MT_GRID_STRIDE(i, n)                                                  \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)gridDim.x * blockDim.x)

inline int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

// A grid's x dimension of n blocks, one per item (a row, a head): an error beyond CUDA's limit
// of 2^31 - 1, where the unsigned cast would wrap and skip work silently.
inline unsigned grid_x(int64_t n, const char* what) {
    if (n < 0 || n > INT32_MAX)
        fail("{} = {} blocks: more than a CUDA grid holds (2^31 - 1); use a smaller micro-batch",
             what, n);
    return (unsigned)n;
}

// Blocks for a grid-stride elementwise loop over n items: enough to fill the GPU many times over,
// never more than the grid's x limit.
inline unsigned elementwise_blocks(int64_t n, int threads) {
    int64_t blocks = ceil_div(n, threads);
    if (blocks > (int64_t)1 << 20) blocks = (int64_t)1 << 20;
    return (unsigned)(blocks < 1 ? 1 : blocks);
}

// fp32 <-> storage type, for kernels templated on float / __nv_bfloat16 / __half (fp32
// arithmetic).
__device__ __forceinline__ float to_float(float x) {
    return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
__device__ __forceinline__ float to_float(__half x) {
    return __half2float(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}

// Butterfly reductions: every lane ends with the result, and the order of the additions depends
// only on the lane values, so it is the same on every run.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024) in a fixed tree; every
// thread gets the result. `shared` holds 32 values; the call ends with a barrier, so it may be
// called again with the same array.
template <typename F>
__device__ F block_sum(F v, F* shared) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int nwarps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    F r = lane < nwarps ? shared[lane] : F(0);
    r = warp_sum(r);
    __syncthreads();
    return r;
}

// Rows per partial sum in the column reductions (bias and norm-parameter gradients): a fixed
// number, so the summation order depends on N alone.
constexpr int kColumnChunkRows = 64;

// dst[c] += sum over chunks k (in order) of partial[k * C + c], for `nchunks` chunks.
void finish_column_sums(float* dst, const float* partial, int nchunks, int C, cudaStream_t stream);
// dst[c] += sum over rows r of x[r, c] for x (N,C): per-chunk partials, then finish_column_sums.
// Uses device_scratch().
void column_sums_accumulate(float* dst, const float* x, int N, int C, cudaStream_t stream);
// Sum of n doubles in a fixed order by one block, written to result_device and returned (waits for
// the stream).
double sum_doubles(const double* values, int64_t n, double* result_device, cudaStream_t stream);

}  // namespace memtrain::cuda
