// Attention kernels against the CPU reference.
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

#endif  // MEMTRAIN_HAVE_CUDA
