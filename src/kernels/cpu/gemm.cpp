// GEMM dispatch for the CPU kernels: OpenBLAS for fp32, oneDNN's matmul for bf16 operands.
#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "core/dtype.h"
#include "core/error.h"

namespace memtrain::cpu {

namespace {

using dt = dnnl::memory::data_type;

dnnl::engine& dnnl_engine() {
    static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    return eng;
}

// One matmul primitive per shape, created on first use. The descriptors carry the strides, so
// the memory objects of a call only wrap its pointers.
struct MatmulKey {
    int M, N, K, ldc;
    bool ta, tb, accumulate;
    auto tie() const { return std::tie(M, N, K, ldc, ta, tb, accumulate); }
    bool operator<(const MatmulKey& o) const { return tie() < o.tie(); }
};
struct Matmul {
    dnnl::memory::desc a, b, c, scratch;
    dnnl::matmul prim;
    bool ok = false;  // false: oneDNN has no bf16 matmul for this CPU (no AVX-512): widen instead
};

const Matmul& matmul_for(const MatmulKey& k) {
    static std::mutex mu;
    static std::map<MatmulKey, Matmul> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(k);
    if (it != cache.end()) return it->second;
    using dims = dnnl::memory::dims;
    Matmul m;
    m.a = dnnl::memory::desc(dims{k.M, k.K}, dt::bf16, k.ta ? dims{1, k.M} : dims{k.K, 1});
    m.b = dnnl::memory::desc(dims{k.K, k.N}, dt::bf16, k.tb ? dims{1, k.K} : dims{k.N, 1});
    m.c = dnnl::memory::desc(dims{k.M, k.N}, dt::f32, dims{k.ldc, 1});
    dnnl::primitive_attr attr;
    // The caller's scratchpad, not the library's: the library's is shared by every thread unless
    // oneDNN was built for concurrent execution, and the attention runs GEMMs on several threads.
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (k.accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
    }
    try {
        const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m.a, m.b, m.c), attr,
                                              dnnl_engine());
        m.scratch = pd.scratchpad_desc();
        m.prim = dnnl::matmul(pd);
        m.ok = true;
    } catch (const dnnl::error&) {
        // oneDNN 2.6 builds bf16 matmuls from AVX-512 up; below that the caller widens.
    }
    return cache.emplace(k, std::move(m)).first->second;
}

}  // namespace

void to_bf16(uint16_t* out, const float* in, int64_t rows, int64_t cols, int64_t ld) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* src = in + r * ld;
        uint16_t* dst = out + r * cols;
        for (int64_t c = 0; c < cols; c++) dst[c] = f32_to_bf16(src[c]);
    }
}

void from_bf16(float* out, const uint16_t* in, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}

void round_to_bf16(float* x, int64_t n, uint16_t* store) {
    if (!store) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
        return;
    }
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t b = f32_to_bf16(x[i]);
        store[i] = b;
        x[i] = bf16_to_f32(b);
    }
}

void gemm_bf16(bool ta, bool tb, int M, int N, int K, const uint16_t* A, const uint16_t* B,
               float beta, float* C, int ldc) {
    if (beta != 0.0f && beta != 1.0f) fail("gemm_bf16: beta = {} (0 or 1 only)", beta);
    if (M == 0 || N == 0) return;
    const Matmul& m = matmul_for({M, N, K, ldc, ta, tb, beta != 0.0f});
    if (!m.ok) {
        // The same product on fp32 FMAs: the operands widened exactly, then OpenBLAS.
        thread_local std::vector<float> wa, wb;
        wa.resize((std::size_t)M * K);
        wb.resize((std::size_t)K * N);
        from_bf16(wa.data(), A, (int64_t)wa.size());
        from_bf16(wb.data(), B, (int64_t)wb.size());
        gemm(nullptr, ta, tb, M, N, K, wa.data(), ta ? M : K, wb.data(), tb ? K : N, beta, C, ldc);
        return;
    }
    dnnl::engine& eng = dnnl_engine();
    dnnl::memory a(m.a, eng, const_cast<uint16_t*>(A));
    dnnl::memory b(m.b, eng, const_cast<uint16_t*>(B));
    dnnl::memory c(m.c, eng, C);
    thread_local dnnl::stream stream(eng);
    thread_local std::vector<uint8_t> pad;  // this thread's scratchpad, grown as shapes need
    if (pad.size() < m.scratch.get_size()) pad.resize(m.scratch.get_size());
    dnnl::memory scratch(m.scratch, eng, pad.data());
    m.prim.execute(stream, {{DNNL_ARG_SRC, a},
                            {DNNL_ARG_WEIGHTS, b},
                            {DNNL_ARG_DST, c},
                            {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
}

void gemm(const Bf16Gemm* g, bool ta, bool tb, int M, int N, int K, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
    if (!g) {
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    const std::size_t na = (std::size_t)M * K, nb = (std::size_t)K * N;
    if (na + nb > g->elems)
        fail("bf16 GEMM ({} x {} x {}): its operands need {} bf16 elements, the scratch holds {}",
             M, N, K, na + nb, g->elems);
    uint16_t* a = g->scratch;
    uint16_t* b = g->scratch + na;
    // Stored shapes: A is (M,K) or (K,M), B is (K,N) or (N,K).
    to_bf16(a, A, ta ? K : M, ta ? M : K, lda);
    to_bf16(b, B, tb ? N : K, tb ? K : N, ldb);
    gemm_bf16(ta, tb, M, N, K, a, b, beta, C, ldc);
}

bool cpu_has_bf16() {
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

std::string bf16_gemm_path() {
    const dnnl_version_t* v = dnnl_version();
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    const char* unit = isa == dnnl::cpu_isa::avx512_core_amx    ? "AMX"
                       : isa == dnnl::cpu_isa::avx512_core_bf16 ? "AVX512-BF16"
                                                                : nullptr;
    return fmt::format("oneDNN {}.{}.{}, {}", v->major, v->minor, v->patch,
                       unit ? unit : "fp32 FMAs: no bf16 instructions on this CPU");
}

}  // namespace memtrain::cpu
