// Fused causal grouped-query attention (reference and tensor-core kernels) against the CPU, and
// the tensor-core primitives it runs on (kernels/cuda/mma.cuh) against host products.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cpu/ops.h"

#if MEMTRAIN_HAVE_CUDA
#include "cuda/mma_test_kernels.h"
#include "kernels/cuda/ops.h"
#endif

using namespace memtrain;
using namespace memtrain::test;

#if MEMTRAIN_HAVE_CUDA

namespace {

struct Shape {
    int B, T, NH, NKV, hs;
    int C() const { return NH * hs; }
    int QKV() const { return C() + 2 * NKV * hs; }
};

std::string describe(const Shape& s) {
    return "B " + std::to_string(s.B) + " T " + std::to_string(s.T) + " NH " +
           std::to_string(s.NH) + " NKV " + std::to_string(s.NKV) + " hs " + std::to_string(s.hs);
}

// Every case: T in {1, 7, 64, 130} (none but 64 a multiple of the 64-row tiles), B in {1, 2},
// NH / NKV in {2/2, 4/2, 4/1}. Head sizes 64 and 128 run on both paths, 8 on the reference only.
const std::vector<Shape> kTensorCoreShapes = {
    {1, 1, 2, 2, 64},   {2, 7, 4, 2, 64},    {1, 64, 4, 1, 128},
    {2, 130, 4, 2, 64}, {1, 130, 2, 2, 128}, {2, 7, 4, 1, 128},
};
const std::vector<Shape> kSmallHeadShapes = {
    {1, 1, 4, 2, 8},
    {2, 7, 2, 2, 8},
    {2, 130, 4, 1, 8},
};

struct Result {
    std::vector<float> out, lse, dqkv;
};

// The CPU kernels on the (already T-rounded) inputs; lse in double from q and k.
Result cpu_reference(const Shape& s, const std::vector<float>& qkv,
                     const std::vector<float>& dout) {
    const int C = s.C(), QKV = s.QKV(), group = s.NH / s.NKV;
    Result r;
    r.out.resize((std::size_t)s.B * s.T * C);
    r.dqkv.resize(qkv.size());
    std::vector<float> att((std::size_t)s.B * s.NH * s.T * s.T);
    cpu::attention_forward(r.out.data(), att.data(), qkv.data(), s.B, s.T, C, s.NH, s.NKV);
    cpu::attention_backward(r.dqkv.data(), dout.data(), qkv.data(), att.data(), s.B, s.T, C, s.NH,
                            s.NKV);
    r.lse.resize((std::size_t)s.B * s.NH * s.T);
    const double scale = 1.0 / std::sqrt((double)s.hs);
    for (int b = 0; b < s.B; b++) {
        for (int h = 0; h < s.NH; h++) {
            for (int i = 0; i < s.T; i++) {
                const float* q = qkv.data() + ((std::size_t)b * s.T + i) * QKV + h * s.hs;
                std::vector<double> sc(i + 1);
                double mx = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    const float* k =
                        qkv.data() + ((std::size_t)b * s.T + j) * QKV + C + (h / group) * s.hs;
                    double dot = 0.0;
                    for (int x = 0; x < s.hs; x++) dot += (double)q[x] * k[x];
                    sc[j] = dot * scale;
                    mx = std::max(mx, sc[j]);
                }
                double sum = 0.0;
                for (double v : sc) sum += std::exp(v - mx);
                r.lse[((std::size_t)b * s.NH + h) * s.T + i] = (float)(mx + std::log(sum));
            }
        }
    }
    return r;
}

enum class Path { Dispatch, Reference, TensorCore };

// Forward then backward (on the device's own out and lse) on one path. `offset` > 0 places every
// E array that many elements past its allocation's start, so that it is not 16-byte aligned.
template <typename E>
Result run_device(const Shape& s, Path path, const std::vector<float>& qkv,
                  const std::vector<float>& dout, int offset = 0) {
    const int C = s.C();
    auto padded = [&](const std::vector<float>& v) {
        std::vector<float> p((std::size_t)offset, 0.0f);
        p.insert(p.end(), v.begin(), v.end());
        return upload_as<E>(p);
    };
    auto d_qkv = padded(qkv), d_dout = padded(dout);
    DeviceBuffer<E> d_out(offset + (std::size_t)s.B * s.T * C, MemCategory::Activations);
    // NaN-filled: everything the kernels must write is checked.
    DeviceBuffer<E> d_dqkv(offset + qkv.size(), MemCategory::Activations);
    DeviceBuffer<float> d_lse((std::size_t)s.B * s.NH * s.T, MemCategory::Activations);
    DeviceBuffer<float> d_delta(d_lse.size(), MemCategory::Activations);
    E *out = d_out.data() + offset, *dqkv = d_dqkv.data() + offset;
    const E *x = d_qkv.data() + offset, *g = d_dout.data() + offset;
    if (path == Path::Dispatch) {
        cuda::attention_forward(out, d_lse.data(), x, s.B, s.T, C, s.NH, s.NKV);
        cuda::attention_backward(dqkv, d_delta.data(), g, x, out, d_lse.data(), s.B, s.T, C, s.NH,
                                 s.NKV);
    } else if (path == Path::Reference) {
        cuda::attention_forward_reference(out, d_lse.data(), x, s.B, s.T, C, s.NH, s.NKV);
        cuda::attention_backward_reference(dqkv, d_delta.data(), g, x, out, d_lse.data(), s.B, s.T,
                                           C, s.NH, s.NKV);
    } else {
        if constexpr (std::is_same_v<E, float>) {
            ADD_FAILURE() << "no fp32 tensor-core path";
        } else {
            cuda::attention_forward_tensor_core(out, d_lse.data(), x, s.B, s.T, C, s.NH, s.NKV);
            cuda::attention_backward_tensor_core(dqkv, d_delta.data(), g, x, out, d_lse.data(), s.B,
                                                 s.T, C, s.NH, s.NKV);
        }
    }
    auto unpadded = [&](const DeviceBuffer<E>& d) {
        std::vector<float> v = download_float(d);
        v.erase(v.begin(), v.begin() + offset);
        return v;
    };
    return {unpadded(d_out), download(d_lse), unpadded(d_dqkv)};
}

// Columns [c0, c0 + width) of every row of a (rows, ld) matrix.
std::vector<float> columns(const std::vector<float>& m, int ld, int c0, int width) {
    const std::size_t rows = m.size() / ld;
    std::vector<float> r(rows * width);
    for (std::size_t i = 0; i < rows; i++) {
        std::copy_n(m.begin() + (std::ptrdiff_t)(i * ld + c0), width,
                    r.begin() + (std::ptrdiff_t)(i * width));
    }
    return r;
}

float max_abs(const std::vector<float>& v) {
    float m = 0.0f;
    for (float x : v) m = std::max(m, std::fabs(x));
    return m;
}

// Tolerances for one comparison, per tensor: atol_scale * max|want| + atol, and rtol * |want|.
struct Tolerance {
    double atol_scale, atol, rtol;
};

void compare(const std::string& what, const Shape& s, const Result& got, const Result& want,
             Tolerance out_tol, Tolerance lse_tol, Tolerance grad_tol) {
    auto check = [&](const std::string& name, const std::vector<float>& g,
                     const std::vector<float>& w, Tolerance t) {
        expect_close(what + " " + name, g, w, t.atol + t.atol_scale * max_abs(w), t.rtol);
    };
    check("out", got.out, want.out, out_tol);
    check("lse", got.lse, want.lse, lse_tol);
    const int C = s.C(), QKV = s.QKV(), kvw = s.NKV * s.hs;
    check("dq", columns(got.dqkv, QKV, 0, C), columns(want.dqkv, QKV, 0, C), grad_tol);
    check("dk", columns(got.dqkv, QKV, C, kvw), columns(want.dqkv, QKV, C, kvw), grad_tol);
    check("dv", columns(got.dqkv, QKV, C + kvw, kvw), columns(want.dqkv, QKV, C + kvw, kvw),
          grad_tol);
}

// Unit roundoff of the storage type (half an ulp at 1).
template <typename E>
double roundoff() {
    if constexpr (std::is_same_v<E, float>)
        return 0x1p-24;
    else if constexpr (std::is_same_v<E, __nv_bfloat16>)
        return 0x1p-8;
    else
        return 0x1p-11;
}

// Inputs: scores scale * q.k of spread about 1 (q, k ~ N(0, 1)), so the softmax is neither
// uniform nor one-hot; seeds differ per shape.
struct Inputs {
    std::vector<float> qkv, dout;
};
template <typename E>
Inputs make_inputs(const Shape& s, uint64_t seed) {
    return {rounded<E>(randn((std::size_t)s.B * s.T * s.QKV(), seed)),
            rounded<E>(randn((std::size_t)s.B * s.T * s.C(), seed + 1))};
}

// Storage types E: fp32 runs in fp32 end to end, so it matches the CPU to fp32 roundoff; bf16 /
// fp16 outputs are rounded to E once at the end, and the tensor-core kernels also round P and dS
// to E as mma operands (FlashAttention-2 does the same).
template <typename E>
Tolerance output_tolerance() {
    if constexpr (std::is_same_v<E, float>) {
        // Different summation orders over <= 130 keys and expf vs std::exp: measured <= 7 ulps
        // (4e-7) of the largest output.
        return {1e-6, 1e-6, 1e-5};
    } else {
        // One rounding of the output (u |out|) plus P rounded to E inside the sum (at most u times
        // sum_j p_j |v_j| <= u max|v|, and |out| is of the order of max|v| here). Measured <= 0.9u
        // of the largest output; allowed 4u.
        return {4 * roundoff<E>(), 0.0, roundoff<E>()};
    }
}
// lse is fp32 from E-exact inputs on every path: fp32 dot products and exp / log roundoff.
Tolerance lse_tolerance() {
    return {0.0, 1e-5, 2e-6};
}
template <typename E>
Tolerance grad_tolerance() {
    // Where a row has a single key (T = 1) dq and dk are exactly 0, and dP - delta cancels to the
    // fp32 roundoff of two dot products of hs terms (measured <= 1e-6): no relative tolerance
    // covers that, an absolute 1e-5 does.
    if constexpr (std::is_same_v<E, float>) {
        // Sums of up to 130 * group terms of either sign in different orders (the CPU forms
        // d(att) per row, then dpre; the kernels recompute p from lse): measured <= 2e-6 of the
        // largest gradient.
        return {1e-5, 1e-5, 1e-4};
    } else {
        // One rounding of the result, plus the inputs to the backward that carry E's roundoff:
        // out (through delta = rowsum(dout * out)) and, on the tensor cores, P and dS rounded to
        // E; all are relative u errors inside sums with cancellation (sum_j dS_ij = 0), so they
        // are bounded by the scale of the gradient tensor rather than by each element. Measured
        // <= 1.4u of the largest gradient; allowed 4u.
        return {4 * roundoff<E>(), 1e-5, roundoff<E>()};
    }
}

template <typename E>
void reference_matches_cpu() {
    SCOPED_TRACE(type_name<E>());
    std::vector<Shape> shapes = kTensorCoreShapes;
    shapes.insert(shapes.end(), kSmallHeadShapes.begin(), kSmallHeadShapes.end());
    uint64_t seed = 100;
    for (const Shape& s : shapes) {
        SCOPED_TRACE(describe(s));
        const Inputs in = make_inputs<E>(s, seed += 2);
        const Result want = cpu_reference(s, in.qkv, in.dout);
        const Result got = run_device<E>(s, Path::Reference, in.qkv, in.dout);
        compare("reference", s, got, want, output_tolerance<E>(), lse_tolerance(),
                grad_tolerance<E>());
    }
}

template <typename E>
void tensor_core_matches_cpu_and_reference() {
    SCOPED_TRACE(type_name<E>());
    uint64_t seed = 200;
    for (const Shape& s : kTensorCoreShapes) {
        SCOPED_TRACE(describe(s));
        const Inputs in = make_inputs<E>(s, seed += 2);
        const Result want = cpu_reference(s, in.qkv, in.dout);
        const Result got = run_device<E>(s, Path::TensorCore, in.qkv, in.dout);
        compare("tensor core vs cpu", s, got, want, output_tolerance<E>(), lse_tolerance(),
                grad_tolerance<E>());
        // Both E-rounded: the two paths' errors against the exact result add up.
        const Result ref = run_device<E>(s, Path::Reference, in.qkv, in.dout);
        auto twice = [](Tolerance t) {
            return Tolerance{2 * t.atol_scale, 2 * t.atol, 2 * t.rtol};
        };
        compare("tensor core vs reference", s, got, ref, twice(output_tolerance<E>()),
                twice(lse_tolerance()), twice(grad_tolerance<E>()));
    }
}

void expect_same_bits(const std::string& what, const Result& a, const Result& b) {
    expect_bitwise(what + " out", a.out, b.out);
    expect_bitwise(what + " lse", a.lse, b.lse);
    expect_bitwise(what + " dqkv", a.dqkv, b.dqkv);
}

}  // namespace

// ---- the tensor-core primitives -----------------------------------------------------------------

// Small integers in E: every product and sum is exact in fp32, so any correct mma gives the host
// product bit for bit whatever its internal order.
template <typename E>
static void mma_direct_matches_host() {
    SCOPED_TRACE(type_name<E>());
    std::vector<float> a(16 * 16), b(16 * 8), c(16 * 8);
    for (int i = 0; i < 16 * 16; i++) a[i] = (float)((i * 7) % 11 - 5);
    for (int i = 0; i < 16 * 8; i++) b[i] = (float)((i * 5) % 9 - 4);
    for (int i = 0; i < 16 * 8; i++) c[i] = (float)(i % 13) * 0.5f;
    std::vector<float> want(16 * 8);
    for (int r = 0; r < 16; r++) {
        for (int n = 0; n < 8; n++) {
            float s = c[r * 8 + n];
            for (int k = 0; k < 16; k++) s += a[r * 16 + k] * b[k * 8 + n];
            want[r * 8 + n] = s;
        }
    }
    auto d_a = upload_as<E>(a), d_b = upload_as<E>(b);
    auto d_c = upload(c);
    DeviceBuffer<float> d_d(16 * 8, MemCategory::Other);
    mma_test::mma_direct(d_d.data(), d_a.data(), d_b.data(), d_c.data());
    expect_bitwise("d", download(d_d), want);
}

TEST(CudaMma, FragmentLayoutsGiveTheHostProduct) {
    REQUIRE_GPU();
    mma_direct_matches_host<__nv_bfloat16>();
    mma_direct_matches_host<__half>();
}

TEST(CudaMma, LdmatrixDealsRowsAndColumnsAsDocumented) {
    REQUIRE_GPU();
    std::vector<uint16_t> m(16 * 16);
    for (int i = 0; i < 256; i++)
        m[i] = (uint16_t)(0x1000 + i);  // element (r, c) = 0x1000 + 16r + c
    auto d_m = upload(m);
    DeviceBuffer<uint32_t> d_plain(128, MemCategory::Other), d_trans(128, MemCategory::Other);
    mma_test::ldmatrix_fragments(d_plain.data(), d_trans.data(), d_m.data());
    const auto plain = download(d_plain), trans = download(d_trans);
    auto at = [&](int r, int c) { return (uint32_t)m[r * 16 + c]; };
    int bad = 0;
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 4; i++) {
            const int r0 = (i % 2) * 8, c0 = (i / 2) * 8;
            // Plain: row lane / 4, columns 2 (lane % 4) and + 1; trans: rows 2 (lane % 4) and
            // + 1 of column lane / 4. The lower-numbered element sits in the low half.
            const uint32_t p = at(r0 + lane / 4, c0 + 2 * (lane % 4)) |
                               at(r0 + lane / 4, c0 + 2 * (lane % 4) + 1) << 16;
            const uint32_t t = at(r0 + 2 * (lane % 4), c0 + lane / 4) |
                               at(r0 + 2 * (lane % 4) + 1, c0 + lane / 4) << 16;
            if (plain[lane * 4 + i] != p || trans[lane * 4 + i] != t) bad++;
            EXPECT_EQ(plain[lane * 4 + i], p) << "lane " << lane << " matrix " << i;
            EXPECT_EQ(trans[lane * 4 + i], t) << "lane " << lane << " matrix " << i << " (trans)";
            if (bad > 8) return;
        }
    }
}

template <typename E>
static void mma_via_ldmatrix_matches_host() {
    SCOPED_TRACE(type_name<E>());
    std::vector<float> a(256), b_nk(256), b_kn(256);
    for (int i = 0; i < 256; i++) {
        a[i] = (float)((i * 7) % 9 - 4);
        b_nk[i] = (float)((i * 3) % 7 - 3);
        b_kn[i] = (float)((i * 5) % 11 - 5);
    }
    std::vector<float> want_nk(256), want_kn(256);
    for (int r = 0; r < 16; r++) {
        for (int n = 0; n < 16; n++) {
            float s1 = 0.0f, s2 = 0.0f;
            for (int k = 0; k < 16; k++) {
                s1 += a[r * 16 + k] * b_nk[n * 16 + k];
                s2 += a[r * 16 + k] * b_kn[k * 16 + n];
            }
            want_nk[r * 16 + n] = s1;
            want_kn[r * 16 + n] = s2;
        }
    }
    auto d_a = upload_as<E>(a), d_bnk = upload_as<E>(b_nk), d_bkn = upload_as<E>(b_kn);
    DeviceBuffer<float> d_nk(256, MemCategory::Other), d_kn(256, MemCategory::Other);
    mma_test::mma_via_ldmatrix(d_nk.data(), d_kn.data(), d_a.data(), d_bnk.data(), d_bkn.data());
    expect_bitwise("a * b_nk^T", download(d_nk), want_nk);
    expect_bitwise("a * b_kn", download(d_kn), want_kn);
}

TEST(CudaMma, LdmatrixOperandsGiveTheHostProduct) {
    REQUIRE_GPU();
    mma_via_ldmatrix_matches_host<__nv_bfloat16>();
    mma_via_ldmatrix_matches_host<__half>();
}

// ---- attention ---------------------------------------------------------------------------------

TEST(CudaAttention, ReferenceMatchesCpu) {
    REQUIRE_GPU();
    reference_matches_cpu<float>();
    reference_matches_cpu<__nv_bfloat16>();
    reference_matches_cpu<__half>();
}

TEST(CudaAttention, TensorCoreMatchesCpuAndReference) {
    REQUIRE_GPU();
    tensor_core_matches_cpu_and_reference<__nv_bfloat16>();
    tensor_core_matches_cpu_and_reference<__half>();
}

TEST(CudaAttention, DispatchPicksTensorCoresForBf16Fp16AtHeadSizes64And128) {
    REQUIRE_GPU();
    const Shape tc{2, 7, 4, 2, 64}, small{2, 7, 4, 2, 8};
    {
        const Inputs in = make_inputs<__nv_bfloat16>(tc, 300);
        expect_same_bits("bf16 hs 64",
                         run_device<__nv_bfloat16>(tc, Path::Dispatch, in.qkv, in.dout),
                         run_device<__nv_bfloat16>(tc, Path::TensorCore, in.qkv, in.dout));
    }
    {
        const Inputs in = make_inputs<__half>(small, 302);
        expect_same_bits("fp16 hs 8", run_device<__half>(small, Path::Dispatch, in.qkv, in.dout),
                         run_device<__half>(small, Path::Reference, in.qkv, in.dout));
    }
    {
        const Inputs in = make_inputs<float>(tc, 304);
        expect_same_bits("fp32 hs 64", run_device<float>(tc, Path::Dispatch, in.qkv, in.dout),
                         run_device<float>(tc, Path::Reference, in.qkv, in.dout));
    }
}

TEST(CudaAttention, RepeatsBitForBit) {
    REQUIRE_GPU();
    const Shape s{2, 130, 4, 2, 64};
    {
        const Inputs in = make_inputs<__nv_bfloat16>(s, 400);
        expect_same_bits("bf16 tensor core",
                         run_device<__nv_bfloat16>(s, Path::TensorCore, in.qkv, in.dout),
                         run_device<__nv_bfloat16>(s, Path::TensorCore, in.qkv, in.dout));
    }
    {
        const Inputs in = make_inputs<float>(s, 402);
        expect_same_bits("fp32 reference", run_device<float>(s, Path::Reference, in.qkv, in.dout),
                         run_device<float>(s, Path::Reference, in.qkv, in.dout));
    }
}

// Arrays that are not 16-byte aligned take the element-wise loads and stores of the tensor-core
// kernels; the arithmetic is the same, so are the bits.
TEST(CudaAttention, UnalignedArraysGiveTheSameBits) {
    REQUIRE_GPU();
    const Shape s{1, 70, 4, 2, 64};
    const Inputs in = make_inputs<__half>(s, 500);
    expect_same_bits("fp16 tensor core, offset 1",
                     run_device<__half>(s, Path::TensorCore, in.qkv, in.dout, 1),
                     run_device<__half>(s, Path::TensorCore, in.qkv, in.dout));
}

// A bad size fails before any launch, with a memtrain::Error naming the entry.
static void expect_error(const std::string& op, const std::function<void()>& call) {
    try {
        call();
        ADD_FAILURE() << op << ": no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("cuda::" + op), std::string::npos) << e.what();
    }
}

TEST(CudaAttention, RejectsBadShapes) {
    REQUIRE_GPU();
    // Never dereferenced: validation comes first.
    float* f = nullptr;
    __nv_bfloat16* h = nullptr;
    const float* cf = nullptr;
    // hs = 520 / 2 = 260 > 256.
    expect_error("attention_forward", [&] { cuda::attention_forward(f, f, cf, 1, 4, 520, 2, 2); });
    expect_error("attention_forward_reference",
                 [&] { cuda::attention_forward_reference(h, f, h, 1, 4, 520, 2, 2); });
    expect_error("attention_backward",
                 [&] { cuda::attention_backward(h, f, h, h, h, cf, 1, 4, 520, 2, 2); });
    // C % NH != 0, NH % NKV != 0, non-positive sizes.
    expect_error("attention_forward", [&] { cuda::attention_forward(f, f, cf, 1, 4, 130, 4, 4); });
    expect_error("attention_backward_reference", [&] {
        cuda::attention_backward_reference(f, f, cf, cf, cf, cf, 1, 4, 128, 4, 3);
    });
    expect_error("attention_forward", [&] { cuda::attention_forward(f, f, cf, 1, 0, 128, 2, 2); });
    // The tensor-core kernels exist for hs 64 and 128 only.
    expect_error("attention_forward_tensor_core",
                 [&] { cuda::attention_forward_tensor_core(h, f, h, 1, 4, 64, 2, 2); });
    expect_error("attention_backward_tensor_core",
                 [&] { cuda::attention_backward_tensor_core(h, f, h, h, h, cf, 1, 4, 512, 2, 2); });
}

#endif  // MEMTRAIN_HAVE_CUDA
