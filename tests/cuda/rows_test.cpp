// Row and elementwise kernels against the CPU reference: embedding, LayerNorm, GELU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/token_buckets.h"
#include "model/param_layout.h"
#include "optim/optimizer.h"

#if MEMTRAIN_HAVE_CUDA
#include "kernels/cuda/ops.h"
#endif

using namespace memtrain;
using namespace memtrain::test;

#if MEMTRAIN_HAVE_CUDA

// ---- embedding ----------------------------------------------------------------------------------

TEST(CudaOps, EmbeddingMatchesCpuBitwise) {
    REQUIRE_GPU();
    struct Case {
        int B, T, C, V;
        bool wpe;
    };
    for (Case c : {Case{2, 5, 48, 67, true}, Case{1, 1, 64, 3, true}, Case{3, 7, 33, 4, false},
                   Case{4, 64, 96, 1000, true}}) {
        SCOPED_TRACE(testing::Message() << "B " << c.B << " T " << c.T << " C " << c.C << " V "
                                        << c.V << " wpe " << c.wpe);
        const int N = c.B * c.T;
        auto ids = random_ids(N, c.V, 1 + c.C);  // V = 4 with 21 positions: many repeats
        auto wte = randn((std::size_t)c.V * c.C, 2), wpe = randn((std::size_t)c.T * c.C, 3);
        auto dout = randn((std::size_t)N * c.C, 4);
        auto dwte = randn(wte.size(), 5), dwpe = randn(wpe.size(), 6);  // accumulated into

        std::vector<float> out(dout.size());
        cpu::embedding_forward(out.data(), ids.data(), wte.data(), c.wpe ? wpe.data() : nullptr,
                               c.B, c.T, c.C);
        auto d_ids = upload(ids);
        auto d_wte = upload(wte), d_wpe = upload(wpe), d_dout = upload(dout);
        auto d_dwte = upload(dwte), d_dwpe = upload(dwpe);
        DeviceBuffer<float> d_out(out.size(), MemCategory::Activations);
        cuda::embedding_forward(d_out.data(), d_ids.data(), d_wte.data(),
                                c.wpe ? d_wpe.data() : nullptr, c.B, c.T, c.C);
        expect_bitwise("out", download(d_out), out);

        cpu::embedding_backward(dwte.data(), c.wpe ? dwpe.data() : nullptr, dout.data(), ids.data(),
                                c.B, c.T, c.C);
        cuda::embedding_backward(d_dwte.data(), c.wpe ? d_dwpe.data() : nullptr, d_dout.data(),
                                 d_ids.data(), c.B, c.T, c.C);
        expect_bitwise("dwte", download(d_dwte), dwte);
        expect_bitwise("dwpe", download(d_dwpe), dwpe);
    }
}

// ---- layernorm ----------------------------------------------------------------------------------

TEST(CudaOps, LayerNormMatchesCpu) {
    REQUIRE_GPU();
    struct Case {
        int N, C;
    };
    for (Case c : {Case{5, 33}, Case{1, 64}, Case{130, 100}, Case{67, 768}}) {
        SCOPED_TRACE(testing::Message() << "N " << c.N << " C " << c.C);
        const std::size_t nc = (std::size_t)c.N * c.C;
        auto inp = randn(nc, 11, 2.0f), w = randn(c.C, 12), b = randn(c.C, 13);
        for (auto& x : inp) x += 0.5f;  // a non-zero mean
        auto dout = randn(nc, 14), dinp = randn(nc, 15), dw = randn(c.C, 16), db = randn(c.C, 17);
        std::vector<float> out(nc), mean(c.N), rstd(c.N);
        cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                               c.N, c.C);

        auto d_inp = upload(inp), d_w = upload(w), d_b = upload(b), d_dout = upload(dout);
        auto d_dinp = upload(dinp), d_dw = upload(dw), d_db = upload(db);
        DeviceBuffer<float> d_out(nc, MemCategory::Activations), d_mean(c.N, MemCategory::Other),
            d_rstd(c.N, MemCategory::Other);
        cuda::layernorm_forward(d_out.data(), d_mean.data(), d_rstd.data(), d_inp.data(),
                                d_w.data(), d_b.data(), c.N, c.C);
        expect_close("out", download(d_out), out, 1e-5, 1e-5);
        expect_close("mean", download(d_mean), mean, 1e-6, 1e-5);
        expect_close("rstd", download(d_rstd), rstd, 1e-6, 1e-5);

        cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(),
                                w.data(), mean.data(), rstd.data(), c.N, c.C);
        cuda::layernorm_backward(d_dinp.data(), d_dw.data(), d_db.data(), d_dout.data(),
                                 d_inp.data(), d_w.data(), d_mean.data(), d_rstd.data(), c.N, c.C);
        expect_close("dinp", download(d_dinp), dinp, 1e-5, 1e-5);
        expect_close("dweight", download(d_dw), dw, 1e-4, 1e-5);
        expect_close("dbias", download(d_db), db, 1e-4, 1e-5);
    }
}

TEST(CudaOps, LayerNormBf16MatchesCpuOnRoundedInputs) {
    REQUIRE_GPU();
    const int N = 37, C = 200;
    const std::size_t nc = (std::size_t)N * C;
    auto inp16 = to_bf16(randn(nc, 21, 2.0f)), w16 = to_bf16(randn(C, 22)),
         b16 = to_bf16(randn(C, 23));
    auto inp = from_bf16(inp16), w = from_bf16(w16), b = from_bf16(b16);
    std::vector<float> out(nc), mean(N), rstd(N);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N,
                           C);
    auto d_inp = upload(inp16), d_w = upload(w16), d_b = upload(b16);
    DeviceBuffer<uint16_t> d_out(nc, MemCategory::Activations);
    DeviceBuffer<float> d_mean(N, MemCategory::Other), d_rstd(N, MemCategory::Other);
    cuda::layernorm_forward_bf16(bf(d_out), d_mean.data(), d_rstd.data(), bf(d_inp), bf(d_w),
                                 bf(d_b), N, C);
    // One bf16 rounding of the output (relative 2^-9), plus fp32 noise near zero.
    expect_close("out", from_bf16(download(d_out)), out, 1e-4, 1.0 / 256);
    expect_close("mean", download(d_mean), mean, 1e-6, 1e-5);
    expect_close("rstd", download(d_rstd), rstd, 1e-6, 1e-5);
}

// ---- activation
// -----------------------------------------------------------------------------------

TEST(CudaOps, GeluMatchesCpu) {
    REQUIRE_GPU();
    const int64_t n = 4099;
    auto inp = randn(n, 51, 3.0f), dout = randn(n, 52);
    std::vector<float> out(n), dinp(n);
    cpu::gelu_forward(out.data(), inp.data(), n);
    cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), n);
    auto d_inp = upload(inp), d_dout = upload(dout);
    DeviceBuffer<float> d_out(n, MemCategory::Activations), d_dinp(n, MemCategory::Gradients);
    cuda::gelu_forward(d_out.data(), d_inp.data(), n);
    cuda::gelu_backward(d_dinp.data(), d_inp.data(), d_dout.data(), n);
    expect_close("out", download(d_out), out, 2e-6, 1e-5);
    expect_close("dinp", download(d_dinp), dinp, 5e-6, 1e-5);
}

TEST(CudaOps, GeluBf16MatchesCpuOnRoundedInputs) {
    REQUIRE_GPU();
    const int64_t n = 1027;
    auto inp16 = to_bf16(randn(n, 53, 3.0f)), dout16 = to_bf16(randn(n, 54));
    auto inp = from_bf16(inp16), dout = from_bf16(dout16);
    std::vector<float> out(n), dinp(n);
    cpu::gelu_forward(out.data(), inp.data(), n);
    cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), n);
    auto d_inp = upload(inp16), d_dout = upload(dout16);
    DeviceBuffer<uint16_t> d_out(n, MemCategory::Activations), d_dinp(n, MemCategory::Gradients);
    cuda::gelu_forward_bf16(bf(d_out), bf(d_inp), n);
    cuda::gelu_backward_bf16(bf(d_dinp), bf(d_inp), bf(d_dout), n);
    expect_close("out", from_bf16(download(d_out)), out, 1e-5, 1.0 / 256);
    expect_close("dinp", from_bf16(download(d_dinp)), dinp, 1e-5, 1.0 / 256);
}

#endif  // MEMTRAIN_HAVE_CUDA
