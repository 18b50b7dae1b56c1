// Causal grouped-query attention on the GPU, first version: it materialises the (B,NH,T,T)
// probabilities as the CPU path does, and its backward a (B,NH,T,T) d(pre-softmax) scratch. Each
// output element has one thread that walks its sum in the CPU's order, so there are no atomics:
//   forward:  a warp per query row for the scores and softmax; a thread per out[b,t,h,d];
//   backward: a warp per row for d(pre-softmax); a thread per d(q) element (keys in order); a
//             thread per d(k), d(v) element (the group's query heads, then the queries, in order).
// A flash-attention kernel that keeps neither (T,T) array is the next step (docs/cuda.md).
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

constexpr int kRowThreads = 256;  // 8 warps: 8 rows of scores per block
constexpr int kRowsPerBlock = kRowThreads / 32;
constexpr int kThreads = 256;

struct Dims {
    int B, T, C, NH, NKV, hs, QKV, group;
};

static Dims check_dims(const char* op, int B, int T, int C, int NH, int NKV) {
    if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || NKV <= 0 || C % NH != 0 || NH % NKV != 0) {
        fail(
            "cuda::{}: B {} T {} C {} NH {} NKV {}: expected positive sizes, C % NH == 0 and NH "
            "% NKV == 0",
            op, B, T, C, NH, NKV);
    }
    const int hs = C / NH;
    if (hs > 1024) fail("cuda::{}: head size {} is above the supported 1024", op, hs);
    return Dims{B, T, C, NH, NKV, hs, C + 2 * NKV * hs, NH / NKV};
}

// Row r = (b, h, i): att[r, j] = softmax_j(q_i . k_j * scale) for j <= i, 0 for j > i. The lanes
// split the keys; the query row sits in shared memory.
static __global__ void attention_softmax_kernel(float* att, const float* qkv, Dims d, float scale) {
    MT_DYNAMIC_SHARED(float, shared_q);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + warp;
    if (row >= (int64_t)d.B * d.NH * d.T) return;
    const int i = (int)(row % d.T);
    const int h = (int)((row / d.T) % d.NH);
    const int b = (int)(row / ((int64_t)d.T * d.NH));
    float* q = shared_q + warp * d.hs;
    const float* qsrc = qkv + ((int64_t)b * d.T + i) * d.QKV + h * d.hs;
    for (int x = lane; x < d.hs; x += 32) q[x] = qsrc[x];
    __syncwarp();
    const float* kbase = qkv + (int64_t)b * d.T * d.QKV + d.C + (h / d.group) * d.hs;
    float* a = att + row * d.T;

    float maxv = -INFINITY;
    for (int j = lane; j <= i; j += 32) {
        const float* k = kbase + (int64_t)j * d.QKV;
        float s = 0.0f;
        for (int x = 0; x < d.hs; x++) s += q[x] * k[x];
        s *= scale;
        a[j] = s;
        maxv = fmaxf(maxv, s);
    }
    maxv = warp_max(maxv);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += 32) {
        float e = expf(a[j] - maxv);
        a[j] = e;
        sum += e;
    }
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j <= i; j += 32) a[j] *= inv;
    for (int j = i + 1 + lane; j < d.T; j += 32) a[j] = 0.0f;
}

// out[b, i, h, x] = sum_{j <= i} att[b, h, i, j] * v[b, j, h / group, x], j in order.
static __global__ void attention_out_kernel(float* out, const float* att, const float* qkv,
                                            Dims d) {
    MT_GRID_STRIDE(idx, (int64_t)d.B * d.T * d.C) {
        const int x = (int)(idx % d.hs);
        const int h = (int)((idx / d.hs) % d.NH);
        const int i = (int)((idx / d.C) % d.T);
        const int b = (int)(idx / ((int64_t)d.T * d.C));
        const float* a = att + (((int64_t)b * d.NH + h) * d.T + i) * d.T;
        const float* v = qkv + (int64_t)b * d.T * d.QKV + d.C + (d.NKV + h / d.group) * d.hs + x;
        float acc = 0.0f;
        for (int j = 0; j <= i; j++) acc += a[j] * v[(int64_t)j * d.QKV];
        out[idx] = acc;
    }
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       int NKV, cudaStream_t stream) {
    const Dims d = check_dims("attention_forward", B, T, C, NH, NKV);
    const float scale = 1.0f / std::sqrt((float)d.hs);
    const int64_t rows = (int64_t)B * NH * T;
    const size_t smem = (size_t)kRowsPerBlock * d.hs * sizeof(float);
    MT_LAUNCH(attention_softmax_kernel, (unsigned)ceil_div(rows, kRowsPerBlock), kRowThreads, smem,
              stream, att, qkv, d, scale);
    const int64_t n = (int64_t)B * T * C;
    MT_LAUNCH(attention_out_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, att,
              qkv, d);
}

// Row r = (b, h, i): datt_j = dout_i . v_j, s = sum_j att_j datt_j,
// dpre[r, j] = att_j (datt_j - s) * scale for j <= i (entries j > i are never read).
static __global__ void attention_dpre_kernel(float* dpre, const float* dout, const float* qkv,
                                             const float* att, Dims d, float scale) {
    MT_DYNAMIC_SHARED(float, shared_do);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + warp;
    if (row >= (int64_t)d.B * d.NH * d.T) return;
    const int i = (int)(row % d.T);
    const int h = (int)((row / d.T) % d.NH);
    const int b = (int)(row / ((int64_t)d.T * d.NH));
    float* g = shared_do + warp * d.hs;
    const float* gsrc = dout + ((int64_t)b * d.T + i) * d.C + h * d.hs;
    for (int x = lane; x < d.hs; x += 32) g[x] = gsrc[x];
    __syncwarp();
    const float* vbase = qkv + (int64_t)b * d.T * d.QKV + d.C + (d.NKV + h / d.group) * d.hs;
    const float* a = att + row * d.T;
    float* p = dpre + row * d.T;

    float s = 0.0f;
    for (int j = lane; j <= i; j += 32) {
        const float* v = vbase + (int64_t)j * d.QKV;
        float da = 0.0f;
        for (int x = 0; x < d.hs; x++) da += g[x] * v[x];
        p[j] = da;
        s += a[j] * da;
    }
    s = warp_sum(s);
    for (int j = lane; j <= i; j += 32) p[j] = a[j] * (p[j] - s) * scale;
}

// dq[b, i, h, x] = sum_{j <= i} dpre[b, h, i, j] * k[b, j, h / group, x], j in order.
static __global__ void attention_dq_kernel(float* dqkv, const float* dpre, const float* qkv,
                                           Dims d) {
    MT_GRID_STRIDE(idx, (int64_t)d.B * d.T * d.C) {
        const int x = (int)(idx % d.hs);
        const int h = (int)((idx / d.hs) % d.NH);
        const int i = (int)((idx / d.C) % d.T);
        const int b = (int)(idx / ((int64_t)d.T * d.C));
        const float* p = dpre + (((int64_t)b * d.NH + h) * d.T + i) * d.T;
        const float* k = qkv + (int64_t)b * d.T * d.QKV + d.C + (h / d.group) * d.hs + x;
        float acc = 0.0f;
        for (int j = 0; j <= i; j++) acc += p[j] * k[(int64_t)j * d.QKV];
        dqkv[((int64_t)b * d.T + i) * d.QKV + h * d.hs + x] = acc;
    }
}

// For kv head g and key j: dk[b, j, g, x] = sum_h sum_{i >= j} dpre[b, h, i, j] * q[b, i, h, x]
// and dv[b, j, g, x] = sum_h sum_{i >= j} att[b, h, i, j] * dout[b, i, h, x], over the group's
// query heads h in order, then i in order (the CPU's order).
static __global__ void attention_dkv_kernel(float* dqkv, const float* dpre, const float* att,
                                            const float* dout, const float* qkv, Dims d) {
    const int kvw = d.NKV * d.hs;
    MT_GRID_STRIDE(idx, (int64_t)d.B * d.T * kvw) {
        const int x = (int)(idx % d.hs);
        const int g = (int)((idx / d.hs) % d.NKV);
        const int j = (int)((idx / kvw) % d.T);
        const int b = (int)(idx / ((int64_t)d.T * kvw));
        float dk = 0.0f, dv = 0.0f;
        for (int h = g * d.group; h < (g + 1) * d.group; h++) {
            const int64_t bh = (int64_t)b * d.NH + h;
            for (int i = j; i < d.T; i++) {
                const int64_t e = (bh * d.T + i) * d.T + j;
                const int64_t bi = (int64_t)b * d.T + i;
                dk += dpre[e] * qkv[bi * d.QKV + h * d.hs + x];
                dv += att[e] * dout[bi * d.C + h * d.hs + x];
            }
        }
        float* dst = dqkv + ((int64_t)b * d.T + j) * d.QKV + d.C + g * d.hs + x;
        dst[0] = dk;
        dst[kvw] = dv;
    }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH, int NKV, cudaStream_t stream) {
    const Dims d = check_dims("attention_backward", B, T, C, NH, NKV);
    const float scale = 1.0f / std::sqrt((float)d.hs);
    const int64_t rows = (int64_t)B * NH * T;
    float* dpre = static_cast<float*>(device_scratch((size_t)rows * T * sizeof(float)));
    const size_t smem = (size_t)kRowsPerBlock * d.hs * sizeof(float);
    MT_LAUNCH(attention_dpre_kernel, (unsigned)ceil_div(rows, kRowsPerBlock), kRowThreads, smem,
              stream, dpre, dout, qkv, att, d, scale);
    const int64_t nq = (int64_t)B * T * C;
    MT_LAUNCH(attention_dq_kernel, elementwise_blocks(nq, kThreads), kThreads, 0, stream, dqkv,
              dpre, qkv, d);
    const int64_t nkv = (int64_t)B * T * NKV * d.hs;
    MT_LAUNCH(attention_dkv_kernel, elementwise_blocks(nkv, kThreads), kThreads, 0, stream, dqkv,
              dpre, att, dout, qkv, d);
}

}  // namespace memtrain::cuda
