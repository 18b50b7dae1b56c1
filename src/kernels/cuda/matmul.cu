// GEMMs through cuBLASLt (fp32 in, fp32 compute, no TF32), the Conv1D-layout matmul forward and
// backward built on them, and the chunked classifier + softmax cross-entropy with its fused
// backward.
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major (R, K) matrix with leading
// dimension K is the column-major (K, R) matrix with the same leading dimension. So the row-major
// out (N,OC) = inp (N,IC) @ weight (IC,OC) is the column-major out^T (OC,N) = weight^T (OC,IC) @
// inp^T (IC,N), where weight^T and inp^T are just the row-major buffers read column-major.
#include <cublasLt.h>

#include <cstdint>
#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

namespace {

constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

struct Lt {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
};

// One handle and one workspace for the process, created on first use and never destroyed (so no
// destructor runs after the CUDA runtime has been torn down at exit).
Lt& lt() {
    static Lt state;
    static std::once_flag once;
    std::call_once(once, [] {
        MT_CUBLAS_CHECK(cublasLtCreate(&state.handle));
        state.workspace = device_alloc(kWorkspaceBytes, MemCategory::Workspace);
    });
    return state;
}

// The largest power of two (at most 256) dividing the address: what the heuristic may assume.
uint32_t alignment_of(const void* p) {
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    uint32_t align = 256;
    while (align > 4 && a % align != 0) align /= 2;
    return align;
}

// Destroys cuBLASLt descriptors when the scope ends, also when a check throws.
struct LtDescs {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~LtDescs() {
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (d) cublasLtMatrixLayoutDestroy(d);
        if (b) cublasLtMatrixLayoutDestroy(b);
        if (a) cublasLtMatrixLayoutDestroy(a);
        if (op) cublasLtMatmulDescDestroy(op);
    }
};

}  // namespace

// Column-major D (m,n) = op(A) (m,k) @ op(B) (k,n) + beta * D [+ bias (m) broadcast over columns].
// A is stored (m,k) with leading dimension lda, or (k,m) when transa; B likewise (k,n) or (n,k).
// Returns false, having queued nothing, when cuBLASLt offers no algorithm for the problem.
static bool try_gemm(bool transa, bool transb, int m, int n, int k, const float* A, int lda,
                     const float* B, int ldb, float* D, int ldd, float beta, const float* bias,
                     cudaStream_t stream) {
    if (m <= 0 || n <= 0) return true;
    if (k <= 0) fail("cuda gemm: inner dimension {} (m {}, n {}), expected > 0", k, m, n);
    Lt& h = lt();
    LtDescs s;
    MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&s.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        MT_CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
        MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &bias, sizeof(bias)));
    }
    MT_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&s.a, CUDA_R_32F, transa ? k : m, transa ? m : k, lda));
    MT_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&s.b, CUDA_R_32F, transb ? n : k, transb ? k : n, ldb));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&s.d, CUDA_R_32F, m, n, ldd));

    // The heuristic assumes 256-byte aligned pointers unless told otherwise; views into a flat
    // buffer (one layer's weights, a chunk of rows) are often less aligned.
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&s.pref));
    std::size_t ws = kWorkspaceBytes;
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    uint32_t align_a = alignment_of(A), align_b = alignment_of(B), align_d = alignment_of(D);
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)));
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));

    // Split-K with the in-place reduction scheme accumulates partial products into D from
    // several CTAs; the other schemes reduce through the workspace in a fixed order.
    uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_INPLACE;
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        s.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)));

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h.handle, s.op, s.a, s.b, s.d, s.d, s.pref,
                                                       1, &result, &found);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0))
        return false;  // no algorithm for this problem
    if (st != CUBLAS_STATUS_SUCCESS)
        cublas_fail((int)st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    const float alpha = 1.0f;
    MT_CUBLAS_CHECK(cublasLtMatmul(h.handle, s.op, &alpha, A, s.a, B, s.b, &beta, D, s.d, D, s.d,
                                   &result.algo, h.workspace, kWorkspaceBytes, stream));
    return true;
}

static void gemm(bool transa, bool transb, int m, int n, int k, const float* A, int lda,
                 const float* B, int ldb, float* D, int ldd, float beta, cudaStream_t stream) {
    if (!try_gemm(transa, transb, m, n, k, A, lda, B, ldb, D, ldd, beta, nullptr, stream)) {
        fail("cuBLASLt offers no fp32 algorithm for m {} n {} k {} (transa {}, transb {})", m, n, k,
             transa, transb);
    }
}

// out[r, c] += bias[c]: the fallback when the bias is too loosely aligned for the epilogue.
static __global__ void add_bias_kernel(float* out, const float* bias, int OC, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] += bias[i % OC];
}

// ---- matmul ------------------------------------------------------------------------------------
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, float beta, cudaStream_t stream) {
    if (N <= 0 || OC <= 0) return;
    // cuBLASLt's bias epilogue reads the vector in 16-byte pieces; a less aligned bias, or a shape
    // with no epilogue algorithm, gets the bias from a separate kernel after the GEMM.
    if (bias && reinterpret_cast<uintptr_t>(bias) % 16 == 0 &&
        try_gemm(false, false, OC, N, IC, weight, OC, inp, IC, out, OC, beta, bias, stream)) {
        return;
    }
    gemm(false, false, OC, N, IC, weight, OC, inp, IC, out, OC, beta, stream);
    if (bias) {
        const int64_t n = (int64_t)N * OC;
        MT_LAUNCH(add_bias_kernel, elementwise_blocks(n, 256), 256, 0, stream, out, bias, OC, n);
    }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC, float beta, cudaStream_t stream) {
    if (N <= 0) return;
    // dinp^T (IC,N) = weight (as (OC,IC) column-major, transposed) @ dout^T (OC,N)
    if (dinp) gemm(true, false, IC, N, OC, weight, OC, dout, OC, dinp, IC, beta, stream);
    // dweight^T (OC,IC) += dout^T (OC,N) @ inp (N,IC)
    gemm(false, true, OC, IC, N, dout, OC, inp, IC, dweight, OC, 1.0f, stream);
    if (dbias) column_sums_accumulate(dbias, dout, N, OC, stream);
}

// ---- classifier + cross-entropy ----------------------------------------------------------------
constexpr int kLossThreads = 512;

static __device__ float block_max(float v, float* shared) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_max(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float r = lane < (int)(blockDim.x / 32) ? shared[lane] : -INFINITY;
    r = warp_max(r);
    __syncthreads();
    return r;
}

// One block per row of logits (R, Vp): loss_r = logsumexp - logit[y] in double, as the CPU does;
// with `backward`, the row becomes d(logits) = (softmax - onehot(y)) * grad_scale, zero in the
// padded columns [V, Vp). A target outside [0, V) gives a NaN loss (and no one-hot term).
static __global__ void softmax_xent_kernel(float* logits, double* row_loss, const int32_t* targets,
                                           int V, int Vp, float grad_scale, bool backward) {
    __shared__ float fshared[32];
    __shared__ double dshared[32];
    float* l = logits + (int64_t)blockIdx.x * Vp;
    const int y = targets[blockIdx.x];
    const bool valid = y >= 0 && y < V;
    const float ly = valid ? l[y] : 0.0f;  // read before any thread rewrites the row

    float maxv = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) maxv = fmaxf(maxv, l[v]);
    maxv = block_max(maxv, fshared);
    double sum = 0.0;
    for (int v = threadIdx.x; v < V; v += blockDim.x) sum += exp((double)(l[v] - maxv));
    sum = block_sum(sum, dshared);
    const double lse = maxv + log(sum);
    if (threadIdx.x == 0) row_loss[blockIdx.x] = valid ? lse - ly : (double)NAN;
    if (!backward) return;
    for (int v = threadIdx.x; v < Vp; v += blockDim.x) {
        float g = 0.0f;
        if (v < V) {
            g = (float)(exp((double)l[v] - lse) * grad_scale);
            if (v == y) g -= grad_scale;
        }
        l[v] = g;
    }
}

double classifier_loss(float* dx, float* dwte, float* logits_buf, const float* x, const float* wte,
                       const int32_t* targets, int N, int C, int V, int Vp, int chunk,
                       float grad_scale, cudaStream_t stream) {
    if (N <= 0) return 0.0;
    if (chunk <= 0 || V <= 0 || V > Vp) {
        fail("cuda::classifier_loss: chunk {}, V {}, Vp {}: expected chunk > 0 and 0 < V <= Vp",
             chunk, V, Vp);
    }
    double* row_loss = static_cast<double*>(device_scratch(((size_t)N + 1) * sizeof(double)));
    for (int r0 = 0; r0 < N; r0 += chunk) {
        const int R = chunk < N - r0 ? chunk : N - r0;
        const float* xr = x + (int64_t)r0 * C;
        // logits^T (Vp,R) = wte (as (C,Vp) column-major, transposed) @ x^T (C,R)
        gemm(true, false, Vp, R, C, wte, C, xr, C, logits_buf, Vp, 0.0f, stream);
        MT_LAUNCH(softmax_xent_kernel, R, kLossThreads, 0, stream, logits_buf, row_loss + r0,
                  targets + r0, V, Vp, grad_scale, dx != nullptr);
        if (dx) {
            // dx^T (C,R) = wte^T (C,Vp) @ dlogits^T (Vp,R)
            gemm(false, false, C, R, Vp, wte, C, logits_buf, Vp, dx + (int64_t)r0 * C, C, 0.0f,
                 stream);
            // dwte^T (C,Vp) += x^T (C,R) @ dlogits (R,Vp)
            if (dwte) gemm(false, true, C, Vp, R, xr, C, logits_buf, Vp, dwte, C, 1.0f, stream);
        }
    }
    return sum_doubles(row_loss, N, row_loss + N, stream);
}

void classifier_logits(float* out, const float* x, const float* wte, int N, int C, int V,
                       cudaStream_t stream) {
    // out^T (V,N) = wte[:V] (as (C,V) column-major, transposed) @ x^T (C,N)
    gemm(true, false, V, N, C, wte, C, x, C, out, V, 0.0f, stream);
}

}  // namespace memtrain::cuda
