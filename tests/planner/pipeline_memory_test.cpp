// The planner prices a pipeline stage's activations with the engine's own layout: for small
// pipeline layouts, `memtrain estimate --pp P`'s per-stage activation bytes are to the byte what
// the pipeline engine of that stage predicts (and allocates: tests/mpi/pipeline_test.cpp
// checks that against measured bytes), under every schedule and remat policy the planner knows.
#include <gtest/gtest.h>

#include <memory>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/cli_util.h"
#include "comm/communicator.h"
#include "config/run_config.h"
#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "model/activation_layout.h"
#include "parallel/pipeline/schedule.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "planner/stage_activations.h"
#include "remat/policy.h"
#include "train/plan.h"

using namespace memtrain;

namespace {

// Rank `rank` of a `size`-rank world in one process, for building one stage's engine: only the
// broadcast of the constructor (the timeline's epoch) is answered; anything else that would
// communicate fails the test.
class OneStageOfMany final : public dist::Communicator {
  public:
    OneStageOfMany(int rank, int size) : rank_(rank), size_(size) {}
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    int local_rank() const override { return rank_; }
    int local_size() const override { return size_; }
    void all_reduce_sum(float*, int64_t) override { no(); }
    void all_reduce_max(double*, int64_t) override { no(); }
    void all_reduce_max(int64_t*, int64_t) override { no(); }
    void reduce_scatter_sum(const float*, float*, std::span<const int64_t>) override { no(); }
    void all_gather(const float*, float*, std::span<const int64_t>) override { no(); }
    void all_gather_bytes(const void*, void*, int64_t) override { no(); }
    void broadcast(void*, int64_t, int) override {}
    void send(const float*, int64_t, int, int) override { no(); }
    void recv(float*, int64_t, int, int) override { no(); }
    void barrier() override { no(); }
    [[noreturn]] void abort(std::string_view reason) override {
        fail("abort in a one-process test: {}", reason);
    }
    // The engine's mesh (dist::split_mesh) of one pipeline: the pipeline is this whole world, and
    // each stage's data group is the rank alone.
    std::unique_ptr<dist::Communicator> split(int, int, std::string_view name) override {
        if (name.starts_with("pipeline")) return std::make_unique<OneStageOfMany>(rank_, size_);
        return std::make_unique<OneStageOfMany>(0, 1);
    }

  private:
    [[noreturn]] static void no() { fail("this test's engine must not communicate"); }
    int rank_, size_;
};

// 8 blocks (two per stage at pp 4), micro-batches of 2 x 32 tokens, 5 per step (more than p,
// not a multiple of it); interleaved: 2 chunks per rank (one block each at pp 4) and 4
// micro-batches (a multiple of p).
RunConfig tiny_pipeline(int pp, const std::string& schedule, const std::string& remat, bool llama) {
    RunConfig c;
    c.model.n_layer = 8;
    c.model.n_head = 4;
    c.model.n_embd = 64;
    c.model.block_size = 32;
    c.model.vocab_size = 100;
    if (llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.n_kv_head = 2;
        c.model.tied_embeddings = false;
        c.model.bias = false;
    }
    c.train.pp = pp;
    c.train.pp_schedule = schedule;
    c.train.remat = remat;
    c.train.seq_len = 32;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * 5;
    if (schedule == "interleaved") {
        c.train.pp_virtual = 2;
        c.train.batch_size = 2 * 4;
    }
    c.world = pp;
    c.train.precision =
        "fp32";  // the fp32 layout on every machine ("auto": bf16 where the CPU has it)
    return c;
}

// The planner's run for the same layout, on the CPU engine (fp32, attention probabilities).
plan::RunSpec planner_run(const RunConfig& c, pp::Kind schedule) {
    plan::RunSpec r;
    r.pp = c.train.pp;
    r.schedule = schedule;
    r.micro_batch = c.micro_batch();
    r.seq = c.train.seq_len;
    r.micro_batches = c.accum_steps();
    r.virtual_stages = c.train.pp_virtual;
    r.recompute = plan::parse_recompute(c.train.remat);
    r.precision = Precision::fp32;
    r.flash_attention = false;  // the CPU engine's layout
    r.optimizer = plan::Optimizer::adamw;
    return r;
}

const std::string& detail(const plan::MemoryEstimate& est, const std::string& name) {
    for (const plan::MemoryLine& l : est.lines)
        if (l.name == name) return l.detail;
    static const std::string none = "(no such line)";
    return none;
}

std::size_t predicted(const std::vector<MemoryPrediction>& lines, MemCategory c) {
    for (const MemoryPrediction& p : lines)
        if (p.category == c) return p.bytes;
    ADD_FAILURE() << "no " << category_name(c) << " line";
    return 0;
}

}  // namespace

// Each name means one per-block plan in planner and trainer: the planner's recompute option is
// the plan train.remat of the same name gives.
TEST(PlanPipeline, RecomputeNamesMeanTheTrainersRematPlans) {
    const RunConfig c = tiny_pipeline(2, "1f1b", "none", false);
    for (plan::Recompute rc :
         {plan::Recompute::none, plan::Recompute::selective, plan::Recompute::full}) {
        const RematPlan trainer =
            remat::solve_policy(remat::parse_policy(plan::to_string(rc)), c.model, 2, 32).plan;
        EXPECT_EQ(plan::remat_plan(rc, c.model.n_layer), trainer) << plan::to_string(rc);
    }
    EXPECT_EQ(plan::block_keep(plan::Recompute::selective), BlockKeep::Selective);
    EXPECT_EQ(plan::block_keep(plan::Recompute::full), BlockKeep::Input);
}

// The planner's spec of a trainer config and back: the same shape, parameters and layout bytes.
TEST(PlanPipeline, ConfigFromModelRoundTrips) {
    for (const char* name :
         {"gpt2", "gpt2-xl", "gpt3-175b", "llama2-7b", "llama2-70b", "llama3-8b", "llama3-405b"}) {
        const plan::ModelSpec m = plan::load_model(name);
        const ModelConfig c = plan::config_from_model(m);
        EXPECT_NO_THROW(c.validate()) << name;
        EXPECT_EQ(c.padded_vocab(), m.vocab_size) << name;
        EXPECT_EQ(c.mlp_hidden(), m.ffn()) << name;
        EXPECT_EQ(c.qkv_dim(), m.n_embd + 2 * m.kv_dim()) << name;
        EXPECT_EQ(c.is_llama(), m.is_llama()) << name;
        const plan::ModelSpec back = plan::model_from_config(c);
        EXPECT_EQ(back.n_layer, m.n_layer) << name;
        EXPECT_EQ(back.kv_heads(), m.kv_heads()) << name;
        EXPECT_EQ(back.ffn(), m.ffn()) << name;
        EXPECT_EQ(back.rmsnorm, m.rmsnorm) << name;
        EXPECT_EQ(back.swiglu, m.swiglu) << name;
        EXPECT_EQ(back.rope, m.rope) << name;
        EXPECT_EQ(back.tied_embeddings, m.tied_embeddings) << name;
        EXPECT_EQ(back.total_params(), m.total_params()) << name;
    }
    // And a trainer config through the planner and back allocates the same layout.
    for (bool llama : {false, true}) {
        const ModelConfig c = tiny_pipeline(2, "1f1b", "none", llama).model;
        const ModelConfig back = plan::config_from_model(plan::model_from_config(c));
        EXPECT_EQ(back.padded_vocab(), c.padded_vocab());
        EXPECT_EQ(plan_arena(back, 2, 32).activation_bytes, plan_arena(c, 2, 32).activation_bytes);
        EXPECT_EQ(plan_arena(back, 2, 32).workspace_bytes, plan_arena(c, 2, 32).workspace_bytes);
    }
}

// pp 2 and 4, GPipe / 1F1B / ZB-H1 / interleaved, remat none / selective / full, GPT-2 and Llama
// blocks: the estimate's activations for every stage are the stage engine's predicted
// activation bytes.
TEST(PlanPipeline, StageActivationsAreThePipelineEnginesPrediction) {
    struct Sched {
        const char* name;
        pp::Kind planner;
    };
    const Sched scheds[] = {{"gpipe", pp::Kind::GPipe},
                            {"1f1b", pp::Kind::OneFOneB},
                            {"zb-h1", pp::Kind::ZbH1},
                            {"interleaved", pp::Kind::Interleaved}};
    int checked = 0;
    std::map<std::string, int64_t> none_bytes, selective_bytes;
    for (int P : {2, 4})
        for (const Sched& sc : scheds)
            for (const char* remat : {"none", "selective", "full"})
                for (bool llama : {false, true}) {
                    const RunConfig c = tiny_pipeline(P, sc.name, remat, llama);
                    const std::string what = fmt::format("pp {} {} remat {} {}", P, sc.name, remat,
                                                         llama ? "llama" : "gpt2");
                    const plan::ModelSpec spec = plan::model_from_config(c.model);
                    const plan::RunSpec r = planner_run(c, sc.planner);
                    const plan::MemoryEstimate whole = plan::estimate_memory(spec, r);
                    ASSERT_EQ((int)whole.stage_activations.size(), P) << what;
                    const int B = c.micro_batch(), T = c.train.seq_len;
                    for (int s = 0; s < P; s++) {
                        OneStageOfMany comm(s, P);
                        CpuEngine engine(plan_layout(c, comm), comm);
                        // What the Trainer hands the engine: the policy's plan for the whole model.
                        engine.set_remat(remat::solve_policy(remat::parse_policy(c.train.remat),
                                                             c.model, B, T, nullptr,
                                                             engine.arena_format())
                                             .plan);
                        const auto lines = engine.predicted_memory(B, T);
                        const std::size_t engine_act = predicted(lines, MemCategory::Activations);
                        const plan::MemoryEstimate est = plan::estimate_stage_memory(spec, r, s);
                        // The engine counts the output gradients kept for W among its
                        // activations; the planner shows them on a line of their own.
                        const int64_t planner_act =
                            est.bytes("activations") + est.bytes("zero-bubble W gradients");
                        EXPECT_EQ(planner_act, (int64_t)engine_act) << what << " stage " << s;
                        EXPECT_EQ(whole.stage_activations[s], est.bytes("activations"))
                            << what << " stage " << s;
                        // And the same functions under it: each chunk's slots x its arena.
                        const plan::PipelineActivations pa = plan::pipeline_activations(spec, r);
                        const plan::RankActivations& ra = pa.ranks[s];
                        ASSERT_EQ((int)ra.chunks.size(), engine.chunks()) << what;
                        int64_t sum = 0, blocks = 0;
                        for (int ch = 0; ch < engine.chunks(); ch++) {
                            EXPECT_EQ(ra.slots[ch], engine.chunk_slots(ch)) << what;
                            EXPECT_EQ(ra.arena[ch],
                                      engine.model(ch).stage_arena(B, T).activation_bytes)
                                << what;
                            sum += (int64_t)engine.chunk_slots(ch) *
                                   (int64_t)engine.model(ch).stage_arena(B, T).activation_bytes;
                            blocks += engine.model(ch).end_block() - engine.model(ch).first_block();
                        }
                        EXPECT_EQ(est.bytes("activations"), sum) << what << " stage " << s;
                        EXPECT_EQ(est.layers_on_stage, blocks) << what;
                        EXPECT_EQ(est.bytes("recompute working set"), 0) << what;
                        EXPECT_NE(detail(est, "activations").find("plan_stage_arena"),
                                  std::string::npos)
                            << detail(est, "activations");
                        // The policies differ: each keeps less than the one before, except in
                        // one-block chunks, whose recompute scratch is all they drop (a slot's
                        // arena holds its own scratch).
                        const std::string key = fmt::format("{} {} {} {}", P, sc.name, llama, s);
                        const bool one_block =
                            *std::min_element(ra.blocks.begin(), ra.blocks.end()) == 1;
                        const int64_t now = est.bytes("activations");
                        if (std::string(remat) == "none") {
                            none_bytes[key] = now;
                        } else if (one_block) {
                            EXPECT_EQ(now, none_bytes.at(key)) << what;
                        } else {
                            EXPECT_LT(now, none_bytes.at(key)) << what;
                        }
                        if (std::string(remat) == "full" && !one_block) {
                            EXPECT_LT(now, selective_bytes.at(key)) << what;
                        }
                        if (std::string(remat) == "selective")
                            selective_bytes[key] = est.bytes("activations");
                        checked++;
                    }
                }
    EXPECT_EQ(checked, (2 + 4) * (4 * 3 * 2));  // stages x schedules x remat x gpt2/llama
}

// GPU layouts (flash attention, 16-bit activations) use the CUDA engine's arena.
TEST(PlanPipeline, GpuStagesUseTheCudaArena) {
    const RunConfig c = tiny_pipeline(2, "gpipe", "selective", true);
    const plan::ModelSpec spec = plan::model_from_config(c.model);
    // bf16 with flash attention: the CUDA engine's arena (fused attention, 256-byte regions).
    plan::RunSpec g = planner_run(c, pp::Kind::GPipe);
    g.precision = Precision::bf16;
    g.flash_attention = true;
    const pp::StageSplit split = pp::split_stages(c.model, 2, 2, 32);
    const ActFormat fmt = cuda_arena_format(c.model, 2, 2, 32);
    for (int s = 0; s < 2; s++) {
        const std::size_t arena =
            plan_stage_arena(c.model, split.blocks[s], 2, 32,
                             RematPlan(split.blocks[s], BlockKeep::Selective), fmt)
                .activation_bytes;
        EXPECT_EQ(plan::estimate_stage_memory(spec, g, s).bytes("activations"),
                  (int64_t)(5 * arena))  // GPipe holds all 5 micro-batches
            << "stage " << s;
    }
}

// pp = 1 and tensor parallelism keep the per-layer formulas, and say so.
TEST(PlanPipeline, TensorParallelPipelinesKeepTheFormulas) {
    const plan::ModelSpec m = plan::load_model("gpt2");
    plan::RunSpec r;
    r.pp = 2, r.tp = 2, r.micro_batches = 8;
    const plan::MemoryEstimate e = plan::estimate_stage_memory(m, r, 0);
    EXPECT_TRUE(e.stage_activations.empty());
    EXPECT_TRUE(plan::estimate_memory(m, r).stage_activations.empty());
    EXPECT_NE(detail(e, "activations").find("Korthikanti"), std::string::npos)
        << detail(e, "activations");
    EXPECT_EQ(e.bytes("activations"),
              (int64_t)plan::layer_activation_bytes(m, r).saved * 6 * 2 +  // 6 layers x 2 in flight
                  1024LL * 768);  // stage 0's embedding dropout mask (bf16 elsewhere, 1 byte)
    r.pp = 1, r.tp = 1;
    EXPECT_TRUE(plan::estimate_memory(m, r).stage_activations.empty());
}

// The command line says where a stage's activations come from.
TEST(PlanPipeline, EstimateCliNamesTheLayoutFunction) {
    const auto o = test::run_memtrain("estimate gpt2 --pp 2 --schedule 1f1b");
    ASSERT_EQ(o.code, 0) << o.output;
    std::string act_line;
    std::size_t at = o.output.find("\nactivations ");
    ASSERT_NE(at, std::string::npos) << o.output;
    act_line = o.output.substr(at + 1, o.output.find('\n', at + 1) - at - 1);
    EXPECT_NE(act_line.find("plan_stage_arena"), std::string::npos) << act_line;
    EXPECT_NE(act_line.find("1f1b"), std::string::npos) << act_line;
    EXPECT_NE(o.output.find("activations per stage"), std::string::npos) << o.output;
    const auto j = test::run_memtrain("estimate gpt2 --pp 2 --schedule gpipe --json");
    ASSERT_EQ(j.code, 0) << j.output;
    const auto json = nlohmann::json::parse(j.output);
    ASSERT_EQ(json["stage_activation_bytes"].size(), 2u);
}
