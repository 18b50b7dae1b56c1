// Causal grouped-query attention on tensor cores: FlashAttention-2 (Dao, 2023) on
// mma.sync.m16n8k16 with bf16 / fp16 operands and fp32 accumulators (kernels/cuda/mma.cuh), for
// head sizes 64 and 128. No (T,T) matrix is stored; the backward recomputes the probabilities
// from the forward's log-sum-exp.
//
// Work split (a CTA is 4 warps; a warp owns 16 rows of a 64-row tile; K/V and Q/dO tiles of 64
// rows are staged in shared memory with rows padded by 16 bytes, so that the eight 16-byte rows
// an ldmatrix phase reads fall in distinct banks):
//   forward: a CTA per (batch, head, 64-query tile) walks the key tiles 0..diagonal in order with
//            an online softmax in fp32 (exp2 with a log2(e) prescale); S and P stay in registers
//            (an accumulator fragment of S is, packed to bf16/fp16, the A fragment of P V).
//   d(q):    a CTA per (batch, head, 64-query tile) walks the key tiles 0..diagonal in order,
//            recomputing P from lse: dS = P (dO V^T - delta), dQ += dS K.
//   d(k,v):  a CTA per (batch, kv head, 64-key tile) walks the group's query heads in order, then
//            the query tiles diagonal..last in order: dV += P^T dO, dK += dS^T Q.
// Every accumulator has one owner and a fixed order of additions: deterministic, no atomics.
// Causal skipping: tiles above the diagonal are never visited, and within the diagonal tile each
// warp skips the 16-column blocks that lie wholly above its rows.
//
// What a tuning pass on a GPU should try (tile shapes change the order of the fp32 sums, so the
// last bits, not the accuracy):
//   - cp.async (with a simulator branch) and double-buffered K/V (Q/dO) tiles, so loads overlap
//     the mma work; now every tile is loaded synchronously between two barriers;
//   - 8 warps / 128-row tiles for the forward and d(q), and a larger key tile for d(k,v);
//   - keeping Q (and dO) fragments in registers across key tiles where the register budget
//     allows (now re-read with ldmatrix per tile: holding them made the hs 128 forward spill);
//     ptxas -v for sm_90 now reports no spills, and 96 / 133 (forward, hs 64 / 128), 143 / 180
//     (d(q)), 208 / 251 (d(k,v)) registers per thread;
//   - staging the output tile through shared memory for 16-byte coalesced stores (now each quad
//     of lanes stores 16-byte row segments);
//   - an XOR swizzle instead of the padding, to cut shared memory per CTA and raise occupancy;
//   - computing delta inside d(q) instead of its own kernel (d(k,v) runs after d(q));
//   - grid order: the longest tiles are launched first (forward and d(q): the last query tiles;
//     d(k,v): the first key tiles); a persistent-CTA schedule could balance further.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

using attention_detail::Dims;

constexpr int kTile = 64;  // rows of every shared-memory tile: queries or keys
constexpr int kWarps = 4;  // 16 rows of the CTA's tile each
constexpr int kTcThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// A (kTile, HS) tile of E in shared memory, rows padded to kStride = HS + 8 elements (16 bytes).
template <int HS>
constexpr int kStride = HS + 8;
template <typename E, int HS>
constexpr size_t tile_bytes() {
    return sizeof(E) * kTile * kStride<HS>;
}

// ---- device helpers ----------------------------------------------------------------------------

__device__ __forceinline__ void copy16(void* dst, const void* src) {
#if MEMTRAIN_CUDA_SIM
    std::memcpy(dst, src, 16);
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void zero16(void* dst) {
#if MEMTRAIN_CUDA_SIM
    std::memset(dst, 0, 16);
#else
    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
#endif
}

// Rows [r0, r0 + kTile) of a matrix whose row r has HS elements at src + r * ld, into a padded
// shared tile; rows >= T are zeros. All threads of the CTA take part. `vec`: src and ld allow
// 16-byte loads.
template <typename E, int HS>
__device__ __forceinline__ void load_tile(E* dst, const E* src, int64_t ld, int r0, int T,
                                          bool vec) {
    constexpr int kChunks = HS / 8;  // 16-byte pieces of a row
    for (int c = threadIdx.x; c < kTile * kChunks; c += kTcThreads) {
        const int r = c / kChunks, x = (c % kChunks) * 8;
        E* dp = dst + r * kStride<HS> + x;
        if (r0 + r < T) {
            const E* sp = src + (int64_t)(r0 + r) * ld + x;
            if (vec) {
                copy16(dp, sp);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) dp[e] = sp[e];
            }
        } else {
            zero16(dp);
        }
    }
}

// Two adjacent outputs (columns 2t, 2t + 1 of an accumulator fragment) to global memory.
template <typename E>
__device__ __forceinline__ void store_pair(E* dst, float lo, float hi, bool vec) {
    if (vec) {
        const uint32_t v = pack2<E>(lo, hi);
#if MEMTRAIN_CUDA_SIM
        std::memcpy(static_cast<void*>(dst), &v, sizeof v);
#else
        *reinterpret_cast<uint32_t*>(dst) = v;  // one 4-byte store (dst is 4-byte aligned)
#endif
    } else {
        dst[0] = from_float<E>(lo);
        dst[1] = from_float<E>(hi);
    }
}

// Sum / max over the four lanes of a quad (the lanes that share a fragment row). The butterfly
// gives every lane the same value: each step adds two values in either order.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
    return v;
}

// Row addresses this lane gives ldmatrix_x4, for a 16x16 block at (r0, c0) of a padded tile:
//   a_operand: the A fragment of rows r0..r0+15, k = columns c0..c0+15;
//   b_pair:    B fragments (k = columns c0..c0+15) of two n-tiles, rows r0..r0+7 and r0+8..r0+15,
//              from a tile stored as [n][k] (registers 0,1: first n-tile; 2,3: second);
//   b_pair_trans (with ldmatrix_x4_trans): B fragments (k = rows r0..r0+15) of two n-tiles,
//              columns c0..c0+7 and c0+8..c0+15, from a tile stored as [k][n].
template <int HS, typename E>
__device__ __forceinline__ const E* a_operand(const E* tile, int r0, int c0, int lane) {
    return tile + (r0 + lane % 16) * kStride<HS> + c0 + (lane / 16) * 8;
}
template <int HS, typename E>
__device__ __forceinline__ const E* b_pair(const E* tile, int r0, int c0, int lane) {
    return tile + (r0 + lane % 8 + (lane / 16) * 8) * kStride<HS> + c0 + ((lane / 8) % 2) * 8;
}
template <int HS, typename E>
__device__ __forceinline__ const E* b_pair_trans(const E* tile, int r0, int c0, int lane) {
    return tile + (r0 + lane % 8 + ((lane / 8) % 2) * 8) * kStride<HS> + c0 + (lane / 16) * 8;
}

// The A fragment (16 rows x 16 k) made of accumulator n-tiles 2kk and 2kk + 1 (each 16x8),
// rounded to E: how P and dS feed the next product without leaving registers.
template <typename E>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                                  const float (&hi)[4]) {
    a[0] = pack2<E>(lo[0], lo[1]);  // row g,     k 2t, 2t+1
    a[1] = pack2<E>(lo[2], lo[3]);  // row g + 8, k 2t, 2t+1
    a[2] = pack2<E>(hi[0], hi[1]);  // row g,     k 2t+8, 2t+9
    a[3] = pack2<E>(hi[2], hi[3]);  // row g + 8, k 2t+8, 2t+9
}

// ---- forward -----------------------------------------------------------------------------------

// Grid (B * NH, query tiles); blockIdx.y = 0 is the last query tile (the most keys).
template <typename E, int HS>
static __global__ void __launch_bounds__(kTcThreads)
    flash_forward_kernel(E* out, float* lse, const E* qkv, Dims d, float scale_log2, bool vec) {
    constexpr int S = kStride<HS>;
    MT_DYNAMIC_SHARED(E, smem);
    E* sq = smem;
    E* sk = sq + kTile * S;
    E* sv = sk + kTile * S;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.x, b = bh / d.NH, h = bh % d.NH, kvh = h / d.group;
    const int qt = (int)gridDim.y - 1 - (int)blockIdx.y;
    const int q0 = qt * kTile;
    const E* batch = qkv + (int64_t)b * d.T * d.QKV;
    const E* ksrc = batch + d.C + kvh * HS;
    const E* vsrc = ksrc + d.NKV * HS;
    load_tile<E, HS>(sq, batch + h * HS, d.QKV, q0, d.T, vec);

    const int wr = warp * 16;  // this warp's first row within the tile
    const int row0 = q0 + wr + g, row1 = row0 + 8;

    float o[HS / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY};  // running max of the scaled scores (log2 units)
    float l[2] = {0.0f, 0.0f};            // this lane's part of the running sum
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * kTile;
        __syncthreads();  // the Q tile is in; every warp is done with the previous K, V tiles
        load_tile<E, HS>(sk, ksrc, d.QKV, k0, d.T, vec);
        load_tile<E, HS>(sv, vsrc, d.QKV, k0, d.T, vec);
        __syncthreads();
        // In the diagonal tile, keys beyond 16 (warp + 1) are above all of this warp's rows.
        const int blocks = kt == qt ? warp + 1 : kTile / 16;

        float s[kTile / 8][4] = {};
#pragma unroll
        for (int ks = 0; ks < HS / 16; ks++) {
            // Q's fragments are re-read per tile rather than held: 32 registers more at hs 128.
            uint32_t qa[4];
            ldmatrix_x4(qa, a_operand<HS>(sq, wr, ks * 16, lane));
#pragma unroll
            for (int np = 0; np < kTile / 16; np++) {
                if (np < blocks) {
                    uint32_t kf[4];
                    ldmatrix_x4(kf, b_pair<HS>(sk, np * 16, ks * 16, lane));
                    mma_m16n8k16<E>(s[2 * np], qa, kf[0], kf[1]);
                    mma_m16n8k16<E>(s[2 * np + 1], qa, kf[2], kf[3]);
                }
            }
        }

        // Online softmax on this lane's rows row0 (elements 0, 1) and row1 (elements 2, 3).
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < kTile / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1);
                const int row = e < 2 ? row0 : row1;
                const float v = key <= row && key < d.T ? s[nt][e] * scale_log2 : -INFINITY;
                s[nt][e] = v;
                mx[e / 2] = fmaxf(mx[e / 2], v);
            }
        }
        float base[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = quad_max(mx[r]);
            // A row with no key yet (not reached with 64-aligned tiles, kept safe): exp2(-inf) = 0.
            base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];
            alpha[r] = exp2f(m[r] - base[r]);
            m[r] = mx[r];
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int nt = 0; nt < kTile / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nt][e] = exp2f(s[nt][e] - base[e / 2]);
                l[e / 2] += s[nt][e];
            }
        }
#pragma unroll
        for (int nt = 0; nt < HS / 8; nt++) {
            o[nt][0] *= alpha[0];
            o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1];
            o[nt][3] *= alpha[1];
        }

        // O += P V: P's accumulator fragments are the A operand; V [key][dim] gives B via .trans.
#pragma unroll
        for (int kk = 0; kk < kTile / 16; kk++) {
            if (kk < blocks) {
                uint32_t pa[4];
                accumulators_to_a<E>(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
                for (int dp = 0; dp < HS / 16; dp++) {
                    uint32_t vf[4];
                    ldmatrix_x4_trans(vf, b_pair_trans<HS>(sv, kk * 16, dp * 16, lane));
                    mma_m16n8k16<E>(o[2 * dp], pa, vf[0], vf[1]);
                    mma_m16n8k16<E>(o[2 * dp + 1], pa, vf[2], vf[3]);
                }
            }
        }
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] = quad_sum(l[r]);
        inv[r] = 1.0f / l[r];
    }
    E* obase = out + (int64_t)b * d.T * d.C + h * HS;
#pragma unroll
    for (int nt = 0; nt < HS / 8; nt++) {
        const int col = nt * 8 + 2 * t;
        if (row0 < d.T) {
            store_pair(obase + (int64_t)row0 * d.C + col, o[nt][0] * inv[0], o[nt][1] * inv[0],
                       vec);
        }
        if (row1 < d.T) {
            store_pair(obase + (int64_t)row1 * d.C + col, o[nt][2] * inv[1], o[nt][3] * inv[1],
                       vec);
        }
    }
    if (t == 0) {
        float* lrow = lse + (int64_t)bh * d.T;
        if (row0 < d.T) lrow[row0] = (m[0] + log2f(l[0])) * kLn2;
        if (row1 < d.T) lrow[row1] = (m[1] + log2f(l[1])) * kLn2;
    }
}

// ---- backward: d(q) ----------------------------------------------------------------------------

// Grid (B * NH, query tiles); blockIdx.y = 0 is the last query tile.
template <typename E, int HS>
static __global__ void __launch_bounds__(kTcThreads)
    flash_dq_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* delta,
                    Dims d, float scale, float scale_log2, bool vec) {
    constexpr int S = kStride<HS>;
    MT_DYNAMIC_SHARED(E, smem);
    E* sq = smem;
    E* sdo = sq + kTile * S;
    E* sk = sdo + kTile * S;
    E* sv = sk + kTile * S;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.x, b = bh / d.NH, h = bh % d.NH, kvh = h / d.group;
    const int qt = (int)gridDim.y - 1 - (int)blockIdx.y;
    const int q0 = qt * kTile;
    const E* batch = qkv + (int64_t)b * d.T * d.QKV;
    const E* ksrc = batch + d.C + kvh * HS;
    const E* vsrc = ksrc + d.NKV * HS;
    load_tile<E, HS>(sq, batch + h * HS, d.QKV, q0, d.T, vec);
    load_tile<E, HS>(sdo, dout + (int64_t)b * d.T * d.C + h * HS, d.C, q0, d.T, vec);

    const int wr = warp * 16;
    const int rows[2] = {q0 + wr + g, q0 + wr + g + 8};
    float lse2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool in = rows[r] < d.T;
        lse2[r] = in ? lse[(int64_t)bh * d.T + rows[r]] * kLog2e : 0.0f;
        dl[r] = in ? delta[(int64_t)bh * d.T + rows[r]] : 0.0f;
    }

    float dq[HS / 8][4] = {};
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * kTile;
        __syncthreads();
        load_tile<E, HS>(sk, ksrc, d.QKV, k0, d.T, vec);
        load_tile<E, HS>(sv, vsrc, d.QKV, k0, d.T, vec);
        __syncthreads();
        const int blocks = kt == qt ? warp + 1 : kTile / 16;

        // S = Q K^T and dP = dO V^T for this warp's 16 rows and the tile's keys.
        float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
#pragma unroll
        for (int ks = 0; ks < HS / 16; ks++) {
            uint32_t qa[4], ga[4];
            ldmatrix_x4(qa, a_operand<HS>(sq, wr, ks * 16, lane));
            ldmatrix_x4(ga, a_operand<HS>(sdo, wr, ks * 16, lane));
#pragma unroll
            for (int np = 0; np < kTile / 16; np++) {
                if (np < blocks) {
                    uint32_t kf[4], vf[4];
                    ldmatrix_x4(kf, b_pair<HS>(sk, np * 16, ks * 16, lane));
                    mma_m16n8k16<E>(s[2 * np], qa, kf[0], kf[1]);
                    mma_m16n8k16<E>(s[2 * np + 1], qa, kf[2], kf[3]);
                    ldmatrix_x4(vf, b_pair<HS>(sv, np * 16, ks * 16, lane));
                    mma_m16n8k16<E>(dp[2 * np], ga, vf[0], vf[1]);
                    mma_m16n8k16<E>(dp[2 * np + 1], ga, vf[2], vf[3]);
                }
            }
        }
        // dS = P (dP - delta), P recomputed from lse; zero outside the causal mask and past T.
#pragma unroll
        for (int nt = 0; nt < kTile / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1);
                const int row = rows[e / 2];
                const float p =
                    key <= row && row < d.T ? exp2f(s[nt][e] * scale_log2 - lse2[e / 2]) : 0.0f;
                s[nt][e] = p * (dp[nt][e] - dl[e / 2]);
            }
        }
        // dQ += dS K: K [key][dim] gives B (k = keys) via .trans.
#pragma unroll
        for (int kk = 0; kk < kTile / 16; kk++) {
            if (kk < blocks) {
                uint32_t da[4];
                accumulators_to_a<E>(da, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
                for (int np = 0; np < HS / 16; np++) {
                    uint32_t kf[4];
                    ldmatrix_x4_trans(kf, b_pair_trans<HS>(sk, kk * 16, np * 16, lane));
                    mma_m16n8k16<E>(dq[2 * np], da, kf[0], kf[1]);
                    mma_m16n8k16<E>(dq[2 * np + 1], da, kf[2], kf[3]);
                }
            }
        }
    }

    E* dqbase = dqkv + (int64_t)b * d.T * d.QKV + h * HS;
#pragma unroll
    for (int nt = 0; nt < HS / 8; nt++) {
        const int col = nt * 8 + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (rows[r] < d.T) {
                store_pair(dqbase + (int64_t)rows[r] * d.QKV + col, dq[nt][2 * r] * scale,
                           dq[nt][2 * r + 1] * scale, vec);
            }
        }
    }
}

// ---- backward: d(k), d(v) ----------------------------------------------------------------------

// Grid (B * NKV, key tiles); blockIdx.y = 0 is the first key tile (the most queries). The warp's
// accumulator fragments hold its 16 keys (rows) by head dimensions; the transposed products
// S^T = K Q^T and dP^T = V dO^T have the keys as rows and the queries as columns.
template <typename E, int HS>
static __global__ void __launch_bounds__(kTcThreads)
    flash_dkv_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* delta,
                     Dims d, float scale, float scale_log2, bool vec) {
    constexpr int S = kStride<HS>;
    // Queries per inner step: 64 for hs 64; 32 for hs 128, where the dK, dV accumulators alone
    // take 128 registers per thread.
    constexpr int kSub = HS == 128 ? 32 : 64;
    MT_DYNAMIC_SHARED(E, smem);
    E* sk = smem;
    E* sv = sk + kTile * S;
    E* sq = sv + kTile * S;
    E* sdo = sq + kTile * S;
    float* slse = reinterpret_cast<float*>(sdo + kTile * S);  // lse * log2(e) of the query tile
    float* sdelta = slse + kTile;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int bk = blockIdx.x, b = bk / d.NKV, kvh = bk % d.NKV;
    const int kt = (int)blockIdx.y;
    const int k0 = kt * kTile;
    const int nqt = (d.T + kTile - 1) / kTile;
    const E* batch = qkv + (int64_t)b * d.T * d.QKV;
    load_tile<E, HS>(sk, batch + d.C + kvh * HS, d.QKV, k0, d.T, vec);
    load_tile<E, HS>(sv, batch + d.C + (d.NKV + kvh) * HS, d.QKV, k0, d.T, vec);

    const int wr = warp * 16;
    const int keys[2] = {k0 + wr + g, k0 + wr + g + 8};
    float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
    for (int h = kvh * d.group; h < (kvh + 1) * d.group; h++) {
        const int64_t bh = (int64_t)b * d.NH + h;
        for (int qt = kt; qt < nqt; qt++) {
            const int q0 = qt * kTile;
            __syncthreads();  // every warp is done with the previous Q, dO tiles
            load_tile<E, HS>(sq, batch + h * HS, d.QKV, q0, d.T, vec);
            load_tile<E, HS>(sdo, dout + (int64_t)b * d.T * d.C + h * HS, d.C, q0, d.T, vec);
            for (int c = threadIdx.x; c < kTile; c += kTcThreads) {
                const bool in = q0 + c < d.T;
                slse[c] = in ? lse[bh * d.T + q0 + c] * kLog2e : 0.0f;
                sdelta[c] = in ? delta[bh * d.T + q0 + c] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int c0 = 0; c0 < kTile; c0 += kSub) {
                // In the diagonal tile, query blocks wholly before this warp's keys are skipped.
                auto needed = [&](int block) { return qt > kt || c0 + 16 * block >= wr; };
                float s[kSub / 8][4] = {}, dp[kSub / 8][4] = {};
#pragma unroll
                for (int ks = 0; ks < HS / 16; ks++) {
                    uint32_t ka[4], va[4];
                    ldmatrix_x4(ka, a_operand<HS>(sk, wr, ks * 16, lane));
                    ldmatrix_x4(va, a_operand<HS>(sv, wr, ks * 16, lane));
#pragma unroll
                    for (int np = 0; np < kSub / 16; np++) {
                        if (needed(np)) {
                            uint32_t qf[4], gf[4];
                            ldmatrix_x4(qf, b_pair<HS>(sq, c0 + np * 16, ks * 16, lane));
                            mma_m16n8k16<E>(s[2 * np], ka, qf[0], qf[1]);
                            mma_m16n8k16<E>(s[2 * np + 1], ka, qf[2], qf[3]);
                            ldmatrix_x4(gf, b_pair<HS>(sdo, c0 + np * 16, ks * 16, lane));
                            mma_m16n8k16<E>(dp[2 * np], va, gf[0], gf[1]);
                            mma_m16n8k16<E>(dp[2 * np + 1], va, gf[2], gf[3]);
                        }
                    }
                }
                // P^T and dS^T = P^T (dP^T - delta): element (key, query).
#pragma unroll
                for (int nt = 0; nt < kSub / 8; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int c = c0 + nt * 8 + 2 * t + (e & 1);
                        const int query = q0 + c;
                        const float p = query >= keys[e / 2] && query < d.T
                                            ? exp2f(s[nt][e] * scale_log2 - slse[c])
                                            : 0.0f;
                        s[nt][e] = p;
                        dp[nt][e] = p * (dp[nt][e] - sdelta[c]);
                    }
                }
                // dV += P^T dO and dK += dS^T Q (k = queries): dO, Q [query][dim] via .trans.
#pragma unroll
                for (int kk = 0; kk < kSub / 16; kk++) {
                    if (needed(kk)) {
                        uint32_t pa[4], da[4];
                        accumulators_to_a<E>(pa, s[2 * kk], s[2 * kk + 1]);
                        accumulators_to_a<E>(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
                        for (int np = 0; np < HS / 16; np++) {
                            uint32_t gf[4], qf[4];
                            ldmatrix_x4_trans(gf,
                                              b_pair_trans<HS>(sdo, c0 + kk * 16, np * 16, lane));
                            mma_m16n8k16<E>(dv[2 * np], pa, gf[0], gf[1]);
                            mma_m16n8k16<E>(dv[2 * np + 1], pa, gf[2], gf[3]);
                            ldmatrix_x4_trans(qf,
                                              b_pair_trans<HS>(sq, c0 + kk * 16, np * 16, lane));
                            mma_m16n8k16<E>(dk[2 * np], da, qf[0], qf[1]);
                            mma_m16n8k16<E>(dk[2 * np + 1], da, qf[2], qf[3]);
                        }
                    }
                }
            }
        }
    }

    E* dkbase = dqkv + (int64_t)b * d.T * d.QKV + d.C + kvh * HS;
    E* dvbase = dkbase + d.NKV * HS;
#pragma unroll
    for (int nt = 0; nt < HS / 8; nt++) {
        const int col = nt * 8 + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (keys[r] < d.T) {
                const int64_t off = (int64_t)keys[r] * d.QKV + col;
                store_pair(dkbase + off, dk[nt][2 * r] * scale, dk[nt][2 * r + 1] * scale, vec);
                store_pair(dvbase + off, dv[nt][2 * r], dv[nt][2 * r + 1], vec);
            }
        }
    }
}

// ---- launch ------------------------------------------------------------------------------------

// Dynamic shared memory above the default 48 KiB must be allowed per kernel (and device).
static void allow_smem(const void* kernel, size_t bytes) {
    if (bytes > 48 * 1024) {
        MT_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    }
}

static bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename E, int HS>
static void launch_flash_forward(E* out, float* lse, const E* qkv, const Dims& d, bool vec,
                                 cudaStream_t stream) {
    const float scale_log2 = kLog2e / std::sqrt((float)HS);
    const size_t smem = 3 * tile_bytes<E, HS>();
    const auto flash_forward = flash_forward_kernel<E, HS>;
    allow_smem((const void*)flash_forward, smem);
    const dim3 grid(grid_x((int64_t)d.B * d.NH, "batch x heads"), (unsigned)ceil_div(d.T, kTile));
    MT_LAUNCH(flash_forward, grid, kTcThreads, smem, stream, out, lse, qkv, d, scale_log2, vec);
}

template <typename E, int HS>
static void launch_flash_backward(E* dqkv, const float* delta, const E* dout, const E* qkv,
                                  const float* lse, const Dims& d, bool vec, cudaStream_t stream) {
    const float scale = 1.0f / std::sqrt((float)HS);
    const float scale_log2 = kLog2e * scale;
    const unsigned tiles = (unsigned)ceil_div(d.T, kTile);
    const size_t smem = 4 * tile_bytes<E, HS>();
    const auto flash_dq = flash_dq_kernel<E, HS>;
    allow_smem((const void*)flash_dq, smem);
    MT_LAUNCH(flash_dq, dim3(grid_x((int64_t)d.B * d.NH, "batch x heads"), tiles), kTcThreads, smem,
              stream, dqkv, dout, qkv, lse, delta, d, scale, scale_log2, vec);
    const size_t dkv_smem = smem + 2 * kTile * sizeof(float);
    const auto flash_dkv = flash_dkv_kernel<E, HS>;
    allow_smem((const void*)flash_dkv, dkv_smem);
    MT_LAUNCH(flash_dkv, dim3(grid_x((int64_t)d.B * d.NKV, "batch x kv heads"), tiles), kTcThreads,
              dkv_smem, stream, dqkv, dout, qkv, lse, delta, d, scale, scale_log2, vec);
}

// ---- entries -----------------------------------------------------------------------------------

static Dims check_tensor_core_dims(const char* op, int B, int T, int C, int NH, int NKV) {
    const Dims d = attention_detail::check_dims(op, B, T, C, NH, NKV, 256);
    if (d.hs != 64 && d.hs != 128) {
        fail(
            "cuda::{}: C {} NH {}: head size C / NH = {}, expected 64 or 128 (the sizes the "
            "tensor-core kernels are built for; attention_forward / attention_backward fall back "
            "to the reference kernels for others)",
            op, C, NH, d.hs);
    }
    return d;
}

template <typename E>
void attention_forward_tensor_core(E* out, float* lse, const E* qkv, int B, int T, int C, int NH,
                                   int NKV, cudaStream_t stream) {
    static_assert(std::is_same_v<E, __nv_bfloat16> || std::is_same_v<E, __half>,
                  "the tensor-core attention takes bf16 or fp16");
    const Dims d = check_tensor_core_dims("attention_forward_tensor_core", B, T, C, NH, NKV);
    // Rows of qkv and out start at multiples of 8 elements (QKV and C are multiples of 64), so
    // 16-byte aligned bases allow 16-byte loads and 4-byte paired stores.
    const bool vec = aligned16(qkv) && aligned16(out);
    if (d.hs == 64) {
        launch_flash_forward<E, 64>(out, lse, qkv, d, vec, stream);
    } else {
        launch_flash_forward<E, 128>(out, lse, qkv, d, vec, stream);
    }
}

template <typename E>
void attention_backward_tensor_core(E* dqkv, float* delta, const E* dout, const E* qkv,
                                    const E* out, const float* lse, int B, int T, int C, int NH,
                                    int NKV, cudaStream_t stream) {
    static_assert(std::is_same_v<E, __nv_bfloat16> || std::is_same_v<E, __half>,
                  "the tensor-core attention takes bf16 or fp16");
    const Dims d = check_tensor_core_dims("attention_backward_tensor_core", B, T, C, NH, NKV);
    const bool vec = aligned16(dqkv) && aligned16(dout) && aligned16(qkv);
    attention_detail::launch_delta(delta, dout, out, d, stream);
    if (d.hs == 64) {
        launch_flash_backward<E, 64>(dqkv, delta, dout, qkv, lse, d, vec, stream);
    } else {
        launch_flash_backward<E, 128>(dqkv, delta, dout, qkv, lse, d, vec, stream);
    }
}

#define MT_INSTANTIATE_ATTENTION_TC(E)                                                            \
    template void attention_forward_tensor_core<E>(E*, float*, const E*, int, int, int, int, int, \
                                                   cudaStream_t);                                 \
    template void attention_backward_tensor_core<E>(E*, float*, const E*, const E*, const E*,     \
                                                    const float*, int, int, int, int, int,        \
                                                    cudaStream_t);
MT_INSTANTIATE_ATTENTION_TC(__nv_bfloat16)
MT_INSTANTIATE_ATTENTION_TC(__half)
#undef MT_INSTANTIATE_ATTENTION_TC

}  // namespace memtrain::cuda
