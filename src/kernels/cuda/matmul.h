// GEMMs through cuBLASLt for float, bf16 and fp16 storage: the Conv1D-layout linear layer (bias,
// fused residual, fused GELU forward and GELU gradient), and the chunked classifier + softmax
// cross-entropy. Included through kernels/cuda/ops.h.
//
// Every GEMM accumulates in fp32 (CUBLAS_COMPUTE_32F, fp32 alpha / beta, no TF32) and rounds once
// to T on output, so fp32 results track the CPU's to summation order. Each cuBLASLt epilogue has
// a fallback (the heuristic may refuse an epilogue for a shape, type or alignment): a plain GEMM
// plus a kernel, giving the same values up to one more rounding to T.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- linear layer (Hugging Face Conv1D layout: weight (IC,OC), row-major activations) ----------
// out (N,OC) = inp (N,IC) @ weight (IC,OC) [+ bias (OC)] [+ residual (N,OC)]; residual may be
// `out` itself (in-place add) or another buffer (cuBLASLt's C input with beta = 1).
template <typename T>
void matmul_forward(T* out /*(N,OC)*/, const T* inp /*(N,IC)*/, const T* weight /*(IC,OC)*/,
                    const T* bias /*(OC) or null*/, int N, int IC, int OC,
                    const T* residual /*(N,OC) or null*/ = nullptr, cudaStream_t stream = 0);

// out = gelu(pre) and pre = inp @ weight + bias, both (N,OC): cuBLASLt's GELU_AUX_BIAS epilogue
// where it offers it for the shape and alignment, else the GEMM then a GELU kernel (tanh
// approximation, kernels/cpu/activation.cpp's formula). bias may be null (GELU_AUX).
template <typename T>
void matmul_forward_gelu(T* out /*(N,OC)*/, T* pre /*(N,OC)*/, const T* inp /*(N,IC)*/,
                         const T* weight /*(IC,OC)*/, const T* bias /*(OC) or null*/, int N, int IC,
                         int OC, cudaStream_t stream = 0);

// dinp (N,IC) (null: skipped) = dout @ weight^T, overwritten; with gelu_pre (N,IC) given, times
// gelu'(gelu_pre) elementwise (the gradient through the GELU that produced this layer's input: the
// DGELU epilogue where available, else a kernel). dweight (IC,OC) += inp^T @ dout (beta = 1 into
// T storage). dbias (OC) (null: skipped) += column sums of dout (fixed order, fp32 partial sums;
// cuBLASLt's BGRAD epilogues overwrite instead of accumulating, so they do not fit gradient
// accumulation). A null dweight (a frozen weight, LoRA) skips the weight gradient, and dbias must
// then be null too.
template <typename T>
void matmul_backward(T* dinp /*(N,IC) or null*/, T* dweight /*(IC,OC) or null*/,
                     T* dbias /*(OC) or null*/, const T* dout /*(N,OC)*/, const T* inp /*(N,IC)*/,
                     const T* weight /*(IC,OC)*/, int N, int IC, int OC,
                     const T* gelu_pre /*(N,IC) or null*/ = nullptr, cudaStream_t stream = 0);

// ---- general GEMM
// -------------------------------------------------------------------------------- Row-major C
// (M,N) = alpha op(A) (M,K) @ op(B) (K,N) + beta C, fp32 accumulation: A is stored (M,K) with
// leading dimension lda, or (K,M) when ta; B (K,N) with ldb, or (N,K) when tb; C's rows are ldc
// apart (C may be a column slice of a wider matrix). LoRA's adapters run on it.
template <typename T>
void gemm_rows(bool ta, bool tb, int M, int N, int K, float alpha, const T* A, int64_t lda,
               const T* B, int64_t ldb, float beta, T* C, int64_t ldc, cudaStream_t stream = 0);

// ---- classifier + cross-entropy ----------------------------------------------------------------
// Classifier (x @ wte^T over the first V of Vp rows) + softmax cross-entropy, `chunk` rows of
// logits at a time (logits_buf holds chunk * Vp values of T): writes row_loss[r] = logsumexp -
// logit[target] (fp32, softmax statistics in fp32) for every row (NaN for a target outside
// [0, V)); with dx non-null also the backward with d(loss_r) = grad_scale: dx (N,C) overwritten,
// dwte (Vp,C) accumulated (null: skipped), padded columns [V,Vp) get zero gradient. Queues only:
// never waits for the stream (the caller sums row_loss on the device, e.g. with sum_floats).
template <typename T>
void classifier_loss(T* dx /*(N,C) or null*/, T* dwte /*(Vp,C) or null*/,
                     T* logits_buf /*(chunk,Vp)*/, float* row_loss /*(N)*/, const T* x /*(N,C)*/,
                     const T* wte /*(Vp,C)*/, const int32_t* targets /*(N)*/, int N, int C, int V,
                     int Vp, int chunk, float grad_scale, cudaStream_t stream = 0);

// Logits over the real vocabulary in fp32: out (N,V) (bf16/fp16 inputs, fp32 output GEMM).
template <typename T>
void classifier_logits(float* out /*(N,V)*/, const T* x /*(N,C)*/, const T* wte /*(Vp,C)*/, int N,
                       int C, int V, cudaStream_t stream = 0);

// ---- observability -----------------------------------------------------------------------------
// How many epilogue requests (bias, GELU_AUX[_BIAS], DGELU) ran fused in cuBLASLt and how many
// took the fallback path since the process started: lets tests check that both paths ran, and a
// GPU run see whether cuBLASLt refused an epilogue it was expected to take.
struct EpilogueCounts {
    int64_t fused = 0;
    int64_t fallback = 0;
};
EpilogueCounts matmul_epilogue_counts();

}  // namespace memtrain::cuda
