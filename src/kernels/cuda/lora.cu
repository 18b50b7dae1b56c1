// LoRA's kernels on the GPU (see lora.h): the adapters' dropout and the QLoRA base's decoders.
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/dropout_mask.h"

namespace memtrain::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void lora_dropout_kernel(T* out, const T* x, int64_t n, uint64_t key, double p,
                                    float keep) {
    MT_GRID_STRIDE(i, n) {
        out[i] = from_float<T>(to_float(x[i]) * dropout_mask::factor(key, (uint64_t)i, p, keep));
    }
}

template <typename T>
__global__ void lora_masked_add_kernel(T* dx, const T* t, int64_t n, uint64_t key, double p,
                                       float keep) {
    MT_GRID_STRIDE(i, n) {
        const float f = dropout_mask::factor(key, (uint64_t)i, p, keep);
        dx[i] = from_float<T>(to_float(dx[i]) + to_float(t[i]) * f);
    }
}

// IEEE half bits to float, exactly (quant::f16_to_f32).
__device__ __forceinline__ float half_bits(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float v = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
        return sign ? -v : v;
    }
    const uint32_t bits =
        exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

// Nibble e of an LSB-first 4-bit stream.
__device__ __forceinline__ int nibble(const uint8_t* codes, int64_t e) {
    return (codes[e >> 1] >> ((e & 1) * 4)) & 15;
}

// One thread per element of the (in, out) output: o = j * rows + i holds (row i, column j).
template <typename T>
__global__ void dequant_int8_kernel(T* out, const uint8_t* codes, const uint16_t* scales,
                                    int64_t rows, int64_t cols) {
    MT_GRID_STRIDE(o, rows * cols) {
        const int64_t i = o % rows, j = o / rows;
        out[o] = from_float<T>((float)((int)codes[i * cols + j] - 127) * half_bits(scales[i]));
    }
}

template <typename T>
__global__ void dequant_int4_kernel(T* out, const uint8_t* codes, const uint16_t* scales,
                                    int64_t rows, int64_t cols, int group) {
    MT_GRID_STRIDE(o, rows * cols) {
        const int64_t i = o % rows, j = o / rows;
        const float s = half_bits(scales[i * (cols / group) + j / group]);
        out[o] = from_float<T>((float)(nibble(codes, i * cols + j) - 7) * s);
    }
}

template <typename T>
__global__ void dequant_nf4_kernel(T* out, const uint8_t* codes, const uint8_t* absmax_q,
                                   const float* absmax_scale, int64_t rows, int64_t cols, int group,
                                   int dq_block, Nf4Levels levels) {
    MT_GRID_STRIDE(o, rows * cols) {
        const int64_t i = o % rows, j = o / rows;
        const int64_t k = i * (cols / group) + j / group;
        const float absmax = (float)absmax_q[k] * absmax_scale[k / dq_block];
        out[o] = from_float<T>(levels.v[nibble(codes, i * cols + j)] * absmax);
    }
}

void check_matrix(const char* op, int64_t rows, int64_t cols, int group) {
    if (rows <= 0 || cols <= 0 || group <= 0 || cols % group != 0)
        fail("cuda::{}: rows {} cols {} group {}, expected positive sizes and group | cols", op,
             rows, cols, group);
}

}  // namespace

template <typename T>
void lora_dropout(T* out, const T* x, int64_t n, uint64_t key, double p, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(lora_dropout_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, x,
              n, key, p, (float)(1.0 / (1.0 - p)));
}

template <typename T>
void lora_masked_add(T* dx, const T* t, int64_t n, uint64_t key, double p, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(lora_masked_add_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, dx,
              t, n, key, p, (float)(1.0 / (1.0 - p)));
}

template <typename T>
void dequant_int8(T* out, const uint8_t* codes, const uint16_t* scales, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
    check_matrix("dequant_int8", rows, cols, 1);
    MT_LAUNCH(dequant_int8_kernel<T>, elementwise_blocks(rows * cols, kThreads), kThreads, 0,
              stream, out, codes, scales, rows, cols);
}

template <typename T>
void dequant_int4(T* out, const uint8_t* codes, const uint16_t* scales, int64_t rows, int64_t cols,
                  int group, cudaStream_t stream) {
    check_matrix("dequant_int4", rows, cols, group);
    MT_LAUNCH(dequant_int4_kernel<T>, elementwise_blocks(rows * cols, kThreads), kThreads, 0,
              stream, out, codes, scales, rows, cols, group);
}

template <typename T>
void dequant_nf4(T* out, const uint8_t* codes, const uint8_t* absmax_q, const float* absmax_scale,
                 int64_t rows, int64_t cols, int group, int dq_block, const Nf4Levels& levels,
                 cudaStream_t stream) {
    check_matrix("dequant_nf4", rows, cols, group);
    if (dq_block <= 0) fail("cuda::dequant_nf4: dq_block {} must be positive", dq_block);
    MT_LAUNCH(dequant_nf4_kernel<T>, elementwise_blocks(rows * cols, kThreads), kThreads, 0, stream,
              out, codes, absmax_q, absmax_scale, rows, cols, group, dq_block, levels);
}

#define MT_INSTANTIATE(T)                                                                     \
    template void lora_dropout<T>(T*, const T*, int64_t, uint64_t, double, cudaStream_t);     \
    template void lora_masked_add<T>(T*, const T*, int64_t, uint64_t, double, cudaStream_t);  \
    template void dequant_int8<T>(T*, const uint8_t*, const uint16_t*, int64_t, int64_t,      \
                                  cudaStream_t);                                              \
    template void dequant_int4<T>(T*, const uint8_t*, const uint16_t*, int64_t, int64_t, int, \
                                  cudaStream_t);                                              \
    template void dequant_nf4<T>(T*, const uint8_t*, const uint8_t*, const float*, int64_t,   \
                                 int64_t, int, int, const Nf4Levels&, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
