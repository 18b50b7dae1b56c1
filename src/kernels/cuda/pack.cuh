// Packs of W consecutive elements moved as one access: the 128-bit loads and stores of the row and
// elementwise kernels (embedding, norm, activation, rope). W = kPackWidth<T> fills 16 bytes; W = 1
// is the scalar fallback for pointers or widths that are not 16-byte aligned, so every kernel is
// written once over packs and instantiated for both. Internal to kernels/cuda.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/cuda/common.cuh"

namespace memtrain::cuda {

// Elements of T per 16-byte access: 4 floats, 8 bf16 or fp16 values.
template <typename T>
constexpr int kPackWidth = 16 / (int)sizeof(T);

template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
    T v[W];
};

// p must be aligned to the pack (16 bytes for a full-width pack).
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
    Pack<T, W> r;
    if constexpr (sizeof(Pack<T, W>) == 16) {
#if MEMTRAIN_CUDA_SIM
        memcpy(static_cast<void*>(&r), p, 16);  // no type punning on the host compiler
#else
        const int4 bits = *reinterpret_cast<const int4*>(p);  // one 128-bit load
        memcpy(static_cast<void*>(&r), &bits, 16);
#endif
    } else {
#pragma unroll
        for (int j = 0; j < W; j++) r.v[j] = p[j];
    }
    return r;
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& r) {
    if constexpr (sizeof(Pack<T, W>) == 16) {
#if MEMTRAIN_CUDA_SIM
        memcpy(static_cast<void*>(p), &r, 16);
#else
        int4 bits;
        memcpy(&bits, &r, 16);
        *reinterpret_cast<int4*>(p) = bits;  // one 128-bit store
#endif
    } else {
#pragma unroll
        for (int j = 0; j < W; j++) p[j] = r.v[j];
    }
}

template <typename T, int W>
__device__ __forceinline__ void unpack(const Pack<T, W>& p, float (&f)[W]) {
#pragma unroll
    for (int j = 0; j < W; j++) f[j] = to_float(p.v[j]);
}

template <typename T, int W>
__device__ __forceinline__ void load_floats(const T* p, float (&f)[W]) {
    unpack(load_pack<T, W>(p), f);
}

// Rounds each value to T once.
template <typename T, int W>
__device__ __forceinline__ void store_floats(T* p, const float (&f)[W]) {
    Pack<T, W> r;
#pragma unroll
    for (int j = 0; j < W; j++) r.v[j] = from_float<T>(f[j]);
    store_pack<T, W>(p, r);
}

// Host side: whether a pointer allows full-width packs.
inline bool aligned16(const void* p) {
    return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

}  // namespace memtrain::cuda
