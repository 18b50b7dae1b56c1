// GEMMs through cuBLASLt (fp32 accumulation, no TF32) for float, bf16 and fp16 storage, the
// Conv1D-layout linear layer built on them (bias, residual, GELU and GELU-gradient epilogues with
// fallbacks), and the chunked classifier + softmax cross-entropy with its fused backward.
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major (R, K) matrix with leading
// dimension K is the column-major (K, R) matrix with the same leading dimension. So the row-major
// out (N,OC) = inp (N,IC) @ weight (IC,OC) is the column-major out^T (OC,N) = weight^T (OC,IC) @
// inp^T (IC,N), where weight^T and inp^T are just the row-major buffers read column-major. A bias
// over OC is then a vector over the rows of D (what CUBLASLT_EPILOGUE_BIAS broadcasts), and a
// row-major (N,OC) auxiliary matrix has leading dimension OC.
//
// What this file relies on from the cuBLASLt documentation (cublasLt.h, cuBLAS 13):
//   - EPILOGUE_BIAS adds a packed vector of length rows(D) to every column, after alpha AB +
//     beta C; its type is set with BIAS_DATA_TYPE (default: D's type; we set it to D's type).
//   - GELU_AUX_BIAS: D = GELU(AB + bias) and writes the GELU input AB + bias to
//     EPILOGUE_AUX_POINTER (type EPILOGUE_AUX_DATA_TYPE, default D's; set to D's); GELU_AUX is the
//     same without bias. DGELU: D = AB * GELU'(aux), aux read from EPILOGUE_AUX_POINTER. Both need
//     EPILOGUE_AUX_LD divisible by 8 and >= rows(D). cuBLASLt's GELU is the tanh approximation
//     (PyTorch fuses it into addmm only for approximate = "tanh"), the same as GPT-2's and
//     kernels/cpu/activation.cpp's.
//   - The heuristic refuses (NOT_SUPPORTED or no result) what it cannot run, in which case
//     nothing is queued and the fallback below runs instead. It does NOT refuse epilogue pointers
//     it cannot write: on an H200 (cuBLAS 13.0, 2026-11-26) it offered a GELU_AUX kernel that
//     stores the aux matrix 16 bytes at a time for an aux pointer 2 bytes past a 16-byte
//     boundary, and the launch died with "misaligned address". So an epilogue runs only with
//     16-byte aligned bias and aux pointers (try_epilogue_gemm), as the simulator enforces.
//   - Its DGELU epilogue computes GELU'(x) with a faster tanh than tanhf: on the same H200 one
//     fp32 element in 12480 came out 4e-3 relative from the exact derivative. bf16 and fp16 round
//     far more than that; fp32, the reference precision, takes the exact fallback instead.
#include <cublasLt.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

namespace {

constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

template <typename T>
cudaDataType_t data_type() {
    if (std::is_same<T, float>::value) return CUDA_R_32F;
    if (std::is_same<T, __nv_bfloat16>::value) return CUDA_R_16BF;
    return CUDA_R_16F;
}

// The largest power of two (at most 256) dividing the address: what the heuristic may assume.
uint32_t alignment_of(const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    uint32_t align = 256;
    while (align > 1 && a % align != 0) align /= 2;
    return align;
}

// One GEMM as cuBLASLt sees it: column-major D (m,n) = op(A) (m,k) @ op(B) (k,n) + beta C, with
// an optional epilogue. A is stored (m,k) with leading dimension lda, or (k,m) when ta; B (k,n)
// or (n,k) when tb. C (null: D) and D have the same shape and type.
struct GemmArgs {
    bool ta = false, tb = false;
    int m = 0, n = 0, k = 0;
    const void* A = nullptr;
    int64_t lda = 0;
    const void* B = nullptr;
    int64_t ldb = 0;
    const void* C = nullptr;
    int64_t ldc = 0;
    void* D = nullptr;
    int64_t ldd = 0;
    cudaDataType_t ab_type = CUDA_R_32F, cd_type = CUDA_R_32F;
    float alpha = 1.0f, beta = 0.0f;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void* bias = nullptr;  // BIAS epilogues: rows(D) values of cd_type
    const void* aux = nullptr;   // GELU_AUX (written) / DGELU (read): (aux_ld, n) of cd_type
    int64_t aux_ld = 0;
};

// A plain GEMM's arguments (no C input, no epilogue): D (m,n) = op(A) (m,k) @ op(B) (k,n) +
// beta D, A and B of type ab, D of type cd.
GemmArgs gemm_args(bool ta, bool tb, int m, int n, int k, const void* A, int64_t lda, const void* B,
                   int64_t ldb, void* D, int64_t ldd, cudaDataType_t ab, cudaDataType_t cd,
                   float beta = 0.0f) {
    GemmArgs g;
    g.ta = ta;
    g.tb = tb;
    g.m = m;
    g.n = n;
    g.k = k;
    g.A = A;
    g.lda = lda;
    g.B = B;
    g.ldb = ldb;
    g.D = D;
    g.ldd = ldd;
    g.ab_type = ab;
    g.cd_type = cd;
    g.beta = beta;
    return g;
}

// Descriptors and the algorithm for one (shape, types, epilogue, alignments) key, created on the
// first call and reused: the trainer runs the same few GEMMs every step, and descriptor creation
// and the heuristic cost host time. `usable` false remembers that cuBLASLt refused the problem.
struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool usable = false;
};

using PlanKey = std::array<int64_t, 20>;

PlanKey plan_key(const GemmArgs& g) {
    const void* C = g.C ? g.C : g.D;
    return {g.ta,
            g.tb,
            g.m,
            g.n,
            g.k,
            g.lda,
            g.ldb,
            g.C ? g.ldc : g.ldd,
            g.ldd,
            (int64_t)g.ab_type,
            (int64_t)g.cd_type,
            (int64_t)g.epilogue,
            g.aux_ld,
            alignment_of(g.A),
            alignment_of(g.B),
            alignment_of(C),
            alignment_of(g.D),
            g.bias ? alignment_of(g.bias) : 0,
            g.aux ? alignment_of(g.aux) : 0,
            g.beta != 0.0f};
}

// More plans than any model needs means shapes are churning (tests): start over.
constexpr std::size_t kMaxPlans = 4096;

struct Lt {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    std::mutex mu;  // guards plans and the pointer attributes set on a cached descriptor
    std::map<PlanKey, Plan> plans;
    std::atomic<int64_t> fused{0}, fallback{0};
};

// One handle, one workspace and the plans for the process, created on first use and never
// destroyed (so no destructor runs after the CUDA runtime has been torn down at exit).
Lt& lt() {
    static Lt* state = [] {
        Lt* s = new Lt;
        MT_CUBLAS_CHECK(cublasLtCreate(&s->handle));
        s->workspace = device_alloc(kWorkspaceBytes, MemCategory::Workspace);
        return s;
    }();
    return *state;
}

void destroy(Plan& p) {
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.op) cublasLtMatmulDescDestroy(p.op);
    p = Plan{};
}

template <typename V>
void set_desc(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const V& value) {
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof(value)));
}
template <typename V>
void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
              const V& value) {
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

// Builds the descriptors of a plan and asks the heuristic; `plan` is filled even when it fails
// (usable = false), so that a refusal is remembered.
void make_plan(Lt& h, const GemmArgs& g, Plan& plan) {
    struct PrefGuard {
        cublasLtMatmulPreference_t p = nullptr;
        ~PrefGuard() {
            if (p) cublasLtMatmulPreferenceDestroy(p);
        }
    } pref;
    try {
        MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const int32_t ta = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        set_desc(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, ta);
        set_desc(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, tb);
        const uint32_t epilogue = g.epilogue;
        set_desc(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
        const int32_t cd_type = g.cd_type;
        if (g.bias) {
            set_desc(plan.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cd_type);
            set_desc(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
        }
        if (g.aux) {
            set_desc(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, cd_type);
            set_desc(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
            set_desc(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
        }
        MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, g.ab_type, g.ta ? g.k : g.m,
                                                   g.ta ? g.m : g.k, g.lda));
        MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, g.ab_type, g.tb ? g.n : g.k,
                                                   g.tb ? g.k : g.n, g.ldb));
        MT_CUBLAS_CHECK(
            cublasLtMatrixLayoutCreate(&plan.c, g.cd_type, g.m, g.n, g.C ? g.ldc : g.ldd));
        MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.d, g.cd_type, g.m, g.n, g.ldd));

        // The heuristic assumes 256-byte aligned matrices unless told otherwise; views into a
        // flat buffer (one layer's weights, a chunk of rows) are often less aligned.
        MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.p));
        const uint64_t ws = kWorkspaceBytes;
        set_pref(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
        set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(g.A));
        set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(g.B));
        set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(g.C ? g.C : g.D));
        set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(g.D));
        // Split-K with the in-place reduction scheme accumulates partial products into D from
        // several CTAs in whatever order they finish; the other schemes reduce through the
        // workspace in a fixed order, so results repeat bit for bit.
        const uint32_t reductions =
            CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_INPLACE;
        set_pref(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reductions);

        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
            h.handle, plan.op, plan.a, plan.b, plan.c, plan.d, pref.p, 1, &result, &found);
        if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
            plan.algo = result.algo;
            plan.usable = true;
        } else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED &&
                   g.epilogue == CUBLASLT_EPILOGUE_DEFAULT) {
            cublas_fail((int)st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
        }
    } catch (const Error&) {
        destroy(plan);
        // An epilogue attribute this cuBLASLt does not accept (say, a data type it wants left at
        // its default) means no fused path: the caller falls back. A plain GEMM has no fallback.
        if (g.epilogue == CUBLASLT_EPILOGUE_DEFAULT) throw;
    }
}

}  // namespace

// Queues the GEMM and returns true, or returns false having queued nothing when cuBLASLt offers
// no algorithm for it (or rejects the epilogue at launch). A plain GEMM that cannot run fails.
static bool try_gemm(const GemmArgs& g, cudaStream_t stream) {
    if (g.m <= 0 || g.n <= 0) return true;
    if (g.k <= 0) fail("cuda gemm: inner dimension {} (m {}, n {}), expected > 0", g.k, g.m, g.n);
    Lt& h = lt();
    std::lock_guard<std::mutex> lock(h.mu);
    const PlanKey key = plan_key(g);
    auto it = h.plans.find(key);
    if (it == h.plans.end()) {
        if (h.plans.size() >= kMaxPlans) {
            for (auto& kv : h.plans) destroy(kv.second);
            h.plans.clear();
        }
        Plan plan;
        make_plan(h, g, plan);
        it = h.plans.emplace(key, plan).first;
    }
    Plan& plan = it->second;
    if (!plan.usable) return false;
    // The key fixes everything but the pointers, which are this call's.
    if (g.bias) set_desc(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    if (g.aux) set_desc(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    const float alpha = g.alpha, beta = g.beta;
    const cublasStatus_t st =
        cublasLtMatmul(h.handle, plan.op, &alpha, g.A, plan.a, g.B, plan.b, &beta, g.C ? g.C : g.D,
                       plan.c, g.D, plan.d, &plan.algo, h.workspace, kWorkspaceBytes, stream);
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    if (g.epilogue == CUBLASLT_EPILOGUE_DEFAULT)
        cublas_fail((int)st, "cublasLtMatmul", __FILE__, __LINE__);
    // An epilogue the heuristic offered but the launch rejected (an attribute combination this
    // cuBLASLt does not take): remember, and let the caller's fallback run.
    plan.usable = false;
    return false;
}

static void gemm(const GemmArgs& g, cudaStream_t stream) {
    if (!try_gemm(g, stream))
        fail("cuBLASLt offers no algorithm for m {} n {} k {} (transa {}, transb {}, types {} {})",
             g.m, g.n, g.k, g.ta, g.tb, (int)g.ab_type, (int)g.cd_type);
}

// An epilogue GEMM, counted as fused or fallen back: never asked for with bias or aux pointers
// less than 16-byte aligned (the header says why).
static bool try_epilogue_gemm(const GemmArgs& g, cudaStream_t stream) {
    const bool aligned =
        (!g.bias || alignment_of(g.bias) >= 16) && (!g.aux || alignment_of(g.aux) >= 16);
    const bool ok = aligned && try_gemm(g, stream);
    (ok ? lt().fused : lt().fallback)++;
    return ok;
}

EpilogueCounts matmul_epilogue_counts() {
    Lt& h = lt();
    return {h.fused.load(), h.fallback.load()};
}

// ---- elementwise kernels of the fallback paths --------------------------------------------------
constexpr int kThreads = 256;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

// GELU, tanh approximation, and its derivative: kernels/cpu/activation.cpp's formulas.
static __device__ __forceinline__ float gelu_tanh(float x) {
    const float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}
static __device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float cube = 0.044715f * x * x * x;
    const float th = tanhf(kGeluScale * (x + cube));
    const float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

// out[r, c] = residual[r, c] + bias[c] (residual null: 0; it may be out itself), the seed a
// beta = 1 GEMM then adds the product to: the bias fallback, as the CPU does it.
template <typename T>
static __global__ void seed_bias_kernel(T* out, const T* residual, const T* bias, int OC,
                                        int64_t n) {
    MT_GRID_STRIDE(i, n) {
        const float r = residual ? to_float(residual[i]) : 0.0f;
        out[i] = from_float<T>(r + to_float(bias[i % OC]));
    }
}

template <typename T>
static __global__ void gelu_kernel(T* out, const T* pre, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = from_float<T>(gelu_tanh(to_float(pre[i])));
}

template <typename T>
static __global__ void dgelu_inplace_kernel(T* d, const T* pre, int64_t n) {
    MT_GRID_STRIDE(i, n) d[i] = from_float<T>(to_float(d[i]) * gelu_tanh_grad(to_float(pre[i])));
}

// ---- linear layer ------------------------------------------------------------------------------
static void check_linear(const char* op, int N, int IC, int OC) {
    if (N < 0 || IC <= 0 || OC <= 0)
        fail("cuda::{}: N {} IC {} OC {}, expected N >= 0, IC > 0 and OC > 0", op, N, IC, OC);
}

// out^T (OC,N) = weight^T (OC,IC) @ inp^T (IC,N): weight is the column-major (OC,IC) matrix.
template <typename T>
static GemmArgs forward_args(T* out, const T* inp, const T* weight, int N, int IC, int OC) {
    return gemm_args(false, false, OC, N, IC, weight, OC, inp, IC, out, OC, data_type<T>(),
                     data_type<T>());
}

template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int N, int IC, int OC,
                    const T* residual, cudaStream_t stream) {
    check_linear("matmul_forward", N, IC, OC);
    if (N == 0) return;
    GemmArgs g = forward_args(out, inp, weight, N, IC, OC);
    if (residual) {
        g.C = residual;
        g.ldc = OC;
        g.beta = 1.0f;
    }
    if (!bias) return gemm(g, stream);
    g.epilogue = CUBLASLT_EPILOGUE_BIAS;
    g.bias = bias;
    if (try_epilogue_gemm(g, stream)) return;
    // Seed out with residual + bias, then accumulate the product into it.
    const int64_t n = (int64_t)N * OC;
    MT_LAUNCH(seed_bias_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, out,
              residual, bias, OC, n);
    g.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    g.bias = nullptr;
    g.C = nullptr;
    g.beta = 1.0f;
    gemm(g, stream);
}

template <typename T>
void matmul_forward_gelu(T* out, T* pre, const T* inp, const T* weight, const T* bias, int N,
                         int IC, int OC, cudaStream_t stream) {
    check_linear("matmul_forward_gelu", N, IC, OC);
    if (out == pre) fail("cuda::matmul_forward_gelu: out and pre are the same buffer");
    if (N == 0) return;
    GemmArgs g = forward_args(out, inp, weight, N, IC, OC);
    g.epilogue = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    g.bias = bias;
    g.aux = pre;
    g.aux_ld = OC;
    // aux_ld must be a multiple of 8 (cublasLt.h, EPILOGUE_AUX_LD): not worth asking otherwise.
    if (OC % 8 == 0 && try_epilogue_gemm(g, stream)) return;
    if (OC % 8 != 0) lt().fallback++;
    matmul_forward(pre, inp, weight, bias, N, IC, OC, static_cast<const T*>(nullptr), stream);
    const int64_t n = (int64_t)N * OC;
    MT_LAUNCH(gelu_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, pre, n);
}

template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     int N, int IC, int OC, const T* gelu_pre, cudaStream_t stream) {
    check_linear("matmul_backward", N, IC, OC);
    if (!dweight && dbias) fail("cuda::matmul_backward: dbias without dweight");
    if (N == 0) return;
    const cudaDataType_t type = data_type<T>();
    if (dinp) {
        // dinp^T (IC,N) = weight (the column-major (OC,IC) matrix, transposed) @ dout^T (OC,N)
        GemmArgs g = gemm_args(true, false, IC, N, OC, weight, OC, dout, OC, dinp, IC, type, type);
        if (!gelu_pre) {
            gemm(g, stream);
        } else {
            g.epilogue = CUBLASLT_EPILOGUE_DGELU;
            g.aux = gelu_pre;
            g.aux_ld = IC;
            // (fp32: the exact derivative, not cuBLASLt's; the header says why.)
            const bool exact = std::is_same<T, float>::value;
            const bool fused = IC % 8 == 0 && !exact && try_epilogue_gemm(g, stream);
            if (!fused) {
                if (IC % 8 != 0 || exact) lt().fallback++;
                g.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
                g.aux = nullptr;
                g.aux_ld = 0;
                gemm(g, stream);
                const int64_t n = (int64_t)N * IC;
                MT_LAUNCH(dgelu_inplace_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0,
                          stream, dinp, gelu_pre, n);
            }
        }
    }
    if (!dweight) return;  // a frozen weight (LoRA): input gradient only
    // dweight^T (OC,IC) += dout^T (OC,N) @ inp (N,IC): inp read as the column-major (IC,N),
    // transposed
    gemm(gemm_args(false, true, OC, IC, N, dout, OC, inp, IC, dweight, OC, type, type, 1.0f),
         stream);
    if (dbias) column_sums_accumulate<T>(dbias, dout, N, OC, stream);
}

// ---- general row-major GEMM -------------------------------------------------------------------
// Row-major C (M,N) is the column-major C^T (N,M) = op(B)^T op(A)^T: B and A swap places, and a
// row-major matrix's transpose flag carries over to the column-major operand it becomes.
template <typename T>
void gemm_rows(bool ta, bool tb, int M, int N, int K, float alpha, const T* A, int64_t lda,
               const T* B, int64_t ldb, float beta, T* C, int64_t ldc, cudaStream_t stream) {
    if (M < 0 || N < 0 || K <= 0)
        fail("cuda::gemm_rows: M {} N {} K {}, expected M, N >= 0 and K > 0", M, N, K);
    if (M == 0 || N == 0) return;
    GemmArgs g =
        gemm_args(tb, ta, N, M, K, B, ldb, A, lda, C, ldc, data_type<T>(), data_type<T>(), beta);
    g.alpha = alpha;
    gemm(g, stream);
}

// ---- classifier + cross-entropy ----------------------------------------------------------------
constexpr int kLossMaxThreads = 512;

// 16 bytes of T: the unit of the loss kernel's row reads and writes.
template <typename T>
struct alignas(16) Pack {
    static constexpr int kWidth = 16 / (int)sizeof(T);
    T v[kWidth];
};

// Running (max, sum of exp(x - max)) of a softmax, merged in a fixed order. A state whose max is
// -inf has sum 0, and merging it must not form inf - inf.
struct MaxSum {
    float m, s;
};
static __device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.0f};
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// Loads group `g` (values [g W, g W + W)) of a row: one 16-byte load when the row is aligned for
// it and the group lies inside [0, limit), else one value at a time (the rest -inf). Either way
// the same values land in x, so the summation order does not depend on the path.
template <typename T>
static __device__ __forceinline__ void load_group(float* x, const T* row, int g, int limit,
                                                  bool vec) {
    constexpr int W = Pack<T>::kWidth;
    const int base = g * W;
    if (vec && base + W <= limit) {
        const Pack<T> p = *reinterpret_cast<const Pack<T>*>(row + base);
        for (int j = 0; j < W; j++) x[j] = to_float(p.v[j]);
    } else {
        for (int j = 0; j < W; j++) x[j] = base + j < limit ? to_float(row[base + j]) : -INFINITY;
    }
}

// One block per row of logits (R, Vp): the online max and sum of exponentials over [0, V) in one
// read (per group of W values: one rescale, W exponentials), a fixed-order block merge, loss_r =
// logsumexp - logit[y]; with `backward`, a second read that rewrites the row in place as
// d(logits) = (softmax - onehot(y)) * grad_scale, zero in the padded columns [V, Vp). A target
// outside [0, V) gives a NaN loss (and no one-hot term). fp32 statistics: the sum of up to 2^16
// exponentials, each at most 1, accumulated by 512 threads and a tree, is good to about 1e-6
// relative, which is below what bf16 logits carry.
template <typename T>
static __global__ void softmax_xent_kernel(T* logits, float* row_loss, const int32_t* targets,
                                           int V, int Vp, float grad_scale, bool backward,
                                           bool vec) {
    constexpr int W = Pack<T>::kWidth;
    __shared__ float shared_m[32], shared_s[32];
    T* l = logits + (int64_t)blockIdx.x * Vp;
    const int y = targets[blockIdx.x];
    const bool valid = y >= 0 && y < V;
    // Read before any thread rewrites the row (the writes come after the barriers below).
    const float ly = valid && threadIdx.x == 0 ? to_float(l[y]) : 0.0f;

    MaxSum st{-INFINITY, 0.0f};
    const int groups = (V + W - 1) / W;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        float x[W];
        load_group(x, l, g, V, vec);
        float gm = -INFINITY;
        for (int j = 0; j < W; j++) gm = fmaxf(gm, x[j]);
        const float m = fmaxf(st.m, gm);
        if (m == -INFINITY) continue;
        float s = st.s * expf(st.m - m);
        for (int j = 0; j < W; j++) s += expf(x[j] - m);
        st = {m, s};
    }
    // Butterfly within each warp (every lane ends with the same state), then across warps.
    for (int o = 16; o > 0; o >>= 1)
        st = merge(st,
                   {__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o)});
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    if (lane == 0) {
        shared_m[warp] = st.m;
        shared_s[warp] = st.s;
    }
    __syncthreads();
    st = lane < nwarps ? MaxSum{shared_m[lane], shared_s[lane]} : MaxSum{-INFINITY, 0.0f};
    for (int o = 16; o > 0; o >>= 1)
        st = merge(st,
                   {__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o)});
    const float lse = st.m + logf(st.s);
    if (threadIdx.x == 0) row_loss[blockIdx.x] = valid ? lse - ly : NAN;
    if (!backward) return;

    const int all_groups = (Vp + W - 1) / W;
    for (int g = threadIdx.x; g < all_groups; g += blockDim.x) {
        float x[W];
        load_group(x, l, g, Vp, vec);
        const int base = g * W;
        Pack<T> out;
        for (int j = 0; j < W; j++) {
            const int v = base + j;
            float d = 0.0f;
            if (v < V) {
                d = expf(x[j] - lse) * grad_scale;
                if (v == y) d -= grad_scale;
            }
            out.v[j] = from_float<T>(d);
        }
        if (vec && base + W <= Vp) {
            *reinterpret_cast<Pack<T>*>(l + base) = out;
        } else {
            for (int j = 0; j < W && base + j < Vp; j++) l[base + j] = out.v[j];
        }
    }
}

template <typename T>
void classifier_loss(T* dx, T* dwte, T* logits_buf, float* row_loss, const T* x, const T* wte,
                     const int32_t* targets, int N, int C, int V, int Vp, int chunk,
                     float grad_scale, cudaStream_t stream) {
    if (N < 0 || C <= 0 || chunk <= 0 || V <= 0 || V > Vp) {
        fail(
            "cuda::classifier_loss: N {} C {} V {} Vp {} chunk {}: expected N >= 0, C > 0, "
            "chunk > 0 and 0 < V <= Vp",
            N, C, V, Vp, chunk);
    }
    if (N == 0) return;
    if (!logits_buf || !row_loss || !x || !wte || !targets)
        fail("cuda::classifier_loss: null logits_buf, row_loss, x, wte or targets");
    const cudaDataType_t type = data_type<T>();
    constexpr int W = Pack<T>::kWidth;
    // Rows are 16-byte aligned when the buffer is and Vp values of T are a multiple of 16 bytes.
    const bool vec = alignment_of(logits_buf) >= 16 && (int64_t)Vp * sizeof(T) % 16 == 0;
    // Enough threads for one group of W values each across the row, at most kLossMaxThreads: a
    // function of Vp and T alone, so the summation order is too.
    const int64_t groups = ceil_div(Vp, W);
    const int threads =
        (int)(groups >= kLossMaxThreads ? kLossMaxThreads : ceil_div(groups, 32) * 32);
    for (int r0 = 0; r0 < N; r0 += chunk) {
        const int R = chunk < N - r0 ? chunk : N - r0;
        const T* xr = x + (int64_t)r0 * C;
        // logits^T (Vp,R) = wte (the column-major (C,Vp) matrix, transposed) @ x^T (C,R)
        gemm(gemm_args(true, false, Vp, R, C, wte, C, xr, C, logits_buf, Vp, type, type), stream);
        MT_LAUNCH(softmax_xent_kernel<T>, (unsigned)R, (unsigned)threads, 0, stream, logits_buf,
                  row_loss + r0, targets + r0, V, Vp, grad_scale, dx != nullptr, vec);
        if (!dx) continue;
        // dx^T (C,R) = wte^T (C,Vp) @ dlogits^T (Vp,R)
        gemm(gemm_args(false, false, C, R, Vp, wte, C, logits_buf, Vp, dx + (int64_t)r0 * C, C,
                       type, type),
             stream);
        if (!dwte) continue;
        // dwte^T (C,Vp) += x^T (C,R) @ dlogits (R,Vp)
        gemm(gemm_args(false, true, C, Vp, R, xr, C, logits_buf, Vp, dwte, C, type, type, 1.0f),
             stream);
    }
}

template <typename T>
void classifier_logits(float* out, const T* x, const T* wte, int N, int C, int V,
                       cudaStream_t stream) {
    if (N < 0 || C <= 0 || V <= 0)
        fail("cuda::classifier_logits: N {} C {} V {}, expected N >= 0, C > 0 and V > 0", N, C, V);
    // out^T (V,N) = wte[:V] (the column-major (C,V) matrix, transposed) @ x^T (C,N), fp32 out
    gemm(gemm_args(true, false, V, N, C, wte, C, x, C, out, V, data_type<T>(), CUDA_R_32F), stream);
}

// ---- instantiations ----------------------------------------------------------------------------
#define MT_INSTANTIATE(T)                                                                         \
    template void matmul_forward<T>(T*, const T*, const T*, const T*, int, int, int, const T*,    \
                                    cudaStream_t);                                                \
    template void matmul_forward_gelu<T>(T*, T*, const T*, const T*, const T*, int, int, int,     \
                                         cudaStream_t);                                           \
    template void matmul_backward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int,     \
                                     const T*, cudaStream_t);                                     \
    template void classifier_loss<T>(T*, T*, T*, float*, const T*, const T*, const int32_t*, int, \
                                     int, int, int, int, float, cudaStream_t);                    \
    template void classifier_logits<T>(float*, const T*, const T*, int, int, int, cudaStream_t);  \
    template void gemm_rows<T>(bool, bool, int, int, int, float, const T*, int64_t, const T*,     \
                               int64_t, float, T*, int64_t, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
