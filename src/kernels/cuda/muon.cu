// Muon on the GPU (kernels/cuda/muon.h): Newton-Schulz through cuBLASLt's fp32 GEMMs
// (kernels/cuda/matmul.h's gemm_rows) and the matrix's update.
#include <cmath>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/optimizer_math.cuh"

namespace memtrain::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void muon_normalize_kernel(float* x, int64_t n, const double* sumsq,
                                      const StepScalars* s) {
    if (s->skip) return;
    const float inv = (float)(1.0 / (sqrt(*sumsq) + 1e-7));
    MT_GRID_STRIDE(i, n) x[i] = mul_rn(x[i], inv);
}

template <typename T>
__global__ void muon_apply_kernel(T* params, float* master, const float* o, int64_t begin,
                                  int64_t n, int rows, int cols, int decays, const StepScalars* s,
                                  ParamRounding round) {
    if (s->skip) return;
    const float decay = decays ? s->muon_decay : 1.0f;
    const float step = (float)(s->muon_lr * sqrt(fmax(1.0, (double)cols / (double)rows)));
    MT_GRID_STRIDE(i, n) {
        const int64_t j = begin + i;
        const float p = master ? master[j] : to_float(params[j]);
        const float pn = fma_rn(-step, o[i], mul_rn(p, decay));
        if (master) master[j] = pn;
        params[j] = round_param<T>(pn, round, s->step, j);
    }
}

}  // namespace

float* newton_schulz5(float* x, float* y, float* ga, float* gb, double* sumsq, int rows, int cols,
                      const StepScalars* s, cudaStream_t stream) {
    if (!x || !y || !ga || !gb || !sumsq || !s || rows < 1 || cols < 1)
        fail("cuda::newton_schulz5: null buffer or a {} x {} matrix", rows, cols);
    const int64_t n = (int64_t)rows * cols;
    sum_squares<float>(sumsq, x, n, stream);
    MT_LAUNCH(muon_normalize_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, x, n,
              sumsq, s);
    const bool tall = rows > cols;
    const int r = tall ? cols : rows;
    const std::size_t gram = sizeof(float) * (std::size_t)r * (std::size_t)r;
    const float a = 3.4445f, b = -4.7750f, c = 2.0315f;
    for (int k = 0; k < 5; k++) {
        // A = X X^T (wide) or X^T X (tall).
        if (tall)
            gemm_rows<float>(true, false, r, r, rows, 1.0f, x, cols, x, cols, 0.0f, ga, r, stream);
        else
            gemm_rows<float>(false, true, r, r, cols, 1.0f, x, cols, x, cols, 0.0f, ga, r, stream);
        // B = b A + c A A.
        MT_CUDA_CHECK(cudaMemcpyAsync(gb, ga, gram, cudaMemcpyDeviceToDevice, stream));
        gemm_rows<float>(false, false, r, r, r, c, ga, r, ga, r, b, gb, r, stream);
        // Y = a X + B X (wide) or a X + X B (tall).
        MT_CUDA_CHECK(cudaMemcpyAsync(y, x, sizeof(float) * (std::size_t)n,
                                      cudaMemcpyDeviceToDevice, stream));
        if (tall)
            gemm_rows<float>(false, false, rows, cols, cols, 1.0f, x, cols, gb, r, a, y, cols,
                             stream);
        else
            gemm_rows<float>(false, false, rows, cols, rows, 1.0f, gb, r, x, cols, a, y, cols,
                             stream);
        std::swap(x, y);
    }
    return x;
}

template <typename T>
void muon_apply(T* params, float* master, const float* o, int64_t begin, int64_t n, int rows,
                int cols, int decays, const StepScalars* s, cudaStream_t stream,
                const ParamRounding& round) {
    check_step("muon_apply", params, master, params, o, 1, s, round);
    if (n < 1 || n > (int64_t)rows * cols)
        fail("cuda::muon_apply: {} floats of a {} x {} matrix", n, rows, cols);
    MT_LAUNCH(muon_apply_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, params,
              master, o, begin, n, rows, cols, decays, s, round);
}

#define MT_INSTANTIATE(T)                                                                  \
    template void muon_apply<T>(T*, float*, const float*, int64_t, int64_t, int, int, int, \
                                const StepScalars*, cudaStream_t, const ParamRounding&);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
