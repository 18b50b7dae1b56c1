// The planner against memtrain's measured memory, per rank, over a grid of small layouts: tensor
// parallelism with and without sequence parallelism (GPT-2 and Llama-style), pipelines side by
// side, ZeRO stages 0-3 and remat none / selective / full.
// Every layout whose ranks equal this job's (mpirun -np 1, 2 or 4) and that RunConfig accepts
// trains one step; on every rank the allocator's growth in parameters, gradients, optimizer
// state and activations must be within 5% of plan::estimate_rank_memory for that rank (the
// planner's `memtrain estimate` numbers, from the engines' own layout functions). Then
// `memtrain plan --emit-config` output trains as planned.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "engine/host_memory.h"
#include "mpi/dist_runs.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "planner/report.h"
#include "planner/search.h"
#include "test_util.h"
#include "train/validate.h"

namespace memtrain::dist {
namespace {

struct Layout {
    int tp, pp, dp, zero;
    std::string remat;
    bool sp = false;     // train.sequence_parallel
    bool llama = false;  // RMSNorm, SwiGLU, RoPE, GQA, untied, no biases
    std::string name() const {
        return fmt::format("tp{} pp{} dp{} zero{} remat={}{}{}", tp, pp, dp, zero, remat,
                           sp ? " sp" : "", llama ? " llama" : "");
    }
};

// Every combination of the grid; with tp = 2 each also with sequence parallelism, and a
// Llama-style model with it under selective remat (whose regions differ from GPT-2's).
std::vector<Layout> grid() {
    std::vector<Layout> out;
    for (int tp : {1, 2})
        for (int pp : {1, 2})
            for (int dp : {1, 2})
                for (int zero = 0; zero <= 3; zero++)
                    for (const char* remat : {"none", "selective", "full"})
                        for (bool sp : {false, true})
                            if (!sp || tp > 1) out.push_back({tp, pp, dp, zero, remat, sp});
    for (int pp : {1, 2})
        for (int dp : {1, 2}) out.push_back({2, pp, dp, 0, "selective", true, true});
    return out;
}

// A small model with 4 blocks (2 per stage at pp = 2), 4 heads (2 per rank at tp = 2).
RunConfig grid_run(const Layout& l) {
    RunConfig c = shared_tiny_run_config("plan_grid", 1);
    c.model.n_layer = 4;
    c.model.n_head = 4;
    c.model.n_embd = 32;
    c.train.seq_len = 16;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * 2 * l.dp;  // two micro-batches per replica
    c.train.eval_every = 0;
    c.io.save_final = false;
    // (Appended in two steps: GCC 12 at -O2 reports a false -Wrestrict for `+= "_" + s` here.)
    c.io.out_dir += '_';
    c.io.out_dir += std::to_string(comm().size());
    c.world = comm().size();
    c.train.tp = l.tp;
    c.train.pp = l.pp;
    c.train.zero_stage = l.zero;
    c.train.remat = l.remat;
    c.train.sequence_parallel = l.sp;
    if (l.llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
        c.model.n_kv_head = 2;
        c.model.ffn_hidden = 64;
    }
    return c;
}

// Trains `c` on comm() and expects this rank's growth in parameters, gradients, optimizer state
// and activations within 5% of the planner's estimate for the rank (priced by the engines'
// layout functions).
void train_and_compare(const RunConfig& c, const std::string& name) {
    const int rank = comm().rank();
    const MemoryStats before = host_memory().snapshot();
    Trainer t(c, test::quiet(), &comm());
    t.run();
    const MemoryStats after = host_memory().snapshot();
    const RunConfig& tc = t.config();
    const plan::MemoryEstimate est = plan::estimate_rank_memory(
        plan::model_from_config(tc.model), planner_run_spec(tc, t.engine().arena_format()),
        planner_rank(tc, rank));
    EXPECT_TRUE(est.engine_layout) << name;
    const struct {
        const char* line;
        MemCategory category;
    } rows[] = {
        {"parameters", MemCategory::Parameters},
        {"gradients", MemCategory::Gradients},
        {"optimizer states", MemCategory::OptimizerState},
        {"activations", MemCategory::Activations},
    };
    std::string out = fmt::format("{:<40} rank {}:", name, rank);
    for (const auto& row : rows) {
        const double measured = (double)after[row.category] - (double)before[row.category];
        const double planned = (double)est.bytes(row.line);
        const double err = std::abs(planned - measured) / measured;
        EXPECT_LE(err, 0.05) << name << " rank " << rank << ": " << row.line << " planned "
                             << planned << " measured " << measured;
        out += fmt::format(" | {} {:.0f} / {:.0f}", row.line, planned, measured);
    }
    std::printf("%s\n", out.c_str());
}

TEST(PlanGrid, PerRankBytesMatchMeasuredWithin5Percent) {
    const int N = comm().size();
    int ran = 0;
    for (const Layout& l : grid()) {
        if (l.tp * l.pp * l.dp != N) continue;  // another job size's layout
        RunConfig c = grid_run(l);
        try {
            validate_config(c);
        } catch (const Error& e) {  // not a layout the engines run
            if (comm().rank() == 0) std::printf("%-40s skipped: %s\n", l.name().c_str(), e.what());
            continue;
        }
        train_and_compare(c, l.name());
        ran++;
    }
    // Every job size has some: 1 rank ZeRO alone, 2 ranks tp, pp and dp, 4 ranks pp x dp.
    EXPECT_GT(ran, 0);
}

// `memtrain plan --emit-config` with this job's ranks as GPUs, small enough that the best plan
// shards (ZeRO) or splits the model (tp, with sequence parallelism): the TOML carries the plan's
// layout, reads back as the RunSpec the plan was priced with, and trains two steps on this job,
// every rank's memory within 5% of the planner's per-rank numbers (from the engines' layout).
TEST(PlanGrid, EmittedConfigTrainsAsPlanned) {
    const int N = comm().size();
    if (N < 2) GTEST_SKIP() << "the plans worth emitting here need 2 ranks or more";
    const bool root = comm().rank() == 0;
    const RunConfig base = grid_run(Layout{1, 1, N, 0, "none"});
    const plan::ModelSpec m = plan::model_from_config(base.model);
    int trained = 0, sequence_parallel = 0;
    // GPU memory (decimal bytes): at 2 ranks 2 MB picks a pipeline (its micro-batch of 128 tokens
    // fills the GEMM tiles that dp = 2's 64 would not), 0.8 MB tp = 2.
    for (double gpu_bytes : {2e6, 0.8e6}) {
        plan::ClusterSpec cluster;
        cluster.gpu = plan::gpu_preset("h100-80gb");
        cluster.gpu.memory_bytes = gpu_bytes;
        cluster.gpus = N;
        plan::SearchSpec spec;
        spec.global_batch = 8;
        spec.seq = 16;
        spec.precision = Precision::fp32;  // what the CPU engines train in
        spec.flash_attention = false;      // the CPU kernels keep the probabilities
        spec.allow_offload = false;
        spec.reserve_bytes = 0;
        spec.fragmentation = 0;
        const plan::SearchResult res = plan::search_plans(m, cluster, spec);
        if (res.plans.empty()) continue;
        const plan::Plan& best = res.plans[0];
        const plan::RunSpec& want = best.run;
        const std::string name = "emitted " + plan::describe(want);
        if (root) std::printf("%s\n", name.c_str());
        RunConfig c = parse_run_config(
            plan::emit_config_toml(m, best), "emitted.toml",
            {"data.train=" + base.data.train, "data.val=" + base.data.val,
             "io.out_dir=" + base.io.out_dir + "_emitted", "io.save_final=false",
             "train.max_steps=2", "train.eval_every=0", "train.device=cpu", "sample.max_tokens=0"});
        // The keys, as planned.
        EXPECT_EQ(c.train.tp, want.tp) << name;
        EXPECT_EQ(c.train.pp, want.pp) << name;
        EXPECT_EQ(c.train.zero_stage, want.zero) << name;
        EXPECT_EQ(c.train.precision, "fp32") << name;
        EXPECT_EQ(c.train.offload_optimizer, want.offload != plan::Offload::none) << name;
        EXPECT_EQ(c.train.micro_batch_size, want.micro_batch) << name;
        EXPECT_EQ(c.train.batch_size, want.global_batch()) << name;
        EXPECT_EQ(c.train.remat, plan::to_string(want.recompute)) << name;
        if (want.pp > 1) {
            EXPECT_EQ(c.train.pp_schedule, plan::to_string(want.schedule)) << name;
        }
        ASSERT_EQ(want.gpus(), N) << name;
        c.world = N;
        // Read back, the config is the run the plan priced.
        const plan::RunSpec got = planner_run_spec(c, ActFormat::cpu());
        EXPECT_EQ(got.dp, want.dp) << name;
        EXPECT_EQ(got.micro_batches, want.micro_batches) << name;
        EXPECT_EQ(got.schedule, want.schedule) << name;
        EXPECT_EQ(got.recompute, want.recompute) << name;
        EXPECT_EQ(got.precision, want.precision) << name;
        try {
            validate_config(c);
        } catch (const Error& e) {
            if (root) std::printf("  not runnable by the CPU engines: %s\n", e.what());
            continue;
        }
        // Sequence parallelism, which the search turns on with tp, is the trainer's key too.
        EXPECT_EQ(c.train.sequence_parallel, want.sequence_parallel) << name;
        EXPECT_EQ(got.sequence_parallel, want.sequence_parallel) << name;
        EXPECT_TRUE(plan::uses_engine_layout(m, want)) << name;
        train_and_compare(c, name);
        trained += want.tp > 1 || want.pp > 1 || want.zero > 0;
        sequence_parallel += want.sequence_parallel;
    }
    EXPECT_GT(trained, 0) << "no emitted plan with tp, pp or ZeRO trained";
    if (N == 2) {
        EXPECT_GT(sequence_parallel, 0) << "no emitted plan with sequence parallelism";
    }
}

}  // namespace
}  // namespace memtrain::dist
