// Block-scaled int8 storage for the CPU model's saved activations (train.cpu_activations =
// "int8"): blocks of kInt8Block values share one fp32 scale, a power of two, so that a value
// quantizes the same way twice. qdq_int8 rounds a field in place where the forward makes it (the
// forward, the backward and any recompute then read the same values); to_int8 stores the rounded
// field without a further loss and from_int8 gives it back bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace memtrain::cpu {

inline constexpr std::size_t kInt8Block = 256;

// Bytes of n values stored: the blocks' fp32 scales first, then one signed byte per value.
inline std::size_t int8_store_bytes(std::size_t n) {
    return n + sizeof(float) * ((n + kInt8Block - 1) / kInt8Block);
}

// Each block's scale is the least power of two s with max|x| <= 127 s; x becomes round(x / s) s
// (to nearest, ties to even). A block holding a non-finite value becomes NaN throughout.
void qdq_int8(float* x, std::size_t n);
// x (already through qdq_int8) into `out` (int8_store_bytes(n), 4-byte aligned), and back.
void to_int8(void* out, const float* x, std::size_t n);
void from_int8(float* x, const void* in, std::size_t n);
// The values [begin, begin + count) of an n-value store: begin on a block boundary, and the part
// ending on one or at n, so each of its blocks is one of the whole field's (the tiled MLP stores
// and reads a tile of rows at a time).
void to_int8_part(void* out, std::size_t n, std::size_t begin, const float* x, std::size_t count);
// qdq_int8 of the part's values x and to_int8_part of the result, in one pass over them.
void qdq_int8_store(float* x, void* out, std::size_t n, std::size_t begin, std::size_t count);
void from_int8_part(float* x, const void* in, std::size_t n, std::size_t begin, std::size_t count);

}  // namespace memtrain::cpu
