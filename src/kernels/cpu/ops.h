// CPU reference kernels: forward and backward of every op the GPT block uses, fp32.
// Argument order everywhere: outputs, saved, inputs, params, dims (see kernels/README.md).
// Shapes are in comments; B = batch, T = time, C = channels, NH = heads, V = vocab rows.
// Backward kernels *accumulate* into parameter gradients (gradient accumulation across
// micro-batches) and *overwrite* input gradients unless a `beta`/`accumulate` says otherwise.
// All reductions run in a fixed order independent of the thread count, so results are bitwise
// reproducible.
#pragma once

#include <cstdint>

namespace memtrain::cpu {

// ---- embedding -------------------------------------------------------------------------------
// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
void embedding_forward(float* out /*(B,T,C)*/, const int32_t* inp /*(B,T)*/,
                       const float* wte /*(V,C)*/, const float* wpe /*(maxT,C)*/, int B, int T,
                       int C);
void embedding_backward(float* dwte /*(V,C)*/, float* dwpe /*(maxT,C)*/,
                        const float* dout /*(B,T,C)*/, const int32_t* inp /*(B,T)*/, int B, int T,
                        int C);

// ---- layernorm -------------------------------------------------------------------------------
void layernorm_forward(float* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                       const float* inp /*(N,C)*/, const float* weight /*(C)*/,
                       const float* bias /*(C)*/, int N, int C);
// dinp is accumulated into (it is the residual stream's gradient).
void layernorm_backward(float* dinp /*(N,C)*/, float* dweight /*(C)*/, float* dbias /*(C)*/,
                        const float* dout /*(N,C)*/, const float* inp /*(N,C)*/,
                        const float* weight /*(C)*/, const float* mean /*(N)*/,
                        const float* rstd /*(N)*/, int N, int C);

// ---- matmul (Hugging Face Conv1D layout: weight is (IC, OC), out = inp @ weight + bias) --------
// beta = 0 overwrites out, beta = 1 adds the product to what out holds (fused residual add).
void matmul_forward(float* out /*(N,OC)*/, const float* inp /*(N,IC)*/,
                    const float* weight /*(IC,OC)*/, const float* bias /*(OC) or null*/, int N,
                    int IC, int OC, float beta = 0.0f);
// dinp = dout @ weight^T (+ beta * dinp); dweight += inp^T @ dout; dbias += sum_rows(dout).
void matmul_backward(float* dinp /*(N,IC)*/, float* dweight /*(IC,OC)*/,
                     float* dbias /*(OC) or null*/, const float* dout /*(N,OC)*/,
                     const float* inp /*(N,IC)*/, const float* weight /*(IC,OC)*/, int N, int IC,
                     int OC, float beta = 0.0f);

// ---- activation ------------------------------------------------------------------------------
// GELU, tanh approximation (as GPT-2).
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// ---- attention (causal, multi-head; qkv packed as [q | k | v] along channels) ------------------
void attention_forward(float* out /*(B,T,C)*/, float* att /*(B,NH,T,T) softmax probabilities*/,
                       const float* qkv /*(B,T,3C)*/, int B, int T, int C, int NH);
// dqkv is overwritten; d(att) is formed one row at a time, so no (T,T) scratch is needed.
void attention_backward(float* dqkv /*(B,T,3C)*/, const float* dout /*(B,T,C)*/,
                        const float* qkv /*(B,T,3C)*/, const float* att /*(B,NH,T,T)*/, int B,
                        int T, int C, int NH);

// ---- classifier + cross-entropy, chunked so at most `chunk` rows of logits exist ---------------
// For rows r of x (N,C): logits = x @ wte^T over the first V of Vp rows; loss_r = lse - logit[y_r].
// Returns the sum of per-row losses (double, fixed order). When dx is not null it also runs the
// backward with dloss_r = grad_scale for every row: dx (overwritten) and dwte (accumulated).
// logits_buf holds chunk * Vp floats.
double classifier_loss(float* dx /*(N,C) or null*/, float* dwte /*(Vp,C) or null*/,
                       float* logits_buf /*(chunk,Vp)*/, const float* x /*(N,C)*/,
                       const float* wte /*(Vp,C)*/, const int32_t* targets /*(N)*/, int N, int C,
                       int V, int Vp, int chunk, float grad_scale);
// Full logits for the given rows (used for sampling and tests): out (N,V).
void classifier_logits(float* out /*(N,V)*/, const float* x /*(N,C)*/, const float* wte /*(Vp,C)*/,
                       int N, int C, int V);

// ---- small helpers -----------------------------------------------------------------------------
void add_inplace(float* a, const float* b, int64_t n);  // a += b
double sum_squares(const float* a, int64_t n);          // fixed-order, double accumulation
void scale_inplace(float* a, float s, int64_t n);

}  // namespace memtrain::cpu
