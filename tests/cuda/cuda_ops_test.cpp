// The CUDA backend against the CPU reference: every kernel of kernels/cuda on random inputs with
// odd sizes, and the device layer (availability, the device memory tracker, error reporting).
// Kernel tests report SKIPPED where no GPU answers; the Device tests that need none always run.
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

// ---- the device layer (runs everywhere) ---------------------------------------------------------

TEST(Device, BuildDefinesCudaFlag) {
#ifndef MEMTRAIN_HAVE_CUDA
    FAIL() << "MEMTRAIN_HAVE_CUDA is not defined (CMakeLists.txt defines it as 0 or 1)";
#else
    EXPECT_TRUE(MEMTRAIN_HAVE_CUDA == 0 || MEMTRAIN_HAVE_CUDA == 1);
    if (!MEMTRAIN_HAVE_CUDA) {
        EXPECT_FALSE(cuda_available());
    }
#endif
}

TEST(Device, AvailabilityAnswersWithoutThrowing) {
    bool available = false;
    EXPECT_NO_THROW(available = cuda_available());
    EXPECT_EQ(available, cuda_available());  // computed once, stable
    EXPECT_EQ(available, cuda_device_count() > 0);
    if (!available) {
        EXPECT_EQ(cuda_device_name(), "none");
        EXPECT_NO_THROW(device_synchronize());
    } else {
        EXPECT_NE(cuda_device_name(), "none");
    }
}

TEST(Device, AllocationWithoutDeviceIsAnError) {
    if (cuda_available()) GTEST_SKIP() << "a CUDA device is present";
    MemoryStats before = device_memory().snapshot();
    try {
        DeviceBuffer<float> b(16, MemCategory::Activations);
        FAIL() << "allocating device memory without a device succeeded";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("activations"), std::string::npos) << e.what();
    }
    EXPECT_EQ(device_memory().snapshot().total_used, before.total_used);
    DeviceBuffer<float> empty;  // default construction needs no device
    EXPECT_EQ(empty.data(), nullptr);
    EXPECT_EQ(empty.size(), 0u);
}

TEST(Device, CheckMacroNamesTheCallAndPlace) {
    try {
        MT_CUDA_CHECK(1);  // 1 is cudaErrorInvalidValue
        FAIL() << "MT_CUDA_CHECK(1) did not throw";
    } catch (const Error& e) {
        std::string m = e.what();
        EXPECT_NE(m.find("cuda_ops_test.cpp:"), std::string::npos) << m;
        EXPECT_NE(m.find(": 1 failed"), std::string::npos) << m;
#if MEMTRAIN_HAVE_CUDA
        EXPECT_NE(m.find("invalid argument"), std::string::npos) << m;
#endif
    }
    EXPECT_NO_THROW(MT_CUDA_CHECK(0));
    EXPECT_THROW(MT_CUBLAS_CHECK(7), Error);
}

// The host half of the GPU embedding backward (plain C++, so it is checked on every machine).
TEST(Device, TokenBucketsAreAStableSortById) {
    const std::vector<int32_t> ids = {5, 2, 5, 0, 2, 5, 9};
    std::vector<int32_t> plan;
    const int N = (int)ids.size();
    const int U = cuda::bucket_tokens(ids.data(), N, plan);
    ASSERT_EQ(U, 4);
    ASSERT_EQ(plan.size(), (std::size_t)N + 2 * U + 1);
    const std::vector<int32_t> order(plan.begin(), plan.begin() + N);
    const std::vector<int32_t> seg(plan.begin() + N, plan.begin() + N + U + 1);
    const std::vector<int32_t> uniq(plan.begin() + N + U + 1, plan.end());
    EXPECT_EQ(order, (std::vector<int32_t>{3, 1, 4, 0, 2, 5, 6}));
    EXPECT_EQ(seg, (std::vector<int32_t>{0, 1, 3, 6, 7}));
    EXPECT_EQ(uniq, (std::vector<int32_t>{0, 2, 5, 9}));

    // Random ids: every position once, runs hold one id each, positions ascending within a run.
    Rng r(7);
    std::vector<int32_t> many(1000);
    for (auto& x : many) x = (int32_t)(r.next_u64() % 37);
    const int M = (int)many.size();
    const int V = cuda::bucket_tokens(many.data(), M, plan);
    std::vector<int> seen(M, 0);
    for (int u = 0; u < V; u++) {
        const int32_t* seg_m = plan.data() + M;
        const int32_t id = plan[M + V + 1 + u];
        for (int k = seg_m[u]; k < seg_m[u + 1]; k++) {
            EXPECT_EQ(many[plan[k]], id);
            if (k > seg_m[u]) {
                EXPECT_LT(plan[k - 1], plan[k]);
            }
            seen[plan[k]]++;
        }
    }
    for (int p = 0; p < M; p++) EXPECT_EQ(seen[p], 1) << p;

    const std::vector<int32_t> bad = {1, -3};
    EXPECT_THROW(cuda::bucket_tokens(bad.data(), 2, plan), Error);
    EXPECT_EQ(cuda::bucket_tokens(bad.data(), 0, plan), 0);
}

TEST(Device, TrackerCountsDeviceBuffers) {
    REQUIRE_GPU();
    const MemoryStats host_before = host_memory().snapshot();
    const MemoryStats before = device_memory().snapshot();
    {
        DeviceBuffer<float> a(1000, MemCategory::Activations);  // 4000 bytes, 4096 reserved
        DeviceBuffer<double> p(3, MemCategory::Parameters);     // 24 bytes, 256 reserved
        MemoryStats s = device_memory().snapshot();
        EXPECT_EQ(s[MemCategory::Activations] - before[MemCategory::Activations], 4000u);
        EXPECT_EQ(s[MemCategory::Parameters] - before[MemCategory::Parameters], 24u);
        EXPECT_EQ(s.total_used - before.total_used, 4024u);
        EXPECT_EQ(s.total_reserved - before.total_reserved, 4096u + 256u);
        EXPECT_GE(s.peak_total_used, before.total_used + 4024u);

        DeviceBuffer<float> moved = std::move(a);  // ownership moves, the count does not change
        EXPECT_EQ(a.data(), nullptr);
        EXPECT_EQ(moved.size(), 1000u);
        EXPECT_EQ(device_memory().snapshot().total_used - before.total_used, 4024u);

        std::vector<float> zeros(1000, 1.0f);  // new buffers are zeroed, like Buffer<T>
        copy_to_host(zeros.data(), moved.data(), moved.bytes());
        for (float z : zeros) ASSERT_EQ(z, 0.0f);
    }
    MemoryStats after = device_memory().snapshot();
    EXPECT_EQ(after.total_used, before.total_used);
    EXPECT_EQ(after.total_reserved, before.total_reserved);
    EXPECT_EQ(host_memory().snapshot().total_used, host_before.total_used);
}

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

// ---- matmul
// ---------------------------------------------------------------------------------------

TEST(CudaOps, MatmulMatchesCpu) {
    REQUIRE_GPU();
    struct Case {
        int N, IC, OC;
        float beta;
        bool bias, misaligned_bias, with_dinp;
    };
    for (Case c :
         {Case{1, 64, 64, 0.0f, true, false, true}, Case{7, 33, 65, 0.0f, true, true, true},
          Case{130, 128, 50, 1.0f, true, false, true}, Case{64, 96, 288, 1.0f, false, false, false},
          Case{9, 17, 3, 0.0f, false, false, true}}) {
        SCOPED_TRACE(testing::Message()
                     << "N " << c.N << " IC " << c.IC << " OC " << c.OC << " beta " << c.beta
                     << " bias " << c.bias << " misaligned " << c.misaligned_bias);
        auto inp = randn((std::size_t)c.N * c.IC, 31), w = randn((std::size_t)c.IC * c.OC, 32);
        auto bias_store = randn(c.OC + 1, 33);  // bias at offset 1 when misaligned (4 bytes off)
        auto out = randn((std::size_t)c.N * c.OC, 34);  // the residual when beta = 1
        auto dout = randn(out.size(), 35), dinp = randn(inp.size(), 36);
        auto dw = randn(w.size(), 37), db_store = randn(c.OC + 1, 38);
        const int off = c.misaligned_bias ? 1 : 0;

        auto d_inp = upload(inp), d_w = upload(w), d_bias = upload(bias_store), d_out = upload(out);
        auto d_dout = upload(dout), d_dinp = upload(dinp), d_dw = upload(dw),
             d_db = upload(db_store);
        const float* bias = c.bias ? bias_store.data() + off : nullptr;
        cpu::matmul_forward(out.data(), inp.data(), w.data(), bias, c.N, c.IC, c.OC, c.beta);
        cuda::matmul_forward(d_out.data(), d_inp.data(), d_w.data(),
                             c.bias ? d_bias.data() + off : nullptr, c.N, c.IC, c.OC, c.beta);
        expect_close("out", download(d_out), out, 1e-4, 1e-5);

        float* db = c.bias ? db_store.data() + off : nullptr;
        cpu::matmul_backward(c.with_dinp ? dinp.data() : nullptr, dw.data(), db, dout.data(),
                             inp.data(), w.data(), c.N, c.IC, c.OC, c.beta);
        cuda::matmul_backward(c.with_dinp ? d_dinp.data() : nullptr, d_dw.data(),
                              c.bias ? d_db.data() + off : nullptr, d_dout.data(), d_inp.data(),
                              d_w.data(), c.N, c.IC, c.OC, c.beta);
        expect_close("dinp", download(d_dinp), dinp, 1e-4, 1e-5);
        expect_close("dweight", download(d_dw), dw, 2e-4, 1e-5);
        expect_close("dbias", download(d_db), db_store, 1e-4, 1e-5);
    }
}

TEST(CudaOps, MatmulBackwardRepeatsBitwise) {
    REQUIRE_GPU();
    const int N = 256, IC = 192, OC = 320;
    auto inp = randn((std::size_t)N * IC, 41), w = randn((std::size_t)IC * OC, 42);
    auto dout = randn((std::size_t)N * OC, 43);
    auto d_inp = upload(inp), d_w = upload(w), d_dout = upload(dout);
    std::vector<float> first_dw, first_db, first_dinp;
    for (int run = 0; run < 2; run++) {
        DeviceBuffer<float> dinp(inp.size(), MemCategory::Gradients),
            dw(w.size(), MemCategory::Gradients), db(OC, MemCategory::Gradients);
        cuda::matmul_backward(dinp.data(), dw.data(), db.data(), d_dout.data(), d_inp.data(),
                              d_w.data(), N, IC, OC);
        if (run == 0) {
            first_dinp = download(dinp);
            first_dw = download(dw);
            first_db = download(db);
        } else {
            expect_bitwise("dinp", download(dinp), first_dinp);
            expect_bitwise("dweight", download(dw), first_dw);
            expect_bitwise("dbias", download(db), first_db);
        }
    }
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

// ---- attention
// ------------------------------------------------------------------------------------

TEST(CudaOps, AttentionMatchesCpu) {
    REQUIRE_GPU();
    struct Case {
        int B, T, C, NH, NKV;
    };
    for (Case c : {Case{2, 5, 128, 2, 2}, Case{1, 1, 64, 1, 1}, Case{2, 9, 256, 2, 1},
                   Case{1, 37, 256, 4, 2}, Case{2, 70, 192, 3, 3}}) {
        SCOPED_TRACE(testing::Message() << "B " << c.B << " T " << c.T << " C " << c.C << " NH "
                                        << c.NH << " NKV " << c.NKV);
        const int hs = c.C / c.NH, QKV = c.C + 2 * c.NKV * hs;
        auto qkv = randn((std::size_t)c.B * c.T * QKV, 61, 0.7f);
        auto dout = randn((std::size_t)c.B * c.T * c.C, 62);
        std::vector<float> out(dout.size()), att((std::size_t)c.B * c.NH * c.T * c.T),
            dqkv(qkv.size());
        cpu::attention_forward(out.data(), att.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
        cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), c.B, c.T, c.C,
                                c.NH, c.NKV);

        auto d_qkv = upload(qkv), d_dout = upload(dout);
        auto d_dqkv = upload(randn(qkv.size(), 63));  // overwritten, not accumulated
        DeviceBuffer<float> d_out(out.size(), MemCategory::Activations),
            d_att(att.size(), MemCategory::Activations);
        cuda::attention_forward(d_out.data(), d_att.data(), d_qkv.data(), c.B, c.T, c.C, c.NH,
                                c.NKV);
        expect_close("att", download(d_att), att, 1e-6, 1e-5);
        expect_close("out", download(d_out), out, 1e-5, 1e-5);
        cuda::attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_att.data(), c.B, c.T,
                                 c.C, c.NH, c.NKV);
        expect_close("dqkv", download(d_dqkv), dqkv, 2e-5, 1e-4);
    }
}

// ---- classifier + cross-entropy
// -------------------------------------------------------------------

TEST(CudaOps, ClassifierLossMatchesCpu) {
    REQUIRE_GPU();
    struct Case {
        int N, C, V, Vp, chunk;
        bool backward;
    };
    for (Case c : {Case{7, 64, 67, 80, 3, true}, Case{1, 64, 50, 64, 4, true},
                   Case{40, 96, 1001, 1024, 16, true}, Case{11, 32, 30, 30, 11, false}}) {
        SCOPED_TRACE(testing::Message() << "N " << c.N << " C " << c.C << " V " << c.V << " Vp "
                                        << c.Vp << " chunk " << c.chunk);
        auto x = randn((std::size_t)c.N * c.C, 71), wte = randn((std::size_t)c.Vp * c.C, 72, 0.3f);
        auto targets = random_ids(c.N, c.V, 73);
        targets[0] = c.V - 1;  // the last real column
        const float scale = 1.0f / c.N;
        std::vector<float> dx(x.size()), logits((std::size_t)c.chunk * c.Vp);
        auto dwte = randn(wte.size(), 74);  // accumulated into
        auto d_x = upload(x), d_wte = upload(wte), d_dwte = upload(dwte);
        auto d_targets = upload(targets);
        double loss = cpu::classifier_loss(
            c.backward ? dx.data() : nullptr, c.backward ? dwte.data() : nullptr, logits.data(),
            x.data(), wte.data(), targets.data(), c.N, c.C, c.V, c.Vp, c.chunk, scale);
        DeviceBuffer<float> d_dx(x.size(), MemCategory::Gradients),
            d_logits(logits.size(), MemCategory::Workspace);
        double d_loss = cuda::classifier_loss(c.backward ? d_dx.data() : nullptr,
                                              c.backward ? d_dwte.data() : nullptr, d_logits.data(),
                                              d_x.data(), d_wte.data(), d_targets.data(), c.N, c.C,
                                              c.V, c.Vp, c.chunk, scale);
        EXPECT_GT(loss, 0.0);
        EXPECT_NEAR(d_loss, loss, 1e-6 * loss);
        if (c.backward) {
            expect_close("dx", download(d_dx), dx, 1e-6, 1e-4);
            expect_close("dwte", download(d_dwte), dwte, 1e-6, 1e-5);
        }

        std::vector<float> full((std::size_t)c.N * c.V);
        cpu::classifier_logits(full.data(), x.data(), wte.data(), c.N, c.C, c.V);
        DeviceBuffer<float> d_full(full.size(), MemCategory::Activations);
        cuda::classifier_logits(d_full.data(), d_x.data(), d_wte.data(), c.N, c.C, c.V);
        expect_close("logits", download(d_full), full, 1e-4, 1e-5);
    }
}

// ---- optimizer
// ------------------------------------------------------------------------------------

TEST(CudaOps, AdamWMatchesCpuOptimizer) {
    REQUIRE_GPU();
    // Two tensors: a decayed matrix and a bias without decay, as the model's layout marks them.
    ParamLayout layout;
    ParamSpec a, b;
    a.name = "w";
    a.shape = {37, 29};
    a.numel = 37 * 29;
    a.decay = true;
    b.name = "b";
    b.shape = {29};
    b.offset = a.numel;
    b.numel = 29;
    layout.tensors = {a, b};
    layout.total = a.numel + b.numel;
    const std::size_t n = layout.total;
    OptimConfig cfg;  // adamw, betas (0.9, 0.95), eps 1e-8, weight decay 0.1
    auto opt = make_optimizer(cfg, layout);

    auto params = randn(n, 81);
    std::vector<uint8_t> decay(n, 0);
    for (std::size_t i = 0; i < a.numel; i++) decay[i] = 1;
    auto d_params = upload(params);
    auto d_decay = upload(decay);
    DeviceBuffer<float> d_m(n, MemCategory::OptimizerState), d_v(n, MemCategory::OptimizerState);
    const double lrs[] = {1e-3, 6e-4, 3e-4};
    for (int step = 1; step <= 3; step++) {
        auto grads = randn(n, 90 + step, 0.1f);
        auto d_grads = upload(grads);
        opt->step(params.data(), grads.data(), lrs[step - 1]);
        cuda::adamw_step(d_params.data(), d_m.data(), d_v.data(), d_grads.data(), d_decay.data(),
                         (int64_t)n, lrs[step - 1], cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                         step);
    }
    auto state = opt->state();
    std::vector<float> m(state[0].second->data(), state[0].second->data() + n);
    std::vector<float> v(state[1].second->data(), state[1].second->data() + n);
    expect_close("params", download(d_params), params, 1e-7, 1e-6);
    expect_close("exp_avg", download(d_m), m, 1e-9, 1e-5);
    expect_close("exp_avg_sq", download(d_v), v, 1e-12, 1e-5);
}

// ---- helpers and casts
// ------------------------------------------------------------------------------

TEST(CudaOps, SumSquaresScaleAddMatchCpu) {
    REQUIRE_GPU();
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{200003}}) {
        SCOPED_TRACE(testing::Message() << "n " << n);
        auto a = randn(n, 101), b = randn(n, 102);
        auto d_a = upload(a), d_b = upload(b);
        double want = cpu::sum_squares(a.data(), n);
        double got = cuda::sum_squares(d_a.data(), n);
        EXPECT_NEAR(got, want, 1e-10 * want);              // float accumulation would be ~1e-7
        EXPECT_EQ(cuda::sum_squares(d_a.data(), n), got);  // fixed order: same bits again

        cpu::add_inplace(a.data(), b.data(), n);
        cpu::scale_inplace(a.data(), 0.37f, n);
        cuda::add_inplace(d_a.data(), d_b.data(), n);
        cuda::scale_inplace(d_a.data(), 0.37f, n);
        expect_bitwise("a", download(d_a), a);
    }
    EXPECT_EQ(cuda::sum_squares(nullptr, 0), 0.0);
}

TEST(CudaOps, CastsRoundToNearestEven) {
    REQUIRE_GPU();
    const int64_t n = 3001;
    auto x = randn(n, 111, 10.0f);
    x[0] = 1.0f + 1.0f / 256;  // a tie: rounds to even (1.0)
    x[1] = 1.0f + 3.0f / 256;  // a tie: rounds to even (1 + 1/64)
    x[2] = 0.0f;
    x[3] = -2.5f;
    auto d_x = upload(x);
    DeviceBuffer<uint16_t> d_b(n, MemCategory::Other), d_h(n, MemCategory::Other);
    DeviceBuffer<float> d_back(n, MemCategory::Other);

    cuda::cast_f32_to_bf16(bf(d_b), d_x.data(), n);
    auto bits = download(d_b);
    EXPECT_EQ(bits, to_bf16(x));
    EXPECT_EQ(bf16_value(bits[0]), 1.0f);
    cuda::cast_bf16_to_f32(d_back.data(), bf(d_b), n);
    expect_bitwise("bf16 -> f32", download(d_back), from_bf16(bits));

    __half* h = reinterpret_cast<__half*>(d_h.data());
    cuda::cast_f32_to_f16(h, d_x.data(), n);
    cuda::cast_f16_to_f32(d_back.data(), h, n);
    // fp16 keeps 11 significant bits: relative error at most 2^-11 in the normal range.
    expect_close("f16 round trip", download(d_back), x, 1e-7, 1.0 / 2000);
    auto back = download(d_back);
    EXPECT_EQ(back[2], 0.0f);
    EXPECT_EQ(back[3], -2.5f);
}

#else  // built without CUDA

TEST(CudaOps, NotBuiltWithCuda) {
    if (gpu_required()) {
        FAIL() << "MEMTRAIN_REQUIRE_GPU is set but memtrain was built without CUDA";
    }
    GTEST_SKIP() << "memtrain was built without CUDA (no nvcc, or -DMEMTRAIN_CUDA=OFF)";
}

#endif
