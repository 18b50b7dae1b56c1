// LayerNorm and RMSNorm on the GPU: one set of kernels, kLayerNorm selecting the centring and the
// bias. Forward and d(inp) run one warp per row, 4 rows per block, over 128-bit packs where the
// pointers and C allow (pack.cuh). A row that fits (at most 16 packs per lane forward, 8 backward,
// where two rows are held) stays in registers between the statistics pass and the output pass, so
// memory is read once; a wider row is read again on the second pass, from L1/L2. Statistics are
// fp32 and follow the CPU's two-pass formulas. The parameter gradients are column sums: partial
// sums per chunk of kColumnChunkRows rows (rows in order), then one pass over the chunks in order,
// so the result depends on N alone: no atomics.
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace memtrain::cuda {

constexpr int kRowThreads = 128;  // 4 warps, a row each
constexpr int kRowsPerBlock = kRowThreads / 32;

// A lane's share of a row of W-wide packs: packs lane, lane + 32, lane + 64, ... Held in registers
// when kPacks > 0 (the row has at most 32 kPacks packs), otherwise read from memory on each get().
template <typename T, int W, int kPacks>
class LaneRow {
  public:
    __device__ LaneRow(const T* row, int npacks, int lane)
        : row_(row), npacks_(npacks), lane_(lane) {
        if constexpr (kPacks > 0) {
#pragma unroll
            for (int k = 0; k < kPacks; k++) {
                if (has(k)) cache_[k] = load_pack<T, W>(row_ + offset(k));
            }
        }
    }
    // Bound of the lane loops `for (k = 0; k < iters(); k++) if (has(k)) ...`: the constant kPacks
    // when cached, so that the loops unroll and the cache is indexed by constants (registers).
    __device__ int iters() const {
        return kPacks > 0 ? kPacks : (npacks_ + 31) / 32;
    }
    __device__ bool has(int k) const {
        return lane_ + 32 * k < npacks_;
    }
    // Element offset of the lane's k-th pack in the row.
    __device__ int offset(int k) const {
        return (lane_ + 32 * k) * W;
    }
    __device__ void get(int k, float (&f)[W]) const {
        if constexpr (kPacks > 0) {
            unpack(cache_[k], f);
        } else {
            load_floats<T, W>(row_ + offset(k), f);
        }
    }

  private:
    const T* row_;
    int npacks_, lane_;
    Pack<T, W> cache_[kPacks > 0 ? kPacks : 1];
};

// ---- forward -----------------------------------------------------------------------------------
// LayerNorm: out = (x - mean) * rstd * weight + bias; RMSNorm: out = x * rstd * weight (mean and
// bias unused).
template <typename T, int W, int kPacks, bool kLayerNorm>
static __global__ void __launch_bounds__(kRowThreads)
    norm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                        const T* bias, int N, int C, float eps) {
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp leaves together
    const LaneRow<T, W, kPacks> x(inp + row * C, C / W, lane);

    float m = 0.0f;
    if constexpr (kLayerNorm) {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < x.iters(); k++) {
            if (!x.has(k)) continue;
            float f[W];
            x.get(k, f);
#pragma unroll
            for (int j = 0; j < W; j++) sum += f[j];
        }
        m = warp_sum(sum) / C;
    }
    float var = 0.0f;  // RMSNorm: the mean square
#pragma unroll
    for (int k = 0; k < x.iters(); k++) {
        if (!x.has(k)) continue;
        float f[W];
        x.get(k, f);
#pragma unroll
        for (int j = 0; j < W; j++) {
            const float d = f[j] - m;
            var += d * d;
        }
    }
    const float s = 1.0f / sqrtf(warp_sum(var) / C + eps);

    T* o = out + row * C;
#pragma unroll
    for (int k = 0; k < x.iters(); k++) {
        if (!x.has(k)) continue;
        float f[W], w[W], b[W];
        x.get(k, f);
        load_floats<T, W>(weight + x.offset(k), w);
        if constexpr (kLayerNorm) load_floats<T, W>(bias + x.offset(k), b);
#pragma unroll
        for (int j = 0; j < W; j++) {
            f[j] = (f[j] - m) * s * w[j];
            if constexpr (kLayerNorm) f[j] += b[j];
        }
        store_floats<T, W>(o + x.offset(k), f);
    }
    if (lane == 0) {
        if constexpr (kLayerNorm) mean[row] = m;
        rstd[row] = s;
    }
}

// ---- backward ----------------------------------------------------------------------------------
// d(inp) += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = weight * dout, norm =
// (x - mean) * rstd; RMSNorm has no mean and no mean(dnorm) term.
template <typename T, int W, int kPacks, bool kLayerNorm>
static __global__ void __launch_bounds__(kRowThreads)
    norm_dinp_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* mean,
                     const float* rstd, int N, int C) {
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
    if (row >= N) return;
    const LaneRow<T, W, kPacks> d(dout + row * C, C / W, lane), x(inp + row * C, C / W, lane);
    const float m = kLayerNorm ? mean[row] : 0.0f, s = rstd[row];

    float sum_dnorm = 0.0f, sum_dnorm_norm = 0.0f;
#pragma unroll
    for (int k = 0; k < x.iters(); k++) {
        if (!x.has(k)) continue;
        float xf[W], df[W], w[W];
        x.get(k, xf);
        d.get(k, df);
        load_floats<T, W>(weight + x.offset(k), w);
#pragma unroll
        for (int j = 0; j < W; j++) {
            const float norm = (xf[j] - m) * s, dnorm = w[j] * df[j];
            sum_dnorm += dnorm;
            sum_dnorm_norm += dnorm * norm;
        }
    }
    const float dnorm_mean = kLayerNorm ? warp_sum(sum_dnorm) / C : 0.0f;
    const float dnorm_norm_mean = warp_sum(sum_dnorm_norm) / C;

    T* di = dinp + row * C;
#pragma unroll
    for (int k = 0; k < x.iters(); k++) {
        if (!x.has(k)) continue;
        float xf[W], df[W], w[W], g[W];
        x.get(k, xf);
        d.get(k, df);
        load_floats<T, W>(weight + x.offset(k), w);
        load_floats<T, W>(di + x.offset(k), g);
#pragma unroll
        for (int j = 0; j < W; j++) {
            const float norm = (xf[j] - m) * s, dnorm = w[j] * df[j];
            g[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
        store_floats<T, W>(di + x.offset(k), g);
    }
}

// Partial sums over chunk k of kColumnChunkRows rows, the rows in order: pw[k, c] = sum of
// norm * dout, pb[k, c] = sum of dout (LayerNorm only); pw, pb are (nchunks, C). One thread per
// pack of W channels, chunks over blockIdx.y.
template <typename T, int W, bool kLayerNorm>
static __global__ void norm_param_partials_kernel(float* pw, float* pb, const T* dout, const T* inp,
                                                  const float* mean, const float* rstd, int N,
                                                  int C, int nchunks) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= C / W) return;
    const int c = p * W;
    for (int k = blockIdx.y; k < nchunks; k += gridDim.y) {
        const int r0 = k * kColumnChunkRows;
        const int r1 = r0 + kColumnChunkRows < N ? r0 + kColumnChunkRows : N;
        float dw[W] = {}, db[W] = {};
        for (int r = r0; r < r1; r++) {
            float d[W], x[W];
            load_floats<T, W>(dout + (int64_t)r * C + c, d);
            load_floats<T, W>(inp + (int64_t)r * C + c, x);
            const float m = kLayerNorm ? mean[r] : 0.0f, s = rstd[r];
#pragma unroll
            for (int j = 0; j < W; j++) {
                dw[j] += (x[j] - m) * s * d[j];
                db[j] += d[j];
            }
        }
#pragma unroll
        for (int j = 0; j < W; j++) {
            pw[(int64_t)k * C + c + j] = dw[j];
            if constexpr (kLayerNorm) pb[(int64_t)k * C + c + j] = db[j];
        }
    }
}

// dw[c] += sum over chunks k in order of pw[k, c] (and db from pb when db is not null), rounded
// to T once: finish_column_sums for a T destination.
template <typename T>
static __global__ void norm_param_finish_kernel(T* dw, T* db, const float* pw, const float* pb,
                                                int nchunks, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (int k = 0; k < nchunks; k++) {
        sw += pw[(int64_t)k * C + c];
        if (db) sb += pb[(int64_t)k * C + c];
    }
    dw[c] = from_float<T>(to_float(dw[c]) + sw);
    if (db) db[c] = from_float<T>(to_float(db[c]) + sb);
}

// ---- launch ------------------------------------------------------------------------------------
template <int V>
using IntC = std::integral_constant<int, V>;

// Calls f(IntC<W>, IntC<kPacks>) for the row-kernel variant that fits: scalar (W = 1, uncached)
// unless `vec`; else full packs, held in registers with the fewest of 4, 8, 16 (up to kMaxPacks)
// packs per lane that hold the row, or read again on each pass (kPacks = 0) when none does.
template <typename T, int kMaxPacks, typename F>
static void with_row_variant(bool vec, int C, F&& f) {
    constexpr int V = kPackWidth<T>;
    if (!vec) return f(IntC<1>{}, IntC<0>{});
    const int64_t per_lane = ceil_div(C / V, 32);
    if (per_lane <= 4) return f(IntC<V>{}, IntC<4>{});
    if (per_lane <= 8) return f(IntC<V>{}, IntC<8>{});
    if constexpr (kMaxPacks >= 16) {
        if (per_lane <= 16) return f(IntC<V>{}, IntC<16>{});
    }
    return f(IntC<V>{}, IntC<0>{});
}

template <typename T, bool kLayerNorm>
static void norm_forward(const char* op, T* out, float* mean, float* rstd, const T* inp,
                         const T* weight, const T* bias, int N, int C, float eps,
                         cudaStream_t stream) {
    if (N < 0 || C <= 0) fail("cuda::{}: N = {}, C = {}, expected N >= 0 and C > 0", op, N, C);
    if (N == 0) return;
    const bool vec = C % kPackWidth<T> == 0 && aligned16(out) && aligned16(inp) &&
                     aligned16(weight) && (!kLayerNorm || aligned16(bias));
    const unsigned blocks = (unsigned)ceil_div(N, kRowsPerBlock);
    with_row_variant<T, 16>(vec, C, [&](auto w, auto packs) {
        constexpr int W = decltype(w)::value, kPacks = decltype(packs)::value;
        MT_LAUNCH((norm_forward_kernel<T, W, kPacks, kLayerNorm>), blocks, kRowThreads, 0, stream,
                  out, mean, rstd, inp, weight, bias, N, C, eps);
    });
}

template <typename T, bool kLayerNorm>
static void norm_backward(const char* op, T* dinp, T* dweight, T* dbias, const T* dout,
                          const T* inp, const T* weight, const float* mean, const float* rstd,
                          int N, int C, cudaStream_t stream) {
    if (N < 0 || C <= 0) fail("cuda::{}: N = {}, C = {}, expected N >= 0 and C > 0", op, N, C);
    if (N == 0) return;
    constexpr int V = kPackWidth<T>;
    const bool vec_cols = C % V == 0 && aligned16(dout) && aligned16(inp);
    const bool vec = vec_cols && aligned16(dinp) && aligned16(weight);
    const unsigned blocks = (unsigned)ceil_div(N, kRowsPerBlock);
    with_row_variant<T, 8>(vec, C, [&](auto w, auto packs) {
        constexpr int W = decltype(w)::value, kPacks = decltype(packs)::value;
        MT_LAUNCH((norm_dinp_kernel<T, W, kPacks, kLayerNorm>), blocks, kRowThreads, 0, stream,
                  dinp, dout, inp, weight, mean, rstd, N, C);
    });
    if (!dweight) return;  // a frozen norm (LoRA): input gradient only

    const int nchunks = (int)ceil_div(N, kColumnChunkRows);
    const size_t part = (size_t)nchunks * C;
    float* pw = static_cast<float*>(device_scratch((kLayerNorm ? 2 : 1) * part * sizeof(float)));
    float* pb = kLayerNorm ? pw + part : nullptr;
    constexpr int kThreads = 128;
    auto partials = [&](auto w) {
        constexpr int W = decltype(w)::value;
        dim3 grid((unsigned)ceil_div(C / W, kThreads),
                  (unsigned)(nchunks < 65535 ? nchunks : 65535));
        MT_LAUNCH((norm_param_partials_kernel<T, W, kLayerNorm>), grid, kThreads, 0, stream, pw, pb,
                  dout, inp, mean, rstd, N, C, nchunks);
    };
    if (vec_cols) {
        partials(IntC<V>{});
    } else {
        partials(IntC<1>{});
    }
    MT_LAUNCH(norm_param_finish_kernel<T>, (unsigned)ceil_div(C, 256), 256, 0, stream, dweight,
              kLayerNorm ? dbias : nullptr, pw, pb, nchunks, C);
}

// ---- entry points ------------------------------------------------------------------------------
template <typename T>
void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                       const T* bias, int N, int C, float eps, cudaStream_t stream) {
    norm_forward<T, true>("layernorm_forward", out, mean, rstd, inp, weight, bias, N, C, eps,
                          stream);
}

template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const float* mean, const float* rstd, int N, int C, cudaStream_t stream) {
    norm_backward<T, true>("layernorm_backward", dinp, dweight, dbias, dout, inp, weight, mean,
                           rstd, N, C, stream);
}

template <typename T>
void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int N, int C, float eps,
                     cudaStream_t stream) {
    norm_forward<T, false>("rmsnorm_forward", out, nullptr, rstd, inp, weight, nullptr, N, C, eps,
                           stream);
}

template <typename T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                      const float* rstd, int N, int C, cudaStream_t stream) {
    norm_backward<T, false>("rmsnorm_backward", dinp, dweight, nullptr, dout, inp, weight, nullptr,
                            rstd, N, C, stream);
}

#define MT_INSTANTIATE(T)                                                                          \
    template void layernorm_forward<T>(T*, float*, float*, const T*, const T*, const T*, int, int, \
                                       float, cudaStream_t);                                       \
    template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const float*,    \
                                        const float*, int, int, cudaStream_t);                     \
    template void rmsnorm_forward<T>(T*, float*, const T*, const T*, int, int, float,              \
                                     cudaStream_t);                                                \
    template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const float*, int,     \
                                      int, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
