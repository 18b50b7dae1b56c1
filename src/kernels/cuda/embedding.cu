// Token + position embedding on the GPU. The backward is deterministic without atomics: d(wpe) has
// one thread per (t, c) walking the batch in order, and d(wte) groups the positions by token id on
// the host (a counting sort of the B*T ids), then one block per distinct id walks its positions in
// (b, t) order. Both orders equal the CPU's, so the results are the CPU's bits.
#include <mutex>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/token_buckets.h"

namespace memtrain::cuda {

constexpr int kThreads = 256;

static __global__ void embedding_forward_kernel(float* out, const int32_t* inp, const float* wte,
                                                const float* wpe, int T, int C, int64_t n) {
    MT_GRID_STRIDE(i, n) {
        const int64_t bt = i / C;
        const int c = (int)(i % C);
        float e = wte[(int64_t)inp[bt] * C + c];
        if (wpe) e += wpe[(bt % T) * C + c];
        out[i] = e;
    }
}

void embedding_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B,
                       int T, int C, cudaStream_t stream) {
    const int64_t n = (int64_t)B * T * C;
    if (n <= 0) return;
    MT_LAUNCH(embedding_forward_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, out,
              inp, wte, wpe, T, C, n);
}

// dwpe[t, c] += sum over b (in order) of dout[b, t, c].
static __global__ void embedding_dwpe_kernel(float* dwpe, const float* dout, int B, int T, int C) {
    MT_GRID_STRIDE(i, (int64_t)T * C) {
        float acc = dwpe[i];
        for (int b = 0; b < B; b++) acc += dout[(int64_t)b * T * C + i];
        dwpe[i] = acc;
    }
}

// Block u owns the u-th distinct id: dwte[id, c] += dout[p, c] over its positions p in order.
// `order` lists all positions sorted by (id, position); seg[u] .. seg[u+1] is id u's run.
static __global__ void embedding_dwte_kernel(float* dwte, const float* dout, const int32_t* order,
                                             const int32_t* seg, const int32_t* ids, int C) {
    const int u = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float* row = dwte + (int64_t)ids[u] * C;
    float acc = row[c];
    for (int k = seg[u]; k < seg[u + 1]; k++) acc += dout[(int64_t)order[k] * C + c];
    row[c] = acc;
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B,
                        int T, int C, cudaStream_t stream) {
    const int64_t N64 = (int64_t)B * T;
    if (N64 <= 0 || C <= 0) return;
    if (N64 > INT32_MAX / 2) fail("cuda::embedding_backward: B*T = {} is too large", N64);
    const int N = (int)N64;
    if (dwpe) {
        MT_LAUNCH(embedding_dwpe_kernel, elementwise_blocks((int64_t)T * C, kThreads), kThreads, 0,
                  stream, dwpe, dout, B, T, C);
    }

    // Host staging, reused between calls (the upload below is a staged copy of pageable memory,
    // complete from the host's side when cudaMemcpyAsync returns).
    static std::mutex mu;
    static std::vector<int32_t> ids, plan;
    std::lock_guard lock(mu);
    ids.resize(N);
    MT_CUDA_CHECK(cudaMemcpyAsync(ids.data(), inp, (size_t)N * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const int U = bucket_tokens(ids.data(), N, plan);
    int32_t* dplan = static_cast<int32_t*>(device_scratch(plan.size() * sizeof(int32_t)));
    MT_CUDA_CHECK(cudaMemcpyAsync(dplan, plan.data(), plan.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream));
    dim3 grid((unsigned)U, (unsigned)ceil_div(C, kThreads));
    MT_LAUNCH(embedding_dwte_kernel, grid, kThreads, 0, stream, dwte, dout, dplan, dplan + N,
              dplan + N + U + 1, C);
}

}  // namespace memtrain::cuda
