// Reductions, elementwise helpers and casts for fp32 / bf16 / fp16 storage against host
// references.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
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

double download_double(const DeviceBuffer<double>& d) {
    return download(d)[0];
}

// ---- sums to a scalar ---------------------------------------------------------------------------
template <typename T>
void sum_squares_cases() {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{200003}}) {
        SCOPED_TRACE(testing::Message() << type_name<T>() << " n " << n);
        auto a = rounded<T>(randn((std::size_t)n, 101));
        double want = 0.0;
        for (float x : a) want += (double)x * x;
        auto d_a = upload_as<T>(a);
        DeviceBuffer<double> d_r(1, MemCategory::Other);
        cuda::sum_squares<T>(d_r.data(), d_a.data(), n);
        const double got = download_double(d_r);
        // Double accumulation in another order: ~1e-16 per addition (float would be ~1e-7).
        EXPECT_NEAR(got, want, 1e-12 * want);
        cuda::sum_squares<T>(d_r.data(), d_a.data(), n);
        EXPECT_EQ(download_double(d_r), got);  // fixed order: the same bits again
    }
    DeviceBuffer<double> d_r(1, MemCategory::Other);
    cuda::sum_squares<T>(d_r.data(), static_cast<const T*>(nullptr), 0);
    EXPECT_EQ(download_double(d_r), 0.0);
}

// ---- column sums --------------------------------------------------------------------------------
template <typename T>
void column_sum_cases() {
    for (int N : {1, 5, 130}) {
        for (int C : {33, 64}) {
            SCOPED_TRACE(testing::Message() << type_name<T>() << " N " << N << " C " << C);
            auto x = rounded<T>(randn((std::size_t)N * C, 201));
            auto dst0 = rounded<T>(randn(C, 202, 3.0f));
            std::vector<float> want(C);
            for (int c = 0; c < C; c++) {
                double s = dst0[c];
                for (int r = 0; r < N; r++) s += x[(std::size_t)r * C + c];
                want[c] = (float)s;
            }
            auto d_x = upload_as<T>(x);
            std::vector<float> first;
            for (int run = 0; run < 2; run++) {
                auto d_dst = upload_as<T>(dst0);
                cuda::column_sums_accumulate<T>(d_dst.data(), d_x.data(), N, C);
                auto got = download_float(d_dst);
                if (run == 0) {
                    // fp32 partial sums of at most 64 values (~1e-6 of sums of size ~10), then
                    // one rounding to T.
                    expect_close("column sums", got, want, 1e-4, 1.01 * unit_roundoff<T>());
                    first = got;
                } else {
                    expect_bitwise("column sums (repeat)", got, first);
                }
            }
        }
    }
}

// ---- elementwise --------------------------------------------------------------------------------
template <typename T>
void add_scale_cases() {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3001}}) {
        SCOPED_TRACE(testing::Message() << type_name<T>() << " n " << n);
        auto a = rounded<T>(randn((std::size_t)n, 301)), b = rounded<T>(randn((std::size_t)n, 302));
        auto d_a = upload_as<T>(a), d_b = upload_as<T>(b);
        // One fp32 operation and one rounding to T: the host computes the same bits.
        std::vector<float> want(a.size());
        for (std::size_t i = 0; i < a.size(); i++) {
            const float s = from_type(to_type<T>(a[i] + b[i]));
            want[i] = from_type(to_type<T>(s * 0.37f));
        }
        cuda::add_inplace<T>(d_a.data(), d_b.data(), n);
        cuda::scale_inplace<T>(d_a.data(), 0.37f, n);
        expect_bitwise("a", download_float(d_a), want);
    }
}

// Host reference of a conversion: the exact fp32 value of From, rounded once to To.
template <typename To, typename From>
void cast_pair(const std::vector<float>& values) {
    SCOPED_TRACE(testing::Message() << type_name<From>() << " -> " << type_name<To>());
    std::vector<From> src(values.size());
    for (std::size_t i = 0; i < values.size(); i++) src[i] = to_type<From>(values[i]);
    std::vector<float> want(values.size());
    for (std::size_t i = 0; i < values.size(); i++)
        want[i] = from_type(to_type<To>(from_type(src[i])));
    auto d_src = upload(src);
    DeviceBuffer<To> d_dst(values.size(), MemCategory::Other);
    cuda::cast<To, From>(d_dst.data(), d_src.data(), (int64_t)values.size());
    expect_bitwise("cast", download_float(d_dst), want);
}

template <typename From>
void cast_from(const std::vector<float>& values) {
    cast_pair<float, From>(values);
    cast_pair<__nv_bfloat16, From>(values);
    cast_pair<__half, From>(values);
}

}  // namespace

TEST(CudaReduce, SumSquares) {
    REQUIRE_GPU();
    sum_squares_cases<float>();
    sum_squares_cases<__nv_bfloat16>();
    sum_squares_cases<__half>();
}

TEST(CudaReduce, SumFloats) {
    REQUIRE_GPU();
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{777}, int64_t{150001}}) {
        SCOPED_TRACE(testing::Message() << "n " << n);
        auto a = randn((std::size_t)n + 1, 111);
        double want = 0.0;
        for (int64_t i = 0; i < n; i++) want += a[i];
        auto d_a = upload(a);
        DeviceBuffer<double> d_r(1, MemCategory::Other);
        cuda::sum_floats(d_r.data(), d_a.data(), n);
        const double got = download_double(d_r);
        EXPECT_NEAR(got, want, 1e-12 * (std::fabs(want) + n));
        cuda::sum_floats(d_r.data(), d_a.data(), n);
        EXPECT_EQ(download_double(d_r), got);
    }
}

TEST(CudaReduce, ColumnSumsAccumulate) {
    REQUIRE_GPU();
    column_sum_cases<float>();
    column_sum_cases<__nv_bfloat16>();
    column_sum_cases<__half>();
}

TEST(CudaReduce, AddAndScaleInPlace) {
    REQUIRE_GPU();
    add_scale_cases<float>();
    add_scale_cases<__nv_bfloat16>();
    add_scale_cases<__half>();
    // fp32 against the CPU kernels, which are the same single operations.
    auto a = randn(999, 121), b = randn(999, 122);
    auto d_a = upload(a), d_b = upload(b);
    cpu::add_inplace(a.data(), b.data(), 999);
    cpu::scale_inplace(a.data(), -1.7f, 999);
    cuda::add_inplace<float>(d_a.data(), d_b.data(), 999);
    cuda::scale_inplace<float>(d_a.data(), -1.7f, 999);
    expect_bitwise("fp32 vs cpu", download(d_a), a);
}

TEST(CudaReduce, CastsRoundToNearestEven) {
    REQUIRE_GPU();
    auto values = randn(3001, 131, 10.0f);
    const float ties[] = {
        1.0f + 1.0f / 256,     // fp32 -> bf16 tie: to even, 1
        1.0f + 3.0f / 256,     // fp32 -> bf16 tie: to even, 1 + 2^-6
        -(1.0f + 1.0f / 256),  // the same below zero
        1.0f + 1.0f / 2048,    // fp32 -> fp16 tie: to even, 1
        1.0f + 3.0f / 2048,    // fp32 -> fp16 tie: to even, 1 + 2^-9
        3.0f * 0x1p-25f,       // bf16 -> fp16: 1.5 subnormal units, a tie: to 2 units
        5.0f * 0x1p-26f,       // 1.25 units: rounds to 1
        70000.0f,              // beyond fp16's 65504: inf
        0.0f,
        -0.0f,
        -2.5f,
        std::numeric_limits<float>::infinity(),
    };
    for (std::size_t i = 0; i < std::size(ties); i++) values[i] = ties[i];
    cast_from<float>(values);
    cast_from<__nv_bfloat16>(values);
    cast_from<__half>(values);

    // The ties, spelled out (the host conversions above are themselves being trusted).
    auto d_x = upload(values);
    DeviceBuffer<__nv_bfloat16> d_b(values.size(), MemCategory::Other);
    DeviceBuffer<__half> d_h(values.size(), MemCategory::Other);
    cuda::cast<__nv_bfloat16, float>(d_b.data(), d_x.data(), (int64_t)values.size());
    cuda::cast<__half, float>(d_h.data(), d_x.data(), (int64_t)values.size());
    auto b = download_float(d_b), h = download_float(d_h);
    EXPECT_EQ(b[0], 1.0f);
    EXPECT_EQ(b[1], 1.0f + 1.0f / 64);
    EXPECT_EQ(b[2], -1.0f);
    EXPECT_EQ(h[3], 1.0f);
    EXPECT_EQ(h[4], 1.0f + 1.0f / 512);
    EXPECT_EQ(h[7], std::numeric_limits<float>::infinity());
    // fp32 -> bf16 against the independent bit-level rounding of cuda_test_util.h.
    std::vector<__nv_bfloat16> braw(values.size());
    device_synchronize();
    copy_to_host(braw.data(), d_b.data(), d_b.bytes());
    std::vector<uint16_t> bits(values.size());
    std::memcpy(bits.data(), braw.data(), bits.size() * 2);
    for (std::size_t i = 0; i < values.size(); i++) {
        if (std::isinf(values[i])) continue;  // bf16_bits handles finite inputs
        ASSERT_EQ(bits[i], bf16_bits(values[i])) << "value " << values[i];
    }
    // bf16 -> fp16 of the subnormal ties.
    DeviceBuffer<__half> d_bh(values.size(), MemCategory::Other);
    cuda::cast<__half, __nv_bfloat16>(d_bh.data(), d_b.data(), (int64_t)values.size());
    auto bh = download_float(d_bh);
    EXPECT_EQ(bh[5], 2.0f * 0x1p-24f);
    EXPECT_EQ(bh[6], 0x1p-24f);
}

TEST(CudaReduce, BadSizesNameTheOp) {
    REQUIRE_GPU();
    DeviceBuffer<float> a(8, MemCategory::Other);
    DeviceBuffer<double> r(1, MemCategory::Other);
    auto throws_naming = [](const char* op, auto&& f) {
        try {
            f();
            ADD_FAILURE() << op << ": no error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
        }
    };
    throws_naming("cuda::sum_squares", [&] { cuda::sum_squares<float>(r.data(), a.data(), -1); });
    throws_naming("cuda::sum_floats", [&] { cuda::sum_floats(nullptr, a.data(), 4); });
    throws_naming("cuda::cast", [&] { cuda::cast<__half, float>(nullptr, a.data(), -2); });
    throws_naming("cuda::column_sums_accumulate",
                  [&] { cuda::column_sums_accumulate<float>(a.data(), a.data(), -1, 4); });
    throws_naming("cuda::add_inplace", [&] { cuda::add_inplace<float>(a.data(), a.data(), -1); });
}

#endif  // MEMTRAIN_HAVE_CUDA
