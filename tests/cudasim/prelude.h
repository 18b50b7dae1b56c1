// Included first when a .cu file is compiled as C++ for cudasim (see sim.h): the CUDA language
// extensions the kernels use, mapped onto the simulator. Device code then compiles as ordinary
// host code; anything not mapped here fails to compile, which is the signal to add it.
#pragma once

// Function and variable spaces: everything is host code; __shared__ storage is per OS thread,
// and a block's threads all run on the OS thread that runs the block, so they share it.
#define __host__
#define __device__
#define __global__
#define __shared__ static thread_local
#define __constant__
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cudasim/sim.h"

#define MEMTRAIN_CUDA_SIM 1

// ---- thread coordinates
// ---------------------------------------------------------------------------
#define threadIdx (::cudasim::self().thread_idx)
#define blockIdx (::cudasim::self().block_idx)
#define blockDim (::cudasim::self().block_dim)
#define gridDim (::cudasim::self().grid_dim)
#define warpSize 32

// ---- barriers and warp collectives
// ---------------------------------------------------------------
inline void __syncthreads() {
    ::cudasim::syncthreads();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
    ::cudasim::warp_exchange(nullptr, 0);
}
inline void __threadfence() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __threadfence_block() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

namespace cudasim {
// Lane `src` of the exchange (the caller's own value when src is outside [0, 32)).
template <typename T>
T shfl_from(T v, int src) {
    static_assert(sizeof(T) <= kMaxExchangeBytes, "shuffle of a type larger than the exchange");
    const unsigned char* table = warp_exchange(&v, sizeof(T));
    if (src < 0 || src >= 32) return v;
    T r;
    std::memcpy(&r, table + (std::size_t)src * kMaxExchangeBytes, sizeof(T));
    return r;
}
inline int lane() {
    return (int)self().lane;
}
}  // namespace cudasim

template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    const int lane = cudasim::lane();
    return cudasim::shfl_from(v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    const int lane = cudasim::lane(), src = lane ^ lane_mask;
    const bool same_segment = (src & ~(width - 1)) == (lane & ~(width - 1));
    return cudasim::shfl_from(v, same_segment ? src : lane);
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = cudasim::lane(), src = lane + (int)delta;
    const bool same_segment = (src & ~(width - 1)) == (lane & ~(width - 1));
    return cudasim::shfl_from(v, same_segment ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = cudasim::lane(), src = lane - (int)delta;
    const bool same_segment = src >= 0 && (src & ~(width - 1)) == (lane & ~(width - 1));
    return cudasim::shfl_from(v, same_segment ? src : lane);
}
inline unsigned __ballot_sync(unsigned, int pred) {
    const int p = pred != 0;
    const unsigned char* table = cudasim::warp_exchange(&p, sizeof(p));
    unsigned bits = 0;
    for (int i = 0; i < 32; i++) {
        int v;
        std::memcpy(&v, table + (std::size_t)i * cudasim::kMaxExchangeBytes, sizeof(v));
        if (v == 1) bits |= 1u << i;
    }
    return bits;
}
inline int __any_sync(unsigned mask, int pred) {
    return __ballot_sync(mask, pred) != 0;
}

// ---- atomics
// ---------------------------------------------------------------------------------------
template <typename T>
T atomicAdd(T* address, T val) {
    return std::atomic_ref<T>(*address).fetch_add(val);
}
template <typename T>
T atomicMax(T* address, T val) {
    std::atomic_ref<T> a(*address);
    T old = a.load();
    while (old < val && !a.compare_exchange_weak(old, val)) {
    }
    return old;
}
template <typename T>
T atomicExch(T* address, T val) {
    return std::atomic_ref<T>(*address).exchange(val);
}
template <typename T>
T atomicCAS(T* address, T compare, T val) {
    std::atomic_ref<T>(*address).compare_exchange_strong(compare, val);
    return compare;
}

// ---- device math without a host twin
// --------------------------------------------------------------
inline float rsqrtf(float x) {
    return 1.0f / std::sqrt(x);
}
inline float __expf(float x) {
    return std::exp(x);
}
inline float __logf(float x) {
    return std::log(x);
}
inline float __fdividef(float a, float b) {
    return a / b;
}
inline float __frcp_rn(float x) {
    return 1.0f / x;
}
inline float __saturatef(float x) {
    return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}
inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}
inline int __float_as_int(float f) {
    int x;
    std::memcpy(&x, &f, sizeof x);
    return x;
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    std::memcpy(&x, &f, sizeof x);
    return x;
}
inline int __popc(unsigned x) {
    return __builtin_popcount(x);
}
template <typename T>
T __ldg(const T* p) {
    return *p;
}
using std::max;
using std::min;
