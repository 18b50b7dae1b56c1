// Token + position embedding on the GPU, over 128-bit packs where the pointers and C allow
// (pack.cuh). The backward is deterministic without atomics and sums in the CPU's order, so for
// fp32 it gives the CPU's bits: d(wpe) has one thread per (t, pack) walking the batch in order,
// and d(wte) one block per distinct id (the host-built bucket_tokens plan) walking that id's
// positions in (b, t) order.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace memtrain::cuda {

constexpr int kThreads = 256;

// Pack i of the (B*T, C) output: position i / (C / W), channels from (i % (C / W)) W.
template <typename T, int W>
static __global__ void embedding_forward_kernel(T* out, const int32_t* inp, const T* wte,
                                                const T* wpe, int T_, int C, int64_t npacks) {
    const int cp = C / W;
    MT_GRID_STRIDE(i, npacks) {
        const int64_t bt = i / cp;
        const int c = (int)(i % cp) * W;
        float e[W];
        load_floats<T, W>(wte + (int64_t)inp[bt] * C + c, e);
        if (wpe) {
            float p[W];
            load_floats<T, W>(wpe + (bt % T_) * C + c, p);
#pragma unroll
            for (int j = 0; j < W; j++) e[j] += p[j];
        }
        store_floats<T, W>(out + i * W, e);
    }
}

// dwpe[t, c] += dout[b, t, c] for b = 0, 1, ... in order; pack i of the (T, C) table.
template <typename T, int W>
static __global__ void embedding_dwpe_kernel(T* dwpe, const T* dout, int B, int64_t tc_packs) {
    MT_GRID_STRIDE(i, tc_packs) {
        float acc[W];
        load_floats<T, W>(dwpe + i * W, acc);
        for (int b = 0; b < B; b++) {
            float d[W];
            load_floats<T, W>(dout + (b * tc_packs + i) * W, d);
#pragma unroll
            for (int j = 0; j < W; j++) acc[j] += d[j];
        }
        store_floats<T, W>(dwpe + i * W, acc);
    }
}

// Block u owns the u-th distinct id of the plan, one thread per pack of W channels (blockIdx.y
// for more): dwte[id, c] += dout[p, c] over the id's positions p in increasing order. `order`
// lists all positions sorted by (id, position); seg[u] .. seg[u + 1] is run u, uniq[u] its id.
// Frequent ids have long runs: kBatch positions are loaded before they are added (in order),
// so a long run waits on memory once per batch rather than once per position.
template <typename T, int W>
static __global__ void embedding_dwte_kernel(T* dwte, const T* dout, const int32_t* order,
                                             const int32_t* seg, const int32_t* uniq, int C) {
    constexpr int kBatch = 8;
    const int u = blockIdx.x;
    const int p = blockIdx.y * blockDim.x + threadIdx.x;
    if (p >= C / W) return;
    const int c = p * W;
    T* row = dwte + (int64_t)uniq[u] * C + c;
    float acc[W];
    load_floats<T, W>(row, acc);
    const int k1 = seg[u + 1];
    for (int k0 = seg[u]; k0 < k1; k0 += kBatch) {
        Pack<T, W> batch[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; j++) {
            if (k0 + j < k1) batch[j] = load_pack<T, W>(dout + (int64_t)order[k0 + j] * C + c);
        }
#pragma unroll
        for (int j = 0; j < kBatch; j++) {
            if (k0 + j < k1) {
                float d[W];
                unpack(batch[j], d);
#pragma unroll
                for (int q = 0; q < W; q++) acc[q] += d[q];
            }
        }
    }
    store_floats<T, W>(row, acc);
}

// ---- launch ------------------------------------------------------------------------------------
template <typename T, int W>
static void launch_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int T_,
                           int C, cudaStream_t stream) {
    const int64_t npacks = (int64_t)B * T_ * (C / W);
    MT_LAUNCH((embedding_forward_kernel<T, W>), elementwise_blocks(npacks, kThreads), kThreads, 0,
              stream, out, inp, wte, wpe, T_, C, npacks);
}

template <typename T, int W>
static void launch_backward(T* dwte, T* dwpe, const T* dout, const int32_t* plan, int unique, int B,
                            int T_, int C, cudaStream_t stream) {
    if (dwpe) {
        const int64_t tc_packs = (int64_t)T_ * (C / W);
        MT_LAUNCH((embedding_dwpe_kernel<T, W>), elementwise_blocks(tc_packs, kThreads), kThreads,
                  0, stream, dwpe, dout, B, tc_packs);
    }
    const int N = B * T_;
    const int packs = C / W;
    // One to four warps across the row's packs; more in blockIdx.y.
    const int threads = packs >= 128 ? 128 : (int)ceil_div(packs, 32) * 32;
    dim3 grid((unsigned)unique, (unsigned)ceil_div(packs, threads));
    MT_LAUNCH((embedding_dwte_kernel<T, W>), grid, threads, 0, stream, dwte, dout, plan, plan + N,
              plan + N + unique + 1, C);
}

// ---- entry points ------------------------------------------------------------------------------
template <typename T>
void embedding_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int T_, int C,
                       cudaStream_t stream) {
    if (B < 0 || T_ < 0 || C <= 0) {
        fail("cuda::embedding_forward: B = {}, T = {}, C = {}, expected B, T >= 0 and C > 0", B, T_,
             C);
    }
    if ((int64_t)B * T_ == 0) return;
    const bool vec =
        C % kPackWidth<T> == 0 && aligned16(out) && aligned16(wte) && (!wpe || aligned16(wpe));
    if (vec) {
        launch_forward<T, kPackWidth<T>>(out, inp, wte, wpe, B, T_, C, stream);
    } else {
        launch_forward<T, 1>(out, inp, wte, wpe, B, T_, C, stream);
    }
}

template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* plan, int unique, int B,
                        int T_, int C, cudaStream_t stream) {
    if (B < 0 || T_ < 0 || C <= 0) {
        fail("cuda::embedding_backward: B = {}, T = {}, C = {}, expected B, T >= 0 and C > 0", B,
             T_, C);
    }
    const int64_t N = (int64_t)B * T_;
    if (N > INT32_MAX / 2) fail("cuda::embedding_backward: B*T = {} is too large", N);
    if (N == 0) return;
    if (unique < 1 || unique > N) {
        fail("cuda::embedding_backward: unique = {}, expected 1 .. B*T = {} (bucket_tokens' count)",
             unique, N);
    }
    if (!dwte || !plan) fail("cuda::embedding_backward: dwte and plan are required");
    const bool vec =
        C % kPackWidth<T> == 0 && aligned16(dwte) && aligned16(dout) && (!dwpe || aligned16(dwpe));
    if (vec) {
        launch_backward<T, kPackWidth<T>>(dwte, dwpe, dout, plan, unique, B, T_, C, stream);
    } else {
        launch_backward<T, 1>(dwte, dwpe, dout, plan, unique, B, T_, C, stream);
    }
}

#define MT_INSTANTIATE(T)                                                                     \
    template void embedding_forward<T>(T*, const int32_t*, const T*, const T*, int, int, int, \
                                       cudaStream_t);                                         \
    template void embedding_backward<T>(T*, T*, const T*, const int32_t*, int, int, int, int, \
                                        cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
