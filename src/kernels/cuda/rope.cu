// Rotary position embedding on the GPU, in place on the q and k heads of the packed qkv buffer.
// A block takes one position t and up to kRopeRows batch rows: its threads first compute the
// position's cos/sin table in double, exactly as the CPU does (so the rounded float values are
// the CPU's up to the device's double sin/cos/pow), keep it in shared memory, then rotate the
// rows' (i, i + hs/2) pairs over 128-bit packs where the pointer and hs allow (pack.cuh).
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace memtrain::cuda {

constexpr int kRopeThreads = 128;
constexpr int kRopeRows = 8;  // batch rows per block: the table is computed once for them

// sign = +1 rotates by +angle (forward), -1 by -angle (backward). Dynamic shared memory: the cos
// and sin tables, hs/2 floats each.
template <typename T, int W>
static __global__ void rope_kernel(T* qkv, int B, int T_, int NH, int NKV, int hs, float theta,
                                   float sign) {
    MT_DYNAMIC_SHARED(float, table);
    const int half = hs / 2, t = blockIdx.x;
    float* cs = table;
    float* sn = table + half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double inv_freq = pow((double)theta, -2.0 * i / hs);
        const double a = t * inv_freq;
        cs[i] = (float)cos(a);
        sn[i] = sign * (float)sin(a);
    }
    __syncthreads();

    // Work item: (row j of the block, head h, pack p of the first half), p fastest so that
    // neighbouring threads touch neighbouring memory.
    const int b0 = blockIdx.y * kRopeRows;
    const int rows = B - b0 < kRopeRows ? B - b0 : kRopeRows;
    const int hp = half / W, heads = NH + NKV;
    const int64_t QKV = (int64_t)(NH + 2 * NKV) * hs;
    for (int item = threadIdx.x; item < rows * heads * hp; item += blockDim.x) {
        const int p = item % hp, h = (item / hp) % heads, j = item / (hp * heads);
        // q heads then k heads are contiguous: [q (NH hs) | k (NKV hs) | v].
        T* x = qkv + ((int64_t)(b0 + j) * T_ + t) * QKV + (int64_t)h * hs + p * W;
        float x1[W], x2[W];
        load_floats<T, W>(x, x1);
        load_floats<T, W>(x + half, x2);
        float y1[W], y2[W];
#pragma unroll
        for (int q = 0; q < W; q++) {
            const float c = cs[p * W + q], s = sn[p * W + q];
            y1[q] = x1[q] * c - x2[q] * s;
            y2[q] = x2[q] * c + x1[q] * s;
        }
        store_floats<T, W>(x, y1);
        store_floats<T, W>(x + half, y2);
    }
}

template <typename T, int W>
static void launch_rope(T* qkv, int B, int T_, int NH, int NKV, int hs, float theta, float sign,
                        cudaStream_t stream) {
    dim3 grid((unsigned)T_, (unsigned)ceil_div(B, kRopeRows));
    MT_LAUNCH((rope_kernel<T, W>), grid, kRopeThreads, (size_t)hs * sizeof(float), stream, qkv, B,
              T_, NH, NKV, hs, theta, sign);
}

template <typename T>
static void rope(const char* op, T* qkv, int B, int T_, int NH, int NKV, int hs, float theta,
                 float sign, cudaStream_t stream) {
    if (B < 0 || T_ < 0 || NH <= 0 || NKV <= 0 || hs <= 0 || hs % 2 != 0) {
        fail(
            "cuda::{}: B = {}, T = {}, NH = {}, NKV = {}, hs = {}, expected B, T >= 0, NH, NKV > 0 "
            "and hs even and > 0",
            op, B, T_, NH, NKV, hs);
    }
    if (!(theta > 0.0f)) fail("cuda::{}: theta is {}, expected > 0", op, theta);
    if (ceil_div(B, kRopeRows) > 65535) fail("cuda::{}: B = {} is too large", op, B);
    if ((int64_t)B * T_ == 0) return;
    // Both halves of every head start on a 16-byte boundary when hs/2 is a multiple of the pack.
    if ((hs / 2) % kPackWidth<T> == 0 && aligned16(qkv)) {
        launch_rope<T, kPackWidth<T>>(qkv, B, T_, NH, NKV, hs, theta, sign, stream);
    } else {
        launch_rope<T, 1>(qkv, B, T_, NH, NKV, hs, theta, sign, stream);
    }
}

template <typename T>
void rope_forward(T* qkv, int B, int T_, int NH, int NKV, int hs, float theta,
                  cudaStream_t stream) {
    rope<T>("rope_forward", qkv, B, T_, NH, NKV, hs, theta, 1.0f, stream);
}

template <typename T>
void rope_backward(T* dqkv, int B, int T_, int NH, int NKV, int hs, float theta,
                   cudaStream_t stream) {
    rope<T>("rope_backward", dqkv, B, T_, NH, NKV, hs, theta, -1.0f, stream);
}

#define MT_INSTANTIATE(T)                                                            \
    template void rope_forward<T>(T*, int, int, int, int, int, float, cudaStream_t); \
    template void rope_backward<T>(T*, int, int, int, int, int, float, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
