// cuBLASLt linear layer (bias, residual, GELU and GELU-gradient epilogues and their fallbacks) and
// the classifier + cross-entropy, for fp32 / bf16 / fp16 storage, against the CPU reference run on
// the same T-rounded inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cpu/ops.h"

#if MEMTRAIN_HAVE_CUDA
#include "kernels/cuda/ops.h"
#endif

using namespace memtrain;
using namespace memtrain::test;

#if MEMTRAIN_HAVE_CUDA

namespace {

double rms(const std::vector<float>& v) {
    double s = 0.0;
    for (float x : v) s += (double)x * x;
    return v.empty() ? 0.0 : std::sqrt(s / (double)v.size());
}

// Values accumulated in fp32 and rounded to T `roundings` times on the way (the output, a seeded
// bias, a pre-activation the fallback rounds before GELU...). fp32: 1e-5 relative plus 2e-5 of
// the values' rms, for summation order and tanhf against the CPU's polynomial. bf16 / fp16: each
// rounding moves a value by at most one unit roundoff of itself, and a rounded intermediate can
// be larger than the result it feeds, so the absolute part is in units of the values' rms.
template <typename T>
void expect_near_t(const std::string& what, const std::vector<float>& got,
                   const std::vector<float>& want, double roundings) {
    const double scale = std::max(rms(want), 1e-3);
    if constexpr (std::is_same_v<T, float>) {
        expect_close(what, got, want, 2e-5 * scale, 1e-5);
    } else {
        const double u = unit_roundoff<T>();
        expect_close(what, got, want, roundings * u * scale, roundings * u);
    }
}

// Under the simulator, whose heuristic refuses exactly what the documentation says cuBLASLt
// refuses, the test knows which path a call takes; on a GPU the heuristic decides, and the test
// only checks the values.
void expect_path(const cuda::EpilogueCounts& before, bool fused, const char* what) {
    const cuda::EpilogueCounts after = cuda::matmul_epilogue_counts();
    if (!on_cudasim()) return;
    if (fused) {
        EXPECT_GT(after.fused, before.fused) << what << ": expected the fused epilogue";
        EXPECT_EQ(after.fallback, before.fallback) << what << ": expected no fallback";
    } else {
        EXPECT_GT(after.fallback, before.fallback) << what << ": expected the fallback path";
    }
}

enum class Bias { None, Aligned, Misaligned };
enum class Residual { None, InPlace, Separate };

// A view at element `off` of a device buffer: off = 1 puts a T pointer 2 or 4 bytes past a
// 256-byte boundary, below the 16 bytes cuBLASLt's bias epilogue needs.
template <typename T>
T* at(DeviceBuffer<T>& d, int off) {
    return d.data() + off;
}

std::vector<float> slice(const std::vector<float>& v, std::size_t off, std::size_t n) {
    return std::vector<float>(v.begin() + (std::ptrdiff_t)off,
                              v.begin() + (std::ptrdiff_t)(off + n));
}

// ---- forward ------------------------------------------------------------------------------------
struct FwdCase {
    int N, IC, OC;
    Bias bias;
    Residual residual;
};

template <typename T>
void forward_case(const FwdCase& c) {
    SCOPED_TRACE(testing::Message()
                 << type_name<T>() << " N " << c.N << " IC " << c.IC << " OC " << c.OC << " bias "
                 << (int)c.bias << " residual " << (int)c.residual);
    const std::size_t NO = (std::size_t)c.N * c.OC;
    auto inp = rounded<T>(randn((std::size_t)c.N * c.IC, 31));
    auto w = rounded<T>(randn((std::size_t)c.IC * c.OC, 32, 1.0f / std::sqrt((float)c.IC)));
    auto bias_store = rounded<T>(randn(c.OC + 1, 33));
    auto res = rounded<T>(randn(NO, 34));
    const int off = c.bias == Bias::Misaligned ? 1 : 0;

    std::vector<float> want = c.residual == Residual::None ? std::vector<float>(NO, 0.0f) : res;
    cpu::matmul_forward(want.data(), inp.data(), w.data(),
                        c.bias == Bias::None ? nullptr : bias_store.data() + off, c.N, c.IC, c.OC,
                        c.residual == Residual::None ? 0.0f : 1.0f);

    auto d_inp = upload_as<T>(inp), d_w = upload_as<T>(w), d_bias = upload_as<T>(bias_store);
    auto d_res = upload_as<T>(res);
    std::vector<float> first;
    for (int run = 0; run < 2; run++) {
        auto d_out = c.residual == Residual::InPlace ? upload_as<T>(res)
                                                     : DeviceBuffer<T>(NO, MemCategory::Other);
        const T* residual = c.residual == Residual::InPlace    ? d_out.data()
                            : c.residual == Residual::Separate ? d_res.data()
                                                               : nullptr;
        const auto before = cuda::matmul_epilogue_counts();
        cuda::matmul_forward<T>(d_out.data(), d_inp.data(), d_w.data(),
                                c.bias == Bias::None ? nullptr : at(d_bias, off), c.N, c.IC, c.OC,
                                residual);
        if (c.bias != Bias::None) expect_path(before, c.bias == Bias::Aligned, "bias");
        auto got = download_float(d_out);
        if (run == 0) {
            // The output rounding, plus the seeded residual + bias of the fallback.
            expect_near_t<T>("out", got, want, c.bias == Bias::Misaligned ? 3 : 2);
            first = got;
        } else {
            expect_bitwise("out (repeat)", got, first);
        }
    }
}

// ---- forward with GELU --------------------------------------------------------------------------
struct GeluCase {
    int N, IC, OC;
    Bias bias;
    int pre_off;  // elements the pre-activation view starts past its buffer's start
    bool fused;   // the path the simulator takes
};

template <typename T>
void forward_gelu_case(const GeluCase& c) {
    SCOPED_TRACE(testing::Message() << type_name<T>() << " N " << c.N << " IC " << c.IC << " OC "
                                    << c.OC << " bias " << (int)c.bias << " pre_off " << c.pre_off);
    const std::size_t NO = (std::size_t)c.N * c.OC;
    auto inp = rounded<T>(randn((std::size_t)c.N * c.IC, 41));
    auto w = rounded<T>(randn((std::size_t)c.IC * c.OC, 42, 1.0f / std::sqrt((float)c.IC)));
    auto bias_store = rounded<T>(randn(c.OC + 1, 43));
    const int off = c.bias == Bias::Misaligned ? 1 : 0;
    std::vector<float> want_pre(NO), want(NO);
    cpu::matmul_forward(want_pre.data(), inp.data(), w.data(),
                        c.bias == Bias::None ? nullptr : bias_store.data() + off, c.N, c.IC, c.OC);
    cpu::gelu_forward(want.data(), want_pre.data(), (int64_t)NO);

    auto d_inp = upload_as<T>(inp), d_w = upload_as<T>(w), d_bias = upload_as<T>(bias_store);
    std::vector<float> first_out, first_pre;
    for (int run = 0; run < 2; run++) {
        DeviceBuffer<T> d_out(NO, MemCategory::Other), d_pre(NO + c.pre_off, MemCategory::Other);
        const auto before = cuda::matmul_epilogue_counts();
        cuda::matmul_forward_gelu<T>(d_out.data(), at(d_pre, c.pre_off), d_inp.data(), d_w.data(),
                                     c.bias == Bias::None ? nullptr : at(d_bias, off), c.N, c.IC,
                                     c.OC);
        expect_path(before, c.fused, "gelu");
        auto out = download_float(d_out);
        auto pre = slice(download_float(d_pre), c.pre_off, NO);
        if (run == 0) {
            expect_near_t<T>("pre", pre, want_pre, c.bias == Bias::Misaligned ? 3 : 2);
            // The fallback applies GELU to the rounded pre-activation: one more rounding's worth.
            expect_near_t<T>("out", out, want, 4);
            first_out = out;
            first_pre = pre;
        } else {
            expect_bitwise("out (repeat)", out, first_out);
            expect_bitwise("pre (repeat)", pre, first_pre);
        }
    }
}

// ---- backward -----------------------------------------------------------------------------------
struct BwdCase {
    int N, IC, OC;
    bool dinp;
    Bias dbias;
    bool gelu;        // the layer's input came through a GELU: dinp *= gelu'(gelu_pre)
    int pre_off;      // elements gelu_pre's view starts past its buffer's start
    bool gelu_fused;  // the path the simulator takes
};

template <typename T>
void backward_case(const BwdCase& c) {
    SCOPED_TRACE(testing::Message() << type_name<T>() << " N " << c.N << " IC " << c.IC << " OC "
                                    << c.OC << " dinp " << c.dinp << " dbias " << (int)c.dbias
                                    << " gelu " << c.gelu << " pre_off " << c.pre_off);
    const std::size_t NI = (std::size_t)c.N * c.IC, NO = (std::size_t)c.N * c.OC;
    auto inp = rounded<T>(randn(NI, 51));
    auto w = rounded<T>(randn((std::size_t)c.IC * c.OC, 52, 1.0f / std::sqrt((float)c.OC)));
    auto dout = rounded<T>(randn(NO, 53));
    auto pre = rounded<T>(randn(NI + c.pre_off, 54));
    auto dw0 = rounded<T>(randn(w.size(), 55));        // accumulated into
    auto db0 = rounded<T>(randn(c.OC + 1, 56, 4.0f));  // accumulated into
    const int off = c.dbias == Bias::Misaligned ? 1 : 0;

    std::vector<float> want_dinp(NI), want_dw = dw0, want_db = db0;
    cpu::matmul_backward(want_dinp.data(), want_dw.data(),
                         c.dbias == Bias::None ? nullptr : want_db.data() + off, dout.data(),
                         inp.data(), w.data(), c.N, c.IC, c.OC);
    if (c.gelu) {
        std::vector<float> g(NI);
        cpu::gelu_backward(g.data(), pre.data() + c.pre_off, want_dinp.data(), (int64_t)NI);
        want_dinp = g;
    }

    auto d_inp = upload_as<T>(inp), d_w = upload_as<T>(w), d_dout = upload_as<T>(dout);
    auto d_pre = upload_as<T>(pre);
    std::vector<float> first_dinp, first_dw, first_db;
    for (int run = 0; run < 2; run++) {
        DeviceBuffer<T> d_dinp(NI, MemCategory::Other);
        auto d_dw = upload_as<T>(dw0), d_db = upload_as<T>(db0);
        const auto before = cuda::matmul_epilogue_counts();
        cuda::matmul_backward<T>(c.dinp ? d_dinp.data() : nullptr, d_dw.data(),
                                 c.dbias == Bias::None ? nullptr : at(d_db, off), d_dout.data(),
                                 d_inp.data(), d_w.data(), c.N, c.IC, c.OC,
                                 c.gelu ? at(d_pre, c.pre_off) : nullptr);
        // fp32 keeps the exact GELU derivative (cuBLASLt's fused DGELU is approximate).
        if (c.gelu && c.dinp)
            expect_path(before, c.gelu_fused && !std::is_same_v<T, float>, "dgelu");
        auto dinp = download_float(d_dinp), dw = download_float(d_dw), db = download_float(d_db);
        if (run == 0) {
            // dinp: the output rounding, plus the fallback's rounding before the GELU factor.
            if (c.dinp) expect_near_t<T>("dinp", dinp, want_dinp, c.gelu ? 3 : 2);
            expect_near_t<T>("dweight", dw, want_dw, 2);
            expect_near_t<T>("dbias", db, want_db, 2);
            first_dinp = dinp;
            first_dw = dw;
            first_db = db;
        } else {
            if (c.dinp) expect_bitwise("dinp (repeat)", dinp, first_dinp);
            expect_bitwise("dweight (repeat)", dw, first_dw);
            expect_bitwise("dbias (repeat)", db, first_db);
        }
    }
}

template <typename T>
void linear_cases() {
    for (FwdCase c : {FwdCase{1, 64, 64, Bias::Aligned, Residual::None},
                      FwdCase{5, 33, 96, Bias::Misaligned, Residual::InPlace},
                      FwdCase{130, 96, 33, Bias::Aligned, Residual::Separate},
                      FwdCase{5, 64, 64, Bias::None, Residual::Separate},
                      FwdCase{130, 33, 64, Bias::Misaligned, Residual::Separate},
                      FwdCase{1, 96, 33, Bias::None, Residual::InPlace}})
        forward_case<T>(c);
    // GELU_AUX[_BIAS] needs OC % 8 == 0 (aux ld), a 16-byte aligned bias and aux.
    for (GeluCase c :
         {GeluCase{5, 64, 64, Bias::Aligned, 0, true},
          GeluCase{130, 33, 96, Bias::Aligned, 0, true},
          GeluCase{5, 64, 33, Bias::Aligned, 0, false},
          GeluCase{1, 96, 64, Bias::Misaligned, 0, false}, GeluCase{5, 33, 64, Bias::None, 0, true},
          GeluCase{5, 64, 64, Bias::Aligned, 1, false}})
        forward_gelu_case<T>(c);
    // DGELU needs IC % 8 == 0 (aux ld) and a 16-byte aligned aux.
    for (BwdCase c : {BwdCase{1, 64, 64, true, Bias::Aligned, true, 0, true},
                      BwdCase{5, 33, 96, true, Bias::Misaligned, true, 0, false},
                      BwdCase{130, 96, 33, true, Bias::None, false, 0, false},
                      BwdCase{5, 64, 33, true, Bias::Aligned, true, 1, false},
                      BwdCase{130, 33, 64, false, Bias::Aligned, false, 0, false},
                      BwdCase{130, 96, 64, true, Bias::Aligned, true, 0, true}})
        backward_case<T>(c);
}

// ---- classifier + cross-entropy
// ------------------------------------------------------------------
struct LossCase {
    int N, C, V, Vp, chunk;
    bool backward, dwte;
};

template <typename T>
void classifier_case(const LossCase& c) {
    SCOPED_TRACE(testing::Message() << type_name<T>() << " N " << c.N << " C " << c.C << " V "
                                    << c.V << " Vp " << c.Vp << " chunk " << c.chunk);
    auto x = rounded<T>(randn((std::size_t)c.N * c.C, 71));
    auto wte = rounded<T>(randn((std::size_t)c.Vp * c.C, 72, 0.3f));
    auto targets = random_ids(c.N, c.V, 73);
    targets[0] = c.V - 1;  // the last real column
    const float scale = 1.0f / c.N;
    auto dwte0 = rounded<T>(randn(wte.size(), 74, 0.01f));  // accumulated into

    // The CPU reference, row by row for the per-row losses, then once for the gradients.
    std::vector<float> logits((std::size_t)c.chunk * c.Vp), want_loss(c.N);
    double want_total = 0.0;
    for (int r = 0; r < c.N; r++) {
        want_loss[r] = (float)cpu::classifier_loss(nullptr, nullptr, logits.data(),
                                                   x.data() + (std::size_t)r * c.C, wte.data(),
                                                   targets.data() + r, 1, c.C, c.V, c.Vp, 1, scale);
        want_total += want_loss[r];
    }
    std::vector<float> want_dx(x.size()), want_dwte = dwte0, unused_dwte = dwte0;
    if (c.backward) {
        // (the CPU kernel always accumulates a dwte when it runs the backward)
        cpu::classifier_loss(want_dx.data(), c.dwte ? want_dwte.data() : unused_dwte.data(),
                             logits.data(), x.data(), wte.data(), targets.data(), c.N, c.C, c.V,
                             c.Vp, c.chunk, scale);
    }

    auto d_x = upload_as<T>(x), d_wte = upload_as<T>(wte);
    auto d_targets = upload(targets);
    std::vector<float> first_loss, first_dx, first_dwte;
    for (int run = 0; run < 2; run++) {
        auto d_dwte = upload_as<T>(dwte0);
        DeviceBuffer<T> d_dx(x.size(), MemCategory::Gradients),
            d_logits((std::size_t)c.chunk * c.Vp, MemCategory::Workspace);
        DeviceBuffer<float> d_loss(c.N, MemCategory::Other);
        DeviceBuffer<double> d_total(1, MemCategory::Other);
        cuda::classifier_loss<T>(c.backward ? d_dx.data() : nullptr,
                                 c.backward && c.dwte ? d_dwte.data() : nullptr, d_logits.data(),
                                 d_loss.data(), d_x.data(), d_wte.data(), d_targets.data(), c.N,
                                 c.C, c.V, c.Vp, c.chunk, scale);
        cuda::sum_floats(d_total.data(), d_loss.data(), c.N);
        auto loss = download(d_loss);
        auto dx = download_float(d_dx), dwte = download_float(d_dwte);
        if (run == 0) {
            // Losses are O(log V); softmax statistics in fp32 track the CPU's double to ~1e-6.
            // bf16 / fp16 logits are rounded before the softmax: a loss moves by about
            // u * (|logit[y]| + max |logit|), logits here being at most ~4.
            const double loss_tol = std::is_same_v<T, float> ? 2e-5 : 10 * unit_roundoff<T>();
            expect_close("row loss", loss, want_loss, loss_tol, loss_tol);
            EXPECT_NEAR(download(d_total)[0], want_total, loss_tol * c.N);
            if (c.backward) {
                // d(logits) is rounded to T after its softmax was computed from rounded logits
                // (a relative error of about u (1 + |logit|)), so dx carries several units.
                expect_near_t<T>("dx", dx, want_dx, 8);
                expect_near_t<T>("dwte", dwte, want_dwte, 8);
                // The last chunk's padded columns hold zero gradient.
                auto lg = download_float(d_logits);
                const int R = c.N - (c.N - 1) / c.chunk * c.chunk;
                for (int r = 0; r < R; r++)
                    for (int v = c.V; v < c.Vp; v++)
                        ASSERT_EQ(lg[(std::size_t)r * c.Vp + v], 0.0f)
                            << "row " << r << " col " << v;
            }
            first_loss = loss;
            first_dx = dx;
            first_dwte = dwte;
        } else {
            expect_bitwise("row loss (repeat)", loss, first_loss);
            if (c.backward) {
                expect_bitwise("dx (repeat)", dx, first_dx);
                expect_bitwise("dwte (repeat)", dwte, first_dwte);
            }
        }
    }

    // fp32 logits over the real vocabulary.
    std::vector<float> full((std::size_t)c.N * c.V);
    cpu::classifier_logits(full.data(), x.data(), wte.data(), c.N, c.C, c.V);
    DeviceBuffer<float> d_full(full.size(), MemCategory::Activations);
    cuda::classifier_logits<T>(d_full.data(), d_x.data(), d_wte.data(), c.N, c.C, c.V);
    // Products of T values are exact in fp32: only the summation order differs.
    expect_close("logits", download(d_full), full, 2e-5 * std::max(rms(full), 1.0), 1e-5);
}

template <typename T>
void classifier_cases() {
    // Vp * sizeof(T) % 16 == 0 takes the vectorised row path, otherwise one value at a time.
    for (LossCase c :
         {LossCase{7, 64, 67, 80, 3, true, true}, LossCase{1, 64, 50, 64, 4, true, true},
          LossCase{40, 96, 1001, 1024, 16, true, true}, LossCase{11, 32, 30, 30, 11, false, false},
          LossCase{130, 33, 200, 203, 48, true, false}, LossCase{5, 32, 77, 96, 2, true, true}})
        classifier_case<T>(c);
}

}  // namespace

TEST(CudaMatmul, LinearFp32) {
    REQUIRE_GPU();
    linear_cases<float>();
}
TEST(CudaMatmul, LinearBf16) {
    REQUIRE_GPU();
    linear_cases<__nv_bfloat16>();
}
TEST(CudaMatmul, LinearFp16) {
    REQUIRE_GPU();
    linear_cases<__half>();
}

TEST(CudaMatmul, ClassifierLossFp32) {
    REQUIRE_GPU();
    classifier_cases<float>();
}
TEST(CudaMatmul, ClassifierLossBf16) {
    REQUIRE_GPU();
    classifier_cases<__nv_bfloat16>();
}
TEST(CudaMatmul, ClassifierLossFp16) {
    REQUIRE_GPU();
    classifier_cases<__half>();
}

// The classifier + loss and the loss sum only queue work: captured into a CUDA graph (after a
// first call has made the GEMM plans and grown the scratch), the replay gives the same bits.
TEST(CudaMatmul, ClassifierLossCapturesIntoAGraph) {
    REQUIRE_GPU();
    using T = __nv_bfloat16;
    const int N = 9, C = 32, V = 70, Vp = 80, chunk = 4;
    auto d_x = upload_as<T>(randn((std::size_t)N * C, 81)),
         d_wte = upload_as<T>(randn((std::size_t)Vp * C, 82, 0.3f));
    auto d_targets = upload(random_ids(N, V, 83));
    DeviceBuffer<T> d_logits((std::size_t)chunk * Vp, MemCategory::Workspace);
    struct Out {
        DeviceBuffer<T> dx, dwte;
        DeviceBuffer<float> loss;
        DeviceBuffer<double> total;
    };
    auto fresh = [&] {
        return Out{DeviceBuffer<T>((std::size_t)N * C, MemCategory::Other),
                   DeviceBuffer<T>((std::size_t)Vp * C, MemCategory::Other),
                   DeviceBuffer<float>(N, MemCategory::Other),
                   DeviceBuffer<double>(1, MemCategory::Other)};
    };
    cudaStream_t stream;
    MT_CUDA_CHECK(cudaStreamCreate(&stream));
    auto queue = [&](Out& o) {
        cuda::classifier_loss<T>(o.dx.data(), o.dwte.data(), d_logits.data(), o.loss.data(),
                                 d_x.data(), d_wte.data(), d_targets.data(), N, C, V, Vp, chunk,
                                 1.0f / N, stream);
        cuda::sum_floats(o.total.data(), o.loss.data(), N, stream);
    };
    Out direct = fresh(), graphed = fresh();
    queue(direct);
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    MT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    queue(graphed);
    cudaGraph_t graph;
    MT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    MT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_bitwise("dx", download_float(graphed.dx), download_float(direct.dx));
    expect_bitwise("dwte", download_float(graphed.dwte), download_float(direct.dwte));
    expect_bitwise("loss", download(graphed.loss), download(direct.loss));
    EXPECT_EQ(download(graphed.total)[0], download(direct.total)[0]);
    MT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MT_CUDA_CHECK(cudaGraphDestroy(graph));
    MT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaMatmul, BadSizesNameTheOp) {
    REQUIRE_GPU();
    DeviceBuffer<float> a(64, MemCategory::Other), b(64, MemCategory::Other),
        c(64, MemCategory::Other);
    DeviceBuffer<int32_t> t(4, MemCategory::Other);
    auto throws_naming = [](const char* op, auto&& f) {
        try {
            f();
            ADD_FAILURE() << op << ": no error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
        }
    };
    throws_naming("cuda::matmul_forward", [&] {
        cuda::matmul_forward<float>(a.data(), b.data(), c.data(), nullptr, 2, 0, 4);
    });
    throws_naming("cuda::matmul_forward_gelu", [&] {
        cuda::matmul_forward_gelu<float>(a.data(), a.data(), b.data(), c.data(), nullptr, 2, 4, 4);
    });
    throws_naming("cuda::matmul_backward", [&] {
        cuda::matmul_backward<float>(a.data(), b.data(), nullptr, c.data(), a.data(), b.data(), -1,
                                     4, 4);
    });
    throws_naming("cuda::classifier_loss", [&] {
        cuda::classifier_loss<float>(nullptr, nullptr, a.data(), b.data(), c.data(), a.data(),
                                     t.data(), 4, 4, 8, 8, 0, 1.0f);
    });
    throws_naming("cuda::classifier_loss", [&] {
        cuda::classifier_loss<float>(nullptr, nullptr, a.data(), b.data(), c.data(), a.data(),
                                     t.data(), 4, 4, 9, 8, 2, 1.0f);
    });
    throws_naming("cuda::classifier_logits",
                  [&] { cuda::classifier_logits<float>(a.data(), b.data(), c.data(), 2, 4, 0); });
    // Nothing to do is not an error.
    cuda::matmul_forward<float>(a.data(), b.data(), c.data(), nullptr, 0, 4, 4);
}

#endif  // MEMTRAIN_HAVE_CUDA
