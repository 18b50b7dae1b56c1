// The planner against memtrain's own measured memory: for several CPU runs, the allocator's
// measured bytes per category are compared with plan::estimate_memory for the same run, under
// each whole-model remat policy. The planner prices these layouts with the engine's own layout
// functions (make_param_layout, plan_arena), so every category matches to the byte. (Layouts of
// several ranks: tests/mpi/plan_grid_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/rng.h"
#include "engine/host_memory.h"
#include "model/gpt.h"
#include "optim/optimizer.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "planner/rank_layout.h"
#include "planner/stage_activations.h"
#include "test_util.h"
#include "train/report.h"
#include "train/trainer.h"

using namespace memtrain;

namespace {

struct Shape {
    int L, NH, C, V, block, B, T;
    bool llama = false;  // rmsnorm + swiglu + rope + GQA (n_head / 2 kv heads) + untied
};

}  // namespace

TEST(PlanMeasured, ModelStatesAndActivationsExact) {
    const Shape shapes[] = {
        {2, 2, 64, 500, 64, 4, 64},            // tiny
        {6, 6, 384, 4096, 128, 8, 128},        // the demo model
        {4, 4, 256, 50257, 256, 2, 256},       // GPT-2 vocabulary, the gpt2vocab benchmark shape
        {4, 4, 256, 4096, 128, 4, 128, true},  // Llama-style block
    };
    for (const auto& s : shapes) {
        ModelConfig mc;
        mc.n_layer = s.L;
        mc.n_head = s.NH;
        mc.n_embd = s.C;
        mc.vocab_size = s.V;
        mc.block_size = s.block;
        if (s.llama) {
            mc.norm = "rmsnorm";
            mc.activation = "swiglu";
            mc.positions = "rope";
            mc.n_kv_head = s.NH / 2;
            mc.tied_embeddings = false;
        }
        // Every policy on the small shapes; the larger ones (slow on 2 cores) remat none.
        std::vector<plan::Recompute> policies = {plan::Recompute::none};
        if (s.C <= 256 && s.V < 50000)
            policies = {plan::Recompute::none, plan::Recompute::selective, plan::Recompute::full};
        for (plan::Recompute rc : policies) {
            auto before = host_memory().snapshot();
            GPT m(mc);
            m.init_weights(1);
            m.set_remat(plan::remat_plan(rc, s.L));
            auto opt = make_optimizer(OptimConfig{}, m.layout());
            std::vector<int32_t> x((std::size_t)s.B * s.T, 1), y((std::size_t)s.B * s.T, 2);
            m.zero_grads();
            m.forward_backward(x.data(), y.data(), s.B, s.T, 1.0f / (s.B * s.T));
            auto after = host_memory().snapshot();
            auto measured = [&](MemCategory c) { return (int64_t)(after[c] - before[c]); };

            plan::RunSpec r;
            r.precision = Precision::fp32;
            r.optimizer = plan::Optimizer::adamw;
            r.micro_batch = s.B;
            r.seq = s.T;
            r.recompute = rc;
            r.flash_attention = false;  // the CPU kernels keep the (T, T) probabilities
            r.fragmentation = 0;
            r.reserve_bytes = 0;
            auto est = plan::estimate_memory(plan::model_from_config(mc), r);
            const std::string what = "L=" + std::to_string(s.L) + " C=" + std::to_string(s.C) +
                                     (s.llama ? " llama" : "") + " remat=" + plan::to_string(rc);
            EXPECT_TRUE(est.engine_layout) << what;
            EXPECT_EQ(est.bytes("parameters"), measured(MemCategory::Parameters)) << what;
            EXPECT_EQ(est.bytes("gradients"), measured(MemCategory::Gradients)) << what;
            EXPECT_EQ(est.bytes("optimizer states"), measured(MemCategory::OptimizerState)) << what;
            EXPECT_EQ(est.bytes("activations"), measured(MemCategory::Activations)) << what;
            EXPECT_EQ(est.bytes("recompute working set"), 0) << what << ": inside the arena";
        }
    }
}

// LoRA on one process: the adapters change the model states, not the arena, so the planner
// prices a LoRA run's activations with the engine's arena under each remat policy, each name
// meaning what train.remat means (plan::uses_engine_arena).
TEST(PlanMeasured, LoraActivationsAreTheEnginesArena) {
    const std::string dir = test::temp_dir("plan_measured_lora");
    for (const char* remat : {"none", "selective", "full"}) {
        RunConfig c = test::tiny_run(dir, 1);
        c.lora.rank = 4;
        c.train.remat = remat;
        TrainOptions o;
        o.quiet = true;
        Trainer t(c, o);
        t.run();
        const plan::RunSpec r = planner_run_spec(t.config(), t.engine().arena_format());
        ASSERT_GT(r.lora_rank, 0);
        const plan::ModelSpec m = plan::model_from_config(c.model);
        EXPECT_TRUE(plan::uses_engine_arena(m, r)) << remat;
        const auto est = plan::estimate_memory(m, r);
        EXPECT_EQ(est.bytes("activations"),
                  (int64_t)t.engine().memory().snapshot().peak(MemCategory::Activations))
            << remat;
    }
}

// The report's "planner estimate" line equals the predicted rows for every remat policy the
// trainer takes, per-block plans included (budget:, every:K, sqrt), and for LoRA on every linear
// (lora.targets = all) (issue 26), and for Muon's optimizer state (issue 30).
TEST(PlanMeasured, TrainerEstimateLineEqualsPredictedForEveryPolicy) {
    const std::string dir = test::temp_dir("plan_measured_policies");
    struct Case {
        std::string remat;
        int lora_rank;
        std::string targets;
        bool lse = false;  // train.cpu_attention = "lse"
    };
    const Case cases[] = {{"none", 0, ""},
                          {"selective", 0, ""},
                          {"full", 0, ""},
                          {"every:2", 0, ""},
                          {"sqrt", 0, ""},
                          {"budget:60KiB", 0, ""},
                          {"none", 4, "all"},
                          {"every:2", 4, "all"},
                          {"full", 4, "attn"},
                          {"muon", 0, ""},
                          {"none", 0, "", true},
                          {"selective", 0, "", true},
                          {"budget:40KiB", 0, "", true}};
    bool saw_mixed = false;
    for (const Case& k : cases) {
        RunConfig c = test::tiny_run(dir, 1);
        c.model.n_layer = 4;
        // "muon": optim.name = muon (one moment on the blocks' matrices), without remat.
        if (k.remat == "muon")
            c.optim.name = "muon";
        else
            c.train.remat = k.remat;
        c.lora.rank = k.lora_rank;
        if (!k.targets.empty()) c.lora.targets = k.targets;
        if (k.lse) c.train.cpu_attention = "lse";
        TrainOptions o;
        o.quiet = true;
        Trainer t(c, o);
        t.run();
        const std::string what =
            k.remat + (k.lora_rank ? " lora " + k.targets : "") + (k.lse ? " lse" : "");
        const RematPlan& bp = t.engine().remat_plan();
        saw_mixed = saw_mixed || (bp.size() == 4 && std::count(bp.begin(), bp.end(), bp[0]) != 4);
        std::map<MemCategory, int64_t> predicted;
        for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
            predicted[row.category] += (int64_t)row.bytes;
        const plan::MemoryEstimate est = planner_estimate(t.config(), t.engine());
        EXPECT_EQ(est.bytes("parameters"), predicted[MemCategory::Parameters]) << what;
        EXPECT_EQ(est.bytes("gradients"), predicted[MemCategory::Gradients]) << what;
        EXPECT_EQ(est.bytes("optimizer states"), predicted[MemCategory::OptimizerState]) << what;
        EXPECT_EQ(est.bytes("activations") + est.bytes("recompute working set"),
                  predicted[MemCategory::Activations])
            << what;
        EXPECT_EQ(predicted[MemCategory::Activations],
                  (int64_t)t.engine().memory().snapshot().peak(MemCategory::Activations))
            << what;
    }
    EXPECT_TRUE(saw_mixed) << "no policy solved a plan that differs between blocks";
}
