// The storage types of the CUDA kernels (float, __nv_bfloat16, __half) seen from host code:
// conversions with fp32 (round to nearest even) and their names. For the engine (optimizer
// offload, weight I/O) and the tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace memtrain::cuda {

template <typename T>
inline T to_storage(float x) {
    if constexpr (std::is_same_v<T, float>)
        return x;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16_rn(x);
    else
        return __float2half_rn(x);
}

template <typename T>
inline float to_fp32(T x) {
    if constexpr (std::is_same_v<T, float>)
        return x;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(x);
    else
        return __half2float(x);
}

// "fp32", "bf16", "fp16": the train.precision that stores T.
template <typename T>
constexpr const char* precision_name() {
    if constexpr (std::is_same_v<T, float>)
        return "fp32";
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return "bf16";
    else
        return "fp16";
}

}  // namespace memtrain::cuda
