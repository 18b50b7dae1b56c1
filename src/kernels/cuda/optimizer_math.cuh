// What the optimizer kernels share (kernels/cuda/optimizer.cu, adafactor.cu): float operations
// rounded exactly as written, so that the GPU's arithmetic does not depend on nvcc's contraction
// choices (optimizer.cu's header says why), the parameters' rounding (to nearest even, or
// stochastically as optim.master = "none" rounds), and the checks of an update's pointers.
// Internal to kernels/cuda.
#pragma once

#include <cmath>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/optimizer_types.h"

namespace memtrain::cuda {

#if MEMTRAIN_CUDA_SIM
using std::isfinite;
#endif

// ---- explicitly rounded float operations -------------------------------------------------------
#if MEMTRAIN_CUDA_SIM
// Host C++ under the simulator, where GCC would contract a product into a following addition:
// a result stored through a volatile is never fused with anything.
static inline float mul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
static inline float add_rn(float a, float b) {
    volatile float r = a + b;
    return r;
}
static inline float div_rn(float a, float b) {
    volatile float r = a / b;
    return r;
}
static inline float sqrt_rn(float a) {
    return std::sqrt(a);
}
static inline float fma_rn(float a, float b, float c) {
    return std::fma(a, b, c);
}
static inline float rint_rn(float a) {
    return std::nearbyint(a);
}
static inline bool sign_bit(float a) {
    return std::signbit(a);
}
#else
static __device__ __forceinline__ float mul_rn(float a, float b) {
    return __fmul_rn(a, b);
}
static __device__ __forceinline__ float add_rn(float a, float b) {
    return __fadd_rn(a, b);
}
static __device__ __forceinline__ float div_rn(float a, float b) {
    return __fdiv_rn(a, b);
}
static __device__ __forceinline__ float sqrt_rn(float a) {
    return __fsqrt_rn(a);
}
static __device__ __forceinline__ float fma_rn(float a, float b, float c) {
    return __fmaf_rn(a, b, c);
}
static __device__ __forceinline__ float rint_rn(float a) {
    return rintf(a);
}
static __device__ __forceinline__ bool sign_bit(float a) {
    return signbit(a);
}
#endif

// ---- the parameters' rounding ------------------------------------------------------------------
// f32_to_bf16_stochastic (optim/state_format.cpp) bit for bit: a splitmix64 finaliser over
// (seed, step, index), its top 16 bits added to the magnitude's bits below bf16's.
__device__ __forceinline__ uint16_t bf16_stochastic_bits(float x, uint64_t seed, uint64_t step,
                                                         uint64_t index) {
    const uint32_t u = __float_as_uint(x);
    uint64_t z = seed ^ (step * 0xD1B54A32D192ED03ull) ^ (index * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const uint32_t up = (u + (uint32_t)(z >> 48)) >> 16;
    if ((up & 0x7f80u) == 0x7f80u) return (uint16_t)(u >> 16);  // would overflow: truncate
    return (uint16_t)up;
}

// The parameter's new value x (element j of the range) in its storage type: rounded to nearest
// even, or (bf16 under ParamRounding::stochastic) stochastically.
template <typename T>
__device__ __forceinline__ T round_param(float x, const ParamRounding& r, int64_t step, int64_t j) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (r.stochastic && isfinite(x)) {
            __nv_bfloat16_raw b;
            b.x = bf16_stochastic_bits(x, r.seed, (uint64_t)step, (uint64_t)(r.base + j));
            return __nv_bfloat16(b);
        }
    }
    return from_float<T>(x);
}

template <typename T>
inline void check_step(const char* op, const T* params, const float* master, const T* grads,
                       const void* chunks, int nchunks, const StepScalars* s,
                       const ParamRounding& round) {
    if (nchunks < 0) fail("cuda::{}: nchunks is {}, expected >= 0", op, nchunks);
    if (nchunks > 0 && (!params || !grads || !chunks || !s))
        fail("cuda::{}: null params, grads, chunks or scalars", op);
    if (round.stochastic) {
        if (!std::is_same<T, __nv_bfloat16>::value || master)
            fail(
                "cuda::{}: stochastic rounding stores bf16 parameters without a master copy, "
                "expected T = bf16 and master = null",
                op);
        return;
    }
    if (std::is_same<T, float>::value) {
        if (master)
            fail("cuda::{}: fp32 parameters are their own master copy, expected master = null", op);
    } else if (nchunks > 0 && !master) {
        fail(
            "cuda::{}: bf16 / fp16 parameters need fp32 master weights (or bf16 ones stochastic "
            "rounding), got master = null",
            op);
    }
}

}  // namespace memtrain::cuda
