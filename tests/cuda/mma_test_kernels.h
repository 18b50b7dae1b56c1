// Test kernels for the tensor-core wrappers of kernels/cuda/mma.cuh (mma_m16n8k16, ldmatrix_x4,
// ldmatrix_x4_trans), built for the GPU and for cudasim alike: the operand fragments are gathered
// here straight from the PTX ISA's layout formulas, so on cudasim the tests check the emulation's
// lane <-> element maps, and on a GPU the same tests check the emulation's maps against the
// hardware. Each launches one warp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::mma_test {

// d = a * b + c for a (16,16) row-major, b (16,8) row-major [k][n], c and d (16,8) row-major
// fp32: one mma_m16n8k16 whose fragments each lane reads from global memory by the PTX layouts.
// E is __nv_bfloat16 or __half.
template <typename E>
void mma_direct(float* d /*(16,8)*/, const E* a /*(16,16)*/, const E* b /*(16,8)*/,
                const float* c /*(16,8)*/, cudaStream_t stream = 0);

// The registers ldmatrix_x4 and ldmatrix_x4_trans give each lane for the 16-bit matrix m staged
// in shared memory as four 8x8 matrices (rows 0-7 / 8-15 by columns 0-7 / 8-15, in the order
// (0-7, 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)): plain[lane * 4 + i], trans[lane * 4 + i].
void ldmatrix_fragments(uint32_t* plain /*(32,4)*/, uint32_t* trans /*(32,4)*/,
                        const uint16_t* m /*(16,16)*/, cudaStream_t stream = 0);

// Two 16x16 products with operands loaded the way the attention kernels load them:
// d_nk = a * b_nk^T (B given as [n][k], loaded with ldmatrix_x4) and d_kn = a * b_kn (B given
// as [k][n], loaded with ldmatrix_x4_trans); A with ldmatrix_x4. All (16,16) row-major.
template <typename E>
void mma_via_ldmatrix(float* d_nk /*(16,16)*/, float* d_kn /*(16,16)*/, const E* a /*(16,16)*/,
                      const E* b_nk /*(16,16)*/, const E* b_kn /*(16,16)*/,
                      cudaStream_t stream = 0);

}  // namespace memtrain::mma_test
