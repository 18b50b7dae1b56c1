// Adafactor on the GPU (kernels/cuda/adafactor.h). Every tensor is stepped whole, as the CPU's
// Adafactor::step_tensor steps it, by launches over all the range's tensors at once:
//   1. a block per row: sum of W^2 (for alpha) and of G^2 (the row factor R, or an unfactored
//      tensor's second moment element by element);
//   2. a block per (256 columns, 256 rows) piece of a factored matrix: partial column sums of G^2;
//   3. a block per 256 columns: the partials in order, the column factor C;
//   4. a block per tensor: alpha = max(1e-3, RMS(W)) rho and 1 / max(mean(R), eps1);
//   5. a block per row: sum of U^2;
//   6. a block per tensor: the step -alpha / max(1, RMS(U) / clip);
//   7. a block per row: W = W (1 - lr wd) + step U, stored (master, rounding) as AdamW stores.
// Each sum is in double in an order fixed by the shapes alone.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/optimizer_math.cuh"

namespace memtrain::cuda {

namespace {

constexpr int kThreads = 256;
static_assert(kAdafactorTile == kThreads, "a column tile is one thread per column");

enum class Grid { Rows, Items, Tiles };

// The tensor whose blocks of grid g hold block b: the last whose first block is at most b (a
// tensor with no blocks in g shares its first with the next tensor, which then owns them).
__device__ __forceinline__ int tensor_of(const AdafactorStores& st, int64_t b, Grid g) {
    auto first = [&](int k) {
        const AdafactorTensor& t = st.tensors[k];
        return g == Grid::Rows ? t.row0 : g == Grid::Items ? t.item0 : t.tile0;
    };
    int lo = 0, hi = st.ntensors - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first(mid) <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// torch.lerp's arithmetic, as optim/optimizer.cpp's lerp_torch.
__device__ __forceinline__ float lerp_torch(float a, float b, float w) {
    return fabsf(w) < 0.5f ? add_rn(a, mul_rn(w, add_rn(b, -a)))
                           : add_rn(b, -mul_rn(add_rn(b, -a), add_rn(1.0f, -w)));
}

template <typename T>
__device__ __forceinline__ float weight(const T* params, const float* master, int64_t k) {
    return master ? master[k] : to_float(params[k]);
}

// U's element (i, j): G / sqrt(max(V, eps1^2)), V the factored estimate or the whole moment.
__device__ __forceinline__ float update_u(const AdafactorTensor& t, const float* V,
                                          float inv_mean_r, int64_t i, int64_t j, float g) {
    const float v = t.factored ? mul_rn(mul_rn(V[i], V[t.rows + j]), inv_mean_r) : V[j];
    const float eps1_sq = mul_rn(FLT_EPSILON, FLT_EPSILON);
    return mul_rn(g, div_rn(1.0f, sqrt_rn(fmaxf(v, eps1_sq))));
}

template <typename T>
__global__ void adafactor_rows_kernel(const T* params, const float* master, AdafactorStores st,
                                      const T* grads, const StepScalars* s) {
    if (s->skip) return;
    __shared__ double shared[32];
    const int64_t b = blockIdx.x;
    const AdafactorTensor t = st.tensors[tensor_of(st, b, Grid::Rows)];
    const int64_t i = b - t.row0;
    const float scale = s->grad_scale, w = s->af_w;
    float* V = st.state + t.state;
    double pp = 0, gg = 0;
    for (int64_t j = threadIdx.x; j < t.cols; j += blockDim.x) {
        const int64_t k = t.begin + i * t.cols + j;
        const float p = weight(params, master, k);
        const float g = mul_rn(to_float(grads[k]), scale);
        pp += (double)p * (double)p;
        gg += (double)g * (double)g;
        if (!t.factored) V[j] = lerp_torch(V[j], mul_rn(g, g), w);
    }
    pp = block_sum(pp, shared);
    gg = block_sum(gg, shared);
    if (threadIdx.x == 0) {
        st.rows[b] = pp;
        if (t.factored) V[i] = lerp_torch(V[i], (float)(gg / (double)t.cols), w);
    }
}

template <typename T>
__global__ void adafactor_col_parts_kernel(AdafactorStores st, const T* grads,
                                           const StepScalars* s) {
    if (s->skip) return;
    const int64_t b = blockIdx.x;
    const AdafactorTensor t = st.tensors[tensor_of(st, b, Grid::Items)];
    const int64_t tiles = (t.cols + kAdafactorTile - 1) / kAdafactorTile;
    const int64_t k = b - t.item0, chunk = k / tiles;
    const int64_t j = (k % tiles) * kAdafactorTile + threadIdx.x;
    if (j >= t.cols) return;
    const int64_t r0 = chunk * kAdafactorChunkRows;
    const int64_t r1 = r0 + kAdafactorChunkRows < t.rows ? r0 + kAdafactorChunkRows : t.rows;
    const float scale = s->grad_scale;
    double acc = 0;
    for (int64_t i = r0; i < r1; i++) {
        const float g = mul_rn(to_float(grads[t.begin + i * t.cols + j]), scale);
        acc += (double)g * (double)g;
    }
    st.parts[t.part0 + chunk * t.cols + j] = acc;
}

__global__ void adafactor_cols_kernel(AdafactorStores st, const StepScalars* s) {
    if (s->skip) return;
    const int64_t b = blockIdx.x;
    const AdafactorTensor t = st.tensors[tensor_of(st, b, Grid::Tiles)];
    const int64_t j = (b - t.tile0) * kAdafactorTile + threadIdx.x;
    if (j >= t.cols) return;
    const int64_t chunks = (t.rows + kAdafactorChunkRows - 1) / kAdafactorChunkRows;
    double acc = 0;
    for (int64_t c = 0; c < chunks; c++) acc += st.parts[t.part0 + c * t.cols + j];
    float* C = st.state + t.state + t.rows;
    C[j] = lerp_torch(C[j], (float)(acc / (double)t.rows), s->af_w);
}

// phase 0: alpha and 1 / max(mean(R), eps1) from the rows' sums of W^2; phase 1: the step from
// the rows' sums of U^2.
__global__ void adafactor_tensor_kernel(AdafactorStores st, const StepScalars* s, int phase) {
    if (s->skip) return;
    __shared__ double shared[32];
    const AdafactorTensor t = st.tensors[blockIdx.x];
    AdafactorScalars* sc = st.scalars + blockIdx.x;
    const double n = (double)t.rows * (double)t.cols;
    double sum = 0;
    for (int64_t i = threadIdx.x; i < t.rows; i += blockDim.x) sum += st.rows[t.row0 + i];
    sum = block_sum(sum, shared);
    if (phase == 1) {
        if (threadIdx.x == 0) {
            const double rms_u = sqrt(sum / n);
            sc->step = (float)(-sc->alpha / fmax(1.0, rms_u / s->af_clip));
        }
        return;
    }
    double sum_r = 0;
    if (t.factored) {
        const float* R = st.state + t.state;
        for (int64_t i = threadIdx.x; i < t.rows; i += blockDim.x) sum_r += (double)R[i];
        sum_r = block_sum(sum_r, shared);
    }
    if (threadIdx.x == 0) {
        sc->alpha = fmax(1e-3, sqrt(sum / n)) * s->af_rho;
        sc->inv_mean_r =
            t.factored ? div_rn(1.0f, fmaxf((float)(sum_r / (double)t.rows), FLT_EPSILON)) : 0.0f;
    }
}

template <typename T>
__global__ void adafactor_u_rows_kernel(AdafactorStores st, const T* grads, const StepScalars* s) {
    if (s->skip) return;
    __shared__ double shared[32];
    const int64_t b = blockIdx.x;
    const int k = tensor_of(st, b, Grid::Rows);
    const AdafactorTensor t = st.tensors[k];
    const int64_t i = b - t.row0;
    const float scale = s->grad_scale, inv_mean_r = st.scalars[k].inv_mean_r;
    const float* V = st.state + t.state;
    double uu = 0;
    for (int64_t j = threadIdx.x; j < t.cols; j += blockDim.x) {
        const float g = mul_rn(to_float(grads[t.begin + i * t.cols + j]), scale);
        const float u = update_u(t, V, inv_mean_r, i, j, g);
        uu += (double)u * (double)u;
    }
    uu = block_sum(uu, shared);
    if (threadIdx.x == 0) st.rows[b] = uu;
}

template <typename T>
__global__ void adafactor_apply_kernel(T* params, float* master, AdafactorStores st, const T* grads,
                                       const StepScalars* s, ParamRounding round) {
    if (s->skip) return;
    const int64_t b = blockIdx.x;
    const int k = tensor_of(st, b, Grid::Rows);
    const AdafactorTensor t = st.tensors[k];
    const int64_t i = b - t.row0;
    const float scale = s->grad_scale, inv_mean_r = st.scalars[k].inv_mean_r,
                step = st.scalars[k].step;
    const float keep = t.decay ? s->decay_factor : 1.0f;
    const float* V = st.state + t.state;
    for (int64_t j = threadIdx.x; j < t.cols; j += blockDim.x) {
        const int64_t e = t.begin + i * t.cols + j;
        const float g = mul_rn(to_float(grads[e]), scale);
        const float u = update_u(t, V, inv_mean_r, i, j, g);
        const float pn = fma_rn(step, u, mul_rn(weight(params, master, e), keep));
        if (master) master[e] = pn;
        params[e] = round_param<T>(pn, round, s->step, e);
    }
}

}  // namespace

template <typename T>
void adafactor_step(T* params, float* master, const AdafactorStores& st, const T* grads,
                    const StepScalars* s, cudaStream_t stream, const ParamRounding& round) {
    check_step("adafactor_step", params, master, grads, st.tensors, st.ntensors, s, round);
    if (st.ntensors == 0) return;
    if (!st.state || !st.scalars || !st.rows || (st.items > 0 && !st.parts))
        fail("cuda::adafactor_step: null state, scalars or scratch");
    const unsigned rows = grid_x(st.nrows, "Adafactor's rows");
    // A row's block: a warp per 32 columns up to kThreads (a narrow model's rows would leave
    // most of a wide block idle).
    const int row_threads =
        (int)std::min<int64_t>(kThreads, std::max<int64_t>(32, (st.max_cols + 31) / 32 * 32));
    MT_LAUNCH(adafactor_rows_kernel<T>, rows, row_threads, 0, stream, params, master, st, grads, s);
    if (st.items > 0) {
        MT_LAUNCH(adafactor_col_parts_kernel<T>, grid_x(st.items, "Adafactor's column pieces"),
                  kThreads, 0, stream, st, grads, s);
        MT_LAUNCH(adafactor_cols_kernel, grid_x(st.tiles, "Adafactor's column tiles"), kThreads, 0,
                  stream, st, s);
    }
    MT_LAUNCH(adafactor_tensor_kernel, (unsigned)st.ntensors, kThreads, 0, stream, st, s, 0);
    MT_LAUNCH(adafactor_u_rows_kernel<T>, rows, row_threads, 0, stream, st, grads, s);
    MT_LAUNCH(adafactor_tensor_kernel, (unsigned)st.ntensors, kThreads, 0, stream, st, s, 1);
    MT_LAUNCH(adafactor_apply_kernel<T>, rows, row_threads, 0, stream, params, master, st, grads, s,
              round);
}

#define MT_INSTANTIATE(T)                                                         \
    template void adafactor_step<T>(T*, float*, const AdafactorStores&, const T*, \
                                    const StepScalars*, cudaStream_t, const ParamRounding&);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
