// The CUDA semantics memtrain's kernels rely on, asked of the GPU and of cudasim with the same
// expectations (semantics_kernels.h); stream capture refuses synchronising calls as a GPU does.
// (The simulator's own checks are tests/cudasim/tests/sim_test.cpp.)
#include <gtest/gtest.h>

#include <vector>

#include "cuda/cuda_test_util.h"

#if MEMTRAIN_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cuda/semantics_kernels.h"

using namespace memtrain;
using namespace memtrain::test;

TEST(CudaSemantics, BlockBarrierPublishesSharedMemory) {
    REQUIRE_GPU();
    for (int threads : {1, 32, 96, 1024}) {
        const int blocks = 3;
        DeviceBuffer<int> d(blocks * threads, MemCategory::Other);
        semantics::rotate_through_shared(d.data(), blocks, threads);
        auto out = download(d);
        for (int b = 0; b < blocks; b++)
            for (int t = 0; t < threads; t++)
                ASSERT_EQ(out[b * threads + t], b * threads + (t + 1) % threads + 1)
                    << "threads " << threads << " block " << b << " thread " << t;
    }
}

TEST(CudaSemantics, WarpShuffles) {
    REQUIRE_GPU();
    const int threads = 128;
    DeviceBuffer<int> d(5 * threads, MemCategory::Other);
    semantics::warp_shuffles(d.data(), threads);
    auto out = download(d);
    unsigned odd = 0;
    for (int l = 1; l < 32; l += 2) odd |= 1u << l;
    for (int t = 0; t < threads; t++) {
        const int l = t % 32;
        SCOPED_TRACE(t);
        EXPECT_EQ(out[5 * t + 0], l ^ 5);
        EXPECT_EQ(out[5 * t + 1], l + 3 < 32 ? l + 3 : l);
        EXPECT_EQ(out[5 * t + 2], l >= 2 ? l - 2 : l);
        EXPECT_EQ(out[5 * t + 3], (l & ~15) + 7);
        EXPECT_EQ((unsigned)out[5 * t + 4], odd);
    }
}

TEST(CudaSemantics, ThreeDimensionalIndices) {
    REQUIRE_GPU();
    const int n = 2 * 3 * 4 * 3 * 2;
    DeviceBuffer<int> d(n, MemCategory::Other);
    semantics::indices_3d(d.data());
    auto out = download(d);
    int id = 0;
    for (int by = 0; by < 3; by++)
        for (int bx = 0; bx < 2; bx++)
            for (int tz = 0; tz < 2; tz++)
                for (int ty = 0; ty < 3; ty++)
                    for (int tx = 0; tx < 4; tx++)
                        EXPECT_EQ(out[id++], tx + 10 * ty + 100 * tz + 1000 * bx + 10000 * by);
}

TEST(CudaSemantics, DynamicSharedMemory) {
    REQUIRE_GPU();
    const int blocks = 4, threads = 200;
    std::vector<float> in(blocks * threads);
    for (std::size_t i = 0; i < in.size(); i++) in[i] = (float)(i % 7);
    auto d_in = upload(in);
    DeviceBuffer<float> d_out(blocks, MemCategory::Other);
    semantics::dynamic_shared_sum(d_out.data(), d_in.data(), blocks, threads);
    auto out = download(d_out);
    for (int b = 0; b < blocks; b++) {
        float want = 0;
        for (int t = 0; t < threads; t++) want += in[b * threads + t];
        EXPECT_EQ(out[b], want) << b;
    }
}

TEST(CudaSemantics, ThreadsThatLeaveDoNotHoldBackABarrier) {
    REQUIRE_GPU();
    DeviceBuffer<int> d(64, MemCategory::Other);
    MT_CUDA_CHECK(cudaMemset(d.data(), 0, d.bytes()));
    semantics::early_exit_then_barrier(d.data(), 64, 40);
    auto out = download(d);
    for (int t = 0; t < 64; t++) EXPECT_EQ(out[t], t < 40 ? 1 : 0) << t;
}

TEST(CudaSemantics, CapturedGraphReplaysItsWork) {
    REQUIRE_GPU();
    const int n = 1000;
    DeviceBuffer<float> d(n, MemCategory::Other);
    cudaStream_t s;
    MT_CUDA_CHECK(cudaStreamCreate(&s));
    MT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    semantics::increment(d.data(), n, s);
    semantics::increment(d.data(), n, s);
    cudaGraph_t graph;
    MT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    EXPECT_EQ(download(d)[0], 0.0f) << "captured work must not run at capture";
    cudaGraphExec_t exec;
    MT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MT_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MT_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MT_CUDA_CHECK(cudaStreamSynchronize(s));
    auto out = download(d);
    for (float x : out) ASSERT_EQ(x, 4.0f);
    MT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MT_CUDA_CHECK(cudaGraphDestroy(graph));
    MT_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(CudaSemantics, SynchronisingDuringCaptureInvalidatesIt) {
    REQUIRE_GPU();
    DeviceBuffer<float> d(16, MemCategory::Other);
    std::vector<float> host(16);
    cudaStream_t s;
    MT_CUDA_CHECK(cudaStreamCreate(&s));
    MT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    semantics::increment(d.data(), 16, s);
    EXPECT_NE(cudaStreamSynchronize(s), cudaSuccess);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(graph, nullptr);
    cudaGetLastError();
    MT_CUDA_CHECK(cudaStreamDestroy(s));
}

#endif  // MEMTRAIN_HAVE_CUDA
