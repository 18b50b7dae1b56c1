// Pipeline parallelism under mpirun (2 and 4 ranks, one stage each): for every schedule the
// executor runs, a pipeline trains exactly as one process accumulating the same micro-batches in
// the same order: losses, gradients and parameters bitwise equal (the tied embedding's gradient,
// summed across the first and last stage once per step, to rounding), and each stage holds the
// activations of exactly as many micro-batches as its schedule keeps in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist_mpi/dist_runs.h"
#include "test_util.h"
#include "train/pipeline_engine.h"

namespace memtrain::dist {
namespace {

struct PpCase {
    std::string schedule;
    bool llama;  // untied head, rmsnorm, swiglu, rope
    std::string remat = "none";
};

std::string case_name(const PpCase& k) {
    return "pp_" + k.schedule + (k.llama ? "_llama" : "_gpt2") + "_" + k.remat;
}

RunConfig pipeline_run(const PpCase& k, int steps) {
    RunConfig c = shared_tiny_run_config(case_name(k), steps);
    c.model.n_layer = 4;  // one block per stage at 4 ranks
    c.io.save_final = false;
    c.train.eval_every = 5;
    c.train.remat = k.remat;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * 5;  // 5 micro-batches: more than p, and not a multiple of it
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
void check_pipeline_matches_single_process(const PpCase& k, int steps = 6, bool clip = true) {
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
    Trainer t(c, quiet, &comm());
    const TrainSummary sum = t.run();
    auto* pe = dynamic_cast<PipelineEngine*>(&t.engine());
    ASSERT_NE(pe, nullptr);
    EXPECT_EQ(pe->stage(), r);
    const RunConfig& tc = t.config();  // with the world size filled in

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
    const pp::StageStore& st = pe->store();
    const ParamLayout& layout = pe->model().layout();
    const std::size_t tied_end =
        c.model.tied_embeddings ? layout.units[ParamLayout::embedding_unit()].end : 0;
    const std::vector<float> params = t.params();  // every rank, broadcast by the owners
    ASSERT_EQ(params.size(), ref_params.size());
    std::size_t grad_diff = 0, param_diff = 0;
    double worst = 0;
    double worst_param = 0;
    for (std::size_t j = st.begin(); j < st.end(); j++) {
        const float g = const_cast<pp::StageStore&>(st).owned_grads()[j - st.begin()];
        if (j < tied_end || !exact)
            worst = std::max(worst, (double)std::abs(g - ref_grads[j]));
        else
            grad_diff += g != ref_grads[j];
    }
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
    const PipelineStats& ps = pe->stats();
    EXPECT_EQ(ps.steps, steps - 1);
    EXPECT_GE(ps.bubble, 0.0);
    EXPECT_LE(ps.bubble, ps.steps);  // a fraction per step
    const int64_t act = (int64_t)tc.micro_batch() * tc.train.seq_len * tc.model.n_embd * 4;
    EXPECT_EQ(ps.bytes_sent, (int64_t)steps * tc.accum_steps() * act * ((r < P - 1) + (r > 0)));

    // The last step as it ran (the same on every rank): each rank's actions in its list's order
    // without overlap, and a stage's forward of a micro-batch after the previous stage's, its
    // backward after the next stage's (the receives it waited for).
    const int m = tc.accum_steps();
    const pp::SimResult& tl = pe->measured_timeline();
    ASSERT_EQ((int)tl.spans.size(), P);
    std::vector<std::vector<double>> f_end(P, std::vector<double>(m)),
        b_end = f_end, f_start = f_end, b_start = f_end;
    for (int s = 0; s < P; s++) {
        ASSERT_EQ(tl.spans[s].size(), (k.schedule == "zb-h1" ? 3u : 2u) * m);
        double prev = 0;
        for (const pp::Span& sp : tl.spans[s]) {
            EXPECT_GE(sp.start, prev) << "rank " << s;
            EXPECT_GE(sp.end, sp.start);
            EXPECT_LE(sp.end, tl.makespan + 1e-9);
            prev = sp.end;
            if (sp.a.op == pp::Op::W) continue;  // local: depends on nothing sent
            (sp.a.op == pp::Op::F ? f_start : b_start)[s][sp.a.mb] = sp.start;
            (sp.a.op == pp::Op::F ? f_end : b_end)[s][sp.a.mb] = sp.end;
        }
    }
    for (int s = 1; s < P; s++)
        for (int i = 0; i < m; i++) {
            EXPECT_GE(f_start[s][i], f_end[s - 1][i]) << "F" << s << "." << i;
            EXPECT_GE(b_start[s - 1][i], b_end[s][i]) << "B" << s - 1 << "." << i;
        }

    // Activations: this stage's slots (GPipe m, 1F1B min(p - s, m), naive 1), each exactly one
    // micro-batch's arena of the stage's blocks; measured equals predicted.
    // (zb-h1: until W, as the simulator counts it.)
    const int expect_slots = k.schedule == "gpipe"  ? m
                             : k.schedule == "1f1b" ? std::min(P - r, m)
                             : k.schedule == "zb-h1"
                                 ? (int)pp::uniform_in_flight(pp::Kind::ZbH1, P, m)[r]
                                 : 1;
    EXPECT_EQ(pe->slots(), expect_slots) << case_name(k) << " stage " << r;
    const ArenaPlan a = pe->model().stage_arena(tc.micro_batch(), tc.train.seq_len);
    // `memtrain pipeline` prices a stage's micro-batch with the same layout (without remat).
    if (k.remat == "none") {
        EXPECT_EQ(pe->split().act_bytes[r], a.activation_bytes) << case_name(k) << " stage " << r;
    }
    const MemoryStats ms = host_memory().snapshot();
    EXPECT_EQ(
        ms[MemCategory::Activations],
        (std::size_t)expect_slots * (a.activation_bytes + pe->model().split_backward_bytes(
                                                              tc.micro_batch(), tc.train.seq_len)));
    for (const MemoryPrediction& p : pe->predicted_memory(tc.micro_batch(), tc.train.seq_len)) {
        if (p.category != MemCategory::Workspace) {
            EXPECT_EQ(ms[p.category], p.bytes) << category_name(p.category) << " stage " << r;
        }
    }
    // Parameters: only this stage's units (and the tied embedding's copy on the last stage).
    EXPECT_LT(ms[MemCategory::Parameters], 4 * layout.total);
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

TEST(Pipeline, BadLayoutsAreRefusedBeforeTraining) {
    PpCase k{"1f1b", false};
    RunConfig c = pipeline_run(k, 1);
    TrainOptions quiet;
    quiet.quiet = true;
    auto refused = [&](RunConfig bad, const std::string& what) {
        try {
            Trainer t(bad, quiet, &comm());
            ADD_FAILURE() << "accepted: " << what;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    RunConfig many = c;
    many.train.pp = 5;  // more stages than the 4 blocks
    refused(many, "every stage needs a block");
    RunConfig odd = c;
    odd.train.pp = comm().size() + 1;
    odd.model.n_layer = 8;
    refused(odd, "does not divide");
    RunConfig zb = c;
    zb.train.pp = comm().size();
    zb.train.pp_schedule = "zb-h1";
    zb.train.pp_schedule = "interleaved";
    refused(zb, "naive, gpipe, 1f1b and zb-h1 only");
    zb.train.pp_schedule = "zb-h1";
    zb.train.remat = "selective";
    refused(zb, "needs train.remat = \"none\"");
    RunConfig unknown = c;
    unknown.train.pp = comm().size();
    unknown.train.pp_schedule = "2f2b";
    refused(unknown, "unknown pipeline schedule");
}

}  // namespace
}  // namespace memtrain::dist
