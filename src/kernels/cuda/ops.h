// CUDA kernels: the same ops, argument order and semantics as kernels/cpu/ops.h (read that file's
// comments for each op), on device pointers, with the stream last. Each entry queues its work on
// `stream` and returns; the ones that return a host value (classifier_loss, sum_squares) wait for
// that stream. fp32 throughout except where a name says bf16.
//
// Determinism: no floating-point atomics anywhere. Every sum runs in an order fixed by the shapes
// alone (never by timing or the number of SMs), so a run repeats bit for bit on the same GPU and
// build; results differ from the CPU's in the last bits where the summation order differs
// (docs/cuda.md lists which ops match the CPU order exactly).
//
// Scratch memory: kernels that need temporary room take it from memtrain::device_scratch(), one
// process-wide area, so calls on two different streams must not overlap in time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- embedding -------------------------------------------------------------------------------
void embedding_forward(float* out /*(B,T,C)*/, const int32_t* inp /*(B,T)*/,
                       const float* wte /*(V,C)*/, const float* wpe /*(maxT,C) or null*/, int B,
                       int T, int C, cudaStream_t stream = 0);
// Accumulates into dwte and dwpe (null: no position table). dwte is summed per token id over the
// positions that hold it, in (b,t) order: the ids are copied to the host and bucketed there (a
// counting sort), so this call waits for `stream` once. Same order as the CPU: same bits.
void embedding_backward(float* dwte /*(V,C)*/, float* dwpe /*(maxT,C) or null*/,
                        const float* dout /*(B,T,C)*/, const int32_t* inp /*(B,T)*/, int B, int T,
                        int C, cudaStream_t stream = 0);

// ---- layernorm -------------------------------------------------------------------------------
void layernorm_forward(float* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                       const float* inp /*(N,C)*/, const float* weight /*(C)*/,
                       const float* bias /*(C)*/, int N, int C, float eps = 1e-5f,
                       cudaStream_t stream = 0);
// bf16 activations and parameters, fp32 statistics and arithmetic.
void layernorm_forward_bf16(__nv_bfloat16* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                            const __nv_bfloat16* inp /*(N,C)*/, const __nv_bfloat16* weight /*(C)*/,
                            const __nv_bfloat16* bias /*(C)*/, int N, int C, float eps = 1e-5f,
                            cudaStream_t stream = 0);
// dinp is accumulated into; dweight and dbias too (per-chunk partial sums, then a fixed-order
// pass).
void layernorm_backward(float* dinp /*(N,C)*/, float* dweight /*(C)*/, float* dbias /*(C)*/,
                        const float* dout /*(N,C)*/, const float* inp /*(N,C)*/,
                        const float* weight /*(C)*/, const float* mean /*(N)*/,
                        const float* rstd /*(N)*/, int N, int C, cudaStream_t stream = 0);

// ---- matmul (cuBLASLt; Hugging Face Conv1D layout: weight (IC,OC), out = inp @ weight + bias) --
// Plain fp32 GEMMs (CUBLAS_COMPUTE_32F, no TF32), so results track the CPU to rounding.
void matmul_forward(float* out /*(N,OC)*/, const float* inp /*(N,IC)*/,
                    const float* weight /*(IC,OC)*/, const float* bias /*(OC) or null*/, int N,
                    int IC, int OC, float beta = 0.0f, cudaStream_t stream = 0);
// dinp (null: skipped) = dout @ weight^T (+ beta * dinp); dweight += inp^T @ dout;
// dbias (null: skipped) += column sums of dout (partial sums, then a fixed-order pass).
void matmul_backward(float* dinp /*(N,IC)*/, float* dweight /*(IC,OC)*/,
                     float* dbias /*(OC) or null*/, const float* dout /*(N,OC)*/,
                     const float* inp /*(N,IC)*/, const float* weight /*(IC,OC)*/, int N, int IC,
                     int OC, float beta = 0.0f, cudaStream_t stream = 0);

// ---- activation ------------------------------------------------------------------------------
void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream = 0);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                   cudaStream_t stream = 0);
void gelu_forward_bf16(__nv_bfloat16* out, const __nv_bfloat16* inp, int64_t n,
                       cudaStream_t stream = 0);
void gelu_backward_bf16(__nv_bfloat16* dinp, const __nv_bfloat16* inp, const __nv_bfloat16* dout,
                        int64_t n, cudaStream_t stream = 0);

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

// ---- classifier + cross-entropy, `chunk` rows of logits at a time (see cpu/ops.h) ---------------
// Returns the sum of the per-row losses, so it waits for `stream`. logits_buf is device memory.
double classifier_loss(float* dx /*(N,C) or null*/, float* dwte /*(Vp,C) or null*/,
                       float* logits_buf /*(chunk,Vp)*/, const float* x /*(N,C)*/,
                       const float* wte /*(Vp,C)*/, const int32_t* targets /*(N)*/, int N, int C,
                       int V, int Vp, int chunk, float grad_scale, cudaStream_t stream = 0);
void classifier_logits(float* out /*(N,V)*/, const float* x /*(N,C)*/, const float* wte /*(Vp,C)*/,
                       int N, int C, int V, cudaStream_t stream = 0);

// ---- optimizer -------------------------------------------------------------------------------
// One AdamW update over a flat buffer with torch.optim.AdamW's arithmetic, exactly as memtrain's
// CPU AdamW (optim/optimizer.cpp): `step` is the 1-based step count after this update, bias
// corrections are computed in double on the host. decay (null: decay everywhere) marks with a
// nonzero byte the elements weight decay applies to (matrices and embeddings).
void adamw_step(float* params /*(n)*/, float* m /*(n)*/, float* v /*(n)*/,
                const float* grads /*(n)*/, const uint8_t* decay /*(n) or null*/, int64_t n,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, cudaStream_t stream = 0);

// ---- small helpers -----------------------------------------------------------------------------
void add_inplace(float* a, const float* b, int64_t n, cudaStream_t stream = 0);  // a += b
// Sum of squares in double: fixed chunks, then one fixed-order pass; waits for `stream`.
double sum_squares(const float* a, int64_t n, cudaStream_t stream = 0);
void scale_inplace(float* a, float s, int64_t n, cudaStream_t stream = 0);

// ---- casts (round to nearest even) -------------------------------------------------------------
void cast_f32_to_bf16(__nv_bfloat16* out, const float* inp, int64_t n, cudaStream_t stream = 0);
void cast_bf16_to_f32(float* out, const __nv_bfloat16* inp, int64_t n, cudaStream_t stream = 0);
void cast_f32_to_f16(__half* out, const float* inp, int64_t n, cudaStream_t stream = 0);
void cast_f16_to_f32(float* out, const __half* inp, int64_t n, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
