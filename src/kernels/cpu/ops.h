// CPU reference kernels: forward and backward of every op the GPT block uses, fp32.
// Argument order everywhere: outputs, saved, inputs, params, dims (see kernels/README.md).
// Shapes are in comments; B = batch, T = time, C = channels, NH = heads, V = vocab rows.
// Backward kernels *accumulate* into parameter gradients (gradient accumulation across
// micro-batches) and *overwrite* input gradients unless a `beta`/`accumulate` says otherwise.
// All reductions run in a fixed order independent of the thread count, so results are bitwise
// reproducible.
#pragma once

#include <cstdint>

#include "kernels/dropout_mask.h"

namespace memtrain::cpu {

struct Bf16Gemm;  // kernels/cpu/gemm.h: where bf16 GEMM operands are rounded (null: fp32)

// ---- embedding -------------------------------------------------------------------------------
// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]. wpe (and dwpe) may be null: models with rotary
// positions have no position table, so the token row is copied as is.
void embedding_forward(float* out /*(B,T,C)*/, const int32_t* inp /*(B,T)*/,
                       const float* wte /*(V,C)*/, const float* wpe /*(maxT,C)*/, int B, int T,
                       int C);
void embedding_backward(float* dwte /*(V,C)*/, float* dwpe /*(maxT,C)*/,
                        const float* dout /*(B,T,C)*/, const int32_t* inp /*(B,T)*/, int B, int T,
                        int C);

// ---- dropout (model.dropout; the mask of kernels/dropout_mask.h) -----------------------------
// out = drop(inp), element t * C + c of sequence b kept with probability 1 - m.p and scaled by
// 1 / (1 - m.p). Its own backward (d(inp) = drop(d(out))). out may be inp.
void dropout(float* out /*(B,T,C)*/, const float* inp /*(B,T,C)*/, const DropoutMask& m, int B,
             int T, int C);
// A residual branch's dropout and add: on entry out holds the branch, on exit resid + drop(out).
void dropout_residual(float* out /*(B,T,C)*/, const float* resid /*(B,T,C)*/, const DropoutMask& m,
                      int B, int T, int C);

// ---- layernorm -------------------------------------------------------------------------------
void layernorm_forward(float* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                       const float* inp /*(N,C)*/, const float* weight /*(C)*/,
                       const float* bias /*(C)*/, int N, int C, float eps = 1e-5f);
// dinp is accumulated into (it is the residual stream's gradient).
// A null dweight (frozen norm, LoRA) skips the parameter gradients.
void layernorm_backward(float* dinp /*(N,C)*/, float* dweight /*(C)*/, float* dbias /*(C)*/,
                        const float* dout /*(N,C)*/, const float* inp /*(N,C)*/,
                        const float* weight /*(C)*/, const float* mean /*(N)*/,
                        const float* rstd /*(N)*/, int N, int C);

// ---- rmsnorm (Llama): out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps); no bias ----
void rmsnorm_forward(float* out /*(N,C)*/, float* rstd /*(N)*/, const float* inp /*(N,C)*/,
                     const float* weight /*(C)*/, int N, int C, float eps);
// dinp is accumulated into (the residual stream's gradient), like layernorm_backward; a null
// dweight skips the parameter gradient.
void rmsnorm_backward(float* dinp /*(N,C)*/, float* dweight /*(C)*/, const float* dout /*(N,C)*/,
                      const float* inp /*(N,C)*/, const float* weight /*(C)*/,
                      const float* rstd /*(N)*/, int N, int C);

// ---- matmul (Hugging Face Conv1D layout: weight is (IC, OC), out = inp @ weight + bias) --------
// beta = 0 overwrites out, beta = 1 adds the product to what out holds (fused residual add).
// With g (train.precision = bf16 on the CPU) the GEMM's operands are rounded to bf16 in g's
// scratch and multiplied with fp32 accumulation (kernels/cpu/gemm.h); out stays fp32.
void matmul_forward(float* out /*(N,OC)*/, const float* inp /*(N,IC)*/,
                    const float* weight /*(IC,OC)*/, const float* bias /*(OC) or null*/, int N,
                    int IC, int OC, float beta = 0.0f, const Bf16Gemm* g = nullptr);
// dinp = dout @ weight^T (+ beta * dinp); dweight += inp^T @ dout; dbias += sum_rows(dout).
// A null dinp or dweight skips that half (a zero-bubble pipeline runs them apart, with the same
// bits as together). With g both products take bf16 operands; the scratch holds d(out) and
// one of weight / inp at a time: N*OC + max(IC*OC, N*IC) elements.
void matmul_backward(float* dinp /*(N,IC)*/, float* dweight /*(IC,OC)*/,
                     float* dbias /*(OC) or null*/, const float* dout /*(N,OC)*/,
                     const float* inp /*(N,IC)*/, const float* weight /*(IC,OC)*/, int N, int IC,
                     int OC, float beta = 0.0f, const Bf16Gemm* g = nullptr);

// ---- activation ------------------------------------------------------------------------------
// GELU, tanh approximation (as GPT-2).
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// SwiGLU (Llama MLP): out = silu(gate) * up on a fused input inp = [gate | up] along channels.
void swiglu_forward(float* out /*(N,H)*/, const float* inp /*(N,2H)*/, int N, int H);
// dinp is overwritten.
void swiglu_backward(float* dinp /*(N,2H)*/, const float* inp /*(N,2H)*/,
                     const float* dout /*(N,H)*/, int N, int H);

// ---- rotary position embedding (Hugging Face Llama's rotate-half convention) -------------------
// In place on the q (NH heads) and k (NKV heads) parts of a packed qkv row of width
// QKV = (NH + 2 NKV) * hs; v is untouched. Per head, for i < hs/2 and position t:
//   angle = t * theta^(-2i/hs); (x_i, x_{i+hs/2}) <- (x_i cos - x_{i+hs/2} sin,
//                                                    x_{i+hs/2} cos + x_i sin).
// Row t of the input sits at position pos0 + t (pos0 > 0: decoding after a KV cache).
void rope_forward(float* qkv /*(B,T,QKV)*/, int B, int T, int NH, int NKV, int hs, float theta,
                  int pos0 = 0);
// The gradient of a rotation is the inverse rotation, applied in place to d(qkv).
void rope_backward(float* dqkv /*(B,T,QKV)*/, int B, int T, int NH, int NKV, int hs, float theta);

// ---- attention (causal, grouped-query; qkv packed as [q | k | v] along channels) ---------------
// q has NH heads, k and v NKV heads each (NH % NKV == 0), all of size hs = C / NH, so a row of
// qkv is QKV = C + 2 * NKV * hs wide; query head h attends with kv head h / (NH / NKV).
// NKV == NH is plain multi-head attention (GPT-2: QKV = 3C).
// With a mask (model.dropout) the probabilities are dropped before they weight v: element
// (h * T + i) * T + j of sequence b. att keeps them undropped; the backward asks the mask again.
// With att null (train.cpu_attention = "lse") only each row's log-sum-exp is kept, in lse
// (B,NH,T), and the backward recomputes the probabilities from it a row at a time; the output
// is the same bits either way.
// bf16: the score and output GEMMs take bf16 operands (fp32 accumulation, fp32 softmax).
void attention_forward(float* out /*(B,T,C)*/, float* att /*(B,NH,T,T) softmax probabilities*/,
                       const float* qkv /*(B,T,QKV)*/, int B, int T, int C, int NH, int NKV,
                       const DropoutMask* drop = nullptr, float* lse /*(B,NH,T)*/ = nullptr,
                       bool bf16 = false);
// dqkv is overwritten; d(att) is formed a block of rows at a time, so no (T,T) scratch is needed.
void attention_backward(float* dqkv /*(B,T,QKV)*/, const float* dout /*(B,T,C)*/,
                        const float* qkv /*(B,T,QKV)*/, const float* att /*(B,NH,T,T)*/, int B,
                        int T, int C, int NH, int NKV, const DropoutMask* drop = nullptr,
                        const float* lse /*(B,NH,T), when att is null*/ = nullptr,
                        bool bf16 = false);

// ---- classifier + cross-entropy, chunked so at most `chunk` rows of logits exist ---------------
// `wte` is the output embedding: the token embedding when tied, lm_head.weight when not.
// For rows r of x (N,C): logits = x @ wte^T over the first V of Vp rows; loss_r = lse - logit[y_r].
// Returns the sum of per-row losses (double, fixed order). When dx is not null it also runs the
// backward with dloss_r = grad_scale for every row: dx (overwritten) and dwte (accumulated).
// logits_buf holds chunk * Vp floats. With g the three GEMMs take bf16 operands: wte is rounded
// once per call, x and d(logits) a chunk at a time (Vp*C + min(chunk,N)*(C + Vp) elements).
double classifier_loss(float* dx /*(N,C) or null*/, float* dwte /*(Vp,C) or null*/,
                       float* logits_buf /*(chunk,Vp)*/, const float* x /*(N,C)*/,
                       const float* wte /*(Vp,C)*/, const int32_t* targets /*(N)*/, int N, int C,
                       int V, int Vp, int chunk, float grad_scale, const Bf16Gemm* g = nullptr);
// Full logits for the given rows (used for sampling and tests): out (N,V).
void classifier_logits(float* out /*(N,V)*/, const float* x /*(N,C)*/, const float* wte /*(Vp,C)*/,
                       int N, int C, int V, const Bf16Gemm* g = nullptr);

// ---- small helpers -----------------------------------------------------------------------------
void add_inplace(float* a, const float* b, int64_t n);  // a += b
double sum_squares(const float* a, int64_t n);          // fixed-order, double accumulation
void scale_inplace(float* a, float s, int64_t n);

}  // namespace memtrain::cpu
