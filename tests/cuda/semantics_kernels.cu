// See semantics_kernels.h.
#include "cuda/semantics_kernels.h"
#include "kernels/cuda/common.cuh"

namespace memtrain::semantics {

static __global__ void rotate_kernel(int* out) {
    __shared__ int values[1024];
    const int t = threadIdx.x;
    values[t] = blockIdx.x * blockDim.x + t + 1;
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = values[(t + 1) % blockDim.x];
}

void rotate_through_shared(int* out, int blocks, int threads, cudaStream_t stream) {
    MT_LAUNCH(rotate_kernel, blocks, threads, 0, stream, out);
}

static __global__ void shuffle_kernel(int* out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    int* o = out + 5 * t;
    o[0] = __shfl_xor_sync(0xffffffffu, lane, 5);
    o[1] = __shfl_down_sync(0xffffffffu, lane, 3);
    o[2] = __shfl_up_sync(0xffffffffu, lane, 2);
    o[3] = __shfl_sync(0xffffffffu, lane, 7, 16);
    o[4] = (int)__ballot_sync(0xffffffffu, lane % 2);
}

void warp_shuffles(int* out, int threads, cudaStream_t stream) {
    MT_LAUNCH(shuffle_kernel, (threads + 63) / 64, 64, 0, stream, out);
}

static __global__ void indices_kernel(int* out) {
    const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int local = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int id = block * blockDim.x * blockDim.y * blockDim.z + local;
    out[id] = threadIdx.x + 10 * threadIdx.y + 100 * threadIdx.z + 1000 * blockIdx.x +
              10000 * blockIdx.y + 100000 * blockIdx.z;
}

void indices_3d(int* out, cudaStream_t stream) {
    MT_LAUNCH(indices_kernel, dim3(2, 3, 1), dim3(4, 3, 2), 0, stream, out);
}

static __global__ void dynamic_sum_kernel(float* out, const float* in) {
    MT_DYNAMIC_SHARED(float, values);
    const int t = threadIdx.x;
    values[t] = in[blockIdx.x * blockDim.x + t];
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (int i = 0; i < (int)blockDim.x; i++) s += values[i];
        out[blockIdx.x] = s;
    }
}

void dynamic_shared_sum(float* out, const float* in, int blocks, int threads, cudaStream_t stream) {
    MT_LAUNCH(dynamic_sum_kernel, blocks, threads, threads * sizeof(float), stream, out, in);
}

static __global__ void early_exit_kernel(int* out, int live) {
    const int t = threadIdx.x;
    if (t >= live) return;
    __shared__ int flag;
    if (t == 0) flag = 1;
    __syncthreads();
    out[t] = flag;
}

void early_exit_then_barrier(int* out, int threads, int live, cudaStream_t stream) {
    MT_LAUNCH(early_exit_kernel, 1, threads, 0, stream, out, live);
}

static __global__ void increment_kernel(float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

void increment(float* x, int n, cudaStream_t stream) {
    MT_LAUNCH(increment_kernel, (n + 127) / 128, 128, 0, stream, x, n);
}

static __global__ void divergent_kernel(int* out) {
    if (threadIdx.x == 0)
        __syncthreads();
    else
        __syncwarp();
    out[threadIdx.x] = 1;
}

void divergent_barrier(int* out, cudaStream_t stream) {
    MT_LAUNCH(divergent_kernel, 1, 32, 0, stream, out);
}

}  // namespace memtrain::semantics
