// Token + position embedding on the GPU (see cpu/ops.h for the semantics), for T in {float,
// __nv_bfloat16, __half}.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- embedding -------------------------------------------------------------------------------
// T is the storage type, so the sequence length is named T_ (the T of the shape comments).
// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:] (wpe null: rotary models have no position table).
template <typename T>
void embedding_forward(T* out /*(B,T,C)*/, const int32_t* inp /*(B,T) device*/,
                       const T* wte /*(Vp,C)*/, const T* wpe /*(maxT,C) or null*/, int B, int T_,
                       int C, cudaStream_t stream = 0);
// Accumulates into dwte and dwpe (null: none). d(wte) rows are summed in the token order of
// `plan`, the bucket_tokens() plan of the micro-batch's ids (token_buckets.h) built on the host
// from the host copy of the tokens and uploaded by the caller (N + 2U + 1 ints, U = `unique`),
// so the backward never copies ids back from the GPU and can be captured in a CUDA graph. Sums
// run in fp32 in the CPU's (b,t) order, starting from the existing gradient value: for T = float
// the result equals the CPU's bits.
template <typename T>
void embedding_backward(T* dwte /*(Vp,C)*/, T* dwpe /*(maxT,C) or null*/, const T* dout /*(B,T,C)*/,
                        const int32_t* plan /*(B*T + 2U + 1) device*/, int unique, int B, int T_,
                        int C, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
