// The CPU engine's GEMMs: fp32 through OpenBLAS, or (train.precision = bf16 on the CPU) bf16
// operands with fp32 accumulation through oneDNN, which runs them on AMX tiles where the CPU has
// them, on AVX512-BF16 dot products where it does not, and on fp32 FMAs (operands widened) on a
// CPU with neither (oneDNN's emulation on AVX-512; below AVX-512, where oneDNN 2.6 has no bf16
// matmul, the widened operands go through OpenBLAS). The result is fp32 either way: only the
// operands are rounded.
//
// Row-major throughout. op(A) is (M,K): A itself is stored (M,K) with leading dimension lda, or
// (K,M) when ta; op(B) is (K,N): B is stored (K,N), or (N,K) when tb. C is (M,N) with ldc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace memtrain::cpu {

// Where the bf16 copies of one GEMM's operands are written: a workspace region the model's arena
// plan sizes (model/activation_layout.h, "bf16 GEMM operands"), so the bytes are planned, not
// allocated behind the report's back. A null Bf16Gemm* means fp32.
struct Bf16Gemm {
    uint16_t* scratch = nullptr;
    std::size_t elems = 0;  // capacity in bf16 elements
};

// C = op(A) op(B) + beta * C (beta 0 or 1). With g, A and B are rounded to bf16 into g's scratch
// (A's (M,K) first, B's (K,N) after it) and multiplied by gemm_bf16; an Error if they do not fit.
void gemm(const Bf16Gemm* g, bool ta, bool tb, int M, int N, int K, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);
// Both operands already bf16 and packed: A's leading dimension is K (or M when ta), B's N (or K
// when tb). The oneDNN primitive of each shape is created once and reused.
void gemm_bf16(bool ta, bool tb, int M, int N, int K, const uint16_t* A, const uint16_t* B,
               float beta, float* C, int ldc);
// Rounds the (rows, cols) matrix `in` with leading dimension ld to packed bf16 (nearest even).
void to_bf16(uint16_t* out, const float* in, int64_t rows, int64_t cols, int64_t ld);
// n bf16 values widened to fp32 (exact).
void from_bf16(float* out, const uint16_t* in, int64_t n);
// Rounds n floats to their nearest bf16 value in place (they stay fp32; to_bf16 of them is exact);
// with `store`, their bf16 bits into it too, in the same pass.
void round_to_bf16(float* x, int64_t n, uint16_t* store = nullptr);

// Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as oneDNN sees it.
bool cpu_has_bf16();
// What the bf16 GEMMs run on, for the start-up line: "oneDNN 2.6.3, AVX512-BF16" (or "AMX",
// or "fp32 FMAs: no bf16 instructions on this CPU").
std::string bf16_gemm_path();

}  // namespace memtrain::cpu
