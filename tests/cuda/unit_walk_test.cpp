// The GPU model follows the shared step schedule (model/unit_walk.h) call for call, as the CPU
// model does (tests/model/unit_walk_test.cpp): a device unit store that records what CudaGPT asks
// of it during a micro-batch, against the walk.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "core/device.h"
#include "cuda/cuda_test_util.h"
#include "model/unit_walk.h"
#include "test_util.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "model/cuda_gpt.h"

using namespace memtrain;

namespace {

using Part = UnitVisit::Part;
using Call = std::pair<char, int>;  // (a)cquire, (r)elease, (p)refetch, (g)rads done; a unit

// Whole flat buffers on the device, every call written down.
class RecordingUnits final : public DeviceUnitStore<float> {
  public:
    explicit RecordingUnits(const ParamLayout& l)
        : l_(l),
          params_(l.total, MemCategory::Parameters),
          grads_(l.total, MemCategory::Gradients) {
        MT_CUDA_CHECK(cudaMemset(params_.data(), 0, params_.bytes()));
        MT_CUDA_CHECK(cudaMemset(grads_.data(), 0, grads_.bytes()));
    }
    float* acquire_params(int u) override {
        log.emplace_back('a', u);
        return params_.data() + l_.units[u].begin;
    }
    void release_params(int u) override { log.emplace_back('r', u); }
    void prefetch_params(int u) override { log.emplace_back('p', u); }
    float* acquire_grads(int u) override { return grads_.data() + l_.units[u].begin; }
    void grads_done(int u) override { log.emplace_back('g', u); }
    std::vector<Call> log;

  private:
    const ParamLayout& l_;
    DeviceBuffer<float> params_, grads_;
};

}  // namespace

TEST(CudaUnitWalk, TheGpuModelAsksItsStoreInTheWalksOrder) {
    REQUIRE_GPU();
    cudaStream_t stream = nullptr;
    MT_CUDA_CHECK(cudaStreamCreate(&stream));
    for (bool tied : {true, false}) {
        ModelConfig c = test::tiny_model(3);
        c.tied_embeddings = tied;
        const ParamLayout layout = make_param_layout(c);
        RecordingUnits store(layout);
        CudaGPT<float> m(c, stream, 0, &store);
        const RematPlan plan = {BlockKeep::All, BlockKeep::Input, BlockKeep::Selective};
        m.set_remat(plan);
        const int B = 2, T = 4;
        const auto x = test::random_tokens(B * T, c.vocab_size, 1);
        const auto y = test::random_tokens(B * T, c.vocab_size, 2);
        DeviceBuffer<double> loss(1, MemCategory::Workspace);
        MT_CUDA_CHECK(cudaMemset(loss.data(), 0, sizeof(double)));
        m.forward_backward(x.data(), y.data(), B, T, 1.0f, loss.data());
        MT_CUDA_CHECK(cudaStreamSynchronize(stream));
        // The walk, spelled the way the store records it. The head's backward reads the output
        // embedding (wte when tied) for the classifier before ln_f's unit.
        const UnitWalk w = make_unit_walk(layout, 3, tied, 0, 3, plan);
        const int E = ParamLayout::embedding_unit(), lm = tied ? E : layout.head_unit();
        std::vector<Call> want;
        for (const UnitVisit& v : w.forward) {
            want.emplace_back('a', v.unit);
            if (v.prefetch >= 0) want.emplace_back('p', v.prefetch);
            want.emplace_back('r', v.unit);
        }
        for (const UnitVisit& v : w.backward) {
            if (v.part == Part::Embedding) {
                want.emplace_back('g', v.unit);
                continue;
            }
            if (v.part == Part::Head) want.insert(want.end(), {{'a', lm}, {'r', lm}});
            want.emplace_back('a', v.unit);
            if (v.prefetch >= 0) want.emplace_back('p', v.prefetch);
            want.insert(want.end(), {{'r', v.unit}, {'g', v.unit}});
        }
        EXPECT_EQ(store.log, want) << "tied " << tied;
    }
    MT_CUDA_CHECK(cudaStreamDestroy(stream));
}

#endif  // MEMTRAIN_HAVE_CUDA
