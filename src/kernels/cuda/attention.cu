// Causal grouped-query attention on the GPU without the (T,T) matrix: the public entries
// (validation, dispatch), the delta kernel both backward passes share, and the reference kernels
// (any storage type, hs <= 256, fp32 arithmetic). The tensor-core kernels are in
// attention_tensor_core.cu.
//
// Reference kernels: one warp per row. The row's keys (or, for d(k) and d(v), its queries) are
// taken 32 at a time: first a lane per key computes the dot products and the probability, which
// goes through shared memory; then a lane per head dimension (x = lane + 32 r) walks those 32
// keys in order. The forward is an online softmax (a running max and sum, rescaled per chunk);
// the backward recomputes each probability from the saved log-sum-exp. Every sum has an order
// fixed by the shapes, nothing is atomic, and no (T,T) scratch exists. Simple rather than fast:
// what fp32 training runs and what the tensor-core kernels are checked against.
#include <cmath>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

using attention_detail::Dims;

constexpr int kRefThreads = 256;  // 8 warps: 8 rows per block
constexpr int kRefRows = kRefThreads / 32;
constexpr int kRefMaxHs = 256;
constexpr int kRefDimsPerLane = kRefMaxHs / 32;

Dims attention_detail::check_dims(const char* op, int B, int T, int C, int NH, int NKV,
                                  int max_hs) {
    if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || NKV <= 0 || C % NH != 0 || NH % NKV != 0) {
        fail(
            "cuda::{}: B {} T {} C {} NH {} NKV {}: expected positive sizes, C % NH == 0 and NH "
            "% NKV == 0",
            op, B, T, C, NH, NKV);
    }
    const int hs = C / NH;
    if (hs > max_hs) {
        fail("cuda::{}: C {} NH {}: head size C / NH = {} is above the supported {}", op, C, NH, hs,
             max_hs);
    }
    return Dims{B, T, C, NH, NKV, hs, C + 2 * NKV * hs, NH / NKV};
}

// ---- kernels ---------------------------------------------------------------------------------

// Row r = (b, h, i) of (B,NH,T): delta[r] = dout_i . out_i over head h's hs channels.
template <typename E>
static __global__ void __launch_bounds__(kRefThreads)
    attention_delta_kernel(float* delta, const E* dout, const E* out, Dims d) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * kRefRows + warp;
    if (row >= (int64_t)d.B * d.NH * d.T) return;
    const int i = (int)(row % d.T);
    const int h = (int)((row / d.T) % d.NH);
    const int b = (int)(row / ((int64_t)d.T * d.NH));
    const int64_t base = ((int64_t)b * d.T + i) * d.C + (int64_t)h * d.hs;
    float s = 0.0f;
    for (int x = lane; x < d.hs; x += 32) s += to_float(dout[base + x]) * to_float(out[base + x]);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
}

// Row r = (b, h, i): out_i = sum_{j <= i} softmax_j(scale q_i . k_j) v_j and
// lse[r] = log sum_{j <= i} exp(scale q_i . k_j), as an online softmax over chunks of 32 keys.
// Shared memory per warp: q_i (hs floats), then the chunk's probabilities (32 floats).
template <typename E>
static __global__ void __launch_bounds__(kRefThreads)
    reference_forward_kernel(E* out, float* lse, const E* qkv, Dims d, float scale) {
    MT_DYNAMIC_SHARED(float, smem);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * kRefRows + warp;
    if (row >= (int64_t)d.B * d.NH * d.T) return;
    const int i = (int)(row % d.T);
    const int h = (int)((row / d.T) % d.NH);
    const int b = (int)(row / ((int64_t)d.T * d.NH));
    float* q = smem + warp * (d.hs + 32);
    float* p = q + d.hs;
    const E* batch = qkv + (int64_t)b * d.T * d.QKV;
    const E* qsrc = batch + (int64_t)i * d.QKV + (int64_t)h * d.hs;
    for (int x = lane; x < d.hs; x += 32) q[x] = to_float(qsrc[x]);
    __syncwarp();
    const E* kbase = batch + d.C + (int64_t)(h / d.group) * d.hs;
    const E* vbase = kbase + (int64_t)d.NKV * d.hs;

    float acc[kRefDimsPerLane] = {};
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 <= i; j0 += 32) {
        const int j = j0 + lane;
        float s = -INFINITY;
        if (j <= i) {
            const E* k = kbase + (int64_t)j * d.QKV;
            float dot = 0.0f;
            for (int x = 0; x < d.hs; x++) dot += q[x] * to_float(k[x]);
            s = dot * scale;
        }
        // Finite: key j0 <= i is in every chunk. On the first chunk m = -inf and alpha = 0.
        const float mnew = fmaxf(m, warp_max(s));
        const float pj = j <= i ? expf(s - mnew) : 0.0f;
        const float alpha = expf(m - mnew);
        l = l * alpha + warp_sum(pj);
        m = mnew;
        p[lane] = pj;
        __syncwarp();
        const int n = min(32, i - j0 + 1);
#pragma unroll
        for (int r = 0; r < kRefDimsPerLane; r++) {
            const int x = lane + 32 * r;
            if (x < d.hs) {
                float a = acc[r] * alpha;
                for (int c = 0; c < n; c++)
                    a += p[c] * to_float(vbase[(int64_t)(j0 + c) * d.QKV + x]);
                acc[r] = a;
            }
        }
        __syncwarp();  // p is rewritten by the next chunk
    }
    const float inv = 1.0f / l;
    E* o = out + ((int64_t)b * d.T + i) * d.C + (int64_t)h * d.hs;
#pragma unroll
    for (int r = 0; r < kRefDimsPerLane; r++) {
        const int x = lane + 32 * r;
        if (x < d.hs) o[x] = from_float<E>(acc[r] * inv);
    }
    if (lane == 0) lse[row] = m + logf(l);
}

// Row r = (b, h, i): dq_i = scale * sum_{j <= i} p_ij (dout_i . v_j - delta_i) k_j, with
// p_ij = exp(scale q_i . k_j - lse_i), keys in order. Shared memory per warp: q_i, dout_i (hs
// floats each), then the chunk's d(scores) (32 floats).
template <typename E>
static __global__ void __launch_bounds__(kRefThreads)
    reference_dq_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* delta,
                        Dims d, float scale) {
    MT_DYNAMIC_SHARED(float, smem);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * kRefRows + warp;
    if (row >= (int64_t)d.B * d.NH * d.T) return;
    const int i = (int)(row % d.T);
    const int h = (int)((row / d.T) % d.NH);
    const int b = (int)(row / ((int64_t)d.T * d.NH));
    float* q = smem + warp * (2 * d.hs + 32);
    float* g = q + d.hs;
    float* ds = g + d.hs;
    const E* batch = qkv + (int64_t)b * d.T * d.QKV;
    const E* qsrc = batch + (int64_t)i * d.QKV + (int64_t)h * d.hs;
    const E* gsrc = dout + ((int64_t)b * d.T + i) * d.C + (int64_t)h * d.hs;
    for (int x = lane; x < d.hs; x += 32) {
        q[x] = to_float(qsrc[x]);
        g[x] = to_float(gsrc[x]);
    }
    __syncwarp();
    const E* kbase = batch + d.C + (int64_t)(h / d.group) * d.hs;
    const E* vbase = kbase + (int64_t)d.NKV * d.hs;
    const float lse_i = lse[row], delta_i = delta[row];

    float acc[kRefDimsPerLane] = {};
    for (int j0 = 0; j0 <= i; j0 += 32) {
        const int j = j0 + lane;
        float dsj = 0.0f;
        if (j <= i) {
            const E* k = kbase + (int64_t)j * d.QKV;
            const E* v = vbase + (int64_t)j * d.QKV;
            float qk = 0.0f, gv = 0.0f;
            for (int x = 0; x < d.hs; x++) {
                qk += q[x] * to_float(k[x]);
                gv += g[x] * to_float(v[x]);
            }
            dsj = expf(qk * scale - lse_i) * (gv - delta_i);
        }
        ds[lane] = dsj;
        __syncwarp();
        const int n = min(32, i - j0 + 1);
#pragma unroll
        for (int r = 0; r < kRefDimsPerLane; r++) {
            const int x = lane + 32 * r;
            if (x < d.hs) {
                float a = acc[r];
                for (int c = 0; c < n; c++)
                    a += ds[c] * to_float(kbase[(int64_t)(j0 + c) * d.QKV + x]);
                acc[r] = a;
            }
        }
        __syncwarp();
    }
    E* dq = dqkv + ((int64_t)b * d.T + i) * d.QKV + (int64_t)h * d.hs;
#pragma unroll
    for (int r = 0; r < kRefDimsPerLane; r++) {
        const int x = lane + 32 * r;
        if (x < d.hs) dq[x] = from_float<E>(acc[r] * scale);
    }
}

// Row r = (b, g, j) of (B,NKV,T), kv head g, key j: over the group's query heads h in order, then
// the queries i >= j in order,
//   dv_j = sum p_ij dout_i,   dk_j = scale * sum p_ij (dout_i . v_j - delta_i) q_i.
// Shared memory per warp: k_j, v_j (hs floats each), then the chunk's p and d(scores) (32 each).
template <typename E>
static __global__ void __launch_bounds__(kRefThreads)
    reference_dkv_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* delta,
                         Dims d, float scale) {
    MT_DYNAMIC_SHARED(float, smem);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * kRefRows + warp;
    if (row >= (int64_t)d.B * d.NKV * d.T) return;
    const int j = (int)(row % d.T);
    const int kvh = (int)((row / d.T) % d.NKV);
    const int b = (int)(row / ((int64_t)d.T * d.NKV));
    float* k = smem + warp * (2 * d.hs + 64);
    float* v = k + d.hs;
    float* p = v + d.hs;
    float* ds = p + 32;
    const E* batch = qkv + (int64_t)b * d.T * d.QKV;
    const E* ksrc = batch + (int64_t)j * d.QKV + d.C + (int64_t)kvh * d.hs;
    const E* vsrc = ksrc + (int64_t)d.NKV * d.hs;
    for (int x = lane; x < d.hs; x += 32) {
        k[x] = to_float(ksrc[x]);
        v[x] = to_float(vsrc[x]);
    }
    __syncwarp();

    float dk[kRefDimsPerLane] = {}, dv[kRefDimsPerLane] = {};
    for (int h = kvh * d.group; h < (kvh + 1) * d.group; h++) {
        const E* qbase = batch + (int64_t)h * d.hs;
        const E* gbase = dout + (int64_t)b * d.T * d.C + (int64_t)h * d.hs;
        const float* lse_h = lse + ((int64_t)b * d.NH + h) * d.T;
        const float* delta_h = delta + ((int64_t)b * d.NH + h) * d.T;
        for (int i0 = j; i0 < d.T; i0 += 32) {
            const int i = i0 + lane;
            float pi = 0.0f, dsi = 0.0f;
            if (i < d.T) {
                const E* q = qbase + (int64_t)i * d.QKV;
                const E* g = gbase + (int64_t)i * d.C;
                float qk = 0.0f, gv = 0.0f;
                for (int x = 0; x < d.hs; x++) {
                    qk += to_float(q[x]) * k[x];
                    gv += to_float(g[x]) * v[x];
                }
                pi = expf(qk * scale - lse_h[i]);
                dsi = pi * (gv - delta_h[i]);
            }
            p[lane] = pi;
            ds[lane] = dsi;
            __syncwarp();
            const int n = min(32, d.T - i0);
#pragma unroll
            for (int r = 0; r < kRefDimsPerLane; r++) {
                const int x = lane + 32 * r;
                if (x < d.hs) {
                    float a = dv[r], c = dk[r];
                    for (int e = 0; e < n; e++) {
                        a += p[e] * to_float(gbase[(int64_t)(i0 + e) * d.C + x]);
                        c += ds[e] * to_float(qbase[(int64_t)(i0 + e) * d.QKV + x]);
                    }
                    dv[r] = a;
                    dk[r] = c;
                }
            }
            __syncwarp();
        }
    }
    E* dkdst = dqkv + ((int64_t)b * d.T + j) * d.QKV + d.C + (int64_t)kvh * d.hs;
    E* dvdst = dkdst + (int64_t)d.NKV * d.hs;
#pragma unroll
    for (int r = 0; r < kRefDimsPerLane; r++) {
        const int x = lane + 32 * r;
        if (x < d.hs) {
            dkdst[x] = from_float<E>(dk[r] * scale);
            dvdst[x] = from_float<E>(dv[r]);
        }
    }
}

// ---- launch ------------------------------------------------------------------------------------

static unsigned row_blocks(int64_t rows) {
    return grid_x(ceil_div(rows, kRefRows), "attention row blocks");
}

template <typename E>
void attention_detail::launch_delta(float* delta, const E* dout, const E* out, const Dims& d,
                                    cudaStream_t stream) {
    MT_LAUNCH(attention_delta_kernel<E>, row_blocks((int64_t)d.B * d.NH * d.T), kRefThreads, 0,
              stream, delta, dout, out, d);
}

template <typename E>
static void launch_reference_forward(E* out, float* lse, const E* qkv, const Dims& d,
                                     cudaStream_t stream) {
    const float scale = 1.0f / std::sqrt((float)d.hs);
    const size_t smem = (size_t)kRefRows * (d.hs + 32) * sizeof(float);
    MT_LAUNCH(reference_forward_kernel<E>, row_blocks((int64_t)d.B * d.NH * d.T), kRefThreads, smem,
              stream, out, lse, qkv, d, scale);
}

template <typename E>
static void launch_reference_backward(E* dqkv, float* delta, const E* dout, const E* qkv,
                                      const E* out, const float* lse, const Dims& d,
                                      cudaStream_t stream) {
    const float scale = 1.0f / std::sqrt((float)d.hs);
    attention_detail::launch_delta(delta, dout, out, d, stream);
    const size_t dq_smem = (size_t)kRefRows * (2 * d.hs + 32) * sizeof(float);
    MT_LAUNCH(reference_dq_kernel<E>, row_blocks((int64_t)d.B * d.NH * d.T), kRefThreads, dq_smem,
              stream, dqkv, dout, qkv, lse, delta, d, scale);
    const size_t dkv_smem = (size_t)kRefRows * (2 * d.hs + 64) * sizeof(float);
    MT_LAUNCH(reference_dkv_kernel<E>, row_blocks((int64_t)d.B * d.NKV * d.T), kRefThreads,
              dkv_smem, stream, dqkv, dout, qkv, lse, delta, d, scale);
}

// ---- entries -----------------------------------------------------------------------------------

template <typename E>
void attention_forward_reference(E* out, float* lse, const E* qkv, int B, int T, int C, int NH,
                                 int NKV, cudaStream_t stream) {
    const Dims d =
        attention_detail::check_dims("attention_forward_reference", B, T, C, NH, NKV, kRefMaxHs);
    launch_reference_forward(out, lse, qkv, d, stream);
}

template <typename E>
void attention_backward_reference(E* dqkv, float* delta, const E* dout, const E* qkv, const E* out,
                                  const float* lse, int B, int T, int C, int NH, int NKV,
                                  cudaStream_t stream) {
    const Dims d =
        attention_detail::check_dims("attention_backward_reference", B, T, C, NH, NKV, kRefMaxHs);
    launch_reference_backward(dqkv, delta, dout, qkv, out, lse, d, stream);
}

// The head sizes the tensor-core kernels are compiled for.
static bool tensor_core_head(int hs) {
    return hs == 64 || hs == 128;
}

template <typename E>
void attention_forward(E* out, float* lse, const E* qkv, int B, int T, int C, int NH, int NKV,
                       cudaStream_t stream) {
    const Dims d = attention_detail::check_dims("attention_forward", B, T, C, NH, NKV, kRefMaxHs);
    if constexpr (!std::is_same_v<E, float>) {
        if (tensor_core_head(d.hs)) {
            attention_forward_tensor_core(out, lse, qkv, B, T, C, NH, NKV, stream);
            return;
        }
    }
    launch_reference_forward(out, lse, qkv, d, stream);
}

template <typename E>
void attention_backward(E* dqkv, float* delta, const E* dout, const E* qkv, const E* out,
                        const float* lse, int B, int T, int C, int NH, int NKV,
                        cudaStream_t stream) {
    const Dims d = attention_detail::check_dims("attention_backward", B, T, C, NH, NKV, kRefMaxHs);
    if constexpr (!std::is_same_v<E, float>) {
        if (tensor_core_head(d.hs)) {
            attention_backward_tensor_core(dqkv, delta, dout, qkv, out, lse, B, T, C, NH, NKV,
                                           stream);
            return;
        }
    }
    launch_reference_backward(dqkv, delta, dout, qkv, out, lse, d, stream);
}

#define MT_INSTANTIATE_ATTENTION(E)                                                             \
    template void attention_forward<E>(E*, float*, const E*, int, int, int, int, int,           \
                                       cudaStream_t);                                           \
    template void attention_backward<E>(E*, float*, const E*, const E*, const E*, const float*, \
                                        int, int, int, int, int, cudaStream_t);                 \
    template void attention_forward_reference<E>(E*, float*, const E*, int, int, int, int, int, \
                                                 cudaStream_t);                                 \
    template void attention_backward_reference<E>(E*, float*, const E*, const E*, const E*,     \
                                                  const float*, int, int, int, int, int,        \
                                                  cudaStream_t);                                \
    template void attention_detail::launch_delta<E>(float*, const E*, const E*, const Dims&,    \
                                                    cudaStream_t);
MT_INSTANTIATE_ATTENTION(float)
MT_INSTANTIATE_ATTENTION(__nv_bfloat16)
MT_INSTANTIATE_ATTENTION(__half)
#undef MT_INSTANTIATE_ATTENTION

}  // namespace memtrain::cuda
