// GEMMs through cuBLASLt, the Conv1D-layout linear layer, and the chunked classifier +
// softmax cross-entropy.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

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

// ---- classifier + cross-entropy, `chunk` rows of logits at a time (see cpu/ops.h) ---------------
// Returns the sum of the per-row losses, so it waits for `stream`. logits_buf is device memory.
double classifier_loss(float* dx /*(N,C) or null*/, float* dwte /*(Vp,C) or null*/,
                       float* logits_buf /*(chunk,Vp)*/, const float* x /*(N,C)*/,
                       const float* wte /*(Vp,C)*/, const int32_t* targets /*(N)*/, int N, int C,
                       int V, int Vp, int chunk, float grad_scale, cudaStream_t stream = 0);
void classifier_logits(float* out /*(N,V)*/, const float* x /*(N,C)*/, const float* wte /*(Vp,C)*/,
                       int N, int C, int V, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
