// Row and elementwise kernels against the CPU reference, for each storage type (fp32, bf16, fp16):
// embedding, LayerNorm, RMSNorm, GELU, SwiGLU, rope. The CPU runs on the T-rounded inputs the
// kernel sees, so a T result may differ from it by the fp32 tolerance of the op (a different
// summation order, device math functions) plus one rounding to T: that is each tolerance below.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/token_buckets.h"

#if MEMTRAIN_HAVE_CUDA
#include "kernels/cuda/ops.h"
#endif

using namespace memtrain;
using namespace memtrain::test;

#if MEMTRAIN_HAVE_CUDA

namespace {

using StorageTypes = testing::Types<float, __nv_bfloat16, __half>;
struct StorageNames {
    template <typename T>
    static std::string GetName(int) {
        return type_name<T>();
    }
};

template <typename T>
class CudaRows : public testing::Test {};
TYPED_TEST_SUITE(CudaRows, StorageTypes, StorageNames);

// The relative error of one rounding to T (half a unit in the last place): 2^-24 for fp32,
// 2^-8 for bf16 (8 significant bits), 2^-11 for fp16 (11).
template <typename T>
double rounding() {
    if constexpr (std::is_same_v<T, float>)
        return std::ldexp(1.0, -24);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return std::ldexp(1.0, -8);
    else
        return std::ldexp(1.0, -11);
}

// Within the op's fp32 tolerance (atol, rtol) plus one rounding of the stored T value.
template <typename T>
void expect_close_t(const std::string& what, const std::vector<float>& got,
                    const std::vector<float>& want, double atol, double rtol) {
    expect_close(what, got, want, atol, rtol + rounding<T>());
}

// Random values already representable in T: the inputs both the CPU and the kernel see.
template <typename T>
std::vector<float> randn_t(std::size_t n, uint64_t seed, float scale = 1.0f) {
    return rounded<T>(randn(n, seed, scale));
}

// Runs `fn` and expects a memtrain::Error whose message names `op`.
void expect_error_naming(const std::string& op, const std::function<void()>& fn) {
    try {
        fn();
        ADD_FAILURE() << op << ": no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
    }
}

}  // namespace

// ---- embedding ----------------------------------------------------------------------------------

// Forward and backward add T values in fp32 in the CPU's order and round once, so the results are
// the CPU's rounded to T, bit for bit; for fp32, the CPU's bits.
TYPED_TEST(CudaRows, EmbeddingMatchesCpuBitwise) {
    using T = TypeParam;
    REQUIRE_GPU();
    struct Case {
        int B, T, C, V;
        bool wpe;
    };
    for (Case c : {Case{2, 5, 48, 67, true}, Case{1, 1, 64, 3, true}, Case{3, 7, 33, 4, false},
                   Case{2, 32, 40, 3, true}, Case{4, 16, 96, 1000, true}}) {
        SCOPED_TRACE(testing::Message() << "B " << c.B << " T " << c.T << " C " << c.C << " V "
                                        << c.V << " wpe " << c.wpe);
        const int N = c.B * c.T;
        auto ids = random_ids(N, c.V, 1 + c.C);  // V = 3 or 4: many repeats, runs longer than 8
        auto wte = randn_t<T>((std::size_t)c.V * c.C, 2),
             wpe = randn_t<T>((std::size_t)c.T * c.C, 3);
        auto dout = randn_t<T>((std::size_t)N * c.C, 4);
        auto dwte0 = randn_t<T>(wte.size(), 5), dwpe0 = randn_t<T>(wpe.size(), 6);  // accumulated

        std::vector<float> out(dout.size()), dwte = dwte0, dwpe = dwpe0;
        cpu::embedding_forward(out.data(), ids.data(), wte.data(), c.wpe ? wpe.data() : nullptr,
                               c.B, c.T, c.C);
        cpu::embedding_backward(dwte.data(), c.wpe ? dwpe.data() : nullptr, dout.data(), ids.data(),
                                c.B, c.T, c.C);

        // The plan is built on the host from the host ids and uploaded, as the trainer does.
        std::vector<int32_t> plan;
        const int U = cuda::bucket_tokens(ids.data(), N, plan);
        auto d_ids = upload(ids), d_plan = upload(plan);
        auto d_wte = upload_as<T>(wte), d_wpe = upload_as<T>(wpe), d_dout = upload_as<T>(dout);
        auto run = [&] {
            auto d_dwte = upload_as<T>(dwte0), d_dwpe = upload_as<T>(dwpe0);
            DeviceBuffer<T> d_out(out.size(), MemCategory::Activations);
            cuda::embedding_forward<T>(d_out.data(), d_ids.data(), d_wte.data(),
                                       c.wpe ? d_wpe.data() : nullptr, c.B, c.T, c.C);
            cuda::embedding_backward<T>(d_dwte.data(), c.wpe ? d_dwpe.data() : nullptr,
                                        d_dout.data(), d_plan.data(), U, c.B, c.T, c.C);
            return std::vector<std::vector<float>>{download_float(d_out), download_float(d_dwte),
                                                   download_float(d_dwpe)};
        };
        const auto got = run(), again = run();
        expect_bitwise("out", got[0], rounded<T>(out));
        expect_bitwise("dwte", got[1], rounded<T>(dwte));
        expect_bitwise("dwpe", got[2], rounded<T>(dwpe));  // untouched without wpe
        for (int i = 0; i < 3; i++) expect_bitwise("repeat", again[i], got[i]);
    }
}

// The backward takes its plan from the caller and never waits for the GPU, so it can be captured
// (the simulator, like CUDA, invalidates a capture that synchronises) and replayed.
TEST(CudaRowsGraph, EmbeddingBackwardReplaysFromAGraph) {
    REQUIRE_GPU();
    const int B = 2, T = 9, C = 40, V = 5, N = B * T;
    auto ids = random_ids(N, V, 81);
    auto dout = randn((std::size_t)N * C, 82);
    auto dwte = randn((std::size_t)V * C, 83), dwpe = randn((std::size_t)T * C, 84);
    std::vector<int32_t> plan;
    const int U = cuda::bucket_tokens(ids.data(), N, plan);
    auto d_plan = upload(plan);
    auto d_dout = upload(dout), d_dwte = upload(dwte), d_dwpe = upload(dwpe);

    cudaStream_t s;
    MT_CUDA_CHECK(cudaStreamCreate(&s));
    MT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    cuda::embedding_backward<float>(d_dwte.data(), d_dwpe.data(), d_dout.data(), d_plan.data(), U,
                                    B, T, C, s);
    cudaGraph_t graph;
    MT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    MT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int step = 0; step < 2; step++) {  // two micro-batches of gradient accumulation
        MT_CUDA_CHECK(cudaGraphLaunch(exec, s));
        cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), ids.data(), B, T, C);
    }
    MT_CUDA_CHECK(cudaStreamSynchronize(s));
    expect_bitwise("dwte", download(d_dwte), dwte);
    expect_bitwise("dwpe", download(d_dwpe), dwpe);
    MT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MT_CUDA_CHECK(cudaGraphDestroy(graph));
    MT_CUDA_CHECK(cudaStreamDestroy(s));
}

// ---- LayerNorm and RMSNorm ----------------------------------------------------------------------

struct NormCase {
    int N, C;
};
// Odd widths (scalar path), the GPT-2 widths, one with more than 64 rows (two partial-sum chunks)
// and wide rows that take every register-cached variant and the uncached one.
const NormCase kNormCases[] = {{1, 33}, {5, 100}, {67, 768}, {67, 1600}, {2, 3072}, {3, 4104}};

TYPED_TEST(CudaRows, LayerNormMatchesCpu) {
    using T = TypeParam;
    REQUIRE_GPU();
    for (NormCase c : kNormCases) {
        SCOPED_TRACE(testing::Message() << "N " << c.N << " C " << c.C);
        const std::size_t nc = (std::size_t)c.N * c.C;
        auto inp = randn(nc, 11, 2.0f);
        for (auto& x : inp) x += 0.5f;  // a non-zero mean
        inp = rounded<T>(inp);
        auto w = randn_t<T>(c.C, 12), b = randn_t<T>(c.C, 13), dout = randn_t<T>(nc, 14);
        auto dinp0 = randn_t<T>(nc, 15), dw0 = randn_t<T>(c.C, 16), db0 = randn_t<T>(c.C, 17);
        std::vector<float> out(nc), mean(c.N), rstd(c.N), dinp = dinp0, dw = dw0, db = db0;
        cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                               c.N, c.C, 1e-5f);
        cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(),
                                w.data(), mean.data(), rstd.data(), c.N, c.C);

        auto d_inp = upload_as<T>(inp), d_w = upload_as<T>(w), d_b = upload_as<T>(b);
        auto d_dout = upload_as<T>(dout);
        auto run = [&] {
            auto d_dinp = upload_as<T>(dinp0), d_dw = upload_as<T>(dw0), d_db = upload_as<T>(db0);
            DeviceBuffer<T> d_out(nc, MemCategory::Activations);
            DeviceBuffer<float> d_mean(c.N, MemCategory::Other), d_rstd(c.N, MemCategory::Other);
            cuda::layernorm_forward<T>(d_out.data(), d_mean.data(), d_rstd.data(), d_inp.data(),
                                       d_w.data(), d_b.data(), c.N, c.C, 1e-5f);
            cuda::layernorm_backward<T>(d_dinp.data(), d_dw.data(), d_db.data(), d_dout.data(),
                                        d_inp.data(), d_w.data(), d_mean.data(), d_rstd.data(), c.N,
                                        c.C);
            return std::vector<std::vector<float>>{download_float(d_out), download(d_mean),
                                                   download(d_rstd),      download_float(d_dinp),
                                                   download_float(d_dw),  download_float(d_db)};
        };
        const auto got = run(), again = run();
        // fp32 noise of a different summation order (warp tree vs sequential, ~1e-6 relative on
        // O(1) values) plus one rounding to T; the statistics stay fp32.
        expect_close_t<T>("out", got[0], out, 1e-5, 1e-5);
        expect_close("mean", got[1], mean, 1e-6, 1e-5);
        expect_close("rstd", got[2], rstd, 1e-6, 1e-5);
        expect_close_t<T>("dinp", got[3], dinp, 1e-5, 1e-5);
        // Column sums over up to 67 rows in another order: fp32 error grows with the row count.
        expect_close_t<T>("dweight", got[4], dw, 1e-4, 1e-5);
        expect_close_t<T>("dbias", got[5], db, 1e-4, 1e-5);
        for (std::size_t i = 0; i < got.size(); i++) expect_bitwise("repeat", again[i], got[i]);
    }
}

TYPED_TEST(CudaRows, RmsNormMatchesCpu) {
    using T = TypeParam;
    REQUIRE_GPU();
    for (NormCase c : kNormCases) {
        SCOPED_TRACE(testing::Message() << "N " << c.N << " C " << c.C);
        const std::size_t nc = (std::size_t)c.N * c.C;
        auto inp = randn_t<T>(nc, 31, 2.0f), w = randn_t<T>(c.C, 32), dout = randn_t<T>(nc, 33);
        auto dinp0 = randn_t<T>(nc, 34), dw0 = randn_t<T>(c.C, 35);
        std::vector<float> out(nc), rstd(c.N), dinp = dinp0, dw = dw0;
        cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), c.N, c.C, 1e-6f);
        cpu::rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(),
                              rstd.data(), c.N, c.C);

        auto d_inp = upload_as<T>(inp), d_w = upload_as<T>(w), d_dout = upload_as<T>(dout);
        auto run = [&] {
            auto d_dinp = upload_as<T>(dinp0), d_dw = upload_as<T>(dw0);
            DeviceBuffer<T> d_out(nc, MemCategory::Activations);
            DeviceBuffer<float> d_rstd(c.N, MemCategory::Other);
            cuda::rmsnorm_forward<T>(d_out.data(), d_rstd.data(), d_inp.data(), d_w.data(), c.N,
                                     c.C, 1e-6f);
            cuda::rmsnorm_backward<T>(d_dinp.data(), d_dw.data(), d_dout.data(), d_inp.data(),
                                      d_w.data(), d_rstd.data(), c.N, c.C);
            return std::vector<std::vector<float>>{download_float(d_out), download(d_rstd),
                                                   download_float(d_dinp), download_float(d_dw)};
        };
        const auto got = run(), again = run();
        // As LayerNorm: fp32 summation-order noise plus one rounding to T.
        expect_close_t<T>("out", got[0], out, 1e-5, 1e-5);
        expect_close("rstd", got[1], rstd, 1e-6, 1e-5);
        expect_close_t<T>("dinp", got[2], dinp, 1e-5, 1e-5);
        expect_close_t<T>("dweight", got[3], dw, 1e-4, 1e-5);
        for (std::size_t i = 0; i < got.size(); i++) expect_bitwise("repeat", again[i], got[i]);
    }
}

// ---- GELU and SwiGLU ----------------------------------------------------------------------------

TYPED_TEST(CudaRows, GeluMatchesCpu) {
    using T = TypeParam;
    REQUIRE_GPU();
    // n = 4099 leaves a partial pack at the end; offset 1 misaligns every pointer (scalar path).
    for (int64_t n : {int64_t{1}, int64_t{4099}}) {
        for (int offset : {0, 1}) {
            SCOPED_TRACE(testing::Message() << "n " << n << " offset " << offset);
            const std::size_t total = (std::size_t)(n + offset);
            auto inp = randn_t<T>(total, 51, 3.0f), dout = randn_t<T>(total, 52);
            std::vector<float> out(n), dinp(n);
            cpu::gelu_forward(out.data(), inp.data() + offset, n);
            cpu::gelu_backward(dinp.data(), inp.data() + offset, dout.data() + offset, n);
            auto d_inp = upload_as<T>(inp);
            auto run = [&] {
                auto d_dout = upload_as<T>(dout);
                DeviceBuffer<T> d_out(total, MemCategory::Activations);
                cuda::gelu_forward<T>(d_out.data() + offset, d_inp.data() + offset, n);
                // In place on dout, as the trainer does.
                cuda::gelu_backward<T>(d_dout.data() + offset, d_inp.data() + offset,
                                       d_dout.data() + offset, n);
                auto o = download_float(d_out), d = download_float(d_dout);
                return std::vector<std::vector<float>>{{o.begin() + offset, o.end()},
                                                       {d.begin() + offset, d.end()}};
            };
            const auto got = run(), again = run();
            // The CPU's tanh is exp-based (absolute error ~2e-7), the GPU's tanhf: a few 1e-7
            // times |x| <= ~12, plus one rounding to T.
            expect_close_t<T>("out", got[0], out, 2e-6, 1e-5);
            expect_close_t<T>("dinp", got[1], dinp, 5e-6, 1e-5);
            for (int i = 0; i < 2; i++) expect_bitwise("repeat", again[i], got[i]);
        }
    }
}

TYPED_TEST(CudaRows, SwiGluMatchesCpu) {
    using T = TypeParam;
    REQUIRE_GPU();
    for (int N : {1, 5, 67}) {
        for (int H : {5, 96}) {  // H = 5: scalar path; 96: full packs for every T
            SCOPED_TRACE(testing::Message() << "N " << N << " H " << H);
            const std::size_t nh = (std::size_t)N * H;
            auto inp = randn_t<T>(2 * nh, 61, 2.0f), dout = randn_t<T>(nh, 62);
            std::vector<float> out(nh), dinp(2 * nh);
            cpu::swiglu_forward(out.data(), inp.data(), N, H);
            cpu::swiglu_backward(dinp.data(), inp.data(), dout.data(), N, H);
            auto d_inp = upload_as<T>(inp), d_dout = upload_as<T>(dout);
            auto run = [&] {
                DeviceBuffer<T> d_out(nh, MemCategory::Activations);
                auto d_dinp = upload_as<T>(randn(2 * nh, 63));  // overwritten
                cuda::swiglu_forward<T>(d_out.data(), d_inp.data(), N, H);
                cuda::swiglu_backward<T>(d_dinp.data(), d_inp.data(), d_dout.data(), N, H);
                return std::vector<std::vector<float>>{download_float(d_out),
                                                       download_float(d_dinp)};
            };
            const auto got = run(), again = run();
            // expf on the device vs the CPU's exp (a few ulp each), plus one rounding to T.
            expect_close_t<T>("out", got[0], out, 1e-6, 2e-6);
            expect_close_t<T>("dinp", got[1], dinp, 1e-6, 2e-6);
            for (int i = 0; i < 2; i++) expect_bitwise("repeat", again[i], got[i]);
        }
    }
}

// ---- rope ---------------------------------------------------------------------------------------

TYPED_TEST(CudaRows, RopeMatchesCpu) {
    using T = TypeParam;
    REQUIRE_GPU();
    struct Case {
        int B, T, NH, NKV, hs;
    };
    // hs = 6 and 8: scalar for some T; B = 9: two blocks of batch rows; NKV < NH: grouped query.
    for (Case c : {Case{1, 1, 2, 1, 8}, Case{2, 5, 4, 2, 64}, Case{3, 7, 6, 2, 128},
                   Case{9, 3, 2, 1, 64}, Case{1, 67, 3, 3, 8}, Case{2, 4, 2, 2, 6}}) {
        SCOPED_TRACE(testing::Message() << "B " << c.B << " T " << c.T << " NH " << c.NH << " NKV "
                                        << c.NKV << " hs " << c.hs);
        const float theta = 10000.0f;
        const std::size_t n = (std::size_t)c.B * c.T * (c.NH + 2 * c.NKV) * c.hs;
        auto qkv = randn_t<T>(n, 71), dqkv = randn_t<T>(n, 72);
        std::vector<float> fwd = qkv, bwd = dqkv;
        cpu::rope_forward(fwd.data(), c.B, c.T, c.NH, c.NKV, c.hs, theta);
        cpu::rope_backward(bwd.data(), c.B, c.T, c.NH, c.NKV, c.hs, theta);
        auto run = [&] {
            auto d_qkv = upload_as<T>(qkv), d_dqkv = upload_as<T>(dqkv);
            cuda::rope_forward<T>(d_qkv.data(), c.B, c.T, c.NH, c.NKV, c.hs, theta);
            cuda::rope_backward<T>(d_dqkv.data(), c.B, c.T, c.NH, c.NKV, c.hs, theta);
            return std::vector<std::vector<float>>{download_float(d_qkv), download_float(d_dqkv)};
        };
        const auto got = run(), again = run();
        // x1 c - x2 s in fp32 (the GPU may fuse it into an fma) with the CPU's cos/sin, up to the
        // device's double sin/cos in the last bit; plus one rounding to T. v is compared too: it
        // must be untouched.
        expect_close_t<T>("qkv", got[0], fwd, 1e-6, 1e-6);
        expect_close_t<T>("dqkv", got[1], bwd, 1e-6, 1e-6);
        for (int i = 0; i < 2; i++) expect_bitwise("repeat", again[i], got[i]);
    }
}

// ---- argument errors ----------------------------------------------------------------------------

// Sizes are checked before any pointer is used, so null pointers suffice.
TYPED_TEST(CudaRows, BadSizesNameTheOp) {
    using T = TypeParam;
    REQUIRE_GPU();
    T* p = nullptr;
    float* f = nullptr;
    const int32_t* ids = nullptr;
    expect_error_naming("cuda::embedding_forward",
                        [&] { cuda::embedding_forward<T>(p, ids, p, p, 2, 3, 0); });
    expect_error_naming("cuda::embedding_backward",
                        [&] { cuda::embedding_backward<T>(p, p, p, ids, 0, 2, 3, 8); });
    expect_error_naming("cuda::embedding_backward",
                        [&] { cuda::embedding_backward<T>(p, p, p, ids, 7, 2, 3, 8); });
    expect_error_naming("cuda::layernorm_forward",
                        [&] { cuda::layernorm_forward<T>(p, f, f, p, p, p, 4, 0, 1e-5f); });
    expect_error_naming("cuda::layernorm_backward",
                        [&] { cuda::layernorm_backward<T>(p, p, p, p, p, p, f, f, -1, 8); });
    expect_error_naming("cuda::rmsnorm_forward",
                        [&] { cuda::rmsnorm_forward<T>(p, f, p, p, 4, -2, 1e-5f); });
    expect_error_naming("cuda::rmsnorm_backward",
                        [&] { cuda::rmsnorm_backward<T>(p, p, p, p, p, f, 4, 0); });
    expect_error_naming("cuda::gelu_forward", [&] { cuda::gelu_forward<T>(p, p, -1); });
    expect_error_naming("cuda::gelu_backward", [&] { cuda::gelu_backward<T>(p, p, p, -5); });
    expect_error_naming("cuda::swiglu_forward", [&] { cuda::swiglu_forward<T>(p, p, 3, 0); });
    expect_error_naming("cuda::swiglu_backward", [&] { cuda::swiglu_backward<T>(p, p, p, -1, 4); });
    expect_error_naming("cuda::rope_forward",
                        [&] { cuda::rope_forward<T>(p, 1, 2, 4, 2, 7, 10000.0f); });  // hs odd
    expect_error_naming("cuda::rope_backward",
                        [&] { cuda::rope_backward<T>(p, 1, 2, 4, 0, 8, 10000.0f); });
    // Empty inputs are no-ops, not errors.
    cuda::gelu_forward<T>(p, p, 0);
    cuda::layernorm_forward<T>(p, f, f, p, p, p, 0, 8, 1e-5f);
    cuda::embedding_backward<T>(p, p, p, ids, 0, 0, 3, 8);
}

#endif  // MEMTRAIN_HAVE_CUDA
