// Causal grouped-query attention on the GPU, fused (flash attention): no (T,T) matrix is ever
// stored; the forward saves the per-row log-sum-exp instead and the backward recomputes the
// probabilities from it. Semantics of kernels/cpu/attention.cpp on device pointers, with the
// stream last (kernels/README.md); included through kernels/cuda/ops.h.
//
// E is the storage type of qkv, out, dout and dqkv: float, __nv_bfloat16 or __half (the template
// parameter is not called T because T is the sequence length). Arithmetic is fp32 throughout.
// Every entry is deterministic: no atomics, every sum in an order fixed by the shapes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- attention (causal, grouped-query; qkv packed as [q | k | v]; see cpu/ops.h) ---------------
// Causal grouped-query attention without the (T,T) matrix: qkv rows are packed
// [q (NH heads) | k (NKV heads) | v (NKV heads)], head size hs = C / NH, query head h uses kv
// head h / (NH / NKV), scale 1/sqrt(hs) (exactly src/kernels/cpu/attention.cpp's semantics).
// The forward writes, for each query row, the natural log of the sum over its keys j <= i of
// exp(scale * q.k_j) (the log-sum-exp the backward needs).
// Dispatch: the tensor-core kernels when E is bf16/fp16 and hs is 64 or 128, else the reference
// kernels (any E, hs <= 256).
template <typename E>
void attention_forward(E* out /*(B,T,C)*/, float* lse /*(B,NH,T)*/, const E* qkv /*(B,T,QKV)*/,
                       int B, int T, int C, int NH, int NKV, cudaStream_t stream = 0);
// dqkv (B,T,QKV) is overwritten (q, k and v parts). delta (B,NH,T) is fp32 scratch this call
// fills (rowsum(dout * out) per query row).
template <typename E>
void attention_backward(E* dqkv /*(B,T,QKV)*/, float* delta /*(B,NH,T)*/, const E* dout /*(B,T,C)*/,
                        const E* qkv /*(B,T,QKV)*/, const E* out /*(B,T,C)*/,
                        const float* lse /*(B,NH,T)*/, int B, int T, int C, int NH, int NKV,
                        cudaStream_t stream = 0);

// The two implementations behind the entries above, callable directly (tests run both on the
// same inputs). Same arguments and results.
//
// Reference: any E, hs <= 256, fp32 arithmetic, one warp per query row (forward, d(q)) or per key
// row (d(k), d(v)) walking its keys / queries in order. What fp32 training runs.
template <typename E>
void attention_forward_reference(E* out /*(B,T,C)*/, float* lse /*(B,NH,T)*/,
                                 const E* qkv /*(B,T,QKV)*/, int B, int T, int C, int NH, int NKV,
                                 cudaStream_t stream = 0);
template <typename E>
void attention_backward_reference(E* dqkv /*(B,T,QKV)*/, float* delta /*(B,NH,T)*/,
                                  const E* dout /*(B,T,C)*/, const E* qkv /*(B,T,QKV)*/,
                                  const E* out /*(B,T,C)*/, const float* lse /*(B,NH,T)*/, int B,
                                  int T, int C, int NH, int NKV, cudaStream_t stream = 0);
// Tensor cores (FlashAttention-2 on mma.sync m16n8k16, fp32 accumulation): E = __nv_bfloat16 or
// __half only (instantiated for those two), hs = 64 or 128; other head sizes fail.
template <typename E>
void attention_forward_tensor_core(E* out /*(B,T,C)*/, float* lse /*(B,NH,T)*/,
                                   const E* qkv /*(B,T,QKV)*/, int B, int T, int C, int NH, int NKV,
                                   cudaStream_t stream = 0);
template <typename E>
void attention_backward_tensor_core(E* dqkv /*(B,T,QKV)*/, float* delta /*(B,NH,T)*/,
                                    const E* dout /*(B,T,C)*/, const E* qkv /*(B,T,QKV)*/,
                                    const E* out /*(B,T,C)*/, const float* lse /*(B,NH,T)*/, int B,
                                    int T, int C, int NH, int NKV, cudaStream_t stream = 0);

namespace attention_detail {

// The shapes both implementations derive from (B, T, C, NH, NKV), validated.
struct Dims {
    int B, T, C, NH, NKV, hs, QKV, group;
};
// Fails (memtrain::Error naming `op`) unless the sizes are positive, C % NH == 0,
// NH % NKV == 0 and hs <= max_hs.
Dims check_dims(const char* op, int B, int T, int C, int NH, int NKV, int max_hs);
// delta[b, h, i] = sum_x dout[b, i, h, x] * out[b, i, h, x] (fp32, a fixed order): the softmax
// backward's per-row term, shared by both backward implementations.
template <typename E>
void launch_delta(float* delta /*(B,NH,T)*/, const E* dout /*(B,T,C)*/, const E* out /*(B,T,C)*/,
                  const Dims& d, cudaStream_t stream);

}  // namespace attention_detail

}  // namespace memtrain::cuda
