// Warp-level tensor-core primitives for the kernels of kernels/cuda: mma.sync m16n8k16 with fp32
// accumulation on bf16 / fp16 operands, ldmatrix (four 8x8 b16 matrices, plain or transposed),
// and the packing of two values into one operand register. Internal to kernels/cuda.
//
// On a GPU each is one PTX instruction. Under cudasim (MEMTRAIN_CUDA_SIM) each is emulated as a
// warp collective: every lane deposits its operand registers (or its row address) through
// cudasim::warp_exchange, then computes the registers it would receive from all lanes' deposits,
// with exactly the lane <-> element maps of the PTX ISA, so that code which depends on which lane
// holds which element (the softmax of flash attention) runs as it would on the hardware.
//
// Fragment layouts, from the PTX ISA (sections "Matrix Fragments for mma.m16n8k16 with floating
// point type" and "Warp-level matrix load instruction: ldmatrix",
// https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float
// and #warp-level-matrix-instructions-ldmatrix), with groupID = lane >> 2 and
// threadID_in_group = lane % 4 (g and t below); a .b32 register holds two 16-bit elements, the
// lower-numbered one in the low half:
//   A (16x16, row): a0..a7 in 4 registers; row = g for a0,a1,a4,a5 and g + 8 for a2,a3,a6,a7;
//                   col = 2t + (i & 1) for i < 4, 2t + (i & 1) + 8 for i >= 4.
//   B (16x8, col):  b0..b3 in 2 registers; row (k) = 2t + (i & 1) for i < 2, + 8 for i >= 2;
//                   col (n) = g.
//   C, D (16x8):    c0..c3 fp32; row = g for i < 2, g + 8 for i >= 2; col = 2t + (i & 1).
//   ldmatrix .m8n8.x4.b16: lanes 8m..8m+7 give the addresses of rows 0..7 of matrix m (16-byte
//                   aligned); register m of lane l receives row l / 4, cols 2(l % 4) and
//                   2(l % 4) + 1 of matrix m; with .trans, rows 2(l % 4) and 2(l % 4) + 1 of
//                   col l / 4 instead (the matrix read as column-major).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/common.cuh"

#if MEMTRAIN_CUDA_SIM
#include <cstdio>
#include <cstdlib>
#endif

namespace memtrain::cuda {

// Two fp32 values rounded to E (round to nearest even) in one operand register, `lo` in the low
// half: the element with the lower index in the fragment layouts above.
template <typename E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    uint32_t r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}

#if MEMTRAIN_CUDA_SIM
namespace mma_sim {

// Element `half` (0: low, 1: high) of a register of two E values, as fp32 (exact).
template <typename E>
inline float element(uint32_t reg, int half) {
    const uint16_t bits = (uint16_t)(half ? reg >> 16 : reg & 0xFFFFu);
    E v;
    std::memcpy(static_cast<void*>(&v), &bits, sizeof v);
    return to_float(v);
}

struct MmaOperands {
    uint32_t a[4];
    uint32_t b[2];
};

[[noreturn]] inline void misaligned(const char* what, const void* p) {
    std::fprintf(stderr, "cudasim: %s row address %p is not 16-byte aligned\n", what, p);
    std::abort();
}

// The shared work of ldmatrix_x4 / ldmatrix_x4_trans: exchange the row addresses, then gather.
inline void ldmatrix(uint32_t (&r)[4], const void* row, bool trans) {
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0) misaligned("ldmatrix", row);
    const unsigned char* table = cudasim::warp_exchange(&row, sizeof row);
    const unsigned char* rows[32];
    for (int l = 0; l < 32; l++) {
        std::memcpy(&rows[l], table + (std::size_t)l * cudasim::kMaxExchangeBytes, sizeof rows[l]);
    }
    const int lane = cudasim::lane();
    for (int m = 0; m < 4; m++) {
        uint16_t e[2];
        for (int h = 0; h < 2; h++) {
            // Row and column of the element within matrix m.
            const int mr = trans ? 2 * (lane % 4) + h : lane / 4;
            const int mc = trans ? lane / 4 : 2 * (lane % 4) + h;
            std::memcpy(&e[h], rows[8 * m + mr] + 2 * mc, sizeof e[h]);
        }
        r[m] = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
    }
}

}  // namespace mma_sim
#endif

// d += A * B for a 16x16 A (a: this lane's four registers, layout A above) and a 16x8 B (b0, b1:
// layout B), fp32 accumulation; every lane of the warp must call it (mma.sync).
template <typename E>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#if MEMTRAIN_CUDA_SIM
    const mma_sim::MmaOperands mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
    static_assert(sizeof mine <= cudasim::kMaxExchangeBytes, "mma operands exceed the exchange");
    const unsigned char* table = cudasim::warp_exchange(&mine, sizeof mine);
    mma_sim::MmaOperands ops[32];
    for (int l = 0; l < 32; l++) {
        std::memcpy(&ops[l], table + (std::size_t)l * cudasim::kMaxExchangeBytes, sizeof ops[l]);
    }
    const int lane = cudasim::lane(), g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; i++) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        // The products of two bf16 / fp16 values are exact in fp32; they are summed in k order.
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) {
            // A[row][k] sits with lane 4 * (row % 8) + (k % 8) / 2, register (row >= 8) +
            // 2 * (k >= 8); B[k][col] with lane 4 * col + (k % 8) / 2, register k >= 8.
            const int kl = (k % 8) / 2, kh = k & 1;
            const float av = mma_sim::element<E>(
                ops[4 * (row % 8) + kl].a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], kh);
            const float bv = mma_sim::element<E>(ops[4 * col + kl].b[k >= 8 ? 1 : 0], kh);
            sum += av * bv;
        }
        d[i] += sum;
    }
#else
    static_assert(sizeof(E) == 2, "mma_m16n8k16 takes bf16 or fp16 operands");
    if constexpr (std::is_same_v<E, __nv_bfloat16>) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#endif
}

// Four 8x8 matrices of 16-bit elements from shared memory: this lane gives `row`, the address of
// row (lane % 8) of matrix lane / 8 (16-byte aligned); r[m] receives this lane's part of matrix m
// (layout above). Every lane of the warp must call it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if MEMTRAIN_CUDA_SIM
    mma_sim::ldmatrix(r, row, false);
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}
// The same, each matrix transposed on the way (.trans).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if MEMTRAIN_CUDA_SIM
    mma_sim::ldmatrix(r, row, true);
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

}  // namespace memtrain::cuda
