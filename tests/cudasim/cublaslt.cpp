// The cuBLASLt calls memtrain makes, reimplemented for cudasim (see sim.h) with the signatures of
// cublasLt.h: column-major D = alpha op(A) op(B) + beta C with fp32, bf16 or fp16 storage and
// fp32 accumulation (OpenBLAS sgemm on fp32 copies), and the epilogues memtrain uses (bias,
// GELU with its auxiliary output, GELU gradient, bias gradients), as the cuBLASLt documentation
// defines them. The heuristic refuses what the real library refuses where that is documented
// (unaligned or missing epilogue pointers, row-major layouts this simulator does not model), so
// the callers' fallbacks run here too.
#include <cblas.h>
#include <cublasLt.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cudasim/sim.h"

struct cublasLtContext {
    int unused = 0;
};

namespace cudasim {
namespace {

struct Desc {
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = CUDA_R_32F;
    int32_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void* bias = nullptr;
    int32_t bias_type = -1;
    void* aux = nullptr;
    int64_t aux_ld = 0;
    int32_t aux_type = -1;
    int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
};

struct Layout {
    cudaDataType_t type = CUDA_R_32F;
    uint64_t rows = 0, cols = 0;
    int64_t ld = 0;
    int32_t order = CUBLASLT_ORDER_COL;
    int32_t batch = 1;
    int64_t stride = 0;
};

struct Pref {
    uint64_t max_workspace = 0;
};

Desc* desc(cublasLtMatmulDesc_t d) {
    return reinterpret_cast<Desc*>(d);
}
Layout* layout(cublasLtMatrixLayout_t l) {
    return reinterpret_cast<Layout*>(l);
}

template <typename T>
cublasStatus_t set(T& field, const void* buf, std::size_t size) {
    if (!buf || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&field, buf, sizeof(T));
    return CUBLAS_STATUS_SUCCESS;
}

float load(cudaDataType_t t, const void* base, int64_t i) {
    switch (t) {
        case CUDA_R_32F:
            return static_cast<const float*>(base)[i];
        case CUDA_R_16BF:
            return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
        case CUDA_R_16F:
            return __half2float(static_cast<const __half*>(base)[i]);
        default:
            return NAN;
    }
}

void store(cudaDataType_t t, void* base, int64_t i, float v) {
    switch (t) {
        case CUDA_R_32F:
            static_cast<float*>(base)[i] = v;
            break;
        case CUDA_R_16BF:
            static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
            break;
        case CUDA_R_16F:
            static_cast<__half*>(base)[i] = __float2half_rn(v);
            break;
        default:
            break;
    }
}

bool storage_type(cudaDataType_t t) {
    return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

std::size_t type_bytes(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : 2;
}

// GELU, tanh approximation, and its derivative (what cuBLASLt's GELU epilogues compute).
float gelu(float x) {
    const float k = 0.7978845608028654f;
    return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}
float gelu_grad(float x) {
    const float k = 0.7978845608028654f;
    const float th = std::tanh(k * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

bool has(uint32_t epi, uint32_t bit) {
    return (epi & bit) == bit;
}

// What the heuristic checks: supported types, consistent shapes, epilogue pointers present and
// aligned. Returns false where the real library would offer no algorithm (or reject the call).
bool supported(const Desc& d, const Layout& a, const Layout& b, const Layout& c, const Layout& dd) {
    if (d.compute != CUBLAS_COMPUTE_32F && d.compute != CUBLAS_COMPUTE_32F_FAST_TF32) return false;
    if (d.scale != CUDA_R_32F || d.pointer_mode != CUBLASLT_POINTER_MODE_HOST) return false;
    for (const Layout* l : {&a, &b, &c, &dd})
        if (!storage_type(l->type) || l->order != CUBLASLT_ORDER_COL || l->batch < 1) return false;
    if (a.type != b.type || c.type != dd.type) return false;
    if (a.type == CUDA_R_32F && dd.type != CUDA_R_32F) return false;
    const uint64_t m = d.ta == CUBLAS_OP_N ? a.rows : a.cols;
    const uint64_t k = d.ta == CUBLAS_OP_N ? a.cols : a.rows;
    const uint64_t kb = d.tb == CUBLAS_OP_N ? b.rows : b.cols;
    const uint64_t n = d.tb == CUBLAS_OP_N ? b.cols : b.rows;
    if (k != kb || dd.rows != m || dd.cols != n || c.rows != m || c.cols != n) return false;
    for (const Layout* l : {&a, &b, &c, &dd})
        if (l->ld < (int64_t)l->rows) return false;
    const uint32_t e = d.epilogue;
    const bool bias_in = has(e, CUBLASLT_EPILOGUE_BIAS) && !has(e, CUBLASLT_EPILOGUE_DGELU);
    const bool bias_out = has(e, CUBLASLT_EPILOGUE_BGRADA) || has(e, CUBLASLT_EPILOGUE_BGRADB) ||
                          e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
    if ((bias_in || bias_out) && (!d.bias || reinterpret_cast<uintptr_t>(d.bias) % 16 != 0))
        return false;
    const bool aux = e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
                     has(e, CUBLASLT_EPILOGUE_DGELU);
    if (aux && (!d.aux || d.aux_ld < (int64_t)m || d.aux_ld % 8 != 0 ||
                reinterpret_cast<uintptr_t>(d.aux) % 16 != 0))
        return false;
    const uint32_t known[] = {CUBLASLT_EPILOGUE_DEFAULT,   CUBLASLT_EPILOGUE_BIAS,
                              CUBLASLT_EPILOGUE_GELU,      CUBLASLT_EPILOGUE_GELU_AUX,
                              CUBLASLT_EPILOGUE_GELU_BIAS, CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                              CUBLASLT_EPILOGUE_DGELU,     CUBLASLT_EPILOGUE_DGELU_BGRAD,
                              CUBLASLT_EPILOGUE_BGRADA,    CUBLASLT_EPILOGUE_BGRADB};
    for (uint32_t k2 : known)
        if (e == k2) return true;
    return false;
}

void run_matmul(const Desc d, float alpha, float beta, const void* A, const Layout la,
                const void* B, const Layout lb, const void* C, const Layout lc, void* D,
                const Layout ld) {
    const bool ta = d.ta != CUBLAS_OP_N, tb = d.tb != CUBLAS_OP_N;
    const int64_t m = (int64_t)ld.rows, n = (int64_t)ld.cols;
    const int64_t k = ta ? (int64_t)la.rows : (int64_t)la.cols;
    const cudaDataType_t bias_t = d.bias_type < 0 ? ld.type : (cudaDataType_t)d.bias_type;
    const cudaDataType_t aux_t = d.aux_type < 0 ? ld.type : (cudaDataType_t)d.aux_type;
    const uint32_t e = d.epilogue;
    std::vector<float> fa((std::size_t)la.rows * la.cols), fb((std::size_t)lb.rows * lb.cols);
    std::vector<float> acc((std::size_t)m * n);
    for (int32_t bi = 0; bi < ld.batch; bi++) {
        const char* pa = static_cast<const char*>(A) + bi * la.stride * type_bytes(la.type);
        const char* pb = static_cast<const char*>(B) + bi * lb.stride * type_bytes(lb.type);
        const char* pc = static_cast<const char*>(C) + bi * lc.stride * type_bytes(lc.type);
        char* pd = static_cast<char*>(D) + bi * ld.stride * type_bytes(ld.type);
        for (uint64_t j = 0; j < la.cols; j++)
            for (uint64_t i = 0; i < la.rows; i++)
                fa[j * la.rows + i] = load(la.type, pa, (int64_t)(j * la.ld + i));
        for (uint64_t j = 0; j < lb.cols; j++)
            for (uint64_t i = 0; i < lb.rows; i++)
                fb[j * lb.rows + i] = load(lb.type, pb, (int64_t)(j * lb.ld + i));
        if (k > 0)
            cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans,
                        tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, fa.data(),
                        (int)la.rows, fb.data(), (int)lb.rows, 0.0f, acc.data(), (int)m);
        else
            std::fill(acc.begin(), acc.end(), 0.0f);
        std::vector<double> bias_sum(
            has(e, CUBLASLT_EPILOGUE_BGRADB) ? (std::size_t)n : (std::size_t)m, 0.0);
        for (int64_t j = 0; j < n; j++) {
            for (int64_t i = 0; i < m; i++) {
                float x = alpha * acc[(std::size_t)j * m + i];
                if (beta != 0.0f) x += beta * load(lc.type, pc, j * lc.ld + i);
                if (has(e, CUBLASLT_EPILOGUE_DGELU)) {
                    x *= gelu_grad(load(aux_t, d.aux, j * d.aux_ld + i));
                    if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD) bias_sum[i] += x;
                } else {
                    if (has(e, CUBLASLT_EPILOGUE_BIAS)) x += load(bias_t, d.bias, i);
                    if (has(e, CUBLASLT_EPILOGUE_GELU)) {
                        if (has(e, CUBLASLT_EPILOGUE_GELU_AUX))
                            store(aux_t, d.aux, j * d.aux_ld + i, x);
                        x = gelu(x);
                    }
                }
                store(ld.type, pd, j * ld.ld + i, x);
            }
        }
        if (has(e, CUBLASLT_EPILOGUE_BGRADA)) {  // sum over k of op(A)[i, k]
            for (int64_t i = 0; i < m; i++)
                for (int64_t kk = 0; kk < k; kk++)
                    bias_sum[i] +=
                        ta ? fa[(std::size_t)i * la.rows + kk] : fa[(std::size_t)kk * la.rows + i];
        }
        if (has(e, CUBLASLT_EPILOGUE_BGRADB)) {  // sum over k of op(B)[k, j]
            for (int64_t j = 0; j < n; j++)
                for (int64_t kk = 0; kk < k; kk++)
                    bias_sum[j] +=
                        tb ? fb[(std::size_t)kk * lb.rows + j] : fb[(std::size_t)j * lb.rows + kk];
        }
        if (has(e, CUBLASLT_EPILOGUE_BGRADA) || has(e, CUBLASLT_EPILOGUE_BGRADB) ||
            e == CUBLASLT_EPILOGUE_DGELU_BGRAD)
            for (std::size_t i = 0; i < bias_sum.size(); i++)
                store(bias_t, const_cast<void*>(d.bias), (int64_t)i, (float)bias_sum[i]);
    }
}

}  // namespace
}  // namespace cudasim

using namespace cudasim;

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    *handle = new cublasLtContext;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

const char* cublasLtGetStatusName(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS:
            return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED:
            return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED:
            return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE:
            return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_NOT_SUPPORTED:
            return "CUBLAS_STATUS_NOT_SUPPORTED";
        case CUBLAS_STATUS_EXECUTION_FAILED:
            return "CUBLAS_STATUS_EXECUTION_FAILED";
        default:
            return "CUBLAS_STATUS_UNKNOWN";
    }
}

const char* cublasLtGetStatusString(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS:
            return "success";
        case CUBLAS_STATUS_INVALID_VALUE:
            return "an invalid numeric value was used as an argument";
        case CUBLAS_STATUS_NOT_SUPPORTED:
            return "the functionality requested is not supported";
        case CUBLAS_STATUS_ALLOC_FAILED:
            return "resource allocation failed";
        default:
            return "unknown error";
    }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    Desc* x = new Desc;
    x->compute = compute;
    x->scale = scale;
    *d = reinterpret_cast<cublasLtMatmulDesc_t>(x);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete desc(d);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t md,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t size) {
    Desc& d = *desc(md);
    switch (attr) {
        case CUBLASLT_MATMUL_DESC_TRANSA:
            return set(d.ta, buf, size);
        case CUBLASLT_MATMUL_DESC_TRANSB:
            return set(d.tb, buf, size);
        case CUBLASLT_MATMUL_DESC_EPILOGUE:
            return set(d.epilogue, buf, size);
        case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
            return set(d.bias, buf, size);
        case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
            return set(d.bias_type, buf, size);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
            return set(d.aux, buf, size);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
            return set(d.aux_ld, buf, size);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
            return set(d.aux_type, buf, size);
        case CUBLASLT_MATMUL_DESC_POINTER_MODE:
            return set(d.pointer_mode, buf, size);
        case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
            return set(d.scale, buf, size);
        case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
            return set(d.compute, buf, size);
        default:
            return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
    Layout* x = new Layout;
    x->type = type;
    x->rows = rows;
    x->cols = cols;
    x->ld = ld;
    *l = reinterpret_cast<cublasLtMatrixLayout_t>(x);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete layout(l);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t ml,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
    Layout& l = *layout(ml);
    switch (attr) {
        case CUBLASLT_MATRIX_LAYOUT_ORDER:
            return set(l.order, buf, size);
        case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
            return set(l.batch, buf, size);
        case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
            return set(l.stride, buf, size);
        default:
            return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
    *p = reinterpret_cast<cublasLtMatmulPreference_t>(new Pref);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete reinterpret_cast<Pref*>(p);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
    Pref& x = *reinterpret_cast<Pref*>(p);
    switch (attr) {
        case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
            return set(x.max_workspace, buf, size);
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
        case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
            return buf && size == sizeof(uint32_t) ? CUBLAS_STATUS_SUCCESS
                                                   : CUBLAS_STATUS_INVALID_VALUE;
        default:
            return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t md,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* count) {
    if (!handle || requested <= 0) return CUBLAS_STATUS_INVALID_VALUE;
    *count = 0;
    if (!supported(*desc(md), *layout(a), *layout(b), *layout(c), *layout(d)))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    std::memset(&results[0], 0, sizeof(results[0]));
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t md, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t a, const void* B,
                              cublasLtMatrixLayout_t b, const void* beta, const void* C,
                              cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t stream) {
    if (!handle || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
    const Desc dd = *desc(md);
    const Layout la = *layout(a), lb = *layout(b), lc = *layout(c), ldd = *layout(d);
    if (!supported(dd, la, lb, lc, ldd)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    enqueue(stream, [=] { run_matmul(dd, al, be, A, la, B, lb, C, lc, D, ldd); });
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
