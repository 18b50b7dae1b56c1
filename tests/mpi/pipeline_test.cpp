// Pipeline parallelism under mpirun (2 and 4 ranks, one stage each): for every schedule the
// executor runs, a pipeline trains exactly as one process accumulating the same micro-batches in
// the same order: losses, gradients and parameters bitwise equal (the tied embedding's gradient,
// summed across the first and last stage once per step, to rounding), and each stage holds the
// activations of exactly as many micro-batches as its schedule keeps in flight. The interleaved
// schedule (train.pp_virtual chunks per rank) likewise, chunk by chunk.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/host_memory.h"
#include "io/safetensors.h"
#include "mpi/dist_runs.h"
#include "remat/policy.h"
#include "test_util.h"
#include "train/validate.h"

namespace memtrain::dist {
namespace {

struct PpCase {
    std::string schedule;
    bool llama;  // untied head, rmsnorm, swiglu, rope
    std::string remat = "none";
    int virt = 1;        // train.pp_virtual (interleaved)
    double dropout = 0;  // model.dropout: each micro-batch's masks keyed by its sequences
    std::string precision = "fp32";  // bf16: the CPU engine's bf16 GEMMs and saved fields
    int layers = 0;  // > 0: this many blocks per virtual stage (for remat that rebuilds inputs)
};

std::string case_name(const PpCase& k) {
    return "pp_" + k.schedule + (k.virt > 1 ? "_v" + std::to_string(k.virt) : "") +
           (k.llama ? "_llama" : "_gpt2") + "_" + k.remat + (k.dropout > 0 ? "_dropout" : "") +
           (k.precision == "fp32" ? "" : "_" + k.precision) +
           (k.layers > 0 ? "_l" + std::to_string(k.layers) : "");
}

RunConfig pipeline_run(const PpCase& k, int steps) {
    RunConfig c = shared_tiny_run_config(case_name(k), steps);
    c.model.n_layer = 4;  // one block per stage at 4 ranks
    c.io.save_final = false;
    c.train.eval_every = 5;
    c.train.remat = k.remat;
    c.model.dropout = k.dropout;
    c.train.precision = k.precision;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * 5;  // 5 micro-batches: more than p, and not a multiple of it
    if (k.schedule == "interleaved") {
        const int P = comm().size();
        // One more block than virtual stages, so one chunk holds two; micro-batches a multiple
        // of p (the schedule's groups), two groups.
        c.model.n_layer = P * k.virt + 1;
        c.train.batch_size = 2 * 2 * P;
    }
    if (k.layers > 0) c.model.n_layer = k.layers * comm().size() * k.virt;
    if (k.llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
    }
    return c;
}

// A tied model's embedding gradient is summed in another order, so after its first update the
// runs differ in the last bits; `steps` = 1 without clipping (whose coefficient reads the
// embedding's gradient too) checks everything else bitwise, more steps check to rounding.
void check_pipeline_matches_single_process(const PpCase& k, int steps = 10, bool clip = true) {
    const int P = comm().size(), r = comm().rank();
    RunConfig c = pipeline_run(k, steps);
    if (!clip) c.optim.grad_clip = 0;
    const bool exact = !c.model.tied_embeddings || steps == 1;
    TrainOptions quiet;
    quiet.quiet = true;

    RunConfig ref_cfg = c;
    ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(r);
    TrainSummary ref_sum;
    std::vector<float> ref_params, ref_grads;
    {
        Trainer ref(ref_cfg, quiet);
        ref_sum = ref.run();
        ref_params.assign(ref.model().params(), ref.model().params() + ref.model().num_params());
        ref_grads.assign(ref.model().grads(), ref.model().grads() + ref.model().num_params());
    }

    c.train.pp = P;
    c.train.pp_schedule = k.schedule;
    c.train.pp_virtual = k.virt;
    Trainer t(c, quiet, &comm());
    const TrainSummary sum = t.run();
    auto* pe = dynamic_cast<CpuEngine*>(&t.engine());
    ASSERT_NE(pe, nullptr);
    EXPECT_EQ(pe->stage(), r);
    EXPECT_EQ(pe->chunks(), k.virt);
    const RunConfig& tc = t.config();  // with the world size filled in
    const int V = k.virt, S = P * V;

    // Losses of every step and the evaluations: bitwise (a tied model's first step too; later
    // steps follow its embedding, which differs in the last bits).
    ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
    for (std::size_t i = 0; i < sum.losses.size(); i++) {
        if (exact || i == 0)
            EXPECT_EQ(sum.losses[i], ref_sum.losses[i]) << case_name(k) << " step " << i + 1;
        else
            EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 1e-5 * std::abs(ref_sum.losses[i]));
    }
    ASSERT_EQ(sum.val_losses.size(), ref_sum.val_losses.size());
    for (std::size_t i = 0; i < sum.val_losses.size(); i++) {
        if (exact)
            EXPECT_EQ(sum.val_losses[i].second, ref_sum.val_losses[i].second);
        else
            EXPECT_NEAR(sum.val_losses[i].second, ref_sum.val_losses[i].second, 1e-5);
    }

    // This stage's gradients of the last step (clipped as the single process clipped them) and
    // parameters after it: bitwise, except the tied embedding (to rounding) and, after more than
    // one step of a tied model, what followed from it.
    const pp::StageStore& st = pe->stage_store();
    const ParamLayout& layout = pe->model().layout();
    const std::size_t tied_end =
        c.model.tied_embeddings ? layout.units[ParamLayout::embedding_unit()].end : 0;
    const std::vector<float> params = t.params();  // every rank, broadcast by the owners
    ASSERT_EQ(params.size(), ref_params.size());
    std::size_t grad_diff = 0, param_diff = 0;
    double worst = 0;
    double worst_param = 0;
    // One range per chunk of the model, at chunk c's virtual stage c * P + r.
    ASSERT_EQ((int)st.ranges().size(), V);
    std::size_t owned = 0;
    for (int c = 0; c < V; c++) {
        const pp::StageStore::Range& rg = st.ranges()[c];
        EXPECT_EQ(pe->model(c).first_block(), pe->split().first_block[c * P + r]);
        EXPECT_EQ(rg.at, owned);
        owned += rg.count();
        for (std::size_t j = rg.begin; j < rg.end; j++) {
            const float g = const_cast<pp::StageStore&>(st).owned_grads()[rg.at + j - rg.begin];
            if (j < tied_end || !exact)
                worst = std::max(worst, (double)std::abs(g - ref_grads[j]));
            else
                grad_diff += g != ref_grads[j];
        }
    }
    EXPECT_EQ(owned, st.count());
    for (std::size_t j = 0; j < params.size(); j++) {
        if (j < tied_end || !exact)
            worst_param = std::max(worst_param, (double)std::abs(params[j] - ref_params[j]));
        else
            param_diff += params[j] != ref_params[j];
    }
    EXPECT_EQ(grad_diff, 0u) << case_name(k) << " stage " << r;
    EXPECT_EQ(param_diff, 0u) << case_name(k);
    EXPECT_LT(worst, exact ? 1e-6 : 1e-4) << case_name(k) << ": gradients to rounding";
    EXPECT_LT(worst_param, 2e-5) << case_name(k) << ": parameters to rounding";

    // What the executor measured: every step after the first, the bytes it passed on (an
    // activation forward unless last, a gradient back unless first, per micro-batch).
    const pp::PipelineStats& ps = pe->timeline().stats();
    EXPECT_EQ(ps.steps, steps - 1);
    EXPECT_GE(ps.bubble, 0.0);
    EXPECT_LE(ps.bubble, ps.steps);  // a fraction per step
    const int64_t act = (int64_t)tc.micro_batch() * tc.train.seq_len * tc.model.n_embd * 4;
    int64_t messages = 0;  // per micro-batch: each chunk's forward out and gradient back
    for (int c = 0; c < V; c++) messages += (c * P + r < S - 1) + (c * P + r > 0);
    EXPECT_EQ(ps.bytes_sent, (int64_t)steps * tc.accum_steps() * act * messages);

    // The last step as it ran (the same on every rank): each rank's actions in its list's order
    // without overlap, and a stage's forward of a micro-batch after the previous stage's, its
    // backward after the next stage's (the receives it waited for); interleaved, by virtual
    // stage, across the ranks (rank P - 1's chunk c passes on to rank 0's chunk c + 1).
    const int m = tc.accum_steps();
    const pp::SimResult& tl = pe->timeline().measured();
    ASSERT_EQ((int)tl.spans.size(), P);
    std::vector<std::vector<double>> f_end(S, std::vector<double>(m, -1)),
        b_end = f_end, f_start = f_end, b_start = f_end;
    for (int rk = 0; rk < P; rk++) {
        ASSERT_EQ(tl.spans[rk].size(), (k.schedule == "zb-h1" ? 3u : 2u) * m * V);
        double prev = 0;
        for (const pp::Span& sp : tl.spans[rk]) {
            EXPECT_GE(sp.start, prev) << "rank " << rk;
            EXPECT_GE(sp.end, sp.start);
            EXPECT_LE(sp.end, tl.makespan + 1e-9);
            EXPECT_EQ(sp.a.stage % P, rk);
            prev = sp.end;
            if (sp.a.op == pp::Op::W) continue;  // local: depends on nothing sent
            (sp.a.op == pp::Op::F ? f_start : b_start)[sp.a.stage][sp.a.mb] = sp.start;
            (sp.a.op == pp::Op::F ? f_end : b_end)[sp.a.stage][sp.a.mb] = sp.end;
        }
    }
    for (int s = 1; s < S; s++)
        for (int i = 0; i < m; i++) {
            EXPECT_GE(f_start[s][i], f_end[s - 1][i]) << "F" << s << "." << i;
            EXPECT_GE(b_start[s - 1][i], b_end[s][i]) << "B" << s - 1 << "." << i;
            EXPECT_GE(f_end[s][i], 0) << "F" << s << "." << i << " ran";
        }

    // Activations: this stage's slots (GPipe m, 1F1B min(p - s, m), naive 1), each exactly one
    // micro-batch's arena of the stage's blocks; measured equals predicted.
    // (zb-h1: until W, as the simulator counts it.)
    // Interleaved: each chunk's slots are the most of its micro-batches the schedule keeps
    // between F and B, the simulator's count for its virtual stage; together at least the
    // rank's peak over all its chunks.
    std::vector<int> expect_slots(V);
    if (k.schedule == "interleaved") {
        const pp::SimResult sim = pp::simulate(pp::make_schedule(pp::Kind::Interleaved, P, m, V),
                                               pp::StageCosts::uniform(S, 1, 2));
        int sum = 0;
        for (int c = 0; c < V; c++) {
            expect_slots[c] = sim.peak_stage_in_flight[c * P + r];
            EXPECT_GE(expect_slots[c], 1);
            EXPECT_LE(expect_slots[c], m);
            sum += expect_slots[c];
        }
        EXPECT_GE(sum, sim.peak_in_flight[r]);
        // Rank 0's first chunk fills while every other chunk waits: it holds the most.
        if (r == 0) {
            EXPECT_EQ(expect_slots[0], *std::max_element(expect_slots.begin(), expect_slots.end()));
        }
    } else {
        expect_slots[0] = k.schedule == "gpipe"  ? m
                          : k.schedule == "1f1b" ? std::min(P - r, m)
                          : k.schedule == "zb-h1"
                              ? (int)pp::uniform_in_flight(pp::Kind::ZbH1, P, m)[r]
                              : 1;
    }
    std::size_t expect_acts = 0;
    int total_slots = 0;
    for (int c = 0; c < V; c++) {
        EXPECT_EQ(pe->chunk_slots(c), expect_slots[c])
            << case_name(k) << " rank " << r << " chunk " << c;
        total_slots += expect_slots[c];
        const ArenaPlan a = pe->model(c).stage_arena(tc.micro_batch(), tc.train.seq_len);
        // `memtrain pipeline` prices a stage's micro-batch with the same layout (without remat).
        if (k.remat == "none") {
            EXPECT_EQ(pe->split().act_bytes[c * P + r], a.activation_bytes)
                << case_name(k) << " stage " << c * P + r;
        }
        expect_acts += (std::size_t)expect_slots[c] *
                       (a.activation_bytes +
                        pe->model(c).split_backward_bytes(tc.micro_batch(), tc.train.seq_len));
    }
    EXPECT_EQ(pe->slots(), total_slots);
    const MemoryStats ms = host_memory().snapshot();
    EXPECT_EQ(ms[MemCategory::Activations], expect_acts) << case_name(k) << " rank " << r;
    for (const MemoryPrediction& p : pe->predicted_memory(tc.micro_batch(), tc.train.seq_len)) {
        if (p.category != MemCategory::Workspace) {
            EXPECT_EQ(ms[p.category], p.bytes) << category_name(p.category) << " stage " << r;
        }
        if (p.category == MemCategory::Activations) {
            EXPECT_EQ(p.bytes, expect_acts);
        }
    }
    // Parameters: only this stage's units (and the tied embedding's copy on the last stage).
    EXPECT_LT(ms[MemCategory::Parameters], 4 * layout.total);
}

// model.dropout through the stages: the same masks as one process (keyed by sequence, the
// site by the global block), so still bitwise, under 1F1B with recompute, zero-bubble's split
// backward and interleaved chunks.
TEST(Pipeline, DropoutMatchesSingleProcessBitwise) {
    check_pipeline_matches_single_process({"1f1b", true, "full", 1, 0.1});
    check_pipeline_matches_single_process({"zb-h1", true, "none", 1, 0.1});
    check_pipeline_matches_single_process({"interleaved", true, "none", 2, 0.1});
}

// bf16 on the CPU: each stage stashes its blocks' bf16 fields and unstashes them (again for a
// zero-bubble W), so every schedule keeps one process's bits.
TEST(Pipeline, CpuBf16MatchesSingleProcessBitwise) {
    check_pipeline_matches_single_process({"1f1b", true, "full", 1, 0, "bf16"});
    check_pipeline_matches_single_process({"zb-h1", true, "selective", 1, 0, "bf16"});
    check_pipeline_matches_single_process({"interleaved", true, "none", 2, 0, "bf16"});
}

TEST(Pipeline, GpipeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"gpipe", true});
}
TEST(Pipeline, OneFOneBMatchesSingleProcess) {
    check_pipeline_matches_single_process({"1f1b", true});
}
// Zero bubble: the backward split into I and W, W's delayed; weight gradients still accumulate in
// micro-batch order, so the bits are 1F1B's.
TEST(Pipeline, ZeroBubbleH1MatchesSingleProcess) {
    check_pipeline_matches_single_process({"zb-h1", true});
}
// Under remat the weight halves (W) recompute the GEMM inputs the block dropped, once more.
TEST(Pipeline, ZeroBubbleH1WithSelectiveRecomputeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"zb-h1", true, "selective"});
}
TEST(Pipeline, ZeroBubbleH1WithFullRecomputeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"zb-h1", true, "full"});
}
TEST(Pipeline, ZeroBubbleH1TiedGpt2MatchesSingleProcess) {
    check_pipeline_matches_single_process({"zb-h1", false}, 1, false);
}
TEST(Pipeline, NaiveMatchesSingleProcess) {
    check_pipeline_matches_single_process({"naive", true});
}
TEST(Pipeline, OneFOneBTiedGpt2MatchesSingleProcess) {
    check_pipeline_matches_single_process({"1f1b", false}, 1, false);
    check_pipeline_matches_single_process({"1f1b", false});
}
TEST(Pipeline, GpipeWithSelectiveRecomputeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"gpipe", true, "selective"});
}
TEST(Pipeline, OneFOneBWithFullRecomputeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"1f1b", false, "full"});
}
// Interleaved: P x V virtual stages, rank r holding r, r + P, ...; every chunk accumulates its
// micro-batches in order, so the bits are one process's, with every remat policy.
TEST(Pipeline, InterleavedTwoChunksMatchesSingleProcess) {
    check_pipeline_matches_single_process({"interleaved", true, "none", 2});
}
TEST(Pipeline, InterleavedTwoChunksWithSelectiveRecomputeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"interleaved", true, "selective", 2});
}
TEST(Pipeline, InterleavedTwoChunksWithFullRecomputeMatchesSingleProcess) {
    check_pipeline_matches_single_process({"interleaved", true, "full", 2});
}
TEST(Pipeline, InterleavedThreeChunksMatchesSingleProcess) {
    if (comm().size() > 2) GTEST_SKIP() << "3 chunks x 4 ranks: the test model is kept small";
    check_pipeline_matches_single_process({"interleaved", true, "none", 3});
}
// The tied embedding: wte on virtual stage 0 (rank 0, chunk 0), its mirror beside the head on
// the last virtual stage (rank P - 1, chunk V - 1).
TEST(Pipeline, InterleavedTiedGpt2MatchesSingleProcess) {
    check_pipeline_matches_single_process({"interleaved", false, "none", 2}, 1, false);
    check_pipeline_matches_single_process({"interleaved", false, "none", 2});
}

// Remat that rebuilds block inputs runs per chunk of blocks: each chunk keeps its first input
// (received from the stage before) and rebuilds the others from it within the chunk, so a
// pipeline still trains bitwise as one process, each stage's activations measured as predicted
// (below full's; `full` holds every block input of every micro-batch in flight).
TEST(Pipeline, RebuiltBlockInputsMatchSingleProcessBitwise) {
    check_pipeline_matches_single_process({"1f1b", true, "memory-poor", 1, 0, "fp32", 3});
    check_pipeline_matches_single_process({"gpipe", true, "chen:2", 1, 0.1, "fp32", 3});
    check_pipeline_matches_single_process({"interleaved", true, "revolve:1", 2, 0, "fp32", 2});
    check_pipeline_matches_single_process({"1f1b", true, "chen:2", 1, 0, "bf16", 3});
    check_pipeline_matches_single_process({"1f1b", false, "memory-poor", 1, 0, "fp32", 3}, 1,
                                          false);
}

// Each stage's plan, sliced from the run's, is its chunk's own: memory-poor keeps the first input
// of every chunk, and a stage of 5 blocks holds 4 residual streams to full's 6.
TEST(Pipeline, RebuildPlansAreSolvedPerChunk) {
    PpCase k{"1f1b", true, "memory-poor", 1, 0, "fp32", 5};
    RunConfig c = pipeline_run(k, 1);
    c.train.pp = comm().size();
    c.train.pp_schedule = k.schedule;
    Trainer t(c, test::quiet(), &comm());
    const RematPlan& plan = t.engine().remat_plan();
    ASSERT_EQ((int)plan.size(), c.model.n_layer);
    for (int l = 0; l < c.model.n_layer; l++)
        EXPECT_EQ(plan[l], l % 5 == 0 ? BlockKeep::Input : BlockKeep::Dropped) << "block " << l;
    auto* pe = dynamic_cast<CpuEngine*>(&t.engine());
    ASSERT_NE(pe, nullptr);
    const RematPlan& mine = pe->model().remat_plan();
    ASSERT_EQ(mine.size(), 5u);
    EXPECT_EQ(mine[0], BlockKeep::Input);
    RunConfig f = c;
    f.train.remat = "full";
    f.io.out_dir += "_full";
    Trainer tf(f, test::quiet(), &comm());
    auto* fe = dynamic_cast<CpuEngine*>(&tf.engine());
    ASSERT_NE(fe, nullptr);
    EXPECT_LT(pe->model().stage_arena(c.micro_batch(), c.train.seq_len).activation_bytes,
              fe->model().stage_arena(c.micro_batch(), c.train.seq_len).activation_bytes);
}

// Checkpoints stay per tensor with Hugging Face names and per-range optimizer files: a pipeline's
// checkpoint resumes in one process, and one process's at this many stages, each continuing
// bitwise as the uninterrupted single process does.
TEST(Pipeline, CheckpointsMoveBetweenPipelineAndOneProcess) {
    const int steps = 6;
    const RunConfig c = pipeline_run({"1f1b", true}, steps);
    RunConfig one = c;  // the uninterrupted single process, on every rank
    one.io.out_dir = c.io.out_dir + "_one" + std::to_string(comm().rank());
    RunConfig piped = c;
    piped.train.pp = comm().size();
    piped.io.out_dir = c.io.out_dir + "_pp";
    check_checkpoint_round_trip(one, piped, steps, 3, "pipeline");
}

// An interleaved run's checkpoint (an optimizer file per chunk of each rank) resumes in one
// process and in a pipeline of another layout (1F1B, one range per rank), and one process's
// checkpoint resumes interleaved, each continuing bitwise.
TEST(Pipeline, InterleavedCheckpointsMoveBetweenLayouts) {
    const int steps = 6, cut = 3, P = comm().size(), r = comm().rank();
    const RunConfig c = pipeline_run({"interleaved", true, "none", 2}, steps);
    RunConfig one = c;
    one.io.out_dir = c.io.out_dir + "_one" + std::to_string(r);
    RunConfig piped = c;
    piped.train.pp = P;
    piped.train.pp_schedule = "interleaved";
    piped.train.pp_virtual = 2;
    piped.io.out_dir = c.io.out_dir + "_pp";
    check_checkpoint_round_trip(one, piped, steps, cut, "interleaved pipeline");

    // The interleaved checkpoint has an optimizer file per chunk of each rank, in rank order
    // and chunk order: P x 2 slices of the layout in increasing order, between them the whole
    // model.
    {
        const std::filesystem::path ck = std::filesystem::path(piped.io.out_dir) / "ckpt_000003";
        std::size_t next = 0, params = 0, rank_first_end = 0;
        for (int k = 0; k < 2 * P; k++) {
            const std::string path =
                (ck / fmt::format("optimizer.{:05d}-of-{:05d}.safetensors", k, 2 * P)).string();
            ASSERT_TRUE(std::filesystem::exists(path)) << path;
            const auto f = io::SafetensorsFile::open(path);
            const std::size_t off = std::stoull(f.metadata().at("offset"));
            const std::size_t cnt = std::stoull(f.metadata().at("count"));
            params = std::stoull(f.metadata().at("total"));
            // File k is rank k / 2's chunk k % 2 (virtual stage (k % 2) P + k / 2): a rank's
            // second chunk lies after its first in the layout.
            EXPECT_GT(cnt, 0u) << path;
            EXPECT_LE(off + cnt, params) << path;
            if (k % 2 == 1) {
                EXPECT_GT(off, rank_first_end) << path;
            }
            rank_first_end = off + cnt;
            next += cnt;
        }
        EXPECT_EQ(next, params);  // the slices cover the model once
        EXPECT_FALSE(std::filesystem::exists(
            ck / fmt::format("optimizer.{:05d}-of-{:05d}.safetensors", 2 * P, 2 * P)));
    }

    // The interleaved checkpoint (left by the round trip at step `cut`), resumed by 1F1B.
    TrainOptions quiet;
    quiet.quiet = true;
    TrainSummary ref;
    std::vector<float> ref_params;
    {
        RunConfig o = one;
        o.io.out_dir += "_ref";
        Trainer t(o, quiet);
        ref = t.run();
        ref_params = t.params();
    }
    RunConfig other = piped;
    other.train.pp_schedule = "1f1b";
    other.train.pp_virtual = 1;
    other.io.out_dir = c.io.out_dir + "_1f1b";
    TrainOptions o = quiet;
    o.resume = piped.io.out_dir;
    Trainer t(other, o, &comm());
    const TrainSummary s = t.run();
    ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut));
    for (int i = 0; i < steps - cut; i++)
        EXPECT_EQ(s.losses[i], ref.losses[cut + i])
            << "1f1b from interleaved, step " << cut + i + 1;
    const std::vector<float> params = t.params();
    ASSERT_EQ(params.size(), ref_params.size());
    std::size_t diff = 0;
    for (std::size_t j = 0; j < params.size(); j++) diff += params[j] != ref_params[j];
    EXPECT_EQ(diff, 0u) << "1f1b from interleaved";
}

// A pipeline rank that cannot fit the host is refused before anything is allocated, with the
// planner's per-rank bytes of its stage (which the engine's allocations match to the byte:
// tests/mpi/plan_grid_test.cpp).
TEST(Pipeline, AStageThatCannotFitIsRefusedBeforeAllocating) {
    RunConfig c = pipeline_run(PpCase{"1f1b", false}, 1);
    c.train.pp = comm().size();
    RunConfig resolved = c;
    resolve_config(resolved);  // as the Trainer holds it
    const auto rows = predict_pipeline_memory(resolved, comm().rank());
    ASSERT_EQ(rows.size(), 4u);
    std::size_t need = 0;
    for (const auto& r : rows) need += r.bytes;
    EXPECT_GT(need, 0u);
    setenv("MEMTRAIN_HOST_MEMORY", "64KiB", 1);
    const MemoryStats before = host_memory().snapshot();
    expect_refused(c, fmt::format("of host memory per rank on pipeline stage {}", comm().rank()));
    const MemoryStats after = host_memory().snapshot();
    unsetenv("MEMTRAIN_HOST_MEMORY");
    EXPECT_EQ(after[MemCategory::Parameters], before[MemCategory::Parameters]) << "allocated";
    EXPECT_EQ(after[MemCategory::Activations], before[MemCategory::Activations]) << "allocated";
    comm().barrier();
}

// Every schedule and remat policy is priced before anything is allocated, as the executor
// allocates it (naive's one slot, per-block remat plans, a budget's): the plan's rows are what
// the built engine reports, its measured bytes those rows, and a naive stage that cannot fit the
// host is refused before allocating, naming its stage.
TEST(Pipeline, EveryScheduleAndRematIsPlannedAsTheEngineAllocates) {
    for (const PpCase& k :
         {PpCase{"naive", true}, PpCase{"1f1b", true, "every:2"}, PpCase{"gpipe", false, "sqrt"}}) {
        RunConfig c = pipeline_run(k, 2);
        c.train.pp = comm().size();
        c.train.pp_schedule = k.schedule;
        {
            Trainer t(c, test::quiet(), &comm());
            const auto built = expect_planned_rows_are_the_engines(t, case_name(k));
            t.run();
            const MemoryStats ms = host_memory().snapshot();
            for (const MemoryPrediction& p : built)
                if (p.category != MemCategory::Workspace) {
                    EXPECT_EQ(ms[p.category], p.bytes)
                        << case_name(k) << " " << category_name(p.category);
                }
        }
        if (k.schedule == "naive")
            expect_refused_before_allocating(
                c, fmt::format("of host memory per rank on pipeline stage {}", comm().rank()));
    }
}

// A budget one byte below the least plan that keeps every block input: the whole model's joint
// solver meets it only by rebuilding inputs.
std::size_t rebuild_budget(const RunConfig& c) {
    const remat::Chain chain =
        remat::make_chain(c.model, c.micro_batch(), c.train.seq_len, cpu_arena_format(c.model));
    return remat::min_feasible_bytes(chain) - 1;
}

TEST(Pipeline, BadLayoutsAreRefusedBeforeTraining) {
    PpCase k{"1f1b", false};
    RunConfig c = pipeline_run(k, 1);
    const auto refused = &expect_refused;
    RunConfig many = c;
    many.train.pp = 5;  // more stages than the 4 blocks
    refused(many, "every stage needs a block");
    RunConfig odd = c;
    odd.train.pp = comm().size() + 1;
    odd.model.n_layer = 8;
    refused(odd, "does not divide");
    RunConfig zb = c;
    zb.train.pp = comm().size();
    zb.train.pp_schedule = "pipedream";  // on a tied model (tests/mpi/pipedream_test.cpp)
    refused(zb, "set model.tied_embeddings = false");
    // Interleaved: pp_virtual only with it, at least 1, at most the blocks, and micro-batches
    // in whole groups of pp.
    RunConfig iv = c;
    iv.train.pp = comm().size();
    iv.train.pp_virtual = 2;
    refused(iv, "train.pp_virtual = 2 needs train.pp_schedule = \"interleaved\"");
    iv.train.pp_schedule = "interleaved";
    iv.train.pp_virtual = 0;
    refused(iv, "train.pp_virtual = 0 must be >= 1");
    iv.train.pp_virtual = 3;  // 3 x P virtual stages for the 4 blocks
    refused(iv, "virtual stages for model.n_layer = 4 blocks");
    iv.train.pp_virtual = 2;
    iv.model.n_layer = 2 * comm().size();
    iv.train.batch_size = 2 * (comm().size() + 1);  // P + 1 micro-batches
    refused(iv, "to be a multiple of train.pp");
    RunConfig unknown = c;
    unknown.train.pp = comm().size();
    unknown.train.pp_schedule = "2f2b";
    refused(unknown, "unknown pipeline schedule");
    // Rebuilding block inputs: not under zero-bubble's split backward, and not a budget that
    // solves to it over the whole model (the structured policies rebuild within each stage).
    RunConfig zbr = c;
    zbr.train.pp = comm().size();
    zbr.train.pp_schedule = "zb-h1";
    zbr.train.remat = "memory-poor";
    refused(zbr, "train.remat = memory-poor does not run with train.pp_schedule = \"zb-h1\"");
    RunConfig low = c;
    low.train.pp = comm().size();
    low.train.remat = "budget:1KiB";
    refused(low, "below the smallest feasible");
    low.train.remat = "budget:" + std::to_string(rebuild_budget(low));
    refused(low, "which rebuild within each stage");
}

}  // namespace
}  // namespace memtrain::dist
