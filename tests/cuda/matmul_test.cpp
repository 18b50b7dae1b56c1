// cuBLASLt matmul and the classifier + cross-entropy against the CPU reference.
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

#endif  // MEMTRAIN_HAVE_CUDA
