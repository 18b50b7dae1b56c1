// Causal grouped-query attention on the GPU.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- attention (causal, grouped-query; qkv packed as [q | k | v]; see cpu/ops.h) ---------------
// This first version materialises att (B,NH,T,T) like the CPU path (no flash attention yet).
void attention_forward(float* out /*(B,T,C)*/, float* att /*(B,NH,T,T) softmax probabilities*/,
                       const float* qkv /*(B,T,QKV)*/, int B, int T, int C, int NH, int NKV,
                       cudaStream_t stream = 0);
// dqkv is overwritten. Unlike the CPU version it takes a (B,NH,T,T) scratch for d(pre-softmax)
// from device_scratch(). d(k) and d(v) are summed over the group's query heads in order.
void attention_backward(float* dqkv /*(B,T,QKV)*/, const float* dout /*(B,T,C)*/,
                        const float* qkv /*(B,T,QKV)*/, const float* att /*(B,NH,T,T)*/, int B,
                        int T, int C, int NH, int NKV, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
