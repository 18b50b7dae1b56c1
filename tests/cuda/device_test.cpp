// The device layer: availability, the device memory tracker, error reporting, token buckets.
// These run on every machine; the kernel tests in the other files of tests/cuda report SKIPPED
// where no GPU answers (and run under cudasim as sim.*).
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
        EXPECT_NE(m.find("device_test.cpp:"), std::string::npos) << m;
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

#if !MEMTRAIN_HAVE_CUDA

TEST(CudaOps, NotBuiltWithCuda) {
    if (gpu_required()) {
        FAIL() << "MEMTRAIN_REQUIRE_GPU is set but memtrain was built without CUDA";
    }
    GTEST_SKIP() << "memtrain was built without CUDA (no nvcc, or -DMEMTRAIN_CUDA=OFF)";
}

#endif  // !MEMTRAIN_HAVE_CUDA
