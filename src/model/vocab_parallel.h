// The vocabulary-parallel embedding and cross-entropy (Megatron): each tensor-parallel rank holds
// the rows [v0, v0 + Vl) of wte (or lm_head), and the lookup, the loss and the logits combine
// across the group through model/tp_comm.h.
#pragma once

#include <cstdint>

#include "kernels/cpu/gemm.h"
#include "model/tp_comm.h"

namespace memtrain {

// Vocabulary-parallel embedding forward: out (N,C) = the rows of `wte_local` (Vl,C) for the
// tokens in [v0, v0 + Vl), zero for the others, all-reduced, then + wpe[t] when wpe is not null.
// With `sp_scratch` (N,C) (sequence parallelism) the lookup goes there and is reduce-scattered:
// `out` receives this rank's N / size() rows only, each + wpe at its global position.
void vocab_parallel_embedding(TpComm& tp, float* out, const int32_t* inp, const float* wte_local,
                              const float* wpe, int B, int T, int C, int v0, int Vl,
                              float* sp_scratch = nullptr);
// Its backward: dwte_local += dout rows of the owned tokens; dwpe += dout (every rank the same).
void vocab_parallel_embedding_backward(float* dwte_local, float* dwpe, const float* dout,
                                       const int32_t* inp, int B, int T, int C, int v0, int Vl);

// cpu::classifier_loss over the vocabulary slice [v0, v0 + Vl) of each rank (wte_local (Vl,C)),
// never gathering the logits: the row max, sum of exps and target logit are combined across the
// group. Returns the sum of the rows' losses (the same on every rank). With dx, also the
// backward: dx (N,C) overwritten with the all-reduced input gradient, dwte_local accumulated;
// with `dx_rows` too (sequence parallelism), dx is reduce-scattered instead: dx_rows receives
// this rank's N / size() rows of the sum (it may alias x, which is read before). With g the
// GEMMs take bf16 operands (cpu::gemm).
double vocab_parallel_loss(TpComm& tp, float* dx, float* dwte_local, float* logits_buf,
                           const float* x, const float* wte_local, const int32_t* targets, int N,
                           int C, int V, int v0, int Vl, int chunk, float grad_scale,
                           float* dx_rows = nullptr, const cpu::Bf16Gemm* g = nullptr);
// The full logits (N,V) for sampling: each rank's slice (rank r's from r x Vl), all-gathered.
void vocab_parallel_logits(TpComm& tp, float* out, const float* x, const float* wte_local, int N,
                           int C, int V, int Vl);

}  // namespace memtrain
