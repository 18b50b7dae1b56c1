// Rotary position embedding on the GPU, for T in {float, __nv_bfloat16, __half}.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- rope ------------------------------------------------------------------------------------
// T is the storage type, so the sequence length is named T_ (the T of the shape comments).
// Rotate-half rotary embedding in place on the q (NH heads) and k (NKV heads) parts of packed qkv
// rows, QKV = (NH + 2 NKV) hs wide, as cpu::rope_forward: pair (i, i + hs/2) of every q and k head
// at position t turns by t * theta^(-2i/hs), the angle computed in double and its cos and sin
// rounded to float; v is untouched. hs must be even.
template <typename T>
void rope_forward(T* qkv /*(B,T,QKV)*/, int B, int T_, int NH, int NKV, int hs, float theta,
                  cudaStream_t stream = 0);
// The inverse rotation (the forward's transpose), in place on d(qkv).
template <typename T>
void rope_backward(T* dqkv /*(B,T,QKV)*/, int B, int T_, int NH, int NKV, int hs, float theta,
                   cudaStream_t stream = 0);

}  // namespace memtrain::cuda
