// LoRA on the GPU: the adapters' dropout (the mask of kernels/dropout_mask.h, the CPU's bit for
// bit) and the frozen QLoRA base's dequantization (quant/quantized_store.h's formats, decoded to
// T). Included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- dropout on an adapter's input -------------------------------------------------------------
// out[i] = x[i] * factor(key, i): 0 with probability p, else 1 / (1 - p) (dropout_mask::factor).
template <typename T>
void lora_dropout(T* out /*(n)*/, const T* x /*(n)*/, int64_t n, uint64_t key, double p,
                  cudaStream_t stream = 0);
// dx[i] += t[i] * factor(key, i): the gradient through the same mask.
template <typename T>
void lora_masked_add(T* dx /*(n)*/, const T* t /*(n)*/, int64_t n, uint64_t key, double p,
                     cudaStream_t stream = 0);

// ---- the quantized base's block matrices -------------------------------------------------------
// One packed matrix of `rows` outputs x `cols` inputs (quant/quantized_store.h), decoded into the
// (in, out) layout the model reads: out[j * rows + i] = value (i, j), computed as the CPU decodes
// it (fp32 products, then one rounding to T). codes: LSB-first bitstream, 8 bits (int8) or 4 bits
// per weight; scales: fp16 bits, one per row (int8) or per `group` inputs (int4); NF4: one uint8
// absmax code per block of `group` inputs, times one fp32 scale per `dq_block` blocks, times
// `levels`, the 16 NF4 levels.
struct Nf4Levels {
    float v[16];
};
template <typename T>
void dequant_int8(T* out, const uint8_t* codes, const uint16_t* scales, int64_t rows, int64_t cols,
                  cudaStream_t stream = 0);
template <typename T>
void dequant_int4(T* out, const uint8_t* codes, const uint16_t* scales, int64_t rows, int64_t cols,
                  int group, cudaStream_t stream = 0);
template <typename T>
void dequant_nf4(T* out, const uint8_t* codes, const uint8_t* absmax_q, const float* absmax_scale,
                 int64_t rows, int64_t cols, int group, int dq_block, const Nf4Levels& levels,
                 cudaStream_t stream = 0);

}  // namespace memtrain::cuda
