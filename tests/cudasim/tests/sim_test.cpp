// cudasim's own checks (tests/cudasim, linked into memtrain_sim_tests only): what a GPU would hang
// on or corrupt is reported, and streams keep CUDA's meaning: work runs only when a
// synchronisation needs it, in an order the seed draws among those CUDA allows, so code that
// leaves out an event wait reads stale data under some seed.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <vector>

#include "core/device.h"
#include "cuda/cuda_test_util.h"
#include "cuda/semantics_kernels.h"
#include "cudasim/sim.h"

using namespace memtrain;
using namespace memtrain::test;

namespace {

float read(const float* d) {
    float h = 0;
    MT_CUDA_CHECK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    return h;
}

cudaStream_t non_blocking() {
    cudaStream_t s = nullptr;
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
}

// Restores the interleaving seed the process started with.
struct SeedGuard {
    uint64_t seed = cudasim::seed();
    ~SeedGuard() { cudasim::set_seed(seed); }
};

}  // namespace

// ---- the simulator's own checks (on a GPU these would hang or corrupt memory) ------------------

TEST(CudaSim, DivergentBarrierIsReportedAsDeadlock) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    DeviceBuffer<int> d(32, MemCategory::Other);
    // (The kernel runs when something waits for it.)
    EXPECT_DEATH(
        {
            semantics::divergent_barrier(d.data());
            cudaDeviceSynchronize();
        },
        "cudasim: deadlock in kernel divergent_kernel, block \\(0,0,0\\): 1 threads "
        "wait at __syncthreads, 31 at a warp collective");
}

TEST(CudaSim, CopiesCheckDevicePointers) {
    std::vector<float> host(8), other(8);
    void* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, 32), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host.data(), 32, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(other.data(), host.data(), 32, cudaMemcpyHostToDevice),
              cudaErrorInvalidValue);
    EXPECT_EQ(cudaMemcpy(host.data(), d, 36, cudaMemcpyDeviceToHost), cudaErrorInvalidValue)
        << "a copy past the end of the allocation";
    cudaGetLastError();
    ASSERT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaSim, DeviceMemoryStartsUndefined) {
    void* p = nullptr;
    ASSERT_EQ(cudaMalloc(&p, 16), cudaSuccess);
    std::vector<float> h(4);
    ASSERT_EQ(cudaMemcpy(h.data(), p, 16, cudaMemcpyDeviceToHost), cudaSuccess);
    for (float x : h) EXPECT_TRUE(std::isnan(x));
    ASSERT_EQ(cudaFree(p), cudaSuccess);
}

// ---- streams ---------------------------------------------------------------------------------

// A synchronous copy runs on the legacy stream, which does not wait for a non-blocking stream:
// the increment queued there has not run (nothing needed it) until the stream is synchronised.
TEST(CudaSimStreams, WorkRunsWhenASynchronisationNeedsIt) {
    DeviceBuffer<float> x(1, MemCategory::Other);
    cudaStream_t s = non_blocking();
    semantics::increment(x.data(), 1, s);
    EXPECT_EQ(read(x.data()), 0.0f) << "a non-blocking stream's work ran before anything waited";
    MT_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_EQ(read(x.data()), 1.0f);
    MT_CUDA_CHECK(cudaStreamDestroy(s));
}

// Streams created without cudaStreamNonBlocking and the legacy stream wait for each other.
TEST(CudaSimStreams, BlockingStreamsSynchroniseWithTheLegacyStream) {
    DeviceBuffer<float> x(1, MemCategory::Other);
    cudaStream_t s = nullptr;
    MT_CUDA_CHECK(cudaStreamCreate(&s));
    semantics::increment(x.data(), 1, s);
    EXPECT_EQ(read(x.data()), 1.0f);
    MT_CUDA_CHECK(cudaStreamDestroy(s));
}

// x += 1 on one stream, then y = x on another: with the event wait every seed copies 1; without
// it, some seed copies before the increment has run.
TEST(CudaSimStreams, AnEventWaitOrdersTwoStreamsUnderEverySeed) {
    SeedGuard guard;
    int stale = 0;
    for (uint64_t seed = 1; seed <= 8; seed++) {
        cudasim::set_seed(seed);
        for (bool wait : {true, false}) {
            DeviceBuffer<float> x(1, MemCategory::Other), y(1, MemCategory::Other);
            cudaStream_t a = non_blocking(), b = non_blocking();
            cudaEvent_t e = nullptr;
            MT_CUDA_CHECK(cudaEventCreate(&e));
            semantics::increment(x.data(), 1, a);
            MT_CUDA_CHECK(cudaEventRecord(e, a));
            if (wait) MT_CUDA_CHECK(cudaStreamWaitEvent(b, e, 0));
            MT_CUDA_CHECK(
                cudaMemcpyAsync(y.data(), x.data(), sizeof(float), cudaMemcpyDeviceToDevice, b));
            MT_CUDA_CHECK(cudaDeviceSynchronize());
            if (wait)
                EXPECT_EQ(read(y.data()), 1.0f) << "seed " << seed;
            else
                stale += read(y.data()) == 0.0f;
            MT_CUDA_CHECK(cudaEventDestroy(e));
            MT_CUDA_CHECK(cudaStreamDestroy(a));
            MT_CUDA_CHECK(cudaStreamDestroy(b));
        }
    }
    EXPECT_GT(stale, 0) << "no seed ran the copy before the increment it did not wait for";
    EXPECT_LT(stale, 8) << "no seed ran the increment first";
}

// A wait is on the record made before it: work queued on the stream after the record is not
// waited for (here it never runs before the wait's consumer, since nothing needs it).
TEST(CudaSimStreams, AWaitIsOnTheRecordBeforeIt) {
    DeviceBuffer<float> x(1, MemCategory::Other), y(1, MemCategory::Other);
    cudaStream_t a = non_blocking(), b = non_blocking();
    cudaEvent_t e = nullptr;
    MT_CUDA_CHECK(cudaEventCreate(&e));
    semantics::increment(x.data(), 1, a);
    MT_CUDA_CHECK(cudaEventRecord(e, a));
    MT_CUDA_CHECK(cudaStreamWaitEvent(b, e, 0));
    semantics::increment(x.data(), 1, a);
    MT_CUDA_CHECK(cudaMemcpyAsync(y.data(), x.data(), sizeof(float), cudaMemcpyDeviceToDevice, b));
    MT_CUDA_CHECK(cudaStreamSynchronize(b));
    EXPECT_EQ(read(y.data()), 1.0f);
    MT_CUDA_CHECK(cudaEventSynchronize(e));
    EXPECT_EQ(read(x.data()), 1.0f) << "the event does not cover the second increment";
    MT_CUDA_CHECK(cudaStreamSynchronize(a));
    EXPECT_EQ(read(x.data()), 2.0f);
    MT_CUDA_CHECK(cudaEventDestroy(e));
    MT_CUDA_CHECK(cudaStreamDestroy(a));
    MT_CUDA_CHECK(cudaStreamDestroy(b));
}

// An asynchronous copy from pinned memory reads it when the stream runs the copy, so the host
// must not overwrite it before an event says so; from pageable memory it is staged at the call.
TEST(CudaSimStreams, AsyncCopiesReadHostMemoryWhenCudaDoes) {
    DeviceBuffer<float> pinned_dst(1, MemCategory::Other), pageable_dst(1, MemCategory::Other);
    float* pinned = nullptr;
    MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(float)));
    float pageable = 1.0f;
    *pinned = 1.0f;
    cudaStream_t s = non_blocking();
    MT_CUDA_CHECK(
        cudaMemcpyAsync(pinned_dst.data(), pinned, sizeof(float), cudaMemcpyHostToDevice, s));
    MT_CUDA_CHECK(
        cudaMemcpyAsync(pageable_dst.data(), &pageable, sizeof(float), cudaMemcpyHostToDevice, s));
    *pinned = 2.0f;
    pageable = 2.0f;
    MT_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_EQ(read(pinned_dst.data()), 2.0f) << "the copy read pinned memory at the call";
    EXPECT_EQ(read(pageable_dst.data()), 1.0f) << "pageable memory was not staged at the call";
    MT_CUDA_CHECK(cudaStreamDestroy(s));
    MT_CUDA_CHECK(cudaFreeHost(pinned));
}

// cudaFree waits for the work queued before it (no queued kernel reads freed memory), and a
// query makes progress as a GPU would meanwhile.
TEST(CudaSimStreams, FreeAndQueryMakeProgress) {
    DeviceBuffer<float> x(1, MemCategory::Other);
    cudaStream_t s = non_blocking();
    semantics::increment(x.data(), 1, s);
    void* other = nullptr;
    MT_CUDA_CHECK(cudaMalloc(&other, 16));
    MT_CUDA_CHECK(cudaFree(other));
    EXPECT_EQ(read(x.data()), 1.0f);
    semantics::increment(x.data(), 1, s);
    EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);
    EXPECT_EQ(read(x.data()), 2.0f);
    MT_CUDA_CHECK(cudaStreamDestroy(s));
}
