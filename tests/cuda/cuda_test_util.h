// Helpers of the CUDA tests: skipping without a GPU (failing instead under
// MEMTRAIN_REQUIRE_GPU=1), random inputs, uploads and downloads, tolerance and bitwise checks,
// and bf16 bit helpers. Shared by the GPU build (tests report SKIPPED without a device) and the
// cudasim build (tests run on the simulator).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "test_util.h"

#if MEMTRAIN_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/host_convert.h"
#endif

namespace memtrain::test {

inline bool gpu_required() {
    const char* v = std::getenv("MEMTRAIN_REQUIRE_GPU");
    return v && std::string(v) == "1";
}

}  // namespace memtrain::test

// Skips where no GPU answers, except under MEMTRAIN_REQUIRE_GPU=1 (bench/gpu_device.sh sets it),
// where a missing device is a failure: on the GPU machine a skipped kernel test must not read as a
// pass.
#define REQUIRE_GPU()                                                       \
    do {                                                                    \
        if (!::memtrain::cuda_available()) {                                \
            if (::memtrain::test::gpu_required()) {                         \
                FAIL() << "MEMTRAIN_REQUIRE_GPU is set but no CUDA device"; \
            }                                                               \
            GTEST_SKIP() << "no CUDA device";                               \
        }                                                                   \
    } while (0)

#if MEMTRAIN_HAVE_CUDA
namespace memtrain::test {

inline std::vector<float> randn(std::size_t n, uint64_t seed, float scale = 1.0f) {
    Rng r(seed);
    std::vector<float> v(n);
    for (auto& x : v) x = (float)r.normal() * scale;
    return v;
}

inline std::vector<int32_t> random_ids(std::size_t n, int vocab, uint64_t seed) {
    Rng r(seed);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = (int32_t)(r.next_u64() % (uint64_t)vocab);
    return v;
}

template <typename T>
DeviceBuffer<T> upload(const std::vector<T>& h) {
    DeviceBuffer<T> d(h.size(), MemCategory::Other);
    copy_to_device(d.data(), h.data(), d.bytes());
    return d;
}

template <typename T>
std::vector<T> download(const DeviceBuffer<T>& d) {
    std::vector<T> h(d.size());
    device_synchronize();
    copy_to_host(h.data(), d.data(), d.bytes());
    return h;
}

// Every element within atol + rtol * |want|; reports the count and the worst element once.
inline void expect_close(const std::string& what, const std::vector<float>& got,
                         const std::vector<float>& want, double atol, double rtol) {
    ASSERT_EQ(got.size(), want.size()) << what;
    ASSERT_FALSE(want.empty()) << what;
    std::size_t bad = 0, worst = 0;
    double worst_excess = -1.0;
    for (std::size_t i = 0; i < got.size(); i++) {
        double err = std::fabs((double)got[i] - (double)want[i]);
        double tol = atol + rtol * std::fabs((double)want[i]);
        if (!(err <= tol)) {
            bad++;
            double excess = std::isnan(err) ? 1e300 : err - tol;
            if (excess > worst_excess) {
                worst_excess = excess;
                worst = i;
            }
        }
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements outside atol "
                       << atol << " rtol " << rtol << "; worst [" << worst << "]: got "
                       << got[worst] << ", want " << want[worst];
}

inline void expect_bitwise(const std::string& what, const std::vector<float>& got,
                           const std::vector<float>& want) {
    ASSERT_EQ(got.size(), want.size()) << what;
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < got.size(); i++) {
        if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                       << " elements differ in bits; first [" << first << "]: got " << got[first]
                       << ", want " << want[first];
}

// fp32 -> bf16 bits, round to nearest even (finite inputs).
inline uint16_t bf16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
// ---- any storage type T in {float, __nv_bfloat16, __half} --------------------------------------
template <typename T>
inline T to_type(float x) {
    return cuda::to_storage<T>(x);
}
template <typename T>
inline float from_type(T x) {
    return cuda::to_fp32(x);
}
// The values T can hold nearest to v (round to nearest even): what a CPU reference should be fed
// so that it sees exactly the inputs the T kernel sees.
template <typename T>
inline std::vector<float> rounded(const std::vector<float>& v) {
    std::vector<float> r(v.size());
    for (std::size_t i = 0; i < v.size(); i++) r[i] = from_type(to_type<T>(v[i]));
    return r;
}
// Uploads v converted to T; downloads a T buffer as floats.
template <typename T>
inline DeviceBuffer<T> upload_as(const std::vector<float>& v) {
    std::vector<T> h(v.size());
    for (std::size_t i = 0; i < v.size(); i++) h[i] = to_type<T>(v[i]);
    return upload(h);
}
template <typename T>
inline std::vector<float> download_float(const DeviceBuffer<T>& d) {
    std::vector<T> h = download(d);
    std::vector<float> r(h.size());
    for (std::size_t i = 0; i < h.size(); i++) r[i] = from_type(h[i]);
    return r;
}
// A short name for test messages.
template <typename T>
inline const char* type_name() {
    return cuda::precision_name<T>();
}
// Unit roundoff of T: half the distance from 1 to the next value (bf16 keeps 8 significant bits,
// fp16 11).
template <typename T>
inline double unit_roundoff() {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return 1.0 / 256;
    else if constexpr (std::is_same_v<T, __half>)
        return 1.0 / 2048;
    else
        return 1.0 / (1 << 24);
}

}  // namespace memtrain::test
#endif
