// See mma_test_kernels.h. Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type" (groupID g = lane >> 2, threadID_in_group t = lane % 4).
#include <cstring>

#include "cuda/mma_test_kernels.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"

namespace memtrain::mma_test {

// Two 16-bit values as one register, `lo` in the low half.
template <typename E>
__device__ __forceinline__ uint32_t bits2(E lo, E hi) {
    uint16_t l, h;
    std::memcpy(&l, &lo, 2);
    std::memcpy(&h, &hi, 2);
    return (uint32_t)l | ((uint32_t)h << 16);
}

// Writes a 16x8 accumulator fragment into d (row stride ld) at column offset n0:
// c_i at row g (+8 for i >= 2), column 2t + (i & 1).
__device__ __forceinline__ void store_accumulator(float* d, int ld, int n0, const float (&acc)[4],
                                                  int lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; i++) d[(g + (i >= 2 ? 8 : 0)) * ld + n0 + 2 * t + (i & 1)] = acc[i];
}

template <typename E>
static __global__ void mma_direct_kernel(float* d, const E* a, const E* b, const float* c) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    // A: register r holds a_{2r}, a_{2r+1}: row g (+8 for r odd), columns 2t, 2t+1 (+8 for r >= 2).
    uint32_t af[4];
    for (int r = 0; r < 4; r++) {
        const int row = g + (r % 2) * 8, col = 2 * t + (r / 2) * 8;
        af[r] = bits2(a[row * 16 + col], a[row * 16 + col + 1]);
    }
    // B: register r holds b_{2r}, b_{2r+1}: rows (k) 2t, 2t+1 (+8 for r = 1), column g.
    uint32_t bf[2];
    for (int r = 0; r < 2; r++) {
        const int k = 2 * t + r * 8;
        bf[r] = bits2(b[k * 8 + g], b[(k + 1) * 8 + g]);
    }
    float acc[4];
    for (int i = 0; i < 4; i++) acc[i] = c[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)];
    cuda::mma_m16n8k16<E>(acc, af, bf[0], bf[1]);
    store_accumulator(d, 8, 0, acc, lane);
}

template <typename E>
void mma_direct(float* d, const E* a, const E* b, const float* c, cudaStream_t stream) {
    MT_LAUNCH(mma_direct_kernel<E>, 1, 32, 0, stream, d, a, b, c);
}

constexpr int kPad = 24;  // padded row of the shared tiles: 48 bytes, a multiple of 16

static __global__ void ldmatrix_kernel(uint32_t* plain, uint32_t* trans, const uint16_t* m) {
    __shared__ __align__(16) uint16_t tile[16 * kPad];
    const int lane = threadIdx.x;
    for (int e = lane; e < 256; e += 32) tile[(e / 16) * kPad + e % 16] = m[e];
    __syncwarp();
    // Lane l gives row l % 8 of matrix l / 8; matrix i covers rows (i % 2) * 8.., cols (i / 2) * 8.
    const uint16_t* row = tile + (lane % 8 + ((lane / 8) % 2) * 8) * kPad + (lane / 16) * 8;
    uint32_t r[4];
    cuda::ldmatrix_x4(r, row);
    for (int i = 0; i < 4; i++) plain[lane * 4 + i] = r[i];
    cuda::ldmatrix_x4_trans(r, row);
    for (int i = 0; i < 4; i++) trans[lane * 4 + i] = r[i];
}

void ldmatrix_fragments(uint32_t* plain, uint32_t* trans, const uint16_t* m, cudaStream_t stream) {
    MT_LAUNCH(ldmatrix_kernel, 1, 32, 0, stream, plain, trans, m);
}

template <typename E>
static __global__ void mma_ldmatrix_kernel(float* d_nk, float* d_kn, const E* a, const E* b_nk,
                                           const E* b_kn) {
    __shared__ __align__(16) E sa[16 * kPad];
    __shared__ __align__(16) E sbn[16 * kPad];
    __shared__ __align__(16) E sbk[16 * kPad];
    const int lane = threadIdx.x;
    for (int e = lane; e < 256; e += 32) {
        const int o = (e / 16) * kPad + e % 16;
        sa[o] = a[e];
        sbn[o] = b_nk[e];
        sbk[o] = b_kn[e];
    }
    __syncwarp();
    // A: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = a0a1, a2a3, a4a5,
    // a6a7.
    uint32_t af[4];
    cuda::ldmatrix_x4(af, sa + (lane % 16) * kPad + (lane / 16) * 8);
    // B stored [n][k]: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
    // = b0b1, b2b3 of n-tile 0, then of n-tile 1.
    uint32_t bf[4];
    cuda::ldmatrix_x4(bf, sbn + (lane % 8 + (lane / 16) * 8) * kPad + ((lane / 8) % 2) * 8);
    float acc0[4] = {}, acc1[4] = {};
    cuda::mma_m16n8k16<E>(acc0, af, bf[0], bf[1]);
    cuda::mma_m16n8k16<E>(acc1, af, bf[2], bf[3]);
    store_accumulator(d_nk, 16, 0, acc0, lane);
    store_accumulator(d_nk, 16, 8, acc1, lane);
    // B stored [k][n], transposed on load: matrices (k 0-7, n 0-7), (k 8-15, n 0-7),
    // (k 0-7, n 8-15), (k 8-15, n 8-15).
    cuda::ldmatrix_x4_trans(bf, sbk + (lane % 8 + ((lane / 8) % 2) * 8) * kPad + (lane / 16) * 8);
    float acc2[4] = {}, acc3[4] = {};
    cuda::mma_m16n8k16<E>(acc2, af, bf[0], bf[1]);
    cuda::mma_m16n8k16<E>(acc3, af, bf[2], bf[3]);
    store_accumulator(d_kn, 16, 0, acc2, lane);
    store_accumulator(d_kn, 16, 8, acc3, lane);
}

template <typename E>
void mma_via_ldmatrix(float* d_nk, float* d_kn, const E* a, const E* b_nk, const E* b_kn,
                      cudaStream_t stream) {
    MT_LAUNCH(mma_ldmatrix_kernel<E>, 1, 32, 0, stream, d_nk, d_kn, a, b_nk, b_kn);
}

template void mma_direct<__nv_bfloat16>(float*, const __nv_bfloat16*, const __nv_bfloat16*,
                                        const float*, cudaStream_t);
template void mma_direct<__half>(float*, const __half*, const __half*, const float*, cudaStream_t);
template void mma_via_ldmatrix<__nv_bfloat16>(float*, float*, const __nv_bfloat16*,
                                              const __nv_bfloat16*, const __nv_bfloat16*,
                                              cudaStream_t);
template void mma_via_ldmatrix<__half>(float*, float*, const __half*, const __half*, const __half*,
                                       cudaStream_t);

}  // namespace memtrain::mma_test
