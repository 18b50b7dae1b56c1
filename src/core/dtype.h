// Element types of stored tensors (safetensors files, quantized parts, checkpoints): their names
// as safetensors headers spell them and their sizes. Below io/ and quant/, which both use them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace memtrain {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

// The one precision type: what a model computes in and stores its parameters, gradients and
// activations in (mixed precision keeps fp32 master weights beside bf16 or fp16).
enum class Precision { fp32, bf16, fp16 };
const char* precision_name(Precision p);  // "fp32" | "bf16" | "fp16"
std::optional<Precision> find_precision(std::string_view name);

// Bytes per element.
std::size_t dtype_size(DType dtype);
// The name used in safetensors headers: "F32", "BF16", ...
std::string_view dtype_name(DType dtype);
// The dtype for a header name, or nullopt if it is not one we know.
std::optional<DType> parse_dtype(std::string_view name);

// bf16 as its 16 stored bits: the top half of an fp32. Rounded to nearest even; NaN stays a
// (quiet) NaN. Inline: the CPU engine's bf16 GEMM operands convert through these.
inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

}  // namespace memtrain
