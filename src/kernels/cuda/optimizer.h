// The optimizer on the GPU: gradient-norm clipping and skipping, AdamW and SGD with momentum as
// multi-tensor kernels over the pieces of a parameter range (kernels/cuda/optimizer_types.h),
// reading their per-step constants from device memory so a captured step replays with new values.
// Included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/optimizer_types.h"

namespace memtrain::cuda {

// From *sumsq (sum of squares of the stored gradients, e.g. from sum_squares): grad_norm =
// sqrt(sumsq) / loss_scale, skip = !isfinite(grad_norm), grad_scale = coef / loss_scale with
// torch.nn.utils.clip_grad_norm_'s coef = max_norm / (norm + 1e-6) when max_norm > 0 and that is
// below 1, else 1 (exactly memtrain::clip_grad_norm in optim/optimizer.cpp, in the same float /
// double types). Queues one single-thread kernel.
void finish_grad_norm(StepScalars* s /*device*/, const double* sumsq /*device*/,
                      cudaStream_t stream = 0);
// s->clip_norm > 0 (the previous step's norm, optim.step_in_backward_clip = "previous-norm")
// takes the place of this step's norm in the coefficient, in both kernels. For an update queued
// before its norm is known (optim.step_in_backward without a norm pass): skip = 0 and grad_scale =
// the coefficient of s->clip_norm (1 without it) / loss_scale; finish_grad_norm fills grad_norm
// after the backward.
void scale_before_norm(StepScalars* s /*device*/, cudaStream_t stream = 0);

// The moments a step updates (device pointers): the stores of the CPU's MomentBuffer
// (optim/state_format.h), laid out by cuda::moment_layout. With `at` null: fp32 moments indexed
// like the parameters (m32, v32; optim.state_format = "fp32"). Otherwise each chunk's moments are
// at[chunk]: in m32 / v32 (a chunk whose tensor keeps fp32), in m16 / v16 stored in bf16 (rounded
// to nearest even), or (bits 8 or 4) one quantization block of codes in mq / vq with its scale in
// ms / vs, decoded through the 256-entry tables and re-encoded with the block's new largest
// magnitude as the CPU encodes (the maps qm, qv). The update is computed in fp32 exactly as with
// fp32 moments in every format, so each stores the CPU's bits. v* are unused by SGD.
struct MomentStores {
    float* m32 = nullptr;
    float* v32 = nullptr;
    __nv_bfloat16* m16 = nullptr;
    __nv_bfloat16* v16 = nullptr;
    const StateChunk* at = nullptr;
    int bits = 0;  // 8 or 4 for the block-quantized formats
    uint8_t* mq = nullptr;
    uint8_t* vq = nullptr;
    float* ms = nullptr;
    float* vs = nullptr;
    const float* table_m = nullptr;  // decode tables (256 floats: decode_code's values)
    const float* table_v = nullptr;
    QuantMap qm{}, qv{};
    // int8 / int4: each chunk's CUDA blocks (cuda::moment_layout's grid) and their count, the
    // step's grid size; null: a CUDA block per chunk.
    const ChunkGrid* grid = nullptr;
    int64_t blocks = 0;
};

// AdamW with torch.optim.AdamW's arithmetic, exactly AdamW::step in src/optim/optimizer.cpp (the
// same float operations in the same order, including the multiply-adds GCC fuses there at -O2
// and above), so that for T = float with loss_scale 1 the result equals the CPU optimizer's bits
// after the same clipping. On every chunk, g = float(grads[i]) * s->grad_scale; nothing at all
// when s->skip. `master` (fp32 master weights) is given when T is not float: it is updated and
// params[i] = T(master[i]) (round to nearest even); it is null when T is float (params are the
// master). Indices are the range's: params, master, m, v and grads all start at its first float.
template <typename T>
void adamw_step(T* params /*(n)*/, float* master /*(n) or null*/, float* m /*(n)*/,
                float* v /*(n)*/, const T* grads /*(n)*/, const TensorChunk* chunks /*device*/,
                int nchunks, const StepScalars* s /*device*/, cudaStream_t stream = 0);
// The same with moments in any MomentStores, and the parameters stored as `round` says (with
// round.stochastic: T = bf16, master null, the parameters are the weights: optim.master =
// "none").
template <typename T>
void adamw_step(T* params, float* master, const MomentStores& moments, const T* grads,
                const TensorChunk* chunks, int nchunks, const StepScalars* s,
                cudaStream_t stream = 0, const ParamRounding& round = {});

// SGD with momentum (and Nesterov when s->nesterov), exactly Sgd::step in src/optim/optimizer.cpp;
// same conventions as adamw_step.
template <typename T>
void sgd_step(T* params /*(n)*/, float* master /*(n) or null*/, float* momentum /*(n)*/,
              const T* grads /*(n)*/, const TensorChunk* chunks /*device*/, int nchunks,
              const StepScalars* s /*device*/, cudaStream_t stream = 0);
// The same with the momentum in any MomentStores (m32, m16, codes), and `round` as adamw_step's.
template <typename T>
void sgd_step(T* params, float* master, const MomentStores& momentum, const T* grads,
              const TensorChunk* chunks, int nchunks, const StepScalars* s, cudaStream_t stream = 0,
              const ParamRounding& round = {});

// Muon's momentum over one matrix's chunks of a masked momentum (cuda::muon_layout: `st.at`
// given, the grid rebased to the matrix): buf = lerp(buf, g, 1 - s->muon_momentum) stored in its
// format as SGD's momentum is, and u[j - u_begin] = lerp(g, buf, mu) in fp32, with g =
// float(grads[j]) * s->grad_scale (j: the range's index); nothing when s->skip.
template <typename T>
void muon_momentum(float* u, int64_t u_begin, const MomentStores& st, const T* grads,
                   const TensorChunk* chunks, int nchunks, const StepScalars* s,
                   cudaStream_t stream = 0);

}  // namespace memtrain::cuda
