// The shared step schedule (model/unit_walk.h): its shape for whole models and pipeline stages,
// tied or not, under each remat keep; and the CPU driver following it call for call (a store that
// records what the model asks of it).
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "core/error.h"
#include "model/gpt.h"
#include "model/unit_walk.h"
#include "test_util.h"

using namespace memtrain;

namespace {

using Part = UnitVisit::Part;

// Every unit visited once per direction, in order, each announcing the next unit it will
// acquire (the head's forward: the output embedding; the last visit: nothing).
void check_shape(const UnitWalk& w, const ParamLayout& layout, int L, bool tied, int b0, int b1) {
    const bool emb = b0 == 0, head = b1 == L;
    ASSERT_EQ(w.forward.size(), (std::size_t)(b1 - b0 + emb + head));
    ASSERT_EQ(w.backward.size(), w.forward.size());
    for (std::size_t i = 0; i < w.forward.size(); i++) {
        const UnitVisit& f = w.forward[i];
        const UnitVisit& b = w.backward[w.backward.size() - 1 - i];
        EXPECT_EQ(f.unit, b.unit) << i;  // the backward is the forward reversed
        EXPECT_EQ(f.part, b.part) << i;
        if (f.part == Part::Head) {
            EXPECT_EQ(f.prefetch, tied ? ParamLayout::embedding_unit() : -1);
        } else if (i + 1 < w.forward.size()) {
            EXPECT_EQ(f.prefetch, w.forward[i + 1].unit) << i;
        } else {
            EXPECT_EQ(f.prefetch, -1) << "the last block of a stage announces another stage's unit";
        }
    }
    for (std::size_t i = 0; i < w.backward.size(); i++) {
        const UnitVisit& v = w.backward[i];
        const bool next_reads_params =
            i + 1 < w.backward.size() && w.backward[i + 1].part != Part::Embedding;
        EXPECT_EQ(v.prefetch, next_reads_params ? w.backward[i + 1].unit : -1) << i;
    }
    if (emb) {
        EXPECT_EQ(w.forward.front().part, Part::Embedding);
    }
    if (head) {
        EXPECT_EQ(w.forward.back().part, Part::Head);
    }
    for (const UnitVisit& v : w.forward) {
        if (v.part == Part::Block) {
            EXPECT_EQ(v.unit, layout.block_unit(v.block));
        }
    }
}

// A FullUnitStore that writes down every call the model makes.
class RecordingStore final : public UnitStore {
  public:
    explicit RecordingStore(const ParamLayout& l) : inner_(l) {}
    float* full_params() override { return inner_.full_params(); }
    float* full_grads() override { return inner_.full_grads(); }
    float* acquire(int u, bool w) override {
        log.emplace_back('a', u);
        return inner_.acquire(u, w);
    }
    void release(int u) override { log.emplace_back('r', u); }
    void prefetch(int u) override { log.emplace_back('p', u); }
    float* unit_grads(int u) override { return inner_.unit_grads(u); }
    void grads_done(int u) override { log.emplace_back('g', u); }
    void zero_grads() override { inner_.zero_grads(); }
    // (a)cquire, (r)elease, (p)refetch, (g)rads done, of a unit
    std::vector<std::pair<char, int>> log;

  private:
    FullUnitStore inner_;
};

}  // namespace

TEST(UnitWalk, WholeModelsAndStagesHaveTheScheduleShape) {
    for (bool tied : {true, false}) {
        ModelConfig c = test::tiny_model(4);
        c.tied_embeddings = tied;
        const ParamLayout layout = make_param_layout(c);
        for (auto [b0, b1] : {std::pair{0, 4}, {0, 2}, {1, 3}, {2, 4}, {3, 4}}) {
            SCOPED_TRACE(testing::Message() << "tied " << tied << " blocks " << b0 << ".." << b1);
            check_shape(make_unit_walk(layout, 4, tied, b0, b1, {}), layout, 4, tied, b0, b1);
        }
    }
}

TEST(UnitWalk, BackwardRedoesWhatEachBlockDidNotKeep) {
    const ModelConfig c = test::tiny_model(4);
    const ParamLayout layout = make_param_layout(c);
    const RematPlan plan = {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input,
                            BlockKeep::Offload};
    const UnitWalk w = make_unit_walk(layout, 4, true, 0, 4, plan);
    std::vector<Redo> got;
    for (const UnitVisit& v : w.backward)
        if (v.part == Part::Block) got.push_back(v.redo);
    EXPECT_EQ(
        got, (std::vector<Redo>{Redo::BlockFromHost, Redo::Block, Redo::Selective, Redo::Nothing}));
    // A stage's plan covers its own blocks.
    const UnitWalk s = make_unit_walk(layout, 4, true, 1, 3, {BlockKeep::Input, BlockKeep::All});
    EXPECT_EQ(s.backward[0].redo, Redo::Nothing);  // block 2
    EXPECT_EQ(s.backward[1].redo, Redo::Block);    // block 1
    EXPECT_THROW(make_unit_walk(layout, 4, true, 1, 3, plan), Error);
    EXPECT_THROW(make_unit_walk(layout, 4, true, 2, 2, {}), Error);
}

TEST(UnitWalk, TheCpuModelAsksItsStoreInTheWalksOrder) {
    for (bool tied : {true, false}) {
        ModelConfig c = test::tiny_model(3);
        c.tied_embeddings = tied;
        const ParamLayout layout = make_param_layout(c);
        RecordingStore store(layout);
        GPT m(c, &store);
        m.set_remat({BlockKeep::All, BlockKeep::Input, BlockKeep::Selective});
        const int B = 2, T = 4;
        const auto x = test::random_tokens(B * T, c.vocab_size, 1);
        const auto y = test::random_tokens(B * T, c.vocab_size, 2);
        store.log.clear();
        m.forward_backward(x.data(), y.data(), B, T, 1.0f);
        // What the walk says, spelled the way the store records it.
        const UnitWalk w = make_unit_walk(layout, 3, tied, 0, 3, m.remat_plan());
        const int E = ParamLayout::embedding_unit();
        std::vector<std::pair<char, int>> want;
        auto at = [](char k, int u) { return std::pair<char, int>{k, u}; };
        for (const UnitVisit& v : w.forward) {
            want.push_back(at('a', v.unit));
            if (v.prefetch >= 0) want.push_back(at('p', v.prefetch));
            if (v.part != Part::Head) want.push_back(at('r', v.unit));
        }
        for (const UnitVisit& v : w.backward) {
            switch (v.part) {
                case Part::Head:  // the held unit again, the output embedding, the announcement
                    want.insert(want.end(), {at('a', v.unit), at('r', v.unit)});
                    if (tied) want.push_back(at('a', E));
                    want.push_back(at('p', v.prefetch));
                    if (tied) want.push_back(at('r', E));
                    want.insert(want.end(), {at('g', v.unit), at('r', v.unit)});
                    break;
                case Part::Block:
                    want.push_back(at('a', v.unit));
                    if (v.prefetch >= 0) want.push_back(at('p', v.prefetch));
                    want.insert(want.end(), {at('g', v.unit), at('r', v.unit)});
                    break;
                case Part::Embedding:
                    want.push_back(at('g', v.unit));
                    break;
            }
        }
        EXPECT_EQ(store.log, want) << "tied " << tied;
    }
}

// A block whose input is rebuilt (memory-poor, chen:K) first acquires the unit its rebuild
// re-runs from, so that is the unit the visit before it announces (ZeRO-3 gathers it meanwhile).
TEST(UnitWalk, ARebuiltInputIsAnnouncedByTheBlockItsRebuildStartsFrom) {
    const ModelConfig c = test::tiny_model(4);
    const ParamLayout layout = make_param_layout(c);
    using K = BlockKeep;
    auto prefetches = [&](const RematPlan& plan) {
        std::vector<int> out;
        for (const UnitVisit& v : make_unit_walk(layout, 4, true, 0, 4, plan).backward)
            out.push_back(v.prefetch);
        return out;
    };
    auto u = [&](int l) { return layout.block_unit(l); };
    // (head, blocks 3 to 0, embedding) memory-poor: every rebuild re-runs from block 0's input.
    EXPECT_EQ(prefetches({K::Input, K::Dropped, K::Dropped, K::Dropped}),
              (std::vector<int>{u(0), u(0), u(0), u(0), -1, -1}));
    // chen:2: block 3's segment re-runs block 2, block 1's block 0.
    EXPECT_EQ(prefetches({K::Input, K::Segment, K::Input, K::Segment}),
              (std::vector<int>{u(2), u(2), u(0), u(0), -1, -1}));
    // Inputs kept: each block announces the one before it.
    EXPECT_EQ(prefetches({}), (std::vector<int>{u(3), u(2), u(1), u(0), -1, -1}));
}
